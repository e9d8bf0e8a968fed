"""Pretrain GPT-2 from scratch in plain PyTorch, on one device or many.

    python train_gpt2.py                                       # one device (CUDA, MPS or CPU)
    torchrun --standalone --nproc_per_node=8 train_gpt2.py     # one machine, 8 processes

The file reads top to bottom in the order data flows: config, model, data, distributed setup,
optimizer and schedule, evaluation, weights to start from, checkpoints, run setup, logging, the
training loop, other run modes (--generate, --eval_only, --export_hf), main.
`python train_gpt2.py --help` lists every flag.
"""

import argparse
import contextlib
import dataclasses
import datetime
import glob
import hashlib
import json
import math
import os
import random
import re
import signal
import statistics
import sys
import time
import typing
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

PROJECT_ROOT = os.path.dirname(os.path.abspath(__file__))
TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
GPT2_VOCAB_SIZE = 50257
END_OF_TEXT = 50256  # GPT-2's <|endoftext|>: it separates documents, and an empty prompt starts from it
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
UNTIMED_STEPS = 3  # a run's first steps (compilation, allocator warm-up), left out of its speed summary and profile

# (n_layer, n_head, n_embd) of the four published GPT-2 models
MODEL_SHAPES = {
    "gpt2": (12, 12, 768),  # 124M
    "gpt2-medium": (24, 16, 1024),  # 350M
    "gpt2-large": (36, 20, 1280),  # 774M
    "gpt2-xl": (48, 25, 1600),  # 1558M
}


class ConfigError(Exception):
    """A user mistake (or a run its settings made diverge): main() prints its message as one line and exits
    with status 2."""


# ----------------------------------------------------------------------------- config


@dataclass
class TrainConfig:
    # model shape
    model: str = field(default="gpt2", metadata={"help": "GPT-2 shape: " + ", ".join(MODEL_SHAPES)})
    n_layer: int | None = field(default=None, metadata={"help": "transformer blocks (default: from --model)"})
    n_head: int | None = field(default=None, metadata={"help": "attention heads (default: from --model)"})
    n_embd: int | None = field(default=None, metadata={"help": "model width (default: from --model)"})
    block_size: int = field(default=1024, metadata={"help": "longest context the model accepts (learned positions)"})
    vocab_size: int = field(
        default=50304, metadata={"help": "embedding rows: GPT-2's 50257 tokens padded to a multiple of 128 for speed"}
    )
    # data
    data_dir: str = field(
        default="", metadata={"help": "folder of uint16 .npy shards (*_train_*, *_val_*); empty: train on --text_file"}
    )
    text_file: str = field(
        default=os.path.join(PROJECT_ROOT, "input.txt"),
        metadata={"help": "text to train on when --data_dir is empty, split 90/10 into train/val"},
    )
    text_url: str = field(
        default=TINY_SHAKESPEARE_URL, metadata={"help": "where to download --text_file from when it is missing"}
    )
    shuffle: bool | None = field(
        default=None,
        metadata={"help": "visit the training windows in a new seeded order each epoch (default: on with --data_dir, "
                  "off for --text_file)"},
    )
    # batch: 2**19 = 524,288 tokens a step, about GPT-3 small's 0.5M
    total_batch_size: int = field(default=2**19, metadata={"help": "tokens per optimizer step, over all processes"})
    micro_batch_size: int = field(default=64, metadata={"help": "sequences per forward/backward pass per process"})
    seq_len: int = field(default=1024, metadata={"help": "tokens per training sequence (at most --block_size)"})
    # optimizer and schedule (GPT-3 small's recipe, as in build-nanogpt)
    max_lr: float = field(default=6e-4, metadata={"help": "peak learning rate, reached at the end of warmup"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final learning rate as a fraction of --max_lr"})
    warmup_steps: int = field(default=715, metadata={"help": "linear warmup steps (375M tokens at 2**19 a step)"})
    max_steps: int = field(default=19073, metadata={"help": "optimizer steps; 19073 x 2**19 tokens is 10B tokens"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay on 2-D tensors only"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    eps: float = field(default=1e-8, metadata={"help": "AdamW epsilon"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this; 0 disables"})
    # runtime
    device: str = field(default="auto", metadata={"help": "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps"})
    dtype: str = field(
        default="auto",
        metadata={"help": "autocast dtype: auto (bfloat16 on CUDA that has it, else float16 with a "
                  "GradScaler; float32 on MPS and CPU), float32, bfloat16 or float16"},
    )
    compile: bool | None = field(default=None, metadata={"help": "torch.compile the model (default: on for CUDA only)"})
    compile_mode: str = field(
        default="default",
        metadata={"help": "torch.compile's mode: default, reduce-overhead (replays each step's kernels as CUDA "
                  "graphs), max-autotune (also benchmarks matmul kernels: minutes more compiling) or "
                  "max-autotune-no-cudagraphs"},
    )
    fp8: bool = field(
        default=False,
        metadata={"help": "train the blocks' linear layers in float8 through torchao (pip install torchao); needs an "
                  "NVIDIA GPU of compute capability 8.9+ (Ada, Hopper)"},
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata={"help": "compute the loss over slices of this many tokens, so the full float32 logits never exist; "
                  "0: plain loss over full logits (default: 0 with --compile, which fuses it, else 8192)"},
    )
    recompute: bool = field(
        default=False,
        metadata={"help": "keep only each block's input from the forward pass and recompute the rest of its "
                  "activations during backward (activation checkpointing): one more forward of the blocks (a "
                  "quarter more compute at 124M) for most of the activation memory, so a larger "
                  "--micro_batch_size or model fits"},
    )
    shard_optimizer: bool = field(
        default=False,
        metadata={"help": "under torchrun, each process keeps AdamW's moments for its share of the weights only and "
                  "updates that share, then sends it to the others (ZeRO stage 1): 8 bytes a parameter become "
                  "8 / processes, for a larger model on smaller GPUs; the same training; one process: nothing to "
                  "shard"},
    )
    seed: int = field(default=1337, metadata={"help": "seed for initialisation, shuffling and sampling"})
    peak_tflops: float = field(
        default=989.0,
        metadata={"help": "peak TFLOP/s of one device, for MFU (a step's FLOPs over the peaks of all its processes' "
                  "devices): 989 is the H100 SXM dense bf16 datasheet figure"},
    )
    profile_steps: int = field(
        default=0,
        metadata={"help": "profile N steps with torch.profiler after 3 warm-up steps and 1 for the profiler: "
                  "prints the operators that took the most time and writes <log_dir>/profile_trace.json.gz "
                  "(open it in ui.perfetto.dev); those steps are left out of the summary; 0: off"},
    )
    # where the weights come from, and what to do with them
    init_from: str = field(
        default="", metadata={"help": "start from gpt2, gpt2-medium, gpt2-large or gpt2-xl (OpenAI's weights, "
                              "through transformers) or a checkpoint path; its shape replaces the shape flags. "
                              "Training from it fine-tunes: a fresh optimizer, step 0 (--resume continues a run)"}
    )
    eval_only: bool = field(default=False, metadata={"help": "print the val loss and HellaSwag accuracy, then exit"})
    generate: bool = field(default=False, metadata={"help": "print --num_samples continuations of --prompt, then exit"})
    kv_cache: bool = field(default=True, metadata={"help": "generate with a key/value cache (same tokens, faster)"})
    export_hf: str = field(
        default="", metadata={"help": "write --init_from's weights to this folder as a transformers GPT-2 model "
                              "(GPT2LMHeadModel.from_pretrained reads it), then exit"}
    )
    # evaluation and logging
    eval_every: int = field(default=250, metadata={"help": "validation loss every N steps and at the end; 0: never"})
    eval_steps: int = field(
        default=20, metadata={"help": "validation steps of --total_batch_size tokens per evaluation (10M tokens)"}
    )
    sample_every: int = field(default=250, metadata={"help": "print samples every N steps and at the end; 0: never"})
    num_samples: int = field(default=4, metadata={"help": "continuations of --prompt per sampling"})
    max_new_tokens: int = field(default=32, metadata={"help": "tokens per sample"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_k: int = field(default=50, metadata={"help": "sample among the k most likely tokens"})
    prompt: str = field(default="Hello, I'm a language model,", metadata={"help": "text the samples continue"})
    hellaswag_every: int = field(
        default=0, metadata={"help": "HellaSwag validation accuracy (10,042 examples) every N steps and at the end; "
                             "0: never"}
    )
    hellaswag_path: str = field(
        default="", metadata={"help": "hellaswag_val.jsonl; empty: download it once to ~/.cache/train_gpt2/"}
    )
    log_dir: str = field(default="log", metadata={"help": "folder for metrics.jsonl and checkpoints"})
    # checkpoints
    ckpt_every: int = field(
        default=1000,
        metadata={"help": "write <log_dir>/ckpt_<step>.pt every N steps and at the end; 0: only at the end"},
    )
    keep_ckpts: int = field(default=2, metadata={"help": "keep the N newest checkpoints; 0 keeps all"})
    stop_after_steps: int = field(
        default=0,
        metadata={"help": "end this run with a checkpoint after N steps, for jobs with a time limit; the schedule "
                  "still runs to --max_steps; 0: train to --max_steps"},
    )
    resume: str = field(
        default="",
        metadata={"help": "a checkpoint to continue from, or 'auto' for the newest readable one in --log_dir"},
    )



class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints its usage and exits on a bad flag; we raise the one-line ConfigError instead."""

    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


def parse_args(argv: list[str]) -> TrainConfig:
    """Build the command line from TrainConfig's fields: every field is a --flag with its help."""
    parser = _OneLineErrorParser(
        description="Pretrain GPT-2. Defaults are the GPT-2 124M recipe on GPUs; see README.md for a CPU run.",
    )
    for config_field in dataclasses.fields(TrainConfig):
        flag, help_text = f"--{config_field.name}", config_field.metadata["help"]
        if "(default" not in help_text:
            help_text += f" (default: {config_field.default})"
        if config_field.type in (bool, bool | None):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=config_field.default,
                                help=help_text)
        else:
            value_type = [t for t in typing.get_args(config_field.type) if t is not type(None)] or [config_field.type]
            parser.add_argument(flag, type=value_type[0], default=config_field.default, help=help_text)
    return TrainConfig(**vars(parser.parse_args(argv)))


def model_shape(cfg: TrainConfig) -> tuple[int, int, int]:
    """(n_layer, n_head, n_embd): the --model preset, with any explicit shape flag taking precedence."""
    n_layer, n_head, n_embd = MODEL_SHAPES[cfg.model]
    return (cfg.n_layer or n_layer, cfg.n_head or n_head, cfg.n_embd or n_embd)


def steps_to_profile(cfg: TrainConfig) -> int:
    """Steps of a run that --profile_steps spans: the untimed ones, 1 for the profiler to warm up, the profiled ones."""
    return UNTIMED_STEPS + 1 + cfg.profile_steps


def check_config(cfg: TrainConfig, world_size: int) -> None:
    """Catch user mistakes before any heavy work; each ConfigError names the problem and the fix."""
    if cfg.model not in MODEL_SHAPES:
        raise ConfigError(f"unknown --model {cfg.model!r}: choose one of {', '.join(MODEL_SHAPES)}")
    explicit_shape = [n for n in ("n_layer", "n_head", "n_embd") if getattr(cfg, n) is not None]
    positive = ["block_size", "vocab_size", "total_batch_size", "micro_batch_size", "seq_len", "max_steps"]
    for name in positive + explicit_shape:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(cfg, name)}")
    n_layer, n_head, n_embd = model_shape(cfg)
    if n_embd % n_head:
        raise ConfigError(f"--n_embd {n_embd} is not divisible by --n_head {n_head}: pick a width that is")
    if cfg.seq_len > cfg.block_size:
        raise ConfigError(
            f"--seq_len {cfg.seq_len} is longer than --block_size {cfg.block_size}: "
            "lower --seq_len or raise --block_size"
        )
    if cfg.vocab_size < GPT2_VOCAB_SIZE:
        raise ConfigError(
            f"--vocab_size {cfg.vocab_size} is smaller than the GPT-2 tokenizer's {GPT2_VOCAB_SIZE} tokens: "
            "use at least 50257 (50304 is faster)"
        )
    tokens_per_micro_step = cfg.micro_batch_size * cfg.seq_len * world_size
    if cfg.total_batch_size % tokens_per_micro_step:
        raise ConfigError(
            f"--total_batch_size {cfg.total_batch_size} is not divisible by micro_batch_size x seq_len x processes "
            f"= {cfg.micro_batch_size} x {cfg.seq_len} x {world_size} = {tokens_per_micro_step}: "
            "make --total_batch_size a multiple of it"
        )
    if not 0 <= cfg.warmup_steps <= cfg.max_steps:
        raise ConfigError(
            f"--warmup_steps {cfg.warmup_steps} must be between 0 and --max_steps {cfg.max_steps}: "
            "lower --warmup_steps"
        )
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"unknown --dtype {cfg.dtype!r}: choose auto, float32, bfloat16 or float16")
    if cfg.compile_mode not in COMPILE_MODES:
        raise ConfigError(f"unknown --compile_mode {cfg.compile_mode!r}: choose {', '.join(COMPILE_MODES)}")
    if cfg.eval_every and cfg.eval_steps < 1:
        raise ConfigError(f"--eval_steps must be at least 1 when --eval_every is set, got {cfg.eval_steps}")
    if cfg.loss_chunk_size is not None and cfg.loss_chunk_size < 0:
        raise ConfigError(f"--loss_chunk_size must be 0 or more, got {cfg.loss_chunk_size}")
    if cfg.max_lr <= 0 or not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError(f"--max_lr ({cfg.max_lr}) must be above 0 and --min_lr_ratio ({cfg.min_lr_ratio}) "
                          "between 0 and 1")
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1) or cfg.eps < 0 or cfg.weight_decay < 0:
        raise ConfigError(f"AdamW needs 0 <= --beta1 ({cfg.beta1}), --beta2 ({cfg.beta2}) < 1 and --eps ({cfg.eps}), "
                          f"--weight_decay ({cfg.weight_decay}) of 0 or more")
    if cfg.grad_clip < 0:  # clip_grad_norm_ would scale the gradients by a negative factor: training uphill
        raise ConfigError(f"--grad_clip must be 0 (off) or more, got {cfg.grad_clip}")
    if cfg.peak_tflops <= 0:
        raise ConfigError(f"--peak_tflops must be above 0 (the device's peak, for MFU), got {cfg.peak_tflops}")
    intervals = ["eval_every", "sample_every", "hellaswag_every", "ckpt_every", "keep_ckpts", "stop_after_steps",
                 "profile_steps"]
    negative = [f"--{name} {getattr(cfg, name)}" for name in intervals if getattr(cfg, name) < 0]
    if negative:
        raise ConfigError(f"{', '.join(negative)}: must be 0 (off) or more")
    if cfg.num_samples < 1 or cfg.max_new_tokens < 0:
        raise ConfigError(f"--num_samples ({cfg.num_samples}) must be at least 1 and --max_new_tokens "
                          f"({cfg.max_new_tokens}) 0 or more")
    run_steps, step_limit = ((cfg.stop_after_steps, "--stop_after_steps") if 0 < cfg.stop_after_steps < cfg.max_steps
                             else (cfg.max_steps, "--max_steps"))
    if cfg.profile_steps and run_steps < steps_to_profile(cfg):
        raise ConfigError(f"--profile_steps {cfg.profile_steps} needs {steps_to_profile(cfg)} steps ({UNTIMED_STEPS} "
                          f"warm-up, 1 for the profiler): raise {step_limit} to {steps_to_profile(cfg)}")
    if cfg.top_k < 1 or cfg.temperature <= 0:
        raise ConfigError(f"--top_k ({cfg.top_k}) must be at least 1 and --temperature ({cfg.temperature}) above 0")
    if cfg.init_from and cfg.init_from not in MODEL_SHAPES and not os.path.isfile(cfg.init_from):
        raise ConfigError(f"--init_from {cfg.init_from} is neither {', '.join(MODEL_SHAPES)} nor a checkpoint file")
    if cfg.init_from and explicit_shape:
        flags = " ".join(f"--{n}" for n in explicit_shape)
        raise ConfigError(f"--init_from {cfg.init_from} sets the model's shape: drop {flags}")
    if cfg.generate and (cfg.eval_only or world_size > 1):
        raise ConfigError("--generate runs alone in one process: drop --eval_only, and use python, not torchrun")
    if cfg.export_hf and (not cfg.init_from or cfg.generate or cfg.eval_only or world_size > 1):
        raise ConfigError("--export_hf runs alone in one process and needs --init_from with the checkpoint to "
                          "export: add it, drop --generate and --eval_only, and use python, not torchrun")
    if cfg.hellaswag_path and not os.path.isfile(cfg.hellaswag_path):
        raise ConfigError(f"--hellaswag_path {cfg.hellaswag_path} does not exist: give hellaswag_val.jsonl's path")
    if cfg.generate or cfg.export_hf:
        return  # needs no data
    if cfg.data_dir:
        for split in ("train", "val"):
            find_shards(cfg.data_dir, split)
    elif not os.path.exists(cfg.text_file) and not cfg.text_url:
        raise ConfigError(f"--text_file {cfg.text_file} does not exist and --text_url is empty: give a text file")


