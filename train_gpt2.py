"""Pretrain GPT-2 from scratch in plain PyTorch, on one device or many.

    python train_gpt2.py --data_dir edu_fineweb10B         # one device (CUDA, MPS or CPU)
    torchrun --standalone --nproc_per_node=8 train_gpt2.py --data_dir edu_fineweb10B  # 8 GPUs

Read it down to the one "# ====" banner: the model, data, distributed setup, optimizer and
schedule, the training config and train(), evaluation and sampling. That much trains alone, as
train(TrainConfig(...)); the machinery after the banner is the command line, and hardens it.
"""

import collections
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP


def tokenizer():
    """Named here alone: vocab rows, <|endoftext|>, shards, sampling, export all follow it."""
    import tiktoken  # here: importing this file does no work
    return tiktoken.get_encoding("gpt2")


class RunError(Exception):
    """Why a run cannot go on (a user mistake, a full disk, a corrupt checkpoint, a diverged loss,
    an edit on one path alone): the machinery prints `error: ...` on rank 0, and all exit 2."""


# ------------------------------ model
@dataclass
class GPTConfig:
    """The model's shape, which its weights are made for, and dropout, which each run sets."""
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024  # positions the model has
    vocab_size: int = 50304  # 50,257 tokens padded to 128 x 393: matmul tiles divide it evenly
    dropout: float = 0.0  # not taken from a checkpoint: a training choice


def visible(query_positions, key_positions, key_tokens) -> torch.Tensor:
    """Which keys each query may see: True where it may, (Tq, Tk) or (B, 1, Tq, Tk). Training, the
    evaluations and the cache all ask here. Queries at query_positions (Tq,); key j at position j
    holds token key_tokens[:, j] (B, Tk), for a mask by documents. GPT-2: itself and earlier."""
    return key_positions <= query_positions[:, None]


@functools.cache
def visible_is_causal(block_size: int) -> bool:
    """Whether visible() is causal alone: then training runs SDPA's fused causal kernel, no mask."""
    at, inner, vocab = torch.arange(block_size, device="cpu"), max(1, block_size - 2), tokenizer()
    # every token id inside some row, then <|endoftext|> every 7th: a mask keyed on tokens shows
    rows = torch.arange(-1, vocab.n_vocab - 1, inner, device="cpu")[:, None] + at
    tokens = torch.cat([rows % vocab.n_vocab, torch.where(at % 7 == 3, vocab.eot_token, at)[None]])
    return all(bool((visible(at, at, some) == (at <= at[:, None])).all())
               for some in tokens.split(8))  # (8, T): masks of (8, 1, T, T) at a time


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key, value in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.fused_causal = visible_is_causal(config.block_size)

    def forward(self, x, positions, tokens, cache: "KVCache | None" = None):
        """x (B, T, C) for tokens (B, T) at positions (T,): the cache writes there, visible() reads
        them (GPT-2 adds positions at the input; rotary embeddings would rotate q and k here)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): each head attends with its own slice of C
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        key_positions = positions
        if cache is not None:  # generating: all keys, values and tokens so far, and their positions
            k, v, tokens, key_positions = cache.update(positions, tokens, k, v)
        fused = cache is None and self.fused_causal  # no cache, causal: the kernel masks
        mask = None if fused else visible(positions, key_positions, tokens)
        # softmax(q k^T / sqrt(head_dim)) v, fused (flash attention on a GPU when is_causal)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=fused,
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
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x)); the residual path stays clean."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, positions, tokens, cache=None):
        x = x + self.attn(self.ln_1(x), positions, tokens, cache)
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    """GPT-2 as published; names follow OpenAI's checkpoint (its Conv1D weights transposed)."""

    def __init__(self, config: GPTConfig, loss_chunk_size=0, recompute=False):
        super().__init__()
        # memory savers (--loss_chunk_size, --recompute): the same numbers, in less memory
        self.config, self.loss_chunk_size, self.recompute = config, loss_chunk_size, recompute
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # tied: a token's input vector is also its output vector (GPT-2; 38M fewer parameters)
        self.transformer.wte.weight = self.lm_head.weight
        self.reset_parameters()

    def reset_parameters(self):
        # GPT-2: std 0.02; each block adds to the residual stream twice, so the projections that
        # add start at 0.02/sqrt(2 n_layer): the stream's variance does not grow with depth
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        """idx (B, T) -> (logits (B, T, vocab_size), None); with targets (B, T): (None, the mean
        loss). A loss that adds terms adds them here: validation and HellaSwag score the logits'
        cross_entropy alone."""
        x = self.hidden_states(idx)
        return (self.logits(x), None) if targets is None else (None, self.cross_entropy(x, targets))

    def hidden_states(self, idx, caches: list | None = None, positions=None):
        """idx (B, T) at positions (T,), default 0 to T - 1, -> (B, T, n_embd) for logits()."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"{T} tokens, longer than block_size {self.config.block_size}")
        positions = torch.arange(T, device=idx.device) if positions is None else positions
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        recompute = self.recompute and torch.is_grad_enabled()  # keep x alone, rerun in backward
        for block, cache in zip(self.transformer.h, caches or [None] * len(self.transformer.h),
                                strict=True):
            args = (x, positions, idx, cache)  # the block's one argument list
            x = (torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False) if recompute
                 else block(*args))
        return self.transformer.ln_f(x)

    def logits(self, x):
        """(..., n_embd) -> (..., vocab_size): the loss, HellaSwag and sampling all come here."""
        return self.lm_head(x)

    def cross_entropy(self, x, targets, reduction="mean"):
        """The logits' cross-entropy of hidden states x (..., n_embd) against targets (...), in
        float32 (a softmax over 50k needs it): the mean, or each token's (reduction "none").
        loss_chunk_size: that many tokens at a time, each slice's logits made again in backward,
        so the float32 logits are never whole (12.3 GiB at 64 x 1024)."""
        def losses(x, targets, reduction):
            return F.cross_entropy(self.logits(x).float(), targets, reduction=reduction)
        x, targets = x.flatten(0, -2), targets.flatten()
        if not self.loss_chunk_size:
            return losses(x, targets, reduction)
        n = self.loss_chunk_size
        per_token = torch.cat([torch.utils.checkpoint.checkpoint(losses, *pair, "none",
                                                                 use_reentrant=False)
                               for pair in zip(x.split(n), targets.split(n), strict=True)])
        return per_token.mean() if reduction == "mean" else per_token


class KVCache:
    """One layer's keys and values while generating, for all block_size positions, as attention
    makes them, and their tokens for visible(): every one-token step has the same shapes."""

    def __init__(self, block_size: int):
        self.block_size, self.keys, self.values, self.tokens = block_size, None, None, None

    def update(self, positions, tokens, k, v) -> tuple:
        """Write k, v (B, heads, T, head_dim) and tokens (B, T) at positions (T,); return all keys,
        values (B, heads, block_size, head_dim), tokens (B, block_size) and their positions."""
        def write(old, new, dim):  # dim: the positions'
            shape = (*new.shape[:dim], self.block_size, *new.shape[dim + 1 :])
            if old is None or (old.shape, old.dtype) != (shape, new.dtype):
                old = new.new_zeros(shape)  # not empty: a masked 0 x NaN would be NaN
            return old.index_copy_(dim, positions, new)
        self.keys, self.values = write(self.keys, k, 2), write(self.values, v, 2)
        self.tokens = write(self.tokens, tokens, 1)
        return self.keys, self.values, self.tokens, torch.arange(self.block_size, device=k.device)


def kv_caches(model: GPT, use_cache=True) -> list[KVCache] | None:
    """One empty KVCache a layer, or None: each token then rereads its whole context."""
    return [KVCache(model.config.block_size) for _ in model.transformer.h] if use_cache else None


# ------------------------------ data
class TokenStream:
    """Token arrays (the shards) as one sequence: a read may run across their ends."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays, self.starts = arrays, np.cumsum([0] + [len(a) for a in arrays])
        self.num_tokens = int(self.starts[-1])

    def array_at(self, position: int) -> int:
        return int(np.searchsorted(self.starts, position, side="right")) - 1

    def read(self, start: int, count: int) -> np.ndarray:
        first, last = self.array_at(start), self.array_at(start + count - 1)
        return np.concatenate([self.arrays[i][max(0, start - self.starts[i]) :
                                              start + count - self.starts[i]]
                               for i in range(first, last + 1)]).astype(np.int64)


