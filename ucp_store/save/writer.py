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

:class:`CheckpointWriter` is the public face; the work is done by its collaborators, one per concern, which
see the store only as a :class:`~ucp_store.registry.context.StoreContext` (location, catalog, settings):

- :class:`~ucp_store.save.arrays.ArrayWriter`: whole arrays (copy, hash, dedup, the window of writes);
- :class:`~ucp_store.save.shards.ShardWriter`: ``write_shard`` / ``write_region`` and the origin's hashing;
- :class:`~ucp_store.save.objects.ObjectWriter`: named objects (JSON or arrays);
- :class:`~ucp_store.save.rows.CatalogRecorder`: the rows, the commit's transaction, the abort;
- :class:`~ucp_store.save.dedup.Deduplicator` and :class:`~ucp_store.save.durable.Durability`, shared by them.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from sqlalchemy.exc import IntegrityError

from ucp_store._killpoints import killpoint
from ucp_store.errors import CommitRaceError, WriterClosedError
from ucp_store.io import format as fmt
from ucp_store.registry.context import StoreContext, as_store_context
from ucp_store.save.arrays import ArrayWriter, plan_array_layout
from ucp_store.save.checks import MAX_ELEMENTS, check_extent, layer_of
from ucp_store.save.dedup import Deduplicator
from ucp_store.save.delta import DeltaPlanner
from ucp_store.save.durable import Durability
from ucp_store.save.objects import ObjectWriter
from ucp_store.save.order import Positions
from ucp_store.save.rows import CatalogRecorder, check_row_dict, row_to_dict, take
from ucp_store.save.shards import ShardWriter

if TYPE_CHECKING:  # pragma: no cover
    from ucp_store.store import Store

__all__ = ["MAX_ELEMENTS", "CheckpointWriter", "check_extent", "check_row_dict", "layer_of", "row_to_dict"]

ROW_BATCH = 512  # rows a writer holds before ``write`` records them (``flush``)

def _flip_and_hooks(writer: CheckpointWriter, s, labels: list[str]) -> None:
    """The commit's status flip, then the writer's ``commit_hooks``, in the commit's transaction."""
    writer.recorder.flip_status(s, labels)
    for hook in writer.commit_hooks:
        hook(s)


