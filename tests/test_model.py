import contextlib
import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt2 as t
from conftest import Seen, named, queries_keys_values, turning


@pytest.mark.recipe
def test_gpt2_shape_has_124439808_parameters():
    with torch.device("meta"):  # no memory, no init cost
        model = t.GPT(t.GPTConfig(**t.MODEL_SHAPES["gpt2"], block_size=1024, vocab_size=50257))
    assert t.count_parameters(model) == 124_439_808


@pytest.mark.recipe
def test_padded_vocab_adds_exactly_the_padding_rows():
    with torch.device("meta"):
        model = t.GPT(t.GPTConfig(**t.MODEL_SHAPES["gpt2"], block_size=1024, vocab_size=50304))
    assert t.count_parameters(model) == 124_439_808 + (50304 - 50257) * 768


@pytest.mark.recipe
@pytest.mark.parametrize("name, expected_millions", [("gpt2-medium", 354.8), ("gpt2-large", 774.0), ("gpt2-xl", 1557.6)])
def test_larger_shapes_match_published_sizes(name, expected_millions):
    with torch.device("meta"):
        model = t.GPT(t.GPTConfig(**t.MODEL_SHAPES[name], block_size=1024, vocab_size=50257))
    assert round(t.count_parameters(model) / 1e6, 1) == expected_millions


def trained_as_main_trains(model):
    """model with attention's mask left to SDPA's causal kernel where visible() is causal, as CheckedRun.prepare
    leaves it (with_options' use_fused_causal): the path a run trains on. A new GPT passes visible()'s mask always."""
    t.use_fused_causal(model)
    return model


def tiny_model(vocab_size=64, seed=0):
    torch.manual_seed(seed)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=vocab_size))
    return trained_as_main_trains(model)


def test_logits_shape_and_loss_at_init_near_uniform():
    """forward gives the logits without targets, the loss alone with them (a scalar: the logits never kept); a new
    model's loss is about ln(vocab)."""
    model = tiny_model(vocab_size=64)
    idx = torch.randint(0, 64, (3, 16))
    assert model(idx).shape == (3, 16, 64)
    targets = torch.randint(0, 64, (3, 16))  # independent of idx: the tied embedding favours idx itself
    loss = model(idx, targets)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(64)) < 0.2, loss


def test_attention_passes_visibles_mask_until_main_checks_that_it_is_causal():
    """The recipe alone passes visible()'s mask on every call; use_fused_causal (main()'s, through with_options)
    leaves it to SDPA's causal kernel where visible_is_causal() says it may: for GPT-2's mask, not for documents'."""
    def fused(model):
        return [getattr(block.attn, "fused_causal", None) for block in model.transformer.h]

    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    if None in fused(model):
        premise_gone("this check assumes GPT-2's attention, which may leave its mask to SDPA's causal kernel; the "
                     "file's has no fused_causal")
    assert fused(model) == [False, False]
    with visible_as(gpt2_mask):
        assert fused(tiny_model()) == [True, True]
    with visible_as(document_mask):
        assert fused(tiny_model()) == [False, False]


def test_the_start_line_says_when_attention_takes_visibles_mask(tmp_path, capsys):
    """An edited visible() costs the fused kernel's speed: the run says so on its start line (a reader found it
    silent); GPT-2's mask says nothing."""
    from conftest import TINY_ARGS

    said = "visible() is not causal alone: attention takes its mask, not SDPA's fused causal kernel"
    for mask, log_dir in ((gpt2_mask, "plain"), (document_mask, "documents")):
        with visible_as(mask):
            t.main(t.parse_args(TINY_ARGS + ["--max_steps", "1", "--warmup_steps", "1", "--log_dir",
                                             str(tmp_path / log_dir)]))
        start_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("device "))
        assert (said in start_line) == (mask is document_mask), start_line


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


# ------------------------------ the checks a hacker's model must pass: each a helper, run on the file's own GPT here
# and on scratch edits at the end of this file (a SwiGLU MLP passes them all; attention that counts its rotary
# positions from 0 fails the cache's)

def assert_causal(model):
    """A position's logits do not change when only later tokens do, to rounding (an MoE's routing sums its experts
    in another order: 6e-8 apart)."""
    vocab_size, length = model.config.vocab_size, model.config.block_size
    idx = torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % vocab_size  # change only the future after position 9
    skip_unless_visible_hides_later_keys(idx, 10)
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10], rtol=0, atol=1e-5,
                               msg=named("the logits at positions 0-9 changed with the tokens after position 9"))


def premise_gone(reason):
    """Skip a check, saying why: the hacker's file lacks what it assumes (a causal mask, a loss that is the logits'
    cross-entropy, GPT-2's attention for an edit to make). A test that runs the check (passes) skips with it."""
    skipped = pytest.skip.Exception(reason)
    skipped.premise_gone = True
    raise skipped


def skip_unless_visible_hides_later_keys(tokens, position):
    """assert_causal's premise: visible() shows no query before `position` a key at or after it. A hacker's mask
    that does (a prefix that attends both ways) is no longer causal: the check skips, saying so."""
    at = torch.arange(tokens.size(1))
    seen = t.visible(at, at, tokens)[..., :position, position:]  # (Tq, Tk) or (B, 1, Tq, Tk)
    if seen.any():
        query, key = (int(i) for i in seen.nonzero()[0, -2:])
        premise_gone(f"this check assumes a causal mask; visible() shows the query at {query} the later key at "
                     f"{key + position}")


def assert_cache_equals_no_cache(model, autocast=contextlib.nullcontext, atol=1e-5, rtol=0.0, prompt_length=5,
                                 new_tokens=8):
    """The logits of generation's path (the prompt's pass through hidden_states with one KVCache a layer, then one
    token at a time at its position) equal, within atol + rtol * |logit|, those of the uncached forward over the
    whole sequence. The first position that differs names the failure."""
    model.eval()
    length = prompt_length + new_tokens
    assert length <= model.config.block_size
    tokens = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), autocast():
        uncached = model(tokens).float()
        caches = t.kv_caches(model)
        pieces = [model.logits(model.hidden_states(tokens[:, :prompt_length], caches, torch.arange(prompt_length)))]
        for position in range(prompt_length, length):
            pieces.append(model.logits(model.hidden_states(tokens[:, position : position + 1], caches,
                                                           torch.tensor([position]))))
    model.train()
    cached = torch.cat(pieces, dim=1).float()
    assert cached.shape == uncached.shape, (cached.shape, uncached.shape)
    for position in range(length):
        difference = (cached[:, position] - uncached[:, position]).abs()
        allowed = atol + rtol * uncached[:, position].abs()
        if (difference > allowed).any():
            step = "the prompt's pass" if position < prompt_length else "a one-token step"
            raise AssertionError(
                f"with the KV cache, the logits at position {position} differ from the uncached forward's by "
                f"{difference.max().item():.3g} (allowed: {atol:g} + {rtol:g} x |logit|), in {step} (prompt "
                f"positions 0-{prompt_length - 1}, then one token at a time)")


BF16_LOGITS_ATOL = 1e-2  # bfloat16 keeps 8 bits: 1 ulp is 0.002 at the logits' 0.5; cached and uncached differ by 1-2


def evaluation_config(dtype="float32"):
    """What estimate_val_loss and evaluate_hellaswag read of the flags: 2 validation steps of one (2, 16) batch each,
    on the CPU, in dtype (bfloat16: under autocast)."""
    return t.TrainConfig(device="cpu", dtype=dtype, eval_steps=2, micro_batch_size=2, seq_len=16, total_batch_size=32)


