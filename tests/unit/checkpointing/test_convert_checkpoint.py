"""Hugging Face Llama <-> megatron_h2 checkpoint conversion, on tiny random models (CPU, fp32).

Every model here is built and saved by the test itself; nothing is downloaded. (Tied, biased,
RoPE-scaled Llamas and GPT-2 are in test_convert_architectures.py; the tool run as a script:
tests/e2e/test_convert_checkpoint.py.)
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megatron_h2.checkpointing import load_checkpoint, save_checkpoint
from megatron_h2.checkpointing.hf import (
    hf_config_from_model,
    hf_to_megatron_state,
    megatron_to_hf_state,
    model_config_from_hf,
    read_hf_weights,
)
from megatron_h2.config import LLAMA_ARCHITECTURE, ModelConfig, RunConfig
from megatron_h2.errors import ConfigError
from megatron_h2.models.gpt.gpt_model import GPTModel, init_parameters
from tests.helpers.paths import ROOT

SCRIPT = ROOT / "tools" / "convert_checkpoint.py"
VOCAB = 200  # not a multiple of 128: exercises vocabulary padding
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _load_cli() -> ModuleType:
    spec = importlib.util.spec_from_file_location("convert_checkpoint", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli = _load_cli()


def convert(*argv: str | Path) -> int:
    return cli.main([str(a) for a in argv])


def tiny_llama_config(kv_heads: int = 2, **overrides: object) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                       max_position_embeddings=64, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                       **overrides)


def tiny_llama(kv_heads: int) -> LlamaForCausalLM:
    """Random weights of a visible size (norm scales too, so swapped norms would show)."""
    torch.manual_seed(kv_heads)
    model = LlamaForCausalLM(tiny_llama_config(kv_heads)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model


@torch.no_grad()
def hf_logits(model: LlamaForCausalLM) -> torch.Tensor:
    return model(TOKENS).logits


@torch.no_grad()
def our_logits(ckpt_dir: Path, iteration: int | None = None) -> torch.Tensor:
    ckpt = load_checkpoint(ckpt_dir, iteration, load_optimizer=False)
    assert ckpt is not None
    model = GPTModel(ModelConfig(**ckpt.metadata["config"]["model"])).eval()
    model.load_state_dict(ckpt.model, strict=True)
    return model(TOKENS)


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module", params=[2, 4], ids=["gqa", "mha"])
def hf_model(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, Path]:
    """A tiny random Llama saved with save_pretrained (kv heads 2 of 4, or 4 of 4)."""
    model = tiny_llama(request.param)
    path = tmp_path_factory.mktemp("hf") / "model"
    model.save_pretrained(path)
    return model, path


# --- HF -> megatron_h2 --------------------------------------------------------------------------

def test_hf_to_megatron_gives_same_logits(hf_model, tmp_path: Path) -> None:
    model, hf_dir = hf_model
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", hf_dir,
                   "--output", tmp_path / "ours") == 0
    ckpt = load_checkpoint(tmp_path / "ours")
    assert ckpt is not None and ckpt.iteration == 0 and ckpt.optimizer == {}
    config = ModelConfig(**ckpt.metadata["config"]["model"])
    assert config.vocab_size == 256 and ckpt.metadata["hf"]["vocab_size"] == VOCAB
    assert config.num_query_groups == model.config.num_key_value_heads
    assert config.rotary_base == 5000.0 and config.norm_epsilon == 1e-5
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert ckpt.model[name].shape == (256, 64)
        assert torch.count_nonzero(ckpt.model[name][VOCAB:]) == 0  # padding rows are zero
    ours = our_logits(tmp_path / "ours")
    torch.testing.assert_close(ours[..., :VOCAB], hf_logits(model), atol=1e-5, rtol=0)


def test_vocab_padding_follows_flag(hf_model, tmp_path: Path) -> None:
    _, hf_dir = hf_model
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", hf_dir, "--output",
                   tmp_path / "ours", "--make-vocab-size-divisible-by", "64") == 0
    ckpt = load_checkpoint(tmp_path / "ours")
    assert ckpt is not None
    assert ckpt.metadata["config"]["model"]["vocab_size"] == 256
    assert ckpt.metadata["config"]["data"]["make_vocab_size_divisible_by"] == 64
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", hf_dir, "--output",
                   tmp_path / "exact", "--make-vocab-size-divisible-by", "1") == 0
    exact = load_checkpoint(tmp_path / "exact")
    assert exact is not None and exact.model["output_layer.weight"].shape[0] == VOCAB


# --- HF -> megatron_h2 -> HF --------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_hf_round_trip_is_exact(hf_model, sharded: bool, tmp_path: Path) -> None:
    model, hf_dir = hf_model
    if sharded:  # sharded input, and sharded output
        hf_dir = tmp_path / "hf_sharded"
        model.save_pretrained(hf_dir, max_shard_size="100KB")
        assert (hf_dir / "model.safetensors.index.json").is_file()
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", hf_dir,
                   "--output", tmp_path / "ours") == 0
    shard_flag = ["--max-shard-size", "100KB"] if sharded else []
    assert convert("--from", "megatron_h2", "--to", "hf", "--input", tmp_path / "ours",
                   "--output", tmp_path / "back", *shard_flag) == 0
    back = tmp_path / "back"
    assert (back / "model.safetensors.index.json").is_file() == sharded
    assert_same_tensors(read_hf_weights(hf_dir), read_hf_weights(back))
    for name in ("config.json", "generation_config.json"):
        assert json.loads((hf_dir / name).read_text()) == json.loads((back / name).read_text())
    reloaded = LlamaForCausalLM.from_pretrained(back).eval()
    assert torch.equal(hf_logits(reloaded), hf_logits(model))


# --- megatron_h2 -> HF -> megatron_h2 -----------------------------------------------------------

def save_our_checkpoint(path: Path, config: ModelConfig, iteration: int, seed: int,
                        dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = GPTModel(config)
    init_parameters(model, config, seed)
    state = {n: p.detach().to(dtype) for n, p in model.named_parameters()}
    optim = {f"{n}.exp_avg": torch.zeros_like(t) for n, t in state.items()}
    metadata = {"config": RunConfig(model=config).to_dict(), "consumed_samples": 64}
    save_checkpoint(path, iteration, state, optim, metadata)
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [2, 4], ids=["gqa", "mha"])
def test_megatron_round_trip_is_exact(groups: int, dtype: torch.dtype, tmp_path: Path) -> None:
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                         num_query_groups=groups, ffn_hidden_size=96, seq_length=64,
                         vocab_size=256, norm_epsilon=1e-6, rotary_base=20000.0,
                         hidden_dropout=0.0, attention_dropout=0.0, group_query_attention=True,
                         **LLAMA_ARCHITECTURE)
    state = save_our_checkpoint(tmp_path / "ours", config, 5, seed=3, dtype=dtype)
    save_our_checkpoint(tmp_path / "ours", config, 7, seed=4, dtype=dtype)  # latest, not used
    assert convert("--from", "megatron_h2", "--to", "hf", "--input", tmp_path / "ours",
                   "--output", tmp_path / "hf", "--iteration", "5") == 0
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["vocab_size"] == 256  # nothing recorded: keep the config's vocabulary
    assert hf_config["dtype"] == str(dtype).removeprefix("torch.")
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", tmp_path / "hf",
                   "--output", tmp_path / "again") == 0
    again = load_checkpoint(tmp_path / "again")
    assert again is not None
    assert_same_tensors(state, again.model)
    assert again.metadata["config"]["model"] == RunConfig(model=config).to_dict()["model"]
    if dtype == torch.float32:
        hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
        torch.testing.assert_close(hf_logits(hf), our_logits(tmp_path / "ours", 5),
                                   atol=1e-5, rtol=0)


def test_state_functions_invert_each_other() -> None:
    model = tiny_llama(2)
    config = model_config_from_hf(model.config.to_dict())
    hf_state = {k: v.detach() for k, v in model.state_dict().items()}
    ours = hf_to_megatron_state(hf_state, config)
    assert_same_tensors(hf_state, megatron_to_hf_state(ours, config, VOCAB))


# --- configuration ------------------------------------------------------------------------------

BASE_HF_CONFIG = tiny_llama_config().to_dict()


def test_config_mapping() -> None:
    config = model_config_from_hf(BASE_HF_CONFIG)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads,
            config.num_query_groups, config.ffn_hidden_size) == (2, 64, 4, 2, 96)
    assert config.max_position_embeddings == config.seq_length == 64
    back = hf_config_from_model(config, VOCAB, BASE_HF_CONFIG)
    assert back == {**BASE_HF_CONFIG, "architectures": ["LlamaForCausalLM"]}
    fresh = hf_config_from_model(config, VOCAB, None)
    assert fresh["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    assert fresh["vocab_size"] == VOCAB and fresh["head_dim"] == 16


def test_legacy_rope_theta_is_read_and_kept() -> None:
    legacy = dict(BASE_HF_CONFIG, rope_theta=500000.0, rope_scaling=None)
    del legacy["rope_parameters"]
    config = model_config_from_hf(legacy)
    assert config.rotary_base == 500000.0
    back = hf_config_from_model(config, VOCAB, legacy)
    assert back["rope_theta"] == 500000.0 and "rope_parameters" not in back


@pytest.mark.parametrize("change, words", [
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.5, "rope_theta": 1e4}}, "linear"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                          "rope_theta": 1e4}}, "llama3"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"head_dim": "16"}, "head_dim"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "mistral"}, "model_type"),
    ({"num_key_value_heads": 3}, "num-query-groups"),
    ({"hidden_size": None}, "hidden_size"),
    ({"intermediate_size": "96"}, "intermediate_size"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_hf_config_is_refused(change: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        model_config_from_hf({**BASE_HF_CONFIG, **change})
    assert "\n" not in str(info.value)


# --- bad input on the command line -------------------------------------------------------------

@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A saved tiny HF model, its conversion, broken variants and an empty directory."""
    root = tmp_path_factory.mktemp("bad")
    tiny_llama(2).save_pretrained(root / "hf")
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", root / "hf",
                   "--output", root / "ours") == 0
    # "tied": the config ties the embeddings but the file holds a different lm_head
    variants = {"bias": {"attention_bias": True}, "tied": {"tie_word_embeddings": True},
                "shape": {"intermediate_size": 128}, "vocab": {"vocab_size": 201}}
    for name, change in variants.items():
        shutil.copytree(root / "hf", root / name)
        cfg = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**cfg, **change}))
    (root / "empty").mkdir()
    (root / "config_only").mkdir()
    shutil.copy(root / "hf" / "config.json", root / "config_only")
    return {p.name: p for p in root.iterdir()} | {"root": root}


