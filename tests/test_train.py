import contextlib
import dataclasses
import importlib.metadata
import json
import math
import platform

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_gpt2 as t
from conftest import checked_run, hash_routed_gpt, idle_experts, SHAKESPEARE, TINY_ARGS


def run(args, tmp_path, name="log"):
    return t.main(t.parse_args(TINY_ARGS + ["--log_dir", str(tmp_path / name)] + args))


def train_losses(result):
    return [r["train_loss"] for r in result.run.records if "train_loss" in r]


def test_twenty_steps_on_tiny_shakespeare_lower_the_loss(tmp_path):
    losses = train_losses(run([], tmp_path))
    assert len(losses) == 20
    assert abs(losses[0] - 10.83) < 0.1  # about ln(50257): uniform over the real vocabulary
    assert losses[19] < losses[0] - 0.75, losses


def test_same_seed_gives_identical_losses_and_another_seed_does_not(one_thread, tmp_path):
    first = train_losses(run(["--max_steps", "5"], tmp_path, "a"))
    second = train_losses(run(["--max_steps", "5"], tmp_path, "b"))
    other_seed = train_losses(run(["--max_steps", "5", "--seed", "7"], tmp_path, "c"))
    assert first == second
    assert other_seed[0] != first[0]


def test_metrics_file_holds_every_record_and_a_summary(tmp_path):
    result = run(["--max_steps", "6", "--eval_every", "3", "--eval_steps", "2"], tmp_path)
    lines = (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()
    first, *rest = [json.loads(line) for line in lines]
    assert rest == result.run.records
    # first, what the run is (issue 62): every flag, the versions, the device, the code's sha256
    assert first["run"] == {"flags": first["run"]["flags"], "resumed_at": None, "torch": torch.__version__,
                            "numpy": np.__version__, "tiktoken": importlib.metadata.version("tiktoken"), "device": "cpu",
                            "device_name": platform.processor(), "world_size": 1,
                            "train_gpt2_sha256": t.file_sha256(t.__file__)}
    assert first["run"]["flags"] == dataclasses.asdict(dataclasses.replace(  # as the machine and the run picked them
        t.parse_args(TINY_ARGS + ["--max_steps", "6", "--eval_every", "3", "--eval_steps", "2", "--log_dir",
                                  str(tmp_path / "log")]), dtype="float32", compile=False, vocab_size=50304,
        hellaswag_path=t.HELLASWAG_CACHE))
    assert [r["step"] for r in result.run.records if "val_loss" in r] == [-1, 2, 5]  # -1: before training
    train_records = [r for r in result.run.records if "train_loss" in r]
    assert [r["step"] for r in train_records] == [0, 1, 2, 3, 4, 5]
    assert [r["lr"] for r in train_records] == [t.lr_at(s, t.parse_args(TINY_ARGS + ["--max_steps", "6"]))
                                                for s in range(6)]
    summary = result.run.records[-1]["summary"]
    assert summary["timed_steps"] == 3  # the first 3 steps are left out of the median
    assert summary["median_tokens_per_s"] == pytest.approx(256 * 1000 / summary["median_ms"])
    assert "mfu" not in summary  # MFU is reported on CUDA only


def test_a_finished_run_ends_naming_its_last_checkpoint(tmp_path, capsys):
    """The quick start's log/ckpt_50.pt was named in the README alone (issue 56). Without checkpoints: no line."""
    run(["--max_steps", "3"], tmp_path)
    assert capsys.readouterr().out.splitlines()[-1] == f"last checkpoint: {tmp_path / 'log' / 'ckpt_3.pt'}"
    run(["--max_steps", "3", "--ckpt_every", "0"], tmp_path, "none")
    assert capsys.readouterr().out.splitlines()[-1].startswith("summary: ")


def test_a_new_run_starts_a_fresh_metrics_file(tmp_path):
    run(["--max_steps", "3", "--ckpt_every", "0"], tmp_path)  # with checkpoints, it would be refused
    run(["--max_steps", "2"], tmp_path)
    lines = (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line).get("step") for line in lines] == [None, 0, 1, None]  # the run, 2 steps, the summary
    assert "run" in json.loads(lines[0])


