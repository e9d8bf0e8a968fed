import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt2 as t
from conftest import named


@pytest.mark.recipe
def test_gpt2_shape_has_124439808_parameters():
    with torch.device("meta"):  # no memory, no init cost
        model = t.GPT(t.GPTConfig(*t.MODEL_SHAPES["gpt2"], block_size=1024, vocab_size=50257))
    assert t.count_parameters(model) == 124_439_808


@pytest.mark.recipe
def test_padded_vocab_adds_exactly_the_padding_rows():
    with torch.device("meta"):
        model = t.GPT(t.GPTConfig(*t.MODEL_SHAPES["gpt2"], block_size=1024, vocab_size=50304))
    assert t.count_parameters(model) == 124_439_808 + (50304 - 50257) * 768


@pytest.mark.recipe
@pytest.mark.parametrize("name, expected_millions", [("gpt2-medium", 354.8), ("gpt2-large", 774.0), ("gpt2-xl", 1557.6)])
def test_larger_shapes_match_published_sizes(name, expected_millions):
    with torch.device("meta"):
        model = t.GPT(t.GPTConfig(*t.MODEL_SHAPES[name], block_size=1024, vocab_size=50257))
    assert round(t.count_parameters(model) / 1e6, 1) == expected_millions


def tiny_model(vocab_size=64, seed=0):
    torch.manual_seed(seed)
    return t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=vocab_size))


def test_logits_shape_and_loss_at_init_near_uniform():
    model = tiny_model(vocab_size=64)
    idx = torch.randint(0, 64, (3, 16))
    assert model(idx).shape == (3, 16, 64)
    targets = torch.randint(0, 64, (3, 16))  # independent of idx: the tied embedding favours idx itself
    loss = model(idx, targets).item()
    assert abs(loss - math.log(64)) < 0.2, loss


@pytest.mark.recipe
def test_lm_head_is_tied_to_the_token_embedding():
    model = tiny_model()
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.recipe
def test_residual_projections_get_scaled_init():
    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=8, n_head=4, n_embd=256, block_size=16, vocab_size=64))
    proj_std = model.transformer.h[0].attn.c_proj.weight.std().item()
    fc_std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert proj_std == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.05)
    assert fc_std == pytest.approx(0.02, rel=0.05)
    assert model.transformer.h[0].mlp.c_fc.bias.abs().sum().item() == 0.0


def test_attention_is_causal():
    model = tiny_model()
    idx = torch.randint(0, 64, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 64  # change only the future after position 9
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10], rtol=0, atol=0)


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="longer than block_size 16"):
        tiny_model()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.recipe
def test_flops_per_token_of_gpt2_is_about_860_million():
    config = t.GPTConfig(*t.MODEL_SHAPES["gpt2"], block_size=1024, vocab_size=50304)
    flops = t.flops_per_token(config, 124_475_904, seq_len=1024)
    assert flops == 6 * 124_475_904 + 12 * 12 * 1024 * 768
    assert round(flops / 1e6) == 860


def loss_and_gradients(chunk_size, autocast_dtype=None):
    model = tiny_model(vocab_size=300)
    model.config.loss_chunk_size = chunk_size
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 300, (3, 16), generator=generator), torch.randint(0, 300, (3, 16), generator=generator)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = model(x, y)
    (2.5 * loss).backward()  # a non-unit incoming gradient, as under accumulation
    return loss, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("chunk_size", [7, 16, 48])  # uneven last chunk, one row of 16, all 48 tokens at once
def test_chunked_loss_equals_the_plain_loss_and_gradients(chunk_size):
    plain_loss, plain_grads = loss_and_gradients(0)
    chunked_loss, chunked_grads = loss_and_gradients(chunk_size)
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-6, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6, msg=named(name))


def test_chunked_loss_under_bf16_autocast_matches_within_bf16_rounding():
    plain_loss, plain_grads = loss_and_gradients(0, torch.bfloat16)
    chunked_loss, chunked_grads = loss_and_gradients(7, torch.bfloat16)
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-5, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=2e-2, atol=8e-3,  # bf16: 8 bits
                                   msg=named(name))


def test_chunked_loss_without_gradients_is_the_plain_loss():
    model = tiny_model(vocab_size=300)
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        plain = model(x, y)
        model.config.loss_chunk_size = 5
        torch.testing.assert_close(model(x, y), plain, rtol=1e-6, atol=0)


@pytest.mark.parametrize("flags, expected", [([], 0), (["--compile"], 0), (["--loss_chunk_size", "4096"], 4096),
                                             (["--device", "cpu", "--loss_chunk_size", "8192"], 8192)])
def test_the_loss_is_chunked_only_when_asked_on_every_device(flags, expected):
    """The CPU's default loss was chunked (its own code path) while the GPU's was not: an edit to the logits tried
    on a laptop changed nothing there."""
    cfg, _ = t.settle_defaults(t.parse_args(["--n_layer", "1", "--n_head", "1", "--n_embd", "8"] + flags), t.Launch())
    assert t.build_model(cfg, "cpu").config.loss_chunk_size == expected


