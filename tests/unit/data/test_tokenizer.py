"""Tokenizers built locally from tiny generated text (nothing is downloaded). (The training tool
run as a script: tests/e2e/test_tokenizer.py.)"""

from __future__ import annotations

import importlib.util
import json
import os
import random

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
from tests.helpers.paths import ROOT

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
    """Megatron's NullTokenizer(N): N ids, the last one (N - 1) is eod unless
    --null-tokenizer-eod-id says otherwise."""
    tokenizer = build_tokenizer("NullTokenizer", vocab_size=100)
    assert isinstance(tokenizer, NullTokenizer)
    assert tokenizer.vocab_size == 100 and tokenizer.eod == 99
    assert tokenizer.tokenize(" 1 2  3\n4\t99 ") == [1, 2, 3, 4, 99]
    assert tokenizer.detokenize([1, 2, 3]) == "1 2 3"
    with pytest.raises(ConfigError, match="whitespace-separated integers"):
        tokenizer.tokenize("1 two 3")
    with pytest.raises(ConfigError, match="outside"):
        tokenizer.tokenize("100")
    assert build_tokenizer("NullTokenizer", vocab_size=100, null_tokenizer_eod_id=0).eod == 0
    with pytest.raises(ConfigError, match="--null-tokenizer-eod-id 100 is outside"):
        build_tokenizer("NullTokenizer", vocab_size=100, null_tokenizer_eod_id=100)


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
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
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


# ------------------------------------------------- GPT-2 BPE, Llama 2, tiktoken, HF specials
@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory) -> tuple[str, str]:
    from tests.helpers.tokenizer_files import gpt2_files as make

    return make(tmp_path_factory.mktemp("gpt2"))


def test_gpt2_bpe_tokenizer_from_vocab_and_merges(gpt2_files, tmp_path):
    """Megatron's GPT2BPETokenizer: vocab.json's size, <|endoftext|> as eod, GPT-2 byte-level
    BPE (the same ids as transformers' GPT-2 tokenizer on the same files)."""
    from transformers import GPT2Tokenizer

    vocab, merges = gpt2_files
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    table = json.load(open(vocab))
    assert tokenizer.vocab_size == len(table) and tokenizer.eod == table["<|endoftext|>"]
    reference = GPT2Tokenizer.from_pretrained(os.path.dirname(vocab), local_files_only=True)
    for text in ["the quick brown fox", " leading space and  two\n\nlines", "héllo ✓ 🙂 {}"]:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text) and tokenizer.detokenize(ids) == text
    assert tokenizer.eod not in tokenizer.tokenize("<|endoftext|>")  # plain text, as Megatron
    with pytest.raises(ConfigError, match="needs --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab)
    with pytest.raises(ConfigError, match="--vocab-file .*missing.json not found"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json"),
                        merge_file=merges)
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps({k: v for k, v in table.items() if k != "<|endoftext|>"}))
    with pytest.raises(ConfigError, match="has no <|endoftext|> token"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(no_eod), merge_file=merges)


def test_llama2_tokenizer_starts_with_bos(sp_model):
    llama = build_tokenizer("Llama2Tokenizer", sp_model)
    plain = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    ids = llama.tokenize("the lazy dog")
    assert ids == [1, *plain.tokenize("the lazy dog")] and llama.eod == 2 == plain.eod
    assert llama.vocab_size == 300 and llama.detokenize(ids) == "the lazy dog"


def test_tiktokenizer_layout_patterns_and_errors(tmp_path):
    """Megatron's TikTokenizer: S special tokens first (</s> = eod = 2), the file's tokens
    shifted by S; v1 and v2 split camel case differently; special strings are special."""
    from tests.helpers.tokenizer_files import tiktoken_file

    path, count = tiktoken_file(tmp_path / "tok.json")
    kwargs = dict(tiktoken_num_special_tokens=10)
    v2 = build_tokenizer("TikTokenizer", path, 10 + count, **kwargs)
    v1 = build_tokenizer("TikTokenizer", path, 10 + count, tiktoken_pattern="v1", **kwargs)
    assert (v2.vocab_size, v2.eod, v2.bos) == (10 + count, 2, 1)
    text = "HelloWorld the lazy dog ✓"
    for tokenizer in (v1, v2):
        ids = tokenizer.tokenize(text)
        assert min(ids) >= 10 and tokenizer.detokenize(ids) == text
    o_w = 10 + 256  # the first merge of the file, "oW": only v1 keeps "HelloWorld" in one piece
    assert o_w in v1.tokenize("HelloWorld") and o_w not in v2.tokenize("HelloWorld")
    assert v2.tokenize("dog</s>")[-1] == 2
    import pickle

    assert pickle.loads(pickle.dumps(v1)).tokenize(text) == v1.tokenize(text)
    smaller = build_tokenizer("TikTokenizer", path, 10 + 300, **kwargs)
    assert smaller.vocab_size == 310 and max(smaller.tokenize(text)) < 310
    for args, message in [
        ((path, 11 + count), f"has {count} tokens but --vocab-size"),
        ((str(tmp_path / "tok.txt"), 300), "not found"),
    ]:
        with pytest.raises(ConfigError, match=message) as info:
            build_tokenizer("TikTokenizer", *args, **kwargs)
        assert "\n" not in str(info.value)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"rank": 1, "token_bytes": "AA==", "token_str": ""}]))
    with pytest.raises(ConfigError, match="entry 0 is not"):
        build_tokenizer("TikTokenizer", str(bad), 300, **kwargs)
    with pytest.raises(ConfigError, match="needs a .json vocabulary"):
        build_tokenizer("TikTokenizer", str(tmp_path), 300, **kwargs)
    with pytest.raises(ConfigError, match="must be at least the 7 special tokens"):
        build_tokenizer("TikTokenizer", path, 300, tiktoken_num_special_tokens=5)
    with pytest.raises(ConfigError, match="must list each token once and include"):
        build_tokenizer("TikTokenizer", path, 300, special_tokens=["<s>"], **kwargs)


def test_huggingface_special_tokens_as_megatron(tmp_path):
    """Megatron's HuggingFaceTokenizer adds the tokenizer's special tokens (here a BOS) unless
    --tokenizer-hf-no-include-special-tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_texts(100), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.save_pretrained(str(tmp_path))
    with_bos = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    without = build_tokenizer("HuggingFaceTokenizer", str(tmp_path),
                              hf_include_special_tokens=False)
    assert with_bos.tokenize("lazy dog") == [0, *without.tokenize("lazy dog")]
    assert with_bos.eod == without.eod == 1
