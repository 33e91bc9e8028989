"""The sharded side of a save: every rank writes its own share straight into the logical arrays.

``write_shard`` (a rank's TP-local tensor or ZeRO flat fragment, placed by its pattern and topology) and
``write_region`` (a box at an offset, for sources that know their boxes: DTensor shards) write into arrays
whose id and layout every rank derives alike; inner chunks and shard files follow the writers' split points
so that ranks own whole files where they can. The rank holding element 0 of an array (its origin) hashes it
after every rank wrote (:meth:`ShardWriter.finish`), from the unit digests the ranks took of what they wrote
and, for the units no single write held whole, from the stored array.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ucp_store import dtypes, names
from ucp_store._killpoints import killpoint
from ucp_store.catalog import models as m
from ucp_store.errors import ShapeMismatch
from ucp_store.io import format as fmt
from ucp_store.io import localwrite
from ucp_store.io.location import array_path
from ucp_store.registry.context import StoreContext
from ucp_store.save import straddle
from ucp_store.save.arrays import ArrayWriter
from ucp_store.save.checks import check_extent, layer_of, validate_pattern
from ucp_store.save.dedup import Deduplicator
from ucp_store.save.durable import Durability
from ucp_store.save.order import Positions

__all__ = ["ShardWriter", "writer_aligned_shards"]


def writer_aligned_shards(layout: fmt.ArrayLayout, source_points: Mapping[int, Iterable[int]]) -> tuple[int, ...]:
    """Shard extents that divide the source topology's split points (in whole inner chunks) where they can.

    Then each writer rank owns whole shard files; where a split point is not a multiple of the inner
    chunk, the shard stays as planned and concurrent writers merge through conditional writes."""
    shard = list(layout.shard_shape)
    for d, points in source_points.items():
        pts = [p for p in points if 0 < p < layout.shape[d]]
        if not pts:
            continue
        g = 0
        for p in pts:
            g = math.gcd(g, p)
        c = layout.chunk_shape[d]
        if g % c == 0:
            # the largest whole number of chunks that divides every split point and fits the planned shard,
            # so no shard straddles a split point (``min(shard, g)`` did when g was over the shard target)
            k, cap = g // c, max(1, shard[d] // c)
            shard[d] = c * max(n for i in range(1, math.isqrt(k) + 1) if k % i == 0 for n in (i, k // i) if n <= cap)
    return tuple(shard)


#: shard files of an array written as flat fragments by ``dp`` ranks hold about 1/(FRAGMENT_FILES x dp) of it
FRAGMENT_FILES = 8


def fragment_shards(layout: fmt.ArrayLayout, dp: int) -> tuple[int, ...]:
    """Shard extents for an array that ``dp`` ranks write as ZeRO flat fragments: about 1/(8 dp) of it each
    (whole inner chunks, never larger than planned). A fragment edge cuts at most a file or two; those go to
    one writer each (:mod:`ucp_store.save.straddle`), so the bytes that move stay a small part of the array."""
    from ucp_store.io.chunking import shard_shape

    if dp <= 1 or not layout.shape or not layout.nbytes:
        return layout.shard_shape
    target = max(1, layout.nbytes // (FRAGMENT_FILES * dp))
    small = shard_shape(layout.shape, layout.chunk_shape, layout.itemsize, target)
    return tuple(min(a, b) for a, b in zip(small, layout.shard_shape))


class ShardWriter:
    """The sharded arrays of one pending checkpoint on one rank: those it opened, wrote boxes of, and is the
    origin of (``origin``: it records their rows). Writes go through the ``arrays`` writer's window; rows are
    appended to the writer's shared ``rows``."""

    def __init__(self, ctx: StoreContext, checkpoint_id: str, *, arrays: ArrayWriter, dedup: Deduplicator,
                 durability: Durability, rows: list, positions: Positions):
        self.ctx = ctx
        self.id = checkpoint_id
        self.arrays = arrays
        self.dedup = dedup
        self.durability = durability
        self.rows = rows
        self.positions = positions
        #: (name, state) -> (array id, path, layout, pattern) of every sharded array this rank writes to
        self.sharded: dict[tuple[str, str], tuple] = {}
        #: the keys whose element 0 this rank wrote: it hashes them and records their rows
        self.origin: set[tuple[str, str]] = set()
        #: ``origin_writes_metadata``: only an array's origin writes its zarr.json (in ``finish``)
        self.origin_metadata = False
        self._handles: dict[tuple[str, str], Any] = {}
        self._shard_positions: dict[tuple[str, str], int] = {}  # write_shard(position=...)
        self._unit_digests: dict[tuple[str, str], dict | None] = {}  # write_region's boxes' unit digests
        self._region_hashes: dict[tuple[str, str], str] = {}
        # write_shard(digest=True): inner-chunk digests of what this rank wrote, computed from memory
        self._shard_digests: dict[tuple[str, str], dict] = {}
        self._chunk_digests: dict[tuple[str, str], dict] = {}  # set_chunk_digests: every rank's, merged
        self._opened: dict[tuple[str, str], tuple] = {}  # open_shards: (layout, path, array id) before any write
        # arrays opened without writing their zarr.json (another rank, or this one as origin in finish,
        # writes it: one writer per object)
        self._uncreated: set[tuple[str, str]] = set()
        self._local_folders: dict[tuple[str, str], str | None] = {}  # localwrite folder of an array, or None
        #: ``hold_straddling`` (a multi-rank save): the pieces of shard files this rank's boxes only cut, kept for
        #: the exchange that hands each file to its one writer (``write_owned``); None: written in place
        self.straddling: list[straddle.Piece] | None = None
        #: ``open_delta`` tensor-states: (base array id, stored bytes of every rank's files)
        self.deltas: dict[tuple[str, str], tuple[str, int]] = {}

    def write_shard(self, name: str, state: str, local: torch.Tensor, *, shape, pattern: dict | None,
                    topology, rank: int, fragment=None, targets: Iterable = (), position: int | None = None,
                    digest: bool = False) -> int:
        """``CheckpointWriter.write_shard``: rank ``rank``'s shard of a tensor-state into the logical
        array, from the caller's memory (no copy); returns the number of elements written."""
        from ucp_store import patterns as pat
        from ucp_store.topology import as_topology

        names.tensor_name(name)
        names.state_name(state)
        what = f"tensor {name!r} state {state!r}"
        topology = as_topology(topology)
        shape = check_extent(shape, what)
        if isinstance(local, torch.Tensor | np.ndarray):
            check_extent(local.shape, what)
        if isinstance(local, torch.Tensor):
            array = dtypes.to_numpy(local, what=what)
        else:
            array = np.require(local, requirements="C")
        dtype = dtypes.zarr_name(array.dtype, what=what)
        if pattern is not None:
            validate_pattern(name, pattern, shape)
        handle, layout, rel, aid = self._sharded_array(name, state, shape, dtype, pattern, topology, targets)
        written = 0
        if fragment is None:
            expected = pat.local_layout(pattern, shape, topology, rank, name=name).shape
            if tuple(array.shape) != tuple(expected):
                raise ShapeMismatch(f"{what}: rank {rank} shard has shape {tuple(array.shape)}, its layout in "
                                    f"{topology.describe()} expects {tuple(expected)}")
            copies = [(c.logical, array[c.local.slices()]) for c in
                      pat.writer_copies(pattern, shape, topology, rank, name=name)]
        else:
            flat = array.reshape(-1)
            if flat.size < fragment.slot:
                raise ShapeMismatch(f"{what}: rank {rank} fragment has {flat.size} elements, expected {fragment.slot}")
            copies = [(fc.logical, flat[fc.flat.start:fc.flat.stop].reshape(fc.logical.shape)) for fc in
                      pat.fragment_writer_copies(pattern, shape, topology, rank, fragment, name=name)]
        key = (name, state)
        for box, whole_box in copies:
            offset = tuple(lo for lo, _ in box.ranges)
            written += whole_box.size
            data: np.ndarray | None = whole_box
            if self.straddling is not None and shape:
                # a multi-rank save: the parts of shard files this box only cuts go to each file's one writer
                offset, data = self._hold_pieces(key, layout, offset, whole_box, digest)
            if data is not None:
                self._write_box(key, handle, layout, rel, offset, data, digest, what)
            killpoint("write.shard_box")
        self.sharded.setdefault((name, state), (aid, rel, layout, pattern))
        if position is not None:
            self._shard_positions[(name, state)] = int(position)
        else:
            self.positions.touch((name, state))
        if any(all(lo == 0 for lo, _ in box.ranges) for box, _ in copies) or (not shape and copies):
            self.origin.add((name, state))  # this rank records the row (it wrote element 0)
        return written

    def _write_box(self, key: tuple[str, str], handle, layout: fmt.ArrayLayout, rel: str, offset: tuple[int, ...],
                   data: np.ndarray, digest: bool, what: str) -> None:
        """One box of a ``write_shard`` (or an owner's assembled shard file) into the array."""
        localwrite.log_box(rel, layout, offset, tuple(data.shape))
        folder = self._local_folder(key, rel, layout) if self.durability.deferred else None
        if folder is not None and localwrite.whole_shards(layout, offset, tuple(data.shape)):
            # whole shards of a local store with deferred durability: their files straight from memory; the
            # write pool digests each chunk from the copy it writes (not this thread, one more pass over it)
            self._submit_local_shards(folder, rel, layout, offset, data,
                                      self._shard_digests.setdefault(key, {}) if digest else None, what)
            return
        box = tuple(slice(o, o + n) for o, n in zip(offset, data.shape))
        self.durability.touch(rel)  # TensorStore writes shard files this writer does not name: the pass walks rel
        self.arrays.window.submit(handle[box].write(data), data.nbytes, (data, what))
        if digest:
            fmt.box_unit_digests(layout.dtype, layout.shape, offset, data, self._shard_digests.setdefault(key, {}))

    def _hold_pieces(self, key: tuple[str, str], layout: fmt.ArrayLayout, offset: tuple[int, ...],
                     data: np.ndarray, digest: bool) -> tuple[tuple[int, ...], np.ndarray | None]:
        """Keep (copied: the caller's memory may go) the parts of ``data`` in shard files it only cuts, for
        the exchange; returns the box of the whole shard files it covers (data None when none)."""
        assert self.straddling is not None
        whole, parts = straddle.split_box(layout.shape, layout.shard_shape, offset, data.shape)
        for index, (at, extent) in parts:
            sl = tuple(slice(a - o, a - o + e) for a, o, e in zip(at, offset, extent))
            self.straddling.append(straddle.Piece(key[0], key[1], index, at, np.array(data[sl]), digest))
        if whole is None:
            return offset, None
        at, extent = whole
        return at, data[tuple(slice(a - o, a - o + e) for a, o, e in zip(at, offset, extent))]

    def take_straddling(self) -> list[straddle.Piece]:
        """The pieces held for the exchange; holding ends (later boxes are written in place)."""
        pieces, self.straddling = self.straddling or [], None
        return pieces

    def write_owned(self, pieces: Iterable[straddle.Piece]) -> None:
        """Write the shard files this rank owns from every rank's pieces of them (its own among them): each
        assembled into the whole file and written once, or, where the pieces leave part of it unwritten, piece
        by piece, one after another (still this one writer)."""
        groups: dict[tuple, list[straddle.Piece]] = {}
        for p in pieces:
            groups.setdefault(p.key, []).append(p)
        for (name, state, _), group in sorted(groups.items(), key=lambda kv: kv[0]):
            key = (name, state)
            what = f"tensor {name!r} state {state!r}"
            _, rel, layout, _ = self.sharded[key]  # the owner holds a piece of each file it owns: it opened the array
            handle = self._handles[key]
            digest = any(p.digest for p in group)
            whole = straddle.assemble(layout.shape, layout.shard_shape, group)
            if whole is not None:
                (at, _), data = whole
                self._write_box(key, handle, layout, rel, at, data, digest, what)
                continue
            for p in group:  # one after another: each a read-modify-write of the same file
                self._write_box(key, handle, layout, rel, p.offset, p.data, digest, what)
                self.arrays.drain()

    def numpy_dtype(self, name: str, state: str) -> np.dtype:
        """The numpy dtype of the data of a sharded array this writer opened."""
        return dtypes.numpy_dtype(self.sharded[(name, state)][2].dtype)

    def write_region(self, name: str, state: str, local: torch.Tensor | np.ndarray, *, shape, offset,
                     pattern: dict | None, boundaries: Mapping[int, Iterable[int]] | None = None,
                     origin: bool = False) -> int:
        """``CheckpointWriter.write_region``: one box of a tensor-state at ``offset`` of the logical
        ``shape``, from the caller's memory (no copy); returns the number of elements written."""
        names.tensor_name(name)
        names.state_name(state)
        what = f"tensor {name!r} state {state!r}"
        shape = check_extent(shape, what)
        if isinstance(local, torch.Tensor | np.ndarray):
            check_extent(local.shape, what)
        offset = tuple(int(o) for o in offset)
        array = (dtypes.to_numpy(local, what=what) if isinstance(local, torch.Tensor)
                 else np.require(local, requirements="C"))
        dtype = dtypes.zarr_name(array.dtype, what=what)
        if len(offset) != len(shape) or array.ndim != len(shape) or any(
                o < 0 or o + n > s for o, n, s in zip(offset, array.shape, shape)):
            raise ShapeMismatch(f"{what}: a box of shape {tuple(array.shape)} at offset {offset} does not fit the "
                                f"logical shape {shape}")
        if pattern is not None:
            validate_pattern(name, pattern, shape)
        key = (name, state)
        if key not in self.sharded:
            self.open_regions([(name, state, dtype, shape, pattern, boundaries)])
        self.positions.touch(key)
        handle, layout, rel, aid = self._known_array(key, dtype, shape, f"{what}: box", "boxes")
        if array.size:
            localwrite.log_box(rel, layout, offset, tuple(array.shape))
            folder = self._local_folder(key, rel, layout)
            if folder is not None and localwrite.whole_shards(layout, offset, tuple(array.shape)):
                # this rank owns whole shard files: written here, each chunk copied once (crc, digest, writev)
                self._submit_local_shards(folder, rel, layout, offset, array,
                                          self._unit_digests.setdefault(key, {}), what)
            else:
                box = tuple(slice(o, o + n) for o, n in zip(offset, array.shape))
                self.durability.touch(rel)  # TensorStore's shard files: the pass walks rel
                future = handle[box].write(array) if box else handle.write(array)
                self.arrays.window.submit(future, array.nbytes, (array, what))
                self._digest_region(key, layout, offset, array)
        if origin:
            self.origin.add(key)
        return int(array.size)

    def _local_folder(self, key: tuple[str, str], rel: str, layout: fmt.ArrayLayout) -> str | None:
        folder = self._local_folders.get(key, "")
        if folder == "":
            folder = self._local_folders[key] = localwrite.local_folder(self.ctx.location, rel, layout)
        return folder

    def _submit_local_shards(self, folder: str, rel: str, layout: fmt.ArrayLayout, offset: tuple[int, ...],
                             array: np.ndarray, digests: dict | None, what: str) -> None:
        """The shard files of a ``localwrite.whole_shards`` box, on the write pool. Durable per file (folders
        once, in ``_drain``), or, when this writer defers durability, left to ``flush``'s single pass, which
        fsyncs exactly these files and the folders whose entries they changed (not every rank's files)."""
        deferred = self.durability.deferred
        dirs: set[str] = self.durability.changed_dirs if deferred else self.durability.local_dirs
        shape = tuple(array.shape)
        for shard in localwrite.shard_boxes(layout, offset, shape):
            if deferred:
                self.durability.touch_file(rel, layout.shard_file_key(shard))
            future = localwrite.submit(localwrite.write_shard_file, folder, layout, shard, array, offset, digests,
                                       dirs, not deferred)
            self.arrays.window.submit(future, min(array.nbytes, math.prod(layout.shard_shape) * array.itemsize),
                                (array, what))

    def open_regions(self, specs: Iterable[tuple], *, create: Container | None = None) -> None:
        """``CheckpointWriter.open_regions``: create or open, all at once, the arrays ``write_region``
        boxes will go to (only the keys in ``create`` are created, when given)."""
        import xxhash

        pending: list[tuple] = []
        for name, state, dtype, shape, pattern, boundaries, *units in specs:
            key = (name, state)
            if key in self.sharded or any(k == key for k, *_ in pending):
                continue
            shape = tuple(int(x) for x in shape)
            if pattern is not None:
                validate_pattern(name, pattern, shape)
            points = {int(d): [int(p) for p in v] for d, v in (boundaries or {}).items()}
            layout = self.arrays.layout(shape, dtype, pattern, boundaries=points or None,
                                        units=units[0] if units else None)
            layout = fmt.ArrayLayout(layout.dtype, layout.shape, layout.chunk_shape,
                                     writer_aligned_shards(layout, points), layout.compression)
            aid = xxhash.xxh3_128(f"{self.id}\0{name}\0{state}".encode()).hexdigest()
            rel = array_path(self.id, aid)
            if (create is None and self.origin_metadata) or (create is not None and key not in create):
                future = None
            else:
                future = fmt.create_array(self.ctx.location, rel, layout, self.durability.array_context(), shared=True,
                                          wait=False)
                self.durability.touch_file(rel, "zarr.json")
                localwrite.log_object(rel, "zarr.json")
            pending.append((key, aid, rel, layout, pattern, future))
        for key, aid, rel, layout, pattern, future in pending:
            if future is None:  # another rank creates it: the layout stands in for its zarr.json
                self._handles[key] = self._uncreated_array(key, rel, layout)
            else:
                self._handles[key] = fmt.created(future, self.ctx.location, rel,
                                                 f"tensor {key[0]!r} state {key[1]!r}")
            self.sharded[key] = (aid, rel, layout, pattern)

    def open_delta(self, name: str, state: str, base: Any, *, pattern: dict | None, codec: str,
                   stored_nbytes: int) -> None:
        """Register a tensor-state every rank writes as a delta of ``base`` (the parent's ``TensorInfo``, its
        chain included; ``distributed/publish.py``): the base's grid with ``codec``'s chain, the same array id
        on every rank; the origin writes its zarr.json in ``finish`` and records an ``xor`` row."""
        import xxhash

        from ucp_store.io import deltaio
        from ucp_store.records import ArrayRef, TensorInfo

        key = (name, state)
        layout = deltaio.delta_layout(fmt.ArrayLayout.from_catalog(base.dtype, base.shape, base.chunk_shape,
                                                                   base.shard_shape, base.codecs), codec)
        aid = xxhash.xxh3_128(f"{self.id}\0{name}\0{state}".encode()).hexdigest()
        rel = array_path(self.id, aid)
        chain = (ArrayRef(base.array, base.array_id, base.codecs, base.encoding), *base.bases)
        info = TensorInfo.from_catalog(name, state, layout.shape, layout.dtype, pattern, layout.chunk_shape,
                                       layout.shard_shape, rel, aid, layout.codecs(), layout.nbytes, "", 0, "xor",
                                       chain)
        self._uncreated.add(key)  # the origin writes the zarr.json (finish); a read-back reconstructs
        self._handles[key] = fmt.LazyArray(lambda: deltaio.DeltaArray(self.ctx.location, info, layout,
                                                                      self.durability.array_context()))
        self.sharded[key] = (aid, rel, layout, pattern)
        self.deltas[key] = (base.array_id, int(stored_nbytes))
        self.durability.touch(rel)

    def add_delta_box(self, name: str, state: str, values: np.ndarray, *, offset, files: Mapping[str, bytes],
                      origin: bool) -> None:
        """One box of an ``open_delta`` tensor-state: its encoded shard files (whole files of the box, written
        here) and the digests of its ``values`` for the content hash."""
        from ucp_store.io import deltaio

        key = (name, state)
        _aid, rel, layout, _pattern = self.sharded[key]
        kv = deltaio.open_kvstore(self.ctx.location, rel, self.durability.array_context())
        for fkey, data in files.items():
            localwrite.log_object(rel, fkey)
            self.arrays.window.submit(kv.write(fkey, data), len(data), (None, f"tensor {name!r} state {state!r}"))
        self._digest_region(key, layout, tuple(offset), np.ascontiguousarray(values))
        if origin:
            self.origin.add(key)

    def _digest_region(self, key, layout: fmt.ArrayLayout, offset, array: np.ndarray) -> None:
        """Digest every unit of the content hash that lies wholly inside the box (``fmt.box_unit_digests``), so
        that the origin rank reads back only the units that no box held whole."""
        digests = self._unit_digests.setdefault(key, {})
        if digests is not None:
            fmt.box_unit_digests(layout.dtype, layout.shape, tuple(offset), array, digests)

    def region_digests(self) -> dict:
        """``{(name, state): {unit: digest}}`` of the units of the content hash (``fmt.box_unit_digests``) that
        boxes of this writer held whole; waits for the writes in flight first (the local write path digests
        as it writes)."""
        self.arrays.drain()
        return dict(self._unit_digests)

    def set_region_hash(self, name: str, state: str, content_hash: str) -> None:
        """The content hash of a region-written array, computed from every rank's unit digests
        (``fmt.units_hash``); the origin rank's ``finish_shards`` then records it instead of reading back."""
        self._region_hashes[(name, state)] = content_hash

    def shard_digests(self) -> dict:
        """``{(name, state): {unit: digest}}`` of the units of the content hash that this writer's
        ``write_shard(digest=True)`` boxes held whole (see ``set_chunk_digests``). Waits for the writes in
        flight first: the write pool digests the units of whole shard files it writes."""
        self.arrays.drain()
        return {k: dict(v) for k, v in self._shard_digests.items()}

    def set_chunk_digests(self, name: str, state: str, digests: dict) -> None:
        """Every rank's ``shard_digests`` (or ``region_digests``) of one tensor-state, merged: the origin rank's
        ``finish_shards`` hashes the array from them (``fmt.HASH_PREFIX``), reading back only the units
        missing here."""
        self._chunk_digests[(name, state)] = dict(digests)

    def _known_array(self, key, dtype: str, shape, who: str, earlier: str):
        """The array an earlier shard or box of ``key`` opened: (handle, layout, path, id); every writer of a
        tensor-state must declare its dtype and logical shape alike."""
        aid, rel, layout, _ = self.sharded[key]
        if layout.dtype != dtype or layout.shape != shape:
            raise ShapeMismatch(f"{who} declares {dtype}{list(shape)}, earlier {earlier} "
                                f"{layout.dtype}{list(layout.shape)}")
        return self._handles[key], layout, rel, aid

    def open_shards(self, specs: Iterable[tuple], *, topology, targets: Iterable = (),
                    create: Container | None = None) -> None:
        """``CheckpointWriter.open_shards``: create or open, all at once, the arrays of many
        tensor-states ahead of their ``write_shard`` calls (only the keys in ``create`` are created, when given)."""
        from ucp_store.topology import as_topology

        topology = as_topology(topology)
        targets = list(targets)
        pending = []
        keys: set[tuple[str, str]] = set()
        for name, state, shape, dtype, pattern in specs:
            key = (name, state)
            if key in self.sharded or key in self._handles or key in keys:
                continue
            keys.add(key)
            shape = tuple(int(s) for s in shape)
            dt = dtypes.zarr_name(dtype, what=f"tensor {name!r} state {state!r}")
            layout, rel, aid = self._shard_layout(name, state, shape, dt, pattern, topology, targets)
            if (create is None and self.origin_metadata) or (create is not None and key not in create):
                self._handles[key] = self._uncreated_array(key, rel, layout)
                self._opened[key] = (layout, rel, aid)
                continue
            pending.append((key, layout, rel, aid))
        if self.durability.deferred:
            # deferred durability on a local store: every zarr.json written directly (by each rank that writes to
            # the array: the same bytes, renamed into place), made durable by flush
            handles = fmt.create_local_arrays(self.ctx.location, [(rel, layout) for _, layout, rel, _ in pending],
                                              self.durability.array_context())
        else:
            futures = [fmt.create_array(self.ctx.location, rel, layout, self.durability.array_context(), shared=True,
                                        wait=False) for _, layout, rel, _ in pending]
            handles = [fmt.created(f, self.ctx.location, rel, f"tensor {key[0]!r} state {key[1]!r}")
                       for f, (key, _, rel, _) in zip(futures, pending)]
        for (key, layout, rel, aid), handle in zip(pending, handles):
            self.durability.touch_file(rel, "zarr.json")
            localwrite.log_object(rel, "zarr.json")
            self._handles[key] = handle
            self._opened[key] = (layout, rel, aid)

    def _sharded_array(self, name, state, shape, dtype, pattern, topology, targets):
        key = (name, state)
        if key in self.sharded:
            return self._known_array(key, dtype, shape, f"tensor {name!r} state {state!r}: shard", "shards")
        if key in self._opened:  # open_shards created it: same layout, or the caller declared another one
            layout, rel, aid = self._opened[key]
            if layout.dtype != dtype or layout.shape != shape:
                raise ShapeMismatch(f"tensor {name!r} state {state!r}: shard declares {dtype}{list(shape)}, "
                                    f"open_shards {layout.dtype}{list(layout.shape)}")
            return self._handles[key], layout, rel, aid
        layout, rel, aid = self._shard_layout(name, state, shape, dtype, pattern, topology, targets)
        if self.origin_metadata:  # the origin writes its zarr.json in finish_shards
            handle = self._uncreated_array(key, rel, layout)
        else:
            self.durability.touch_file(rel, "zarr.json")
            handle = fmt.create_array(self.ctx.location, rel, layout, self.durability.array_context(), shared=True,
                                      what=f"tensor {name!r} state {state!r}")
            localwrite.log_object(rel, "zarr.json")
        self._handles[key] = handle
        return handle, layout, rel, aid

    def _shard_layout(self, name, state, shape, dtype, pattern, topology, targets):
        """(layout, path, array id) of a sharded tensor-state: every rank derives the same ones."""
        import xxhash

        from ucp_store.plan.planner import chunk_alignment, split_points

        topologies = [topology, *targets]
        units = {}
        if shape:
            points = split_points(pattern, shape, topologies)
            align = chunk_alignment(pattern, shape, topologies, itemsize=dtypes.itemsize(dtype))
            units = {d: a for d, a in enumerate(align) if points[d]}
        layout = self.arrays.layout(shape, dtype, pattern, units=units)
        source_points = {d: p for d, p in enumerate(split_points(pattern, shape, [topology])) if p} if shape else {}
        shards = writer_aligned_shards(layout, source_points)
        if self.straddling is not None and topology.zero_stage and topology.dp > 1:
            # flat fragments from several ranks: smaller files, so few bytes of cut ones move to their owner (one
            # writer, as a single-process import is, keeps the planned files)
            shards = fragment_shards(fmt.ArrayLayout(layout.dtype, layout.shape, layout.chunk_shape, shards,
                                                     layout.compression), topology.dp)
        layout = fmt.ArrayLayout(layout.dtype, layout.shape, layout.chunk_shape, shards, layout.compression)
        # every rank derives the same array id, so all of them open one array
        aid = xxhash.xxh3_128(f"{self.id}\0{name}\0{state}".encode()).hexdigest()
        return layout, array_path(self.id, aid), aid

    def _uncreated_array(self, key: tuple[str, str], rel: str, layout: fmt.ArrayLayout) -> Any:
        """A handle of an array whose zarr.json this writer does not write now (no I/O: the layout stands in)."""
        self._uncreated.add(key)
        return fmt.LazyArray(lambda: fmt.open_array(self.ctx.location, rel, layout, self.durability.array_context()))

    def _create_uncreated(self, keys: list[tuple[str, str]]) -> None:
        """Write the zarr.json of the arrays among ``keys`` (this writer is their origin) opened uncreated."""
        todo = [(key, self.sharded[key][1], self.sharded[key][2]) for key in keys if key in self._uncreated]
        if not todo:
            return
        if self.durability.deferred:
            fmt.create_local_arrays(self.ctx.location, [(rel, layout) for _, rel, layout in todo],
                                    self.durability.array_context())
        else:
            futures = [fmt.create_array(self.ctx.location, rel, layout, self.durability.array_context(), shared=True,
                                        wait=False) for _, rel, layout in todo]
            for f, (key, rel, _) in zip(futures, todo):
                fmt.created(f, self.ctx.location, rel, f"tensor {key[0]!r} state {key[1]!r}")
        for key, rel, _ in todo:
            if self.durability.deferred:  # an fsync pass that ran since the array was opened did not see this file
                self.durability.touch_file(rel, "zarr.json")
            localwrite.log_object(rel, "zarr.json")
            self._uncreated.discard(key)

    def finish(self) -> None:
        """``CheckpointWriter.finish_shards``: hash the arrays this rank is origin of (after every rank wrote)
        and add their rows (an array whose content is stored already is dropped and referenced)."""
        self.arrays.drain()
        self._create_uncreated(sorted(self.origin))
        hashes: dict[tuple[str, str], str] = {}
        for key in sorted(self.origin):
            aid, rel, layout, pattern = self.sharded[key]
            handle = self._handles[key]
            h = self._region_hashes.get(key)
            if h is None and key in self._chunk_digests:
                h = self._tree_hash(key, handle, layout, rel)
            if h is None:
                h = self._read_back_hash(handle, layout, rel, f"tensor {key[0]!r} state {key[1]!r}")
            hashes[key] = h
        self.dedup.lookup_hashes([h for h in hashes.values() if h not in self.dedup.local_arrays])  # one query for all
        for key, h in hashes.items():
            aid, rel, layout, pattern = self.sharded[key]
            existing = self.dedup.find(h, layout.dtype, layout.shape)
            if existing is not None:
                self.ctx.location.delete_tree(rel)  # identical content is already stored
                array_id = existing
            else:
                base, stored = self.deltas.get(key, (None, None))
                self.rows.append(m.Array(id=aid, path=rel, dtype=layout.dtype, shape=list(layout.shape),
                                          chunk_shape=list(layout.chunk_shape), shard_shape=list(layout.shard_shape),
                                          codecs=layout.codecs(), nbytes=layout.nbytes, content_hash=h, status="ready",
                                          **({} if base is None else {"encoding": "xor", "base_array_id": base,
                                                                      "stored_nbytes": stored})))
                array_id = aid
                self.dedup.local_arrays[h] = aid  # later identical arrays of this save reference it
            self.rows.append(m.Tensor(checkpoint_id=self.id, name=key[0], state=key[1], array_id=array_id,
                                       shape=list(layout.shape), dtype=layout.dtype, pattern=pattern,
                                       nbytes=layout.nbytes, content_hash=h,
                                       position=self.positions.of(key, self._shard_positions.get(key)),
                                       layer=layer_of(pattern)))
        self.origin.clear()

    def _tree_hash(self, key, handle, layout: fmt.ArrayLayout, rel: str) -> str:
        """The content hash of a sharded array from the merged unit digests; units that no single write held
        whole (a ZeRO fragment boundary, a box cutting rows) are read back and digested. When most are
        missing (boxes that cut every row), the whole array is read back in order instead."""
        digests = dict(self._chunk_digests[key])
        missing = fmt.missing_units(layout.dtype, layout.shape, digests)
        what = f"tensor {key[0]!r} state {key[1]!r}"
        if 2 * len(missing) > max(1, len(digests) + len(missing)):
            return self._read_back_hash(handle, layout, rel, what)
        url = self.ctx.array_url(rel)
        fmt.read_missing_units(layout.dtype, layout.shape, digests,
                               lambda box: fmt.read_box(handle, layout, box, what=what, array_url=url))
        h = fmt.units_hash(layout.dtype, layout.shape, digests)
        assert h is not None  # every unit has a digest now
        return h

    def _read_back_hash(self, handle, layout: fmt.ArrayLayout, rel: str, what: str) -> str:
        hasher = fmt.ContentHasher(layout.dtype, layout.shape)
        for box in fmt.slabs(layout):
            hasher.update(fmt.read_box(handle, layout, box, what=what, array_url=self.ctx.array_url(rel)))
        return hasher.hexdigest()