# ----------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int = 1024
    vocab_size: int = 50304


class KVCache:
    """Keys and values of the tokens seen so far, for generation: each new token then costs one position.

    layers[i] is layer i's (k, v), each (B, n_head, length, head_dim), or None before the first call.
    """

    def __init__(self, n_layer: int):
        self.layers = [None] * n_layer

    @property
    def length(self) -> int:
        return 0 if self.layers[0] is None else self.layers[0][0].size(2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key, value in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, cache: KVCache | None = None, layer: int = 0):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            if cache.layers[layer] is not None:
                if T != 1:
                    raise ValueError("a filled KV cache takes one new token at a time")
                k, v = (torch.cat([past, new], dim=2) for past, new in zip(cache.layers[layer], (k, v)))
            cache.layers[layer] = (k, v)
        # T new queries over all keys: causal among themselves; a single new token sees every key
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, cache: KVCache | None = None, layer: int = 0):
        x = x + self.attn(self.ln_1(x), cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 as published; module names follow OpenAI's checkpoint so its weights map one to one."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input and output embeddings
        # tokens per slice of the training loss; 0: the plain loss over full logits (torch.compile fuses that
        # one into something better; without compile the chunked one saves memory)
        self.loss_chunk_size = 0
        self.recompute_blocks = False  # --recompute
        self.reset_parameters()

    def reset_parameters(self):
        # GPT-2 paper: scale residual projections by 1/sqrt(N), N = 2 residual adds per block
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if name.endswith("c_proj") else 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def hidden_states(self, idx, cache: KVCache | None = None):
        """idx (B, T) token ids, following the cache's tokens if one is given. Returns the final LayerNorm's output
        (B, T, n_embd), which lm_head turns into logits."""
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size {self.config.block_size}")
        positions = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(positions)  # (B, T, n_embd)
        for layer, block in enumerate(self.transformer.h):
            if self.recompute_blocks and cache is None and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)  # saves x alone for backward
            else:
                x = block(x, cache, layer)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, cache: KVCache | None = None):
        """Logits (B, T, vocab_size) for idx (B, T), or the mean loss if targets (B, T) is given."""
        B, T = idx.shape
        x = self.hidden_states(idx, cache)
        if targets is None:
            return self.lm_head(x)  # (B, T, vocab_size)
        if self.loss_chunk_size:
            return chunked_cross_entropy(x.view(B * T, -1), self.lm_head.weight, targets.view(-1),
                                         self.loss_chunk_size)
        logits = self.lm_head(x)  # (B, T, vocab_size)
        return F.cross_entropy(logits.float().view(B * T, -1), targets.view(-1))


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits = hidden @ weight.T, one slice of rows at a time.

    Only one (chunk_size, vocab) slice of logits exists at once: at 64 x 1024 tokens the float32 logits of a
    whole micro-batch would take 12.3 GiB (13.2 GB). The loss ends the graph, so each slice's gradients are computed
    right away and backward only scales them by its incoming gradient: nothing is recomputed.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size: int, matmul_dtype: torch.dtype):
        # hidden (N, C), weight (V, C), targets (N,)
        wants_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        num_rows = hidden.size(0)
        matmul_weight = weight.to(matmul_dtype)
        loss_sum = torch.zeros((), device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if wants_grad else None
        grad_weight = torch.zeros(weight.shape, device=weight.device) if wants_grad else None  # float32 sum
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            chunk_hidden = hidden[rows].to(matmul_dtype)
            logits = (chunk_hidden @ matmul_weight.t()).float()  # (chunk, V): the only logits held
            chunk_targets = targets[rows]
            target_logits = logits.gather(1, chunk_targets[:, None])  # (chunk, 1)
            # log-sum-exp in place over the logits (torch.logsumexp would make a second (chunk, V) float32 tensor)
            row_max = logits.amax(dim=-1, keepdim=True)
            exp_shifted = logits.sub_(row_max).exp_()  # exp(logits - max), the logits are gone from here on
            sum_exp = exp_shifted.sum(dim=-1, keepdim=True)
            loss_sum += (row_max + sum_exp.log() - target_logits).sum()
            if wants_grad:
                # d(mean loss)/d(logits) = (softmax - one_hot(target)) / N, in place over the same slice
                grad_logits = exp_shifted.div_(sum_exp)
                grad_logits[torch.arange(len(chunk_targets), device=logits.device), chunk_targets] -= 1.0
                grad_logits = grad_logits.div_(num_rows).to(matmul_dtype)
                grad_hidden[rows] = grad_logits @ matmul_weight
                grad_weight += (grad_logits.t() @ chunk_hidden).float()
        if wants_grad:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss_sum / num_rows

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None, None


def chunked_cross_entropy(hidden, weight, targets, chunk_size: int):
    """ChunkedCrossEntropy with the matmul in autocast's dtype when autocast is on, as lm_head would run."""
    device_type = hidden.device.type
    autocast_on = torch.is_autocast_enabled(device_type)
    matmul_dtype = torch.get_autocast_dtype(device_type) if autocast_on else weight.dtype
    with torch.autocast(device_type, enabled=False):  # the function casts for itself
        return ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_size, matmul_dtype)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields the tied matrix once


