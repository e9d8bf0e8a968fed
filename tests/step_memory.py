"""Peak memory and time of one forward + backward, with the loss chunked or plain and the blocks recomputed or not
(a figure for the README, not a test).

    python3 tests/step_memory.py --loss_chunk_size 1024      # or 0 (the default): the plain loss over full logits
    python3 tests/step_memory.py --recompute --n_layer 12 --n_head 12 --n_embd 768 --batch_size 4   # GPT-2 124M
    python3 tests/step_memory.py --code DIR ...               # DIR/train_gpt2.py instead of this checkout's

By default a 2-layer, width-64 GPT on 8 x 1024 tokens with the 50304-token vocabulary, float32 on the CPU, so the
(tokens, vocab) logits dominate: one float32 copy of them is 8192 x 50304 x 4 bytes = 1.54 GiB. With the shape
flags, the blocks' activations dominate instead. Run each setting in its own process: the peak resident memory
(ru_maxrss) only ever grows.
"""

import argparse
import resource
import sys
import time
from pathlib import Path

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss_chunk_size", type=int, default=0)
    parser.add_argument("--recompute", action="store_true", help="recompute the blocks in backward")
    parser.add_argument("--hold_logits", action="store_true", help="keep forward's logits through backward")
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_head", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=8, help="sequences of 1024 tokens")
    parser.add_argument("--code", default=str(Path(__file__).resolve().parents[1]), help="folder of train_gpt2.py")
    args = parser.parse_args()
    sys.path.insert(0, args.code)
    import train_gpt2

    torch.manual_seed(0)
    config = train_gpt2.GPTConfig(args.n_layer, args.n_head, args.n_embd, block_size=1024, vocab_size=50304)
    model = train_gpt2.GPT(config)
    if hasattr(train_gpt2, "with_options"):  # the options wrap the recipe's model, as a run's
        train_gpt2.with_options(model, train_gpt2.Config(loss_chunk_size=args.loss_chunk_size,
                                                         recompute=args.recompute))
    else:  # a train_gpt2.py before issue 70 (--code): the model's attributes
        model.loss_chunk_size, model.recompute = args.loss_chunk_size, args.recompute
    tokens = torch.randint(0, 50304, (args.batch_size, 1024))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
    started = time.perf_counter()
    out = model(tokens, tokens)  # the loss; (logits, loss) from a train_gpt2.py of issues 50 to 69 (--code)
    loss = out[1] if isinstance(out, tuple) else out
    if not args.hold_logits:  # as train() does: the logits let go before backward
        del out
    loss.backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"loss_chunk_size {args.loss_chunk_size}, recompute {'on' if args.recompute else 'off'}: loss "
          f"{loss.item():.6f}, forward + backward {seconds:.1f} s, peak resident memory {before:.2f} -> {peak:.2f} GiB")


if __name__ == "__main__":
    main()
