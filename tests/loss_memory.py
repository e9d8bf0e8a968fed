"""Peak memory and time of forward + backward through the loss, chunked or plain (a figure for the README, not a test).

    python3 tests/loss_memory.py --loss_chunk_size 8192      # or 0: the plain loss over full logits
    python3 tests/loss_memory.py --code DIR ...               # DIR/train_gpt2.py instead of this checkout's

A 2-layer, width-64 GPT on 8 x 1024 tokens with the 50304-token vocabulary, float32 on the CPU, so the
(tokens, vocab) logits dominate: one float32 copy of them is 8192 x 50304 x 4 bytes = 1.54 GiB. Run each
setting in its own process: the peak resident memory (ru_maxrss) only ever grows.
"""

import argparse
import resource
import sys
import time
from pathlib import Path

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss_chunk_size", type=int, default=8192)
    parser.add_argument("--code", default=str(Path(__file__).resolve().parents[1]), help="folder of train_gpt2.py")
    args = parser.parse_args()
    sys.path.insert(0, args.code)
    import train_gpt2

    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(2, 2, 64, block_size=1024, vocab_size=50304))
    model.loss_chunk_size = args.loss_chunk_size
    tokens = torch.randint(0, 50304, (8, 1024))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    started = time.perf_counter()
    loss = model(tokens, tokens)
    loss.backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"loss_chunk_size {args.loss_chunk_size}: loss {loss.item():.6f}, forward + backward {seconds:.1f} s, "
          f"peak resident memory {before:.2f} -> {peak:.2f} GiB")


if __name__ == "__main__":
    main()
