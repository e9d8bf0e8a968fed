"""The recipe alone (issues 60 and 70): train_gpt2.py cut at its "# ====" banner trains, evaluates, samples,
checkpoints and resumes, on one process and under torchrun, with the full script's numbers, and joins and leaves
its process group; and --loss_chunk_size, which wraps the recipe's cross-entropy, keeps validation's memory down."""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SHAKESPEARE, TINY_ARGS, run_python, run_script
from test_ddp import torchrun

# TINY_ARGS as TrainConfig's keywords, with evaluation, HellaSwag, samples and checkpoints on
TINY = {flag[2:]: value for flag, value in zip(TINY_ARGS[::2], TINY_ARGS[1::2], strict=True)}
TINY = {**{k: (v if k in ("device", "text_file") else float(v) if "." in v or "e-" in v else int(v))
           for k, v in TINY.items()},
        "max_steps": 6, "eval_every": 2, "eval_steps": 2, "sample_every": 6, "num_samples": 1,
        "max_new_tokens": 4, "hellaswag_every": 3, "ckpt_every": 2}
# each config given, one after another in this process, their outputs apart by a line of rank 0's
DRIVER = """import json, os, sys
import recipe
for config in sys.argv[1:]:
    recipe.train(recipe.TrainConfig(**json.loads(config)))
    if os.environ.get("RANK", "0") == "0":
        print("=== the next run", flush=True)
"""
# the lines that carry numbers the run computed: a step's loss, lr and norm, an evaluation's scores
NUMBERS = re.compile(r"^step +-?\d+/\d+ \| (loss \S+ \| lr \S+ \| norm \S+|val loss \S+$|HellaSwag .*$)")


def hellaswag_file(tmp_path):
    path = tmp_path / "hellaswag.jsonl"
    path.write_text("".join(json.dumps({"ctx": f"A man opens the door {i} and", "label": i % 4,
                                        "endings": ["walks in.", "sings loudly.", "eats it.", "sits."]}) + "\n"
                            for i in range(6)))
    return str(path)


def recipe_folder(tmp_path):
    """recipe.py: the lines of train_gpt2.py above its banner, as a learner would copy them."""
    source = (ROOT / "train_gpt2.py").read_text().splitlines(keepends=True)
    banner = next(i for i, line in enumerate(source) if line.startswith("# ===="))
    folder = tmp_path / "recipe"
    folder.mkdir()
    (folder / "recipe.py").write_text("".join(source[:banner]))
    (folder / "driver.py").write_text(DRIVER)
    return folder


def numbers(output):
    return [match.group(0) for line in output.splitlines() if (match := NUMBERS.search(line))]


