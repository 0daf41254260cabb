"""Tokenize a JSONL file (one {"text": ...} object per line) into a Megatron indexed dataset,
PREFIX_text_document.bin/.idx, with megatron-core's IndexedDatasetBuilder."""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    # Run as `python tools/preprocess_data.py` from a checkout: make `megatron.app` importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron.app.tokenizer import TOKENIZER_TYPES, Tokenizer, TokenizerError, build_tokenizer  # noqa: E402

_BATCH_LINES = 256


class PreprocessError(Exception):
    """The input cannot be turned into a dataset; the message names the file and line."""


@dataclass(slots=True)
class _Batch:
    """Tokens of one batch of input lines, or the first error in it."""

    # [document][json key] -> ids; None for a document whose texts are all empty.
    documents: list[list[list[int]] | None] = field(default_factory=list)
    text_bytes: int = 0
    blank_lines: int = 0
    error: str | None = None


# Set in each worker (and in the parent when --workers 1) by _init_worker.
_worker_tokenizer: Tokenizer | None = None
_worker_options: dict = {}


def _init_worker(tokenizer_args: tuple, options: dict) -> None:
    global _worker_tokenizer, _worker_options
    if options.get("in_subprocess"):
        # Each worker is one of --workers processes; a Rust thread pool per worker would
        # oversubscribe the cores that --workers already asked for.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = build_tokenizer(*tokenizer_args[:3], vocab_size=tokenizer_args[3])
    _worker_options = options


def _encode_batch(numbered_lines: list[tuple[int, str]]) -> _Batch:
    tokenizer, options = _worker_tokenizer, _worker_options
    batch = _Batch()
    keys, path = options["json_keys"], options["input"]
    texts_per_key: list[list[str]] = [[] for _ in keys]
    for line_number, line in numbered_lines:
        if not line.strip():
            batch.blank_lines += 1
            continue
        try:
            # Without the line break, an unterminated string reads as such, not as a control character.
            record = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as error:
            batch.error = f"{path}:{line_number}: invalid JSON at column {error.colno}: {error.msg}"
            return batch
        if not isinstance(record, dict):
            batch.error = f"{path}:{line_number}: expected a JSON object like {{\"text\": ...}}, got {type(record).__name__}"
            return batch
        for key_index, key in enumerate(keys):
            if key not in record:
                present = ", ".join(map(repr, record)) or "none"
                batch.error = (
                    f"{path}:{line_number}: no key {key!r} (keys present: {present}); "
                    "choose the key with --json-keys"
                )
                return batch
            if not isinstance(record[key], str):
                batch.error = f"{path}:{line_number}: {key!r} is {type(record[key]).__name__}, expected a string"
                return batch
            texts_per_key[key_index].append(record[key])
            batch.text_bytes += len(record[key].encode("utf-8"))
    tokens_per_key = [tokenizer.tokenize_batch(texts) for texts in texts_per_key]
    for document in zip(*tokens_per_key):
        ids = [list(key_ids) for key_ids in document]
        if all(len(key_ids) == 0 for key_ids in ids):
            # Checked before eod is appended: an empty text would otherwise become a lone eod.
            batch.documents.append(None)
            continue
        if options["append_eod"]:
            for key_ids in ids:
                key_ids.append(tokenizer.eod)
        batch.documents.append(ids)
    return batch


def _numbered_batches(path: str) -> Iterator[list[tuple[int, str]]]:
    with open(path, encoding="utf-8", errors="strict") as stream:
        batch: list[tuple[int, str]] = []
        line_number = 0
        while True:
            try:
                line = stream.readline()
            except UnicodeDecodeError as error:
                raise PreprocessError(f"{path}:{line_number + 1}: not UTF-8 text ({error.reason})") from None
            if not line:
                break
            line_number += 1
            batch.append((line_number, line))
            if len(batch) == _BATCH_LINES:
                yield batch
                batch = []
        if batch:
            yield batch


def _output_paths(prefix: str, key: str) -> tuple[str, str]:
    return f"{prefix}_{key}_document.bin", f"{prefix}_{key}_document.idx"


