import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt2 as t
from conftest import ROOT, SHAKESPEARE, TINY_ARGS, named, run_script, single_thread
from resume_memory import resident_gib
from test_ddp import ENTRY, ONE_THREAD, assert_every_rank_stopped_with_one_line, torchrun

EIGHT_STEPS = TINY_ARGS + ["--max_steps", "8", "--eval_every", "4", "--eval_steps", "1"]


def run(args, log_dir):
    return t.main(t.parse_args(EIGHT_STEPS + ["--log_dir", str(log_dir)] + args))


def logged(log_dir, key="train_loss"):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r[key]) for r in map(json.loads, lines) if key in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 8-step run in this process, one thread (as conftest.one_thread, and as a subprocess with
    ONE_THREAD: bitwise the same): the --log_dir (metrics.jsonl, ckpt_8.pt) that several tests' stopped, failed or
    restarted and resumed runs must end up equal to. 2 processes of 1 micro-step and 1 process of 2 compute each
    step bitwise alike (their averaged gradient is the same sum, halved): it is the 2-process tests' too."""
    log_dir = tmp_path_factory.mktemp("straight")
    with single_thread():
        run([], log_dir)
    return log_dir


def assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=named(name))  # bitwise


@pytest.mark.parametrize("dropout", [[], ["--dropout", "0.1"]])  # with dropout, the torch RNG state matters too
def test_resume_is_exact_in_one_process(one_thread, tmp_path, dropout):
    straight = run(dropout, tmp_path / "straight")
    first_half = run(dropout + ["--stop_after_steps", "4"], tmp_path / "resumed")
    assert [r["step"] for r in first_half.run.records if "train_loss" in r] == [0, 1, 2, 3]
    with open(tmp_path / "resumed" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train_loss": 10.7')  # the tail of a process killed while writing a record
    resumed = run(dropout + ["--resume", "auto"], tmp_path / "resumed")
    assert [r["step"] for r in resumed.run.records if "train_loss" in r] == [4, 5, 6, 7]
    assert logged(tmp_path / "resumed") == logged(tmp_path / "straight")  # all 8 steps, no duplicates
    assert logged(tmp_path / "resumed", "val_loss") == logged(tmp_path / "straight", "val_loss")
    assert_same_weights(resumed.model.state_dict(), straight.model.state_dict())


def no_room(path):
    """The line for a write that failed: here, past the subprocess's file size limit (conftest.files_limited_to)."""
    return (f"error: cannot write {path} (File too large): make room in {path.parent}, then run the same command "
            "with --resume auto")


def test_a_checkpoint_the_disk_cannot_take_stops_with_one_line_and_the_run_resumes_exactly(tmp_path, straight,
                                                                                          one_thread):
    """The run that fails to write is a real process with a real size limit; the run before it and the run after
    it are this process's (one thread, as the straight run's)."""
    log_dir = tmp_path / "resumed"
    flags = ["--ckpt_every", "3", "--keep_ckpts", "0"]
    run(flags + ["--stop_after_steps", "3"], log_dir)
    # 1 MiB a file: the log fits, a checkpoint (6 MiB of weights, 13 of AdamW state) does not
    failed = run_script(EIGHT_STEPS + flags + ["--log_dir", str(log_dir), "--resume", "auto"], env=ONE_THREAD,
                        max_file_bytes=2**20)
    assert one_line_error(failed) == no_room(log_dir / "ckpt_6.pt")
    # no partial file: the older checkpoint is whole
    assert sorted(p.name for p in log_dir.iterdir()) == ["ckpt_3.pt", "ckpt_3.pt.sha256", "metrics.jsonl"]
    assert t.read_checkpoint(str(log_dir / "ckpt_3.pt"))["step"] == 3
    run(flags + ["--resume", "auto"], log_dir)
    assert logged(log_dir) == logged(straight)
    assert_same_weights(torch.load(log_dir / "ckpt_8.pt")["model"], torch.load(straight / "ckpt_8.pt")["model"])


def after_the_run_record(args, room):
    """A limit on a file's size: metrics.jsonl's first record (the run's flags, versions, ...: some 250 bytes and
    the flags as JSON) and room for more."""
    return len(json.dumps(dataclasses.asdict(t.parse_args(args)))) + 300 + room


def test_a_log_the_disk_cannot_take_stops_with_one_line_leaving_whole_records(tmp_path):
    args = EIGHT_STEPS + ["--eval_every", "0", "--log_dir", str(tmp_path)]
    result = run_script(args, env=ONE_THREAD, max_file_bytes=after_the_run_record(args, 1_000))  # 170 bytes a step
    assert one_line_error(result) == no_room(tmp_path / "metrics.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no checkpoint, no temporary file
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "train_loss" in r]
    assert steps == list(range(len(steps))) and 4 <= len(steps) < 8  # whole records only, then it stopped


def test_a_checkpoint_the_disk_cannot_take_under_torchrun_stops_every_rank_with_one_line(tmp_path):
    """The run to resume is this process's (its checkpoint holds 1 rank's generators; rank 1 keeps its seed)."""
    log_dir = tmp_path / "log"
    args = TINY_ARGS + ["--ckpt_every", "2", "--log_dir", str(log_dir)]
    t.main(t.parse_args(args + ["--stop_after_steps", "2"]))
    result = torchrun(2, ["train_gpt2.py"] + args + ["--resume", "auto"], timeout=120, max_file_bytes=2**20)
    # rank 1 waited for the checkpoint and stopped with rank 0: no lost-connection traceback from either
    assert_every_rank_stopped_with_one_line(result, no_room(log_dir / "ckpt_4.pt"))
    assert 'train_gpt2.py", line' not in result.stderr
    assert sorted(p.name for p in log_dir.glob("ckpt_*")) == ["ckpt_2.pt", "ckpt_2.pt.sha256"]


def test_a_log_the_disk_cannot_take_under_torchrun_stops_every_rank_with_one_line(tmp_path):
    """Rank 0 alone writes the log: the others hear of its failed write at the end of the step."""
    args = EIGHT_STEPS + ["--eval_every", "0", "--log_dir", str(tmp_path)]
    result = torchrun(2, ["train_gpt2.py"] + args, timeout=120, max_file_bytes=after_the_run_record(args, 1_000))
    assert_every_rank_stopped_with_one_line(result, no_room(tmp_path / "metrics.jsonl"))
    assert 'train_gpt2.py", line' not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# main() under torchrun, each rank saying how many DDP objects are alive, uncollected, as its group ends
COUNTING_DRIVER = f"""import gc, os, sys
sys.path.insert(0, {str(ROOT)!r})
import torch.distributed as dist
import train_gpt2 as t
from torch.nn.parallel import DistributedDataParallel as DDP
destroy = dist.destroy_process_group
def counted():
    alive = sum(isinstance(o, DDP) for o in gc.get_objects())
    print(f"rank {{os.environ['RANK']}}: {{alive}} DDP alive as the group ends", file=sys.stderr, flush=True)
    destroy()
dist.destroy_process_group = counted
t.main(t.parse_args(sys.argv[1:]))
"""


def test_a_failed_write_under_torchrun_leaves_nothing_holding_the_group_as_it_ends(tmp_path):
    """The failed write's OSError holds train()'s frame, and its DDP, through its traceback, in a reference cycle:
    left to the collector, DDP now and then outlived destroy_process_group() and gloo aborted rank 0's exit (CI: -6).
    main() collects first: no DDP is alive as the group ends, on either rank."""
    driver = tmp_path / "driver.py"
    driver.write_text(COUNTING_DRIVER)
    args = EIGHT_STEPS + ["--eval_every", "0", "--log_dir", str(tmp_path / "log")]
    result = torchrun(2, [str(driver)] + args, timeout=120, max_file_bytes=after_the_run_record(args, 1_000))
    assert_every_rank_stopped_with_one_line(result, no_room(tmp_path / "log" / "metrics.jsonl"))
    assert sorted(line for line in result.stderr.splitlines() if "DDP alive" in line) == [
        "rank 0: 0 DDP alive as the group ends", "rank 1: 0 DDP alive as the group ends"], result.stderr


def test_with_dropout_two_processes_draw_their_own_masks_and_resume_exactly(tmp_path):
    """Each rank seeds dropout's generator each step from (--seed, step, rank), so a checkpoint holds no generator
    state. The uninterrupted run writes ckpt_3.pt as it goes; a new launch goes on from it in a folder of its own, as
    from a run stopped there (kill -9 after it: metrics.jsonl's later records are dropped), and must draw the same
    masks and log the same losses. Each rank saves the embeddings' dropout mask of every training step."""
    args = EIGHT_STEPS + ["--dropout", "0.1", "--ckpt_every", "3", "--keep_ckpts", "0"]
    straight = torchrun(2, [ENTRY, "dropout_masks", str(tmp_path / "straight")] + args +
                        ["--log_dir", str(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr
    (tmp_path / "log").mkdir()
    for name in ("ckpt_3.pt", "ckpt_3.pt.sha256", "metrics.jsonl"):
        shutil.copy(tmp_path / "straight" / name, tmp_path / "log")
    assert "rng" not in torch.load(tmp_path / "log" / "ckpt_3.pt")
    resumed = torchrun(2, [ENTRY, "dropout_masks", str(tmp_path / "resumed")] + args +
                       ["--log_dir", str(tmp_path / "log"), "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr
    assert logged(tmp_path / "log") == logged(tmp_path / "straight")
    masks = {(run, rank): torch.load(tmp_path / f"{run}.rank{rank}") for run in ("straight", "resumed") for rank in (0, 1)}
    assert masks["straight", 0].shape == (8, 4, 32, 32)  # a step's one micro-batch (B, T, C) a rank
    assert 0.05 < masks["straight", 0].float().mean() < 0.15  # about --dropout's share of the activations
    for step in range(8):  # each rank its own masks, each step new ones
        assert not torch.equal(masks["straight", 0][step], masks["straight", 1][step])
        assert step == 0 or not torch.equal(masks["straight", 0][step], masks["straight", 0][step - 1])
    for rank in (0, 1):  # the resumed run's steps 3 to 7 drew the uninterrupted run's masks
        assert torch.equal(masks["resumed", rank], masks["straight", rank][3:])


@pytest.mark.parametrize("started", ["anew", "from a checkpoint"])
def test_resume_is_exact_under_two_processes_after_torchrun_restarts_a_crashed_job(tmp_path, straight, started):
    """(Two processes stopped by --stop_after_steps and resumed: the sharded-optimizer test below.) The uninterrupted
    run: the 1-process one, which 2 processes train bitwise like (the fixture `straight`). A job started with
    --resume CKPT went back to CKPT when restarted: now a restart goes on from its --log_dir's newest."""
    def two_processes(log_dir, *extra, entry=("train",), torchrun_flags=(), env=None):
        command, *entry_args = entry
        result = torchrun(2, [*torchrun_flags, ENTRY, command, str(log_dir / "final.pt"), *entry_args] + EIGHT_STEPS +
                          ["--log_dir", str(log_dir), *extra], env=env)
        assert result.returncode == 0, result.stderr
        return result

    # rank 1 crashes at step 5; torchrun restarts both ranks, which go on from ckpt_4.pt as if nothing happened.
    # Without the variable, restarted ranks can read the last attempt's addresses from torchrun's shared store and
    # fail to connect (PyTorch #135712, #167288): 3 of 4 tries here failed without it, 5 of 5 passed with it.
    # No --resume auto: a restart goes on from the newest checkpoint of its --log_dir, saying so (issue 62).
    resume, first_step = [], 0
    if started == "from a checkpoint":  # of a 1-process run stopped after 2 steps, in another folder
        with single_thread():
            run(["--ckpt_every", "2", "--stop_after_steps", "2"], tmp_path / "first")
        resume, first_step = ["--resume", str(tmp_path / "first" / "ckpt_2.pt")], 2
    restarted = two_processes(tmp_path / "restarted", "--ckpt_every", "2", *resume,
                              entry=("crash_once", "1", "5"), torchrun_flags=("--max-restarts=1",),
                              env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert "injected failure on rank 1 at step 5" in restarted.stderr
    assert "resumed from step 4" in restarted.stdout
    assert f"torchrun's restart 1: going on from the newest checkpoint in {tmp_path / 'restarted'}\n" in restarted.stdout
    assert logged(tmp_path / "restarted") == logged(straight)[first_step:]
    assert_same_weights(torch.load(tmp_path / "restarted" / "final.pt"),
                        torch.load(straight / "ckpt_8.pt")["model"])


def test_resume_at_another_world_size_and_with_the_optimizer_sharded_trains_on_the_same_tokens(tmp_path, straight,
                                                                                              one_thread):
    """1 plain process stops after 3 steps, 2 processes with AdamW sharded (--shard_optimizer, ZeRO stage 1: each
    keeps the state of and updates its share of the weights) go on for 3, 1 plain process finishes. 1 process
    accumulating 2 micro-batches and 2 processes of 1 compute bitwise the same step, and each weight's sharded update
    is the plain optimizer's arithmetic, so equal losses mean each resumed run read exactly the uninterrupted run's
    tokens, and that the checkpoints carried the whole AdamW state from plain to sharded and back. (The plain
    process is this one, with one thread, as torchrun's.)"""
    log_dir = tmp_path / "log"
    run(["--stop_after_steps", "3"], log_dir)
    sharded = torchrun(2, ["train_gpt2.py"] + EIGHT_STEPS + ["--log_dir", str(log_dir), "--shard_optimizer",
                                                             "--resume", "auto", "--stop_after_steps", "3"])
    assert sharded.returncode == 0, sharded.stderr
    assert "optimizer state sharded over the processes" in sharded.stdout
    num_tensors = len(list(t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)).parameters()))
    assert len(torch.load(log_dir / "ckpt_6.pt")["optimizer"][0]["state"]) == num_tensors  # both shares
    run(["--resume", "auto"], log_dir)
    assert logged(log_dir) == logged(straight)
    assert torch.load(log_dir / "ckpt_8.pt")["data_position"] == 8 * 256  # 8 steps of 256 tokens


def test_muon_in_two_processes_trains_like_one_and_resumes_exactly_at_another_count_plain_or_sharded(tmp_path,
                                                                                                     one_thread):
    """--optimizer muon: 2 plain processes stop after 3 steps, 1 process goes on for 3, 2 with the optimizers sharded
    finish; every loss is the uninterrupted 1-process run's, bitwise (as for AdamW above: the ranks' averaged
    gradient is one process's, and Muon steps each matrix alone), so both optimizers' states went through each
    checkpoint whole; and one schedule set both optimizers' learning rates. (The 1-process runs are this process's,
    with one thread, as torchrun's.)"""
    muon = EIGHT_STEPS + ["--optimizer", "muon"]
    run(["--optimizer", "muon"], tmp_path / "straight")
    log_dir = tmp_path / "log"
    args = muon + ["--log_dir", str(log_dir)]
    two = torchrun(2, ["train_gpt2.py"] + args + ["--stop_after_steps", "3"])
    assert two.returncode == 0, two.stderr
    adamw_state, muon_state = torch.load(log_dir / "ckpt_3.pt")["optimizer"]
    # Muon: each block's 4 matrices; AdamW: both embeddings, each block's 4 biases and 2 LayerNorms, the final one
    assert len(muon_state["state"]) == 2 * 4 and len(adamw_state["state"]) == 2 + 2 * (4 + 2 * 2) + 2
    assert all(set(state) == {"momentum_buffer"} for state in muon_state["state"].values())
    one = run(["--optimizer", "muon", "--resume", "auto", "--stop_after_steps", "3"], log_dir)
    assert [r["step"] for r in one.run.records if "train_loss" in r] == [3, 4, 5]
    sharded = torchrun(2, ["train_gpt2.py"] + args + ["--shard_optimizer", "--resume", "auto"])
    assert sharded.returncode == 0, sharded.stderr
    assert logged(log_dir) == logged(tmp_path / "straight") and len(logged(log_dir)) == 8
    assert logged(log_dir, "val_loss") == logged(tmp_path / "straight", "val_loss")
    final = torch.load(log_dir / "ckpt_8.pt")
    assert_same_weights(final["model"], torch.load(tmp_path / "straight" / "ckpt_8.pt")["model"])
    last_lr = t.lr_at(7, t.parse_args(muon))
    assert [group["lr"] for state in final["optimizer"] for group in state["param_groups"]] == [last_lr] * 3


def test_resuming_with_the_other_optimizer_is_refused_naming_the_flag(two_checkpoints):
    newest = two_checkpoints / "ckpt_8.pt"
    line = one_line_error(run_script(EIGHT_STEPS + ["--log_dir", str(two_checkpoints), "--resume", "auto",
                                                    "--optimizer", "muon"]))
    assert line == (f"error: cannot resume from {newest} with --optimizer muon: it holds adamw's state; resume with "
                    f"--optimizer adamw, or start a new run from its weights with --init_from {newest}")


def test_checkpoint_holds_plain_names_and_everything_resume_needs(tmp_path):
    run(["--max_steps", "3", "--warmup_steps", "1"], tmp_path)
    checkpoint = torch.load(tmp_path / "ckpt_3.pt", weights_only=True)  # the safe loader reads it
    assert set(checkpoint) == {"model", "trained_model", "model_config", "optimizer", "scaler", "step", "config",
                               "data_epoch", "data_position", "train_tokens", "n_vocab", "source"}  # source: the train_gpt2.py that wrote it
    # no generator state: dropout's generator is seeded each step from (--seed, step, rank), the data order from
    # (--seed, epoch)
    # "model": the weights scored (t.weights_to_score), here the trained ones: one copy in the file
    assert all(checkpoint["trained_model"][name].data_ptr() == weight.data_ptr()
               for name, weight in checkpoint["model"].items())
    assert checkpoint["model_config"] == {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64,
                                          "vocab_size": 50304, "dropout": 0.0}  # what the weights mean
    assert checkpoint["step"] == 3 and (checkpoint["data_epoch"], checkpoint["data_position"]) == (0, 3 * 256)
    assert checkpoint["n_vocab"] == 50257  # the tokenizer's: its embedding rows mean its ids
    assert checkpoint["train_tokens"] == 304_222  # tiny Shakespeare's first 90%
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in checkpoint["model"])
    assert checkpoint["config"]["n_embd"] == 32
    assert (tmp_path / "ckpt_3.pt.sha256").read_text().strip() == t.file_sha256(str(tmp_path / "ckpt_3.pt"))


def test_a_checkpoint_written_before_trained_model_was_kept_apart_resumes_exactly(one_thread, tmp_path, straight):
    """Its "model" holds the trained weights, which resume then takes for both."""
    run(["--stop_after_steps", "4"], tmp_path / "written")
    older = torch.load(tmp_path / "written" / "ckpt_4.pt", weights_only=True)
    del older["trained_model"]
    (tmp_path / "older").mkdir()
    torch.save(older, tmp_path / "older" / "ckpt_4.pt")
    run(["--resume", "auto"], tmp_path / "older")
    assert logged(tmp_path / "older") == logged(straight)[4:]
    assert_same_weights(*(torch.load(log_dir / "ckpt_8.pt", weights_only=True)["model"]
                          for log_dir in (tmp_path / "older", straight)))


def test_a_checkpoint_that_holds_generator_states_resumes_with_dropout_exactly(one_thread, tmp_path):
    """Checkpoints held each rank's torch generator states ("rng": CPU, and one for every GPU of the machine in older
    ones, whose restore raised IndexError on a machine with fewer). Dropout's generator is now seeded each step from
    (--seed, step, rank): such a checkpoint resumes as any other, its states unread, and draws the same masks as the
    uninterrupted run."""
    dropout = ["--dropout", "0.1", "--ckpt_every", "4", "--keep_ckpts", "0"]
    run(dropout, tmp_path / "straight")
    checkpoint = torch.load(tmp_path / "straight" / "ckpt_4.pt", weights_only=True)
    assert "rng" not in checkpoint
    other = torch.Generator().manual_seed(7).get_state()  # not the state the run had
    checkpoint["rng"] = [{"torch_cpu": other, "torch_cuda": [torch.full((16,), gpu, dtype=torch.uint8)
                                                            for gpu in range(8)]}]
    (tmp_path / "older").mkdir()
    torch.save(checkpoint, tmp_path / "older" / "ckpt_4.pt")
    shutil.copy(tmp_path / "straight" / "metrics.jsonl", tmp_path / "older")  # its later records are dropped
    resumed = run(dropout + ["--resume", "auto"], tmp_path / "older")
    assert [r["step"] for r in resumed.run.records if "train_loss" in r] == [4, 5, 6, 7]
    assert logged(tmp_path / "older") == logged(tmp_path / "straight")
    assert_same_weights(torch.load(tmp_path / "older" / "ckpt_8.pt")["model"],
                        torch.load(tmp_path / "straight" / "ckpt_8.pt")["model"])


def test_resuming_on_other_training_data_says_the_data_position_no_longer_matches(tmp_path, capsys):
    run(["--stop_after_steps", "2"], tmp_path)
    shorter = tmp_path / "shorter.txt"
    shorter.write_text(SHAKESPEARE.read_text()[:500_000])
    run(["--resume", "auto", "--stop_after_steps", "2"], tmp_path)  # the same data: no warning
    assert "warning" not in capsys.readouterr().out
    run(["--resume", "auto", "--text_file", str(shorter)], tmp_path)
    train_tokens = len(t.tokenizer().encode_ordinary(shorter.read_text())) * 9 // 10  # the recipe's 90/10 split
    assert (f"warning: the training data holds {train_tokens:,} tokens, the checkpoint's held 304,222: its data "
            "position points at other tokens now; resume with the checkpoint's data to go on exactly") in \
        capsys.readouterr().out.splitlines()


def test_keep_ckpts_leaves_exactly_the_newest(tmp_path):
    run(["--max_steps", "5", "--warmup_steps", "1", "--ckpt_every", "1", "--keep_ckpts", "2"], tmp_path)
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == [
        "ckpt_4.pt", "ckpt_4.pt.sha256", "ckpt_5.pt", "ckpt_5.pt.sha256"]


def one_line_error(result):
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def two_checkpoints_run(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("two_checkpoints")
    run(["--ckpt_every", "4"], log_dir)
    return log_dir


@pytest.fixture
def two_checkpoints(two_checkpoints_run, tmp_path):
    """A copy of one 8-step run's folder (ckpt_4.pt, ckpt_8.pt, metrics.jsonl), each test's own to break."""
    return Path(shutil.copytree(two_checkpoints_run, tmp_path / "log"))


def test_truncated_checkpoint(two_checkpoints, capsys):
    newest = two_checkpoints / "ckpt_8.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    (two_checkpoints / "ckpt_8.pt.sha256").unlink()  # as if killed before the checksum was written
    line = one_line_error(run_script(EIGHT_STEPS + ["--log_dir", str(two_checkpoints), "--resume", str(newest)]))
    assert line.startswith(f"error: cannot read checkpoint {newest} (")
    assert line.endswith("): resume from an older checkpoint")
    # auto warns and takes the one before (in this process: a warning, not an exit)
    run(["--resume", "auto"], two_checkpoints)
    out = capsys.readouterr().out
    assert f"warning: skipping cannot read checkpoint {newest}" in out
    assert "resumed from step 4" in out


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_a_checkpoint_is_mapped_not_copied_and_writes_to_it_stay_in_the_process(tmp_path):
    """Every process reads the checkpoint on --resume. Mapped, the processes of a machine share one copy in the page
    cache; read, each held its own in private memory (8 x 19 GB for GPT-2 XL). On the CPU AdamW's moments are
    updated in place in the loaded tensors: the file must not change under them."""
    path = str(tmp_path / "ckpt_1.pt")
    checkpoint = {key: {} for key in t.CHECKPOINT_KEYS}
    t.save_checkpoint(path, {**checkpoint, "model": {"weights": torch.ones(2**25)}}, keep=0)  # 128 MiB of float32
    before = resident_gib()["RssAnon"]
    weights = t.read_checkpoint(path)["model"]["weights"]
    assert weights.sum().item() == 2**25  # every page read
    assert (resident_gib()["RssAnon"] - before) * 1024 < 16  # MiB; read into private memory, it grew by 128 MiB
    weights.add_(1)
    assert t.file_sha256(path) == Path(f"{path}.sha256").read_text().strip()
    assert t.read_checkpoint(path)["model"]["weights"].sum().item() == 2**25


def test_corrupt_checkpoint_is_caught_by_its_checksum(two_checkpoints):
    newest = two_checkpoints / "ckpt_8.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside tensor data: torch.load alone would not notice
    newest.write_bytes(bytes(data))
    line = one_line_error(run_script(EIGHT_STEPS + ["--log_dir", str(two_checkpoints), "--resume", str(newest)]))
    assert line == (f"error: checkpoint {newest} is corrupt (its sha256 differs from {newest}.sha256): "
                    "resume from an older checkpoint")


def test_resuming_an_older_checkpoint_beside_later_ones_is_refused_until_they_are_moved(two_checkpoints, capsys):
    """Going back to ckpt_4.pt (as the divergence line advises) beside ckpt_8.pt trained on: --keep_ckpts then pruned
    the new branch's checkpoints, and --resume auto (a preemption, a torchrun restart) went on from the old ckpt_8."""
    expected = logged(two_checkpoints)  # the run's 8 steps, which the resumed branch retrains from step 4
    with pytest.raises(SystemExit) as stopped:
        run(["--resume", str(two_checkpoints / "ckpt_4.pt")], two_checkpoints)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"error: --log_dir {two_checkpoints} holds ckpt_8.pt, later than step 4 of "
                                       "--resume: move them, or use another --log_dir\n")
    for later in two_checkpoints.glob("ckpt_8.pt*"):
        later.rename(two_checkpoints.parent / later.name)
    resumed = run(["--resume", str(two_checkpoints / "ckpt_4.pt")], two_checkpoints)
    assert [(r["step"], r["train_loss"]) for r in resumed.run.records if "train_loss" in r] == expected[4:]


def test_a_resume_with_another_data_order_is_refused(two_checkpoints, capsys):
    """--shuffle and --seed choose which windows come next, as --total_batch_size and --seq_len do: a changed one
    redrew the epoch's order part way through, repeating some windows and skipping others."""
    with pytest.raises(SystemExit):
        run(["--resume", "auto", "--shuffle", "--seed", "7"], two_checkpoints)
    assert capsys.readouterr().err == (f"error: cannot resume from {two_checkpoints / 'ckpt_8.pt'}: shuffle False -> "
                                       "True, seed 1337 -> 7 (they define its weights, schedule and data position): "
                                       "use its values\n")


def test_a_fine_tune_stopped_early_goes_on_exactly_with_the_same_command_and_resume_auto(two_checkpoints, tmp_path,
                                                                                       one_thread):
    """The stop line says "run the same command with --resume auto"; with --init_from in that command it was refused
    (--init_from and --resume), and without it the run took the default shape. --resume now goes on, and --init_from
    gives the shape."""
    tune = ["--init_from", str(two_checkpoints / "ckpt_8.pt"), "--max_steps", "4", "--warmup_steps", "1"]
    straight = run(tune, tmp_path / "straight")
    run(tune + ["--stop_after_steps", "2"], tmp_path / "tune")
    resumed = run(tune + ["--resume", "auto"], tmp_path / "tune")
    assert [r["step"] for r in resumed.run.records if "train_loss" in r] == [2, 3]
    assert logged(tmp_path / "tune") == logged(tmp_path / "straight")
    assert_same_weights(resumed.model.state_dict(), straight.model.state_dict())


def test_a_different_shape_or_batch_is_refused_naming_each_field(two_checkpoints):
    args = EIGHT_STEPS + ["--log_dir", str(two_checkpoints), "--resume", "auto", "--n_layer", "3",
                          "--n_embd", "64", "--total_batch_size", "512"]
    line = one_line_error(run_script(args))
    assert line == (f"error: cannot resume from {two_checkpoints / 'ckpt_8.pt'}: n_layer 2 -> 3, n_embd 32 -> 64, "
                    "total_batch_size 256 -> 512 (they define its weights, schedule and data position): use its "
                    "values")


def test_missing_checkpoint_path(tmp_path):
    line = one_line_error(run_script(EIGHT_STEPS + ["--log_dir", str(tmp_path), "--resume", str(tmp_path / "x.pt")]))
    assert line == f"error: --resume {tmp_path / 'x.pt'} does not exist: give a ckpt_<step>.pt from a --log_dir"


def test_resume_auto_finds_the_checkpoints_of_a_log_dir_named_with_glob_characters(tmp_path):
    """--log_dir 'runs/[lr3]' was read as a glob pattern: --resume auto found no checkpoint and started again."""
    run(["--stop_after_steps", "2"], tmp_path / "[lr3]")
    resumed = run(["--resume", "auto", "--max_steps", "3"], tmp_path / "[lr3]")
    assert [r["step"] for r in resumed.run.records if "train_loss" in r] == [2]


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path, capsys):
    result = run(["--resume", "auto", "--max_steps", "3", "--warmup_steps", "1"], tmp_path)
    assert f"--resume auto: no checkpoint in {tmp_path}, starting from scratch" in capsys.readouterr().out
    assert [r["step"] for r in result.run.records if "train_loss" in r] == [0, 1, 2]


def start_training(args, ignored_signal=None):
    def ignore():  # as nohup starts a program
        signal.signal(ignored_signal, signal.SIG_IGN)

    return subprocess.Popen([sys.executable, "-u"] + args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **ONE_THREAD}, preexec_fn=ignore if ignored_signal else None)


def wait_for_line(process, text, timeout=120):
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"{text!r} never printed: {''.join(seen)}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])  # preemption, ssh gone, Ctrl-C
def test_a_signal_finishes_the_step_checkpoints_and_exits_cleanly(tmp_path, signum):
    args = TINY_ARGS + ["--max_steps", "100000", "--ckpt_every", "0", "--log_dir", str(tmp_path)]
    process = start_training(["train_gpt2.py"] + args)
    wait_for_line(process, "step     2/100000")
    process.send_signal(signum)
    signalled = time.monotonic()
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert time.monotonic() - signalled < 10
    assert err == f"{signum.name}: {ANSWERED}\n"  # at once, before the step ends
    stop_line = [line for line in out.splitlines() if line.startswith("stopped by a signal")][0]
    stopped_after = int(stop_line.split("after step ")[1].split(",")[0])
    assert stopped_after <= 4  # the step in progress, or the one after it
    assert stop_line.endswith(f"ckpt_{stopped_after + 1}.pt written: to continue, run the same command with "
                              "--resume auto")
    assert [p.name for p in tmp_path.glob("ckpt_*.pt")] == [f"ckpt_{stopped_after + 1}.pt"]
    # whole (its checksum matches) and at that step; resuming from such a checkpoint: the tests above
    assert t.read_checkpoint(str(tmp_path / f"ckpt_{stopped_after + 1}.pt"))["step"] == stopped_after + 1


ANSWERED = "the step ends, a checkpoint is written, then the run stops (a second Ctrl-C stops at once)"


@pytest.mark.parametrize("ckpt_every", [1, 0])
def test_a_second_ctrl_c_stops_at_once_with_one_line_saying_what_is_lost(tmp_path, ckpt_every):
    """It ended in a KeyboardInterrupt traceback. Steps of 32 micro-steps (some 2 seconds, against the milliseconds
    the signals take): both Ctrl-Cs land in step 1, after ckpt_1.pt and before the checkpoint the first one asks
    for at the end of the step. The first is sent once step 0's sample is printed, after step 0 looked for a
    signal and wrote its checkpoint (sent at a step's line, on a loaded machine it landed before that, and that
    step stopped the run); the second once the first is answered, however long a step takes (two pending signals
    would be one)."""
    args = TINY_ARGS + ["--max_steps", "100000", "--total_batch_size", str(128 * 32), "--ckpt_every",
                        str(ckpt_every), "--sample_every", "1", "--num_samples", "1", "--max_new_tokens", "2",
                        "--log_dir", str(tmp_path)]
    process = start_training(["train_gpt2.py"] + args)
    wait_for_line(process, "sample 0: ")
    process.send_signal(signal.SIGINT)
    assert process.stderr.readline() == f"SIGINT: {ANSWERED}\n"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert "stopped by a signal" not in out and process.returncode == 130
    lost = (f"the steps after {tmp_path / 'ckpt_1.pt'} are lost; to go on from it, run the same command with "
            "--resume auto" if ckpt_every else "no checkpoint was written, its steps are lost")
    assert err == f"stopped at once by a second Ctrl-C: {lost}\n"
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == (["ckpt_1.pt", "ckpt_1.pt.sha256"] if ckpt_every
                                                              else [])


def test_a_second_ctrl_c_while_the_first_is_being_answered_stops_at_once(monkeypatch):
    """It was taken for a first one (the flag was set after the message's write): the message twice, and the run
    went on to a checkpoint and exit 0. Here the second SIGINT arrives inside that write, as it can under load."""
    written = []

    def write(fd, data):  # the second Ctrl-C lands while the first one's line is being written
        written.append(data.decode())
        if len(written) == 1:
            signal.raise_signal(signal.SIGINT)
        return len(data)
    with t.catching_stop_signals(True) as stop:
        monkeypatch.setattr(t.os, "write", write)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        monkeypatch.undo()
    assert stop["requested"] and written == [f"SIGINT: {ANSWERED}\n"]


def test_ctrl_c_in_another_run_mode_stops_it_at_once_with_one_line(tmp_path):
    """--generate has nothing to save: the first Ctrl-C ends it. 200,000 tokens of a tiny model take minutes; the
    signal comes once the script has built the model and said so, before it generates."""
    process = start_training(["train_gpt2.py", "--generate", "--device", "cpu", "--n_layer", "2", "--n_head", "2",
                              "--n_embd", "32", "--block_size", "64", "--seq_len", "64", "--num_samples", "1",
                              "--max_new_tokens", "200000", "--log_dir", str(tmp_path / "log")])
    untrained = "no --init_from: the samples come from untrained weights\n"
    seen = wait_for_line(process, untrained)
    still_running = process.poll() is None
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    out = "".join(seen) + out
    assert still_running and (process.returncode, out, err) == (130, untrained, "stopped by Ctrl-C\n"), err


def test_under_nohup_a_closed_session_does_not_stop_the_run(tmp_path):
    args = TINY_ARGS + ["--max_steps", "100000", "--ckpt_every", "0", "--log_dir", str(tmp_path)]
    process = start_training(["train_gpt2.py"] + args, ignored_signal=signal.SIGHUP)
    wait_for_line(process, "step     2/100000")
    process.send_signal(signal.SIGHUP)
    wait_for_line(process, "step    12/100000")  # still training, ten steps on
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    stopped_after = [int(line.split("after step ")[1].split(",")[0]) for line in out.splitlines()
                     if line.startswith("stopped by a signal")]
    assert len(stopped_after) == 1 and stopped_after[0] >= 12  # by the SIGTERM, not by the SIGHUP at step 2


def test_sigterm_to_torchrun_checkpoints_once_and_every_rank_exits_cleanly(tmp_path):
    args = TINY_ARGS + ["--max_steps", "100000", "--ckpt_every", "0", "--log_dir", str(tmp_path)]
    process = start_training(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              "train_gpt2.py"] + args)
    wait_for_line(process, "step     2/100000")
    process.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    out, err = process.communicate(timeout=60)
    assert out.count("stopped by a signal") == 1, out + err
    # what the README says the user sees: rank 0's line at once, then torchrun's own SignalException, exit 1
    assert err.count(f"SIGTERM: {ANSWERED}\n") == 1 and "SignalException" in err and process.returncode == 1, err
    assert len(list(tmp_path.glob("ckpt_*.pt"))) == 1
    assert "exitcode  : 1" not in err and "Traceback (most recent call last):\n  File \"" + str(ROOT) not in err


def test_sigterm_to_every_worker_checkpoints_once_and_every_rank_exits_0(tmp_path):
    """As a scheduler that signals each process of the job: torchrun exits 0 only if every worker did, none aborted
    as it exited (gloo's threads, PyTorch #179291: -6)."""
    args = TINY_ARGS + ["--max_steps", "100000", "--ckpt_every", "0", "--log_dir", str(tmp_path)]
    process = start_training(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              "train_gpt2.py"] + args)
    wait_for_line(process, "step     2/100000")
    workers = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()  # Linux
    for pid in workers:
        os.kill(int(pid), signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert (len(workers), process.returncode) == (2, 0), err
    assert out.count("stopped by a signal") == 1 and err.count(f"SIGTERM: {ANSWERED}\n") == 1, out + err
    assert len(list(tmp_path.glob("ckpt_*.pt"))) == 1


def not_a_checkpoint(tmp_path, kind):
    path = tmp_path / f"{kind}.pt"
    if kind == "dict":
        torch.save({"a": 1}, path)
    elif kind == "tensor":
        torch.save(torch.ones(3), path)
    elif kind == "text":
        path.write_text("notes, not weights\n")
    else:
        path.write_bytes(os.urandom(4096))
    holds = {"dict": "keys a", "tensor": "Tensor"}.get(kind)
    what = f"not a checkpoint of train_gpt2.py (it holds {holds})" if holds else \
        "not a checkpoint (not a file torch.save wrote)"
    return path, what


@pytest.mark.parametrize("kind", ["dict", "tensor", "text", "random bytes"])
@pytest.mark.parametrize("flags", [["--resume", "{path}"], ["--init_from", "{path}", "--generate"],
                                   ["--init_from", "{path}", "--export_hf", "{tmp}/hf"]])
def test_a_file_that_is_not_our_checkpoint_is_one_line_naming_what_it_is(tmp_path, capsys, recwarn, kind, flags):
    """They were KeyError: 'config', KeyError: 'model_config' or TypeError tracebacks, or, for a file torch.save did
    not write, mmap jargon and "resume from an older checkpoint". A bare tensor also printed PyTorch's warning about
    indexing it with "config" before the line."""
    path, what = not_a_checkpoint(tmp_path, kind)
    args = [arg.format(path=path, tmp=tmp_path) for arg in flags]
    with pytest.raises(SystemExit) as stopped:
        t.main(t.parse_args((EIGHT_STEPS if args[0] == "--resume" else ["--device", "cpu"]) + args
                            + ["--log_dir", str(tmp_path / "log")]))
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"error: {args[0]} {path} is {what}: give a ckpt_<step>.pt from a --log_dir\n"
    # (@record's fault handler finds no fileno for pytest's captured stderr, and says so)
    assert [str(w.message) for w in recwarn if "fault handler" not in str(w.message)] == []


def test_a_write_killed_part_way_leaves_no_temporary_file_behind(tmp_path):
    """kill -9 while saving leaves ckpt_N.pt.<host>-<pid>.tmp (1.5 GB at 124M): the next run's start removes it."""
    run(["--stop_after_steps", "2"], tmp_path)
    killed = tmp_path / "ckpt_4.pt.somehost-12345.tmp"
    killed.write_bytes(b"PK\x03\x04 the first megabytes of a checkpoint")
    run(["--resume", "auto", "--stop_after_steps", "2"], tmp_path)
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == ["ckpt_2.pt", "ckpt_2.pt.sha256", "ckpt_4.pt",
                                                             "ckpt_4.pt.sha256"]


def test_a_fresh_run_over_an_earlier_runs_checkpoints_is_refused(tmp_path, capsys):
    """It overwrote the metrics and left the checkpoints, which a later --resume auto then took for its own."""
    run(["--max_steps", "3", "--warmup_steps", "1"], tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(SystemExit) as stopped:
        run([], tmp_path)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"error: --log_dir {tmp_path} holds an earlier run's checkpoints (ckpt_3.pt): "
                                       "continue it with --resume auto, or pass another --log_dir\n")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_resuming_with_another_schedule_says_how_the_learning_rate_jumps(tmp_path, capsys):
    """Extending a finished run is allowed; its cosine restarts from a new length, which one warning line says."""
    run(["--max_steps", "4", "--warmup_steps", "1"], tmp_path)
    capsys.readouterr()
    result = run(["--max_steps", "8", "--warmup_steps", "1", "--resume", "auto"], tmp_path)
    old, new = t.parse_args(EIGHT_STEPS + ["--max_steps", "4", "--warmup_steps", "1"]), \
        t.parse_args(EIGHT_STEPS + ["--warmup_steps", "1"])
    assert (f"warning: the optimizer and schedule differ from the checkpoint's (--max_steps 4 -> 8): at step 4 the "
            f"learning rate goes on at {t.lr_at(4, new):.4e} instead of {t.lr_at(4, old):.4e}") in capsys.readouterr().out
    assert t.lr_at(4, old) == pytest.approx(3e-4)  # the minimum: the old run had ended
    assert [r["lr"] for r in result.run.records if "lr" in r][0] == t.lr_at(4, new) > 6 * t.lr_at(4, old)


def test_a_longer_schedule_whose_rate_stays_the_same_gives_no_warning(tmp_path, capsys):
    """A fine-tune at a constant rate (--min_lr_ratio 1) extended: it warned "goes on at 3.0000e-03 instead of
    3.0000e-03"."""
    constant = ["--warmup_steps", "1", "--min_lr_ratio", "1"]
    run(constant + ["--max_steps", "4"], tmp_path)
    capsys.readouterr()
    result = run(constant + ["--max_steps", "6", "--resume", "auto"], tmp_path)
    assert "warning" not in capsys.readouterr().out
    assert [r["lr"] for r in result.run.records if "lr" in r] == [3e-3, 3e-3]


def test_ckpt_every_0_writes_no_checkpoint(tmp_path):
    """The benchmark command: it used to write one at the end anyway (1.49 GB at 124M)."""
    run(["--max_steps", "3", "--warmup_steps", "1", "--ckpt_every", "0"], tmp_path)
    assert list(tmp_path.glob("ckpt_*")) == [] and (tmp_path / "metrics.jsonl").exists()


def test_resume_checks_a_model_field_a_hacker_adds_and_names_a_changed_flag_added_to_the_optimizer(
        tmp_path, monkeypatch, capsys):
    """The checks named seven shape fields and four schedule flags in lists: a field added to GPTConfig (say, the
    number of key/value heads) or a flag added under --help's optimizer section went unchecked."""
    import dataclasses

    def config_with(kv_heads):
        return dataclasses.make_dataclass("GPTConfig", [("n_kv_head", int, kv_heads)], bases=(t.GPTConfig,))

    # after every flag, the checkpoints' and the run modes': its section is its own, not its place's
    lr_floor = ("lr_floor", float, t.flag(0.0, "a hacker's flag: the lowest learning rate", "optimizer"))
    monkeypatch.setattr(t, "Config", dataclasses.make_dataclass("Config", [lr_floor], bases=(t.Config,)))
    monkeypatch.setattr(t, "GPTConfig", config_with(2))
    assert t.parse_args(["--lr_floor", "1e-5"]).lr_floor == 1e-5
    run(["--max_steps", "4", "--warmup_steps", "1"], tmp_path)
    assert t.read_checkpoint(str(tmp_path / "ckpt_4.pt"))["model_config"]["n_kv_head"] == 2
    capsys.readouterr()
    resumed = run(["--warmup_steps", "1", "--resume", "auto", "--weight_decay", "0", "--lr_floor", "1e-5",
                   "--dropout", "0.1"], tmp_path)  # dropout: this run's own
    old = t.parse_args(EIGHT_STEPS + ["--warmup_steps", "1", "--max_steps", "4"])
    assert (f"warning: the optimizer and schedule differ from the checkpoint's (--max_steps 4 -> 8, --weight_decay "
            f"0.1 -> 0.0, --lr_floor 0.0 -> 1e-05): at step 4 the learning rate goes on at "
            f"{resumed.run.records[0]['lr']:.4e} instead of {t.lr_at(4, old):.4e}") in capsys.readouterr().out
    monkeypatch.setattr(t, "GPTConfig", config_with(1))
    with pytest.raises(SystemExit) as stopped:
        run(["--max_steps", "12", "--resume", "auto"], tmp_path)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"error: cannot resume from {tmp_path / 'ckpt_8.pt'}: n_kv_head 2 -> 1 (they "
                                       "define its weights, schedule and data position): use its values\n")