def test_no_validation_data_needed_without_evaluation(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("To be, or not to be, that is the question. " * 40)  # 10% of it is too short to validate on
    args = ["--max_steps", "2", "--text_file", str(text)]
    assert len(train_losses(run(args, tmp_path))) == 2
    with pytest.raises(SystemExit) as stopped:
        run(args + ["--eval_every", "1"], tmp_path)
    assert stopped.value.code == 2


def test_epoch_rollover_is_logged_and_training_goes_on(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("To be, or not to be, that is the question. " * 40)
    train_tokens = len(t.tokenizer().encode_ordinary(text.read_text())) * 9 // 10
    windows = (train_tokens - 1) // 32
    assert windows == 14  # 8 windows a step: epoch 1 begins during step 1, epoch 2 during step 3
    result = run(["--max_steps", "5", "--text_file", str(text)], tmp_path)
    assert [(r["step"], r["epoch"]) for r in result.run.records if "epoch" in r] == [(1, 1), (3, 2)]
    assert len(train_losses(result)) == 5
    assert "step     1/5 | epoch 1 begins: all 14 training windows were used, starting again" in capsys.readouterr().out


def test_val_loss_is_the_mean_over_the_first_eval_batches(tmp_path):
    result = run(["--max_steps", "3", "--eval_every", "3", "--eval_steps", "2"], tmp_path)
    logged = [r["val_loss"] for r in result.run.records if "val_loss" in r]
    cfg = t.parse_args(TINY_ARGS)
    _, val = t.CheckedRun(cfg).token_streams()
    # 2 steps of 256 tokens: windows 0-3 of 4 x 32 tokens each, from the first validation token
    windows = [torch.from_numpy(val.read(i * 128, 129)) for i in range(4)]
    with torch.no_grad():
        expected = sum(result.model(w[:-1].view(4, 32), w[1:].view(4, 32)) for w in windows) / 4
    assert logged[1:] == [pytest.approx(expected.item(), rel=1e-6)]  # logged[0]: before step 0


def test_samples_are_seeded(one_thread, tmp_path, capsys):
    args = ["--max_steps", "2", "--sample_every", "2", "--num_samples", "2", "--max_new_tokens", "8"]
    run(args, tmp_path, "a")
    first = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sample")]
    run(args, tmp_path, "b")
    second = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sample")]
    assert len(first) == 2 and first[0].startswith("sample 0: Hello, I'm a language model,")
    assert first == second


class PaddedVocabModel(torch.nn.Module):
    """Logits that favour the padding rows (id >= 50257) and then token 7."""

    config = t.GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=50304)

    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(8, 8, bias=False)  # generate() takes the device from its weight

    def hidden_states(self, idx, caches=None, positions=None):
        assert idx.shape[1] <= 4, "the context must be cropped to block_size"
        return torch.zeros(*idx.shape, 8)

    def logits(self, hidden):
        logits = torch.zeros(*hidden.shape[:-1], 50304)
        logits[..., 50257:] = 100.0
        logits[..., 7] = 50.0
        return logits


@pytest.mark.parametrize("next_token", [lambda: t.sample_next, lambda: t.CachedNextToken([t.KVCache(4)])],
                         ids=["the recipe's", "cached"])
def test_generate_never_samples_padding_rows_and_crops_to_block_size(next_token):
    tokens = t.generate(PaddedVocabModel(), [1, 2, 3, 4, 5], max_new_tokens=3, num_samples=2, temperature=1.0,
                        top_k=1, seed=0, autocast=contextlib.nullcontext, next_token=next_token())
    assert tokens == [[7, 7, 7], [7, 7, 7]]


class ContextRecordingModel(PaddedVocabModel):
    def hidden_states(self, idx, caches=None, positions=None):
        self.contexts = getattr(self, "contexts", []) + [idx[0].tolist()]
        return super().hidden_states(idx)


def test_an_empty_prompt_samples_from_end_of_text_as_gpt2_does():
    model = ContextRecordingModel()
    tokens = t.generate(model, [], max_new_tokens=2, num_samples=2, temperature=1.0, top_k=1, seed=0,
                        autocast=contextlib.nullcontext)
    assert tokens == [[7, 7], [7, 7]]  # the new tokens only, not the <|endoftext|> they follow
    assert model.contexts == [[50256], [50256, 7]]


@pytest.fixture(scope="module")
def float32_losses(tmp_path_factory):
    """The float32 run both reduced-precision cases are held to, run once."""
    return train_losses(run(["--max_steps", "3"], tmp_path_factory.mktemp("float32"), "fp32"))


@pytest.mark.parametrize("dtype, tolerance", [("bfloat16", 0.02), ("float16", 0.01)])
def test_reduced_precision_paths_track_float32(float32_losses, tmp_path, dtype, tolerance):
    """bf16 autocast and fp16 with a GradScaler are the GPU defaults; CPU autocast runs the same code. 3 steps of 2
    micro-steps (fp16 matmuls are slow on a CPU: 5 steps made this the slowest test of the file)."""
    reference = float32_losses
    reduced = train_losses(run(["--max_steps", "3", "--dtype", dtype], tmp_path, dtype))
    assert reduced != reference  # autocast really ran
    assert max(abs(a - b) for a, b in zip(reduced, reference, strict=True)) < tolerance


# compile's own fused loss, or chunks; with the blocks recomputed in backward; with Muon
@pytest.mark.parametrize("flags", [[], ["--loss_chunk_size", "48"], ["--recompute"], ["--optimizer", "muon"]])
def test_compiled_model_trains_like_the_eager_one(tmp_path, flags):
    """torch.compile is the CUDA default; inductor also compiles for CPU, so a GPU run finds no surprise."""
    eager = train_losses(run(["--max_steps", "3"] + flags, tmp_path, "eager"))
    compiled = train_losses(run(["--max_steps", "3", "--compile"] + flags, tmp_path, "compiled"))
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-4


def test_cuda_summary_has_mfu_and_both_memory_peaks(monkeypatch, tmp_path, capsys):
    """The CUDA branch of the summary, with the CUDA memory counters stubbed: 124M's figures at 1,100 ms a step."""
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 25 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 27.5 * 2**30)
    log = t.CheckedRun(t.parse_args(["--peak_tflops", "989", "--device", "cpu", "--log_dir", str(tmp_path)]))
    log.open_log(None)
    log.card = "NVIDIA H100 80GB HBM3"  # the CUDA branch, at the H100's peak above
    # what start() and log_step() would have kept: the steps' times, the FLOPs of a step
    log.step_ms, log.flops_per_step = [5000.0, 3000.0, 2000.0, 1100.0, 1000.0, 1200.0], 860e6 * 524_288
    log.summary()
    assert log.records == [{"summary": {"timed_steps": 3, "median_ms": 1100.0, "median_tokens_per_s": 524_288 / 1.1,
                                        "peak_memory_gib": 25.0, "peak_reserved_gib": 27.5,
                                        "mfu": pytest.approx(860e6 * 524_288 / 1.1 / 989e12)}}]
    assert capsys.readouterr().out == (
        "summary: median 1100.0 ms/step, 476,625 tokens/s over the last 3 steps; peak memory 25.00 GiB "
        "(27.50 GiB reserved); MFU 41.4% of 989 TFLOP/s\n")


