"""The array side of a save: whole tensor-states copied, hashed, deduplicated and written in a bounded window.

``write`` copies a tensor into a buffer the writer owns (once the window of writes in flight has room for
it), hashing the copy as it is made; an identical array of this save or of a committed version is referenced
instead of written again (:mod:`ucp_store.save.dedup`). A committed array referenced this way is "borrowed"
until the rows that name it are recorded: a concurrent rm/gc that sweeps it meanwhile makes the writer write
it again from the data in hand (:meth:`ArrayWriter.restore_borrowed`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ucp_store import dtypes, names
from ucp_store._killpoints import killpoint
from ucp_store.catalog import models as m
from ucp_store.errors import CommitRaceError, DuplicateEntryError, ShapeMismatch, ValidationError, WriteError
from ucp_store.io import deltaio, localwrite
from ucp_store.io import format as fmt
from ucp_store.io.location import array_path
from ucp_store.io.window import FutureWindow
from ucp_store.registry.context import StoreContext
from ucp_store.save.checks import check_extent, layer_of, validate_pattern
from ucp_store.save.dedup import Deduplicator
from ucp_store.save.delta import DeltaChoice, DeltaPlanner
from ucp_store.save.durable import Durability
from ucp_store.save.order import Positions
from ucp_store.save.rows import existing_arrays

__all__ = ["MAX_INFLIGHT_BYTES", "SNAPSHOT_PIECE", "ArrayWriter", "plan_array_layout"]

MAX_INFLIGHT_BYTES = 1 << 30
SNAPSHOT_PIECE = 4 << 20  # write()'s copy is hashed a piece at a time, while the piece is still in cache


def plan_array_layout(settings: Any, shape: Any, dtype: str, pattern: Any, boundaries: Any = None,
                      shard_shape: Any = None, units: Any = None) -> fmt.ArrayLayout:
    """The layout of a new array under the store's settings (compression, chunk target)."""
    return fmt.plan_layout(shape, dtype, pattern=pattern, compression=settings["compression"],
                           target_bytes=settings["chunk_target_bytes"], boundaries=boundaries,
                           shard_shape=shard_shape, units=units)


class Borrowed(dict):
    """``ArrayWriter.borrowed``: a dict whose ``bases`` (a delta base's id -> its deltas' data in hand) goes
    with it whenever it is cleared (the rows that need them are recorded)."""

    def __init__(self) -> None:
        super().__init__()
        self.bases: dict[str, list[tuple]] = {}

    def clear(self) -> None:
        super().clear()
        self.bases.clear()


def _array_row_in(row: Any, ids: set[str]) -> bool:
    if isinstance(row, dict):
        return row.get("_table") == "array" and row.get("id") in ids
    return isinstance(row, m.Array) and row.id in ids


