"""Tokenizers for training and tools/preprocess_data.py: GPT-2 byte-level BPE read from
vocab.json/merges.txt, plus a byte tokenizer and a null tokenizer that need no files, and a
trainer that writes GPT-2-format vocab.json/merges.txt from local text."""
from __future__ import annotations

import json
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

EOD_TEXT = "<|endoftext|>"
TOKENIZER_TYPES = ("GPT2BPETokenizer", "ByteLevelTokenizer", "NullTokenizer")
# For --mock-data without a tokenizer: NullTokenizer(1023) has 1023 ids plus eod = 1024.
MOCK_DEFAULT_VOCAB_SIZE = 1023
_DEMO_HINT = (
    "to make a vocab.json/merges.txt on this machine run "
    "`python -m megatron.app.corpus --output data/corpus.jsonl --train-tokenizer data/tokenizer`"
)


class TokenizerError(Exception):
    """A tokenizer cannot be built from the given flags or files."""


class Tokenizer(ABC):
    """What the trainer and the preprocessing tool need from a tokenizer."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, eod included (ids are 0..vocab_size-1)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """Id of the end-of-document token appended between documents."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(text) for text in texts]

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        # megatron-core serialises the tokenizer into the key of its dataset index cache with
        # json.dumps(default=lambda obj: obj.unique_identifiers); without it that call fails.
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class ByteLevelTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255 and eod is 256: lossless, no files, vocabulary of 257."""

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eod(self) -> int:
        return 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        # Decode runs of bytes together so multi-byte characters survive; eod prints like GPT-2's.
        pieces: list[str] = []
        run = bytearray()
        for token in ids:
            token = int(token)
            if token == self.eod:
                pieces.append(run.decode("utf-8", errors="replace"))
                pieces.append(EOD_TEXT)
                run = bytearray()
            elif 0 <= token < 256:
                run.append(token)
            else:
                raise ValueError(f"token id {token} is outside ByteLevelTokenizer's 0..256")
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)


class NullTokenizer(Tokenizer):
    """Text is already token ids separated by spaces; eod is the extra id `vocab_size`.

    As in Megatron-LM, `--vocab-size N` means N ordinary ids, so the vocabulary is N + 1.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 1:
            raise TokenizerError(f"--vocab-size must be at least 1 for NullTokenizer, got {vocab_size}")
        self._ids_without_eod = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._ids_without_eod + 1

    @property
    def eod(self) -> int:
        return self._ids_without_eod

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(word) for word in text.split()]
        except ValueError as error:
            raise ValueError(f"NullTokenizer expects space-separated integers: {error}") from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(token)) for token in ids)


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            "GPT-2 BPE needs the `tokenizers` package (Hugging Face, no download of models): "
            "pip install tokenizers"
        ) from None
    return tokenizers


