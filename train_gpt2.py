"""Pretrain GPT-2 in plain PyTorch: `python train_gpt2.py` on one device, `torchrun --standalone
--nproc_per_node=8 train_gpt2.py` on 8 GPUs. Down to the "# ====" banner: GPT-2's pretraining,
which trains alone as train(TrainConfig(...)); after it, the options and checks main() adds."""

import collections
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

def tokenizer():
    """Named here alone: vocab rows, <|endoftext|>, shards, sampling, export all follow it."""
    import tiktoken  # here: importing this file does no work
    return tiktoken.get_encoding("gpt2")

# ------------------------------ model
@dataclasses.dataclass
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

class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key, value in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.fused_causal = False  # main() sets it once it has checked that visible() is causal

    def forward(self, x, positions, tokens, cache=None):
        """x (B, T, C) for tokens (B, T) at positions (T,): a KV cache (--generate's) writes there,
        visible() reads them (GPT-2 adds positions at the input; rotary would rotate q and k)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): each head attends with its own slice of C
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        key_positions, fused = positions, self.fused_causal and cache is None
        if cache is not None:  # generating: all keys, values and tokens so far, and their positions
            k, v, tokens, key_positions = cache.update(positions, tokens, k, v)
        # softmax(q k^T / sqrt(head_dim)) v in one kernel; fused_causal: SDPA's causal kernel
        # makes the mask itself (flash attention on a GPU): the same attention, faster
        mask = None if fused else visible(positions, key_positions, tokens)
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
        """idx (B, T) -> logits (B, T, vocab_size); given targets (B, T), their mean loss instead.
        A loss that adds terms adds them here: validation and HellaSwag score cross_entropy."""
        x = self.hidden_states(idx)
        return self.logits(x) if targets is None else self.cross_entropy(x, targets)

    def hidden_states(self, idx, caches: list | None = None, positions=None):
        """idx (B, T) at positions (T,), default 0 to T - 1, -> (B, T, n_embd) for logits()."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"{T} tokens, longer than block_size {self.config.block_size}")
        positions = torch.arange(T, device=idx.device) if positions is None else positions
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for i, block in enumerate(self.transformer.h):
            x = block(x, positions, idx, caches[i] if caches else None)
        return self.transformer.ln_f(x)

    def logits(self, x):
        """(..., n_embd) -> (..., vocab_size): the loss, HellaSwag and sampling all come here."""
        return self.lm_head(x)

    def cross_entropy(self, x, targets, reduction="mean"):
        """The logits' cross-entropy of hidden states x (..., n_embd) against targets (...), in
        float32 (a softmax over 50k needs it): the mean, or each token's (reduction "none")."""
        logits = self.logits(x.flatten(0, -2)).float()
        return F.cross_entropy(logits, targets.flatten(), reduction=reduction)

