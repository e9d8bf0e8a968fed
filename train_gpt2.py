"""Pretrain GPT-2 from scratch in plain PyTorch, on one device or many.

    python train_gpt2.py                                       # one device (CUDA, MPS or CPU)
    torchrun --standalone --nproc_per_node=8 train_gpt2.py     # one machine, 8 processes

The recipe comes first (config to evaluation), then the plumbing a real run needs.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import glob
import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import sys
import sysconfig
import time
import typing
import urllib.parse
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

TEXT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "input.txt")
TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
GPT2_VOCAB_SIZE = 50257
END_OF_TEXT = 50256  # <|endoftext|>: between documents; an empty prompt starts from it
UNTIMED_STEPS = 3  # first steps (compilation, warm-up): left out of the speed summary

# (n_layer, n_head, n_embd) of the published GPT-2 models
MODEL_SHAPES = {
    "gpt2": (12, 12, 768),  # 124M
    "gpt2-medium": (24, 16, 1024),  # 350M
    "gpt2-large": (36, 20, 1280),  # 774M
    "gpt2-xl": (48, 25, 1600),  # 1558M
}


class ConfigError(Exception):
    """A user mistake (or a run its settings made diverge): one line, exit 2."""


class DownloadError(ConfigError):
    """A file needed from the network could not be fetched."""


# ------------------------------ config

def flag(default, help: str, choices=None, section: str | None = None):
    """A TrainConfig field; section: the --help heading starting at this flag."""
    return field(default=default, metadata={"help": help, "choices": choices, "section": section})


@dataclass
class TrainConfig:
    model: str = flag("gpt2", "GPT-2 shape", choices=list(MODEL_SHAPES), section="model")
    n_layer: int | None = flag(None, "transformer blocks (default: from --model)")
    n_head: int | None = flag(None, "attention heads (default: from --model)")
    n_embd: int | None = flag(None, "model width (default: from --model)")
    block_size: int = flag(1024, "longest context the model accepts (learned positions)")
    vocab_size: int = flag(50304, "embedding rows: 50257 tokens padded to a multiple of 128")
    dropout: float = flag(0.0, "dropout where GPT-2 had it, training only (0.1-0.2 to fine-tune)")
    data_dir: str = flag("", "fineweb.py's .npy shards' folder; empty: --text_file", section="data")
    text_file: str = flag("", "text to split 90/10 into train/val (default: tiny Shakespeare)")
    shuffle: bool | None = flag(None, "new seeded window order each epoch (default: on for shards)")
    # batch: 2**19 = 524,288 tokens a step, about GPT-3 small's 0.5M
    total_batch_size: int = flag(2**19, "tokens per optimizer step, all processes", section="batch")
    micro_batch_size: int = flag(64, "sequences per forward/backward pass per process")
    seq_len: int = flag(1024, "tokens per training sequence (at most --block_size)")
    # optimizer and schedule: GPT-3 small's, as in build-nanogpt
    optimizer: str = flag("adamw", "adamw, or muon: Muon for the blocks' matrices, AdamW for the "
                          "rest", choices=["adamw", "muon"], section="optimizer and schedule")
    max_lr: float = flag(6e-4, "peak learning rate, reached at the end of warmup")
    min_lr_ratio: float = flag(0.1, "final learning rate as a fraction of --max_lr")
    warmup_steps: int = flag(715, "linear warmup steps (375M tokens at 2**19 a step)")
    max_steps: int = flag(19073, "optimizer steps: 19073 x 2**19 tokens is 10B tokens")
    weight_decay: float = flag(0.1, "weight decay (AdamW's and Muon's), on 2-D tensors only")
    beta1: float = flag(0.9, "AdamW beta1")
    beta2: float = flag(0.95, "AdamW beta2")
    eps: float = flag(1e-8, "AdamW epsilon")
    grad_clip: float = flag(1.0, "clip the global gradient norm to this; 0: off")
    device: str = flag("auto", "auto (cuda, mps, cpu), cpu, cuda, cuda:N or mps", section="runtime")
    dtype: str = flag("auto", "autocast dtype (auto: bfloat16 or, on older GPUs, float16; float32 "
                      "off CUDA)", choices=["auto", "float32", "bfloat16", "float16"])
    compile: bool | None = flag(None, "torch.compile (default: on for CUDA where Triton runs; off "
                                      "for --generate)")
    loss_chunk_size: int = flag(0, "loss a slice of N tokens at a time (less memory); 0: off")
    recompute: bool = flag(False, "recompute each block's activations in backward (less memory)")
    shard_optimizer: bool = flag(False, "under torchrun, share the optimizer state out (ZeRO-1)")
    seed: int = flag(1337, "seed for initialisation, shuffling and sampling")
    peak_tflops: float | None = flag(None, "one device's peak TFLOP/s, for MFU (default: the "
                                           "GPU's, from a table of common GPUs)")
    init_from: str = flag("", "start from gpt2, gpt2-medium, gpt2-large, gpt2-xl or a checkpoint",
                          section="weights and run modes")
    eval_only: bool = flag(False, "print the val loss and HellaSwag accuracy, then exit")
    generate: bool = flag(False, "print --num_samples continuations of --prompt, then exit")
    kv_cache: bool = flag(True, "generate with a key/value cache (same tokens, faster)")
    export_hf: str = flag("", "write --init_from's weights here as a transformers model, then exit")
    eval_every: int = flag(250, "val loss before step 0, every N steps and at the end; 0: never",
                           section="evaluation and logging")
    eval_steps: int = flag(20, "validation steps of --total_batch_size tokens per evaluation")
    sample_every: int = flag(250, "print samples every N steps and at the end; 0: never")
    num_samples: int = flag(4, "continuations of --prompt per sampling")
    max_new_tokens: int = flag(32, "tokens per sample")
    temperature: float = flag(1.0, "sampling temperature")
    top_k: int = flag(50, "sample among the k most likely tokens")
    prompt: str = flag("Hello, I'm a language model,", "text the samples continue")
    hellaswag_every: int = flag(0, "HellaSwag accuracy every N steps and at the end; 0: never")
    hellaswag_path: str = flag("", "hellaswag_val.jsonl (default: downloaded once)")
    log_dir: str = flag("log", "folder for metrics.jsonl and checkpoints")
    tensorboard: bool = flag(False, "also write the figures to --log_dir for TensorBoard")
    ckpt_every: int = flag(1000, "checkpoint every N steps and at the end; 0: never",
                           section="checkpoints")
    keep_ckpts: int = flag(2, "keep the N newest checkpoints; 0: all")
    stop_after_steps: int = flag(0, "end this run with a checkpoint after N steps; 0: never")
    resume: str = flag("", "a checkpoint to continue from, or auto: the newest in --log_dir")


def model_shape(cfg: TrainConfig) -> tuple[int, int, int]:
    n_layer, n_head, n_embd = MODEL_SHAPES[cfg.model]
    return (cfg.n_layer or n_layer, cfg.n_head or n_head, cfg.n_embd or n_embd)


def settle_defaults(cfg: TrainConfig, launch) -> tuple[TrainConfig, list[str]]:
    """cfg with the machine's defaults decided; lines saying why a GPU leaves out part of it."""
    device = pick_device(cfg.device, launch, torch.cuda.device_count(),
                         torch.backends.mps.is_available())
    gpu, card, major, minor, blocker = device.startswith("cuda"), "", 0, 0, None
    if gpu:
        card = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        check_kernels(card, major, minor, torch.cuda.get_arch_list())
        blocker = compile_blocker(major, minor, os.environ)
        torch.set_float32_matmul_precision("high")  # TF32 for what autocast leaves in float32
    # bfloat16 arithmetic came with compute capability 8.0; older GPUs emulate it
    bf16 = major >= 8 or torch.version.hip is not None
    if cfg.dtype != "auto":
        dtype = cfg.dtype
    elif gpu:
        dtype = "bfloat16" if bf16 else "float16"
    else:
        dtype = "float32"
    if gpu and dtype == "bfloat16" and not bf16:
        raise ConfigError(f"--dtype bfloat16: {card} (compute capability {major}.{minor}) has no "
                          "bfloat16 arithmetic: use --dtype float16")
    notes = []
    if cfg.compile is not None:
        compile = cfg.compile
    else:  # on CUDA, but not for --generate (compiling outlasts a short text)
        compile = gpu and not blocker and not cfg.generate
        if blocker and not cfg.generate:
            notes.append(f"compile off: {blocker} ({COMPILE_GAIN})")
    if compile and blocker:
        raise ConfigError(f"--compile cannot run on {card}: {blocker}; use --no-compile")
    peak_tflops = cfg.peak_tflops
    if gpu and peak_tflops is None:  # (bfloat16 or float16, float32) of the first row that fits
        peaks = [peak for pattern, *peak in PEAK_TFLOPS if re.search(pattern, card)]
        if peaks:
            peak_tflops = peaks[0][1] if dtype == "float32" else peaks[0][0]
    shuffle = cfg.shuffle if cfg.shuffle is not None else bool(cfg.data_dir)
    return dataclasses.replace(cfg, device=device, dtype=dtype, compile=compile,
                               peak_tflops=peak_tflops, shuffle=shuffle), notes


# ------------------------------ model

@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int = 1024
    vocab_size: int = 50304
    dropout: float = 0.0
    loss_chunk_size: int = 0  # tokens a slice of the training loss; 0: the plain loss
    recompute: bool = False  # rerun each block in backward instead of keeping its activations


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key, value in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, cache: tuple | None = None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        mask = None
        if cache is not None:  # generating: k, v go into the cache; attend over all of it
            kv_cache, layer, positions, mask = cache  # KVCache.at's
            k, v = kv_cache.update(layer, positions, k, v)  # (B, heads, block_size, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=cache is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, cache: tuple | None = None):
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 as published; module names follow OpenAI's checkpoint (its weights map 1:1)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input and output embeddings
        self.reset_parameters()

    def reset_parameters(self):
        # GPT-2 paper: residual projections scaled by 1/sqrt(N), N = 2 adds per block
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def hidden_states(self, idx, cache: "KVCache | None" = None, positions=None):
        """idx (B, T) at positions (T,) (default 0 to T - 1) -> (B, T, n_embd) for logits()."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size "
                             f"{self.config.block_size}")
        if positions is None:
            positions = torch.arange(T, device=idx.device)
        layer_caches = cache.at(positions) if cache is not None else [None] * self.config.n_layer
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block, layer_cache in zip(self.transformer.h, layer_caches, strict=True):
            if self.config.recompute and torch.is_grad_enabled():
                # keeps x alone for backward, and reruns the block there
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, layer_cache)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab_size) for idx (B, T); given targets (B, T), the mean loss alone."""
        x = self.hidden_states(idx)
        return self.logits(x) if targets is None else self.loss(x, targets)

    def logits(self, x):
        """(..., n_embd) -> (..., vocab_size): the loss, HellaSwag and sampling all come here."""
        return self.lm_head(x)

    def loss(self, x, targets):
        """Mean cross-entropy of logits(x) against targets (B, T); with loss_chunk_size, a slice
        of tokens at a time, remade in backward: no full float32 logits (12.3 GiB at 64 x 1024)."""
        x, targets = x.flatten(0, 1), targets.flatten()
        if not self.config.loss_chunk_size:
            return F.cross_entropy(self.logits(x).float(), targets)

        def summed_loss(x, targets):  # summed: the last slice may be shorter
            return F.cross_entropy(self.logits(x).float(), targets, reduction="sum")
        size = self.config.loss_chunk_size
        slices = zip(x.split(size), targets.split(size), strict=True)
        return sum(torch.utils.checkpoint.checkpoint(summed_loss, *pair, use_reentrant=False)
                   for pair in slices) / len(targets)


