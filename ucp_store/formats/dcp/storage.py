"""ucp_store as a storage backend of ``torch.distributed.checkpoint`` (DCP).

    import torch.distributed.checkpoint as dcp
    from ucp_store.formats.dcp.storage import UcpStorageReader, UcpStorageWriter

    dcp.save(state_dict, storage_writer=UcpStorageWriter("ckpts", run="llama", step=100))
    dcp.load(state_dict, storage_reader=UcpStorageReader("ckpts", "llama@latest"))

The training loop keeps ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` and its planners; only the storage
changes. DCP calls the writer in this order (``torch/distributed/checkpoint/storage.py``): every rank
``set_up_storage_writer`` and ``prepare_local_plan``; the coordinator ``prepare_global_plan``; every rank
``write_data``; the coordinator ``finish``, after DCP gathered every rank's ``WriteResult`` s to it.

The save is one ucp version, with the catalog touched by the coordinator only (:func:`_catalog_begin`,
:func:`_catalog_commit`):

* ``prepare_global_plan`` (coordinator) sees every rank's ``WriteItem`` s: it maps each DCP key to a
  tensor-state with the rule ``ucp import dcp`` uses (``adapters.dcp._classify``), keeps one copy of each
  replicated box, checks that the boxes tile each tensor, begins the pending version and hands each rank
  the version id and its keys' array geometry in its plan's ``storage_data`` (DCP scatters the plans).
* ``write_data`` (every rank) writes its boxes straight into the version's logical arrays
  (``CheckpointWriter.write_region``, split at every rank's box edges so each rank owns whole chunks), makes
  them durable (one fsync pass) and returns, per item, the chunk digests of what it wrote. Non-tensor
  (``BYTE_IO``) values travel to the coordinator as the bytes DCP serialised, never unpickled, as do 0-d
  tensors and tensors that are no parameter state (RNG state, counters).
* ``finish`` (coordinator) hashes each array from the gathered digests (no read-back), stores the bytes
  as opaque objects and the key layout as the ``_dcp`` index (so ``ucp export dcp`` gives the same keys
  back), and commits in one transaction. When any rank fails, DCP never calls ``finish``: the version stays
  pending (never listed) and the writer's next save or the process exit drops it.

The reader serves any committed version (saved here, by ``ucp_store.distributed``, imported from DeepSpeed, DCP
or HF): ``read_metadata`` lists every tensor-state under the DCP key its ``_dcp`` index names, and under
the flattened keys DCP state dicts use (``model.<name>`` and ``<name>`` for the model state,
``optim.state.<name>.<state>``, ``optimizer.state.<name>.<state>``, ``state.<name>.<state>``), each as
ONE chunk covering the tensor. DCP's planner then asks for exactly each local shard's box, and
``read_data`` reads only the chunks that box touches (``io._Reader``, the store's own read path).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import io
import logging
import multiprocessing.util
import os
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ucp_store import dtypes, names
from ucp_store.distributed.coord import detached_store, store_facts
from ucp_store.errors import ConfigurationError, ShapeMismatch, UcpError, ValidationError

__all__ = ["UcpStorageReader", "UcpStorageWriter", "dcp_keys"]

_OPAQUE_WHY = "saved through ucp_store.formats.dcp.storage: DCP's serialised bytes, never unpickled"
_SAVED_BY = "ucp_store.formats.dcp.storage"


# ------------------------------------------------------------------------------------------------ store
def _open(store: Any, *, create: bool):
    """A Store from a Store, a folder or a URL."""
    from ucp_store.store import Store

    if isinstance(store, Store):
        return store
    if isinstance(store, (str, os.PathLike)):
        return _shared_store(os.fspath(store), None, create)
    raise ConfigurationError(f"store: expected a Store, a folder or a store URL, got {type(store).__name__}")


_SHARED: dict[tuple, tuple[Any, Any]] = {}
_SHARED_LOCK = threading.Lock()


def _catalog_identity(store) -> tuple | None:
    """(device, inode, ctime) of a store's SQLite catalog file; None for another catalog or a missing file.
    The ctime too: a store removed and made again can get the freed inode back, and a cached engine would
    then write to the removed file. SQLite changes the file itself only at WAL checkpoints (or every commit
    with the rollback journal), where the store is merely opened again."""
    from sqlalchemy.engine import make_url

    url = store.location.catalog_url
    if not url.startswith("sqlite"):
        return None
    try:
        st = os.stat(make_url(url).database or "")
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def _shared_store(url: str, catalog: str | None, create: bool):
    """The Store at ``url``, opened once per process for an SQLite catalog.

    Why: a loop builds a new writer or reader for every ``dcp.save`` / ``dcp.load``, and opening a store
    (engine, revision check, settings; SQLAlchemy's compiled-statement cache is per engine) cost each
    call more than its catalog transaction. The cached Store is used again only while its catalog file is
    the same file (a store removed and made again at the path is opened afresh) and in the process that
    opened it (an SQLite connection must not cross a fork). Other catalogs (PostgreSQL) open per call.
    Identity (``_catalog_identity``) is read after the open, so a checkpoint that the open itself runs makes
    only the next call open again."""
    from ucp_store.store import open_store

    key = (os.getpid(), url, catalog)
    with _SHARED_LOCK:
        hit = _SHARED.get(key)
        if hit is not None and hit[1] is not None and _catalog_identity(hit[0]) == hit[1]:
            return hit[0]
        store = open_store(url, catalog=catalog, create=create)
        ident = _catalog_identity(store)
        if ident is not None:
            if len(_SHARED) >= 16:
                _SHARED.pop(next(iter(_SHARED)))
            _SHARED[key] = (store, ident)
        return store


class _StoreRef:
    """A store that survives pickling (``async_save`` with the process executor sends the writer to a
    spawned process): the URL and catalog URL travel, the open Store is made again on the other side.

    ``lazy``: a folder or URL is opened on first use, so that a writer's non-coordinator ranks, which get a
    detached store (array I/O, no catalog) from the coordinator's plan, never open the catalog."""

    def __init__(self, store: Any, *, create: bool, lazy: bool = False):
        from ucp_store.store import Store

        if not isinstance(store, (Store, str, os.PathLike)):
            raise ConfigurationError(f"store: expected a Store, a folder or a store URL, got {type(store).__name__}")
        self.create = create
        self._store: Any = None
        self.url: str = ""
        self.catalog: str | None = None
        if lazy and not isinstance(store, Store):
            self.url = os.fspath(store)
        else:
            self._store = _open(store, create=create)
            self.url, self.catalog = self._store.location.url, self._store.location.catalog_url

    def get(self):
        if self._store is None:
            self._store = _shared_store(self.url, self.catalog, self.create)
        return self._store

    def __getstate__(self) -> dict:
        return {"url": self.url, "catalog": self.catalog, "create": self.create, "_store": None}


def _parse_run_step(checkpoint_id: Any) -> tuple[str, int]:
    text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else checkpoint_id
    if not isinstance(text, str) or "@" not in text:
        raise ValidationError(f"checkpoint_id {checkpoint_id!r}: UcpStorageWriter expects 'RUN@STEP'")
    run, _, step = text.rpartition("@")
    try:
        number = int(step)
    except ValueError:
        raise ValidationError(f"checkpoint_id {checkpoint_id!r}: step {step!r} is not an integer") from None
    return run, number


def _check_run_step(run: Any, step: Any) -> None:
    if run is None or step is None:
        raise ConfigurationError("UcpStorageWriter needs run= and step= (or dcp.save(checkpoint_id='RUN@STEP'))")
    names.run_name(run)
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**63:
        raise ValidationError(f"UcpStorageWriter step must be an integer from 0 to 2^63-1, got {step!r}")


# --------------------------------------------------------------------------------------- save planning
@dataclasses.dataclass(frozen=True)
class _Key:
    """What one DCP key becomes: ``kind`` "tensor" (a tensor-state written as boxes), "whole" (a tensor-state
    the coordinator writes whole: 0-d), "array" (a tensor object), "bytes" (an opaque object)."""

    kind: str
    name: str | None = None
    state: str | None = None
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    boundaries: tuple[tuple[int, tuple[int, ...]], ...] = ()
    units: tuple[tuple[int, int], ...] = ()  # the chunk extent per dim (``_chunk_units``); empty: the default

    def points(self) -> dict[int, list[int]]:
        return {d: list(p) for d, p in self.boundaries}

    def region(self) -> tuple:
        """``CheckpointWriter.open_regions``' spec of this tensor-state (the same on every rank)."""
        return (self.name, self.state, self.dtype, self.shape, None, self.points(), dict(self.units) or None)


# DCP saves DTensors: a later load may shard any of rows and columns (FSDP dim 0, TP colwise dim 0 or
# rowwise dim 1), whatever the saving ranks split. The chunk policy of ``ucp_store.distributed``'s DTensor saves
# (a ``dtensor`` pattern: both dims aligned to every power-of-two split <= 64, tiles grown to the chunk
# target, the saving ranks' edges kept) gives chunks that such loads read whole. The pattern is used for the
# layout only: DCP does not say which mesh saved, so none is recorded.
_ANY_SPLIT = {"kind": "dtensor", "mesh": {"shape": [1]}, "placements": [{"type": "replicate"}]}


def _chunk_units(shape: tuple[int, ...], dtype: str, points: dict[int, set[int]], target_bytes: int) -> tuple:
    """The chunk shape (as ``units`` per dim) of a tensor-state of ``shape`` cut at the saving ranks' box edges
    ``points``: rows and columns both follow the power-of-two splits (see ``_ANY_SPLIT``). 1-D tensors keep the
    default policy (rows)."""
    from ucp_store.io.chunking import choose_chunking

    if len(shape) < 2 or not all(shape):
        return ()
    edges: dict[int, Any] = {d: sorted(v) for d, v in points.items()}
    c = choose_chunking(shape, dtypes.itemsize(dtype), pattern=_ANY_SPLIT, boundaries=edges, target_bytes=target_bytes)
    return tuple(enumerate(c.chunk_shape))


@dataclasses.dataclass(frozen=True)
class _PlanData:
    """The coordinator's word to each rank, in ``SavePlan.storage_data``."""

    checkpoint_id: str
    keys: dict[str, _Key]
    store: dict  # coord.store_facts: the other ranks write through a detached store, never the catalog
    durable: dict | None = None  # a tiered save: ``TierSave.durable_facts`` (each rank writes to its fast tier)


def _stand_in_metadata(plans: list[SavePlan]) -> Any:
    """The keys of every plan as ``adapters.dcp``'s allow-listed Metadata stand-in, so that the one key ->
    (name, state) rule of ``ucp import dcp`` (``classify``) decides here too."""
    from ucp_store.safe_pickle import DcpBytesStorageMetadata, DcpMetadata, DcpTensorStorageMetadata

    sdm: dict[str, Any] = {}
    planner_data: dict[str, Any] = {}
    for plan in plans:
        if isinstance(plan.planner_data, dict):
            planner_data.update(plan.planner_data)
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                sdm.setdefault(fqn, DcpBytesStorageMetadata())
            else:
                td = item.tensor_data
                assert td is not None  # a tensor item always carries its tensor data
                sdm.setdefault(fqn, DcpTensorStorageMetadata(properties=None, size=td.size, chunks=[]))
    return DcpMetadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data={}, storage_meta=None,
                       version=None)