def flops_per_token(model_config: GPTConfig, num_params: int, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the matmuls (forward + backward) plus 12 L T C for attention (PaLM, App. B)."""
    return 6 * num_params + 12 * model_config.n_layer * seq_len * model_config.n_embd


def model_flops_utilization(flops_per_step: float, step_ms: float, peak_tflops: float, world_size: int) -> float:
    """The fraction of the devices' peak that a step's model FLOPs used. The step's FLOPs are those of all processes
    together, each on its own device: their peaks add up."""
    return flops_per_step * 1000 / step_ms / (world_size * peak_tflops * 1e12)


# ----------------------------------------------------------------------------- data


def gpt2_tokenizer():
    import tiktoken  # imported here so that importing this file does no work

    try:
        return tiktoken.get_encoding("gpt2")
    except (OSError, ValueError) as error:  # offline with nothing cached (requests' errors are OSErrors); a bad file
        raise ConfigError(f"cannot load the GPT-2 tokenizer ({type(error).__name__}): tiktoken downloads its two "
                          "files once; connect to the network, or set TIKTOKEN_CACHE_DIR to a folder that holds "
                          "them") from None


def write_atomically(path: str, write) -> None:
    """write(temporary_path), flush it to disk, then rename: a reader sees the old file or the whole new one.
    A write that fails (a full disk) takes its partial temporary file with it. The temporary name is this
    process's own: the first rank of each machine may download the same file to shared storage at once."""
    temporary = f"{path}.{os.uname().nodename}-{os.getpid()}.tmp"
    try:
        write(temporary)
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    os.replace(temporary, path)


def download(url: str, path: str, fix: str) -> None:
    """Fetch url into path; the file appears only once it is complete."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            data = response.read()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_atomically(path, lambda temporary: Path(temporary).write_bytes(data))
    except OSError as error:
        raise ConfigError(f"could not download {url} to {path} ({error}): {fix}") from None


def read_text_tokens(path: str) -> np.ndarray:
    """The whole text file as GPT-2 tokens, uint16 (ids fit: the vocabulary has 50257 entries)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else f"not UTF-8: {error.reason} at byte {error.start}"
        raise ConfigError(f"cannot read --text_file {path} ({reason}): give a UTF-8 text file") from None
    return np.array(gpt2_tokenizer().encode_ordinary(text), dtype=np.uint16)


def find_shards(data_dir: str, split: str) -> list[str]:
    if not os.path.isdir(data_dir):
        raise ConfigError(f"--data_dir {data_dir} is not a folder: run fineweb.py to make shards, or fix the path")
    if os.path.exists(os.path.join(data_dir, "INCOMPLETE")):  # fineweb.py's marker, removed once all shards are in
        raise ConfigError(f"--data_dir {data_dir} is incomplete: fineweb.py is still writing it, or was interrupted "
                          "(its INCOMPLETE file is there): wait for it, or rerun fineweb.py with --resume")
    paths = sorted(glob.glob(os.path.join(data_dir, f"*_{split}_*.npy")))
    if not paths:
        raise ConfigError(
            f"no {split} shards (*_{split}_*.npy) in --data_dir {data_dir}: run fineweb.py to make them"
        )
    return paths


def open_shard(path: str) -> np.ndarray:
    """Memory-map one shard: its pages are read when a batch touches them, never the whole file into RAM."""
    try:
        tokens = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read shard {path} ({error}): delete it and rerun fineweb.py") from None
    if tokens.dtype != np.uint16 or tokens.ndim != 1 or len(tokens) < 2:
        raise ConfigError(
            f"shard {path} holds {tokens.dtype} of shape {tokens.shape}, not a 1-D uint16 array of at least "
            "2 tokens: rerun fineweb.py"
        )
    return tokens


class TokenStream:
    """Token arrays (memory-mapped shards, or one in-memory array) read as one sequence."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.starts = np.cumsum([0] + [len(a) for a in arrays])  # starts[i]: first global index of arrays[i]
        self.num_tokens = int(self.starts[-1])

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) as int64, gathered across array boundaries."""
        pieces, end = [], start + count
        index = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < end:
            local = start - self.starts[index]
            piece = self.arrays[index][local : local + end - start]
            pieces.append(piece)
            start += len(piece)
            index += 1
        return np.concatenate(pieces).astype(np.int64)


def load_token_streams(cfg: TrainConfig) -> tuple[TokenStream, TokenStream]:
    """(train, val) streams: the shards in --data_dir, or --text_file split 90/10."""
    if cfg.data_dir:
        return tuple(TokenStream([open_shard(p) for p in find_shards(cfg.data_dir, s)]) for s in ("train", "val"))
    tokens = read_text_tokens(cfg.text_file)
    split = int(0.9 * len(tokens))
    return TokenStream([tokens[:split]]), TokenStream([tokens[split:]])


class DataLoader:
    """(B, T) batches drawn from a stream cut into windows of T + 1 tokens: x = window[:-1], y = window[1:].

    Window k starts at token k*T, so consecutive windows share one token and only the final partial
    window is left out; windows span shard boundaries. The whole position is one integer, the windows
    consumed by all ranks together: each call gives rank r of W the B windows starting at
    position + r*B, and advances the position by W*B. A step of S windows is thus split the same way
    for any W and B, and with shuffle off rank r reads at token offset r*B*T, advancing W*B*T (the
    contiguous layout). When the windows run out a new epoch starts; with shuffle on, each epoch
    visits them in a permutation drawn from (seed, epoch) alone, so every rank agrees without talking.
    """

    def __init__(self, stream: TokenStream, batch_size: int, seq_len: int, rank: int, world_size: int,
                 windows_per_step: int, shuffle: bool, seed: int, name: str, need: str, fix: str):
        self.num_windows = max(0, stream.num_tokens - 1) // seq_len
        if self.num_windows < windows_per_step:  # need, fix: what takes that many windows, and what to change
            raise ConfigError(
                f"the {name} data holds {stream.num_tokens:,} tokens, {self.num_windows:,} windows of {seq_len} + 1, "
                f"but {need} needs {windows_per_step:,}: {fix}"
            )
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.windows_consumed = 0
        self._order_epoch, self._order = None, None

    @property
    def epoch(self) -> int:
        return self.windows_consumed // self.num_windows

    def window_order(self, epoch: int) -> np.ndarray:
        """Window numbers in the order this epoch visits them (8 bytes a window, made once an epoch)."""
        if self._order_epoch != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order_epoch, self._order = epoch, rng.permutation(self.num_windows)
        return self._order

    def window_start(self, window: int) -> int:
        """Token offset of the window-th window consumed since the start of training."""
        epoch, index = divmod(window, self.num_windows)
        return int(self.window_order(epoch)[index] if self.shuffle else index) * self.seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = self.batch_size, self.seq_len
        first = self.windows_consumed + self.rank * B
        windows = np.stack([self.stream.read(self.window_start(w), T + 1) for w in range(first, first + B)])
        self.windows_consumed += self.world_size * B
        windows = torch.from_numpy(windows)  # (B, T + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def to_device(batch: torch.Tensor, device: str) -> torch.Tensor:
    """A host batch on the device. On CUDA it goes through pinned memory, so the copy is queued without waiting:
    a copy from ordinary (pageable) memory first waits for all queued GPU work, a stall every micro-step."""
    if device.startswith("cuda"):
        return batch.pin_memory().to(device, non_blocking=True)
    return batch.to(device)


# ----------------------------------------------------------------------------- distributed setup

# Backstop for a collective whose peer never arrives. Rank 0 alone samples and writes checkpoints
# between collectives (10 s for 124M, minutes for gpt2-xl), so this must exceed the longest such
# pause; a crashed peer is detected in about a second anyway.
DIST_TIMEOUT = datetime.timedelta(minutes=20)

# How long rank 0 waits at startup for every process to report (the others give rank 0 twice this). torchrun starts
# the processes of all machines together, after its own rendezvous, so they report within the seconds that importing
# PyTorch takes; one that has not after minutes crashed before it could (a package missing on its machine), and
# nothing else would tell the others.
STARTUP_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass
class Launch:
    """Where this process sits in the job. A plain `python train_gpt2.py` run is rank 0 of 1."""

    rank: int = 0  # global rank, 0 .. world_size - 1
    local_rank: int = 0  # rank within this machine: picks the GPU
    world_size: int = 1
    torchrun: bool = False  # started by torchrun: a process group is needed, even for one process
    local_world_size: int = 1  # processes on this machine: they share its memory


def launch_from_env(environ) -> Launch:
    """The one place that reads torchrun's variables; everything else receives a Launch."""
    if "RANK" not in environ:
        return Launch()
    return Launch(int(environ["RANK"]), int(environ["LOCAL_RANK"]), int(environ["WORLD_SIZE"]), torchrun=True,
                  local_world_size=int(environ["LOCAL_WORLD_SIZE"]))


def pick_device(requested: str, launch: Launch, gpu_count: int, mps_available: bool) -> str:
    """The device for this process; gpu_count is the machine's CUDA devices (those CUDA_VISIBLE_DEVICES shows)."""
    if requested == "auto":
        requested = "cuda" if gpu_count else "mps" if mps_available else "cpu"
    device_type, _, index = requested.partition(":")
    if device_type not in ("cpu", "cuda", "mps") or (index and (device_type != "cuda" or not index.isdigit())):
        raise ConfigError(f"unknown --device {requested!r}: use auto, cpu, cuda, cuda:N or mps")
    if device_type == "cuda" and not gpu_count or device_type == "mps" and not mps_available:
        raise ConfigError(f"--device {requested} is not available on this machine: use --device auto or cpu")
    if device_type == "cuda" and launch.torchrun and index and launch.world_size > 1:
        raise ConfigError(f"--device {requested} names one GPU for {launch.world_size} processes: use --device cuda")
    if device_type == "cuda" and launch.torchrun and not index:
        if launch.local_world_size > gpu_count:  # the same on every process of the machine: all stop, rank 0 says so
            raise ConfigError(f"{launch.local_world_size} processes on this machine, which has {gpu_count} GPU(s): "
                              f"start one process a GPU (torchrun --nproc_per_node={gpu_count})")
        return f"cuda:{launch.local_rank}"  # one GPU per process
    if index and int(index) >= gpu_count:
        raise ConfigError(f"--device {requested} is not on this machine, which has {gpu_count} GPU(s), cuda:0 to "
                          f"cuda:{gpu_count - 1}: pick one of those")
    return requested


# Flags that name a place on this machine: they may differ between machines (each mounts its data somewhere)
MACHINE_LOCAL_FLAGS = ("data_dir", "text_file", "text_url", "hellaswag_path", "log_dir", "init_from", "resume",
                       "export_hf")


def software_versions() -> dict:
    """What must be the same on every machine besides the flags: PyTorch, and this file (a machine with an older
    checkout computes something else, or fails in a collective that the others never reach)."""
    code_digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    return {"torch": torch.__version__, "train_gpt2.py sha256": code_digest}


def differing_values(rows: list[tuple[int, dict]], prefix: str = "", skip: tuple = ()) -> list[str]:
    """rows: (rank, {name: value}). For each name whose value differs from the first row's: "<prefix><name> <value>
    on rank <first> but <value> on rank <other>"."""
    if not rows:
        return []
    first_rank, first = rows[0]
    differing = []
    for name in [name for name in first if name not in skip]:
        other = next(((rank, values[name]) for rank, values in rows if values[name] != first[name]), None)
        if other:
            differing.append(f"{prefix}{name} {first[name]} on rank {first_rank} but {other[1]} on rank {other[0]}")
    return differing


def first_problem(problems: list[str | None]) -> str | None:
    """problems[r]: rank r's problem, or None. The lowest rank's, naming that rank unless it is rank 0 (who says it)."""
    failed = [(rank, problem) for rank, problem in enumerate(problems) if problem is not None]
    if not failed:
        return None
    rank, problem = failed[0]
    return problem if rank == 0 else f"{problem} (on rank {rank})"


def startup_verdict(posts: list[dict]) -> str:
    """What stops the job before it starts, given each rank's {"problem": str | None, "flags": dict | None,
    "software": software_versions()} (flags None where they did not parse); empty if nothing does. Differing
    software and flags come first: they are the cause of the mistakes one machine makes."""
    software = differing_values([(rank, post["software"]) for rank, post in enumerate(posts)])
    if software:
        return (f"the machines run different software ({', '.join(software)}): install the same PyTorch and "
                "train_gpt2.py on every machine")
    flags = differing_values([(rank, post["flags"]) for rank, post in enumerate(posts) if post["flags"] is not None],
                             "--", MACHINE_LOCAL_FLAGS)
    if flags:
        return (f"the processes were started with different flags ({', '.join(flags)}): start every machine with the "
                "same command")
    return first_problem([post["problem"] for post in posts]) or ""


def rank_ranges(ranks: list[int]) -> str:
    """[1] -> "rank 1"; [3, 8, 9, 10] -> "ranks 3, 8-10"."""
    runs = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    listed = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {listed}"


def wait_for_keys(store: dist.Store, keys: list[str], timeout: datetime.timedelta) -> bool:
    """Whether every key was set within timeout. Polled: store.wait prints the TCPStore's own warnings on a timeout."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def did_not_come_up(missing: list[int], waited: datetime.timedelta) -> str:
    they, hang, their = ("it", "hangs", "its") if len(missing) == 1 else ("they", "hang", "their")
    return (f"{rank_ranges(missing)} did not come up within {waited.total_seconds():.0f} s ({they} crashed or {hang} "
            f"before training): torchrun's output on {their} machine says why")


def exit_on_user_error(error: ConfigError, launch: Launch, leave_process_group: bool = False) -> typing.NoReturn:
    if launch.rank == 0:  # said first: once a peer has exited, torchrun ends this process within a second
        print(f"error: {error}", file=sys.stderr, flush=True)
    if leave_process_group:
        dist.destroy_process_group()
    sys.exit(2)


def exchange_startup_posts(store: dist.Store, launch: Launch, post: dict) -> str:
    """Post this process's startup report; rank 0 posts the verdict on all of them. Returns the verdict."""
    store.set(f"startup/{launch.rank}", json.dumps(post))
    keys = [f"startup/{rank}" for rank in range(launch.world_size)]
    if launch.rank == 0:
        if wait_for_keys(store, keys, STARTUP_TIMEOUT):
            verdict = startup_verdict([json.loads(store.get(key)) for key in keys])
        else:
            verdict = did_not_come_up([rank for rank, key in enumerate(keys) if not store.check([key])],
                                      STARTUP_TIMEOUT)
        store.set("startup/verdict", verdict)
    elif not wait_for_keys(store, ["startup/verdict"], 2 * STARTUP_TIMEOUT):  # rank 0 takes at most one timeout
        raise dist.DistStoreError(f"no word from it in {2 * STARTUP_TIMEOUT.total_seconds():.0f} s")
    return store.get("startup/verdict").decode()


def start_together(launch: Launch, problem: ConfigError | None, cfg: TrainConfig | None) -> dist.Store | None:
    """Stop if this process or, under torchrun, any other found a mistake before the process group exists (cfg is
    None where the flags did not parse). Every process posts its problem, flags and software versions to torchrun's
    key-value store, rank 0 posts the verdict, and all stop with it or go on: a mistake only one machine makes (a
    command typed differently there, fewer GPUs, a crash before reporting) used to stop that machine without a word
    while the others waited 20 minutes for it in init_process_group. Returns the store, to make the process group
    from."""
    if not launch.torchrun:
        if problem:
            exit_on_user_error(problem, launch)
        return None
    post = {"problem": None if problem is None else str(problem),
            "flags": None if cfg is None else dataclasses.asdict(cfg), "software": software_versions()}
    try:  # the store is served by torchrun on rank 0's machine
        store, _, _ = next(dist.rendezvous(f"env://?rank={launch.rank}&world_size={launch.world_size}",
                                           timeout=STARTUP_TIMEOUT))
        verdict = exchange_startup_posts(store, launch, post)
    except dist.DistError as error:  # rank 0 never came up, or its machine's torchrun ended with it
        if launch.local_rank == 0:  # a line on each machine; rank 0's own torchrun reports the crash there
            print(f"error: rank 0 did not come up, or its machine's torchrun ended ({str(error).splitlines()[0]}): "
                  "torchrun's output on that machine says why", file=sys.stderr, flush=True)
        sys.exit(2)
    if verdict:
        exit_on_user_error(ConfigError(verdict), launch)
    store.set_timeout(DIST_TIMEOUT)  # from here on it serves the process group, whose waits may be long
    return store


def init_distributed(launch: Launch, device: str, store: dist.Store | None = None) -> None:
    """Make a CUDA device the current one (pinned memory and NCCL use it: no stray context on GPU 0), then
    under torchrun join the process group, through start_together's store (None: one made from the environment)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    if not launch.torchrun:
        return
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store, rank=launch.rank,
                            world_size=launch.world_size, timeout=DIST_TIMEOUT)


def gather_from_ranks(value, launch: Launch) -> list:
    """[value of rank 0, value of rank 1, ...] on every rank (picklable values)."""
    if not launch.torchrun:
        return [value]
    values = [None] * launch.world_size
    dist.all_gather_object(values, value)
    return values


def on_every_rank(work, launch: Launch):
    """Return work(). A ConfigError it raises on any rank (a file missing on one machine) is raised on every
    rank, so that all stop together and rank 0 tells it once."""
    result, message = None, None
    try:
        result = work()
    except ConfigError as error:
        message = str(error)
    problem = first_problem(gather_from_ranks(message, launch))
    if problem is not None:
        raise ConfigError(problem)
    return result


def all_reduce_mean(value: torch.Tensor, launch: Launch) -> torch.Tensor:
    """Mean over ranks. SUM then divide: gloo's ReduceOp.AVG came late and had a correctness bug."""
    if launch.torchrun:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= launch.world_size
    return value


# Ranks that run out of memory together (the same shapes at the same step) do so within a fraction of a second of
# each other under DDP, which keeps them in step: each waits this long for the others to say so
OUT_OF_MEMORY_GATHER_SECONDS = 2.0


def exit_out_of_memory(message: str, launch: Launch, store: dist.Store | None) -> typing.NoReturn:
    """Stop a rank that ran out of memory, said once for all that did. The others may wait inside a collective,
    where nothing reaches them (torchrun ends them once this one exits), so this cannot gather as on_every_rank
    does: each rank that ran out posts to start_together's store, and the lowest of them says it."""
    ranks = [launch.rank]
    if store is not None:
        store.set(f"out_of_memory/{launch.rank}", "")
        time.sleep(OUT_OF_MEMORY_GATHER_SECONDS)
        ranks = [rank for rank in range(launch.world_size) if store.check([f"out_of_memory/{rank}"])]
    if ranks[0] == launch.rank:
        print(f"error: {message}{f' (on {rank_ranges(ranks)})' if ranks != [0] else ''}", file=sys.stderr, flush=True)
    sys.exit(2)


# ----------------------------------------------------------------------------- optimizer and schedule


def grad_accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """Micro-steps per optimizer step; check_config has made sure this divides exactly."""
    return cfg.total_batch_size // (cfg.micro_batch_size * cfg.seq_len * world_size)


def smaller_micro_batches(cfg: TrainConfig, world_size: int) -> list[int]:
    """The micro batch sizes below --micro_batch_size that still divide a step, largest first (1 always does):
    what a run that runs out of memory can switch to and train exactly the same."""
    return [b for b in range(cfg.micro_batch_size - 1, 0, -1)
            if cfg.total_batch_size % (b * cfg.seq_len * world_size) == 0]


def lower_micro_batch_fix(cfg: TrainConfig, micro_batch: int) -> str:
    """The fix that memory errors name: the same training, in more micro-steps."""
    return (f"lower --micro_batch_size to {micro_batch} (a step stays {cfg.total_batch_size:,} tokens, in more "
            "micro-steps)")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to max_lr (step 0 already takes a non-zero step), cosine decay to min lr at max_steps."""
    min_lr = cfg.max_lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return min_lr
    progress = (step - cfg.warmup_steps) / (cfg.max_steps - cfg.warmup_steps)  # 0 -> 1
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.max_lr - min_lr)


def configure_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool,
                        sharded: bool = False) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices and embeddings (2-D) only, never on biases and LayerNorms. sharded: ZeRO
    stage 1 over the process group; its state_dict (after consolidate_state_dict) is the plain optimizer's."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    options = dict(lr=cfg.max_lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if sharded:  # not fused: a sharded fused AdamW cannot load a checkpoint (its step counts land on the CPU: #124133)
        # imported here: torch.distributed.optim imports FSDP and DTensor, 1.8 s of every start on a 2-core machine
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **options)
    return torch.optim.AdamW(groups, fused=fused, **options)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def estimate_val_loss(model, loader: DataLoader, eval_steps: int, accum_steps: int, device: str, autocast,
                      launch: Launch) -> float:
    """Mean loss over the first eval_steps validation steps, read like training steps (accum_steps micro-batches
    per rank), so every evaluation and every process count sees the same tokens."""
    model.eval()
    loader.windows_consumed = 0
    step_losses = torch.zeros(eval_steps, device=device)
    for step in range(eval_steps):
        for _ in range(accum_steps):
            x, y = (to_device(batch, device) for batch in loader.next_batch())
            with autocast():
                step_losses[step] += model(x, y) / accum_steps
    model.train()
    # each step averaged over ranks exactly as the training loss is, then the mean over steps
    return all_reduce_mean(step_losses, launch).mean().item()


@torch.no_grad()
def generate(model: GPT, prompt_tokens: list[int], num_samples: int, max_new_tokens: int, temperature: float,
             top_k: int, seed: int, device: str, autocast, use_cache: bool = True) -> list[list[int]]:
    """Sample num_samples continuations; a private generator keeps the training RNG untouched and the text seeded.
    An empty prompt samples text from scratch: the context is then <|endoftext|> alone, as in GPT-2's own samples.

    With use_cache, the first call reads the prompt and each later call only the newest token, until the text
    outgrows block_size; from there (and without the cache) each token rereads the last block_size tokens.
    """
    model.eval()
    context = prompt_tokens or [END_OF_TEXT]
    tokens = torch.tensor(context, dtype=torch.long, device=device).repeat(num_samples, 1)  # (num_samples, length)
    generator = torch.Generator(device=device).manual_seed(seed)
    real_vocab = min(model.config.vocab_size, GPT2_VOCAB_SIZE)  # never sample a padding row
    cache = KVCache(model.config.n_layer) if use_cache else None
    for _ in range(max_new_tokens):
        with autocast():
            if cache is not None and tokens.size(1) <= model.config.block_size:
                logits = model(tokens[:, cache.length :], cache=cache)
            else:
                logits = model(tokens[:, -model.config.block_size :])
        logits = logits[:, -1, :real_vocab].float() / temperature  # (num_samples, real_vocab)
        top_logits, top_ids = torch.topk(logits, min(top_k, real_vocab), dim=-1)
        choice = torch.multinomial(F.softmax(top_logits, dim=-1), 1, generator=generator)  # (num_samples, 1)
        tokens = torch.cat([tokens, torch.gather(top_ids, -1, choice)], dim=1)
    model.train()
    return tokens[:, len(context) :].tolist()


HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "train_gpt2", "hellaswag_val.jsonl")


def read_hellaswag(path: str) -> list[dict]:
    """The original jsonl records: a context "ctx", 4 "endings", the right one's index "label"."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            try:
                record = json.loads(line)
                endings = record["endings"]
                valid = (isinstance(record["ctx"], str) and isinstance(endings, list) and len(endings) == 4
                         and all(isinstance(ending, str) for ending in endings) and record["label"] in range(4))
            except (json.JSONDecodeError, KeyError, TypeError):
                valid = False
            if not valid:
                raise ConfigError(f"{path} line {line_number} is not a HellaSwag record (ctx, 4 endings, label 0-3)")
            examples.append(record)
    if not examples:
        raise ConfigError(f"{path} holds no HellaSwag records: give hellaswag_val.jsonl's path")
    return examples


def render_hellaswag(example: dict, tokenizer) -> tuple[torch.Tensor, torch.Tensor, int]:
    """tokens (4, L): the context followed by each ending, zero-padded; mask (4, L): 1 on ending tokens only."""
    context = tokenizer.encode_ordinary(example["ctx"])
    rows = [context + tokenizer.encode_ordinary(" " + ending) for ending in example["endings"]]
    tokens = torch.zeros(4, max(len(row) for row in rows), dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, len(context) : len(row)] = 1
    return tokens, mask, int(example["label"])


def pack_hellaswag(rendered: list[tuple], max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Rendered examples (tokens (4, L), mask (4, L), label) in batches: tokens (4n, L), mask (4n, L), labels (n,),
    zero-padded to the batch's longest, at most max_tokens tokens with the padding unless one example alone is
    longer. Shortest first, so that examples of like length share a batch and little of it is padding."""
    groups = []
    for example in sorted(rendered, key=lambda example: example[0].size(1)):
        # sorted: this example is the longest yet, so the group would be padded to its length
        if not groups or 4 * (len(groups[-1]) + 1) * example[0].size(1) > max_tokens:
            groups.append([])
        groups[-1].append(example)
    batches = []
    for group in groups:
        length = group[-1][0].size(1)
        tokens, mask = (torch.cat([F.pad(example[i], (0, length - example[i].size(1))) for example in group])
                        for i in (0, 1))
        batches.append((tokens, mask, torch.tensor([label for _, _, label in group])))
    return batches


@torch.no_grad()
def hellaswag_choices(model: GPT, tokens: torch.Tensor, mask: torch.Tensor, autocast) -> tuple[torch.Tensor, ...]:
    """For each example of a batch (rows 4i to 4i + 3): the ending with the lowest summed loss (acc) and the one with
    the lowest mean loss per token (acc_norm), each (n,).

    Only the positions that predict an ending token get logits (about a quarter of them in HellaSwag): the
    50304-row lm_head and the float32 cross-entropy over the others would be thrown away.
    """
    rows, positions = mask[:, 1:].nonzero(as_tuple=True)  # position i predicts token i + 1: (ending tokens,) each
    with autocast():
        hidden = model.hidden_states(tokens)[rows, positions]  # (ending tokens, n_embd)
        logits = model.lm_head(hidden)
    losses = F.cross_entropy(logits.float(), tokens[rows, positions + 1], reduction="none")
    summed = torch.zeros(len(tokens), device=tokens.device).index_add_(0, rows, losses).view(-1, 4)
    mean = summed / mask[:, 1:].sum(dim=1).view(-1, 4)
    return summed.argmin(dim=1), mean.argmin(dim=1)


def evaluate_hellaswag(model: GPT, batches: list[tuple], device: str, autocast, launch: Launch) -> dict:
    """Accuracy over all examples: each rank scores its own batches (open_hellaswag) and the counts are summed."""
    model.eval()
    counts = torch.zeros(3, device=device)  # examples, right by summed loss, right by mean loss
    for tokens, mask, labels in batches:
        by_sum, by_mean = hellaswag_choices(model, to_device(tokens, device), to_device(mask, device), autocast)
        labels = to_device(labels, device)
        counts[0] += len(labels)
        counts[1:] += torch.stack([(by_sum == labels).sum(), (by_mean == labels).sum()])
    model.train()
    if launch.torchrun:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    total, right, right_norm = counts.tolist()
    return {"hellaswag_examples": int(total), "hellaswag_acc": right / total, "hellaswag_acc_norm": right_norm / total}


def plot_metrics(metrics_path: str, png_path: str) -> bool:
    """Train and val loss against step, HellaSwag acc_norm on a second axis; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no window
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f]

    def series(key):
        return [r["step"] for r in records if key in r], [r[key] for r in records if key in r]

    figure, loss_axis = plt.subplots(figsize=(9, 5))
    loss_axis.plot(*series("train_loss"), label="train loss", linewidth=1)
    loss_axis.plot(*series("val_loss"), "o-", label="val loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss")
    loss_axis.legend(loc="upper left")
    if series("hellaswag_acc_norm")[0]:
        accuracy_axis = loss_axis.twinx()
        accuracy_axis.plot(*series("hellaswag_acc_norm"), "s-", color="tab:green", label="HellaSwag acc_norm")
        accuracy_axis.set_ylabel("HellaSwag acc_norm")
        accuracy_axis.legend(loc="upper right")
    write_atomically(png_path, lambda temporary: figure.savefig(temporary, format="png", dpi=100))
    plt.close(figure)
    return True


# ----------------------------------------------------------------------------- weights to start from

# OpenAI's checkpoint stores these as Conv1D weights, (in, out): nn.Linear wants (out, in)
OPENAI_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def state_from_openai(hf_state: dict) -> dict:
    """transformers' GPT2LMHeadModel state in our names (the same names; four matrices a block transposed)."""
    return {name: tensor.t() if name.endswith(OPENAI_TRANSPOSED) else tensor for name, tensor in hf_state.items()
            if not name.endswith((".attn.bias", ".attn.masked_bias"))}  # causal-mask buffers of older versions


def state_to_openai(state: dict, vocab_size: int) -> dict:
    """Our state in transformers' GPT2LMHeadModel layout (state_from_openai undone), keeping the first vocab_size
    rows of the vocabulary: the padding rows are no token, and no tokenizer could decode them."""
    exported = {}
    for name, tensor in state.items():
        if name.endswith(OPENAI_TRANSPOSED):
            tensor = tensor.t()
        if name in ("transformer.wte.weight", "lm_head.weight"):
            tensor = tensor[:vocab_size]
        exported[name] = tensor.contiguous()
    return exported


def load_openai_weights(name: str) -> dict:
    try:
        from transformers import GPT2LMHeadModel  # only this path needs it
    except ImportError:
        raise ConfigError(f"--init_from {name} needs the transformers library: pip install transformers") from None
    try:
        return state_from_openai(GPT2LMHeadModel.from_pretrained(name).state_dict())
    except OSError as error:
        raise ConfigError(f"cannot load {name} from the Hugging Face hub ({str(error).splitlines()[0]}): "
                          "check the network") from None


def initial_weights(cfg: TrainConfig) -> tuple[GPTConfig, dict | None]:
    """The model's shape and the weights to start from: None for a fresh model of the flags' shape."""
    if not cfg.init_from:
        n_layer, n_head, n_embd = model_shape(cfg)
        return GPTConfig(n_layer, n_head, n_embd, cfg.block_size, cfg.vocab_size), None
    if cfg.init_from in MODEL_SHAPES:
        # as released: 1024 positions and the 50257 real tokens (no padding rows to make up)
        return GPTConfig(*MODEL_SHAPES[cfg.init_from], 1024, GPT2_VOCAB_SIZE), load_openai_weights(cfg.init_from)
    checkpoint = load_checkpoint(cfg.init_from)
    return GPTConfig(**checkpoint["model_config"]), checkpoint["model"]


# ----------------------------------------------------------------------------- checkpoints

# Fields a resumed run must share with its checkpoint: the model's shape, and what numbers the data
# stream and the schedule (a step is total_batch_size tokens in windows of seq_len).
RESUME_MUST_MATCH = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "total_batch_size", "seq_len")


