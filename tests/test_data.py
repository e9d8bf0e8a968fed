import numpy as np
import pytest
import torch

import train_gpt2 as t
from conftest import SHAKESPEARE


def arange_stream(n, pieces=1):
    """Token i has id i, so every batch shows exactly where it was read from."""
    return t.TokenStream(np.array_split(np.arange(n, dtype=np.uint16), pieces))


def windows(loader, count):
    """Start token of each sequence in the next `count` batches."""
    return [int(row[0]) for _ in range(count) for row in loader.next_batch()[0]]


def test_first_batches_are_contiguous_windows_with_targets_shifted_by_one():
    loader = t.DataLoader(arange_stream(100), batch_size=2, seq_len=4, rank=0, world_size=1, tokens_per_step=16,
                          name="training")
    x, y = loader.next_batch()
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert x.dtype == torch.int64
    x, y = loader.next_batch()
    assert x.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert y.tolist() == [[9, 10, 11, 12], [13, 14, 15, 16]]


def test_wraps_to_the_start_when_a_whole_step_no_longer_fits():
    # steps of 16 tokens need 17; 100 tokens hold steps at 0, 16, ..., 80 (80 + 17 = 97), not at 96
    loader = t.DataLoader(arange_stream(100), 2, 4, 0, 1, tokens_per_step=16, name="training")
    starts = windows(loader, 14)
    assert starts == list(range(0, 96, 4)) + [0, 4, 8, 12]


def test_second_rank_reads_the_second_micro_batch():
    loader = t.DataLoader(arange_stream(100), 2, 4, rank=1, world_size=2, tokens_per_step=16, name="training")
    assert loader.next_batch()[0].tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert loader.next_batch()[0].tolist() == [[24, 25, 26, 27], [28, 29, 30, 31]]  # advanced by 2 x 8 tokens


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_partition_the_single_process_windows_across_shard_boundaries(world_size):
    """W ranks with B each see exactly the windows one process sees with the same total batch."""
    stream = arange_stream(1000, pieces=7)  # shard boundaries every ~143 tokens, inside windows too
    B, T, steps, tokens_per_step = 2, 5, 6, 40  # 40 tokens a step: 4 micro-batches of 2 x 5 for one process
    single = t.DataLoader(stream, B, T, 0, 1, tokens_per_step, "training")
    single_windows = windows(single, steps * tokens_per_step // (B * T))
    per_rank = [windows(t.DataLoader(stream, B, T, r, world_size, tokens_per_step, "training"),
                        steps * tokens_per_step // (B * T * world_size)) for r in range(world_size)]
    all_ranks = sorted(s for rank_windows in per_rank for s in rank_windows)
    assert all_ranks == sorted(single_windows) == list(range(0, steps * tokens_per_step, T))


def test_read_spans_array_boundaries():
    stream = t.TokenStream([np.array([1, 2, 3], np.uint16), np.array([4], np.uint16), np.array([5, 6], np.uint16)])
    assert stream.num_tokens == 6
    assert stream.read(2, 4).tolist() == [3, 4, 5, 6]
    assert stream.read(0, 6).tolist() == [1, 2, 3, 4, 5, 6]


def test_data_shorter_than_one_step_is_refused():
    with pytest.raises(t.ConfigError, match=r"the training data holds 16 tokens, fewer than one step needs \(16 \+ 1\)"):
        t.DataLoader(arange_stream(16), 2, 4, 0, 1, tokens_per_step=16, name="training")
    t.DataLoader(arange_stream(17), 2, 4, 0, 1, tokens_per_step=16, name="training")  # B*T+1 is enough


def test_tiny_shakespeare_splits_90_10_by_tokens():
    cfg = t.parse_args(["--text_file", str(SHAKESPEARE)])
    train, val = t.load_token_streams(cfg)
    assert (train.num_tokens, val.num_tokens) == (304_222, 33_803)
    first = train.read(0, 4).tolist()
    assert first == t.gpt2_tokenizer().encode_ordinary("First Citizen:\n")[:4]


def write_shards(folder, sizes_by_split):
    """uint16 shards whose tokens count up from 0 through all of a split's shards."""
    for split, sizes in sizes_by_split.items():
        start = 0
        for i, size in enumerate(sizes):
            np.save(folder / f"tiny_{split}_{i:06d}.npy", np.arange(start, start + size, dtype=np.uint16))
            start += size


def test_shards_are_memory_mapped_and_read_as_one_stream(tmp_path):
    write_shards(tmp_path, {"val": [50], "train": [30, 30, 40]})
    train, val = t.load_token_streams(t.parse_args(["--data_dir", str(tmp_path)]))
    assert all(isinstance(a, np.memmap) for a in train.arrays + val.arrays)  # nothing loaded whole
    assert (train.num_tokens, val.num_tokens) == (100, 50)
    loader = t.DataLoader(train, 2, 8, 0, 1, tokens_per_step=32, name="training")
    # 3 steps of 32 (+1) tokens fit in 100; the windows cross the shard boundaries at 30 and 60
    assert windows(loader, 6) == list(range(0, 96, 8))
    assert loader.next_batch()[0].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]


def test_shard_of_the_wrong_dtype_is_named(tmp_path):
    write_shards(tmp_path, {"val": [50], "train": [30]})
    np.save(tmp_path / "tiny_train_000001.npy", np.arange(30, dtype=np.int32))
    with pytest.raises(t.ConfigError, match=r"shard .*tiny_train_000001.npy holds int32 of shape \(30,\), not a 1-D uint16"):
        t.load_token_streams(t.parse_args(["--data_dir", str(tmp_path)]))


def test_unreadable_shard_is_named(tmp_path):
    write_shards(tmp_path, {"val": [50], "train": [30]})
    (tmp_path / "tiny_train_000001.npy").write_bytes(b"not a numpy file")
    with pytest.raises(t.ConfigError, match=r"cannot read shard .*tiny_train_000001.npy"):
        t.load_token_streams(t.parse_args(["--data_dir", str(tmp_path)]))
