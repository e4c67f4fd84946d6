"""Tokenizers built locally from tiny generated text (nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

from megatron_h2.data.tokenizer import (
    TOKENIZER_TYPES,
    GPTSentencePieceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
)
from megatron_h2.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def _texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(count)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("sp")
    return train_sentencepiece(iter(_texts(200)), str(folder / "tok"), 300)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_texts(200), trainer)
    folder = str(tmp_path_factory.mktemp("hf"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer"])
def test_sentencepiece_roundtrip_and_eod(sp_model, kind):
    tokenizer = build_tokenizer(kind, sp_model)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert tokenizer.vocab_size == 300 and tokenizer.eod == 2
    for text in ["the quick brown fox", "  leading and  double  spaces\n\tand tabs\n",
                 "unseen: héllo wörld ✓ 🙂 {}[]", "def f(x):\n    return x ** 2\n"]:
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text
    assert tokenizer.eod not in tokenizer.tokenize("the quick brown fox")
    assert type(build_tokenizer("GPTSentencePieceTokenizer", sp_model)) is GPTSentencePieceTokenizer


def test_sentencepiece_pickles(sp_model):
    import pickle

    tokenizer = pickle.loads(pickle.dumps(build_tokenizer("GPTSentencePieceTokenizer", sp_model)))
    assert tokenizer.detokenize(tokenizer.tokenize("lazy dog")) == "lazy dog"


def test_train_from_files(tmp_path):
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}) + "\n" for t in _texts(100)))
    text = tmp_path / "in.txt"
    text.write_text("\n".join(_texts(50, seed=1)))
    model = train_sentencepiece([str(jsonl), str(text)], str(tmp_path / "m"), 300,
                                model_type="unigram", json_keys=["body"])
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    assert tokenizer.vocab_size == 300
    assert tokenizer.detokenize(tokenizer.tokenize("wizards hex")) == "wizards hex"


def test_huggingface_tokenizer(hf_dir):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_dir)
    assert tokenizer.eod == 0  # the only special token, added first
    assert 256 < tokenizer.vocab_size <= 400
    text = "the lazy dog jumps ✓"
    ids = tokenizer.tokenize(text)
    assert tokenizer.eod not in ids and tokenizer.detokenize(ids) == text


def test_huggingface_without_eos_is_rejected(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="no eos_token"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


def test_null_tokenizer():
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.vocab_size == 101 and tokenizer.eod == 100 == tokenizer.vocab_size - 1
    assert tokenizer.tokenize(" 1 2  3\n4\t99 ") == [1, 2, 3, 4, 99]
    assert tokenizer.detokenize([1, 2, 3]) == "1 2 3"
    with pytest.raises(ConfigError, match="whitespace-separated integers"):
        tokenizer.tokenize("1 two 3")
    with pytest.raises(ConfigError, match="outside"):
        tokenizer.tokenize("100")


@pytest.mark.parametrize(
    "args, message",
    [
        (("BertWordPieceTokenizer",), "unknown tokenizer type.*" + ", ".join(TOKENIZER_TYPES)),
        (("NullTokenizer",), "NullTokenizer needs --vocab-size"),
        (("GPTSentencePieceTokenizer",), "needs --tokenizer-model"),
        (("GPTSentencePieceTokenizer", "/nonexistent/tok.model"), "not found"),
        (("HuggingFaceTokenizer", "/nonexistent/dir"), "not found"),
    ],
)
def test_build_tokenizer_errors(args, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_tokenizer(*args)
    assert "\n" not in str(info.value)


def test_bad_model_files(tmp_path, sp_model):
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00not a model\xff" * 10)
    with pytest.raises(ConfigError, match="cannot load .* as a SentencePiece model") as info:
        build_tokenizer("SentencePieceTokenizer", str(garbage))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="is a directory"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path))
    with pytest.raises(ConfigError, match="cannot load a Hugging Face tokenizer"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    with pytest.raises(ConfigError, match="smaller than the vocab"):
        build_tokenizer("GPTSentencePieceTokenizer", sp_model, vocab_size=100)
    assert build_tokenizer("GPTSentencePieceTokenizer", sp_model, vocab_size=512).vocab_size == 300


def test_train_errors(tmp_path):
    prefix = str(tmp_path / "m")
    with pytest.raises(ConfigError, match="model type"):
        train_sentencepiece(iter(_texts(5)), prefix, 300, model_type="wordpiece")
    with pytest.raises(ConfigError, match="too small"):
        train_sentencepiece(iter(_texts(5)), prefix, 100)
    with pytest.raises(ConfigError, match="no text"):
        train_sentencepiece(iter(["", "   \n"]), prefix, 300)
    with pytest.raises(ConfigError, match="not found"):
        train_sentencepiece([str(tmp_path / "missing.jsonl")], prefix, 300)
    with pytest.raises(ConfigError, match="lower --vocab-size") as info:
        train_sentencepiece(iter(["ab ab ab"]), prefix, 5000)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="raise --vocab-size"):
        train_sentencepiece(iter(["abcdefghijklmnopqrstuvwxyz0123456789" * 3]), prefix, 280,
                            model_type="unigram")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: not valid JSON"):
        train_sentencepiece([str(bad)], prefix, 300)
    with pytest.raises(ConfigError, match="no string value for key 'body'"):
        train_sentencepiece([str(bad)], prefix, 300, json_keys=["body"])


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_tokenizer_cli(tmp_path, capsys):
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(100)))
    tool = _load_tool("train_tokenizer")
    prefix = ["--model-prefix", str(tmp_path / "t")]
    assert tool.main(["--input", str(data), "--vocab-size", "300", *prefix]) == 0
    assert "300 pieces" in capsys.readouterr().out
    assert tool.main(["--input", str(data), "--vocab-size", "10", *prefix]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1


@pytest.mark.e2e
def test_train_tokenizer_script_runs_standalone(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("\n".join(_texts(100)))
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "train_tokenizer.py"), "--input", str(data),
         "--vocab-size", "300", "--model-prefix", str(tmp_path / "t")],
        capture_output=True, text=True, cwd=str(tmp_path), timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert os.path.isfile(tmp_path / "t.model")