class DataLoader:
    """(B, T) batches of windows, T + 1 tokens of a TokenStream: x = window[:-1], y = window[1:].
    Place: `position` tokens read of this `epoch`'s order (shuffled: windows at k*T, ordered by
    (seed, epoch)); rank r of W reads B from position + r*B*T; all move on W*B*T, in tokens."""

    def __init__(self, stream, batch_size, seq_len, rank, world_size, shuffle, seed):
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.epoch, self.position, self._order = 0, 0, None

    @property
    def num_windows(self) -> int:  # of seq_len, in an epoch
        return max(0, self.stream.num_tokens - 1) // self.seq_len

    def window_order(self, epoch: int) -> np.ndarray:
        """This epoch's window order, drawn once (8 bytes a window)."""
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = epoch, rng.permutation(self.num_windows)
        return self._order[1]

    def place(self, k: int) -> tuple[int, int]:
        """(epoch, position) of the k-th window from here: past this epoch's last, the next's."""
        T, left = self.seq_len, max(0, self.stream.num_tokens - 1 - self.position) // self.seq_len
        epochs, i = divmod(k - left, self.num_windows)  # k >= left: windows into the next epochs
        return (self.epoch, self.position + k * T) if k < left else (self.epoch + 1 + epochs, i * T)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.batch_size, self.seq_len
        starts = [int(self.window_order(epoch)[at // T]) * T if self.shuffle else at
                  for epoch, at in map(self.place, range(self.rank * B, self.rank * B + B))]
        windows = torch.from_numpy(np.stack([self.stream.read(at, T + 1) for at in starts]))
        self.epoch, self.position = self.place(self.world_size * B)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # of (B, T + 1)


def to_device(batch: torch.Tensor, device: str) -> torch.Tensor:
    """On CUDA via pinned memory: the CPU queues the copy and goes on, not waiting."""
    pinned = device.startswith("cuda")
    return (batch.pin_memory() if pinned else batch).to(device, non_blocking=pinned)


# ------------------------------ distributed setup
@dataclass
class Launch:
    """Where this process sits in the job; `python train_gpt2.py` is rank 0 of 1."""
    rank: int = 0
    local_rank: int = 0  # rank within this machine: picks the GPU
    world_size: int = 1
    torchrun: bool = False  # under torchrun: a process group, even for one process
    local_world_size: int = 1  # processes on this machine
    restarts: int = 0  # times torchrun (--max-restarts) has restarted the workers


def launch_from_env(environ) -> Launch:
    """torchrun's variables, read here alone: everything else is handed the Launch."""
    if "RANK" not in environ:
        return Launch()
    return Launch(int(environ["RANK"]), int(environ["LOCAL_RANK"]), int(environ["WORLD_SIZE"]),
                  True, int(environ["LOCAL_WORLD_SIZE"]),
                  int(environ.get("TORCHELASTIC_RESTART_COUNT", 0)))


def init_distributed(launch: Launch, device: str):
    """Under torchrun, join the process group: gloo for CPU tensors, NCCL for CUDA's."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # no stray context on GPU 0
    if launch.torchrun:  # first: imported later, their default arguments would hold the group
        from torch.distributed import nn as _nn, optim as _optim  # noqa: F401 (see main()'s end)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=datetime.timedelta(minutes=20))  # outlasts a gpt2-xl save


def all_reduce_mean(value: torch.Tensor, launch: Launch) -> torch.Tensor:
    """The mean over ranks: SUM, then divide (gloo's ReduceOp.AVG came late, with a bug)."""
    if launch.torchrun:
        dist.all_reduce(value := value.clone(), op=dist.ReduceOp.SUM)  # a copy: it sums in place
    return value / launch.world_size


def gather(value, launch: Launch) -> list:
    """Every rank's value (any picklable), in rank order, on every rank."""
    values = [value] * launch.world_size
    if launch.torchrun:
        dist.all_gather_object(values, value)
    return values


# ------------------------------ optimizer and schedule
def grad_accum_steps(cfg: "TrainConfig", world_size: int) -> int:
    """Micro-steps a step: a step is the same tokens however many processes share it."""
    return cfg.total_batch_size // (cfg.micro_batch_size * cfg.seq_len * world_size)


def lr_at(step: int, cfg: "TrainConfig") -> float:
    """Linear warmup to max_lr (Adam's early updates are noisy: its moment estimates are new),
    then cosine decay to the minimum at max_steps; small steps at the end settle the loss."""
    min_lr = cfg.max_lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps  # step 0's rate is not 0
    if step >= cfg.max_steps:
        return min_lr
    progress = (step - cfg.warmup_steps) / (cfg.max_steps - cfg.warmup_steps)  # 0 -> 1
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.max_lr - min_lr)


def configure_optimizers(model: GPT, cfg: "TrainConfig", fused: bool, sharded=False) -> list:
    """AdamW; --optimizer muon: Muon for the blocks' matrices, AdamW for the rest. sharded: each
    optimizer's state split over the processes (ZeRO-1)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    to_muon = {name for name, p in named if cfg.optimizer == "muon" and p.dim() == 2
               and name.startswith("transformer.h.")}
    params = [p for name, p in named if name not in to_muon]
    # decay pulls weights toward 0: matrices and embeddings; not biases or LayerNorm gains,
    # whose scale is not a model's capacity to overfit. The rule is 2 or more dimensions: a new
    # gain shaped (n_head, 1, 1) is decayed unless given a group of its own
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def make(optimizer_class, params, **options):
        if sharded:  # imported here: it imports FSDP and DTensor (slow)
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **options)
        return optimizer_class(params, **options)
    # beta2 0.95, not Adam's 0.999: the second moment forgets a loss spike sooner. fused: one
    # kernel for all parameters on CUDA (sharded, it cannot load a checkpoint: PyTorch #124133)
    optimizers = [make(torch.optim.AdamW, groups, lr=cfg.max_lr, betas=(cfg.beta1, cfg.beta2),
                       eps=cfg.eps, fused=fused and not sharded)]
    if to_muon:  # Muon's update at AdamW's RMS: --max_lr and --weight_decay carry over
        optimizers.append(make(torch.optim.Muon, [p for name, p in named if name in to_muon],
                               lr=cfg.max_lr, weight_decay=cfg.weight_decay,
                               adjust_lr_fn="match_rms_adamw"))
    return optimizers


# ------------------------------ training
MODEL_SHAPES = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M; then 350M, 774M, 1558M
                "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
                "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
                "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600)}


def flag(default, help: str, section: str, choices=None):  # a --flag, in --help's `section`
    return field(default=default, metadata={"help": help, "section": section, "choices": choices})


@dataclass
class TrainConfig:
    """Every --flag. Defaults: build-nanogpt's GPT-2 124M model, batch, optimizer and schedule
    (its data: --data_dir with fineweb.py's FineWeb-Edu shards)."""
    model: str = flag("gpt2", "gpt2, gpt2-medium, -large or -xl shape", "model", list(MODEL_SHAPES))
    n_layer: int = flag(12, "transformer blocks", "model")
    n_head: int = flag(12, "attention heads", "model")
    n_embd: int = flag(768, "model width", "model")
    block_size: int = flag(1024, "longest context the model accepts (learned positions)", "model")
    vocab_size: int = flag(0, "embedding rows; 0: the tokenizer's, padded (GPT-2: 50304)", "model")
    dropout: float = flag(0.0, "dropout where GPT-2 had it (0.1 to fine-tune)", "model")
    data_dir: str = flag("", "fineweb.py's .npy shards' folder; empty: --text_file", "data")
    text_file: str = flag("", "text split 90/10 into train/val (default: tiny Shakespeare)", "data")
    shuffle: bool = flag(False, "a new seeded window order each epoch (off: in order)", "data")
    total_batch_size: int = flag(2**19, "tokens a step, all processes (GPT-3 small: 0.5M)", "batch")
    micro_batch_size: int = flag(64, "sequences per forward/backward pass per process", "batch")
    seq_len: int = flag(1024, "tokens per training sequence (at most --block_size)", "batch")
    optimizer: str = flag("adamw", "muon: for the blocks' matrices; AdamW the rest", "optimizer",
                          ["adamw", "muon"])
    max_lr: float = flag(6e-4, "peak learning rate, reached at the end of warmup", "optimizer")
    min_lr_ratio: float = flag(0.1, "final learning rate as a fraction of --max_lr", "optimizer")
    warmup_steps: int = flag(715, "linear warmup steps (375M tokens at 2**19 a step)", "optimizer")
    max_steps: int = flag(19073, "optimizer steps: 19073 x 2**19 tokens is 10B", "optimizer")
    weight_decay: float = flag(0.1, "AdamW's and Muon's, on 2-D tensors only", "optimizer")
    beta1: float = flag(0.9, "AdamW beta1", "optimizer")
    beta2: float = flag(0.95, "AdamW beta2", "optimizer")
    eps: float = flag(1e-8, "AdamW epsilon, above 0", "optimizer")
    grad_clip: float = flag(1.0, "clip the global gradient norm to this; 0: off", "optimizer")
    eval_every: int = flag(250, "val loss first, every N steps, at the end; 0: never", "logging")
    eval_steps: int = flag(20, "validation steps of --total_batch_size tokens each", "logging")
    sample_every: int = flag(250, "samples every N steps and at the end; 0: never", "logging")
    num_samples: int = flag(4, "continuations of --prompt per sampling", "logging")
    max_new_tokens: int = flag(32, "tokens per sample", "logging")
    temperature: float = flag(1.0, "sampling temperature", "logging")
    top_k: int = flag(50, "sample among the k most likely tokens", "logging")
    prompt: str = flag("Hello, I'm a language model,", "text the samples continue", "logging")
    hellaswag_every: int = flag(0, "HellaSwag every N steps and at the end; 0: never", "logging")
    hellaswag_path: str = flag("", "hellaswag_val.jsonl (default: downloaded once)", "logging")
    log_dir: str = flag("log", "folder for metrics.jsonl and checkpoints", "logging")
    tensorboard: bool = flag(False, "also write the figures for TensorBoard", "logging")
    # the machinery's flags: "the machine picks" is machine_choices(), checked against the card
    # in main(); the recipe alone ignores --tensorboard, --peak_tflops, --keep_ckpts, the run modes
    device: str = flag("auto", "auto (the machine picks), cpu, cuda, cuda:N or mps", "runtime")
    dtype: str = flag("auto", "auto (the machine picks), float32, bfloat16 or float16", "runtime",
                      choices=["auto", "float32", "bfloat16", "float16"])
    compile: bool | None = flag(None, "torch.compile (default: the machine picks)", "runtime")
    loss_chunk_size: int = flag(0, "loss N tokens at a time (less memory); 0: off", "runtime")
    recompute: bool = flag(False, "recompute activations in backward (less memory)", "runtime")
    shard_optimizer: bool = flag(False, "torchrun: share the optimizer state (ZeRO-1)", "runtime")
    seed: int = flag(1337, "seed for initialisation, shuffling and sampling", "runtime")
    peak_tflops: float | None = flag(None, "a GPU's peak TFLOP/s, for MFU (default: the machine "
                                     "picks)", "runtime")
    init_from: str = flag("", "start from gpt2, gpt2-medium, -large, -xl or a ckpt", "run modes")
    eval_only: bool = flag(False, "print the val loss and HellaSwag accuracy, exit", "run modes")
    generate: bool = flag(False, "print --num_samples continuations of --prompt, exit", "run modes")
    kv_cache: bool = flag(True, "generate with a key/value cache (faster)", "run modes")
    export_hf: str = flag("", "write --init_from as a transformers model here, exit", "run modes")
    ckpt_every: int = flag(1000, "checkpoint every N steps and at the end; 0: never", "checkpoints")
    keep_ckpts: int = flag(2, "keep the N newest checkpoints; 0: all", "checkpoints")
    stop_after_steps: int = flag(0, "end with a checkpoint after N steps; 0: never", "checkpoints")
    resume: str = flag("", "checkpoint to go on from; auto: the newest in --log_dir", "checkpoints")


def machine_choices(cfg: TrainConfig, launch: Launch) -> TrainConfig:
    """cfg with "auto" made plain: this process's GPU, else Apple's, else the CPU; bfloat16 where
    the GPU computes in it (compute capability 8.0+), float16 with a loss scaler where it does
    not, float32 elsewhere; compile on CUDA. --vocab_size 0: the tokenizer's, padded."""
    device = cfg.device if cfg.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available()
        else "cpu")
    device = f"cuda:{launch.local_rank}" if device == "cuda" else device  # one GPU a process
    gpu = device.startswith("cuda")
    if gpu:  # float32 matmuls in TF32: 10 bits of mantissa, on tensor cores (A100 and later)
        torch.set_float32_matmul_precision("high")
    bf16 = gpu and (torch.cuda.get_device_capability(device)[0] >= 8 or bool(torch.version.hip))
    dtype = cfg.dtype if cfg.dtype != "auto" else "bfloat16" if bf16 else (
        "float16" if gpu else "float32")
    vocab_size = cfg.vocab_size or -(-tokenizer().n_vocab // 128) * 128  # 50257 -> 128 x 393
    return dataclasses.replace(cfg, device=device, dtype=dtype, vocab_size=vocab_size,
                               compile=gpu if cfg.compile is None else cfg.compile)


def autocast_for(dtype: str, device: str):
    """autocast() runs matmuls in dtype (bfloat16: tensor cores, half the memory traffic), keeps
    softmax and the loss in float32; float32: off (CUDA runs its matmuls in TF32)."""
    return functools.partial(torch.autocast, device.split(":")[0], dtype=getattr(torch, dtype),
                             enabled=dtype != "float32")


def is_due(every: int, steps_done: int, last_step: bool) -> bool:
    return bool(every) and (steps_done % every == 0 or last_step)


def count_parameters(model: nn.Module):
    return sum(p.numel() for p in model.parameters())  # the tied matrix once


def build_model(cfg: TrainConfig, model_config: GPTConfig, weights: dict | None, device) -> GPT:
    """A new GPT, the same on every rank (seeded), or one holding --init_from's weights."""
    torch.manual_seed(cfg.seed)
    model = GPT(model_config, cfg.loss_chunk_size, cfg.recompute).to(device)
    if weights is not None:  # GPT-2's or a checkpoint's
        model.load_state_dict(weights)
    return model


def weights_to_score(model: GPT, scored: GPT | None = None) -> GPT:
    """The weights that validation, HellaSwag, samples and the run modes (checkpoints' "model")
    score: model's. An EMA returns a copy (scored None: before step 0) that it moves each step."""
    return model


def rng_states(device):
    """torch's generators; on CUDA this GPU's only (a new machine may have fewer)."""
    return {"torch_cpu": torch.get_rng_state(),
            "torch_cuda": [torch.cuda.get_rng_state(device)] if device.startswith("cuda") else []}


def restore_rng_states(states, device):
    torch.set_rng_state(states["torch_cpu"])
    if states["torch_cuda"] and device.startswith("cuda"):
        torch.cuda.set_rng_state(states["torch_cuda"][0], device)


# what train() reads before step 0; weights: --init_from's (None: new), hellaswag: this rank's
Inputs = collections.namedtuple("Inputs", ["model_config", "weights", "train_tokens", "val_tokens",
                                           "checkpoint", "hellaswag", "tokenizer"])
# what train() returns: the plain model (no DDP or compile wrapper), and what rank 0 logged
TrainResult = collections.namedtuple("TrainResult", ["model", "records"])
TEXT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "input.txt")


class Run:
    """What train() reads and writes besides the model: inputs, log, checkpoints, a stop. This
    plain Run trains alone; main() hands train() a subclass (after the banner) that checks each
    input on every rank, fetches, writes whole files and metrics.jsonl, and stops all together."""

    def __init__(self, cfg: TrainConfig, launch: Launch | None = None):
        self.launch = launch or launch_from_env(os.environ)
        self.cfg, self.records, self.step_ms = machine_choices(cfg, self.launch), [], []
        self.owns_group = self.launch.torchrun and not dist.is_initialized()
        if self.owns_group:  # else main() has joined it
            init_distributed(self.launch, self.cfg.device)

    def read_inputs(self) -> Inputs:
        cfg = self.cfg
        checkpoint = self.load_checkpoint(cfg.resume) if cfg.resume else None
        return Inputs(*self.initial_weights(), *self.token_streams(), checkpoint,
                      self.hellaswag() if cfg.hellaswag_every else [],
                      tokenizer() if cfg.sample_every else None)

    def initial_weights(self) -> tuple[GPTConfig, dict | None]:
        """A new model's shape from the flags, or --init_from's weights and shape (our dropout)."""
        if not self.cfg.init_from:
            return GPTConfig(**{name: value for name, value in vars(self.cfg).items()
                                if name in GPTConfig.__dataclass_fields__}), None
        saved = self.load_checkpoint(self.cfg.init_from)
        return GPTConfig(**{**saved["model_config"], "dropout": self.cfg.dropout}), saved["model"]

    @staticmethod
    def load_checkpoint(path) -> dict:  # mmap: tensors are read from the file as used
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)

    def token_streams(self) -> tuple[TokenStream, TokenStream]:
        """(train, val): fineweb.py's shards in --data_dir, or the text file split 90/10."""
        if self.cfg.data_dir:
            return tuple(TokenStream([self.open_shard(path) for path in self.shard_paths(split)])
                         for split in ("train", "val"))
        tokens = self.text_tokens(self.cfg.text_file or TEXT_FILE)
        split = len(tokens) * 9 // 10
        return TokenStream([tokens[:split]]), TokenStream([tokens[split:]])

    def shard_paths(self, split) -> list[str]:  # fineweb.py's PREFIX_{split}_000001.npy
        return sorted(map(str, Path(self.cfg.data_dir).glob(f"*_{split}_{'[0-9]' * 6}.npy")))

    def open_shard(self, path) -> np.ndarray:  # mapped: a batch reads the pages it touches
        return np.load(path, mmap_mode="r")

    def text_tokens(self, path) -> np.ndarray:
        text = Path(path).read_text(encoding="utf-8")  # uint32: any tokenizer's ids
        return np.array(tokenizer().encode_ordinary(text), dtype=np.uint32)

    def hellaswag(self) -> list[tuple]:  # this rank's share of the examples, in batches
        rank, world_size = self.launch.rank, self.launch.world_size
        return pack_hellaswag([render_hellaswag(example, tokenizer())
                               for example in self.hellaswag_examples()[rank::world_size]],
                              min(8192, self.cfg.micro_batch_size * self.cfg.seq_len))

    def hellaswag_examples(self) -> list[dict]:  # each: "ctx", 4 "endings", the right "label"
        lines = Path(self.cfg.hellaswag_path).read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines]

    def restore(self, checkpoint, model, scored, optimizers, scaler, loader) -> int:
        """Go on exactly: weights, optimizer state, data position, this rank's RNG; its step."""
        scored.load_state_dict(checkpoint["model"])  # the weights scored (weights_to_score), and
        model.load_state_dict(checkpoint.get("trained_model", checkpoint["model"]))  # the trained
        for optimizer, state in zip(optimizers, checkpoint["optimizer"], strict=True):
            # its moments, under this run's group settings (--weight_decay, betas), not the saved
            groups = zip(state["param_groups"], optimizer.param_groups, strict=False)
            optimizer.load_state_dict({**state, "param_groups": [
                {**saved, **group, "params": saved["params"]} for saved, group in groups]})
        if checkpoint["scaler"]:
            scaler.load_state_dict(checkpoint["scaler"])
        loader.epoch, loader.position = checkpoint["data_epoch"], checkpoint["data_position"]
        if self.launch.rank < len(checkpoint["rng"]):  # a new rank keeps its seed
            restore_rng_states(checkpoint["rng"][self.launch.rank], self.cfg.device)
        self.info(f"resumed from step {checkpoint['step']} (token {loader.position:,} of epoch "
                  f"{loader.epoch})")
        return checkpoint["step"]

    def checkpoint_state(self, model, scored, optimizers, scaler, loader, steps_done):
        """What a checkpoint holds, on rank 0 (None elsewhere): enough to go on exactly."""
        if self.cfg.shard_optimizer and self.launch.world_size > 1:
            for optimizer in optimizers:
                optimizer.consolidate_state_dict(to=0)  # each rank sends its share
        rng = gather(rng_states(self.cfg.device), self.launch)  # every rank's
        return {"model": scored.state_dict(), "trained_model": model.state_dict(),
                "model_config": dataclasses.asdict(model.config),  # (the same weights: saved once)
                "optimizer": [optimizer.state_dict() for optimizer in optimizers], "rng": rng,
                "scaler": scaler.state_dict(), "config": dataclasses.asdict(self.cfg),
                "step": steps_done, "data_epoch": loader.epoch, "data_position": loader.position,
                "train_tokens": loader.stream.num_tokens} if self.launch.rank == 0 else None

    def write_checkpoint(self, state: dict | None, steps_done):
        if state is not None:
            os.makedirs(self.cfg.log_dir, exist_ok=True)
            torch.save(state, os.path.join(self.cfg.log_dir, f"ckpt_{steps_done}.pt"))

    def start(self, model, accum_steps, loader):  # (the machinery's start line names each choice)
        self.info(f"{count_parameters(model):,} parameters, {accum_steps} micro-steps a step")

    def info(self, line):
        if self.launch.rank == 0:
            print(line, flush=True)

    def log(self, record: dict, line: str):
        """Figures (a step's, an evaluation's) and their line: rank 0 keeps and prints them."""
        if self.launch.rank == 0:
            self.records.append(record)
            self.info(line)

    def log_step(self, step, loss, lr, grad_norm, ms, loader):
        cfg, tokens_per_s = self.cfg, self.cfg.total_batch_size * 1000 / ms
        self.step_ms.append(ms)  # the time left: the median step so far, each step to come
        left = datetime.timedelta(seconds=round(np.median(self.step_ms) / 1000 * (
            cfg.max_steps - step - 1)))
        self.log({"step": step, "train_loss": loss, "lr": lr, "grad_norm": grad_norm, "ms": ms,
                  "tokens_per_s": tokens_per_s}, f"step {step:5d}/{cfg.max_steps} | loss "
                 f"{loss:.6f} | lr {lr:.4e} | norm {grad_norm:.4f} | {ms:.0f} ms | "
                 f"{tokens_per_s:,.0f} tok/s | {left} left")

    def log_scores(self, step, scores: dict):  # after step (-1: before training)
        self.log({"step": step, **scores}, f"step {step:5d}/{self.cfg.max_steps} | " + (
            f"val loss {scores['val_loss']:.6f}" if "val_loss" in scores else "HellaSwag acc_norm "
            f"{scores['hellaswag_acc_norm']:.4f} (acc {scores['hellaswag_acc']:.4f})"))

    def diverged(self, step, loss, grad_norm):
        raise FloatingPointError(f"diverged at step {step}: loss {loss:.4g}, norm {grad_norm:.4g}")

    def stop_requested(self) -> bool:
        return False  # the machinery's: a signal or a failed write, on any rank

    def stopped(self, step, reason):
        self.info(f"stopped by {reason} after step {step}, checkpoint {self.cfg.log_dir}/ckpt_"
                  f"{step + 1}.pt written")

    def finish(self, start_step):
        if self.owns_group:  # together, nothing else holding the group: see main()'s end
            dist.barrier()
            dist.destroy_process_group()


