import concurrent.futures
import contextlib
import functools
import io
import itertools
import json
import math
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import fineweb
import train_gpt2
from conftest import checked_run, moved_gpt2, ROOT, TINY_ARGS, run_python
from test_ddp import torchrun

# Words of a made-up corpus: ASCII, accents, CJK, Cyrillic, Arabic, an emoji, tabs, newlines and U+2028
# (a line separator that a JSON line may hold raw)
WORDS = ["the", "of", "and", "to", "data", "model", "training", "tokens", "GPT-2", "don't", "1,024", "(see",
         "above).", "naïve", "café", "Zürich", "東京", "данные", "مرحبا", "😀", "x²", "—", "\t", "\n", "\n\n", "\u2028"]


@functools.cache
def corpus_texts() -> tuple[str, ...]:
    """700 documents drawn from a seeded generator: lengths spread like web pages (median 245 words), every
    101st one empty, and document 120 of 150,000 words, longer than a 300,000-token shard."""
    rng = random.Random(0)
    lengths = [0 if i % 101 == 7 else 150_000 if i == 120 else int(rng.lognormvariate(5.5, 1.0)) for i in range(700)]
    return tuple(" ".join(rng.choices(WORDS, k=length)) for length in lengths)


@functools.cache
def document_tokens() -> tuple[list[int], ...]:
    """Each document as the shards must hold it, counted here with tiktoken itself: <|endoftext|>, then its tokens."""
    import tiktoken

    encoding = tiktoken.get_encoding("gpt2")
    return tuple([encoding.eot_token] + encoding.encode_ordinary(text) for text in corpus_texts())


def expected_counts(shard_size: int, copies: int = 1) -> tuple[int, int, int]:
    """(documents, tokens, shards) of the corpus repeated `copies` times in shards of shard_size tokens, or in
    tenths where it is less than 10 shards."""
    tokens = copies * sum(len(document) for document in document_tokens())
    return copies * len(corpus_texts()), tokens, max(10, -(-tokens // shard_size))


def documents_within(tokens: int) -> int:
    """How many leading documents lie whole within the first `tokens` tokens of the stream."""
    ends = itertools.accumulate(len(document) for document in document_tokens())
    return sum(1 for end in ends if end <= tokens)


def write_corpus(path: Path, copies: int = 1) -> Path:
    lines = [json.dumps({"id": i, "text": text}, ensure_ascii=False) + "\n" for i, text in enumerate(corpus_texts())]
    path.write_text("".join(lines) * copies, encoding="utf-8")
    return path


def write_first_documents(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus_texts()[:count]), encoding="utf-8")
    return path


def npy_bytes(tokens: np.ndarray) -> bytes:
    """The file np.save writes for these tokens, as build-nanogpt's fineweb.py saves each shard."""
    written = io.BytesIO()
    np.save(written, tokens)
    return written.getvalue()


def read_shards(folder):
    return [np.load(p) for p in sorted(folder.glob("*.npy"), key=lambda p: p.name.split("_")[-1])]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="module")
def corpus_shards(corpus, tmp_path_factory):
    """The corpus in shards of 300,000 tokens, one worker: the reference the other runs must equal byte for byte."""
    out_dir = tmp_path_factory.mktemp("shards") / "sample"
    counts = fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(out_dir),
                                              "--shard_size", "300000", "--workers", "1"]))
    return out_dir, counts


def test_the_corpus_gives_exactly_its_tokens_in_tenths(corpus_shards):
    """924,915 tokens, less than 10 shards of 300,000 (4 of them): cut again in tenths, the first to validate."""
    out_dir, counts = corpus_shards
    assert counts == expected_counts(300_000) == (700, 924_915, 10)
    assert sorted(p.name for p in out_dir.iterdir()) == (
        [f"sample_train_{i:06d}.npy" for i in range(1, 10)] + ["sample_val_000000.npy"])
    assert [len(s) for s in read_shards(out_dir)] == [92_492] * 9 + [92_487]
    assert all(s.dtype == np.uint16 and s.ndim == 1 for s in read_shards(out_dir))


def test_shards_concatenated_equal_each_document_tokenized_alone(corpus_shards):
    out_dir, _ = corpus_shards
    assert np.concatenate(read_shards(out_dir)).tolist() == [t for document in document_tokens() for t in document]
    assert [1] * 7 == [len(document) for text, document in zip(corpus_texts(), document_tokens(), strict=True) if not text]
    assert len(document_tokens()[120]) > 300_000  # spans shards 0 to 1 of 300,000 as written, then 1 to 4 of tenths


def test_two_workers_write_byte_identical_shards(corpus, corpus_shards, tmp_path):
    one_worker, _ = corpus_shards
    fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(tmp_path / "sample"),
                                     "--shard_size", "300000", "--workers", "2"]))
    for path in one_worker.iterdir():
        assert (tmp_path / "sample" / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_document_longer_than_a_shard_spills_over(tmp_path):
    documents = [np.arange(10, dtype=np.uint16), np.arange(100, 103, dtype=np.uint16)]
    assert fineweb.write_shards(iter(documents), str(tmp_path), "x", shard_size=4) == (2, 13, 4)
    assert [s.tolist() for s in read_shards(tmp_path)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 100, 101], [102]]
    assert (tmp_path / "x_val_000000.npy").exists() and (tmp_path / "x_train_000003.npy").exists()


def test_a_prefix_holding_a_split_name_reads_each_split_alone(tmp_path):
    """fineweb.py's prefix is --out_dir's name: in my_train_data, *_train_*.npy matched my_train_data_val_000000.npy
    too, and training read the validation shard."""
    fineweb.write_shards(iter([np.arange(12, dtype=np.uint16)]), str(tmp_path), "my_train_data", shard_size=4)
    assert [p.name for p in train_gpt2.shard_paths(tmp_path, "train")] == ["my_train_data_train_000001.npy",
                                                                          "my_train_data_train_000002.npy"]
    assert [p.name for p in train_gpt2.shard_paths(tmp_path, "val")] == ["my_train_data_val_000000.npy"]
    train, val = checked_run(data_dir=str(tmp_path)).token_streams()  # the first 4 tokens validate
    assert train.read(0, train.num_tokens).tolist() == list(range(4, 12)) and val.num_tokens == 4