def _tensor_boxes(plans: list[SavePlan]) -> tuple[dict[str, list], dict[tuple[int, int], bool]]:
    """key -> [(rank, index, offsets, sizes, size, dtype)] of every tensor item, one per distinct box
    (replicas once: the first rank keeps it), and (rank, index) -> kept."""
    boxes: dict[str, list] = {}
    seen: dict[tuple[str, tuple, tuple], int] = {}
    keep: dict[tuple[int, int], bool] = {}
    for rank, plan in enumerate(plans):
        for i, item in enumerate(plan.items):
            if item.type == WriteItemType.BYTE_IO:
                keep[(rank, i)] = (item.index.fqn, None, None) not in seen
                seen.setdefault((item.index.fqn, None, None), rank)  # type: ignore[arg-type]
                continue
            td = item.tensor_data
            assert td is not None
            offsets, sizes = tuple(int(x) for x in td.chunk.offsets), tuple(int(x) for x in td.chunk.sizes)
            mark = (item.index.fqn, offsets, sizes)
            keep[(rank, i)] = mark not in seen
            if mark in seen:
                continue
            seen[mark] = rank
            boxes.setdefault(item.index.fqn, []).append(
                (rank, i, offsets, sizes, tuple(int(x) for x in td.size), td.properties.dtype))
    return boxes, keep


