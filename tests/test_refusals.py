"""Refusals a newcomer or a hacker meets: one line that says what to do, and nothing left behind."""

import dataclasses

import pytest
import torch

import train_gpt2 as t
from conftest import TINY_ARGS, TINY_ARGS_WITHOUT_SHAPE
from test_ddp import assert_every_rank_stopped_with_one_line, torchrun
from test_evaluation import one_line_exit
from test_tensorboard import BOARD_ARGS, board_curves, jsonl_curves


# ------------------------------ a checkpoint the edited model does not fit (issue 51)

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny run's checkpoint, as the code before an edit wrote it."""
    log_dir = tmp_path_factory.mktemp("before_the_edit")
    t.main(t.parse_args(TINY_ARGS + ["--max_steps", "2", "--log_dir", str(log_dir)]))
    return torch.load(log_dir / "ckpt_2.pt", weights_only=True)


class WithAModule(t.GPT):
    """A hacker's edit that adds a module."""

    def __init__(self, config):
        super().__init__(config)
        self.gate = torch.nn.Linear(config.n_embd, 1)


class WithoutPositions(t.GPT):
    """A hacker's edit that removes the learned positions (rotary embeddings instead)."""

    def __init__(self, config):
        super().__init__(config)
        del self.transformer["wpe"]


class WiderMLP(t.GPT):
    """A hacker's edit that widens the first block's MLP."""

    def __init__(self, config):
        super().__init__(config)
        self.transformer.h[0].mlp.c_fc = torch.nn.Linear(config.n_embd, 8 * config.n_embd)


EDITS = {WithAModule: "missing gate.weight; missing gate.bias",
         WithoutPositions: "unexpected transformer.wpe.weight",
         WiderMLP: "transformer.h.0.mlp.c_fc.weight is (128, 32), the model's is (256, 32); "
                   "transformer.h.0.mlp.c_fc.bias is (128,), the model's is (256,)"}


@pytest.mark.parametrize("edited_model", EDITS)
@pytest.mark.parametrize("flags", [["--resume"], ["--init_from"], ["--eval_only", "--init_from"]])
def test_a_checkpoint_the_edited_model_does_not_fit_is_one_line(checkpoint, edited_model, flags, tmp_path,
                                                               monkeypatch, capsys):
    """It ended in load_state_dict's traceback ("Unexpected key(s) in state_dict"): the config compare passed, as no
    config field changed."""
    torch.save(checkpoint, tmp_path / "ckpt_1.pt")
    monkeypatch.setattr(t, "GPT", edited_model)
    path = str(tmp_path / "ckpt_1.pt")
    base = TINY_ARGS if flags == ["--resume"] else TINY_ARGS_WITHOUT_SHAPE  # --init_from gives the shape
    line = one_line_exit(capsys, base + ["--max_steps", "2", *flags, path, "--log_dir", str(tmp_path / "log")])
    assert line == (f"error: {flags[-1]} {path} does not fit this model ({EDITS[edited_model]}): the model's code "
                    "changed since it was saved; start a new run, or use the code that wrote it")
    assert not (tmp_path / "log").exists()


def saved_with(checkpoint, edit, path):
    """The checkpoint with its weights edited, as if another model's code had written them."""
    state = {**checkpoint, "model": dict(checkpoint["model"])}
    edit(state["model"])
    torch.save(state, path)
    return str(path)


def test_the_line_names_the_first_three_problems_and_counts_the_rest(checkpoint, tmp_path, capsys):
    def drop_biases(state):
        for name in [name for name in state if name.endswith(".bias")][:5]:
            del state[name]
    path = saved_with(checkpoint, drop_biases, tmp_path / "ckpt_1.pt")
    line = one_line_exit(capsys, TINY_ARGS_WITHOUT_SHAPE + ["--init_from", path, "--log_dir", str(tmp_path / "log")])
    assert line.count("missing ") == 3 and " and 2 more): " in line


