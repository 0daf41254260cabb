"""Data pipeline end to end: demo corpus -> tokenizer -> preprocess_data.py -> megatron-core
GPTDataset -> microbatches, plus mock data and every bad-input message."""
import collections
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import warnings

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron.core warns that Transformer Engine is absent
    from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.app import corpus
from megatron.app.data import (
    DataConfig,
    DataError,
    MicrobatchSource,
    build_datasets,
    build_microbatch_sources,
    check_indexed_dataset,
    get_microbatch,
    num_samples_per_split,
    parse_data_path,
    tokenizer_from_config,
)
from megatron.app.tokenizer import GPT2BPETokenizer, NullTokenizer

try:
    from . import data_fixtures
except ImportError:
    import data_fixtures

preprocess_tool = data_fixtures.load_preprocess_tool()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo as run_single.sh builds it, on a slice of the corpus to stay fast."""
    root = tmp_path_factory.mktemp("demo")
    corpus_path, tokenizer_dir = root / "corpus.jsonl", root / "tokenizer"
    assert corpus.main(["--output", str(corpus_path), "--max-chars", "300000",
                        "--train-tokenizer", str(tokenizer_dir), "--vocab-size", "2048"]) == 0
    vocab, merges = str(tokenizer_dir / "vocab.json"), str(tokenizer_dir / "merges.txt")
    prefix = str(root / "corpus")
    assert preprocess_tool.main(["--input", str(corpus_path), "--output-prefix", prefix,
                                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                 "--merge-file", merges, "--append-eod"]) == 0
    return {
        "root": root, "corpus": corpus_path, "vocab": vocab, "merges": merges,
        "prefix": prefix + "_text_document", "tokenizer": GPT2BPETokenizer(vocab, merges),
        "texts": [json.loads(line)["text"] for line in corpus_path.read_text(encoding="utf-8").splitlines()],
    }


def config(prefix, **overrides):
    values = dict(data_path=[prefix], split="8,1,1", seq_length=64, global_batch_size=8,
                  micro_batch_size=2, data_parallel_size=2, train_iters=20, eval_iters=2, eval_interval=10)
    values.update(overrides)
    return DataConfig(**values)


# ---- corpus ------------------------------------------------------------------------------------

def test_demo_corpus_is_english_prose_from_the_standard_library(demo):
    texts = demo["texts"]
    assert len(texts) > 100 and sum(map(len, texts)) >= 300_000
    words = re.findall(r"[a-z]+", " ".join(texts).lower())
    counts = collections.Counter(words)
    top = {word for word, _ in counts.most_common(25)}
    assert {"the", "of", "to", "is", "a", "and"} <= top
    assert counts["the"] / len(words) > 0.03  # about 5% in English prose
    assert len(set(texts)) == len(texts)


def test_corpus_reads_docstrings_without_importing_and_skips_tests(tmp_path):
    library = tmp_path / "lib"
    (library / "pkg" / "tests").mkdir(parents=True)
    (library / "pkg" / "__init__.py").write_text(
        '"""The package docstring."""\n'
        "raise SystemExit('importing this module would stop the interpreter')\n"
        "def helper():\n    '''Help with one thing.'''\n"
        "class Widget:\n    '''A widget.'''\n    def spin(self):\n        '''Spin the widget.'''\n"
        "def copy():\n    '''Help with one thing.'''\n"  # duplicate: dropped
    )
    (library / "pkg" / "tests" / "test_pkg.py").write_text('"""Test suite docstring."""\n')
    (library / "old.py").write_text('print "python 2"\n')
    documents = list(corpus.iter_stdlib_documents(root=library, min_chars=0))
    assert sorted(documents) == sorted(["The package docstring.", "Help with one thing.", "A widget.\n\nSpin the widget."])
    assert list(corpus.iter_stdlib_documents(root=library, min_chars=25)) == ["A widget.\n\nSpin the widget."]


def test_corpus_progress_is_on_stderr_and_silenceable(tmp_path, capsys, monkeypatch):
    library = tmp_path / "lib"
    library.mkdir()
    for i in range(3):
        (library / f"m{i}.py").write_text(f'"""Module {i} explains a thing at length, twice over."""\n')
    monkeypatch.setattr(corpus, "stdlib_root", lambda: library)
    monkeypatch.delenv("MEGATRON_PROGRESS", raising=False)
    assert corpus.main(["--output", str(tmp_path / "a.jsonl"), "--min-chars", "10"]) == 0
    shown = capsys.readouterr()
    assert re.search(r"^\[corpus\] reading standard-library files 3/3 \(\d+\.\d s\)$", shown.err, re.M), shown.err
    assert "[corpus]" not in shown.out and shown.out.startswith("wrote 3 documents")
    monkeypatch.setenv("MEGATRON_PROGRESS", "0")
    assert corpus.main(["--output", str(tmp_path / "b.jsonl"), "--min-chars", "10"]) == 0
    silent = capsys.readouterr()
    assert "[corpus]" not in silent.err
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()


# ---- preprocess_data.py ------------------------------------------------------------------------

def test_preprocess_writes_an_indexed_dataset_of_the_documents(demo):
    dataset = IndexedDataset(demo["prefix"])
    tokenizer = demo["tokenizer"]
    assert len(dataset) == len(demo["texts"])
    for index in (0, 7, len(dataset) - 1):
        ids = dataset[index].tolist()
        assert ids[-1] == tokenizer.eod  # --append-eod
        assert tokenizer.detokenize(ids[:-1]) == demo["texts"][index]
    info = check_indexed_dataset(demo["prefix"])
    assert info.documents == len(demo["texts"]) and info.dtype.__name__ == "uint16"


def test_preprocess_reports_progress_and_summary_and_workers_give_same_bytes(demo, tmp_path, capsys):
    prefix = str(tmp_path / "parallel")
    assert preprocess_tool.main(["--input", str(demo["corpus"]), "--output-prefix", prefix,
                                 "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", demo["vocab"],
                                 "--merge-file", demo["merges"], "--append-eod", "--workers", "2",
                                 "--log-interval", "100"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"processed [\d,]+ documents \([\d,]+ docs/s, [\d.]+ MB/s\)", out)
    assert f"done: {len(demo['texts']):,} documents" in out
    assert f"train with --data-path {prefix}_text_document" in out
    for suffix in (".bin", ".idx"):
        with open(demo["prefix"] + suffix, "rb") as serial, open(f"{prefix}_text_document{suffix}", "rb") as parallel:
            assert serial.read() == parallel.read()


def test_preprocess_skips_empty_documents_and_blank_lines(tmp_path, capsys):
    source = data_fixtures.write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": ""}, "", {"text": "4"}])
    assert preprocess_tool.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod"]) == 0
    assert "skipped 1 empty documents and 1 blank lines" in capsys.readouterr().out
    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == [[1, 2, 3, 10], [4, 10]]


# 600 good lines first, so the error comes after whole batches were already written.
GOOD_LINES = [{"text": "ok"}] * 600


@pytest.mark.parametrize(
    "lines, expected",
    [
        (GOOD_LINES + [{"text": "fine"}, '{"text": "unterminated}'], r"in\.jsonl:602: invalid JSON at column 10: Unterminated string starting at"),
        (GOOD_LINES + [{"body": "wrong key"}], r"in\.jsonl:601: no key 'text' \(keys present: 'body'\); choose the key with --json-keys"),
        (["[1, 2]"], r"in\.jsonl:1: expected a JSON object"),
        ([{"text": 5}], r"in\.jsonl:1: 'text' is int, expected a string"),
        ([], r"in\.jsonl: no non-empty documents"),
    ],
)
def test_preprocess_bad_input_names_the_line_and_leaves_no_files(tmp_path, capsys, lines, expected):
    source = data_fixtures.write_jsonl(tmp_path / "in.jsonl", lines)
    code = preprocess_tool.main(["--input", str(source), "--output-prefix", str(tmp_path / "out"),
                                 "--tokenizer-type", "ByteLevelTokenizer", "--workers", "2"])
    assert code == 1
    assert re.search("error: .*" + expected, capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no .bin/.idx, no temporary files


def test_preprocess_failure_keeps_the_previous_dataset(tmp_path):
    good = data_fixtures.write_jsonl(tmp_path / "good.jsonl", [{"text": "hello"}])
    bad = data_fixtures.write_jsonl(tmp_path / "bad.jsonl", [{"text": "hello"}, "{oops"])
    common = ["--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "ByteLevelTokenizer"]
    assert preprocess_tool.main(["--input", str(good)] + common) == 0
    before = (tmp_path / "out_text_document.bin").read_bytes(), (tmp_path / "out_text_document.idx").read_bytes()
    assert preprocess_tool.main(["--input", str(bad)] + common) == 1
    after = (tmp_path / "out_text_document.bin").read_bytes(), (tmp_path / "out_text_document.idx").read_bytes()
    assert before == after


def test_preprocess_cli_exit_status_for_missing_input_and_tokenizer_files(tmp_path):
    missing_input = subprocess.run(
        [sys.executable, str(data_fixtures.PREPROCESS_SCRIPT), "--input", str(tmp_path / "nope.jsonl"),
         "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "ByteLevelTokenizer"],
        capture_output=True, text=True, timeout=120,
    )
    assert missing_input.returncode == 1
    assert f"error: --input {tmp_path / 'nope.jsonl'}: no such file" in missing_input.stderr
    source = data_fixtures.write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    missing_vocab = subprocess.run(
        [sys.executable, str(data_fixtures.PREPROCESS_SCRIPT), "--input", str(source),
         "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")],
        capture_output=True, text=True, timeout=120,
    )
    assert missing_vocab.returncode == 1
    assert f"--vocab-file {tmp_path / 'vocab.json'}: no such file" in missing_vocab.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


# ---- datasets and microbatches ---------------------------------------------------------------

def test_microbatches_are_deterministic_text_with_shifted_labels(demo):
    cfg = config(demo["prefix"])
    train, valid, test = build_microbatch_sources(cfg, demo["tokenizer"])
    batch = train.get(iteration=5, dp_rank=1, microbatch_index=1)
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        "tokens": ((2, 64), torch.int64), "labels": ((2, 64), torch.int64),
        "loss_mask": ((2, 64), torch.float32), "position_ids": ((2, 64), torch.int64),
    }
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"][0], torch.arange(64))
    assert batch["loss_mask"].sum() == 2 * 64
    # Rebuilt from scratch (cached indices now): the same tokens.
    again, _, _ = build_microbatch_sources(cfg, demo["tokenizer"])
    assert torch.equal(again.get(5, 1, 1)["tokens"], batch["tokens"])
    # Real corpus text: each piece between eods (ends trimmed, they may cut a character) occurs
    # in some document.
    text = demo["tokenizer"].detokenize(batch["tokens"][0].tolist())
    pieces = [piece[2:-2] for piece in text.split("<|endoftext|>") if len(piece) > 8]
    assert pieces and all(any(piece in document for document in demo["texts"]) for piece in pieces), text
    assert len(train.dataset) >= cfg.train_iters * cfg.global_batch_size
    assert valid is not None and test is not None
    assert len(valid.dataset) >= num_samples_per_split(cfg)[1] == 3 * 2 * 8


def test_dp_ranks_get_disjoint_contiguous_shares_of_the_global_batch(demo):
    train_dataset, _, _ = build_datasets(config(demo["prefix"]), demo["tokenizer"])
    source = MicrobatchSource(train_dataset, global_batch_size=8, micro_batch_size=2, data_parallel_size=2)
    assert source.num_microbatches == 2
    iteration = 3
    shares = {(r, m): source.sample_indices(iteration, r, m) for r in range(2) for m in range(2)}
    assert [list(shares[key]) for key in sorted(shares)] == [[24, 25], [26, 27], [28, 29], [30, 31]]
    tokens = torch.cat([source.get(iteration, r, m)["tokens"] for r in range(2) for m in range(2)])
    expected = torch.stack([train_dataset[i]["tokens"] for i in range(24, 32)])
    assert torch.equal(tokens, expected)
    assert len({tuple(row.tolist()) for row in tokens}) == 8  # eight different samples
    functional = get_microbatch(train_dataset, iteration, 1, 0, global_batch_size=8, micro_batch_size=2,
                                data_parallel_size=2)
    assert torch.equal(functional["tokens"], tokens[4:6])


def test_attention_mask_and_eod_options_reach_the_batch(demo):
    cfg = config(demo["prefix"], create_attention_mask=True, reset_attention_mask=True,
                 reset_position_ids=True, eod_mask_loss=True, seq_length=256)
    train, _, _ = build_microbatch_sources(cfg, demo["tokenizer"])
    batch = train.get(0, 0, 0)
    eod = demo["tokenizer"].eod
    assert batch["attention_mask"].shape == (2, 1, 256, 256) and batch["attention_mask"].dtype == torch.bool
    assert (batch["tokens"] == eod).any()  # 256 tokens span a document boundary in this corpus
    assert torch.all(batch["loss_mask"][batch["tokens"] == eod] == 0)
    assert (batch["position_ids"] == 0).sum() > 2  # positions restart after each eod


def test_blend_of_two_prefixes_samples_both(demo, tmp_path):
    other = tmp_path / "copy_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copy(demo["prefix"] + suffix, str(other) + suffix)
    assert parse_data_path([f"0.3 {demo['prefix']} 0.7 {other}"]) == ([demo["prefix"], str(other)], [0.3, 0.7])
    train, _, _ = build_datasets(config(None, data_path=["0.3", demo["prefix"], "0.7", str(other)]), demo["tokenizer"])
    dataset_ids = collections.Counter(int(train[i]["dataset_id"]) for i in range(160))
    assert 30 < dataset_ids[0] < 70 and dataset_ids[0] + dataset_ids[1] == 160
    source = MicrobatchSource(train, global_batch_size=8, micro_batch_size=2, data_parallel_size=2)
    assert "dataset_id" not in source.get(0, 0, 0)


def test_mock_data_needs_no_files_and_respects_vocab():
    cfg = DataConfig(mock_data=True, seq_length=32, global_batch_size=4, micro_batch_size=2,
                     data_parallel_size=1, train_iters=5, eval_iters=1, eval_interval=5, vocab_size=50)
    tokenizer = tokenizer_from_config(cfg)
    assert isinstance(tokenizer, NullTokenizer) and tokenizer.vocab_size == 51
    train, valid, _ = build_microbatch_sources(cfg, tokenizer)
    batch = train.get(4, 0, 1)
    assert batch["tokens"].shape == (2, 32) and int(batch["tokens"].max()) < 51
    assert torch.equal(batch["tokens"], train.get(4, 0, 1)["tokens"])
    assert not torch.equal(train.get(0, 0, 0)["tokens"], batch["tokens"])
    assert valid.get(0, 0, 0)["tokens"].shape == (2, 32)
    assert tokenizer_from_config(DataConfig(mock_data=True)).vocab_size == 1024


# ---- bad input -----------------------------------------------------------------------------

def test_missing_data_path_files_name_the_files_and_the_fix(demo, tmp_path):
    missing = str(tmp_path / "nothing")
    with pytest.raises(DataError) as error:
        build_datasets(config(missing), demo["tokenizer"])
    message = str(error.value)
    assert f"--data-path {missing}: missing {missing}.bin and {missing}.idx." in message
    assert "tools/preprocess_data.py" in message and "--mock-data" in message
    # The common slip: passing --output-prefix instead of the dataset prefix, or a file name.
    written_prefix = demo["prefix"][: -len("_text_document")]
    with pytest.raises(DataError, match=f"Did you mean --data-path {re.escape(demo['prefix'])} "):
        build_datasets(config(written_prefix), demo["tokenizer"])
    with pytest.raises(DataError, match=f"Pass the prefix without the extension: --data-path {re.escape(demo['prefix'])}"):
        build_datasets(config(demo["prefix"] + ".bin"), demo["tokenizer"])


def test_no_data_source_and_both_sources_are_refused(demo):
    with pytest.raises(DataError, match=r"no training data: pass --data-path PREFIX .* or --mock-data"):
        build_datasets(DataConfig(train_iters=1), demo["tokenizer"])
    with pytest.raises(DataError, match="either --data-path or --mock-data, not both"):
        build_datasets(config(demo["prefix"], mock_data=True), demo["tokenizer"])


def corrupt_copy(demo, tmp_path, *, idx=None, bin_=None):
    prefix = str(tmp_path / "broken_text_document")
    idx_bytes = open(demo["prefix"] + ".idx", "rb").read()
    bin_bytes = open(demo["prefix"] + ".bin", "rb").read()
    open(prefix + ".idx", "wb").write(idx(idx_bytes) if idx else idx_bytes)
    open(prefix + ".bin", "wb").write(bin_(bin_bytes) if bin_ else bin_bytes)
    return prefix


@pytest.mark.parametrize(
    "damage, expected",
    [
        (dict(idx=lambda b: b[: len(b) - 100]), r"broken_text_document\.idx is corrupt: truncated \(\d+ bytes, the header describes"),
        (dict(idx=lambda b: b[:20]), r"broken_text_document\.idx is not a Megatron indexed-dataset index \(bad or truncated header"),
        (dict(idx=lambda b: b"GARBAGE!!" + b[9:]), r"broken_text_document\.idx is not a Megatron indexed-dataset index"),
        (dict(idx=lambda b: b""), r"broken_text_document\.idx is not a Megatron"),
        (dict(bin_=lambda b: b[:-10]), r"broken_text_document\.bin has \d+ bytes but .*idx describes \d+ tokens of uint16"),
    ],
)
def test_corrupt_dataset_files_raise_data_error_with_path_and_remedy(demo, tmp_path, damage, expected):
    prefix = corrupt_copy(demo, tmp_path, **damage)
    with pytest.raises(DataError) as error:
        build_datasets(config(prefix), demo["tokenizer"])
    assert re.search(expected, str(error.value))
    assert "Rebuild it with tools/preprocess_data.py" in str(error.value)


def test_megatron_core_failures_become_data_errors(demo, tmp_path, monkeypatch):
    import megatron.core.datasets.gpt_dataset as gpt_dataset

    def broken(*args, **kwargs):
        raise AssertionError("bad header, cannot read: x.idx")

    monkeypatch.setattr(gpt_dataset, "IndexedDataset", broken)
    with pytest.raises(DataError, match=r"megatron-core could not build the datasets from --data-path .*AssertionError: bad header"):
        build_datasets(config(demo["prefix"]), demo["tokenizer"])


def test_split_that_leaves_a_split_empty_is_refused_instead_of_hanging(tmp_path):
    source = data_fixtures.write_jsonl(tmp_path / "in.jsonl", [{"text": f"{i} {i}"} for i in range(10)])
    assert preprocess_tool.main(["--input", str(source), "--output-prefix", str(tmp_path / "tiny"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "20", "--append-eod"]) == 0
    cfg = config(str(tmp_path / "tiny_text_document"), split="969,30,1", seq_length=4)
    with pytest.raises(DataError, match=r"--split 969,30,1 leaves the valid split of .* without tokens \(0 of its 10 documents\)"):
        build_datasets(cfg, NullTokenizer(20))
    for bad in (["0.5", "a", "b"], ["1", "2"]):
        with pytest.raises(DataError, match="expected PREFIX"):
            parse_data_path(bad)
    with pytest.raises(DataError, match="--split 'x,y': expected up to three non-negative weights"):
        build_datasets(config(str(tmp_path / "tiny_text_document"), split="x,y"), NullTokenizer(20))


def test_microbatch_source_rejects_bad_batch_geometry_and_reads_past_the_end(demo):
    train, _, _ = build_datasets(config(demo["prefix"]), demo["tokenizer"])
    with pytest.raises(ValueError, match=r"global batch size \(10\) is not divisible by micro batch size \(2\) x data parallel size \(2\) = 4"):
        MicrobatchSource(train, global_batch_size=10, micro_batch_size=2, data_parallel_size=2)
    source = MicrobatchSource(train, global_batch_size=8, micro_batch_size=2, data_parallel_size=2)
    with pytest.raises(DataError, match="train batch .* needs samples up to .* build it for more iterations"):
        source.get(source.num_batches + 1, 0, 0)


# ---- multi-rank ------------------------------------------------------------------------------

def test_two_gloo_ranks_build_the_same_batches_and_both_fail_on_corrupt_data(demo, tmp_path):
    corrupt = corrupt_copy(demo, tmp_path, idx=lambda b: b[:-8])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cache = tmp_path / "cache"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
               PYTHONPATH=os.pathsep.join([str(data_fixtures.REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    arguments = [demo["prefix"], str(cache), corrupt, demo["vocab"], demo["merges"], str(tmp_path)]
    ranks = [
        subprocess.Popen([sys.executable, str(data_fixtures.__file__)] + arguments,
                         env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    outputs = [process.communicate(timeout=150)[0] for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0], outputs
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "broken_text_document.idx is corrupt: truncated" in report["corrupt"]
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert any(cache.iterdir())  # rank 0 wrote the index cache that rank 1 read
    for key in ("batch", "valid"):
        assert rank0[key].keys() == rank1[key].keys()
        for name in rank0[key]:
            assert torch.equal(rank0[key][name], rank1[key][name])
    # ...and equal to what a single process computes for the same coordinates.
    train, _, _ = build_microbatch_sources(
        config(demo["prefix"], seq_length=32, train_iters=6, eval_iters=1, eval_interval=3), demo["tokenizer"])
    assert torch.equal(train.get(3, 1, 1)["tokens"], rank0["batch"]["tokens"])
