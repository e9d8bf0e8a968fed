"""Shared test setup: offline tokenizer files, the tiny Shakespeare text, a tiny model's flags."""

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))

if (SHARED / "tiktoken_cache").is_dir():  # offline copy of the GPT-2 BPE files (CI has no network)
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken_cache"))

# The one corpus the tests read from beside their own files: input.txt, which a first run downloads (and
# .ci/run copies into place, offline). Every other corpus a test needs, it makes.
SHAKESPEARE = ROOT / "input.txt"
if not SHAKESPEARE.exists():
    import train_gpt2

    train_gpt2.download(train_gpt2.TINY_SHAKESPEARE_URL, str(SHAKESPEARE), "put tiny Shakespeare there by hand")

# A 1.6M-parameter model (most of it the 50304-row embedding): 20 CPU steps take about 2 seconds.
TINY_ARGS = [
    "--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64",
    "--seq_len", "32", "--micro_batch_size", "4", "--total_batch_size", "256",
    "--max_steps", "20", "--warmup_steps", "2", "--max_lr", "3e-3",
    "--eval_every", "0", "--sample_every", "0", "--device", "cpu", "--text_file", str(SHAKESPEARE),
]


def pytest_configure(config):
    # A file or socket a test leaves open fails that test (python -X dev -W error::ResourceWarning would only warn)
    config.addinivalue_line("filterwarnings", "error::ResourceWarning")
    config.addinivalue_line("filterwarnings", "error::pytest.PytestUnraisableExceptionWarning")


def run_python(args, env=None, timeout=300, max_file_bytes=None):
    """Run `python ARGS` in the project root, as a user would from a shell. With max_file_bytes, its writes past
    that size in any file fail as the kernel fails them (files_limited_to)."""
    return subprocess.run([sys.executable] + list(args), cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout,
                          preexec_fn=max_file_bytes and files_limited_to(max_file_bytes))


def run_script(args, env=None, timeout=300, max_file_bytes=None):
    return run_python(["train_gpt2.py"] + list(args), env, timeout, max_file_bytes)


def files_limited_to(max_bytes):
    """A subprocess's preexec_fn: a write past max_bytes in any file fails in the kernel with EFBIG, as one on a full
    disk fails with ENOSPC, and needs no mount. SIGXFSZ, which would kill the process, is ignored; exec keeps both."""

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return limit


@pytest.fixture
def tiny_args(tmp_path):
    return TINY_ARGS + ["--log_dir", str(tmp_path / "log")]


@pytest.fixture
def one_thread():
    """For bitwise comparisons between runs in this process. With one thread no kernel can split a sum
    differently from one run to the next; two identical 2-thread runs once differed by a few ulps at step 0
    on a loaded CI machine. (Subprocess tests get OMP_NUM_THREADS=1 for the same reason.)"""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