def test_mfu_counts_the_peak_of_every_device_of_the_step():
    """A step of 8 processes does 8 times the FLOPs on 8 GPUs: the same MFU as one GPU doing one share in the same
    time (before, the step's FLOPs were set against one GPU's peak: 331% on 8 H100s)."""
    one_share = 860e6 * 524_288
    assert t.model_flops_utilization(one_share, 1100.0, 989, world_size=1) == pytest.approx(0.414457, abs=1e-6)
    assert t.model_flops_utilization(8 * one_share, 1100.0, 989, world_size=8) == pytest.approx(0.414457, abs=1e-6)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_diverging_run_stops_with_one_line_and_saves_nothing_from_that_step(tmp_path, capsys, optimizer):
    # with a learning rate of 1e8 the first update blows the weights up: step 1's loss is NaN
    log_dir = tmp_path / "log"
    with pytest.raises(SystemExit) as stopped:
        run(["--max_lr", "1e8", "--warmup_steps", "0", "--ckpt_every", "1", "--keep_ckpts", "0", "--optimizer",
             optimizer], tmp_path)
    assert stopped.value.code == 2
    checkpoint = log_dir / "ckpt_1.pt"
    assert capsys.readouterr().err == (
        f"error: training diverged at step 1: loss nan, gradient norm nan; nothing was saved from this step: "
        f"go on from {checkpoint} (--resume {checkpoint}), or an older checkpoint if the loss was rising there "
        "already, with a lower --max_lr or more --warmup_steps\n")
    assert sorted(p.name for p in log_dir.glob("ckpt_*.pt")) == ["ckpt_1.pt"]  # none of the NaN weights
    saved = torch.load(checkpoint)["model"]
    assert all(torch.isfinite(tensor).all() for tensor in saved.values())
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in records] == [None, 0, 1] and math.isnan(records[2]["train_loss"])  # no summary