def run_recipe(folder, *configs, processes=1):
    """The recipe's output for each config, run one after another by one process (or by each rank under torchrun)."""
    args = [str(folder / "driver.py")] + [json.dumps(config) for config in configs]  # it imports the recipe beside it
    result = torchrun(processes, args, timeout=300) if processes > 1 else run_python(args, {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = result.stdout.split("=== the next run\n")
    assert len(outputs) == len(configs) + 1 and outputs[-1] == "", result.stdout
    return outputs[:-1]


def as_flags(config):
    return [arg for key, value in config.items() for arg in (f"--{key}", str(value))]


@pytest.fixture(scope="module")
def alone_and_full(tmp_path_factory):
    """The recipe alone and the full script, on one config with evaluation, HellaSwag, samples and checkpoints on,
    started together (one core each). (folder, config, alone's output, full's result)."""
    tmp_path = tmp_path_factory.mktemp("recipe")
    folder, hellaswag = recipe_folder(tmp_path), hellaswag_file(tmp_path)
    config = {**TINY, "hellaswag_path": hellaswag, "log_dir": str(tmp_path / "alone")}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        full = pool.submit(run_script, as_flags({**config, "log_dir": str(tmp_path / "full")}),
                           {"OMP_NUM_THREADS": "1"})
        [alone] = run_recipe(folder, config)
        return folder, config, alone, full.result()


def test_the_recipe_alone_trains_evaluates_samples_and_resumes_with_the_full_scripts_numbers(alone_and_full):
    folder, config, alone, full = alone_and_full
    assert full.returncode == 0, full.stderr[-3000:]
    assert len(numbers(alone)) == 1 + 6 + 3 + 2  # val loss at -1, 6 steps, 3 val losses, 2 HellaSwag
    assert numbers(alone) == numbers(full.stdout)
    assert "sample 0: Hello, I'm a language model," in alone
    log_dir = config["log_dir"]
    assert sorted(p.name for p in Path(log_dir).iterdir()) == ["ckpt_2.pt", "ckpt_4.pt", "ckpt_6.pt"]

    # resumed from its step-4 checkpoint in a new process: steps 4 and 5, their evaluations, the same numbers
    parts = Path(log_dir).parent / "parts"
    [rest] = run_recipe(folder, {**config, "log_dir": str(parts), "resume": str(Path(log_dir) / "ckpt_4.pt")})
    assert "resumed from step 4" in rest
    assert numbers(rest) == numbers(alone)[-4:] and len(numbers(rest)) == 2 + 1 + 1


def test_the_recipe_alone_under_torchrun_on_2_processes_gives_the_losses_of_1(alone_and_full):
    """The first test's config, HellaSwag and the sample included, on 2 processes: the numbers of 1."""
    folder, config, alone, _ = alone_and_full
    [two] = run_recipe(folder, {**config, "log_dir": str(Path(config["log_dir"]).parent / "two")}, processes=2)
    assert len(numbers(alone)) == 1 + 6 + 3 + 2 and numbers(two) == numbers(alone)


def test_the_recipe_joins_its_process_group_and_leaves_it_after_a_barrier(tmp_path, monkeypatch):
    """train(cfg) with torchrun's variables (one process, a real gloo group) joins the group itself and leaves it as
    main() does: all ranks together (a barrier), then destroy_process_group (a group left to Python's exit aborted)."""
    import socket

    import torch.distributed as dist

    import train_gpt2 as t
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
        monkeypatch.setenv(name, str(value))
    calls = []

    def recorded(name):
        real = getattr(dist, name)
        return lambda: (calls.append(name), real())[1]
    for name in ("barrier", "destroy_process_group"):
        monkeypatch.setattr(dist, name, recorded(name))
    config = {**TINY, "max_steps": 1, "eval_every": 0, "sample_every": 0, "ckpt_every": 0, "hellaswag_every": 0}
    result = t.train(t.TrainConfig(**config, log_dir=str(tmp_path)))
    assert calls == ["barrier", "destroy_process_group"] and not dist.is_initialized()
    assert [r["step"] for r in result.run.records] == [0]


def peak_memory_gib(tmp_path, *flags):
    """--eval_only at 8 x 1024 tokens on a tiny model, whose 50,304 logits a token dominate: (val loss, peak RSS)."""
    tmp_path.mkdir()
    # VmHWM, this process's own peak: ru_maxrss starts at the parent's peak (Linux keeps it across the exec), so
    # it read a pytest worker's 1.79 GiB after that worker's earlier tests
    code = ("import sys, train_gpt2 as t; t.main(t.parse_args(sys.argv[1:])); print('peak', next("
            "int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM')) / 2**20)")
    result = subprocess.run([sys.executable, "-c", code, "--n_layer", "1", "--n_head", "2", "--n_embd", "32",
                             "--block_size", "1024", "--seq_len", "1024", "--micro_batch_size", "8",
                             "--total_batch_size", "8192", "--eval_steps", "1", "--eval_only", "--device", "cpu",
                             "--text_file", str(SHAKESPEARE), "--hellaswag_path", hellaswag_file(tmp_path),
                             *flags], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    val_loss = float(re.search(r"val loss (\S+)", result.stdout).group(1))
    return val_loss, float(result.stdout.split("peak ")[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_validation_with_loss_chunk_size_never_holds_the_whole_logits(tmp_path):
    """The float32 logits of 8 x 1024 tokens are 1.6 GiB, their log-softmax as much again: chunked, neither is made."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # two processes, one a core: each its own peak
        chunked = pool.submit(peak_memory_gib, tmp_path / "chunked", "--loss_chunk_size", "256")
        plain_loss, plain_peak = peak_memory_gib(tmp_path / "plain")
        chunked_loss, chunked_peak = chunked.result()
    assert abs(chunked_loss - plain_loss) < 1e-4
    assert plain_peak > 3.0 and chunked_peak < plain_peak - 1.6, (plain_peak, chunked_peak)  # 1.6: the logits