class ArrayWriter:
    """Writes whole arrays of one pending checkpoint, appending their rows to the writer's shared ``rows``.

    ``layout(shape, dtype, pattern, ...)`` plans an array's layout and ``snapshot(array, dtype)`` copies and
    hashes one (:meth:`snapshot`); both are the writer's, looked up when called, so that a test can replace
    them on the writer. ``positions`` numbers the tensor-states in the order they are recorded."""

    def __init__(self, ctx: StoreContext, checkpoint_id: str, *, rows: list, dedup: Deduplicator,
                 durability: Durability, positions: Positions, layout: Callable[..., fmt.ArrayLayout],
                 snapshot: Callable[[np.ndarray, str], tuple[np.ndarray, str]], delta: DeltaPlanner | None = None):
        self.ctx = ctx
        #: which tensor-states go in as deltas of the base version (issue 39; None: never)
        self.delta = delta
        self.id = checkpoint_id
        self.rows = rows
        self.dedup = dedup
        self.durability = durability
        self.positions = positions
        self.layout = layout
        self._snapshot = snapshot
        #: (future, (array kept alive until written, what)) in flight, at most MAX_INFLIGHT_BYTES
        self.window: FutureWindow[tuple[Any, str]] = FutureWindow(MAX_INFLIGHT_BYTES, self._complete_write)
        #: committed arrays this writer deduplicated against, with the data in hand, until its rows are
        #: recorded: array id -> (array, dtype, pattern, what, content hash); a delta's base -> None, its
        #: deltas' data in ``borrowed.bases`` (a base swept meanwhile: those tensors are written in full)
        self.borrowed: Borrowed = Borrowed()
        self._seen: set[tuple[str, str]] = set()

    def _complete_write(self, future: Any, item: tuple[Any, str]) -> None:
        try:
            future.result()
        except Exception as exc:  # TensorStore raises ValueError with the kvstore's message
            raise WriteError(f"writing {item[1]} into checkpoint {self.id} failed: {exc}") from None
        killpoint("write.array_written")

    def drain(self) -> None:
        """Wait for every write in flight (the first failure raises here), then sync the folders they changed."""
        self.window.drain()
        self.durability.sync_dirs()

    def snapshot(self, array: np.ndarray, dtype: str) -> tuple[np.ndarray, str]:
        """``(copy of array, its content hash)``: the copy is made, hashed as it is made (a piece at a time,
        while the piece is in cache), after waiting until the window of writes in flight has room for it
        (the back-pressure that bounds the writer's memory; one array larger than the window waits for the
        window to empty)."""
        window = self.window
        while window.max_bytes is not None and len(window) and window.bytes + array.nbytes > window.max_bytes:
            window.complete_one()
        copy = np.empty(array.shape, array.dtype)
        hasher = fmt.ContentHasher(dtype, array.shape)
        if array.flags.c_contiguous and array.ndim and array.size:
            src, dst = array.reshape(-1), copy.reshape(-1)
            step = hasher.piece(SNAPSHOT_PIECE // array.itemsize)  # whole blocks of the hash's tiles
            for lo in range(0, src.size, step):
                np.copyto(dst[lo:lo + step], src[lo:lo + step])
                hasher.update(dst[lo:lo + step])
        else:
            np.copyto(copy, array)
            hasher.update(copy)
        return copy, hasher.hexdigest()

    def put_array(self, array: np.ndarray, dtype: str, pattern: Any, what: str,
                  key: tuple[str, str] | None = None) -> tuple[str, str, int]:
        """Write (or dedup) one array; returns (array id, content hash, stored bytes written).

        The array is copied first into a buffer this writer owns (once there is room for it in the window of
        writes in flight), and hashed from that copy: the write in flight reads only the copy, so the caller
        may change its tensor as soon as ``write`` returns, and the hash describes exactly the bytes written.
        On a dedup hit the copy is dropped and nothing is written."""
        snapshot, h = self._snapshot(array, dtype)
        local = h in self.dedup.local_arrays
        aid = self.dedup.find(h, dtype, array.shape)
        if aid is not None:
            if not local:  # kept until the rows are recorded, in case a concurrent rm/gc sweeps the array
                self.borrowed.setdefault(aid, (array, dtype, pattern, what, h))
            return aid, h, 0
        choice = self.delta.choose(key, snapshot, dtype, array) if self.delta is not None else None
        if choice is not None:
            return self._new_delta(choice, dtype, pattern, what, h)
        return self._new_array(snapshot, dtype, pattern, what, h)

    def _new_delta(self, choice: DeltaChoice, dtype: str, pattern: Any, what: str, h: str) -> tuple[str, str, int]:
        """Write a delta array (``save/delta.py``): the base's grid, only its non-zero chunks, every shard file."""
        layout, encoded = choice.layout, choice.encoded
        aid = m.new_id(32)
        rel = array_path(self.id, aid)
        self.durability.touch(rel)
        futures = deltaio.write_delta(self.ctx.location, rel, layout, encoded, self.durability.array_context())
        localwrite.log_object(rel, "zarr.json")
        for key in encoded.files:
            localwrite.log_object(rel, key)
        killpoint("write.array_created")
        self.rows.append(m.Array(id=aid, path=rel, dtype=dtype, shape=list(layout.shape),
                                 chunk_shape=list(layout.chunk_shape), shard_shape=list(layout.shard_shape),
                                 codecs=layout.codecs(), nbytes=layout.nbytes, content_hash=h, status="ready",
                                 encoding="xor", base_array_id=choice.base.array_id, stored_nbytes=encoded.nbytes))
        self.dedup.local_arrays[h] = aid
        self.borrowed.setdefault(choice.base.array_id, None)  # checked, locked, when the rows are inserted
        self.borrowed.bases.setdefault(choice.base.array_id, []).append((aid, choice.values, dtype, pattern, what, h))
        for fut, data in zip(futures, encoded.files.values()):
            self.window.submit(fut, len(data), (None, what))
        return aid, h, encoded.nbytes

    def _new_array(self, array: np.ndarray, dtype: str, pattern: Any, what: str, h: str) -> tuple[str, str, int]:
        layout = self.layout(array.shape, dtype, pattern)
        aid = m.new_id(32)
        rel = array_path(self.id, aid)
        self.durability.touch(rel)
        handle = fmt.create_array(self.ctx.location, rel, layout, self.durability.array_context(), what=what)
        localwrite.log_object(rel, "zarr.json")
        localwrite.log_box(rel, layout, (0,) * array.ndim, tuple(array.shape))
        killpoint("write.array_created")
        self.rows.append(m.Array(id=aid, path=rel, dtype=dtype, shape=list(layout.shape),
                                 chunk_shape=list(layout.chunk_shape), shard_shape=list(layout.shard_shape),
                                 codecs=layout.codecs(), nbytes=layout.nbytes, content_hash=h, status="ready",
                                 stored_nbytes=deltaio.stored_bytes(layout)))
        self.dedup.local_arrays[h] = aid
        self.window.submit(handle.write(array), array.nbytes, (array, what))
        return aid, h, array.nbytes

    def write(self, name: str, state: str, tensor: torch.Tensor | np.ndarray, *, pattern: dict | None,
              expect_shape: Any, expect_dtype: Any, position: int | None) -> int:
        """``CheckpointWriter.write``: one tensor-state, checked, written (or deduplicated) and its row added;
        returns its bytes."""
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
            validate_pattern(name, pattern, array.shape)
        aid, h, _ = self.put_array(array, dtype, pattern, what, key=(name, state))
        self._seen.add((name, state))
        self.rows.append(m.Tensor(checkpoint_id=self.id, name=name, state=state, array_id=aid,
                                  shape=list(array.shape), dtype=dtype, pattern=pattern, nbytes=array.nbytes,
                                  content_hash=h, position=self.positions.of((name, state), position),
                                  layer=layer_of(pattern)))
        return int(array.nbytes)

    def restore_borrowed(self, gone: set[str] | None = None, rows: list | None = None) -> None:
        """Write again, from the data in hand, each committed array this save deduplicated against that a
        concurrent rm/gc swept meanwhile (``gone``, or those the catalog no longer lists), and point the
        pending rows (and ``rows``) at the new copy: a save never needs an array that is gone. The data is
        copied and re-hashed first; if the caller changed it since ``write``, the save aborts."""
        if not self.borrowed:
            return
        if gone is None:
            with self.ctx.catalog.session() as s:
                gone = set(self.borrowed) - existing_arrays(self.ctx, s, set(self.borrowed))
        remap: dict[str, str] = {}
        dropped: set[str] = set()  # deltas whose base was swept: written in full instead
        for old in sorted(gone & set(self.borrowed)):
            entry = self.borrowed.pop(old)
            for delta_aid, *data in self.borrowed.bases.pop(old, []):
                remap[delta_aid] = self._rewrite(*data)
                dropped.add(delta_aid)
            if entry is None:
                continue
            array, dtype, pattern, what, h = entry
            copy, again = self._snapshot(array, dtype)
            if again != h:
                raise CommitRaceError(f"{what}: the array it was deduplicated against was removed by a concurrent "
                                      "rm/gc and the tensor was changed in place after write() returned; the save "
                                      "is aborted, retry it")
            self.dedup.forget_committed()  # stale: it listed the swept array
            remap[old] = self._new_array(copy, dtype, pattern, what, h)[0]
        for row in itertools.chain(self.rows, rows or ()):
            if isinstance(row, dict):
                if row.get("array_id") in remap:
                    row["array_id"] = remap[row["array_id"]]
            elif getattr(row, "array_id", None) in remap:
                row.array_id = remap[row.array_id]
        if dropped:  # the deltas' own array rows and files go (written and drained before the rows were due)
            for lst in (self.rows, rows):
                if lst is not None:
                    lst[:] = [r for r in lst if not _array_row_in(r, dropped)]
            for aid in dropped:
                self.ctx.location.delete_tree(array_path(self.id, aid))
            for h, aid in list(self.dedup.local_arrays.items()):
                if aid in remap:
                    self.dedup.local_arrays[h] = remap[aid]

    def _rewrite(self, array: np.ndarray, dtype: str, pattern: Any, what: str, h: str) -> str:
        """A delta whose base a concurrent rm/gc swept: the tensor written again in full, from the data in hand."""
        copy, again = self._snapshot(array, dtype)
        if again != h:
            raise CommitRaceError(f"{what}: the base of its delta was removed by a concurrent rm/gc and the tensor "
                                  "was changed in place after write() returned; the save is aborted, retry it")
        return self._new_array(copy, dtype, pattern, what, h)[0]

    def settle(self) -> None:
        """Every write has returned and is durable, and every committed array the pending rows deduplicated
        against still exists (one swept meanwhile is written again from the data in hand; one swept after
        this check is caught, under lock, when the rows are inserted)."""
        self.drain()
        self.durability.make_durable()
        if self.rows and self.borrowed:
            self.restore_borrowed()
            self.drain()
            self.durability.make_durable()  # the arrays written again are durable before a row names them

    def rewrite_swept(self, gone: set[str], rows: list) -> None:
        """The retry of a transaction that found borrowed arrays ``gone``: write them again, add their rows
        to ``rows`` (the ones being recorded), and make them durable before a row names them."""
        self.restore_borrowed(gone, rows)
        rows.extend(self.rows)  # the rows of the arrays written again
        self.rows.clear()
        self.drain()
        self.durability.make_durable()