def test_a_checkpoint_holds_its_code_and_going_on_with_other_code_says_how_far_apart(tmp_path, capsys):
    """A hacker who edits the file and runs --resume auto went on from a checkpoint of other code without a word."""
    run(["--stop_after_steps", "2"], tmp_path)
    path = tmp_path / "ckpt_2.pt"
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["source"] == (ROOT / "train_gpt2.py").read_text()
    checkpoint["source"] += "# a line the hacker added\n"  # the code that wrote it, other than this
    torch.save(checkpoint, path)
    Path(f"{path}.sha256").write_text(t.file_sha256(str(path)) + "\n")
    capsys.readouterr()
    run(["--resume", "auto"], tmp_path)
    out = capsys.readouterr().out
    assert f"; --resume {path} was written by a train_gpt2.py 1 line apart\n" in out  # not "1 lines"
    first_records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "run" in line[:8]]
    assert [r["run"]["resumed_at"] for r in first_records] == [None, 2]  # each start of the run is recorded


# ------------------------------ the data position counts tokens (issue 68)

def counting_shards(folder):
    """--data_dir flags for uint16 shards whose token at each position is that position: a batch's tokens say where
    it was read."""
    folder.mkdir(exist_ok=True)
    for split, size in (("train", 20_000), ("val", 300)):
        np.save(folder / f"count_{split}_000000.npy", np.arange(size, dtype=np.uint16))
    return TINY_ARGS[: TINY_ARGS.index("--text_file")] + ["--data_dir", str(folder)]