def _byte_level_bpe(tokenizers, model):
    """A tokenizers.Tokenizer that pre-splits and decodes exactly like GPT-2."""
    tokenizer = tokenizers.Tokenizer(model)
    # add_prefix_space=False: GPT-2 does not insert a space before the first word.
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return tokenizer


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from a GPT-2 `vocab.json` and `merges.txt`; eod is `<|endoftext|>`.

    `<|endoftext|>` written inside a document is encoded as ordinary text, as GPT-2's own
    encoder does, so only preprocess_data.py's `--append-eod` puts eod ids into a dataset.
    """

    def __init__(self, vocab_file: str | os.PathLike, merge_file: str | os.PathLike) -> None:
        tokenizers = _import_tokenizers()
        self.vocab_file = str(vocab_file)
        self.merge_file = str(merge_file)
        try:
            with open(self.vocab_file, encoding="utf-8") as stream:
                vocab = json.load(stream)
        except json.JSONDecodeError as error:
            raise TokenizerError(
                f"--vocab-file {self.vocab_file} is not valid JSON ({error}); "
                "expected a GPT-2 vocab.json mapping token -> id"
            ) from None
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise TokenizerError(
                f"--vocab-file {self.vocab_file} is not a GPT-2 vocab.json (a JSON object token -> id)"
            )
        if EOD_TEXT not in vocab:
            raise TokenizerError(
                f"--vocab-file {self.vocab_file} has no {EOD_TEXT!r} token, which GPT-2 uses as eod"
            )
        self._eod = int(vocab[EOD_TEXT])
        # max id + 1 rather than len(): an embedding table must cover every id even with gaps.
        self._vocab_size = max(vocab.values()) + 1
        try:
            model = tokenizers.models.BPE.from_file(self.vocab_file, self.merge_file)
        except Exception as error:  # the Rust side raises a bare Exception
            raise TokenizerError(
                f"cannot read --merge-file {self.merge_file} with --vocab-file {self.vocab_file}: {error}"
            ) from None
        self._tokenizer = _byte_level_bpe(tokenizers, model)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch runs on the Rust thread pool.
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(token) for token in ids], skip_special_tokens=False)

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {**super().unique_identifiers, "vocab_file": self.vocab_file, "merge_file": self.merge_file}


def _require_file(flag: str, path: str | None, tokenizer_type: str, what: str) -> str:
    if not path:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type} needs {flag} ({what}); {_DEMO_HINT}"
        )
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path}: no such file ({what}); {_DEMO_HINT}")
    return path


def build_tokenizer(
    tokenizer_type: str | None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    *,
    vocab_size: int | None = None,
) -> Tokenizer:
    """Build the tokenizer named by `--tokenizer-type`; errors name the flag or file to fix."""
    if tokenizer_type is None and vocab_file and merge_file:
        tokenizer_type = "GPT2BPETokenizer"  # what Megatron-LM's GPT scripts mean by passing only the two files
    if tokenizer_type is None:
        raise TokenizerError(f"pass --tokenizer-type, one of: {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "GPT2BPETokenizer":
        vocab_file = _require_file("--vocab-file", vocab_file, tokenizer_type, "GPT-2 vocab.json")
        merge_file = _require_file("--merge-file", merge_file, tokenizer_type, "GPT-2 merges.txt")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("ByteLevelTokenizer", "NullTokenizer"):
        unused = [flag for flag, value in (("--vocab-file", vocab_file), ("--merge-file", merge_file)) if value]
        if unused:
            # A file the user passed being silently ignored usually means the wrong type was picked.
            raise TokenizerError(
                f"--tokenizer-type {tokenizer_type} uses no files, but {' and '.join(unused)} "
                "was given; use --tokenizer-type GPT2BPETokenizer to read them"
            )
        if tokenizer_type == "ByteLevelTokenizer":
            return ByteLevelTokenizer()
        if vocab_size is None:
            raise TokenizerError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise TokenizerError(
        f"unknown --tokenizer-type {tokenizer_type!r}; choose one of: {', '.join(TOKENIZER_TYPES)}"
    )


def train_byte_level_bpe(
    texts: Iterable[str],
    output_dir: str | os.PathLike,
    *,
    vocab_size: int = 4096,
    min_frequency: int = 2,
) -> tuple[Path, Path]:
    """Train a GPT-2-style byte-level BPE on `texts`; write vocab.json and merges.txt.

    The files have GPT-2's format and put `<|endoftext|>` on the last id as GPT-2 does, so
    GPT2BPETokenizer (and any GPT-2 reader) loads them. Returns (vocab_path, merges_path).
    """
    if vocab_size < 257 + 1:
        raise TokenizerError(f"vocab_size must be at least 258 (256 bytes, a merge, eod), got {vocab_size}")
    tokenizers = _import_tokenizers()
    tokenizer = _byte_level_bpe(tokenizers, tokenizers.models.BPE())
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the last id is kept for eod
        min_frequency=min_frequency,
        # All 256 byte symbols, so any text encodes even if some byte never occurs in training.
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir) as scratch:
        tokenizer.model.save(scratch)
        vocab = json.loads(Path(scratch, "vocab.json").read_text(encoding="utf-8"))
        vocab[EOD_TEXT] = len(vocab)
        ordered = dict(sorted(vocab.items(), key=lambda item: item[1]))
        Path(scratch, "vocab.json").write_text(json.dumps(ordered, ensure_ascii=False), encoding="utf-8")
        # Rename into place so a reader never sees a half-written pair.
        os.replace(Path(scratch, "merges.txt"), output_dir / "merges.txt")
        os.replace(Path(scratch, "vocab.json"), output_dir / "vocab.json")
    return output_dir / "vocab.json", output_dir / "merges.txt"
