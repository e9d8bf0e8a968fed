"""Time --eval_only's HellaSwag scoring on made-up records shaped like HellaSwag's (a figure for the README, not a
test).

    python3 tests/hellaswag_speed.py [--examples 500] [--code DIR] [-- FLAGS]   # DIR/train_gpt2.py instead

FLAGS are train_gpt2.py's: the model's shape (default: the quick-start model with --block_size 256), and for
a GPU `--device cuda --seq_len 1024 --total_batch_size 8192` (batches of up to 8,192 tokens, as in training).

No copy of HellaSwag is at hand offline, so the records are drawn from tiny Shakespeare's words with lengths like
HellaSwag's (a context of 10 to 90 words, four endings of 5 to 30 words each; HellaSwag's contexts run from one
short ActivityNet sentence to a few WikiHow steps). The labels are random: the accuracy printed only shows that
two versions of the code chose the same endings. Runs `train_gpt2.py --eval_only` in this process, and times
its call of evaluate_hellaswag, the scoring (in 4b9a546 and before, that call also tokenized every example; now
that is done once a run, before it), as well as the whole run.
"""

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "input.txt"  # the made-up records' words: the tiny Shakespeare a first training run downloads
QUICK_START_MODEL = ["--n_layer", "4", "--n_head", "4", "--n_embd", "128", "--block_size", "256"]


def made_up_records(count: int, seed: int = 0) -> list[dict]:
    if not SHAKESPEARE.exists():
        sys.exit(f"{SHAKESPEARE} is missing: run python3 train_gpt2.py once to download it, or copy it there")
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
        flags = [
            "--eval_only", "--hellaswag_path", str(path), "--text_file", str(SHAKESPEARE), "--device", "cpu",
            "--seq_len", "128", "--micro_batch_size", "8", "--total_batch_size", "1024", "--eval_steps", "1",
            "--log_dir", folder] + args.model_flags  # given last, so that they win
        scoring_seconds = []
        evaluate_hellaswag = train_gpt2.evaluate_hellaswag

        def timed_evaluate_hellaswag(*args, **kwargs):  # the same name and use in every version of the code
            started = time.perf_counter()
            scores = evaluate_hellaswag(*args, **kwargs)  # ends reading the counts: the device is done
            scoring_seconds.append(time.perf_counter() - started)
            return scores

        train_gpt2.evaluate_hellaswag = timed_evaluate_hellaswag
        started = time.perf_counter()
        result = train_gpt2.main(train_gpt2.parse_args(flags))
        seconds = time.perf_counter() - started
    scored = scoring_seconds[0]
    print(f"{args.examples} examples: scored in {scored:.2f} s ({1000 * scored / args.examples:.1f} ms an example), "
          f"{seconds:.1f} s in all with tokenizing, the model and one validation step; "
          f"acc {result['hellaswag_acc']:.4f}, acc_norm {result['hellaswag_acc_norm']:.4f}")


if __name__ == "__main__":
    main()