def test_a_diverged_step_with_no_checkpoint_says_start_again_and_the_recipe_alone_trains_on(tmp_path):
    # a finite loss with an infinite norm: clipping has zeroed (or NaN-ed) the gradients of this step
    with pytest.raises(t.RunError) as stopped:
        t.CheckedRun(t.parse_args(TINY_ARGS + ["--log_dir", str(tmp_path)])).diverged(7, 3.6e9, float("inf"))
    assert str(stopped.value) == ("training diverged at step 7: loss 3.6e+09, gradient norm inf; nothing was saved "
                                  "from this step: start again with a lower --max_lr or more --warmup_steps")
    # the stop is the machinery's (CheckedRun.check_step): the recipe's Run logs every step, NaN or not
    cfg = t.parse_args(TINY_ARGS + ["--max_steps", "3", "--max_lr", "1e8", "--warmup_steps", "0", "--ckpt_every", "0",
                                    "--log_dir", str(tmp_path / "recipe")])
    losses = train_losses(t.train(cfg))
    assert len(losses) == 3 and math.isfinite(losses[0]) and all(math.isnan(loss) for loss in losses[1:])
    assert not hasattr(t.Run, "diverged")


class HostWaits(TorchDispatchMode):
    """Records the operators that make the host wait for a CUDA device: reading a value back (.item(), bool(),
    int(), float() all run _local_scalar_dense) and nonzero (the size of its output depends on the data). They
    dispatch the same on the CPU, where they can be counted without a GPU."""

    WAITING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self):
        super().__init__()
        self.waits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.WAITING:
            self.waits.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_host_waits_for_the_device_in_no_micro_step(tmp_path, monkeypatch):
    """"One host sync a step" (Performance): inside the micro-step loop nothing reads a value back, so on a GPU the
    host prepares the next batch and queues its kernels while the last ones run; the loss and gradient norm are
    read once, after the optimizer step. Checked with the chunked loss (the default without compile) and the
    plain one, a step of 2 micro-steps each."""
    with HostWaits() as counter:  # the counter itself sees what it should
        (torch.ones(3) > 0).nonzero()
        torch.ones(3).sum().item()
    assert counter.waits == ["nonzero.default", "_local_scalar_dense.default"]
    # the micro-steps are inline in train(): counted from the step's first batch to all_reduce_mean, which train()
    # calls once a step, right after them
    waits, counting, next_batch, all_reduce_mean = [], [], t.DataLoader.next_batch, t.all_reduce_mean

    def first_batch_starts_counting(self):
        if not counting:
            counting.append(HostWaits())
            counting[0].__enter__()
        return next_batch(self)

    def micro_steps_done(value, launch):
        counter = counting.pop()
        counter.__exit__(None, None, None)
        waits.append(counter.waits)
        return all_reduce_mean(value, launch)

    monkeypatch.setattr(t.DataLoader, "next_batch", first_batch_starts_counting)
    monkeypatch.setattr(t, "all_reduce_mean", micro_steps_done)
    for loss_chunk_size in ("48", "0"):
        run(["--max_steps", "1", "--warmup_steps", "1", "--loss_chunk_size", loss_chunk_size], tmp_path,
            loss_chunk_size)
    assert waits == [[], []]