def train(cfg: TrainConfig, run: Run | None = None) -> TrainResult:
    """Build the model, the data and the optimizer, then train: every rank runs this. run reads
    the inputs and writes the log and checkpoints: a plain Run, or main()'s hardened one."""
    run = run or Run(cfg)
    cfg, launch, device = run.cfg, run.launch, run.cfg.device
    inputs = run.read_inputs()
    raw_model = build_model(cfg, inputs.model_config, inputs.weights, device)
    scored = weights_to_score(raw_model)  # what is validated, sampled, saved as "model": see there
    # model trains. Compiled: fused kernels, fewer trips to memory. DDP: a copy a process;
    # gradients averaged in backward (one a batch skipped, an idle MoE expert: as 0)
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if launch.torchrun:
        model = DDP(model, gradient_as_bucket_view=True, find_unused_parameters=True)

    B, T, W = cfg.micro_batch_size, cfg.seq_len, launch.world_size
    train_loader = DataLoader(inputs.train_tokens, batch_size=B, seq_len=T, rank=launch.rank,
                              world_size=W, shuffle=cfg.shuffle, seed=cfg.seed)
    val_loader = validation_loader(inputs.val_tokens, cfg, launch) if cfg.eval_every else None

    optimizers = configure_optimizers(raw_model, cfg, fused=device.startswith("cuda"),
                                      sharded=cfg.shard_optimizer and W > 1)
    for group in (group for optimizer in optimizers for group in optimizer.param_groups):
        group["lr_ratio"] = group["lr"] / cfg.max_lr  # a group given its own rate keeps its ratio
    # float16's narrow range: small gradients underflow unless the loss is scaled; bfloat16's not
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=cfg.dtype == "float16")
    torch.manual_seed(cfg.seed + launch.rank)  # dropout: each rank its own masks
    start_step = (run.restore(inputs.checkpoint, raw_model, scored, optimizers, scaler,
                              train_loader) if inputs.checkpoint else 0)
    autocast, accum_steps = autocast_for(cfg.dtype, device), grad_accum_steps(cfg, W)
    run.start(raw_model, accum_steps, train_loader)
    if start_step == 0:  # a new run: the val loss before training is the curve's first point
        if cfg.eval_every:
            run.log_scores(-1, {"val_loss": estimate_val_loss(
                scored, val_loader, cfg.eval_steps, accum_steps, device, autocast, launch)})
        if cfg.hellaswag_every:  # a batch, unlogged: a broken edit fails before step 0
            evaluate_hellaswag(scored, inputs.hellaswag[:1], device, autocast, launch)
    check_paths_agree(raw_model, device)  # training's logits are the cache's: an edit reached both

    for step in range(start_step, cfg.max_steps):
        started = time.perf_counter()
        raw_model.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=device)  # the step's mean loss, on this rank
        for micro_step in range(accum_steps):
            x, y = (to_device(batch, device) for batch in train_loader.next_batch())
            # DDP all-reduces the gradients in the last micro-step only: once a step
            sync = micro_step == accum_steps - 1 or not launch.torchrun
            with contextlib.nullcontext() if sync else model.no_sync():
                with autocast():
                    micro_loss = model(x, y)[1]  # (logits, loss): the logits were never kept
                # gradients add up over micro-steps: each loss / accum_steps makes their sum the
                # gradient of the step's mean loss, as one big batch would give
                micro_loss = micro_loss / accum_steps
                scaler.scale(micro_loss).backward()  # float16: scaled so that none round to 0
            loss += micro_loss.detach()
        loss = all_reduce_mean(loss, launch)  # DDP averaged the gradients; this, the logged loss
        for optimizer in optimizers:  # AdamW, and Muon with --optimizer muon
            scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        # a rare huge gradient (a bad batch) is scaled to --grad_clip before Adam's moments see it
        grad_norm = nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
        lr = lr_at(step, cfg)  # one schedule drives every optimizer's groups
        for optimizer in optimizers:
            for group in optimizer.param_groups:  # (older checkpoints hold no lr_ratio)
                group["lr"] = lr * group.get("lr_ratio", 1.0)
            scaler.step(optimizer)
        scaler.update()
        scored = weights_to_score(raw_model, scored)  # an EMA moves toward the new weights
        loss, grad_norm = loss.item(), grad_norm.item()  # the step's one wait for the device
        run.log_step(step, loss, lr, grad_norm, (time.perf_counter() - started) * 1000,
                     train_loader)
        # every rank holds the same loss and norm: all stop (float16's scaler skips inf norms)
        if not (math.isfinite(loss) and (math.isfinite(grad_norm) or scaler.is_enabled())):
            run.diverged(step, loss, grad_norm)  # raises, saving nothing from this step

        # the rest is bookkeeping: evaluate, checkpoint, sample
        steps_done, last_step = step + 1, step + 1 == cfg.max_steps
        if is_due(cfg.eval_every, steps_done, last_step):
            run.log_scores(step, {"val_loss": estimate_val_loss(
                scored, val_loader, cfg.eval_steps, accum_steps, device, autocast, launch)})
        if is_due(cfg.hellaswag_every, steps_done, last_step):
            run.log_scores(step, evaluate_hellaswag(scored, inputs.hellaswag, device, autocast,
                                                    launch))
        stop = run.stop_requested()  # a signal to any rank stops all (the machinery's)
        pause = steps_done - start_step == cfg.stop_after_steps and not last_step  # the job's end
        if stop or pause or is_due(cfg.ckpt_every, steps_done, last_step):
            run.write_checkpoint(run.checkpoint_state(raw_model, scored, optimizers, scaler,
                                                      train_loader, steps_done), steps_done)
        if launch.rank == 0 and is_due(cfg.sample_every, steps_done, last_step):
            print_samples(scored, inputs.tokenizer, cfg, autocast, kv_caches(scored, cfg.kv_cache))
        if stop or pause:  # the checkpoint was written: say how to go on
            run.stopped(step, "a signal" if stop else f"--stop_after_steps {cfg.stop_after_steps}")
            break
    del model  # DDP: freed after run.finish, it would end the group holding the GIL (#56297: hangs)
    run.finish(start_step)
    return TrainResult(raw_model, run.records)


# ------------------------------ evaluation and sampling
@torch.no_grad()
def check_paths_agree(model: GPT, device):
    """Training's forward, the prompt's cached pass and one-token cached steps must agree in
    float32 over a block holding <|endoftext|>: an edit that reached one path alone stops here."""
    T, steps = model.config.block_size, min(4, model.config.block_size - 1)  # steps at the end
    at, first_step, vocab = torch.arange(T, device=device), T - steps, tokenizer()
    tokens = torch.where(at % 7 == 3, vocab.eot_token, at * 7919 % vocab.n_vocab)[None]  # (1, T)
    paths = ["the prompt's cached pass", "a one-token cached step"]  # before first_step, from it
    edit = ("an edit reached one path alone (say which keys a query sees in visible(), and use "
            "attention's positions)")
    precision = torch.get_float32_matmul_precision()  # "high" on CUDA: TF32's 10-bit inputs
    torch.set_float32_matmul_precision("highest")  # TF32 alone parts the paths by 1e-3 at 124M
    model.eval()
    full, caches, cached = model(tokens)[0][0], kv_caches(model), []  # (T, vocab_size)
    for chunk in [slice(0, first_step)] + [slice(i, i + 1) for i in range(first_step, T)]:
        try:
            cached.append(model.logits(model.hidden_states(tokens[:, chunk], caches, at[chunk]))[0])
        except Exception as error:  # a mask shaped for training's call alone, say
            if isinstance(error, torch.OutOfMemoryError):
                raise
            raise RuntimeError(f"{paths[chunk.start >= first_step]} fails (above) where "
                               f"training's forward runs: {edit}") from error
    model.train()
    torch.set_float32_matmul_precision(precision)
    difference = (torch.cat(cached) - full).abs().amax(dim=-1)  # (T,)
    if (parted := difference > 1e-4 * max(1.0, full.abs().max().item())).any():
        i = int(parted.nonzero()[0])
        raise RunError(f"the logits of training's forward and of {paths[i >= first_step]} differ "
                       f"at position {i} by {difference[i]:.3g}: {edit}")


def validation_loader(stream: TokenStream, cfg: TrainConfig, launch: Launch) -> DataLoader:
    """In order from its start each time: every evaluation scores the same tokens."""
    return DataLoader(stream, cfg.micro_batch_size, cfg.seq_len, launch.rank, launch.world_size,
                      shuffle=False, seed=cfg.seed)