def test_a_leftover_temporary_file_is_never_read(tmp_path):
    fineweb.write_shards(iter([np.arange(8, dtype=np.uint16)]), str(tmp_path), "x", shard_size=4)
    (tmp_path / "x_train_000002.npy.tmp").write_bytes(b"half a shard")  # as a killed run would leave it
    assert train_gpt2.shard_paths(tmp_path, "train") == [tmp_path / "x_train_000001.npy"]
    assert checked_run(data_dir=str(tmp_path)).token_streams()[0].num_tokens == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x_train_000001.npy", "x_train_000002.npy.tmp",
                                                         "x_val_000000.npy"]


@pytest.mark.parametrize("folder", ["out", "out[1]"])  # a glob's brackets: the old shards were not found, and stayed
def test_overwrite_replaces_old_shards(corpus, tmp_path, folder):
    out_dir = tmp_path / folder
    out_dir.mkdir()
    fineweb.write_shards(iter([np.arange(48, dtype=np.uint16)]), str(out_dir), "x", shard_size=4)  # 12 shards
    (out_dir / "x_train_000012.npy.tmp").write_bytes(b"leftover")
    fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(out_dir), "--prefix", "x",
                                     "--shard_size", "600000", "--overwrite", "--workers", "1"]))
    assert sorted(p.name for p in out_dir.iterdir()) == (  # 2 shards' tokens, cut in tenths; 10 to 12 gone
        [f"x_train_{i:06d}.npy" for i in range(1, 10)] + ["x_val_000000.npy"])


def test_each_complete_shard_records_its_position_and_resuming_from_any_gives_the_same_shards(tmp_path):
    documents = [np.arange(10, dtype=np.uint16), np.arange(100, 103, dtype=np.uint16)]
    positions = []
    (tmp_path / "whole").mkdir()
    fineweb.write_shards(iter(documents), str(tmp_path / "whole"), "x", shard_size=4, on_shard=positions.append)
    # shard 1 and 2 hold 4 and 8 tokens of document 0; shard 3 ends it and holds 2 tokens of document 1
    assert positions == [fineweb.Position(1, 0, 4), fineweb.Position(2, 0, 8), fineweb.Position(3, 1, 2)]
    for position in positions:
        folder = tmp_path / f"from_{position.shards}"
        folder.mkdir()
        for index in range(position.shards):
            (folder / f"x_{'val' if index == 0 else 'train'}_{index:06d}.npy").write_bytes(
                (tmp_path / "whole" / f"x_{'val' if index == 0 else 'train'}_{index:06d}.npy").read_bytes())
        counts = fineweb.write_shards(iter(documents[position.documents:]), str(folder), "x", 4, position)
        assert counts == (2, 13, 4)
        assert [s.tolist() for s in read_shards(folder)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 100, 101], [102]]


# fineweb.py, whose disk fills up once two shards are whole: from then on a write past 4 kB in any file fails in the
# kernel (EFBIG, as ENOSPC on a full disk; conftest.files_limited_to). Only the moment is chosen here, through the
# marker written after each shard; the failing write is real.
FILLS_AFTER_TWO_SHARDS = """
import resource, signal, sys
import fineweb
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
plain_write_marker = fineweb.write_marker
def write_marker(out_dir, settings, position, stream_note):
    plain_write_marker(out_dir, settings, position, stream_note)
    if position.shards == 2:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
fineweb.write_marker = write_marker
try:
    fineweb.main(fineweb.parse_args(sys.argv[1:]))
except fineweb.ConfigError as error:  # as fineweb.py's own __main__ says it
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
"""


def test_a_run_stopped_by_a_full_disk_resumes_to_the_same_bytes(corpus, corpus_shards, tmp_path):
    reference, _ = corpus_shards
    out_dir = tmp_path / "sample"
    args = ["--input", str(corpus), "--out_dir", str(out_dir), "--shard_size", "300000"]
    result = run_python(["-c", FILLS_AFTER_TWO_SHARDS] + args + ["--workers", "2"])
    line = one_line_error(result)  # numpy says "300000 requested and 1984 written"
    assert line.startswith(f"error: cannot write {out_dir / 'sample_train_000002.npy'} (")
    assert line.endswith(f" written): make room in {out_dir}, then rerun with --resume")
    assert sorted(p.name for p in (tmp_path / "sample").iterdir()) == [  # no half-written shard left behind
        "INCOMPLETE", "sample_train_000001.npy", "sample_val_000000.npy"]
    position = json.loads((tmp_path / "sample" / "INCOMPLETE").read_text())["position"]
    whole = documents_within(600_000)
    into_next = 600_000 - sum(len(document) for document in document_tokens()[:whole])
    assert position == {"shards": 2, "documents": whole, "tokens_into_next": into_next}
    assert 0 < into_next < len(document_tokens()[whole])  # that document spans the shard boundary
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(args))
    assert str(raised.value) == (f"--out_dir {tmp_path / 'sample'} holds an interrupted run's shards: pass --resume "
                                 "to go on from them, or --overwrite to start again")

    # what a kill could also leave: a shard renamed before the marker moved past it, half of the one after
    (tmp_path / "sample" / "sample_train_000002.npy").write_bytes((reference / "sample_train_000002.npy").read_bytes())
    (tmp_path / "sample" / "sample_train_000003.npy.tmp").write_bytes(b"half a shard")
    assert fineweb.main(fineweb.parse_args(args + ["--resume", "--workers", "1"])) == expected_counts(300_000)
    assert sorted(p.name for p in (tmp_path / "sample").iterdir()) == sorted(p.name for p in reference.iterdir())
    for path in reference.iterdir():
        assert (tmp_path / "sample" / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])  # Ctrl-C to the terminal's group; a scheduler
def test_a_signal_stops_tokenizing_and_resume_finishes_the_shards(corpus_shards, tmp_path, signum):
    reference, _ = corpus_shards
    # its own session, as a terminal's foreground job is its own group; SIGINT as a shell leaves it to a foreground job
    process, args = start_tokenizing(tmp_path, start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    (os.killpg if signum == signal.SIGINT else os.kill)(process.pid, signum)
    stdout, stderr = process.communicate(timeout=60)  # returns once the workers too have closed their stderr
    if signum == signal.SIGINT:  # one line, and no worker's traceback
        assert (process.returncode, stdout) == (130, "")
        assert stderr == (f"stopped: the complete shards stay in {tmp_path / 'out'}; rerun the same command with "
                          "--resume to go on\n")
    else:  # Python's own default: gone at once, every file whole
        assert (process.returncode, stdout, stderr) == (-signum, "", "")
    assert (tmp_path / "out" / "INCOMPLETE").exists()
    assert fineweb.main(fineweb.parse_args(args + ["--resume"])) == expected_counts(50_000, copies=2)
    assert np.array_equal(np.concatenate(read_shards(tmp_path / "out")),
                          np.tile(np.concatenate(read_shards(reference)), 2))


def start_tokenizing(tmp_path, **popen_options):
    """fineweb.py with 2 workers on the corpus twice over into tmp_path/out, returned once it has written 3
    shards: (the process, its arguments)."""
    corpus = write_corpus(tmp_path / "corpus.jsonl", copies=2)
    out_dir = tmp_path / "out"
    args = ["--input", str(corpus), "--out_dir", str(out_dir), "--shard_size", "50000", "--workers", "2"]
    process = subprocess.Popen([sys.executable, "fineweb.py"] + args, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, **popen_options)
    while not (out_dir / "out_train_000002.npy").exists():
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)
    return process, args