def preprocess(args: argparse.Namespace) -> dict:
    """Write the datasets; returns a summary. Raises PreprocessError/TokenizerError on bad input."""
    # Checked before importing megatron.core (seconds), so typos fail at once.
    if not os.path.isfile(args.input):
        raise PreprocessError(f"--input {args.input}: no such file")
    tokenizer_args = (args.tokenizer_type, args.vocab_file, args.merge_file, args.vocab_size)
    # Built here for its vocabulary size and errors; tokenizing happens in _encode_batch.
    tokenizer = build_tokenizer(*tokenizer_args[:3], vocab_size=args.vocab_size)
    import numpy

    with warnings.catch_warnings():
        # Importing megatron.core warns that Transformer Engine/Apex are absent; no use here.
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_dir, exist_ok=True)

    final_paths = {key: _output_paths(args.output_prefix, key) for key in args.json_keys}
    # Write under temporary names and rename at the end, so a failed or interrupted run leaves
    # neither partial files nor a mismatched .bin/.idx pair under the final names.
    suffix = f".tmp-{os.getpid()}"
    temporary = {key: (bin_path + suffix, idx_path + suffix) for key, (bin_path, idx_path) in final_paths.items()}
    builders = {key: IndexedDatasetBuilder(temporary[key][0], dtype=dtype) for key in args.json_keys}
    options = {
        "json_keys": list(args.json_keys),
        "input": args.input,
        "append_eod": args.append_eod,
        "in_subprocess": args.workers > 1,
    }
    documents = tokens = text_bytes = blank_lines = skipped_empty = 0
    start = time.perf_counter()
    next_log = args.log_interval
    pool = None
    succeeded = False
    try:
        if args.workers > 1:
            # fork: workers inherit the imports; the parent never ran the Rust tokenizer, so no
            # thread pool is copied into the children.
            context = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
            pool = context.Pool(args.workers, initializer=_init_worker, initargs=(tokenizer_args, options))
            batches = pool.imap(_encode_batch, _numbered_batches(args.input), chunksize=4)
        else:
            _init_worker(tokenizer_args, options)
            batches = map(_encode_batch, _numbered_batches(args.input))
        for batch in batches:
            if batch.error:
                raise PreprocessError(batch.error)
            blank_lines += batch.blank_lines
            text_bytes += batch.text_bytes
            for document in batch.documents:
                if document is None:
                    skipped_empty += 1
                    continue
                for key, ids in zip(args.json_keys, document):
                    builders[key].add_document(numpy.asarray(ids, dtype=numpy.int64), [len(ids)])
                    tokens += len(ids)
                documents += 1
            if args.log_interval and documents >= next_log:
                elapsed = max(time.perf_counter() - start, 1e-9)
                print(
                    f"processed {documents:,} documents ({documents / elapsed:,.0f} docs/s, "
                    f"{text_bytes / elapsed / 1e6:.2f} MB/s)",
                    flush=True,
                )
                next_log += args.log_interval
        if documents == 0:
            raise PreprocessError(
                f"{args.input}: no non-empty documents under key(s) {', '.join(args.json_keys)}"
            )
        for key, builder in builders.items():
            builder.finalize(temporary[key][1])
        for key in args.json_keys:
            # .idx last: until it is in place a reader does not see the new dataset at all.
            os.replace(temporary[key][0], final_paths[key][0])
            os.replace(temporary[key][1], final_paths[key][1])
        succeeded = True
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if not succeeded:
            for builder in builders.values():
                builder.data_file.close()
            for paths in temporary.values():
                for path in paths:
                    if os.path.exists(path):
                        os.remove(path)
    elapsed = max(time.perf_counter() - start, 1e-9)
    return {
        "documents": documents,
        "tokens": tokens,
        "text_bytes": text_bytes,
        "skipped_empty": skipped_empty,
        "blank_lines": blank_lines,
        "seconds": elapsed,
        "dtype": numpy.dtype(dtype).name,
        "outputs": [final_paths[key] for key in args.json_keys],
        "tokenizer": repr(tokenizer),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tools/preprocess_data.py",
        description="Tokenize JSONL into a Megatron indexed dataset (PREFIX_KEY_document.bin/.idx).",
    )
    group = parser.add_argument_group("input")
    group.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES,
                       help="tokenizer the documents are encoded with (as pretrain_gpt.py's --tokenizer-type)")
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    group.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    group.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_KEY_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=int, default=1000, help="report progress every N documents")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("error: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        summary = preprocess(args)
    except (PreprocessError, TokenizerError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    seconds = summary["seconds"]
    print(
        f"done: {summary['documents']:,} documents, {summary['tokens']:,} tokens "
        f"({summary['dtype']}), {summary['text_bytes'] / 1e6:.2f} MB of text in {seconds:.2f} s "
        f"({summary['documents'] / seconds:,.0f} docs/s, {summary['text_bytes'] / seconds / 1e6:.2f} MB/s); "
        f"skipped {summary['skipped_empty']} empty documents and {summary['blank_lines']} blank lines; "
        f"tokenizer {summary['tokenizer']}"
    )
    for bin_path, idx_path in summary["outputs"]:
        print(f"wrote {bin_path} and {idx_path}; train with --data-path {bin_path[:-len('.bin')]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