def assert_every_path_runs_under_bfloat16(make_model):
    """The GPU's precision on a CPU: a training step's loss in float32 and within bf16's rounding of float32's, the
    validation loss likewise, generation with and without the cache, and the cached logits within bf16's rounding of
    the uncached ones. make_model() gives the same model each call."""
    import numpy as np

    model = make_model()
    vocab_size = model.config.vocab_size
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, vocab_size, (2, 16), generator=generator) for _ in range(2))
    with autocast():
        loss = model(x, y)
    loss.backward()
    float32_loss = make_model()(x, y).item()
    assert loss.dtype == torch.float32 and abs(loss.item() - float32_loss) < 0.02, (
        f"under bf16 autocast the training loss is {loss.item():.4f} ({loss.dtype}), float32's {float32_loss:.4f}")
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    loader = t.DataLoader(t.TokenStream([np.arange(200, dtype=np.uint16) % vocab_size]), 2, 16, 0, 1)
    val_losses = [t.estimate_val_loss(model, loader, evaluation_config(dtype), t.Launch())
                  for dtype in ("bfloat16", "float32")]
    assert abs(val_losses[0] - val_losses[1]) < 0.02, f"validation loss under bf16, float32: {val_losses}"
    for cached in (True, False):
        next_token = t.CachedNextToken(t.kv_caches(model)) if cached else t.sample_next
        samples = t.generate(model, [1, 2, 3], 10, 2, 1.0, 20, 0, autocast, next_token)
        assert len(samples) == 2 and all(len(s) == 10 and all(0 <= i < vocab_size for i in s) for s in samples), (
            cached, samples)
    # the logits, not sampled tokens: bf16's rounding may tip a sample of a correct model to another token
    assert_cache_equals_no_cache(model, autocast, atol=BF16_LOGITS_ATOL)


def favouring_seven(model):
    """model with an edit to GPT.logits: token 7's logit raised by 100 wherever the model makes logits. A shallow
    copy: the same modules and weights (deepcopy fails on a module holding a non-leaf tensor, a hacker's loss)."""
    edited = copy.copy(model)

    class FavourSeven(type(model)):
        def logits(self, x):
            logits = super().logits(x)
            return logits + 100 * F.one_hot(torch.tensor(7, device=logits.device), logits.size(-1)).to(logits.dtype)

    edited.__class__ = FavourSeven
    return edited


@contextlib.contextmanager
def loss_chunked(chunk_size, *models):
    """models training on --loss_chunk_size's loss (chunk_the_loss) until the block ends; chunk_size 0: the plain
    one. The chunked loss is an attribute of each model: deleted, the class's cross_entropy is back."""
    chunked = models if chunk_size else ()
    for model in chunked:
        t.chunk_the_loss(model, chunk_size)
    try:
        yield
    finally:
        for model in chunked:
            del model.cross_entropy


def skip_unless_the_loss_is_cross_entropy(model):
    """The loss checks below assume that forward's loss is the cross-entropy of its logits; a hacker's label
    smoothing or auxiliary loss is not, and is skipped, saying so."""
    idx = torch.randint(0, model.config.vocab_size, (2, model.config.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(idx, idx.roll(-1, 1))
        plain = F.cross_entropy(model(idx).flatten(0, 1).float(), idx.roll(-1, 1).flatten())
    if not torch.allclose(loss, plain, rtol=1e-5, atol=0):
        premise_gone(f"this check assumes the training loss is the logits' cross-entropy ({plain.item():.4f}); "
                     f"forward's is {loss.item():.4f}")


def assert_loss_falls_when_the_target_logit_rises(model):
    """The loss, plain and chunked, comes from GPT.logits: raising the target's logit there lowers it (assumes a
    loss that is cross-entropy, as with a z-loss or soft-capped logits; a smoothed one is skipped)."""
    skip_unless_the_loss_is_cross_entropy(model)
    edited = favouring_seven(model)
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (2, model.config.block_size), generator=generator)
    sevens = torch.full_like(idx, 7)  # the target everywhere
    for loss_chunk_size in (0, 5):
        with loss_chunked(loss_chunk_size, model, edited):  # each its own: the chunks wrap a model's cross_entropy
            plain, raised = (m(idx, sevens).item() for m in (model, edited))
        assert raised < plain, (
            f"the loss must fall when the logit of the target rises (the edit to GPT.logits must reach the "
            f"loss, plain and chunked): with loss_chunk_size {loss_chunk_size} it is {plain:.4f}, and "
            f"{raised:.4f} with the target's logit raised by 100")


def test_attention_is_causal():
    """A position's logits do not depend on later tokens."""
    assert_causal(tiny_model())


def test_the_kv_cache_gives_the_logits_of_the_uncached_forward():
    """Generation's path (the prompt's pass through hidden_states filling one KVCache a layer, then a token at a time
    at its position, 8 positions past a 5-token prompt) gives the uncached forward's logits in float32, to 1e-5:
    rounding is about 1e-7 here, a token at the wrong position (a rotary edit fed positions from 0) 2e-4."""
    assert_cache_equals_no_cache(tiny_model())


def test_sequence_longer_than_block_size_is_refused():
    """hidden_states refuses more tokens than the model has positions, in one line."""
    with pytest.raises(ValueError, match="^17 tokens, longer than block_size 16$"):
        tiny_model()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.recipe
def test_flops_per_token_of_gpt2_is_about_860_million():
    config = t.GPTConfig(**t.MODEL_SHAPES["gpt2"], block_size=1024, vocab_size=50304)
    flops = t.flops_per_token(config, 124_475_904, seq_len=1024)
    assert flops == 6 * 124_475_904 + 12 * 12 * 1024 * 768
    assert round(flops / 1e6) == 860


def loss_and_gradients(chunk_size, autocast_dtype=None, make_model=tiny_model):
    model = make_model(vocab_size=300)
    if chunk_size:  # 0: the plain loss
        t.chunk_the_loss(model, chunk_size)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 300, (3, 16), generator=generator), torch.randint(0, 300, (3, 16), generator=generator)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = model(x, y)
    assert loss.shape == ()  # the loss alone: the logits are never kept
    (2.5 * loss).backward()  # a non-unit incoming gradient, as under accumulation
    return loss, {name: p.grad for name, p in model.named_parameters()}


def assert_chunked_loss_equals_the_plain_loss_and_gradients(chunk_size, make_model=tiny_model):
    skip_unless_the_loss_is_cross_entropy(make_model())  # the chunked loss is cross-entropy
    plain_loss, plain_grads = loss_and_gradients(0, make_model=make_model)
    chunked_loss, chunked_grads = loss_and_gradients(chunk_size, make_model=make_model)
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-6, atol=0, msg=named("the chunked loss"))
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-6, msg=named(name))


@pytest.mark.parametrize("chunk_size", [7, 16, 48])  # uneven last chunk, one row of 16, all 48 tokens at once
def test_chunked_loss_equals_the_plain_loss_and_gradients(chunk_size):
    """--loss_chunk_size changes the memory, not the loss or a gradient (float32, to rounding)."""
    assert_chunked_loss_equals_the_plain_loss_and_gradients(chunk_size)


