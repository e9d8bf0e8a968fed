"""Tokenize a corpus into the .npy shards that `train_gpt2.py --data_dir` reads.

    python3 fineweb.py                                   # FineWeb-Edu sample-10BT (needs datasets)
    python3 fineweb.py --input 'my_corpus/*.jsonl' --out_dir my_shards
    python3 fineweb.py --resume                          # the same command again after a stop

Each document becomes <|endoftext|> and its tokens (tokenizer(): GPT-2's, uint16; uint32 for ids
past 65,535), cut into shards of --shard_size tokens (a corpus of less than 10: in tenths): the
first for validation, the rest for training; the same bytes for any number of workers.
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
import socket
import sys
import threading
import time
import urllib.parse
import zlib
from dataclasses import dataclass

import numpy as np

# In --out_dir while shards are written, and left there if the run is interrupted: train_gpt2.py
# refuses a folder that holds it. Its JSON says how far the complete shards reach, for --resume.
INCOMPLETE_MARKER = "INCOMPLETE"
MIN_SHARD_SIZE = 1025  # one training window at GPT-2's context: 1024 tokens and the next one


class ConfigError(Exception):
    """A user mistake: printed as one line, exit status 2."""


class StoppedError(ConfigError):
    """A run stopped part way by a full disk or a lost connection: its shards stay for --resume."""


class _OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _OneLineErrorParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--input", nargs="+", default=[], metavar="FILE_OR_GLOB",
                        help=".jsonl, .jsonl.gz, .parquet or .txt files; none: --dataset")
    parser.add_argument("--text_field", default="text", help="the text's field or column")
    parser.add_argument("--out_dir", default="edu_fineweb10B", help="folder for the shards")
    parser.add_argument("--prefix", default="", help="shard name prefix (default: out_dir's name)")
    parser.add_argument("--shard_size", type=int, default=10**8,
                        help="tokens per shard (200 MB); a corpus of less than 10: a tenth of it")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="tokenizer processes")
    parser.add_argument("--overwrite", action="store_true", help="delete out_dir's shards first")
    parser.add_argument("--resume", action="store_true", help="go on from a stopped run's shards")
    parser.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu",
                        help="Hugging Face dataset read without --input")
    parser.add_argument("--dataset_subset", default="sample-10BT", help="its subset")
    cfg = parser.parse_args(argv)
    if cfg.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {cfg.workers}")
    if cfg.shard_size < MIN_SHARD_SIZE:
        raise ConfigError(f"--shard_size {cfg.shard_size} is too small: a shard should hold at "
                          f"least one training window of {MIN_SHARD_SIZE} tokens")
    if os.sep in cfg.prefix:
        raise ConfigError(f"--prefix {cfg.prefix} holds a {os.sep!r}: it starts the shards' file "
                          "names, and --out_dir is their folder")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume keeps out_dir's shards and --overwrite deletes them: pass "
                          "one of the two")
    return cfg


# ----------------------------------------------------------------------------- reading documents

def read_jsonl(path: str, text_field: str):
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{path} line {number} is not valid JSON") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"{path} line {number} has no string {text_field!r} "
                                  f"({line.strip()[:40]}): pass --text_field, or fix that record")
            yield text


def read_parquet(path: str, text_field: str):
    import pyarrow.parquet  # main made sure it imports

    try:
        table = pyarrow.parquet.ParquetFile(path)
    except pyarrow.ArrowInvalid as error:
        raise ConfigError(f"{path} is not a parquet file ({error}): check the file") from None
    if text_field not in table.schema_arrow.names:
        raise ConfigError(f"{path} has no column {text_field!r} (it has "
                          f"{table.schema_arrow.names}): pass --text_field")
    texts = (text for batch in table.iter_batches(columns=[text_field])
             for text in batch.column(0).to_pylist())
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(f"{path} row {row}: {text_field!r} is {text!r}, not a string: fix or "
                              "drop that row")
        yield text


def read_text(path: str, text_field: str):
    with open(path, encoding="utf-8") as f:
        yield f.read()  # the whole file is one document


READERS = {".jsonl": read_jsonl, ".jsonl.gz": read_jsonl, ".parquet": read_parquet,
           ".txt": read_text}


def input_files(patterns: list[str]) -> list[str]:
    """Each pattern's files, sorted, in the order of the patterns."""
    paths = []
    for pattern in patterns:
        paths += sorted(glob.glob(pattern)) or [pattern]
    for path in paths:
        if not os.path.exists(path):
            raise ConfigError(f"--input {path} matches no file: check the path")
        if os.path.isdir(path):
            raise ConfigError(f"--input {path} is a folder: give its files, as in "
                              f"'{os.path.join(path, '*.jsonl')}'")
        reader_for(path)
    return paths