BAD_CLI = [
    ("hf megatron_h2 missing new", "does not exist"),
    ("hf megatron_h2 empty new", "no config.json"),
    ("hf megatron_h2 config_only new", "model.safetensors"),
    ("hf megatron_h2 bias new", "attention_bias"),
    ("hf megatron_h2 tied new", "tie_word_embeddings"),
    ("hf megatron_h2 shape new", "shape"),
    ("hf megatron_h2 vocab new", "vocab_size 201"),
    ("hf megatron_h2 hf ours", "already holds a checkpoint"),
    ("megatron_h2 hf empty new", "holds no megatron_h2 checkpoint"),
    ("megatron_h2 hf ours hf", "already holds a checkpoint"),
    ("megatron_h2 hf ours new --iteration 9", "does not exist"),
    ("hf megatron_h2 hf new --iteration 1", "--iteration applies only"),
    ("safetensors megatron_h2 hf new", "--from must be one of"),
    ("hf nemo hf new", "--to must be one of"),
    ("hf hf hf new", "nothing to convert"),
    ("megatron_h2 hf ours new --max-shard-size 5XB", "--max-shard-size"),
]


@pytest.mark.parametrize("spec, words", BAD_CLI, ids=[s for s, _ in BAD_CLI])
def test_bad_cli_input_prints_one_line(dirs: dict[str, Path], spec: str, words: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    src, dst, inp, out, *rest = spec.split()
    path = {name: str(dirs.get(name, dirs["root"] / name)) for name in (inp, out)}
    assert convert("--from", src, "--to", dst, "--input", path[inp], "--output", path[out],
                   *rest) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert words in err
    assert not (dirs["root"] / "new").exists()  # nothing written on refusal


def test_missing_argument_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", "x") == 2
    err = capsys.readouterr().err
    assert err == "error: the following arguments are required: --output\n"
