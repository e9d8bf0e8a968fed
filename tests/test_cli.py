"""Each user mistake: exit status 2, one line on stderr naming the problem and the fix, nothing else."""

import dataclasses
import re
import types
import typing

import numpy as np
import pytest
import torch

import train_gpt2 as t
from conftest import ROOT, TINY_ARGS, TINY_ARGS_WITHOUT_SHAPE, report_card, run_python, run_script

README = ROOT / "README.md"


def one_line_error(result):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # stopped before any work: the start-up line was never printed
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--total_batch_size", "1000"],
         "error: --total_batch_size 1000 is not divisible by micro_batch_size x seq_len x processes = 4 x 32 x 1 = 128: "
         "make --total_batch_size a multiple of seq_len x processes = 32"),  # no micro batch divides 1000
        (["--seq_len", "128"],
         "error: --seq_len 128 is longer than --block_size 64: lower --seq_len or raise --block_size"),
        (["--model", "gpt3"], "error: argument --model: invalid choice: 'gpt3' (choose from 'gpt2', "
                              "'gpt2-medium', 'gpt2-large', 'gpt2-xl') (see --help)"),
        (["--device", "tpu"], "error: unknown --device 'tpu': use auto, cpu, cuda, cuda:N or mps"),
        (["--device", "cuda"], "error: --device cuda is not available on this machine: use --device auto or cpu"),
        (["--vocab_size", "1000"],
         "error: --vocab_size 1000 is smaller than the tokenizer's 50257 tokens: use at least 50257, or 0 (padded: "
         "faster)"),
        (["--warmup_steps", "21"], "error: --warmup_steps 21 must be between 0 and --max_steps 20: lower --warmup_steps"),
        (["--n_embd", "33"], "error: --n_embd 33 is not divisible by --n_head 2: pick a width that is"),
        (["--dtype", "float8"], "error: argument --dtype: invalid choice: 'float8' (choose from 'auto', "
                                "'float32', 'bfloat16', 'float16') (see --help)"),
        (["--max_steps", "ten"], "error: argument --max_steps: invalid int value: 'ten' (see --help)"),
        (["--learning_rate", "1"], "error: unrecognized arguments: --learning_rate 1 (see --help)"),
    ],
)
def test_config_mistakes(args, message, capsys, tmp_path):
    """Run in this process (a new Python costs 2 s a case); test_the_command_line_says_a_mistake_in_one_line checks
    that the command line prints the same."""
    assert error_line_in_process(TINY_ARGS + ["--log_dir", str(tmp_path)] + args, capsys) == message


@pytest.mark.parametrize("args, message", [
    (["--total_batch_size", str(2**19)],  # the default step on the tiny model's 32-token windows
     "error: the training data holds 304,222 tokens, 9,506 windows of 32 + 1, but one step of --total_batch_size "
     "524,288 tokens needs 16,384: train on more data (--data_dir with fineweb.py's shards) or lower "
     "--total_batch_size (the README's quick start trains a small model on tiny Shakespeare)"),
    (["--eval_every", "5", "--eval_steps", "133"],  # 133 steps of 8 windows
     "error: the validation data holds 33,803 tokens, 1,056 windows of 32 + 1, but an evaluation of --eval_steps 133 "
     "steps of 256 tokens needs 1,064: lower --eval_steps or --total_batch_size, or use more data (--data_dir with "
     "fineweb.py's shards)"),
])
def test_too_little_data_for_a_step_or_an_evaluation(args, message, capsys, tmp_path):
    """`python3 train_gpt2.py` with no flags on tiny Shakespeare, the first thing a newcomer may type, ends here."""
    assert error_line_in_process(TINY_ARGS + args + ["--log_dir", str(tmp_path)], capsys) == message


TOKENIZER_OFFLINE = ("error: cannot load the tokenizer (ProxyError): tiktoken downloads its files once; "
                     "connect to the network, or set TIKTOKEN_CACHE_DIR to a folder that holds them")


def offline_tokenizer(tmp_path) -> dict:
    """The environment of a process whose tiktoken has nothing cached and whose download is refused at once (a proxy
    on the discard port): the real requests raises ProxyError, a ConnectionError and so an OSError, as offline."""
    (tmp_path / "empty_cache").mkdir()
    proxy = "http://127.0.0.1:9"
    return {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache"), "HTTPS_PROXY": proxy, "https_proxy": proxy,
            "NO_PROXY": "", "no_proxy": ""}