def record_batches(monkeypatch) -> list:
    """Every x (B, T) a DataLoader hands out from now on, in order."""
    batches, next_batch = [], t.DataLoader.next_batch

    def recorded(loader):
        x, y = next_batch(loader)
        batches.append(x)
        return x, y
    monkeypatch.setattr(t.DataLoader, "next_batch", recorded)
    return batches


def assert_read_in_order(batches):
    """Each row of counting_shards' tokens starts where the row before it ended: no token read twice, none skipped."""
    due = 0
    for i, x in enumerate(batches):
        for row in x.tolist():
            assert row[0] == due, f"batch {i} (of {len(x[0])} tokens a row) read token {row[0]} where {due} was due"
            due = row[-1] + 1


def test_a_resume_at_another_seq_len_reads_next_the_token_where_it_stopped(tmp_path, monkeypatch, capsys):
    """The data position was a count of windows: 16 windows of 32 read as windows of 64 skipped 512 tokens, with a
    normal "resumed" line."""
    args = counting_shards(tmp_path / "data") + ["--max_steps", "8", "--log_dir", str(tmp_path / "log")]
    batches = record_batches(monkeypatch)
    t.main(t.parse_args(args + ["--stop_after_steps", "2"]))
    capsys.readouterr()
    t.main(t.parse_args(args + ["--resume", "auto", "--seq_len", "64"]))
    out = capsys.readouterr().out.splitlines()  # the first line as the checkpoint is read, the second as train() resumes
    assert out.index("--seq_len 32 -> 64: the data goes on from its next unread token, 512 of epoch 0") < \
        out.index("resumed from step 2 (token 512 of epoch 0)")
    assert [x.shape[1] for x in batches] == [32] * 4 + [64] * 6  # 2 steps of 2 micro-steps, then 6 steps of 1
    assert_read_in_order(batches)


