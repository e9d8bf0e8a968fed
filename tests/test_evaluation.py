"""HellaSwag, OpenAI's weights, generation with a KV cache, the loss plot."""

import contextlib
import json

import pytest
import torch
import torch.nn.functional as F

import train_gpt2 as t
from conftest import TINY_ARGS, run_python, run_script
from test_ddp import ONE_THREAD, torchrun
from test_model import tiny_model

TOKENIZER = t.gpt2_tokenizer()


def test_render_hellaswag_exact_tokens_and_mask():
    example = {"ctx": "The cat sat on the", "endings": ["mat.", "dog", "dog dog dog", "dog la la la la"], "label": 0}
    tokens, mask, label = t.render_hellaswag(example, TOKENIZER)
    context = [464, 3797, 3332, 319, 262]  # "The cat sat on the"
    assert tokens.tolist() == [
        context + [2603, 13, 0, 0, 0],  # " mat." then padding
        context + [3290, 0, 0, 0, 0],  # " dog"
        context + [3290, 3290, 3290, 0, 0],
        context + [3290, 8591, 8591, 8591, 8591],  # " dog la la la la"
    ]
    assert mask.tolist() == [[0] * 5 + m for m in ([1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1] * 5)]
    assert label == 0


def test_scores_equal_an_independent_per_ending_loss():
    model = tiny_model(vocab_size=50257, seed=3)
    example = {"ctx": "The cat sat on the", "endings": ["mat.", "dog", "dog dog dog", "dog la la la la"], "label": 2}
    context = TOKENIZER.encode_ordinary(example["ctx"])
    sums, means = [], []
    with torch.no_grad():
        for ending in example["endings"]:  # each ending alone, unpadded
            ending_tokens = TOKENIZER.encode_ordinary(" " + ending)
            row = torch.tensor([context + ending_tokens])
            losses = F.cross_entropy(model(row)[0, :-1], row[0, 1:], reduction="none")[len(context) - 1 :]
            assert len(losses) == len(ending_tokens)
            sums.append(losses.sum().item())
            means.append(losses.mean().item())
    tokens, mask, _ = t.render_hellaswag(example, TOKENIZER)
    by_sum, by_mean = t.hellaswag_choices(model, tokens, mask, contextlib.nullcontext)
    assert by_sum == min(range(4), key=sums.__getitem__)
    assert by_mean == min(range(4), key=means.__getitem__)


class EasyLaModel(torch.nn.Module):
    """Uniform logits, except that the token " la" (8591) is easy to predict: each costs about 1.19 instead of
    ln(50257) = 10.82. So " dog" (one hard token) has the lowest summed loss and " dog la la la la" (one hard,
    four easy) the lowest mean loss: acc and acc_norm pick different endings."""

    config = t.GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=64, vocab_size=50257)

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, 50257)
        logits[:, :, 8591] = 10.0
        return logits


def test_acc_by_summed_loss_and_acc_norm_by_mean_loss_differ():
    endings = ["dog", "dog dog dog", "dog la la la la", "dog dog dog dog dog dog"]
    examples = [{"ctx": "The cat sat on the", "endings": endings, "label": label} for label in (0, 0, 2)]
    scores = t.evaluate_hellaswag(EasyLaModel(), examples, TOKENIZER, "cpu", contextlib.nullcontext, t.Launch())
    assert scores == {"hellaswag_examples": 3, "hellaswag_acc": 2 / 3, "hellaswag_acc_norm": 1 / 3}


def write_hellaswag(path, count):
    endings = ["dog", "dog dog dog", "dog la la la la", "mat."]
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"ctx": f"Example {i}: the cat sat on the", "endings": endings, "label": i % 4}) + "\n")
    return path


def test_eval_only_gives_the_same_counts_in_one_and_two_processes(tmp_path):
    """5 examples: rank 0 scores 3, rank 1 scores 2; the summed counts equal one process's."""
    args = ["train_gpt2.py"] + TINY_ARGS + ["--eval_only", "--eval_steps", "1", "--log_dir", str(tmp_path),
                                           "--hellaswag_path", str(write_hellaswag(tmp_path / "hs.jsonl", 5))]
    one = run_python(args, env=ONE_THREAD)
    two = torchrun(2, args)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    one_line = [line for line in one.stdout.splitlines() if line.startswith("val loss")]
    assert one_line[0].endswith("over 5 examples")
    assert [line for line in two.stdout.splitlines() if line.startswith("val loss")] == one_line


