"""HellaSwag, OpenAI's weights, generation with a KV cache, export to transformers."""

import copy
import json
import os
import random
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import train_gpt2 as t
from conftest import ROOT, SHAKESPEARE, TINY_ARGS, run_script, single_thread
from test_cli import error_line_in_process
from test_ddp import torchrun
from test_model import document_mask, visible_as

TOKENIZER = t.CheckedRun.tokenizer()
CPU_FLOAT32 = t.TrainConfig(device="cpu", dtype="float32")  # evaluate_hellaswag's device, without autocast


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A folder holding ckpt_2.pt of TINY_ARGS --max_steps 2: the checkpoint the export tests start from, trained
    once for all of them (each copies the folder into its own tmp_path; none writes into it)."""
    log_dir = tmp_path_factory.mktemp("two_steps") / "log"
    t.main(t.parse_args(TINY_ARGS + ["--max_steps", "2", "--log_dir", str(log_dir)]))
    return log_dir


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """(folder holding ckpt_3.pt, the trained model) of TINY_ARGS --max_steps 3, trained once on one thread (as the
    one_thread fixture would) for the tests that start from it: each copies the folder, and calls .eval() on the
    model itself (no dropout: eval and train give the same logits)."""
    log_dir = tmp_path_factory.mktemp("three_steps") / "log"
    with single_thread():
        model = t.main(t.parse_args(TINY_ARGS + ["--max_steps", "3", "--log_dir", str(log_dir)])).model
    return log_dir, model


def copy_of(log_dir, tmp_path, name="log"):
    """The fixture's folder at tmp_path / name, as if this test's own run had written it there."""
    return Path(shutil.copytree(log_dir, tmp_path / name))


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
    assert label.tolist() == [0]  # a batch of one example


def made_up_examples(count, seed=0):
    """HellaSwag-like records of many lengths: contexts of 1 to 20 words, endings of 1 to 8."""
    words = "the cat sat on a mat and then dog ran far to see la who is my friend in town".split()
    rng = random.Random(seed)
    return [{"ctx": " ".join(rng.choices(words, k=rng.randint(1, 20))),
             "endings": [" ".join(rng.choices(words, k=rng.randint(1, 8))) for _ in range(4)], "label": 0}
            for _ in range(count)]


def one_ending_at_a_time(model, example):
    """(ending with the lowest summed loss, with the lowest mean loss), each ending scored alone and unpadded from
    the model's full logits: nothing shared with evaluate_hellaswag but the model."""
    context = TOKENIZER.encode_ordinary(example["ctx"])
    sums, means = [], []
    with torch.no_grad():
        for ending in example["endings"]:
            ending_tokens = TOKENIZER.encode_ordinary(" " + ending)
            row = torch.tensor([context + ending_tokens])
            losses = F.cross_entropy(model(row)[0, :-1], row[0, 1:], reduction="none")[len(context) - 1 :]
            assert len(losses) == len(ending_tokens)
            sums.append(losses.sum().item())
            means.append(losses.mean().item())
    return min(range(4), key=sums.__getitem__), min(range(4), key=means.__getitem__)


def test_batched_scores_equal_each_ending_scored_alone():
    """Batches of several examples, padded, logits only where an ending token is predicted: the same choice for
    every example as its endings scored one by one. Each example is labelled with its own expected choice, so a
    single wrong one (or one example's choice given to another) lowers the accuracy below 1."""
    torch.manual_seed(3)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=50257)).eval()
    examples = made_up_examples(24)
    expected = [one_ending_at_a_time(model, example) for example in examples]
    same = sum(by_sum == by_mean for by_sum, by_mean in expected) / len(examples)
    assert 0 < same < 1 and len({by_sum for by_sum, _ in expected}) > 1  # the choices differ, so the test can fail
    for labelled_by, scores in ((0, {"hellaswag_acc": 1.0, "hellaswag_acc_norm": same}),
                                (1, {"hellaswag_acc": same, "hellaswag_acc_norm": 1.0})):
        labelled = [{**example, "label": choices[labelled_by]} for example, choices in zip(examples, expected, strict=True)]
        batches = t.pack_hellaswag([t.render_hellaswag(example, TOKENIZER) for example in labelled], max_tokens=300)
        assert len(batches) > 4 and max(len(labels) for _, _, labels in batches) > 2  # really in batches
        assert t.evaluate_hellaswag(model, batches, CPU_FLOAT32, t.Launch()) == {
            "hellaswag_examples": 24, **scores}


@pytest.mark.parametrize("max_tokens", [40, 300])  # 40: most examples take more alone, and go alone
def test_pack_hellaswag_holds_each_example_once_within_the_token_budget(max_tokens):
    rendered = [t.render_hellaswag({**example, "label": i % 4}, TOKENIZER)
                for i, example in enumerate(made_up_examples(30, seed=1))]
    batches = t.pack_hellaswag(rendered, max_tokens)
    unpacked, lengths = [], []
    for tokens, mask, labels in batches:
        assert tokens.shape == mask.shape and tokens.size(0) == 4 * len(labels)
        assert tokens.numel() <= max_tokens or len(labels) == 1
        lengths.append(tokens.size(1))
        for i, label in enumerate(labels.tolist()):
            rows = slice(4 * i, 4 * i + 4)
            length = int(mask[rows].nonzero()[:, 1].max()) + 1  # the example's own length: its longest ending's end
            assert not tokens[rows, length:].any() and not mask[rows, length:].any()  # only padding after it
            unpacked.append((tokens[rows, :length].tolist(), mask[rows, :length].tolist(), label))
    assert lengths == sorted(lengths)  # shortest first: examples of like length share a batch
    as_lists = [(tokens.tolist(), mask.tolist(), label) for tokens, mask, label in rendered]
    assert sorted(unpacked) == sorted(as_lists)
    assert (len(batches) == len(rendered)) == (max_tokens == 40)


