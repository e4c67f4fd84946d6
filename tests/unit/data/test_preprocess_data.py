"""tools/preprocess_data.py and megatron_h2.data.preprocess, in this process. (Worker processes
and the script: tests/e2e/test_preprocess_data.py.)"""

from __future__ import annotations

import importlib.util
import json
import os
import random

import numpy as np
import pytest

from megatron_h2.data.indexed_dataset import IndexedDataset
from megatron_h2.data.preprocess import _split_ranges, preprocess_jsonl
from megatron_h2.data.tokenizer import build_tokenizer, train_sentencepiece
from megatron_h2.errors import ConfigError
from tests.helpers.paths import ROOT

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


def _write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as stream:
        for record in records:
            stream.write(record if isinstance(record, str) else json.dumps(record))
            stream.write("\n")
    return str(path)


def _number_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(count):
        ids = [rng.randrange(1000) for _ in range(rng.randint(0 if i % 7 == 3 else 1, 40))]
        records.append({"text": " ".join(map(str, ids)), "meta": str(i)})
    return records


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    rng = random.Random(1)
    texts = (" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(200))
    return train_sentencepiece(texts, str(tmp_path_factory.mktemp("sp") / "tok"), 300)


def test_null_tokenizer_output_matches_input(tmp_path):
    records = _number_records(50)
    source = _write_jsonl(tmp_path / "in.jsonl", records)
    outputs = preprocess_jsonl(source, str(tmp_path / "out" / "corpus"), "NullTokenizer",
                               vocab_size=1001, append_eod=True)  # ids 0..1000, eod 1000
    prefix = str(tmp_path / "out" / "corpus_text_document")
    assert outputs == {"text": prefix}
    dataset = IndexedDataset(prefix)
    expected = [[int(x) for x in r["text"].split()] + [1000] for r in records if r["text"]]
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    assert dataset.dtype == np.uint16
    assert dataset.document_indices.tolist() == list(range(len(expected) + 1))
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".preprocess-")]


def test_without_eod_and_wide_vocab_uses_int32(tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 69999"}, {"text": "5"}])
    preprocess_jsonl(source, str(tmp_path / "c"), "NullTokenizer", vocab_size=70000)
    dataset = IndexedDataset(str(tmp_path / "c_text_document"))
    assert dataset.dtype == np.int32
    assert [dataset[i].tolist() for i in range(2)] == [[1, 2, 69999], [5]]


def test_multiple_json_keys(tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl",
                          [{"text": "1 2", "meta": "7"}, {"text": "3", "meta": "8 9"}])
    outputs = preprocess_jsonl(source, str(tmp_path / "c"), "NullTokenizer", vocab_size=11,
                               json_keys=["text", "meta"], append_eod=True)
    assert set(outputs) == {"text", "meta"}
    meta = IndexedDataset(outputs["meta"])
    assert [meta[i].tolist() for i in range(2)] == [[7, 10], [8, 9, 10]]


def test_split_ranges_cover_file_on_line_starts(tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", _number_records(30))
    data = open(source, "rb").read()
    for parts in (1, 2, 5, 64):
        ranges = _split_ranges(source, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(data) and len(ranges) == parts
        for (start, end, first_line), nxt in zip(ranges, ranges[1:] + [(len(data), 0, 0)]):
            assert end == nxt[0] and (start == 0 or data[start - 1 : start] == b"\n")
            assert first_line == data[:start].count(b"\n") + 1


@pytest.mark.parametrize(
    "record, message",
    [
        ({"body": "1"}, r":2: JSON object has no key 'text'"),
        ({"text": 5}, r":2: value of 'text' is int"),
        ("[1, 2]", r":2: expected a JSON object"),
        ({"text": "1 x 2"}, "whitespace-separated integers"),
    ],
)
def test_bad_records(tmp_path, record, message):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}, record])
    with pytest.raises(ConfigError, match=message):
        preprocess_jsonl(source, str(tmp_path / "c"), "NullTokenizer", vocab_size=10)


