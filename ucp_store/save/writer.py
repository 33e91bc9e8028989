"""The checkpoint writer: tensor-states and objects into one pending version, then one commit.

Commit protocol (why a crashed save is never listed):
1. ``Store.begin`` inserts a ``pending`` checkpoint row naming its owner (host, pid).
2. Each tensor-state is hashed, then either references an existing ready array with the same
   content (dedup) or is written to a fresh array at ``location.array_path(checkpoint, array)``.
   TensorStore's file kvstore writes by atomic rename, so an array is durable when its write returns.
   Writes run asynchronously in a bounded-bytes window (``_window.FutureWindow``).
3. Rows (arrays, tensors, objects) are inserted under the pending checkpoint in batches (``flush``).
4. ``commit`` waits for every write, then flips the status to ``committed`` in one transaction.
``write_shard`` is the sharded variant: every rank of a source topology writes its own share straight
into the logical arrays; the rank holding element 0 of an array hashes and records it (``finish_shards``).
A pending checkpoint whose owner died is removed by ``gc`` with everything it wrote.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
from collections.abc import Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sqlalchemy import exists, func, insert, select
from sqlalchemy.exc import IntegrityError

from ucp_store import dtypes, names
from ucp_store._killpoints import killpoint
from ucp_store.catalog import models as m
from ucp_store.errors import (
    CommitRaceError,
    DuplicateEntryError,
    ShapeMismatch,
    ValidationError,
    WriteError,
    WriterClosedError,
)
from ucp_store.io import format as fmt
from ucp_store.io import localwrite
from ucp_store.io.location import array_path
from ucp_store.io.window import FutureWindow

if TYPE_CHECKING:  # pragma: no cover
    from ucp_store.store import Store

__all__ = ["CheckpointWriter", "layer_of"]

_ROW_BATCH = 512
_TARGETED_LOOKUPS = 8  # a writer's catalog lookups of single content hashes before it reads them all at once
_MAX_INFLIGHT_BYTES = 1 << 30
_SNAPSHOT_PIECE = 4 << 20  # write()'s copy is hashed a piece at a time, while the piece is still in cache
_SYNC_WORKERS = 16  # concurrent fsyncs of a deferred-durability pass (the journal commits them together)
#: the most elements one tensor-state may have (256 Ti: 1 PiB of fp32). A larger shape is a bad input
#: (a corrupt header, a stride-0 view of 2^62 elements), refused before a byte is hashed or allocated.
MAX_ELEMENTS = 1 << 48


def check_extent(shape, what: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints of at most :data:`MAX_ELEMENTS` elements, or a ValidationError."""
    try:
        dims = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise ValidationError(f"{what}: shape {shape!r} is not a sequence of integers") from None
    if any(d < 0 for d in dims):
        raise ValidationError(f"{what}: shape {list(dims)} has a negative dimension")
    n = math.prod(dims)
    if n > MAX_ELEMENTS:
        raise ValidationError(f"{what}: shape {list(dims)} has {n} elements (~2^{n.bit_length() - 1}); a "
                              f"tensor-state holds at most 2^48 ({MAX_ELEMENTS})")
    return dims


#: pattern JSON texts that passed the schema (the schema check is the slow half of pattern validation)
_SCHEMA_CHECKED: set[str] = set()


def layer_of(pattern: dict | None) -> int | None:
    """The catalog's ``tensors.layer``: the pattern's placement layer, or None."""
    if pattern is None:
        return None
    from ucp_store.patterns import parse_pattern

    return parse_pattern(pattern).layer


def _utcnow():
    import datetime as _dt

    return _dt.datetime.now(_dt.UTC)


