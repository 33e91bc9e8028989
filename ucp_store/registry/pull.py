"""Pull: a holder of version M moves to version N in place, reading only the chunks that changed in its boxes.

A puller (an inference engine's process, or each of its TP ranks) holds tensor-states of M in its own layout:
per tensor-state one box of the logical tensor in a tensor of the box's shape (any device). :func:`pull`
plans per tensor-state a route (``plan/pull.route``: ``same``, ``delta`` or ``full``) from the catalog's
``arrays.encoding`` / ``base_array_id`` chains, then reads, for each delta array on the route, only the
stored chunks that intersect the box (``io/chunkread``) and XORs them into the held tensor; a ``full`` route
(a keyframe between M and N) reads N's values of the box: its chain's full array, then the deltas above it.
Where a chain of deltas would read more than N's own chain, the full route is taken instead.

The plan (:func:`plan_pull`) is catalog work only and JSON-able, so one rank of a job plans and the others
execute it from the broadcast plan without a catalog client (``distributed/pull.py``). :func:`chunk_diff`
says which chunks changed between two versions per tensor-state (``ucp diff --chunks``).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from ucp_store._lazy import lazy_module
from ucp_store.catalog import models as m
from ucp_store.errors import ChecksumError, ValidationError
from ucp_store.geometry import Box
from ucp_store.io.pools import LazyPool
from ucp_store.plan.pull import ChunkCut, Route, box_in, chunk_cuts, route

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

    from ucp_store import dtypes
    from ucp_store.io import chunkread, delta
    from ucp_store.io import format as fmt
else:
    np = lazy_module("numpy")
    torch = lazy_module("torch")
    dtypes = lazy_module("ucp_store.dtypes")
    chunkread = lazy_module("ucp_store.io.chunkread")
    delta = lazy_module("ucp_store.io.delta")
    fmt = lazy_module("ucp_store.io.format")

__all__ = ["ChainArray", "TensorRoute", "PullTarget", "TensorPull", "PullResult", "plan_pull", "apply_pull",
           "chunk_diff"]

Key = tuple[str, str]


@dataclass(frozen=True)
class ChainArray:
    """One array as a pull reads it: where it is, its geometry and codecs, and its encoding."""

    id: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    shard_shape: tuple[int, ...]
    codecs: Any
    encoding: str = "plain"
    base: str | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "path": self.path, "shape": list(self.shape), "dtype": self.dtype,
                "shard_shape": list(self.shard_shape), "codecs": self.codecs, "encoding": self.encoding,
                "base": self.base}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ChainArray":
        return cls(d["id"], d["path"], tuple(d["shape"]), d["dtype"], tuple(d["shard_shape"]), d["codecs"],
                   d.get("encoding", "plain"), d.get("base"))


@dataclass(frozen=True)
class TensorRoute:
    """The plan of one tensor-state: ``route.kind``; ``deltas`` to XOR into the held values (kind ``delta``);
    ``full``: N's chain, its full array first, then the deltas above it (read for kind ``full``, and the
    alternative a ``delta`` route of several deltas is weighed against); N's content hash."""

    name: str
    state: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    reason: str
    deltas: tuple[ChainArray, ...]
    full: tuple[ChainArray, ...]
    content_hash: str

    def to_json(self) -> dict:
        return {"name": self.name, "state": self.state, "shape": list(self.shape), "dtype": self.dtype,
                "kind": self.kind, "reason": self.reason, "deltas": [a.to_json() for a in self.deltas],
                "full": [a.to_json() for a in self.full], "content_hash": self.content_hash}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TensorRoute":
        return cls(d["name"], d["state"], tuple(d["shape"]), d["dtype"], d["kind"], d["reason"],
                   tuple(ChainArray.from_json(a) for a in d["deltas"]),
                   tuple(ChainArray.from_json(a) for a in d["full"]), d["content_hash"])


@dataclass
class PullTarget:
    """What a puller holds of one tensor-state: ``box`` of the logical tensor (None: all of it) in ``tensor``
    (the box's shape and the stored dtype; any device), filled in place; ``label`` names it in results (an
    HF name, a state dict key)."""

    name: str
    state: str
    tensor: Any
    box: Box | None = None
    label: str = ""


