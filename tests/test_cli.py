"""Each user mistake: exit status 2, one line on stderr naming the problem and the fix, nothing else."""

import dataclasses
import json
import re
import shlex

import numpy as np
import pytest
import torch

import train_gpt2 as t
from conftest import ROOT, TINY_ARGS, run_python, run_script


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
         "make --total_batch_size a multiple of it"),
        (["--seq_len", "128"],
         "error: --seq_len 128 is longer than --block_size 64: lower --seq_len or raise --block_size"),
        (["--model", "gpt3"],
         "error: unknown --model 'gpt3': choose one of gpt2, gpt2-medium, gpt2-large, gpt2-xl"),
        (["--device", "tpu"], "error: unknown --device 'tpu': use auto, cpu, cuda, cuda:N or mps"),
        (["--device", "cuda"], "error: --device cuda is not available on this machine: use --device auto or cpu"),
        (["--vocab_size", "1000"],
         "error: --vocab_size 1000 is smaller than the GPT-2 tokenizer's 50257 tokens: use at least 50257 "
         "(50304 is faster)"),
        (["--warmup_steps", "21"], "error: --warmup_steps 21 must be between 0 and --max_steps 20: lower --warmup_steps"),
        (["--n_embd", "33"], "error: --n_embd 33 is not divisible by --n_head 2: pick a width that is"),
        (["--dtype", "float8"], "error: unknown --dtype 'float8': choose auto, float32, bfloat16 or float16"),
        (["--max_steps", "ten"], "error: argument --max_steps: invalid int value: 'ten' (see --help)"),
        (["--fp8"], "error: --fp8 needs an NVIDIA GPU with float8 matmuls (compute capability 8.9 or newer: Ada, "
                    "Hopper); this run is on cpu: drop --fp8"),
        (["--learning_rate", "1"], "error: unrecognized arguments: --learning_rate 1 (see --help)"),
        (["--compile_mode", "fast"], "error: unknown --compile_mode 'fast': choose default, reduce-overhead, "
                                     "max-autotune, max-autotune-no-cudagraphs"),
        (["--compile_mode", "reduce-overhead"],
         "error: --compile_mode reduce-overhead needs torch.compile, which is off on cpu: add --compile"),
        (["--profile_steps", "17"],
         "error: --profile_steps 17 needs 21 steps (3 warm-up, 1 for the profiler): raise --max_steps to 21"),
    ],
)
def test_config_mistakes(args, message, capsys):
    """Run in this process (a new Python costs 2 s a case); test_the_command_line_says_a_mistake_in_one_line checks
    that the command line prints the same."""
    assert error_line_in_process(TINY_ARGS + args, capsys) == message


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


GPT2_ON_16_GIB = ("error: micro batch 64 x 1024 needs at least 37.9 GiB of memory on the CPU (weights, gradients, "
                  "AdamW state and activations), more than this machine's 16.0 GiB: lower --micro_batch_size to 8 (a "
                  "step stays {step} tokens, in more micro-steps), or add --recompute")


def test_a_cpu_run_too_large_for_the_machine_is_one_line_before_the_first_step(capsys, monkeypatch, tmp_path):
    """The GPU recipe's micro batch on a 16 GiB laptop: the kernel used to kill the run part way, without a word."""
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16 * 2**30 // 4096}
    monkeypatch.setattr(t.os, "sysconf", pages.__getitem__)
    monkeypatch.setattr(t, "forward_backward", None)  # a step of this size here would take minutes, if it fit at all
    args = ["--device", "cpu", "--text_file", TINY_ARGS[TINY_ARGS.index("--text_file") + 1], "--total_batch_size",
            "65536", "--max_steps", "1", "--warmup_steps", "1", "--eval_every", "0", "--log_dir", str(tmp_path)]
    assert error_line_in_process(args, capsys) == GPT2_ON_16_GIB.format(step="65,536")


GPT2_124M = t.GPTConfig(12, 12, 768, 1024, 50304)