def _check_tiling(key: str, entries: list) -> tuple[tuple[int, ...], torch.dtype]:
    """The one logical shape and dtype of a key's boxes, which must tile it (no overlap, no gap)."""
    from ucp_store.formats.dcp.adapter import tiling_problem

    _, _, _, _, size, dtype = entries[0]
    for rank, _, _, _, s, dt in entries[1:]:
        if s != size or dt != dtype:
            raise ShapeMismatch(f"DCP key {key!r}: rank {rank} saves it as {dt}{list(s)}, rank {entries[0][0]} as "
                                f"{dtype}{list(size)}")
    problem = tiling_problem(size, [(o, s) for _, _, o, s, _, _ in entries])
    if problem is not None:
        kind, i, j, n = problem
        where = {"outside": lambda: f"rank {entries[i][0]}'s box at {list(entries[i][2])} leaves the tensor",
                 "overlap": lambda: f"the boxes of ranks {entries[i][0]} and {entries[j][0]} overlap",
                 "gap": lambda: f"{n} elements lie in no rank's box"}[kind]()
        raise ShapeMismatch(f"DCP key {key!r} of shape {list(size)}: {where}; the ranks' boxes must tile the tensor")
    return size, dtype


def _plan_keys(plans: list[SavePlan], target_bytes: int | None = None
               ) -> tuple[dict[str, _Key], dict[tuple[int, int], bool], Any]:
    """Every DCP key -> what it becomes (checked: names, shapes, tiling), which items each rank keeps, and
    the stand-in metadata (for the key paths). ``target_bytes``: the store's chunk target."""
    from ucp_store.formats.dcp.adapter import classify
    from ucp_store.io.chunking import DEFAULT_TARGET

    md = _stand_in_metadata(plans)
    classes = classify(md, None, None)
    boxes, keep = _tensor_boxes(plans)
    keys: dict[str, _Key] = {}
    for key, e in classes.items():
        if key not in boxes:
            keys[key] = _Key("bytes")
            names.object_name(key)
            continue
        size, dtype = _check_tiling(key, boxes[key])
        zarr = dtypes.zarr_name(dtype, what=f"DCP key {key!r}")
        whole = len(boxes[key]) == 1
        if e.kind != "tensor":
            if not whole:
                raise ValidationError(f"DCP key {key!r}: a sharded tensor that is no model or optimizer state "
                                      "(ucp keeps such tensors as objects, whole); save it unsharded")
            names.object_name(key)
            keys[key] = _Key("array", dtype=zarr, shape=size)
            continue
        assert e.name is not None and e.state is not None
        names.tensor_name(e.name)
        names.state_name(e.state)
        points: dict[int, set[int]] = {}
        for _, _, offsets, sizes, _, _ in boxes[key]:
            for d, (o, n) in enumerate(zip(offsets, sizes)):
                for p in (o, o + n):
                    if 0 < p < size[d]:
                        points.setdefault(d, set()).add(p)
        kind = "whole" if not size else "tensor"
        units = _chunk_units(size, zarr, points, target_bytes or DEFAULT_TARGET) if kind == "tensor" else ()
        keys[key] = _Key(kind, e.name, e.state, zarr, size, tuple((d, tuple(sorted(v))) for d, v in
                                                                  sorted(points.items())), units)
    return keys, keep, md