def test_under_torchrun_every_rank_stops_on_a_checkpoint_that_does_not_fit(checkpoint, tmp_path):
    path = saved_with(checkpoint, lambda state: state.update({"transformer.h.0.mlp.c_fc.bias": torch.zeros(64)}),
                      tmp_path / "ckpt_1.pt")
    args = ["train_gpt2.py"] + TINY_ARGS + ["--resume", path, "--log_dir", str(tmp_path / "log")]
    result = torchrun(2, args)
    line = (f"error: --resume {path} does not fit this model (transformer.h.0.mlp.c_fc.bias is (64,), the model's is "
            "(128,)): the model's code changed since it was saved; start a new run, or use the code that wrote it")
    assert_every_rank_stopped_with_one_line(result, line)
    assert [text for text in result.stderr.splitlines() if text.startswith("error: ")] == [line]  # rank 0's alone
    assert "exitcode  : 2" in result.stderr.split("Root Cause")[1]


# ------------------------------ an export the tokenizer cannot drive (issue 51)

def test_an_export_with_a_vocabulary_smaller_than_the_tokenizers_is_refused(checkpoint, tmp_path, capsys):
    """Ids taken modulo 32768: transformers' generate and pipeline then failed on ordinary text (IndexError)."""
    pytest.importorskip("transformers")
    state = {**checkpoint, "model_config": {**checkpoint["model_config"], "vocab_size": 32768},
             "model": {name: tensor[:32768] if name in ("transformer.wte.weight", "lm_head.weight") else tensor
                       for name, tensor in checkpoint["model"].items()}}
    torch.save(state, tmp_path / "small.pt")
    line = one_line_exit(capsys, ["--init_from", str(tmp_path / "small.pt"), "--export_hf", str(tmp_path / "hf"),
                    "--log_dir", str(tmp_path / "log")])
    assert line == (f"error: cannot export {tmp_path / 'small.pt'} as GPT-2: its transformer.wte.weight is (32768, "
                    "32), GPT-2's is (50257, 32)")
    assert not (tmp_path / "hf").exists()


# ------------------------------ a refused run leaves nothing behind (issue 52)