def raise_out_of_memory(*args, **kwargs):
    """What CUDA's caching allocator raises: c10::OutOfMemoryError, which PyTorch's Python bindings raise as
    torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class). A CPU cannot make it: there an
    allocation that fails is a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.28 GiB.")


@pytest.mark.parametrize("flags, fix", [
    ([], "at micro batch 4 x 32: lower --micro_batch_size to 2 (a step stays 256 tokens, in more micro-steps), or "
         "add --loss_chunk_size 8192"),
    (["--loss_chunk_size", "64"], "at micro batch 4 x 32: lower --micro_batch_size to 2 (a step stays 256 tokens, in "
                                  "more micro-steps)"),
    (["--micro_batch_size", "1"], "at micro batch 1 x 32: add --loss_chunk_size 8192 or --recompute, lower --seq_len "
                                  "or pick a smaller --model"),
    (["--micro_batch_size", "1", "--recompute"], "at micro batch 1 x 32: add --loss_chunk_size 8192, lower --seq_len "
                                                 "or pick a smaller --model"),
    (["--micro_batch_size", "1", "--recompute", "--loss_chunk_size", "64"], "at micro batch 1 x 32: lower --seq_len "
                                                                             "or pick a smaller --model"),
    (["--generate"], "while generating: lower --num_samples"),
])
def test_running_out_of_device_memory_is_one_line_naming_the_flag_to_lower(tmp_path, capsys, monkeypatch, flags,
                                                                             fix):
    monkeypatch.setattr(t.GPT, "hidden_states", raise_out_of_memory)
    with pytest.raises(SystemExit) as stopped:
        run(flags, tmp_path)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"error: out of memory on cpu {fix}\n"


def test_the_out_of_memory_line_names_the_largest_micro_batch_that_divides_a_step():
    # each of 8 GPUs takes 96 sequences a step: the largest micro batch under 48 that divides 96 is 32, not 24
    cfg = t.parse_args(["--micro_batch_size", "48", "--total_batch_size", str(48 * 1024 * 8 * 2)])
    assert t.out_of_memory_message(cfg, "cuda:3", world_size=8) == (
        "out of memory on cuda:3 at micro batch 48 x 1024: lower --micro_batch_size to 32 (a step stays 786,432 "
        "tokens, in more micro-steps), or add --loss_chunk_size 8192")
    cfg = t.parse_args(["--model", "gpt2-xl", "--micro_batch_size", "1", "--total_batch_size", str(1024 * 8)])
    assert t.out_of_memory_message(cfg, "cuda:3", world_size=8) == (
        "out of memory on cuda:3 at micro batch 1 x 1024: add --loss_chunk_size 8192 or --recompute, lower --seq_len "
        "or pick a smaller --model")


def test_a_log_dir_that_cannot_be_made_is_one_line(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    for log_dir, problem in [(a_file, "it is a file"), (a_file / "log", "Not a directory")]:
        with pytest.raises(SystemExit) as stopped:
            t.main(t.parse_args(TINY_ARGS + ["--log_dir", str(log_dir)]))
        assert stopped.value.code == 2
        assert capsys.readouterr().err == (f"error: cannot make --log_dir {log_dir} ({problem}): give a folder you can "
                                           "write to\n")


def broken(*args, **kwargs):
    raise RuntimeError("a broken edit")


@pytest.mark.parametrize("path, flags, breaks", [
    ("validation", ["--eval_every", "10"], ("GPT", "cross_entropy")),  # the loss in eval mode
    ("HellaSwag", ["--hellaswag_every", "10"], ("GPT", "logits")),  # training never calls logits without a loss
    ("the cached one-token step", ["--sample_every", "10"], ("KVCache", "update")),
])
def test_a_broken_edit_on_a_later_path_stops_a_fresh_run_before_step_0(tmp_path, monkeypatch, capsys, path, flags,
                                                                        breaks):
    """Each path a run takes later (validation, HellaSwag, sampling with its cache) runs once before step 0, in the
    run's dtype: an edit that breaks one fails in seconds, with its traceback, not at step 9 or hours in."""
    from test_evaluation import write_hellaswag

    flags += ["--hellaswag_path", str(write_hellaswag(tmp_path / "hs.jsonl", 3))]
    method = getattr(getattr(t, breaks[0]), breaks[1])
    if breaks == ("GPT", "cross_entropy"):  # broken in evaluation only: training's own losses still work
        monkeypatch.setattr(t.GPT, "cross_entropy", lambda self, *a: broken() if not self.training else method(self, *a))
    elif breaks == ("GPT", "logits"):
        monkeypatch.setattr(t.GPT, "logits", lambda self, x: broken() if x.dim() == 2 else method(self, x))
    else:
        monkeypatch.setattr(t.KVCache, "update", broken)
    with pytest.raises(RuntimeError) as raised:
        run(flags + ["--dtype", "bfloat16"], tmp_path)
    assert "a broken edit" in str(raised.value.__cause__ or raised.value)  # a cached path's: said, then named
    out = capsys.readouterr().out
    assert out.startswith("device cpu (bfloat16, compile off)") and " | loss " not in out, (path, out)