def worker_pids(process) -> list[int]:
    workers = subprocess.run(["ps", "-o", "pid=", "--ppid", str(process.pid)], capture_output=True, text=True)
    return [int(pid) for pid in workers.stdout.split()]


def test_a_worker_killed_by_the_system_is_one_line_not_a_hang(tmp_path):
    process, _ = start_tokenizing(tmp_path)
    try:
        os.kill(worker_pids(process)[0], signal.SIGKILL)  # as the kernel's out-of-memory killer does
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert (process.returncode, stdout) == (1, "")
    assert stderr == ("error: a tokenizer process died (the system may have run out of memory): rerun with "
                      "--resume, with fewer --workers if memory is short\n")
    assert (tmp_path / "out" / "INCOMPLETE").exists()


def test_a_worker_gone_while_sending_its_result_is_noticed_too(monkeypatch):
    """Killed halfway through sending, a worker leaves a cut message that the executor's own thread waits on for
    good, so the executor never says the pool broke: a worker seen alive and now gone is what tells. A kill cannot be
    timed into a send (1 run in 40 hit it), so this drives the check with a pid that is no child, which
    multiprocessing.active_children() leaves out as it does a dead worker; the real SIGKILL is the test above.
    end_the_run_now is replaced only because it ends the process with os._exit, the test's own."""
    def end_the_run_now(message, status):
        raise SystemExit((message, status))

    monkeypatch.setattr(fineweb, "end_the_run_now", end_the_run_now)
    never_done = concurrent.futures.Future()
    with pytest.raises(SystemExit) as ended:
        fineweb.result_when_done(never_done, workers_seen={2**22 + 1})  # a pid that is no child of this process
    assert ended.value.code == ("error: a tokenizer process died (the system may have run out of memory): rerun "
                                "with --resume, with fewer --workers if memory is short", 1)


def test_a_worker_gone_before_the_first_wait_is_noticed(monkeypatch):
    """The workers are noted as submit starts them. They used to be noted only when a wait for a result timed
    out, so a worker killed while results still came quickly was never seen alive; if it was cut off while sending,
    the run then waited forever (1 run in 40 of the killed-worker test above, and once in CI). Here the executor
    starts a worker at the first submit, as ProcessPoolExecutor does, the worker ends 0.3 s later, and no result
    ever comes."""
    class ExecutorWithAStuckThread:
        def __init__(self):
            self.worker = None

        def submit(self, function, chunk):
            if self.worker is None:
                self.worker = multiprocessing.Process(target=time.sleep, args=(0.3,))
                self.worker.start()
            return concurrent.futures.Future()

    ended = []

    def end_the_run_now(message, status):
        ended.append((message, status))
        raise SystemExit(status)

    monkeypatch.setattr(fineweb, "end_the_run_now", end_the_run_now)
    tokenized = fineweb.tokenized_in_order(ExecutorWithAStuckThread(), ["a document"], chunk_size=1, in_flight=1)

    def wait_for_the_results():
        with contextlib.suppress(SystemExit):  # how the stand-in for end_the_run_now ends the wait
            list(tokenized)

    waiting = threading.Thread(target=wait_for_the_results, daemon=True)  # a daemon: the old code never returns
    waiting.start()
    waiting.join(timeout=10)
    assert ended == [("error: a tokenizer process died (the system may have run out of memory): rerun with "
                      "--resume, with fewer --workers if memory is short", 1)]


def test_the_workers_exit_when_the_main_process_is_killed(tmp_path):
    process, _ = start_tokenizing(tmp_path)
    workers = worker_pids(process)
    process.kill()
    process.communicate()
    assert len(workers) == 2
    deadline = time.monotonic() + 10  # each checks on its parent once a second
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers), "a worker outlived the main process"


def interrupted_folder(tmp_path, monkeypatch):
    """What a run stopped by Ctrl-C once 4 shards of 1025 tokens are whole leaves: those shards, and the marker. The
    corpus's second record is bad; the run stopped before it got there. (A refusal would leave nothing.)"""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "' + "word " * 4100 + '"}\n' + "not json\n")
    plain_write_marker = fineweb.write_marker

    def write_marker(out_dir, settings, position, stream_note):
        plain_write_marker(out_dir, settings, position, stream_note)
        if position.shards == 4:
            raise KeyboardInterrupt  # as Ctrl-C does, here just after the marker moved past shard 4

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(fineweb, "write_marker", write_marker)
        fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(tmp_path / "out"),
                                         "--shard_size", "1025", "--workers", "1"]))
    return corpus, tmp_path / "out"


def test_resume_refuses_other_settings_or_input_naming_them(tmp_path, monkeypatch):
    corpus, out_dir = interrupted_folder(tmp_path, monkeypatch)
    args = ["--input", str(corpus), "--out_dir", str(out_dir), "--resume", "--workers", "1"]
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(args + ["--shard_size", "2050"]))
    assert str(raised.value) == (f"--resume: the interrupted run in {out_dir} had --shard_size 1025, not 2050: pass the "
                                 "same settings, or --overwrite to start again")
    corpus.write_text('{"text": "' + "word " * 4100 + '"}\n')  # the bad record fixed: the file is another one now
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(args + ["--shard_size", "1025"]))
    assert str(raised.value) == (f"--resume: the interrupted run in {out_dir} had --input other files or sizes, not "
                                 "these: pass the same settings, or --overwrite to start again")
    assert len(list(out_dir.glob("*.npy"))) == 4  # nothing deleted by a refused resume
    assert fineweb.main(fineweb.parse_args(args[:-3] + ["--shard_size", "1025", "--overwrite"])) == (1, 4102, 10)
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(args + ["--shard_size", "1025"]))
    assert str(raised.value) == (f"--out_dir {out_dir} holds a finished run (no INCOMPLETE file): nothing to resume; "
                                 "pass --overwrite to tokenize again")
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.parse_args(args + ["--overwrite"])
    assert str(raised.value) == "--resume keeps out_dir's shards and --overwrite deletes them: pass one of the two"