def test_hellaswag_during_training_is_logged(tmp_path):
    path = write_hellaswag(tmp_path / "hs.jsonl", 3)
    result = t.main(t.parse_args(TINY_ARGS + ["--max_steps", "4", "--hellaswag_every", "2", "--hellaswag_path",
                                              str(path), "--log_dir", str(tmp_path / "log")]))
    scored = [r for r in result.records if "hellaswag_acc_norm" in r]
    assert [r["step"] for r in scored] == [1, 3]
    assert all(r["hellaswag_examples"] == 3 and r["hellaswag_acc"] in (0, 1 / 3, 2 / 3, 1) for r in scored)


def one_line_exit(capsys, args):
    with pytest.raises(SystemExit) as stopped:
        t.main(t.parse_args(args))
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_hellaswag_offline_without_a_local_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(t, "HELLASWAG_URL", "http://127.0.0.1:9/hellaswag_val.jsonl")  # refused at once
    monkeypatch.setattr(t, "HELLASWAG_CACHE", str(tmp_path / "cache" / "hellaswag_val.jsonl"))
    line = one_line_exit(capsys, TINY_ARGS + ["--hellaswag_every", "1", "--log_dir", str(tmp_path)])
    assert line.startswith("error: could not download http://127.0.0.1:9/hellaswag_val.jsonl to ")
    assert line.endswith("): pass --hellaswag_path with a local copy")


def test_hellaswag_file_with_a_bad_record(tmp_path, capsys):
    path = write_hellaswag(tmp_path / "hs.jsonl", 2)
    with open(path, "a") as f:
        f.write(json.dumps({"ctx": "three endings", "endings": ["a", "b", "c"], "label": 0}) + "\n")
    line = one_line_exit(capsys, TINY_ARGS + ["--eval_only", "--hellaswag_path", str(path), "--log_dir", str(tmp_path)])
    assert line == f"error: {path} line 3 is not a HellaSwag record (ctx, 4 endings, label 0-3)"


