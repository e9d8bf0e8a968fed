"""Tokenize a corpus into uint16 .npy shards that `train_gpt2.py --data_dir` reads.

    python3 fineweb.py                                   # FineWeb-Edu sample-10BT (needs `datasets`, network)
    python3 fineweb.py --input my_corpus/*.jsonl --out_dir my_shards
    python3 fineweb.py --resume                          # the same command again after an interruption

Every document becomes <|endoftext|> followed by its GPT-2 tokens; the token stream is cut into
shards of --shard_size tokens, the first one validation and the rest training. Output is
byte-identical whatever the number of workers, and after an interruption `--resume` tokenizes only
what the complete shards lack.
"""

import argparse
import collections
import concurrent.futures
import contextlib
import errno
import functools
import glob
import gzip
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import typing
from dataclasses import dataclass

import numpy as np


class ConfigError(Exception):
    """A user mistake: printed as one line, exit status 2."""


# Lies in --out_dir while shards are being written, and stays there if the run is interrupted: train_gpt2.py
# refuses a --data_dir that holds it, rather than train on the part written so far. It holds (as JSON) the
# settings and how far the complete shards reach, which is what --resume goes on from.
INCOMPLETE_MARKER = "INCOMPLETE"


# ----------------------------------------------------------------------------- config


@dataclass
class ShardConfig:
    input: list[str]  # local files or globs; empty: FineWeb-Edu through `datasets`
    text_field: str = "text"
    out_dir: str = "edu_fineweb10B"
    prefix: str = ""  # shard names start with this; empty: the name of out_dir
    shard_size: int = 10**8  # 100M tokens: 200 MB a shard, about 100 shards for 10B tokens
    workers: int = max(1, (os.cpu_count() or 2) // 2)
    overwrite: bool = False
    resume: bool = False
    dataset: str = "HuggingFaceFW/fineweb-edu"
    dataset_subset: str = "sample-10BT"


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


def parse_args(argv: list[str]) -> ShardConfig:
    defaults = ShardConfig(input=[])
    parser = _OneLineErrorParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--input", nargs="+", default=[], metavar="FILE_OR_GLOB",
                        help=".jsonl, .jsonl.gz, .parquet or .txt files (a .txt file is one document); "
                             "none: download --dataset")
    parser.add_argument("--text_field", default=defaults.text_field, help="field holding the text in .jsonl/.parquet")
    parser.add_argument("--out_dir", default=defaults.out_dir, help="folder for the shards")
    parser.add_argument("--prefix", default=defaults.prefix, help="shard name prefix (empty: the out_dir's name)")
    parser.add_argument("--shard_size", type=int, default=defaults.shard_size, help="tokens per shard")
    parser.add_argument("--workers", type=int, default=defaults.workers, help="tokenizer processes (half the cores)")
    parser.add_argument("--overwrite", action="store_true",
                        help="allow a non-empty out_dir, deleting the shards (and leftover .tmp files) in it first")
    parser.add_argument("--resume", action="store_true",
                        help="go on from an interrupted run in out_dir (same settings): keep its complete shards and "
                             "tokenize only the documents after them; the shards come out as an uninterrupted run's")
    parser.add_argument("--dataset", default=defaults.dataset, help="Hugging Face dataset used when --input is empty")
    parser.add_argument("--dataset_subset", default=defaults.dataset_subset, help="its subset (config name)")
    cfg = ShardConfig(**vars(parser.parse_args(argv)))
    if cfg.shard_size < 1 or cfg.workers < 1:
        raise ConfigError(f"--shard_size ({cfg.shard_size}) and --workers ({cfg.workers}) must be at least 1")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume keeps out_dir's shards and --overwrite deletes them: pass one of the two")
    return cfg


# ----------------------------------------------------------------------------- reading documents


def expand_inputs(patterns: list[str]) -> list[str]:
    """Each pattern's files in sorted order, patterns in the order given."""
    paths = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise ConfigError(f"--input {pattern} matches no file: check the path")
        paths.extend(matches)
    return paths