@pytest.mark.parametrize("marker_text", ["garbage", '{"settings": {}, "position": {"shards": 1, "documents": 0, '
                                         '"tokens_into_next": 0}, "stream_note": {"documents": "350"}}'])
def test_resume_refuses_a_marker_it_did_not_write(tmp_path, monkeypatch, marker_text):
    corpus, out_dir = interrupted_folder(tmp_path, monkeypatch)
    (out_dir / "INCOMPLETE").write_text(marker_text)
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(out_dir), "--shard_size", "1025",
                                         "--resume", "--workers", "1"]))
    assert str(raised.value) == (f"{out_dir / 'INCOMPLETE'} is not a progress record fineweb.py wrote: pass "
                                 "--overwrite to start again")


def test_a_resume_reads_on_to_the_bad_record_and_an_out_dir_that_is_a_file_is_one_line(tmp_path, monkeypatch):
    corpus, out_dir = interrupted_folder(tmp_path, monkeypatch)
    args = ["--input", str(corpus), "--out_dir", str(out_dir), "--shard_size", "1025", "--workers", "1"]
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(args + ["--resume"]))
    assert str(raised.value) == f"{corpus} line 2 is not valid JSON"
    assert list(out_dir.iterdir()) == []  # the fixed corpus is another input, which --resume would refuse
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(corpus), "--resume"]))
    assert str(raised.value) == f"cannot make --out_dir {corpus} (it is a file): give a folder you can write to"


def test_resume_with_a_missing_shard_is_refused_and_on_a_new_folder_starts_afresh(tmp_path, monkeypatch):
    corpus, out_dir = interrupted_folder(tmp_path, monkeypatch)
    (out_dir / "out_train_000002.npy").unlink()
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(out_dir), "--shard_size", "1025",
                                         "--resume"]))
    assert str(raised.value) == (f"--resume: {out_dir / 'out_train_000002.npy'} is missing or not 1025 tokens: pass "
                                 "--overwrite to start again")
    corpus.write_text('{"text": "' + "word " * 4100 + '"}\n')
    counts = fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(tmp_path / "new"),
                                              "--shard_size", "1025", "--resume", "--workers", "1"]))
    assert counts == (1, 4102, 10) and len(list((tmp_path / "new").iterdir())) == 10


def one_line_error(result):
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def run_fineweb(args, env=None):
    return run_python(["fineweb.py"] + args, env=env)


def test_error_input_missing(tmp_path):
    line = one_line_error(run_fineweb(["--input", str(tmp_path / "*.jsonl"), "--out_dir", str(tmp_path / "out")]))
    assert line == f"error: --input {tmp_path / '*.jsonl'} matches no file: check the path"


def test_error_input_empty(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    line = one_line_error(run_fineweb(["--input", str(tmp_path / "empty.jsonl"), "--out_dir", str(tmp_path / "out")]))
    assert line == f"error: no documents in --input {tmp_path / 'empty.jsonl'}: check the files"
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_that_cannot_be_downloaded_stops_it_before_anything_is_written(corpus, tmp_path):
    from test_cli import offline_tokenizer

    result = run_fineweb(["--input", str(corpus), "--out_dir", str(tmp_path / "out")], env=offline_tokenizer(tmp_path))
    assert one_line_error(result) == ("error: cannot load the tokenizer (ProxyError): tiktoken downloads its files "
                                      "once; connect to the network, or set TIKTOKEN_CACHE_DIR to a folder that holds them")
    assert not (tmp_path / "out").exists()


def test_error_out_dir_not_empty(corpus, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    line = one_line_error(run_fineweb(["--input", str(corpus), "--out_dir", str(tmp_path / "out")]))
    assert line == (f"error: --out_dir {tmp_path / 'out'} is not empty: pass --overwrite to replace its shards, "
                    "or choose another folder")


@pytest.mark.parametrize("workers", ["1", "2"])  # read in this process, or while a pool tokenizes
def test_error_record_without_the_text_field_names_file_and_line(tmp_path, workers):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"body": "no text here"}\n')
    line = one_line_error(run_fineweb(["--input", str(corpus), "--out_dir", str(tmp_path / "out"),
                                       "--workers", workers]))
    assert line == f"error: {corpus} line 3 has no string 'text' ({{\"body\": \"no text here\"}}): pass --text_field, or fix " \
                   "that record"
    assert not (tmp_path / "out").exists()  # a refusal leaves nothing behind
    if workers == "1":  # so the corrected input goes into the same folder without --overwrite
        corpus.write_text('{"text": "' + "word " * 1100 + '"}\n')  # 1,102 tokens
        assert run_fineweb(["--input", str(corpus), "--out_dir", str(tmp_path / "out"),
                            "--shard_size", "1025"]).returncode == 0
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == (  # 2 shards' tokens, cut in tenths
            [f"out_train_{i:06d}.npy" for i in range(1, 10)] + ["out_val_000000.npy"])


def without_module(tmp_path, name):
    """An environment in which `import NAME` fails, as on a machine that lacks it."""
    fake = tmp_path / "fake_modules" / name
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError('{name} is not installed')\n")
    return {"PYTHONPATH": str(tmp_path / "fake_modules")}


def test_error_parquet_without_pyarrow(tmp_path):
    corpus = tmp_path / "corpus.parquet"
    corpus.write_bytes(b"PAR1")
    line = one_line_error(run_fineweb(["--input", str(corpus), "--out_dir", str(tmp_path / "out")],
                                      env=without_module(tmp_path, "pyarrow")))
    assert line == f"error: reading {corpus} needs pyarrow: pip install pyarrow"


def test_error_default_source_without_datasets(tmp_path):
    line = one_line_error(run_fineweb(["--out_dir", str(tmp_path / "out")], env=without_module(tmp_path, "datasets")))
    assert line == ("error: downloading FineWeb-Edu needs the datasets library: pip install datasets "
                    "(or pass --input with local files)")


def fake_datasets(records, fail_at=None):
    """A stand-in for the datasets library: load_dataset streams RECORDS; the first stream drops its connection at
    record FAIL_AT, as a long download can. The hub cannot be reached here; what the stand-in raises is what datasets
    5.2 raises: its streamed reads retry a dropped connection, then raise the builtin ConnectionError("Server
    Disconnected") (_add_retries_to_file_obj_read_method in datasets/utils/file_utils.py)."""
    calls = []

    def load_dataset(path, name, split, streaming):
        calls.append((path, name, split, streaming))
        for index, record in enumerate(records):
            if index == fail_at and len(calls) == 1:
                raise ConnectionError("Connection reset by peer")
            yield record

    return types.SimpleNamespace(load_dataset=load_dataset), calls


def test_the_hub_stream_gives_the_local_files_bytes_and_resumes_after_a_dropped_connection(corpus_shards, tmp_path,
                                                                                            monkeypatch):
    reference, _ = corpus_shards
    records = [{"id": i, "text": text} for i, text in enumerate(corpus_texts())]
    datasets, calls = fake_datasets(records, fail_at=500)
    monkeypatch.setitem(sys.modules, "datasets", datasets)
    monkeypatch.setattr(fineweb, "STREAM_NOTE_EVERY", 50)  # a stream without state_dict (datasets before 2.18)
    monkeypatch.setattr(fineweb, "check_hub_reachable", lambda dataset: None)  # the stand-in needs no network
    args = ["--out_dir", str(tmp_path / "sample"), "--shard_size", "300000", "--workers", "1"]
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(args))
    assert str(raised.value) == ("cannot reach HuggingFaceFW/fineweb-edu (Connection reset by peer): check the "
                                 "network and rerun with --resume (no shard is lost), or pass --input")
    read_before_the_drop = sum(len(document) for document in document_tokens()[:499])
    assert len(list((tmp_path / "sample").glob("*.npy"))) == read_before_the_drop // 300_000 == 2
    assert fineweb.main(fineweb.parse_args(args + ["--resume"])) == expected_counts(300_000)
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)] * 2
    assert sorted(p.name for p in (tmp_path / "sample").iterdir()) == sorted(p.name for p in reference.iterdir())
    for path in reference.iterdir():
        assert (tmp_path / "sample" / path.name).read_bytes() == path.read_bytes(), path.name