@pytest.mark.parametrize("flags, launch, machine_gib, message", [
    ([], t.Launch(), 16, GPT2_ON_16_GIB.format(step="524,288")),
    ([], t.Launch(), 38, None),  # 16 x 124,475,904 + 65,536 tokens x 16 x 768 x 4 bytes x 12 layers = 37.85 GiB
    (["--micro_batch_size", "8"], t.Launch(), 16, None),  # 6.4 GiB; measured: 7.7 GiB at the peak (Measured figures)
    (["--recompute"], t.Launch(), 16, None),  # 1.85 GiB + 65,536 x (16 + 12) x 768 x 4 bytes = 7.1 GiB
    (["--micro_batch_size", "8"], t.Launch(rank=0, world_size=2, torchrun=True, local_world_size=2), 12,
     "error: micro batch 8 x 1024 needs at least 12.7 GiB of memory on the CPU for 2 processes (weights, gradients, "
     "AdamW state and activations), more than this machine's 12.0 GiB: lower --micro_batch_size to 2 (a step stays "
     "524,288 tokens, in more micro-steps), or add --recompute"),  # 2 x (1.85 + 2 x 0.56 GiB) fits in half of 12
    # AdamW's moments shared out: 2 x (12 x 124,475,904 bytes + 8,192 tokens x 16 x 768 x 4 bytes x 12) = 11.78 GiB
    (["--micro_batch_size", "8", "--shard_optimizer"], t.Launch(rank=0, world_size=2, torchrun=True,
                                                                local_world_size=2), 12, None),
    (["--micro_batch_size", "1", "--recompute"], t.Launch(), 1.5,
     "error: micro batch 1 x 1024 needs at least 1.9 GiB of memory on the CPU (weights, gradients, AdamW state and "
     "activations), more than this machine's 1.5 GiB: pick a smaller model or --seq_len"),
])
def test_cpu_memory_check_counts_weights_optimizer_and_saved_activations(flags, launch, machine_gib, message):
    cfg = t.parse_args(["--device", "cpu"] + flags)
    check = lambda: t.check_fits_in_cpu_memory(cfg, GPT2_124M, 124_475_904, torch.float32, launch,
                                               int(machine_gib * 2**30))
    if message is None:
        check()
    else:
        with pytest.raises(t.ConfigError) as refused:
            check()
        assert f"error: {refused.value}" == message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_memory_check_is_a_close_lower_bound_of_what_autograd_saves(dtype):
    """What a forward pass saves for backward, counted with saved_tensors_hooks (each storage once; not the weights,
    nor the chunked loss's float32 gradient of the embedding, which does not grow with the batch), is at least the
    check's figure for the activations, and not far more: the check never refuses a run that fits, and is not so
    low that it lets everything through (under bf16 autocast the LayerNorms work in float32, hence its looser fit)."""
    torch.manual_seed(0)
    config = t.GPTConfig(n_layer=3, n_head=4, n_embd=96, block_size=128, vocab_size=50304)
    model = t.GPT(config)
    model.loss_chunk_size = 8192  # as on a CPU, where compile is off
    storages = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda x: storages.setdefault(x.untyped_storage().data_ptr(), x),
                                                  lambda x: x):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            tokens = torch.randint(0, 50304, (4, 128))
            model(tokens, tokens)
    fixed = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(x.untyped_storage().nbytes() for pointer, x in storages.items()
                if pointer not in fixed and x.shape != (50304, 96))
    bound = 4 * 128 * t.SAVED_VALUES_PER_TOKEN_LAYER_CHANNEL * 96 * torch.finfo(dtype).bits // 8 * 3
    assert bound <= saved <= (1.1 if dtype == torch.float32 else 1.4) * bound, (saved, bound)


TOKENIZER_OFFLINE = ("error: cannot load the GPT-2 tokenizer (ConnectionError): tiktoken downloads its two files once; "
                     "connect to the network, or set TIKTOKEN_CACHE_DIR to a folder that holds them")


def offline(name):
    """What tiktoken.get_encoding raises with no network and nothing cached (requests' ConnectionError, an OSError;
    it used to end the run with requests' traceback)."""
    raise ConnectionError("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net', port=443): Max retries "
                          "exceeded with url: /gpt-2/encodings/main/vocab.bpe")


@pytest.mark.parametrize("source", ["text", "shards"])  # the text is tokenized first; shards need it for samples
def test_a_tokenizer_that_cannot_be_downloaded_is_one_line(source, monkeypatch, capsys, tmp_path):
    tiktoken = pytest.importorskip("tiktoken")
    data = []
    if source == "shards":
        for split in ("train", "val"):
            np.save(tmp_path / f"tiny_{split}_000000.npy", np.arange(1000, dtype=np.uint16))
        data = ["--data_dir", str(tmp_path)]
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    assert error_line_in_process(TINY_ARGS + data + ["--log_dir", str(tmp_path / "log")], capsys) == TOKENIZER_OFFLINE


