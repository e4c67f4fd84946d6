"""Shared fixtures: a tiny learnable corpus in Megatron's format, made by the real tool."""

import pytest
from dist_utils import write_counting_corpus

VOCAB = 256  # NullTokenizer ids 0..255 (eod = 256)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Counting sequences (each token is the previous plus one), so a tiny model learns fast."""
    return write_counting_corpus(tmp_path_factory.mktemp("corpus"), 300, (40, 120), VOCAB)