def reader_for(path: str):
    suffix = next((suffix for suffix in READERS if path.endswith(suffix)), None)
    if suffix is None:
        raise ConfigError(f"{path}: unknown file type; use {', '.join(READERS)}")
    return READERS[suffix]


def read_local_documents(paths: list[str], text_field: str):
    for path in paths:
        try:
            yield from reader_for(path)(path, text_field)
        except UnicodeDecodeError as error:
            raise ConfigError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}): "
                              "convert it to UTF-8") from None
        except (gzip.BadGzipFile, EOFError, zlib.error) as error:
            raise ConfigError(f"{path} is not a whole gzip file ({error or 'it is cut short'}): "
                              "download or compress it again") from None


# Every this many documents the hub stream's position is noted (datasets' state_dict), so that
# --resume goes on from the last note within the complete shards, not from the first document
STREAM_NOTE_EVERY = 10_000


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_hub_reachable(dataset: str) -> None:
    """Offline, datasets retries for half a minute and prints a dozen lines: one line, at once."""
    from huggingface_hub.constants import ENDPOINT

    url = urllib.parse.urlsplit(ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=10).close()
    except OSError as error:
        raise ConfigError(f"cannot reach {ENDPOINT} for {dataset} ({error}): check the network, "
                          "or pass --input with local files") from None


def read_hub_documents(cfg, skip: int, resume_note: dict | None, notes: collections.deque):
    """The dataset's documents after the first `skip`, from resume_note on where the stream can.
    Every STREAM_NOTE_EVERY documents it notes the stream's state_dict() in `notes`."""
    import datasets

    def load():
        return datasets.load_dataset(cfg.dataset, name=cfg.dataset_subset, split="train",
                                     streaming=True)

    try:
        stream, records, index = load(), None, 0
        if resume_note and resume_note["documents"] <= skip:
            records = records_from_note(stream, resume_note, cfg.text_field, datasets.__version__)
            if records is None:
                print(f"{cfg.dataset}'s stream cannot go on where the last run noted (another "
                      "version of datasets, or the stream changed): reading it again from the "
                      "start", file=sys.stderr, flush=True)
                stream = load()
            else:
                notes.append(resume_note)  # until a later note is within the shards
                index = resume_note["documents"]
        state = None
        for record in records or stream:
            text = record[cfg.text_field]
            if state is not None:  # the state before this document, whose digest completes it
                notes.append({"documents": index, "state": state, "datasets": datasets.__version__,
                              "next_document": text_digest(text)})
                state = None
            if index >= skip:
                yield text
            index += 1
            if index % STREAM_NOTE_EVERY == 0 and hasattr(stream, "state_dict"):  # datasets 2.18+
                state = stream.state_dict()
    except (OSError, ConnectionError) as error:
        raise StoppedError(f"cannot reach {cfg.dataset} ({error}): check the network and rerun "
                           "with --resume (no shard is lost), or pass --input") from None


def records_from_note(stream, note: dict, text_field: str, datasets_version: str):
    """The stream's records from the note's document on; None where another datasets version wrote
    the state, or it leads to another document than the note's."""
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
    """The last note at or before `documents`; drops earlier ones, which no later shard needs."""
    while len(notes) > 1 and notes[1]["documents"] <= documents:
        notes.popleft()
    return notes[0] if notes and notes[0]["documents"] <= documents else None


# ----------------------------------------------------------------------------- tokenizing

@functools.cache
def tokenizer():
    """The one place that names the tokenizer: the ids, <|endoftext|> and the dtype follow it."""
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except (OSError, ValueError) as error:  # offline with nothing cached; a damaged file
        raise ConfigError(f"cannot load the tokenizer ({type(error).__name__}): tiktoken "
                          "downloads its files once; connect to the network, or set "
                          "TIKTOKEN_CACHE_DIR to a folder that holds them") from None


def token_dtype() -> type:
    """uint16 while every id fits, as build-nanogpt's GPT-2 shards; else uint32."""
    return np.uint16 if tokenizer().n_vocab <= 2**16 else np.uint32


def tokenize_document(text: str) -> np.ndarray:
    """<|endoftext|> then the document's tokens."""
    encoding = tokenizer()
    return np.array([encoding.eot_token] + encoding.encode_ordinary(text), dtype=token_dtype())


def tokenize_documents(texts: list[str]) -> list[np.ndarray]:
    return [tokenize_document(text) for text in texts]