@torch.no_grad()
def estimate_val_loss(model, loader, eval_steps, accum_steps, device, autocast, launch) -> float:
    """Mean loss of the first eval_steps validation steps: the same tokens every time."""
    model.eval()  # no dropout
    loader.epoch = loader.position = 0
    step_losses = torch.zeros(eval_steps, device=device)
    for step in range(eval_steps):
        for _ in range(accum_steps):
            x, y = (to_device(batch, device) for batch in loader.next_batch())
            with autocast():  # the logits' cross-entropy, even if training's loss adds terms
                step_losses[step] += model.cross_entropy(model.hidden_states(x), y) / accum_steps
    model.train()
    return all_reduce_mean(step_losses, launch).mean().item()


@torch.no_grad()
def evaluate_hellaswag(model: GPT, batches: list[tuple], device, autocast, launch) -> dict:
    """Pick the likeliest of 4 endings. acc: the ending of lowest summed loss is right; acc_norm:
    of lowest mean loss a token (long endings are not penalised for their length)."""
    model.eval()
    counts = torch.zeros(3, device=device)  # examples, right by summed, by mean loss
    for batch in batches:  # tokens, mask (4n, L): example i in rows 4i to 4i + 3
        tokens, mask, labels = (to_device(tensor, device) for tensor in batch)
        rows, positions = mask[:, 1:].nonzero(as_tuple=True)  # position i predicts token i + 1
        with autocast():  # the endings' tokens alone
            losses = model.cross_entropy(model.hidden_states(tokens)[rows, positions],
                                         tokens[rows, positions + 1], reduction="none")
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


def render_hellaswag(example: dict, tokenizer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """tokens (4, L): context then each ending; mask (4, L): 1 on ending tokens."""
    context = tokenizer.encode_ordinary(example["ctx"])
    rows = [context + tokenizer.encode_ordinary(" " + ending) for ending in example["endings"]]
    tokens = torch.zeros(4, max(len(row) for row in rows), dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, len(context) : len(row)] = 1
    return tokens, mask, int(example["label"])


def pack_hellaswag(rendered: list[tuple], max_tokens):
    """Batches (tokens, mask (4n, L), labels (n,)) of up to max_tokens, shortest first."""
    groups = []
    for example in sorted(rendered, key=lambda example: example[0].size(1)):
        if not groups or 4 * (len(groups[-1]) + 1) * example[0].size(1) > max_tokens:
            groups.append([])
        groups[-1].append(example)
    pad = functools.partial(nn.utils.rnn.pad_sequence, batch_first=True)  # to the longest row
    return [(pad([row for tokens, _, _ in group for row in tokens]),
             pad([row for _, mask, _ in group for row in mask]),
             torch.tensor([label for _, _, label in group])) for group in groups]


def sample_next(model: GPT, idx, caches, positions, noise, temperature: float, n_vocab: int):
    """(B, 1): the token after idx (B, T) at positions (T,), from softmax p of the top k (noise's
    width) of n_vocab logits: argmax(p / E), E ~ Exp(1), is i with probability p_i, sync-free."""
    hidden = model.hidden_states(idx, caches, positions)[:, -1]  # (B, n_embd): the last position
    logits = model.logits(hidden)[:, :n_vocab].float() / temperature  # no padding rows
    top_logits, top_ids = torch.topk(logits, noise.size(1), dim=-1)
    choice = (F.softmax(top_logits, dim=-1) / noise).argmax(dim=-1, keepdim=True)
    return top_ids.gather(-1, choice)


# cuDNN's attention plans anew for each length (the prompt's, each window's): 64 tokens/s at 124M
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.no_grad()
def generate(model: GPT, prompt_tokens: list[int], max_new_tokens: int, caches, num_samples=1,
             temperature=1.0, top_k=50, seed=0, autocast=contextlib.nullcontext,
             next_token=sample_next) -> list[list[int]]:
    """num_samples continuations. caches (kv_caches): the prompt's pass fills them, then each
    token runs alone (next_token: sample_next, or a compiled copy); None: every token rereads
    the whole context. An empty prompt starts from <|endoftext|>, as GPT-2's did."""
    model.eval()
    device, vocab, block_size = model.lm_head.weight.device, tokenizer(), model.config.block_size
    context = prompt_tokens or [vocab.eot_token]
    tokens = F.pad(torch.tensor(context, device=device), (0, max_new_tokens)).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)  # training's RNG untouched
    top_k = min(top_k, model.config.vocab_size, vocab.n_vocab)
    position = torch.tensor([len(context)], device=device)  # the newest token's
    with autocast(), sdpa_kernel(WITHOUT_CUDNN):
        for length in range(len(context), tokens.size(1)):  # tokens so far
            noise = torch.empty(num_samples, top_k, device=device).exponential_(generator=generator)
            if caches is None or length > block_size:  # the last block_size tokens, all again
                window = tokens[:, max(0, length - block_size) : length]
                new = sample_next(model, window, None, None, noise, temperature, vocab.n_vocab)
            elif length == len(context):  # the prompt fills the caches
                new = sample_next(model, tokens[:, :length], caches, torch.arange(length,
                                  device=device), noise, temperature, vocab.n_vocab)
            else:  # the newest token alone, (B, 1), at its position
                new = next_token(model, new, caches, position, noise, temperature, vocab.n_vocab)
                position += 1
            tokens[:, length] = new[:, 0]
    model.train()
    return tokens[:, len(context) :].tolist()


def print_samples(model: GPT, tokenizer, cfg, autocast, caches, next_token=sample_next):
    """Print (and return) --num_samples continuations of --prompt."""
    samples = generate(model, tokenizer.encode_ordinary(cfg.prompt), cfg.max_new_tokens, caches,
                       cfg.num_samples, cfg.temperature, cfg.top_k, cfg.seed, autocast, next_token)
    texts = [cfg.prompt + tokenizer.decode(sample) for sample in samples]
    for i, text in enumerate(texts):
        print(f"sample {i}: {text}", flush=True)
    return texts


# ==== The machinery: nothing below is needed to learn or change the algorithm above. ==========
# ruff: noqa: E402 (the machinery's own imports)
import argparse
import difflib
import glob
import hashlib
import importlib.metadata
import importlib.util
import platform
import re
import shutil
import signal
import socket
import sys
import sysconfig
import typing
import urllib.parse
import urllib.request
import weakref

from torch.distributed.elastic.multiprocessing.errors import record


RESUME_AUTO = "run the same command with --resume auto"


class UnavailableError(RunError):
    """An input that cannot be had (a failed download, HellaSwag longer than the model):
    --eval_only goes on without HellaSwag, saying why."""


# ------------------------------ main and the command line
@record  # torchrun's summary names the failing rank
def main(cfg, launch=None, problem=None) -> TrainResult | dict | list[str] | str:
    """Run cfg; under torchrun, all ranks check it together."""
    launch, machine_cfg, notes, status = launch or launch_from_env(os.environ), cfg, [], 0
    try:
        if problem is None:
            check_config(cfg, launch.world_size)
            machine_cfg, notes = device_settings(cfg, launch)  # cfg with the machine's picks
    except RunError as error:
        problem = error
    device = machine_cfg.device if problem is None else "cpu"
    init_distributed(launch, device)
    try:
        check_same_command(cfg, problem, launch, machine_cfg and machine_cfg.dtype)  # as picked
        cfg = machine_cfg
        if cfg.export_hf:
            result = export_hf(cfg)
        elif cfg.generate:
            result = generate_samples(cfg, device)
        elif cfg.eval_only:
            result = evaluate_only(cfg, launch, device)
        else:
            with catching_stop_signals(launch.rank == 0) as stop_signal:
                result = train(cfg, CheckedRun(cfg, launch, stop_signal, notes))
    except RunError as error:  # on every rank: rank 0 says it
        if launch.rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        if launch.torchrun:  # torchrun's SIGTERM, once a rank has exited 2, ended the others -15
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        status = 2
    except KeyboardInterrupt:  # a 2nd Ctrl-C while training, else the 1st
        if launch.rank == 0:
            print(interrupted_line(cfg), file=sys.stderr, flush=True)
        sys.exit(130)
    except torch.OutOfMemoryError:  # torchrun ends the others
        print(f"error: {out_of_memory_message(cfg, device, launch.world_size)}", file=sys.stderr,
              flush=True)
        sys.exit(2)
    # all leave here, a RunError (raised on all) past its except, whose traceback held DDP: held by
    # nothing else, the group ends gloo's threads now; one left to Python's exit aborts it (#179291)
    if launch.torchrun:
        dist.barrier()
        dist.destroy_process_group()
    if status:
        sys.exit(status)
    return result


def parse_args(argv: list[str]) -> TrainConfig:
    """A --flag per TrainConfig field; --model and --init_from fill in flags not given."""
    parser = _OneLineErrorParser(
        description="Pretrain GPT-2 (defaults: the 124M recipe on GPUs).", usage="%(prog)s [flags]",
        formatter_class=lambda prog: _OneLineHelp(prog, max_help_position=32))
    sections = dict.fromkeys(f.metadata["section"] for f in dataclasses.fields(TrainConfig))
    groups = {section: parser.add_argument_group(section) for section in sections}  # --help's
    for f in dataclasses.fields(TrainConfig):
        help_text = f.metadata["help"]  # with the default, unless it says it
        help_text += "" if "(default" in help_text else f" (default: {f.default})"
        value_type = (typing.get_args(f.type) or [f.type])[0]  # bool | None: bool
        options = {"action": argparse.BooleanOptionalAction} if value_type is bool else {
            "type": value_type, "choices": f.metadata["choices"], "metavar": value_type.__name__}
        for name in dict.fromkeys([f.name, f.name.replace("_", "-")]):  # --max-steps, unlisted
            groups[f.metadata["section"]].add_argument(f"--{name}", dest=f.name, **options,
                default=argparse.SUPPRESS, help=help_text if name == f.name else argparse.SUPPRESS)
    given = vars(parser.parse_args(argv))  # only the flags on the command line
    cfg = TrainConfig(**{**MODEL_SHAPES[given.get("model", "gpt2")], **given})
    model_config, run_config = init_from_settings(cfg.init_from)
    model_flags = {name for name in model_config if name != "dropout" and hasattr(cfg, name)}
    clashes = sorted(n for n in model_flags & given.keys() if given[n] != model_config[n])
    if clashes:  # its weights are of its shape
        raise RunError(f"--init_from {cfg.init_from} has " + ", ".join(
            f"{name} {model_config[name]}" for name in clashes) + ": drop " + " ".join(
            f"--{name} {given[name]}" for name in clashes))
    if model_config and "model" in given and any(model_config.get(name) != value for name, value
                                                 in MODEL_SHAPES[given["model"]].items()):
        raise RunError(f"--init_from {cfg.init_from} sets the shape: drop --model {given['model']}")
    taken = {name: model_config[name] for name in model_flags}  # and, unless given, its run's
    taken |= {name: run_config[name] for name in run_config.keys() - given if name in (
        "seq_len", "micro_batch_size", "total_batch_size", "eval_steps")}
    return dataclasses.replace(cfg, **taken)  # the start line and --eval_only's line say so


def init_from_settings(init_from) -> tuple[dict, dict]:
    """--init_from's (model config, run config), as far as a quick read finds them."""
    if init_from in MODEL_SHAPES:  # OpenAI's
        return {**MODEL_SHAPES[init_from], "block_size": 1024, "vocab_size": GPT2_TOKENS}, {}
    with contextlib.suppress(Exception):  # no file, an unreadable one: check_config or loading
        saved = Run.load_checkpoint(init_from)
        if isinstance(saved, dict):
            return saved["model_config"], saved["config"]
    return {}, {}


GPT2_TOKENS = 50257  # the vocabulary of OpenAI's weights, and of checkpoints that name none


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):  # not argparse's usage and exit
        typos = re.findall(r"(--[\w-]+)", message) if message.startswith("unrecognized") else []
        flags = self._option_string_actions  # the shortest with it as a word (--steps: --max_steps)
        close = [min([f for f in flags if f"_{typo[2:]}" in f"_{f[2:]}"] or  # else the nearest
                     difflib.get_close_matches(typo, flags, 1) or [""], key=len) for typo in typos]
        message += f": did you mean {' or '.join(filter(None, close))}?" if any(close) else ""
        raise RunError(f"{message} (see --help)")


class _OneLineHelp(argparse.HelpFormatter):  # each flag and its help on one line at 100 columns
    def _format_action_invocation(self, action):  # --[no-]shuffle, not --shuffle, --no-shuffle
        boolean = isinstance(action, argparse.BooleanOptionalAction)
        return f"--[no-]{action.dest}" if boolean else super()._format_action_invocation(action)


