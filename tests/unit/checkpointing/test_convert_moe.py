"""Hugging Face conversion of mixture-of-experts models: transformers' MixtralForCausalLM both
ways (logits equal within 1e-5 in fp32, the round trip bit-exact, the converted model the one
pretrain_gpt.py builds from Megatron's Mixtral flags), MoE models Mixtral cannot hold refused in
one line. Every model is built by the test itself; nothing is downloaded."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from megatron_h2.checkpointing import save_checkpoint
from megatron_h2.config import ModelConfig, RunConfig
from megatron_h2.models.gpt.gpt_model import GPTModel, init_parameters
from megatron_h2.training.arguments import config_from_args
from tests.unit.checkpointing.test_convert_architectures import (
    TOKENS,
    VOCAB,
    convert,
    hf_to_ours_and_back,
    randomize,
)


def tiny_mixtral(**kw) -> MixtralForCausalLM:
    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2, max_position_embeddings=64)
    config = MixtralConfig(**{**args, **kw})
    return randomize(MixtralForCausalLM(config), seed=3)


@pytest.mark.parametrize("kw", [{}, {"num_experts_per_tok": 3, "tie_word_embeddings": True}])
def test_mixtral_logits_and_round_trip(kw, tmp_path):
    diff, config = hf_to_ours_and_back(tiny_mixtral(**kw), tmp_path)
    assert diff < 1e-5
    assert config.num_experts == 4 and config.moe_router_topk == kw.get("num_experts_per_tok", 2)
    assert config.moe_layers == [0, 1] and config.moe_ffn_hidden_size == 48


def test_mixtral_is_what_megatrons_flags_build():
    """The converted config equals the model Megatron's Mixtral example flags describe."""
    from megatron_h2.checkpointing.hf import model_config_from_hf

    hf = tiny_mixtral().config.to_dict()
    ours = model_config_from_hf(hf)
    cfg, _ = config_from_args([
        "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "48",
        "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
        "--seq-length", "64", "--max-position-embeddings", "64", "--swiglu",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base",
        "1000000", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--num-experts", "4", "--moe-router-topk", "2", "--norm-epsilon", "1e-5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--lr", "1e-4",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
        "--vocab-size", str(VOCAB), "--tokenizer-type", "NullTokenizer"])
    from megatron_h2.config import ARCHITECTURE_FIELDS

    for name in ARCHITECTURE_FIELDS + ("num_layers", "hidden_size", "num_attention_heads"):
        assert getattr(ours, name) == getattr(cfg.model, name), name


def test_ours_to_mixtral_logits(tmp_path):
    """A model trained here (router and expert weights of its own) read by transformers."""
    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                         group_query_attention=True, num_query_groups=2, ffn_hidden_size=40,
                         seq_length=32, swiglu=True, normalization="RMSNorm",
                         position_embedding_type="rope", add_bias_linear=False,
                         untie_embeddings_and_output_weights=True, num_experts=3,
                         moe_router_topk=2, vocab_size=256, hidden_dropout=0.0,
                         attention_dropout=0.0)
    model = GPTModel(config).eval()
    init_parameters(model, config, seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.5)  # decisive routing
    save_checkpoint(tmp_path / "ours", 1, model.state_dict(), None,
                    {"config": RunConfig(model=config).to_dict(), "consumed_samples": 0})
    assert convert("--from", "megatron_h2", "--to", "hf", "--input", tmp_path / "ours",
                   "--output", tmp_path / "hf") == 0
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        want, got = model(TOKENS), hf(TOKENS).logits
    assert (want - got).abs().max().item() < 1e-5


@pytest.mark.parametrize("kw,reason", [
    (dict(moe_shared_expert_intermediate_size=16), "shared experts"),
    (dict(moe_layer_freq=2), "dense layers between the MoE layers"),
    (dict(moe_router_score_function="sigmoid"), "router score function sigmoid"),
])
def test_moe_models_mixtral_cannot_hold_are_refused(kw, reason):
    from megatron_h2.checkpointing.hf import family_of
    from megatron_h2.errors import ConfigError

    config = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                         swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                         add_bias_linear=False, num_experts=4, vocab_size=256, **kw)
    with pytest.raises(ConfigError, match="MixtralForCausalLM cannot hold this model") as exc:
        family_of(config)
    assert reason in str(exc.value) and "\n" not in str(exc.value)


def test_mixtral_sliding_window_is_refused(tmp_path):
    from megatron_h2.checkpointing.hf import model_config_from_hf
    from megatron_h2.errors import ConfigError

    with pytest.raises(ConfigError, match="sliding_window 16"):
        model_config_from_hf(tiny_mixtral(sliding_window=16).config.to_dict())


@pytest.mark.parametrize("kw", [
    dict(mlp_only_layers=[0], norm_topk_prob=False),  # dense first layer, pre-softmax top-k
    dict(decoder_sparse_step=2, norm_topk_prob=True, num_experts_per_tok=3),
])
def test_qwen2_moe_to_ours_logits(kw, tmp_path):
    """Qwen2-MoE (QKV bias, dense and MoE layers, shared expert with its sigmoid gate) converts
    to ours with transformers' logits; writing it back is refused in one line."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from megatron_h2.checkpointing import load_checkpoint
    from tests.unit.checkpointing.test_convert_architectures import our_logits

    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                moe_intermediate_size=24, shared_expert_intermediate_size=40,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    model = randomize(Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**args, **kw})), seed=4)
    model.save_pretrained(tmp_path / "hf")
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", tmp_path / "hf",
                   "--output", tmp_path / "ours") == 0
    with torch.no_grad():
        want = model(TOKENS).logits
    assert (our_logits(tmp_path / "ours")[..., :VOCAB] - want).abs().max().item() < 1e-5
    config = ModelConfig(**load_checkpoint(tmp_path / "ours").metadata["config"]["model"])
    assert config.moe_shared_expert_gate and config.add_qkv_bias and not config.add_bias_linear
    assert config.moe_layers == ([1, 2] if "mlp_only_layers" in kw else [1])
    assert convert("--from", "megatron_h2", "--to", "hf", "--input", tmp_path / "ours",
                   "--output", tmp_path / "back") == 2


def test_hf_moe_checkpoint_with_another_expert_count_is_one_line(tmp_path, capsys):
    import json

    tiny_mixtral().save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # save_pretrained's progress bar
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_local_experts"] = 3  # the weights hold 4
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert convert("--from", "hf", "--to", "megatron_h2", "--input", tmp_path / "hf",
                   "--output", tmp_path / "ours") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert "block_sparse_moe.experts.3" in err and "does not match its config" in err
