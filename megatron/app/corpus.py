"""The embedded demo corpus: English text made on the machine itself from the docstrings and
help topics of this Python's standard library, read with `ast` (no module is imported or run)
and written as JSONL, one `{"text": ...}` document per line."""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron.app.progress import SILENT, Reporter, reporter

# Test suites and vendored third-party code are not the library's own prose.
_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
_SHUFFLE_SEED = 1234


@dataclass(frozen=True, slots=True)
class CorpusStats:
    path: Path
    documents: int
    characters: int
    source: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _python_files(root: Path) -> list[Path]:
    files = []
    for directory, subdirs, names in os.walk(root):
        # Sorting in place makes os.walk's order, and so the corpus, the same on every run.
        subdirs[:] = sorted(name for name in subdirs if name not in _SKIPPED_DIRS)
        files.extend(Path(directory, name) for name in sorted(names) if name.endswith(".py"))
    return files


def _docstring_groups(tree: ast.Module) -> Iterator[list[str]]:
    """Module docstring; each top-level function; each class with its methods' docstrings."""
    module_doc = ast.get_docstring(tree)
    if module_doc:
        yield [module_doc]
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield [doc]
        elif isinstance(node, ast.ClassDef):
            group = [ast.get_docstring(node)]
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    group.append(ast.get_docstring(member))
            yield [doc for doc in group if doc]


def _help_topics(root: Path) -> list[str]:
    """The reference-manual sections that `help('assert')` prints, from pydoc_data/topics.py."""
    path = root / "pydoc_data" / "topics.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return []
    topics: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            topics.extend(
                value.value
                for value in node.values
                if isinstance(value, ast.Constant) and isinstance(value.value, str)
            )
    return topics


def iter_stdlib_documents(*, min_chars: int = 200, root: Path | None = None,
                          progress: Reporter = SILENT) -> Iterator[str]:
    """Documents of English text from the standard library, deduplicated, in a fixed order.

    The order is shuffled with a fixed seed so that a train/valid/test split by position is a
    fair sample of all modules rather than the alphabetically last ones. `progress` counts the
    files parsed (silent by default).
    """
    root = stdlib_root() if root is None else root
    seen: set[str] = set()
    documents: list[str] = []
    for path in progress.iterate("reading standard-library files", _python_files(root)):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            continue  # e.g. lib2to3 grammar fixtures in Python 2 syntax
        for group in _docstring_groups(tree):
            fresh = [doc.strip() for doc in group if doc.strip() not in seen]
            seen.update(fresh)
            text = "\n\n".join(fresh)
            if text and len(text) >= min_chars:
                documents.append(text)
    for topic in _help_topics(root):
        topic = topic.strip()
        if topic and topic not in seen and len(topic) >= min_chars:
            seen.add(topic)
            documents.append(topic)
    random.Random(_SHUFFLE_SEED).shuffle(documents)
    yield from documents


def write_corpus(
    output: str | os.PathLike, *, min_chars: int = 200, max_chars: int | None = None,
    progress: Reporter = SILENT,
) -> CorpusStats:
    """Write the demo corpus as JSONL (atomically) and return what was written."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    documents = characters = 0
    try:
        with open(temporary, "w", encoding="utf-8") as stream:
            for text in iter_stdlib_documents(min_chars=min_chars, progress=progress):
                if max_chars is not None and characters >= max_chars:
                    break
                stream.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                documents += 1
                characters += len(text)
        os.replace(temporary, output)
    finally:
        temporary.unlink(missing_ok=True)
    source = f"Python {sys.version.split()[0]} standard library at {stdlib_root()}"
    return CorpusStats(path=output, documents=documents, characters=characters, source=source)


def read_jsonl_texts(path: str | os.PathLike, key: str = "text") -> Iterator[str]:
    with open(path, encoding="utf-8") as stream:
        for line in stream:
            if line.strip():
                yield json.loads(line)[key]


def _counted(items: Iterator[str], step) -> Iterator[str]:
    for item in items:
        step.update()
        yield item


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.app.corpus",
        description="Write the embedded demo corpus (standard-library docstrings) as JSONL.",
    )
    parser.add_argument("--output", required=True, help="JSONL file to write, e.g. data/corpus.jsonl")
    parser.add_argument("--min-chars", type=int, default=200, help="drop shorter documents")
    parser.add_argument("--max-chars", type=int, default=None, help="stop after about this many characters")
    parser.add_argument(
        "--train-tokenizer",
        metavar="DIR",
        default=None,
        help="also train a byte-level BPE on the corpus and write DIR/vocab.json and DIR/merges.txt",
    )
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size for --train-tokenizer")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    # Progress lines go to stderr (MEGATRON_PROGRESS=0 silences them); the summaries stay on stdout.
    progress = reporter("corpus")
    stats = write_corpus(args.output, min_chars=args.min_chars, max_chars=args.max_chars, progress=progress)
    if stats.documents == 0:
        print(f"error: no documents of at least {args.min_chars} characters found", file=sys.stderr)
        return 1
    print(
        f"wrote {stats.documents:,} documents, {stats.characters:,} characters "
        f"({stats.characters / 1e6:.1f} MB) to {stats.path} in {time.perf_counter() - start:.1f} s "
        f"(from the {stats.source})"
    )
    if args.train_tokenizer:
        from megatron.app.tokenizer import TokenizerError, build_tokenizer, train_byte_level_bpe

        start = time.perf_counter()
        try:
            # The trainer pulls the documents as it counts words (counted here), then computes the merges.
            with progress.step("training the tokenizer, documents read", stats.documents) as step:
                vocab_path, merges_path = train_byte_level_bpe(
                    _counted(read_jsonl_texts(stats.path), step), args.train_tokenizer, vocab_size=args.vocab_size
                )
            tokenizer = build_tokenizer("GPT2BPETokenizer", str(vocab_path), str(merges_path))
        except TokenizerError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(
            f"trained a byte-level BPE tokenizer (vocab size {tokenizer.vocab_size}, eod {tokenizer.eod}) "
            f"in {time.perf_counter() - start:.1f} s: --vocab-file {vocab_path} --merge-file {merges_path}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