def error_line_in_process(args, capsys):
    """What `python train_gpt2.py ARGS` prints on stderr for a mistake, as its __main__ block runs it."""
    try:
        cfg = t.parse_args(args)
    except t.ConfigError as error:
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
def test_the_command_line_says_a_mistake_in_one_line(args, capsys):  # one from the parser, two from main's checks
    assert one_line_error(run_script(TINY_ARGS + args)) == error_line_in_process(TINY_ARGS + args, capsys)


def test_missing_data_dir(tmp_path):
    line = one_line_error(run_script(TINY_ARGS + ["--data_dir", str(tmp_path / "nowhere")]))
    assert line == f"error: --data_dir {tmp_path / 'nowhere'} is not a folder: run fineweb.py to make shards, or fix the path"


def test_data_dir_without_shards(tmp_path):
    (tmp_path / "notes.txt").write_text("no shards here")
    line = one_line_error(run_script(TINY_ARGS + ["--data_dir", str(tmp_path)]))
    assert line == f"error: no train shards (*_train_*.npy) in --data_dir {tmp_path}: run fineweb.py to make them"


def test_text_download_failure_offline(tmp_path):
    missing = tmp_path / "input.txt"
    url = "http://127.0.0.1:9/input.txt"  # the discard port: the connection is refused at once
    line = one_line_error(run_script(TINY_ARGS + ["--text_file", str(missing), "--text_url", url,
                                                  "--log_dir", str(tmp_path / "log")]))
    assert line.startswith(f"error: could not download {url} to {missing} (")
    assert line.endswith("): put a text file there or pass --text_file or --data_dir")
    assert [p.name for p in tmp_path.iterdir()] == ["log"]  # no partial download left behind


def test_importing_the_scripts_does_no_work_and_loads_only_what_every_run_needs():
    """Importing prints nothing, starts no process group, and leaves out what only some runs need: the optional
    packages and torch.distributed.optim (--shard_optimizer), which imports FSDP and DTensor: 1.8 s more before
    a mistake could be told."""
    optional = ["torch.distributed.optim", "tiktoken", "transformers", "matplotlib", "torchao", "datasets", "pyarrow"]
    result = run_python(["-c", "import sys, torch.distributed as dist, train_gpt2, fineweb; "
                         f"print(dist.is_initialized(), [m for m in {optional!r} if m in sys.modules])"])
    assert (result.returncode, result.stdout, result.stderr) == (0, "False []\n", "")


def test_help_explains_every_flag():
    result = run_script(["--help"])
    assert result.returncode == 0
    import train_gpt2 as t
    import dataclasses

    for field in dataclasses.fields(t.TrainConfig):
        assert f"--{field.name}" in result.stdout
    assert "989 is the H100 SXM dense bf16 datasheet figure" in " ".join(result.stdout.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--micro_batch_size", "0"], "--micro_batch_size must be at least 1, got 0"),
        (["--n_layer", "0"], "--n_layer must be at least 1, got 0"),
        (["--eval_every", "1", "--eval_steps", "0"], "--eval_steps must be at least 1 when --eval_every is set, got 0"),
        (["--loss_chunk_size", "-1"], "--loss_chunk_size must be 0 or more, got -1"),
        (["--profile_steps", "2", "--stop_after_steps", "5"],
         "--profile_steps 2 needs 6 steps (3 warm-up, 1 for the profiler): raise --stop_after_steps to 6"),
        (["--profile_steps", "-1"], "--profile_steps -1: must be 0 (off) or more"),
        (["--keep_ckpts", "-1", "--eval_every", "-250"], "--eval_every -250, --keep_ckpts -1: must be 0 (off) or more"),
        (["--sample_every", "-5", "--hellaswag_every", "-1"],
         "--sample_every -5, --hellaswag_every -1: must be 0 (off) or more"),
        (["--max_lr", "-1"], "--max_lr (-1.0) must be above 0 and --min_lr_ratio (0.1) between 0 and 1"),
        (["--min_lr_ratio", "2"], "--max_lr (0.003) must be above 0 and --min_lr_ratio (2.0) between 0 and 1"),
        (["--beta1", "1.5"], "AdamW needs 0 <= --beta1 (1.5), --beta2 (0.95) < 1 and --eps (1e-08), --weight_decay (0.1) "
                             "of 0 or more"),
        (["--weight_decay", "-0.1"], "AdamW needs 0 <= --beta1 (0.9), --beta2 (0.95) < 1 and --eps (1e-08), "
                                     "--weight_decay (-0.1) of 0 or more"),
        (["--grad_clip", "-1"], "--grad_clip must be 0 (off) or more, got -1.0"),
        (["--peak_tflops", "0"], "--peak_tflops must be above 0 (the device's peak, for MFU), got 0.0"),
        (["--num_samples", "0"], "--num_samples (0) must be at least 1 and --max_new_tokens (32) 0 or more"),
        (["--top_k", "0"], "--top_k (0) must be at least 1 and --temperature (1.0) above 0"),
        (["--init_from", "gpt5"], "--init_from gpt5 is neither gpt2, gpt2-medium, gpt2-large, gpt2-xl nor a checkpoint file"),
        (["--generate", "--eval_only"], "--generate runs alone in one process: drop --eval_only, and use python, not torchrun"),
        (["--hellaswag_path", "/nowhere/hs.jsonl"],
         "--hellaswag_path /nowhere/hs.jsonl does not exist: give hellaswag_val.jsonl's path"),
        (["--text_file", "/nowhere/input.txt", "--text_url", ""],
         "--text_file /nowhere/input.txt does not exist and --text_url is empty: give a text file"),
    ],
)
def test_more_config_mistakes(args, message):
    import train_gpt2 as t

    with pytest.raises(t.ConfigError) as raised:
        t.check_config(t.parse_args(TINY_ARGS + args), world_size=1)
    assert str(raised.value) == message


