"""Shared test setup: offline tokenizer files, the tiny Shakespeare text, a tiny model's flags."""

import contextlib
import functools
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

if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n 2`: a core each, their subprocesses too (not 2 threads each)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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
# TINY_ARGS without the model's flags, for --init_from, which sets them (parse_args refuses one that differs)
TINY_ARGS_WITHOUT_SHAPE = [arg for flag, value in zip(TINY_ARGS[::2], TINY_ARGS[1::2], strict=True)
                           if flag not in ("--n_layer", "--n_head", "--n_embd", "--block_size") for arg in (flag, value)]


def checked_run(**config):
    """train_gpt2's hardened Run for Config(device="cpu", **config): its token_streams(), hellaswag(), ..."""
    import train_gpt2

    return train_gpt2.CheckedRun(train_gpt2.Config(device="cpu", **config))


@functools.cache
def moved_gpt2(offset=70_000):
    """Another tokenizer, offline: GPT-2's merges with every id moved up by offset, so that ids run past 65,535
    (<|endoftext|> is 120,256 of 120,257). The ids below offset decode to bytes no UTF-8 text holds (0xff, then the
    id), so a model that samples one prints a replacement character, and no text ever encodes to one. Tests put it
    in place of train_gpt2.tokenizer and fineweb.tokenizer (pytest --tokenizer moved_gpt2: for the whole run)."""
    import tiktoken

    gpt2 = tiktoken.get_encoding("gpt2")
    ranks = {b"\xff" + i.to_bytes(3, "big"): i for i in range(offset)}
    ranks |= {piece: rank + offset for piece, rank in gpt2._mergeable_ranks.items()}
    return tiktoken.Encoding(name=f"gpt2_moved_{offset}", pat_str=gpt2._pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": gpt2.eot_token + offset})


def pytest_addoption(parser):
    parser.addoption("--tokenizer", default="gpt2", choices=["gpt2", "moved_gpt2"],
                     help="moved_gpt2: the tests run with conftest's moved_gpt2() in place of train_gpt2's tokenizer")


def hash_routed_gpt(n_experts=8):
    """train_gpt2.GPT with each block's MLP a mixture of n_experts of them, top-1 routed by hash (Roller et al. 2021,
    "Hash Layers For Large Sparse Models"): token id % n_experts picks a token's expert. An expert that no token of a
    batch picks is skipped, so its parameters get no gradient from that batch, as top-1 routing leaves them."""
    import train_gpt2

    class HashRoutedMLP(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.experts = torch.nn.ModuleList(train_gpt2.MLP(config) for _ in range(n_experts))
            self.tokens = None  # (B, T): the block's, set before each call

        def forward(self, x):  # (B, T, C)
            y, expert_of = torch.zeros_like(x), self.tokens % n_experts
            for i, expert in enumerate(self.experts):
                if (picked := expert_of == i).any():  # (B, T)
                    y[picked] = expert(x[picked])  # (tokens picked, C)
            return y

    class HashRoutedBlock(train_gpt2.Block):
        def __init__(self, config):
            super().__init__(config)
            self.mlp = HashRoutedMLP(config)

        def forward(self, x, positions, tokens, cache=None):
            self.mlp.tokens = tokens
            return super().forward(x, positions, tokens, cache)

    class HashRoutedGPT(train_gpt2.GPT):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.transformer.h = torch.nn.ModuleList(HashRoutedBlock(config) for _ in range(config.n_layer))
            self.reset_parameters()

    return HashRoutedGPT


def idle_experts(tokens, n_experts=8):
    """The experts of hash_routed_gpt that no token of tokens (a batch) picks."""
    return set(range(n_experts)) - set((tokens % n_experts).flatten().tolist())


def pytest_configure(config):
    # `pytest -m "not recipe" tests/test_model.py` after an edit to the model: the invariants alone
    config.addinivalue_line("markers", "recipe: pins GPT-2's published numbers (sizes, init, learning rates)")
    # A file or socket a test leaves open fails that test (python -X dev -W error::ResourceWarning would only warn)
    config.addinivalue_line("filterwarnings", "error::ResourceWarning")
    config.addinivalue_line("filterwarnings", "error::pytest.PytestUnraisableExceptionWarning")
    if config.getoption("tokenizer") == "moved_gpt2":  # as a hacker's edit of tokenizer() would
        import fineweb
        import train_gpt2

        train_gpt2.tokenizer = fineweb.tokenizer = moved_gpt2


def named(name):
    """assert_close's msg: its own message (the numbers that differ), after name."""
    return lambda message: f"{name}: {message}"


class Seen:
    """module as its own code reads it, with the attributes given replaced: type(module).forward(Seen(module,
    c_attn=...), ...) runs a hacker's forward on a test's change, composed around it, its text untouched."""

    def __init__(self, module, **replaced):
        self.seen_module, self.replaced = module, replaced

    def __getattr__(self, name):  # all but seen_module and replaced: the module's own, or its replacement
        return self.replaced[name] if name in self.replaced else getattr(self.seen_module, name)


def queries_keys_values(qkv, n_embd):
    """Attention's c_attn output (..., n_embd + 2 width) as queries (..., n_embd), keys and values (..., width):
    width is n_embd in GPT-2, less where the keys and values have fewer heads (multi-query, grouped attention)."""
    q, kv = qkv.split([n_embd, qkv.size(-1) - n_embd], dim=-1)
    return (q, *kv.chunk(2, dim=-1))


def turning(c_attn, head_dim, turn):
    """c_attn with its queries and keys turned by turn(q, k), each (B, heads, T, head_dim), on the way out."""
    def turned(x):
        B, T, C = x.shape
        q, k, v = queries_keys_values(c_attn(x), C)
        q, k = turn(*(z.view(B, T, -1, head_dim).transpose(1, 2) for z in (q, k)))
        return torch.cat([z.transpose(1, 2).reshape(B, T, -1) for z in (q, k)] + [v], dim=-1)
    return turned


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


@contextlib.contextmanager
def single_thread():
    """For bitwise comparisons between runs in this process. With one thread no kernel can split a sum
    differently from one run to the next; two identical 2-thread runs once differed by a few ulps at step 0
    on a loaded CI machine. (Subprocess tests get OMP_NUM_THREADS=1 for the same reason.)"""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def one_thread():
    """single_thread() for the whole test (a module's fixtures use single_thread() itself)."""
    with single_thread():
        yield


# What torch.cuda.get_device_properties reports on each real card: name, compute capability, memory in bytes
CARDS = {
    "h100": ("NVIDIA H100 80GB HBM3", 9, 0, 85_029_158_912),
    "a100": ("NVIDIA A100-SXM4-80GB", 8, 0, 84_974_239_744),
    "4090": ("NVIDIA GeForce RTX 4090", 8, 9, 25_393_692_672),
    "v100": ("Tesla V100-SXM2-16GB", 7, 0, 16_945_512_448),
    "t4": ("Tesla T4", 7, 5, 15_828_320_256),
    "1080": ("NVIDIA GeForce GTX 1080 Ti", 6, 1, 11_721_506_816),
    "a6000": ("NVIDIA RTX A6000", 8, 6, 51_041_271_808),  # not in train_gpt2.py's table of peaks
}


# torch.cuda.get_arch_list() of PyTorch's Linux builds for CUDA 12.6 (5.0 to 9.0, by PyTorch's support matrix) and
# for CUDA 13.0, PyPI's default (as 2.11.0+cu130 printed it on an H200 here)
ARCH_LISTS = {"cu126": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
              "cu130": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]}


def report_card(card, setattr, gpus=1, build="cu126"):
    """Make this CPU-only torch report `gpus` of the card: its properties, whence torch's own get_device_name,
    get_device_capability and is_bf16_supported answer (the last true with emulation on every card, as a bfloat16
    tensor can be made on each, and false without it below 8.0), a set_device that checks its argument as the
    real one does first, and the kernels of torch's `build` (ARCH_LISTS). setattr: pytest's monkeypatch.setattr, or
    the builtin in a child process."""
    from torch.cuda._utils import _get_device_index

    name, major, minor, memory = CARDS[card]
    properties = type("_CudaDeviceProperties", (), dict(name=name, major=major, minor=minor, total_memory=memory))
    setattr(torch.cuda, "device_count", lambda: gpus)
    setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    setattr(torch.cuda, "current_device", lambda: 0)
    setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
    setattr(torch.cuda, "set_device", lambda device: _get_device_index(device))
    setattr(torch.cuda, "get_arch_list", lambda: ARCH_LISTS[build])