def read_jsonl(path: str, text_field: str):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{path} line {line_number} is not valid JSON") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ConfigError(f"{path} line {line_number} has no field {text_field!r}: pass --text_field")
            text = record[text_field]
            if not isinstance(text, str):
                raise ConfigError(f"{path} line {line_number}: {text_field!r} is {json.dumps(text)[:40]}, "
                                  "not a string: fix or drop that record")
            yield text


def read_parquet(path: str, text_field: str):
    import pyarrow.parquet  # check_readers made sure it imports

    table = pyarrow.parquet.ParquetFile(path)
    if text_field not in table.schema_arrow.names:
        raise ConfigError(f"{path} has no column {text_field!r} (it has {table.schema_arrow.names}): pass --text_field")
    row = 0
    for batch in table.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise ConfigError(f"{path} row {row}: {text_field!r} is {text!r}, not a string: fix or drop that row")
            row += 1
            yield text


def read_text(path: str, text_field: str):
    with open(path, encoding="utf-8") as f:
        yield f.read()


READERS = {".jsonl": read_jsonl, ".jsonl.gz": read_jsonl, ".parquet": read_parquet, ".txt": read_text}


def reader_for(path: str):
    suffix = next((s for s in READERS if path.endswith(s)), None)
    if suffix is None:
        raise ConfigError(f"{path}: unknown file type; use {', '.join(READERS)}")
    return READERS[suffix]


def check_readers(paths: list[str] | None) -> None:
    """Before any work: every file has a reader, and the optional library its path needs imports."""
    for path in paths or []:
        if reader_for(path) is read_parquet:
            try:
                import pyarrow.parquet  # noqa: F401  (only .parquet inputs need it)
            except ImportError:
                raise ConfigError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    if paths is None:
        try:
            import datasets  # noqa: F401  (only the default source needs it)
        except ImportError:
            raise ConfigError("downloading FineWeb-Edu needs the datasets library: pip install datasets "
                              "(or pass --input with local files)") from None


def read_local_documents(paths: list[str], text_field: str):
    for path in paths:
        try:
            yield from reader_for(path)(path, text_field)
        except UnicodeDecodeError as error:
            raise ConfigError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): convert it to UTF-8") \
                from None


# Every this many documents the hub stream's position is noted (datasets' state_dict, a small dict), so that --resume
# goes on from the last note before the complete shards' end instead of streaming all of 10B tokens' text again
STREAM_NOTE_EVERY = 10_000


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_hub_documents(cfg: ShardConfig, skip: int, resume_note: dict | None, notes: collections.deque):
    """FineWeb-Edu's documents after the first `skip`, going on from resume_note (a note an earlier run took, at or
    before `skip`) where the stream can, which then heads `notes`. Appends a note to `notes` every STREAM_NOTE_EVERY
    documents: {"documents": n, "state": the stream's state_dict() after n documents, "datasets": its version,
    "next_document": document n's digest, checked when going on from it}."""
    import datasets

    def load():
        return datasets.load_dataset(cfg.dataset, name=cfg.dataset_subset, split="train", streaming=True)

    try:
        stream, records, index = load(), None, 0
        if resume_note and resume_note["documents"] <= skip:
            records = records_from_note(stream, resume_note, cfg.text_field, datasets.__version__)
            if records is None:
                print(f"{cfg.dataset}'s stream cannot go on where the last run noted (another version of datasets, "
                      "or the stream changed): reading it again from the start", file=sys.stderr, flush=True)
                stream = load()
            else:
                notes.append(resume_note)  # until a later note is within the shards
                index = resume_note["documents"]
        state = None
        for record in records or stream:
            text = record[cfg.text_field]
            if state is not None:  # the state before this document: the note is complete with its digest
                notes.append({"documents": index, "state": state, "datasets": datasets.__version__,
                              "next_document": text_digest(text)})
                state = None
            if index >= skip:
                yield text
            index += 1
            if index % STREAM_NOTE_EVERY == 0 and hasattr(stream, "state_dict"):  # datasets 2.18 and newer
                state = stream.state_dict()
    except (OSError, ConnectionError) as error:
        raise ConfigError(f"cannot reach {cfg.dataset} ({error}): check the network and rerun with --resume "
                          "(no shard is lost), or pass --input") from None


