"""Which elements of a model tensor a rank holds, and what two layouts of it have in common.

Pure functions, no communication: :mod:`megatron_h2.distributed.pipeline_sum` turns them into
messages between data-parallel pipelines that shard the same parameter differently (another TP
degree, other stage boundaries, ZeRO-1 shards of other bucket layouts).

A rank holds, of one parameter, a contiguous range ``[start, stop)`` of its TP shard flattened
(a whole shard, or the part inside its DP shard of a gradient bucket): a :class:`Holding`. In
the full (unsharded) tensor, seen as a matrix (a vector is one row), that range covers a few
rectangles, :class:`Box` es (:func:`boxes`): a partial first row, whole rows, a partial last
row, each cut where the TP shard's pieces end (a shard of a tensor made of ``blocks`` blocks,
the fused QKV or gate/up weights, is one piece of every block). Two holdings of the same
parameter share the intersections of their boxes (:func:`transfers`), listed in one order that
both ends compute alike, each element once.
"""

from __future__ import annotations

from dataclasses import dataclass

Rect = tuple[int, int, int, int]
"""``(row0, row1, col0, col1)``: rows ``[row0, row1)`` x columns ``[col0, col1)``."""


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter of a rank lies in the model's full tensor.

    ``name`` is the parameter's name in checkpoints (the same in every layout); ``shard_dim``
    the full tensor's dimension that tensor parallelism splits (None: every TP rank holds all of
    it), into ``blocks`` blocks each split over the TP ranks. ``primary`` is False for a copy of
    elements another rank of the same pipeline also holds (a TP-replicated parameter on a TP
    rank other than 0, the last stage's copy of a tied embedding).
    """

    name: str
    full_shape: tuple[int, ...]
    shard_dim: int | None
    blocks: int = 1
    primary: bool = True

    def __post_init__(self) -> None:
        if not 1 <= len(self.full_shape) <= 2:
            raise ValueError(f"{self.name}: only vectors and matrices are exchanged, got shape "
                             f"{self.full_shape}")
        if self.shard_dim is not None:
            object.__setattr__(self, "shard_dim", self.shard_dim % len(self.full_shape))


@dataclass(frozen=True)
class Holding:
    """Elements ``[start, stop)`` of TP rank ``tp_rank``'s (of ``tp_size``) shard of a
    parameter, flattened, that a rank holds; ``unit`` orders the holdings' sends."""

    layout: ParamLayout
    tp_rank: int
    tp_size: int
    start: int
    stop: int
    unit: int = 0

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def local_shape(self) -> tuple[int, int]:
        """The TP shard as a matrix: ``(rows, cols)``."""
        rows, cols = matrix_shape(self.layout.full_shape)
        axis = shard_axis(self.layout)
        if axis == 0:
            rows //= self.tp_size
        elif axis == 1:
            cols //= self.tp_size
        return rows, cols


@dataclass(frozen=True)
class Box:
    """Full-tensor rows ``[row0, row1)`` x columns ``[col0, col1)``, which are the holder's
    shard rows / columns from ``(local_row, local_col)`` on."""

    row0: int
    row1: int
    col0: int
    col1: int
    local_row: int
    local_col: int


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A vector of ``n`` is a ``1 x n`` matrix."""
    return (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])


def shard_axis(layout: ParamLayout) -> int | None:
    """The matrix axis TP splits (a sharded vector splits its columns)."""
    if layout.shard_dim is None:
        return None
    return 1 if len(layout.full_shape) == 1 else layout.shard_dim


def flat_rects(start: int, stop: int, cols: int) -> list[Rect]:
    """Rectangles of a row-major ``? x cols`` matrix covering flat elements ``[start, stop)``."""
    out: list[Rect] = []
    row, col = divmod(start, cols)
    if col and start < stop:  # partial first row
        end = min(stop, (row + 1) * cols)
        out.append((row, row + 1, col, col + end - start))
        start, row = end, row + 1
    whole = stop // cols
    if start < stop and row < whole:
        out.append((row, whole, 0, cols))
        start, row = whole * cols, whole
    if start < stop:
        out.append((row, row + 1, 0, stop - start))
    return out


def _pieces(lo: int, hi: int, piece: int, tp_rank: int, tp_size: int
            ) -> list[tuple[int, int, int]]:
    """``(local_lo, local_hi, full_lo)``: local indices ``[lo, hi)`` along the sharded axis cut
    where a block's piece ends, with the full index of each part's first element."""
    out = []
    while lo < hi:
        block, within = divmod(lo, piece)
        end = min(hi, (block + 1) * piece)
        out.append((lo, end, block * piece * tp_size + tp_rank * piece + within))
        lo = end
    return out


def boxes(holding: Holding) -> list[Box]:
    """The full-tensor rectangles that ``holding`` covers, in its flat order."""
    rows, cols = holding.local_shape
    axis = shard_axis(holding.layout)
    out: list[Box] = []
    for r0, r1, c0, c1 in flat_rects(holding.start, holding.stop, cols):
        if axis is None:
            out.append(Box(r0, r1, c0, c1, r0, c0))
            continue
        length = rows if axis == 0 else cols
        piece = length // holding.layout.blocks
        lo, hi = (r0, r1) if axis == 0 else (c0, c1)
        for a, b, full in _pieces(lo, hi, piece, holding.tp_rank, holding.tp_size):
            if axis == 0:
                out.append(Box(full, full + b - a, c0, c1, a, c0))
            else:
                out.append(Box(r0, r1, full, full + b - a, r0, a))
    return out


@dataclass(frozen=True)
class Transfer:
    """One rectangle both holdings cover: ``rows x cols`` elements, at ``(send_row, send_col)``
    of the sender's shard and ``(recv_row, recv_col)`` of the receiver's."""

    send_index: int  # the sender's holding (index into its list)
    recv_index: int  # the receiver's holding
    rows: int
    cols: int
    send_row: int
    send_col: int
    recv_row: int
    recv_col: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def _overlap(a: Box, b: Box) -> Rect | None:
    r0, r1 = max(a.row0, b.row0), min(a.row1, b.row1)
    c0, c1 = max(a.col0, b.col0), min(a.col1, b.col1)
    return (r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None


def transfers(sent: list[Holding], received: list[Holding]) -> list[Transfer]:
    """What the sender's primary holdings ``sent`` have in common with the receiver's holdings
    ``received``: one :class:`Transfer` per shared rectangle, in the order both ends compute
    (sender's holdings, receiver's holdings, their boxes)."""
    by_name: dict[str, list[tuple[int, Holding, list[Box]]]] = {}
    for index, held in enumerate(received):
        by_name.setdefault(held.layout.name, []).append((index, held, boxes(held)))
    out = []
    for s_index, held in enumerate(sent):
        if not held.layout.primary or held.layout.name not in by_name:
            continue
        mine = boxes(held)
        for r_index, other, theirs in by_name.get(held.layout.name, []):
            if other.layout.full_shape != held.layout.full_shape:
                raise ValueError(f"{held.layout.name} has shape {held.layout.full_shape} in one "
                                 f"pipeline and {other.layout.full_shape} in another")
            for a in mine:
                for b in theirs:
                    rect = _overlap(a, b)
                    if rect is not None:
                        r0, r1, c0, c1 = rect
                        out.append(Transfer(s_index, r_index, r1 - r0, c1 - c0,
                                            a.local_row + r0 - a.row0, a.local_col + c0 - a.col0,
                                            b.local_row + r0 - b.row0, b.local_col + c0 - b.col0))
    return out