def test_openai_weights_through_transformers_give_the_same_logits():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=64)
    hf_model = transformers.GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():
        for parameter in hf_model.parameters():  # random everywhere, biases and LayerNorms too
            parameter.normal_(0.0, 0.1)
    ours = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    ours.load_state_dict(t.state_from_openai(hf_model.state_dict()))
    idx = torch.randint(0, 64, (3, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf_model(idx).logits, rtol=0, atol=1e-5)


def test_init_from_without_transformers_says_how_to_get_it(tmp_path):
    fake = tmp_path / "fake_modules" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('transformers is not installed')\n")
    result = run_script(["--init_from", "gpt2", "--generate", "--device", "cpu"],
                        env={"PYTHONPATH": str(tmp_path / "fake_modules")})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "error: --init_from gpt2 needs the transformers library: pip install transformers"


def test_init_from_gpt2_offline_says_so_in_one_line(monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")

    def offline(name):  # what from_pretrained raises when the hub cannot be reached and nothing is cached
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files of {name}.\nCheck your "
                      "internet connection.")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", offline)
    line = one_line_exit(capsys, ["--init_from", "gpt2", "--generate", "--device", "cpu"])
    assert line == ("error: cannot load gpt2 from the Hugging Face hub (We couldn't connect to 'https://huggingface.co' "
                    "to load the files of gpt2.): check the network")


def test_export_hf_gives_transformers_the_same_model(one_thread, tmp_path):
    transformers = pytest.importorskip("transformers")
    trained = t.main(t.parse_args(TINY_ARGS + ["--max_steps", "3", "--log_dir", str(tmp_path / "log")])).model
    t.main(t.parse_args(["--init_from", str(tmp_path / "log" / "ckpt_3.pt"), "--export_hf", str(tmp_path / "hf")]))
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert hf_model.config.vocab_size == 50257 and hf_model.config.n_positions == 64  # no padding rows
    assert hf_model.lm_head.weight.data_ptr() == hf_model.transformer.wte.weight.data_ptr()  # still tied
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trained.eval()(idx)[..., :50257]
        torch.testing.assert_close(hf_model.eval()(idx).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(hf_model.train()(idx).logits, ours, rtol=0, atol=1e-5)  # no dropout either


@pytest.mark.parametrize("flags", [["--export_hf", "hf"], ["--export_hf", "hf", "--init_from", "gpt2", "--generate"]])
def test_export_hf_without_a_checkpoint_or_with_another_mode_is_refused(capsys, flags):
    assert one_line_exit(capsys, flags) == (
        "error: --export_hf runs alone in one process and needs --init_from with the checkpoint to export: add it, "
        "drop --generate and --eval_only, and use python, not torchrun")


def test_export_hf_without_transformers_says_how_to_get_it(tmp_path):
    trained = tmp_path / "log" / "ckpt_2.pt"
    assert run_script(TINY_ARGS + ["--max_steps", "2", "--log_dir", str(tmp_path / "log")]).returncode == 0
    fake = tmp_path / "fake_modules" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('transformers is not installed')\n")
    result = run_script(["--init_from", str(trained), "--export_hf", str(tmp_path / "hf")],
                        env={"PYTHONPATH": str(tmp_path / "fake_modules")})
    assert result.returncode == 2 and result.stdout == "" and not (tmp_path / "hf").exists()
    assert result.stderr.strip() == "error: --export_hf needs the transformers library: pip install transformers"


def test_init_from_our_checkpoint_and_generate(one_thread, tmp_path):
    trained = t.main(t.parse_args(TINY_ARGS + ["--max_steps", "3", "--log_dir", str(tmp_path)]))
    args = ["--init_from", str(tmp_path / "ckpt_3.pt"), "--generate", "--device", "cpu", "--num_samples", "2",
            "--max_new_tokens", "5"]
    texts = t.main(t.parse_args(args))
    expected = t.generate(trained.model, TOKENIZER.encode_ordinary("Hello, I'm a language model,"), 2, 5, 1.0, 50,
                          1337, "cpu", contextlib.nullcontext)
    assert texts == ["Hello, I'm a language model," + TOKENIZER.decode(sample) for sample in expected]
    result = run_script(args + ["--no-kv_cache"], env=ONE_THREAD)
    assert result.returncode == 0, result.stderr
    assert [line.removeprefix(f"sample {i}: ") for i, line in enumerate(result.stdout.splitlines()[:2])] == texts
    assert "10 tokens in" in result.stdout and "(KV cache off, 1,637,248 parameters)" in result.stdout


def test_init_from_refuses_shape_flags(tmp_path):
    result = run_script(["--init_from", "gpt2", "--n_layer", "4", "--generate"])
    assert result.stderr.strip() == "error: --init_from gpt2 sets the model's shape: drop --n_layer"


def test_cached_decoding_gives_the_same_logits_and_tokens():
    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64))
    tokens = torch.randint(0, 64, (2, 20))
    cache = t.KVCache(2)
    with torch.no_grad():
        stepwise = [model(tokens[:, :12], cache=cache)[:, -1]]  # the prompt in one call
        stepwise += [model(tokens[:, i : i + 1], cache=cache)[:, -1] for i in range(12, 20)]  # then one at a time
        full = model(tokens)[:, 11:]
    torch.testing.assert_close(torch.stack(stepwise, dim=1), full, rtol=0, atol=1e-5)
    for length in (10, 50):  # 50 runs past block_size, where both reread the last 32 tokens
        with_cache = t.generate(model, [1, 2, 3], 3, length, 1.0, 20, 7, "cpu", contextlib.nullcontext, True)
        without = t.generate(model, [1, 2, 3], 3, length, 1.0, 20, 7, "cpu", contextlib.nullcontext, False)
        assert with_cache == without


def test_loss_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    t.main(t.parse_args(TINY_ARGS + ["--max_steps", "4", "--eval_every", "2", "--eval_steps", "1",
                                     "--log_dir", str(tmp_path)]))
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (900, 500)


def test_without_matplotlib_one_line_says_how_to_get_it(tmp_path):
    fake = tmp_path / "fake_modules" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    result = run_script(TINY_ARGS + ["--max_steps", "4", "--eval_every", "2", "--eval_steps", "1",
                                     "--log_dir", str(tmp_path / "log")], env={"PYTHONPATH": str(tmp_path / "fake_modules")})
    assert result.returncode == 0, result.stderr
    hint = f"{tmp_path / 'log' / 'loss.png'} not written: matplotlib is not installed (pip install matplotlib)"
    assert result.stdout.splitlines().count(hint) == 1
    assert not (tmp_path / "log" / "loss.png").exists()
