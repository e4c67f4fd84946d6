"""Activation recompute as Megatron chooses it: --recompute-granularity full with
--recompute-method uniform (groups of N layers checkpointed as one) or block (the first N layers
of every model chunk), and the command-line rules around them."""

import pytest
import torch

import megatron_h2.models.gpt.gpt_model as gpt_model
from megatron_h2.errors import ConfigError
from megatron_h2.training.arguments import config_from_args
from tests.helpers.tiny_models import build, tiny

FOUR_LAYERS = [0, 1, 2, 3]


@pytest.mark.parametrize("method, count, chunks, groups, recomputed", [
    ("uniform", 1, None, [[0], [1], [2], [3]], FOUR_LAYERS),
    ("uniform", 2, None, [[0, 1], [2, 3]], FOUR_LAYERS),
    ("uniform", 3, None, [[0, 1, 2], [3]], FOUR_LAYERS),  # the last group is shorter
    ("block", 1, None, [[0]], [0]),
    ("block", 3, None, [[0], [1], [2]], [0, 1, 2]),
    # virtual stages: the rule applies inside each model chunk
    ("block", 1, [(0, 2), (2, 4)], [[0], [2]], [0, 2]),
    ("uniform", 2, [(0, 1), (1, 4)], [[0], [1, 2], [3]], FOUR_LAYERS),
], ids=lambda v: str(v).replace(" ", ""))
def test_recompute_method_groups_layers_and_keeps_gradients(monkeypatch, method, count, chunks,
                                                            groups, recomputed):
    tokens = torch.randint(0, 128, (2, 17))
    reference = build(tiny())
    model = build(tiny(recompute="full", recompute_method=method, recompute_num_layers=count),
                  chunks=chunks)
    calls: list[list[int]] = []
    real = gpt_model.checkpoint

    def recording(fn, layers, x, **kwargs):
        calls.append(list(layers))
        return real(fn, layers, x, **kwargs)

    monkeypatch.setattr(gpt_model, "checkpoint", recording)
    runs = {i: 0 for i in FOUR_LAYERS}
    for i in FOUR_LAYERS:  # count the layer's forward calls (recompute included)
        layer = model.decoder.layers[str(i)]

        def counted(x, i=i, forward=layer.forward):
            runs[i] += 1
            return forward(x)

        monkeypatch.setattr(layer, "forward", counted)
    losses = []
    for m in (reference, model):
        hidden = None
        for c in range(m.num_chunks):
            out = m(tokens=tokens[:, :-1] if c == 0 else None, hidden_states=hidden,
                    labels=tokens[:, 1:], chunk=c)
            hidden = out
        losses.append(out.mean())
        losses[-1].backward()
    assert calls == groups
    # a checkpointed layer runs again in backward; the others once
    assert runs == {i: 2 if i in recomputed else 1 for i in FOUR_LAYERS}
    assert torch.equal(losses[0], losses[1])
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name].grad), name


def test_no_checkpoint_without_gradients(monkeypatch):
    model = build(tiny(recompute="full", recompute_method="uniform", recompute_num_layers=1))
    calls = []
    monkeypatch.setattr(gpt_model, "checkpoint", lambda *a, **k: calls.append(a))
    with torch.no_grad():
        model(tokens=torch.randint(0, 128, (1, 16)))
    model.eval()
    model(tokens=torch.randint(0, 128, (1, 16)))
    assert calls == []


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


@pytest.mark.parametrize("flags, message", [
    (["--recompute-granularity", "full"], "needs --recompute-method uniform|block"),
    (["--recompute-granularity", "selective", "--recompute-method", "block",
      "--recompute-num-layers", "1"], "need --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "go together"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "5"], "between 1 and --num-layers 4"),
])
def test_recompute_flags_follow_megatrons_rules(flags, message):
    with pytest.raises(ConfigError, match=message.replace("|", r"\|")):
        config_from_args(BASE + flags)


def test_recompute_flags_reach_the_model_config():
    cfg, _ = config_from_args(BASE + ["--recompute-granularity", "full", "--recompute-method",
                                      "block", "--recompute-num-layers", "2"])
    assert (cfg.model.recompute, cfg.model.recompute_method, cfg.model.recompute_num_layers) \
        == ("full", "block", 2)
    assert cfg.model.recompute_groups(range(4, 8)) == [([4], True), ([5], True), ([6], False),
                                                        ([7], False)]