@pytest.mark.parametrize("chunk_size, recompute", [(0, False), (5, False), (0, True)])
def test_the_training_forward_is_one_graph_for_torch_compile(chunk_size, recompute):
    """A graph break would split what compile fuses on a GPU; fullgraph=True turns any break into an error.
    aot_eager captures and splits forward from backward as inductor does, without generating kernels, so the loss
    is the eager one exactly."""
    model = tiny_model(vocab_size=300)
    model.config.loss_chunk_size, model.config.recompute = chunk_size, recompute
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        captured = torch.compile(model, fullgraph=True, backend="aot_eager")(x, y)
        eager = model(x, y)
    captured.backward()
    assert captured.item() == eager.item()
    assert model.transformer.wte.weight.grad is not None


def test_recompute_runs_each_block_again_in_backward_for_the_same_loss_and_gradients(one_thread):
    """--recompute keeps only each block's input and runs the block a second time during backward: the same
    operations on the same inputs, so the loss and every gradient are those of the plain model, bit for bit.
    Without gradients (evaluation, sampling) nothing is recomputed."""
    model = tiny_model(vocab_size=300)
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    block_calls = []
    for block in model.transformer.h:
        block.register_forward_pre_hook(lambda *args: block_calls.append(1))  # recomputing may stop early
    results = []
    for recompute in (False, True):
        model.config.recompute = recompute
        model.zero_grad()
        block_calls.clear()
        loss = model(x, y)
        loss.backward()
        results.append((len(block_calls), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_calls, plain_loss, plain_grads), (calls, loss, grads) = results
    assert (plain_calls, calls) == (2, 4)  # 2 blocks: once each, or once more in backward
    assert loss == plain_loss
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=named(name))
    block_calls.clear()
    with torch.no_grad():
        model(x, y)
    assert len(block_calls) == 2


def test_dropout_is_where_gpt2_had_it_and_only_in_training(monkeypatch):
    """On the embeddings, the attention weights (SDPA's dropout_p) and the outputs of attention and MLP; in eval
    mode (validation, HellaSwag, generation all use it) the model is the same function as without dropout."""
    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.5))
    plain = tiny_model(vocab_size=64)
    plain.load_state_dict(model.state_dict())  # dropout adds no parameters
    assert [name for name, module in model.named_modules() if isinstance(module, torch.nn.Dropout)] == [
        "transformer.drop"] + [f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.resid_dropout", "mlp.dropout")]
    attention_dropout, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *args, dropout_p=0.0, **kwargs: attention_dropout.append(dropout_p) or
                        sdpa(*args, dropout_p=dropout_p, **kwargs))
    idx = torch.randint(0, 64, (3, 16))
    with torch.no_grad():
        assert torch.equal(model.eval()(idx), plain.eval()(idx))
        assert not torch.allclose(model.train()(idx), plain.train()(idx))
        assert torch.equal(plain(idx), plain.eval()(idx))  # at 0.0, training mode changes nothing
    assert attention_dropout == [0.0] * 4 + [0.5] * 2 + [0.0] * 6  # 2 layers a call: only training uses it
    tokens = [t.generate(m, [1, 2, 3], 2, 8, 1.0, 10, 0, "cpu", contextlib.nullcontext) for m in (model, plain)]
    assert tokens[0] == tokens[1]


# ------------------------------ what a hacker's edit must reach: every path, the cache, resume