class CheckpointWriter:
    """Writes tensor-states and objects into one pending checkpoint; ``commit`` makes it visible.

    ``store``: the :class:`~ucp_store.store.Store` the checkpoint was begun in (``Store.begin`` / ``join``, or
    a detached store of a distributed save's rank), or its :class:`StoreContext`. The writer works on the
    context alone; the store is kept (``self.store``) only to open the committed version for reading."""

    def __init__(self, store: "Store | StoreContext", checkpoint_id: str, *, owner: bool, delta: str | None = None):
        self.store = store
        self.store_context = ctx = as_store_context(store)
        self.id = checkpoint_id
        self.owner = owner
        self.checkpoint: Any = None
        self.nbytes = 0
        self._closed = False
        self._rows: list = []  # shared by the collaborators: emptied in place (``rows.take``), never replaced
        #: positions of the rows: the caller's order (``positions.set_order``, its state dict's), else first write
        self.positions = positions = Positions()
        self.dedup = Deduplicator(ctx)
        self.durability = Durability(ctx, checkpoint_id)
        self.arrays = ArrayWriter(ctx, checkpoint_id, rows=self._rows, dedup=self.dedup, durability=self.durability,
                                  positions=positions, layout=lambda *a, **k: self._layout(*a, **k),
                                  snapshot=lambda array, dtype: self._snapshot(array, dtype),
                                  delta=DeltaPlanner(ctx, checkpoint_id, delta))
        self.shards = ShardWriter(ctx, checkpoint_id, arrays=self.arrays, dedup=self.dedup,
                                  durability=self.durability, rows=self._rows, positions=positions)
        self.objects = ObjectWriter(checkpoint_id, self.arrays, self._rows)
        self.recorder = CatalogRecorder(ctx, checkpoint_id)
        #: ``hook(session)`` calls run inside the commit's transaction, after the status flip (a tiered save
        #: records where its objects are, ``ucp_store.tiers``): the version is never listed without them
        self.commit_hooks: list[Callable[[Any], None]] = []
        self._snapshot = self.arrays.snapshot  # a test replaces it on one writer

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

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError(f"checkpoint writer {self.id} is closed (committed, aborted or closed already)")

    def _layout(self, shape, dtype: str, pattern, boundaries=None, shard_shape=None, units=None) -> fmt.ArrayLayout:
        """The layout of a new array (a method here, looked up at each call, so that tests can replace it)."""
        return plan_array_layout(self.store_context.settings, shape, dtype, pattern, boundaries=boundaries,
                                 shard_shape=shard_shape, units=units)

    def _settle(self) -> None:
        """Every write has returned and is durable, and every committed array the pending rows deduplicated
        against still exists (:meth:`ArrayWriter.settle`; a method here so that tests can wrap it)."""
        self.arrays.settle()

    def _insert_rows(self, s, rows: list, lost: str) -> set[str]:
        """Insert ``rows`` in session ``s`` (:meth:`CatalogRecorder.insert_rows`): the one place rows are
        recorded, a method here so that tests can watch it."""
        return self.recorder.insert_rows(s, rows, lost, self.arrays.borrowed)

    def _record(self, rows: list, lost: str, then=None) -> Any:
        """Record ``rows`` in one transaction, then ``then(session)`` in it (:meth:`CatalogRecorder.record`)."""
        return self.recorder.record(rows, lost, self._insert_rows, self.arrays.rewrite_swept, then)

    def defer_durability(self) -> bool:
        """Local stores: write arrays without an fsync per file and per folder (TensorStore's default); instead
        :meth:`flush` makes every file and folder this writer wrote durable in one parallel fsync pass, before
        it records any row (so a row never names data that a crash could lose; commit comes after). Many small
        files per save (one zarr.json and a few shard files per array) then cost one round of concurrent
        fsyncs, which the file system's journal commits together, instead of one journal commit each.
        Returns False (nothing changes) for a bucket, where a completed PUT is durable already."""
        self._check_open()
        if self.store_context.location.kind != "file":
            return False
        if not self.durability.deferred:
            self.arrays.drain()
            self.durability.defer()
        return True

    def make_durable_async(self) -> Future:
        """Start, on a thread, the fsync pass over what was written until now (call after the writes returned:
        ``drain``); returns its Future (``result()`` re-raises a failure). What is written later goes to the
        next pass (``commit`` / ``export_rows`` run it), so the caller overlaps this pass with other work."""
        return self.durability.make_durable_async()

    def write(self, name: str, state: str, tensor: torch.Tensor | np.ndarray, *, pattern: dict | None = None,
              expect_shape=None, expect_dtype=None, position: int | None = None) -> None:
        """Store one tensor-state (bit-exact, native dtype). ``pattern`` says how it maps onto ranks.

        ``position`` orders tensor-states in the checkpoint (the planner lays ZeRO groups out in this
        order); by default the order of writing. Distributed writers pass the global parameter order."""
        self._check_open()
        self.nbytes += self.arrays.write(name, state, tensor, pattern=pattern, expect_shape=expect_shape,
                                         expect_dtype=expect_dtype, position=position)
        if len(self._rows) >= ROW_BATCH:
            self.flush()
        return None

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
        self._check_open()
        return self.shards.write_shard(name, state, local, shape=shape, pattern=pattern, topology=topology,
                                       rank=rank, fragment=fragment, targets=targets, position=position,
                                       digest=digest)

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
        return self.shards.write_region(name, state, local, shape=shape, offset=offset, pattern=pattern,
                                        boundaries=boundaries, origin=origin)

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
        self.shards.open_regions(specs, create=create)

    def open_shards(self, specs: Iterable[tuple], *, topology, targets: Iterable = (),
                    create: Container | None = None) -> None:
        """Create (or open) the arrays of many tensor-states at once, ahead of their ``write_shard`` calls:
        ``specs`` are ``(name, state, shape, dtype, pattern)`` (dtype a torch or numpy dtype or store name).
        One array open is a metadata write made durable; waited for one by one they dominate a save of
        many parameters, so their futures run together here.
        ``create``: the keys whose ``zarr.json`` this writer writes now; the others are opened on the layout
        alone and the array's origin (the writer of element 0) writes it in ``finish_shards``, so a
        multi-rank save passes ``create=()`` and each ``zarr.json`` has one writer. ``None``: all now."""
        self._check_open()
        self.shards.open_shards(specs, topology=topology, targets=targets, create=create)

    def drain(self) -> None:
        """Wait for every array write in flight; the first failure raises here (a ``WriteError``)."""
        self.arrays.drain()

    def region_digests(self) -> dict:
        """``{(name, state): {unit: digest}}`` of the units of the content hash (``fmt.box_unit_digests``) that
        boxes of this writer held whole; waits for the writes in flight first (the local write path digests
        as it writes)."""
        return self.shards.region_digests()

    def set_region_hash(self, name: str, state: str, content_hash: str) -> None:
        """The content hash of a region-written array, computed from every rank's unit digests
        (``fmt.units_hash``); the origin rank's ``finish_shards`` then records it instead of reading back."""
        self.shards.set_region_hash(name, state, content_hash)

    def shard_digests(self) -> dict:
        """``{(name, state): {unit: digest}}`` of the units of the content hash that this writer's
        ``write_shard(digest=True)`` boxes held whole (see ``set_chunk_digests``). Waits for the writes in
        flight first: the write pool digests the units of whole shard files it writes."""
        return self.shards.shard_digests()

    def set_chunk_digests(self, name: str, state: str, digests: dict) -> None:
        """Every rank's ``shard_digests`` (or ``region_digests``) of one tensor-state, merged: the origin rank's
        ``finish_shards`` hashes the array from them (``fmt.HASH_PREFIX``), reading back only the units
        missing here."""
        self.shards.set_chunk_digests(name, state, digests)

    def origin_writes_metadata(self) -> None:
        """For one rank of a multi-rank save (``distributed.distributed_begin`` calls it): the arrays of
        ``write_shard`` and ``write_region`` are opened on their layout alone (no I/O) and only the array's
        origin (the rank writing element 0) writes its ``zarr.json``, in ``finish_shards``; ``open_regions``
        and ``open_shards`` called with an explicit ``create`` still create those keys at once. Then no
        ``zarr.json`` has two writers (a conditional create-or-open that S3 and NFS do not make atomic)."""
        self.shards.origin_metadata = True

    def hold_straddling(self) -> None:
        """For one rank of a multi-rank save that writes with ``write_shard`` (``distributed_begin`` calls it):
        the parts of a box inside shard files it only cuts (a ZeRO fragment ending mid-row) are kept, not
        written, until ``ucp_store.distributed.commit.exchange_straddling`` hands each such file to its one writer."""
        if self.shards.straddling is None:
            self.shards.straddling = []

    @property
    def exchange_due(self) -> bool:
        """True while ``hold_straddling`` is on and its exchange has not run (the same on every rank); the
        exchange takes the pieces from ``self.shards`` (``take_straddling``, ``write_owned``)."""
        return self.shards.straddling is not None

    def finish_shards(self, *, record: bool = True) -> None:
        """After all ranks wrote (barrier first): hash and record the arrays this rank is origin of.
        ``record=False``: their rows stay with the writer (for :meth:`commit` or :meth:`export_rows`)."""
        self.shards.finish()
        if record:
            self.flush()

    def write_object(self, name: str, value: Any) -> None:
        """Store non-tensor state: JSON (dicts, lists, numbers, strings) or a tensor/array. Never pickle.

        A JSON value reads back exactly (``Checkpoint.objects``), types and signs included; tuples become
        lists, and a dict whose keys JSON would make equal (``1`` and ``"1"``) is refused."""
        self._check_open()
        self.objects.write(name, value)

    # --- the catalog: rows, commit, abort ------------------------------------------------------------
    def flush(self) -> None:
        """Wait for in-flight writes (and, with ``defer_durability``, make them durable), then record their
        rows under the pending checkpoint."""
        self._settle()
        if not self._rows:
            return
        self._record(take(self._rows), "the save is lost")
        self.arrays.borrowed.clear()  # from here the flushed rows reference them: no sweep takes them
        killpoint("flush.after_rows")

    def export_rows(self) -> list[dict]:
        """For a joined writer of a distributed save (after every rank's writes returned: a barrier first):
        hash the arrays this rank is origin of, make everything it wrote durable, and hand its rows over as
        plain dicts for the owner's :meth:`commit` (``extra_rows``), which records them in its one
        transaction. The writer is closed after."""
        self._check_open()
        if self.shards.origin:
            self.finish_shards(record=False)
        self._settle()
        rows = take(self._rows)
        self._closed = True
        return [row_to_dict(r) for r in rows]

    def close(self) -> None:
        """For a joined writer: flush and detach (the owner commits)."""
        if not self._closed:
            if self.shards.origin:
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
            if self.shards.origin:
                self.finish_shards(record=False)
            self._settle()
            rows = take(self._rows)
            rows.extend(check_row_dict(d) for d in extra_rows)
            # one transaction: the rows still pending (this writer's, and every joined rank's) and the commit
            self._record(rows, "cannot commit", lambda s: _flip_and_hooks(self, s, labels))
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
        self.arrays.borrowed.clear()
        self.checkpoint = Checkpoint(self.store, self.id) if reload else None
        return self.checkpoint

    def abort(self) -> None:
        """Drop the pending checkpoint and every array it wrote (nothing is ever listed)."""
        if self._closed:
            return
        self._closed = True
        self.arrays.window.cancel()
        self._rows.clear()
        self.arrays.borrowed.clear()
        if self.owner:
            self.recorder.drop_pending()