def checkpoint_paths(log_dir: str) -> list[str]:
    """ckpt_<step>.pt files in log_dir, newest (highest step) first."""
    found = [(int(m.group(1)), p) for p in glob.glob(os.path.join(log_dir, "ckpt_*.pt"))
             if (m := re.fullmatch(r"ckpt_(\d+)\.pt", os.path.basename(p)))]
    return [p for _, p in sorted(found, reverse=True)]


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(path: str, state: dict, keep: int) -> None:
    """Write the checkpoint and its sha256 beside it (torch.load misses a flipped byte in tensor data), then keep
    only the `keep` newest checkpoints."""
    try:
        write_atomically(path, lambda temporary: torch.save(state, temporary))
        digest = file_sha256(path)
        write_atomically(f"{path}.sha256", lambda temporary: Path(temporary).write_text(digest + "\n"))
    except OSError as error:  # a full disk, a quota, a lost network mount: the older checkpoints are intact
        raise ConfigError(f"cannot write checkpoint {path} ({error.strerror or error}): make room in "
                          f"{os.path.dirname(path) or '.'} and run the same command with --resume auto") from None
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    os.fsync(directory)  # make the renames themselves durable
    os.close(directory)
    for old in checkpoint_paths(os.path.dirname(path))[keep:] if keep else []:
        for stale in (old, f"{old}.sha256"):
            if os.path.exists(stale):
                os.remove(stale)


