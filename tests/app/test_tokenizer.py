"""Tokenizers: round trips, GPT-2 equivalence against a reference encoder, trained files, errors."""
import json

import pytest

from megatron.app.corpus import iter_stdlib_documents, stdlib_root
from megatron.app.tokenizer import (
    EOD_TEXT,
    ByteLevelTokenizer,
    GPT2BPETokenizer,
    NullTokenizer,
    TokenizerError,
    build_tokenizer,
    train_byte_level_bpe,
)

try:
    from . import data_fixtures
except ImportError:
    import data_fixtures

MIXED_TEXT = "Return  the value\n\n\tof x² — naïve café, 3.14 items_list; emoji 😀 and 中文.\n"


@pytest.fixture(scope="module")
def training_texts():
    texts = []
    for package in ("email", "asyncio"):
        texts.extend(iter_stdlib_documents(root=stdlib_root() / package, min_chars=0))
    assert sum(map(len, texts)) > 50_000
    return texts


@pytest.fixture(scope="module")
def trained_files(training_texts, tmp_path_factory):
    return train_byte_level_bpe(training_texts, tmp_path_factory.mktemp("bpe"), vocab_size=1024)


def test_byte_tokenizer_round_trips_any_text_and_shows_eod():
    tokenizer = build_tokenizer("ByteLevelTokenizer")
    ids = tokenizer.tokenize(MIXED_TEXT)
    assert tokenizer.vocab_size == 257 and tokenizer.eod == 256
    assert ids == list(MIXED_TEXT.encode("utf-8"))
    assert tokenizer.detokenize(ids) == MIXED_TEXT
    assert tokenizer.detokenize(ids + [tokenizer.eod] + ids) == MIXED_TEXT + EOD_TEXT + MIXED_TEXT


def test_trained_files_have_gpt2_format_with_eod_last(trained_files):
    vocab_path, merges_path = trained_files
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    assert len(vocab) == 1024
    assert vocab[EOD_TEXT] == 1023  # GPT-2 keeps <|endoftext|> on the last id
    assert sorted(vocab.values()) == list(range(1024))
    lines = merges_path.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#version")
    assert len(lines) - 1 == 1024 - 1 - 256  # every id beyond the 256 bytes and eod is a merge
    tokenizer = build_tokenizer("GPT2BPETokenizer", str(vocab_path), str(merges_path))
    assert isinstance(tokenizer, GPT2BPETokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (1024, 1023)


def test_gpt2_bpe_round_trips_and_compresses_english(trained_files, training_texts):
    tokenizer = GPT2BPETokenizer(*trained_files)
    for text in [MIXED_TEXT, " leading space", "trailing   \n", "", "<|endoftext|> inside text"]:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    english = "\n\n".join(training_texts[:40])
    ids = tokenizer.tokenize(english)
    assert tokenizer.detokenize(ids) == english
    assert len(english.encode("utf-8")) / len(ids) > 2.5  # bytes per token: merges were learned
    # Literal "<|endoftext|>" in a document is text, not an eod id (as in GPT-2's encoder).
    assert tokenizer.eod not in tokenizer.tokenize("a <|endoftext|> b")
    assert tokenizer.tokenize_batch(["one two", "three"]) == [tokenizer.tokenize("one two"), tokenizer.tokenize("three")]


def test_gpt2_bpe_matches_reference_gpt2_encoder(trained_files, training_texts):
    tokenizer = GPT2BPETokenizer(*trained_files)
    reference = data_fixtures.ReferenceGPT2Encoder(*map(str, trained_files))
    # ASCII plus ordinary accented letters, where the reference's `re` classes equal \p{L}/\p{N}.
    texts = [t for t in training_texts[:150] if t.isascii()] + ["Héllo wörld's   café,  it'll be\n\n 42 naïve_x!"]
    assert len(texts) > 100
    for text in texts:
        assert tokenizer.tokenize(text) == reference.encode(text), text[:80]


def test_training_is_deterministic(training_texts, tmp_path):
    first = train_byte_level_bpe(training_texts, tmp_path / "a", vocab_size=600)
    second = train_byte_level_bpe(training_texts, tmp_path / "b", vocab_size=600)
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


def test_null_tokenizer_follows_megatron_vocab_size_convention():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tokenizer, NullTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (101, 100)
    assert tokenizer.tokenize("5 6  7") == [5, 6, 7]
    assert tokenizer.detokenize([5, 6, 7]) == "5 6 7"


def test_tokenizer_identifiers_are_json_for_megatron_dataset_cache(trained_files):
    for tokenizer in (ByteLevelTokenizer(), NullTokenizer(10), GPT2BPETokenizer(*trained_files)):
        json.dumps(tokenizer.unique_identifiers)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(tokenizer_type=None), "pass --tokenizer-type, one of: GPT2BPETokenizer, ByteLevelTokenizer, NullTokenizer"),
        (dict(tokenizer_type="SentencePiece"), "unknown --tokenizer-type 'SentencePiece'; choose one of"),
        (dict(tokenizer_type="GPT2BPETokenizer"), "--tokenizer-type GPT2BPETokenizer needs --vocab-file (GPT-2 vocab.json)"),
        (dict(tokenizer_type="NullTokenizer"), "--tokenizer-type NullTokenizer needs --vocab-size"),
        (dict(tokenizer_type="ByteLevelTokenizer", vocab_file="v.json"), "uses no files, but --vocab-file was given"),
    ],
)
def test_build_tokenizer_names_the_flag_to_fix(kwargs, expected):
    with pytest.raises(TokenizerError) as error:
        build_tokenizer(**kwargs)
    assert expected in str(error.value)


def test_missing_and_malformed_tokenizer_files_are_named(trained_files, tmp_path):
    vocab_path, merges_path = map(str, trained_files)
    with pytest.raises(TokenizerError, match="--merge-file /nonexistent/merges.txt: no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_path, "/nonexistent/merges.txt")
    with pytest.raises(TokenizerError, match=r"needs --merge-file \(GPT-2 merges.txt\).*megatron.app.corpus"):
        build_tokenizer("GPT2BPETokenizer", vocab_path, None)
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps({"a": 0, "b": 1}))
    with pytest.raises(TokenizerError, match=f"{no_eod} has no '<\\|endoftext\\|>' token"):
        build_tokenizer("GPT2BPETokenizer", str(no_eod), merges_path)
    not_json = tmp_path / "broken.json"
    not_json.write_text("{not json")
    with pytest.raises(TokenizerError, match=f"--vocab-file {not_json} is not valid JSON"):
        build_tokenizer("GPT2BPETokenizer", str(not_json), merges_path)
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nzz qq\n")
    with pytest.raises(TokenizerError, match=f"cannot read --merge-file {bad_merges}"):
        build_tokenizer("GPT2BPETokenizer", vocab_path, str(bad_merges))