def easy_la_model():
    """A GPT whose logits are 0 for every token but " la" (8591), 10 for it, at every position: the final LayerNorm
    outputs its bias, (1, 0, ..., 0), and lm_head's first column is 10 on that row. Each " la" then costs about 1.19
    instead of ln(50257) = 10.82, so " dog" (one hard token) has the lowest summed loss and " dog la la la la"
    (one hard, four easy) the lowest mean loss: acc and acc_norm pick different endings."""
    model = t.GPT(t.GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=64, vocab_size=50257))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[8591, 0] = 10.0
    return model


def test_acc_by_summed_loss_and_acc_norm_by_mean_loss_differ():
    endings = ["dog", "dog dog dog", "dog la la la la", "dog dog dog dog dog dog"]
    examples = [{"ctx": "The cat sat on the", "endings": endings, "label": label} for label in (0, 0, 2)]
    batches = t.pack_hellaswag([t.render_hellaswag(example, TOKENIZER) for example in examples], max_tokens=1024)
    scores = t.evaluate_hellaswag(easy_la_model(), batches, CPU_FLOAT32, t.Launch())
    assert scores == {"hellaswag_examples": 3, "hellaswag_acc": 2 / 3, "hellaswag_acc_norm": 1 / 3}


def write_hellaswag(path, count):
    endings = ["dog", "dog dog dog", "dog la la la la", "mat."]
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"ctx": f"Example {i}: the cat sat on the", "endings": endings, "label": i % 4}) + "\n")
    return path


def test_eval_only_gives_the_same_counts_in_one_and_two_processes(one_thread, tmp_path, capsys):
    """5 examples: rank 0 scores 3, rank 1 scores 2; the summed counts equal one process's (this one, on one thread
    as torchrun's ranks are)."""
    args = TINY_ARGS + ["--eval_only", "--eval_steps", "1", "--log_dir", str(tmp_path),
                        "--hellaswag_path", str(write_hellaswag(tmp_path / "hs.jsonl", 5))]
    t.main(t.parse_args(args))
    one_stdout = capsys.readouterr().out
    two = torchrun(2, ["train_gpt2.py"] + args)
    assert two.returncode == 0, two.stderr
    one_line = [line for line in one_stdout.splitlines() if line.startswith("val loss")]
    assert one_line[0].endswith("over 5 examples")
    assert [line for line in two.stdout.splitlines() if line.startswith("val loss")] == one_line


def test_hellaswag_during_training_is_logged(tmp_path):
    path = write_hellaswag(tmp_path / "hs.jsonl", 3)
    result = t.main(t.parse_args(TINY_ARGS + ["--max_steps", "4", "--hellaswag_every", "2", "--hellaswag_path",
                                              str(path), "--log_dir", str(tmp_path / "log")]))
    scored = [r for r in result.run.records if "hellaswag_acc_norm" in r]
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
    assert line.endswith("): pass --hellaswag_path with a local copy of it")


@pytest.mark.parametrize("record", [
    {"ctx": "three endings", "endings": ["a", "b", "c"], "label": 0},
    {"ctx": "a string of 4 letters", "endings": "abcd", "label": 0},  # was read as the endings "a", "b", "c", "d"
    {"ctx": "endings that are no text", "endings": [1, 2, 3, 4], "label": 0},  # was a TypeError while scoring
    {"ctx": "label out of range", "endings": ["a", "b", "c", "d"], "label": 4},
])
def test_hellaswag_file_with_a_bad_record(tmp_path, capsys, record):
    path = write_hellaswag(tmp_path / "hs.jsonl", 2)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    line = one_line_exit(capsys, TINY_ARGS + ["--eval_only", "--hellaswag_path", str(path), "--log_dir", str(tmp_path)])
    assert line == f"error: {path} line 3 is not a HellaSwag record (ctx, 4 endings, label 0-3)"


def test_empty_hellaswag_file(tmp_path, capsys):
    path = tmp_path / "hs.jsonl"
    path.write_text("")  # scoring it divided by zero
    line = one_line_exit(capsys, TINY_ARGS + ["--eval_only", "--hellaswag_path", str(path), "--log_dir", str(tmp_path)])
    assert line == f"error: {path} holds no HellaSwag records: give hellaswag_val.jsonl's path"


@pytest.mark.parametrize("mode", [["--hellaswag_every", "2"], ["--eval_only"]])
def test_hellaswag_longer_than_the_model_is_refused_before_training_or_skipped_by_eval_only(tmp_path, capsys,
                                                                                            mode):
    """A model of 64 positions cannot read a 70-token example. Training used to stop with a ValueError traceback
    at the first HellaSwag evaluation, --hellaswag_every steps in, with nothing saved. --eval_only was refused too,
    with a fix that --init_from's shape forbids: it now gives the val loss and says why HellaSwag was skipped."""
    long_example = {"ctx": "the cat " * 30, "endings": ["sat", "ran", "sat on the mat", "la la la"], "label": 0}
    longest = t.render_hellaswag(long_example, TOKENIZER)[0].size(1)
    path = write_hellaswag(tmp_path / "hs.jsonl", 3)
    with open(path, "a") as f:
        f.write(json.dumps(long_example) + "\n")
    problem = (f"the longest HellaSwag example in {path} takes {longest} tokens, more than the model's block_size "
               f"of 64: HellaSwag needs --block_size {longest} or more")
    args = TINY_ARGS + mode + ["--hellaswag_path", str(path), "--log_dir", str(tmp_path)]
    if mode == ["--eval_only"]:  # an --init_from model's block_size is its own: the val loss, without HellaSwag
        result = t.main(t.parse_args(args))
        assert capsys.readouterr().out.endswith(f" | HellaSwag skipped: {problem}\n") and set(result) == {"val_loss"}
        return
    assert one_line_exit(capsys, args) == f"error: {problem}, or drop --hellaswag_every"
    metrics = tmp_path / "metrics.jsonl"
    assert longest > 64 and (not metrics.exists() or metrics.read_text() == "")  # not a step was trained


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
    result = run_script(["--init_from", "gpt2", "--generate", "--device", "cpu", "--log_dir", str(tmp_path / "log")],
                        env={"PYTHONPATH": str(tmp_path / "fake_modules")})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == "error: --init_from gpt2 needs the transformers library: pip install transformers"