def test_chunked_loss_under_bf16_autocast_matches_within_bf16_rounding():
    plain_loss, plain_grads = loss_and_gradients(0, torch.bfloat16)
    chunked_loss, chunked_grads = loss_and_gradients(7, torch.bfloat16)
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-5, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=2e-2, atol=8e-3,  # bf16: 8 bits
                                   msg=named(name))


def test_chunked_loss_without_gradients_is_the_plain_loss():
    """Evaluation (no_grad) through the chunked path: the plain loss, alone (no logits)."""
    model = tiny_model(vocab_size=300)
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        plain = model(x, y)
        with loss_chunked(5, model):
            chunked = model(x, y)
    assert chunked.shape == ()
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)


def test_a_copy_of_a_model_with_the_chunked_loss_scores_its_own_logits():
    """A hacker's EMA (weights_to_score's copy.deepcopy of the model with_options made) was validated with the
    trained model's logits on its own hidden states under --loss_chunk_size: the chunked loss held the trained
    model's cross_entropy, and the copy's came with it."""
    model = tiny_model(vocab_size=300)
    t.chunk_the_loss(model, 5)
    averaged = copy.deepcopy(model)
    with torch.no_grad():
        averaged.lm_head.weight.mul_(3)  # weights of its own (tied: the embedding's too)
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        hidden = averaged.hidden_states(x)
        torch.testing.assert_close(averaged.cross_entropy(hidden, y), t.GPT.cross_entropy(averaged, hidden, y),
                                   rtol=1e-6, atol=0, msg=named("the copy's chunked loss against its plain loss"))


def logits_rows_of_the_loss(model, tokens=10_000) -> list[int]:
    """The rows of each call of GPT.logits while model's training loss scores `tokens` tokens: [tokens] unchunked.
    A (rows, 2) of zeros stands in for each call's logits (the real ones, 10,000 x 50,304, would take 2 GB)."""
    rows = []

    def logits(x):  # (rows, n_embd)
        rows.append(len(x))
        return x.new_zeros(len(x), 2)
    model.logits = logits  # read by the class's cross_entropy, which the chunked one calls for each chunk
    with torch.no_grad():
        model.cross_entropy(torch.zeros(1, tokens, model.config.n_embd), torch.zeros(1, tokens, dtype=torch.long))
    return rows


@pytest.mark.parametrize("flags, rows", [([], [10_000]), (["--compile"], [10_000]),
                                         (["--loss_chunk_size", "4096"], [4096, 4096, 1808]),
                                         (["--device", "cpu", "--loss_chunk_size", "8192"], [8192, 1808])])
def test_the_loss_is_chunked_only_when_asked_on_every_device(flags, rows):
    """The CPU's default loss was chunked (its own code path) while the GPU's was not: an edit to the logits tried
    on a laptop changed nothing there. Now the model main() trains (with_options, as CheckedRun.prepare and
    --generate apply them) takes its logits in --loss_chunk_size rows at a time, and whole without it."""
    cfg, _ = t.device_settings(t.parse_args(["--n_layer", "1", "--n_head", "1", "--n_embd", "8"] + flags), t.Launch())
    model = t.with_options(t.CheckedRun(cfg).with_weights(t.new_model(cfg)), cfg)
    assert logits_rows_of_the_loss(model) == rows


@pytest.mark.parametrize("chunk_size, recompute", [(0, False), (5, False), (0, True)])
def test_the_training_forward_is_one_graph_for_torch_compile(chunk_size, recompute):
    """A graph break would split what compile fuses on a GPU; fullgraph=True turns any break into an error.
    aot_eager captures and splits forward from backward as inductor does, without generating kernels, so the loss
    is the eager one exactly."""
    model = tiny_model(vocab_size=300)
    if chunk_size:
        t.chunk_the_loss(model, chunk_size)
    if recompute:
        t.recompute_blocks(model)
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        captured = torch.compile(model, fullgraph=True, backend="aot_eager")(x, y)
        eager = model(x, y)
    captured.backward()
    assert captured.item() == eager.item()
    assert model.transformer.wte.weight.grad is not None


def gradients(model) -> dict:
    """Each parameter's gradient by name, copied; None for one that got none (a hacker's scalar used in some
    layers only): assert_close passes None against None and names a None against a tensor."""
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def counting_block_calls(model) -> list:
    """A list that each run of a block's forward adds a 1 to, for model's blocks (a block repeated in h: counted at
    each use). The count wraps the forward on the block itself, where recompute_blocks then wraps it: a recomputation
    in backward calls the forward again, not the block (its hooks would not see it)."""
    calls = []

    def counted(forward, *args, **kwargs):
        calls.append(1)  # on entry: recomputing may stop early
        return forward(*args, **kwargs)
    for block in dict.fromkeys(model.transformer.h):
        block.forward = functools.partial(counted, block.forward)
    return calls


def test_recompute_runs_each_block_again_in_backward_for_the_same_loss_and_gradients(one_thread):
    """--recompute (recompute_blocks) keeps only each block's input and runs the block a second time during
    backward: the same operations on the same inputs, so the loss and every gradient are those of the plain model
    (the same weights), bit for bit. Without gradients (evaluation, sampling) nothing is recomputed."""
    x, y = torch.randint(0, 300, (2, 16)), torch.randint(0, 300, (2, 16))
    results = []
    for recompute in (False, True):
        model = tiny_model(vocab_size=300)  # seeded: the same weights each time
        block_calls, layers = counting_block_calls(model), len(model.transformer.h)
        if recompute:
            t.recompute_blocks(model)
        loss = model(x, y)
        loss.backward()
        results.append((len(block_calls), loss.item(), gradients(model)))
    (plain_calls, plain_loss, plain_grads), (calls, loss, grads) = results
    assert (plain_calls, calls) == (layers, 2 * layers)  # each layer once, or once more in backward
    assert loss == plain_loss
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=named(name))
    block_calls.clear()
    with torch.no_grad():
        model(x, y)
    assert len(block_calls) == layers


@pytest.mark.recipe  # where GPT-2 had dropout: an MLP of another shape may put it elsewhere
def test_dropout_is_where_gpt2_had_it_and_only_in_training(monkeypatch):
    """On the embeddings, the attention weights (SDPA's dropout_p) and the outputs of attention and MLP; in eval
    mode (validation, HellaSwag, generation all use it) the model is the same function as without dropout."""
    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.5))
    model, plain = trained_as_main_trains(model), tiny_model(vocab_size=64)
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
    tokens = [t.generate(m, [1, 2, 3], 8, 2, 1.0, 10, 0, next_token=t.CachedNextToken(t.kv_caches(m)))
              for m in (model, plain)]
    assert tokens[0] == tokens[1]


# ------------------------------ what a hacker's edit must reach: every path, the cache, resume

SAMPLING = ("uncached", "cached", "compiled")


def next_token(model, way):
    """generate()'s next_token for a way of SAMPLING: the recipe's sample_next (each step rereads the window), or
    CachedNextToken with a KV cache a layer, its steps eager or --compile's (compiled_step: its caches kept with it)."""
    if way == "uncached":
        return t.sample_next
    caches, step = t.compiled_step(model, "cpu") if way == "compiled" else (t.kv_caches(model), t.sample_next)
    return t.CachedNextToken(caches, step)