# --------------------------------------------------------------------------------------- the catalog
def _catalog_begin(store, run: str, step: int, message: str | None):
    """The coordinator begins the pending version (the only catalog write before ``finish``)."""
    return store.begin(run, step, message=message)


def _catalog_commit(writer, keys: dict[str, _Key], paths: dict[str, Any], results: list[list[WriteResult]],
                    version: str | None) -> None:
    """The coordinator records every rank's writes and commits: arrays hashed from the gathered chunk
    digests, shipped tensors and opaque bytes written here, the ``_dcp`` index last; one transaction."""
    from ucp_store.distributed.saver import set_region_hashes
    from ucp_store.formats.dcp.index import INDEX_OBJECT

    tensor_keys = {k: v for k, v in keys.items() if v.kind == "tensor"}
    writer.open_regions([v.region() for v in tensor_keys.values()])
    for v in tensor_keys.values():  # an empty box at the origin: this writer hashes and records the array
        assert v.name is not None and v.state is not None and v.dtype is not None
        empty = np.empty((0,) * len(v.shape), dtype=dtypes.numpy_dtype(v.dtype))
        writer.write_region(v.name, v.state, empty, shape=v.shape, offset=(0,) * len(v.shape), pattern=None,
                            boundaries=v.points(), origin=True)
    digests: list[dict] = []
    index: dict[str, Any] = {}
    for rank_results in results:
        for r in rank_results:
            key = r.index.fqn
            found, data = keys.get(key), r.storage_data
            if found is None or not isinstance(data, dict):
                raise UcpError(f"DCP save: a write result for key {key!r} that the global plan does not hold")
            v = found
            if "digests" in data:
                digests.append({(v.name, v.state): data["digests"]})
            if v.kind == "whole":
                writer.write(v.name, v.state, data["tensor"])
            elif v.kind == "array":
                writer.write_object(key, data["tensor"])
            elif v.kind == "bytes":
                raw = data["bytes"]
                writer.write_object(key, np.frombuffer(raw, dtype=np.uint8).copy())
                index[key] = {"kind": "opaque", "path": paths.get(key, [key]), "nbytes": len(raw),
                              "sha256": hashlib.sha256(raw).hexdigest(), "why": _OPAQUE_WHY, "source_transforms": []}
    set_region_hashes(writer, _merge_digests(digests))
    for key, v in keys.items():
        if v.kind in ("tensor", "whole"):
            index[key] = {"kind": "tensor", "name": v.name, "state": v.state, "path": paths.get(key, [key])}
        elif v.kind == "array":
            index[key] = {"kind": "array", "path": paths.get(key, [key])}
    missing = [k for k in keys if k not in index]
    if missing:
        raise UcpError(f"DCP save: no rank wrote key(s) {', '.join(sorted(missing)[:5])}")
    writer.write_object(INDEX_OBJECT, {"format": "dcp", "version": version, "keys": index, "saved_by": _SAVED_BY})
    writer.commit(reload=False)


def tiered_node_map(group, node: str) -> Any:
    """Every rank's node (``tiered.node_map``: a collective on ``group`` at its first tiered save)."""
    from ucp_store.distributed import tiered

    return tiered.node_map(group, node)


def _tier_save(options: dict) -> Any:
    """This rank's TierSave of a tiered save (``tier="fast"``): its node and fast-tier folder; the job's nodes
    are learnt by ``replicate`` (``finish`` records the fast copies by node from the write results)."""
    from ucp_store.distributed import tiered
    from ucp_store.tiers import node as tnode

    name = tnode.node_name(options["node"])
    root = tnode.fast_tier_root(options["fast_tier"], name)
    if root is None:
        raise ConfigurationError("UcpStorageWriter tier='fast' needs a fast tier: pass fast_tier= (a folder; may "
                                 "contain {node}) or set UCP_FAST_TIER")
    root.mkdir(parents=True, exist_ok=True)
    return tiered.TierSave(root=root, node=name, nodes=tiered.NodeMap(()), rank=0, replicas=options["replicas"])


def _tier_commit(tier, writer, results: list[list[WriteResult]]) -> None:
    """A tiered save's part of ``finish``: the fast copies every rank reported (node -> objects, in its first
    write result), recorded in the commit's transaction. The units of a content hash no rank wrote whole are
    read back from the coordinator's node, where ``write_data`` copied their files (``TierSave.to_origins``)."""
    from ucp_store.tiers.placement import ObjectInfo

    reported: dict[str, list] = {}
    for rs in results:
        for r in rs:
            rep = r.storage_data.get("tier") if isinstance(r.storage_data, dict) else None
            if rep is not None:
                reported.setdefault(rep["node"], []).extend(ObjectInfo(*o) for o in rep["objects"])
    tier.record_at_commit(writer, reported)


def _merge_digests(parts: list[dict]) -> list[dict]:
    """Per-item chunk digests -> one dict per tensor-state (None wins: a box off the chunk grid)."""
    merged: dict = {}
    for part in parts:
        for key, d in part.items():
            if d is None or (key in merged and merged[key] is None):
                merged[key] = None
            else:
                merged.setdefault(key, {}).update(d)
    return [merged]


