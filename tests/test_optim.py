import dataclasses
import math

import pytest
import torch

import train_gpt2 as t
from test_model import tiny_model


@pytest.mark.recipe
def test_defaults_are_the_gpt2_124m_recipe():
    cfg = t.parse_args([])
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd) == (12, 12, 768)
    assert (cfg.block_size, t.machine_choices(cfg, t.Launch()).vocab_size) == (1024, 50304)  # 50257 padded
    assert (cfg.total_batch_size, cfg.micro_batch_size, cfg.seq_len) == (524_288, 64, 1024)
    assert (cfg.max_lr, cfg.max_lr * cfg.min_lr_ratio) == (6e-4, pytest.approx(6e-5))
    assert (cfg.warmup_steps, cfg.max_steps) == (715, 19073)
    assert (cfg.weight_decay, cfg.beta1, cfg.beta2, cfg.eps, cfg.grad_clip) == (0.1, 0.9, 0.95, 1e-8, 1.0)
    assert t.grad_accum_steps(cfg, world_size=1) == 8
    assert t.grad_accum_steps(cfg, world_size=8) == 1


@pytest.mark.recipe
@pytest.mark.parametrize(
    "step, expected",
    [
        (0, 6e-4 / 715),  # warmup starts above zero: step 0 already trains
        (357, 6e-4 * 358 / 715),
        (714, 6e-4),  # last warmup step reaches the peak
        (715, 6e-4),  # cosine starts at the peak
        (715 + (19073 - 715) // 2, 3.3e-4),  # midpoint: halfway between 6e-4 and 6e-5
        (19072, 6e-5 + 5.4e-4 * 0.5 * (1 - math.cos(math.pi / 18358))),  # last trained step: a hair above
        (19073, 6e-5),
        (50_000, 6e-5),
    ],
)
def test_lr_schedule_exact_values(step, expected):
    assert t.lr_at(step, t.parse_args([])) == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.recipe
def test_lr_schedule_without_warmup_starts_at_peak():
    cfg = t.parse_args(["--warmup_steps", "0", "--max_steps", "10"])
    assert t.lr_at(0, cfg) == pytest.approx(6e-4, rel=1e-12, abs=0)


def test_weight_decay_applies_to_exactly_the_2d_tensors():
    model = tiny_model()
    [optimizer] = t.configure_optimizers(model, t.parse_args([]))
    decayed, not_decayed = optimizer.param_groups
    assert (decayed["weight_decay"], not_decayed["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}  # the tied matrix is listed once, as wte
    decayed_names = {names[id(p)] for p in decayed["params"]}
    not_decayed_names = {names[id(p)] for p in not_decayed["params"]}
    assert decayed_names == {"transformer.wte.weight", "transformer.wpe.weight"} | {
        f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert not_decayed_names == {"transformer.ln_f.weight", "transformer.ln_f.bias"} | {
        f"transformer.h.{i}.{m}.bias" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    } | {f"transformer.h.{i}.{ln}.{w}" for i in range(2) for ln in ("ln_1", "ln_2") for w in ("weight", "bias")}
    assert decayed_names.isdisjoint(not_decayed_names)
    assert len(decayed["params"]) + len(not_decayed["params"]) == len(list(model.parameters()))


def test_muon_takes_the_blocks_matrices_and_adamw_keeps_the_embeddings_biases_and_layernorms():
    model = tiny_model()
    adamw, muon = t.make_optimizers(model, t.parse_args(["--optimizer", "muon", "--max_lr", "0.02"]), t.Launch())
    names = {id(p): n for n, p in model.named_parameters()}
    assert type(muon) is torch.optim.Muon and len(muon.param_groups) == 1
    assert {names[id(p)] for p in muon.param_groups[0]["params"]} == {
        f"transformer.h.{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert (muon.defaults["lr"], muon.defaults["weight_decay"], muon.defaults["adjust_lr_fn"]) == (0.02, 0.1, "match_rms_adamw")
    decayed, not_decayed = adamw.param_groups
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["lr"] == 0.02
    assert {names[id(p)] for p in decayed["params"]} == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 1 for p in not_decayed["params"])
    assert len(muon.param_groups[0]["params"]) + len(decayed["params"]) + len(not_decayed["params"]) == len(
        list(model.parameters()))


def test_muon_is_refused_in_one_line_by_a_pytorch_without_it(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(t.RunError, match=r"^--optimizer muon needs torch.optim.Muon, new in PyTorch 2.9; this is "
                                            r"\S+: upgrade torch$"):
        t.check_config(t.parse_args(["--optimizer", "muon"]), world_size=1)


def test_fused_adamw_the_cuda_default_steps_like_the_plain_one(one_thread):
    """CUDA runs take the fused AdamW kernel; PyTorch also has it for CPU, so its update is checked here (a cfg whose
    device is cuda picks it; the model stays on the CPU)."""
    cfg = t.parse_args(["--warmup_steps", "0", "--max_steps", "10"])
    initial = [p.detach().clone() for p in tiny_model().parameters()]
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    results = []
    for device, fused in (("cpu", False), ("cuda", True)):
        model = tiny_model()
        [optimizer] = t.configure_optimizers(model, dataclasses.replace(cfg, device=device))
        assert optimizer.defaults["fused"] is fused
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            model(x, x).backward()
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    plain, fused = results
    assert all((p - p0).abs().max() > 1e-4 for p, p0 in zip(plain, initial, strict=True))  # every tensor moved
    # the kernels order their float32 arithmetic differently: 1.3e-6 apart was seen (2 threads, a loaded machine);
    # a wrong update would be off by about a step, lr 6e-4
    assert max((a - b).abs().max().item() for a, b in zip(plain, fused, strict=True)) < 1e-5


def test_a_group_given_its_own_learning_rate_keeps_its_ratio_through_the_schedule_and_a_resume(tmp_path, monkeypatch):
    """A hacker's per-group rate (here the decayed matrices at 3x) was reset to the schedule's every step (issue 61):
    now the schedule scales each group's own rate, and the ratio is saved and resumed."""
    from conftest import TINY_ARGS

    configure_optimizers, seen = t.configure_optimizers, []

    def three_times_for_the_matrices(*args, **kwargs):
        optimizers = configure_optimizers(*args, **kwargs)
        optimizers[0].param_groups[0]["lr"] *= 3  # as a group written with "lr": 3 * cfg.max_lr
        optimizers[0].register_step_pre_hook(lambda optimizer, *_: seen.append([g["lr"] for g in optimizer.param_groups]))
        return optimizers

    monkeypatch.setattr(t, "configure_optimizers", three_times_for_the_matrices)
    flags = TINY_ARGS + ["--max_steps", "3", "--warmup_steps", "2", "--log_dir", str(tmp_path)]
    t.main(t.parse_args(flags + ["--stop_after_steps", "2"]))
    t.main(t.parse_args(flags + ["--resume", "auto"]))
    cfg = t.parse_args(flags)
    assert seen == [[3 * t.lr_at(step, cfg), t.lr_at(step, cfg)] for step in range(3)]


def test_a_resume_with_other_optimizer_flags_steps_with_them_and_keeps_a_groups_own_settings(tmp_path, monkeypatch):
    """optimizer.load_state_dict puts back the checkpoint's groups: a resume with --weight_decay 0 --beta2 0.99 was
    warned of "--weight_decay 0.1 -> 0.0" and went on at 0.1 and 0.95. Now the moments come back under this run's
    settings; the undecayed group keeps its own weight decay of 0."""
    from conftest import TINY_ARGS

    configure_optimizers, seen = t.configure_optimizers, []

    def watched(*args, **kwargs):
        optimizers = configure_optimizers(*args, **kwargs)
        optimizers[0].register_step_pre_hook(lambda optimizer, *_: seen.append(
            [(group["weight_decay"], group["betas"], len(optimizer.state)) for group in optimizer.param_groups]))
        return optimizers

    monkeypatch.setattr(t, "configure_optimizers", watched)
    flags = TINY_ARGS + ["--max_steps", "3", "--warmup_steps", "1", "--log_dir", str(tmp_path)]
    t.main(t.parse_args(flags + ["--stop_after_steps", "2"]))
    t.main(t.parse_args(flags + ["--resume", "auto", "--weight_decay", "0", "--beta2", "0.99"]))
    tensors = len(list(t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)).parameters()))  # TINY_ARGS'
    assert seen == [[(0.1, (0.9, 0.95), 0), (0.0, (0.9, 0.95), 0)],
                    [(0.1, (0.9, 0.95), tensors), (0.0, (0.9, 0.95), tensors)],
                    [(0.0, (0.9, 0.99), tensors), (0.0, (0.9, 0.99), tensors)]]  # the moments came back too


def test_a_sharded_optimizer_is_freed_with_its_last_reference_not_left_to_the_collector(tmp_path):
    """ZeroRedundancyOptimizer holds the process group. Its state_dict override once closed over the instance: a
    reference cycle, freed only when the collector ran, which under CI's load was after destroy_process_group(),
    and gloo aborted rank 0's exit (-6). With the collector off, the last reference must free it."""
    import gc
    import weakref

    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    gc.disable()
    try:
        model = t.GPT(t.GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
        [adamw] = t.configure_optimizers(model, t.TrainConfig(device="cpu"))
        sharded = t.sharded_over_ranks(adamw, t.Launch(torchrun=True))
        assert sharded.state_dict()["param_groups"]  # rank 0 of 1 gets it whole
        freed = weakref.ref(sharded)
        del sharded
        assert freed() is None
    finally:
        gc.enable()
        dist.destroy_process_group()