def test_a_fresh_run_logs_the_val_loss_before_step_0_and_a_resumed_one_does_not(tmp_path, capsys):
    """The curve's first point: the untrained model's loss on the validation windows, logged at step -1."""
    first = run(["--max_steps", "2", "--eval_every", "2", "--eval_steps", "1"], tmp_path)
    cfg = t.machine_choices(t.parse_args(TINY_ARGS + ["--eval_steps", "1"]), t.Launch())
    untrained, (_, val_tokens) = t.new_model(cfg), t.CheckedRun(cfg).token_streams()
    val_loader = t.DataLoader(val_tokens, cfg.micro_batch_size, cfg.seq_len, 0, 1)
    expected = t.estimate_val_loss(untrained, val_loader, cfg, t.Launch())
    assert [(r["step"], r["val_loss"]) for r in first.run.records if "val_loss" in r][0] == (-1, expected)
    assert f"step    -1/2 | val loss {expected:.6f}\n" in capsys.readouterr().out
    resumed = run(["--max_steps", "4", "--eval_every", "2", "--eval_steps", "1", "--resume", "auto"], tmp_path)
    assert [r["step"] for r in resumed.run.records if "val_loss" in r] == [3]  # not -1 again
    kept = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept if "val_loss" in r] == [-1, 1, 3]


def test_a_checkpoint_due_with_samples_is_written_before_them(tmp_path, monkeypatch):
    """Samples came first: a sampling edit that crashed lost the steps since the last checkpoint."""
    seen = []
    monkeypatch.setattr(t, "print_samples", lambda *args: seen.append(sorted(p.name for p in tmp_path.glob("*/*.pt"))))
    run(["--max_steps", "4", "--sample_every", "2", "--ckpt_every", "2", "--keep_ckpts", "0"], tmp_path)
    assert seen == [["ckpt_2.pt"], ["ckpt_2.pt", "ckpt_4.pt"]]


