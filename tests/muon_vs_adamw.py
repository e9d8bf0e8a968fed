"""--optimizer adamw against muon at equal tokens, each at its best peak learning rate from a small sweep: a figure
for the README, not a test.

    python3 tests/muon_vs_adamw.py                                   # the README's figures: 18 minutes on 2 cores
    python3 tests/muon_vs_adamw.py --optimizers muon --lrs 2.4e-2,4.8e-2                   # and the larger rates
    python3 tests/muon_vs_adamw.py --lrs 1e-3,2e-3 -- --n_layer 6 --n_head 6 --n_embd 384     # another shape

Each run trains a fresh model (4 layers, width 128 by default) for 300 steps of 16 x 64 tokens of tiny Shakespeare
with warmup and cosine decay, then prints its val loss (over 20 batches of the held-out tenth) and its median time
a step. Flags after `--` go to train_gpt2.py after these defaults (the last value of a flag wins).
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt2  # noqa: E402

DEFAULTS = ["--n_layer", "4", "--n_head", "4", "--n_embd", "128", "--block_size", "64", "--seq_len", "64",
            "--micro_batch_size", "16", "--total_batch_size", "1024", "--max_steps", "300", "--warmup_steps", "30",
            "--eval_every", "300", "--eval_steps", "20", "--sample_every", "0", "--ckpt_every", "0"]


def train(optimizer: str, lr: float, flags: list[str], log_dir: str) -> tuple[float, float]:
    """(the last val loss, the median ms a step) of one run."""
    cfg = train_gpt2.parse_args(DEFAULTS + flags + ["--optimizer", optimizer, "--max_lr", str(lr),
                                                    "--log_dir", log_dir])
    records = train_gpt2.main(cfg).run.records
    val_loss = [r["val_loss"] for r in records if "val_loss" in r][-1]
    return val_loss, next(r["summary"]["median_ms"] for r in records if "summary" in r)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", default="1.5e-3,3e-3,6e-3,1.2e-2", help="peak learning rates to sweep")
    parser.add_argument("--optimizers", default="adamw,muon", help="which of the two to run")
    parser.add_argument("flags", nargs="*", help="train_gpt2.py flags, after --")
    args = parser.parse_args()
    lrs, optimizers = [float(lr) for lr in args.lrs.split(",")], args.optimizers.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for optimizer in optimizers:
            for lr in lrs:
                val_loss, ms = train(optimizer, lr, args.flags, f"{folder}/{optimizer}-{lr}")
                results[optimizer, lr] = val_loss, ms
                print(f"RESULT {optimizer} max_lr {lr:g}: val loss {val_loss:.4f}, {ms:.1f} ms/step", flush=True)
    print(f"\n| max lr | {' | '.join(f'{lr:g}' for lr in lrs)} |\n| --- |{' --- |' * len(lrs)}")
    for optimizer in optimizers:
        print(f"| {optimizer} | {' | '.join(f'{results[optimizer, lr][0]:.3f}' for lr in lrs)} |")
    for optimizer in optimizers:
        lr = min(lrs, key=lambda lr: results[optimizer, lr][0])
        print(f"best {optimizer}: max_lr {lr:g}, val loss {results[optimizer, lr][0]:.4f}, median "
              f"{results[optimizer, lr][1]:.1f} ms/step")


if __name__ == "__main__":
    main()