# ------------------------------ data
class TokenStream:
    """Token arrays (the shards) as one sequence: a read may run across their ends."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays, self.starts = arrays, np.cumsum([0] + [len(a) for a in arrays])
        self.num_tokens = int(self.starts[-1])

    def read(self, start: int, count: int) -> np.ndarray:  # from the arrays first to last
        first, last = np.searchsorted(self.starts, [start, start + count - 1], side="right") - 1
        return np.concatenate([self.arrays[i][max(0, start - self.starts[i]) :
                                              start + count - self.starts[i]]
                               for i in range(first, last + 1)]).astype(np.int64)

class DataLoader:
    """(B, T) batches of windows, T + 1 tokens of a TokenStream: x = window[:-1], y = window[1:].
    Its place: `position` tokens read in this `epoch`, a pass over the stream. Rank r of W reads
    B windows from position + r*B*T; then all move on W*B*T, past the end into the next epoch."""

    def __init__(self, stream: TokenStream, batch_size, seq_len, rank, world_size):
        self.stream, self.batch_size, self.seq_len = stream, batch_size, seq_len
        self.rank, self.world_size, self.epoch, self.position = rank, world_size, 0, 0

    @property
    def num_windows(self) -> int:  # of seq_len, in an epoch
        return max(0, self.stream.num_tokens - 1) // self.seq_len

    def place(self, k: int) -> tuple[int, int]:
        """(epoch, position) of the k-th window from here: past this epoch's last, the next's."""
        T, left = self.seq_len, max(0, self.stream.num_tokens - 1 - self.position) // self.seq_len
        epochs, i = divmod(k - left, self.num_windows)  # k >= left: windows into the next epochs
        return (self.epoch, self.position + k * T) if k < left else (self.epoch + 1 + epochs, i * T)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        B = self.batch_size
        windows = torch.from_numpy(np.stack([self.read_window(*self.place(k))  # (B, T + 1)
                                             for k in range(self.rank * B, self.rank * B + B)]))
        self.epoch, self.position = self.place(self.world_size * B)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def read_window(self, epoch: int, position: int) -> np.ndarray:  # (--shuffle: another one)
        return self.stream.read(position, self.seq_len + 1)

def to_device(batch: torch.Tensor, device: str) -> torch.Tensor:  # pinned: the CPU goes on
    pinned = device.startswith("cuda")
    return (batch.pin_memory() if pinned else batch).to(device, non_blocking=pinned)

# ------------------------------ distributed setup
# where this process sits (python train_gpt2.py: rank 0 of 1); local_rank picks the GPU
Launch = collections.namedtuple("Launch", "rank local_rank world_size torchrun local_world_size "
                                "restarts", defaults=(0, 0, 1, False, 1, 0))

def launch_from_env(environ) -> Launch:
    """torchrun's variables, read here alone: everything else is handed the Launch."""
    if "RANK" not in environ:
        return Launch()
    rank, local_rank, world_size, local_world_size = (int(environ[name]) for name in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    return Launch(rank, local_rank, world_size, True, local_world_size,
                  int(environ.get("TORCHELASTIC_RESTART_COUNT", 0)))

def init_distributed(launch: Launch, device: str):
    """Under torchrun, join the process group: gloo for CPU tensors, NCCL for CUDA's."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # no stray context on GPU 0
    if launch.torchrun:  # imported after the group, these hold it in default arguments: gloo's
        from torch.distributed import nn as _nn, optim as _optim  # noqa: F401 (abort at exit)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=datetime.timedelta(minutes=20))  # outlasts a gpt2-xl save

def all_reduce_mean(value: torch.Tensor, launch: Launch) -> torch.Tensor:
    """The mean over ranks: SUM, then divide (gloo's ReduceOp.AVG came late, with a bug)."""
    if launch.torchrun:
        dist.all_reduce(value := value.clone(), op=dist.ReduceOp.SUM)  # a copy: it sums in place
    return value / launch.world_size

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

def configure_optimizers(model: GPT, cfg: "TrainConfig", skip=frozenset()) -> list:
    """[AdamW] over the parameters that train, but skip's (main()'s Muon). beta2 0.95: the second
    moment forgets a spike sooner. Decay: matrices and embeddings (2+ dims), not biases or gains."""
    params = [p for name, p in model.named_parameters() if p.requires_grad and name not in skip]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [torch.optim.AdamW(groups, lr=cfg.max_lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                              fused=cfg.device.startswith("cuda"))]

# ------------------------------ training
def flag(default, help: str, section: str, choices=None):  # a --flag, in --help's `section`
    return dataclasses.field(default=default, metadata=dict(help=help, section=section,
                                                            choices=choices))

@dataclasses.dataclass
class TrainConfig:
    """The recipe's flags (main()'s Config adds the options'); defaults: build-nanogpt's 124M."""
    n_layer: int = flag(12, "transformer blocks", "model")
    n_head: int = flag(12, "attention heads", "model")
    n_embd: int = flag(768, "model width", "model")
    block_size: int = flag(1024, "longest context the model accepts (learned positions)", "model")
    vocab_size: int = flag(0, "embedding rows; 0: the tokenizer's, padded (GPT-2: 50304)", "model")
    dropout: float = flag(0.0, "dropout where GPT-2 had it (0.1 to fine-tune)", "model")
    data_dir: str = flag("", "fineweb.py's .npy shards' folder; empty: --text_file", "data")
    text_file: str = flag("", "text split 90/10 into train/val (default: input.txt)", "data")
    total_batch_size: int = flag(2**19, "tokens a step, all processes (GPT-3 small: 0.5M)", "batch")
    micro_batch_size: int = flag(64, "sequences per forward/backward pass per process", "batch")
    seq_len: int = flag(1024, "tokens per training sequence (at most --block_size)", "batch")
    max_lr: float = flag(6e-4, "peak learning rate, reached at the end of warmup", "optimizer")
    min_lr_ratio: float = flag(0.1, "final learning rate as a fraction of --max_lr", "optimizer")
    warmup_steps: int = flag(715, "linear warmup steps (375M tokens at 2**19 a step)", "optimizer")
    max_steps: int = flag(19073, "optimizer steps: 19073 x 2**19 tokens is 10B", "optimizer")
    weight_decay: float = flag(0.1, "AdamW's (and Muon's), on 2-D tensors only", "optimizer")
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
    hellaswag_path: str = flag("", "hellaswag_val.jsonl (main(): downloaded once)", "logging")
    log_dir: str = flag("log", "folder for metrics.jsonl and checkpoints", "logging")
    device: str = flag("auto", "auto (the machine picks), cpu, cuda, cuda:N or mps", "runtime")
    dtype: str = flag("auto", "auto (the machine picks), float32, bfloat16 or float16", "runtime",
                      choices=["auto", "float32", "bfloat16", "float16"])
    compile: bool | None = flag(None, "torch.compile (default: the machine picks)", "runtime")
    seed: int = flag(1337, "seed for initialisation, dropout, shuffling and sampling", "runtime")
    ckpt_every: int = flag(1000, "checkpoint every N steps and at the end; 0: never", "checkpoints")
    resume: str = flag("", "checkpoint to go on from; auto: the newest in --log_dir", "checkpoints")

def machine_choices(cfg: TrainConfig, launch: Launch) -> TrainConfig:
    """"auto" made plain: this process's GPU, else Apple's, else the CPU; bfloat16 where the GPU
    has it (8.0+), float16 on older ones, else float32; compile on CUDA; the vocab's rows."""
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

def autocast_for(dtype: str, device: str):  # matmuls in dtype, softmax and the loss in float32
    return functools.partial(torch.autocast, device.split(":")[0], dtype=getattr(torch, dtype),
                             enabled=dtype != "float32")

def is_due(every: int, steps_done: int, last_step: bool) -> bool:
    return bool(every) and (steps_done % every == 0 or last_step)

def new_model(cfg: TrainConfig) -> GPT:  # of the flags' shape, the same on every rank (seeded)
    torch.manual_seed(cfg.seed)
    shape = {k: v for k, v in vars(cfg).items() if k in GPTConfig.__dataclass_fields__}
    return GPT(GPTConfig(**shape)).to(cfg.device)

def weights_to_score(model: GPT, scored: GPT | None = None) -> GPT:
    """The weights that validation, HellaSwag, samples and the run modes (checkpoints' "model")
    score: model's. For an EMA, return a copy (scored is None before step 0) and move it here."""
    return model

def shard_paths(data_dir, split) -> list[Path]:  # fineweb.py's PREFIX_{split}_000001.npy
    return sorted(Path(data_dir).glob(f"*_{split}_{'[0-9]' * 6}.npy"))

TrainResult = collections.namedtuple("TrainResult", "model run")  # (the model without DDP)
TEXT_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "input.txt")

class Run:
    """What train() reads and writes besides the model. main() hands train() its CheckedRun: it
    checks each input on every rank, writes files whole, adds the options where "main()'s" says."""

    def __init__(self, cfg: TrainConfig, launch: Launch):
        self.cfg, self.launch, self.records = cfg, launch, []

    def read_inputs(self) -> tuple:
        """Train and val tokens: fineweb.py's shards (mapped: read as used), or the text split
        90/10 (uint32: any tokenizer's ids); the checkpoint to resume (None: new); HellaSwag."""
        cfg = self.cfg
        if cfg.data_dir:
            streams = [TokenStream([np.load(path, mmap_mode="r") for path in shard_paths(
                cfg.data_dir, split)]) for split in ("train", "val")]
        else:
            text = Path(cfg.text_file or TEXT_FILE).read_text(encoding="utf-8")
            tokens = np.array(tokenizer().encode_ordinary(text), dtype=np.uint32)
            streams = [TokenStream([part]) for part in np.split(tokens, [len(tokens) * 9 // 10])]
        return (*streams, self.load_checkpoint(cfg.resume) if cfg.resume else None,
                self.hellaswag() if cfg.hellaswag_every else [])

    @staticmethod
    def load_checkpoint(path) -> dict:  # mmap: tensors are read from the file as they are used
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)

    def hellaswag(self) -> list[tuple]:  # this rank's share (main()'s: packed in fewer batches)
        lines = Path(self.cfg.hellaswag_path).read_text("utf-8").splitlines()  # a JSON record each
        return [render_hellaswag(json.loads(line), tokenizer())
                for line in lines[self.launch.rank :: self.launch.world_size]]

    def prepare(self, model: GPT) -> GPT:  # main()'s: --init_from's weights, --recompute...
        return model

    make_loader = DataLoader  # main()'s: --shuffle's loader
    make_optimizers = staticmethod(configure_optimizers)  # main()'s: Muon beside AdamW, ZeRO-1

    def log(self, line: str, record: dict | None = None):
        """Rank 0 prints the line, keeps its figures (main()'s checks a step's: NaN stops all)."""
        if self.launch.rank == 0:
            print(line, flush=True)
            self.records += [record] if record else []

    def log_scores(self, step, scores: dict):  # after step (-1: before training)
        self.log(f"step {step:5d}/{self.cfg.max_steps} | " + (
            f"val loss {scores['val_loss']:.6f}" if "val_loss" in scores else "HellaSwag acc_norm "
            f"{scores['hellaswag_acc_norm']:.4f} (acc {scores['hellaswag_acc']:.4f})"),
            {"step": step, **scores})

    def write_checkpoint(self, state: dict | None, steps_done):
        if state is not None:  # rank 0's
            os.makedirs(self.cfg.log_dir, exist_ok=True)
            torch.save(state, os.path.join(self.cfg.log_dir, f"ckpt_{steps_done}.pt"))

    def stop_requested(self, steps_done) -> bool:  # main()'s: a signal, --stop_after_steps
        return False

def train(cfg: TrainConfig, make_run=Run) -> TrainResult:
    """Build the model, the data and the optimizer, then train: every rank runs this. The run,
    make_run(cfg, launch), reads the inputs and writes the log and checkpoints."""
    launch = launch_from_env(os.environ)
    cfg = machine_choices(cfg, launch)  # (main() made them plain already)
    run, device = make_run(cfg, launch), cfg.device
    joins = launch.torchrun and not dist.is_initialized()  # (main() has joined)
    if joins:
        init_distributed(launch, device)
    train_tokens, val_tokens, checkpoint, hellaswag = run.read_inputs()
    raw_model = run.prepare(new_model(cfg))  # (main()'s: --init_from's weights, the options)
    scored = weights_to_score(raw_model)  # what is validated, sampled, saved as "model": see there
    # model trains. Compiled: fused kernels, fewer trips to memory. DDP: a copy a process;
    # gradients averaged in backward (a parameter a batch did not use, say an MoE's: as 0)
    model = torch.compile(raw_model) if cfg.compile else raw_model
    if launch.torchrun:
        model = DDP(model, gradient_as_bucket_view=True, find_unused_parameters=True)
    B, T, W = cfg.micro_batch_size, cfg.seq_len, launch.world_size
    train_loader = run.make_loader(train_tokens, B, T, launch.rank, W)  # (main()'s: --shuffle)
    val_loader = DataLoader(val_tokens, B, T, launch.rank, W)  # read from its start
    optimizers = run.make_optimizers(raw_model, cfg)
    for group in (group for optimizer in optimizers for group in optimizer.param_groups):
        group["lr_ratio"] = group["lr"] / cfg.max_lr  # a group given its own rate keeps its ratio
    # float16's narrow range: small gradients underflow unless the loss is scaled; bfloat16's not
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=cfg.dtype == "float16")
    start_step = checkpoint["step"] if checkpoint else 0
    if checkpoint:
        resume(checkpoint, raw_model, scored, optimizers, scaler, train_loader)
        run.log(f"resumed from step {start_step} (token {train_loader.position:,} of epoch "
                 f"{train_loader.epoch})")
    autocast, accum_steps = autocast_for(cfg.dtype, device), grad_accum_steps(cfg, W)
    if start_step == 0 and cfg.eval_every:  # the val loss before training: the curve's start
        run.log_scores(-1, {"val_loss": estimate_val_loss(scored, val_loader, cfg, launch)})

    for step in range(start_step, cfg.max_steps):
        started = time.perf_counter()
        raw_model.zero_grad(set_to_none=True)
        torch.manual_seed(cfg.seed + 1 + step * W + launch.rank)  # dropout's: a resume's the same
        loss = torch.zeros((), device=device)  # the step's mean loss, on this rank
        for micro_step in range(accum_steps):
            x, y = (to_device(batch, device) for batch in train_loader.next_batch())
            # DDP all-reduces the gradients in the last micro-step only: once a step
            sync = micro_step == accum_steps - 1 or not launch.torchrun
            with contextlib.nullcontext() if sync else model.no_sync():
                with autocast():
                    micro_loss = model(x, y)
                # gradients add up over micro-steps: each loss / accum_steps makes their sum the
                # gradient of the step's mean loss, as one big batch would give
                micro_loss = micro_loss / accum_steps
                scaler.scale(micro_loss).backward()  # float16: scaled so that none round to 0
            loss += micro_loss.detach()
        loss = all_reduce_mean(loss, launch)  # DDP averaged the gradients; this, the logged loss
        for optimizer in optimizers:
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
        ms = (time.perf_counter() - started) * 1000
        tokens_per_s = cfg.total_batch_size * 1000 / ms
        run.log(f"step {step:5d}/{cfg.max_steps} | loss {loss:.6f} | lr {lr:.4e} | norm "
                f"{grad_norm:.4f} | {ms:.0f} ms | {tokens_per_s:,.0f} tok/s", dict(step=step,
                train_loss=loss, lr=lr, grad_norm=grad_norm, ms=ms, tokens_per_s=tokens_per_s))

        steps_done, last_step = step + 1, step + 1 == cfg.max_steps
        if is_due(cfg.eval_every, steps_done, last_step):
            run.log_scores(step, {"val_loss": estimate_val_loss(scored, val_loader, cfg, launch)})
        if is_due(cfg.hellaswag_every, steps_done, last_step):
            run.log_scores(step, evaluate_hellaswag(scored, hellaswag, cfg, launch))
        stop = run.stop_requested(steps_done)  # main()'s run: a signal, --stop_after_steps
        if stop or is_due(cfg.ckpt_every, steps_done, last_step):
            state = checkpoint_state(raw_model, scored, optimizers, scaler, train_loader,
                                     steps_done, cfg, launch)
            run.write_checkpoint(state, steps_done)
        if launch.rank == 0 and is_due(cfg.sample_every, steps_done, last_step):
            print_samples(scored, cfg, autocast)
        if stop:
            break
    del model  # DDP: freed after the group ends, it would end it holding the GIL (#56297: hangs)
    if joins:  # all together, then end the group with nothing else holding it (see main()'s end)
        dist.barrier()
        dist.destroy_process_group()
    return TrainResult(raw_model, run)

def checkpoint_state(model, scored, optimizers, scaler, loader, steps_done, cfg, launch):
    """What a checkpoint holds, on rank 0 (None elsewhere): enough to go on exactly."""
    optimizer_states = [optimizer.state_dict() for optimizer in optimizers]  # ZeRO: all send
    return {"model": scored.state_dict(),  # the weights scored, and the trained (the same: once)
            "trained_model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
            "optimizer": optimizer_states, "scaler": scaler.state_dict(), "step": steps_done,
            "config": dataclasses.asdict(cfg), "data_epoch": loader.epoch,
            "data_position": loader.position} if launch.rank == 0 else None

def resume(checkpoint, model, scored, optimizers, scaler, loader):
    """Go on exactly: the weights, the optimizers' moments, the data's place."""
    scored.load_state_dict(checkpoint["model"])  # the weights scored (weights_to_score), and
    model.load_state_dict(checkpoint.get("trained_model", checkpoint["model"]))  # the trained
    for optimizer, state in zip(optimizers, checkpoint["optimizer"], strict=True):
        optimizer.load_state_dict(state)  # the moments, and each group's settings
    if checkpoint["scaler"]:
        scaler.load_state_dict(checkpoint["scaler"])
    loader.epoch, loader.position = checkpoint["data_epoch"], checkpoint["data_position"]

# ------------------------------ evaluation and sampling
@torch.no_grad()
def estimate_val_loss(model, loader, cfg: TrainConfig, launch: Launch) -> float:
    """Mean loss of the first --eval_steps validation steps: the same tokens every time."""
    model.eval()  # no dropout
    loader.epoch = loader.position = 0
    device, autocast = cfg.device, autocast_for(cfg.dtype, cfg.device)
    accum_steps = grad_accum_steps(cfg, launch.world_size)
    step_losses = torch.zeros(cfg.eval_steps, device=device)
    for step in range(cfg.eval_steps):
        for _ in range(accum_steps):
            x, y = (to_device(batch, device) for batch in loader.next_batch())
            with autocast():  # the logits' cross-entropy, even if training's loss adds terms
                step_losses[step] += model.cross_entropy(model.hidden_states(x), y) / accum_steps
    model.train()
    return all_reduce_mean(step_losses, launch).mean().item()

@torch.no_grad()
def evaluate_hellaswag(model: GPT, batches: list[tuple], cfg: TrainConfig, launch) -> dict:
    """Pick the likeliest of 4 endings. acc: the ending of lowest summed loss is right; acc_norm:
    of lowest mean loss a token (long endings are not penalised for their length)."""
    model.eval()
    device, autocast = cfg.device, autocast_for(cfg.dtype, cfg.device)
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

def render_hellaswag(example: dict, vocab) -> tuple:
    """A batch of one example: tokens (4, L), the context then each ending; mask (4, L), 1 on
    the endings' tokens; labels (1,), the right one's. (main()'s run packs many to a batch.)"""
    context = vocab.encode_ordinary(example["ctx"])
    rows = [context + vocab.encode_ordinary(" " + ending) for ending in example["endings"]]
    tokens, mask = torch.zeros(2, 4, max(len(row) for row in rows), dtype=torch.long)  # 0: pad
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, len(context) : len(row)] = 1
    return tokens, mask, torch.tensor([example["label"]])

def sample_next(model: GPT, idx, noise, temperature: float, n_vocab: int, caches=None,
                positions=None):
    """(B, 1): the token after idx (B, T) at positions (T,), drawn from the top k (noise's width)
    of n_vocab logits: softmax p, then argmax(p / E) for noise E ~ Exp(1) picks token i with
    probability p_i, as torch.multinomial would, with no host sync (--generate --compile)."""
    hidden = model.hidden_states(idx, caches, positions)[:, -1]  # (B, n_embd): the last position
    logits = model.logits(hidden)[:, :n_vocab].float() / temperature  # no padding rows
    top_logits, top_ids = torch.topk(logits, noise.size(1), dim=-1)
    choice = (F.softmax(top_logits, dim=-1) / noise).argmax(dim=-1, keepdim=True)
    return top_ids.gather(-1, choice)

@torch.no_grad()
def generate(model: GPT, prompt_tokens: list[int], max_new_tokens: int, num_samples=1,
             temperature=1.0, top_k=50, seed=0, autocast=contextlib.nullcontext,
             next_token=sample_next) -> list:
    """num_samples continuations, each token from its context's last block_size tokens (--generate
    passes a next_token that keeps a KV cache). An empty prompt starts from <|endoftext|>."""
    model.eval()
    device, vocab, block_size = model.lm_head.weight.device, tokenizer(), model.config.block_size
    tokens = torch.tensor(prompt_tokens or [vocab.eot_token], device=device).repeat(num_samples, 1)
    generator = torch.Generator(device=device).manual_seed(seed)  # training's RNG untouched
    top_k = min(top_k, model.config.vocab_size, vocab.n_vocab)
    with autocast():
        for _ in range(max_new_tokens):
            noise = torch.empty(num_samples, top_k, device=device).exponential_(generator=generator)
            new = next_token(model, tokens[:, -block_size:], noise, temperature, vocab.n_vocab)
            tokens = torch.cat([tokens, new], dim=1)
    model.train()
    return tokens[:, tokens.size(1) - max_new_tokens :].tolist()

def print_samples(model: GPT, cfg, autocast, next_token=sample_next):
    """Print (and return) --num_samples continuations of --prompt."""
    vocab = tokenizer()
    samples = generate(model, vocab.encode_ordinary(cfg.prompt), cfg.max_new_tokens,
                       cfg.num_samples, cfg.temperature, cfg.top_k, cfg.seed, autocast, next_token)
    texts = [cfg.prompt + vocab.decode(sample) for sample in samples]
    for i, text in enumerate(texts):
        print(f"sample {i}: {text}", flush=True)
    return texts

# ==== The machinery: nothing below is needed to learn or change the algorithm above. ==========
# ruff: noqa: E402 (the machinery's own imports)
import argparse
import difflib
import gc
import glob
import hashlib
import importlib.metadata
import importlib.util
import inspect
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
from torch.nn.attention import SDPBackend, sdpa_kernel

RESUME_AUTO = "run the same command with --resume auto"

class RunError(Exception):
    """Why a run cannot go on (a mistake, a full disk, a corrupt checkpoint, a diverged loss, an
    edit on one path alone): main() prints `error: ...` on rank 0; all exit 2."""

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
            if launch.restarts and checkpoint_paths(cfg.log_dir):  # torchrun restarted: go on
                notes = [*notes, f"torchrun's restart {launch.restarts}: going on from the newest "
                         f"checkpoint in {cfg.log_dir}"]
                cfg = dataclasses.replace(cfg, resume="auto")
            with catching_stop_signals(launch.rank == 0) as stop_signal:
                result = train(cfg, functools.partial(CheckedRun, stop_signal=stop_signal,
                                                      notes=notes))
                result.run.finish()
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
    # all leave here, a RunError past its except; what holds the group (DDP, ZeRO), in a cycle too
    # (a failed write's traceback), goes first: one left to Python's exit aborts it (#179291)
    if launch.torchrun:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    if status:
        sys.exit(status)
    return result

def parse_args(argv: list[str]) -> "Config":
    """A --flag per Config field; --model and --init_from fill in flags not given."""
    parser = _OneLineErrorParser(
        description="Pretrain GPT-2 (defaults: the 124M recipe on GPUs).", usage="%(prog)s [flags]",
        formatter_class=lambda prog: _OneLineHelp(prog, max_help_position=32))
    sections = dict.fromkeys(f.metadata["section"] for f in dataclasses.fields(Config))
    groups = {section: parser.add_argument_group(section) for section in sections}  # --help's
    for f in dataclasses.fields(Config):
        help_text = f.metadata["help"]  # with the default, unless it says it
        help_text += "" if "(default" in help_text else f" (default: {f.default})"
        value_type = (typing.get_args(f.type) or [f.type])[0]  # bool | None: bool
        options = {"action": argparse.BooleanOptionalAction} if value_type is bool else {
            "type": value_type, "choices": f.metadata["choices"], "metavar": value_type.__name__}
        for name in dict.fromkeys([f.name, f.name.replace("_", "-")]):  # --max-steps, unlisted
            groups[f.metadata["section"]].add_argument(f"--{name}", dest=f.name, **options,
                default=argparse.SUPPRESS, help=help_text if name == f.name else argparse.SUPPRESS)
    given = vars(parser.parse_args(argv))  # only the flags on the command line
    cfg = Config(**{**MODEL_SHAPES[given.get("model", "gpt2")], **given})
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

MODEL_SHAPES = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M; then 350M, 774M, 1558M
                "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
                "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),
                "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600)}

@dataclasses.dataclass
class Config(TrainConfig):
    """The recipe's flags and the options' (each hooked in by CheckedRun), the run modes'."""
    model: str = flag("gpt2", "gpt2, gpt2-medium, -large or -xl shape", "model", list(MODEL_SHAPES))
    shuffle: bool = flag(False, "a new seeded window order each epoch (off: in order)", "data")
    optimizer: str = flag("adamw", "muon: for the blocks' matrices; AdamW the rest", "optimizer",
                          ["adamw", "muon"])
    loss_chunk_size: int = flag(0, "loss N tokens at a time (less memory); 0: off", "runtime")
    recompute: bool = flag(False, "recompute activations in backward (less memory)", "runtime")
    shard_optimizer: bool = flag(False, "torchrun: share the optimizer state (ZeRO-1)", "runtime")
    peak_tflops: float | None = flag(None, "a GPU's peak TFLOP/s, for MFU (default: the machine "
                                     "picks)", "runtime")
    tensorboard: bool = flag(False, "also write the figures for TensorBoard", "logging")
    init_from: str = flag("", "start from gpt2, gpt2-medium, -large, -xl or a ckpt", "run modes")
    eval_only: bool = flag(False, "print the val loss and HellaSwag accuracy, exit", "run modes")
    generate: bool = flag(False, "print --num_samples continuations of --prompt, exit", "run modes")
    kv_cache: bool = flag(True, "generate with a key/value cache (faster)", "run modes")
    export_hf: str = flag("", "write --init_from as a transformers model here, exit", "run modes")
    keep_ckpts: int = flag(2, "keep the N newest checkpoints; 0: all", "checkpoints")
    stop_after_steps: int = flag(0, "end with a checkpoint after N steps; 0: never", "checkpoints")

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
def device_settings(cfg, launch) -> tuple[Config, list[str]]:
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
    """The recipe's Run, hardened: inputs checked on every rank first (one problem stops all),
    downloads, the options, files written whole, metrics.jsonl, and the run's stops."""

    def __init__(self, cfg, launch=None, stop_signal=None, notes=()):
        hellaswag_path = cfg.hellaswag_path or HELLASWAG_CACHE  # downloaded there once
        super().__init__(dataclasses.replace(cfg, hellaswag_path=hellaswag_path),
                         launch or launch_from_env(os.environ))
        self.stop_signal, self.notes = stop_signal or {"requested": False}, notes
        self.sources = {}  # the checkpoints read, by flag: the code that wrote them
        self.card = (torch.cuda.get_device_name(self.cfg.device)
                     if self.cfg.device.startswith("cuda") else "")
        self.path, self.problem = os.path.join(cfg.log_dir, "metrics.jsonl"), None
        self.step_ms, self.stop_reason, self.steps_done, self.initial = [], None, 0, None

    def read_inputs(self):
        """Every rank reads and checks them, then rank 0 opens the log; any problem stops all."""
        cfg, launch = self.cfg, self.launch

        def read():
            if (earlier := checkpoint_paths(cfg.log_dir)) and not cfg.resume:  # auto takes them
                raise RunError(f"--log_dir {cfg.log_dir} holds an earlier run's checkpoints "
                               f"({os.path.basename(earlier[0])}): continue it with --resume "
                               "auto, or pass another --log_dir")
            checkpoint = self.load_checkpoint(cfg.resume) if cfg.resume else None
            self.initial = self.init_from_weights() if cfg.init_from else None  # before downloads
            train_tokens, val_tokens = self.token_streams()
            check_token_counts((train_tokens, val_tokens), cfg, with_val=cfg.eval_every > 0)
            if checkpoint is not None:  # it fits the model new_model() or --init_from makes
                check_resumable(checkpoint, cfg, self.initial[0] if self.initial else GPTConfig(
                    **{k: v for k, v in vars(cfg).items() if k in GPTConfig.__dataclass_fields__}))
                checkpoint = self.resumable(checkpoint, train_tokens)
                step = checkpoint["step"]  # later ones: another branch, --resume auto's pick
                later = [os.path.basename(p) for p in earlier if int(Path(p).stem[5:]) > step]
                if later and cfg.resume != "auto":  # (auto skips only unreadable ones)
                    raise RunError(f"--log_dir {cfg.log_dir} holds {', '.join(later)}, later than "
                                   f"step {step} of --resume: move them, or use another --log_dir")
            return train_tokens, val_tokens, checkpoint, self.hellaswag() if cfg.hellaswag_every \
                else []
        self.inputs = inputs = on_every_rank(launch, read)
        checkpoint = inputs[2]
        found = gather((inputs[0].num_tokens, inputs[1].num_tokens,
                        checkpoint and checkpoint["step"]), launch)
        if len(set(found)) > 1:
            raise RunError(f"the ranks found different data or checkpoints ((train tokens, val "
                           f"tokens, checkpoint step) on each: {found}): give every machine the "
                           "same shards and a shared --log_dir")
        self.start_step = checkpoint["step"] if checkpoint else 0
        self.epoch = checkpoint["data_epoch"] if checkpoint else 0
        on_every_rank(launch, lambda: launch.rank == 0 and self.open_log(checkpoint))
        return inputs

    def token_streams(self) -> list:
        """The recipe's (train, val) tokens, their folder, files and ids checked."""
        cfg = self.cfg
        if cfg.data_dir:
            check_data_dir(cfg.data_dir)
        elif not cfg.text_file and not os.path.exists(TEXT_FILE):
            download(TINY_SHAKESPEARE_URL, TEXT_FILE,
                     "put a text file there, or pass --text_file or --data_dir")
        reader = Run(dataclasses.replace(cfg, resume="", hellaswag_every=0), self.launch)
        try:
            streams = reader.read_inputs()[:2]
        except (OSError, ValueError, EOFError) as error:  # (UnicodeDecodeError is a ValueError)
            raise RunError(unreadable_data(cfg, error)) from None
        dtype = np.dtype(np.uint16 if tokenizer().n_vocab <= 2**16 else np.uint32)  # fineweb.py's
        for tokens in (tokens for stream in streams for tokens in stream.arrays if cfg.data_dir):
            if tokens.dtype != dtype or tokens.ndim != 1 or len(tokens) < 1:
                raise RunError(f"shard {tokens.filename} holds {tokens.dtype} of shape "
                               f"{tokens.shape}, not a 1-D {dtype} array of tokens: rerun "
                               "fineweb.py")
        return [CheckedTokenStream(stream.arrays, tokenizer()) for stream in streams]

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
                self.log(f"warning: skipping {error}")
        self.log(f"--resume auto: no checkpoint in {cfg.log_dir}, starting from "
                 f"{cfg.init_from or 'scratch'}")
        return None

    def resumable(self, checkpoint, train_tokens):
        """The checkpoint in today's layout; what differs from it said, where a resume allows it."""
        cfg, saved, step = self.cfg, checkpoint["config"], checkpoint["step"]
        if "windows_consumed" in checkpoint:  # written before the place was counted in tokens
            T, windows = saved["seq_len"], checkpoint["windows_consumed"]
            epoch, window = divmod(windows, (checkpoint["train_tokens"] - 1) // T)
            checkpoint = {**checkpoint, "data_epoch": epoch, "data_position": window * T}
        if reshaped := changed(saved, cfg, ("seq_len", "micro_batch_size")):
            self.log(", ".join(f"--{name} {old} -> {new}" for name, (old, new) in reshaped.items())
                     + ": the data goes on from its next unread token, "
                     f"{checkpoint['data_position']:,} of epoch {checkpoint['data_epoch']}")
        tokens = train_tokens.num_tokens
        if checkpoint.get("train_tokens", tokens) != tokens:
            self.log(f"warning: the training data holds {tokens:,} tokens, the checkpoint's held "
                     f"{checkpoint['train_tokens']:,}: its data position points at other tokens "
                     "now; resume with the checkpoint's data to go on exactly")
        differing = changed(saved, cfg, [f.name for f in dataclasses.fields(Config)
                                         if f.metadata["section"] == "optimizer"])
        if differing:  # allowed (to extend a run)
            old = dataclasses.replace(cfg, **{k: v for k, (v, _) in differing.items()
                                              if v is not None})
            flags = ", ".join(f"--{k} {v} -> {now}" for k, (v, now) in differing.items())
            rate, saved_rate = lr_at(step, cfg), lr_at(step, old)  # the same: say the flags alone
            if rate != saved_rate or differing.keys() - {"max_lr", "min_lr_ratio", "warmup_steps",
                                                         "max_steps"}:
                self.log(f"warning: the optimizer and schedule differ from the checkpoint's "
                         f"({flags})" + (f": at step {step} the learning rate goes on at "
                         f"{rate:.4e} instead of {saved_rate:.4e}" if rate != saved_rate else ""))
        # the saved groups' settings that were the saved flags' become this run's flags'
        then, now = ({"weight_decay": c["weight_decay"], "eps": c["eps"],
                      "betas": (c["beta1"], c["beta2"])} for c in (saved, vars(cfg)))
        for state in checkpoint["optimizer"]:
            for group in state["param_groups"]:
                group.update({name: now[name] for name in now if group.get(name) == then[name]})
        return checkpoint

    @staticmethod
    def tokenizer():  # check_config's call comes first: tiktoken keeps what it loaded
        try:
            return tokenizer()
        except (OSError, ValueError) as error:  # offline; a damaged file
            raise RunError(f"cannot load the tokenizer ({type(error).__name__}): tiktoken "
                           "downloads its files once; connect to the network, or set "
                           "TIKTOKEN_CACHE_DIR to a folder that holds them") from None

    def hellaswag(self):
        """Downloaded once where no --hellaswag_path is given, each record checked, then the
        recipe's, packed in batches of up to 8,192 tokens: 4.9x faster."""
        path, block_size = self.cfg.hellaswag_path, self.cfg.block_size
        if not os.path.exists(path):
            download(HELLASWAG_URL, path, "pass --hellaswag_path with a local copy of it")
        check_hellaswag_records(path)
        batches = super().hellaswag()
        if (longest := max((tokens.size(1) for tokens, _, _ in batches), default=0)) > block_size:
            fix = "" if self.cfg.eval_only else ", or drop --hellaswag_every"
            raise UnavailableError(f"the longest HellaSwag example in {path} takes {longest} "
                                   f"tokens, more than the model's block_size of {block_size}: "
                                   f"HellaSwag needs --block_size {longest} or more{fix}")
        return pack_hellaswag(batches, min(8192, self.cfg.micro_batch_size * self.cfg.seq_len))

    def init_from_weights(self) -> tuple[GPTConfig, dict]:
        """--init_from's shape (with this run's dropout) and weights, checked."""
        saved = self.load_checkpoint(self.cfg.init_from)
        model_config = GPTConfig(**{**saved["model_config"], "dropout": self.cfg.dropout})
        check_vocabulary(self.sources.get("--init_from", {}), "--init_from", self.cfg.init_from)
        check_weights_fit(saved["model"], model_config, self.cfg.init_from, "--init_from")
        return model_config, saved["model"]

    def with_weights(self, model):
        """model holding --init_from's weights (a new one, if the flags gave another shape)."""
        if self.cfg.init_from:
            model_config, weights = self.initial or self.init_from_weights()
            if model_config != model.config:  # parse_args gave cfg its shape; code may not
                model = GPT(model_config).to(self.cfg.device)
            model.load_state_dict(weights)
        return model

    def prepare(self, model):
        """--init_from's weights, the options, the start line; then the check before step 0:
        training's logits are the cache's (an edit reached both)."""
        cfg, launch, checkpoint = self.cfg, self.launch, self.inputs[2]
        model = on_every_rank(launch, lambda: self.with_weights(model))
        self.model = model = with_options(model, cfg)
        self.start(model)
        check_paths_agree(model, cfg.device)
        if cfg.hellaswag_every and checkpoint is None:  # a batch, unlogged: an edit fails now
            evaluate_hellaswag(model, self.inputs[3][:1], cfg, launch)
        return model

    def make_loader(self, *args):  # the recipe's DataLoader, or --shuffle's
        self.loader = ShuffledLoader(*args, seed=self.cfg.seed) if self.cfg.shuffle else \
            DataLoader(*args)
        return self.loader

    def make_optimizers(self, model, cfg):
        return make_optimizers(model, cfg, self.launch)

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

    def log(self, line, record=None):
        """The recipe's, with the time left and MFU; then the files; then check_step."""
        if record and "train_loss" in record:
            line = self.time_left(record, line)
        if record and self.cfg.peak_tflops and "ms" in record:
            record["mfu"] = model_flops_utilization(self.flops_per_step, record["ms"],
                                                    self.cfg.peak_tflops, self.launch.world_size)
            line += f" | MFU {100 * record['mfu']:.1f}%"
        super().log(line, record)
        if record and self.launch.rank == 0 and not self.problem:
            size = os.path.getsize(self.path)
            try:
                with failed_write_is_one_line(self.path), open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
                if self.cfg.tensorboard:
                    self.write_events([record])
            except RunError as error:
                os.truncate(self.path, size)  # no half record left
                self.problem = str(error)
        if record and "train_loss" in record:
            self.check_step(record)

    def time_left(self, record, line):  # the median step so far, each step to come
        self.step_ms.append(record["ms"])
        left = datetime.timedelta(seconds=round(np.median(self.step_ms) / 1000 * (
            self.cfg.max_steps - record["step"] - 1)))
        return f"{line} | {left} left"

    def start(self, model):
        cfg, W, params = self.cfg, self.launch.world_size, count_parameters(model)
        accum_steps = grad_accum_steps(cfg, W)
        self.flops_per_step = cfg.total_batch_size * flops_per_token(model.config, params,
                                                                     cfg.seq_len)
        card = f", {self.card}" if self.card else ""
        mfu = (f", MFU against {cfg.peak_tflops:g} TFLOP/s" if cfg.peak_tflops else
               ", no MFU: its peak TFLOP/s is unknown, give --peak_tflops" if card else "")
        sharded = "optimizer state sharded over the processes; " * (cfg.shard_optimizer and W > 1)
        processes = f"{W} process{'es' * (W > 1)}"
        self.log("\n".join([*self.notes, (
            f"device {cfg.device}{card} ({cfg.dtype}, compile {'on' if cfg.compile else 'off'}"
            f"{mfu}), {processes}; {params:,} parameters; {cfg.total_batch_size:,} tokens per "
            f"step = {accum_steps} micro-step{'s' * (accum_steps > 1)} x {processes} x "
            f"{cfg.micro_batch_size} x {cfg.seq_len}; {sharded}"
            f"{self.inputs[0].num_tokens:,} train tokens" + (
                f"; flags not given: {cfg.init_from}'s seq_len, batch sizes, eval_steps"
                if os.path.isfile(cfg.init_from) else "") + "".join(
                f"; {flag} {saved['path']} was written by a train_gpt2.py {apart} line"
                f"{'s' * (apart > 1)} apart"
                for flag, saved, apart in self.code_changes()) + (
                "" if visible_is_causal(model.config.block_size) else "; visible() is not causal "
                "alone: attention takes its mask, not SDPA's fused causal kernel"))]))

    def code_changes(self):
        """(flag, checkpoint, lines added or removed) where a checkpoint's code differs."""
        this = Path(__file__).read_text().splitlines()
        for flag, saved in self.sources.items():
            if "source" not in saved:  # written before checkpoints held their code
                continue
            diff = difflib.unified_diff(saved["source"].splitlines(), this, n=0)
            if apart := sum(line[:1] in "+-" and line[:3] not in ("+++", "---") for line in diff):
                yield flag, saved, apart

    def check_step(self, record):
        """Every rank holds the same loss and norm: a diverged one stops all (float16's scaler
        skips an inf norm); a new run's first steps name a parameter no batch used; an epoch."""
        step, loss, grad_norm = record["step"], record["train_loss"], record["grad_norm"]
        if not (math.isfinite(loss) and (math.isfinite(grad_norm) or self.cfg.dtype == "float16")):
            self.diverged(step, loss, grad_norm)
        if self.inputs[2] is None and step < NO_GRADIENT_STEPS:  # a new run's first steps
            self.check_gradients(step)
        if self.loader.epoch > self.epoch:
            self.epoch, shuffled = self.loader.epoch, isinstance(self.loader, ShuffledLoader)
            self.log(f"step {step:5d}/{self.cfg.max_steps} | epoch {self.epoch} begins: all "
                     f"{self.loader.num_windows:,} training windows were used, starting again"
                     f"{' in a new order' if shuffled else ''}",
                     {"step": step, "epoch": self.epoch})

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

    def stop_requested(self, steps_done):
        """A signal to any rank, or --stop_after_steps (the job's end, not the run's); any rank's
        failed write or bad token stops all."""
        signalled = stop_or_fail_together(self.stop_signal["requested"], [self, *self.inputs[:2]],
                                          self.launch)
        cfg, self.steps_done = self.cfg, steps_done
        pause = steps_done - self.start_step == cfg.stop_after_steps and steps_done < cfg.max_steps
        self.stop_reason = ("a signal" if signalled else f"--stop_after_steps "
                            f"{cfg.stop_after_steps}" if pause else None)
        return self.stop_reason is not None

    def write_checkpoint(self, state, steps_done):
        path = os.path.join(self.cfg.log_dir, f"ckpt_{steps_done}.pt")
        on_every_rank(self.launch, lambda: state is not None and save_checkpoint(
            path, {**state, "source": Path(__file__).read_text(), "n_vocab": tokenizer().n_vocab,
                   "train_tokens": self.inputs[0].num_tokens}, self.cfg.keep_ckpts))

    def finish(self):
        cfg = self.cfg
        if self.stop_reason:
            self.log(f"stopped by {self.stop_reason} after step {self.steps_done - 1}, checkpoint "
                     f"{cfg.log_dir}/ckpt_{self.steps_done}.pt written: to continue, {RESUME_AUTO}")
        if self.step_ms:
            self.summary()
            if cfg.ckpt_every and (written := checkpoint_paths(cfg.log_dir)):
                self.log(f"last checkpoint: {written[0]}")  # this run's last write
        else:
            self.log(f"nothing to train: the checkpoint is at step {self.start_step} of "
                     f"--max_steps {cfg.max_steps}")
        stop_or_fail_together(False, [self], self.launch)  # rank 0's log failed: all stop

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
        self.log(line, {"summary": summary})

# A new run's first steps (all, if fewer): a parameter some batches skip (an MoE's expert, a gate)
# gets a gradient in them on some rank. Not after a resume: an expert may idle a while, by design
NO_GRADIENT_STEPS = 10

def count_parameters(model: nn.Module):
    return sum(p.numel() for p in model.parameters())  # the tied matrix once

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

# ------------------------------ the options, hooked in by CheckedRun
def with_options(model: GPT, cfg) -> GPT:
    """The model with --recompute, --loss_chunk_size and, where it may, SDPA's causal kernel."""
    if cfg.recompute:
        recompute_blocks(model)
    if cfg.loss_chunk_size:
        chunk_the_loss(model, cfg.loss_chunk_size)
    use_fused_causal(model)
    return model

def recompute_blocks(model: GPT):
    """--recompute: each block keeps its input alone and runs again in backward (PyTorch's
    activation checkpointing, wrapped around each block's forward)."""
    def recomputed(forward, *args):
        if not torch.is_grad_enabled():
            return forward(*args)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False)
    for block in dict.fromkeys(model.transformer.h):  # a block repeated: wrapped once
        block.forward = functools.partial(recomputed, block.forward)

def chunk_the_loss(model: GPT, chunk_size: int):
    """--loss_chunk_size: the recipe's cross_entropy over chunk_size tokens at a time, each slice's
    logits made again in backward: the float32 logits are never whole (12.3 GiB at 64 x 1024)."""
    def cross_entropy(self, x, targets, reduction="mean"):
        pairs = zip(x.flatten(0, -2).split(chunk_size), targets.flatten().split(chunk_size),
                    strict=True)
        per_token = torch.cat([torch.utils.checkpoint.checkpoint(
            type(self).cross_entropy, self, *pair, "none", use_reentrant=False) for pair in pairs])
        return per_token.mean() if reduction == "mean" else per_token
    model.cross_entropy = cross_entropy.__get__(model)  # bound: a copy (an EMA) scores its own

def use_fused_causal(model: GPT):
    """Training's attention leaves the mask to SDPA's causal kernel where visible() is causal."""
    fused = visible_is_causal(model.config.block_size)
    for module in model.modules():
        if hasattr(module, "fused_causal"):
            module.fused_causal = fused

@functools.cache
def visible_is_causal(block_size: int) -> bool:
    """Whether visible() is causal alone, asked for every token id in some row, then with
    <|endoftext|> at every 7th position: a mask keyed on tokens shows."""
    at, vocab = torch.arange(block_size, device="cpu"), tokenizer()
    inner = max(1, block_size - 2)  # row r holds ids r*inner - 1 to r*inner + block_size - 2
    rows = torch.arange(-1, vocab.n_vocab - 1, inner, device="cpu")[:, None] + at
    tokens = torch.cat([rows % vocab.n_vocab, torch.where(at % 7 == 3, vocab.eot_token, at)[None]])
    return all(bool((visible(at, at, some) == (at <= at[:, None])).all())
               for some in tokens.split(8))  # (8, T): masks of (8, 1, T, T) at a time

class ShuffledLoader(DataLoader):
    """--shuffle: each epoch reads its windows (at k * seq_len) in an order drawn from (seed,
    epoch); the place still counts tokens."""

    def __init__(self, *args, seed):
        super().__init__(*args)
        self.seed, self.order = seed, None

    def read_window(self, epoch, position):
        if self.order is None or self.order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self.order = epoch, rng.permutation(self.num_windows)
        window = int(self.order[1][position // self.seq_len])
        return super().read_window(epoch, window * self.seq_len)

def make_optimizers(model: GPT, cfg, launch) -> list:
    """The recipe's AdamW; --optimizer muon: Muon for the blocks' matrices (at AdamW's RMS: the
    same --max_lr and --weight_decay); --shard_optimizer: the state split over ranks (ZeRO-1)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    to_muon = {name for name, p in named if cfg.optimizer == "muon" and p.dim() == 2
               and name.startswith("transformer.h.")}
    optimizers = configure_optimizers(model, cfg, skip=to_muon)
    if to_muon:
        optimizers.append(torch.optim.Muon([p for name, p in named if name in to_muon],
                                           lr=cfg.max_lr, weight_decay=cfg.weight_decay,
                                           adjust_lr_fn="match_rms_adamw"))
    if cfg.shard_optimizer and launch.world_size > 1:
        optimizers = [sharded_over_ranks(optimizer, launch) for optimizer in optimizers]
    return optimizers

def sharded_over_ranks(optimizer, launch):
    """optimizer as ZeroRedundancyOptimizer's: state_dict(), on every rank, sends each share to
    rank 0, which returns it whole."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # here: it imports FSDP (slow)
    options = {name: value for name, value in optimizer.defaults.items()  # (defaults hold more)
               if name in inspect.signature(type(optimizer)).parameters}
    if "fused" in options:  # fused, sharded, it cannot load a checkpoint: PyTorch #124133
        options["fused"] = False
        for group in optimizer.param_groups:
            group["fused"] = False

    class Sharded(ZeroRedundancyOptimizer):  # (a closure over the instance: a cycle)
        def state_dict(self):
            self.consolidate_state_dict(to=0)
            return super().state_dict() if launch.rank == 0 else None
    return Sharded(optimizer.param_groups, optimizer_class=type(optimizer), **options)

def pack_hellaswag(batches: list[tuple], max_tokens) -> list[tuple]:
    """The recipe's batches of one example regrouped: (tokens, mask (4n, L), labels (n,)) of at
    most max_tokens, shortest first."""
    groups = []
    for example in sorted(batches, key=lambda example: example[0].size(1)):
        if not groups or 4 * (len(groups[-1]) + 1) * example[0].size(1) > max_tokens:
            groups.append([])
        groups[-1].append(example)
    pad = functools.partial(nn.utils.rnn.pad_sequence, batch_first=True)
    return [(pad([row for tokens, _, _ in group for row in tokens]),
             pad([row for _, mask, _ in group for row in mask]),
             torch.cat([labels for _, _, labels in group])) for group in groups]

def gather(value, launch: Launch) -> list:
    """Every rank's value (any picklable), in rank order, on every rank."""
    values = [value] * launch.world_size
    if launch.torchrun:
        dist.all_gather_object(values, value)
    return values

# ------------------------------ the paths check, before step 0
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
    full, caches, cached = model(tokens)[0], kv_caches(model), []  # (T, vocab_size)
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

def kv_caches(model: GPT) -> list["KVCache"]:
    return [KVCache(model.config.block_size) for _ in model.transformer.h]

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

def check_data_dir(data_dir):
    """A folder fineweb.py finished, holding train and val shards."""
    if not os.path.isdir(data_dir):
        raise RunError(f"--data_dir {data_dir} is not a folder: " + (
            f"for a text file, use --text_file {data_dir}" if os.path.isfile(data_dir) else
            "run fineweb.py to make shards, or fix the path"))
    if os.path.exists(os.path.join(data_dir, "INCOMPLETE")):  # fineweb.py's, until done
        raise RunError(f"--data_dir {data_dir} is incomplete (fineweb.py's INCOMPLETE file is "
                       "there): wait for fineweb.py, or rerun it with --resume")
    for split in ("train", "val"):
        if not shard_paths(data_dir, split):
            raise RunError(f"no {split} shards (*_{split}_*.npy) in --data_dir {data_dir}: "
                           "run fineweb.py to make them")

def unreadable_data(cfg, error) -> str:
    """What the recipe failed to read: the first shard that will not open, or the text file."""
    if not cfg.data_dir:
        path = cfg.text_file or TEXT_FILE
        if isinstance(error, FileNotFoundError):
            return (f"--text_file {path} does not exist: give a text file, or --data_dir with "
                    "fineweb.py's shards")
        reason = (error.strerror if isinstance(error, OSError) else
                  f"not UTF-8: {error.reason} at byte {error.start}")
        return f"cannot read --text_file {path} ({reason}): give a UTF-8 text file"
    for path in (path for split in ("train", "val") for path in shard_paths(cfg.data_dir, split)):
        try:
            np.load(path, mmap_mode="r")
        except OSError as error:  # a folder, no permission, a bad disk
            return f"cannot read shard {path} ({error.strerror or error}): check the file"
        except (ValueError, EOFError):  # no .npy header: numpy calls it "pickled data"
            return (f"cannot read shard {path}: it is not a .npy file (empty, cut short or "
                    "another format): delete it and rerun fineweb.py")
    raise error

def check_hellaswag_records(path):
    """Each line a HellaSwag record: "ctx", 4 "endings", the right one's "label"."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for line_number, line in enumerate(lines, 1):
        try:
            example = json.loads(line)
            endings, label = example["endings"], example["label"]
            valid = (isinstance(example["ctx"], str) and label in range(4) and isinstance(
                endings, list) and [type(ending) for ending in endings] == [str] * 4)
        except (json.JSONDecodeError, KeyError, TypeError):
            valid = False
        if not valid:
            raise RunError(f"{path} line {line_number} is not a HellaSwag record (ctx, 4 endings, "
                           "label 0-3)")
    if not lines:
        raise RunError(f"{path} holds no HellaSwag records: give hellaswag_val.jsonl's path")

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
    if unknown := [name for name in saved if name not in known | Config.__dataclass_fields__]:
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

CHECKPOINT_KEYS = {"model", "model_config", "optimizer", "scaler", "step", "config"}

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
            name = self.names[np.searchsorted(self.starts, start + at, side="right") - 1]
            self.problem = self.problem or (
                f"{name} holds token id {tokens[at]}, beyond the {n_vocab} tokens of "
                f"{self.vocab.name} (made with another tokenizer?): remake the shards with "
                "fineweb.py")
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
    model = with_options(CheckedRun(cfg).with_weights(new_model(cfg)), cfg)
    if not cfg.init_from:
        print("no --init_from: the samples come from untrained weights", flush=True)
    tokenizer, autocast = CheckedRun.tokenizer(), autocast_for(cfg.dtype, device)

    def next_token():  # a new one each call: its caches start empty
        caches, step = compiled_step(model, device) if cfg.compile else (kv_caches(model), None)
        return CachedNextToken(caches, step or sample_next) if cfg.kv_cache else sample_next
    started = time.perf_counter()
    with sdpa_kernel(WITHOUT_CUDNN):
        generate(model, tokenizer.encode_ordinary(cfg.prompt), GENERATE_WARMUP_TOKENS,
                 cfg.num_samples, cfg.temperature, cfg.top_k, cfg.seed, autocast, next_token())
        warm_up_s, started = time.perf_counter() - started, time.perf_counter()
        texts = print_samples(model, cfg, autocast, next_token())
    timed_s, tokens = time.perf_counter() - started, cfg.num_samples * cfg.max_new_tokens
    print(f"{tokens:,} tokens in {timed_s:.2f} s: {tokens / timed_s:,.1f} tokens/s (KV cache "
          f"{'on' if cfg.kv_cache else 'off'}, compile {'on' if cfg.compile else 'off'}, "
          f"{count_parameters(model):,} parameters), after an untimed warm-up of "
          f"{GENERATE_WARMUP_TOKENS} tokens a sample: {warm_up_s:.2f} s", flush=True)
    return texts

class CachedNextToken:
    """generate()'s next_token with a KV cache a layer: only the tokens the caches lack run (step:
    sample_next or a compiled copy); past block_size, the window is reread."""

    def __init__(self, caches: list[KVCache], step=sample_next):
        self.caches, self.step, self.length = caches, step, 0  # tokens the caches hold

    def __call__(self, model, window, noise, temperature, n_vocab):
        if window.size(1) <= self.length:  # slid: no cache holds its positions
            return sample_next(model, window, noise, temperature, n_vocab)
        fresh = torch.arange(self.length, window.size(1), device=window.device)  # positions
        step = self.step if self.length else sample_next  # the prompt's pass: eager
        self.length = window.size(1)
        return step(model, window[:, fresh], noise, temperature, n_vocab, self.caches, fresh)

GENERATE_WARMUP_TOKENS = 3  # --generate's untimed first call
# cuDNN's attention plans anew for each length (the prompt's, each window's): 64 tokens/s at 124M
WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

def compiled_step(model: GPT, device) -> tuple:
    """(caches, step) for CachedNextToken: sample_next compiled once, whole (or else eager), and
    the caches its graph reads in place, kept with it."""
    if model not in COMPILED_STEPS:
        compiled = torch.compile(sample_next, fullgraph=True,
                                 mode="reduce-overhead" if device.startswith("cuda") else None)

        def step(model, idx, noise, temperature, n_vocab, caches, positions):
            nonlocal compiled
            args = noise, temperature, n_vocab, caches, positions
            for cache in caches:  # the graph reads them in place
                for tensor in (cache.keys, cache.values, cache.tokens):
                    torch._dynamo.mark_static_address(tensor, guard=False)
            try:  # on a copy: the graph's next run overwrites its last output
                return compiled(model, idx.clone(), *args)
            except (torch._dynamo.exc.TorchDynamoException,  # raised tracing: nothing has run
                    torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode) as error:
                print("--compile: sample_next cannot be compiled whole "  # a branch on data (MoE)
                      f"({str(error).splitlines()[0]}): generating eagerly", flush=True)
                compiled = sample_next
                return sample_next(model, idx, *args)
        COMPILED_STEPS[model] = (kv_caches(model), step)
    return COMPILED_STEPS[model]

COMPILED_STEPS = weakref.WeakKeyDictionary()  # (caches, step) a model

def evaluate_only(cfg, launch, device):
    """Val loss and HellaSwag accuracy (if its file can be had)."""
    run = CheckedRun(cfg, launch)

    def read():
        streams = run.token_streams()
        check_token_counts(streams, cfg, with_val=True)
        model = with_options(run.with_weights(new_model(cfg)), cfg)
        try:
            return streams[1], model, run.hellaswag(), None
        except UnavailableError as error:
            return streams[1], model, None, f"HellaSwag skipped: {error}"
    val_tokens, model, hellaswag, missing = on_every_rank(launch, read)
    missing = next(filter(None, gather(missing, launch)), None)  # all skip it, or none
    val_loader = DataLoader(val_tokens, cfg.micro_batch_size, cfg.seq_len, launch.rank,
                            launch.world_size)
    result = {"val_loss": estimate_val_loss(model, val_loader, cfg, launch)}
    stop_or_fail_together(False, [val_tokens], launch)  # stops on bad tokens
    if missing is None:
        result.update(evaluate_hellaswag(model, hellaswag, cfg, launch))
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
    (model_config, state), vocab = CheckedRun(cfg).init_from_weights(), CheckedRun.tokenizer()
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
        expected = ours.eval()(tokens)[..., :vocab.n_vocab]  # (2, T, n_vocab)
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