@dataclass
class TensorPull:
    """What one target's pull did: the route taken, the chunks its box intersects in N's array, the stored
    chunks read (``changed``: indices of delta chunks XORed in), bytes read (indexes included) and the
    stored bytes of the delta chunks within the box (``delta_bytes``)."""

    label: str
    name: str
    state: str
    kind: str
    reason: str = ""
    chunks: int = 0
    changed: list[tuple[int, ...]] = field(default_factory=list)
    bytes_read: int = 0
    delta_bytes: int = 0
    verified: bool | None = None

    def to_json(self) -> dict:
        return {"label": self.label, "name": self.name, "state": self.state, "kind": self.kind, "reason": self.reason,
                "chunks": self.chunks, "changed_chunks": len(self.changed), "bytes_read": self.bytes_read,
                "delta_bytes": self.delta_bytes, "verified": self.verified}


@dataclass
class PullResult:
    """A pull's outcome: one :class:`TensorPull` per target, totals and the time it took."""

    have: str
    want: str
    tensors: list[TensorPull]
    seconds: float = 0.0
    #: where the time went: wall seconds of ``plan`` (catalog; set by the caller that planned), ``prepare``
    #: (readers, chunk cuts, shard indexes), ``execute`` and ``verify``; seconds summed over the pool's
    #: threads of ``index``, ``read``, ``crc``, ``decode`` (the readers') and ``apply`` (XOR or copy into
    #: the held tensors, with the check that a cut part of a delta chunk holds a change)
    phases: dict[str, float] = field(default_factory=dict)
    #: reads issued (shard indexes and runs of adjacent chunks): what a bucket's per-request cost multiplies
    requests: int = 0

    @property
    def bytes_read(self) -> int:
        return sum(t.bytes_read for t in self.tensors)

    @property
    def delta_bytes(self) -> int:
        return sum(t.delta_bytes for t in self.tensors)

    @property
    def changed(self) -> list[str]:
        """Labels of the targets whose values changed (read anything but an index)."""
        return [t.label for t in self.tensors if t.changed or t.kind == "full"]

    def to_json(self) -> dict:
        return {"have": self.have, "want": self.want, "seconds": self.seconds, "bytes_read": self.bytes_read,
                "delta_bytes": self.delta_bytes, "phases": dict(self.phases), "requests": self.requests,
                "tensors": [t.to_json() for t in self.tensors]}


# --- the plan (catalog) ------------------------------------------------------------------------------

def _array_rows(session, ids: Iterable[str]) -> dict[str, ChainArray]:
    """Every array on the chains of ``ids`` (their bases, recursively), by id, a batched query per level."""
    a = m.Array
    out: dict[str, ChainArray] = {}
    todo = set(ids)
    while todo:
        rows = session.execute(select(a.id, a.path, a.shape, a.dtype, a.shard_shape, a.codecs, a.encoding,
                                      a.base_array_id).where(a.id.in_(sorted(todo)))).all()
        todo = set()
        for aid, path, shape, dtype, shard, codecs, enc, base in rows:
            out[aid] = ChainArray(aid, path, tuple(shape), dtype, tuple(shard), codecs, enc or "plain", base)
            if base is not None and base not in out:
                todo.add(base)
    return out


def _full_chain(want: str, arrays: Mapping[str, ChainArray]) -> tuple[ChainArray, ...]:
    chain, at = [], arrays[want]
    while at.encoding == "xor" and at.base is not None:
        chain.append(at)
        at = arrays[at.base]
    chain.append(at)
    return tuple(reversed(chain))


def plan_pull(store, have: str | None, want: str, keys: Iterable[Key] | None = None) -> dict[Key, TensorRoute]:
    """Routes from version ``have`` (a reference; None: nothing held) to ``want`` for ``keys`` (``(name,
    state)``; default every tensor-state of ``want``). Catalog reads only."""
    ck_want = store.resolve(want)
    ck_have = store.resolve(have) if have is not None else None
    t = m.Tensor
    with store.catalog.session() as s:
        rows_w = {(n, st): (aid, shape, dtype, h) for n, st, aid, shape, dtype, h in s.execute(
            select(t.name, t.state, t.array_id, t.shape, t.dtype, t.content_hash).where(t.checkpoint_id == ck_want))}
        rows_h = {} if ck_have is None else {(n, st): aid for n, st, aid in s.execute(
            select(t.name, t.state, t.array_id).where(t.checkpoint_id == ck_have))}
        wanted = list(rows_w) if keys is None else list(keys)
        for k in wanted:
            if k not in rows_w:
                raise ValidationError(f"pull: version {want!r} has no tensor-state {k[0]!r} [{k[1]}]")
        arrays = _array_rows(s, {rows_w[k][0] for k in wanted} | {rows_h[k] for k in wanted if k in rows_h})
    links = {aid: (a.encoding, a.base) for aid, a in arrays.items()}
    out: dict[Key, TensorRoute] = {}
    for k in wanted:
        aid, shape, dtype, h = rows_w[k]
        r: Route = route(rows_h.get(k), aid, links)
        out[k] = TensorRoute(k[0], k[1], tuple(shape), dtype, r.kind, r.reason,
                             tuple(arrays[d] for d in r.deltas), _full_chain(aid, arrays) if r.kind != "same" else (),
                             h)
    return out