def hub_of_local_files(tmp_path, monkeypatch, fail_at):
    """The real datasets library standing in for the hub: load_dataset streams the corpus from 4 local parquet files
    (as the hub streams FineWeb's parquet files), with the same IterableDataset, state_dict and load_state_dict.
    Returns the records each stream has given so far; the first stream drops its connection at record FAIL_AT, with
    the builtin ConnectionError that datasets raises once its retries are spent (see fake_datasets)."""
    import datasets

    texts = corpus_texts()
    files = [str(tmp_path / f"part{i}.parquet") for i in range(4)]
    for i, path in enumerate(files):
        write_parquet(path, {"text": texts[175 * i : 175 * (i + 1)]}, row_group_size=32)
    records_given, load_parquet = [], datasets.load_dataset

    def load_dataset(path, name, split, streaming):
        stream_number = len(records_given)
        records_given.append(0)

        def count(record):
            records_given[stream_number] += 1
            if stream_number == 0 and records_given[0] == fail_at:
                raise ConnectionError("Connection reset by peer")
            return record

        return load_parquet("parquet", data_files=files, split=split, streaming=streaming).map(count)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(fineweb, "STREAM_NOTE_EVERY", 50)
    monkeypatch.setattr(fineweb, "check_hub_reachable", lambda dataset: None)  # the stand-in needs no network
    return records_given


def test_a_hub_resume_goes_on_from_the_streams_noted_position_not_from_the_start(corpus_shards, tmp_path,
                                                                                 monkeypatch):
    """Before, a resume streamed every document again (for FineWeb-Edu's 10B tokens: all the text before the
    stop); now it loads the stream's state noted at the last multiple of 50 documents within the complete shards."""
    records_given = hub_of_local_files(tmp_path, monkeypatch, fail_at=500)
    args = ["--out_dir", str(tmp_path / "sample"), "--shard_size", "300000", "--workers", "2"]
    with pytest.raises(fineweb.ConfigError):
        fineweb.main(fineweb.parse_args(args))
    marker = json.loads((tmp_path / "sample" / "INCOMPLETE").read_text())
    in_shards = documents_within(600_000)  # what the 2 complete shards of 300,000 tokens hold whole
    noted = in_shards // 50 * 50
    assert (marker["position"]["shards"], marker["position"]["documents"], marker["stream_note"]["documents"]) == (
        2, in_shards, noted)
    assert fineweb.main(fineweb.parse_args(args + ["--resume"])) == expected_counts(300_000)
    assert records_given == [500, 700 - noted]
    reference, _ = corpus_shards
    for path in reference.iterdir():
        assert (tmp_path / "sample" / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_hub_stream_that_does_not_go_on_at_the_noted_document_is_read_again_from_the_start(
        corpus_shards, tmp_path, monkeypatch, capsys):
    records_given = hub_of_local_files(tmp_path, monkeypatch, fail_at=500)
    args = ["--out_dir", str(tmp_path / "sample"), "--shard_size", "300000", "--workers", "1"]
    with pytest.raises(fineweb.ConfigError):
        fineweb.main(fineweb.parse_args(args))
    marker_path = tmp_path / "sample" / "INCOMPLETE"
    marker = json.loads(marker_path.read_text())
    marker["stream_note"]["next_document"] = "0" * 16  # as if the dataset had changed under the same name
    marker_path.write_text(json.dumps(marker))
    assert fineweb.main(fineweb.parse_args(args + ["--resume"])) == expected_counts(300_000)
    assert records_given == [500, 1, 700]  # the noted document (which differs), then the whole stream again
    assert capsys.readouterr().err.splitlines()[0] == (
        "HuggingFaceFW/fineweb-edu's stream cannot go on where the last run noted (another version of datasets, or "
        "the stream changed): reading it again from the start")
    reference, _ = corpus_shards
    for path in reference.iterdir():
        assert (tmp_path / "sample" / path.name).read_bytes() == path.read_bytes(), path.name


def test_txt_and_gzipped_jsonl_inputs(tmp_path):
    import gzip

    (tmp_path / "a.txt").write_text("Hello world")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"content": "Hello world" + " world" * 1100}) + "\n")
    counts = fineweb.main(fineweb.parse_args(["--input", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl.gz"),
                                              "--text_field", "content", "--out_dir", str(tmp_path / "out"),
                                              "--workers", "1", "--shard_size", "1025"]))
    assert counts == (2, 1106, 10)  # each: <|endoftext|> Hello world, then 1,100 more " world"; in tenths
    assert np.concatenate(read_shards(tmp_path / "out")).tolist() == [50256, 15496, 995, 50256, 15496] + [995] * 1101


