"""One writer per shard object: the pieces of a box that only partly cover a shard file (issue 27 item 0).

Where a rank's box cuts a shard file (a ZeRO flat fragment ending mid-row, a TP split that is not whole inner
chunks), two ranks would write one object and rely on a read-modify-write merge, which object stores do not make
atomic. So a multi-rank writer splits each box (:func:`split_box`) into the whole shard files it covers, which it
writes itself, and *pieces*: the part of the box inside each shard file it only cuts. The pieces of one shard file
go to a single owner (:func:`assign_owners`: the rank holding most of its bytes), which assembles them
(:func:`assemble`) and writes the file once. Pure index math; the exchange itself (a gather and a scatter of
the pieces' descriptions through the coordinator, one all-to-all of their bytes) is
``ucp_store.distributed.commit.exchange_straddling``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Piece", "assemble", "assign_owners", "describe", "plan_exchange", "received", "shard_box", "split_box"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)


@dataclass
class Piece:
    """The part of one write inside one shard file it does not cover whole: ``data`` at ``offset`` of the
    logical array of (``name``, ``state``), inside shard file ``shard`` (its grid index). ``digest``: the
    writer wanted the units of the content hash digested from memory (``write_shard(digest=True)``)."""

    name: str
    state: str
    shard: tuple[int, ...]
    offset: tuple[int, ...]
    data: np.ndarray
    digest: bool = False

    @property
    def key(self) -> tuple[str, str, tuple[int, ...]]:
        return self.name, self.state, self.shard


def shard_box(shape: Sequence[int], shard_shape: Sequence[int], index: Sequence[int]) -> Box:
    """(offset, shape) of shard file ``index`` of an array of ``shape``, clipped at the array's end."""
    off = tuple(i * s for i, s in zip(index, shard_shape))
    return off, tuple(min(s, n - o) for o, s, n in zip(off, shard_shape, shape))