# ------------------------------------------------------------------------------- bounded collectives
class _Bound:
    """DCP's collectives of one save bounded by the writer's ``timeout``: the process group's timeout is
    lowered to it (never raised) while a writer holds a lease, and put back when the last lease ends.

    DCP runs its plan and result exchanges on the caller's process group, which the writer cannot replace; a
    rank that dies (or hangs) leaves the others waiting there for the group's timeout (30 minutes for gloo
    by default). A lease starts in ``set_up_storage_writer`` and ends when the writer is garbage (right after
    ``dcp.save`` returns when the writer was made for the call), is set up or reset again, or at exit; the
    coordinator's ends in ``finish``. A non-coordinator has no later hook: its lease must outlive DCP's last
    broadcast."""

    _lock = threading.Lock()
    _held: dict[int, list] = {}  # id(group) -> [group, original timeout, leases]

    @classmethod
    def _current(cls, group) -> Any:
        try:
            return group._get_backend(torch.device("cpu")).options._timeout
        except (AttributeError, RuntimeError):  # a backend without readable options: left alone
            return None

    @classmethod
    def acquire(cls, group, seconds: float) -> bool:
        import datetime

        with cls._lock:
            held = cls._held.get(id(group))
            if held is not None:
                held[2] += 1
                return True
            old = cls._current(group)
            if old is None:
                return False
            new = datetime.timedelta(seconds=seconds)
            if old > new:
                group.set_timeout(new)
            cls._held[id(group)] = [group, old, 1]
            return True

    @classmethod
    def release(cls, group) -> None:
        with cls._lock:
            held = cls._held.get(id(group))
            if held is None:
                return
            held[2] -= 1
            if held[2] <= 0:
                del cls._held[id(group)]
                try:
                    group.set_timeout(held[1])
                except (RuntimeError, ValueError):  # the group was destroyed meanwhile: nothing to put back
                    pass


