from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt2 as t
from conftest import checked_run, SHAKESPEARE, TINY_ARGS


def arange_stream(n, pieces=1):
    """Token i has id i, so every batch shows exactly where it was read from."""
    return t.TokenStream(np.array_split(np.arange(n, dtype=np.uint16), pieces))


def loader(stream, B=2, T=4, rank=0, world_size=1, shuffle=False, seed=0):
    """The recipe's DataLoader, or --shuffle's ShuffledLoader (the machinery's)."""
    if shuffle:
        return t.ShuffledLoader(stream, B, T, rank, world_size, seed=seed)
    return t.DataLoader(stream, B, T, rank, world_size)


def starts(data_loader, batches):
    """Start token of each window in the next `batches` batches."""
    return [int(row[0]) for _ in range(batches) for row in data_loader.next_batch()[0]]


def step_windows(loaders, micro_steps):
    """The set of window starts that all ranks together read in one step."""
    return sorted(s for each in loaders for s in starts(each, micro_steps))


def window_order(data, epoch):
    """The windows (numbered by start // T) that an epoch reads at its positions 0, T, 2T, ..., in that order."""
    T = data.seq_len
    return [int(data.read_window(epoch, k * T)[0]) // T for k in range(data.num_windows)]


def test_first_batches_are_windows_with_targets_shifted_by_one():
    data = loader(arange_stream(100))
    x, y = data.next_batch()
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert y.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert x.dtype == torch.int64
    x, y = data.next_batch()
    assert x.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]
    assert y.tolist() == [[9, 10, 11, 12], [13, 14, 15, 16]]
    assert (data.epoch, data.position) == (0, 16)  # 4 windows of 4 tokens read


def test_every_usable_window_then_a_new_epoch():
    # 100 tokens hold 24 windows of 4 + 1 (the last starts at 92 and ends at token 96); 96..99 cannot fill one
    data = loader(arange_stream(100))
    assert data.num_windows == 24
    assert starts(data, 12) == list(range(0, 96, 4)) and data.epoch == 1
    assert starts(data, 2) == [0, 4, 8, 12]  # epoch 1 starts again from the first window
    assert (data.epoch, data.position) == (1, 16)  # 24 windows in epoch 0, then 4


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epoch_over_several_shards_uses_every_window_exactly_once(shuffle):
    stream = arange_stream(1001, pieces=7)  # shard ends fall inside windows
    data = loader(stream, B=5, T=10, shuffle=shuffle, seed=3)
    assert data.num_windows == 100
    seen = starts(data, 20)
    assert sorted(seen) == list(range(0, 1000, 10))
    assert (seen == sorted(seen)) == (not shuffle)


def test_shuffle_off_is_the_contiguous_layout_token_for_token():
    tokens = np.random.default_rng(0).integers(0, 50257, size=2000).astype(np.uint16)
    stream = t.TokenStream(np.array_split(tokens, 3))
    B, T, W = 2, 8, 3
    ranks = [loader(stream, B, T, r, W, shuffle=False) for r in range(W)]
    for micro_step in range(5):
        for r, data in enumerate(ranks):
            offset = (micro_step * W + r) * B * T  # rank r at r*B*T, advancing W*B*T
            x, y = data.next_batch()
            assert x.flatten().tolist() == tokens[offset : offset + B * T].tolist()
            assert y.flatten().tolist() == tokens[offset + 1 : offset + B * T + 1].tolist()


@pytest.mark.parametrize("world_size, batch_size", [(1, 12), (1, 4), (2, 6), (2, 2), (3, 4), (3, 2)])
def test_ranks_split_each_step_into_the_single_process_windows(world_size, batch_size):
    """12 windows a step; shuffle on; over 10 steps, across shard boundaries and an epoch boundary."""
    stream = arange_stream(801, pieces=5)  # 100 windows of 8 + 1: an epoch ends inside step 9
    single = loader(stream, B=12, T=8, shuffle=True, seed=5)
    ranks = [loader(stream, batch_size, 8, r, world_size, True, 5) for r in range(world_size)]
    micro_steps = 12 // (batch_size * world_size)
    for _ in range(10):
        assert step_windows(ranks, micro_steps) == sorted(starts(single, 1))


def test_order_depends_on_seed_and_epoch_only():
    data = loader(arange_stream(801), T=8, shuffle=True, seed=5)
    again = loader(arange_stream(801, pieces=4), B=4, T=8, world_size=2, shuffle=True, seed=5)
    assert window_order(data, 0) == window_order(again, 0)
    assert window_order(data, 1) != window_order(data, 0)
    assert window_order(loader(arange_stream(801), T=8, shuffle=True, seed=6), 0) != window_order(data, 0)
    assert sorted(window_order(data, 1)) == list(range(100))
    assert data.order[0] == 1 and data.order[1].tolist() == window_order(data, 1)  # one epoch's order kept