# ------------------------------ before step 0, training's path and the cache's agree (issue 61)

def window_of_16_on_masks_alone(query_positions_unknown=None):
    """A window added where attention passes its mask, not in visible(): training's fused causal kernel never sees
    it, generation's masked calls do. Each causal mask row keeps its last 16 keys."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def windowed(q, k, v, attn_mask=None, **kwargs):
        if attn_mask is not None:
            attn_mask = attn_mask & (attn_mask.flip(-1).cumsum(-1).flip(-1) <= 16)
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
    return windowed


END_OF_TEXT = t.tokenizer().eot_token  # once, outside forward, as a hacker's mask takes it


def documents_visible(query_positions, key_positions, key_tokens):
    documents = (key_tokens == END_OF_TEXT).cumsum(-1)  # (B, Tk): each key's document
    same = documents[:, query_positions, None] == documents[:, None, :]  # (B, Tq, Tk)
    return ((key_positions <= query_positions[:, None]) & same)[:, None]


def test_an_edit_that_reaches_one_path_alone_stops_before_step_0_naming_where_they_part(tmp_path, monkeypatch, capsys):
    """Two wrong edits that trained to the end before: a window on attention's own mask (training never sees it), and
    a document mask made in forward() (generation and HellaSwag never see it). A right one, the README's window in
    visible(), trains."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", window_of_16_on_masks_alone())
    with pytest.raises(SystemExit) as stopped:
        run(["--max_steps", "2"], tmp_path, "window")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith(
        "error: the logits of training's forward and of the prompt's cached pass differ at position 16 by ")
    assert err.endswith(": an edit reached one path alone (say which keys a query sees in visible(), and use "
                        "attention's positions)\n") and len(err.splitlines()) == 1
    monkeypatch.undo()

    class DocumentsInForward(t.GPT):  # the mask made for forward's own blocks only
        def forward(self, idx, targets=None):
            for block in self.transformer.h:
                block.attn.fused_causal = False
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(t, "visible", documents_visible)
                return super().forward(idx, targets)

    monkeypatch.setattr(t, "GPT", DocumentsInForward)
    with pytest.raises(SystemExit):
        run(["--max_steps", "2"], tmp_path, "documents")
    assert capsys.readouterr().err.startswith(  # <|endoftext|> at 3: its document starts there
        "error: the logits of training's forward and of the prompt's cached pass differ at position 3 by ")
    monkeypatch.undo()

    window = lambda q, k, tokens: (k <= q[:, None]) & (q[:, None] - k < 16)  # noqa: E731 (the README's)
    monkeypatch.setattr(t, "visible", window)
    t.visible_is_causal.cache_clear()
    try:
        assert len([r for r in run(["--max_steps", "2"], tmp_path, "right").run.records if "train_loss" in r]) == 2
    finally:
        t.visible_is_causal.cache_clear()


def test_a_window_made_as_attentions_own_mask_stops_before_step_0_naming_the_path_that_fails(tmp_path, monkeypatch,
                                                                                            capsys):
    """The third wrong edit of issue 61: a (T, T) window made from the queries' length, passed as attention's own
    attn_mask. It trained, then died at the end-of-run sample; then in the paths check, not naming the path."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def own_window(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        T = q.size(-2)
        return sdpa(q, k, v, attn_mask=torch.ones(T, T, dtype=torch.bool).tril().triu(-15), **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", own_window)
    with pytest.raises(RuntimeError) as raised:
        run(["--max_steps", "2"], tmp_path)
    assert str(raised.value) == ("the prompt's cached pass fails (above) where training's forward runs: an edit reached "
                                 "one path alone (say which keys a query sees in visible(), and use attention's "
                                 "positions)")
    assert "must match the size of tensor b (60)" in str(raised.value.__cause__)  # its traceback, above that line
    assert " | loss " not in capsys.readouterr().out and not list((tmp_path / "log").glob("ckpt_*.pt"))


class WithAnIdleGain(t.GPT):
    """A hacker's new parameter that forward never uses (layer 0's value-residual scalar, say)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.transformer.h[0].attn.value_gain = torch.nn.Parameter(torch.ones(()))