# ------------------------------ generation's key/value cache

class KVCache:
    """Each layer's keys and values (B, heads, block_size, head_dim), made on the prompt's pass as
    attention makes them (any heads, size, dtype): all positions, so every one-token step has
    the same shapes (one attention plan, one compiled step)."""

    def __init__(self, n_layer: int, block_size: int):
        self.block_size, self.keys, self.values = block_size, [None] * n_layer, [None] * n_layer

    def at(self, positions) -> list[tuple]:
        """(cache, layer, positions, visible) a layer; visible (T, block_size): what T sees."""
        visible = positions[:, None] >= torch.arange(self.block_size, device=positions.device)
        return [(self, layer, positions, visible) for layer in range(len(self.keys))]

    def update(self, layer: int, positions, k, v) -> tuple:
        """k, v (B, heads, T, head_dim) written at positions; the layer's whole keys and values."""
        for kept, new in ((self.keys, k), (self.values, v)):
            shape = (*new.shape[:2], self.block_size, *new.shape[3:])
            if kept[layer] is None or (kept[layer].shape, kept[layer].dtype) != (shape, new.dtype):
                kept[layer] = new.new_zeros(shape)  # not empty: a masked 0 x NaN would be NaN
                torch._dynamo.mark_static_address(kept[layer], guard=False)  # for CUDA graphs
        return (self.keys[layer].index_copy_(2, positions, k),
                self.values[layer].index_copy_(2, positions, v))


# ------------------------------ data

class DataLoader:
    """(B, T) batches of windows of T + 1 tokens (x = window[:-1], y = window[1:]) from token k*T.
    Rank r of W reads B windows from position + r*B, all advance W*B: resumable at any world size.
    Shuffled: an epoch's order from (seed, epoch) alone."""

    def __init__(self, stream: "TokenStream", batch_size, seq_len, rank, world_size, shuffle, seed):
        self.num_windows = max(0, stream.num_tokens - 1) // seq_len
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.windows_consumed = 0
        self.problem = None  # ids beyond GPT-2's vocabulary: another tokenizer's shards
        self._order_epoch, self._order = None, None

    @property
    def epoch(self) -> int:
        return self.windows_consumed // self.num_windows

    def window_order(self, epoch: int) -> np.ndarray:
        """This epoch's window order (8 bytes a window, drawn once)."""
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order_epoch, self._order = epoch, rng.permutation(self.num_windows)
        return self._order

    def window_start(self, window: int) -> int:
        epoch, index = divmod(window, self.num_windows)
        return int(self.window_order(epoch)[index] if self.shuffle else index) * self.seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.batch_size, self.seq_len
        first = self.windows_consumed + self.rank * B
        starts = [self.window_start(w) for w in range(first, first + B)]
        windows = np.stack([self.stream.read(start, T + 1) for start in starts])  # (B, T + 1)
        if windows.max() >= GPT2_VOCAB_SIZE:
            row, column = np.argwhere(windows >= GPT2_VOCAB_SIZE)[0]
            self.problem = self.problem or (
                f"{self.stream.name_at(starts[row] + column)} holds token id {windows[row, column]}"
                f", beyond GPT-2's {GPT2_VOCAB_SIZE} tokens (made with another tokenizer?): "
                "remake the shards with fineweb.py")
            # on a GPU such an id is a fatal device-side assert: clipped, until all ranks stop
            np.minimum(windows, GPT2_VOCAB_SIZE - 1, out=windows)
        self.windows_consumed += self.world_size * B
        windows = torch.from_numpy(windows)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def to_device(batch: torch.Tensor, device: str) -> torch.Tensor:
    """On CUDA via pinned memory: a copy from pageable memory waits for queued GPU work."""
    pinned = device.startswith("cuda")
    return (batch.pin_memory() if pinned else batch).to(device, non_blocking=pinned)


# ------------------------------ distributed setup

# For a peer that never arrives (torchrun ends the rest within a second of a crash); outlasts
# rank 0 writing a checkpoint alone (minutes at gpt2-xl).
DIST_TIMEOUT = datetime.timedelta(minutes=20)


@dataclass
class Launch:
    """Where this process sits in the job; `python train_gpt2.py` is rank 0 of 1."""
    rank: int = 0
    local_rank: int = 0  # rank within this machine: picks the GPU
    world_size: int = 1
    torchrun: bool = False  # under torchrun: a process group, even for one process
    local_world_size: int = 1  # processes on this machine


def init_distributed(launch: Launch, device: str):
    """Under torchrun, join the process group: gloo for CPU tensors, NCCL for CUDA's."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # no stray context on GPU 0
    if launch.torchrun:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=DIST_TIMEOUT)


def all_reduce_mean(value: torch.Tensor, launch: Launch) -> torch.Tensor:
    """SUM, then divide: gloo's ReduceOp.AVG came late, with a bug."""
    if launch.torchrun:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= launch.world_size
    return value


# ------------------------------ optimizer and schedule

def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    return cfg.total_batch_size // (cfg.micro_batch_size * cfg.seq_len * world_size)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to max_lr (step 0 trains), cosine decay to the minimum at max_steps."""
    min_lr = cfg.max_lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return min_lr
    progress = (step - cfg.warmup_steps) / (cfg.max_steps - cfg.warmup_steps)  # 0 -> 1
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.max_lr - min_lr)