def test_an_edit_to_the_logits_reaches_the_loss_validation_hellaswag_and_every_way_of_sampling():
    """The chunked loss made its own logits, and sampling and HellaSwag called lm_head themselves: an edit where the
    model makes its logits changed nothing on a CPU. Now all go through GPT.logits: an edit there (token 7's logit
    raised by 100) lowers the validation loss, picks the all-sevens HellaSwag ending, makes every sample all sevens,
    with the cache or without, eager or compiled, and lowers the loss, plain and chunked (checked last: a hacker's
    loss that is not the logits' cross-entropy skips that check alone)."""
    import numpy as np

    plain = tiny_model(vocab_size=64)
    model = favouring_seven(plain)
    loader = t.DataLoader(t.TokenStream([np.full(200, 7, dtype=np.uint16)]), 2, 16, 0, 1)
    val_losses = [t.estimate_val_loss(m, loader, evaluation_config(), t.Launch()) for m in (plain, model)]
    assert val_losses[1] < val_losses[0], f"the validation loss must fall with the edit to GPT.logits: {val_losses}"
    tokens = torch.tensor([[1, 2, 3, 8, 8, 8], [1, 2, 3, 8, 8, 8], [1, 2, 3, 7, 7, 7], [1, 2, 3, 8, 8, 8]])
    mask = torch.zeros_like(tokens)
    mask[:, 3:] = 1  # the endings: only ending 2, all sevens, is likely under the edited logits
    scores = t.evaluate_hellaswag(model, [(tokens, mask, torch.tensor([2]))], evaluation_config(), t.Launch())
    assert (scores["hellaswag_acc"], scores["hellaswag_acc_norm"]) == (1.0, 1.0)
    for way in SAMPLING:
        assert t.generate(model, [1, 2, 3], 6, 2, 1.0, 5, 0, contextlib.nullcontext, next_token(model, way)) == [
            [7] * 6] * 2, way
    assert_loss_falls_when_the_target_logit_rises(plain)


def output_of(returned):
    """What a hacker's attention or Block returns, or its first part: the output (a value residual returns the first
    block's values after it)."""
    return returned if torch.is_tensor(returned) else returned[0]


def with_output(returned, output):
    """returned with output in place of its own."""
    return output if torch.is_tensor(returned) else (output, *returned[1:])


class Around(torch.nn.Module):
    """A test's module around the hacker's (theirs), in the hacker's Block and GPT: an attribute it lacks is theirs
    (an MoE's aux_loss, which the hacker's GPT.forward reads; a block's mlp)."""

    def __init__(self, theirs):
        super().__init__()
        self.theirs = theirs

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)  # its parameters and modules
        except AttributeError:
            return getattr(self.theirs, name)


class StandIn(Around):
    """A test's module (own) in place of the hacker's (theirs): theirs runs beside it on the same inputs (never with
    the cache, which own fills) for what it returns after its output (a value residual's values) or sets (an MoE's
    aux_loss); own's output takes the place of theirs."""

    def __init__(self, own, theirs):
        super().__init__(theirs)
        self.own = own

    def forward(self, *args, **kwargs):
        def uncached(value):
            return None if isinstance(value, t.KVCache) else value
        returned = self.theirs(*map(uncached, args), **{name: uncached(value) for name, value in kwargs.items()})
        return with_output(returned, self.own(*args, **kwargs))


class GroupedQueryAttention(torch.nn.Module):
    """A hacker's attention: 4 query heads share 2 key/value heads, computed in float32 even under autocast. It
    writes its keys and values into its layer's cache as CausalSelfAttention does, and takes and ignores any
    argument a hacker's Block adds after the cache."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, 2, config.n_embd // config.n_head
        self.q = torch.nn.Linear(config.n_embd, config.n_embd)
        self.kv = torch.nn.Linear(config.n_embd, 2 * self.n_kv_head * self.head_dim)
        self.c_proj = torch.nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, positions, tokens, cache=None, *added, **added_by_name):
        B, T, C = x.shape
        q = self.q(x).float().view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).float().view(B, T, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)
        key_positions = positions
        if cache is not None:  # (B, 2, block_size, head_dim)
            k, v, tokens, key_positions = cache.update(positions, tokens, k, v)
        k, v = (kv.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for kv in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=t.visible(positions, key_positions, tokens))
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_takes_its_shape_and_dtype_from_attention(dtype):
    """The cache was sized from n_head and made in autocast's dtype: grouped-query attention trained, then crashed
    at the first sample, and so did keys kept in float32 under bfloat16. Now the same tokens with and without the
    cache, eager and compiled, and the caches in attention's shape and dtype."""
    assert_the_cache_follows_grouped_query_attention(dtype)


def assert_the_cache_follows_grouped_query_attention(dtype, with_compile=True):
    """generate() with grouped-query attention (standing in for the hacker's) gives the same tokens without the cache,
    with it and (with_compile) with the compiled step, whose caches (or else the eager ones) hold attention's 2
    key/value heads in float32."""
    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=64))
    for block in model.transformer.h:
        block.attn = StandIn(GroupedQueryAttention(model.config), block.attn)
    trained_as_main_trains(model)
    with torch.no_grad():  # logits far apart, as a trained model's: bf16's rounding picks no other token
        model.transformer.wte.weight.normal_(0.0, 1.0)
    autocast = lambda: torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)  # noqa: E731
    tokens, filled = {}, None
    for way in SAMPLING[: 3 if with_compile else 2]:
        sampler = next_token(model, way)
        tokens[way] = t.generate(model, [1, 2, 3], 12, 3, 1.0, 20, 7, autocast, sampler)
        filled = getattr(sampler, "caches", filled)  # the last way's: compiled, or eager with the cache
    assert all(sampled == tokens["uncached"] for sampled in tokens.values()), tokens
    assert [(tuple(cache.keys.shape), cache.keys.dtype) for cache in filled] == [((3, 2, 32, 8), torch.float32)] * 2


def test_a_training_step_validation_and_generation_run_under_bfloat16_autocast(one_thread):
    """The GPU's precision on a CPU: a step's loss within bf16's rounding of float32's, the same validation windows,
    generation with and without the cache, and the cached logits within bf16's rounding of the uncached ones."""
    assert_every_path_runs_under_bfloat16(tiny_model)


def test_resuming_goes_on_exactly_as_a_run_never_stopped(one_thread, tmp_path):
    from conftest import TINY_ARGS

    def train(name, *flags):
        return t.main(t.parse_args(TINY_ARGS + ["--max_steps", "4", "--log_dir", str(tmp_path / name), *flags]))

    straight = train("straight")
    train("resumed", "--stop_after_steps", "2")
    resumed = train("resumed", "--resume", "auto")
    assert [r["train_loss"] for r in resumed.run.records if "train_loss" in r] == \
        [r["train_loss"] for r in straight.run.records if "train_loss" in r][2:]
    for (name, parameter), resumed_parameter in zip(straight.model.named_parameters(), resumed.model.parameters(),
                                                    strict=True):
        torch.testing.assert_close(resumed_parameter, parameter, rtol=0, atol=0, msg=named(name))


# ------------------------------ scratch edits that prove the checks above: what a hacker's edit would be

