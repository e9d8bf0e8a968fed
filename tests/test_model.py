import math

import pytest
import torch

import train_gpt2 as t


def test_gpt2_shape_has_124439808_parameters():
    with torch.device("meta"):  # no memory, no init cost
        model = t.GPT(t.GPTConfig(*t.MODEL_SHAPES["gpt2"], block_size=1024, vocab_size=50257))
    assert t.count_parameters(model) == 124_439_808


def test_padded_vocab_adds_exactly_the_padding_rows():
    with torch.device("meta"):
        model = t.GPT(t.GPTConfig(*t.MODEL_SHAPES["gpt2"], block_size=1024, vocab_size=50304))
    assert t.count_parameters(model) == 124_439_808 + (50304 - 50257) * 768


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


def test_lm_head_is_tied_to_the_token_embedding():
    model = tiny_model()
    assert model.lm_head.weight is model.transformer.wte.weight


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


def test_flops_per_token_of_gpt2_is_about_860_million():
    config = t.GPTConfig(*t.MODEL_SHAPES["gpt2"], block_size=1024, vocab_size=50304)
    flops = t.flops_per_token(config, 124_475_904, seq_len=1024)
    assert flops == 6 * 124_475_904 + 12 * 12 * 1024 * 768
    assert round(flops / 1e6) == 860