def configure_optimizer(model, cfg: TrainConfig, fused: bool, sharded=False) -> list:
    """AdamW, weight decay on 2-D tensors only; --optimizer muon: Muon for the blocks' matrices.
    sharded: ZeRO-1, with the plain state_dict."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    muon_names = {name for name, p in named if cfg.optimizer == "muon" and p.dim() == 2
                  and name.startswith("transformer.h.")}
    to_muon = [p for name, p in named if name in muon_names]
    params = [p for name, p in named if name not in muon_names]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # a sharded fused AdamW cannot load a checkpoint (PyTorch #124133)
    adamw = dict(lr=cfg.max_lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                 fused=fused and not sharded)
    # Muon's update at AdamW's RMS: --max_lr and --weight_decay carry over
    muon = dict(lr=cfg.max_lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    chosen = [(torch.optim.AdamW, groups, adamw)]
    if to_muon:
        chosen.append((torch.optim.Muon, to_muon, muon))
    if sharded:
        # here: it imports FSDP and DTensor, 1.8 s of a start on 2 cores
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return [ZeroRedundancyOptimizer(owned, optimizer_class=kind, **options)
                for kind, owned, options in chosen]
    return [kind(owned, **options) for kind, owned, options in chosen]


# ------------------------------ training loop

def forward_backward(model, loader, accum_steps, device, autocast, scaler, sync_last_only):
    """Accumulate one step's mean gradient; returns this rank's mean loss. sync_last_only: DDP
    all-reduces in the last micro-step only."""
    step_loss = torch.zeros((), device=device)
    for micro_step in range(accum_steps):
        x, y = (to_device(batch, device) for batch in loader.next_batch())
        skip_sync = sync_last_only and micro_step < accum_steps - 1
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            with autocast():
                loss = model(x, y) / accum_steps  # the step's loss: the mean over micro-steps
            scaler.scale(loss).backward()
        step_loss += loss.detach()
    return step_loss


def due(every: int, steps_done: int, last_step: bool) -> bool:
    return bool(every) and (steps_done % every == 0 or last_step)


@dataclass
class TrainResult:
    model: "GPT"  # the plain model: no DDP or compile wrapper
    records: list[dict]  # what rank 0 logged


def train(cfg: TrainConfig, launch: Launch, device, stop_signal: dict, notes) -> TrainResult:
    log = MetricsLog(cfg.log_dir, launch.rank == 0, cfg.tensorboard)
    run = open_run(cfg, launch, device, log)  # data, model, checkpoint: the same on every rank
    raw_model, train_loader, val_loader = run.model, run.train_loader, run.val_loader
    # model trains (compiled, in DDP under torchrun); raw_model is saved, sampled, scored
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if launch.torchrun:  # DDP all-reduces the gradients in buckets during backward
        device_ids = [torch.device(device).index] if device.startswith("cuda") else None
        model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=cfg.dtype == "float16")
    optimizers = configure_optimizer(raw_model, cfg, fused=device.startswith("cuda"),
                                     sharded=cfg.shard_optimizer and launch.world_size > 1)
    torch.manual_seed(cfg.seed + launch.rank)  # dropout: each rank its own masks
    start_step = restore_checkpoint(run.checkpoint, cfg, raw_model, optimizers, scaler,
                                    train_loader, device, log)
    autocast, accum_steps = autocast_for(cfg, device), grad_accum_steps(cfg, launch.world_size)
    params, W = count_parameters(raw_model), launch.world_size
    flops_per_step = cfg.total_batch_size * flops_per_token(raw_model.config, params, cfg.seq_len)
    for line in notes + [start_line(cfg, device, W, params, accum_steps, train_loader)]:
        log.say(line)
    if start_step == 0:  # every later path once, before step 0: a broken edit fails here
        if cfg.eval_every:  # the curve's first point, "after step -1"
            log.evaluation(-1, cfg.max_steps, {"val_loss": estimate_val_loss(
                model, val_loader, cfg.eval_steps, accum_steps, device, autocast, launch)})
        if cfg.hellaswag_every:
            evaluate_hellaswag(raw_model, run.hellaswag[:1], device, autocast, launch)
        if cfg.sample_every and launch.rank == 0:  # the prompt's pass and a one-token step
            generate(raw_model, run.tokenizer.encode_ordinary(cfg.prompt), cfg.num_samples, 2,
                     cfg.temperature, cfg.top_k, cfg.seed, device, autocast, cfg.kv_cache)
    step_ms, epoch = [], train_loader.epoch

    for step in range(start_step, cfg.max_steps):
        started = time.perf_counter()
        raw_model.zero_grad(set_to_none=True)
        loss = forward_backward(model, train_loader, accum_steps, device, autocast, scaler,
                                sync_last_only=launch.torchrun)
        loss = all_reduce_mean(loss, launch)  # DDP averaged the gradients; this, the logged loss
        for optimizer in optimizers:  # AdamW, and Muon with --optimizer muon
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
        lr = lr_at(step, cfg)  # one schedule drives every optimizer
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
            scaler.step(optimizer)
        scaler.update()
        loss, grad_norm = loss.item(), grad_norm.item()  # the step's one wait for the device
        elapsed_ms = (time.perf_counter() - started) * 1000

        # the rest is bookkeeping: log, evaluate, checkpoint, sample
        step_ms.append(elapsed_ms)
        log.train_step(step, cfg, loss, lr, grad_norm, elapsed_ms, flops_per_step, W)
        # all ranks hold the same loss and gradients: if one stops here, all do
        check_step_finite(step, loss, grad_norm, scaler.is_enabled(), cfg.log_dir)
        if train_loader.epoch > epoch:
            epoch = train_loader.epoch
            log.write({"step": step, "epoch": epoch}, f"step {step:5d}/{cfg.max_steps} | epoch "
                      f"{epoch} begins: all {train_loader.num_windows:,} training windows were "
                      f"used, starting again{' in a new order' if train_loader.shuffle else ''}")
        steps_done, last_step = step + 1, step + 1 == cfg.max_steps
        if due(cfg.eval_every, steps_done, last_step):
            log.evaluation(step, cfg.max_steps, {"val_loss": estimate_val_loss(
                model, val_loader, cfg.eval_steps, accum_steps, device, autocast, launch)})
        if due(cfg.hellaswag_every, steps_done, last_step):
            log.evaluation(step, cfg.max_steps,
                           evaluate_hellaswag(raw_model, run.hellaswag, device, autocast, launch))
        stop = stop_or_fail_together(stop_signal["requested"], [train_loader, val_loader, log],
                                     launch, device)
        pause = not last_step and steps_done - start_step == cfg.stop_after_steps > 0
        if stop or pause or due(cfg.ckpt_every, steps_done, last_step):
            write_checkpoint(cfg, launch, device, raw_model, optimizers, scaler, train_loader,
                             steps_done)
        if launch.rank == 0 and due(cfg.sample_every, steps_done, last_step):
            print_samples(raw_model, run.tokenizer, cfg, device, autocast)
        if stop or pause:
            reason = "a signal" if stop else f"--stop_after_steps {cfg.stop_after_steps}"
            log.say(f"stopped by {reason} after step {step}, checkpoint {cfg.log_dir}/ckpt_"
                    f"{steps_done}.pt written: to continue, {RESUME_AUTO}")
            break

    if step_ms:
        log.summary(step_ms, cfg, device, flops_per_step, W)
    else:
        log.say(f"nothing to train: the checkpoint is at step {start_step} of --max_steps "
                f"{cfg.max_steps}")
    stop_or_fail_together(False, [log], launch, device)  # stops every rank if it was not written
    return TrainResult(raw_model, log.records)


# ------------------------------ evaluation

@torch.no_grad()
def estimate_val_loss(model, loader, eval_steps, accum_steps, device, autocast, launch) -> float:
    """Mean loss of the first eval_steps validation steps: the same tokens every time."""
    model.eval()
    loader.windows_consumed = 0
    step_losses = torch.zeros(eval_steps, device=device)
    for step in range(eval_steps):
        for _ in range(accum_steps):
            x, y = (to_device(batch, device) for batch in loader.next_batch())
            with autocast():
                step_losses[step] += model(x, y) / accum_steps
    model.train()
    return all_reduce_mean(step_losses, launch).mean().item()


def next_token(model: GPT, idx, cache: KVCache | None, positions, noise, temperature: float):
    """(B, 1): the token after idx (B, T) at positions (T,), from the top k: argmax(p / E), E Exp(1)
    noise (B, k), samples p as torch.multinomial does, without waiting for the device."""
    hidden = model.hidden_states(idx, cache, positions)[:, -1]  # (B, n_embd)
    logits = model.logits(hidden)[:, :GPT2_VOCAB_SIZE].float() / temperature  # no padding row
    top_logits, top_ids = torch.topk(logits, noise.size(1), dim=-1)
    choice = (F.softmax(top_logits, dim=-1) / noise).argmax(dim=-1, keepdim=True)
    return top_ids.gather(-1, choice)


GENERATE_WARMUP_TOKENS = 3  # not in --generate's tokens/s: prompt, compile, CUDA graph record
# a compiled step's cache, kept with its model: a new one is a new CUDA graph
COMPILED_STEP_CACHES = weakref.WeakKeyDictionary()


@torch.no_grad()
def generate(model: GPT, prompt_tokens: list[int], num_samples, max_new_tokens, temperature, top_k,
             seed, device, autocast, use_cache=True, compile_step=False, timing=None) -> list:
    """Continuations from a private generator (training's RNG untouched); an empty prompt starts
    from <|endoftext|>, as GPT-2's did; past block_size, the last block_size tokens are reread.
    Nothing waits for the device until the end."""
    model.eval()
    context, block_size = prompt_tokens or [END_OF_TEXT], model.config.block_size
    tokens = F.pad(torch.tensor(context, device=device), (0, max_new_tokens)).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    top_k = min(top_k, model.config.vocab_size, GPT2_VOCAB_SIZE)
    position = torch.tensor([len(context)], device=device)  # the one-token step's, +1 in place
    step = next_token  # compiled: once for all lengths and calls, with CUDA graphs on CUDA
    if compile_step:
        step = torch.compile(next_token, fullgraph=True,
                             mode="reduce-overhead" if device.startswith("cuda") else None)
    cache = KVCache(model.config.n_layer, block_size) if use_cache else None
    if use_cache and compile_step:
        cache = COMPILED_STEP_CACHES.setdefault(model, cache)
    with autocast():  # once: each weight is cast once a generation, not once a token
        started = time.perf_counter()
        for length in range(len(context), tokens.size(1)):  # tokens so far
            if timing is not None and length == len(context) + GENERATE_WARMUP_TOKENS:
                tokens[0, length - 1].item()  # for the clock alone: waits for the warm-up
                timing["warm_up_s"], started = time.perf_counter() - started, time.perf_counter()
            noise = torch.empty(num_samples, top_k, device=device).exponential_(generator=generator)
            if cache is None or length > block_size:  # the last block_size tokens, all again
                window = tokens[:, max(0, length - block_size) : length]
                # cuDNN would plan anew for each length
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                  SDPBackend.MATH]):
                    new = next_token(model, window, None, None, noise, temperature)
            elif length == len(context):  # the prompt fills the cache
                new = next_token(model, tokens[:, :length], cache,
                                 torch.arange(length, device=device), noise, temperature)
            else:  # the newest token alone: (B, 1), the same shape and strides
                # a copy: the graph's own output, as input, is what its next run overwrites
                new = step(model, new.clone(), cache, position, noise, temperature)
                position += 1
            tokens[:, length] = new[:, 0]
    model.train()
    samples = tokens[:, len(context) :].tolist()
    if timing is not None:
        timing["timed_s"] = time.perf_counter() - started
    return samples


def print_samples(model: GPT, tokenizer, cfg, device, autocast, compile_step=False, timing=None):
    samples = generate(model, tokenizer.encode_ordinary(cfg.prompt), cfg.num_samples,
                       cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.seed, device, autocast,
                       cfg.kv_cache, compile_step, timing)
    texts = [cfg.prompt + tokenizer.decode(sample) for sample in samples]
    for i, text in enumerate(texts):
        print(f"sample {i}: {text}", flush=True)
    return texts


@torch.no_grad()
def evaluate_hellaswag(model: GPT, batches: list[tuple], device, autocast, launch) -> dict:
    """acc: the ending of lowest summed loss is right; acc_norm: of lowest mean loss a token."""
    model.eval()
    counts = torch.zeros(3, device=device)  # examples, right by summed, by mean loss
    for batch in batches:  # tokens, mask (4n, L): example i in rows 4i to 4i + 3
        tokens, mask, labels = (to_device(tensor, device) for tensor in batch)
        rows, positions = mask[:, 1:].nonzero(as_tuple=True)  # position i predicts token i + 1
        with autocast():
            hidden = model.hidden_states(tokens)[rows, positions]  # (ending tokens, n_embd)
            logits = model.logits(hidden)
        losses = F.cross_entropy(logits.float(), tokens[rows, positions + 1], reduction="none")
        summed = torch.zeros(len(tokens), device=device).index_add_(0, rows, losses).view(-1, 4)
        mean = summed / mask[:, 1:].sum(dim=1).view(-1, 4)
        right = [(scores.argmin(dim=1) == labels).sum() for scores in (summed, mean)]
        counts += torch.stack([torch.tensor(len(labels), device=device), *right])
    model.train()
    if launch.torchrun:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    total, right, right_norm = counts.tolist()
    return {"hellaswag_examples": int(total), "hellaswag_acc": right / total,
            "hellaswag_acc_norm": right_norm / total}


# ------------------------------ the command line and the machine

class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):  # instead of argparse's usage and exit
        raise ConfigError(f"{message} (see --help)")


def parse_args(argv: list[str]) -> TrainConfig:
    """Every TrainConfig field a --flag; --init_from's checkpoint gives the batch shape."""
    parser = _OneLineErrorParser(
        description="Pretrain GPT-2 (defaults: the 124M recipe on GPUs).", usage="%(prog)s [flags]",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=32))
    for f in dataclasses.fields(TrainConfig):
        if f.metadata["section"]:
            group = parser.add_argument_group(f.metadata["section"])
        help_text = f.metadata["help"]  # with the default, unless it says it
        help_text += "" if "(default" in help_text else f" (default: {f.default})"
        if f.type in (bool, bool | None):
            group.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:  # int | None parses as int
            value_type = [t for t in typing.get_args(f.type) if t is not type(None)] or [f.type]
            group.add_argument(f"--{f.name}", type=value_type[0], default=argparse.SUPPRESS,
                               help=help_text, choices=f.metadata["choices"],
                               metavar=None if f.metadata["choices"] else value_type[0].__name__)
    given = vars(parser.parse_args(argv))  # only the flags on the command line
    cfg = TrainConfig(**given)
    if os.path.isfile(cfg.init_from):
        with contextlib.suppress(Exception):  # unreadable: loading it says why
            saved = torch.load(cfg.init_from, map_location="cpu", weights_only=True, mmap=True)
            for name in ("seq_len", "micro_batch_size", "total_batch_size", "eval_steps"):
                if name not in given and isinstance(saved, dict):
                    setattr(cfg, name, saved["config"][name])
    return cfg