@pytest.mark.parametrize("source", ["text", "shards"])  # the text is tokenized first; shards need it for samples
def test_a_tokenizer_that_cannot_be_downloaded_is_one_line(source, tmp_path):
    data = []
    if source == "shards":
        for split in ("train", "val"):
            np.save(tmp_path / f"tiny_{split}_000000.npy", np.arange(1000, dtype=np.uint16))
        data = ["--data_dir", str(tmp_path), "--sample_every", "5"]
    result = run_script(TINY_ARGS + data + ["--log_dir", str(tmp_path / "log")], env=offline_tokenizer(tmp_path))
    assert result.stdout == ""  # stopped before any work: the start-up line was never printed
    assert one_line_error(result) == TOKENIZER_OFFLINE


def error_line_in_process(args, capsys):
    """What `python train_gpt2.py ARGS` prints on stderr for a mistake, as its __main__ block runs it."""
    try:
        cfg = t.parse_args(args)
    except t.RunError as error:
        return f"error: {error}"
    with pytest.raises(SystemExit) as exited:
        t.main(cfg, t.launch_from_env({}))
    assert exited.value.code == 2
    stdout, stderr = capsys.readouterr()
    assert stdout == ""  # stopped before any work: the start-up line was never printed
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("args", [["--max_steps", "ten"], ["--total_batch_size", "1000"], ["--device", "cuda"]])
def test_the_command_line_says_a_mistake_in_one_line(args, capsys, tmp_path):  # one from the parser, two from main's
    args = TINY_ARGS + ["--log_dir", str(tmp_path)] + args  # checks
    assert one_line_error(run_script(args)) == error_line_in_process(args, capsys)


def test_missing_data_dir(tmp_path, capsys):  # in process: the script says main's refusals alike (the test above)
    line = error_line_in_process(TINY_ARGS + ["--data_dir", str(tmp_path / "nowhere"),
                                              "--log_dir", str(tmp_path / "log")], capsys)
    assert line == f"error: --data_dir {tmp_path / 'nowhere'} is not a folder: run fineweb.py to make shards, or fix the path"