def test_init_from_gpt2_offline_says_so_in_one_line(tmp_path):
    """Offline with nothing cached, transformers' hub client used to retry for 30 s and print 16 lines first."""
    pytest.importorskip("transformers")
    endpoint = "http://127.0.0.1:9"  # the discard port: refused at once, with or without a network
    result = run_script(["--init_from", "gpt2", "--generate", "--device", "cpu", "--log_dir", str(tmp_path / "log")],
                        env={"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf_home")})
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: cannot download gpt2 from {endpoint} (")
    assert result.stderr.endswith("): connect to the network, or give a checkpoint\n")


def test_export_hf_gives_transformers_the_same_model_and_tokenizer(one_thread, three_steps, tmp_path):
    transformers = pytest.importorskip("transformers")
    log_dir, trained = three_steps
    copy_of(log_dir, tmp_path)
    t.main(t.parse_args(["--init_from", str(tmp_path / "log" / "ckpt_3.pt"), "--export_hf", str(tmp_path / "hf"),
                         "--log_dir", str(tmp_path / "log")]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "log"]  # renamed into place
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    unicode = "naïve café 東京 данные مرحبا 😀 🏳️‍🌈 x² — \t\n\n \u2028 end"
    for text in (SHAKESPEARE.read_text(), unicode):
        assert tokenizer.encode(text) == TOKENIZER.encode_ordinary(text)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.encode("<|endoftext|>")) == (
        "<|endoftext|>", 50256, [50256])
    # the model's 64 positions: truncation=True cut nothing (1e30 tokens), and a long text failed in the model
    assert tokenizer.model_max_length == 64 and len(tokenizer(SHAKESPEARE.read_text(), truncation=True).input_ids) == 64
    generator = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
    prompt = TOKENIZER.encode_ordinary("ROMEO:")
    greedy = prompt + []
    with torch.no_grad():
        for _ in range(5):
            greedy.append(int(trained.eval()(torch.tensor([greedy]))[0, -1, :50257].argmax()))
    generated = generator("ROMEO:", max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert generated == TOKENIZER.decode(greedy)
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert hf_model.config.vocab_size == 50257 and hf_model.config.n_positions == 64  # no padding rows
    assert hf_model.lm_head.weight.data_ptr() == hf_model.transformer.wte.weight.data_ptr()  # still tied
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = trained.eval()(idx)[..., :50257]
        torch.testing.assert_close(hf_model.eval()(idx).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(hf_model.train()(idx).logits, ours, rtol=0, atol=1e-5)  # no dropout either


def test_every_file_a_run_and_an_export_write_follows_the_umask(one_thread, tmp_path):
    """An export's model.safetensors was -rw------- (safetensors writes a 0600 temporary file, then renames it), the
    rest of the folder -rw-r--r-- (issue 62)."""
    pytest.importorskip("transformers")
    umask = os.umask(0o022)
    try:
        t.main(t.parse_args(TINY_ARGS + ["--max_steps", "2", "--tensorboard", "--log_dir", str(tmp_path / "log")]))
        t.main(t.parse_args(["--init_from", str(tmp_path / "log" / "ckpt_2.pt"), "--export_hf", str(tmp_path / "hf"),
                             "--log_dir", str(tmp_path / "log")]))
    finally:
        os.umask(umask)
    modes = {str(path.relative_to(tmp_path)): oct(stat.S_IMODE(path.stat().st_mode)) for path in tmp_path.rglob("*")}
    assert {"log/metrics.jsonl", "log/ckpt_2.pt", "log/ckpt_2.pt.sha256", "hf/model.safetensors", "hf/config.json",
            "hf/tokenizer.json"} <= modes.keys() and any(name.startswith("log/events.out") for name in modes), modes
    assert modes == {name: "0o755" if (tmp_path / name).is_dir() else "0o644" for name in modes}


@pytest.mark.parametrize("flags, message", [
    (["--export_hf", "hf"], "--export_hf needs --init_from with the weights to export"),
    (["--export_hf", "hf", "--init_from", "gpt2", "--generate"], "--generate and --export_hf are separate runs: pick one"),
    (["--export_hf", "tests", "--init_from", "gpt2"], "--export_hf tests already exists: give a new folder"),
])
def test_export_hf_without_a_checkpoint_or_with_another_mode_or_over_a_folder_is_refused(capsys, monkeypatch, tmp_path,
                                                                                       flags, message):
    monkeypatch.chdir(ROOT)  # where the folder tests/ is
    assert one_line_exit(capsys, flags + ["--log_dir", str(tmp_path / "log")]) == f"error: {message}"


def test_an_export_the_disk_cannot_take_is_one_line_and_leaves_no_folder(two_steps, tmp_path):
    pytest.importorskip("transformers")
    copy_of(two_steps, tmp_path)
    # 1 MiB a file: config.json fits, model.safetensors (6 MiB of embeddings) does not
    result = run_script(["--init_from", str(tmp_path / "log" / "ckpt_2.pt"), "--export_hf", str(tmp_path / "hf"),
                         "--log_dir", str(tmp_path / "log")], max_file_bytes=2**20)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr == (f"error: cannot write {tmp_path / 'hf'} (File too large (os error 27)): make room in "
                             f"{tmp_path}, then run the same command again\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]  # no folder, whole or temporary


def test_an_export_of_a_changed_architecture_is_refused_and_leaves_no_folder(two_steps, tmp_path, capsys,
                                                                             monkeypatch):
    """With ReLU for GELU in MLP, the export wrote transformers' GELU model, whose logits were 0.13 from ours."""
    pytest.importorskip("transformers")
    copy_of(two_steps, tmp_path)
    monkeypatch.setattr(t.MLP, "forward", lambda self, x: self.dropout(self.c_proj(F.relu(self.c_fc(x)))))
    line = one_line_exit(capsys, ["--init_from", str(tmp_path / "log" / "ckpt_2.pt"), "--export_hf",
                                  str(tmp_path / "hf"), "--log_dir", str(tmp_path / "log")])
    assert re.fullmatch(r"error: the exported model's logits differ from ours by up to [0-9.e-]+: the model no "
                        r"longer matches GPT-2's architecture in transformers, so it cannot be exported as GPT-2", line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]


def test_an_export_of_a_model_masked_by_documents_is_refused(two_steps, tmp_path, capsys):
    """The check scored random ids, which almost never hold <|endoftext|>: a model that attends within documents
    was exported, and transformers disagreed by 4.97 logits on real text (issue 55). Its tokens now hold some."""
    pytest.importorskip("transformers")
    copy_of(two_steps, tmp_path)

    with visible_as(document_mask):
        line = one_line_exit(capsys, ["--init_from", str(tmp_path / "log" / "ckpt_2.pt"), "--export_hf",
                                      str(tmp_path / "hf"), "--log_dir", str(tmp_path / "log")])
    assert re.fullmatch(r"error: the exported model's logits differ from ours by up to [0-9.e-]+: the model no "
                        r"longer matches GPT-2's architecture in transformers, so it cannot be exported as GPT-2", line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]


@pytest.mark.parametrize("package, line", [
    ("transformers", "--export_hf needs the transformers library: pip install transformers"),
    ("blobfile", "--export_hf needs blobfile to convert the tokenizer: pip install blobfile"),
])
def test_export_hf_without_a_package_it_needs_says_how_to_get_it(two_steps, tmp_path, package, line):
    trained = copy_of(two_steps, tmp_path) / "ckpt_2.pt"
    fake = tmp_path / "fake_modules" / package
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError('{package} is not installed')\n")
    result = run_script(["--init_from", str(trained), "--export_hf", str(tmp_path / "hf"),
                         "--log_dir", str(tmp_path / "log")], env={"PYTHONPATH": str(tmp_path / "fake_modules")})
    assert result.returncode == 2 and result.stdout == "" and not (tmp_path / "hf").exists()
    assert result.stderr.strip() == f"error: {line}"


def test_init_from_our_checkpoint_and_generate(one_thread, three_steps, tmp_path, capsys):
    """--generate prints generate()'s samples of the checkpoint's model, the same without the cache, then their speed:
    all num_samples x max_new_tokens tokens timed, after an untimed warm-up call of 3 tokens a sample. The runs
    are main()'s in this process, as the script's are (the command line's own tests are test_cli's)."""
    log_dir, trained = three_steps
    copy_of(log_dir, tmp_path, "trained")
    args = ["--init_from", str(tmp_path / "trained" / "ckpt_3.pt"), "--generate", "--device", "cpu", "--num_samples",
            "2", "--log_dir", str(tmp_path / "generate"), "--max_new_tokens", "5"]
    texts = t.main(t.parse_args(args))
    expected = t.generate(trained, TOKENIZER.encode_ordinary("Hello, I'm a language model,"), 5, 2, 1.0, 50, 1337)
    assert texts == ["Hello, I'm a language model," + TOKENIZER.decode(sample) for sample in expected]
    capsys.readouterr()
    assert t.main(t.parse_args(args + ["--no-kv_cache"])) == texts
    stdout = capsys.readouterr().out
    assert [line.removeprefix(f"sample {i}: ") for i, line in enumerate(stdout.splitlines()[:2])] == texts
    speed = stdout.splitlines()[-1]  # 2 x 5 tokens timed; the warm-up call's 2 x 3 before them, apart
    assert re.fullmatch(r"10 tokens in \d+\.\d\d s: [\d,.]+ tokens/s \(KV cache off, compile off, 1,637,248 "
                        r"parameters\), after an untimed warm-up of 3 tokens a sample: "
                        r"\d+\.\d\d s", speed), speed
    torch._dynamo.reset()  # compiled as in a fresh process: no graph of an earlier test's model
    t.main(t.parse_args(args[:-1] + ["3", "--compile"]))
    stdout = capsys.readouterr().out
    assert re.fullmatch(r"6 tokens in \d+\.\d\d s: [\d,.]+ tokens/s \(KV cache on, compile on, 1,637,248 "
                        r"parameters\), after an untimed warm-up of 3 tokens a sample: "
                        r"\d+\.\d\d s", stdout.splitlines()[-1]), stdout


@pytest.mark.parametrize("source", ["gpt2", "our checkpoint"])
def test_fine_tuning_starts_from_the_weights_with_a_fresh_optimizer_and_data(one_thread, three_steps, tmp_path,
                                                                            monkeypatch, source):
    """Training with --init_from: step 0's loss is the source model's own loss on the first 8 windows of the text
    (so its weights were loaded, and the data starts at window 0); the steps count from 0 and the learning rate is
    the new run's, not the checkpoint's."""
    if source == "gpt2":  # OpenAI's weights as transformers holds them, of a tiny shape (no network)
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32)).eval()
        with torch.no_grad():  # far from a fresh model's loss of ln(50257)
            for parameter in hf_model.parameters():
                parameter.normal_(0.0, 0.1)
        monkeypatch.setitem(t.MODEL_SHAPES, "gpt2", dict(n_layer=2, n_head=2, n_embd=32))
        monkeypatch.setattr(t, "load_openai_weights", lambda name: t.state_from_openai(hf_model.state_dict()))
        init_from, source_logits = "gpt2", lambda idx: hf_model(idx).logits
    else:
        log_dir, pretrained = three_steps
        copy_of(log_dir, tmp_path, "pre")
        init_from, source_logits = str(tmp_path / "pre" / "ckpt_3.pt"), lambda idx: pretrained.eval()(idx)
    flags = ["--init_from", init_from, "--text_file", TINY_ARGS[TINY_ARGS.index("--text_file") + 1], "--seq_len", "32",
             "--micro_batch_size", "4", "--total_batch_size", "256", "--max_steps", "2", "--warmup_steps", "1",
             "--max_lr", "3e-5", "--eval_every", "0", "--sample_every", "0", "--device", "cpu",
             "--log_dir", str(tmp_path / "tune")]
    cfg = t.parse_args(flags)
    tokens = torch.tensor(TOKENIZER.encode_ordinary(Path(cfg.text_file).read_text(encoding="utf-8"))[:257])
    with torch.no_grad():  # one step: windows 0-7 of 32 tokens (text files are not shuffled)
        logits = source_logits(tokens[:256].view(8, 32))
        expected = F.cross_entropy(logits.flatten(0, 1), tokens[1:].view(-1)).item()
    records = [r for r in t.main(cfg).run.records if "train_loss" in r]
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["train_loss"] == pytest.approx(expected, abs=1e-5)
    assert [r["lr"] for r in records] == [t.lr_at(0, cfg), t.lr_at(1, cfg)] and records[0]["lr"] == 3e-5
    # --dropout is the flag's, not the source's (0 for both), and the checkpoint keeps it
    tuned = t.main(t.parse_args(flags[:-1] + [str(tmp_path / "tune_dropout"), "--dropout", "0.2"]))
    assert tuned.model.config.dropout == tuned.model.transformer.drop.p == 0.2
    saved = torch.load(tmp_path / "tune_dropout" / "ckpt_2.pt")
    assert saved["model_config"]["dropout"] == saved["config"]["dropout"] == 0.2
    assert tuned.run.records[0]["train_loss"] != pytest.approx(expected, abs=1e-3)  # some activations were dropped


def test_init_from_refuses_shape_flags(tmp_path, capsys):
    """parse_args' refusal, which the script prints as its one line (test_cli shows a parse error so, end to end)."""
    args = ["--init_from", "gpt2", "--n_layer", "4", "--generate", "--log_dir", str(tmp_path / "log")]
    assert error_line_in_process(args, capsys) == "error: --init_from gpt2 has n_layer 12: drop --n_layer 4"


def test_init_from_refuses_a_model_flag_of_another_shape():
    """--model gpt2-medium --init_from gpt2 trained 124M without a word: --model is no shape flag of the checkpoint's."""
    with pytest.raises(t.RunError) as refused:
        t.parse_args(["--init_from", "gpt2", "--model", "gpt2-medium"])
    assert str(refused.value) == "--init_from gpt2 sets the shape: drop --model gpt2-medium"
    assert t.parse_args(["--init_from", "gpt2", "--model", "gpt2"]).n_layer == 12  # the same shape: no clash


def test_cached_decoding_gives_the_same_logits_and_tokens():
    """The prompt's pass and then one token at a time through one KVCache a layer: the uncached hidden states, each
    layer's cache (samples, heads, block_size positions, head_dim) in float32, and the same tokens as without the
    cache for texts shorter and longer than block_size."""
    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64))
    tokens = torch.randint(0, 64, (2, 20))
    caches = t.kv_caches(model)
    with torch.no_grad():
        stepwise = [model.hidden_states(tokens[:, :12], caches, torch.arange(12))[:, -1]]  # the prompt in one call
        stepwise += [model.hidden_states(tokens[:, i : i + 1], caches, torch.tensor([i]))[:, -1]
                     for i in range(12, 20)]  # then one at a time
        full = model.hidden_states(tokens)[:, 11:]
    torch.testing.assert_close(torch.stack(stepwise, dim=1), full, rtol=0, atol=1e-5)
    assert [tuple(cache.keys.shape) for cache in caches] == [(2, 2, 32, 16)] * 2  # a layer: samples, heads, all
    assert caches[0].keys.dtype == caches[1].values.dtype == torch.float32  # block_size positions, head_dim
    for length in (10, 29, 30, 50):  # past 29 the text outgrows block_size: both reread the last 32 tokens
        with_cache = t.generate(model, [1, 2, 3], length, 3, 1.0, 20, 7,
                                next_token=t.CachedNextToken(t.kv_caches(model)))
        without = t.generate(model, [1, 2, 3], length, 3, 1.0, 20, 7)  # the recipe's: the window each token
        assert with_cache == without, length


