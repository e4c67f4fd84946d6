"""Numeric start-up flags are range-checked in one line before anything runs (``--lr 1e39``
was a traceback from inside Adam: "value cannot be converted to type float without
overflow")."""

from __future__ import annotations

import pytest

from tests.helpers.tiny_runs import run_error


@pytest.mark.parametrize("flag, value, message", [
    ("--lr", "1e39", "error: argument --lr: expected a finite number of at most 3.4e+38 in "
                     "magnitude (float32), got '1e39'"),
    ("--lr", "nan", "error: argument --lr: expected a finite number"),
    ("--lr", "1e11", "error: --lr must be in [0, 1e+10], got 1e+11"),
    ("--clip-grad", "inf", "error: argument --clip-grad: expected a finite number"),
    ("--adam-beta1", "1.5", "error: --adam-beta1 must be in [0, 1), got 1.5"),
    ("--adam-beta2", "-0.1", "error: --adam-beta2 must be in [0, 1), got -0.1"),
    ("--adam-eps", "0", "error: --adam-eps must be in (0, 1], got 0"),
    ("--weight-decay", "1e20", "error: --weight-decay must be in [0, 1e+10], got 1e+20"),
    ("--train-iters", "1" + "0" * 30, "error: argument --train-iters: expected an integer of "
                                      "at most 2**53 in magnitude, got a 31-digit number"),
    ("--log-interval", "0", "error: --log-interval must be a positive number, got 0"),
    ("--save-interval", "-2", "error: --save-interval must be a positive number"),
])
def test_numeric_flags_out_of_range_are_one_line(corpus, tmp_path, capsys, flag, value,
                                                 message):
    """Issue reproduction 5 (``--lr 1e39``) and its neighbours."""
    extra = ["--train-iters", "2"] if flag != "--train-iters" else []
    err = run_error(corpus, tmp_path, capsys, *extra, flag, value)
    assert err.startswith(message), err
