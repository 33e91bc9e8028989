"""Reading a committed checkpoint: lazy tensor handles, slice reads, stats, diff, verify, manifest.

A :class:`Checkpoint` is the catalog's view of one committed version; its metadata (``manifest``,
``tensors``, ``objects`` stored as JSON) comes from the catalog alone, so ``ucp show`` and friends never
load torch or TensorStore: numpy, torch and the array format are imported on the first tensor read.
"""

from __future__ import annotations

import contextlib
import json
import json.scanner
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Text, cast, select

from ucp_store import typed_json
from ucp_store._lazy import lazy_module
from ucp_store.catalog import models as m
from ucp_store.catalog.chains import base_chains
from ucp_store.errors import ReferenceNotFound, UcpError, ValidationError
from ucp_store.records import TensorInfo, main_state

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

    from ucp_store import dtypes
    from ucp_store.io import deltaio, localread
    from ucp_store.io import format as fmt
else:
    np = lazy_module("numpy")
    torch = lazy_module("torch")
    dtypes = lazy_module("ucp_store.dtypes")
    fmt = lazy_module("ucp_store.io.format")
    localread = lazy_module("ucp_store.io.localread")
    deltaio = lazy_module("ucp_store.io.deltaio")

__all__ = ["Checkpoint", "TensorHandle", "TensorStats", "compute_stats", "parse_slice", "diff"]


def gc_paused() -> contextlib.AbstractContextManager:
    """The planner's collector pause (imported on use: the planner is not needed to list rows)."""
    from ucp_store.plan.planner import gc_paused as paused

    return paused()


def _normalize_index(index: Any, shape: tuple[int, ...], what: str) -> tuple[fmt.Box, tuple]:
    """Split a numpy-style basic index into the bounding box to read and the index to apply after.

    Only ints, slices and Ellipsis (basic indexing): reads then touch just the chunks in the box.
    """
    if type(index) is int and shape:  # one row (the common inspection read): no general pass
        n = shape[0]
        j = index + n if index < 0 else index
        if not 0 <= j < n:
            raise ValidationError(f"{what}: index {index} is out of bounds for a dimension of size {n}")
        return ((j, j + 1),) + tuple((0, m) for m in shape[1:]), (0,)
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        pos = next(k for k, i in enumerate(index) if i is Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:pos] + (slice(None),) * fill + index[pos + 1:]
    if len(index) > len(shape):
        raise ValidationError(f"{what}: index {index!r} has {len(index)} entries for a {len(shape)}-d tensor")
    index = index + (slice(None),) * (len(shape) - len(index))
    box: list[tuple[int, int]] = []
    residual: list[int | slice] = []
    for i, n in zip(index, shape):
        if isinstance(i, (int, np.integer)) and not isinstance(i, bool):
            j = int(i) + n if i < 0 else int(i)
            if not 0 <= j < n:
                raise ValidationError(f"{what}: index {int(i)} is out of bounds for a dimension of size {n}")
            box.append((j, j + 1))
            residual.append(0)
        elif isinstance(i, slice):
            if i.step == 0:
                raise ValidationError(f"{what}: slice step cannot be zero ({i})")
            start, stop, step = i.indices(n)
            if step < 0:
                raise ValidationError(f"{what}: negative slice steps are not supported ({i})")
            stop = max(start, stop)
            if stop > start:  # end the box at the last selected element, not at the slice's stop
                stop = start + (stop - 1 - start) // step * step + 1
            box.append((start, stop))
            residual.append(slice(0, stop - start, step))
        else:
            raise ValidationError(f"{what}: only integers, slices and ... are supported in an index, got {i!r}")
    return tuple(box), tuple(residual)


