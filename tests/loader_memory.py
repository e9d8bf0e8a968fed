"""Print the loader's memory while it streams through 4 shards (a figure for the README, not a test).

    python3 tests/loader_memory.py

Writes 4 shards of 25M tokens (50 MB each) to a temporary folder and reads every window once, shuffled,
in batches of 64 x 1024 tokens. Resident memory is reported from /proc/self/status (Linux) in two parts:
RssAnon, memory the process owns (the batches), and RssFile, shard pages the kernel mapped in, which it
drops again under memory pressure. Loading the shards as int64 arrays instead would own 200 MB a shard.
"""

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt2  # noqa: E402


def memory_mib() -> dict:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) / 1024
    return fields


def main():
    shard_tokens, B, T = 25_000_000, 64, 1024
    with tempfile.TemporaryDirectory() as folder:
        for i in range(4):
            np.save(Path(folder) / f"mem_train_{i:06d}.npy",
                    np.random.default_rng(i).integers(0, 50257, shard_tokens, dtype=np.uint16))
        stream = train_gpt2.TokenStream([np.load(path, mmap_mode="r")  # as a run maps them
                                         for path in train_gpt2.shard_paths(folder, "train")])
        loader = train_gpt2.ShuffledLoader(stream, B, T, 0, 1, seed=0)  # --shuffle's
        before = memory_mib()
        started = time.perf_counter()
        while loader.epoch == 0:
            loader.next_batch()
        elapsed = time.perf_counter() - started
        after = memory_mib()
    print(f"streamed {loader.num_windows:,} windows ({stream.num_tokens:,} tokens in 4 shards) in {elapsed:.1f} s")
    print(f"RssAnon (owned) before {before['RssAnon']:.0f} MiB, after {after['RssAnon']:.0f} MiB; "
          f"RssFile (mapped shard pages) before {before['RssFile']:.0f} MiB, after {after['RssFile']:.0f} MiB")


if __name__ == "__main__":
    main()
