"""Transports under the bridge: the plan's per-chip-pair selection of gloo (default) or NIXL
(optional), one-line errors, and what start-up says of each bridged boundary. (Runs over NIXL
across processes: tests/e2e/test_transport.py.)"""

from __future__ import annotations

import pytest

from megatron_h2.distributed import transport as transport_module
from megatron_h2.distributed.transport import GlooTransport, check_transport, make_transport
from megatron_h2.errors import ConfigError
from megatron_h2.plan.schema import HeteroPlan


def _plan(transports: list | None) -> dict:
    plan = {"data_parallel_size": 1, "micro_batch_size": 1, "global_batch_size": 2,
            "chips": {"a": {"device": "cpu"}, "b": {"device": "cpu"}},
            "stages": [{"chip": "a", "tensor_parallel_size": 1, "num_layers": 1},
                       {"chip": "b", "tensor_parallel_size": 1, "num_layers": 1}]}
    if transports is not None:
        plan["transports"] = transports
    return plan


def test_plan_selects_a_transport_per_chip_pair(tmp_path):
    plan = HeteroPlan.from_dict(_plan([{"chips": ["b", "a"], "transport": "nixl"}]))
    assert plan.transport_between("a", "b") == plan.transport_between("b", "a") == "nixl"
    assert plan.transport_between("a", "a") == "gloo"
    assert HeteroPlan.from_dict(_plan(None)).transport_between("a", "b") == "gloo"
    plan.to_yaml(tmp_path / "plan.yaml")
    assert HeteroPlan.from_yaml(tmp_path / "plan.yaml") == plan


@pytest.mark.parametrize("links, fragment", [
    ([{"chips": ["a", "c"], "transport": "nixl"}], "unknown chip 'c'"),
    ([{"chips": ["a", "b"], "transport": "nixel"}], "did you mean 'nixl'"),
    ([{"chips": ["a", "b"], "transport": "mooncake"}], "mooncake was evaluated but is not"),
    ([{"chips": ["a"], "transport": "nixl"}], "needs chips: [chip_a, chip_b]"),
    ([{"chips": ["a", "b"]}], "missing key 'transport'"),
    ([{"chips": ["a", "b"], "transport": "gloo"}, {"chips": ["b", "a"], "transport": "nixl"}],
     "twice"),
    ({"a": "b"}, "must be a list"),
])
def test_bad_transports_are_one_line_errors(links, fragment):
    with pytest.raises(ConfigError) as info:
        HeteroPlan.from_dict(_plan(links))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_missing_library_is_reported_before_anything_starts(monkeypatch):
    check_transport("gloo")
    with pytest.raises(ConfigError, match="unknown transport 'rdma'"):
        check_transport("rdma")
    monkeypatch.setitem(transport_module.TRANSPORT_PACKAGES, "nixl", "no_such_nixl_package")
    with pytest.raises(ConfigError, match=r"needs the 'no_such_nixl_package' package.*"
                                          r"pip install 'megatron_h2\[nixl\]'"):
        check_transport("nixl")
    assert isinstance(make_transport("gloo", None, 0, [1], 64, "b0", 1.0), GlooTransport)


def test_start_up_names_each_bridged_boundary_and_unused_entries():
    from megatron_h2.config import ParallelConfig
    from megatron_h2.training.main import say_bridges

    plan = HeteroPlan.from_dict(_plan([{"chips": ["b", "a"], "transport": "nixl"}]))
    lines: list[str] = []
    say_bridges(plan, ParallelConfig(), lines.append)  # both chips are cpu: no bridge
    assert len(lines) == 1 and lines[0].startswith("note: transports entry b/a (nixl) has no "
                                                   "effect")
    lines.clear()
    say_bridges(plan, ParallelConfig(force_bridge=True, bridge_dtype="bf16"), lines.append)
    assert lines == ["boundary 0-1: bridge over nixl (chunks of 4 MiB, bf16 on the wire)"]