def write_parquet(path, columns, row_group_size):
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table(columns), path, row_group_size=row_group_size)


def test_parquet_gives_the_tokens_of_the_same_documents_in_jsonl(corpus_shards, tmp_path):
    """FineWeb's own files are parquet: the corpus rewritten as parquet (in row groups of 64, read batch by
    batch) must give byte-identical shards."""
    texts = list(corpus_texts())
    write_parquet(tmp_path / "sample.parquet", {"id": list(range(len(texts))), "text": texts}, row_group_size=64)
    counts = fineweb.main(fineweb.parse_args(["--input", str(tmp_path / "sample.parquet"), "--out_dir",
                                              str(tmp_path / "sample"), "--shard_size", "300000", "--workers", "1"]))
    from_jsonl, _ = corpus_shards
    assert counts == expected_counts(300_000)
    for path in from_jsonl.iterdir():
        assert (tmp_path / "sample" / path.name).read_bytes() == path.read_bytes(), path.name


def test_error_parquet_without_the_text_column(tmp_path):
    corpus = tmp_path / "corpus.parquet"
    write_parquet(corpus, {"id": [1], "body": ["no text column"]}, row_group_size=1)
    line = one_line_error(run_fineweb(["--input", str(corpus), "--out_dir", str(tmp_path / "out")]))
    assert line == f"error: {corpus} has no column 'text' (it has ['id', 'body']): pass --text_field"


def test_error_parquet_with_a_null_text_names_the_row(tmp_path):
    corpus = tmp_path / "corpus.parquet"
    write_parquet(corpus, {"text": ["fine", "also fine", None]}, row_group_size=2)
    line = one_line_error(run_fineweb(["--input", str(corpus), "--out_dir", str(tmp_path / "out")]))
    assert line == f"error: {corpus} row 2: 'text' is None, not a string: fix or drop that row"


def shard_training_args(out_dir, log_dir):
    args = TINY_ARGS[: TINY_ARGS.index("--text_file")]
    return args + ["--data_dir", str(out_dir), "--max_steps", "20", "--max_lr", "1e-2", "--eval_every", "20",
                   "--eval_steps", "1", "--log_dir", str(log_dir)]


def losses(log_dir):
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in records if "train_loss" in r], [r["val_loss"] for r in records if "val_loss" in r]


def test_an_interrupted_run_leaves_a_folder_the_trainer_refuses(tmp_path, monkeypatch):
    """A run stopped part way: its shards are whole, but training on them would be training on part of the data."""
    corpus, _ = interrupted_folder(tmp_path, monkeypatch)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [  # 4 of the 4,102 tokens' 5 shards were written
        "INCOMPLETE", "out_train_000001.npy", "out_train_000002.npy", "out_train_000003.npy", "out_val_000000.npy"]
    with pytest.raises(train_gpt2.RunError) as raised:
        checked_run(data_dir=str(tmp_path / "out")).token_streams()
    assert str(raised.value) == (f"--data_dir {tmp_path / 'out'} is incomplete (fineweb.py's INCOMPLETE file is "
                                 "there): wait for fineweb.py, or rerun it with --resume")
    corpus.write_text('{"text": "' + "word " * 4100 + '"}\n')
    assert run_fineweb(["--input", str(corpus), "--out_dir", str(tmp_path / "out"), "--shard_size", "1025",
                        "--overwrite"]).returncode == 0
    assert "INCOMPLETE" not in [p.name for p in (tmp_path / "out").iterdir()]
    train, _ = checked_run(data_dir=str(tmp_path / "out")).token_streams()
    assert len(train.arrays) == 9  # 4,102 tokens: in tenths


def test_a_corpus_within_one_shard_gets_shards_of_a_tenth_in_one_command_and_trains(tmp_path, capsys):
    """Issue 62: `fineweb.py --input small.jsonl` took three commands: a refusal ("less than one --shard_size") that
    left the INCOMPLETE marker, then "holds an interrupted run's shards", then --overwrite. Now the first command
    cuts the corpus in tenths (a tenth validates, as train_gpt2.py splits a text file) and says so."""
    corpus = write_first_documents(tmp_path / "small.jsonl", 5)
    tokens = [token for document in document_tokens()[:5] for token in document]
    assert len(tokens) == 4808  # shards of 481: 9 of them, and the last of 479
    result = run_fineweb(["--input", str(corpus), "--out_dir", str(tmp_path / "small"), "--workers", "1"])
    assert result.returncode == 0, result.stderr
    split, summary = result.stdout.splitlines()
    assert split == ("4,808 tokens: 481 validate (the val shard), 4,327 train in 9 shards (a tenth each, as the corpus "
                     "is under 10 --shard_size)")
    assert summary.startswith(f"5 documents, 10 shards in {tmp_path / 'small'}, ")
    assert sorted(p.name for p in (tmp_path / "small").iterdir()) == (
        [f"small_train_{i:06d}.npy" for i in range(1, 10)] + ["small_val_000000.npy"])  # and no INCOMPLETE
    shards = read_shards(tmp_path / "small")
    assert [len(shard) for shard in shards] == [481] * 9 + [479]
    assert np.concatenate(shards).tolist() == tokens

    # a --shard_size of exactly the corpus: its one shard fills (the marker moves past it), and is cut again the same
    counts = fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(tmp_path / "given"),
                                              "--prefix", "small", "--shard_size", "4808", "--workers", "1"]))
    assert counts == (5, 4808, 10)
    assert capsys.readouterr().out.splitlines()[0] == split
    for path in (tmp_path / "small").iterdir():
        assert (tmp_path / "given" / path.name).read_bytes() == path.read_bytes(), path.name

    # 4 steps of 8 windows of 32 + 1 tokens; an evaluation of 8 windows needs 257 of the 481 val tokens (main() in
    # this process: what the script runs; the command that trains on shards is the end-to-end test's below)
    train_gpt2.main(train_gpt2.parse_args(shard_training_args(tmp_path / "small", tmp_path / "log") +
                                          ["--max_steps", "4", "--eval_every", "4"]))
    assert "; 4,327 train tokens" in capsys.readouterr().out  # 4,808 - 481
    train_losses, val_losses = losses(tmp_path / "log")
    assert (len(train_losses), len(val_losses)) == (4, 2)  # val: before training and after step 3
    assert all(math.isfinite(loss) for loss in train_losses + val_losses), (train_losses, val_losses)
    assert train_losses[-1] < train_losses[0], train_losses