def rotate(x, positions):
    """Rotary embedding: each pair of x's (B, heads, T, head_dim) channels turned by angles that grow with the
    position (T,), so that q . k depends on how far apart their positions are."""
    half = x.size(-1) // 2
    angles = positions.float()[:, None] / 10000 ** (torch.arange(half, device=x.device) / half)  # (T, half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RotaryAttention(Around):
    """The hacker's attention with q and k rotated by their positions (rotary embeddings, beside the learned ones):
    its own forward runs, given every argument, with a c_attn whose queries and keys come out rotated, in heads of
    the config's head_dim (keys of fewer heads too, as in multi-query attention)."""

    def __init__(self, attention, config):
        super().__init__(attention)
        self.head_dim = config.n_embd // config.n_head

    def rotary_positions(self, positions, T):
        return positions

    def forward(self, x, positions, *args, **kwargs):
        at = self.rotary_positions(positions, x.size(1))
        c_attn = turning(self.theirs.c_attn, self.head_dim, lambda q, k: (rotate(q, at), rotate(k, at)))
        return type(self.theirs).forward(Seen(self.theirs, c_attn=c_attn), x, positions, *args, **kwargs)


class RotaryFromZero(RotaryAttention):
    """The bug: rotary angles from torch.arange(T), ignoring `positions`. Training and the uncached forward never
    notice (there the positions are 0 to T - 1); a one-token step past the prompt is rotated as position 0."""

    def rotary_positions(self, positions, T):
        return torch.arange(T, device=positions.device)


class SwiGLU(torch.nn.Module):
    """LLaMA's MLP: silu(x W_gate) * (x W_up), then down; 2/3 of the width, for GPT-2's MLP's parameters."""

    def __init__(self, config):
        super().__init__()
        hidden = 4 * config.n_embd * 2 // 3
        self.c_fc = torch.nn.Linear(config.n_embd, 2 * hidden, bias=False)  # gate and up in one matmul
        self.c_proj = torch.nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x):
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up)


def tiny_model_with(attention=None, mlp=None, vocab_size=64, seed=0):
    """tiny_model with each block's attention and/or MLP made by attention(the hacker's, config) or mlp(...), around
    the hacker's or standing in for it, and initialised as GPT initialises."""
    model = tiny_model(vocab_size=vocab_size, seed=seed)
    for block in model.transformer.h:
        block.attn = attention(block.attn, model.config) if attention else block.attn
        block.mlp = mlp(block.mlp, model.config) if mlp else block.mlp
    torch.manual_seed(seed)
    model.reset_parameters()
    return trained_as_main_trains(model)


def test_the_cache_check_fails_for_rotary_attention_that_counts_its_positions_from_zero():
    """Scratch edit: rotary attention fed `positions` passes the cache check; the same attention taking its angles
    from torch.arange(T) gives the uncached forward's logits exactly (training cannot see the bug) and fails the
    cache check at the first one-token step, position 5, with a message naming the cache and the position."""
    correct, from_zero = tiny_model_with(RotaryAttention), tiny_model_with(RotaryFromZero)
    assert_cache_equals_no_cache(correct)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(correct(idx), from_zero(idx))
    assert_causal(from_zero)
    with pytest.raises(AssertionError, match=r"^with the KV cache, the logits at position 5 differ from the uncached "
                                             r"forward's by [0-9.e-]+ \(allowed: 1e-05 \+ 0 x \|logit\|\), in a "
                                             r"one-token step"):
        assert_cache_equals_no_cache(from_zero)


def test_a_swiglu_mlp_passes_every_check_a_hacker_runs(one_thread):
    """Scratch edit: a SwiGLU MLP standing in for the file's is causal, gives the uncached logits with the cache
    (float32, to 1e-5), runs every path under bf16 with the cached logits within bf16's rounding, takes its loss
    (plain and chunked) from GPT.logits, and its chunked loss and gradients are the plain ones."""
    def make_model(vocab_size=64):
        return tiny_model_with(mlp=lambda mlp, config: StandIn(SwiGLU(config), mlp), vocab_size=vocab_size)

    assert_causal(make_model())
    assert_cache_equals_no_cache(make_model())
    assert_every_path_runs_under_bfloat16(make_model)
    assert_loss_falls_when_the_target_logit_rises(make_model())
    assert_chunked_loss_equals_the_plain_loss_and_gradients(7, make_model)


# ------------------------------ which keys a query sees, edited in the one place (issue 55)
# The file's visible() may be a hacker's already: these tests make their own edits at run time, over it (never in the
# file's text), and take the positions they expect from the masks.

@contextlib.contextmanager
def visible_as(mask):
    """train_gpt2 as if visible() were mask, until the block ends; yields the file's own. Build the models inside:
    use_fused_causal (trained_as_main_trains) asks visible_is_causal(), cached by block_size, whether attention may
    leave the mask to SDPA's causal kernel, and sets it on the attention modules there and then."""
    files = t.visible
    t.visible = mask
    t.visible_is_causal.cache_clear()
    try:
        yield files
    finally:
        t.visible = files
        t.visible_is_causal.cache_clear()


# <|endoftext|>'s id, taken once from the file's tokenizer (whichever it names), as a hacker's mask would take it:
# torch.compile cannot trace the tokenizer's load inside forward. document_mask's lines read as they would in the file.
END_OF_TEXT = t.tokenizer().eot_token


def gpt2_mask(query_positions, key_positions, key_tokens):  # GPT-2's visible(): itself and earlier
    return key_positions <= query_positions[:, None]


def sliding_window(query_positions, key_positions, key_tokens):  # README.md's edit of visible()'s return line
    return (key_positions <= query_positions[:, None]) & (query_positions[:, None] - key_positions < 16)


def document_mask(query_positions, key_positions, key_tokens):  # within documents: <|endoftext|> starts one
    documents = (key_tokens == END_OF_TEXT).cumsum(-1)  # (B, Tk): each key's document
    same = documents[:, query_positions, None] == documents[:, None, :]  # (B, Tq, Tk)
    return ((key_positions <= query_positions[:, None]) & same)[:, None]


MASKS = {"sliding_window": sliding_window, "document_mask": document_mask}


def first_query_seeing_otherwise(mask, other, tokens) -> int | None:
    """The first query position that the two masks show different keys, in any row of tokens (B, T); None: none."""
    at = torch.arange(tokens.size(1))
    differs = (mask(at, at, tokens) != other(at, at, tokens)).any(-1)  # (Tq,) or (B, 1, Tq)
    positions = differs.reshape(-1, len(at)).any(0).nonzero()
    return int(positions[0]) if len(positions) else None


def with_documents(length=64, every=13):
    """(2, length) tokens below 300, with <|endoftext|> every `every` tokens from a different start in each row."""
    tokens = torch.randint(0, 300, (2, length), generator=torch.Generator().manual_seed(0))
    tokens[0, 5::every], tokens[1, 9::every] = END_OF_TEXT, END_OF_TEXT
    return tokens


def tiny_model_64(seed=0):
    """tiny_model with 64 positions and the tokenizer's padded vocabulary, for with_documents()."""
    torch.manual_seed(seed)
    vocab_size = t.machine_choices(t.TrainConfig(device="cpu"), t.Launch()).vocab_size  # GPT-2's: 50304
    return trained_as_main_trains(t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64,
                                                    vocab_size=vocab_size)))


def assert_cache_equals_no_cache_over(model, tokens, prompt_length=7):
    """assert_cache_equals_no_cache on these tokens: the prompt's pass, then a token at a time, to 1e-5."""
    with torch.no_grad():
        uncached = model.eval()(tokens)
        caches = t.kv_caches(model)
        pieces = [model.logits(model.hidden_states(tokens[:, :prompt_length], caches, torch.arange(prompt_length)))]
        for position in range(prompt_length, tokens.size(1)):
            pieces.append(model.logits(model.hidden_states(tokens[:, position:position + 1], caches,
                                                           torch.tensor([position]))))
    difference = (torch.cat(pieces, dim=1) - uncached).abs().amax(dim=(0, 2))  # (T,)
    if (difference > 1e-5).any():
        first = int((difference > 1e-5).nonzero()[0])
        raise AssertionError(f"with the KV cache, the logits at position {first} differ from the uncached "
                             f"forward's by {difference[first].item():.3g}")