def test_the_stored_position_resumes_the_same_windows_at_another_world_size():
    stream = arange_stream(801, pieces=3)
    uninterrupted = loader(stream, B=12, T=8, shuffle=True, seed=1)
    two_ranks = [loader(stream, 3, 8, r, 2, True, 1) for r in range(2)]
    for _ in range(4):
        step_windows(two_ranks, 2)
        starts(uninterrupted, 1)
    place = (two_ranks[0].epoch, two_ranks[0].position)  # what a checkpoint stores: tokens read of the epoch
    assert place == (two_ranks[1].epoch, two_ranks[1].position) == (0, 48 * 8)
    three_ranks = [loader(stream, 2, 8, r, 3, True, 1) for r in range(3)]
    for data in three_ranks:
        data.epoch, data.position = place
    for _ in range(10):  # past the end of the epoch too
        assert step_windows(three_ranks, 2) == sorted(starts(uninterrupted, 1))


def test_data_with_fewer_windows_than_a_step_is_refused():
    """B*T+1 tokens make B windows of T + 1: 16 tokens are 3 windows of 4 + 1, one short of a step of 4."""
    assert [loader(arange_stream(n)).num_windows for n in (16, 17, 0)] == [3, 4, 0]  # an empty file: not -1 windows
    cfg = t.parse_args(["--seq_len", "4", "--micro_batch_size", "2", "--total_batch_size", "16"])
    with pytest.raises(t.RunError, match=r"^the training data holds 16 tokens, 3 windows of 4 \+ 1, but one step "
                                            r"of --total_batch_size 16 tokens needs 4: train on more data"):
        t.check_token_counts((arange_stream(16), arange_stream(17)), cfg, with_val=True)


@pytest.mark.parametrize("content, reason", [(b"caf\xe9 in Latin-1", "not UTF-8: invalid continuation byte at byte 3"),
                                             (None, "Is a directory")])
def test_a_text_file_that_cannot_be_read_is_one_line(tmp_path, content, reason):
    path = tmp_path / "input.txt"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(t.RunError) as raised:
        checked_run(text_file=str(path)).token_streams()
    assert str(raised.value) == f"cannot read --text_file {path} ({reason}): give a UTF-8 text file"


def test_read_spans_array_boundaries():
    stream = t.TokenStream([np.array([1, 2, 3], np.uint16), np.array([4], np.uint16), np.array([5, 6], np.uint16)])
    assert stream.num_tokens == 6
    assert stream.read(2, 4).tolist() == [3, 4, 5, 6]
    assert stream.read(0, 6).tolist() == [1, 2, 3, 4, 5, 6]


def test_tiny_shakespeare_splits_90_10_by_tokens():
    cfg = t.parse_args(["--text_file", str(SHAKESPEARE)])
    train, val = t.CheckedRun(cfg).token_streams()
    assert (train.num_tokens, val.num_tokens) == (304_222, 33_803)
    first = train.read(0, 4).tolist()
    assert first == t.CheckedRun.tokenizer().encode_ordinary("First Citizen:\n")[:4]


def write_shards(folder, sizes_by_split):
    """uint16 shards whose tokens count up from 0 through all of a split's shards."""
    for split, sizes in sizes_by_split.items():
        start = 0
        for i, size in enumerate(sizes):
            np.save(folder / f"tiny_{split}_{i:06d}.npy", np.arange(start, start + size, dtype=np.uint16))
            start += size


def test_shards_are_memory_mapped_and_read_as_one_stream(tmp_path):
    write_shards(tmp_path, {"val": [50], "train": [30, 30, 40]})
    train, val = checked_run(data_dir=str(tmp_path)).token_streams()
    assert all(isinstance(a, np.memmap) for a in train.arrays + val.arrays)  # nothing loaded whole
    assert (train.num_tokens, val.num_tokens) == (100, 50)
    data = loader(train, B=2, T=8)
    # 12 windows of 8 + 1 fit in 100 tokens; they cross the shard boundaries at 30 and 60
    assert starts(data, 6) == list(range(0, 96, 8))
    x, _ = data.next_batch()
    assert x.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]]  # epoch 1


def test_shard_of_the_wrong_dtype_is_named(tmp_path):
    write_shards(tmp_path, {"val": [50], "train": [30]})
    np.save(tmp_path / "tiny_train_000001.npy", np.arange(30, dtype=np.int32))
    with pytest.raises(t.RunError, match=r"shard .*tiny_train_000001.npy holds int32 of shape \(30,\), not a 1-D uint16"):
        checked_run(data_dir=str(tmp_path)).token_streams()