def load_checkpoint(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"no such checkpoint file: {path}")
    checksum_path = f"{path}.sha256"
    if os.path.exists(checksum_path):
        with open(checksum_path) as f:
            if f.read().strip() != file_sha256(path):
                raise ConfigError(f"checkpoint {path} is corrupt (its sha256 differs from {checksum_path}): "
                                  "resume from an older checkpoint")
    try:
        # On the CPU first: loading straight to the GPU can run out of memory next to the model. Mapped, not read:
        # the tensors are the file's pages in the kernel's page cache, one copy for all the processes on a machine
        # (read, 8 processes of GPT-2 XL would each hold its own 19 GB copy in private memory at once)
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a truncated or foreign file fails in many ways; all mean the same to the user
        raise ConfigError(f"cannot read checkpoint {path} ({str(error).splitlines()[0]}): "
                          "resume from an older checkpoint") from None
    checkpoint["path"] = path
    return checkpoint


def find_resume_checkpoint(cfg: TrainConfig, say) -> dict | None:
    """The checkpoint --resume names; with 'auto', the newest one in log_dir that loads, or None."""
    if cfg.resume != "auto":
        return load_checkpoint(cfg.resume) if cfg.resume else None
    for path in checkpoint_paths(cfg.log_dir):
        try:
            return load_checkpoint(path)
        except ConfigError as error:
            say(f"warning: skipping {error}")
    say(f"--resume auto: no checkpoint in {cfg.log_dir}, starting from scratch")
    return None


def check_resumable(checkpoint: dict, cfg: TrainConfig, model_config: GPTConfig) -> None:
    # the model's shape from its own config: the run config's shape flags may be empty (--model, --init_from)
    saved = {**checkpoint["config"], **checkpoint["model_config"]}
    wanted = {**dataclasses.asdict(cfg), **dataclasses.asdict(model_config)}
    differing = [f"{name} {saved[name]} -> {wanted[name]}" for name in RESUME_MUST_MATCH if saved[name] != wanted[name]]
    if differing:
        raise ConfigError(
            f"cannot resume from {checkpoint['path']}: {', '.join(differing)} (the checkpoint's model shape, "
            "total batch and seq_len define its weights, schedule and data position): use the checkpoint's values"
        )


