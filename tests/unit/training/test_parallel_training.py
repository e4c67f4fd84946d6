"""Bad TP / PP / DP layouts fail with one line before any process group starts.

MODEL is the GPT-3-style command line the layouts train in tests/e2e/test_parallel_training.py
(no architecture flags: Megatron's LayerNorm, 4h GeLU MLP with biases, learned positions,
embedding tied to the output layer).
"""

import pytest
import torch.distributed as dist

from megatron_h2.training.main import main

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8",
         "--lr", "3e-3", "--lr-warmup-iters", "2", "--seed", "11", "--train-iters", "10",
         "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--split", "90,10,0",
         "--log-params-norm", "--log-num-zeros-in-grad", "--max-position-embeddings", "48"]

MOE = ["--num-experts", "4", "--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.parametrize("world, flags, fragment", [
    (3, ["--tensor-model-parallel-size", "2"], "world size 3 is not TP x PP x DP"),
    (2, ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size",
         "48"], "does not divide the 3 attention heads"),
    (4, ["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups",
         "2"], "does not divide the 2 query groups"),
    (2, ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "257"],
     "does not divide the padded vocabulary 257"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "3,2"],
     "adds up to 5 layers but --num-layers is 4"),
    (2, ["--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "1,1,2"],
     "has 3 counts but --pipeline-model-parallel-size is 2"),
    (4, ["--pipeline-model-parallel-size", "4", "--pipeline-layer-split", "1,0,2,1"],
     "stage 1 has no layer"),
    (2, ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "5"],
     "cannot be split over 2 stages"),
    (2, [*MOE, "--expert-model-parallel-size", "3"], "expert_model_parallel_size 3 x "
     "expert_tensor_parallel_size 1 = 3 does not divide the stage's TP x DP = 2 ranks"),
    (4, [*MOE, "--expert-model-parallel-size", "4", "--num-experts", "6"],
     "expert_model_parallel_size 4 does not divide the 6 experts (--num-experts)"),
    (2, [*MOE, "--expert-model-parallel-size", "2", "--num-experts", "0"],
     "expert_model_parallel_size 2 is set but the model has no experts"),
    (2, [*MOE, "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
         "--seq-length", "33"], "stage 0: an expert tensor parallel size (1) other than TP 2 "
     "needs --seq-length 33 divisible by TP"),
    (2, [*MOE, "--expert-tensor-parallel-size", "2", "--moe-ffn-hidden-size", "63"],
     "stage 0: expert tensor parallel size 2 does not divide --moe-ffn-hidden-size 63"),
])
def test_bad_layout_is_one_line_before_any_process_group(world, flags, fragment, corpus,
                                                         monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert main([*MODEL, "--data-path", corpus, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and fragment in err, err
    assert not dist.is_initialized()