def section_fields(section):
    """The TrainConfig fields under one of --help's headings."""
    names, current = [], None
    for f in dataclasses.fields(TrainConfig):
        current = f.metadata["section"] or current
        names += [f.name] if current == section else []
    return names


# Dense tensor-core TFLOP/s from datasheets, for MFU: (pattern of torch's name for the card,
# bfloat16 or float16, float32 as TF32). GeForce: with float32 accumulation, as autocast's.
PEAK_TFLOPS = [
    (r"H100 80GB HBM3|H100 SXM", 989, 495), (r"H100 PCIe", 756, 378), (r"H200$", 989, 495),
    (r"A100", 312, 156), (r"\bA10$", 125, 62.5), (r"\bL4$", 121, 60), (r"L40S$", 362, 183),
    (r"RTX 3090$", 71, 35.6), (r"RTX 4090$", 165, 82.6), (r"V100-SXM", 125, 15.7),
    (r"V100-PCIE", 112, 14), (r"\bT4$", 65, 8.1),
    (r"GTX 1080 Ti$", 11.3, 11.3)]  # no tensor cores: its float32 rate for both
COMPILE_GAIN = "on an H100 compile trains 1.54x faster: 489k against 317k tokens/s"


def check_kernels(card, major, minor, arch_list: list[str]):
    """Refuse a torch with no code the card runs: sm_XY of its major at or below its minor, or
    compute_XY (PTX) at or below its capability."""
    for kind, built_major, built_minor in re.findall(r"(sm|compute)_(\d+)(\d)", str(arch_list)):
        built = (int(built_major), int(built_minor))  # sm_86: (8, 6); sm_100a: (10, 0)
        if built <= (major, minor) and (kind == "compute" or built[0] == major):
            return
    if torch.version.hip is None:  # CUDA 12.6's build: 5.0 to 9.0; PyPI's (CUDA 13): 7.5 up
        raise ConfigError(f"{card} (compute capability {major}.{minor}) has no kernels in torch "
                          f"{torch.__version__}, built for {' '.join(arch_list)}: pip install "
                          "torch --index-url https://download.pytorch.org/whl/cu126")


def compile_blocker(major, minor, environ):
    """Why torch.compile cannot run on this GPU, or None. Triton (Inductor's kernels) builds with
    $CC as given (else gcc, else clang) and Python's headers."""
    from torch.utils._triton import has_triton_package
    if major < 7:
        return f"torch.compile needs compute capability 7.0 or more, this GPU has {major}.{minor}"
    if not has_triton_package():
        return "Triton is not installed (pip install triton)"
    compiler = environ["CC"] if "CC" in environ else shutil.which("gcc") or shutil.which("clang")
    if not (compiler and shutil.which(compiler)):
        named = f"$CC={compiler!r}" if "CC" in environ else "gcc or clang"
        return f"Triton builds with a C compiler and cannot run {named}: install gcc"
    scheme = sysconfig.get_default_scheme()  # as Triton picks it
    headers = sysconfig.get_paths("posix_prefix" if scheme == "posix_local" else scheme)["include"]
    if not os.path.isfile(os.path.join(headers, "Python.h")):
        return (f"Triton builds with Python's headers and {headers} has no Python.h: install "
                "python3-dev")
    return None


def pick_device(requested, launch: Launch, gpu_count, mps_available):
    if requested == "auto":
        requested = "cuda" if gpu_count else "mps" if mps_available else "cpu"
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", requested):
        raise ConfigError(f"unknown --device {requested!r}: use auto, cpu, cuda, cuda:N or mps")
    kind, _, index = requested.partition(":")
    if kind == "cuda" and not gpu_count or kind == "mps" and not mps_available:
        raise ConfigError(f"--device {requested} is not available on this machine: use --device "
                          "auto or cpu")
    if kind == "cuda" and launch.torchrun and index and launch.world_size > 1:
        raise ConfigError(f"--device {requested} names one GPU for {launch.world_size} processes: "
                          "use --device cuda")
    if kind == "cuda" and launch.torchrun and not index:  # one GPU per process
        if launch.local_world_size > gpu_count:
            raise ConfigError(f"{launch.local_world_size} processes on this machine, which has "
                              f"{gpu_count} GPU(s): start one process a GPU "
                              f"(torchrun --nproc_per_node={gpu_count})")
        return f"cuda:{launch.local_rank}"
    if index and int(index) >= gpu_count:
        raise ConfigError(f"--device {requested} is not on this machine, which has {gpu_count} "
                          f"GPU(s), cuda:0 to cuda:{gpu_count - 1}: pick one of those")
    return "cuda:0" if requested == "cuda" else requested  # torch.cuda.set_device needs an index


def check_config(cfg: TrainConfig, world_size):
    shape_flags = [n for n in ("n_layer", "n_head", "n_embd") if getattr(cfg, n) is not None]
    for name in ["block_size", "vocab_size", "total_batch_size", "micro_batch_size", "seq_len",
                 "max_steps", "eval_steps", "num_samples", "top_k"] + shape_flags:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(cfg, name)}")
    negative = [f"--{name} {getattr(cfg, name)}" for name in (
        "eval_every", "sample_every", "hellaswag_every", "ckpt_every", "keep_ckpts", "grad_clip",
        "stop_after_steps", "loss_chunk_size", "max_new_tokens", "weight_decay", "eps")
        if (getattr(cfg, name) or 0) < 0]
    n_layer, n_head, n_embd = model_shape(cfg)
    micro_step_tokens = cfg.micro_batch_size * cfg.seq_len * world_size
    modes = [f"--{mode}" for mode in ("generate", "eval_only", "export_hf") if getattr(cfg, mode)]
    mistakes = [
        (negative, f"{', '.join(negative)}: must be 0 or more"),
        (n_embd % n_head, f"--n_embd {n_embd} is not divisible by --n_head {n_head}: pick a width "
         "that is"),
        (cfg.seq_len > cfg.block_size, f"--seq_len {cfg.seq_len} is longer than --block_size "
         f"{cfg.block_size}: lower --seq_len or raise --block_size"),
        (cfg.vocab_size < GPT2_VOCAB_SIZE, f"--vocab_size {cfg.vocab_size} is smaller than the "
         f"GPT-2 tokenizer's {GPT2_VOCAB_SIZE} tokens: use at least 50257 (50304 is faster)"),
        (cfg.total_batch_size % micro_step_tokens, f"--total_batch_size {cfg.total_batch_size} is "
         f"not divisible by micro_batch_size x seq_len x processes = {cfg.micro_batch_size} x "
         f"{cfg.seq_len} x {world_size} = {micro_step_tokens}: make --total_batch_size a multiple "
         "of it"),
        (not 0 <= cfg.warmup_steps <= cfg.max_steps, f"--warmup_steps {cfg.warmup_steps} must be "
         f"between 0 and --max_steps {cfg.max_steps}: lower --warmup_steps"),
        (cfg.max_lr <= 0, f"--max_lr {cfg.max_lr} is not above 0"),
        (not 0 <= cfg.min_lr_ratio <= 1, f"--min_lr_ratio {cfg.min_lr_ratio} is not in [0, 1]"),
        (not 0 <= cfg.dropout < 1, f"--dropout {cfg.dropout} is not in [0, 1)"),
        (cfg.optimizer == "muon" and not hasattr(torch.optim, "Muon"), "--optimizer muon needs "
         f"torch.optim.Muon, new in PyTorch 2.9; this is {torch.__version__}: upgrade torch"),
        (not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1), f"--beta1 {cfg.beta1} and --beta2 "
         f"{cfg.beta2} must be in [0, 1)"),
        (cfg.temperature <= 0, f"--temperature {cfg.temperature} is not above 0"),
        (cfg.peak_tflops is not None and cfg.peak_tflops <= 0, f"--peak_tflops {cfg.peak_tflops} "
         "is not above 0"),
        (cfg.init_from and cfg.resume, "--init_from starts a new run and --resume continues one: "
         "drop one"),
        (cfg.init_from and cfg.init_from not in MODEL_SHAPES and not os.path.isfile(cfg.init_from),
         f"--init_from {cfg.init_from} is neither {', '.join(MODEL_SHAPES)} nor a checkpoint file"),
        (cfg.init_from and shape_flags, f"--init_from {cfg.init_from} sets the model's shape: "
         f"drop {' '.join('--' + name for name in shape_flags)}"),
        (len(modes) > 1, f"{' and '.join(modes)} are separate runs: pick one"),
        (cfg.export_hf and not cfg.init_from, "--export_hf needs --init_from with the weights to "
         "export"),
        (cfg.export_hf and os.path.exists(cfg.export_hf), f"--export_hf {cfg.export_hf} already "
         "exists: give a new folder"),
        ((cfg.generate or cfg.export_hf) and world_size > 1, f"{' '.join(modes)} runs in one "
         "process: use python, not torchrun"),
        (cfg.tensorboard and not importlib.util.find_spec("tensorboard"),
         "--tensorboard needs the tensorboard package: pip install tensorboard"),
        (cfg.hellaswag_path and not os.path.isfile(cfg.hellaswag_path),
         f"--hellaswag_path {cfg.hellaswag_path} does not exist: give hellaswag_val.jsonl's path"),
    ]
    for mistake, message in mistakes:
        if mistake:
            raise ConfigError(message)


def gather(value, launch: Launch) -> list:
    if not launch.torchrun:
        return [value]
    values = [None] * launch.world_size
    dist.all_gather_object(values, value)
    return values


def raise_first_problem(problems: list[str | None]):
    """Raise the lowest rank's problem, if any, on every rank: rank 0 says it."""
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise ConfigError(problem if rank == 0 else f"{problem} (on rank {rank})")


def check_same_command(cfg: TrainConfig | None, problem: ConfigError | None, launch: Launch):
    """Raise on every rank flags that differ between ranks, then any rank's problem."""
    posts = gather((problem and str(problem), cfg and dataclasses.asdict(cfg)), launch)
    parsed = [(rank, flags) for rank, (_, flags) in enumerate(posts) if flags is not None]
    differing = [f"--{name} {value} on rank {parsed[0][0]} but {flags[name]} on rank {rank}"
                 for name, value in (parsed[0][1].items() if parsed else ())
                 for rank, flags in parsed[1:] if flags[name] != value]
    if differing:
        raise ConfigError("the processes were started with different flags "
                          f"({', '.join(differing)}): start every machine with the same command")
    raise_first_problem([problem for problem, _ in posts])


# ------------------------------ reading tokens and HellaSwag

