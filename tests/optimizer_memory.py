"""Peak memory of each process of a 2-process DDP run of the GPT-2 124M shape on the CPU, with AdamW plain or sharded
(--shard_optimizer, ZeRO stage 1): a figure for the README, not a test.

    torchrun --standalone --nproc_per_node=2 tests/optimizer_memory.py                     # plain AdamW
    torchrun --standalone --nproc_per_node=2 tests/optimizer_memory.py --shard_optimizer

Each process trains 3 steps on one sequence of 64 tokens, so that weights, gradients and AdamW's moments dominate
its memory, and prints its peak resident memory and how many parameters it keeps AdamW state for. No checkpoint is
written: when one is, a sharded run gathers the whole state on rank 0 for that moment.
"""

import os
import resource
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt2  # noqa: E402


def main():
    cfg = train_gpt2.parse_args(sys.argv[1:])
    launch = train_gpt2.launch_from_env(os.environ)
    train_gpt2.init_distributed(launch, "cpu")
    torch.manual_seed(0)
    raw_model = train_gpt2.GPT(train_gpt2.GPTConfig(n_layer=12, n_head=12, n_embd=768))
    model = DDP(raw_model, gradient_as_bucket_view=True)
    sharded = cfg.shard_optimizer
    [optimizer] = train_gpt2.make_optimizers(raw_model, cfg, launch)  # --shard_optimizer: ZeRO-1's
    tokens = torch.randint(0, 50257, (1, 64), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(tokens, tokens).backward()  # the loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = optimizer.optim.state if sharded else optimizer.state  # ZeRO's own AdamW holds this rank's share
    with_state = sum(param.numel() for param in state)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    print(f"rank {launch.rank}, AdamW {'sharded' if sharded else 'plain'}: state for {with_state:,} of "
          f"{train_gpt2.count_parameters(raw_model):,} parameters, peak resident memory {peak_gib:.2f} GiB",
          flush=True)
    del model  # its reducer holds the group: freed after it, gloo can deadlock (see ddp_entry.py's grad_sync)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
