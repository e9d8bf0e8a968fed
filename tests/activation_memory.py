"""Predict GPT-2 124M's GPU memory at micro batch 64 x 1024 with --no-compile (a figure for the README, not a test).

    python3 tests/activation_memory.py [--micro_batch_size 64]

Runs one forward pass of the 124M model on the CPU for 2 sequences of 1024 tokens under bf16 autocast, as
the GPU would with compile off, and adds up the tensors autograd saves for backward (torch's
saved_tensors_hooks), each storage once. Those shaped like a parameter or its transpose (autocast's
bfloat16 weight copies, the chunked loss's float32 gradient of the embedding) do not grow with the batch;
the rest are scaled to the micro batch asked for. On top: float32 weights, gradients and AdamW's two
moments (16 bytes a parameter), and the chunked loss's slice of logits (float32, and a bfloat16 copy).
Not counted: kernel workspaces and the allocator's slack; the attention kernel saves what the CPU one
saves (output and log-sum-exp, as flash attention does).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt2  # noqa: E402

GIB = 2**30
LOSS_CHUNK_SIZE = 8192  # --loss_chunk_size 8192, as the out-of-memory line suggests


def saved_bytes(model: train_gpt2.GPT, batch_size: int, seq_len: int) -> tuple[int, int]:
    """(bytes saved for backward that grow with the batch, bytes that do not) for one forward."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    x = torch.randint(0, model.config.vocab_size, (batch_size, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x, x)
    weight_shapes = {tuple(sorted(p.shape)) for p in model.parameters()}  # sorted: a matmul may save W.T
    batch_bytes = fixed_bytes = 0
    for pointer, tensor in storages.items():
        if pointer in parameter_storages:
            continue
        size = tensor.untyped_storage().nbytes()
        if tuple(sorted(tensor.shape)) in weight_shapes:
            fixed_bytes += size
        else:
            batch_bytes += size
    return batch_bytes, fixed_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro_batch_size", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = train_gpt2.GPT(train_gpt2.GPTConfig(12, 12, 768, block_size=1024, vocab_size=50304))  # GPT-2 124M
    train_gpt2.with_options(model, train_gpt2.Config(loss_chunk_size=LOSS_CHUNK_SIZE))  # as a run's model
    measured_batch, seq_len = 2, 1024
    batch_bytes, fixed_bytes = saved_bytes(model, measured_batch, seq_len)
    num_params = train_gpt2.count_parameters(model)
    activations = batch_bytes / measured_batch * args.micro_batch_size
    states = 16 * num_params  # float32 weights, gradients, AdamW exp_avg and exp_avg_sq
    logits_slice = LOSS_CHUNK_SIZE * model.config.vocab_size * (4 + 2)  # float32 logits + a bfloat16 copy
    print(f"saved for backward: {batch_bytes / measured_batch / 2**20:.1f} MiB a sequence of {seq_len} tokens, "
          f"{fixed_bytes / 2**20:.0f} MiB that do not grow with it (weight copies, the loss's weight gradient)")
    print(f"micro batch {args.micro_batch_size} x {seq_len}: activations {activations / GIB:.2f} GiB + weights, "
          f"gradients and AdamW state {states / GIB:.2f} GiB + {fixed_bytes / GIB:.2f} GiB + "
          f"one loss slice {logits_slice / GIB:.2f} GiB = "
          f"{(activations + states + fixed_bytes + logits_slice) / GIB:.1f} GiB")


if __name__ == "__main__":
    main()