def start_worker() -> None:
    """Leave Ctrl-C to the main process; exit once it is gone (killed outright, it would leave the
    workers waiting for work forever: tested)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def exit_when_orphaned():  # the parent is the main process, or a forkserver that ends with it
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=exit_when_orphaned, daemon=True).start()


def end_the_run_now(message: str, status: int):
    """Kill the workers, say why, exit without shutting the pool down (it may wait forever)."""
    for worker in multiprocessing.active_children():
        worker.kill()
    print(message, file=sys.stderr, flush=True)
    os._exit(status)


WORKER_DIED = ("error: a tokenizer process died (the system may have run out of memory): rerun "
               "with --resume, with fewer --workers if memory is short")


def tokenized_in_order(executor, documents, chunk_size: int, in_flight: int):
    """Each document's tokens in order; at most in_flight chunks queued, so memory stays bounded."""
    documents = iter(documents)
    chunks = iter(lambda: list(itertools.islice(documents, chunk_size)), [])
    pending, workers_seen = collections.deque(), set()
    try:
        for chunk in chunks:
            pending.append(executor.submit(tokenize_documents, chunk))
            workers_seen |= {worker.pid for worker in multiprocessing.active_children()}
            if len(pending) == in_flight:
                yield from result_when_done(pending.popleft(), workers_seen)
        while pending:
            yield from result_when_done(pending.popleft(), workers_seen)
    except concurrent.futures.BrokenExecutor:  # the executor saw a worker die
        end_the_run_now(WORKER_DIED, status=1)


def result_when_done(chunk: concurrent.futures.Future, workers_seen: set[int]) -> list:
    """A worker killed while sending a result hangs the executor (1 run in 40 of the killed-worker
    test): a worker seen alive and now gone ends the run then."""
    while True:
        try:
            return chunk.result(timeout=1)
        except concurrent.futures.TimeoutError:
            if workers_seen - {worker.pid for worker in multiprocessing.active_children()}:
                end_the_run_now(WORKER_DIED, status=1)


@contextlib.contextmanager
def tokenizing(documents, workers: int):
    """The documents' token arrays in order, the same for any number of workers."""
    if workers == 1:
        yield map(tokenize_document, documents)
        return
    executor = concurrent.futures.ProcessPoolExecutor(workers, initializer=start_worker)
    try:
        yield tokenized_in_order(executor, documents, chunk_size=16, in_flight=4 * workers)
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------- writing shards

def shard_path(out_dir: str, prefix: str, index: int) -> str:
    split = "val" if index == 0 else "train"  # the first shard is held out for validation
    return os.path.join(out_dir, f"{prefix}_{split}_{index:06d}.npy")


def write_atomically(path: str, write) -> None:
    """write(file) to PATH.tmp, flush it to disk, rename: readers never see half a file."""
    temporary = path + ".tmp"
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as error:  # np.save's short write has no errno: "N requested and M written"
        if os.path.exists(temporary):
            os.remove(temporary)  # a full disk gets its space back
        full = error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, None)
        fix = f"make room in {os.path.dirname(path) or '.'}" if full else "fix that"
        raise StoppedError(f"cannot write {path} ({error.strerror or error}): {fix}, then rerun "
                           "with --resume") from None


@dataclass(frozen=True)  # frozen: write_shards' default start is shared by every call
class Position:
    """How far the complete shards reach into the document stream: what --resume goes on from."""
    shards: int = 0  # complete shards written
    documents: int = 0  # documents wholly inside them
    tokens_into_next: int = 0  # tokens of the next document already in them


def write_shards(token_arrays, out_dir: str, prefix: str, shard_size: int,
                 start: Position = Position(), on_shard=None, progress=None):
    """Cut the tokens into shards of shard_size (the last holds the rest), documents spilling over.
    token_arrays go on from start (the first less the tokens already written); on_shard gets each
    complete shard's Position. Returns (documents, tokens, shards) from the stream's start."""
    buffer = np.empty(shard_size, dtype=token_dtype())
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
                write_atomically(shard_path(out_dir, prefix, shards), lambda f: np.save(f, buffer))
                filled, shards = 0, shards + 1
                if on_shard is not None:  # whole in the shards once nothing of it is left
                    on_shard(Position(shards, documents + 1, 0) if len(tokens) == 0 else
                             Position(shards, documents, len(document) - len(tokens)))
        documents += 1
    if filled:
        write_atomically(shard_path(out_dir, prefix, shards), lambda f: np.save(f, buffer[:filled]))
        shards += 1
    return documents, total_tokens, shards