def check_config(cfg, world_size):
    if cfg.init_from not in ("", *MODEL_SHAPES) and not os.path.isfile(cfg.init_from):
        raise RunError(missing_checkpoint(cfg.init_from, "--init_from"))
    for name in ["n_layer", "n_head", "n_embd", "block_size", "total_batch_size",
                 "micro_batch_size", "seq_len", "max_steps", "eval_steps", "num_samples", "top_k"]:
        if getattr(cfg, name) < 1:
            raise RunError(f"--{name} must be at least 1, got {getattr(cfg, name)}")
    negative = [f"--{name} {getattr(cfg, name)}" for name in (
        "eval_every", "sample_every", "hellaswag_every", "ckpt_every", "keep_ckpts", "grad_clip",
        "stop_after_steps", "loss_chunk_size", "max_new_tokens", "weight_decay", "vocab_size")
        if (getattr(cfg, name) or 0) < 0]
    micro_step_tokens = cfg.micro_batch_size * cfg.seq_len * world_size
    n_vocab = CheckedRun.tokenizer().n_vocab
    modes = [f"--{mode}" for mode in ("generate", "eval_only", "export_hf") if getattr(cfg, mode)]
    resumed = f"{cfg.log_dir}/ckpt_<step>.pt" if cfg.resume == "auto" else cfg.resume
    fits = micro_batch_that_divides(cfg, world_size, cfg.micro_batch_size)
    divide = (f"use --micro_batch_size {fits}, the largest that divides it, or make "
              "--total_batch_size a multiple of it" if fits else "make --total_batch_size a "
              f"multiple of seq_len x processes = {cfg.seq_len * world_size}")
    mistakes = [(negative, f"{', '.join(negative)}: must be 0 or more"),
        (cfg.n_embd % cfg.n_head, f"--n_embd {cfg.n_embd} is not divisible by --n_head "
         f"{cfg.n_head}: pick a width that is"),
        (cfg.seq_len > cfg.block_size and not (cfg.generate or cfg.export_hf), f"--seq_len "
         f"{cfg.seq_len} is longer than --block_size {cfg.block_size}: lower --seq_len"
         f"{'' if cfg.init_from else ' or raise --block_size'}"),
        (0 < cfg.vocab_size < n_vocab and not cfg.init_from, f"--vocab_size {cfg.vocab_size} is "
         f"smaller than the tokenizer's {n_vocab} tokens: use at least {n_vocab}, or 0 (padded: "
         "faster)"),
        (cfg.total_batch_size % micro_step_tokens, f"--total_batch_size {cfg.total_batch_size} is "
         f"not divisible by micro_batch_size x seq_len x processes = {cfg.micro_batch_size} x "
         f"{cfg.seq_len} x {world_size} = {micro_step_tokens}: {divide}"),
        (not 0 <= cfg.warmup_steps <= cfg.max_steps, f"--warmup_steps {cfg.warmup_steps} must be "
         f"between 0 and --max_steps {cfg.max_steps}: lower --warmup_steps"),
        (cfg.max_lr <= 0, f"--max_lr {cfg.max_lr} is not above 0"),
        (cfg.eps <= 0, f"--eps {cfg.eps} is not above 0: AdamW divides by it where a gradient is 0"
         " (try 1e-8)"),
        (not 0 <= cfg.min_lr_ratio <= 1, f"--min_lr_ratio {cfg.min_lr_ratio} is not in [0, 1]"),
        (not 0 <= cfg.dropout < 1, f"--dropout {cfg.dropout} is not in [0, 1)"),
        (cfg.optimizer == "muon" and not hasattr(torch.optim, "Muon"), "--optimizer muon needs "
         f"torch.optim.Muon, new in PyTorch 2.9; this is {torch.__version__}: upgrade torch"),
        (not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1), f"--beta1 {cfg.beta1} and --beta2 "
         f"{cfg.beta2} must be in [0, 1)"),
        (cfg.temperature <= 0, f"--temperature {cfg.temperature} is not above 0"),
        (cfg.peak_tflops is not None and cfg.peak_tflops <= 0, f"--peak_tflops {cfg.peak_tflops} "
         "is not above 0"),
        (len(modes) > 1, f"{' and '.join(modes)} are separate runs: pick one"),
        (modes and cfg.resume, f"{' '.join(modes)} takes the weights of --init_from, not --resume: "
         f"use --init_from {resumed}"),
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
            raise RunError(message)


def micro_batch_that_divides(cfg, world_size, at_most):
    return next((b for b in range(at_most, 0, -1)
                 if cfg.total_batch_size % (b * cfg.seq_len * world_size) == 0), None)


# ------------------------------ the machine's choices
def device_settings(cfg, launch) -> tuple[TrainConfig, list[str]]:
    """cfg with the recipe's machine_choices, checked against the card; compile; MFU's peak."""
    device = pick_device(cfg.device, launch, torch.cuda.device_count(),
                         torch.backends.mps.is_available())
    gpu, card, major, minor, blocker = device.startswith("cuda"), "", 0, 0, None
    if gpu:
        card = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        check_kernels(card, major, minor, torch.cuda.get_arch_list())
        blocker = compile_blocker(major, minor, os.environ)
    if gpu and cfg.dtype == "bfloat16" and major < 8 and not torch.version.hip:  # emulated
        raise RunError(f"--dtype bfloat16: {card} (compute capability {major}.{minor}) has no "
                       "bfloat16 arithmetic: use --dtype float16")
    auto = cfg.compile is None and not cfg.generate  # compiling outlasts --generate
    compile = gpu and not blocker if auto else bool(cfg.compile)  # on CUDA
    if compile and blocker:
        raise RunError(f"--compile cannot run on {card}: {blocker}; use --no-compile")
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")  # Inductor's
    if compile and device == "cpu" and not shutil.which(cxx):
        raise RunError(f"--compile on the CPU builds C++ with {cxx}, which is not installed: "
                       "install it (g++), or use --no-compile")
    cfg = machine_choices(dataclasses.replace(cfg, device=device, compile=compile), launch)
    peaks = [tf32 if cfg.dtype == "float32" else half for pattern, half, tf32 in PEAK_TFLOPS
             if gpu and re.search(pattern, card)]  # the first row that fits, unless given
    notes = [f"compile off: {blocker} (on an H100 compile trains 1.54x faster: 489k against 317k "
             "tokens/s)"] if auto and blocker else []
    return dataclasses.replace(cfg, peak_tflops=cfg.peak_tflops if cfg.peak_tflops is not None
                               else next(iter(peaks), None)), notes

PEAK_TFLOPS = [  # datasheets' dense (card, 16-bit, TF32) TFLOP/s
    (r"H100 80GB HBM3|H100 SXM", 989, 495), (r"H100 PCIe", 756, 378), (r"H200$", 989, 495),
    (r"A100", 312, 156), (r"\bA10$", 125, 62.5), (r"\bL4$", 121, 60), (r"L40S$", 362, 183),
    (r"RTX 3090$", 71, 35.6), (r"RTX 4090$", 165, 82.6), (r"V100-SXM", 125, 15.7),
    (r"V100-PCIE", 112, 14), (r"\bT4$", 65, 8.1), (r"GTX 1080 Ti$", 11.3, 11.3)]


def pick_device(requested, launch, gpu_count, mps_available):
    if requested == "auto":
        requested = "cuda" if gpu_count else "mps" if mps_available else "cpu"
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", requested):
        raise RunError(f"unknown --device {requested!r}: use auto, cpu, cuda, cuda:N or mps")
    kind, _, index = requested.partition(":")
    if kind == "cuda" and not gpu_count or kind == "mps" and not mps_available:
        raise RunError(f"--device {requested} is not available on this machine: use --device "
                       "auto or cpu")
    if kind == "cuda" and launch.torchrun and index and launch.world_size > 1:
        raise RunError(f"--device {requested} names one GPU for {launch.world_size} processes: "
                       "use --device cuda")
    if kind == "cuda" and launch.torchrun and not index:  # one GPU per process
        if launch.local_world_size > gpu_count:
            raise RunError(f"{launch.local_world_size} processes on this machine, which has "
                           f"{gpu_count} GPU(s): start one process a GPU "
                           f"(torchrun --nproc_per_node={gpu_count})")
        return f"cuda:{launch.local_rank}"
    if index and int(index) >= gpu_count:
        raise RunError(f"--device {requested} is not on this machine, which has {gpu_count} "
                       f"GPU(s), cuda:0 to cuda:{gpu_count - 1}: pick one of those")
    return "cuda:0" if requested == "cuda" else requested  # torch.cuda.set_device needs an index


def check_kernels(card, major, minor, arch_list: list[str]):
    """Refuse a torch with no kernels for the card (sm_XY of its major, or PTX)."""
    for kind, built_major, built_minor in re.findall(r"(sm|compute)_(\d+)(\d)", str(arch_list)):
        built = (int(built_major), int(built_minor))  # sm_86: (8, 6); sm_100a: (10, 0)
        if built <= (major, minor) and (kind == "compute" or built[0] == major):
            return
    if torch.version.hip is None:  # cu126: 5.0 to 9.0; cu130: 7.5 up
        raise RunError(f"{card} (compute capability {major}.{minor}) has no kernels in torch "
                       f"{torch.__version__}, built for {' '.join(arch_list)}: pip install "
                       "torch --index-url https://download.pytorch.org/whl/cu126")


def compile_blocker(major, minor, environ):
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


# ------------------------------ every rank agrees, or all stop
def check_same_command(cfg, problem: RunError | None, launch, dtype):
    """Raise flags that differ between ranks, then any rank's problem, then dtypes that the ranks'
    cards picked apart (--dtype auto: bfloat16 beside float16's loss scaler), on every rank."""
    reports = gather((problem and str(problem), cfg and dataclasses.asdict(cfg), dtype), launch)
    parsed = [(rank, flags) for rank, (_, flags, _) in enumerate(reports) if flags is not None]
    differing = [f"--{name} {value} on rank {parsed[0][0]} but {flags[name]} on rank {rank}"
                 for name, value in (parsed[0][1].items() if parsed else ())
                 for rank, flags in parsed[1:] if flags[name] != value]
    if differing:
        raise RunError("the processes were started with different flags "
                       f"({', '.join(differing)}): start every machine with the same command")
    raise_first_problem([problem for problem, _, _ in reports])
    picked = [dtype for _, _, dtype in reports]
    if apart := next((rank for rank, dtype in enumerate(picked) if dtype != picked[0]), None):
        raise RunError(f"--dtype auto picked {picked[0]} on rank 0 but {picked[apart]} on rank "
                       f"{apart} (a card without bfloat16): pass --dtype float16 everywhere")


def raise_first_problem(problems: list[str | None]):
    for rank, problem in enumerate(problems):
        if problem is not None:
            raise RunError(problem if rank == 0 else f"{problem} (on rank {rank})")


@contextlib.contextmanager
def catching_stop_signals(say: bool):
    """SIGTERM, SIGHUP, Ctrl-C (not ignored) set ["requested"], said at once; a 2nd Ctrl-C stops."""
    stop = {"requested": False}

    def handle(signum, frame):
        first, stop["requested"] = not stop["requested"], True  # set before the write below
        if not first and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if say and first:  # os.write: a print may be half done beneath us
            os.write(2, f"{signal.Signals(signum).name}: the step ends, a checkpoint is written, "
                     "then the run stops (a second Ctrl-C stops at once)\n".encode())
    previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGTERM,
                signal.SIGHUP, signal.SIGINT) if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# ------------------------------ the hardened run
