"""Training data: megatron-core GPT datasets (indexed or mock) built from a DataConfig, and a
deterministic microbatch source that any rank can query without communication."""
from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from megatron.app.config import DataConfig  # noqa: F401  (the run config's data section, built from here)
from megatron.app.tokenizer import MOCK_DEFAULT_VOCAB_SIZE, Tokenizer, build_tokenizer

_PREPROCESS_HINT = (
    "Build an indexed dataset with `python tools/preprocess_data.py --input DOCS.jsonl "
    "--output-prefix NAME --tokenizer-type ... --append-eod` (it writes NAME_text_document.bin/.idx; "
    "pass --data-path NAME_text_document), or train on synthetic tokens with --mock-data."
)
# The .idx layout megatron-core writes (indexed_dataset._IndexWriter): magic, version, dtype code,
# sequence count, document count, then int32 lengths, int64 pointers and int64 document indices.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
_IDX_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
               6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


class DataError(Exception):
    """The training data cannot be used as given; the message says which file and what to do."""





@dataclass(frozen=True, slots=True)
class IndexedDatasetInfo:
    prefix: str
    documents: int
    tokens: int
    dtype: Any
    sequence_lengths: numpy.ndarray


def tokenizer_from_config(cfg: DataConfig) -> Tokenizer:
    """The configured tokenizer; with --mock-data and no --tokenizer-type, a NullTokenizer."""
    if cfg.tokenizer_type is None and cfg.mock_data:
        vocab_size = cfg.vocab_size if cfg.vocab_size is not None else MOCK_DEFAULT_VOCAB_SIZE
        return build_tokenizer("NullTokenizer", vocab_size=vocab_size)
    return build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, vocab_size=cfg.vocab_size)


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's --data-path: `PREFIX [PREFIX ...]` or `WEIGHT PREFIX [WEIGHT PREFIX ...]`."""
    # A quoted "0.5 a 0.5 b" arrives as one item; split it like separate arguments.
    items = [word for item in data_path for word in str(item).split()]
    if not items:
        raise DataError("--data-path is empty; pass PREFIX [PREFIX ...] or WEIGHT PREFIX [WEIGHT PREFIX ...]")

    def is_number(word: str) -> bool:
        try:
            float(word)
        except ValueError:
            return False
        return True

    if len(items) % 2 == 0 and all(is_number(w) for w in items[0::2]) and not any(is_number(p) for p in items[1::2]):
        weights = [float(w) for w in items[0::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(f"--data-path weights must be non-negative with a positive sum, got {weights}")
        return items[1::2], weights
    if any(is_number(w) for w in items):
        raise DataError(
            f"--data-path {' '.join(items)!r}: expected PREFIX [PREFIX ...] or "
            "WEIGHT PREFIX [WEIGHT PREFIX ...] (a weight before every prefix)"
        )
    return items, None


def _parse_split(split: str) -> list[float]:
    try:
        parts = [float(p) for p in split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise DataError(f"--split {split!r}: expected up to three non-negative weights like 969,30,1")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def _missing_files_message(prefix: str) -> str:
    missing = [path for path in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(path)]
    message = f"--data-path {prefix}: missing {' and '.join(missing)}."
    stem, extension = os.path.splitext(prefix)
    if extension in (".bin", ".idx") and os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx"):
        message += f" Pass the prefix without the extension: --data-path {stem}."
    elif os.path.isfile(prefix + "_text_document.bin") and os.path.isfile(prefix + "_text_document.idx"):
        message += f" Did you mean --data-path {prefix}_text_document (preprocess_data.py adds _text_document)?"
    return f"{message} {_PREPROCESS_HINT}"


def check_indexed_dataset(prefix: str) -> IndexedDatasetInfo:
    """Check that PREFIX.bin/.idx exist and agree, in O(documents) reads, before megatron-core
    opens them: its own checks are asserts that fail on one rank while the others wait."""
    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        raise DataError(_missing_files_message(prefix))
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    redo = "Rebuild it with tools/preprocess_data.py (or use --mock-data)."
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as stream:
        header = stream.read(_IDX_HEADER_BYTES)
    if len(header) < _IDX_HEADER_BYTES or header[:9] != _IDX_MAGIC:
        raise DataError(
            f"{idx_path} is not a Megatron indexed-dataset index (bad or truncated header, "
            f"{idx_size} bytes). {redo}"
        )
    version, dtype_code, sequence_count, document_count = struct.unpack("<QBQQ", header[9:])
    if version != 1 or dtype_code not in _IDX_DTYPES:
        raise DataError(f"{idx_path}: unsupported index version {version} or dtype code {dtype_code}. {redo}")
    expected = _IDX_HEADER_BYTES + 12 * sequence_count + 8 * document_count
    if idx_size != expected:
        state = "truncated" if idx_size < expected else "longer than its header says"
        raise DataError(
            f"{idx_path} is corrupt: {state} ({idx_size} bytes, the header describes {sequence_count} "
            f"sequences and {document_count - 1} documents = {expected} bytes). {redo}"
        )
    lengths = numpy.fromfile(idx_path, dtype=numpy.int32, count=sequence_count, offset=_IDX_HEADER_BYTES)
    document_indices = numpy.fromfile(
        idx_path, dtype=numpy.int64, count=document_count, offset=_IDX_HEADER_BYTES + 12 * sequence_count
    )
    if (
        document_count < 1
        or document_indices[0] != 0
        or document_indices[-1] != sequence_count
        or numpy.any(numpy.diff(document_indices) < 0)
        or numpy.any(lengths < 0)
    ):
        raise DataError(f"{idx_path} is corrupt: its document boundaries are inconsistent. {redo}")
    dtype = _IDX_DTYPES[dtype_code]
    tokens = int(lengths.sum(dtype=numpy.int64))
    bin_size = os.path.getsize(bin_path)
    if bin_size != tokens * numpy.dtype(dtype).itemsize:
        raise DataError(
            f"{bin_path} has {bin_size} bytes but {idx_path} describes {tokens} tokens of "
            f"{numpy.dtype(dtype).name} = {tokens * numpy.dtype(dtype).itemsize} bytes: the .bin is "
            f"truncated or the two files are from different runs. {redo}"
        )
    return IndexedDatasetInfo(
        prefix=prefix, documents=document_count - 1, tokens=tokens, dtype=dtype, sequence_lengths=lengths
    )


def _check_splits(info: IndexedDatasetInfo, split: list[float], split_text: str) -> None:
    # megatron-core loops forever counting epochs of a split with no tokens, so refuse it here.
    # Same arithmetic as BlendedMegatronDatasetBuilder: split by sequence, bounds rounded.
    count = len(info.sequence_lengths)
    start = 0.0
    for name, fraction in zip(("train", "valid", "test"), split):
        end = start + fraction
        if fraction > 0:
            begin, stop = int(round(start * count)), int(round(end * count))
            if info.sequence_lengths[begin:stop].sum() == 0:
                raise DataError(
                    f"--split {split_text} leaves the {name} split of {info.prefix} without tokens "
                    f"({stop - begin} of its {count} documents): use more data, or a --split that "
                    f"gives {name} a larger share or 0"
                )
        start = end


def num_samples_per_split(cfg: DataConfig) -> tuple[int, int, int]:
    """Samples to draw for (train, valid, test), counted as Megatron-LM does: every evaluation
    reads the next eval_iters global batches of the validation set, and the test set one round."""
    evaluations = 1 if not cfg.eval_interval else cfg.train_iters // cfg.eval_interval + 1
    return (
        cfg.train_iters * cfg.global_batch_size,
        evaluations * cfg.eval_iters * cfg.global_batch_size,
        cfg.eval_iters * cfg.global_batch_size,
    )


def build_datasets(cfg: DataConfig, tokenizer: Tokenizer) -> tuple[Any | None, Any | None, Any | None]:
    """Build (train, valid, test) with megatron-core's BlendedMegatronDatasetBuilder.

    Each item is a GPTDataset, MockGPTDataset or BlendedDataset (None for a split with weight 0).
    When torch.distributed is initialised every rank must call this: megatron-core builds the
    index caches on global rank 0 first and the others load them after a barrier, so the cache
    directory must be shared by all ranks (one machine, or --data-cache-path on shared storage).
    All input checks run on every rank before the first barrier, so bad input fails everywhere.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    if cfg.mock_data and cfg.data_path:
        raise DataError("pass either --data-path or --mock-data, not both")
    if not cfg.mock_data and not cfg.data_path:
        raise DataError(
            "no training data: pass --data-path PREFIX (an indexed dataset made by "
            "tools/preprocess_data.py) or --mock-data for synthetic tokens"
        )
    if cfg.reset_attention_mask and not cfg.create_attention_mask:
        raise DataError("reset_attention_mask needs create_attention_mask: the mask is what gets reset")
    sizes = list(num_samples_per_split(cfg))

    blend = None
    path_to_cache = cfg.data_cache_path
    if not cfg.mock_data:
        prefixes, weights = parse_data_path(cfg.data_path)
        split = _parse_split(cfg.split)
        for prefix in prefixes:
            _check_splits(check_indexed_dataset(prefix), split, cfg.split)
        blend = (prefixes, weights)
        if len(prefixes) > 1 and path_to_cache and not torch.distributed.is_initialized():
            # megatron-core 0.16 BlendedDataset calls torch.distributed.get_rank() unguarded when
            # it has a cache path, which fails in a single process; build those indices uncached.
            path_to_cache = None

    config = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=cfg.seq_length,
        blend=blend,
        split=None if cfg.mock_data else cfg.split,
        path_to_cache=path_to_cache,
        tokenizer=tokenizer,
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=cfg.create_attention_mask,
    )
    dataset_class = MockGPTDataset if cfg.mock_data else GPTDataset
    # Every rank (all TP ranks and pipeline stages) reads its own microbatches, so all build it.
    builder = BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config)
    try:
        train, valid, test = builder.build()
    except DataError:
        raise
    except Exception as error:
        source = "--mock-data" if cfg.mock_data else f"--data-path {' '.join(cfg.data_path)}"
        raise DataError(
            f"megatron-core could not build the datasets from {source}: {type(error).__name__}: {error}. "
            f"{_PREPROCESS_HINT}"
        ) from error
    return train, valid, test


class MicrobatchSource:
    """Microbatches of one dataset split, a pure function of (iteration, dp_rank, microbatch).

    Global batch `i` is samples [i*gbs, (i+1)*gbs); data-parallel rank `r` owns the contiguous
    share [i*gbs + r*gbs/dp, ...), and microbatch `m` is the m-th run of mbs samples within it.
    """

    def __init__(self, dataset: Any, *, global_batch_size: int, micro_batch_size: int,
                 data_parallel_size: int, name: str = "train") -> None:
        if global_batch_size % (micro_batch_size * data_parallel_size) != 0:
            raise ValueError(
                f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                f"({micro_batch_size}) x data parallel size ({data_parallel_size}) = "
                f"{micro_batch_size * data_parallel_size}"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.name = name
        self.num_microbatches = global_batch_size // (micro_batch_size * data_parallel_size)

    @property
    def num_batches(self) -> int:
        """How many global batches the dataset holds."""
        return len(self.dataset) // self.global_batch_size

    def sample_indices(self, iteration: int, dp_rank: int, microbatch_index: int) -> range:
        if not 0 <= dp_rank < self.data_parallel_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{self.data_parallel_size - 1}")
        if not 0 <= microbatch_index < self.num_microbatches:
            raise ValueError(f"microbatch {microbatch_index} is outside 0..{self.num_microbatches - 1}")
        return self.global_sample_indices(iteration, dp_rank * self.num_microbatches + microbatch_index)

    def global_sample_indices(self, iteration: int, global_microbatch: int) -> range:
        """The samples of the global batch's `global_microbatch`-th run of mbs samples (replica r's
        microbatch m is global microbatch r * num_microbatches + m under an even split)."""
        count = self.num_microbatches * self.data_parallel_size
        if not 0 <= global_microbatch < count:
            raise ValueError(f"global microbatch {global_microbatch} is outside 0..{count - 1}")
        start = iteration * self.global_batch_size + global_microbatch * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def get(self, iteration: int, dp_rank: int, microbatch_index: int) -> dict[str, torch.Tensor]:
        """{tokens, labels, position_ids: int64 [mbs, seq]; loss_mask: float32 [mbs, seq];
        attention_mask: bool [mbs, 1, seq, seq] (True = masked), only if the dataset makes it}."""
        return self._get(iteration, self.sample_indices(iteration, dp_rank, microbatch_index))

    def get_global(self, iteration: int, global_microbatch: int) -> dict[str, torch.Tensor]:
        """The same batch dict, by the microbatch's index in the whole global batch."""
        return self._get(iteration, self.global_sample_indices(iteration, global_microbatch))

    def _get(self, iteration: int, indices: range) -> dict[str, torch.Tensor]:
        if indices.stop > len(self.dataset):
            raise DataError(
                f"{self.name} batch {iteration} needs samples up to {indices.stop} but the {self.name} "
                f"dataset was built with {len(self.dataset)}; build it for more iterations"
            )
        samples = [self.dataset[index] for index in indices]
        return {
            key: torch.stack([torch.as_tensor(sample[key]) for sample in samples])
            for key in _BATCH_KEYS
            if key in samples[0]
        }

    def __repr__(self) -> str:
        return (
            f"MicrobatchSource({self.name}, samples={len(self.dataset)}, gbs={self.global_batch_size}, "
            f"mbs={self.micro_batch_size}, dp={self.data_parallel_size})"
        )


def get_microbatch(
    dataset: Any,
    iteration: int,
    dp_rank: int,
    microbatch_index: int,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> dict[str, torch.Tensor]:
    """Function form of MicrobatchSource.get."""
    source = MicrobatchSource(
        dataset,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        data_parallel_size=data_parallel_size,
    )
    return source.get(iteration, dp_rank, microbatch_index)


def eval_batch_index(evaluation: int, step: int, eval_iters: int) -> int:
    """Global batch index of step `step` of the `evaluation`-th evaluation (0-based): as in
    Megatron-LM, each evaluation continues where the previous one stopped in the valid set."""
    return evaluation * eval_iters + step


def build_microbatch_sources(
    cfg: DataConfig, tokenizer: Tokenizer
) -> tuple[MicrobatchSource, MicrobatchSource | None, MicrobatchSource | None]:
    """(train, valid, test) microbatch sources; valid/test are None when their split is empty."""
    datasets = build_datasets(cfg, tokenizer)
    sources = []
    for name, dataset in zip(("train", "valid", "test"), datasets):
        sources.append(
            None
            if dataset is None
            else MicrobatchSource(
                dataset,
                global_batch_size=cfg.global_batch_size,
                micro_batch_size=cfg.micro_batch_size,
                data_parallel_size=cfg.data_parallel_size,
                name=name,
            )
        )
    if sources[0] is None:
        raise DataError(f"--split {cfg.split} gives the train split no share")
    return sources[0], sources[1], sources[2]