# --- execution ---------------------------------------------------------------------------------------

class _Dest:
    """A target's tensor as the reads write it: a numpy view on CPU, else a device tensor fed per chunk."""

    def __init__(self, tensor, dtype: str, box: Box, what: str):
        if tuple(tensor.shape) != box.shape:
            raise ValidationError(f"pull: {what}: tensor shape {list(tensor.shape)} is not the box's {list(box.shape)}")
        if dtypes.zarr_name(tensor.dtype, what=what) != dtype:
            raise ValidationError(f"pull: {what}: tensor dtype {tensor.dtype} is not the stored {dtype} (a pull "
                                  "applies bitwise deltas; hold the stored dtype)")
        self.tensor = tensor
        self.cpu = tensor.device.type == "cpu"
        self.np = dtypes.numpy_view(tensor) if self.cpu else None

    def put(self, dst: Box, values: np.ndarray) -> None:
        if self.np is not None:
            self.np[dst.slices()] = values
        else:
            self.tensor[dst.slices()].copy_(dtypes.to_torch(np.ascontiguousarray(values)), non_blocking=False)

    def xor(self, dst: Box, values: np.ndarray) -> None:
        if self.np is not None:
            delta.xor_into(self.np[dst.slices()], values)
        else:
            delta.xor_tensor_(self.tensor[dst.slices()], values)


def _readers(arrays: Iterable[ChainArray], location, cache: dict[str, Any]) -> None:
    for a in arrays:
        if a.id not in cache:
            cache[a.id] = chunkread.ChunkReader(location, a.path, shape=a.shape, dtype=a.dtype,
                                                shard_shape=a.shard_shape, codecs=a.codecs, what=f"array {a.path}")