class CheckedRun(Run):
    """The recipe's Run, hardened: each input checked on every rank before any work (a problem on
    one stops all; rank 0 says it), what is missing fetched, files written whole, metrics.jsonl
    (and TensorBoard), signals, and a failed write or a bad token stopping all at a step's end."""

    def __init__(self, cfg, launch=None, stop_signal=None, notes=()):
        super().__init__(cfg, launch)
        self.stop_signal, self.notes = stop_signal or {"requested": False}, notes
        self.sources = {}  # the checkpoints read, by flag: the code that wrote them
        self.card = (torch.cuda.get_device_name(self.cfg.device)
                     if self.cfg.device.startswith("cuda") else "")
        if self.launch.restarts and checkpoint_paths(cfg.log_dir):  # torchrun restarted: go on
            self.cfg = dataclasses.replace(self.cfg, resume="auto")
            self.notes = [*notes, f"torchrun's restart {self.launch.restarts}: going on from the "
                          f"newest checkpoint in {cfg.log_dir}"]
        self.path, self.problem, self.epoch = os.path.join(cfg.log_dir, "metrics.jsonl"), None, 0

    def read_inputs(self) -> Inputs:
        """Every rank reads and checks them, then rank 0 opens the log; any problem stops all."""
        cfg, launch = self.cfg, self.launch

        def read():
            if (earlier := checkpoint_paths(cfg.log_dir)) and not cfg.resume:  # auto takes them
                raise RunError(f"--log_dir {cfg.log_dir} holds an earlier run's checkpoints "
                               f"({os.path.basename(earlier[0])}): continue it with --resume "
                               "auto, or pass another --log_dir")
            inputs = Run.read_inputs(self)
            check_token_counts((inputs.train_tokens, inputs.val_tokens), cfg,
                               with_val=cfg.eval_every > 0)
            if inputs.checkpoint is not None:
                check_resumable(inputs.checkpoint, cfg, inputs.model_config)
                step = inputs.checkpoint["step"]  # later ones: another branch, --resume auto's pick
                later = [os.path.basename(p) for p in earlier if int(Path(p).stem[5:]) > step]
                if later and cfg.resume != "auto":  # (auto skips only unreadable ones)
                    raise RunError(f"--log_dir {cfg.log_dir} holds {', '.join(later)}, later than "
                                   f"step {step} of --resume: move them, or use another --log_dir")
            return inputs
        self.inputs = inputs = on_every_rank(launch, read)
        found = gather((inputs.train_tokens.num_tokens, inputs.val_tokens.num_tokens,
                        inputs.checkpoint and inputs.checkpoint["step"]), launch)
        if len(set(found)) > 1:
            raise RunError(f"the ranks found different data or checkpoints ((train tokens, val "
                           f"tokens, checkpoint step) on each: {found}): give every machine the "
                           "same shards and a shared --log_dir")
        on_every_rank(launch, lambda: launch.rank == 0 and self.open_log(inputs.checkpoint))
        return inputs

    def initial_weights(self):
        model_config, weights = super().initial_weights()
        if weights is not None:
            check_vocabulary(self.sources.get("--init_from", {}), "--init_from", self.cfg.init_from)
            check_weights_fit(weights, model_config, self.cfg.init_from, "--init_from")
        return model_config, weights

    def load_checkpoint(self, path):
        cfg = self.cfg
        if path == cfg.init_from and path in MODEL_SHAPES:  # as released
            check_vocabulary({}, "--init_from", path)
            return {"model": load_openai_weights(path), "model_config": init_from_settings(path)[0]}
        if path != "auto":
            flag = "--init_from" if path == cfg.init_from else "--resume"
            self.sources[flag] = checkpoint = read_checkpoint(path, flag)
            return checkpoint
        for found in checkpoint_paths(cfg.log_dir):
            try:
                self.sources["--resume"] = checkpoint = read_checkpoint(found)
                return checkpoint
            except RunError as error:
                self.info(f"warning: skipping {error}")
        self.info(f"--resume auto: no checkpoint in {cfg.log_dir}, starting from "
                  f"{cfg.init_from or 'scratch'}")
        return None

    def token_streams(self):
        """A token beyond GPT-2's stops the run; the text is downloaded where none is given."""
        cfg = self.cfg
        if not cfg.data_dir and not cfg.text_file and not os.path.exists(TEXT_FILE):
            download(TINY_SHAKESPEARE_URL, TEXT_FILE,
                     "put a text file there, or pass --text_file or --data_dir")
        return [CheckedTokenStream(stream.arrays, tokenizer())
                for stream in super().token_streams()]

    def shard_paths(self, split):
        data_dir = self.cfg.data_dir
        if not os.path.isdir(data_dir):
            raise RunError(f"--data_dir {data_dir} is not a folder: " + (
                f"for a text file, use --text_file {data_dir}" if os.path.isfile(data_dir) else
                "run fineweb.py to make shards, or fix the path"))
        if os.path.exists(os.path.join(data_dir, "INCOMPLETE")):  # fineweb.py's, until done
            raise RunError(f"--data_dir {data_dir} is incomplete (fineweb.py's INCOMPLETE file is "
                           "there): wait for fineweb.py, or rerun it with --resume")
        if not (paths := super().shard_paths(split)):
            raise RunError(f"no {split} shards (*_{split}_*.npy) in --data_dir {data_dir}: "
                           "run fineweb.py to make them")
        return paths

    def open_shard(self, path):
        try:
            tokens = super().open_shard(path)
        except OSError as error:  # a folder, no permission, a bad disk
            raise RunError(f"cannot read shard {path} ({error.strerror or error}): check the "
                           "file") from None
        except (ValueError, EOFError):  # no .npy header: numpy calls it "pickled data"
            raise RunError(f"cannot read shard {path}: it is not a .npy file (empty, cut short "
                           "or another format): delete it and rerun fineweb.py") from None
        dtype = np.dtype(np.uint16 if tokenizer().n_vocab <= 2**16 else np.uint32)  # fineweb.py's
        if tokens.dtype != dtype or tokens.ndim != 1 or len(tokens) < 1:
            raise RunError(f"shard {path} holds {tokens.dtype} of shape {tokens.shape}, not a "
                           f"1-D {dtype} array of tokens: rerun fineweb.py")
        return tokens

    def text_tokens(self, path):
        try:
            return super().text_tokens(path)
        except FileNotFoundError:
            raise RunError(f"--text_file {path} does not exist: give a text file, or --data_dir "
                           "with fineweb.py's shards") from None
        except (OSError, UnicodeDecodeError) as error:
            reason = (error.strerror if isinstance(error, OSError)
                      else f"not UTF-8: {error.reason} at byte {error.start}")
            raise RunError(f"cannot read --text_file {path} ({reason}): give a UTF-8 text "
                           "file") from None

    @staticmethod
    def tokenizer():  # check_config's call comes first: tiktoken keeps what it loaded
        try:
            return tokenizer()
        except (OSError, ValueError) as error:  # offline; a damaged file
            raise RunError(f"cannot load the tokenizer ({type(error).__name__}): tiktoken "
                           "downloads its files once; connect to the network, or set "
                           "TIKTOKEN_CACHE_DIR to a folder that holds them") from None

    def hellaswag(self):
        batches, block_size = super().hellaswag(), self.cfg.block_size
        if (longest := max((tokens.size(1) for tokens, _, _ in batches), default=0)) > block_size:
            fix = "" if self.cfg.eval_only else ", or drop --hellaswag_every"
            raise UnavailableError(f"the longest HellaSwag example in "
                                   f"{self.cfg.hellaswag_path or HELLASWAG_CACHE} takes {longest} "
                                   f"tokens, more than the model's block_size of {block_size}: "
                                   f"HellaSwag needs --block_size {longest} or more{fix}")
        return batches

    def hellaswag_examples(self):
        """Downloaded once where no --hellaswag_path is given; each record checked."""
        path = self.cfg.hellaswag_path or HELLASWAG_CACHE
        if not os.path.exists(path):
            download(HELLASWAG_URL, path, "pass --hellaswag_path with a local copy of it")
        examples = []
        for line_number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            try:
                example = json.loads(line)
                endings, label = example["endings"], example["label"]
                valid = (isinstance(example["ctx"], str) and label in range(4) and isinstance(
                    endings, list) and [type(ending) for ending in endings] == [str] * 4)
            except (json.JSONDecodeError, KeyError, TypeError):
                valid = False
            if not valid:
                raise RunError(f"{path} line {line_number} is not a HellaSwag record (ctx, "
                               "4 endings, label 0-3)")
            examples.append(example)
        if not examples:
            raise RunError(f"{path} holds no HellaSwag records: give hellaswag_val.jsonl's path")
        return examples

    def restore(self, checkpoint, model, scored, optimizers, scaler, loader):
        cfg, saved, step = self.cfg, checkpoint["config"], checkpoint["step"]
        if "windows_consumed" in checkpoint:  # written before the place was counted in tokens
            T, windows = saved["seq_len"], checkpoint["windows_consumed"]
            epoch, window = divmod(windows, (checkpoint["train_tokens"] - 1) // T)
            checkpoint = {**checkpoint, "data_epoch": epoch, "data_position": window * T}
        if reshaped := changed(saved, cfg, ("seq_len", "micro_batch_size")):
            self.info(", ".join(f"--{name} {old} -> {new}" for name, (old, new) in reshaped.items())
                      + ": the data goes on from its next unread token, "
                      f"{checkpoint['data_position']:,} of epoch {checkpoint['data_epoch']}")
        if checkpoint["train_tokens"] != (tokens := loader.stream.num_tokens):
            self.info(f"warning: the training data holds {tokens:,} tokens, the checkpoint's held "
                      f"{checkpoint['train_tokens']:,}: its data position points at other tokens "
                      "now; resume with the checkpoint's data to go on exactly")
        differing = changed(saved, cfg, [f.name for f in dataclasses.fields(TrainConfig)
                                         if f.metadata["section"] == "optimizer"])
        if differing:  # allowed (to extend a run)
            old = dataclasses.replace(cfg, **{k: v for k, (v, _) in differing.items()
                                              if v is not None})
            flags = ", ".join(f"--{k} {v} -> {now}" for k, (v, now) in differing.items())
            rate, saved_rate = lr_at(step, cfg), lr_at(step, old)  # the same: say the flags alone
            if rate != saved_rate or differing.keys() - {"max_lr", "min_lr_ratio", "warmup_steps",
                                                         "max_steps"}:
                self.info(f"warning: the optimizer and schedule differ from the checkpoint's "
                          f"({flags})" + (f": at step {step} the learning rate goes on at "
                          f"{rate:.4e} instead of {saved_rate:.4e}" if rate != saved_rate else ""))
        return super().restore(checkpoint, model, scored, optimizers, scaler, loader)

    # ---- the log: metrics.jsonl, and TensorBoard's events beside it
    def open_log(self, checkpoint):
        """Make --log_dir; metrics.jsonl: empty, or the records before the checkpoint's step."""
        cfg, resume_step = self.cfg, checkpoint and checkpoint["step"]
        try:
            os.makedirs(cfg.log_dir, exist_ok=True)
        except OSError as error:
            why = "it is a file" if os.path.isfile(cfg.log_dir) else error.strerror
            raise RunError(f"cannot make --log_dir {cfg.log_dir} ({why}): give a folder you can "
                           "write to") from None
        kept = []
        if resume_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:  # a summary or a cut line has no step: dropped
                    with contextlib.suppress(json.JSONDecodeError):
                        if "run" in (record := json.loads(line)) or record.get(
                                "step", resume_step) < resume_step:
                            kept.append(line)
        run = {"run": {"flags": dataclasses.asdict(cfg), "resumed_at": resume_step,  # what it is
                       "torch": torch.__version__, "numpy": np.__version__,
                       "tiktoken": importlib.metadata.version("tiktoken"), "device": cfg.device,
                       "device_name": self.card or platform.processor(), "world_size":
                       self.launch.world_size, "train_gpt2_sha256": file_sha256(__file__)}}
        write_atomically(self.path, lambda temporary: Path(temporary).write_text(
            "".join(kept) + json.dumps(run) + "\n"))
        remove_killed_writes(cfg.log_dir)
        if cfg.tensorboard:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog
            name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}"
            first = not any(Path(cfg.log_dir).glob("events.out.tfevents.*"))
            self.board_path = os.path.join(cfg.log_dir, name)
            # TensorBoard drops old events from this step on; first turned on: write the kept ones
            restart = Event(step=resume_step or 0, session_log=SessionLog(status=SessionLog.START))
            self.write_events([json.loads(line) for line in kept if first],
                              Event(file_version="brain.Event:2"), restart)

    def write_events(self, records: list[dict], *events):
        """As SummaryWriter would (its thread can't report a full disk)."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter
        from torch.utils.tensorboard.summary import scalar
        events += tuple(Event(wall_time=time.time(), step=record["step"], summary=scalar(tag, v))
                        for record in records for tag, v in record.items()
                        if tag != "step" and "step" in record)
        with failed_write_is_one_line(self.board_path), open(self.board_path, "ab") as f:
            for event in events:
                RecordWriter(f).write(event.SerializeToString())

    def log(self, record, line):
        """The recipe's, with MFU; then the files. A failed write stops all at the step's end."""
        if self.cfg.peak_tflops and "ms" in record:
            record["mfu"] = model_flops_utilization(self.flops_per_step, record["ms"],
                                                    self.cfg.peak_tflops, self.launch.world_size)
            line += f" | MFU {100 * record['mfu']:.1f}%"
        super().log(record, line)
        if self.launch.rank != 0 or self.problem:
            return
        size = os.path.getsize(self.path)
        try:
            with failed_write_is_one_line(self.path), open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.cfg.tensorboard:
                self.write_events([record])
        except RunError as error:
            os.truncate(self.path, size)  # no half record left
            self.problem = str(error)

    def start(self, model, accum_steps, loader):
        cfg, W, params = self.cfg, self.launch.world_size, count_parameters(model)
        self.model = model  # check_gradients reads its gradients
        self.flops_per_step = cfg.total_batch_size * flops_per_token(model.config, params,
                                                                     cfg.seq_len)
        self.epoch = loader.epoch
        card = f", {self.card}" if self.card else ""
        mfu = (f", MFU against {cfg.peak_tflops:g} TFLOP/s" if cfg.peak_tflops else
               ", no MFU: its peak TFLOP/s is unknown, give --peak_tflops" if card else "")
        sharded = "optimizer state sharded over the processes; " * (cfg.shard_optimizer and W > 1)
        processes = f"{W} process{'es' * (W > 1)}"
        self.info("\n".join([*self.notes, (
            f"device {cfg.device}{card} ({cfg.dtype}, compile {'on' if cfg.compile else 'off'}"
            f"{mfu}), {processes}; {params:,} parameters; {cfg.total_batch_size:,} tokens per "
            f"step = {accum_steps} micro-step{'s' * (accum_steps > 1)} x {processes} x "
            f"{cfg.micro_batch_size} x {cfg.seq_len}; {sharded}"
            f"{loader.stream.num_tokens:,} train tokens" + (
                f"; flags not given: {cfg.init_from}'s seq_len, batch sizes, eval_steps"
                if os.path.isfile(cfg.init_from) else "") + "".join(
                f"; {flag} {saved['path']} was written by a train_gpt2.py {apart} line"
                f"{'s' * (apart > 1)} apart"
                for flag, saved, apart in self.code_changes()))]))

    def code_changes(self):
        """(flag, checkpoint, lines added or removed) where a checkpoint's code differs."""
        this = Path(__file__).read_text().splitlines()
        for flag, saved in self.sources.items():
            if "source" not in saved:  # written before checkpoints held their code
                continue
            diff = difflib.unified_diff(saved["source"].splitlines(), this, n=0)
            if apart := sum(line[:1] in "+-" and line[:3] not in ("+++", "---") for line in diff):
                yield flag, saved, apart

    def log_step(self, step, loss, lr, grad_norm, ms, loader):
        super().log_step(step, loss, lr, grad_norm, ms, loader)
        if self.inputs.checkpoint is None and step < NO_GRADIENT_STEPS:  # a new run's first steps
            self.check_gradients(step)
        if loader.epoch > self.epoch:
            self.epoch = loader.epoch
            self.log({"step": step, "epoch": loader.epoch}, f"step {step:5d}/{self.cfg.max_steps} "
                     f"| epoch {loader.epoch} begins: all {loader.num_windows:,} training windows "
                     f"were used, starting again{' in a new order' if loader.shuffle else ''}")

    def check_gradients(self, step):  # one line names a parameter no rank's batches used
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        got = np.array([p.grad is not None for _, p in named])  # in this step, on this rank
        self.got_gradient = got | self.got_gradient if step else got
        cfg = self.cfg  # the first steps, or all of a shorter run, or of its first part
        if step + 1 == min(NO_GRADIENT_STEPS, cfg.max_steps, cfg.stop_after_steps or math.inf):
            on_any_rank = np.any(gather(self.got_gradient, self.launch), axis=0)
            if idle := [name for (name, _), got in zip(named, on_any_rank, strict=True) if not got]:
                raise RunError(f"{', '.join(idle)} got no gradient in this run's first {step + 1} "
                               "steps: use it in forward, or set its requires_grad to False")

    def diverged(self, step, loss, grad_norm):
        saved = checkpoint_paths(self.cfg.log_dir)
        go_back = (f"go on from {saved[0]} (--resume {saved[0]}), or an older checkpoint if the "
                   "loss was rising there already," if saved else "start again")
        raise RunError(f"training diverged at step {step}: loss {loss:.4g}, gradient norm "
                       f"{grad_norm:.4g}; nothing was saved from this step: {go_back} with a "
                       "lower --max_lr or more --warmup_steps")

    def stop_requested(self):
        return stop_or_fail_together(self.stop_signal["requested"], [
            self, self.inputs.train_tokens, self.inputs.val_tokens], self.launch)

    def write_checkpoint(self, state, steps_done):
        path = os.path.join(self.cfg.log_dir, f"ckpt_{steps_done}.pt")
        on_every_rank(self.launch, lambda: state is not None and save_checkpoint(
            path, {**state, "source": Path(__file__).read_text(), "n_vocab": tokenizer().n_vocab},
            self.cfg.keep_ckpts))

    def stopped(self, step, reason):
        self.info(f"stopped by {reason} after step {step}, checkpoint {self.cfg.log_dir}/ckpt_"
                  f"{step + 1}.pt written: to continue, {RESUME_AUTO}")

    def finish(self, start_step):
        cfg = self.cfg
        if self.step_ms:
            self.summary()
            if cfg.ckpt_every and (written := checkpoint_paths(cfg.log_dir)):
                self.info(f"last checkpoint: {written[0]}")  # this run's last write
        else:
            self.info(f"nothing to train: the checkpoint is at step {start_step} of --max_steps "
                      f"{cfg.max_steps}")
        stop_or_fail_together(False, [self], self.launch)  # rank 0's log failed: all stop
        super().finish(start_step)

    def summary(self):
        cfg = self.cfg
        timed = self.step_ms[3:] or self.step_ms  # the first 3 compile and warm up: untimed
        median_ms = float(np.median(timed))
        summary = {"timed_steps": len(timed), "median_ms": median_ms,
                   "median_tokens_per_s": cfg.total_batch_size * 1000 / median_ms}
        if self.card:  # CUDA's
            summary["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            summary["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        else:  # resident
            import resource  # ru_maxrss: KiB on Linux, bytes on macOS
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            summary["peak_memory_gib"] = peak / (2**30 if sys.platform == "darwin" else 2**20)
        line = (f"summary: median {median_ms:.1f} ms/step, {summary['median_tokens_per_s']:,.0f} "
                f"tokens/s over the last {len(timed)} steps; peak memory "
                f"{summary['peak_memory_gib']:.2f} GiB" + (f" ({summary['peak_reserved_gib']:.2f} "
                "GiB reserved)" if "peak_reserved_gib" in summary else ""))
        if cfg.peak_tflops:
            summary["mfu"] = model_flops_utilization(self.flops_per_step, median_ms,
                                                     cfg.peak_tflops, self.launch.world_size)
            line += f"; MFU {100 * summary['mfu']:.1f}% of {cfg.peak_tflops:g} TFLOP/s"
        self.log({"summary": summary}, line)


# A new run's first steps (all, if fewer): a parameter some batches skip (an MoE's expert, a gate)
# gets a gradient in them on some rank. Not after a resume: an expert may idle a while, by design
NO_GRADIENT_STEPS = 10


def flops_per_token(model_config: GPTConfig, num_params, seq_len):
    """Training FLOPs a token: 6N, and 12 L T C for attention (PaLM, App. B)."""
    return 6 * num_params + 12 * model_config.n_layer * seq_len * model_config.n_embd


def model_flops_utilization(flops_per_step, step_ms, peak_tflops, world_size):
    return flops_per_step * 1000 / step_ms / (world_size * peak_tflops * 1e12)


def on_every_rank(launch, work):
    """work()'s value; a RunError on any rank is raised on every rank (the lowest rank's)."""
    try:
        value, problem = work(), None
    except RunError as error:
        value, problem = None, str(error)
    raise_first_problem(gather(problem, launch))
    return value


def stop_or_fail_together(signalled, sources: list, launch):
    """Whether any rank got a stop signal; any rank's problem is raised on all."""
    problem = next((source.problem for source in sources if getattr(source, "problem", None)),
                   None)
    reports = gather((signalled, problem), launch)
    raise_first_problem([problem for _, problem in reports])
    return any(signalled for signalled, _ in reports)


# ------------------------------ reading the inputs
def check_token_counts(streams, cfg, with_val):
    """(train, val) hold a step, and val an evaluation."""
    T, tokens = cfg.seq_len, f"{cfg.total_batch_size:,} tokens"
    step_windows = cfg.total_batch_size // T
    more = "more shards" if cfg.data_dir else "--data_dir with fineweb.py's shards"
    for stream, name, windows, need, fix in [
        (streams[0], "training", step_windows, f"one step of --total_batch_size {tokens}",
         f"train on more data ({more}) or lower --total_batch_size (the README's quick start "
         "trains a small model on tiny Shakespeare)"),
        (streams[1], "validation", step_windows * cfg.eval_steps * with_val,
         f"an evaluation of --eval_steps {cfg.eval_steps} steps of {tokens}", f"lower "
         f"--eval_steps or --total_batch_size, or use more data ({more})")]:
        if (held := max(0, stream.num_tokens - 1) // T) < windows:  # DataLoader's windows
            raise RunError(f"the {name} data holds {stream.num_tokens:,} tokens, {held:,} windows "
                           f"of {T} + 1, but {need} needs {windows:,}: {fix}")


def checkpoint_paths(log_dir):
    """log_dir's ckpt_<step>.pt files, newest first."""
    found = [(int(m.group(1)), os.path.join(log_dir, p.name))  # a "[lr3]" folder too
             for p in Path(log_dir).glob("ckpt_*.pt")
             if (m := re.fullmatch(r"ckpt_(\d+)\.pt", p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def read_checkpoint(path, flag="--resume"):
    """Ours, checked; model_config keeps GPTConfig's fields (older files held flags there too)."""
    if not os.path.isfile(path):
        raise RunError(missing_checkpoint(path, flag))
    not_ours, give = f"{flag} {path} is not a checkpoint", "give a ckpt_<step>.pt from a --log_dir"
    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":  # torch.save writes zip files
            raise RunError(f"{not_ours} (not a file torch.save wrote): {give}")
    checksum = Path(f"{path}.sha256")
    if checksum.exists() and checksum.read_text().strip() != file_sha256(path):
        raise RunError(f"checkpoint {path} is corrupt (its sha256 differs from {checksum}): "
                       "resume from an older checkpoint")
    try:  # on the CPU: the GPU may lack room beside the model
        checkpoint = Run.load_checkpoint(path)
    except Exception as error:  # a cut or foreign file fails in many ways
        fix = "resume from an older checkpoint" if flag == "--resume" else "give another checkpoint"
        raise RunError(f"cannot read checkpoint {path} ({str(error).splitlines()[0]}): {fix}") \
            from None
    if not isinstance(checkpoint, dict) or not CHECKPOINT_KEYS <= checkpoint.keys():
        holds = (f"keys {', '.join(map(str, checkpoint))}" if isinstance(checkpoint, dict)
                 else type(checkpoint).__name__)
        raise RunError(f"{not_ours} of train_gpt2.py (it holds {holds}): {give}")
    saved, known = checkpoint["model_config"], GPTConfig.__dataclass_fields__
    if unknown := [name for name in saved if name not in known | TrainConfig.__dataclass_fields__]:
        raise RunError(f"{path} holds model field(s) {', '.join(unknown)} that GPTConfig lacks: "
                       "add them to GPTConfig, or use the code that wrote it")
    return {**checkpoint, "path": path,
            "model_config": {k: v for k, v in saved.items() if k in known}}


def missing_checkpoint(path, flag) -> str:
    """What to say of a --resume or --init_from that is no file: the checkpoints there."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    held = ", ".join(os.path.basename(found) for found in checkpoint_paths(folder))
    models = f"{', '.join(MODEL_SHAPES)} or " if flag == "--init_from" else ""
    fix = (f"use --resume auto --log_dir {path}" if flag == "--resume" and folder == path else
           f"{folder} holds {held}" if held else f"give {models}a ckpt_<step>.pt from a --log_dir")
    return f"{flag} {path} {'is a folder' if folder == path else 'does not exist'}: {fix}"


CHECKPOINT_KEYS = {"model", "model_config", "optimizer", "scaler", "step", "config", "rng"}


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:  # by hand: hashlib.file_digest needs Python 3.11
        while chunk := f.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def load_openai_weights(name):
    """OpenAI's weights: transformers' cache, else the Hugging Face hub."""
    load = import_transformers(f"--init_from {name}").GPT2LMHeadModel.from_pretrained
    from huggingface_hub.constants import ENDPOINT
    with contextlib.suppress(OSError):  # offline, the hub retries for 30 s
        return state_from_openai(load(name, local_files_only=True).state_dict())
    try:
        url = urllib.parse.urlsplit(ENDPOINT)
        socket.create_connection((url.hostname, url.port or 443), timeout=10).close()
        return state_from_openai(load(name).state_dict())
    except OSError as error:
        raise RunError(f"cannot download {name} from {ENDPOINT} ({str(error).splitlines()[0]}): "
                       "connect to the network, or give a checkpoint") from None


def import_transformers(flag):
    import logging
    logging.disable(logging.WARNING)
    try:
        import transformers
        import transformers.models.gpt2.modeling_gpt2  # here, quietly
        transformers.utils.logging.disable_progress_bar()
        return transformers
    except ImportError:
        raise RunError(f"{flag} needs the transformers library: pip install transformers") \
            from None
    finally:
        logging.disable(logging.NOTSET)


def state_from_openai(hf_state: dict):
    return {name: tensor.t() if name.endswith(OPENAI_TRANSPOSED) else tensor
            for name, tensor in hf_state.items()
            if not name.endswith((".attn.bias", ".attn.masked_bias"))}  # old versions' masks

# OpenAI's Conv1D weights, (in, out): nn.Linear wants (out, in)
OPENAI_TRANSPOSED = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


def check_weights_fit(weights: dict, model_config: GPTConfig, source, flag):
    with torch.device("meta"):  # shapes alone
        wanted = {name: tuple(t.shape) for name, t in GPT(model_config).state_dict().items()}
    given = {name: tuple(t.shape) for name, t in weights.items()}
    problems = ([f"missing {name}" for name in wanted if name not in given]
                + [f"unexpected {name}" for name in given if name not in wanted]
                + [f"{name} is {given[name]}, the model's is {wanted[name]}" for name in wanted
                   if name in given and given[name] != wanted[name]])
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise RunError(f"{flag} {source} does not fit this model ({'; '.join(problems[:3])}"
                       f"{more}): the model's code changed since it was saved; start a new "
                       "run, or use the code that wrote it")


def changed(saved: dict, now, names) -> dict:
    """{name: (its saved value, now's)} for each of names whose values differ."""
    return {name: (saved.get(name), getattr(now, name)) for name in names
            if saved.get(name) != getattr(now, name)}


def check_resumable(checkpoint: dict, cfg, model_config: GPTConfig):
    path = checkpoint["path"]
    saved = vars(GPTConfig(**{**checkpoint["model_config"], "dropout": cfg.dropout}))
    check_vocabulary(checkpoint, "--resume", path)  # shuffled, the order is over windows of T:
    differing = {**changed(saved, model_config, saved), **changed(checkpoint["config"], cfg, (
        "total_batch_size", "shuffle", "seed", *["seq_len"] * cfg.shuffle))}
    if differing:
        changes = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in differing.items())
        raise RunError(f"cannot resume from {path}: {changes} (they define its weights, schedule "
                       "and data position): use its values")
    if (trained_with := checkpoint["config"]["optimizer"]) != cfg.optimizer:
        raise RunError(f"cannot resume from {path} with --optimizer {cfg.optimizer}: it holds "
                       f"{trained_with}'s state; resume with --optimizer {trained_with}, or start "
                       f"a new run from its weights with --init_from {path}")
    check_weights_fit(checkpoint["model"], model_config, path, "--resume")


def check_vocabulary(checkpoint: dict, flag, path):
    """A checkpoint's (OpenAI's: {}) embedding rows are made for its tokenizer's ids."""
    if (saved := checkpoint.get("n_vocab", GPT2_TOKENS)) != (n_vocab := tokenizer().n_vocab):
        raise RunError(f"{flag} {path} was trained with a tokenizer of {saved:,} tokens, not this "
                       f"one's {n_vocab:,}: use its tokenizer, or train a new model")


def download(url, path, fix):
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_atomically(path, lambda temporary: Path(temporary).write_bytes(data),
                         then="run the same command again")
    except OSError as error:
        raise UnavailableError(f"could not download {url} to {path} ({error}): {fix}") from None


def write_atomically(path, write, then=RESUME_AUTO):
    """write(temporary), a file or a folder, then rename it to path: never a half-written file."""
    temporary = f"{os.path.normpath(path)}.{os.uname().nodename}-{os.getpid()}.tmp"
    try:
        with failed_write_is_one_line(path, then):
            write(temporary)
            if os.path.isfile(temporary):
                with open(temporary, "rb+") as f:  # a crash after the rename leaves no empty file
                    os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        Path(temporary).unlink(missing_ok=True)
        raise
    os.replace(temporary, path)


@contextlib.contextmanager
def failed_write_is_one_line(path, then=RESUME_AUTO):
    try:
        yield
    except (OSError, RuntimeError) as error:  # torch.save's RuntimeError wraps the OSError
        cause = error
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise RunError(f"cannot write {path} ({cause.strerror or cause}): make room in "
                       f"{os.path.dirname(path) or '.'}, then {then}") from None


class CheckedTokenStream(TokenStream):
    """An id beyond the tokenizer's (another tokenizer's shard) is clipped and kept as .problem:
    the run stops at the step's end, on every rank, naming the shard."""

    def __init__(self, arrays, vocab):
        super().__init__(arrays)
        self.names = [getattr(array, "filename", None) or "the text" for array in arrays]
        self.problem, self.vocab = None, vocab

    def read(self, start, count):
        tokens, n_vocab = super().read(start, count), self.vocab.n_vocab
        if tokens.max() >= n_vocab:
            at = int(np.argmax(tokens >= n_vocab))
            self.problem = self.problem or (
                f"{self.names[self.array_at(start + at)]} holds token id {tokens[at]}, beyond "
                f"the {n_vocab} tokens of {self.vocab.name} (made with another tokenizer?): "
                "remake the shards with fineweb.py")
            np.minimum(tokens, n_vocab - 1, out=tokens)
        return tokens


TINY_SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                        "tinyshakespeare/input.txt")
HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_CACHE = os.path.expanduser("~/.cache/train_gpt2/hellaswag_val.jsonl")


def remove_killed_writes(log_dir):
    """A write killed part way leaves its temporary file (1.5 GB at 124M)."""
    for temporary in Path(log_dir).glob("ckpt_*.pt*.tmp"):
        os.remove(temporary)


# ------------------------------ checkpoints
def save_checkpoint(path, state, keep):
    """The checkpoint and its sha256 (torch.load misses a flipped byte); keeps `keep`."""
    def save(temporary):  # to a file: given a path, torch.save hides a full disk's OSError
        with open(temporary, "wb") as f:
            torch.save(state, f)
    write_atomically(path, save)
    write_atomically(f"{path}.sha256",
                     lambda temporary: Path(temporary).write_text(f"{file_sha256(path)}\n"))
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    os.fsync(directory)  # make the renames themselves durable
    os.close(directory)
    for old in checkpoint_paths(os.path.dirname(path))[keep:] if keep else []:
        for stale in glob.glob(glob.escape(old) + "*"):  # with its .sha256
            os.remove(stale)


# ------------------------------ when a run stops early
def interrupted_line(cfg):
    if cfg is None or cfg.export_hf or cfg.generate or cfg.eval_only:  # nothing to save
        return "stopped by Ctrl-C"
    saved = checkpoint_paths(cfg.log_dir)
    lost = (f"the steps after {saved[0]} are lost; to go on from it, {RESUME_AUTO}" if saved
            else "no checkpoint was written, its steps are lost")
    return f"stopped at once by a second Ctrl-C: {lost}"


def out_of_memory_message(cfg, device, world_size):
    if cfg.generate:
        return f"out of memory on {device} while generating: lower --num_samples"
    where = f"out of memory on {device} at micro batch {cfg.micro_batch_size} x {cfg.seq_len}"
    smaller = micro_batch_that_divides(cfg, world_size, cfg.micro_batch_size - 1)  # trains the same
    savers = [flag for flag, on in (("--loss_chunk_size 8192", cfg.loss_chunk_size),
                                    ("--recompute", cfg.recompute)) if not on]
    if smaller:
        return (f"{where}: lower --micro_batch_size to {smaller} (a step stays "
                f"{cfg.total_batch_size:,} tokens, in more micro-steps)"
                + (", or add --loss_chunk_size 8192" if not cfg.loss_chunk_size else ""))
    add = f"add {' or '.join(savers)}, " if savers else ""
    return f"{where}: {add}lower --seq_len or pick a smaller --model"


# ------------------------------ other run modes
def generate_samples(cfg, device):
    model = build_model(cfg, *CheckedRun(cfg).initial_weights(), device)
    if not cfg.init_from:
        print("no --init_from: the samples come from untrained weights", flush=True)
    tokenizer, autocast = CheckedRun.tokenizer(), autocast_for(cfg.dtype, device)
    caches, next_token = (compiled_step(model, device) if cfg.compile and cfg.kv_cache
                          else (kv_caches(model, cfg.kv_cache), sample_next))
    started = time.perf_counter()
    generate(model, tokenizer.encode_ordinary(cfg.prompt), GENERATE_WARMUP_TOKENS, caches,
             cfg.num_samples, cfg.temperature, cfg.top_k, cfg.seed, autocast, next_token)
    warm_up_s, started = time.perf_counter() - started, time.perf_counter()
    texts = print_samples(model, tokenizer, cfg, autocast, caches, next_token)
    timed_s, tokens = time.perf_counter() - started, cfg.num_samples * cfg.max_new_tokens
    print(f"{tokens:,} tokens in {timed_s:.2f} s: {tokens / timed_s:,.1f} tokens/s (KV cache "
          f"{'on' if cfg.kv_cache else 'off'}, compile {'on' if cfg.compile else 'off'}, "
          f"{count_parameters(model):,} parameters), after an untimed warm-up of "
          f"{GENERATE_WARMUP_TOKENS} tokens a sample: {warm_up_s:.2f} s", flush=True)
    return texts

GENERATE_WARMUP_TOKENS = 3  # --generate's untimed first call


def compiled_step(model: GPT, device) -> tuple:
    """(caches, next_token) for generate(): sample_next compiled once, whole (or else eager)."""
    if model not in COMPILED_STEPS:
        compiled = torch.compile(sample_next, fullgraph=True,
                                 mode="reduce-overhead" if device.startswith("cuda") else None)

        def next_token(model, idx, caches, *args):  # args: positions, noise, temperature, n_vocab
            nonlocal compiled
            for cache in caches:  # the graph reads them in place
                for tensor in (cache.keys, cache.values, cache.tokens):
                    torch._dynamo.mark_static_address(tensor, guard=False)
            try:  # on a copy: the graph's next run overwrites its last output
                return compiled(model, idx.clone(), caches, *args)
            except (torch._dynamo.exc.TorchDynamoException,  # raised tracing: nothing has run
                    torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode) as error:
                print("--compile: sample_next cannot be compiled whole "  # a branch on data (MoE)
                      f"({str(error).splitlines()[0]}): generating eagerly", flush=True)
                compiled = sample_next
                return sample_next(model, idx, caches, *args)
        COMPILED_STEPS[model] = (kv_caches(model), next_token)
    return COMPILED_STEPS[model]

COMPILED_STEPS = weakref.WeakKeyDictionary()  # (caches, next_token) a model


def evaluate_only(cfg, launch, device):
    """Val loss and HellaSwag accuracy (if its file can be had)."""
    run = CheckedRun(cfg, launch)

    def read():
        streams = run.token_streams()
        check_token_counts(streams, cfg, with_val=True)
        model = build_model(cfg, *run.initial_weights(), device)
        try:
            return streams[1], model, run.hellaswag(), None
        except UnavailableError as error:
            return streams[1], model, None, f"HellaSwag skipped: {error}"
    val_tokens, model, hellaswag, missing = on_every_rank(launch, read)
    missing = next(filter(None, gather(missing, launch)), None)  # all skip it, or none
    autocast, accum = autocast_for(cfg.dtype, device), grad_accum_steps(cfg, launch.world_size)
    result = {"val_loss": estimate_val_loss(model, validation_loader(val_tokens, cfg, launch),
                                            cfg.eval_steps, accum, device, autocast, launch)}
    stop_or_fail_together(False, [val_tokens], launch)  # stops on bad tokens
    if missing is None:
        result.update(evaluate_hellaswag(model, hellaswag, device, autocast, launch))
    if launch.rank == 0:
        print(f"val loss {result['val_loss']:.4f} over {cfg.eval_steps} x "
              f"{cfg.total_batch_size:,} tokens | " + (missing or f"HellaSwag acc_norm "
              f"{result['hellaswag_acc_norm']:.4f} (acc {result['hellaswag_acc']:.4f}) over "
              f"{result['hellaswag_examples']:,} examples"), flush=True)
    return result


def export_hf(cfg):
    """--init_from's weights and the tokenizer as a transformers folder."""
    transformers = import_transformers("--export_hf")
    try:
        import blobfile  # noqa: F401 (the tokenizer's converter uses it)
    except ImportError:
        raise RunError("--export_hf needs blobfile to convert the tokenizer: pip install "
                       "blobfile") from None
    from safetensors import SafetensorError
    from transformers.integrations.tiktoken import convert_tiktoken_to_fast
    (model_config, state), vocab = CheckedRun(cfg).initial_weights(), CheckedRun.tokenizer()
    # no tokenizer decodes the padding rows; its other defaults are ours: tanh GELU, eps 1e-5, tied
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab.n_vocab, n_positions=model_config.block_size, n_embd=model_config.n_embd,
        n_layer=model_config.n_layer, n_head=model_config.n_head, resid_pdrop=model_config.dropout,
        embd_pdrop=model_config.dropout, attn_pdrop=model_config.dropout,
        bos_token_id=vocab.eot_token, eos_token_id=vocab.eot_token))
    ours = {name: (tensor.t() if name.endswith(OPENAI_TRANSPOSED) else tensor[:vocab.n_vocab]
                   if name in ("transformer.wte.weight", "lm_head.weight") else tensor).contiguous()
            for name, tensor in state.items()}  # transformers' layout, without the padding rows
    gpt2 = hf_model.state_dict()
    for name in {**ours, **gpt2}:  # a hacked model's (a smaller vocabulary's too) onto GPT-2's
        shapes = [tuple(s[name].shape) if name in s else "absent" for s in (ours, gpt2)]
        if shapes[0] != shapes[1]:
            raise RunError(f"cannot export {cfg.init_from} as GPT-2: its {name} is "
                           f"{shapes[0]}, GPT-2's is {shapes[1]}")
    hf_model.load_state_dict(ours)

    def write(folder):
        try:
            hf_model.save_pretrained(folder)
        except SafetensorError as error:  # not an OSError
            if "I/O error: " not in str(error):
                raise
            raise OSError(str(error).partition("I/O error: ")[2]) from None
        for path in Path(folder).glob("*.safetensors"):  # a tempfile's 0600, not
            shutil.copymode(os.path.join(folder, "config.json"), path)  # the umask's as the rest
        convert_tiktoken_to_fast(vocab, folder)
        end = vocab.decode([vocab.eot_token])  # <|endoftext|>; model_max_length: truncation's
        Path(folder, "tokenizer_config.json").write_text(json.dumps(
            {"model_max_length": model_config.block_size, "bos_token": end, "eos_token": end}))
        check_export(transformers, folder, model_config, state)
    write_atomically(cfg.export_hf, write, then="run the same command again")
    print(f"wrote {cfg.init_from} to {cfg.export_hf}: load it with AutoTokenizer.from_pretrained"
          f"({cfg.export_hf!r}) and GPT2LMHeadModel.from_pretrained({cfg.export_hf!r})", flush=True)
    return cfg.export_hf


def check_export(transformers, folder, model_config: GPTConfig, state):
    """The exported model must give our logits (a hacked one would not), and name our
    <|endoftext|> in its config and its tokenizer."""
    exported, vocab = transformers.GPT2LMHeadModel.from_pretrained(folder), tokenizer()
    named = (exported.config.bos_token_id, exported.config.eos_token_id,
             transformers.AutoTokenizer.from_pretrained(folder).eos_token_id)
    assert named == (vocab.eot_token,) * 3, f"the export names {named}, not {vocab.eot_token}"
    ours = GPT(model_config)
    ours.load_state_dict(state)
    tokens = torch.randint(0, vocab.n_vocab, (2, min(64, model_config.block_size)),
                           generator=torch.Generator().manual_seed(0))
    tokens[:, 3::8] = vocab.eot_token  # text of several documents: a document mask must show
    with torch.no_grad():
        expected = ours.eval()(tokens)[0][..., :vocab.n_vocab]
        difference = (exported.eval()(tokens).logits - expected).abs().max().item()
    if difference > 1e-4 * max(1.0, expected.abs().max().item()):
        raise RunError(f"the exported model's logits differ from ours by up to "
                       f"{difference:.3g}: the model no longer matches GPT-2's architecture in "
                       "transformers, so it cannot be exported as GPT-2")


if __name__ == "__main__":
    try:
        config, parse_problem = parse_args(sys.argv[1:]), None
    except RunError as error:  # the other ranks hear of it
        config, parse_problem = None, error
    main(config, problem=parse_problem)