def _save_group(group) -> Any:
    """The process group DCP's collectives of this save run on (None: not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return group if group is not None else dist.group.WORLD


# -------------------------------------------------------------------------------------------- writer
log = logging.getLogger("ucp_store.dcp")

#: the coordinator's pending versions (CheckpointWriters), held strongly: a failed ``dcp.save`` often drops its
#: UcpStorageWriter at once, and its pending version must still be aborted at exit
_PENDING: set = set()
_PENDING_LOCK = threading.Lock()


def _abort_pending() -> None:
    """Abort every pending version this process began and no save finished (at exit)."""
    with _PENDING_LOCK:
        writers = list(_PENDING)
        _PENDING.clear()
    for w in writers:
        try:
            w.abort()
        except Exception as exc:  # noqa: BLE001 - at exit: say it, gc drops the version later
            log.warning("ucp: could not abort pending version %s at exit: %s", getattr(w, "id", "?"), exc)


# a normal exit aborts what a failed save left pending: atexit in the main process, and multiprocessing's own
# exit hook in a process it started (a spawned or forked rank leaves through os._exit, which skips atexit)
atexit.register(_abort_pending)
multiprocessing.util.Finalize(None, _abort_pending, exitpriority=10)


class UcpStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that saves into a ucp store as version ``run@step``.

    ``store``: a :class:`~ucp_store.store.Store`, a folder or a store URL (created when missing unless
    ``create=False``). ``run``/``step`` name the version; ``dcp.save(..., checkpoint_id="RUN@STEP")``
    sets them per call instead. Pass the same arguments on every rank.

    ``timeout`` (seconds, default ``ucp_store.distributed.commit.default_timeout()``: ``$UCP_DIST_TIMEOUT`` or 300)
    bounds every collective of the save: a rank that dies or hangs gives every other rank an error within
    about twice that, never a hang, and nothing is listed. The writer lowers the timeout of
    ``process_group`` (the group passed to ``dcp.save``; default the world) to it for the save (see
    :class:`_Bound`), never raises it.

    ``tier="fast"`` (issue 38; ``replicas``, ``node``, ``fast_tier``, ``fast_keep``, ``drain`` as in
    ``ucp_store.distributed.save(..., tier="fast")``): every rank writes into its node's fast-tier folder, and
    ``finish`` commits the version with its fast copies recorded (safety ``local``). Replication and the drain
    are collectives DCP's calls leave no room for: call :meth:`replicate` on every rank after ``dcp.save``
    returns (it returns the :class:`~ucp_store.distributed.tiered.TieredResult`, also kept as ``result``)."""

    def __init__(self, store: Any, run: str | None = None, step: int | None = None, *, message: str | None = None,
                 create: bool = True, timeout: float | None = None, process_group: Any = None,
                 tier: str | None = None, replicas: int = 1, node: str | None = None, fast_tier: Any = None,
                 fast_keep: int | None = None, drain: bool = True):
        from ucp_store.distributed.commit import default_timeout

        seconds = default_timeout() if timeout is None else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ConfigurationError(f"UcpStorageWriter timeout: expected a positive number of seconds, got "
                                     f"{timeout!r}")
        self.timeout = float(seconds)
        self.process_group = process_group
        self._lease: Any = None  # the group whose timeout this writer holds lowered (_Bound)
        self._lease_end: Any = None
        self._store = _StoreRef(store, create=create, lazy=True)
        if run is not None:
            names.run_name(run)
        self.run = run
        self.step = step
        self.message = message
        self.is_coordinator = False
        self.rank = 0
        self._writer: Any = None  # the coordinator's pending version, from prepare_global_plan to finish
        self._keys: dict[str, _Key] = {}
        self._paths: dict[str, Any] = {}
        if tier not in (None, "fast"):
            raise ConfigurationError(f"UcpStorageWriter tier={tier!r}: expected None or 'fast'")
        if tier is not None and replicas not in (0, 1):
            raise ConfigurationError(f"UcpStorageWriter replicas={replicas!r}: expected 0 or 1")
        self.tier_options: dict[str, Any] | None = None if tier is None else {
            "replicas": replicas, "node": node, "fast_tier": None if fast_tier is None else os.fspath(fast_tier),
            "drain": drain, **({} if fast_keep is None else {"fast_keep": fast_keep})}
        self._tier: Any = None  # this rank's TierSave of the save in hand (tier="fast"), until replicate()
        self.result: Any = None  # the TieredResult of the last replicate()

    # pickling for async_save's process executor: no open writer, store or process group crosses (the
    # checkpoint process saves on its own group, the default one there)
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_writer=None, process_group=None, _lease=None, _lease_end=None, _tier=None, result=None)
        return state

    def _bound(self) -> None:
        """Hold a lease on the save's group (``_Bound``) until the writer is released or set up again."""
        self._unbound()
        group = _save_group(self.process_group)
        if group is not None and _Bound.acquire(group, self.timeout):
            self._lease = group
            self._lease_end = weakref.finalize(self, _Bound.release, group)

    def _unbound(self) -> None:
        end, self._lease, self._lease_end = self._lease_end, None, None
        if end is not None:
            end()

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.run is None or self.step is None else f"{self.run}@{self.step}"

    @property
    def store(self):
        return self._store.get()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._drop_pending()
        self._unbound()
        if checkpoint_id is not None:
            self.run, self.step = _parse_run_step(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            _parse_run_step(checkpoint_id)
        except UcpError:
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._drop_pending()  # a pending version of a save that failed after its global plan
        if kwargs.get("use_collectives") is False:
            raise ConfigurationError("UcpStorageWriter needs DCP's collectives (use_collectives=True): the "
                                     "coordinator commits every rank's writes as one version")
        _check_run_step(self.run, self.step)
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs.get("rank", 0))
        self._tier = None if self.tier_options is None else _tier_save(self.tier_options)
        self._bound()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        keys, keep, md = _plan_keys(plans, self.store.settings["chunk_target_bytes"])
        assert self.run is not None and self.step is not None
        writer = _catalog_begin(self.store if self._tier is None else self._tier.view(self.store), self.run,
                                self.step, self.message or f"dcp.save from {len(plans)} rank(s) through {_SAVED_BY}")
        self._writer, self._keys = writer, keys
        with _PENDING_LOCK:  # at once: a failure from here on leaves a pending version that exit must abort
            _PENDING.add(writer)
        # positions in the state dict's order (the plans' keys, rank 0's first, in its order), states together
        writer.positions.set_order((str(keys[k].name), str(keys[k].state)) for k in md.state_dict_metadata
                     if k in keys and keys[k].kind in ("tensor", "whole"))
        self._paths = {k: list(v) for k, v in md.planner_data.items() if isinstance(v, (tuple, list))}
        out = []
        facts = store_facts(self.store)
        durable = None if self._tier is None else self._tier.durable_facts()
        for rank, plan in enumerate(plans):
            items = [it for i, it in enumerate(plan.items) if keep[(rank, i)]]
            mine = {it.index.fqn: keys[it.index.fqn] for it in items}
            out.append(dataclasses.replace(plan, items=items,
                                           storage_data=_PlanData(writer.id, mine, facts, durable)))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        try:
            fut.set_result(self._write(plan, planner))
        except BaseException as exc:  # noqa: BLE001 - DCP collects every rank's failure from the future
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch types the argument as the result type
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        if self._tier is None:
            return self._write_items(plan, planner)[0]
        return self._write_tiered(plan, planner)

    def _write_tiered(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """A tiered save's ``write_data``: the items into this node's fast tier, then (a collective of every
        rank) the files of arrays with units no rank wrote whole are copied to the coordinator's node, which
        reads them back in ``finish`` (``TierSave.to_origins``); each rank reports its node's objects."""
        from ucp_store.distributed.context import Ctx

        tier = self._tier
        ctx = Ctx(self.process_group)
        error: BaseException | None = None
        results: list[WriteResult] = []
        writer: Any = None
        try:
            results, writer = self._write_items(plan, planner)
        except BaseException as exc:  # noqa: BLE001 - every rank learns of it in the exchange that follows
            error = exc
        if ctx.group is not None:
            tier.rank = ctx.rank
            tier.nodes = tiered_node_map(ctx.group, tier.node)
            error = tier.to_origins(writer, ctx.group, error, origin_rank=0)
        if error is not None:
            raise error
        if results:  # the objects of this node's folder, for finish to record
            objs = [[o.key, o.nbytes, o.crc32c] for o in tier.describe_node()]
            results[0].storage_data["tier"] = {"node": tier.node, "objects": objs}
        return results

    def _write_items(self, plan: SavePlan, planner: SavePlanner) -> tuple[list[WriteResult], Any]:
        from ucp_store.save.writer import CheckpointWriter

        data = plan.storage_data
        if not isinstance(data, _PlanData):
            raise UcpError("UcpStorageWriter.write_data: the plan lacks the coordinator's storage data (was "
                           "prepare_global_plan of this writer run?)")
        facts = data.store
        if self._tier is not None and data.durable is not None:  # a tiered save: this node's fast-tier folder
            self._tier.checkpoint_id = data.checkpoint_id
            facts = self._tier.relocate_facts(facts, data.durable)
        writer = self._writer if self.is_coordinator else CheckpointWriter(detached_store(facts),
                                                                           data.checkpoint_id, owner=False)
        writer.defer_durability()
        # every zarr.json has one writer: the coordinator, origin of every array, writes them in finish
        # (a create-or-open by each rank is not atomic on S3 or NFS)
        writer.origin_writes_metadata()
        regions = {k: v for k, v in data.keys.items() if v.kind == "tensor"}
        writer.open_regions([v.region() for v in regions.values()])
        results: list[WriteResult] = []
        for item in plan.items:
            key = item.index.fqn
            v = data.keys[key]
            if item.type == WriteItemType.BYTE_IO:
                buf: Any = planner.resolve_data(item)
                raw = buf.getvalue() if isinstance(buf, io.BytesIO) else bytes(buf.read())
                results.append(WriteResult(item.index, len(raw), {"bytes": raw}))
                continue
            t: Any = planner.resolve_data(item)
            t = t.detach().cpu()  # a no-op for a host tensor
            if v.kind == "tensor":
                assert item.tensor_data is not None and v.name is not None and v.state is not None
                offsets = tuple(int(x) for x in item.tensor_data.chunk.offsets)
                n = writer.write_region(v.name, v.state, t, shape=v.shape, offset=offsets, pattern=None,
                                        boundaries=v.points())
                results.append(WriteResult(item.index, n * t.element_size(), {}))
            else:  # "whole" / "array": small; the coordinator writes it
                results.append(WriteResult(item.index, t.numel() * t.element_size(), {"tensor": t.clone()}))
        digests = writer.region_digests()  # waits for every write
        writer.make_durable_async().result()  # durable before DCP gathers the results to the coordinator
        for i, r in enumerate(results):
            v = data.keys[r.index.fqn]
            if v.kind == "tensor":
                results[i] = dataclasses.replace(r, storage_data={"digests": digests.get((v.name, v.state))})
        return results, writer

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            raise UcpError("UcpStorageWriter.finish: no pending version (prepare_global_plan did not run here)")
        with _PENDING_LOCK:
            _PENDING.discard(writer)
        paths = dict(self._paths)
        if isinstance(metadata.planner_data, dict):
            paths.update({k: list(v) for k, v in metadata.planner_data.items() if isinstance(v, (tuple, list))})
        try:
            if self._tier is not None:
                _tier_commit(self._tier, writer, results)
            _catalog_commit(writer, self._keys, paths, results, metadata.version)
        except BaseException:
            writer.abort()
            raise
        finally:
            self._unbound()  # DCP's last collective here is this rank's broadcast of the outcome

    def replicate(self) -> Any:
        """A tiered save's phases 3-4 (``tier="fast"``), on every rank of ``process_group`` after ``dcp.save``
        returned (a collective): the version, committed ``local`` by ``finish``, is replicated to the partner
        nodes (``replicas=1``) with ``ucp_store.distributed.tiered``'s own functions, and its drain to the durable
        tier is queued (``drain=True``). Returns the ``TieredResult`` (also ``self.result``): ``.safety``,
        ``.wait("durable", timeout)``."""
        from ucp_store.distributed import tiered
        from ucp_store.distributed.context import Ctx

        tier, self._tier = self._tier, None
        if tier is None or tier.durable is None or not tier.checkpoint_id:
            raise UcpError("UcpStorageWriter.replicate: no tiered save to replicate (construct the writer with "
                           "tier='fast' and call replicate() on every rank once dcp.save has returned)")
        assert self.run is not None and self.tier_options is not None
        ctx = Ctx(self.process_group)
        options = {k: v for k, v in self.tier_options.items() if k != "node"}
        tiers = tiered.setup(ctx, node=tier.node, **options)
        self.result = tiers.committed(ctx, checkpoint_id=tier.checkpoint_id, run=self.run, durable=tier.durable,
                                      store=tier.store if ctx.rank == 0 else None)
        return self.result

    def _drop_pending(self) -> None:
        writer, self._writer = self._writer, None
        with _PENDING_LOCK:
            _PENDING.discard(writer)
        if writer is not None:
            writer.abort()


# -------------------------------------------------------------------------------------------- reader
@dataclasses.dataclass(frozen=True)
class _Serve:
    """How the reader serves one DCP key: a tensor-state, an array object, an opaque blob or a JSON value."""

    kind: str  # "tensor" | "array" | "opaque" | "value"
    name: str
    state: str | None = None
    sha256: str | None = None


def _tensor_md(shape: Iterable[int], dtype: torch.dtype) -> TensorStorageMetadata:
    size = torch.Size(int(x) for x in shape)
    return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=size,
                                 chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)])