def test_data_dir_without_shards(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("no shards here")
    line = error_line_in_process(TINY_ARGS + ["--data_dir", str(tmp_path), "--log_dir", str(tmp_path / "log")], capsys)
    assert line == f"error: no train shards (*_train_*.npy) in --data_dir {tmp_path}: run fineweb.py to make them"


def test_text_download_failure_offline(tmp_path, monkeypatch, capsys):
    """A first run without --text_file downloads tiny Shakespeare to input.txt beside the script."""
    missing, url = tmp_path / "input.txt", "http://127.0.0.1:9/input.txt"  # the discard port: refused
    monkeypatch.setattr(t, "TEXT_FILE", str(missing))
    monkeypatch.setattr(t, "TINY_SHAKESPEARE_URL", url)
    args = TINY_ARGS[: TINY_ARGS.index("--text_file")] + ["--log_dir", str(tmp_path / "log")]
    line = error_line_in_process(args, capsys)
    assert line.startswith(f"error: could not download {url} to {missing} (")
    assert line.endswith("): put a text file there, or pass --text_file or --data_dir")
    assert list(tmp_path.iterdir()) == []  # no partial download left behind, nor the log folder: the inputs come first


def test_importing_the_scripts_does_no_work_and_loads_only_what_every_run_needs():
    """Importing prints nothing, starts no process group, and leaves out what only some runs need: the optional
    packages and torch.distributed.optim (--shard_optimizer), which imports FSDP and DTensor: 1.8 s more before
    a mistake could be told."""
    optional = ["torch.distributed.optim", "tiktoken", "transformers", "datasets", "pyarrow"]
    result = run_python(["-c", "import sys, torch.distributed as dist, train_gpt2, fineweb; "
                         f"print(dist.is_initialized(), [m for m in {optional!r} if m in sys.modules])"])
    assert (result.returncode, result.stdout, result.stderr) == (0, "False []\n", "")


def fields_in_help_order() -> list:
    """Config's fields (the recipe's TrainConfig's first) under their sections, each section where its first field
    is: within a section, in Config's order."""
    fields = dataclasses.fields(t.Config)
    sections = list(dict.fromkeys(f.metadata["section"] for f in fields))
    return sorted(fields, key=lambda f: sections.index(f.metadata["section"]))


def test_help_explains_every_flag_under_its_section_within_the_terminal():
    """It was 157 lines in one flat list; then 200 columns wide, which wrapped on an 80-column terminal."""
    result = run_script(["--help"], env={"COLUMNS": "80"})
    assert result.returncode == 0
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    sections = ["model", "data", "batch", "optimizer", "logging", "runtime", "checkpoints", "run modes"]
    found, flags, helps = [], [], []
    for line in result.stdout.splitlines():
        if line.rstrip(":") in sections:
            found.append(line.rstrip(":"))
        elif line.startswith("  --"):
            flags.append((found[-1], line.split()[0].rstrip(",").replace("[no-]", "")))
            helps.append(line)
        elif line.startswith("    ") and helps:  # the help's next line
            helps[-1] += " " + line.strip()
    assert found == sections
    assert [name for _, name in flags] == [f"--{field.name}" for field in fields_in_help_order()]
    assert flags == [(field.metadata["section"], f"--{field.name}") for field in fields_in_help_order()]
    assert all("(default" in text for text in helps), helps
    assert ("batch", "--micro_batch_size") in flags and ("model", "--dropout") in flags
    assert any("a GPU's peak TFLOP/s, for MFU (default: the machine picks)" in text for text in helps)


def test_help_gives_each_flag_one_line_at_100_columns_in_the_readmes_section_order():
    """At 100 columns --help wrapped 17 flags onto two lines (issue 62), while the README said one line each;
    --model's and --dtype's choices and --shard_optimizer, --no-shard_optimizer took a line of their own."""
    result = run_script(["--help"], env={"COLUMNS": "100"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n\n", 3)[3].splitlines()  # after the usage, the description and -h
    sections = [line[:-1] for line in lines if line and not line.startswith(" ")]
    flags = [line for line in lines if line.startswith(" ")]
    assert all(re.fullmatch(r"  --\S+( \w+)? +\S.{10,}", line) and len(line) <= 100 for line in flags), flags
    assert [line.split()[0] for line in flags] == [
        f"--[no-]{f.name}" if bool in (typing.get_args(f.type) or [f.type]) else f"--{f.name}"
        for f in fields_in_help_order()]
    said = re.search(r"under the section its\s+`Config` field names: ([^.]+)\.", README.read_text())
    assert said, "the README's sentence naming --help's sections (`Config` field names: ...) is gone"
    assert sections == [name.replace(" (and schedule)", "") for name in re.split(r",\s+", said[1])]


@pytest.mark.parametrize("args, suggested", [
    (["--steps", "5"], "--max_steps"),  # was --eps, the nearest spelling
    (["--lr", "1e-3"], "--max_lr"),  # not --min_lr_ratio: the shortest with the word
    (["--batch_size", "8"], "--total_batch_size"),
    (["--max_stepz", "5"], "--max_steps"),  # no word matches: the nearest spelling
])
def test_a_flag_typed_as_a_word_of_a_flags_name_gets_that_flag(args, suggested):
    with pytest.raises(t.RunError) as error:
        t.parse_args(args)
    assert str(error.value) == f"unrecognized arguments: {' '.join(args)}: did you mean {suggested}? (see --help)"


def test_a_file_given_to_data_dir_points_to_text_file(capsys, tmp_path):
    (tmp_path / "input.txt").write_text("First Citizen:\n")
    line = error_line_in_process(TINY_ARGS + ["--data_dir", str(tmp_path / "input.txt"), "--log_dir",
                                              str(tmp_path / "log")], capsys)
    assert line == (f"error: --data_dir {tmp_path / 'input.txt'} is not a folder: for a text file, use --text_file "
                    f"{tmp_path / 'input.txt'}")


def test_every_flag_takes_hyphens_too_as_torchrun_does():
    """`--max-steps 5` got "did you mean --max_lr?" (issue 56). --help lists the underscores alone: see
    test_help_explains_every_flag_under_its_section_within_the_terminal."""
    for field in dataclasses.fields(t.Config):
        hyphens = field.name.replace("_", "-")
        if bool in (typing.get_args(field.type) or [field.type]):
            for given, expected in ((f"--{hyphens}", True), (f"--no-{hyphens}", False)):
                assert getattr(t.parse_args([given]), field.name) is expected, given
        else:
            value = field.metadata["choices"][-1] if field.metadata["choices"] else "3"
            hyphenated = t.parse_args([f"--{hyphens}", value])
            assert hyphenated == t.parse_args([f"--{field.name}", value]) != t.parse_args([]), hyphens
    assert t.parse_args(["--max-steps=5", "--no-compile"]) == t.parse_args(["--max_steps", "5", "--no-compile"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--micro_batch_size", "0"], "--micro_batch_size must be at least 1, got 0"),
        (["--n_layer", "0"], "--n_layer must be at least 1, got 0"),
        (["--eval_every", "1", "--eval_steps", "0"], "--eval_steps must be at least 1, got 0"),
        (["--loss_chunk_size", "-1"], "--loss_chunk_size -1: must be 0 or more"),
        (["--keep_ckpts", "-1", "--eval_every", "-250"], "--eval_every -250, --keep_ckpts -1: must be 0 or more"),
        (["--sample_every", "-5", "--hellaswag_every", "-1"],
         "--sample_every -5, --hellaswag_every -1: must be 0 or more"),
        (["--max_lr", "-1"], "--max_lr -1.0 is not above 0"),
        (["--min_lr_ratio", "2"], "--min_lr_ratio 2.0 is not in [0, 1]"),
        (["--dropout", "1"], "--dropout 1.0 is not in [0, 1)"),
        (["--beta1", "1.5"], "--beta1 1.5 and --beta2 0.95 must be in [0, 1)"),
        (["--weight_decay", "-0.1"], "--weight_decay -0.1: must be 0 or more"),
        (["--grad_clip", "-1"], "--grad_clip -1.0: must be 0 or more"),
        (["--peak_tflops", "0"], "--peak_tflops 0.0 is not above 0"),
        (["--num_samples", "0"], "--num_samples must be at least 1, got 0"),
        (["--top_k", "0"], "--top_k must be at least 1, got 0"),
        (["--temperature", "0"], "--temperature 0.0 is not above 0"),
        (["--max_new_tokens", "-1"], "--max_new_tokens -1: must be 0 or more"),
        (["--eps", "-1"], "--eps -1.0 is not above 0: AdamW divides by it where a gradient is 0 (try 1e-8)"),
        (["--eps", "0"], "--eps 0.0 is not above 0: AdamW divides by it where a gradient is 0 (try 1e-8)"),
        (["--generate", "--eval_only"], "--generate and --eval_only are separate runs: pick one"),
        # --eval_only --resume scored untrained weights: a run mode reads --init_from alone
        (["--eval_only", "--resume", "log/ckpt_6.pt"],
         "--eval_only takes the weights of --init_from, not --resume: use --init_from log/ckpt_6.pt"),
        (["--generate", "--resume", "auto"],
         "--generate takes the weights of --init_from, not --resume: use --init_from log/ckpt_<step>.pt"),
        (["--hellaswag_path", "/nowhere/hs.jsonl"],
         "--hellaswag_path /nowhere/hs.jsonl does not exist: give hellaswag_val.jsonl's path"),
    ],
)
def test_more_config_mistakes(args, message):
    import train_gpt2 as t

    flags = TINY_ARGS_WITHOUT_SHAPE if "--init_from" in args else TINY_ARGS
    with pytest.raises(t.RunError) as raised:
        t.check_config(t.parse_args(flags + args), world_size=1)
    assert str(raised.value) == message


def test_a_missing_text_file_is_one_line(capsys, tmp_path):
    """Told where the text is read, as the shards' mistakes are (check_config checked both once more)."""
    assert error_line_in_process(TINY_ARGS + ["--text_file", "/nowhere/input.txt", "--log_dir", str(tmp_path)],
                                 capsys) == ("error: --text_file /nowhere/input.txt does not exist: give a text file, "
                                             "or --data_dir with fineweb.py's shards")


@pytest.mark.parametrize("mode", [["--generate"], ["--export_hf", "hf", "--init_from", "gpt2"]])
def test_generate_or_export_under_torchrun_names_only_that(mode):
    with pytest.raises(t.RunError) as raised:
        t.check_config(t.parse_args(mode), world_size=2)
    assert str(raised.value) == f"{mode[0]} runs in one process: use python, not torchrun"


@pytest.mark.parametrize("mode", [["--generate"], ["--export_hf", "hf", "--init_from", "gpt2"]])
def test_generate_and_export_read_no_data_so_a_missing_data_file_is_no_mistake(mode, tmp_path):
    for data in (["--text_file", "/nowhere/input.txt"], ["--data_dir", str(tmp_path / "no_shards")]):
        t.check_config(t.parse_args(mode + data), world_size=1)  # raises nothing


def test_one_gpu_named_for_several_processes():
    import train_gpt2 as t

    with pytest.raises(t.RunError) as raised:
        t.pick_device("cuda:1", t.Launch(rank=0, local_rank=0, world_size=2, torchrun=True), 2, False)
    assert str(raised.value) == "--device cuda:1 names one GPU for 2 processes: use --device cuda"
    two_machines_of_2 = t.Launch(rank=3, local_rank=1, world_size=4, torchrun=True, local_world_size=2)
    assert t.pick_device("cuda", two_machines_of_2, 2, False) == "cuda:1"
    one_process = t.Launch(torchrun=True)  # a GPU named for a lone process is the one it gets (it used to get cuda:0)
    assert t.pick_device("cuda:1", one_process, 2, False) == "cuda:1"


@pytest.mark.parametrize("device, launch, message", [
    # the README's 8-GPU command on a machine with 4: ranks 4-7 died with CUDA's "invalid device ordinal"
    ("cuda", t.Launch(rank=0, local_rank=0, world_size=8, torchrun=True, local_world_size=8),
     "error: 8 processes on this machine, which has 4 GPU(s): start one process a GPU (torchrun --nproc_per_node=4)"),
    ("cuda:4", t.Launch(), "error: --device cuda:4 is not on this machine, which has 4 GPU(s), cuda:0 to cuda:3: pick "
                           "one of those"),
])
def test_more_gpus_asked_for_than_the_machine_has(device, launch, message):
    with pytest.raises(t.RunError) as refused:
        t.pick_device(device, launch, 4, False)
    assert f"error: {refused.value}" == message
    assert t.pick_device(device, launch, 8, False) == ("cuda:0" if launch.torchrun else "cuda:4")  # 8 GPUs: fine


@pytest.mark.parametrize("flags", [[], ["--device", "cuda"], ["--no-compile"]])
def test_a_plain_run_on_a_gpu_machine_starts_on_cuda_0(flags, monkeypatch, tmp_path):
    """The README's one-GPU command, `python train_gpt2.py` without torchrun: it used to stop at start on a GPU,
    as torch.cuda.set_device("cuda") raises. CUDA is reported present here, and set_device checks its argument
    with torch's own function, as the real one does first."""
    from torch.cuda._utils import _get_device_index

    selected, started = [], []
    report_card("h100", monkeypatch.setattr)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: selected.append(_get_device_index(device)))
    trained = t.TrainResult(None, types.SimpleNamespace(finish=lambda: None))  # main() calls its run's finish()
    monkeypatch.setattr(t, "train", lambda cfg, make_run: started.append(cfg.device) or trained)
    assert t.main(t.parse_args(flags + ["--log_dir", str(tmp_path)])) is trained
    assert selected == [0] and started == ["cuda:0"]
    with pytest.raises(ValueError, match="Expected a torch.device with a specified index"):
        torch.cuda.set_device("cuda")  # the stand-in rejects what the real call rejected


def test_sequence_longer_than_the_checkpoint_model(tmp_path):
    import train_gpt2 as t

    t.main(t.parse_args(TINY_ARGS + ["--max_steps", "2", "--log_dir", str(tmp_path)]))  # block_size 64
    cfg = t.parse_args(["--init_from", str(tmp_path / "ckpt_2.pt"), "--seq_len", "128", "--device", "cpu"])
    assert cfg.block_size == 64  # the checkpoint's
    with pytest.raises(t.RunError) as raised:
        t.check_config(cfg, 1)
    assert str(raised.value) == "--seq_len 128 is longer than --block_size 64: lower --seq_len"
