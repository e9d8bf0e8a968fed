"""Time --eval_only's HellaSwag scoring on made-up records shaped like HellaSwag's (a figure for the README, not a
test).

    python3 tests/hellaswag_speed.py [--examples 500] [--code DIR] [-- MODEL FLAGS]   # DIR/train_gpt2.py instead

No copy of HellaSwag is at hand offline, so the records are drawn from tiny Shakespeare's words with lengths like
HellaSwag's (a context of 10 to 90 words, four endings of 5 to 30 words each; HellaSwag's contexts run from one
short ActivityNet sentence to a few WikiHow steps). The labels are random: the accuracy printed only shows that
two versions of the code chose the same endings. Runs `train_gpt2.py --eval_only` in this process with one
validation step, so the time is nearly all HellaSwag's.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
QUICK_START_MODEL = ["--n_layer", "4", "--n_head", "4", "--n_embd", "128", "--block_size", "256"]


def made_up_records(count: int, seed: int = 0) -> list[dict]:
    words = SHAKESPEARE.read_text().split()
    rng = random.Random(seed)

    def text(low, high):
        start = rng.randrange(len(words) - high)
        return " ".join(words[start : start + rng.randint(low, high)])

    return [{"ctx": text(10, 90), "endings": [text(5, 30) for _ in range(4)], "label": rng.randrange(4)}
            for _ in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--code", default=str(ROOT), help="folder of train_gpt2.py")
    parser.add_argument("model_flags", nargs="*", default=QUICK_START_MODEL)
    args = parser.parse_args()
    sys.path.insert(0, args.code)
    import train_gpt2

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hellaswag_made_up.jsonl"
        path.write_text("".join(json.dumps(record) + "\n" for record in made_up_records(args.examples)))
        flags = args.model_flags + [
            "--eval_only", "--hellaswag_path", str(path), "--text_file", str(SHAKESPEARE), "--device", "cpu",
            "--seq_len", "128", "--micro_batch_size", "8", "--total_batch_size", "1024", "--eval_steps", "1",
            "--log_dir", folder]
        started = time.perf_counter()
        result = train_gpt2.main(train_gpt2.parse_args(flags))
        seconds = time.perf_counter() - started
    print(f"{args.examples} examples in {seconds:.1f} s ({1000 * seconds / args.examples:.1f} ms an example); "
          f"acc {result['hellaswag_acc']:.4f}, acc_norm {result['hellaswag_acc_norm']:.4f}")


if __name__ == "__main__":
    main()