def gpt2_tokenizer():
    import tiktoken  # here: importing this file does no work
    try:
        return tiktoken.get_encoding("gpt2")
    except (OSError, ValueError) as error:  # offline and not cached; a damaged file
        raise ConfigError(f"cannot load the GPT-2 tokenizer ({type(error).__name__}): tiktoken "
                          "downloads its two files once; connect to the network, or set "
                          "TIKTOKEN_CACHE_DIR to a folder that holds them") from None


def read_text_tokens(path):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--text_file {path} does not exist: give a text file, or --data_dir "
                          "with fineweb.py's shards") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = (error.strerror if isinstance(error, OSError)
                  else f"not UTF-8: {error.reason} at byte {error.start}")
        raise ConfigError(f"cannot read --text_file {path} ({reason}): give a UTF-8 text file") \
            from None
    return np.array(gpt2_tokenizer().encode_ordinary(text), dtype=np.uint16)


def find_shards(data_dir, split):
    if not os.path.isdir(data_dir):
        raise ConfigError(f"--data_dir {data_dir} is not a folder: run fineweb.py to make shards, "
                          "or fix the path")
    if os.path.exists(os.path.join(data_dir, "INCOMPLETE")):  # fineweb.py's, until all are in
        raise ConfigError(f"--data_dir {data_dir} is incomplete (fineweb.py's INCOMPLETE file is "
                          "there): wait for fineweb.py, or rerun it with --resume")
    paths = sorted(glob.glob(os.path.join(data_dir, f"*_{split}_*.npy")))
    if not paths:
        raise ConfigError(f"no {split} shards (*_{split}_*.npy) in --data_dir {data_dir}: "
                          "run fineweb.py to make them")
    return paths


def open_shard(path):
    """Memory-mapped: a batch reads the pages it touches, not the whole shard."""
    try:
        tokens = np.load(path, mmap_mode="r")
    except OSError as error:  # a folder, no permission, a disk error
        raise ConfigError(f"cannot read shard {path} ({error.strerror or error}): check the file") \
            from None
    except (ValueError, EOFError):  # no .npy header: numpy calls it "pickled data"
        raise ConfigError(f"cannot read shard {path}: it is not a .npy file (empty, cut short or "
                          "another format): delete it and rerun fineweb.py") from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1 or len(tokens) < 1:
        raise ConfigError(f"shard {path} holds {tokens.dtype} of shape {tokens.shape}, not a 1-D "
                          "uint16 array of tokens: rerun fineweb.py")
    return tokens


class TokenStream:
    """Token arrays (memory-mapped shards, or one) read as one sequence."""

    def __init__(self, arrays: list[np.ndarray], names: list[str] | None = None):
        self.arrays, self.names = arrays, names or ["the text"] * len(arrays)
        self.starts = np.cumsum([0] + [len(a) for a in arrays])  # first global index of each
        self.num_tokens = int(self.starts[-1])

    def read(self, start, count):
        pieces, end = [], start + count
        index = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            local = start - self.starts[index]
            pieces.append(self.arrays[index][local : local + end - start])
            start += len(pieces[-1])
            index += 1
        return np.concatenate(pieces).astype(np.int64)

    def name_at(self, position):
        return self.names[int(np.searchsorted(self.starts, position, side="right")) - 1]


def load_token_streams(cfg: TrainConfig) -> tuple[TokenStream, TokenStream]:
    """(train, val): --data_dir's shards, or the text file split 90/10."""
    if cfg.data_dir:
        paths = [find_shards(cfg.data_dir, split) for split in ("train", "val")]
        return tuple(TokenStream([open_shard(path) for path in group], group) for group in paths)
    tokens = read_text_tokens(cfg.text_file or TEXT_FILE)
    split = int(0.9 * len(tokens))
    return TokenStream([tokens[:split]]), TokenStream([tokens[split:]])


HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_CACHE = os.path.expanduser("~/.cache/train_gpt2/hellaswag_val.jsonl")
# Tokens per scoring batch, padding included; only ending tokens (a quarter) get logits
HELLASWAG_BATCH_TOKENS = 8192


def read_hellaswag(path):
    """The records: a context "ctx", 4 "endings", the right one's index "label"."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            try:
                example = json.loads(line)
                endings = example["endings"]
                valid = (isinstance(example["ctx"], str) and isinstance(endings, list)
                         and len(endings) == 4 and all(isinstance(e, str) for e in endings)
                         and example["label"] in range(4))
            except (json.JSONDecodeError, KeyError, TypeError):
                valid = False
            if not valid:
                raise ConfigError(f"{path} line {line_number} is not a HellaSwag record (ctx, "
                                  "4 endings, label 0-3)")
            examples.append(example)
    if not examples:
        raise ConfigError(f"{path} holds no HellaSwag records: give hellaswag_val.jsonl's path")
    return examples


def render_hellaswag(example: dict, tokenizer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """tokens (4, L): context then each ending, zero-padded; mask (4, L): 1 on ending tokens."""
    context = tokenizer.encode_ordinary(example["ctx"])
    rows = [context + tokenizer.encode_ordinary(" " + ending) for ending in example["endings"]]
    tokens = torch.zeros(4, max(len(row) for row in rows), dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, len(context) : len(row)] = 1
    return tokens, mask, int(example["label"])


def pack_hellaswag(rendered: list[tuple], max_tokens):
    """Batches of (tokens (4n, L), mask (4n, L), labels (n,)), padded to their longest, of at
    most max_tokens unless one example is longer; shortest first."""
    groups = []
    for example in sorted(rendered, key=lambda example: example[0].size(1)):
        # the longest yet: the group is padded to it
        if not groups or 4 * (len(groups[-1]) + 1) * example[0].size(1) > max_tokens:
            groups.append([])
        groups[-1].append(example)
    batches = []
    for group in groups:
        length = group[-1][0].size(1)
        tokens, mask = (torch.cat([F.pad(example[i], (0, length - example[i].size(1)))
                                   for example in group]) for i in (0, 1))
        batches.append((tokens, mask, torch.tensor([label for _, _, label in group])))
    return batches


# ------------------------------ setting up a run

RESUME_AUTO = "run the same command with --resume auto"


@contextlib.contextmanager
def failed_write_is_one_line(path, then):
    """A failed write (full disk, quota, lost mount) as one ConfigError naming the folder
    (torch.save raises a RuntimeError caused by the OSError)."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        cause = error
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise ConfigError(f"cannot write {path} ({cause.strerror or cause}): make room in "
                          f"{os.path.dirname(path) or '.'}, then {then}") from None


def write_atomically(path, write, then=RESUME_AUTO):
    """write(file) to this process's temporary file, fsync, rename: readers see the old file or
    the whole new one."""
    temporary = f"{path}.{os.uname().nodename}-{os.getpid()}.tmp"
    try:
        with failed_write_is_one_line(path, then), open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    os.replace(temporary, path)


def download(url, path, fix):
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_atomically(path, lambda f: f.write(data), then="run the same command again")
    except OSError as error:
        raise DownloadError(f"could not download {url} to {path} ({error}): {fix}") from None


def open_data(cfg: TrainConfig, launch: Launch, with_val) -> tuple[DataLoader, DataLoader]:
    if not cfg.data_dir and not cfg.text_file and not os.path.exists(TEXT_FILE):
        download(TINY_SHAKESPEARE_URL, TEXT_FILE, "put a text file there, or pass --text_file or "
                                                  "--data_dir")
    train_stream, val_stream = load_token_streams(cfg)
    B, T, W = cfg.micro_batch_size, cfg.seq_len, launch.world_size
    train_loader = DataLoader(train_stream, B, T, launch.rank, W, cfg.shuffle, cfg.seed)
    # in order: the same windows every time
    val_loader = DataLoader(val_stream, B, T, launch.rank, W, False, cfg.seed) if with_val else None
    step_windows, tokens = cfg.total_batch_size // T, f"{cfg.total_batch_size:,} tokens"
    more = "more shards" if cfg.data_dir else "--data_dir with fineweb.py's shards"
    for loader, name, windows, need, fix in [
        (train_loader, "training", step_windows, f"one step of --total_batch_size {tokens}",
         f"train on more data ({more}) or lower --total_batch_size (the README's quick start "
         "trains a small model on tiny Shakespeare)"),
        (val_loader, "validation", step_windows * cfg.eval_steps, f"an evaluation of --eval_steps "
         f"{cfg.eval_steps} steps of {tokens}", f"lower --eval_steps or --total_batch_size, or use "
         f"more data ({more})")]:
        if loader and loader.num_windows < windows:
            raise ConfigError(f"the {name} data holds {loader.stream.num_tokens:,} tokens, "
                              f"{loader.num_windows:,} windows of {T} + 1, but {need} needs "
                              f"{windows:,}: {fix}")
    return train_loader, val_loader


def open_hellaswag(cfg: TrainConfig, launch: Launch, block_size):
    """This rank's HellaSwag examples (r, r + W, ...), tokenized, in batches."""
    path = cfg.hellaswag_path or HELLASWAG_CACHE
    if not os.path.exists(path):
        download(HELLASWAG_URL, path, "pass --hellaswag_path with a local copy of it")
    examples, tokenizer = read_hellaswag(path), gpt2_tokenizer()
    rendered = [render_hellaswag(example, tokenizer)
                for example in examples[launch.rank :: launch.world_size]]
    longest = max((tokens.size(1) for tokens, _, _ in rendered), default=0)
    if longest > block_size:
        fix = "" if cfg.eval_only else ", or drop --hellaswag_every"
        raise ConfigError(f"the longest HellaSwag example in {path} takes {longest} tokens, more "
                          f"than the model's block_size of {block_size}: HellaSwag needs "
                          f"--block_size {longest} or more{fix}")
    return pack_hellaswag(rendered, min(HELLASWAG_BATCH_TOKENS, cfg.micro_batch_size * cfg.seq_len))


def build_model(cfg: TrainConfig, device) -> GPT:
    model_config, state = initial_weights(cfg)
    if not cfg.generate and cfg.seq_len > model_config.block_size:
        raise ConfigError(f"--seq_len {cfg.seq_len} is longer than the model's "
                          f"{model_config.block_size} positions: lower --seq_len")
    torch.manual_seed(cfg.seed)
    model = GPT(model_config)
    if state is not None:
        model.load_state_dict(state)
    return model.to(device)


def autocast_for(cfg: TrainConfig, device):
    """autocast() enters autocast for --dtype (off for float32)."""
    dtype = getattr(torch, cfg.dtype)
    return functools.partial(torch.autocast, device.split(":")[0], dtype=dtype,
                             enabled=dtype != torch.float32)


