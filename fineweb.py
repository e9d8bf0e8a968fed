"""Tokenize a corpus into uint16 .npy shards that `train_gpt2.py --data_dir` reads.

    python3 fineweb.py                                   # FineWeb-Edu sample-10BT (needs `datasets`, network)
    python3 fineweb.py --input my_corpus/*.jsonl --out_dir my_shards

Every document becomes <|endoftext|> followed by its GPT-2 tokens; the token stream is cut into
shards of --shard_size tokens, the first one validation and the rest training. Output is
byte-identical whatever the number of workers.
"""

import argparse
import functools
import glob
import gzip
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass

import numpy as np


class ConfigError(Exception):
    """A user mistake: printed as one line, exit status 2."""


# Lies in --out_dir while shards are being written, and stays there if the run is interrupted: train_gpt2.py
# refuses a --data_dir that holds it, rather than train on the part written so far.
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
    parser.add_argument("--dataset", default=defaults.dataset, help="Hugging Face dataset used when --input is empty")
    parser.add_argument("--dataset_subset", default=defaults.dataset_subset, help="its subset (config name)")
    cfg = ShardConfig(**vars(parser.parse_args(argv)))
    if cfg.shard_size < 1 or cfg.workers < 1:
        raise ConfigError(f"--shard_size ({cfg.shard_size}) and --workers ({cfg.workers}) must be at least 1")
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


def read_hub_documents(cfg: ShardConfig):
    import datasets

    try:
        stream = datasets.load_dataset(cfg.dataset, name=cfg.dataset_subset, split="train", streaming=True)
        for record in stream:
            yield record[cfg.text_field]
    except (OSError, ConnectionError) as error:
        raise ConfigError(f"cannot reach {cfg.dataset} ({error}): check the network, or pass --input") from None


# ----------------------------------------------------------------------------- tokenizing


@functools.cache
def gpt2_encoding():
    import tiktoken

    return tiktoken.get_encoding("gpt2")


def tokenize_document(text: str) -> np.ndarray:
    """<|endoftext|> then the document's tokens, as uint16 (every GPT-2 id is below 2**16)."""
    encoding = gpt2_encoding()
    tokens = np.array([encoding.eot_token] + encoding.encode_ordinary(text), dtype=np.int64)
    if tokens.max() >= 2**16:
        raise ValueError(f"token id {tokens.max()} does not fit in uint16")
    return tokens.astype(np.uint16)


def tokenized_documents(documents, workers: int):
    """Token arrays in document order; a pool's imap keeps that order, so output never depends on workers."""
    if workers == 1:
        yield from map(tokenize_document, documents)
        return
    with multiprocessing.Pool(workers) as pool:
        yield from pool.imap(tokenize_document, documents, chunksize=16)


# ----------------------------------------------------------------------------- writing shards


def shard_path(out_dir: str, prefix: str, index: int) -> str:
    split = "val" if index == 0 else "train"  # the first shard is held out for validation
    return os.path.join(out_dir, f"{prefix}_{split}_{index:06d}.npy")


def write_shard(path: str, tokens: np.ndarray) -> None:
    """Write to PATH.tmp, flush to disk, then rename: a reader never sees a half-written shard."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        np.save(f, tokens)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def write_shards(token_arrays, out_dir: str, prefix: str, shard_size: int, progress=None) -> tuple[int, int, int]:
    """Cut the stream of token arrays into shards of shard_size tokens (the last holds the rest).

    A document that does not fit spills into the next shard. Returns (documents, tokens, shards).
    """
    buffer = np.empty(shard_size, dtype=np.uint16)
    filled = documents = total_tokens = shards = 0
    for tokens in token_arrays:
        documents += 1
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
    if filled:
        write_shard(shard_path(out_dir, prefix, shards), buffer[:filled])
        shards += 1
    return documents, total_tokens, shards


def prepare_out_dir(out_dir: str, overwrite: bool) -> None:
    # a folder that holds nothing but the marker (a run that failed before its first shard) counts as empty
    if os.path.isdir(out_dir) and set(os.listdir(out_dir)) - {INCOMPLETE_MARKER}:
        if not overwrite:
            raise ConfigError(f"--out_dir {out_dir} is not empty: pass --overwrite to replace its shards, "
                              "or choose another folder")
        # what a loader could read, and an interrupted run's leftovers
        for pattern in ("*_train_*.npy", "*_val_*.npy", "*.npy.tmp", INCOMPLETE_MARKER):
            for path in glob.glob(os.path.join(out_dir, pattern)):
                os.remove(path)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as error:
        problem = "it is a file" if os.path.isfile(out_dir) else error.strerror
        raise ConfigError(f"cannot make --out_dir {out_dir} ({problem}): give a folder you can write to") from None


# ----------------------------------------------------------------------------- main


def main(cfg: ShardConfig) -> tuple[int, int, int]:
    paths = expand_inputs(cfg.input) if cfg.input else None
    check_readers(paths)
    prepare_out_dir(cfg.out_dir, cfg.overwrite)
    prefix = cfg.prefix or os.path.basename(os.path.normpath(cfg.out_dir))
    marker = os.path.join(cfg.out_dir, INCOMPLETE_MARKER)
    with open(marker, "w") as f:
        f.write("fineweb.py is writing the shards in this folder; if it was interrupted, rerun it with --overwrite\n")
    documents = read_local_documents(paths, cfg.text_field) if paths else read_hub_documents(cfg)
    from tqdm import tqdm

    started = time.perf_counter()
    # disable=None: no bar when stderr is not a terminal (a log file, CI)
    with tqdm(unit="tokens", unit_scale=True, desc="tokenizing", file=sys.stderr, disable=None) as progress:
        counts = write_shards(tokenized_documents(documents, cfg.workers), cfg.out_dir, prefix, cfg.shard_size,
                              progress)
    num_documents, num_tokens, num_shards = counts
    if num_documents == 0:
        raise ConfigError(f"no documents in --input {' '.join(cfg.input)}: check the files")
    os.remove(marker)  # every shard is complete and in place
    elapsed = time.perf_counter() - started
    print(f"{num_documents:,} documents, {num_tokens:,} tokens, {num_shards} shards in {cfg.out_dir}, "
          f"{num_tokens / elapsed:,.0f} tokens/s")
    return counts


if __name__ == "__main__":
    try:
        main(parse_args(sys.argv[1:]))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