@pytest.mark.parametrize("mistake, expected", [
    (["--data_dir", "no_such_folder"], "--data_dir no_such_folder is not a folder"),
    (["--resume", "no_such_checkpoint.pt"], "--resume no_such_checkpoint.pt does not exist"),
    (["--text_file", "no_such_file.txt"], "--text_file no_such_file.txt does not exist"),
    (["--hellaswag_every", "5", "--hellaswag_path", "no_such.jsonl"], "--hellaswag_path no_such.jsonl does not"),
    (["--init_from", "input.txt"], "--init_from input.txt is not a checkpoint"),
])
def test_a_refused_run_makes_no_log_dir_and_downloads_nothing(mistake, expected, tmp_path, monkeypatch, capsys):
    """--log_dir was made first and stayed, empty, after a one-line refusal."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(t, "TEXT_FILE", str(tmp_path / "missing.txt"))  # not there: it would be downloaded
    (tmp_path / "input.txt").write_text("not a checkpoint")
    monkeypatch.setattr(t, "download", lambda *args: pytest.fail(f"downloaded {args[0]} before the refusal"))
    args = TINY_ARGS_WITHOUT_SHAPE[: TINY_ARGS_WITHOUT_SHAPE.index("--text_file")] + ["--log_dir", str(tmp_path / "log")]
    assert one_line_exit(capsys, args + mistake).startswith(f"error: {expected}")
    assert [path.name for path in tmp_path.iterdir()] == ["input.txt"]


# ------------------------------ mistakes say what to do (issue 52)

@pytest.mark.parametrize("typo, expected", [
    (["--max_setps", "20"], "unrecognized arguments: --max_setps 20: did you mean --max_steps?"),
    (["--learning_rate", "1e-3"], "unrecognized arguments: --learning_rate 1e-3"),  # nothing close
    (["--warmup_stesp", "5", "--sed", "3"], "unrecognized arguments: --warmup_stesp 5 --sed 3: did you mean "
                                            "--warmup_steps or --seed?"),
    # hyphens, as torchrun takes them: the flag's whole name was not read past its first hyphen (issue 56)
    (["--max-stepz", "20"], "unrecognized arguments: --max-stepz 20: did you mean --max-steps?"),
    (["--eval-evry", "5"], "unrecognized arguments: --eval-evry 5: did you mean --eval-every?"),
    (["--micro-batch-sise", "8"], "unrecognized arguments: --micro-batch-sise 8: did you mean --micro-batch-size?"),
    (["--no-kv-cahce"], "unrecognized arguments: --no-kv-cahce: did you mean --no-kv-cache?"),
])
def test_an_unknown_flag_names_the_flag_it_is_close_to(typo, expected, capsys):
    with pytest.raises(t.RunError) as raised:
        t.parse_args(typo)
    assert str(raised.value) == f"{expected} (see --help)"


@pytest.mark.parametrize("batch, world_size, fix", [
    (["--total_batch_size", "524288", "--micro_batch_size", "96"], 1, "use --micro_batch_size 64, the largest that "
     "divides it, or make --total_batch_size a multiple of it"),
    (["--total_batch_size", "1000", "--micro_batch_size", "4", "--seq_len", "64", "--block_size", "64"], 2,
     "make --total_batch_size a multiple of seq_len x processes = 128"),
])
def test_a_micro_batch_that_does_not_divide_the_step_names_the_largest_that_does(batch, world_size, fix):
    cfg = t.parse_args(batch)
    with pytest.raises(t.RunError) as raised:
        t.check_config(cfg, world_size)
    tokens = cfg.micro_batch_size * cfg.seq_len * world_size
    assert str(raised.value) == (f"--total_batch_size {cfg.total_batch_size} is not divisible by micro_batch_size x "
                                 f"seq_len x processes = {cfg.micro_batch_size} x {cfg.seq_len} x {world_size} = "
                                 f"{tokens}: {fix}")


def test_eps_of_0_is_refused_before_any_work(tmp_path, capsys):
    """With eps 0 AdamW divided 0 by 0 where a parameter got no gradient: one step, then "training diverged ...
    lower --max_lr", the wrong advice."""
    line = one_line_exit(capsys, TINY_ARGS + ["--eps", "0", "--log_dir", str(tmp_path / "log")])
    assert line == "error: --eps 0.0 is not above 0: AdamW divides by it where a gradient is 0 (try 1e-8)"
    assert not (tmp_path / "log").exists()


# ------------------------------ TensorBoard turned on at a resume (issue 52)

def test_tensorboard_first_turned_on_at_a_resume_writes_the_earlier_records_too(tmp_path):
    """It wrote only the resumed steps, though a resumed run is said to continue the same curves. Both runs are
    main()'s in this process: it returns where the script would exit 0, and a failure raises."""
    without = [arg for arg in BOARD_ARGS if arg != "--tensorboard"]
    t.main(t.parse_args(without + ["--log_dir", str(tmp_path), "--stop_after_steps", "5"]))
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    t.main(t.parse_args(BOARD_ARGS + ["--log_dir", str(tmp_path), "--resume", "auto"]))
    curves = board_curves(tmp_path)
    assert [step for step, _ in curves["train_loss"]] == list(range(8))
    assert [step for step, _ in curves["val_loss"]] == [-1, 3, 7]
    assert curves == jsonl_curves(tmp_path)


# ------------------------------ a model field a hacker adds: --init_from and --resume (issue 55)