def assert_recompute_changes_nothing(make_model, tokens):
    """--recompute's loss and gradients (recompute_blocks on one of two models make_model() gives alike) are the
    plain model's, bit for bit."""
    results = []
    for recompute in (False, True):
        model = make_model().train()
        if recompute:
            t.recompute_blocks(model)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.item(), gradients(model)))
    assert results[0][0] == results[1][0], f"the loss with --recompute: {results[1][0]}, without: {results[0][0]}"
    for name, plain in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], plain, rtol=0, atol=0, msg=named(name))


@pytest.mark.parametrize("edit", MASKS)
def test_a_sliding_window_or_document_mask_edited_in_visible_reaches_training_the_cache_and_recompute(one_thread,
                                                                                                    edit):
    """A 16-token window, or attention within documents (<|endoftext|> starts one), as visible(): the uncached
    forward (training, validation, HellaSwag) obeys it, the cache gives its logits over 64 tokens (4 windows, 4 or 5
    documents a row) in float32 to 1e-5, and --recompute trains the same, bit for bit. The logits are the file's own
    model's up to the first position whose keys the edit changes, and differ from there."""
    tokens = with_documents()
    with torch.no_grad():
        files_logits = tiny_model_64().eval()(tokens)
    first = first_query_seeing_otherwise(t.visible, MASKS[edit], tokens)  # None: the file has this edit already
    with visible_as(MASKS[edit]):
        assert not t.visible_is_causal(64)  # every path passes the mask: no fused causal kernel
        model = tiny_model_64()
        assert not any(getattr(module, "fused_causal", False) for module in model.modules())
        with torch.no_grad():
            logits = model.eval()(tokens)
        where = "the file's visible() is this mask" if first is None else f"the masks differ from position {first}"
        torch.testing.assert_close(logits[:, :first], files_logits[:, :first], rtol=0, atol=1e-6,
                                   msg=named(f"the logits where the file's model sees the same keys ({where})"))
        if first is not None:  # training sees the edit
            assert not torch.allclose(logits[:, first:], files_logits[:, first:], atol=1e-3), (
                f"the edit shows the queries from position {first} on other keys, yet the uncached forward's logits "
                f"there are the file's own model's: training does not ask visible()")
        assert_causal(model)
        assert_cache_equals_no_cache_over(model, tokens)
        assert_recompute_changes_nothing(tiny_model_64, tokens)


def test_a_mask_keyed_on_a_token_id_beyond_the_block_size_reaches_training(one_thread):
    """Documents split at newlines (token 198), in a model of 64 positions: visible_is_causal() asked visible() with
    the ids 0 to 63 and <|endoftext|> alone, called the mask causal, and training ran SDPA's causal kernel without
    it (the cache applied it). Now training's logits (attention's fused_causal set as main() sets it) are the mask's,
    as attention gives them with the mask passed."""
    def newline_documents(query_positions, key_positions, key_tokens):
        documents = (key_tokens == 198).cumsum(-1)  # (B, Tk)
        same = documents[:, query_positions, None] == documents[:, None, :]
        return ((key_positions <= query_positions[:, None]) & same)[:, None]

    tokens = with_documents()
    tokens[:, 20::11] = 198
    with visible_as(newline_documents), torch.no_grad():
        model = tiny_model_64().eval()
        trained_on = model(tokens)
        for block in model.transformer.h:
            block.attn.fused_causal = False  # the mask made and passed, on every call
        torch.testing.assert_close(trained_on, model(tokens), rtol=0, atol=1e-6,
                                   msg="training's forward ignores a mask keyed on token 198")


def test_a_window_in_trainings_mask_alone_fails_the_cache_check():
    """The naive edit: a 4-token window written where training's attention makes its mask, beside visible() rather
    than in it. Training obeys it, sampling with the cache asks visible() alone: the cache check names the first
    position whose keys the window takes away."""
    tokens, files = with_documents(), t.visible

    def windowed(query_positions, key_positions, key_tokens):  # training's mask: the file's, 4 positions back
        return files(query_positions, key_positions, key_tokens) & (query_positions[:, None] - key_positions < 4)

    first = first_query_seeing_otherwise(files, windowed, tokens)
    if first is None:
        pytest.skip("the file's visible() hides every key 4 positions back already: the window would change nothing")

    class WindowInTrainingsMaskAlone(t.CausalSelfAttention):
        def forward(self, x, positions, tokens, cache=None, *added, **added_by_name):
            with contextlib.nullcontext() if cache is None else visible_as(files):  # the cache's: the file's mask
                return super().forward(x, positions, tokens, cache, *added, **added_by_name)

    with visible_as(windowed):  # built and run with training's window
        model = tiny_model_64()
        for block in model.transformer.h:
            block.attn = WindowInTrainingsMaskAlone(model.config)
        trained_as_main_trains(model)
        with pytest.raises(AssertionError, match=rf"^with the KV cache, the logits at position {first} differ"):
            assert_cache_equals_no_cache_over(model, tokens)


