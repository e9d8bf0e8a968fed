"""DDP for real: torchrun starts 2 processes on the gloo backend, as a user would on a CPU machine."""

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train_gpt2 as t
from conftest import (checked_run, hash_routed_gpt, idle_experts, ROOT, SHAKESPEARE, TINY_ARGS, run_python,
                      single_thread)

ENTRY = "tests/ddp_entry.py"
# Thread count changes float results; torchrun sets 1 thread for several processes, so pin it everywhere.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def torchrun(nproc, args, timeout=240, env=None, max_file_bytes=None):
    return run_python(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] + args,
                      env={**ONE_THREAD, **(env or {})}, timeout=timeout, max_file_bytes=max_file_bytes)


def assert_every_rank_stopped_with_one_line(result, message):
    """The job (of 2 processes) failed; rank 0 said message, once; both ranks exited with our user-error status 2,
    none with 1 (a traceback), -6 (aborted as it exited: gloo's threads, PyTorch #179291) or -15 (torchrun's SIGTERM,
    which ends the others once a rank has exited non-zero, reaching one still exiting)."""
    assert result.returncode != 0
    assert result.stderr.splitlines().count(message) == 1, result.stderr
    assert re.findall(r"exitcode\s+: (-?\d+)", result.stderr) == ["2", "2"], result.stderr


def records(log_dir):
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def on_two_nodes(args, timeout=120, node_extra_args=([], [])):
    """The README's multi-node command with both machines on this host: a torchrun agent for node 0 and one for
    node 1, one process each (LOCAL_RANK 0 on both, RANK 0 and 1), meeting at node 0's address and port; node N's
    command ends with node_extra_args[N]. Returns each node's (exit status, stdout, stderr)."""
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}"] + args +
                              node_extra_args[node],
                              cwd=ROOT, env={**os.environ, **ONE_THREAD}, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [(node.returncode, *output) for node, output in zip(nodes, outputs, strict=True)]


def in_background(pool, *calls):
    """Each (function, *args) of calls started in pool's threads, for subprocesses that wait on each other: the
    machine's other core works while one launch starts up. Their futures, in order."""
    return [pool.submit(*call) for call in calls]