SPLIT_IN_TENTHS = "1,457 validate (the val shard), 13,113 train in 9 shards (a tenth each, as the corpus is under 10 --shard_size)"


@pytest.mark.parametrize("shard_size, val, train, split", [
    (7285, 1457, [1457] * 9, SPLIT_IN_TENTHS),  # 2 shards as written (validation was half)
    (1619, 1457, [1457] * 9, SPLIT_IN_TENTHS),  # 9 shards, the last of 1,618 (validation was a ninth)
    (1457, 1457, [1457] * 9, "1,457 validate (the val shard), 13,113 train in 9 shards"),  # 10 shards: as written
    (1025, 1025, [1025] * 13 + [220], "1,025 validate (the val shard), 13,545 train in 14 shards"),  # 15 shards
])
def test_validation_gets_at_most_a_tenth_whatever_the_shard_size(tmp_path, capsys, shard_size, val, train, split):
    """Issue 68: a corpus of 2 to 10 shards kept its whole first shard for validation (a 110M-token corpus in shards of
    100M trained on 9% of it). Now one of less than 10 shards' tokens is cut in tenths; from 10 shards on, the first
    is validation as build-nanogpt writes it. The first 20 documents: 14,570 tokens."""
    corpus = write_first_documents(tmp_path / "corpus.jsonl", 20)
    stream = np.array([token for document in document_tokens()[:20] for token in document], dtype=np.uint16)
    counts = fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(tmp_path / "out"), "--prefix",
                                              "x", "--shard_size", str(shard_size), "--workers", "1"]))
    assert counts == (20, 14_570, 1 + len(train))
    assert capsys.readouterr().out.splitlines()[0] == "14,570 tokens: " + split
    ends = list(itertools.accumulate([val] + train))
    assert ends[-1] == len(stream) == 14_570  # the shards hold every token once
    names = ["x_val_000000.npy"] + [f"x_train_{i:06d}.npy" for i in range(1, len(ends))]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(names)
    for name, start, end in zip(names, [0] + ends[:-1], ends, strict=True):  # the stream's tokens in order, uint16
        assert (tmp_path / "out" / name).read_bytes() == npy_bytes(stream[start:end]), name


def test_a_stop_while_cutting_in_tenths_resumes_from_the_start(tmp_path, monkeypatch):
    """The cut rewrites shards that the marker counts as whole at --shard_size: a resume after a stop there (a full
    disk at the cut's 4th shard) kept 8 shards of 1,619 tokens, some of them rewritten, and refused them. The marker
    goes back to the start before the cut, so --resume tokenizes the corpus again."""
    corpus = write_first_documents(tmp_path / "corpus.jsonl", 20)
    args = ["--input", str(corpus), "--out_dir", str(tmp_path / "out"), "--shard_size", "1619", "--workers", "1"]
    plain_recut, plain_write = fineweb.recut_in_tenths, fineweb.write_atomically

    def recut_in_tenths(out_dir, prefix, shards):
        written = []

        def write_atomically(path, write):
            if len(written) == 3:
                raise fineweb.StoppedError(f"cannot write {path} (No space left on device)")
            written.append(path)
            plain_write(path, write)

        with monkeypatch.context() as patch:
            patch.setattr(fineweb, "write_atomically", write_atomically)
            return plain_recut(out_dir, prefix, shards)

    with monkeypatch.context() as patch, pytest.raises(fineweb.StoppedError):
        patch.setattr(fineweb, "recut_in_tenths", recut_in_tenths)
        fineweb.main(fineweb.parse_args(args))
    assert [len(shard) for shard in read_shards(tmp_path / "out")] == [1457] * 3 + [1619] * 5 + [1618]
    assert json.loads((tmp_path / "out" / "INCOMPLETE").read_text())["position"] == {
        "shards": 0, "documents": 0, "tokens_into_next": 0}
    assert fineweb.main(fineweb.parse_args(args + ["--resume"])) == (20, 14_570, 10)
    stream = np.array([token for document in document_tokens()[:20] for token in document], dtype=np.uint16)
    assert [shard.tolist() for shard in read_shards(tmp_path / "out")] == [
        stream[start : start + 1457].tolist() for start in range(0, 14_570, 1457)]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_tokenizer_with_ids_past_65535_writes_uint32_shards(tmp_path, monkeypatch, workers):
    """Issue 68: tokenizer() alone names the tokenizer; <|endoftext|>, the ids and the shards' dtype follow it. Ids
    past 65,535 went into uint16 (numpy's OverflowError). The stand-in: GPT-2's merges with the ids moved up by
    70,000, so its 20 documents are GPT-2's 14,570 tokens, cut the same, in shards of 1,457."""
    if workers == "2" and multiprocessing.get_start_method() != "fork":
        pytest.skip("a stand-in put in place here reaches forked workers only (spawned ones import fineweb.py, "
                    "which is how an edit of tokenizer() reaches them)")
    monkeypatch.setattr(fineweb, "tokenizer", moved_gpt2)
    corpus = write_first_documents(tmp_path / "corpus.jsonl", 20)
    counts = fineweb.main(fineweb.parse_args(["--input", str(corpus), "--out_dir", str(tmp_path / "out"),
                                              "--shard_size", "1457", "--workers", workers]))
    assert counts == (20, 14_570, 10)
    moved = moved_gpt2()
    expected = [token for text in corpus_texts()[:20] for token in [moved.eot_token] + moved.encode_ordinary(text)]
    assert (min(expected) >= 70_000, expected.count(120_256)) == (True, 20)  # <|endoftext|> is 120,256
    shards = read_shards(tmp_path / "out")
    assert [shard.dtype for shard in shards] == [np.uint32] * 10
    assert np.concatenate(shards).tolist() == expected