def test_a_document_mask_whose_tokens_recompute_does_not_pass_fails_the_recompute_check(one_thread, monkeypatch):
    """The naive edit: recompute's checkpoint call given the block's arguments without the tokens the mask reads
    (zeros here: one document), as an argument list of its own would: --recompute trains another model."""
    checkpoint = torch.utils.checkpoint.checkpoint

    def without_the_tokens(function, *args, **kwargs):  # each (B, T) integer tensor passed as zeros
        return checkpoint(function, *(torch.zeros_like(a) if torch.is_tensor(a) and a.dim() == 2
                                      and not a.is_floating_point() else a for a in args), **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", without_the_tokens)
    with visible_as(document_mask), pytest.raises(AssertionError, match="the loss with --recompute"):
        assert_recompute_changes_nothing(tiny_model_64, with_documents())


def test_validation_and_hellaswag_score_the_logits_cross_entropy_whatever_the_training_loss_adds():
    """Label smoothing and an auxiliary loss in forward change training's loss, not the validation loss or HellaSwag:
    those stay comparable across runs. The loss checks above skip such a model, saying why."""
    import numpy as np

    class SmoothedLoss(t.GPT):  # a hacker's forward: its loss smoothed, plus an auxiliary loss
        def forward(self, idx, targets=None):
            if targets is None:
                return super().forward(idx)
            x = self.hidden_states(idx)
            loss = F.cross_entropy(self.logits(x).flatten(0, 1).float(), targets.flatten(), label_smoothing=0.1)
            return loss + 0.01 * x.pow(2).mean()

    plain = tiny_model_64()
    edited = trained_as_main_trains(SmoothedLoss(plain.config))
    edited.load_state_dict(plain.state_dict())
    tokens = with_documents()
    assert edited(tokens[:, :-1], tokens[:, 1:]).item() != plain(tokens[:, :-1], tokens[:, 1:]).item()
    loader = lambda: t.DataLoader(t.TokenStream([tokens.flatten().numpy().astype(np.uint16)]), 2, 16, 0, 1)  # noqa: E731
    val_losses = [t.estimate_val_loss(m, loader(), evaluation_config(), t.Launch()) for m in (edited, plain)]
    assert val_losses[0] == val_losses[1]
    mask = torch.zeros(4, 12, dtype=torch.long)
    mask[:, 6:] = 1
    batch = [(tokens[:, :12].repeat(2, 1), mask, torch.tensor([1]))]
    scores = [t.evaluate_hellaswag(m, batch, evaluation_config(), t.Launch()) for m in (edited, plain)]
    assert scores[0] == scores[1]
    with pytest.raises(pytest.skip.Exception, match="assumes the training loss is the logits' cross-entropy"):
        assert_loss_falls_when_the_target_logit_rises(edited)


# ------------------------------ right edits of the file pass the tests above (issue 61)
# Each edit as the file would hold it, made at run time; the tests that once failed it run on it here and pass.

def passes(test, *args):
    """Run a test function of this file: it must pass, not skip, unless the hacker's file lacks what it assumes (a
    loss that is the logits' cross-entropy, say): then the caller skips too, saying why."""
    try:
        test(*args)
    except pytest.skip.Exception as skipped:
        if not getattr(skipped, "premise_gone", False):
            pytest.fail(f"{test.__name__} skipped: {skipped.msg}")
        raise


@pytest.mark.parametrize("edit", MASKS)
def test_the_mask_tests_pass_a_file_whose_visible_is_edited_already(one_thread, edit):
    """README.md's window, or the document mask, in the file's visible(): the tests above make their edits over it
    and pass (they replaced the file's text, which no longer held GPT-2's line, and expected GPT-2's positions)."""
    with visible_as(MASKS[edit]):
        for mask in MASKS:
            passes(test_a_sliding_window_or_document_mask_edited_in_visible_reaches_training_the_cache_and_recompute,
                   None, mask)
        passes(test_a_window_in_trainings_mask_alone_fails_the_cache_check)
        with pytest.MonkeyPatch.context() as monkeypatch:
            passes(test_a_document_mask_whose_tokens_recompute_does_not_pass_fails_the_recompute_check, None,
                   monkeypatch)
        passes(test_attention_is_causal)


def gain_edit(monkeypatch):
    """A hacker's edit of the file's classes, whatever they are now: attention takes an argument of its own after all
    it took, a gain on its output, and Block passes it 0.5. Returns the attention's class."""
    attention, block = t.CausalSelfAttention, t.Block

    class GainAttention(attention):
        def forward(self, *args, **kwargs):
            *args, gain = args
            returned = attention.forward(self, *args, **kwargs)
            return with_output(returned, gain * output_of(returned))

    class BlockPassingAGain(block):
        def forward(self, *args, **kwargs):
            def attn(*given, **named):
                return self.attn(*given, 0.5, **named)
            return block.forward(Seen(self, attn=attn), *args, **kwargs)

    monkeypatch.setattr(t, "CausalSelfAttention", GainAttention)
    monkeypatch.setattr(t, "Block", BlockPassingAGain)
    return GainAttention


def test_the_cache_tests_pass_a_block_that_gives_attention_a_new_argument(monkeypatch):
    """The tests' own attention classes took 4 arguments and failed with a TypeError; the rotary one passes more on
    to the hacker's attention, which it wraps, the grouped-query one takes and ignores them."""
    gain_attention = gain_edit(monkeypatch)
    assert isinstance(tiny_model().transformer.h[1].attn, gain_attention)
    passes(test_the_cache_check_fails_for_rotary_attention_that_counts_its_positions_from_zero)
    for dtype in (torch.float32, torch.bfloat16):  # eager: the compiled step samples as eager does (14 s more)
        assert_the_cache_follows_grouped_query_attention(dtype, with_compile=False)


class OneBlockGPT(t.GPT):
    """A hacker's GPT whose layers are one block run n_layer times (its weights shared across depth)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.transformer.h = torch.nn.ModuleList([self.transformer.h[0]] * config.n_layer)


def test_the_recompute_test_passes_one_block_repeated_in_every_layer(one_thread, monkeypatch):
    """It hooked the repeated block once a layer, and counted each call twice."""
    monkeypatch.setattr(t, "GPT", OneBlockGPT)
    blocks = tiny_model().transformer.h
    assert blocks[0] is blocks[1]
    passes(test_recompute_runs_each_block_again_in_backward_for_the_same_loss_and_gradients, None)


class ScaledBlock(Around):
    """A hacker's block: the file's Block, its update to the residual stream scaled by a learned scalar, where
    `scaled`."""

    def __init__(self, config, scaled=True):
        super().__init__(t.Block(config))
        self.scale, self.scaled = torch.nn.Parameter(torch.ones(())), scaled

    def forward(self, x, *args, **kwargs):
        returned = self.theirs(x, *args, **kwargs)
        update = output_of(returned) - x
        return with_output(returned, x + (self.scale * update if self.scaled else update))


class FirstBlockUnscaledGPT(t.GPT):
    """A hacker's GPT of ScaledBlocks, the first one unscaled: its scalar gets no gradient."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.transformer.h = torch.nn.ModuleList(ScaledBlock(config, scaled=layer > 0)
                                                 for layer in range(config.n_layer))
        self.reset_parameters()


def test_the_gradient_tests_pass_a_parameter_that_gets_no_gradient(one_thread, monkeypatch):
    """They copied each parameter's gradient and crashed on None; now a None matches a None alone (assert_close
    names the parameter whose gradient is None in one run only)."""
    monkeypatch.setattr(t, "GPT", FirstBlockUnscaledGPT)
    model, tokens = tiny_model_64(), with_documents()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert model.transformer.h[0].scale.grad is None and model.transformer.h[1].scale.grad is not None
    passes(test_recompute_runs_each_block_again_in_backward_for_the_same_loss_and_gradients, None)
    for mask in MASKS:
        passes(test_a_sliding_window_or_document_mask_edited_in_visible_reaches_training_the_cache_and_recompute,
               None, mask)
    with pytest.MonkeyPatch.context() as patch:
        passes(test_a_document_mask_whose_tokens_recompute_does_not_pass_fails_the_recompute_check, None, patch)
    passes(test_chunked_loss_equals_the_plain_loss_and_gradients, 7)


def prefix_seen_both_ways(query_positions, key_positions, key_tokens):  # a prefix LM's: the first 12 see each other
    return (key_positions <= query_positions[:, None]) | (key_positions < 12)


def test_the_causality_test_skips_a_mask_that_is_not_causal_saying_why():
    with visible_as(prefix_seen_both_ways), pytest.raises(
            pytest.skip.Exception, match=r"^this check assumes a causal mask; visible\(\) shows the query at 0 the "
                                         r"later key at 10$"):
        test_attention_is_causal()


def test_the_causality_check_fails_for_attention_that_drops_its_mask(monkeypatch):
    """The wrong edit whose shapes all fit: attention that passes SDPA neither its mask nor is_causal sees later
    tokens, and the causality check names the positions."""
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, attn_mask=None, is_causal=False, **kwargs: sdpa(q, k, v, **kwargs))
    with pytest.raises(AssertionError, match=r"^the logits at positions 0-9 changed with the tokens after position 9"):
        assert_causal(tiny_model())


# ------------------------------ issue 69: right edits of the model's classes pass the tests above
# Each edit made on the file's classes at run time (their methods swapped for ones that run the file's own on the
# edit: whatever else the file holds stays), then the tests that failed it run and pass, or skip saying why.