def _aliases(name: str, state: str, model_state: str) -> list[tuple[str, tuple]]:
    """The flattened keys a DCP state dict may use for (name, state), with their nested paths."""
    if state == model_state:
        return [(f"model.{name}", ("model", name)), (name, (name,))]
    if state in ("fp32", "weight"):
        return []
    return [(f"{head}.state.{name}.{state}", (head, "state", name, state)) for head in ("optim", "optimizer")] + \
        [(f"state.{name}.{state}", ("state", name, state))]


def dcp_keys(checkpoint) -> dict[str, tuple[_Serve, tuple]]:
    """Every DCP key a version offers -> (how it is served, its nested path): the keys of its ``_dcp`` index
    (a DCP import or a save through this backend), then the flattened aliases of every tensor-state (the
    rule of ``ucp export dcp``: model state ``fp32`` when present, else ``weight``)."""
    from ucp_store.formats.dcp.index import read_index

    infos = {(i.name, i.state): i for i in checkpoint.tensors()}
    out: dict[str, tuple[_Serve, tuple]] = {}
    index = read_index(checkpoint)
    for key, v in ((index or {}).get("keys") or {}).items():
        path = tuple(v.get("path") or [key])
        kind = v.get("kind")
        if kind == "tensor" and (v.get("name"), v.get("state")) in infos:
            out[key] = (_Serve("tensor", v["name"], v["state"]), path)
        elif kind in ("array", "value", "opaque"):
            out[key] = (_Serve(kind, key, sha256=v.get("sha256")), path)
    model_state = "fp32" if any(s == "fp32" for _, s in infos) else "weight"
    for (name, state) in infos:
        for key, path in _aliases(name, state, model_state):
            out.setdefault(key, (_Serve("tensor", name, state), path))
    return out