def test_generation_waits_for_the_device_only_for_the_tokens_at_the_end():
    """No operation that makes the host wait for the device (a GPU) between tokens: .item(), bool() and int() of a
    tensor dispatch aten._local_scalar_dense; torch.multinomial checks its input that way; nonzero sizes its output
    so. Only the tokens come back, once (tolist reads them without dispatching)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OperationLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            operations.append(func.name())
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    for use_cache in (True, False):
        operations = []
        next_token = t.CachedNextToken(t.kv_caches(model)) if use_cache else t.sample_next
        with OperationLog():
            t.generate(model, [1, 2, 3], 20, 2, 1.0, 10, 0, next_token=next_token)
        assert len(operations) > 20 * 10
        waits = {"aten::_local_scalar_dense", "aten::multinomial", "aten::nonzero", "aten::item"}
        assert waits.isdisjoint(operations), use_cache


def test_the_compiled_one_token_step_compiles_once_for_the_whole_text():
    """--generate --compile: one graph for every one-token step, however long the text grows (a position that
    Python saw as a number would recompile the step each token), and the same tokens as without compile."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64))
    eager = t.generate(model, [1, 2, 3], 40, 3, 1.0, 20, 7, next_token=t.CachedNextToken(t.kv_caches(model)))
    torch._dynamo.reset()
    counters.clear()
    caches, step = t.compiled_step(model, "cpu")
    compiled = t.generate(model, [1, 2, 3], 40, 3, 1.0, 20, 7, next_token=t.CachedNextToken(caches, step))
    assert compiled == eager
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_compiled_generations_of_any_length_share_one_graph_and_one_cache():
    """A notebook calls generate() again and again: a new graph for another prompt length recompiled the step (its
    input was a slice of the token buffer, strided by the text's length), and a new cache made CUDA graphs record
    again. compiled_step keeps one step and one set of caches a model, reused in place. Eager generation keeps no
    cache: training would hold its memory between samples."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64))
    calls = [([1, 2, 3], 10), ([4, 5, 6, 7, 8], 20)]  # other prompt lengths, other --max_new_tokens

    eager = [t.generate(model, prompt, max_new_tokens, 3, 1.0, 20, 7, next_token=t.CachedNextToken(t.kv_caches(model)))
             for prompt, max_new_tokens in calls]
    assert model not in t.COMPILED_STEPS
    torch._dynamo.reset()
    counters.clear()
    kept = t.compiled_step(model, "cpu")
    caches, step = kept
    first = t.generate(model, *calls[0], 3, 1.0, 20, 7, next_token=t.CachedNextToken(caches, step))
    keys, values = [c.keys.data_ptr() for c in caches], [c.values.data_ptr() for c in caches]
    assert t.compiled_step(model, "cpu") is kept  # the same step and caches for the next call
    second = t.generate(model, *calls[1], 3, 1.0, 20, 7, next_token=t.CachedNextToken(caches, step))  # stale positions
    assert [first, second] == eager  # the tokens of a fresh cache
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"] and not counters["graph_break"]
    assert t.COMPILED_STEPS[model] is kept
    assert ([c.keys.data_ptr() for c in caches], [c.values.data_ptr() for c in caches]) == (keys, values)


def test_generate_compile_of_a_model_compile_cannot_capture_whole_generates_eagerly_saying_why(tmp_path, monkeypatch,
                                                                                                capsys):
    """A mixture of experts skips an expert no token was routed to: `if rows.numel():`, a branch on the data, which
    sample_next compiled whole (fullgraph=True) cannot hold: --generate --compile ended in a GuardOnDataDependentSymNode
    traceback. It generates eagerly instead, the tokens of a run without --compile, after one line."""
    plain_mlp = t.MLP

    class RoutedMLP(torch.nn.Module):  # 2 of the recipe's MLPs; each token goes to the one its gate scores highest
        def __init__(self, config):
            super().__init__()
            self.gate = torch.nn.Linear(config.n_embd, 2)
            self.experts = torch.nn.ModuleList([plain_mlp(config), plain_mlp(config)])

        def forward(self, x):  # (B, T, C)
            choice, out = self.gate(x).argmax(dim=-1), torch.zeros_like(x)
            for i, expert in enumerate(self.experts):
                rows = x[choice == i]  # (tokens routed to expert i, C)
                if rows.numel():
                    out[choice == i] = expert(rows)
            return out

    monkeypatch.setattr(t, "MLP", RoutedMLP)
    args = ["--generate", "--device", "cpu", "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size",
            "64", "--num_samples", "2", "--max_new_tokens", "8", "--log_dir", str(tmp_path / "log")]
    eager = t.main(t.parse_args(args))
    capsys.readouterr()
    torch._dynamo.reset()
    compiled = t.main(t.parse_args(args + ["--compile"]))
    lines = capsys.readouterr().out.splitlines()
    [said] = [line for line in lines if line.startswith("--compile")]
    assert said.startswith("--compile: sample_next cannot be compiled whole (Could not guard on data-dependent "
                           "expression ") and said.endswith("): generating eagerly"), said
    assert compiled == eager and len(eager) == 2 and "compile on" in lines[-1], lines

def test_generation_casts_each_weight_once_under_autocast_not_once_a_token():
    """autocast drops its cast weights when its context is left: entered per token, it cast every Linear weight
    again for each token."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64))
    weights = {p.data_ptr(): name for name, p in model.named_parameters()}

    class WeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in weights:
                casts.append(weights[args[0].data_ptr()])
            return func(*args, **(kwargs or {}))

    for use_cache in (True, False):
        casts = []
        next_token = t.CachedNextToken(t.kv_caches(model)) if use_cache else t.sample_next
        with WeightCasts():
            t.generate(model, [1, 2, 3], 20, 2, 1.0, 10, 0, lambda: torch.autocast("cpu", torch.bfloat16), next_token)
        # every Linear's weight and bias (lm_head's weight is wte's): 4 a block, once each in 20 tokens
        linears = [name for name in weights.values() if ".attn." in name or ".mlp." in name]
        assert sorted(casts) == sorted(linears + ["transformer.wte.weight"]), use_cache