def records_from_note(stream, note: dict, text_field: str, datasets_version: str):
    """The stream's records from the note's document on, or None where it cannot go on there: a state that another
    version of datasets wrote, or one that leads to another document than the note's."""
    if note["datasets"] != datasets_version:
        return None
    try:
        stream.load_state_dict(note["state"])
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    records = iter(stream)
    first = next(records, None)
    if first is None or text_digest(first[text_field]) != note["next_document"]:
        return None
    return itertools.chain([first], records)


def last_note_within(notes: collections.deque, documents: int) -> dict | None:
    """The last note at or before `documents` documents; drops the notes before it, which no later shard needs."""
    while len(notes) > 1 and notes[1]["documents"] <= documents:
        notes.popleft()
    return notes[0] if notes and notes[0]["documents"] <= documents else None


# ----------------------------------------------------------------------------- tokenizing


@functools.cache
def gpt2_encoding():
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except (OSError, ValueError) as error:  # offline with nothing cached (requests' errors are OSErrors); a bad file
        raise ConfigError(f"cannot load the GPT-2 tokenizer ({type(error).__name__}): tiktoken downloads its two "
                          "files once; connect to the network, or set TIKTOKEN_CACHE_DIR to a folder that holds "
                          "them") from None


def tokenize_document(text: str) -> np.ndarray:
    """<|endoftext|> then the document's tokens, as uint16 (every GPT-2 id is below 2**16)."""
    encoding = gpt2_encoding()
    tokens = np.array([encoding.eot_token] + encoding.encode_ordinary(text), dtype=np.int64)
    if tokens.max() >= 2**16:
        raise ValueError(f"token id {tokens.max()} does not fit in uint16")
    return tokens.astype(np.uint16)