def test_a_refusal_after_shards_were_written_leaves_nothing_and_the_same_command_goes_on(tmp_path, monkeypatch):
    """Issue 62: a refusal left its shards and the marker, and the next run was told "holds an interrupted run's
    shards". Line 1 fills 4 shards of 1,025 tokens before line 2 is found bad; then nothing of the run is left."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "' + "word " * 4100 + '"}\n' + "not json\n")
    plain_write_marker, positions = fineweb.write_marker, []

    def write_marker(out_dir, settings, position, stream_note):  # notes how many shards are whole
        positions.append(position.shards)
        plain_write_marker(out_dir, settings, position, stream_note)

    monkeypatch.setattr(fineweb, "write_marker", write_marker)
    args = ["--input", str(corpus), "--out_dir", str(tmp_path / "out"), "--shard_size", "1025", "--workers", "1"]
    with pytest.raises(fineweb.ConfigError) as raised:
        fineweb.main(fineweb.parse_args(args))
    assert str(raised.value) == f"{corpus} line 2 is not valid JSON"
    assert positions == [0, 1, 2, 3, 4]  # 4 shards were whole, and are gone with the folder the run made
    assert not (tmp_path / "out").exists()
    (tmp_path / "mine").mkdir()  # a folder the run did not make stays, with what the run did not write
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(fineweb.ConfigError):
        fineweb.main(fineweb.parse_args(args[:3] + [str(tmp_path / "mine")] + args[4:] + ["--overwrite"]))
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]
    corpus.write_text('{"text": "' + "word " * 4100 + '"}\n')  # fixed: the same command, no --overwrite
    assert fineweb.main(fineweb.parse_args(args)) == (1, 4102, 10)
    assert [len(shard) for shard in read_shards(tmp_path / "out")] == [411] * 9 + [403]  # in tenths


def test_end_to_end_train_on_the_shards_one_and_two_processes(corpus_shards, one_thread, tmp_path):
    """One process (main() here, on one thread as each torchrun rank is) and 2 ranks under torchrun."""
    out_dir, _ = corpus_shards
    train_gpt2.main(train_gpt2.parse_args(shard_training_args(out_dir, tmp_path / "one")))
    train_losses, val_losses = losses(tmp_path / "one")
    assert train_losses[-1] < train_losses[0] - 1.5, train_losses  # measured: 10.81 -> 4.57
    assert val_losses[1] < train_losses[0] - 1.0, val_losses  # measured: 4.55 (val_losses[0]: before training)
    double = torchrun(2, ["train_gpt2.py"] + shard_training_args(out_dir, tmp_path / "two"))
    assert double.returncode == 0, double.stderr
    assert losses(tmp_path / "two") == (train_losses, val_losses)  # 2 ranks x 1 micro-step = 1 x 2, exactly


@pytest.mark.parametrize("name, content, args, message", [
    ("corpus.csv", "text\nhello\n", [], "{path}: unknown file type; use .jsonl, .jsonl.gz, .parquet, .txt"),
    ("corpus.jsonl", '{"text": "fine"}\nnot json\n', [], "{path} line 2 is not valid JSON"),
    ("corpus.jsonl", '{"text": "fine"}\n', ["--workers", "0"], "--workers must be at least 1, got 0"),
    ("corpus.jsonl", '{"text": "fine"}\n', ["--shard_size", "1"],
     "--shard_size 1 is too small: a shard should hold at least one training window of 1025 tokens"),
    ("corpus.jsonl", '{"text": "fine"}\n', ["--prefix", "a/b"],
     "--prefix a/b holds a '/': it starts the shards' file names, and --out_dir is their folder"),
    ("corpus.jsonl", '{"text": "fine"}\n["a", "list"]\n', [],
     "{path} line 2 has no string 'text' ([\"a\", \"list\"]): pass --text_field, or fix that record"),
    ("corpus.jsonl", '{"text": "a short corpus"}\n', [],
     "the corpus holds 4 tokens, less than one training window of 1,025: give more text"),
    ("corpus.jsonl.gz", b"\x1f\x8b\x08 not really gzip", [], "{path} is not a whole gzip file ({reason}): download or "
                                                            "compress it again"),
    ("corpus.parquet", b"PAR1 not really parquet", [], "{path} is not a parquet file ({reason}): check the file"),
    ("corpus.jsonl", '{"text": "fine"}\n{"text": null}\n', [],
     "{path} line 2 has no string 'text' ({{\"text\": null}}): pass --text_field, or fix that record"),
    ("corpus.jsonl", '{"text": "fine"}\n{"text": ["a", "list"]}\n', ["--workers", "2"],
     "{path} line 2 has no string 'text' ({{\"text\": [\"a\", \"list\"]}}): pass --text_field, or fix that record"),
    ("corpus.txt", b"caf\xe9 in Latin-1", [],
     "{path} is not UTF-8 text (invalid continuation byte at byte 3): convert it to UTF-8"),
    ("corpus.jsonl", '{"text": "fine"}\n', ["--out_dir", "{path}"], "cannot make --out_dir {path} (it is a file): "
                                                                    "give a folder you can write to"),
])
def test_more_input_mistakes(tmp_path, name, content, args, message):
    """Among them the issue-22 cases: a list record was told "pass --text_field", a corpus smaller than a shard ended
    with exit 0 and a val shard only, --shard_size 1 wrote 13,239 one-token shards, a corrupt .gz or a file named
    .parquet that is none were tracebacks, --prefix a/b was told "rerun with --resume". Each leaves no --out_dir."""
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    args = [arg.format(path=path) for arg in args]
    line = one_line_error(run_fineweb(["--input", str(path), "--out_dir", str(tmp_path / "out")] + args))
    if "{reason}" in message:  # the library's own words for what is wrong with the file
        reason = line[line.index(" (") + 2 : line.rindex("): ")]
        assert reason and "\n" not in reason
        message = message.replace("{reason}", reason)
    assert line == "error: " + message.format(path=path)
    assert not (tmp_path / "out").exists()


def test_a_gzip_file_cut_short_and_a_folder_given_as_input_are_one_line(tmp_path):
    import gzip

    whole = gzip.compress(("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(2000))).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    line = one_line_error(run_fineweb(["--input", str(tmp_path / "cut.jsonl.gz"), "--out_dir", str(tmp_path / "o")]))
    assert line == (f"error: {tmp_path / 'cut.jsonl.gz'} is not a whole gzip file (Compressed file ended before the "
                    "end-of-stream marker was reached): download or compress it again")
    (tmp_path / "folder").mkdir()
    line = one_line_error(run_fineweb(["--input", str(tmp_path / "folder"), "--out_dir", str(tmp_path / "o2")]))
    assert line == (f"error: --input {tmp_path / 'folder'} is a folder: give its files, as in "
                    f"'{tmp_path / 'folder' / '*.jsonl'}'")


def test_the_hub_offline_is_one_line_at_once(tmp_path):
    """datasets used to retry for 26 s and print 12 lines first."""
    pytest.importorskip("datasets")
    result = run_fineweb(["--out_dir", str(tmp_path / "out")], env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert one_line_error(result) == ("error: cannot reach http://127.0.0.1:9 for HuggingFaceFW/fineweb-edu ([Errno 111] "
                                      "Connection refused): check the network, or pass --input with local files")
    assert not (tmp_path / "out").exists()