def rng_states(device: str) -> dict:
    """The random generators' states. On CUDA only this run's GPU's: a resume on a machine with fewer GPUs could not
    restore the others'."""
    numpy_state = np.random.get_state()  # plain types only, so torch.load's safe weights_only mode reads it
    return {
        "python": random.getstate(),
        "numpy": (numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": [torch.cuda.get_rng_state(device)] if device.startswith("cuda") else [],
    }


def restore_rng_states(states: dict, device: str) -> None:
    random.setstate(states["python"])
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(states["torch_cpu"])
    if states["torch_cuda"] and device.startswith("cuda"):  # the first: older checkpoints hold one a GPU, GPU 0 first
        torch.cuda.set_rng_state(states["torch_cuda"][0], device)


class StopSignal:
    """SIGTERM (preemption, a scheduler's time limit), SIGHUP (the terminal or ssh session closed) or Ctrl-C: finish
    the step, checkpoint, exit cleanly.

    The handler only sets a flag; the loop checks it between steps. A second Ctrl-C stops at once. A signal the
    process was started to ignore stays ignored: under nohup, a closed session must not stop the run.
    """

    def __init__(self):
        self.requested, self.previous = False, {}

    def __enter__(self):
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc_info):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def any_rank(flag: bool, launch: Launch, device: str) -> bool:
    """True on every rank if it is true on any: torchrun forwards a signal to all, but a scheduler may not."""
    if not launch.torchrun:
        return flag
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


# ----------------------------------------------------------------------------- run setup


def fetch_once_per_machine(path: str, url: str, fix: str, launch: Launch) -> None:
    """Download url to path if it is missing: local rank 0 fetches it, the other ranks wait for it."""

    def fetch():
        if launch.local_rank == 0 and not os.path.exists(path):
            download(url, path, fix)

    on_every_rank(fetch, launch)


def open_data(cfg: TrainConfig, launch: Launch, with_val: bool) -> tuple[DataLoader, DataLoader | None]:
    if not cfg.data_dir:
        fetch_once_per_machine(cfg.text_file, cfg.text_url, "put a text file there or pass --text_file or --data_dir",
                               launch)

    def loaders():
        train_stream, val_stream = load_token_streams(cfg)
        B, T, W = cfg.micro_batch_size, cfg.seq_len, launch.world_size
        windows_per_step = cfg.total_batch_size // T
        shuffle = cfg.shuffle if cfg.shuffle is not None else bool(cfg.data_dir)
        more_data = "--data_dir with fineweb.py's shards" if not cfg.data_dir else "more shards"
        return (
            DataLoader(train_stream, B, T, launch.rank, W, windows_per_step, shuffle, cfg.seed, "training",
                       f"one step of --total_batch_size {cfg.total_batch_size:,} tokens",
                       f"train on more data ({more_data}) or lower --total_batch_size (the README's quick start "
                       "trains a small model on tiny Shakespeare)"),
            # validation: in order, the same windows every time; all the evaluation's steps must fit
            DataLoader(val_stream, B, T, launch.rank, W, windows_per_step * cfg.eval_steps, False, cfg.seed,
                       "validation",
                       f"an evaluation of --eval_steps {cfg.eval_steps} steps of {cfg.total_batch_size:,} tokens",
                       f"lower --eval_steps or --total_batch_size, or use more data ({more_data})")
            if with_val else None,
        )

    train_loader, val_loader = on_every_rank(loaders, launch)
    # machines with their own copies of the data (one still being copied, or made with other flags) would each
    # cut the stream differently: some windows read twice, others never
    token_counts = gather_from_ranks((train_loader.stream.num_tokens, val_loader and val_loader.stream.num_tokens),
                                     launch)
    if len(set(token_counts)) > 1:
        raise ConfigError(f"the ranks read different data ((train, val) tokens on each: {token_counts}): give every "
                          "machine the same shards")
    return train_loader, val_loader


# HellaSwag examples are scored in batches of at most this many tokens (fewer if a training micro-batch holds fewer):
# one example at a time left a GPU waiting on kernel launches. Only ending tokens get logits, about a quarter of a
# batch: 2048 x 50304 float32 logits take 0.4 GiB (1.5 GiB if a batch were all endings, like a loss slice)
HELLASWAG_BATCH_TOKENS = 8192


def open_hellaswag(cfg: TrainConfig, launch: Launch, block_size: int) -> list[tuple]:
    """This rank's share of HellaSwag (examples r, r + W, ...), tokenized once for the whole run and packed into
    batches; a model whose block_size is too short for the longest example is refused before training starts."""
    path = cfg.hellaswag_path or HELLASWAG_CACHE
    fetch_once_per_machine(path, HELLASWAG_URL, "pass --hellaswag_path with a local copy", launch)
    examples = on_every_rank(lambda: read_hellaswag(path), launch)
    tokenizer = on_every_rank(gpt2_tokenizer, launch)
    rendered = [render_hellaswag(example, tokenizer) for example in examples[launch.rank :: launch.world_size]]
    longest = max(gather_from_ranks(max((tokens.size(1) for tokens, _, _ in rendered), default=0), launch))
    if longest > block_size:
        fix = "" if cfg.eval_only else ", or drop --hellaswag_every"
        raise ConfigError(f"the longest HellaSwag example in {path} takes {longest} tokens, more than the model's "
                          f"block_size of {block_size}: HellaSwag needs --block_size {longest} or more{fix}")
    return pack_hellaswag(rendered, min(HELLASWAG_BATCH_TOKENS, cfg.micro_batch_size * cfg.seq_len))


def build_model(cfg: TrainConfig, launch: Launch, device: str) -> GPT:
    """Fresh weights from --seed (the same on every rank), or --init_from's."""

    def weights():
        model_config, state = initial_weights(cfg)
        if not cfg.generate and cfg.seq_len > model_config.block_size:
            raise ConfigError(f"--seq_len {cfg.seq_len} is longer than the model's {model_config.block_size} "
                              "positions: lower --seq_len")
        return model_config, state

    model_config, state = on_every_rank(weights, launch)
    torch.manual_seed(cfg.seed)
    model = GPT(model_config)
    if state is not None:
        model.load_state_dict(state)
    model.recompute_blocks = cfg.recompute
    if cfg.loss_chunk_size is not None:
        model.loss_chunk_size = cfg.loss_chunk_size
    else:
        model.loss_chunk_size = 0 if compile_enabled(cfg, device) else 8192
    return model.to(device)


# Values autograd keeps for backward per token, layer and channel of the width, at least: the LayerNorms' inputs and
# outputs, q, k, v, the attention output, the MLP's 4 x width hidden layer before and after GELU. Counted on the CPU
# with saved_tensors_hooks: 66-69 bytes in float32 (16.5-17 values), 37-44 under bf16 autocast (LayerNorms work in
# float32). Backward's temporaries come on top: the 124M shape's peak RSS grew 1.4 times as fast (Measured figures).
SAVED_VALUES_PER_TOKEN_LAYER_CHANNEL = 16


def check_fits_in_cpu_memory(cfg: TrainConfig, model_config: GPTConfig, num_params: int, dtype: torch.dtype,
                             launch: Launch, machine_bytes: int) -> None:
    """Refuse, before the first step, a CPU run that cannot fit in the machine's memory: the kernel would kill it part
    way without a word (a laptop given the GPU defaults). Counts only what must fit for sure, so it never refuses a
    run that fits: float32 weights, gradients and AdamW's two moments (16 bytes a parameter; with
    --shard_optimizer the moments' 8 are shared out over the processes), and the activations saved for backward
    (with --recompute, each block's input and one block's saved values at a time)."""
    width, layers = model_config.n_embd, model_config.n_layer
    value_bytes = torch.finfo(dtype).bits // 8
    bytes_per_param = 8 + (8 / launch.world_size if cfg.shard_optimizer else 8)

    def needed(micro_batch: int) -> float:
        saved_layers = 1 if cfg.recompute else layers
        per_token = SAVED_VALUES_PER_TOKEN_LAYER_CHANNEL * width * value_bytes * saved_layers
        if cfg.recompute:
            per_token += layers * width * 4  # the blocks' float32 inputs
        return launch.local_world_size * (bytes_per_param * num_params + micro_batch * cfg.seq_len * per_token)

    B, T, gib = cfg.micro_batch_size, cfg.seq_len, 2**30
    if needed(B) <= machine_bytes:
        return
    # half the machine for the lower bound leaves room for backward's temporaries and everything else running
    fitting = [b for b in smaller_micro_batches(cfg, launch.world_size) if needed(b) <= machine_bytes / 2]
    fix = lower_micro_batch_fix(cfg, fitting[0]) if fitting else "pick a smaller model or --seq_len"
    if fitting and not cfg.recompute:
        fix += ", or add --recompute"
    processes = f" for {launch.local_world_size} processes" if launch.local_world_size > 1 else ""
    raise ConfigError(f"micro batch {B} x {T} needs at least {needed(B) / gib:.1f} GiB of memory on the CPU{processes} "
                      f"(weights, gradients, AdamW state and activations), more than this machine's "
                      f"{machine_bytes / gib:.1f} GiB: {fix}")


def compile_enabled(cfg: TrainConfig, device: str) -> bool:
    return cfg.compile if cfg.compile is not None else device.startswith("cuda")


def check_fp8_supported(device: str, capability: tuple[int, int] | None) -> None:
    """capability: the CUDA device's (major, minor), None off CUDA."""
    if capability is None or capability < (8, 9):
        raise ConfigError(f"--fp8 needs an NVIDIA GPU with float8 matmuls (compute capability 8.9 or newer: Ada, "
                          f"Hopper); this run is on {device}: drop --fp8")


def convert_to_float8(model: GPT) -> None:
    """Swap the blocks' nn.Linear layers for torchao's Float8Linear: matmuls in float8 with dynamic scales.

    lm_head (tied to the embedding, feeding the loss) stays as it is; float8 matmuls need both dimensions
    divisible by 16.
    """
    try:
        from torchao.float8 import convert_to_float8_training  # only this path needs it
    except ImportError:
        raise ConfigError("--fp8 needs torchao: pip install torchao") from None
    convert_to_float8_training(model.transformer, module_filter_fn=lambda module, name: (
        isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0))


def resolve_dtype(requested: str, device_type: str, bf16_supported: bool) -> torch.dtype:
    if requested == "auto":
        if device_type != "cuda":
            return torch.float32
        return torch.bfloat16 if bf16_supported else torch.float16
    return getattr(torch, requested)


def precision(cfg: TrainConfig, device_type: str):
    """(dtype, autocast): a function that opens an autocast context for that dtype (off for float32)."""
    dtype = resolve_dtype(cfg.dtype, device_type, device_type == "cuda" and torch.cuda.is_bf16_supported())
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls for what autocast leaves in float32

    def autocast():
        return torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32)

    return dtype, autocast


# ----------------------------------------------------------------------------- logging