def parse_slice(text: str) -> tuple:
    """Parse a CLI slice such as ``"3:5,:"`` or ``"0,::2,..."`` into an index tuple."""
    out: list[Any] = []
    for part in text.split(","):
        part = part.strip()
        if part == "...":
            out.append(Ellipsis)
        elif ":" in part:
            bits = [b.strip() for b in part.split(":")]
            if len(bits) > 3:
                raise ValidationError(f"slice {text!r}: {part!r} has too many ':'")
            try:
                vals = [int(b) if b else None for b in bits] + [None] * (3 - len(bits))
            except ValueError:
                raise ValidationError(f"slice {text!r}: {part!r} is not an integer, a:b[:c] or ...") from None
            out.append(slice(*vals))
        elif part:
            try:
                out.append(int(part))
            except ValueError:
                raise ValidationError(f"slice {text!r}: {part!r} is not an integer, a:b[:c] or ...") from None
    return tuple(out)


class TensorHandle:
    """A lazy tensor-state: nothing is read until it is indexed or ``read()``."""

    def __init__(self, checkpoint: "Checkpoint", info: TensorInfo):
        self.checkpoint = checkpoint
        self.info = info
        self._handle = None
        self._local = None  # the handle when it is a LocalArray (the one-row fast path in ``read``)
        # derived from info (immutable); built once
        self._layout: fmt.ArrayLayout | None = None
        self._what: str | None = None
        self._array_url: str | None = None

    def __repr__(self) -> str:
        i = self.info
        return f"TensorHandle({i.name!r}, state={i.state!r}, shape={list(i.shape)}, dtype={i.dtype})"

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.info.shape)

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.torch_dtype(self.info.dtype)

    @property
    def layout(self) -> fmt.ArrayLayout:
        if self._layout is None:
            i = self.info
            self._layout = fmt.ArrayLayout.from_catalog(i.dtype, i.shape, i.chunk_shape, i.shard_shape, i.codecs)
        return self._layout

    @property
    def array_url(self) -> str:
        if self._array_url is None:
            self._array_url = self.checkpoint.store.array_url(self.info.array)
        return self._array_url

    @property
    def what(self) -> str:
        if self._what is None:
            self._what = f"tensor {self.info.name!r} state {self.info.state!r} of checkpoint {self.checkpoint.id}"
        return self._what

    def ts(self):
        if self._handle is None:
            store = self.checkpoint.store
            self._handle = deltaio.open_any(store.location, self.info, self.layout, store.context)
            if type(self._handle) is localread.LocalArray:
                self._local = self._handle
        return self._handle

    def read_numpy(self, index: Any = ()) -> np.ndarray:
        box, residual = _normalize_index(index, self.info.shape, self.what)
        with self.checkpoint.reading():
            handle = self._local or self.ts()
            data = self._read_local(box) if self._local is not None else fmt.read_box(
                handle, self.layout, box, what=self.what, array_url=self.array_url)
        # an all-integer index yields a numpy scalar; keep it a 0-d array (np.array(copy=False) refuses scalars)
        return np.asarray(data[residual]) if residual else data

    def _read_local(self, box: fmt.Box) -> np.ndarray:
        """The box from the local read path, into fresh memory; a failure named as ``fmt.read_box`` names it
        (the chunk that fails), as on the TensorStore path."""
        try:
            return self._local.read(box)  # type: ignore[attr-defined]
        except ValueError:
            return fmt.read_box(self._local, self.layout, box, what=self.what, array_url=self.array_url)

    def read(self, index: Any = (), *, dtype: torch.dtype | None = None) -> torch.Tensor:
        if type(index) is int and self._local is not None and dtype is None:  # one row, held: fewest steps
            box, _ = _normalize_index(index, self.info.shape, self.what)
            data = self._read_local(box)
            return dtypes.to_torch(data.reshape(data.shape[1:]))  # a 1-d tensor's element: 0-d
        out = dtypes.to_torch(np.asarray(self.read_numpy(index)))
        return out.to(dtype) if dtype is not None and dtype != out.dtype else out

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.read(index)

    def slabs(self, max_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
        """The tensor in C-order slabs of whole chunk rows of about ``max_bytes`` (bounded memory)."""
        layout = self.layout
        for box in fmt.slabs(layout, max_bytes):
            yield fmt.read_box(self.ts(), layout, box, what=self.what, array_url=self.array_url)


@dataclass
class TensorStats:
    name: str
    state: str
    shape: list
    dtype: str
    numel: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    norm: float | None
    nan: int
    inf: int

    def to_json(self) -> dict:
        return dict(self.__dict__)


def compute_stats(handle: TensorHandle, *, slab_bytes: int = 64 << 20) -> TensorStats:
    """min, max, mean, std, L2 norm over finite values, and NaN/Inf counts, chunk row by chunk row.

    Complex values count by their magnitude. The mean and std combine each slab's count, mean and sum of
    squared deviations from that mean (Chan et al.'s parallel update, in float64), all taken after
    subtracting the first finite value: ``E[x^2] - mean^2`` cancels catastrophically when the mean is large
    against the spread (std 15x too high at mean 1e8, spread 1e-3), and even a slab's own mean is off by
    the rounding of sums near 2**53 unless the values are shifted first. ``slab_bytes``: the size of the
    pieces read at once (memory, not the result)."""
    n = finite_n = nan = inf = 0
    shift = mean = m2 = total_sq = 0.0  # mean: of x - shift
    lo, hi = math.inf, -math.inf
    for slab in handle.slabs(slab_bytes):
        # a signaling NaN raises FE_INVALID in the fp32/bf16 -> float64 cast (a RuntimeWarning, an error under
        # -W error); it becomes a NaN like any other and is counted below
        with np.errstate(invalid="ignore"):
            x = slab.astype(np.float64) if slab.dtype.kind in "fiub" or slab.dtype.name == "bfloat16" else np.abs(slab)
            x = np.asarray(x, dtype=np.float64).reshape(-1)
        n += x.size
        nan_mask = np.isnan(x)
        inf_mask = np.isinf(x)
        nan += int(nan_mask.sum())
        inf += int(inf_mask.sum())
        finite = x[~(nan_mask | inf_mask)]
        if finite.size:
            if finite_n == 0:
                shift = float(finite[0])
            k = finite.size
            with np.errstate(over="ignore", invalid="ignore"):  # |x| near the float64 limit: inf, as before
                y = finite - shift
                slab_mean = float(y.mean())
                dev = y - slab_mean
                slab_m2 = float(np.dot(dev, dev))
                if finite_n == 0:
                    mean, m2 = slab_mean, slab_m2
                else:
                    delta = slab_mean - mean
                    mean += delta * (k / (finite_n + k))
                    m2 += slab_m2 + delta * delta * (finite_n * k / (finite_n + k))
                total_sq += float(np.dot(finite, finite))
            finite_n += k
            lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
    i = handle.info
    if finite_n == 0:
        return TensorStats(i.name, i.state, list(i.shape), i.dtype, n, None, None, None, None, None, nan, inf)
    return TensorStats(i.name, i.state, list(i.shape), i.dtype, n, lo, hi, shift + mean,
                       math.sqrt(max(m2, 0.0) / finite_n), math.sqrt(total_sq), nan, inf)


_MISSING = object()

# Decoded catalog values shared by every fetch in the process, by their JSON text: shapes as tuples and
# codec chains. Equal text is an equal value, so sharing is sound while records stay read-only (their
# contract); one object per value lets io's held readers and layout caches match a later fetch's records
# by identity instead of comparing nested codec lists. Bounded: cleared past _SHARED_MAX texts.
_TUPLES: dict[str, tuple[int, ...]] = {}
_CODECS: dict[str, Any] = {}
_SHARED_MAX = 1 << 16
_scan_json = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # typeshed: a context


def _json_value(text: str) -> Any:
    """``json.loads`` of catalog text through the decoder's C scanner alone (half the cost per call: the
    Python wrapper around it is most of a short value's decode); anything else (leading space, trailing
    text) goes through ``json.loads``, which also raises the usual errors."""
    try:
        value, end = _scan_json(text, 0)
    except (StopIteration, ValueError, TypeError):  # TypeError: bytes from a driver
        return json.loads(text)
    if end != len(text):
        return json.loads(text)
    return value


def _with_chains(infos: list[TensorInfo], chains: dict[str, tuple]) -> list[TensorInfo]:
    """``infos`` with each ``xor`` array's encoding and bases (``catalog.chains.base_chains``) filled in."""
    out = []
    for i in infos:
        chain = chains.get(i.array_id)
        if chain is not None:
            i = TensorInfo.from_catalog(i.name, i.state, i.shape, i.dtype, i.pattern, i.chunk_shape, i.shard_shape,
                                        i.array, i.array_id, i.codecs, i.nbytes, i.content_hash, i.position,
                                        "xor", chain)
        out.append(i)
    return out


class Checkpoint:
    """A committed version. Tensor rows are loaded from the catalog once, on first use."""

    def __init__(self, store, checkpoint_id: str):
        self.store = store
        self.id = checkpoint_id
        with store.catalog.session() as s:
            ck = s.get(m.Checkpoint, checkpoint_id)
            if ck is None:
                raise ReferenceNotFound(f"checkpoint {checkpoint_id!r} not found")
            self.run = ck.run.name
            self.step = ck.step
            self.status = ck.status
            self.created_at = ck.created_at
            self.committed_at = ck.committed_at
            self.parent = ck.parent_id
            self.message = ck.message
            self.nbytes = ck.nbytes
            self.tags = sorted(t.name for t in ck.tags)
            p = ck.provenance
            self.provenance: dict | None = None if p is None else {
                "source_kind": p.source_kind, "source_path": p.source_path, "source_topology": p.source_topology,
                "tool_version": p.tool_version, "library_versions": p.library_versions, "host": p.host,
                "source_hashes": p.source_hashes, "extra": p.extra}
        self._infos: dict[tuple[str, str], TensorInfo] | None = None
        self._handles: dict[tuple[str, str], TensorHandle] = {}

    def __repr__(self) -> str:
        return f"Checkpoint({self.run}@{self.step}, id={self.id})"

    # --- catalog rows ---------------------------------------------------------------------------
    def _load_infos(self) -> dict[tuple[str, str], TensorInfo]:
        if self._infos is None:
            with gc_paused():
                infos = {(i.name, i.state): i for i in self._fetch_infos()}
            if not infos:  # no rows: a version without tensors, or one removed since it was opened
                self.check_present()
            self._infos = infos
        return self._infos

    # --- a version removed after it was opened ----------------------------------------------------
    def removed(self) -> bool:
        """Whether this version is no longer a committed version of the catalog (``rm`` or ``gc`` removed it
        after it was opened). False where no catalog can be asked (a detached rank)."""
        if getattr(self.store, "detached", False):
            return False
        try:
            with self.store.catalog.session() as s:
                return s.scalar(select(m.Checkpoint.status).where(m.Checkpoint.id == self.id)) != "committed"
        except Exception:  # noqa: BLE001 (no catalog to ask: the original error stands)
            return False

    def removed_error(self) -> ReferenceNotFound:
        return ReferenceNotFound(f"version {self.run}@{self.step} ({self.id}) was removed after it was opened (ucp rm "
                                 "or gc): it can no longer be read or verified")

    def check_present(self) -> None:
        """Raise :meth:`removed_error` when the version was removed after it was opened."""
        if self.removed():
            raise self.removed_error()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """A read or check of this version: a failure of it (a missing or unreadable file) becomes "the version
        was removed" when that is what happened, instead of a report of corrupt data."""
        try:
            yield
        except UcpError:
            if self.removed():
                raise self.removed_error() from None
            raise

    def _fetch_infos(self, layers: range | None = None, layer_limit: int | None = None) -> list[TensorInfo]:
        """Tensor rows in saved order; with ``layers``, only rows on those layers or on none (plus any on a
        layer at or past ``layer_limit``, so that the planner reports them).

        Core rows, not ORM objects, and JSON columns read as text and decoded once per distinct value: a
        1000-layer model has 100k rows but a few thousand distinct values, and the four states of a
        parameter then share one pattern record, which the planner recognises by identity. Treat the
        records' patterns, shapes and codecs as read-only: equal values are one object."""
        t, a = m.Tensor, m.Array
        q = (select(t.name, t.state, cast(t.shape, Text), t.dtype, cast(t.pattern, Text), cast(a.chunk_shape, Text),
                    cast(a.shard_shape, Text), a.path, a.id, cast(a.codecs, Text), t.nbytes, t.content_hash,
                    t.position, a.base_array_id)
             .join(a, t.array_id == a.id).where(t.checkpoint_id == self.id))
        if layers is not None:
            cond = t.layer.is_(None) | t.layer.between(layers.start, layers.stop - 1)
            if layer_limit is not None:
                cond = cond | (t.layer >= layer_limit)
            q = q.where(cond)
        q = q.order_by(t.position)
        values: dict[str | None, Any] = {None: None}  # JSON text -> decoded value (pattern)
        tuples = _TUPLES                       # JSON text of a list of ints -> tuple (process-wide)
        codec_values = _CODECS                 # JSON text of a codec chain -> its value (process-wide)
        if len(tuples) > _SHARED_MAX or len(codec_values) > _SHARED_MAX:
            tuples.clear()
            codec_values.clear()
        loads = _json_value
        make = TensorInfo.from_catalog
        out: list[TensorInfo] = []
        add = out.append
        # a Core connection: an ORM session would add its own per-row loading to plain column tuples
        with gc_paused(), self.store.catalog.engine.connect() as conn:  # 100k acyclic records: see gc_paused
            rows = conn.execute(q).fetchall()  # one DBAPI fetchall, not a fetchone per row
            deltas: dict[str, str | None] = {}  # xor arrays (issue 39) -> their base array
            for (name, state, shape, dtype, pattern, chunk, shard, path, aid, codecs, nbytes, chash, pos,
                 base) in rows:
                s = tuples.get(shape)
                if s is None:
                    s = tuples[shape] = tuple(loads(shape))
                c = tuples.get(chunk)
                if c is None:
                    c = tuples[chunk] = tuple(loads(chunk))
                sh = tuples.get(shard)
                if sh is None:
                    sh = tuples[shard] = tuple(loads(shard))
                p = values.get(pattern, _MISSING)
                if p is _MISSING:
                    p = values[pattern] = loads(pattern)
                cd = codec_values.get(codecs, _MISSING)
                if cd is _MISSING:
                    cd = codec_values[codecs] = loads(codecs)
                add(make(name, state, s, dtype, p, c, sh, path, aid, cd, nbytes, chash, pos))
                if base is not None:
                    deltas[aid] = base
            del rows  # freed before the collector resumes, so it never scans them
            if deltas:
                out = _with_chains(out, base_chains(conn, deltas))
        return out

    def plan_records(self, topology, rank: int) -> list[TensorInfo]:
        """The records a plan for ``rank`` of ``topology`` reads, in saved order.

        With pipeline stages, the catalog returns only the rank's stage's layers and the tensors on no
        layer (tied, unplaced), using ``tensors.layer``: a stage of a 1000-layer model then fetches a
        fraction of the rows. Everything else (or when the rows are already loaded) gets all rows; the
        planner skips what the rank does not hold either way."""
        from ucp_store.topology import as_topology

        topo = as_topology(topology)
        if self._infos is not None or topo.pp == 1:
            return self.tensors()
        stage = topo.coords(rank)["pp"]
        return self._fetch_infos(topo.layers_of_stage(stage), layer_limit=topo.layers)

    def tensors(self, name: str | None = None, state: str | None = None) -> list[TensorInfo]:
        return [i for i in self._load_infos().values()
                if (name is None or i.name == name) and (state is None or i.state == state)]

    def names(self) -> list[str]:
        return list(dict.fromkeys(i.name for i in self._load_infos().values()))

    def states(self, name: str) -> list[str]:
        return [i.state for i in self.tensors(name)]

    def info(self, name: str, state: str | None = None) -> TensorInfo:
        infos = self._load_infos()
        if state is None:  # "the" state: fp32, weight, else the largest, never a 0-d one (records.main_state)
            cands = self.tensors(name)
            if not cands:
                raise self._missing(name, None)
            return main_state(cands)
        try:
            return infos[(name, state)]
        except KeyError:
            raise self._missing(name, state) from None

    def _missing(self, name: str, state: str | None) -> ReferenceNotFound:
        import difflib

        all_names = self.names()
        if name in all_names:
            return ReferenceNotFound(f"tensor {name!r} of checkpoint {self.run}@{self.step} has no state {state!r}; "
                                     f"states: {', '.join(self.states(name))}")
        near = difflib.get_close_matches(name, all_names, n=5, cutoff=0.5)
        hint = f"; did you mean: {', '.join(near)}?" if near else ""
        return ReferenceNotFound(f"checkpoint {self.run}@{self.step} has no tensor {name!r}{hint}")

    def tensor(self, name: str, state: str | None = None) -> TensorHandle:
        info = self.info(name, state)
        key = (info.name, info.state)
        if key not in self._handles:
            self._handles[key] = TensorHandle(self, info)
        return self._handles[key]

    def __getitem__(self, key) -> TensorHandle:
        if isinstance(key, tuple):
            return self.tensor(*key)
        return self.tensor(key)

    def read(self, name: str, state: str | None = None, index: Any = (), *, dtype=None) -> torch.Tensor:
        return self.tensor(name, state).read(index, dtype=dtype)

    def state_dict(self, state: str = "fp32", *, lazy: bool = False) -> dict[str, Any]:
        """``name -> tensor`` for one state, read concurrently (``lazy``: handles that read on access)."""
        infos = self.tensors(state=state)
        if lazy:
            return {i.name: self.tensor(i.name, i.state) for i in infos}
        from ucp_store.io.read import read_tensors

        with self.reading():
            got = read_tensors(self, infos)
        return {i.name: got[(i.name, i.state)] for i in infos}

    # --- objects --------------------------------------------------------------------------------
    def objects(self) -> dict[str, Any]:
        """``name -> value``: JSON values exactly as saved (``1.0`` stays a float, ``-0.0`` keeps its sign, big
        integers stay integers, NaN/Infinity come back, tuples, non-string dict keys and numpy scalars keep
        their types: ``typed_json``), array objects as tensors. Rows written before migration 0004 on SQLite
        may have lost a top-level ``1.0`` -> ``1`` already (see ``migrations/versions/0004_object_value_text.py``)."""
        out = {}
        with self.store.catalog.session() as s:
            for o in s.scalars(select(m.StoredObject).where(m.StoredObject.checkpoint_id == self.id)):
                if o.kind == "json":
                    out[o.name] = typed_json.decode(o.value)
                else:
                    a = o.array
                    layout = fmt.ArrayLayout.from_catalog(a.dtype, a.shape, a.chunk_shape, a.shard_shape, a.codecs)
                    h = localread.open_reader(self.store.location, a.path, layout, self.store.context, codecs=a.codecs)
                    data = fmt.read_box(h, layout, tuple((0, n) for n in a.shape), what=f"object {o.name!r}",
                                        array_url=self.store.array_url(a.path))
                    out[o.name] = dtypes.to_torch(np.asarray(data))
        return out

    # --- derived views --------------------------------------------------------------------------
    def manifest(self) -> dict:
        """The public record ``ucp show --json`` prints (schemas/manifest.schema.json)."""
        with self.store.catalog.session() as s:
            objects = {o.name: ({"kind": "json", "value": o.value} if o.kind == "json" else {"kind": "array"})
                       for o in s.scalars(select(m.StoredObject).where(m.StoredObject.checkpoint_id == self.id))}
        return {
            "id": self.id,
            "run": self.run,
            "step": self.step,
            "status": self.status,
            "created_at": self.created_at.isoformat(),
            "committed_at": self.committed_at.isoformat() if self.committed_at else None,
            "parent": self.parent,
            "message": self.message,
            "tags": self.tags,
            "nbytes": self.nbytes,
            "provenance": self.provenance,
            "objects": objects,
            "tensors": [i.to_json(self.store.array_url(i.array)) for i in self.tensors()],
        }

    def stats(self, name: str | None = None, state: str | None = None, *, progress: bool = False) -> list[TensorStats]:
        from ucp_store.progress import track

        infos = self.tensors(name, state) if name else self.tensors(state=state)
        if name and not infos:
            raise self._missing(name, state)
        return [compute_stats(self.tensor(i.name, i.state))
                for i in track(infos, "stats", enabled=progress, total=len(infos))]

    def verify(self, *, progress: bool = False) -> list[dict]:
        """Decode every chunk (crc32c) and recompute every content hash; returns the problems. A version
        removed after it was opened raises ReferenceNotFound saying so (it has no rows, then no files)."""
        from ucp_store.progress import track

        self.check_present()
        problems: list[dict[str, Any]] = []
        arrays: dict[str, list[TensorInfo]] = {}
        for info in self.tensors():
            arrays.setdefault(info.array_id, []).append(info)
        for infos in track(list(arrays.values()), "verify", enabled=progress, total=len(arrays),
                           weight=lambda group: group[0].nbytes):
            handle = self.tensor(infos[0].name, infos[0].state)
            url = handle.array_url
            try:
                fmt.read_metadata(self.store.location, infos[0].array)  # UcpError if zarr.json is missing
                mismatch = fmt.metadata_mismatch(self.store.location, infos[0].array, handle.layout,
                                                 self.store.context)
                if mismatch is not None:
                    problems.append({"array": url, "tensor": infos[0].name, "state": infos[0].state, "chunk": None,
                                     "error": f"zarr.json does not match the catalog (shape, dtype or codecs): "
                                              f"{mismatch}"})
                    continue
                # recomputed in the scheme it was recorded in (versions saved before the one scheme keep theirs)
                scheme = fmt.hash_scheme(infos[0].content_hash) or fmt.HASH_PREFIX
                report = fmt.verify_array(handle.ts(), handle.layout, url, scheme=scheme)
            except UcpError as exc:
                problems.append({"array": url, "tensor": infos[0].name, "state": infos[0].state, "chunk": None,
                                 "error": str(exc)})
                continue
            for idx, err in report.bad_chunks:
                problems.append({"array": url, "tensor": infos[0].name, "state": infos[0].state, "chunk": list(idx),
                                 "shard": handle.layout.shard_key(idx),
                                 "error": (f"missing chunk: {err}" if "NOT_FOUND" in err or "missing" in err
                                           else f"crc32c mismatch: {err}")})
            if report.ok:
                with self.store.catalog.session() as s:
                    array_hash = s.scalar(select(m.Array.content_hash).where(m.Array.id == infos[0].array_id))
                if array_hash != report.content_hash:  # the arrays row drives dedup: it must be right too
                    problems.append({"array": url, "tensor": infos[0].name, "state": infos[0].state, "chunk": None,
                                     "error": f"content hash {report.content_hash} != catalog array row {array_hash}"})
                for info in infos:
                    if report.content_hash != info.content_hash:
                        problems.append({"array": url, "tensor": info.name, "state": info.state, "chunk": None,
                                         "error": f"content hash {report.content_hash} != catalog {info.content_hash}"})
        if problems:  # files gone because the version was removed meanwhile: say that, not "corrupt"
            self.check_present()
        return problems

    def load_shard(self, topology, rank: int, *, states: Iterable[str] | None = None, dtype=None, lazy: bool = False):
        """Tensors rank ``rank`` of ``topology`` needs, read through the planner (see ucp_store/io/read.py)."""
        from ucp_store.io.read import load_shard

        with self.reading():
            return load_shard(self, topology, rank, states=states, dtype=dtype, lazy=lazy)


def diff(a: Checkpoint, b: Checkpoint, *, progress: bool = False) -> list[dict]:
    """same / changed / added / removed per tensor-state, with the relative change ||b-a|| / ||a||: NaN when
    either side holds a NaN or ``a`` an Inf (the size of such a change is not defined), Inf when only ``b``
    holds an Inf. For complex tensors the norms are of the complex values: a change of the imaginary part
    counts as much as one of the real part."""
    from ucp_store.progress import track

    ia = {(i.name, i.state): i for i in a.tensors()}
    ib = {(i.name, i.state): i for i in b.tensors()}
    out = []
    keys = list(dict.fromkeys(list(ia) + list(ib)))
    for key in track(keys, "diff", enabled=progress, total=len(keys)):
        x, y = ia.get(key), ib.get(key)
        row: dict[str, Any] = {"name": key[0], "state": key[1]}
        if x is None:
            assert y is not None
            out.append({**row, "status": "added", "shape": list(y.shape), "dtype": y.dtype})
        elif y is None:
            out.append({**row, "status": "removed", "shape": list(x.shape), "dtype": x.dtype})
        elif x.content_hash == y.content_hash:
            out.append({**row, "status": "same", "relative_change": 0.0})
        elif x.shape != y.shape or x.dtype != y.dtype:
            out.append({**row, "status": "changed", "relative_change": None,
                        "detail": f"{x.dtype}{list(x.shape)} -> {y.dtype}{list(y.shape)}"})
        else:
            # hashes of two schemes (a version saved before every save path hashed alike) say nothing: the
            # data decides, bit for bit
            bits = fmt.hash_scheme(x.content_hash) != fmt.hash_scheme(y.content_hash)
            num = den = 0.0
            for sa, sb in zip(a.tensor(*key).slabs(), b.tensor(*key).slabs()):
                if bits and not _same_bits(sa, sb):
                    bits = False
                # NaN and Inf make the change NaN or Inf, without numpy's warnings: a signaling NaN's cast (see
                # compute_stats), inf - inf
                with np.errstate(invalid="ignore", over="ignore"):
                    # complex: both parts count (vdot conjugates its first argument: sum of |d|^2)
                    wide = np.complex128 if sa.dtype.kind == "c" else np.float64
                    fa, fb = sa.astype(wide).reshape(-1), sb.astype(wide).reshape(-1)
                    d = fb - fa
                    num += float(np.vdot(d, d).real)
                    den += float(np.vdot(fa, fa).real)
            if bits:  # every bit equal
                out.append({**row, "status": "same", "relative_change": 0.0})
                continue
            if math.isnan(num) or math.isnan(den):
                rel = math.nan  # a NaN on either side (or inf - inf): no size of the change, never "0.0"
            else:
                rel = math.sqrt(num) / math.sqrt(den) if den > 0 else (math.inf if num > 0 else 0.0)
            out.append({**row, "status": "changed", "relative_change": rel})
    return out


def _same_bits(a, b) -> bool:
    """Two slabs hold the same bits (C order): NaN payloads, -0.0 and every other bit pattern count."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
