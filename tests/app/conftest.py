"""Shared fixtures for trainer tests: the embedded demo corpus as an indexed dataset."""
from __future__ import annotations

from pathlib import Path

import pytest

from launch import python

SMALL_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
    "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "2e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--log-interval", "1", "--device", "cpu",
]


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory) -> dict[str, str]:
    """Standard-library docstrings -> BPE trained here -> Megatron indexed dataset."""
    root: Path = tmp_path_factory.mktemp("corpus")
    made = python(["-m", "megatron.app.corpus", "--output", str(root / "corpus.jsonl"),
                   "--max-chars", "600000", "--train-tokenizer", str(root / "tok"), "--vocab-size", "2048"])
    assert made.returncode == 0, made.stderr
    prefix = root / "corpus"
    made = python(["tools/preprocess_data.py", "--input", str(root / "corpus.jsonl"), "--output-prefix", str(prefix),
                   "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(root / "tok" / "vocab.json"),
                   "--merge-file", str(root / "tok" / "merges.txt"), "--append-eod", "--workers", "1"])
    assert made.returncode == 0, made.stderr
    return {
        "data_path": f"{prefix}_text_document",
        "vocab_file": str(root / "tok" / "vocab.json"),
        "merge_file": str(root / "tok" / "merges.txt"),
        "args": ["--data-path", f"{prefix}_text_document", "--tokenizer-type", "GPT2BPETokenizer",
                 "--vocab-file", str(root / "tok" / "vocab.json"), "--merge-file", str(root / "tok" / "merges.txt"),
                 "--split", "98,2,0"],
    }