def multi_query_edit(monkeypatch):
    """Multi-query attention: c_attn makes n_embd of queries, then one head of keys and one of values, shared by
    every query head (the file's forward runs with them repeated n_head times)."""
    attention = tiny_model().transformer.h[0].attn
    if attention.c_attn.out_features != 3 * 32:
        premise_gone(f"this edit makes GPT-2's attention multi-query; the file's c_attn makes "
                     f"{attention.c_attn.out_features} of width 32, not 3 x 32")
    init, forward = t.CausalSelfAttention.__init__, t.CausalSelfAttention.forward

    def multi_query_init(self, config):
        init(self, config)
        self.c_attn = torch.nn.Linear(config.n_embd, config.n_embd + 2 * config.n_embd // config.n_head)

    def multi_query_forward(self, x, positions, *args, **kwargs):
        def c_attn(x):
            q, k, v = queries_keys_values(self.c_attn(x), x.size(-1))
            return torch.cat([q, k.repeat(1, 1, self.n_head), v.repeat(1, 1, self.n_head)], dim=-1)
        return forward(Seen(self, c_attn=c_attn), x, positions, *args, **kwargs)

    monkeypatch.setattr(t.CausalSelfAttention, "__init__", multi_query_init)
    monkeypatch.setattr(t.CausalSelfAttention, "forward", multi_query_forward)


def test_the_tests_attention_takes_its_widths_from_a_multi_query_c_attn(monkeypatch):
    """The tests' rotary attention subclassed the hacker's, then split its c_attn's output by n_embd: 2 false alarms
    on multi-query attention. Now it wraps the hacker's attention and takes the keys' width from the output."""
    multi_query_edit(monkeypatch)
    assert tiny_model().transformer.h[0].attn.c_attn.out_features == 32 + 2 * 16
    passes(test_the_cache_check_fails_for_rotary_attention_that_counts_its_positions_from_zero)
    passes(test_the_cache_tests_pass_a_block_that_gives_attention_a_new_argument, monkeypatch)


def value_residual_edit(monkeypatch):
    """A value residual: each block's attention also gets v1, the first block's values (B, T, width), mixes them
    half and half into its own before the cache, and returns them after its output; Block takes and returns them,
    GPT.hidden_states hands them from block to block."""
    model = tiny_model()
    if not torch.is_tensor(model.transformer.h[0](torch.zeros(1, 2, 32), torch.arange(2), torch.zeros(1, 2).long())):
        premise_gone("this edit makes GPT-2's Block return the first block's values after x; the file's Block "
                     "returns more than x already")
    files_attention, files_block = t.CausalSelfAttention.forward, t.Block.forward
    files_hidden_states = t.GPT.hidden_states

    def attention_forward(self, x, positions, tokens, cache=None, v1=None):
        def c_attn(x):
            nonlocal v1
            q, k, v = queries_keys_values(self.c_attn(x), x.size(-1))
            v1 = v if v1 is None else v1
            return torch.cat([q, k, (v + v1) / 2], dim=-1)
        return files_attention(Seen(self, c_attn=c_attn), x, positions, tokens, cache), v1

    def block_forward(self, x, positions, tokens, cache=None, v1=None):
        def attn(*args):
            nonlocal v1
            y, v1 = self.attn(*args, v1)
            return y
        return files_block(Seen(self, attn=attn), x, positions, tokens, cache), v1

    def gpt_hidden_states(self, idx, caches=None, positions=None):
        v1 = None

        def passing_v1(block):
            def run(*args):
                nonlocal v1
                x, v1 = block(*args, v1)
                return x
            return run
        h = [passing_v1(block) for block in self.transformer.h]
        return files_hidden_states(Seen(self, transformer=Seen(self.transformer, h=h)), idx, caches, positions)

    monkeypatch.setattr(t.CausalSelfAttention, "forward", attention_forward)
    monkeypatch.setattr(t.Block, "forward", block_forward)
    monkeypatch.setattr(t.GPT, "hidden_states", gpt_hidden_states)


def test_the_tests_attention_and_blocks_pass_on_what_a_value_residual_adds(one_thread, monkeypatch):
    """The tests' own attention and blocks returned their output alone, or took 4 arguments: 5 false alarms on a
    value residual. Now they wrap the hacker's, or stand in beside it, and give back what it gives."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        files_logits = tiny_model()(tokens)
        value_residual_edit(monkeypatch)
        assert not torch.allclose(tiny_model()(tokens), files_logits, atol=1e-4)  # the same weights, mixed values
    for dtype in (torch.float32, torch.bfloat16):
        passes(test_the_cache_takes_its_shape_and_dtype_from_attention, dtype)
    passes(test_the_cache_check_fails_for_rotary_attention_that_counts_its_positions_from_zero)
    with pytest.MonkeyPatch.context() as patch:
        passes(test_the_cache_tests_pass_a_block_that_gives_attention_a_new_argument, patch)
    passes(test_the_gradient_tests_pass_a_parameter_that_gets_no_gradient, None, monkeypatch)


def mixture_of_experts_edit(monkeypatch):
    """A mixture of experts: each block's MLP routes each token to the one of 4 of the file's MLPs it rates best,
    scaled by that rate, and keeps Switch Transformer's load-balancing loss as aux_loss at each call; GPT.forward adds
    0.01 x each block's to the loss."""
    mlp, forward = t.MLP, t.GPT.forward

    class MixtureOfExperts(torch.nn.Module):
        def __init__(self, config, n_experts=4):
            super().__init__()
            self.router = torch.nn.Linear(config.n_embd, n_experts, bias=False)
            self.experts = torch.nn.ModuleList(mlp(config) for _ in range(n_experts))

        def forward(self, x):
            rates = F.softmax(self.router(x).float(), dim=-1)  # (B, T, n_experts)
            rate, choice = rates.max(dim=-1)
            chosen = F.one_hot(choice, len(self.experts)).float()  # (B, T, n_experts)
            self.aux_loss = len(self.experts) * (chosen.mean(dim=(0, 1)) * rates.mean(dim=(0, 1))).sum()
            return sum(expert(x) * (rate * chosen[..., i])[..., None] for i, expert in enumerate(self.experts))

    def with_aux_loss(self, idx, targets=None):
        returned = forward(self, idx, targets)  # the logits, or the loss
        return returned if targets is None else returned + 0.01 * sum(block.mlp.aux_loss for block in self.transformer.h)

    monkeypatch.setattr(t, "MLP", MixtureOfExperts)
    monkeypatch.setattr(t.GPT, "forward", with_aux_loss)


def test_the_tests_of_a_loss_with_an_auxiliary_term_skip_its_checks_saying_why(one_thread, monkeypatch):
    """A mixture of experts whose load-balancing loss GPT.forward adds: the SwiGLU test put its MLP in the MoE's place
    (no aux_loss), and a test of the tests failed on the loss checks' documented skip (so did label smoothing): 2
    false alarms. Now the SwiGLU stands in beside the MoE, runs every check but the loss's, and both skip those."""
    mixture_of_experts_edit(monkeypatch)
    for test, args in ((test_a_swiglu_mlp_passes_every_check_a_hacker_runs, [None]),
                       (test_the_gradient_tests_pass_a_parameter_that_gets_no_gradient, [None, monkeypatch])):
        with pytest.raises(pytest.skip.Exception, match=r"^this check assumes the training loss is the logits' "
                                                         r"cross-entropy"):
            test(*args)
