"""--tensorboard: the figures of metrics.jsonl as TensorBoard scalars, read back with TensorBoard's own reader."""

import json
import signal
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train_gpt2 as t
from conftest import TINY_ARGS, run_script
from test_checkpoint import no_room, one_line_error, start_training, wait_for_line
from test_ddp import ONE_THREAD, torchrun

BOARD_ARGS = TINY_ARGS + ["--max_steps", "8", "--eval_every", "4", "--eval_steps", "1", "--tensorboard"]


def board_curves(log_dir):
    """Every scalar tag's (step, value) pairs, as TensorBoard shows them."""
    board = EventAccumulator(str(log_dir))
    board.Reload()
    return {tag: [(event.step, event.value) for event in board.Scalars(tag)] for tag in board.Tags()["scalars"]}


def jsonl_curves(log_dir):
    """The same from metrics.jsonl, each value rounded to the float32 that an event holds."""
    curves = {}
    for record in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines()):
        for tag, value in record.items():
            if "step" in record and tag != "step":
                curves.setdefault(tag, []).append((record["step"], float(np.float32(value))))
    return curves


def test_a_run_writes_every_figure_of_metrics_jsonl_at_its_step(tmp_path):
    t.main(t.parse_args(BOARD_ARGS + ["--log_dir", str(tmp_path)]))
    curves = board_curves(tmp_path)
    assert sorted(curves) == ["grad_norm", "lr", "ms", "tokens_per_s", "train_loss", "val_loss"]
    assert [step for step, _ in curves["train_loss"]] == list(range(8))
    assert [step for step, _ in curves["val_loss"]] == [-1, 3, 7]  # -1: before training
    assert curves == jsonl_curves(tmp_path)


def test_a_run_killed_after_a_checkpoint_and_resumed_holds_each_step_once(tmp_path):
    """kill -9 leaves events past the checkpoint (here step 4's validation at least); the resumed run's writer
    makes TensorBoard drop them from the checkpoint's step on, as metrics.jsonl drops those records. (The killed run
    is a process; the resumed one, this process.)"""
    args = BOARD_ARGS + ["--max_steps", "100000", "--ckpt_every", "4", "--eval_every", "5", "--log_dir",
                         str(tmp_path)]
    process = start_training(["train_gpt2.py"] + args)
    wait_for_line(process, "step     5/100000 | loss")  # printed after step 4's validation was written
    process.send_signal(signal.SIGKILL)  # ckpt_8 comes after two more steps
    process.communicate(timeout=60)
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_4.pt"]
    assert [step for step, _ in board_curves(tmp_path)["val_loss"]] == [-1, 4]  # the killed run's
    t.main(t.parse_args(args + ["--resume", "auto", "--stop_after_steps", "2", "--eval_every", "0"]))
    curves = board_curves(tmp_path)
    assert [step for step, _ in curves["val_loss"]] == [-1]  # step 4's went with the rest from step 4 on
    assert [step for step, _ in curves["train_loss"]] == list(range(6))
    assert {tag: values for tag, values in curves.items() if values} == jsonl_curves(tmp_path)


def test_a_run_stopped_and_resumed_continues_the_same_curves(tmp_path):
    t.main(t.parse_args(BOARD_ARGS + ["--log_dir", str(tmp_path), "--stop_after_steps", "5"]))
    t.main(t.parse_args(BOARD_ARGS + ["--log_dir", str(tmp_path), "--resume", "auto"]))
    curves = board_curves(tmp_path)
    assert [step for step, _ in curves["train_loss"]] == list(range(8))
    assert curves == jsonl_curves(tmp_path)


def test_under_torchrun_rank_0_alone_writes_the_events(tmp_path):
    result = torchrun(2, ["train_gpt2.py"] + BOARD_ARGS + ["--log_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    curves = board_curves(tmp_path)
    assert [step for step, _ in curves["train_loss"]] == list(range(8)) and curves == jsonl_curves(tmp_path)


def test_without_the_tensorboard_package_it_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: importing it fails
    with pytest.raises(SystemExit) as exited:
        t.main(t.parse_args(BOARD_ARGS + ["--log_dir", str(tmp_path / "log")]))
    assert exited.value.code == 2
    assert capsys.readouterr() == ("", "error: --tensorboard needs the tensorboard package: pip install tensorboard\n")
    assert not (tmp_path / "log").exists()


def test_an_events_file_the_disk_cannot_take_stops_the_run_with_one_line(tmp_path):
    """Some 230 bytes a step in the events file against 170 in metrics.jsonl: given room for metrics.jsonl's 40 steps
    after its first record (what the run is), the events file fills first, some 35 steps in."""
    from test_checkpoint import after_the_run_record

    args = BOARD_ARGS + ["--max_steps", "40", "--eval_every", "0", "--log_dir", str(tmp_path)]
    result = run_script(args, env=ONE_THREAD, max_file_bytes=after_the_run_record(args, 170 * 40 + 200))
    assert one_line_error(result) == no_room(next(tmp_path.glob("events.out.tfevents.*")))
    assert not list(tmp_path.glob("ckpt_*"))
    steps = [step for step, _ in jsonl_curves(tmp_path)["train_loss"]]
    assert steps == list(range(len(steps))) and 8 <= len(steps) < 40