def test_one_gpu_named_for_several_processes():
    import train_gpt2 as t

    with pytest.raises(t.ConfigError) as raised:
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
def test_more_gpus_asked_for_than_the_machine_has(device, launch, message, monkeypatch, capsys):
    monkeypatch.setattr(t.torch.cuda, "device_count", lambda: 4)
    cfg = t.parse_args(TINY_ARGS + ["--device", device, "--total_batch_size", "1024"])
    if launch.torchrun:  # this test plays torchrun's agent, whose store the processes meet at, and ranks 1-7
        store = t.dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(store.port))
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        for rank in range(1, 8):  # they found the same problem on this machine
            store.set(f"startup/{rank}", json.dumps({"problem": message.removeprefix("error: "),
                                                     "flags": dataclasses.asdict(cfg),
                                                     "software": t.software_versions()}))
    with pytest.raises(SystemExit) as exited:
        t.main(cfg, launch)  # stops before any process group
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip() == message
    assert t.pick_device(device, launch, 8, False) == ("cuda:0" if launch.torchrun else "cuda:4")  # 8 GPUs: fine


def test_sequence_longer_than_the_checkpoint_model(tmp_path):
    import train_gpt2 as t

    t.main(t.parse_args(TINY_ARGS + ["--max_steps", "2", "--log_dir", str(tmp_path)]))  # block_size 64
    cfg = t.parse_args(["--init_from", str(tmp_path / "ckpt_2.pt"), "--seq_len", "128", "--device", "cpu"])
    with pytest.raises(t.ConfigError) as raised:
        t.build_model(cfg, t.Launch(), "cpu")
    assert str(raised.value) == "--seq_len 128 is longer than the model's 64 positions: lower --seq_len"


def readme_commands():
    """(world size, arguments) of every train_gpt2.py command in the README's bash blocks."""
    readme = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.split("&&"):
                words = shlex.split(command, comments=True)
                if "train_gpt2.py" not in words or "..." in words:
                    continue  # another program, or an elided command
                launcher = dict(w.removeprefix("--").split("=") for w in words[:words.index("train_gpt2.py")] if "=" in w)
                processes = launcher.get("nproc_per_node", "1").replace("N", "2")  # N: any process count
                world_size = int(processes) * int(launcher.get("nnodes", "1"))
                commands.append((world_size, words[words.index("train_gpt2.py") + 1:]))
    return commands


def test_every_command_in_the_readme_passes_the_config_checks(tmp_path, monkeypatch):
    """A README command that fails its own checks is a bug (one did: a 30-step benchmark with 715 warmup steps)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "edu_fineweb10B").mkdir()
    for name in ("edu_fineweb10B_val_000000.npy", "edu_fineweb10B_train_000001.npy"):
        np.save(tmp_path / "edu_fineweb10B" / name, np.zeros(10, dtype=np.uint16))
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "ckpt_19073.pt").write_bytes(b"")  # --init_from's file; the config check only needs it to exist
    commands = readme_commands()
    assert len(commands) >= 9, commands
    assert (1, ["--data_dir", "edu_fineweb10B", "--max_steps", "30", "--warmup_steps", "10", "--eval_every", "0",
                "--sample_every", "0", "--ckpt_every", "0"]) in commands  # the benchmark
    for world_size, args in commands:
        t.check_config(t.parse_args(args), world_size)
