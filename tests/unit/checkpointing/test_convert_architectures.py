"""Hugging Face conversion of the architectures Megatron's flags describe beyond the plain Llama:
tied, biased and RoPE-scaled Llamas, and Megatron's default GPT as transformers' GPT2LMHeadModel
(logits equal within 1e-5 in fp32, round trips exact, unrepresentable models refused in one line).

Every model is built by the test itself; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from megatron_h2.checkpointing import load_checkpoint, save_checkpoint
from megatron_h2.checkpointing.hf import read_hf_weights
from megatron_h2.config import ModelConfig, RunConfig
from megatron_h2.models.gpt.gpt_model import GPTModel, init_parameters
from megatron_h2.training.arguments import config_from_args
from tests.helpers.convert_cli import convert

VOCAB = 200  # not a multiple of 128: exercises vocabulary padding
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of a visible size (norm scales and biases too, so a swap would show)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(0.5 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model.eval()


@torch.no_grad()
def our_logits(ckpt_dir: Path) -> torch.Tensor:
    ckpt = load_checkpoint(ckpt_dir, load_optimizer=False)
    model = GPTModel(ModelConfig(**ckpt.metadata["config"]["model"])).eval()
    model.load_state_dict(ckpt.model, strict=True)
    return model(TOKENS)


def hf_to_ours_and_back(model, tmp_path: Path) -> tuple[float, ModelConfig]:
    """Save ``model``, convert it to ours and back; returns ours-vs-HF max |logit difference|
    (asserting the round trip is bit-exact) and our config."""
    model.save_pretrained(tmp_path / "hf")
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", tmp_path / "hf",
                   "--output", tmp_path / "ours") == 0
    with torch.no_grad():
        want = model(TOKENS).logits
    diff = (our_logits(tmp_path / "ours")[..., :VOCAB] - want).abs().max().item()
    assert convert("--from", "megatron_h2", "--to", "hf", "--input", tmp_path / "ours",
                   "--output", tmp_path / "back") == 0
    a, b = read_hf_weights(tmp_path / "hf"), read_hf_weights(tmp_path / "back")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == \
        json.loads((tmp_path / "back" / "config.json").read_text())
    config = ModelConfig(**load_checkpoint(tmp_path / "ours").metadata["config"]["model"])
    return diff, config


# --- Llama variants -----------------------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_theta": 5000.0}
LLAMA_CASES = {
    "tied_llama3": ({"tie_word_embeddings": True, "rope_parameters": LLAMA3},
                    {"tied_embeddings": True, "use_rope_scaling": True,
                     "rope_scaling_factor": 8.0}),
    "linear_rope_biases_head_dim": (
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
         "attention_bias": True, "mlp_bias": True, "head_dim": 24},
        {"rotary_seq_len_interpolation_factor": 4, "add_bias_linear": True, "kv_channels": 24}),
}


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_variants_give_the_same_logits(case, tmp_path):
    hf_change, ours = LLAMA_CASES[case]
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, rms_norm_eps=1e-5, **hf_change)
    diff, got = hf_to_ours_and_back(randomize(LlamaForCausalLM(config), 7), tmp_path)
    assert diff < 1e-5, diff
    for name, value in ours.items():
        assert getattr(got, name) == value, name
    if hf_change.get("tie_word_embeddings"):
        assert "lm_head.weight" not in read_hf_weights(tmp_path / "back")
        assert "output_layer.weight" not in load_checkpoint(tmp_path / "ours").model


# --- GPT-2 --------------------------------------------------------------------------------------

def tiny_gpt2(activation: str, tied: bool = True) -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                        activation_function=activation, tie_word_embeddings=tied,
                        bos_token_id=0, eos_token_id=0)
    return randomize(GPT2LMHeadModel(config), 3)


@pytest.mark.parametrize("activation, tied, ours", [
    ("gelu_new", True, "gelu_tanh"),  # GPT-2's own, Megatron's default fused bias-GeLU
    ("gelu", False, "gelu"),  # exact GeLU = --no-bias-gelu-fusion
    ("relu2", True, "squared_relu"),
])
def test_gpt2_gives_the_same_logits(activation, tied, ours, tmp_path):
    diff, config = hf_to_ours_and_back(tiny_gpt2(activation, tied), tmp_path)
    assert diff < 1e-5, diff
    assert (config.normalization, config.position_embedding_type) == ("LayerNorm",
                                                                      "learned_absolute")
    assert config.activation == ours and config.tied_embeddings == tied


GPT_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--micro-batch-size 1 --train-iters 1 --lr 1e-4 --data-path x "
             "--tokenizer-type NullTokenizer")


def save_ours(path: Path, extra: str = "") -> ModelConfig:
    """A megatron_h2 checkpoint of the model pretrain_gpt.py builds for GPT_FLAGS + ``extra``."""
    cfg, _ = config_from_args(f"{GPT_FLAGS} {extra}".split())
    config = cfg.model
    config.vocab_size = 256
    model = GPTModel(config)
    init_parameters(model, config, seed=5)
    with torch.no_grad():  # biases and norms away from their initial zeros and ones
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.2 * torch.randn_like(param))
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    save_checkpoint(path, 3, state, None, {"config": RunConfig(model=config).to_dict()})
    return config


@pytest.mark.parametrize("extra, activation", [("", "gelu_new"),
                                               ("--no-bias-gelu-fusion", "gelu"),
                                               ("--apply-layernorm-1p", "gelu_new")])
def test_megatron_gpt_loads_as_gpt2(extra, activation, tmp_path):
    """Megatron's default GPT (no architecture flags) written for GPT2LMHeadModel."""
    save_ours(tmp_path / "ours", extra)
    assert convert("--from", "megatron_h2", "--to", "hf", "--input", tmp_path / "ours",
                   "--output", tmp_path / "hf") == 0
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == ["GPT2LMHeadModel"]
    assert hf_config["activation_function"] == activation and hf_config["tie_word_embeddings"]
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        want = hf(TOKENS).logits
    assert (our_logits(tmp_path / "ours") - want).abs().max().item() < 1e-5