class _CutCache:
    """Chunk cuts by geometry and box, the least recently used dropped past ``limit`` cuts in all: a puller
    moves its same boxes of same-shaped arrays every version, and cutting a box of thousands of chunks costs
    more than the plan (tests/test_pull.py checks a hit equals a fresh cut)."""

    def __init__(self, limit: int = 1 << 20):
        self.limit = limit
        self.size = 0
        self._entries: OrderedDict[tuple, tuple[ChunkCut, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, shape, chunk_shape, shard_shape, box: Box) -> tuple[ChunkCut, ...]:
        key = (shape, chunk_shape, shard_shape, box)
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        cuts = tuple(chunk_cuts(shape, chunk_shape, shard_shape, box))
        if len(cuts) <= self.limit:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = cuts
                    self.size += len(cuts)
                while self.size > self.limit:
                    _k, old = self._entries.popitem(last=False)
                    self.size -= len(old)
        return cuts


_cut_cache = _CutCache()


def _cuts(reader, box: Box) -> Sequence[ChunkCut]:
    return _cut_cache.get(reader.shape, reader.chunk_shape, reader.shard_shape, box)


def _stored_in(reader, cuts: Sequence[ChunkCut]) -> int:
    """The stored bytes of the chunks ``cuts`` name (each shard's index read once, looked up at once)."""
    slots: dict[tuple[int, ...], list[int]] = {}
    for c in cuts:
        slots.setdefault(c.shard, []).append(c.slot)
    total = 0
    for shard, got in slots.items():
        entries = reader.index(shard)[np.asarray(got, dtype=np.intp)]
        total += int(entries[entries[:, 0] != delta.MISSING, 1].sum())
    return total


#: decoded bytes one pool task applies (chunks of one shard file, adjacent ones read at once)
_BATCH_BYTES = 8 << 20


class _Clock:
    """Seconds per phase summed over the pool's threads."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


def _run_batch(reader, shard: tuple[int, ...], cuts: Sequence[ChunkCut], dest: _Dest, mode: str, clock: _Clock
               ) -> list[tuple[int, bool]]:
    """Cuts of one shard file: their chunks read (adjacent ones in one read), each decoded and at once copied
    (``copy``: a full array stores every chunk) or XORed (``xor``) into ``dest`` while it is in the CPU's
    cache; per cut ``(bytes read, whether the box changed)``. ``clock`` gets the CPU time of applying."""
    out = []
    spent = 0.0
    for c, (chunk, nbytes) in zip(cuts, reader.iter_chunks(shard, [(c.slot, c.index) for c in cuts])):
        t0 = time.thread_time()
        out.append(_apply_chunk(reader, c, chunk, nbytes, dest, mode))
        spent += time.thread_time() - t0
    clock.add("apply", spent)
    return out


def _apply_chunk(reader, c: ChunkCut, chunk, nbytes: int, dest: _Dest, mode: str) -> tuple[int, bool]:
    if chunk is None:
        if mode == "copy":
            raise ChecksumError(f"{reader.what}: chunk {list(c.index)} is missing (a full array stores every chunk)")
        return 0, False
    part = chunk[c.src.slices()]
    if mode == "copy":
        dest.put(c.dst, part)
    # a stored delta chunk holds a non-zero bit (zero chunks are never written), but maybe outside this box
    elif part.shape != chunk.shape and not delta.bits(part).any():
        return nbytes, False
    else:
        dest.xor(c.dst, part)
    return nbytes, True


def _batches(reader, cuts: Sequence[ChunkCut]) -> list[tuple[tuple[int, ...], list[ChunkCut]]]:
    """``cuts`` grouped per shard file, in slot order, at most ``_BATCH_BYTES`` decoded per group."""
    per = max(1, _BATCH_BYTES // max(1, reader.chunk_nbytes))
    by_shard: dict[tuple[int, ...], list[ChunkCut]] = {}
    for c in cuts:
        by_shard.setdefault(c.shard, []).append(c)
    out = []
    for shard, group in by_shard.items():
        group.sort(key=lambda c: c.slot)
        out += [(shard, group[i:i + per]) for i in range(0, len(group), per)]
    return out


@dataclass
class _Job:
    """One target being pulled: its result, destination and the arrays to apply in order (reader, cuts, mode)."""

    result: TensorPull
    dest: Any = None
    steps: list = field(default_factory=list)


class _Shared:
    """What the targets of one pull share: readers by array id, cuts by ``(array id, box)`` and the shard
    indexes already counted (a shard's index is read once, counted for the first target that needs it)."""

    def __init__(self, location) -> None:
        self.location = location
        self.readers: dict[str, Any] = {}
        self.cuts: dict[tuple[str, Box], Sequence[ChunkCut]] = {}
        self.counted: set[tuple[str, tuple[int, ...]]] = set()

    def cuts_of(self, a: ChainArray, box: Box) -> Sequence[ChunkCut]:
        _readers([a], self.location, self.readers)
        got = self.cuts.get((a.id, box))
        if got is None:
            got = self.cuts[(a.id, box)] = _cuts(self.readers[a.id], box)
        return got

    def count_indexes(self, a: ChainArray, cuts: Sequence[ChunkCut]) -> int:
        new = {(a.id, c.shard) for c in cuts} - self.counted
        self.counted |= new
        return len(new) * self.readers[a.id].index_nbytes


def _target_box(tr: TensorRoute, target: PullTarget) -> tuple[str, Box]:
    label = target.label or f"{tr.name} [{tr.state}]"
    return label, box_in(target.box if target.box is not None else Box.full(tr.shape), tr.shape, label)


def _prefetch_indexes(pairs: Sequence[tuple[TensorRoute, PullTarget]], shared: _Shared) -> None:
    """The shard indexes every target surely reads (its deltas, or N's chain for a ``full`` route), fetched
    at once on the pool from a bucket: one round trip per index in parallel instead of one after another. A
    folder store reads each index where it is needed (a ``pread`` costs less than handing it to a thread)."""
    if shared.location.kind == "file":
        return
    wanted: dict[tuple[str, tuple[int, ...]], Any] = {}
    for tr, tg in pairs:
        if tr.kind == "same":
            continue
        _label, box = _target_box(tr, tg)
        for a in tr.deltas if tr.kind == "delta" else tr.full:
            for c in shared.cuts_of(a, box):
                wanted.setdefault((a.id, c.shard), shared.readers[a.id])
    if len(wanted) > 1:
        for fut in [_pool.get().submit(reader.index, shard) for (_aid, shard), reader in wanted.items()]:
            fut.result()


def _prepare(tr: TensorRoute, target: PullTarget, shared: _Shared) -> _Job:
    """The arrays a target reads, in order, with the route weighed: several deltas that store more bytes of
    the box than N's own chain give way to that chain. Reads the shard indexes involved (counted)."""
    label, box = _target_box(tr, target)
    job = _Job(TensorPull(label, tr.name, tr.state, tr.kind, tr.reason))
    out = job.result
    if tr.kind == "same":
        return job
    job.dest = _Dest(target.tensor, tr.dtype, box, label)
    readers = shared.readers
    cuts: dict[str, Sequence[ChunkCut]] = {}

    def cuts_of(arrays):
        total = 0
        for a in arrays:
            if a.id not in cuts:
                cuts[a.id] = shared.cuts_of(a, box)
                out.bytes_read += shared.count_indexes(a, cuts[a.id])
            total += _stored_in(readers[a.id], cuts[a.id])  # reads the indexes not fetched yet
        return total

    kind = tr.kind
    if kind == "delta":
        out.delta_bytes = cuts_of(tr.deltas)
        if len(tr.deltas) > 1:  # several deltas may add up to more than N's own chain: weigh it
            full_bytes = cuts_of(tr.full)
            if full_bytes < out.delta_bytes:
                kind = out.kind = "full"
                out.reason = f"{len(tr.deltas)} deltas store {out.delta_bytes} bytes of the box, N's chain {full_bytes}"
    else:
        cuts_of(tr.full)
    if kind == "delta":
        job.steps = [(readers[a.id], cuts[a.id], "xor") for a in tr.deltas]
    else:
        job.steps = [(readers[a.id], cuts[a.id], "copy" if i == 0 else "xor") for i, a in enumerate(tr.full)]
    top = tr.full[-1]
    out.chunks = len(cuts[top.id]) if top.id in cuts else len(shared.cuts_of(top, box))
    return job


def _execute(jobs: Sequence[_Job], clock: _Clock | None = None) -> None:
    """Every job's arrays applied level by level: all jobs' first arrays at once on the pool, then the second,
    ... (two arrays of one job touch the same elements, so they never run concurrently)."""
    pool = _pool.get()
    clock = clock or _Clock()
    depth = max((len(j.steps) for j in jobs), default=0)
    for level in range(depth):
        running = []
        for j in jobs:
            if level < len(j.steps):
                reader, cuts, mode = j.steps[level]
                running += [(j, group, pool.submit(_run_batch, reader, shard, group, j.dest, mode, clock))
                            for shard, group in _batches(reader, cuts)]
        for j, group, fut in running:
            for c, (nbytes, changed) in zip(group, fut.result()):
                j.result.bytes_read += nbytes
                if changed:
                    j.result.changed.append(c.index)
    for j in jobs:
        j.result.changed = sorted(set(j.result.changed))


def _verify(tr: TensorRoute, target: PullTarget) -> bool | None:
    """The held values' content hash against N's, where the target holds the whole tensor (a box alone cannot
    be checked against one hash; a distributed pull checks boxes together, ``distributed/pull.py``)."""
    if target.box is not None and target.box != Box.full(tr.shape):
        return None
    arr = dtypes.to_numpy(target.tensor.detach().cpu(), what=tr.name)
    return fmt.content_hash(arr, tr.dtype) == tr.content_hash


_pool = LazyPool("ucp-pull", "read_threads", lambda cpus: max(4, min(32, 2 * cpus)))


def apply_pull(location, routes: Mapping[Key, TensorRoute], targets: Sequence[PullTarget], *, have: str = "",
               want: str = "", verify: bool = False) -> PullResult:
    """Execute a plan (:func:`plan_pull`) for ``targets`` in place; no catalog use (any rank can run it)."""
    t0 = time.perf_counter()
    shared = _Shared(location)
    pairs = []
    for tg in targets:
        tr = routes.get((tg.name, tg.state))
        if tr is None:
            raise ValidationError(f"pull: the plan has no tensor-state {tg.name!r} [{tg.state}]")
        pairs.append((tr, tg))
    _prefetch_indexes(pairs, shared)
    jobs = [_prepare(tr, tg, shared) for tr, tg in pairs]
    trs = [tr for tr, _tg in pairs]
    readers = shared.readers
    t1 = time.perf_counter()
    clock = _Clock()
    _execute(jobs, clock)
    t2 = time.perf_counter()
    if verify:
        for job, tr, tg in zip(jobs, trs, targets):
            if tr.kind == "same":
                continue
            job.result.verified = _verify(tr, tg)
            if job.result.verified is False:
                raise ChecksumError(f"pull {have} -> {want}: {job.result.label} does not match version {want}'s "
                                    f"content hash after the pull (did the tensor hold version {have}'s values?)")
    t3 = time.perf_counter()
    phases = {"prepare": t1 - t0, "execute": t2 - t1, "verify": t3 - t2}
    for r in readers.values():
        for k, v in r.seconds.items():
            phases[k] = phases.get(k, 0.0) + v
    phases.update(clock.seconds)
    return PullResult(have, want, [j.result for j in jobs], t3 - t0, phases,
                      sum(r.requests for r in readers.values()))


# --- which chunks changed ----------------------------------------------------------------------------

def _values(tr_chain: Sequence[ChainArray], location, readers: dict[str, Any], shape: tuple[int, ...], dtype: str):
    """The whole tensor a chain (full array first, then deltas) holds, on the CPU."""
    t = torch.empty(shape, dtype=dtypes.torch_dtype(dtype))
    box = Box.full(shape)
    dest = _Dest(t, dtype, box, tr_chain[-1].path)
    _readers(tr_chain, location, readers)
    steps = [(readers[a.id], _cuts(readers[a.id], box), "copy" if i == 0 else "xor") for i, a in enumerate(tr_chain)]
    _execute([_Job(TensorPull("", "", "", "full"), dest, steps)])
    return dtypes.numpy_view(t)


def _changed_by_values(old, new, reader) -> list[tuple[int, ...]]:
    bits_old, bits_new = delta.bits(old), delta.bits(new)
    return [c.index for c in _cuts(reader, Box.full(new.shape))
            if not np.array_equal(bits_old[c.dst.slices()], bits_new[c.dst.slices()])]


def chunk_diff(store, a: str, b: str) -> list[dict]:
    """Per tensor-state of versions ``a`` and ``b``, which inner chunks of ``b``'s array changed: from the shard
    indexes alone where ``b`` is one delta of ``a`` (a stored delta chunk is a changed one; unchanged chunks
    are never written), else by comparing the values chunk by chunk. Rows: ``name``, ``state``, ``status``
    (``same`` / ``changed`` / ``added`` / ``removed``), ``how`` (``index`` / ``values``), ``chunk_shape``,
    ``chunks``, ``changed`` (chunk indices), ``delta_bytes`` (stored bytes of ``b``'s delta, if it is one)."""
    ka, kb = store.checkpoint(a), store.checkpoint(b)
    keys_a = {(i.name, i.state) for i in ka.tensors()}
    keys_b = [(i.name, i.state) for i in kb.tensors()]
    routes = plan_pull(store, a, b, [k for k in keys_b if k in keys_a])
    readers: dict[str, Any] = {}
    out: list[dict] = []
    for k in keys_b:
        row: dict[str, Any] = {"name": k[0], "state": k[1]}
        tr = routes.get(k)
        if tr is None:
            out.append({**row, "status": "added"})
            continue
        info = kb.info(*k)
        row.update(chunk_shape=list(info.chunk_shape), chunks=math.prod(
            -(-s // c) for s, c in zip(info.shape, info.chunk_shape)) if info.shape else 1)
        if tr.kind == "same":
            out.append({**row, "status": "same", "how": "index", "changed": [], "delta_bytes": 0})
            continue
        _readers(tr.full, store.location, readers)
        top = readers[tr.full[-1].id]
        if tr.kind == "delta" and len(tr.deltas) == 1:
            cuts = _cuts(top, Box.full(tr.shape))
            changed = [c.index for c in cuts if top.stored(c.shard, c.slot)]
            out.append({**row, "status": "changed" if changed else "same", "how": "index", "changed": changed,
                        "delta_bytes": _stored_in(top, cuts)})
            continue
        old_routes = plan_pull(store, None, a, [k])
        old = _values(old_routes[k].full, store.location, readers, tr.shape, tr.dtype)
        new = _values(tr.full, store.location, readers, tr.shape, tr.dtype)
        changed = _changed_by_values(old, new, top)
        out.append({**row, "status": "changed" if changed else "same", "how": "values", "changed": changed,
                    "delta_bytes": None})
    out.extend({"name": k[0], "state": k[1], "status": "removed"} for k in sorted(keys_a - set(keys_b)))
    return out