def test_two_processes_on_one_machine_or_two_train_exactly_like_one(tmp_path, one_thread):
    """2 ranks x 1 micro-step vs 1 process x 2 micro-steps, same total batch: the same tokens each step. The 2
    ranks run under one torchrun (--standalone), and under two as on two machines (--nnodes=2); the 1 process is
    this one (one thread, as OMP_NUM_THREADS=1 gives the ranks), training while they start."""
    flags = TINY_ARGS + ["--max_steps", "6", "--eval_every", "3", "--eval_steps", "2"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        two, nodes = in_background(
            pool, (torchrun, 2, [ENTRY, "leaving", "train", str(tmp_path / "two.pt")] + flags +
                   ["--log_dir", str(tmp_path / "two")]),
            (on_two_nodes, ["train_gpt2.py"] + flags + ["--log_dir", str(tmp_path / "nodes")]))
        one_params = t.main(t.parse_args(flags + ["--log_dir", str(tmp_path / "one")])).model.state_dict()
        two, nodes = two.result(), nodes.result()
    assert two.returncode == 0, two.stderr
    assert [status for status, _, _ in nodes] == [0, 0], [stderr for _, _, stderr in nodes]
    one_records = records(tmp_path / "one")
    for log_dir in ("two", "nodes"):
        for key in ("train_loss", "val_loss", "lr", "grad_norm"):
            expected = [r[key] for r in one_records if key in r]
            assert len(expected) >= 2 and [r[key] for r in records(tmp_path / log_dir) if key in r] == expected, \
                (log_dir, key)
    two_params = torch.load(tmp_path / "two.pt")
    for name, value in one_params.items():
        assert (value - two_params[name]).abs().max().item() <= 1e-6, name
    assert "2 processes" in two.stdout
    assert two.stdout.count("step     5/6 | loss") == 1  # rank 0 alone prints
    # torch.distributed.nn, imported after the group was made, held it in default arguments: gloo's threads ran on
    for rank in (0, 1):
        assert f"rank {rank} exits 0, leaving gloo threads []\n" in two.stdout, two.stdout
    assert nodes[0][1].count("step     5/6 | loss") == 1 and nodes[1][1] == ""  # rank 0 is on node 0


@pytest.mark.parametrize("node_1_flags, message", [
    (["--micro_batch_size", "2"], "error: the processes were started with different flags (--micro_batch_size 4 on "
                                  "rank 0 but 2 on rank 1): start every machine with the same command"),
    (["--max_stepz", "3"], "error: unrecognized arguments: --max_stepz 3: did you mean --max_steps? (see --help) "
                           "(on rank 1)"),
])
def test_a_mistake_made_on_another_machine_stops_both_with_one_line_from_rank_0(tmp_path, node_1_flags, message):
    """A command typed differently on node 1: every rank joins the process group, then the ranks compare their flags
    and problems in one gather. (--micro_batch_size 2 alone is a valid command: only the comparison catches it.)"""
    started = time.monotonic()
    flags = TINY_ARGS + ["--max_steps", "3", "--log_dir", str(tmp_path / "log")]
    nodes = on_two_nodes(["train_gpt2.py"] + flags, node_extra_args=[[], node_1_flags])
    assert time.monotonic() - started < 60
    assert [status for status, _, _ in nodes] == [1, 1]  # torchrun's own status for a failed worker
    (_, stdout_0, stderr_0), (_, stdout_1, stderr_1) = nodes
    assert stderr_0.splitlines().count(message) == 1, stderr_0
    assert "exitcode  : 2" in stderr_0 and "exitcode  : 2" in stderr_1  # every worker stopped on its own
    assert "error: " not in stderr_1 and "step " not in stdout_0 + stdout_1


def test_sync_on_the_last_micro_step_only_gives_the_same_gradients(tmp_path):
    result = torchrun(2, [ENTRY, "grad_sync", str(tmp_path / "grads.pt")])
    assert result.returncode == 0, result.stderr
    last_only, every_step = torch.load(tmp_path / "grads.pt")
    assert last_only.keys() == every_step.keys()
    for name in last_only:
        torch.testing.assert_close(last_only[name], every_step[name], rtol=1e-5, atol=1e-7, msg=name)


def test_batch_not_divisible_by_world_size_stops_every_rank_with_one_line(tmp_path):
    # 384 tokens a step = 3 sequences of 4 x 32: one process can accumulate them, two cannot split them
    flags = TINY_ARGS + ["--total_batch_size", "384", "--log_dir", str(tmp_path / "log")]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        [result] = in_background(pool, (torchrun, 2, ["train_gpt2.py"] + flags))
        # one process (this one, meanwhile) trains on it: 3 micro-steps a step
        one = t.main(t.parse_args(flags[:-1] + [str(tmp_path / "one"), "--max_steps", "2"]))
        result = result.result()
    assert [r["step"] for r in one.run.records if "train_loss" in r] == [0, 1]
    message = ("error: --total_batch_size 384 is not divisible by micro_batch_size x seq_len x processes "
               "= 4 x 32 x 2 = 256: use --micro_batch_size 3, the largest that divides it, or make --total_batch_size "
               "a multiple of it")
    # said once, by rank 0; both ranks exit with our user-error status. torchrun adds a traceback of its own
    assert_every_rank_stopped_with_one_line(result, message)
    assert 'train_gpt2.py", line' not in result.stderr  # no traceback from our code


def own_folders(tmp_path, ranks=2) -> list:
    """tmp_path/rank0, tmp_path/rank1: each rank's working folder under ddp_entry.py own_folders."""
    folders = [tmp_path / f"rank{rank}" for rank in range(ranks)]
    for folder in folders:
        folder.mkdir()
    return folders


def test_a_data_error_only_one_rank_sees_is_told_once_and_stops_every_rank(tmp_path):
    """Rank 1's copy of a shard is cut short, as by a copy that failed on its machine."""
    folders = own_folders(tmp_path)
    for folder in folders:
        (folder / "shards").mkdir()
        for split in ("train", "val"):
            np.save(folder / "shards" / f"x_{split}_000001.npy", np.arange(2000, dtype=np.uint16))
    cut = folders[1] / "shards" / "x_train_000001.npy"
    cut.write_bytes(cut.read_bytes()[:1000])
    flags = TINY_ARGS[: TINY_ARGS.index("--text_file")] + ["--data_dir", "shards", "--log_dir", str(tmp_path / "log")]
    result = torchrun(2, [ENTRY, "own_folders", str(tmp_path)] + flags)
    # rank 1 alone failed, yet rank 0 prints its message, once, and both ranks exit with status 2
    assert_every_rank_stopped_with_one_line(
        result, "error: cannot read shard shards/x_train_000001.npy: it is not a .npy file (empty, cut short or "
                "another format): delete it and rerun fineweb.py (on rank 1)")
    assert "exitcode  : 2" in result.stderr and "step " not in result.stdout


def test_a_token_beyond_the_vocabulary_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    """Rank 1 alone reads the bad token (windows 4-7, tokens 128-256, at step 0); the ranks stop together at the end
    of the step, rank 0 telling it."""
    from test_data import shards_with_a_token_beyond_the_vocabulary

    shards_with_a_token_beyond_the_vocabulary(tmp_path, 200)
    flags = TINY_ARGS[: TINY_ARGS.index("--text_file")] + ["--data_dir", str(tmp_path), "--no-shuffle"]
    result = torchrun(2, ["train_gpt2.py"] + flags + ["--log_dir", str(tmp_path / "log")])
    assert_every_rank_stopped_with_one_line(
        result, f"error: {tmp_path / 'bad_train_000002.npy'} holds token id 60000, beyond the 50257 tokens of gpt2 (made "
                "with another tokenizer?): remake the shards with fineweb.py (on rank 1)")
    assert "exitcode  : 2" in result.stderr.split("Root Cause")[1] and "IndexError" not in result.stderr


def test_ranks_that_read_different_data_are_refused_with_one_line(tmp_path):
    """Each machine has its own input.txt; rank 1's lacks the last lines."""
    text, folders = SHAKESPEARE.read_text(), own_folders(tmp_path)
    for folder, copy in zip(folders, [text, text[:-4000]], strict=True):
        (folder / "input.txt").write_text(copy)
    flags = TINY_ARGS[: TINY_ARGS.index("--text_file")] + ["--text_file", "input.txt", "--eval_every", "5"]
    result = torchrun(2, [ENTRY, "own_folders", str(tmp_path)] + flags + ["--log_dir", str(tmp_path / "log")])
    tokens = [len(t.tokenizer().encode_ordinary((folder / "input.txt").read_text())) for folder in folders]
    found = [(n * 9 // 10, n - n * 9 // 10, None) for n in tokens]
    assert found[0] != found[1]
    assert_every_rank_stopped_with_one_line(result, "error: the ranks found different data or checkpoints ((train "
                                                    f"tokens, val tokens, checkpoint step) on each: {found}): give "
                                                    "every machine the same shards and a shared --log_dir")
    assert "step " not in result.stdout


def test_ranks_that_find_different_checkpoints_are_refused_with_one_line(tmp_path):
    """--resume auto where each machine has its own --log_dir: only rank 0's holds a checkpoint."""
    folders = own_folders(tmp_path)
    flags = TINY_ARGS + ["--max_steps", "4", "--log_dir", "log"]
    t.main(t.parse_args(flags[:-1] + [str(folders[0] / "log"), "--stop_after_steps", "2"]))  # here: rank 0's
    assert sorted(p.name for p in (folders[0] / "log").glob("ckpt_*.pt")) == ["ckpt_2.pt"]
    result = torchrun(2, [ENTRY, "own_folders", str(tmp_path)] + flags + ["--resume", "auto"])
    assert_every_rank_stopped_with_one_line(result, "error: the ranks found different data or checkpoints ((train "
                                                    "tokens, val tokens, checkpoint step) on each: [(304222, 33803, 2), "
                                                    "(304222, 33803, None)]): give every machine the same shards and a "
                                                    "shared --log_dir")
    assert "step " not in result.stdout


def test_a_rank_that_raises_mid_training_ends_every_rank(tmp_path):
    started = time.monotonic()
    flags = TINY_ARGS + ["--max_steps", "100000", "--log_dir", str(tmp_path / "log")]
    result = torchrun(2, [ENTRY, "fail", "1", "3"] + flags, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "injected failure on rank 1 at step 3" in result.stderr  # @record shows the root cause
    assert elapsed < 60, elapsed
    # rank 1 fails after step 3's collectives, so rank 0 may log step 3, but it never completes step 4
    assert "step     4/100000" not in result.stdout


@pytest.fixture(scope="module")
def accumulating_runs(tmp_path_factory):
    """2 micro-steps a rank: 2 ranks under torchrun with --compile, and 2 with --recompute, started together; and
    their reference, one plain eager process (this one, with one thread) with 4 micro-steps, training meanwhile.
    {"one", "compiled", "recomputed"}: (the launch's result, or None for this process; its log_dir)."""
    folder = tmp_path_factory.mktemp("accumulating")
    flags = TINY_ARGS + ["--max_steps", "3", "--total_batch_size", "512"]  # 2 micro-steps a rank
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        compiled, recomputed = in_background(
            pool, (torchrun, 2, ["train_gpt2.py"] + flags + ["--compile", "--log_dir", str(folder / "compiled")]),
            (torchrun, 2, ["train_gpt2.py"] + flags + ["--recompute", "--log_dir", str(folder / "recomputed")]))
        with single_thread():
            t.main(t.parse_args(flags + ["--log_dir", str(folder / "one")]))
        return {"one": (None, folder / "one"), "compiled": (compiled.result(), folder / "compiled"),
                "recomputed": (recomputed.result(), folder / "recomputed")}


def test_compiled_ddp_with_accumulation_trains_like_one_eager_process(accumulating_runs):
    """torch.compile under DDP, the multi-GPU default: dynamo splits the graph at DDP's gradient buckets, and
    no_sync skips all but the last micro-step's all-reduce. On CPU with gloo the same code paths run."""
    (_, one), (two, compiled) = accumulating_runs["one"], accumulating_runs["compiled"]
    assert two.returncode == 0, two.stderr
    assert "compile on), 2 processes" in two.stdout
    eager = [r["train_loss"] for r in records(one) if "train_loss" in r]
    compiled = [r["train_loss"] for r in records(compiled) if "train_loss" in r]
    assert len(eager) == 3 and max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-4


def test_recompute_under_ddp_trains_like_one_plain_process(accumulating_runs):
    """--recompute runs each block again inside backward, while DDP's hooks reduce the gradients as they come.
    Within float32 rounding: a rank's 2 micro-steps are averaged before the ranks are, one process averages 4."""
    (_, one), (two, recomputed) = accumulating_runs["one"], accumulating_runs["recomputed"]
    assert two.returncode == 0, two.stderr
    for key in ("train_loss", "grad_norm"):
        expected = [r[key] for r in records(one) if key in r]
        got = [r[key] for r in records(recomputed) if key in r]
        assert len(expected) == 3 and max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-5, key


def test_a_loss_that_turns_nan_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    """Rank 1 alone sees a NaN loss at step 3; the averaged loss and gradients carry it to rank 0, so both ranks
    stop at the same step, and the NaN weights are never checkpointed."""
    started = time.monotonic()
    log_dir = tmp_path / "log"
    flags = TINY_ARGS + ["--ckpt_every", "1", "--keep_ckpts", "0", "--log_dir", str(log_dir)]
    result = torchrun(2, [ENTRY, "leaving", "nan_loss", "1", "3"] + flags, timeout=120)
    assert time.monotonic() - started < 60
    # both ranks leave the group: its RunError's traceback held DDP, and DDP the group, whose gloo threads then ran on
    # into Python's exit
    assert [f"rank {rank} exits 2, leaving gloo threads []" in result.stdout for rank in (0, 1)] == [True, True], \
        result.stdout
    assert_every_rank_stopped_with_one_line(
        result, f"error: training diverged at step 3: loss nan, gradient norm nan; nothing was saved from this step: "
                f"go on from {log_dir}/ckpt_3.pt (--resume {log_dir}/ckpt_3.pt), or an older checkpoint if the loss "
                "was rising there already, with a lower --max_lr or more --warmup_steps")
    assert "exitcode  : 2" in result.stderr.split("Root Cause")[1]
    assert sorted(p.name for p in log_dir.glob("ckpt_*.pt")) == ["ckpt_1.pt", "ckpt_2.pt", "ckpt_3.pt"]
    assert "step     3/20 | loss nan" in result.stdout and "step     4/20" not in result.stdout


def test_a_parameter_with_no_gradient_under_ddp_is_one_line_on_every_rank(tmp_path):
    """After t.NO_GRADIENT_STEPS steps, of 20: the ranks gather which parameters each gave a gradient."""
    result = torchrun(2, [ENTRY, "idle_parameter"] + TINY_ARGS + ["--log_dir", str(tmp_path / "log")], timeout=120)
    assert_every_rank_stopped_with_one_line(
        result, "error: transformer.h.0.attn.value_gain got no gradient in this run's first 10 steps: use it in "
                "forward, or set its requires_grad to False")
    assert "step     9/20 | loss" in result.stdout and "step    10/20" not in result.stdout
    assert "exitcode  : 2" in result.stderr.split("Root Cause")[1]


def test_an_expert_that_some_batches_skip_trains_under_torchrun_as_in_one_process(tmp_path, one_thread, monkeypatch):
    """Each block's MLP a mixture of 8 experts, each token routed to one (conftest.hash_routed_gpt): an expert that no
    token of a rank's batch picks gets no gradient there. 2 ranks x 1 micro-step of 16 tokens vs 1 process x 2, the
    same tokens (bitwise equal: RELIABILITY.md). DDP waited for the idle expert's gradient: rank 0 stopped alone at
    step 0 (a first-step check of one rank's gradients), rank 1 in gloo's traceback; without that check the ranks'
    all-reduces crossed (gloo aborted here; issue 69's MoE logged a wrong gradient norm, then died in DDP's
    "Expected to have finished reduction in the prior iteration")."""
    steps, flags = 8, TINY_ARGS + ["--seq_len", "16", "--micro_batch_size", "1", "--total_batch_size", "32"]
    flags += ["--max_steps", str(steps), "--ckpt_every", str(steps)]
    train_tokens = checked_run(text_file=str(SHAKESPEARE)).token_streams()[0]
    loaders = [t.DataLoader(train_tokens, 1, 16, rank, 2) for rank in (0, 1)]
    idle = [[idle_experts(loader.next_batch()[0]) for loader in loaders] for _ in range(steps)]  # each step's, a rank
    assert idle[0] == [{7}, set()]  # expert 7 idle on rank 0 at step 0, used on rank 1
    assert idle[4] == [{4, 7}, {0, 4}]  # and expert 4 on both at step 4: its gradient is None, AdamW skips it
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        [two] = in_background(pool, (torchrun, 2, [ENTRY, "hash_routed", str(tmp_path / "two.pt")] + flags +
                                     ["--log_dir", str(tmp_path / "two")]))
        monkeypatch.setattr(t, "GPT", hash_routed_gpt())
        one = t.main(t.parse_args(flags + ["--log_dir", str(tmp_path / "one")])).model.state_dict()
        two = two.result()
    assert two.returncode == 0, two.stderr
    for key in ("train_loss", "grad_norm"):
        expected = [r[key] for r in records(tmp_path / "one") if key in r]
        assert len(expected) == steps and [r[key] for r in records(tmp_path / "two") if key in r] == expected, key
    two_params = torch.load(tmp_path / "two.pt")
    assert all(torch.equal(value, two_params[name]) for name, value in one.items())


def test_a_rank_that_runs_out_of_memory_says_so_in_one_line_and_ends_every_rank(tmp_path):
    """Rank 1 of 3 runs out at step 3; ranks 0 and 2, left waiting inside a collective, are ended too."""
    started = time.monotonic()
    flags = TINY_ARGS + ["--max_steps", "100000", "--total_batch_size", "384", "--log_dir", str(tmp_path / "log")]
    result = torchrun(3, [ENTRY, "oom", "1", "3"] + flags, timeout=120)
    assert time.monotonic() - started < 60
    assert result.returncode != 0
    # 384 tokens a step on 3 ranks is 4 sequences of 32 a rank: 2 is the next micro batch that divides it
    message = ("error: out of memory on cpu at micro batch 4 x 32: lower --micro_batch_size to 2 (a step stays "
               "384 tokens, in more micro-steps), or add --loss_chunk_size 8192")
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")] == [message], result.stderr
    assert "step     4/100000" not in result.stdout