def recut_in_tenths(out_dir: str, prefix: str, shards: int) -> tuple[int, int]:
    """A corpus of less than 10 shards, read into memory and cut again in tenths: a tenth validates,
    as train_gpt2.py holds out of a text file. Returns (the new shard size, shards)."""
    paths = [shard_path(out_dir, prefix, index) for index in range(shards)]
    tokens = np.concatenate([np.load(path, mmap_mode="r") for path in paths])
    shard_size = -(-len(tokens) // 10)  # rounded up: 10 shards, the last the rest
    return shard_size, write_shards(iter([tokens]), out_dir, prefix, shard_size)[2]


# ----------------------------------------------------------------------------- the marker, --resume

def shard_files(out_dir: str) -> list[str]:
    """What a loader could read, and a stopped run's leftovers."""
    patterns = ("*_train_*.npy", "*_val_*.npy", "*.npy.tmp")
    folder = glob.escape(out_dir)  # a "data[1]" folder too
    return sorted(p for pattern in patterns for p in glob.glob(os.path.join(folder, pattern)))


def write_marker(out_dir: str, settings: dict, position: Position, stream_note: dict | None):
    """stream_note: where the hub's stream stood at or before position; None for local files."""
    record = {"note": "fineweb.py is writing the shards in this folder; if it was stopped, rerun "
                      "it with --resume to go on, or --overwrite to start again",
              "settings": settings, "position": vars(position), "stream_note": stream_note}
    write_atomically(os.path.join(out_dir, INCOMPLETE_MARKER),
                     lambda f: f.write(json.dumps(record, indent=1).encode()))


def resume_position(out_dir: str, settings: dict) -> tuple[Position, dict | None]:
    """Where the stopped run in out_dir goes on (settings checked, complete shards kept, the rest
    removed), and its last note of the hub's stream."""
    marker = os.path.join(out_dir, INCOMPLETE_MARKER)
    if not os.path.exists(marker):
        if shard_files(out_dir):
            raise ConfigError(f"--out_dir {out_dir} holds a finished run (no {INCOMPLETE_MARKER} "
                              "file): nothing to resume; pass --overwrite to tokenize again")
        return Position(), None
    try:
        with open(marker) as f:
            record = json.load(f)
        position, note = Position(**record["position"]), record["stream_note"]
        if note is not None and not (isinstance(note["documents"], int)
                                     and {"state", "datasets", "next_document"} <= set(note)):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{marker} is not a progress record fineweb.py wrote: pass --overwrite "
                          "to start again") from None
    for name, value in settings.items():
        was = record["settings"].get(name)
        if was != value:
            raise ConfigError(f"--resume: the interrupted run in {out_dir} had --{name} "
                              f"{'other files or sizes' if name == 'input' else repr(was)}, not "
                              f"{'these' if name == 'input' else repr(value)}: pass the same "
                              "settings, or --overwrite to start again")
    kept = [shard_path(out_dir, settings["prefix"], index) for index in range(position.shards)]
    for path in kept:
        if not os.path.exists(path) or len(np.load(path, mmap_mode="r")) != settings["shard_size"]:
            raise ConfigError(f"--resume: {path} is missing or not {settings['shard_size']} "
                              "tokens: pass --overwrite to start again")
    for path in set(shard_files(out_dir)) - set(kept):  # past the position, or half-written
        os.remove(path)
    return position, note


