"""tools/preprocess_data.py with worker processes and as a script: the output is the same for
any worker count, and a bad line is reported with its line number."""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys

import pytest

from megatron_h2.data.indexed_dataset import IndexedDataset
from megatron_h2.data.preprocess import preprocess_jsonl
from megatron_h2.data.tokenizer import build_tokenizer
from megatron_h2.errors import ConfigError
from tests.helpers.paths import ROOT
from tests.unit.data import test_preprocess_data as unit
from tests.unit.data.test_preprocess_data import WORDS, _number_records, _write_jsonl

sp_model = unit.sp_model  # the unit tests' SentencePiece model fixture, used here too


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [2, 3])
def test_output_identical_for_any_worker_count(tmp_path, sp_model, workers):
    rng = random.Random(2)
    records = [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 30)))}
               for _ in range(120)]
    records.insert(17, "   ")  # blank lines are skipped
    source = _write_jsonl(tmp_path / "in.jsonl", records)
    common = dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sp_model,
                  append_eod=True)
    one = preprocess_jsonl(source, str(tmp_path / "one"), workers=1, **common)["text"]
    many = preprocess_jsonl(source, str(tmp_path / "many"), workers=workers, log_interval=10,
                            **common)["text"]
    for suffix in (".bin", ".idx"):
        assert open(one + suffix, "rb").read() == open(many + suffix, "rb").read()
    tokenizer = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    dataset = IndexedDataset(one)
    texts = [r["text"] for r in records if isinstance(r, dict) and r["text"]]
    assert len(dataset) == len(texts)
    assert tokenizer.detokenize(dataset[5][:-1]) == texts[5] and dataset[5][-1] == tokenizer.eod


@pytest.mark.e2e
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_reports_line_number(tmp_path, workers):
    records = _number_records(40)
    records[33] = '{"text": "1 2",'
    source = _write_jsonl(tmp_path / "in.jsonl", records)
    with pytest.raises(ConfigError, match=r"in\.jsonl:34: not valid JSON") as info:
        preprocess_jsonl(source, str(tmp_path / "c"), "NullTokenizer", vocab_size=1000,
                         workers=workers)
    assert "\n" not in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no partial output, no scratch


@pytest.mark.e2e
def test_cli_script(tmp_path, sp_model):
    source = _write_jsonl(tmp_path / "in.jsonl", [{"text": "alpha beta"}, {"text": "gamma"}])
    script = os.path.join(ROOT, "tools", "preprocess_data.py")
    args = [sys.executable, script, "--input", source, "--output-prefix", str(tmp_path / "out"),
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
            "--append-eod", "--workers", "2", "--log-interval", "1"]
    result = subprocess.run(args, capture_output=True, text=True, cwd=str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "processed" in result.stderr and "out_text_document.bin" in result.stdout
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 2
    spec = importlib.util.spec_from_file_location("preprocess_tool", script)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", "x",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "5"]) == 2