@dataclass
class OpenedRun:
    """What every rank opened, and found the same, before training."""
    model: GPT  # on the device; a checkpoint's weights are loaded later
    train_loader: DataLoader
    val_loader: DataLoader | None
    checkpoint: dict | None  # to resume from
    hellaswag: list  # this rank's batches
    tokenizer: object


def open_run(cfg: TrainConfig, launch: Launch, device, log) -> OpenedRun:
    """Every rank opens the data, builds the model, finds the checkpoint: a problem on any stops
    all; all must find the same (machines may hold other copies)."""
    problem, found = None, None
    try:
        if launch.rank == 0:
            make_log_dir(cfg.log_dir)
        earlier = checkpoint_paths(cfg.log_dir)
        if earlier and not cfg.resume:  # --resume auto would take them for its own
            raise ConfigError(f"--log_dir {cfg.log_dir} holds an earlier run's checkpoints "
                              f"({os.path.basename(earlier[0])}): continue it with --resume auto, "
                              "or pass another --log_dir")
        train_loader, val_loader = open_data(cfg, launch, with_val=cfg.eval_every > 0)
        model = build_model(cfg, device)
        checkpoint = find_resume_checkpoint(cfg, log.say)
        if checkpoint is not None:
            check_resumable(checkpoint, cfg, model.config)
        hellaswag = open_hellaswag(cfg, launch, model.config.block_size) \
            if cfg.hellaswag_every else []
        run = OpenedRun(model, train_loader, val_loader, checkpoint, hellaswag,
                        gpt2_tokenizer() if cfg.sample_every else None)
        log.begin(checkpoint and checkpoint["step"])
        found = (train_loader.stream.num_tokens, val_loader and val_loader.stream.num_tokens,
                 checkpoint and checkpoint["step"])
    except ConfigError as error:
        problem = str(error)
    posts = gather((problem, found), launch)
    raise_first_problem([problem for problem, _ in posts])
    if len({found for _, found in posts}) > 1:
        raise ConfigError(f"the ranks found different data or checkpoints ((train tokens, val "
                          f"tokens, checkpoint step) on each: {[found for _, found in posts]}): "
                          "give every machine the same shards and a shared --log_dir")
    if launch.rank == 0:
        remove_killed_writes(cfg.log_dir)
    return run


def start_line(cfg: TrainConfig, device, W, parameters, accum_steps, loader):
    card = f", {torch.cuda.get_device_name(device)}" if device.startswith("cuda") else ""
    mfu = (f", MFU against {cfg.peak_tflops:g} TFLOP/s" if cfg.peak_tflops else
           ", no MFU: its peak TFLOP/s is unknown, give --peak_tflops" if card else "")
    sharded = "optimizer state sharded over the processes; " if cfg.shard_optimizer and W > 1 \
        else ""
    return (f"device {device}{card} ({cfg.dtype}, compile {'on' if cfg.compile else 'off'}{mfu}), "
            f"{W} process(es); {parameters:,} parameters; {cfg.total_batch_size:,} tokens per step "
            f"= {accum_steps} micro-steps x {W} process(es) x {cfg.micro_batch_size} x "
            f"{cfg.seq_len}; {sharded}{loader.stream.num_tokens:,} train tokens")


# ------------------------------ weights to start from

# OpenAI's Conv1D weights, (in, out): nn.Linear wants (out, in)
OPENAI_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                     "mlp.c_proj.weight")


def state_from_openai(hf_state: dict):
    """transformers' GPT2LMHeadModel state in our layout."""
    return {name: tensor.t() if name.endswith(OPENAI_TRANSPOSED) else tensor
            for name, tensor in hf_state.items()
            if not name.endswith((".attn.bias", ".attn.masked_bias"))}  # older versions' masks


def state_to_openai(state, vocab_size):
    """Our state in GPT2LMHeadModel's layout, without the padding rows."""
    embeddings = ("transformer.wte.weight", "lm_head.weight")
    return {name: (tensor.t() if name.endswith(OPENAI_TRANSPOSED) else tensor[:vocab_size]
                   if name in embeddings else tensor).contiguous()
            for name, tensor in state.items()}


def import_transformers(flag):
    """transformers, without its warnings and progress bars."""
    import logging
    logging.disable(logging.WARNING)
    try:
        import transformers
        import transformers.models.gpt2.modeling_gpt2  # here, quietly: transformers imports lazily
        transformers.utils.logging.disable_progress_bar()
        return transformers
    except ImportError:
        raise ConfigError(f"{flag} needs the transformers library: pip install transformers") \
            from None
    finally:
        logging.disable(logging.NOTSET)


def load_openai_weights(name):
    """OpenAI's weights through transformers: its cache, else the Hugging Face hub."""
    GPT2LMHeadModel = import_transformers(f"--init_from {name}").GPT2LMHeadModel
    from huggingface_hub.constants import ENDPOINT
    with contextlib.suppress(OSError):  # not cached: offline, the hub would retry for 30 s
        return state_from_openai(GPT2LMHeadModel.from_pretrained(name, local_files_only=True)
                                 .state_dict())
    try:
        url = urllib.parse.urlsplit(ENDPOINT)
        socket.create_connection((url.hostname, url.port or 443), timeout=10).close()
        return state_from_openai(GPT2LMHeadModel.from_pretrained(name).state_dict())
    except OSError as error:
        raise ConfigError(f"cannot download {name} from {ENDPOINT} ({str(error).splitlines()[0]}): "
                          "connect to the network, or give a checkpoint") from None


def training_settings(cfg: TrainConfig):
    """GPTConfig's fields each run sets for itself: they leave the weights' meaning alone."""
    return dict(dropout=cfg.dropout, loss_chunk_size=cfg.loss_chunk_size, recompute=cfg.recompute)


def initial_weights(cfg: TrainConfig) -> tuple[GPTConfig, dict | None]:
    """The model's config (training_settings: this run's) and weights (None: fresh)."""
    training = training_settings(cfg)
    if not cfg.init_from:
        return GPTConfig(*model_shape(cfg), cfg.block_size, cfg.vocab_size, **training), None
    if cfg.init_from in MODEL_SHAPES:  # as released: 1024 positions and the 50257 real tokens
        return (GPTConfig(*MODEL_SHAPES[cfg.init_from], 1024, GPT2_VOCAB_SIZE, **training),
                load_openai_weights(cfg.init_from))
    checkpoint = load_checkpoint(cfg.init_from, "--init_from")
    return GPTConfig(**{**checkpoint["model_config"], **training}), checkpoint["model"]


# ------------------------------ checkpoints

CHECKPOINT_KEYS = {"model", "model_config", "optimizer", "scaler", "step", "config",
                   "windows_consumed", "rng"}


def checkpoint_paths(log_dir):
    """log_dir's ckpt_<step>.pt files, newest first."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(log_dir, "ckpt_*.pt"))
             if (m := re.fullmatch(r"ckpt_(\d+)\.pt", os.path.basename(p)))]
    return [p for _, p in sorted(found, reverse=True)]


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(path, state, keep):
    """The checkpoint and its sha256 (torch.load misses a flipped byte); `keep` newest kept."""
    # to a file object: to a path, torch.save hides a full disk's OSError
    write_atomically(path, lambda f: torch.save(state, f))
    line = file_sha256(path) + "\n"
    write_atomically(f"{path}.sha256", lambda f: f.write(line.encode()))
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    os.fsync(directory)  # make the renames themselves durable
    os.close(directory)
    for old in checkpoint_paths(os.path.dirname(path))[keep:] if keep else []:
        for stale in glob.glob(glob.escape(old) + "*"):  # with its .sha256
            os.remove(stale)
    remove_killed_writes(os.path.dirname(path))


def remove_killed_writes(log_dir):
    """A write killed part way (kill -9) leaves its temporary file: 1.5 GB at 124M."""
    for temporary in glob.glob(os.path.join(log_dir, "ckpt_*.pt*.tmp")):
        os.remove(temporary)


def load_checkpoint(path, flag="--resume"):
    if not os.path.isfile(path):
        raise ConfigError(f"no such checkpoint file: {path}")
    not_ours = f"{flag} {path} is not a checkpoint"
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # torch.save writes zip files
            raise ConfigError(f"{not_ours} (not a file torch.save wrote): give a ckpt_<step>.pt "
                              "from a --log_dir")
    checksum = Path(f"{path}.sha256")
    if checksum.exists() and checksum.read_text().strip() != file_sha256(path):
        raise ConfigError(f"checkpoint {path} is corrupt (its sha256 differs from {checksum}): "
                          "resume from an older checkpoint")
    try:  # memory-mapped, to the CPU (the GPU may lack room beside the model)
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a truncated or foreign file fails in many ways
        fix = "resume from an older checkpoint" if flag == "--resume" else "give another checkpoint"
        raise ConfigError(f"cannot read checkpoint {path} ({str(error).splitlines()[0]}): {fix}") \
            from None
    if not isinstance(checkpoint, dict) or not CHECKPOINT_KEYS <= checkpoint.keys():
        holds = (f"keys {', '.join(map(str, checkpoint))}" if isinstance(checkpoint, dict)
                 else type(checkpoint).__name__)
        raise ConfigError(f"{not_ours} of train_gpt2.py (it holds {holds}): give a ckpt_<step>.pt "
                          "from a --log_dir")
    checkpoint["path"] = path
    return checkpoint


def find_resume_checkpoint(cfg: TrainConfig, say) -> dict | None:
    """The checkpoint --resume names; 'auto': the newest in log_dir that loads, or None."""
    if cfg.resume != "auto":
        return load_checkpoint(cfg.resume) if cfg.resume else None
    for path in checkpoint_paths(cfg.log_dir):
        try:
            return load_checkpoint(path)
        except ConfigError as error:
            say(f"warning: skipping {error}")
    say(f"--resume auto: no checkpoint in {cfg.log_dir}, starting from scratch")
    return None


def check_resumable(checkpoint: dict, cfg: TrainConfig, model_config: GPTConfig):
    """Refuse a checkpoint this run would misread: a GPTConfig field that differs (any but the
    training_settings), the data position's units, the optimizer."""
    saved, wanted = checkpoint["model_config"], dataclasses.asdict(model_config)
    this_runs = training_settings(cfg)
    differing = [f"{name} {saved.get(name)} -> {wanted.get(name)}" for name in {**saved, **wanted}
                 if name not in this_runs and saved.get(name) != wanted.get(name)]
    differing += [f"{name} {checkpoint['config'][name]} -> {getattr(cfg, name)}"
                  for name in ("total_batch_size", "seq_len")  # the data position's units
                  if checkpoint["config"][name] != getattr(cfg, name)]
    if differing:
        raise ConfigError(f"cannot resume from {checkpoint['path']}: {', '.join(differing)} (they "
                          "define its weights, schedule and data position): use its values")
    if (trained_with := checkpoint["config"]["optimizer"]) != cfg.optimizer:
        raise ConfigError(f"cannot resume from {checkpoint['path']} with --optimizer "
                          f"{cfg.optimizer}: it holds {trained_with}'s state; resume with "
                          f"--optimizer {trained_with}, or start a new run from its weights with "
                          f"--init_from {checkpoint['path']}")