def test_a_model_field_a_hacker_adds_is_the_checkpoints_and_a_differing_flag_is_refused(tmp_path, monkeypatch):
    """--init_from CKPT --window 4 ran with the saved 16, and a checkpoint field the code did not know was dropped
    without a word. Every GPTConfig field but dropout is what the weights mean: the checkpoint's, unless a flag given
    differs, which is refused; derived from GPTConfig's fields, not a list."""
    added = ("window", int, dataclasses.field(default=0))
    monkeypatch.setattr(t, "GPTConfig", dataclasses.make_dataclass("GPTConfig", [added], bases=(t.GPTConfig,)))
    flag = ("window", int, t.flag(0, "keys a query sees; 0: all", "model"))  # parse_args reads Config's fields
    monkeypatch.setattr(t, "Config", dataclasses.make_dataclass("Config", [flag], bases=(t.Config,)))
    log, ckpt = ["--log_dir", str(tmp_path / "log")], str(tmp_path / "log" / "ckpt_2.pt")
    t.main(t.parse_args(TINY_ARGS + ["--max_steps", "4", "--stop_after_steps", "2", "--window", "16"] + log))
    tune = TINY_ARGS_WITHOUT_SHAPE + ["--max_steps", "1", "--warmup_steps", "0", "--init_from", ckpt]
    with pytest.raises(t.RunError) as refused:
        t.parse_args(tune + ["--window", "4", "--n_layer", "2"])  # the same n_layer passes
    assert str(refused.value) == f"--init_from {ckpt} has window 16: drop --window 4"
    tuned = t.main(t.parse_args(tune + ["--log_dir", str(tmp_path / "tuned")]))
    assert tuned.model.config.window == 16 and tuned.model.config.n_layer == 2
    with pytest.raises(SystemExit):
        t.main(t.parse_args(TINY_ARGS + ["--max_steps", "4", "--resume", "auto", "--window", "4"] + log))
    monkeypatch.undo()  # the code without the field, a checkpoint with it
    with pytest.raises(t.RunError) as refused:
        t.CheckedRun(t.parse_args(TINY_ARGS_WITHOUT_SHAPE + ["--init_from", ckpt])).init_from_weights()
    assert str(refused.value) == (f"{ckpt} holds model field(s) window that GPTConfig lacks: add them to GPTConfig, "
                                  "or use the code that wrote it")


# ------------------------------ a missing checkpoint is named as missing, with those beside it (issue 56)

@pytest.mark.parametrize("flag, path, expected", [
    ("--init_from", "shakespeare/ckpt_20.pt",
     "--init_from shakespeare/ckpt_20.pt does not exist: shakespeare holds ckpt_10.pt, ckpt_5.pt"),
    ("--resume", "shakespeare/ckpt_20.pt",
     "--resume shakespeare/ckpt_20.pt does not exist: shakespeare holds ckpt_10.pt, ckpt_5.pt"),
    ("--resume", "shakespeare", "--resume shakespeare is a folder: use --resume auto --log_dir shakespeare"),
    ("--init_from", "shakespeare", "--init_from shakespeare is a folder: shakespeare holds ckpt_10.pt, ckpt_5.pt"),
    ("--resume", "empty/ckpt_20.pt", "--resume empty/ckpt_20.pt does not exist: give a ckpt_<step>.pt from a --log_dir"),
    ("--init_from", "gpt5", "--init_from gpt5 does not exist: give gpt2, gpt2-medium, gpt2-large, gpt2-xl or a "
                            "ckpt_<step>.pt from a --log_dir"),
])
def test_a_missing_checkpoint_says_so_and_names_the_checkpoints_in_its_folder(flag, path, expected, tmp_path,
                                                                               monkeypatch, capsys):
    """`--init_from shakespeare/ckpt_20.pt` was "neither gpt2, ... nor a checkpoint file", `--resume log` "no such
    checkpoint file: log"."""
    monkeypatch.chdir(tmp_path)
    for folder in ("shakespeare", "empty"):
        (tmp_path / folder).mkdir()
    for name in ("ckpt_5.pt", "ckpt_10.pt", "metrics.jsonl"):
        (tmp_path / "shakespeare" / name).write_bytes(b"")
    flags = TINY_ARGS_WITHOUT_SHAPE if flag == "--init_from" else TINY_ARGS
    assert one_line_exit(capsys, flags + ["--log_dir", "log", flag, path]) == f"error: {expected}"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty", "shakespeare"]  # nothing written