def test_a_resume_at_another_seq_len_with_shuffle_is_refused(tmp_path, capsys):
    """Shuffled, the order is drawn over windows of --seq_len: another length has another order."""
    run(["--shuffle", "--stop_after_steps", "2"], tmp_path)
    with pytest.raises(SystemExit):
        run(["--shuffle", "--resume", "auto", "--seq_len", "64"], tmp_path)
    assert capsys.readouterr().err == (f"error: cannot resume from {tmp_path / 'ckpt_2.pt'}: seq_len 32 -> 64 (they "
                                       "define its weights, schedule and data position): use its values\n")


def test_a_checkpoint_that_counted_windows_resumes_where_it_stopped(tmp_path, straight, one_thread):
    """Checkpoints written before the position was counted in tokens hold windows_consumed instead."""
    run(["--stop_after_steps", "4"], tmp_path)
    path = tmp_path / "ckpt_4.pt"
    checkpoint = torch.load(path, weights_only=True)
    position = checkpoint.pop("data_position")
    del checkpoint["data_epoch"], checkpoint["n_vocab"]
    torch.save({**checkpoint, "windows_consumed": position // 32}, path)  # as one was written
    Path(f"{path}.sha256").write_text(t.file_sha256(str(path)) + "\n")
    run(["--resume", "auto"], tmp_path)
    assert logged(tmp_path) == logged(straight)