def rng_states(device):
    """torch's generators (dropout's). On CUDA this GPU's only: a machine with fewer GPUs could
    not restore the others'."""
    return {"torch_cpu": torch.get_rng_state(),
            "torch_cuda": [torch.cuda.get_rng_state(device)] if device.startswith("cuda") else []}


def restore_rng_states(states, device):
    torch.set_rng_state(states["torch_cpu"])
    if states["torch_cuda"] and device.startswith("cuda"):
        torch.cuda.set_rng_state(states["torch_cuda"][0], device)


def restore_checkpoint(checkpoint, cfg, model, optimizers, scaler, loader, device, log):
    """Weights, optimizer states, scaler, data position, RNG; returns the step (0: none)."""
    if checkpoint is None:
        return 0
    model.load_state_dict(checkpoint["model"])
    for optimizer, state in zip(optimizers, checkpoint["optimizer"], strict=True):
        optimizer.load_state_dict(state)
    if checkpoint["scaler"]:
        scaler.load_state_dict(checkpoint["scaler"])
    loader.windows_consumed = checkpoint["windows_consumed"]
    if loader.rank < len(checkpoint["rng"]):  # a rank new to a larger world keeps its seed
        restore_rng_states(checkpoint["rng"][loader.rank], device)
    saved, step, tokens = checkpoint["config"], checkpoint["step"], loader.stream.num_tokens
    if checkpoint["train_tokens"] != tokens:
        log.say(f"warning: the training data holds {tokens:,} tokens, the checkpoint's held "
                f"{checkpoint['train_tokens']:,}: its data position points at other tokens now; "
                "resume with the checkpoint's data to go on exactly")
    changed = {name: saved.get(name) for name in section_fields("optimizer and schedule")
               if saved.get(name) != getattr(cfg, name)}
    if changed:  # allowed (to extend a run), but the learning rate may jump
        old_cfg = dataclasses.replace(cfg, **{k: v for k, v in changed.items() if v is not None})
        flags = ", ".join(f"--{k} {v} -> {getattr(cfg, k)}" for k, v in changed.items())
        log.say(f"warning: the optimizer and schedule differ from the checkpoint's ({flags}): at "
                f"step {step} the learning rate goes on at {lr_at(step, cfg):.4e} instead of "
                f"{lr_at(step, old_cfg):.4e}")
    log.say(f"resumed from step {step} ({checkpoint['windows_consumed']:,} windows into the data)")
    return step


def write_checkpoint(cfg, launch, device, model, optimizers, scaler, loader, steps_done):
    """Rank 0 writes <log_dir>/ckpt_<steps_done>.pt; all stop if it could not."""
    if cfg.shard_optimizer and launch.world_size > 1:
        for optimizer in optimizers:
            optimizer.consolidate_state_dict(to=0)  # every rank sends its share of the state
    rng = gather(rng_states(device), launch)
    problem = None
    if launch.rank == 0:
        state = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                 "optimizer": [optimizer.state_dict() for optimizer in optimizers], "rng": rng,
                 "scaler": scaler.state_dict(), "config": dataclasses.asdict(cfg),
                 "step": steps_done, "windows_consumed": loader.windows_consumed,
                 "train_tokens": loader.stream.num_tokens}
        try:
            save_checkpoint(os.path.join(cfg.log_dir, f"ckpt_{steps_done}.pt"), state,
                            cfg.keep_ckpts)
        except ConfigError as error:
            problem = str(error)
    raise_first_problem(gather(problem, launch))


def check_step_finite(step, train_loss, grad_norm, loss_scaling, log_dir):
    """Stop a run whose loss or gradient norm is not finite, saving nothing (with float16's loss
    scaling an infinite norm is routine: the step is skipped)."""
    if math.isfinite(train_loss) and (loss_scaling or math.isfinite(grad_norm)):
        return
    saved = checkpoint_paths(log_dir)
    go_back = (f"go on from {saved[0]} (--resume {saved[0]}), or an older checkpoint if the loss "
               "was rising there already," if saved else "start again")
    raise ConfigError(f"training diverged at step {step}: loss {train_loss:.4g}, gradient norm "
                      f"{grad_norm:.4g}; nothing was saved from this step: {go_back} with a lower "
                      "--max_lr or more --warmup_steps")