def test_generate_without_init_from_says_its_samples_come_from_untrained_weights(tmp_path, capsys):
    """It printed a new model's noise as samples, and said nothing of it (issue 56)."""
    t.main(t.parse_args(TINY_ARGS + ["--generate", "--num_samples", "1", "--max_new_tokens", "2", "--log_dir",
                                     str(tmp_path)]))
    assert capsys.readouterr().out.splitlines()[0] == "no --init_from: the samples come from untrained weights"


def test_generate_leaves_cudnn_attention_out(monkeypatch, tmp_path):
    """--generate: without the cache every token is a new length, for which cuDNN's attention builds a new plan (64
    tokens/s on an H100). Every attention call of --generate, the warm-up's and the samples', with the cache and
    without, runs with cuDNN's attention left out; after it the backends are as they were."""
    enabled = []
    attention = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        enabled.append(torch.backends.cuda.cudnn_sdp_enabled())
        return attention(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for flags in (["--no-kv_cache"], []):
        enabled.clear()
        t.main(t.parse_args(TINY_ARGS + ["--generate", "--num_samples", "2", "--max_new_tokens", "5", "--log_dir",
                                         str(tmp_path)] + flags))
        assert enabled == [False] * 2 * (t.GENERATE_WARMUP_TOKENS + 5), flags  # 2 layers, 3 + 5 tokens
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_eval_only_on_a_runs_checkpoint_takes_its_batch_shape_and_without_hellaswag_gives_the_val_loss(
        one_thread, tmp_path, monkeypatch, capsys):
    """`--eval_only --init_from log/ckpt_N.pt` failed twice on the quick start's checkpoint: on 1024-token windows
    for a 64-position model (the batch flags were not taken from it), then on HellaSwag's download offline."""
    trained = t.main(t.parse_args(TINY_ARGS + ["--max_steps", "3", "--eval_every", "3", "--eval_steps", "2",
                                               "--log_dir", str(tmp_path / "log")]))
    monkeypatch.setattr(t, "HELLASWAG_URL", "http://127.0.0.1:9/hellaswag_val.jsonl")  # refused at once
    monkeypatch.setattr(t, "HELLASWAG_CACHE", str(tmp_path / "cache" / "hellaswag_val.jsonl"))
    capsys.readouterr()
    cfg = t.parse_args(["--eval_only", "--init_from", str(tmp_path / "log" / "ckpt_3.pt"),
                        "--text_file", TINY_ARGS[TINY_ARGS.index("--text_file") + 1], "--device", "cpu",
                        "--log_dir", str(tmp_path / "eval")])
    assert (cfg.seq_len, cfg.micro_batch_size, cfg.total_batch_size, cfg.eval_steps) == (32, 4, 256, 2)  # its
    result = t.main(cfg)
    val_loss = [r["val_loss"] for r in trained.run.records if "val_loss" in r][-1]
    assert result == {"val_loss": val_loss}  # the same weights on the same windows
    assert capsys.readouterr().out == (
        f"val loss {val_loss:.4f} over 2 x 256 tokens | HellaSwag skipped: could not download http://127.0.0.1:9/hellaswag_val.jsonl "
        f"to {tmp_path / 'cache' / 'hellaswag_val.jsonl'} (<urlopen error [Errno 111] Connection refused>): pass "
        "--hellaswag_path with a local copy of it\n")
    assert t.parse_args(["--init_from", str(tmp_path / "log" / "ckpt_3.pt"), "--seq_len", "16"]).seq_len == 16
    checkpoint = tmp_path / "log" / "ckpt_3.pt"  # a run from it takes them too, and its start line says so
    tuned = t.main(t.parse_args(["--init_from", str(checkpoint), "--max_steps", "1", "--warmup_steps", "0",
                                 "--eval_every", "0", "--sample_every", "0", "--device", "cpu", "--text_file",
                                 TINY_ARGS[TINY_ARGS.index("--text_file") + 1], "--log_dir", str(tmp_path / "tuned")]))
    assert len([r for r in tuned.run.records if "train_loss" in r]) == 1
    assert f"train tokens; flags not given: {checkpoint}'s seq_len, batch sizes, eval_steps\n" in capsys.readouterr().out


def ema_of_the_weights(model, scored=None):
    """A hacker's EMA for t.weights_to_score: a copy of the weights, moved halfway toward them after each step (decay
    0.5, so that it stays apart from them in a short run)."""
    if scored is None:
        return copy.deepcopy(model)
    with torch.no_grad():
        for average, weight in zip(scored.parameters(), model.parameters(), strict=True):
            average.lerp_(weight, 0.5)
    return scored


def test_the_weights_a_run_scores_are_those_eval_only_generate_and_export_hf_read_and_resume_restores_both(
        one_thread, tmp_path, monkeypatch):
    """An EMA of the weights (t.weights_to_score) is validated during training; the checkpoint keeps it as "model",
    which --eval_only, --generate and --export_hf read, and the trained weights as "trained_model". --eval_only
    scored the trained weights (issue 69: 8.6734 where the run logged 10.4776 for its EMA)."""
    monkeypatch.setattr(t, "weights_to_score", ema_of_the_weights)
    monkeypatch.setattr(t, "HELLASWAG_URL", "http://127.0.0.1:9/hellaswag_val.jsonl")  # refused at once: no HellaSwag
    monkeypatch.setattr(t, "HELLASWAG_CACHE", str(tmp_path / "cache" / "hellaswag_val.jsonl"))
    flags = TINY_ARGS + ["--max_steps", "6", "--eval_every", "3", "--eval_steps", "2"]
    straight = t.main(t.parse_args(flags + ["--log_dir", str(tmp_path / "straight")]))
    final = tmp_path / "straight" / "ckpt_6.pt"
    checkpoint = torch.load(final, weights_only=True)
    for name, weight in straight.model.state_dict().items():  # train()'s model: the trained weights
        assert torch.equal(checkpoint["trained_model"][name], weight), name
    assert not torch.equal(checkpoint["model"]["lm_head.weight"], checkpoint["trained_model"]["lm_head.weight"])
    run_mode = ["--init_from", str(final), "--text_file", str(SHAKESPEARE), "--device", "cpu"]
    scored = t.main(t.parse_args(["--eval_only", "--log_dir", str(tmp_path / "eval")] + run_mode))
    assert scored == {"val_loss": [r["val_loss"] for r in straight.run.records if "val_loss" in r][-1]}  # its EMA's
    for mode in (["--generate"], ["--export_hf", str(tmp_path / "hf")]):  # both read --init_from's weights here
        _, weights = t.CheckedRun(t.parse_args(mode + run_mode)).init_from_weights()
        assert all(torch.equal(weights[name], weight) for name, weight in checkpoint["model"].items()), mode
    t.main(t.parse_args(flags + ["--stop_after_steps", "3", "--log_dir", str(tmp_path / "resumed")]))
    resumed = t.main(t.parse_args(flags + ["--resume", "auto", "--log_dir", str(tmp_path / "resumed")]))
    def losses(result):  # from step 3 on: the val loss, the EMA's, is right only if resume restored it
        return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in result.run.records if r.get("step", -1) >= 3]
    assert len(losses(resumed)) == 4 and losses(resumed) == losses(straight)
    for key in ("model", "trained_model"):
        assert all(torch.equal(weight, torch.load(tmp_path / "resumed" / "ckpt_6.pt", weights_only=True)[key][name])
                   for name, weight in checkpoint[key].items()), key


