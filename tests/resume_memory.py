"""Memory a process holds once it has read a checkpoint of the GPT-2 124M shape (weights and AdamW's moments, 1.5 GB)
with read_checkpoint, as every process does on --resume: a figure for the README, not a test.

    python3 tests/resume_memory.py DIR

Writes DIR/ckpt_1.pt unless it is there, reads it back in a fresh process, reads every tensor through (as copying
it to a GPU does) and prints the process's private memory and the file pages it has mapped. Private memory is each
process's own; file pages are the kernel's page cache, one copy for all the processes on a machine, and dropped
under memory pressure.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt2  # noqa: E402


def write_checkpoint(path: str) -> None:
    model = train_gpt2.GPT(train_gpt2.GPTConfig(n_layer=12, n_head=12, n_embd=768))
    [optimizer] = train_gpt2.configure_optimizers(model, train_gpt2.parse_args([]))
    tokens = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()  # the loss
    optimizer.step()  # creates AdamW's two moments for every weight
    state = {"model": model.state_dict(), "model_config": vars(model.config), "optimizer": [optimizer.state_dict()],
             "scaler": {}, "step": 1, "config": {}, "data_epoch": 0, "data_position": 0}  # what a checkpoint holds
    train_gpt2.save_checkpoint(path, state, keep=0)


def resident_gib() -> dict[str, float]:
    """Private (RssAnon) and file-backed (RssFile) resident memory of this process, from /proc (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) / 2**20 for name in ("RssAnon", "RssFile")}  # KiB -> GiB


def read_back(path: str) -> None:
    before = resident_gib()
    checkpoint = train_gpt2.read_checkpoint(path)
    tensors = [*checkpoint["model"].values()] + [
        value for state in checkpoint["optimizer"][0]["state"].values() for value in state.values()]
    total = sum(float(tensor.sum()) for tensor in tensors)
    after = resident_gib()
    print(f"read {os.path.getsize(path) / 2**30:.2f} GiB ({len(tensors)} tensors, sum {total:.4g}): private memory "
          f"{before['RssAnon']:.2f} -> {after['RssAnon']:.2f} GiB, mapped file pages {before['RssFile']:.2f} -> "
          f"{after['RssFile']:.2f} GiB")


if __name__ == "__main__":
    if sys.argv[1] == "--read":
        read_back(sys.argv[2])
    else:
        checkpoint_path = os.path.join(sys.argv[1], "ckpt_1.pt")
        if not os.path.exists(checkpoint_path):
            write_checkpoint(checkpoint_path)
        subprocess.run([sys.executable, __file__, "--read", checkpoint_path], check=True)