class FavourSeven(torch.nn.Module):
    """A module put in lm_head's place: lm_head's logits with token 7's raised by 100."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        logits = self.head(x)
        return logits + 100 * F.one_hot(torch.tensor(7), logits.size(-1)).to(logits.dtype)


def test_an_edit_to_the_logits_reaches_the_loss_validation_hellaswag_and_every_way_of_sampling():
    """The chunked loss made its own logits, and sampling and HellaSwag called lm_head themselves: a head changed
    where the model makes its logits changed nothing on a CPU. Now all go through GPT.logits."""
    import numpy as np

    model = tiny_model(vocab_size=64)
    model.lm_head = FavourSeven(model.lm_head)  # still tied: its weight is wte's
    sevens = torch.full((2, 16), 7)
    for chunk_size in (0, 5):  # the plain loss and the chunked one: about 0 when 7 always follows
        model.config.loss_chunk_size = chunk_size
        assert model(sevens, sevens).item() < 1e-3
    loader = t.DataLoader(t.TokenStream([np.full(200, 7, dtype=np.uint16)]), 2, 16, 0, 1, False, 0)
    assert t.estimate_val_loss(model, loader, 2, 1, "cpu", contextlib.nullcontext, t.Launch()) < 1e-3
    tokens = torch.tensor([[1, 2, 3, 8, 8, 8], [1, 2, 3, 8, 8, 8], [1, 2, 3, 7, 7, 7], [1, 2, 3, 8, 8, 8]])
    mask = torch.zeros_like(tokens)
    mask[:, 3:] = 1  # the endings: only ending 2, all sevens, is likely under the edited head
    scores = t.evaluate_hellaswag(model, [(tokens, mask, torch.tensor([2]))], "cpu", contextlib.nullcontext,
                                  t.Launch())
    assert (scores["hellaswag_acc"], scores["hellaswag_acc_norm"]) == (1.0, 1.0)
    for use_cache, compiled in ((True, False), (False, False), (True, True)):
        assert t.generate(model, [1, 2, 3], 2, 6, 1.0, 5, 0, "cpu", contextlib.nullcontext, use_cache,
                          compiled) == [[7] * 6] * 2, (use_cache, compiled)


class GroupedQueryAttention(torch.nn.Module):
    """A hacker's attention: 4 query heads share 2 key/value heads, computed in float32 even under autocast. It
    writes its keys and values into the cache as CausalSelfAttention does."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, 2, config.n_embd // config.n_head
        self.q = torch.nn.Linear(config.n_embd, config.n_embd)
        self.kv = torch.nn.Linear(config.n_embd, 2 * self.n_kv_head * self.head_dim)
        self.c_proj = torch.nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, cache=None):
        B, T, C = x.shape
        q = self.q(x).float().view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).float().view(B, T, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)
        mask = None
        if cache is not None:
            kv_cache, layer, positions, mask = cache
            k, v = kv_cache.update(layer, positions, k, v)  # (B, 2, block_size, head_dim)
        k, v = (kv.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for kv in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cache is None)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_takes_its_shape_and_dtype_from_attention(dtype):
    """The cache was sized from n_head and made in autocast's dtype: grouped-query attention trained, then crashed
    at the first sample, and so did keys kept in float32 under bfloat16. Now the same tokens with and without the
    cache, eager and compiled."""
    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=64))
    for block in model.transformer.h:
        block.attn = GroupedQueryAttention(model.config)
    with torch.no_grad():  # logits far apart, as a trained model's: bf16's rounding picks no other token
        model.transformer.wte.weight.normal_(0.0, 1.0)
    autocast = lambda: torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)  # noqa: E731
    tokens = {(use_cache, compiled): t.generate(model, [1, 2, 3], 3, 12, 1.0, 20, 7, "cpu", autocast, use_cache,
                                                compiled)
              for use_cache, compiled in ((False, False), (True, False), (True, True))}
    assert tokens[True, False] == tokens[False, False] == tokens[True, True]
    cache = t.COMPILED_STEP_CACHES[model]
    assert [(tuple(k.shape), k.dtype) for k in cache.keys] == [((3, 2, 32, 8), torch.float32)] * 2


def test_a_training_step_validation_and_generation_run_under_bfloat16_autocast(one_thread):
    """The GPU's precision on a CPU: a step's loss within bf16's rounding of float32's, the same validation windows,
    and the same tokens with and without the cache."""
    import numpy as np

    model = tiny_model(vocab_size=64)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (2, 16), generator=generator), torch.randint(0, 64, (2, 16), generator=generator)
    with autocast():
        loss = model(x, y)
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert loss.dtype == torch.float32 and abs(loss.item() - tiny_model(vocab_size=64)(x, y).item()) < 0.02
    loader = t.DataLoader(t.TokenStream([np.arange(200, dtype=np.uint16) % 64]), 2, 16, 0, 1, False, 0)
    val_losses = [t.estimate_val_loss(model, loader, 2, 1, "cpu", context, t.Launch())
                  for context in (autocast, contextlib.nullcontext)]
    assert abs(val_losses[0] - val_losses[1]) < 0.02, val_losses
    cached, uncached = (t.generate(model, [1, 2, 3], 2, 10, 1.0, 20, 0, "cpu", autocast, use_cache)
                        for use_cache in (True, False))
    assert cached == uncached


def test_resuming_goes_on_exactly_as_a_run_never_stopped(one_thread, tmp_path):
    from conftest import TINY_ARGS

    def train(name, *flags):
        return t.main(t.parse_args(TINY_ARGS + ["--max_steps", "4", "--log_dir", str(tmp_path / name), *flags]))

    straight = train("straight")
    train("resumed", "--stop_after_steps", "2")
    resumed = train("resumed", "--resume", "auto")
    assert [r["train_loss"] for r in resumed.records if "train_loss" in r] == \
        [r["train_loss"] for r in straight.records if "train_loss" in r][2:]
    for (name, parameter), resumed_parameter in zip(straight.model.named_parameters(), resumed.model.parameters(),
                                                    strict=True):
        torch.testing.assert_close(resumed_parameter, parameter, rtol=0, atol=0, msg=named(name))