@contextlib.contextmanager
def catching_stop_signals():
    """SIGTERM (preemption), SIGHUP or Ctrl-C set ["requested"]: the step ends, checkpoints,
    exits; a second Ctrl-C stops at once. A signal ignored (nohup) stays ignored."""
    stop = {"requested": False}

    def handle(signum, frame):
        if stop["requested"] and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop["requested"] = True

    previous = {signum: signal.signal(signum, handle) for signum in
                (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
                if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def interrupted_line(cfg: TrainConfig | None):
    if cfg is None or cfg.export_hf or cfg.generate or cfg.eval_only:  # nothing to save
        return "stopped by Ctrl-C"
    saved = checkpoint_paths(cfg.log_dir)
    if not saved:
        return "stopped at once by a second Ctrl-C: no checkpoint was written, its steps are lost"
    return (f"stopped at once by a second Ctrl-C: the steps after {saved[0]} are lost; to go on "
            f"from it, {RESUME_AUTO}")


def stop_or_fail_together(signalled, sources: list, launch: Launch, device):
    """Whether any rank got a stop signal (a scheduler may signal some); raises any rank's
    problem (a bad token id, a failed write) on all."""
    problem = next((source.problem for source in sources if source and source.problem), None)
    flags = [signalled, problem is not None]
    if launch.torchrun:
        values = torch.tensor(flags, dtype=torch.float32, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        flags = [bool(value) for value in values.tolist()]
    if flags[1]:
        raise_first_problem(gather(problem, launch))
    return flags[0]


# ------------------------------ logging

def make_log_dir(log_dir):
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as error:
        problem = "it is a file" if os.path.isfile(log_dir) else error.strerror
        raise ConfigError(f"cannot make --log_dir {log_dir} ({problem}): give a folder you can "
                          "write to") from None


def record_step(line, default):
    """A metrics.jsonl record's step; default for the summary or a cut line."""
    try:
        return json.loads(line).get("step", default)
    except json.JSONDecodeError:
        return default


class MetricsLog:
    """Rank 0 prints lines, appends records to <log_dir>/metrics.jsonl (and TensorBoard's file).
    A failed write is the problem all ranks stop on at the step's end."""

    def __init__(self, log_dir, active, tensorboard: bool = False):
        self.active, self.path = active, os.path.join(log_dir, "metrics.jsonl")
        self.records, self.problem, self.tensorboard = [], None, tensorboard

    def begin(self, resume_step: int | None):
        """A new run starts an empty file; a resumed one keeps records before resume_step."""
        if not self.active:
            return
        kept = []
        if resume_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if record_step(line, resume_step) < resume_step]
        write_atomically(self.path, lambda f: f.write("".join(kept).encode()))
        if self.tensorboard:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}"
            self.board_path = os.path.join(os.path.dirname(self.path), name)
            # TensorBoard then drops older events from this step on
            restart = Event(step=resume_step or 0, session_log=SessionLog(status=SessionLog.START))
            self.write_events([Event(file_version="brain.Event:2"), restart])

    def write_events(self, events: list):
        """TensorBoard's format (SummaryWriter's thread prints a traceback on a full disk)."""
        from tensorboard.summary.writer.record_writer import RecordWriter
        with failed_write_is_one_line(self.board_path, RESUME_AUTO), \
                open(self.board_path, "ab") as f:
            writer = RecordWriter(f)
            for event in events:
                writer.write(event.SerializeToString())

    def say(self, line):
        if self.active:
            print(line, flush=True)

    def write(self, record, line):
        if not self.active:
            return
        self.say(line)
        self.records.append(record)
        if self.problem:
            return
        size = os.path.getsize(self.path)
        try:
            with failed_write_is_one_line(self.path, RESUME_AUTO), open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.tensorboard and "step" in record:  # an event a figure
                from tensorboard.compat.proto.event_pb2 import Event
                from torch.utils.tensorboard.summary import scalar
                self.write_events([Event(wall_time=time.time(), step=record["step"],
                                         summary=scalar(tag, value))
                                   for tag, value in record.items() if tag != "step"])
        except ConfigError as error:
            os.truncate(self.path, size)  # no half record left
            self.problem = str(error)

    def train_step(self, step, cfg, loss, lr, grad_norm, elapsed_ms, flops_per_step, world_size):
        tokens_per_s = cfg.total_batch_size * 1000 / elapsed_ms
        record = {"step": step, "train_loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "ms": elapsed_ms, "tokens_per_s": tokens_per_s}
        line = (f"step {step:5d}/{cfg.max_steps} | loss {loss:.6f} | lr {lr:.4e} | norm "
                f"{grad_norm:.4f} | {elapsed_ms:.0f} ms | {tokens_per_s:,.0f} tok/s")
        if cfg.peak_tflops:
            record["mfu"] = model_flops_utilization(flops_per_step, elapsed_ms, cfg.peak_tflops,
                                                    world_size)
            line += f" | MFU {100 * record['mfu']:.1f}%"
        self.write(record, line)

    def evaluation(self, step, max_steps, scores: dict):
        """The val loss or HellaSwag's scores after step (-1: before training)."""
        self.write({"step": step, **scores}, f"step {step:5d}/{max_steps} | " + (
            f"val loss {scores['val_loss']:.6f}" if "val_loss" in scores else "HellaSwag acc_norm "
            f"{scores['hellaswag_acc_norm']:.4f} (acc {scores['hellaswag_acc']:.4f})"))

    def summary(self, step_ms, cfg, device, flops_per_step, world_size):
        """Median speed after the untimed first steps; peak memory."""
        timed = step_ms[UNTIMED_STEPS:] or step_ms
        median_ms = statistics.median(timed)
        summary = {"timed_steps": len(timed), "median_ms": median_ms,
                   "median_tokens_per_s": cfg.total_batch_size * 1000 / median_ms}
        if device.startswith("cuda"):  # allocated, and reserved by the caching allocator
            summary["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            summary["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        else:  # resident
            import resource  # Unix; ru_maxrss: KiB on Linux, bytes on macOS
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            summary["peak_memory_gib"] = peak / (2**30 if sys.platform == "darwin" else 2**20)
        line = (f"summary: median {median_ms:.1f} ms/step, {summary['median_tokens_per_s']:,.0f} "
                f"tokens/s over the last {len(timed)} steps; peak memory "
                f"{summary['peak_memory_gib']:.2f} GiB")
        if "peak_reserved_gib" in summary:
            line += f" ({summary['peak_reserved_gib']:.2f} GiB reserved)"
        if cfg.peak_tflops:
            summary["mfu"] = model_flops_utilization(flops_per_step, median_ms, cfg.peak_tflops,
                                                     world_size)
            line += f"; MFU {100 * summary['mfu']:.1f}% of {cfg.peak_tflops:g} TFLOP/s"
        self.write({"summary": summary}, line)


def count_parameters(model: nn.Module):
    return sum(p.numel() for p in model.parameters())  # the tied matrix counts once


def flops_per_token(model_config: GPTConfig, num_params, seq_len):
    """Training FLOPs a token: 6N for the matmuls, 12 L T C for attention (PaLM, App. B)."""
    return 6 * num_params + 12 * model_config.n_layer * seq_len * model_config.n_embd


def model_flops_utilization(flops_per_step, step_ms, peak_tflops, world_size):
    return flops_per_step * 1000 / step_ms / (world_size * peak_tflops * 1e12)


# ------------------------------ other run modes

def generate_samples(cfg: TrainConfig, device):
    """--generate; the one-token step compiled only with --compile (it outlasts a short text)."""
    model, timing = build_model(cfg, device), {}
    texts = print_samples(model, gpt2_tokenizer(), cfg, device, autocast_for(cfg, device),
                          bool(cfg.compile), timing)
    warm_up = GENERATE_WARMUP_TOKENS if "warm_up_s" in timing else 0
    tokens = cfg.num_samples * (cfg.max_new_tokens - warm_up)
    untimed = (f"after {warm_up} warm-up tokens a sample, {timing['warm_up_s']:.2f} s" if warm_up
               else "warm-up included")
    print(f"{tokens:,} tokens in {timing['timed_s']:.2f} s: {tokens / timing['timed_s']:,.1f} "
          f"tokens/s (KV cache {'on' if cfg.kv_cache else 'off'}, compile "
          f"{'on' if cfg.compile else 'off'}, {count_parameters(model):,} parameters; {untimed})",
          flush=True)
    return texts


def evaluate_only(cfg: TrainConfig, launch: Launch, device):
    """Val loss and HellaSwag accuracy (if its file can be had) of --init_from's weights."""
    problem, hellaswag, missing = None, None, None
    try:
        _, val_loader = open_data(cfg, launch, with_val=True)
        model = build_model(cfg, device)
        try:
            hellaswag = open_hellaswag(cfg, launch, model.config.block_size)
        except DownloadError as error:
            missing = f"HellaSwag skipped: {error}"
    except ConfigError as error:
        problem = str(error)
    posts = gather((problem, missing), launch)
    raise_first_problem([problem for problem, _ in posts])
    missing = next((missing for _, missing in posts if missing), None)  # all skip it, or none
    autocast, accum_steps = autocast_for(cfg, device), grad_accum_steps(cfg, launch.world_size)
    result = {"val_loss": estimate_val_loss(model, val_loader, cfg.eval_steps, accum_steps, device,
                                            autocast, launch)}
    stop_or_fail_together(False, [val_loader], launch, device)  # stops on bad tokens
    if missing is None:
        result.update(evaluate_hellaswag(model, hellaswag, device, autocast, launch))
    if launch.rank == 0:
        print(f"val loss {result['val_loss']:.4f} | " + (missing or (
            f"HellaSwag acc_norm {result['hellaswag_acc_norm']:.4f} (acc "
            f"{result['hellaswag_acc']:.4f}) over {result['hellaswag_examples']:,} examples")),
            flush=True)
    return result


def export_hf(cfg: TrainConfig):
    """--init_from's weights and the tokenizer as a checked transformers folder."""
    transformers = import_transformers("--export_hf")
    try:
        import blobfile  # noqa: F401 (transformers' tiktoken converter writes through it)
    except ImportError:
        raise ConfigError("--export_hf needs blobfile to convert the tokenizer: pip install "
                          "blobfile") from None
    from transformers.integrations.tiktoken import convert_tiktoken_to_fast
    model_config, state = initial_weights(cfg)
    vocab_size = min(model_config.vocab_size, GPT2_VOCAB_SIZE)  # no tokenizer decodes padding
    # its other defaults are ours: tanh GELU, eps 1e-5, tied embeddings
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=model_config.block_size, n_embd=model_config.n_embd,
        n_layer=model_config.n_layer, n_head=model_config.n_head, resid_pdrop=model_config.dropout,
        embd_pdrop=model_config.dropout, attn_pdrop=model_config.dropout))
    ours, gpt2 = (state_to_openai(tensors, vocab_size) for tensors in
                  (state, state_from_openai(hf_model.state_dict())))
    for name in {**ours, **gpt2}:  # a hacked model's tensors must map one to one onto GPT-2's
        shapes = [tuple(s[name].shape) if name in s else "absent" for s in (ours, gpt2)]
        if shapes[0] != shapes[1]:  # in transformers' layout
            raise ConfigError(f"cannot export {cfg.init_from} as GPT-2: its {name} is "
                              f"{shapes[0]}, GPT-2's is {shapes[1]}")
    hf_model.load_state_dict(ours)
    temporary = f"{os.path.normpath(cfg.export_hf)}.{os.uname().nodename}-{os.getpid()}.tmp"
    try:
        with failed_write_is_one_line(cfg.export_hf, "run the same command again"):
            save_pretrained(hf_model, temporary)
            convert_tiktoken_to_fast(gpt2_tokenizer(), temporary)
        del hf_model
        check_export(transformers.GPT2LMHeadModel.from_pretrained(temporary), model_config, state)
    except BaseException:  # nothing is left at --export_hf
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    os.rename(temporary, cfg.export_hf)
    print(f"wrote {cfg.init_from} to {cfg.export_hf}: load it with AutoTokenizer.from_pretrained"
          f"({cfg.export_hf!r}) and GPT2LMHeadModel.from_pretrained({cfg.export_hf!r})", flush=True)
    return cfg.export_hf


def save_pretrained(hf_model, folder):
    from safetensors import SafetensorError
    try:
        hf_model.save_pretrained(folder)
    except SafetensorError as error:  # a failed write there is no OSError
        if "I/O error: " not in str(error):
            raise
        raise OSError(str(error).partition("I/O error: ")[2]) from None


def check_export(exported, model_config: GPTConfig, state):
    """The exported model, as loaded, gives our logits; a hacked one (another activation, norm
    or block) would not."""
    ours = GPT(model_config)
    ours.load_state_dict(state)
    vocab_size = exported.config.vocab_size
    tokens = torch.randint(0, vocab_size, (2, min(64, model_config.block_size)),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.eval()(tokens)[..., :vocab_size]
        difference = (exported.eval()(tokens).logits - expected).abs().max().item()
    if difference > 1e-4 * max(1.0, expected.abs().max().item()):
        raise ConfigError(f"the exported model's logits differ from ours by up to "
                          f"{difference:.3g}: the model no longer matches GPT-2's architecture in "
                          "transformers, so it cannot be exported as GPT-2")


# ------------------------------ main

def launch_from_env(environ) -> Launch:
    if "RANK" not in environ:
        return Launch()
    return Launch(int(environ["RANK"]), int(environ["LOCAL_RANK"]), int(environ["WORLD_SIZE"]),
                  torchrun=True, local_world_size=int(environ["LOCAL_WORLD_SIZE"]))


def out_of_memory_message(cfg: TrainConfig, device, world_size):
    if cfg.generate:
        return f"out of memory on {device} while generating: lower --num_samples"
    B, T = cfg.micro_batch_size, cfg.seq_len
    where = f"out of memory on {device} at micro batch {B} x {T}"
    # a smaller micro batch that divides a step trains the same
    smaller = [b for b in range(B - 1, 0, -1) if cfg.total_batch_size % (b * T * world_size) == 0]
    savers = [flag for flag, on in (("--loss_chunk_size 8192", cfg.loss_chunk_size),
                                    ("--recompute", cfg.recompute)) if not on]
    if smaller:
        return (f"{where}: lower --micro_batch_size to {smaller[0]} (a step stays "
                f"{cfg.total_batch_size:,} tokens, in more micro-steps)"
                + (", or add --loss_chunk_size 8192" if not cfg.loss_chunk_size else ""))
    add = f"add {' or '.join(savers)}, " if savers else ""
    return f"{where}: {add}lower --seq_len or pick a smaller --model"


@record  # under torchrun the failure summary names the failing rank and its traceback
def main(cfg: TrainConfig | None, launch: Launch | None = None,
         problem: ConfigError | None = None) -> TrainResult | dict | list[str] | str:
    """Run cfg; under torchrun all ranks join, then check it together."""
    launch = launch or launch_from_env(os.environ)
    settled, notes = cfg, []
    try:
        if problem is None:
            check_config(cfg, launch.world_size)
            settled, notes = settle_defaults(cfg, launch)
    except ConfigError as error:
        problem = error
    device = settled.device if problem is None else "cpu"
    init_distributed(launch, device)
    try:
        check_same_command(cfg, problem, launch)  # as given: the machines may differ
        cfg = settled
        if cfg.export_hf:
            result = export_hf(cfg)
        elif cfg.generate:
            result = generate_samples(cfg, device)
        elif cfg.eval_only:
            result = evaluate_only(cfg, launch, device)
        else:
            with catching_stop_signals() as stop_signal:
                result = train(cfg, launch, device, stop_signal, notes)
    except ConfigError as error:  # raised on every rank: rank 0 says it, all leave
        if launch.rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        if launch.torchrun:
            dist.destroy_process_group()
        sys.exit(2)
    except KeyboardInterrupt:  # a second Ctrl-C while training, the first otherwise
        if launch.rank == 0:
            print(interrupted_line(cfg), file=sys.stderr, flush=True)
        sys.exit(130)
    except torch.OutOfMemoryError:  # this rank says it; torchrun ends the others
        print(f"error: {out_of_memory_message(cfg, device, launch.world_size)}", file=sys.stderr,
              flush=True)
        sys.exit(2)
    if launch.torchrun:  # leave together: gloo torn down under a running peer aborted at exit
        # (PyTorch #179291); after a crash a peer may be gone
        dist.barrier()
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    try:
        config, parse_problem = parse_args(sys.argv[1:]), None
    except ConfigError as error:  # under torchrun the others hear of it
        config, parse_problem = None, error
    main(config, problem=parse_problem)
