"""Helpers for the data and tokenizer tests: a pure-Python GPT-2 BPE reference encoder, the
preprocessing tool loaded as a module, and the body of a multi-rank dataset-building run."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PREPROCESS_SCRIPT = REPO_ROOT / "tools" / "preprocess_data.py"


def load_preprocess_tool():
    """tools/ is not a package: load tools/preprocess_data.py by path."""
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", PREPROCESS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


def write_jsonl(path: Path, records: list) -> Path:
    with open(path, "w", encoding="utf-8") as stream:
        for record in records:
            stream.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


# ---- reference GPT-2 encoder, written from the published algorithm ---------------------------

def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2 maps every byte to a printable character: printable Latin-1 bytes map to themselves,
    # the rest to code points 256 and up, in byte order.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


# GPT-2's pre-tokenizer with `re` classes in place of \p{L} and \p{N}; identical on text whose
# letters and digits are ordinary (the tests use such text).
_GPT2_PATTERN = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


class ReferenceGPT2Encoder:
    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.encoder = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
        lines = Path(merge_file).read_text(encoding="utf-8").split("\n")
        merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
        self.ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = _bytes_to_unicode()
        self.bpe = lru_cache(maxsize=None)(self._bpe)

    def _bpe(self, word: str) -> tuple[str, ...]:
        parts = list(word)
        while len(parts) > 1:
            pairs = set(zip(parts, parts[1:]))
            best = min(pairs, key=lambda pair: self.ranks.get(pair, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return tuple(parts)

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in _GPT2_PATTERN.findall(text):
            word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[token] for token in self.bpe(word))
        return ids


# ---- one rank of a multi-rank build (run as a subprocess by test_data.py) -------------------

def distributed_rank_main(prefix: str, cache_dir: str, corrupt_prefix: str, vocab: str, merges: str, out_dir: str) -> None:
    import datetime

    import torch

    from megatron.app.data import DataConfig, DataError, build_microbatch_sources
    from megatron.app.tokenizer import build_tokenizer

    rank = int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    base = dict(split="8,1,1", seq_length=32, global_batch_size=8, micro_batch_size=2,
                data_parallel_size=2, train_iters=6, eval_iters=1, eval_interval=3, data_cache_path=cache_dir)
    report = {}
    try:
        build_microbatch_sources(DataConfig(data_path=[corrupt_prefix], **base), tokenizer)
        report["corrupt"] = "no error"
    except DataError as error:
        report["corrupt"] = str(error)
    train, valid, _ = build_microbatch_sources(DataConfig(data_path=[prefix], **base), tokenizer)
    batch = train.get(iteration=3, dp_rank=1, microbatch_index=1)
    torch.save({"batch": batch, "valid": valid.get(0, 0, 0)}, os.path.join(out_dir, f"rank{rank}.pt"))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    distributed_rank_main(*sys.argv[1:])