def test_a_last_shard_of_one_token_is_read(tmp_path):
    """fineweb.py writes the rest of the stream as the last shard: 1,026 tokens in shards of 1,025 leave one."""
    write_shards(tmp_path, {"val": [50], "train": [30, 1]})
    train, _ = checked_run(data_dir=str(tmp_path)).token_streams()
    assert train.num_tokens == 31 and train.read(25, 6).tolist() == list(range(25, 31))


def test_unreadable_shard_is_named(tmp_path):
    write_shards(tmp_path, {"val": [50], "train": [30]})
    (tmp_path / "tiny_train_000001.npy").write_bytes(b"not a numpy file")
    with pytest.raises(t.RunError, match=r"cannot read shard .*tiny_train_000001.npy"):
        checked_run(data_dir=str(tmp_path)).token_streams()


@pytest.mark.parametrize("content", [b"", b"\x93NUMP", b"not a numpy file at all"])  # 0 bytes, 5, no magic
def test_a_shard_that_is_no_npy_file_is_named_without_blaming_pickles(tmp_path, content):
    """0 bytes was an EOFError traceback; the others were said to hold "pickled (object) data"."""
    write_shards(tmp_path, {"val": [50], "train": [30]})
    (tmp_path / "tiny_train_000000.npy").write_bytes(content)
    with pytest.raises(t.RunError) as raised:
        checked_run(data_dir=str(tmp_path)).token_streams()
    assert str(raised.value) == (f"cannot read shard {tmp_path / 'tiny_train_000000.npy'}: it is not a .npy file "
                                 "(empty, cut short or another format): delete it and rerun fineweb.py")


def shards_with_a_token_beyond_the_vocabulary(folder, position):
    """Train shards of 150 and 850 tokens, all ids below 1,000 but one of 60,000 at token `position`."""
    tokens = np.arange(1000, dtype=np.uint16)
    tokens[position] = 60_000
    np.save(folder / "bad_train_000001.npy", tokens[:150])
    np.save(folder / "bad_train_000002.npy", tokens[150:])
    np.save(folder / "bad_val_000000.npy", np.arange(300, dtype=np.uint16))


def test_a_token_beyond_the_vocabulary_is_named_with_its_shard_and_never_reaches_the_model(tmp_path, capsys):
    """Another tokenizer's shards: step 0 raised IndexError in the embedding (on a GPU, a device-side assert)."""
    shards_with_a_token_beyond_the_vocabulary(tmp_path, 200)
    args = TINY_ARGS[: TINY_ARGS.index("--text_file")] + ["--data_dir", str(tmp_path), "--no-shuffle",
                                                          "--log_dir", str(tmp_path / "log")]
    with pytest.raises(SystemExit) as stopped:
        t.main(t.parse_args(args))
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'bad_train_000002.npy'} holds token id 60000, beyond "
                                       "the 50257 tokens of gpt2 (made with another tokenizer?): remake the shards with "
                                       "fineweb.py\n")
    assert list((tmp_path / "log").glob("ckpt_*")) == []  # nothing saved from that step


def test_download_writes_the_whole_file_and_nothing_else(tmp_path):
    import functools
    import http.server
    import threading

    served = tmp_path / "served"
    served.mkdir()
    (served / "input.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # loopback, a free port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        target = tmp_path / "data" / "input.txt"
        t.download(f"http://127.0.0.1:{server.server_port}/input.txt", str(target), "unused")
    finally:
        server.shutdown()
        server.server_close()  # its listening socket
    assert target.read_bytes() == (served / "input.txt").read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["input.txt"]  # no temporary file left


def write_in_step(path, content, both_open):
    """In a process of its own: write_atomically with a writer that waits until the other process has opened
    its temporary file too, as two machines' first ranks downloading to shared storage at once can."""
    def write(temporary):
        both_open.wait(timeout=30)
        Path(temporary).write_text(content)

    t.write_atomically(path, write)


def test_two_processes_writing_the_same_file_at_once_both_succeed_and_leave_one_whole_copy(tmp_path):
    import multiprocessing

    context = multiprocessing.get_context("fork")
    both_open = context.Barrier(2)
    content = "First Citizen:\n" * 1000
    writers = [context.Process(target=write_in_step, args=(str(tmp_path / "input.txt"), content, both_open))
               for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    # with one temporary name for both, the second open emptied the first one's file and the second rename failed
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert (tmp_path / "input.txt").read_text() == content
    assert [p.name for p in tmp_path.iterdir()] == ["input.txt"]