def clear_out_dir(out_dir: str, overwrite: bool) -> None:
    """Make out_dir empty; without --overwrite only a marker (no shard written yet) may be there."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        problem = "it is a file" if os.path.isfile(out_dir) else error.strerror
        raise ConfigError(f"cannot make --out_dir {out_dir} ({problem}): give a folder you can "
                          "write to") from None
    marker = os.path.join(out_dir, INCOMPLETE_MARKER)
    if set(os.listdir(out_dir)) - {INCOMPLETE_MARKER, INCOMPLETE_MARKER + ".tmp"}:
        if not overwrite:
            raise ConfigError(f"--out_dir {out_dir} holds an interrupted run's shards: pass "
                              "--resume to go on from them, or --overwrite to start again"
                              if os.path.exists(marker) else f"--out_dir {out_dir} is not empty: "
                              "pass --overwrite to replace its shards, or choose another folder")
        for path in shard_files(out_dir) + glob.glob(glob.escape(marker)):
            os.remove(path)


@contextlib.contextmanager
def removed_on_refusal(out_dir: str, made_out_dir: bool):
    """A refusal (a bad record, too little text) removes the shards, the marker and a folder this
    run made: the fixed input is another, which --resume refuses. A StoppedError keeps them."""
    try:
        yield
    except StoppedError:
        raise
    except ConfigError:
        marker = os.path.join(out_dir, INCOMPLETE_MARKER)
        for path in shard_files(out_dir) + glob.glob(glob.escape(marker)):
            os.remove(path)
        if made_out_dir and not os.listdir(out_dir):
            os.rmdir(out_dir)
        raise


# ----------------------------------------------------------------------------- main

def main(cfg: argparse.Namespace) -> tuple[int, int, int]:
    paths = input_files(cfg.input) if cfg.input else None
    parquet = [path for path in paths or [] if path.endswith(".parquet")]
    if parquet:  # the optional library a source needs, before any work
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ConfigError(f"reading {parquet[0]} needs pyarrow: pip install pyarrow") from None
    if paths is None:
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise ConfigError("downloading FineWeb-Edu needs the datasets library: pip install "
                              "datasets (or pass --input with local files)") from None
        check_hub_reachable(cfg.dataset)
    prefix = cfg.prefix or os.path.basename(os.path.normpath(cfg.out_dir))
    # what decides the bytes written, for --resume to check (the files' sizes catch edits)
    source = ({"input": [[os.path.abspath(p), os.path.getsize(p)] for p in paths]} if paths else
              {"dataset": cfg.dataset, "dataset_subset": cfg.dataset_subset})
    settings = {**source, "text_field": cfg.text_field, "shard_size": cfg.shard_size,
                "prefix": prefix}
    tokenizer()  # a tokenizer that cannot be had stops the run before it writes anything
    made_out_dir = not os.path.isdir(cfg.out_dir)
    if cfg.resume and not made_out_dir:
        start, resume_note = resume_position(cfg.out_dir, settings)
    else:
        clear_out_dir(cfg.out_dir, cfg.overwrite)
        start, resume_note = Position(), None
    with removed_on_refusal(cfg.out_dir, made_out_dir):
        write_marker(cfg.out_dir, settings, start, resume_note)
        notes = collections.deque()
        # the documents in the complete shards are read again (from files), not tokenized again
        documents = (itertools.islice(read_local_documents(paths, cfg.text_field),
                                      start.documents, None) if paths else
                     read_hub_documents(cfg, start.documents, resume_note, notes))

        def on_shard(position):
            write_marker(cfg.out_dir, settings, position,
                         last_note_within(notes, position.documents))

        from tqdm import tqdm

        started = time.perf_counter()
        # disable=None: no bar where stderr is no terminal (a log file, CI)
        with tokenizing(documents, cfg.workers) as token_arrays, \
                tqdm(unit="tokens", unit_scale=True, desc="tokenizing", disable=None) as progress:
            num_documents, num_tokens, num_shards = write_shards(
                token_arrays, cfg.out_dir, prefix, cfg.shard_size, start, on_shard, progress)
        if num_documents == 0:
            raise ConfigError(f"no documents in --input {' '.join(cfg.input)}: check the files")
        if num_tokens < MIN_SHARD_SIZE:
            raise ConfigError(f"the corpus holds {num_tokens:,} tokens, less than one training "
                              f"window of {MIN_SHARD_SIZE:,}: give more text")
        size, tenths = cfg.shard_size, ""
        if num_tokens < 10 * size:  # the val shard would hold more than a tenth
            write_marker(cfg.out_dir, settings, Position(), None)  # a stop while cutting: anew
            size, num_shards = recut_in_tenths(cfg.out_dir, prefix, num_shards)
            tenths = " (a tenth each, as the corpus is under 10 --shard_size)"
    os.remove(os.path.join(cfg.out_dir, INCOMPLETE_MARKER))  # every shard is whole and in place
    speed = (num_tokens - start.shards * cfg.shard_size) / (time.perf_counter() - started)
    resumed = f" (went on after {start.shards} shards)" if start.shards else ""
    print(f"{num_tokens:,} tokens: {size:,} validate (the val shard), {num_tokens - size:,} train "
          f"in {num_shards - 1} shards{tenths}")
    print(f"{num_documents:,} documents, {num_shards} shards in {cfg.out_dir}{resumed}, "
          f"{speed:,.0f} tokens/s")
    return num_documents, num_tokens, num_shards


if __name__ == "__main__":
    try:
        config = parse_args(sys.argv[1:])
        main(config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # SIGTERM's default is as safe: shards are only replaced whole
        end_progress_bar = "\n" if sys.stderr.isatty() else ""
        print(f"{end_progress_bar}stopped: the complete shards stay in {config.out_dir}; rerun the "
              "same command with --resume to go on", file=sys.stderr)
        sys.exit(130)