def test_bad_arguments(tmp_path):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}])
    out = str(tmp_path / "c")
    with pytest.raises(ConfigError, match="--input .* not found"):
        preprocess_jsonl(str(tmp_path / "missing.jsonl"), out, "NullTokenizer", vocab_size=10)
    with pytest.raises(ConfigError, match="unknown tokenizer type"):
        preprocess_jsonl(source, out, "BertWordPieceCase")
    with pytest.raises(ConfigError, match="GPT2BPETokenizer .* needs --vocab-file"):
        preprocess_jsonl(source, out, "GPT2BPETokenizer")
    with pytest.raises(ConfigError, match="--workers"):
        preprocess_jsonl(source, out, "NullTokenizer", vocab_size=10, workers=0)
    with pytest.raises(ConfigError, match="--json-keys"):
        preprocess_jsonl(source, out, "NullTokenizer", vocab_size=10, json_keys=[])
    with pytest.raises(ConfigError, match="tokenizer model .* not found"):
        preprocess_jsonl(source, out, "GPTSentencePieceTokenizer", str(tmp_path / "none.model"))


def _tool():
    spec = importlib.util.spec_from_file_location(
        "preprocess_tool", os.path.join(ROOT, "tools", "preprocess_data.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_cli_takes_megatrons_tokenizer_flags(tmp_path, sp_model, capsys):
    """GPT2BPETokenizer from --vocab-file/--merge-file, Llama2Tokenizer (BOS first, EOS as eod),
    TikTokenizer with --tiktoken-pattern / --tiktoken-num-special-tokens, NullTokenizer with
    --null-tokenizer-eod-id: the tool writes what the tokenizer of pretrain_gpt.py reads."""
    from tests.helpers.tokenizer_files import gpt2_files, tiktoken_file

    texts = ["the quick brown fox", "over a lazy dog"]
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    vocab, merges = gpt2_files(tmp_path / "gpt2")
    tiktoken, count = tiktoken_file(tmp_path / "tok.json")
    cases = {
        "gpt2": (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                  "--merge-file", merges],
                 dict(vocab_file=vocab, merge_file=merges), None),
        "llama2": (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", sp_model],
                   {}, sp_model),
        "tiktoken": (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", tiktoken,
                      "--vocab-size", str(10 + count), "--tiktoken-pattern", "v1",
                      "--tiktoken-num-special-tokens", "10"],
                     dict(tiktoken_pattern="v1", tiktoken_num_special_tokens=10), tiktoken),
    }
    for name, (flags, options, model) in cases.items():
        out = str(tmp_path / name)
        assert _tool().main(["--input", source, "--output-prefix", out, "--append-eod",
                             *flags]) == 0, capsys.readouterr().err
        kind = flags[1]
        vocab_size = 10 + count if name == "tiktoken" else None
        tokenizer = build_tokenizer(kind, model, vocab_size, **options)
        dataset = IndexedDataset(out + "_text_document")
        assert [dataset[i].tolist() for i in range(2)] == \
            [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts], name
    llama = IndexedDataset(str(tmp_path / "llama2_text_document"))
    assert llama[0][0] == 1 and llama[0][-1] == 2  # BOS ... EOS
    numbers = _write_jsonl(tmp_path / "n.jsonl", [{"text": "1 2 3"}])
    assert _tool().main(["--input", numbers, "--output-prefix", str(tmp_path / "null"),
                         "--tokenizer-type", "NullTokenizer", "--vocab-size", "8",
                         "--null-tokenizer-eod-id", "0", "--append-eod"]) == 0
    assert IndexedDataset(str(tmp_path / "null_text_document"))[0].tolist() == [1, 2, 3, 0]
    assert _tool().main(["--input", source, "--output-prefix", str(tmp_path / "x"),
                         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab]) == 2
    assert "needs --merge-file" in capsys.readouterr().err
