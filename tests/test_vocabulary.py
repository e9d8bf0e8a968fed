"""Another tokenizer in place of GPT-2's, as a hacker's edit of tokenizer() puts it (conftest's moved_gpt2: GPT-2's
merges with the ids moved past 65,535): the embedding rows, <|endoftext|>, the shards' dtype, the token check,
sampling, HellaSwag and the export follow it, in train_gpt2.py and fineweb.py (issue 68)."""

import json

import numpy as np
import pytest
import torch

import fineweb
import train_gpt2 as t
from conftest import SHAKESPEARE, TINY_ARGS, TINY_ARGS_WITHOUT_SHAPE, moved_gpt2

SHORT = TINY_ARGS + ["--max_steps", "3", "--warmup_steps", "1"]


@pytest.fixture
def moved(monkeypatch):
    """moved_gpt2 in place in both files; attention asks visible_is_causal() anew (it probes the vocabulary's ids)."""
    monkeypatch.setattr(t, "tokenizer", moved_gpt2)
    monkeypatch.setattr(fineweb, "tokenizer", moved_gpt2)
    t.visible_is_causal.cache_clear()
    yield moved_gpt2()
    t.visible_is_causal.cache_clear()


def test_another_tokenizer_trains_on_text_samples_evaluates_and_exports_as_itself(moved, tmp_path, capsys):
    pytest.importorskip("transformers")
    log_dir, hellaswag = tmp_path / "log", tmp_path / "hellaswag.jsonl"
    hellaswag.write_text("".join(json.dumps({"ctx": "ROMEO: I", "endings": [" am", " go", " dog", " the"],
                                             "label": i % 4}) + "\n" for i in range(3)))
    result = t.main(t.parse_args(SHORT + ["--eval_every", "3", "--eval_steps", "1", "--hellaswag_every", "3",
                                          "--hellaswag_path", str(hellaswag), "--log_dir", str(log_dir)]))
    assert result.model.config.vocab_size == 120_320  # 120,257 padded to 940 x 128
    assert torch.load(log_dir / "ckpt_3.pt", weights_only=True)["n_vocab"] == 120_257
    train, _ = t.CheckedRun(t.Config(device="cpu", text_file=str(SHAKESPEARE))).token_streams()
    assert [tokens.dtype for tokens in train.arrays] == [np.uint32]  # ids past 65,535 kept
    assert train.read(0, 4).tolist() == moved.encode_ordinary(SHAKESPEARE.read_text()[:15])[:4]
    assert [r["hellaswag_examples"] for r in result.run.records if "hellaswag_examples" in r] == [3]
    for next_token in (t.sample_next, t.CachedNextToken(t.kv_caches(result.model))):  # training's, --generate's
        samples = t.generate(result.model, [], 16, num_samples=4, seed=1, next_token=next_token)
        assert all(0 <= token < 120_257 for sample in samples for token in sample), samples  # no padding row
    capsys.readouterr()
    last_val = [r["val_loss"] for r in result.run.records if "val_loss" in r][-1]
    scored = t.main(t.parse_args(SHORT + ["--eval_only", "--init_from", str(log_dir / "ckpt_3.pt"), "--eval_steps",
                                          "1", "--hellaswag_path", str(hellaswag)]))
    assert scored["val_loss"] == pytest.approx(last_val, rel=1e-6) and scored["hellaswag_examples"] == 3
    folder = tmp_path / "hf"
    t.main(t.parse_args(["--init_from", str(log_dir / "ckpt_3.pt"), "--export_hf", str(folder), "--device", "cpu"]))
    config = json.loads((folder / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (120_257, 120_256, 120_256)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|endoftext|>", 120_256)
    assert tokenizer.encode("ROMEO: I am") == moved.encode_ordinary("ROMEO: I am")


def test_another_tokenizer_trains_on_fineweb_shards_of_its_ids(moved, tmp_path):
    """fineweb.py writes uint32 shards of the tokenizer's ids; train_gpt2.py reads them (it wanted uint16)."""
    corpus = tmp_path / "corpus.jsonl"
    lines = SHAKESPEARE.read_text()[:40_000].split("\n\n")
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in lines))
    fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(tmp_path / "shards"), "--workers", "1"]))
    shard = np.load(tmp_path / "shards" / "shards_train_000001.npy")
    assert shard.dtype == np.uint32 and shard.max() < 120_257 and (shard == 120_256).sum() > 0
    args = SHORT[: SHORT.index("--text_file")] + SHORT[SHORT.index("--text_file") + 2:]
    result = t.main(t.parse_args(args + ["--data_dir", str(tmp_path / "shards"), "--log_dir", str(tmp_path / "log")]))
    assert [r["step"] for r in result.run.records if "train_loss" in r] == [0, 1, 2]


def test_a_checkpoint_of_another_vocabulary_is_refused_naming_both_sizes(tmp_path, monkeypatch, capsys):
    """A GPT-2 checkpoint given to a run of another tokenizer loaded, then failed with an IndexError traceback."""
    t.main(t.parse_args(SHORT + ["--log_dir", str(tmp_path / "gpt2")]))  # GPT-2's tokenizer
    monkeypatch.setattr(t, "tokenizer", moved_gpt2)
    t.visible_is_causal.cache_clear()
    path, new = tmp_path / "gpt2" / "ckpt_3.pt", ["--log_dir", str(tmp_path / "new")]
    for flag, args in [("--init_from", TINY_ARGS_WITHOUT_SHAPE + ["--init_from", str(path)] + new),
                       ("--init_from", TINY_ARGS_WITHOUT_SHAPE + ["--init_from", "gpt2"] + new),  # OpenAI's: GPT-2's
                       ("--resume", SHORT + ["--max_steps", "4", "--resume", "auto", "--log_dir", str(path.parent)])]:
        with pytest.raises(SystemExit) as stopped:
            t.main(t.parse_args(args))
        assert stopped.value.code == 2
        named = path if flag == "--resume" or "gpt2" not in args else "gpt2"
        assert capsys.readouterr().err == (f"error: {flag} {named} was trained with a tokenizer of 50,257 tokens, not "
                                           "this one's 120,257: use its tokenizer, or train a new model\n")
    t.visible_is_causal.cache_clear()
