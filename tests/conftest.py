"""Shared fixtures: a tiny learnable corpus in Megatron's format, made by the real tool."""

import pytest

from tests.helpers.dist_utils import write_counting_corpus
from tests.helpers.tiny_runs import VOCAB


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Counting sequences (each token is the previous plus one), so a tiny model learns fast."""
    return write_counting_corpus(tmp_path_factory.mktemp("corpus"), 300, (40, 120), VOCAB)


@pytest.fixture(scope="session")
def tiny_reference(corpus, tmp_path_factory) -> dict[int, float]:
    """``{iteration: loss}`` of one process training ``dist_utils.tiny_model_flags()`` with
    micro-batch 2 and global batch 8: what multi-process runs of that model must reproduce."""
    from megatron_h2.training.main import main
    from tests.helpers.dist_utils import losses, tiny_model_flags

    log = tmp_path_factory.mktemp("tiny_reference") / "log.jsonl"
    assert main([*tiny_model_flags(), "--data-path", corpus, "--micro-batch-size", "2",
                 "--global-batch-size", "8", "--log-jsonl", str(log)]) == 0
    return losses(log)
