"""What carries the bridge's chunks between two ranks: the Transport interface.

The :class:`~megatron_h2.distributed.bridge.Bridge` owns everything that does not depend on the
transfer library: casting to the wire dtype (bf16 on the wire), staging device tensors through
host buffers, cutting them into ``chunk_mb`` chunks and overlapping the chunks' copies with
their wire time, asynchronous sends. A :class:`Transport` moves one contiguous buffer to, or
into, one peer rank, asynchronously; transfers between two ranks arrive in the order they were
posted. Implementations:

* :class:`GlooTransport` (``gloo``, the default): ``torch.distributed`` isend / irecv on a gloo
  process group (TCP);
* :class:`~megatron_h2.distributed.nixl_transport.NixlTransport` (``nixl``): NVIDIA's NIXL
  transfer library (one-sided writes through UCX: TCP, shared memory, RDMA where present),
  optional (``pip install 'megatron_h2[nixl]'``).

A plan selects one per pair of chip types (``transports:`` in :mod:`megatron_h2.plan.schema`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_h2.errors import ConfigError

TRANSPORT_PACKAGES = {"gloo": None, "nixl": "nixl"}


class Work(Protocol):
    """A posted transfer (``torch.distributed.Work`` is one)."""

    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


class Transport(Protocol):
    """Asynchronous point-to-point transfers of contiguous buffers between ranks.

    ``isend`` / ``irecv`` return at once; the buffer must stay alive and untouched until the
    returned work completes. Transfers between two ranks are matched in posting order.
    """

    name: str

    def isend(self, buf: torch.Tensor, peer: int) -> Work: ...

    def irecv(self, buf: torch.Tensor, peer: int) -> Work: ...

    def close(self) -> None: ...


class GlooTransport:
    """``torch.distributed`` isend / irecv on ``group`` (None: the default group)."""

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def isend(self, buf: torch.Tensor, peer: int) -> Work:
        return dist.isend(buf, peer, group=self.group)

    def irecv(self, buf: torch.Tensor, peer: int) -> Work:
        return dist.irecv(buf, peer, group=self.group)

    def close(self) -> None:
        """Nothing to release: the process group outlives the bridge."""


def check_transport(name: str) -> None:
    """Raise a one-line ConfigError if ``name`` is unknown or its library is not installed
    (call before any process group starts)."""
    if name not in TRANSPORT_PACKAGES:
        raise ConfigError(f"unknown transport {name!r}; known: {', '.join(TRANSPORT_PACKAGES)}")
    package = TRANSPORT_PACKAGES[name]
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(f"the plan's transport {name!r} needs the {package!r} package, which "
                          f"is not installed; pip install 'megatron_h2[{name}]' or use gloo")


def make_transport(name: str, group: dist.ProcessGroup | None, rank: int,
                   peers: Sequence[int], slot_bytes: int, tag: str,
                   timeout_s: float) -> Transport:
    """The transport ``name`` between this rank and ``peers``. Collective with the peers for
    libraries that exchange connection metadata (over the gloo ``group``); every rank of a
    boundary must build its transports in the same order. ``slot_bytes`` is the largest piece
    one transfer is cut into (the bridge's chunk size), ``tag`` names the boundary."""
    check_transport(name)
    if name == "gloo":
        return GlooTransport(group)
    from megatron_h2.distributed.nixl_transport import NixlTransport

    return NixlTransport(group, rank, peers, slot_bytes, tag=tag, timeout_s=timeout_s)