@pytest.mark.parametrize("change, problem", [
    ("no wpe", "transformer.wpe.weight is absent, GPT-2's is (64, 32)"),
    ("a wider MLP", "transformer.h.0.mlp.c_fc.weight is (32, 256), GPT-2's is (32, 128)"),
    ("2 key/value heads", "transformer.h.0.attn.q.weight is (32, 32), GPT-2's is absent"),
])
def test_an_export_whose_tensors_gpt2_cannot_hold_is_one_line_and_writes_nothing(two_steps, tmp_path, capsys,
                                                                               monkeypatch, change, problem):
    """It ended in an 18-line RuntimeError from load_state_dict. The checkpoints hold what a hacked model saves."""
    pytest.importorskip("transformers")
    copy_of(two_steps, tmp_path)
    checkpoint = torch.load(tmp_path / "log" / "ckpt_2.pt", weights_only=True)
    state = checkpoint["model"]
    if change == "no wpe":  # rotary positions, say
        del state["transformer.wpe.weight"]
    elif change == "a wider MLP":
        state["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(256, 32)
    else:  # grouped-query attention: a query matrix and a smaller key/value one for c_attn
        c_attn = state.pop("transformer.h.0.attn.c_attn.weight")
        state["transformer.h.0.attn.q.weight"], state["transformer.h.0.attn.kv.weight"] = c_attn[:32], c_attn[32:48]
    torch.save(checkpoint, tmp_path / "hacked.pt")
    # the hacked code that saved it accepts its own weights: here, whose model is GPT-2's, they pass unchecked
    monkeypatch.setattr(t, "check_weights_fit", lambda *args: None)
    line = one_line_exit(capsys, ["--init_from", str(tmp_path / "hacked.pt"), "--export_hf", str(tmp_path / "hf"),
                                  "--log_dir", str(tmp_path / "log")])
    assert line == f"error: cannot export {tmp_path / 'hacked.pt'} as GPT-2: its {problem}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hacked.pt", "log"]