class MetricsLog:
    """Prints and appends JSON records to <log_dir>/metrics.jsonl; silent on every rank but 0.

    As a context manager (rank 0's) it also holds <log_dir>/run.lock, so that a second run started on the same
    folder stops at once instead of interleaving its records and checkpoints with this one's.
    """

    def __init__(self, log_dir: str, active: bool):
        self.active, self.path = active, os.path.join(log_dir, "metrics.jsonl")
        self.records, self.plot_hint_given, self.lock_file = [], False, None
        if active:
            try:
                os.makedirs(log_dir, exist_ok=True)
            except OSError as error:
                problem = "it is a file" if os.path.isfile(log_dir) else error.strerror
                raise ConfigError(f"cannot make --log_dir {log_dir} ({problem}): give a folder you can write to") \
                    from None
            self.lock(log_dir)

    def lock(self, log_dir: str) -> None:
        import fcntl  # Unix only; the kernel drops the lock when its process ends, so a crash leaves none behind

        self.lock_file = open(os.path.join(log_dir, "run.lock"), "a+")
        try:
            fcntl.flock(self.lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock_file.seek(0)
            holder = self.lock_file.read().strip()
            self.close()
            raise ConfigError(f"another run ({holder}) is writing to --log_dir {log_dir}: wait for it to end, stop "
                              "it, or pass another --log_dir") from None
        except OSError:  # a file system without locks (some network mounts): run unguarded rather than not at all
            return
        self.lock_file.truncate(0)
        self.lock_file.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        self.lock_file.flush()

    def close(self) -> None:
        if self.lock_file is not None:
            self.lock_file.close()  # releases the lock
            self.lock_file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def begin(self, resume_step: int | None) -> None:
        """A new run starts an empty file; a resumed one keeps the records of the steps before resume_step."""
        if not self.active:
            return
        kept = []
        if resume_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if self.step_of(line, resume_step) < resume_step]
        write_atomically(self.path, lambda temporary: Path(temporary).write_text("".join(kept)))  # all or nothing

    @staticmethod
    def step_of(line: str, default: int) -> int:
        """A record's step (default for the summary). A line cut short by a killed process, the last one it wrote,
        reads as the default too, so that resuming drops it rather than fail on it."""
        try:
            return json.loads(line).get("step", default)
        except json.JSONDecodeError:
            return default

    def say(self, line: str) -> None:
        if self.active:
            print(line, flush=True)

    def plot(self) -> None:
        """Redraw <log_dir>/loss.png from the records so far; without matplotlib, say so once."""
        png_path = os.path.join(os.path.dirname(self.path), "loss.png")
        if self.active and not plot_metrics(self.path, png_path) and not self.plot_hint_given:
            self.say(f"{png_path} not written: matplotlib is not installed (pip install matplotlib)")
            self.plot_hint_given = True

    def write(self, record: dict, line: str) -> None:
        if self.active:
            self.say(line)
            self.records.append(record)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def peak_memory_gib(device_type: str) -> float:
    """Peak GPU memory allocated on CUDA; peak resident memory of this process elsewhere."""
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource  # Unix only; ru_maxrss is in KiB on Linux and in bytes on macOS

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def step_summary(step_ms: list[float], tokens_per_step: int, flops_per_step: float | None, cfg: TrainConfig,
                 device_type: str, world_size: int) -> dict:
    """Median speed over the steps after the untimed first ones, peak memory."""
    timed = step_ms[UNTIMED_STEPS:] or step_ms
    median_ms = statistics.median(timed)
    summary = {"timed_steps": len(timed), "median_ms": median_ms,
               "median_tokens_per_s": tokens_per_step * 1000 / median_ms,
               "peak_memory_gib": peak_memory_gib(device_type)}
    if device_type == "cuda":  # what the caching allocator held: with its slack, this is what must fit the GPU
        summary["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if flops_per_step is not None:
        summary["mfu"] = model_flops_utilization(flops_per_step, median_ms, cfg.peak_tflops, world_size)
    return summary


def summary_line(summary: dict, peak_tflops: float) -> str:
    line = (f"summary: median {summary['median_ms']:.1f} ms/step, {summary['median_tokens_per_s']:,.0f} tokens/s "
            f"over the last {summary['timed_steps']} steps; peak memory {summary['peak_memory_gib']:.2f} GiB")
    if "peak_reserved_gib" in summary:
        line += f" ({summary['peak_reserved_gib']:.2f} GiB reserved)"
    if "mfu" in summary:
        line += f"; MFU {100 * summary['mfu']:.1f}% of {peak_tflops:g} TFLOP/s"
    return line


def make_profiler(cfg: TrainConfig, device_type: str) -> torch.profiler.profile:
    """A torch.profiler that skips UNTIMED_STEPS steps, warms up for 1, then records --profile_steps steps
    (the loop calls its step() after each step); then it writes a trace and prints the costliest operators."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace_path = os.path.join(cfg.log_dir, "profile_trace.json.gz")

    def report(profiler):
        profiler.export_chrome_trace(trace_path)  # gzipped because of the name: 124M steps hold many kernels
        by = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
        print(profiler.key_averages().table(sort_by=by, row_limit=25), flush=True)
        print(f"profile of {cfg.profile_steps} step(s) written to {trace_path} (open it in ui.perfetto.dev)",
              flush=True)

    schedule = torch.profiler.schedule(wait=UNTIMED_STEPS, warmup=1, active=cfg.profile_steps, repeat=1)
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=report)


# ----------------------------------------------------------------------------- training loop


def forward_backward(model, loader: DataLoader, accum_steps: int, device: str, autocast, scaler,
                     sync_last_only: bool) -> torch.Tensor:
    """Accumulate one step's mean gradient over accum_steps micro-batches; returns this rank's mean loss.

    A DDP model all-reduces gradients during every backward; sync_last_only skips that on all but the
    last micro-step, which then reduces the accumulated sum once (same result, 1/accum_steps the traffic).
    """
    loss_sum = torch.zeros((), device=device)
    for micro_step in range(accum_steps):
        x, y = (to_device(batch, device) for batch in loader.next_batch())
        skip_sync = sync_last_only and micro_step < accum_steps - 1
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            with autocast():
                loss = model(x, y) / accum_steps  # the step's loss is the mean over micro-steps, not the sum
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
    return loss_sum


def check_step_finite(step: int, train_loss: float, grad_norm: float, loss_scaling: bool, log_dir: str) -> None:
    """Stop a run whose loss or gradient norm is no longer finite: it has reached the weights already (clipping by an
    infinite norm zeroes or NaNs the gradients), so nothing may be evaluated or checkpointed from them. With loss
    scaling (float16) an infinite norm is routine: the GradScaler skips that step itself."""
    if math.isfinite(train_loss) and (loss_scaling or math.isfinite(grad_norm)):
        return
    saved = checkpoint_paths(log_dir)
    go_back = (f"go on from {saved[0]} (--resume {saved[0]}), or an older checkpoint if the loss was rising there "
               "already," if saved else "start again")
    raise ConfigError(f"training diverged at step {step}: loss {train_loss:.4g}, gradient norm {grad_norm:.4g}; "
                      f"nothing was saved from this step: {go_back} with a lower --max_lr or more --warmup_steps")


@dataclass
class TrainResult:
    model: GPT  # the plain model: no DDP or compile wrapper
    records: list[dict]  # what rank 0 logged; empty on other ranks


def train(cfg: TrainConfig, launch: Launch, device: str, stop_signal: StopSignal, log: MetricsLog) -> TrainResult:
    device_type = device.split(":")[0]
    is_main = launch.rank == 0
    train_loader, val_loader = open_data(cfg, launch, with_val=cfg.eval_every > 0)
    raw_model = build_model(cfg, launch, device)
    num_params = count_parameters(raw_model)
    dtype, autocast = precision(cfg, device_type)
    if device_type == "cpu":  # machines may differ in memory: on_every_rank, so that all stop if one must
        machine_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        on_every_rank(lambda: check_fits_in_cpu_memory(cfg, raw_model.config, num_params, dtype, launch,
                                                       machine_bytes), launch)
    hellaswag = open_hellaswag(cfg, launch, raw_model.config.block_size) if cfg.hellaswag_every else []

    # resume: every rank reads the checkpoint, and all must have found the same one
    def resume_checkpoint():
        checkpoint = find_resume_checkpoint(cfg, log.say)
        if checkpoint is not None:
            check_resumable(checkpoint, cfg, raw_model.config)
        return checkpoint

    checkpoint = on_every_rank(resume_checkpoint, launch)
    resume_steps = gather_from_ranks(checkpoint and checkpoint["step"], launch)
    if len(set(resume_steps)) > 1:
        raise ConfigError(f"the ranks found different checkpoints (steps {resume_steps}): put --log_dir on storage "
                          "that every machine shares, or pass --resume PATH")
    start_step = checkpoint["step"] if checkpoint else 0
    log.begin(start_step if checkpoint else None)

    if cfg.fp8:  # a machine may lack torchao: then every rank stops
        on_every_rank(lambda: convert_to_float8(raw_model), launch)
    B, T, W = cfg.micro_batch_size, cfg.seq_len, launch.world_size
    use_compile = compile_enabled(cfg, device)
    model = torch.compile(raw_model, mode=cfg.compile_mode) if use_compile else raw_model
    if launch.torchrun:
        # gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets instead of beside them
        model = DDP(model, device_ids=[torch.device(device).index] if device_type == "cuda" else None,
                    gradient_as_bucket_view=True)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)  # float16 needs loss scaling
    sharded = cfg.shard_optimizer and W > 1
    optimizer = configure_optimizer(raw_model, cfg, fused=device_type == "cuda", sharded=sharded)
    accum_steps = grad_accum_steps(cfg, W)
    flops_per_step = (flops_per_token(raw_model.config, num_params, T) * cfg.total_batch_size  # of all processes
                      if device_type == "cuda" else None)
    if checkpoint is not None:
        raw_model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if checkpoint["scaler"]:
            scaler.load_state_dict(checkpoint["scaler"])
        train_loader.windows_consumed = checkpoint["windows_consumed"]
        saved_tokens, tokens = checkpoint.get("train_tokens"), train_loader.stream.num_tokens
        if saved_tokens not in (None, tokens):  # None: a checkpoint from before this was stored
            log.say(f"warning: the training data holds {tokens:,} tokens, the checkpoint's held {saved_tokens:,}: "
                    "the stored data position no longer points at the same tokens (some will be read twice or "
                    "skipped); resume with the checkpoint's data to go on exactly")
        restore_rng_states(checkpoint["rng"], device)
        log.say(f"resumed from step {start_step} ({checkpoint['windows_consumed']:,} windows into the data)")
    tokenizer = on_every_rank(gpt2_tokenizer, launch)
    if is_main:
        compile_state = ("on" if cfg.compile_mode == "default" else cfg.compile_mode) if use_compile else "off"
        print(f"device {device} ({str(dtype).removeprefix('torch.')}, compile {compile_state}), "
              f"{W} process(es); {num_params:,} parameters; {cfg.total_batch_size:,} tokens per step = "
              f"{accum_steps} micro-steps x {W} process(es) x {B} x {T}; "
              f"{'AdamW state sharded over the processes; ' if sharded else ''}"
              f"{train_loader.stream.num_tokens:,} train tokens",
              flush=True)

    step_ms, epoch = [], train_loader.epoch
    profiler = None
    if is_main and cfg.profile_steps:
        if cfg.max_steps - start_step < steps_to_profile(cfg):
            log.say(f"warning: no profile: {cfg.max_steps - start_step} steps are left after the checkpoint, "
                    f"fewer than the {steps_to_profile(cfg)} that --profile_steps {cfg.profile_steps} needs")
        else:
            profiler = make_profiler(cfg, device_type)
            profiler.start()
    for step in range(start_step, cfg.max_steps):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        local_loss = forward_backward(model, train_loader, accum_steps, device, autocast, scaler,
                                      sync_last_only=launch.torchrun)
        train_loss = all_reduce_mean(local_loss, launch)
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or float("inf"))
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        scaler.step(optimizer)
        scaler.update()
        train_loss, grad_norm = train_loss.item(), grad_norm.item()  # waits for the device
        elapsed_ms = (time.perf_counter() - started) * 1000
        if not (profiler and UNTIMED_STEPS <= step - start_step < steps_to_profile(cfg)):
            step_ms.append(elapsed_ms)  # profiled steps run slower

        tokens_per_s = cfg.total_batch_size * 1000 / elapsed_ms
        record = {"step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm,
                  "ms": elapsed_ms, "tokens_per_s": tokens_per_s}
        line = (f"step {step:5d}/{cfg.max_steps} | loss {train_loss:.6f} | lr {lr:.4e} | norm {grad_norm:.4f} | "
                f"{elapsed_ms:.0f} ms | {tokens_per_s:,.0f} tok/s")
        if flops_per_step is not None:
            record["mfu"] = model_flops_utilization(flops_per_step, elapsed_ms, cfg.peak_tflops, W)
            line += f" | MFU {100 * record['mfu']:.1f}%"
        log.write(record, line)
        # every rank holds the same all-reduced loss and gradients, so if one stops here, all do
        check_step_finite(step, train_loss, grad_norm, scaler.is_enabled(), cfg.log_dir)
        if train_loader.epoch > epoch:
            epoch = train_loader.epoch
            log.write({"step": step, "epoch": epoch},
                      f"step {step:5d}/{cfg.max_steps} | epoch {epoch} begins: all {train_loader.num_windows:,} "
                      f"training windows were used, starting again{' in a new order' if train_loader.shuffle else ''}")

        steps_done, last_step = step + 1, step + 1 == cfg.max_steps
        evaluated = False
        if cfg.eval_every and (steps_done % cfg.eval_every == 0 or last_step):
            val_loss = estimate_val_loss(model, val_loader, cfg.eval_steps, accum_steps, device, autocast, launch)
            log.write({"step": step, "val_loss": val_loss}, f"step {step:5d}/{cfg.max_steps} | val loss {val_loss:.6f}")
            evaluated = True
        if cfg.hellaswag_every and (steps_done % cfg.hellaswag_every == 0 or last_step):
            scores = evaluate_hellaswag(raw_model, hellaswag, device, autocast, launch)
            log.write({"step": step, **scores}, f"step {step:5d}/{cfg.max_steps} | HellaSwag acc_norm "
                      f"{scores['hellaswag_acc_norm']:.4f} (acc {scores['hellaswag_acc']:.4f})")
            evaluated = True
        if evaluated or last_step:
            log.plot()
        if is_main and cfg.sample_every and (steps_done % cfg.sample_every == 0 or last_step):
            samples = generate(raw_model, tokenizer.encode_ordinary(cfg.prompt), cfg.num_samples, cfg.max_new_tokens,
                               cfg.temperature, cfg.top_k, cfg.seed, device, autocast)
            for i, sample in enumerate(samples):
                print(f"sample {i}: {cfg.prompt}{tokenizer.decode(sample)}", flush=True)

        stop = any_rank(stop_signal.requested, launch, device)
        pause = not last_step and cfg.stop_after_steps and steps_done - start_step == cfg.stop_after_steps
        if last_step or stop or pause or cfg.ckpt_every and steps_done % cfg.ckpt_every == 0:
            def write_checkpoint():  # rank 0 writes it; the others wait until it is complete, or stop with rank 0
                if sharded:
                    optimizer.consolidate_state_dict(to=0)  # every rank sends its share of AdamW's state to rank 0
                if is_main:
                    state = {"model": raw_model.state_dict(), "model_config": dataclasses.asdict(raw_model.config),
                             "optimizer": optimizer.state_dict(),
                             "scaler": scaler.state_dict(), "step": steps_done, "config": dataclasses.asdict(cfg),
                             "windows_consumed": train_loader.windows_consumed,
                             "train_tokens": train_loader.stream.num_tokens, "rng": rng_states(device)}
                    save_checkpoint(os.path.join(cfg.log_dir, f"ckpt_{steps_done}.pt"), state, cfg.keep_ckpts)

            on_every_rank(write_checkpoint, launch)
        if stop or pause:
            reason = "a signal" if stop else f"--stop_after_steps {cfg.stop_after_steps}"
            log.say(f"stopped by {reason} after step {step}, checkpoint {cfg.log_dir}/ckpt_{steps_done}.pt written: "
                    "to continue, run the same command with --resume auto")
            break
        if profiler:
            profiler.step()

    if profiler:
        profiler.stop()  # reports now if the run ended while recording
    if not step_ms:
        log.say(f"nothing to train: the checkpoint is at step {start_step} of --max_steps {cfg.max_steps}")
        return TrainResult(raw_model, log.records)
    summary = step_summary(step_ms, cfg.total_batch_size, flops_per_step, cfg, device_type, W)
    log.write({"summary": summary}, summary_line(summary, cfg.peak_tflops))
    return TrainResult(raw_model, log.records)


# ----------------------------------------------------------------------------- other run modes


def generate_samples(cfg: TrainConfig, launch: Launch, device: str) -> list[str]:
    """--generate: print the samples and how fast they came."""
    model = build_model(cfg, launch, device)
    _, autocast = precision(cfg, device.split(":")[0])
    tokenizer = gpt2_tokenizer()
    started = time.perf_counter()
    samples = generate(model, tokenizer.encode_ordinary(cfg.prompt), cfg.num_samples, cfg.max_new_tokens,
                       cfg.temperature, cfg.top_k, cfg.seed, device, autocast, use_cache=cfg.kv_cache)
    elapsed = time.perf_counter() - started
    texts = [cfg.prompt + tokenizer.decode(sample) for sample in samples]
    for i, text in enumerate(texts):
        print(f"sample {i}: {text}", flush=True)
    print(f"{cfg.num_samples * cfg.max_new_tokens:,} tokens in {elapsed:.2f} s: "
          f"{cfg.num_samples * cfg.max_new_tokens / elapsed:,.1f} tokens/s "
          f"(KV cache {'on' if cfg.kv_cache else 'off'}, {count_parameters(model):,} parameters)", flush=True)
    return texts


def evaluate_only(cfg: TrainConfig, launch: Launch, device: str) -> dict:
    """--eval_only: the validation loss and HellaSwag accuracy of --init_from's weights (or fresh ones)."""
    _, val_loader = open_data(cfg, launch, with_val=True)
    model = build_model(cfg, launch, device)
    hellaswag = open_hellaswag(cfg, launch, model.config.block_size)
    _, autocast = precision(cfg, device.split(":")[0])
    accum_steps = grad_accum_steps(cfg, launch.world_size)
    result = {"val_loss": estimate_val_loss(model, val_loader, cfg.eval_steps, accum_steps, device, autocast, launch),
              **evaluate_hellaswag(model, hellaswag, device, autocast, launch)}
    if launch.rank == 0:
        print(f"val loss {result['val_loss']:.4f} | HellaSwag acc_norm {result['hellaswag_acc_norm']:.4f} "
              f"(acc {result['hellaswag_acc']:.4f}) over {result['hellaswag_examples']:,} examples", flush=True)
    return result


def export_hf(cfg: TrainConfig) -> str:
    """--export_hf: --init_from's weights as a transformers GPT-2 folder (config.json, model.safetensors)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel  # only this path needs it
    except ImportError:
        raise ConfigError("--export_hf needs the transformers library: pip install transformers") from None
    model_config, state = initial_weights(cfg)
    vocab_size = min(model_config.vocab_size, GPT2_VOCAB_SIZE)
    # transformers' defaults for the rest match ours: tanh GELU ("gelu_new"), LayerNorm eps 1e-5, tied embeddings;
    # dropout off, as in our model, so that fine-tuning it there starts from the same function
    hf_model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=model_config.block_size,
                                          n_embd=model_config.n_embd, n_layer=model_config.n_layer,
                                          n_head=model_config.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    hf_model.load_state_dict(state_to_openai(state, vocab_size))
    hf_model.save_pretrained(cfg.export_hf)
    print(f"wrote {cfg.init_from} to {cfg.export_hf}: GPT2LMHeadModel.from_pretrained({cfg.export_hf!r}) loads it, "
          "with GPT-2's tokenizer (AutoTokenizer.from_pretrained('gpt2'))", flush=True)
    return cfg.export_hf


# ----------------------------------------------------------------------------- main


def out_of_memory_message(cfg: TrainConfig, device: str, world_size: int) -> str:
    """The line for torch.OutOfMemoryError (CUDA, MPS): where memory ran out and the flag that fixes it."""
    where = f"out of memory on {device}"
    if device.startswith("cuda"):
        held_gib = torch.cuda.max_memory_reserved(device) / 2**30
        total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        where += f" ({held_gib:.1f} of its {total_gib:.1f} GiB held by PyTorch at the peak)"
    if cfg.generate:
        return f"{where} while generating: lower --num_samples"
    B, T = cfg.micro_batch_size, cfg.seq_len
    if B == 1:
        flags = [flag for flag, on in (("--recompute", cfg.recompute),
                                       ("--shard_optimizer", cfg.shard_optimizer or world_size == 1)) if not on]
        add = f"add {' and '.join(flags)}, " if flags else ""
        return f"{where} at micro batch 1 x {T}: {add}lower --seq_len or pick a smaller --model"
    return f"{where} at micro batch {B} x {T}: {lower_micro_batch_fix(cfg, smaller_micro_batches(cfg, world_size)[0])}"


@record  # under torchrun, the failure summary then names the failing rank and shows its traceback
def main(cfg: TrainConfig, launch: Launch | None = None) -> TrainResult | dict | list[str] | str:
    launch = launch or launch_from_env(os.environ)
    problem = None
    try:
        check_config(cfg, launch.world_size)
        device = pick_device(cfg.device, launch, torch.cuda.device_count(), torch.backends.mps.is_available())
        if cfg.compile_mode != "default" and not compile_enabled(cfg, device):
            raise ConfigError(f"--compile_mode {cfg.compile_mode} needs torch.compile, which is off on {device}: "
                              "add --compile")
        if cfg.fp8:
            check_fp8_supported(device, torch.cuda.get_device_capability(device) if device.startswith("cuda") else None)
    except ConfigError as error:
        problem = error
    store = start_together(launch, problem, cfg)
    init_distributed(launch, device, store)
    result = None
    try:
        with StopSignal() as stop_signal:
            if cfg.export_hf:
                result = export_hf(cfg)
            elif cfg.generate:
                result = generate_samples(cfg, launch, device)
            elif cfg.eval_only:
                result = evaluate_only(cfg, launch, device)
            else:
                # rank 0's log folder may fail to open or be in use by another run: then every rank stops
                with on_every_rank(lambda: MetricsLog(cfg.log_dir, active=launch.rank == 0), launch) as log:
                    result = train(cfg, launch, device, stop_signal, log)
    except ConfigError as error:  # raised on every rank together (on_every_rank, or the same diverged step)
        exit_on_user_error(error, launch, leave_process_group=launch.torchrun)
    except torch.OutOfMemoryError:
        exit_out_of_memory(out_of_memory_message(cfg, device, launch.world_size), launch, store)
    if launch.torchrun:
        # every rank gets here together; not after a crash, where a peer may be gone and this can block
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    launch = launch_from_env(os.environ)
    try:
        config = parse_args(sys.argv[1:])
    except ConfigError as error:
        start_together(launch, error, None)  # this process stops here, and under torchrun every other one too
    main(config, launch)