def split_box(shape: Sequence[int], shard_shape: Sequence[int], offset: Sequence[int],
              extent: Sequence[int]) -> tuple[Box | None, list[tuple[tuple[int, ...], Box]]]:
    """Split the box ``extent`` at ``offset`` of an array of ``shape`` stored in shard files of ``shard_shape``
    into the box of the shard files it covers whole (None when it covers none) and, for each shard file it
    only cuts, ``(shard index, (offset, shape))`` of its part there. The parts and the whole box partition the
    box exactly."""
    if not all(extent):
        return None, []
    inner: list[tuple[int, int]] = []  # per dim, the span [a, b) of shard files the box covers whole
    for o, e, s, n in zip(offset, extent, shard_shape, shape):
        a = -(-o // s) * s
        stop = o + e
        b = stop if stop == n else (stop // s) * s
        inner.append((a, b) if a < b else (o, o))  # (o, o): no whole shard along this dim
    whole = None
    if all(a < b for a, b in inner):
        whole = (tuple(a for a, _ in inner), tuple(b - a for a, b in inner))
    pieces: list[tuple[tuple[int, ...], Box]] = []
    for slab_off, slab_ext in _outside(tuple(offset), tuple(extent), inner if whole is not None else None):
        pieces += _per_shard(shard_shape, slab_off, slab_ext)
    return whole, pieces


def _outside(offset: tuple[int, ...], extent: tuple[int, ...], inner: list[tuple[int, int]] | None):
    """The box minus the inner box, as disjoint slabs (at most two per dimension)."""
    if inner is None:
        yield offset, extent
        return
    lo, hi = list(offset), [o + e for o, e in zip(offset, extent)]
    for d, (a, b) in enumerate(inner):
        if lo[d] < a:
            yield tuple(lo), tuple(h - low if i != d else a - lo[d] for i, (low, h) in enumerate(zip(lo, hi)))
        if b < hi[d]:
            yield (tuple(b if i == d else x for i, x in enumerate(lo)),
                   tuple(h - low if i != d else hi[d] - b for i, (low, h) in enumerate(zip(lo, hi))))
        lo[d], hi[d] = a, b  # later slabs lie inside this dimension's inner span


def _per_shard(shard_shape: Sequence[int], offset: tuple[int, ...], extent: tuple[int, ...]):
    """A slab cut along the shard grid: (shard index, (offset, shape)) of each part."""
    ranges = []
    for o, e, s in zip(offset, extent, shard_shape):
        parts, x = [], o
        while x < o + e:
            end = min((x // s + 1) * s, o + e)
            parts.append((x // s, x, end - x))
            x = end
        ranges.append(parts)
    return [(tuple(c[0] for c in combo), (tuple(c[1] for c in combo), tuple(c[2] for c in combo)))
            for combo in itertools.product(*ranges)]


def assign_owners(per_rank: Sequence[Sequence[tuple[str, str, Sequence[int], int]]]) -> dict[tuple, int]:
    """The owner of each shard file any rank holds pieces of: a rank holding most of its bytes, so the fewest
    bytes move; among ranks holding equally many (ZeRO-3's equal partitions), the one that owns the fewest bytes
    so far, largest files first, so that no rank writes every such file. ``per_rank[r]``: rank r's pieces as
    (name, state, shard index, bytes)."""
    held: dict[tuple, dict[int, int]] = {}
    for rank, pieces in enumerate(per_rank):
        for name, state, shard, nbytes in pieces:
            by = held.setdefault((name, state, tuple(int(i) for i in shard)), {})
            by[rank] = by.get(rank, 0) + int(nbytes)
    load: dict[int, int] = {}
    owners: dict[tuple, int] = {}
    for key, by in sorted(held.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])):
        top = max(by.values())
        owner = min((r for r, b in by.items() if b == top), key=lambda r: (load.get(r, 0), r))
        owners[key] = owner
        load[owner] = load.get(owner, 0) + sum(by.values())
    return owners


def assemble(shape: Sequence[int], shard_shape: Sequence[int],
             pieces: Sequence[Piece]) -> tuple[Box, np.ndarray] | None:
    """The whole shard file of ``pieces`` (all of one shard of one array) as one box and its data, when they
    cover it exactly; None when they leave part of it uncovered (then each piece is written on its own, still by
    this one writer)."""
    first = pieces[0]
    off, ext = shard_box(shape, shard_shape, first.shard)
    if sum(p.data.size for p in pieces) != math.prod(ext):
        return None
    out = np.empty(ext, dtype=first.data.dtype)
    seen = np.zeros(ext, dtype=bool)
    for p in pieces:
        sl = tuple(slice(po - o, po - o + n) for po, o, n in zip(p.offset, off, p.data.shape))
        if seen[sl].any():
            return None  # overlapping pieces (replicas written twice): not a partition
        out[sl] = p.data
        seen[sl] = True
    return (off, ext), out


def describe(p: Piece) -> list:
    """A piece's JSON description for the exchange's plan: name, state, shard, offset, shape, digest, bytes."""
    return [p.name, p.state, list(p.shard), list(p.offset), list(p.data.shape), p.digest, int(p.data.nbytes)]


def plan_exchange(per_rank: Sequence[Sequence[list]]) -> list[dict]:
    """The coordinator's answer to each rank, from every rank's :func:`describe` d pieces: ``send``, the owner of
    each of its pieces (in its order), and ``recv``, for each rank sending to it, the descriptions of what
    arrives, in the sender's order (so the payload is raw bytes, no header). Each rank gets its own share only."""
    owners = assign_owners([[(d[0], d[1], d[2], d[6]) for d in pieces] for pieces in per_rank])
    answers: list[dict] = [{"send": [], "recv": {}} for _ in per_rank]
    for src, pieces in enumerate(per_rank):
        for d in pieces:
            dst = owners[(d[0], d[1], tuple(int(i) for i in d[2]))]
            answers[src]["send"].append(dst)
            if dst != src:
                answers[dst]["recv"].setdefault(str(src), []).append(d)
    moves = any(a["recv"] for a in answers)
    for a in answers:
        a["moves"] = moves  # the same on every rank: all of them skip the all-to-all alike when nothing moves
    return answers


def received(descriptions: Sequence[list], payload: memoryview, dtype_of) -> list[Piece]:
    """The pieces of one sender's payload (raw C-order bytes, in the order ``descriptions`` lists them);
    ``dtype_of(name, state)``: the numpy dtype of that array on this rank."""
    out, pos = [], 0
    for name, state, shard, offset, shape, digest, nbytes in descriptions:
        data = np.frombuffer(payload[pos:pos + nbytes], dtype=dtype_of(name, state)).reshape(shape).copy()
        out.append(Piece(name, state, tuple(shard), tuple(offset), data, bool(digest)))
        pos += nbytes
    if pos != len(payload):
        raise ValueError(f"exchanged pieces: {len(payload)} bytes arrived, their descriptions add up to {pos}")
    return out