def start_worker(main_pid: int) -> None:
    """Runs first in each tokenizer process. A worker leaves Ctrl-C (sent to the whole terminal group) and SIGHUP
    to the main process, which ends it, instead of each worker printing a traceback; SIGTERM (`pkill -f fineweb.py`
    reaches workers too) kills it silently rather than running the main process's handler, which the fork copied.
    And it exits once the main process is gone (killed outright, say) instead of waiting for work forever: its
    parent changes (fork, spawn), or the main pid no longer exists (forkserver, whose server outlives the main)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = os.getppid()

    def exit_when_orphaned():
        while os.getppid() == parent:
            time.sleep(1)
            try:
                os.kill(main_pid, 0)  # signal 0: only asks whether the process exists
            except ProcessLookupError:
                break
        os._exit(1)

    threading.Thread(target=exit_when_orphaned, daemon=True).start()


def tokenize_documents(texts: list[str]) -> list[np.ndarray]:
    return [tokenize_document(text) for text in texts]


def end_the_run_now(message: str, status: int) -> typing.NoReturn:
    """Kill the workers, say why in one line, exit. Any moment is a safe one: shards and the marker are only ever
    replaced whole. Nothing is shut down that could wait forever: a worker killed halfway through sending its
    result leaves the rest of that message missing from the result pipe, and whatever reads the pipe (the pool's
    own thread, which a shutdown joins) waits for it for good (seen here, with multiprocessing.Pool and with
    ProcessPoolExecutor)."""
    for worker in multiprocessing.active_children():
        worker.kill()
    print(message, file=sys.stderr, flush=True)
    os._exit(status)


WORKER_DIED = ("error: a tokenizer process died (the system may have run out of memory): rerun with --resume, "
               "with fewer --workers if memory is short")


def tokenized_in_order(executor, documents, chunk_size: int, in_flight: int):
    """Each document's token array, in document order, from chunks of chunk_size documents of which at most
    in_flight are queued or being tokenized at a time: memory stays bounded however fast the input comes. A worker
    that dies (the kernel's out-of-memory killer, say) ends the run with one line."""
    documents = iter(documents)
    chunks = iter(lambda: list(itertools.islice(documents, chunk_size)), [])
    pending, workers_seen = collections.deque(), set()
    try:
        for chunk in chunks:
            pending.append(executor.submit(tokenize_documents, chunk))
            workers_seen |= {worker.pid for worker in multiprocessing.active_children()}  # submit starts them
            if len(pending) == in_flight:
                yield from result_when_done(pending.popleft(), workers_seen)
        while pending:
            yield from result_when_done(pending.popleft(), workers_seen)
    except concurrent.futures.BrokenExecutor:  # BrokenProcessPool: submit and result raise it once a worker has died
        end_the_run_now(WORKER_DIED, status=1)


def result_when_done(chunk: concurrent.futures.Future, workers_seen: set[int]) -> list[np.ndarray]:
    """The chunk's result. A worker killed while sending a result leaves a cut message that the executor's own
    thread waits on for good, so the executor never says that the pool broke: a worker seen alive (when submit
    started it) and now gone is what tells then."""
    while True:
        try:
            return chunk.result(timeout=1)
        except concurrent.futures.TimeoutError:
            if workers_seen - {worker.pid for worker in multiprocessing.active_children()}:
                end_the_run_now(WORKER_DIED, status=1)


@contextlib.contextmanager
def tokenizing(documents, workers: int):
    """The documents' token arrays, in document order; the output never depends on the number of workers.
    Leaving early (an error) cancels the queued chunks and lets the workers finish the ones they hold rather
    than killing them (see end_the_run_now)."""
    if workers == 1:
        yield map(tokenize_document, documents)
        return
    executor = concurrent.futures.ProcessPoolExecutor(workers, initializer=start_worker, initargs=(os.getpid(),))
    try:
        yield tokenized_in_order(executor, documents, chunk_size=16, in_flight=4 * workers)
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def signals_end_the_run(out_dir: str):
    """In here, Ctrl-C, SIGTERM and SIGHUP end the run at once with one line (end_the_run_now), rather than
    raising wherever the main thread happens to be. A signal that was ignored (nohup, a background job) stays
    ignored."""

    def stop(signum, frame):
        end_progress_bar = "\n" if sys.stderr.isatty() else ""
        end_the_run_now(f"{end_progress_bar}stopped by {signal.Signals(signum).name}: the complete shards stay in "
                        f"{out_dir}; rerun the same command with --resume to go on",
                        status=128 + signum)  # the shell's convention for a process ended by that signal

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(signum) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# ----------------------------------------------------------------------------- writing shards


def shard_path(out_dir: str, prefix: str, index: int) -> str:
    split = "val" if index == 0 else "train"  # the first shard is held out for validation
    return os.path.join(out_dir, f"{prefix}_{split}_{index:06d}.npy")


def write_atomically(path: str, write) -> None:
    """write(file) to PATH.tmp, flush to disk, then rename: a reader sees the old file or the whole new one, never
    half a shard. A full disk is one line; the partial .tmp goes, to free its space."""
    temporary = path + ".tmp"
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as error:
        if os.path.exists(temporary):
            os.remove(temporary)
        fix = "make room" if error.errno == errno.ENOSPC else "fix that"
        raise ConfigError(f"cannot write {path} ({error.strerror}): {fix}, then rerun with --resume") from None


def write_shard(path: str, tokens: np.ndarray) -> None:
    write_atomically(path, lambda f: np.save(f, tokens))


@dataclass(frozen=True)  # frozen: write_shards' default start is shared by every call
class Position:
    """How far the complete shards reach into the document stream: all --resume needs to go on."""
    shards: int = 0  # complete shards written
    documents: int = 0  # documents wholly inside them
    tokens_into_next: int = 0  # tokens of the next document already in them (it spills over into the next shard)


def write_shards(token_arrays, out_dir: str, prefix: str, shard_size: int, start: Position = Position(),
                 on_shard=None, progress=None) -> tuple[int, int, int]:
    """Cut the stream of token arrays into shards of shard_size tokens (the last holds the rest).

    A document that does not fit spills into the next shard. token_arrays are the documents after
    start.documents; the first of them loses the start.tokens_into_next tokens already written. After
    each complete shard, on_shard gets the new Position. Returns (documents, tokens, shards), counted
    from the beginning of the stream.
    """
    buffer = np.empty(shard_size, dtype=np.uint16)
    filled, documents, shards = 0, start.documents, start.shards
    total_tokens, already_written = start.shards * shard_size, start.tokens_into_next
    for document in token_arrays:
        tokens, already_written = document[already_written:], 0
        total_tokens += len(tokens)
        if progress is not None:
            progress.update(len(tokens))
        while len(tokens):
            taken = min(len(tokens), shard_size - filled)
            buffer[filled : filled + taken] = tokens[:taken]
            filled, tokens = filled + taken, tokens[taken:]
            if filled == shard_size:
                write_shard(shard_path(out_dir, prefix, shards), buffer)
                filled, shards = 0, shards + 1
                if on_shard is not None:  # the document is whole in the shards once nothing of it is left
                    on_shard(Position(shards, documents + 1, 0) if len(tokens) == 0 else
                             Position(shards, documents, len(document) - len(tokens)))
        documents += 1
    if filled:
        write_shard(shard_path(out_dir, prefix, shards), buffer[:filled])
        shards += 1
    return documents, total_tokens, shards


def shard_files(out_dir: str) -> list[str]:
    """What a loader could read, and an interrupted run's leftovers."""
    patterns = ("*_train_*.npy", "*_val_*.npy", "*.npy.tmp")
    return sorted(path for pattern in patterns for path in glob.glob(os.path.join(out_dir, pattern)))


def make_out_dir(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        problem = "it is a file" if os.path.isfile(out_dir) else error.strerror
        raise ConfigError(f"cannot make --out_dir {out_dir} ({problem}): give a folder you can write to") from None


@contextlib.contextmanager
def writing_alone(out_dir: str):
    """Hold a lock on out_dir while in here, so that a second fineweb.py on it (a --resume started while the first
    still runs) stops at once instead of deleting the first one's files. The kernel drops the lock when the process
    ends, so a crash leaves none behind; a file system without locks runs unguarded."""
    import fcntl  # Unix only

    folder = os.open(out_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another fineweb.py ({marker_record(out_dir).get('writer', 'its pid unknown')}) is "
                              f"writing --out_dir {out_dir}: wait for it to end, or stop it") from None
        except OSError:
            pass
        yield
    finally:
        os.close(folder)


def clear_out_dir(out_dir: str, overwrite: bool) -> None:
    # a folder that holds nothing but the marker (a run that failed before its first shard) counts as empty
    if set(os.listdir(out_dir)) - {INCOMPLETE_MARKER, INCOMPLETE_MARKER + ".tmp"}:
        if not overwrite:
            interrupted = os.path.exists(os.path.join(out_dir, INCOMPLETE_MARKER))
            raise ConfigError(f"--out_dir {out_dir} holds an interrupted run's shards: pass --resume to go on from "
                              "them, or --overwrite to start again" if interrupted else
                              f"--out_dir {out_dir} is not empty: pass --overwrite to replace its shards, "
                              "or choose another folder")
        for path in shard_files(out_dir) + glob.glob(os.path.join(out_dir, INCOMPLETE_MARKER)):
            os.remove(path)


def run_settings(cfg: ShardConfig, paths: list[str] | None, prefix: str) -> dict:
    """What decides the bytes written, so --resume can check it goes on with the same (file sizes catch edits)."""
    source = {"input": [[os.path.abspath(p), os.path.getsize(p)] for p in paths]} if paths else \
        {"dataset": cfg.dataset, "dataset_subset": cfg.dataset_subset}
    return {**source, "text_field": cfg.text_field, "shard_size": cfg.shard_size, "prefix": prefix}


def write_marker(out_dir: str, settings: dict, position: Position, stream_note: dict | None) -> None:
    """stream_note: where the hub's stream stood at or before the position (read_hub_documents), None for files."""
    record = {"note": "fineweb.py is writing the shards in this folder; if it was interrupted, rerun it with "
                      "--resume to go on, or --overwrite to start again",
              "writer": f"pid {os.getpid()} on {os.uname().nodename}", "settings": settings, "position": vars(position),
              "stream_note": stream_note}
    write_atomically(os.path.join(out_dir, INCOMPLETE_MARKER), lambda f: f.write(json.dumps(record, indent=1).encode()))


def marker_record(out_dir: str) -> dict:
    """The marker's record, its position made a Position; {} if there is none."""
    path = os.path.join(out_dir, INCOMPLETE_MARKER)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            record = json.load(f)
        record["position"], record["settings"] = Position(**record["position"]), dict(record["settings"])
        note = record.setdefault("stream_note", None)  # None: local files, or a marker of an older fineweb.py
        if note is not None and not (isinstance(note["documents"], int) and
                                     {"state", "datasets", "next_document"} <= set(note)):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{path} is not a progress record fineweb.py wrote: pass --overwrite to start again") \
            from None
    return record


def resume_position(out_dir: str, settings: dict) -> tuple[Position, dict | None]:
    """Where the interrupted run in out_dir stopped, after checking it had these settings and its shards are whole,
    and its last note of the hub's stream (None for files); Position() for a folder with nothing to go on from.
    Removes what comes after that position."""
    record = marker_record(out_dir)
    if not record:
        if shard_files(out_dir):
            raise ConfigError(f"--out_dir {out_dir} holds a finished run (no {INCOMPLETE_MARKER} file): nothing to "
                              "resume; pass --overwrite to tokenize again")
        return Position(), None
    position, settings_were = record["position"], record["settings"]
    for name, value in settings.items():
        if settings_were.get(name) != value:
            was = "other files or sizes" if name == "input" else repr(settings_were.get(name))
            raise ConfigError(f"--resume: the interrupted run in {out_dir} had --{name} {was}, not "
                              f"{'these' if name == 'input' else repr(value)}: pass the same settings, or "
                              "--overwrite to start again")
    kept = [shard_path(out_dir, settings["prefix"], index) for index in range(position.shards)]
    for path in kept:
        if not os.path.exists(path) or np.load(path, mmap_mode="r").shape != (settings["shard_size"],):
            raise ConfigError(f"--resume: {path} is missing or not {settings['shard_size']} tokens: "
                              "pass --overwrite to start again")
    for path in set(shard_files(out_dir)) - set(kept):  # shards past the position, half-written ones
        os.remove(path)
    return position, record["stream_note"]


# ----------------------------------------------------------------------------- main


def main(cfg: ShardConfig) -> tuple[int, int, int]:
    paths = expand_inputs(cfg.input) if cfg.input else None
    check_readers(paths)
    prefix = cfg.prefix or os.path.basename(os.path.normpath(cfg.out_dir))
    settings = run_settings(cfg, paths, prefix)
    gpt2_encoding()  # loaded here first, so that a tokenizer that cannot be had stops the run before it starts
    make_out_dir(cfg.out_dir)
    with writing_alone(cfg.out_dir):
        if cfg.resume:
            start, resume_note = resume_position(cfg.out_dir, settings)
        else:
            clear_out_dir(cfg.out_dir, cfg.overwrite)
            start, resume_note = Position(), None
        write_marker(cfg.out_dir, settings, start, resume_note)
        # the documents in the complete shards are read again (from files), not tokenized again
        stream_notes = collections.deque()
        documents = (itertools.islice(read_local_documents(paths, cfg.text_field), start.documents, None) if paths
                     else read_hub_documents(cfg, start.documents, resume_note, stream_notes))
        from tqdm import tqdm

        started = time.perf_counter()
        # disable=None: no bar when stderr is not a terminal (a log file, CI)
        with signals_end_the_run(cfg.out_dir), tokenizing(documents, cfg.workers) as token_arrays, \
                tqdm(unit="tokens", unit_scale=True, desc="tokenizing", file=sys.stderr, disable=None) as progress:
            counts = write_shards(token_arrays, cfg.out_dir, prefix, cfg.shard_size, start,
                                  lambda position: write_marker(cfg.out_dir, settings, position,
                                                                last_note_within(stream_notes, position.documents)),
                                  progress)
        num_documents, num_tokens, num_shards = counts
        if num_documents == 0:
            raise ConfigError(f"no documents in --input {' '.join(cfg.input)}: check the files")
        os.remove(os.path.join(cfg.out_dir, INCOMPLETE_MARKER))  # every shard is complete and in place
    elapsed = time.perf_counter() - started
    resumed = f" (went on after {start.shards} shards)" if start.shards else ""
    print(f"{num_documents:,} documents, {num_tokens:,} tokens, {num_shards} shards in {cfg.out_dir}{resumed}, "
          f"{(num_tokens - start.shards * cfg.shard_size) / elapsed:,.0f} tokens/s")
    return counts


if __name__ == "__main__":
    try:
        main(parse_args(sys.argv[1:]))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
