"""Each user mistake: exit status 2, one line on stderr naming the problem and the fix, nothing else."""

import pytest

from conftest import TINY_ARGS, run_script


def one_line_error(result):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""  # stopped before any work: the start-up line was never printed
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--total_batch_size", "1000"],
         "error: --total_batch_size 1000 is not divisible by micro_batch_size x seq_len x processes = 4 x 32 x 1 = 128: "
         "make --total_batch_size a multiple of it"),
        (["--seq_len", "128"],
         "error: --seq_len 128 is longer than --block_size 64: lower --seq_len or raise --block_size"),
        (["--model", "gpt3"],
         "error: unknown --model 'gpt3': choose one of gpt2, gpt2-medium, gpt2-large, gpt2-xl"),
        (["--device", "tpu"], "error: unknown --device 'tpu': use auto, cpu, cuda, cuda:N or mps"),
        (["--device", "cuda"], "error: --device cuda is not available on this machine: use --device auto or cpu"),
        (["--vocab_size", "1000"],
         "error: --vocab_size 1000 is smaller than the GPT-2 tokenizer's 50257 tokens: use at least 50257 "
         "(50304 is faster)"),
        (["--warmup_steps", "21"], "error: --warmup_steps 21 must be between 0 and --max_steps 20: lower --warmup_steps"),
        (["--n_embd", "33"], "error: --n_embd 33 is not divisible by --n_head 2: pick a width that is"),
        (["--dtype", "float8"], "error: unknown --dtype 'float8': choose auto, float32, bfloat16 or float16"),
        (["--max_steps", "ten"], "error: argument --max_steps: invalid int value: 'ten' (see --help)"),
        (["--fp8"], "error: --fp8 needs an NVIDIA GPU with float8 matmuls (compute capability 8.9 or newer: Ada, "
                    "Hopper); this run is on cpu: drop --fp8"),
        (["--learning_rate", "1"], "error: unrecognized arguments: --learning_rate 1 (see --help)"),
    ],
)
def test_config_mistakes(args, message):
    assert one_line_error(run_script(TINY_ARGS + args)) == message


def test_missing_data_dir(tmp_path):
    line = one_line_error(run_script(TINY_ARGS + ["--data_dir", str(tmp_path / "nowhere")]))
    assert line == f"error: --data_dir {tmp_path / 'nowhere'} is not a folder: run fineweb.py to make shards, or fix the path"


def test_data_dir_without_shards(tmp_path):
    (tmp_path / "notes.txt").write_text("no shards here")
    line = one_line_error(run_script(TINY_ARGS + ["--data_dir", str(tmp_path)]))
    assert line == f"error: no train shards (*_train_*.npy) in --data_dir {tmp_path}: run fineweb.py to make them"


def test_text_download_failure_offline(tmp_path):
    missing = tmp_path / "input.txt"
    url = "http://127.0.0.1:9/input.txt"  # the discard port: the connection is refused at once
    line = one_line_error(run_script(TINY_ARGS + ["--text_file", str(missing), "--text_url", url]))
    assert line.startswith(f"error: could not download {url} to {missing} (")
    assert line.endswith("): put a text file there or pass --text_file or --data_dir")
    assert list(tmp_path.iterdir()) == []  # no partial download left behind


def test_help_explains_every_flag():
    result = run_script(["--help"])
    assert result.returncode == 0
    import train_gpt2 as t
    import dataclasses

    for field in dataclasses.fields(t.TrainConfig):
        assert f"--{field.name}" in result.stdout
    assert "989 is the H100 SXM dense bf16 datasheet figure" in " ".join(result.stdout.split())