@pytest.mark.parametrize("steps", [["--max_steps", "2"], ["--stop_after_steps", "2"]])
def test_a_parameter_with_no_gradient_in_a_new_runs_first_steps_is_one_line(tmp_path, monkeypatch, capsys, steps):
    """It used to train on, its value never moving (in one process), or to stop in PyTorch's words (under DDP). The
    first t.NO_GRADIENT_STEPS steps, or all of a shorter run or first part (its resumes are not checked): the line
    comes at the last, before its checkpoint."""
    monkeypatch.setattr(t, "GPT", WithAnIdleGain)
    with pytest.raises(SystemExit) as stopped:
        run(steps + ["--ckpt_every", "1"], tmp_path)
    out, err = capsys.readouterr()
    assert stopped.value.code == 2 and err == (
        "error: transformer.h.0.attn.value_gain got no gradient in this run's first 2 steps: use it in forward, or "
        "set its requires_grad to False\n")
    assert "step     1/" in out and [p.name for p in (tmp_path / "log").glob("ckpt_*.pt")] == ["ckpt_1.pt"]


def test_an_expert_idle_in_the_first_step_of_a_new_run_or_of_a_resume_is_not_named(tmp_path, one_thread, monkeypatch):
    """Each block's MLP a mixture of 8 experts, each token routed to one (conftest.hash_routed_gpt), a step 16
    tokens: expert 7 gets none at step 0, expert 4 none at step 3. The first step's gradients named expert 7 and
    stopped the new run; a resume at step 3 was stopped for expert 4, which top-1 routing idles by design."""
    monkeypatch.setattr(t, "GPT", hash_routed_gpt())
    flags = ["--seq_len", "16", "--micro_batch_size", "1", "--total_batch_size", "16", "--max_steps", "6",
             "--ckpt_every", "3"]
    loader = t.DataLoader(checked_run(text_file=str(SHAKESPEARE)).token_streams()[0], 1, 16, 0, 1)
    assert [idle_experts(loader.next_batch()[0]) for _ in range(4)] == [{7}, set(), {7}, {4}]
    whole = train_losses(run(flags, tmp_path, "whole"))
    run(flags + ["--stop_after_steps", "3"], tmp_path, "resumed")
    assert train_losses(run(flags + ["--resume", "auto"], tmp_path, "resumed")) == whole[3:]


def test_each_step_line_ends_with_the_time_left_and_the_start_line_counts_in_singular_and_plural(tmp_path, capsys):
    """No line said how long was left, and the start line said "1 micro-steps x 1 process(es)" (issue 62)."""
    import datetime
    import re

    result = run(["--max_steps", "3", "--total_batch_size", "128"], tmp_path)
    out = capsys.readouterr().out
    assert "= 1 micro-step x 1 process x 4 x 32;" in out and ", 1 process;" in out
    lefts = re.findall(r"^step +\d+/3 \| .* tok/s \| (\S+) left$", out, re.M)
    ms = [r["ms"] for r in result.run.records if "ms" in r]
    assert lefts == [str(datetime.timedelta(seconds=round(float(np.median(ms[: i + 1])) / 1000 * (2 - i))))
                     for i in range(3)] and lefts[-1] == "0:00:00"
    run(["--max_steps", "2"], tmp_path, "two")
    assert "= 2 micro-steps x 1 process x 4 x 32;" in capsys.readouterr().out