class CheckpointWriter:
    """Writes tensor-states and objects into one pending checkpoint; ``commit`` makes it visible."""

    def __init__(self, store: "Store", checkpoint_id: str, *, owner: bool):
        self.store = store
        self.id = checkpoint_id
        self.owner = owner
        self._rows: list = []
        # (future, (array kept alive until written, what)) in flight, at most _MAX_INFLIGHT_BYTES
        self._window: FutureWindow[tuple[Any, str]] = FutureWindow(_MAX_INFLIGHT_BYTES, self._complete_write)
        self._seen: set[tuple[str, str]] = set()
        self._objects: set[str] = set()
        self._local_arrays: dict[str, str] = {}  # content hash -> array id written by this writer
        self._position = 0
        self._closed = False
        self.checkpoint: Any = None
        self.nbytes = 0
        self._sharded: dict[tuple[str, str], tuple] = {}  # (name, state) -> (array id, path, layout, pattern)
        self._handles: dict[tuple[str, str], Any] = {}
        self._origin: set[tuple[str, str]] = set()
        self._committed_hashes: dict[str, list] | None = None
        self._hash_lookups: dict[str, list] = {}  # _dedup's targeted lookups: content hash -> committed arrays
        self._lookups = 0
        # committed arrays this writer deduplicated against, with the data in hand, until its rows are
        # flushed: array id -> (array, dtype, pattern, what, content hash)
        self._borrowed: dict[str, tuple] = {}
        self._shard_positions: dict[tuple[str, str], int] = {}  # write_shard(position=...)
        self._region_digests: dict[tuple[str, str], dict | None] = {}
        self._region_hashes: dict[tuple[str, str], str] = {}
        # write_shard(digest=True): inner-chunk digests of what this rank wrote, computed from memory
        self._shard_digests: dict[tuple[str, str], dict] = {}
        self._chunk_digests: dict[tuple[str, str], dict] = {}  # set_chunk_digests: every rank's, merged
        self._opened: dict[tuple[str, str], tuple] = {}  # open_shards: (layout, path, array id) before any write
        # arrays opened without writing their zarr.json (another rank, or this one as origin in finish_shards,
        # writes it: one writer per object)
        self._uncreated: set[tuple[str, str]] = set()
        self._origin_metadata = False  # origin_writes_metadata()
        # defer_durability: the context arrays are written with, and the array folders not yet made durable
        self._context: Any = None
        self._unsynced: set[str] | None = None
        self._local_folders: dict[tuple[str, str], str | None] = {}  # localwrite folder of an array, or None
        self._local_dirs: set[str] = set()  # folders whose entries localwrite changed: fsynced once in _drain

    # context manager: commit on success (owner) / flush (joined rank); abort on error
    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.owner:
            self.commit()
        else:
            self.close()

    def _array_context(self) -> Any:
        return self._context if self._context is not None else self.store.context

    def _touch(self, rel: str) -> None:
        if self._unsynced is not None:
            self._unsynced.add(rel)

    def defer_durability(self) -> bool:
        """Local stores: write arrays without an fsync per file and per folder (TensorStore's default); instead
        :meth:`flush` makes every file and folder this writer wrote durable in one parallel fsync pass, before
        it records any row (so a row never names data that a crash could lose; commit comes after). Many small
        files per save (one zarr.json and a few shard files per array) then cost one round of concurrent
        fsyncs, which the file system's journal commits together, instead of one journal commit each.
        Returns False (nothing changes) for a bucket, where a completed PUT is durable already."""
        self._check_open()
        if self.store.location.kind != "file":
            return False
        if self._unsynced is None:
            self._drain()
            self._context = self.store.unsynced_context
            self._unsynced = set()
        return True

    def _make_durable(self) -> None:
        """fsync every file and folder under the array folders written since the last pass, and the folders
        that hold them (the checkpoint's folder, the arrays folder), in parallel."""
        if not self._unsynced:
            return
        rels, self._unsynced = sorted(self._unsynced), set()
        self._sync_rels(rels)

    def make_durable_async(self):
        """Start, on a thread, the fsync pass over what was written until now (call after the writes returned:
        ``drain``); returns its Future (``result()`` re-raises a failure). What is written later goes to the
        next pass (``commit`` / ``export_rows`` run it), so the caller overlaps this pass with other work."""
        from concurrent.futures import Future

        rels = sorted(self._unsynced or ())
        if self._unsynced is not None:
            self._unsynced = set()
        done: Future = Future()
        if not rels:
            done.set_result(None)
            return done

        def run() -> None:
            try:
                self._sync_rels(rels)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the pass
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=run, name="ucp-durable", daemon=True).start()
        return done

    def _sync_rels(self, rels: list[str]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        root = self.store.location.root
        paths: list[str] = []
        for rel in rels:
            top = os.path.join(root, rel)
            for folder, _, files in os.walk(top):
                paths.extend(os.path.join(folder, f) for f in files)
                paths.append(folder)
        paths.extend(sorted({os.path.dirname(os.path.join(root, rel).rstrip("/")) for rel in rels}))
        paths.append(os.path.join(root, os.path.dirname(os.path.dirname(rels[0].rstrip("/")))))

        def sync(path: str) -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # another rank's temporary file, renamed meanwhile (that rank syncs it)
                return
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        try:
            with ThreadPoolExecutor(_SYNC_WORKERS, thread_name_prefix="ucp-fsync") as pool:
                list(pool.map(sync, paths))
        except OSError as exc:
            raise WriteError(f"making the arrays of checkpoint {self.id} durable failed: {exc}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError(f"checkpoint writer {self.id} is closed (committed, aborted or closed already)")

    def _layout(self, shape, dtype: str, pattern, boundaries=None, shard_shape=None, units=None) -> fmt.ArrayLayout:
        st = self.store.settings
        return fmt.plan_layout(shape, dtype, pattern=pattern, compression=st["compression"],
                               target_bytes=st["chunk_target_bytes"], boundaries=boundaries, shard_shape=shard_shape,
                               units=units)

    def _dedup(self, h: str, dtype: str, shape) -> str | None:
        """An existing ready array of a committed version with this content, or None.

        The first lookups of a writer ask the catalog for their hash alone (an indexed query; a save that
        writes few whole arrays, or whose sharded arrays are looked up together by ``finish_shards``, never
        reads every committed array's hash); past ``_TARGETED_LOOKUPS`` of them, the committed arrays' hashes
        are read once (one query instead of one per write). An array swept meanwhile by a concurrent rm/gc
        is caught when the rows are recorded."""
        if h in self._local_arrays:
            return self._local_arrays[h]
        for aid, ashape, adtype in self._committed_candidates(h):
            if adtype == dtype and ashape == list(shape):
                return aid
        return None

    def _committed_candidates(self, h: str) -> list:
        if getattr(self.store, "detached", False):  # a non-coordinator rank: the coordinator dedups its rows
            return []
        if self._committed_hashes is not None:
            return self._committed_hashes.get(h, [])
        if h not in self._hash_lookups:
            if self._lookups >= _TARGETED_LOOKUPS:
                with self.store.catalog.session() as s:
                    self._committed_hashes = {}
                    for ch, aid, ashape, adtype in s.execute(self._committed_query()):
                        self._committed_hashes.setdefault(ch, []).append((aid, list(ashape), adtype))
                return self._committed_hashes.get(h, [])
            self._lookup_hashes([h])
        return self._hash_lookups.get(h, [])

    def _committed_query(self, hashes: list[str] | None = None):
        q = (select(m.Array.content_hash, m.Array.id, m.Array.shape, m.Array.dtype)
             .where(m.Array.status == "ready", m.Array.content_hash.is_not(None))
             .where(exists().where(m.Tensor.array_id == m.Array.id, m.Tensor.checkpoint_id == m.Checkpoint.id,
                                   m.Checkpoint.status == "committed")))
        return q if hashes is None else q.where(m.Array.content_hash.in_(hashes))

    def _lookup_hashes(self, hashes: list[str]) -> None:
        """The committed arrays with these content hashes, in one query (kept for ``_dedup``)."""
        todo = sorted({h for h in hashes if h not in self._hash_lookups})
        if not todo or self._committed_hashes is not None or getattr(self.store, "detached", False):
            return
        self._lookups += 1
        for i in range(0, len(todo), 500):
            part = todo[i:i + 500]
            for h in part:
                self._hash_lookups[h] = []
            with self.store.catalog.session() as s:
                for ch, aid, ashape, adtype in s.execute(self._committed_query(part)):
                    self._hash_lookups[ch].append((aid, list(ashape), adtype))

    def _put_array(self, array: np.ndarray, dtype: str, pattern, what: str) -> tuple[str, str, int]:
        """Write (or dedup) one array; returns (array id, content hash, stored bytes written).

        The array is copied first into a buffer this writer owns (once there is room for it in the window of
        writes in flight), and hashed from that copy: the write in flight reads only the copy, so the caller
        may change its tensor as soon as ``write`` returns, and the hash describes exactly the bytes written.
        On a dedup hit the copy is dropped and nothing is written."""
        snapshot, h = self._snapshot(array, dtype)
        local = h in self._local_arrays
        aid = self._dedup(h, dtype, array.shape)
        if aid is not None:
            if not local:  # kept until the rows are flushed, in case a concurrent rm/gc sweeps the array
                self._borrowed.setdefault(aid, (array, dtype, pattern, what, h))
            return aid, h, 0
        return self._new_array(snapshot, dtype, pattern, what, h)

    def _snapshot(self, array: np.ndarray, dtype: str) -> tuple[np.ndarray, str]:
        """``(copy of array, its content hash)``: the copy is made, hashed as it is made (a piece at a time,
        while the piece is in cache), after waiting until the window of writes in flight has room for it
        (the back-pressure that bounds the writer's memory; one array larger than the window waits for the
        window to empty)."""
        window = self._window
        while window.max_bytes is not None and len(window) and window.bytes + array.nbytes > window.max_bytes:
            window.complete_one()
        copy = np.empty(array.shape, array.dtype)
        hasher = fmt.ContentHasher(dtype, array.shape)
        if array.flags.c_contiguous and array.ndim and array.size:
            src, dst = array.reshape(-1), copy.reshape(-1)
            step = hasher.piece(_SNAPSHOT_PIECE // array.itemsize)  # whole blocks of the hash's tiles
            for lo in range(0, src.size, step):
                np.copyto(dst[lo:lo + step], src[lo:lo + step])
                hasher.update(dst[lo:lo + step])
        else:
            np.copyto(copy, array)
            hasher.update(copy)
        return copy, hasher.hexdigest()

    def _new_array(self, array: np.ndarray, dtype: str, pattern, what: str, h: str) -> tuple[str, str, int]:
        layout = self._layout(array.shape, dtype, pattern)
        aid = m.new_id(32)
        rel = array_path(self.id, aid)
        self._touch(rel)
        handle = fmt.create_array(self.store.location, rel, layout, self._array_context(), what=what)
        localwrite.log_object(rel, "zarr.json")
        localwrite.log_box(rel, layout, (0,) * array.ndim, tuple(array.shape))
        killpoint("write.array_created")
        self._rows.append(m.Array(id=aid, path=rel, dtype=dtype, shape=list(layout.shape),
                                  chunk_shape=list(layout.chunk_shape), shard_shape=list(layout.shard_shape),
                                  codecs=layout.codecs(), nbytes=layout.nbytes, content_hash=h, status="ready"))
        self._local_arrays[h] = aid
        self._window.submit(handle.write(array), array.nbytes, (array, what))
        return aid, h, array.nbytes

    def _complete_write(self, future: Any, item: tuple[Any, str]) -> None:
        try:
            future.result()
        except Exception as exc:  # TensorStore raises ValueError with the kvstore's message
            raise WriteError(f"writing {item[1]} into checkpoint {self.id} failed: {exc}") from None
        killpoint("write.array_written")

    def _drain(self) -> None:
        self._window.drain()
        if self._local_dirs:  # the renamed shard files' folder entries: durable before anyone relies on them
            dirs, self._local_dirs = self._local_dirs, set()
            try:
                localwrite.sync_dirs(dirs)
            except OSError as exc:
                raise WriteError(f"checkpoint {self.id}: syncing its array folders failed: {exc}") from None

    def write(self, name: str, state: str, tensor: torch.Tensor | np.ndarray, *, pattern: dict | None = None,
              expect_shape=None, expect_dtype=None, position: int | None = None) -> None:
        """Store one tensor-state (bit-exact, native dtype). ``pattern`` says how it maps onto ranks.

        ``position`` orders tensor-states in the checkpoint (the planner lays ZeRO groups out in this
        order); by default the order of writing. Distributed writers pass the global parameter order."""
        self._check_open()
        names.tensor_name(name)
        names.state_name(state)
        what = f"tensor {name!r} state {state!r}"
        if (name, state) in self._seen:
            raise DuplicateEntryError(f"{what} was already written to checkpoint {self.id}")
        if isinstance(tensor, torch.Tensor | np.ndarray):
            check_extent(tensor.shape, what)
        if isinstance(tensor, torch.Tensor):
            array = dtypes.to_numpy(tensor, what=what)
        elif isinstance(tensor, np.ndarray):
            dtypes.zarr_name(tensor.dtype, what=what)
            array = np.require(tensor, requirements="C")
        else:
            raise ValidationError(f"{what}: expected a torch.Tensor or numpy array, got {type(tensor).__name__}")
        dtype = dtypes.zarr_name(array.dtype, what=what)
        if expect_shape is not None and tuple(expect_shape) != tuple(array.shape):
            raise ShapeMismatch(f"{what}: shape {tuple(array.shape)} does not match the declared {tuple(expect_shape)}")
        if expect_dtype is not None and dtypes.zarr_name(expect_dtype) != dtype:
            raise ShapeMismatch(f"{what}: dtype {dtype} does not match the declared {dtypes.zarr_name(expect_dtype)}")
        if pattern is not None:
            self._validate_pattern(name, pattern, array.shape)
        aid, h, _ = self._put_array(array, dtype, pattern, what)
        self._seen.add((name, state))
        self._rows.append(m.Tensor(checkpoint_id=self.id, name=name, state=state, array_id=aid, shape=list(array.shape),
                                   dtype=dtype, pattern=pattern, nbytes=array.nbytes, content_hash=h,
                                   position=self._next_position() if position is None else int(position),
                                   layer=layer_of(pattern)))
        self.nbytes += array.nbytes
        if len(self._rows) >= _ROW_BATCH:
            self.flush()
        return None

    def _next_position(self) -> int:
        self._position += 1
        return self._position

    @staticmethod
    def _validate_pattern(name: str, pattern: dict, shape) -> None:
        """Schema first (clear field paths), then the algebra's own checks against the shape."""
        from ucp_store import patterns as pat
        from ucp_store.schema import validate

        text = json.dumps(pattern, sort_keys=True)
        if text not in _SCHEMA_CHECKED:  # many tensors share one pattern (all of a mesh's Shard(0) DTensors)
            validate("pattern", pattern)
            if len(_SCHEMA_CHECKED) > 4096:
                _SCHEMA_CHECKED.clear()
            _SCHEMA_CHECKED.add(text)
        pat.check_pattern(pattern, tuple(shape), name=name)

    # --- sharded writes: each rank writes its shards straight into the logical arrays ---------------
    def write_shard(self, name: str, state: str, local: torch.Tensor, *, shape, pattern: dict | None,
                    topology, rank: int, fragment=None, targets: Iterable = (), position: int | None = None,
                    digest: bool = False) -> int:
        """Write rank ``rank``'s shard of a tensor-state (its TP-local tensor, or with ``fragment`` its
        ZeRO flat fragment) into the logical array; returns the number of elements written.

        Every rank of the source topology calls this for the tensor-states it holds; only the one rank
        that ``patterns.is_writer`` picks for each element writes it. Inner-chunk boundaries follow the
        split points of the source and ``targets`` topologies, and shard files follow the source split so
        that two ranks never write one shard where the layout allows it; where they must (ZeRO flat
        fragments straddling rows), TensorStore's conditional read-modify-write merges them: sound on a local
        filesystem, not on S3 or NFS (issue 27 item 0: routing those pieces to one writer is still open).
        After every rank has written, each calls ``finish_shards`` (after a barrier) and rank 0 commits.
        ``position`` orders the tensor-state like ``write``'s (every rank passes the same global order);
        by default the order in which the origin rank records it.
        ``digest``: also digest, from memory, every unit of the content hash (``fmt.box_unit_digests``) that
        lies wholly inside one of the boxes written (``shard_digests``); once every rank's are merged into
        ``set_chunk_digests``, the origin rank hashes the array reading back only the units no single write
        held whole. The hash is the one every save path records (``fmt.HASH_PREFIX``), so identical bits
        saved through ``write`` and through here deduplicate.

        Unlike ``write``, this writes straight from ``local`` (no copy: the DeepSpeed engine and the
        distributed saves hand over buffers they own): the caller must not change ``local`` until
        :meth:`drain` returns (or ``shard_digests``, ``finish_shards``, ``flush``, ``export_rows`` or
        ``commit``, which drain first). Digests and writes both read ``local`` before then, and the origin
        reads back from the stored array whatever no digest covers, so the hash is of the bytes written.
        """
        from ucp_store import patterns as pat
        from ucp_store.topology import as_topology

        self._check_open()
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
            self._validate_pattern(name, pattern, shape)
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
        folder = None if self._unsynced is None else self._local_folder((name, state), rel, layout)
        for box, data in copies:
            offset = tuple(lo for lo, _ in box.ranges)
            localwrite.log_box(rel, layout, offset, tuple(data.shape))
            if folder is not None and localwrite.whole_shards(layout, offset, tuple(data.shape)):
                # whole shards of a local store with deferred durability: their files straight from memory; the
                # write pool digests each chunk from the copy it writes (not this thread, one more pass over it)
                self._submit_local_shards(folder, layout, offset, data,
                                          self._shard_digests.setdefault((name, state), {}) if digest else None, what)
            else:
                self._window.submit(handle[box.slices()].write(data), data.nbytes, (data, what))
                if digest:
                    fmt.box_unit_digests(dtype, shape, offset, data, self._shard_digests.setdefault((name, state), {}))
            written += data.size
            killpoint("write.shard_box")
        self._sharded.setdefault((name, state), (aid, rel, layout, pattern))
        if position is not None:
            self._shard_positions[(name, state)] = int(position)
        if any(all(lo == 0 for lo, _ in box.ranges) for box, _ in copies) or (not shape and copies):
            self._origin.add((name, state))  # this rank records the row (it wrote element 0)
        return written

    def write_region(self, name: str, state: str, local: torch.Tensor | np.ndarray, *, shape, offset,
                     pattern: dict | None, boundaries: Mapping[int, Iterable[int]] | None = None,
                     origin: bool = False) -> int:
        """Write one box of a tensor-state, ``local`` at ``offset`` of the logical ``shape``; returns elements.

        For sources that know each rank's boxes themselves (DTensor shards: ``ucp_store.distributed``). Every
        rank that writes a box of the tensor-state passes the same ``shape``, dtype, ``pattern`` and
        ``boundaries`` (the split points of all writers), so all derive one array id and one layout;
        chunks and shard files are cut at ``boundaries`` so writers own whole files where they can.
        The caller guarantees one writer per element (replicas write once). Exactly one rank passes
        ``origin=True`` (the one writing element 0, or any one rank for an empty tensor): after the
        barrier it hashes the array and records the row in ``finish_shards``, deduplicating against
        committed arrays with the same content.

        Like ``write_shard``, this writes straight from ``local`` (no copy): the caller must not change it until
        :meth:`drain` returns (or ``region_digests``, ``finish_shards``, ``flush``, ``export_rows`` or
        ``commit``). The unit digests (``fmt.box_unit_digests``) are taken from ``local`` before then, and
        units no box held whole are read back from the stored array by the origin."""
        self._check_open()
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
            self._validate_pattern(name, pattern, shape)
        key = (name, state)
        if key not in self._sharded:
            self.open_regions([(name, state, dtype, shape, pattern, boundaries)])
        handle, layout, rel, aid = self._known_array(key, dtype, shape, f"{what}: box", "boxes")
        if array.size:
            localwrite.log_box(rel, layout, offset, tuple(array.shape))
            folder = self._local_folder(key, rel, layout)
            if folder is not None and localwrite.whole_shards(layout, offset, tuple(array.shape)):
                # this rank owns whole shard files: written here, each chunk copied once (crc, digest, writev)
                self._submit_local_shards(folder, layout, offset, array, self._region_digests.setdefault(key, {}),
                                          what)
            else:
                box = tuple(slice(o, o + n) for o, n in zip(offset, array.shape))
                future = handle[box].write(array) if box else handle.write(array)
                self._window.submit(future, array.nbytes, (array, what))
                self._digest_region(key, layout, offset, array)
        if origin:
            self._origin.add(key)
        return int(array.size)

    def _local_folder(self, key: tuple[str, str], rel: str, layout: fmt.ArrayLayout) -> str | None:
        folder = self._local_folders.get(key, "")
        if folder == "":
            folder = self._local_folders[key] = localwrite.local_folder(self.store.location, rel, layout)
        return folder

    def _submit_local_shards(self, folder: str, layout: fmt.ArrayLayout, offset: tuple[int, ...], array: np.ndarray,
                             digests: dict | None, what: str) -> None:
        """The shard files of a ``localwrite.whole_shards`` box, on the write pool. Durable per file (folders
        once, in ``_drain``), or, when this writer defers durability, left to ``flush``'s single pass."""
        deferred = self._unsynced is not None
        dirs: set[str] = set() if deferred else self._local_dirs
        shape = tuple(array.shape)
        for shard in localwrite.shard_boxes(layout, offset, shape):
            future = localwrite.submit(localwrite.write_shard_file, folder, layout, shard, array, offset, digests,
                                       dirs, not deferred)
            self._window.submit(future, min(array.nbytes, math.prod(layout.shard_shape) * array.itemsize),
                                (array, what))

    def open_regions(self, specs: Iterable[tuple], *, create: Container | None = None) -> None:
        """Create (or open, when another rank did) the arrays that ``write_region`` boxes will go to, all at
        once: ``specs`` are ``(name, state, dtype, shape, pattern, boundaries)`` as ``write_region`` takes
        them (dtype as a store dtype name), optionally with a seventh ``units`` (``chunking.choose_chunking``'s
        aligned extent per dim, for a caller that knows the likely splits better than the pattern says).
        Arrays already open are skipped; creating them concurrently saves one metadata round trip per
        tensor-state on the caller's clock.
        ``create``: the ``(name, state)`` keys this writer creates (writes ``zarr.json`` of); the others are
        opened on the layout alone, with no I/O, for a multi-rank save that gives each ``zarr.json`` one
        writer (the origin's). ``None``: create every array, or open it when another writer did."""
        import xxhash

        pending: list[tuple] = []
        for name, state, dtype, shape, pattern, boundaries, *units in specs:
            key = (name, state)
            if key in self._sharded or any(k == key for k, *_ in pending):
                continue
            shape = tuple(int(x) for x in shape)
            if pattern is not None:
                self._validate_pattern(name, pattern, shape)
            points = {int(d): [int(p) for p in v] for d, v in (boundaries or {}).items()}
            layout = self._layout(shape, dtype, pattern, boundaries=points or None, units=units[0] if units else None)
            layout = fmt.ArrayLayout(layout.dtype, layout.shape, layout.chunk_shape,
                                     _writer_aligned_shards(layout, points), layout.compression)
            aid = xxhash.xxh3_128(f"{self.id}\0{name}\0{state}".encode()).hexdigest()
            rel = array_path(self.id, aid)
            self._touch(rel)
            if (create is None and self._origin_metadata) or (create is not None and key not in create):
                future = None
            else:
                future = fmt.create_array(self.store.location, rel, layout, self._array_context(), shared=True,
                                          wait=False)
                localwrite.log_object(rel, "zarr.json")
            pending.append((key, aid, rel, layout, pattern, future))
        for key, aid, rel, layout, pattern, future in pending:
            if future is None:  # another rank creates it: the layout stands in for its zarr.json
                self._handles[key] = self._uncreated_array(key, rel, layout)
            else:
                self._handles[key] = fmt.created(future, self.store.location, rel,
                                                 f"tensor {key[0]!r} state {key[1]!r}")
            self._sharded[key] = (aid, rel, layout, pattern)

    def _digest_region(self, key, layout: fmt.ArrayLayout, offset, array: np.ndarray) -> None:
        """Digest every unit of the content hash that lies wholly inside the box (``fmt.box_unit_digests``), so
        that the origin rank reads back only the units that no box held whole."""
        digests = self._region_digests.setdefault(key, {})
        if digests is not None:
            fmt.box_unit_digests(layout.dtype, layout.shape, tuple(offset), array, digests)

    def drain(self) -> None:
        """Wait for every array write in flight; the first failure raises here (a ``WriteError``)."""
        self._drain()

    def region_digests(self) -> dict:
        """``{(name, state): {unit: digest}}`` of the units of the content hash (``fmt.box_unit_digests``) that
        boxes of this writer held whole; waits for the writes in flight first (the local write path digests
        as it writes)."""
        self._drain()
        return dict(self._region_digests)

    def set_region_hash(self, name: str, state: str, content_hash: str) -> None:
        """The content hash of a region-written array, computed from every rank's unit digests
        (``fmt.units_hash``); the origin rank's ``finish_shards`` then records it instead of reading back."""
        self._region_hashes[(name, state)] = content_hash

    def shard_digests(self) -> dict:
        """``{(name, state): {unit: digest}}`` of the units of the content hash that this writer's
        ``write_shard(digest=True)`` boxes held whole (see ``set_chunk_digests``). Waits for the writes in
        flight first: the write pool digests the units of whole shard files it writes."""
        self._drain()
        return {k: dict(v) for k, v in self._shard_digests.items()}

    def set_chunk_digests(self, name: str, state: str, digests: dict) -> None:
        """Every rank's ``shard_digests`` (or ``region_digests``) of one tensor-state, merged: the origin rank's
        ``finish_shards`` hashes the array from them (``fmt.HASH_PREFIX``), reading back only the units
        missing here."""
        self._chunk_digests[(name, state)] = dict(digests)

    def _known_array(self, key, dtype: str, shape, who: str, earlier: str):
        """The array an earlier shard or box of ``key`` opened: (handle, layout, path, id); every writer of a
        tensor-state must declare its dtype and logical shape alike."""
        aid, rel, layout, _ = self._sharded[key]
        if layout.dtype != dtype or layout.shape != shape:
            raise ShapeMismatch(f"{who} declares {dtype}{list(shape)}, earlier {earlier} "
                                f"{layout.dtype}{list(layout.shape)}")
        return self._handles[key], layout, rel, aid

    def open_shards(self, specs: Iterable[tuple], *, topology, targets: Iterable = (),
                    create: Container | None = None) -> None:
        """Create (or open) the arrays of many tensor-states at once, ahead of their ``write_shard`` calls:
        ``specs`` are ``(name, state, shape, dtype, pattern)`` (dtype a torch or numpy dtype or store name).
        One array open is a metadata write made durable; waited for one by one they dominate a save of
        many parameters, so their futures run together here.
        ``create``: the keys whose ``zarr.json`` this writer writes now; the others are opened on the layout
        alone and the array's origin (the writer of element 0) writes it in ``finish_shards``, so a
        multi-rank save passes ``create=()`` and each ``zarr.json`` has one writer. ``None``: all now."""
        from ucp_store.topology import as_topology

        self._check_open()
        topology = as_topology(topology)
        targets = list(targets)
        pending = []
        keys: set[tuple[str, str]] = set()
        for name, state, shape, dtype, pattern in specs:
            key = (name, state)
            if key in self._sharded or key in self._handles or key in keys:
                continue
            keys.add(key)
            shape = tuple(int(s) for s in shape)
            dt = dtypes.zarr_name(dtype, what=f"tensor {name!r} state {state!r}")
            layout, rel, aid = self._shard_layout(name, state, shape, dt, pattern, topology, targets)
            self._touch(rel)
            if (create is None and self._origin_metadata) or (create is not None and key not in create):
                self._handles[key] = self._uncreated_array(key, rel, layout)
                self._opened[key] = (layout, rel, aid)
                continue
            pending.append((key, layout, rel, aid))
        if self._unsynced is not None:
            # deferred durability on a local store: every zarr.json written directly (by each rank that writes to
            # the array: the same bytes, renamed into place), made durable by flush
            handles = fmt.create_local_arrays(self.store.location, [(rel, layout) for _, layout, rel, _ in pending],
                                              self._array_context())
        else:
            futures = [fmt.create_array(self.store.location, rel, layout, self._array_context(), shared=True,
                                        wait=False) for _, layout, rel, _ in pending]
            handles = [fmt.created(f, self.store.location, rel, f"tensor {key[0]!r} state {key[1]!r}")
                       for f, (key, _, rel, _) in zip(futures, pending)]
        for (key, layout, rel, aid), handle in zip(pending, handles):
            localwrite.log_object(rel, "zarr.json")
            self._handles[key] = handle
            self._opened[key] = (layout, rel, aid)

    def _sharded_array(self, name, state, shape, dtype, pattern, topology, targets):
        key = (name, state)
        if key in self._sharded:
            return self._known_array(key, dtype, shape, f"tensor {name!r} state {state!r}: shard", "shards")
        if key in self._opened:  # open_shards created it: same layout, or the caller declared another one
            layout, rel, aid = self._opened[key]
            if layout.dtype != dtype or layout.shape != shape:
                raise ShapeMismatch(f"tensor {name!r} state {state!r}: shard declares {dtype}{list(shape)}, "
                                    f"open_shards {layout.dtype}{list(layout.shape)}")
            return self._handles[key], layout, rel, aid
        layout, rel, aid = self._shard_layout(name, state, shape, dtype, pattern, topology, targets)
        self._touch(rel)
        if self._origin_metadata:  # the origin writes its zarr.json in finish_shards
            handle = self._uncreated_array(key, rel, layout)
        else:
            handle = fmt.create_array(self.store.location, rel, layout, self._array_context(), shared=True,
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
        layout = self._layout(shape, dtype, pattern, units=units)
        source_points = {d: p for d, p in enumerate(split_points(pattern, shape, [topology])) if p} if shape else {}
        layout = fmt.ArrayLayout(layout.dtype, layout.shape, layout.chunk_shape,
                                 _writer_aligned_shards(layout, source_points), layout.compression)
        # every rank derives the same array id, so all of them open one array
        aid = xxhash.xxh3_128(f"{self.id}\0{name}\0{state}".encode()).hexdigest()
        return layout, array_path(self.id, aid), aid

    def origin_writes_metadata(self) -> None:
        """For one rank of a multi-rank save (``distributed.distributed_begin`` calls it): the arrays of
        ``write_shard`` and ``write_region`` are opened on their layout alone (no I/O) and only the array's
        origin (the rank writing element 0) writes its ``zarr.json``, in ``finish_shards``; ``open_regions``
        and ``open_shards`` called with an explicit ``create`` still create those keys at once. Then no
        ``zarr.json`` has two writers (a conditional create-or-open that S3 and NFS do not make atomic)."""
        self._origin_metadata = True

    def _uncreated_array(self, key: tuple[str, str], rel: str, layout: fmt.ArrayLayout) -> Any:
        """A handle of an array whose zarr.json this writer does not write now (no I/O: the layout stands in)."""
        self._uncreated.add(key)
        return fmt.LazyArray(lambda: fmt.open_array(self.store.location, rel, layout, self._array_context()))

    def _create_uncreated(self, keys: list[tuple[str, str]]) -> None:
        """Write the zarr.json of the arrays among ``keys`` (this writer is their origin) opened uncreated."""
        todo = [(key, self._sharded[key][1], self._sharded[key][2]) for key in keys if key in self._uncreated]
        if not todo:
            return
        if self._unsynced is not None:
            fmt.create_local_arrays(self.store.location, [(rel, layout) for _, rel, layout in todo],
                                    self._array_context())
        else:
            futures = [fmt.create_array(self.store.location, rel, layout, self._array_context(), shared=True,
                                        wait=False) for _, rel, layout in todo]
            for f, (key, rel, _) in zip(futures, todo):
                fmt.created(f, self.store.location, rel, f"tensor {key[0]!r} state {key[1]!r}")
        for key, rel, _ in todo:
            self._touch(rel)  # an fsync pass that ran since the array was opened did not see this file
            localwrite.log_object(rel, "zarr.json")
            self._uncreated.discard(key)

    def finish_shards(self, *, record: bool = True) -> None:
        """After all ranks wrote (barrier first): hash and record the arrays this rank is origin of.
        ``record=False``: their rows stay with the writer (for :meth:`commit` or :meth:`export_rows`)."""
        self._drain()
        self._create_uncreated(sorted(self._origin))
        hashes: dict[tuple[str, str], str] = {}
        for key in sorted(self._origin):
            aid, rel, layout, pattern = self._sharded[key]
            handle = self._handles[key]
            h = self._region_hashes.get(key)
            if h is None and key in self._chunk_digests:
                h = self._tree_hash(key, handle, layout, rel)
            if h is None:
                h = self._read_back_hash(handle, layout, rel, f"tensor {key[0]!r} state {key[1]!r}")
            hashes[key] = h
        self._lookup_hashes([h for h in hashes.values() if h not in self._local_arrays])  # one query for all
        for key, h in hashes.items():
            aid, rel, layout, pattern = self._sharded[key]
            existing = self._dedup(h, layout.dtype, layout.shape)
            if existing is not None:
                self.store.location.delete_tree(rel)  # identical content is already stored
                array_id = existing
            else:
                self._rows.append(m.Array(id=aid, path=rel, dtype=layout.dtype, shape=list(layout.shape),
                                          chunk_shape=list(layout.chunk_shape), shard_shape=list(layout.shard_shape),
                                          codecs=layout.codecs(), nbytes=layout.nbytes, content_hash=h, status="ready"))
                array_id = aid
                self._local_arrays[h] = aid  # later identical arrays of this save reference it
            self._rows.append(m.Tensor(checkpoint_id=self.id, name=key[0], state=key[1], array_id=array_id,
                                       shape=list(layout.shape), dtype=layout.dtype, pattern=pattern,
                                       nbytes=layout.nbytes, content_hash=h,
                                       position=self._shard_positions[key] if key in self._shard_positions
                                       else self._next_position(),
                                       layer=layer_of(pattern)))
        self._origin.clear()
        if record:
            self.flush()

    def _tree_hash(self, key, handle, layout: fmt.ArrayLayout, rel: str) -> str:
        """The content hash of a sharded array from the merged unit digests; units that no single write held
        whole (a ZeRO fragment boundary, a box cutting rows) are read back and digested. When most are
        missing (boxes that cut every row), the whole array is read back in order instead."""
        digests = dict(self._chunk_digests[key])
        missing = fmt.missing_units(layout.dtype, layout.shape, digests)
        what = f"tensor {key[0]!r} state {key[1]!r}"
        if 2 * len(missing) > max(1, len(digests) + len(missing)):
            return self._read_back_hash(handle, layout, rel, what)
        url = self.store.array_url(rel)
        fmt.read_missing_units(layout.dtype, layout.shape, digests,
                               lambda box: fmt.read_box(handle, layout, box, what=what, array_url=url))
        h = fmt.units_hash(layout.dtype, layout.shape, digests)
        assert h is not None  # every unit has a digest now
        return h

    def _read_back_hash(self, handle, layout: fmt.ArrayLayout, rel: str, what: str) -> str:
        hasher = fmt.ContentHasher(layout.dtype, layout.shape)
        for box in fmt.slabs(layout):
            hasher.update(fmt.read_box(handle, layout, box, what=what, array_url=self.store.array_url(rel)))
        return hasher.hexdigest()

    def write_object(self, name: str, value: Any) -> None:
        """Store non-tensor state: JSON (dicts, lists, numbers, strings) or a tensor/array. Never pickle.

        A JSON value reads back exactly (``Checkpoint.objects``), types and signs included; tuples become
        lists, and a dict whose keys JSON would make equal (``1`` and ``"1"``) is refused."""
        self._check_open()
        names.object_name(name)
        if name in self._objects:
            raise DuplicateEntryError(f"object {name!r} was already written to checkpoint {self.id}")
        if isinstance(value, (torch.Tensor, np.ndarray)):
            array = dtypes.to_numpy(value, what=f"object {name!r}") if isinstance(value, torch.Tensor) else value
            dtype = dtypes.zarr_name(array.dtype, what=f"object {name!r}")
            aid, _, _ = self._put_array(np.require(array, requirements="C"), dtype, None, f"object {name!r}")
            row = m.StoredObject(checkpoint_id=self.id, name=name, kind="array", array_id=aid)
        else:
            row = m.StoredObject(checkpoint_id=self.id, name=name, kind="json", value=_check_json(name, value))
        self._objects.add(name)
        self._rows.append(row)

    def _restore_borrowed(self, gone: set[str] | None = None, rows: list | None = None) -> None:
        """Write again, from the data in hand, each committed array this save deduplicated against that a
        concurrent rm/gc swept meanwhile (``gone``, or those the catalog no longer lists), and point the
        pending rows (and ``rows``) at the new copy: a save never needs an array that is gone. The data is
        copied and re-hashed first; if the caller changed it since ``write``, the save aborts."""
        if not self._borrowed:
            return
        if gone is None:
            with self.store.catalog.session() as s:
                gone = set(self._borrowed) - self._existing(s, set(self._borrowed))
        remap: dict[str, str] = {}
        for old in sorted(gone & set(self._borrowed)):
            array, dtype, pattern, what, h = self._borrowed.pop(old)
            copy, again = self._snapshot(array, dtype)
            if again != h:
                raise CommitRaceError(f"{what}: the array it was deduplicated against was removed by a concurrent "
                                      "rm/gc and the tensor was changed in place after write() returned; the save "
                                      "is aborted, retry it")
            self._committed_hashes = None  # stale: it listed the swept array
            self._hash_lookups.clear()
            remap[old] = self._new_array(copy, dtype, pattern, what, h)[0]
        for row in itertools.chain(self._rows, rows or ()):
            if isinstance(row, dict):
                if row.get("array_id") in remap:
                    row["array_id"] = remap[row["array_id"]]
            elif getattr(row, "array_id", None) in remap:
                row.array_id = remap[row.array_id]

    def _existing(self, s, ids: set[str], *, lock: bool = False) -> set[str]:
        """The arrays among ``ids`` the catalog lists. ``lock``: inside a write transaction, also keep a
        concurrent sweep from deleting them until it ends: PostgreSQL takes ``FOR KEY SHARE`` row locks (a
        sweep's DELETE waits, then fails on the foreign key of the rows this transaction inserts and looks
        again); SQLite's write transaction (``BEGIN IMMEDIATE``) already keeps every other writer out."""
        found: set[str] = set()
        ordered = sorted(ids)
        for i in range(0, len(ordered), 500):
            q = select(m.Array.id).where(m.Array.id.in_(ordered[i:i + 500]))
            if lock and self.store.catalog.dialect == "postgresql":
                q = q.with_for_update(key_share=True)
            found.update(s.scalars(q))
        return found

    def _record(self, rows: list, lost: str, then=None):
        """Insert ``rows`` in one write transaction, and run ``then(session)`` in it (commit's status flip);
        returns what ``then`` returns. A committed array the rows deduplicated against that a concurrent
        rm/gc swept before this transaction locked it is written again from the data in hand
        (:meth:`_restore_borrowed`) and the transaction retried, so the save still commits; each retry
        restores at least one array, so this ends."""
        while True:
            try:
                with self.store.catalog.write_session() as s:
                    gone = self._insert_rows(s, rows, lost) if rows else set()
                    if gone:
                        raise _Swept(gone)  # rolls this transaction back
                    return then(s) if then is not None else None
            except _Swept as swept:
                self._restore_borrowed(swept.gone, rows)
                rows.extend(self._rows)  # the rows of the arrays written again
                self._rows = []
                self._drain()
                self._make_durable()  # the arrays written again are durable before a row names them

    def flush(self) -> None:
        """Wait for in-flight writes (and, with ``defer_durability``, make them durable), then record their
        rows under the pending checkpoint."""
        self._settle()
        if not self._rows:
            return
        rows, self._rows = self._rows, []
        self._record(rows, "the save is lost")
        self._borrowed.clear()  # from here the flushed rows reference them: no sweep takes them
        killpoint("flush.after_rows")

    def _settle(self) -> None:
        """Every write of this writer has returned and is durable, and every committed array its rows
        deduplicated against still exists (one swept meanwhile is written again from the data in hand; one
        swept after this check is caught, under lock, when the rows are inserted: :meth:`_record`)."""
        self._drain()
        self._make_durable()
        if self._rows and self._borrowed:
            self._restore_borrowed()
            self._drain()
            self._make_durable()  # the arrays written again are durable before a row names them

    def _insert_rows(self, s, rows: list, lost: str) -> set[str]:
        """Insert ``rows`` (ORM rows or :func:`row_to_dict` dicts) in session ``s`` (one transaction), after
        checking the checkpoint is still pending and that the committed arrays they deduplicated against
        still exist, locked until the transaction ends (:meth:`_existing`). One multi-row INSERT per table
        (no ORM unit of work: a save has hundreds of rows). Returns, inserting nothing, the arrays this
        writer deduplicated against that a concurrent rm/gc removed (the caller writes them again and
        retries); an array another rank's rows deduplicated against is a CommitRaceError (that rank no
        longer holds the data)."""
        killpoint("flush.before_rows")
        ck = s.get(m.Checkpoint, self.id)
        if ck is None or ck.status != "pending":
            raise CommitRaceError(f"checkpoint {self.id} is no longer pending (removed by gc?); {lost}")
        by_kind: dict[str, list[dict]] = {"array": [], "tensor": [], "object": []}
        for r in rows:
            d = r if isinstance(r, dict) else row_to_dict(r)
            by_kind[d["_table"]].append(d)
        # arrays deduplicated against must still exist: a concurrent rm/gc may have swept them
        new_ids = {a["id"] for a in by_kind["array"]}
        wanted = {d["array_id"] for k in ("tensor", "object") for d in by_kind[k] if d.get("array_id")} - new_ids
        gone = wanted - self._existing(s, wanted, lock=True) if wanted else set()
        if gone and gone <= set(self._borrowed):
            return gone
        if gone:
            names_ = ", ".join(sorted(gone - set(self._borrowed)))[:200]
            raise CommitRaceError(f"checkpoint {self.id}: array(s) {names_} that another rank of this save "
                                  "deduplicated against were removed by a concurrent rm/gc after that rank handed "
                                  "its rows over; the save is aborted (nothing is listed), retry it")
        if by_kind["array"]:
            s.execute(insert(m.Array), _insert_params(m.Array, by_kind["array"]))
        killpoint("flush.mid_rows")
        for kind, cls in (("tensor", m.Tensor), ("object", m.StoredObject)):
            if by_kind[kind]:
                s.execute(insert(cls), _insert_params(cls, by_kind[kind]))
        return set()

    def export_rows(self) -> list[dict]:
        """For a joined writer of a distributed save (after every rank's writes returned: a barrier first):
        hash the arrays this rank is origin of, make everything it wrote durable, and hand its rows over as
        plain dicts for the owner's :meth:`commit` (``extra_rows``), which records them in its one
        transaction. The writer is closed after."""
        self._check_open()
        if self._origin:
            self.finish_shards(record=False)
        self._settle()
        rows, self._rows = self._rows, []
        self._closed = True
        return [row_to_dict(r) for r in rows]

    def close(self) -> None:
        """For a joined writer: flush and detach (the owner commits)."""
        if not self._closed:
            if self._origin:
                self.finish_shards()
            self.flush()
            self._closed = True

    def commit(self, *, extra_rows: Iterable[dict] = (), reload: bool = True):
        """Make the checkpoint visible: one transaction, after every array write has returned (and is durable),
        that records the rows not yet flushed and commits. ``extra_rows``: the rows of the joined ranks of a
        distributed save (:meth:`export_rows`), recorded in the same transaction. Returns the committed
        :class:`~ucp_store.registry.checkpoint.Checkpoint` (read back from the catalog), or None with
        ``reload=False``."""
        from ucp_store.registry.checkpoint import Checkpoint

        self._check_open()
        if not self.owner:
            raise WriterClosedError(f"only the process that began checkpoint {self.id} can commit it (this writer "
                                    "joined it: call close())")
        labels: list[str] = []
        try:
            if self._origin:
                self.finish_shards(record=False)
            self._settle()
            rows, self._rows = self._rows, []
            rows.extend(check_row_dict(d) for d in extra_rows)
            # one transaction: the rows still pending (this writer's, and every joined rank's) and the commit
            self._record(rows, "cannot commit", lambda s: self._flip_status(s, labels))
        except IntegrityError as exc:  # the partial unique index: a concurrent commit of the same step won
            self.abort()
            detail = str(getattr(exc, "orig", exc)).splitlines()[0]
            label = labels[0] if labels else f"checkpoint {self.id}'s step"
            raise CommitRaceError(f"checkpoint {self.id}: {label} was committed meanwhile by another save; nothing "
                                  f"of this save is listed ({detail})") from None
        except BaseException:
            self.abort()
            raise
        killpoint("commit.after")
        self._closed = True
        self._borrowed.clear()
        self.checkpoint = Checkpoint(self.store, self.id) if reload else None
        return self.checkpoint

    def _flip_status(self, s, labels: list[str]) -> None:
        """In commit's transaction, after the rows: the checkpoint becomes ``committed`` (the step still free)."""
        ck = s.get(m.Checkpoint, self.id)
        if ck is None or ck.status != "pending":
            raise CommitRaceError(f"checkpoint {self.id} is no longer pending (removed by gc?); cannot commit")
        taken = s.scalar(select(m.Checkpoint.id).where(
            m.Checkpoint.run_id == ck.run_id, m.Checkpoint.step == ck.step,
            m.Checkpoint.status == "committed"))
        label = f"run {ck.run.name!r} step {ck.step}"
        labels.append(label)
        if taken:
            raise CommitRaceError(f"checkpoint {self.id}: {label} was committed meanwhile by {taken}; "
                                  "nothing of this save is listed")
        total = s.scalar(select(func.coalesce(func.sum(m.Tensor.nbytes), 0)).where(
            m.Tensor.checkpoint_id == self.id))
        ck.nbytes = int(total)
        ck.status = "committed"
        ck.committed_at = _utcnow()
        s.flush()
        killpoint("commit.in_txn")

    def abort(self) -> None:
        """Drop the pending checkpoint and every array it wrote (nothing is ever listed)."""
        if self._closed:
            return
        self._closed = True
        self._window.cancel()
        self._rows.clear()
        self._borrowed.clear()
        if not self.owner:
            return
        try:
            with self.store.catalog.write_session() as s:
                ck = s.get(m.Checkpoint, self.id)
                if ck is not None and ck.status == "pending":
                    run_id = ck.run_id
                    s.delete(ck)
                    s.flush()
                    # a run that begin() created for this save alone goes too (nothing listed, nothing left)
                    run = s.get(m.Run, run_id)
                    if run is not None and run.retention is None and not s.scalar(
                            select(func.count()).select_from(m.Checkpoint).where(m.Checkpoint.run_id == run_id)) \
                            and not s.scalar(select(func.count()).select_from(m.Tag).where(m.Tag.run_id == run_id)):
                        s.delete(run)
            killpoint("abort.after_row")
            from ucp_store.registry.retention import sweep_arrays

            sweep_arrays(self.store, dry_run=False, also={self.id})
        except Exception:
            pass  # gc will reclaim what is left; the checkpoint is not listed either way


_ROW_KINDS: dict[str, Any] = {"array": m.Array, "tensor": m.Tensor, "object": m.StoredObject}


class _Swept(Exception):
    """Arrays a pending save deduplicated against that a concurrent sweep removed (``_record`` retries)."""

    def __init__(self, gone: set[str]):
        super().__init__(", ".join(sorted(gone)))
        self.gone = gone


def row_to_dict(row) -> dict:
    """A pending catalog row as plain data (the columns that are set), for another rank's commit."""
    kind = next(k for k, cls in _ROW_KINDS.items() if isinstance(row, cls))
    out: dict[str, Any] = {"_table": kind}
    for col in row.__table__.columns:
        value = getattr(row, col.key, None)
        if value is not None:
            out[col.key] = value
    return out


def _insert_params(cls, dicts: list[dict]) -> list[dict]:
    """Parameters of one executemany INSERT into ``cls``'s table: every row with the same keys (the columns
    any row sets, None where another does not), the autoincrement id left out, ``created_at`` filled in."""
    skip = {"_table"} if cls is m.Array else {"_table", "id"}
    keys: list[str] = []
    for d in dicts:
        for k in d:
            if k not in skip and k not in keys:
                keys.append(k)
    if cls is m.Array and "created_at" not in keys:
        keys.append("created_at")
    now = _utcnow()
    out = []
    for d in dicts:
        p = {k: d.get(k) for k in keys}
        if cls is m.Array and p["created_at"] is None:
            p["created_at"] = now
        out.append(p)
    return out


def check_row_dict(d: Any) -> dict:
    """``d`` if it is a row as :func:`row_to_dict` describes one (a known kind, only that table's columns)."""
    if not isinstance(d, dict) or d.get("_table") not in _ROW_KINDS:
        raise ValidationError("a joined rank's catalog row must be a dict with _table array/tensor/object, "
                              f"got {str(d)[:200]}")
    cols = {c.key for c in _ROW_KINDS[d["_table"]].__table__.columns}
    extra = set(d) - cols - {"_table"}
    if extra:
        raise ValidationError(f"a joined rank's {d['_table']} row has unknown columns {sorted(extra)}")
    return d


def _writer_aligned_shards(layout: fmt.ArrayLayout, source_points: Mapping[int, Iterable[int]]) -> tuple[int, ...]:
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


def _check_json(name: str, value: Any) -> Any:
    """``value`` as the catalog will give it back (``json``'s view: tuples become lists, ``1.0``, ``-0.0``,
    big integers and NaN/Infinity stay what they are), or a ValidationError naming the object. A dict whose
    keys ``json`` makes equal (``1`` and ``"1"``) is refused: the catalog would keep only one of them."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):  # only converted keys can repeat: a Python dict has no duplicate keys
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise ValidationError(f"object {name!r}: two keys of one dict are both stored as the JSON key "
                                          f"{key!r} (e.g. 1 and '1'); one of them would be lost")
                seen.add(key)
        return out

    try:
        return json.loads(m.encode_json(value), object_pairs_hook=unique)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"object {name!r} is not JSON-serialisable ({exc}); store tensors as arrays, "
                              "never pickle") \
            from None
    except RecursionError:
        raise ValidationError(f"object {name!r} is nested too deeply to store as JSON") from None