class UcpStorageReader(StorageReader):
    """A DCP ``StorageReader`` over one committed version of a ucp store (``ref``: ``RUN@STEP``,
    ``RUN@latest``, ``RUN:TAG`` or an id; ``dcp.load(..., checkpoint_id=REF)`` sets it per call)."""

    def __init__(self, store: Any, ref: str | None = None):
        self._store = _StoreRef(store, create=False)
        self.ref = ref
        self.checkpoint_id = None if ref is None else self.store.resolve(ref)  # a missing ref fails here
        self._serve: dict[str, _Serve] = {}
        self._objects: dict[str, Any] = {}

    @property
    def store(self):
        return self._store.get()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.ref = os.fspath(checkpoint_id)
            self.checkpoint_id = self.store.resolve(self.ref)
        self._serve, self._objects = {}, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, str) and bool(checkpoint_id)

    def _checkpoint(self):
        from ucp_store.registry.checkpoint import Checkpoint

        if self.checkpoint_id is None:
            raise ConfigurationError("UcpStorageReader needs a ref (UcpStorageReader(store, ref) or "
                                     "dcp.load(..., checkpoint_id=REF))")
        return Checkpoint(self.store, self.checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        ck = self._checkpoint()
        infos = {(i.name, i.state): i for i in ck.tensors()}
        sdm: dict[str, Any] = {}
        planner_data: dict[str, tuple] = {}
        serve: dict[str, _Serve] = {}
        for key, (s, path) in dcp_keys(ck).items():
            if s.kind == "tensor":
                info = infos[(s.name, s.state)]
                sdm[key] = _tensor_md(info.shape, dtypes.torch_dtype(info.dtype))
            elif s.kind == "array":
                t = self._object(ck, s.name)
                sdm[key] = _tensor_md(t.shape, t.dtype)
            else:
                sdm[key] = BytesStorageMetadata()
            serve[key] = s
            planner_data[key] = path
        storage = {MetadataIndex(k, torch.Size([0] * len(v.size)) if isinstance(v, TensorStorageMetadata)
                                 else None): serve[k] for k, v in sdm.items()}
        return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=ck.id), version=None)

    def _object(self, ck, name: str) -> Any:
        from ucp_store.formats.dcp.adapter import read_object

        if name not in self._objects:
            self._objects[name] = read_object(ck, name)
        return self._objects[name]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._serve = {idx.fqn: s for idx, s in (metadata.storage_data or {}).items() if isinstance(s, _Serve)}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()
        try:
            self._read(plan, planner)
            fut.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - DCP collects every rank's failure from the future
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch types the argument as the result type
        return fut

    def _bytes(self, ck, s: _Serve) -> bytes:
        if s.kind == "opaque":
            raw = self._object(ck, s.name)
            raw = raw.numpy().tobytes() if isinstance(raw, torch.Tensor) else bytes(raw)
            if s.sha256 and hashlib.sha256(raw).hexdigest() != s.sha256:
                raise UcpError(f"checkpoint {ck.id}: opaque DCP entry {s.name!r} does not match its recorded sha256")
            return raw
        from ucp_store.safe_pickle import from_jsonable

        buf = io.BytesIO()
        torch.save(from_jsonable(self._object(ck, s.name)), buf)
        return buf.getvalue()

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        from ucp_store.geometry import Box
        from ucp_store.io.read import Reader, Sink

        ck = self._checkpoint()
        infos = {(i.name, i.state): i for i in ck.tensors()}
        reader = Reader(ck, infos=infos)
        done: list[tuple[Any, torch.Tensor]] = []
        for item in plan.items:
            key = item.storage_index.fqn
            s = self._serve.get(key)
            if s is None:
                raise UcpError(f"checkpoint {ck.id} has no DCP key {key!r}")
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self._bytes(ck, s)))
                continue
            target = planner.resolve_tensor(item).detach()
            box = tuple(slice(int(o), int(o) + int(n)) for o, n in zip(item.storage_offsets, item.lengths))
            if s.kind == "array":
                target.copy_(self._object(ck, s.name)[box])
            else:
                info = infos[(s.name, s.state)]
                reader.submit(info, Box(tuple((b.start, b.stop) for b in box)), Sink(target))
            done.append((item, target))
        reader.drain()
        for item, target in done:
            planner.commit_tensor(item, target)