LLAMA3_FLAGS = ("--swiglu --normalization RMSNorm --position-embedding-type rope "
                "--disable-bias-linear --untie-embeddings-and-output-weights "
                "--group-query-attention --num-query-groups 2 --kv-channels 24 "
                "--rotary-base 500000 --apply-layernorm-1p --use-rope-scaling "
                "--rope-scaling-factor 32")


def test_megatron_llama3_flags_load_as_llama(tmp_path):
    """Megatron's Llama 3 recipe flags (zero-centred RMSNorm, head size 128-style --kv-channels,
    rope scaling) written for LlamaForCausalLM."""
    save_ours(tmp_path / "ours", LLAMA3_FLAGS)
    assert convert("--from", "megatron_h2", "--to", "hf", "--input", tmp_path / "ours",
                   "--output", tmp_path / "hf") == 0
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["rope_parameters"]["rope_type"] == "llama3" and hf_config["head_dim"] == 24
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        want = hf(TOKENS).logits
    assert (our_logits(tmp_path / "ours") - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("extra, words", [
    ("--swiglu", "GPT2LMHeadModel cannot hold this model (activation swiglu)"),
    ("--group-query-attention --num-query-groups 2", "grouped-query attention"),
    ("--disable-bias-linear --position-embedding-type rope", "position embedding rope"),
    ("--normalization RMSNorm", "LlamaForCausalLM cannot hold this model (activation gelu_tanh"),
    ("--normalization RMSNorm --swiglu --position-embedding-type rope --add-qkv-bias "
     "--disable-bias-linear --rotary-percent 0.5", "--rotary-percent < 1, --add-qkv-bias"),
])
def test_models_hf_cannot_hold_are_refused_in_one_line(extra, words, tmp_path, capsys):
    save_ours(tmp_path / "ours", extra)
    assert convert("--from", "megatron_h2", "--to", "hf", "--input", tmp_path / "ours",
                   "--output", tmp_path / "hf") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "hf").exists()


def test_gpt2_parameter_count_is_megatrons_gpt_count():
    """Megatron's GPT with GPT-2 small's shape, on GPT-2's unpadded vocabulary, has exactly
    GPT2LMHeadModel's parameters (counted by transformers, tied head once)."""
    cfg, _ = config_from_args("--num-layers 12 --hidden-size 768 --num-attention-heads 12 "
                              "--seq-length 1024 --micro-batch-size 1 --train-iters 1 --lr 1e-4 "
                              "--data-path x --tokenizer-type NullTokenizer".split())
    cfg.model.vocab_size = 50257
    with torch.device("meta"):
        hf = GPT2LMHeadModel(GPT2Config())
    assert cfg.model.num_parameters() == sum(p.numel() for p in hf.parameters()) == 124_439_808