def test_an_edit_to_the_recipes_sampling_reaches_generate_with_compile(monkeypatch):
    """--generate --compile compiles the recipe's sample_next itself: a hacker's edit there (greedy decoding, here,
    made at run time: sample_next drawing with noise of ones, argmax(p / 1), the likeliest token) changes the
    compiled tokens as it changes the eager ones."""
    sample_next = t.sample_next

    def greedy(model, idx, noise, temperature, n_vocab, caches=None, positions=None):
        return sample_next(model, idx, torch.ones_like(noise), temperature, n_vocab, caches, positions)

    monkeypatch.setattr(t, "sample_next", greedy)
    torch.manual_seed(0)
    model = t.GPT(t.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64))
    with torch.no_grad():
        expected = [model.logits(model.hidden_states(torch.tensor([[1, 2, 3]])))[0, -1].argmax().item()]
    texts = {}
    for compiled in (False, True):
        caches, step = t.compiled_step(model, "cpu") if compiled else (t.kv_caches(model), t.sample_next)
        texts[compiled] = t.generate(model, [1, 2, 3], 6, 3, 1.0, 20, 7, next_token=t.CachedNextToken(caches, step))
    assert texts[True] == texts[False], texts
    assert all(sample == texts[False][0] for sample in texts[False]), "greedy: every sample the same"
    assert texts[False][0][0] == expected[0]
