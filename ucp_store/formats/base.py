"""The adapter interface: what a source yields, and the one function that stores it.

A *source* is anything a checkpoint can come from: a DeepSpeed tag folder, a universal folder, a torch
file, a DCP folder, a Hugging Face folder, a live sharded state dict. Each one is read by an adapter that
turns it into a stream of :class:`TensorRecord` (name, state, logical tensor or a rank's shard, pattern)
plus JSON objects and provenance. :func:`import_source` owns everything else, once for every source:

1. (rank 0) ``store.begin`` / (other ranks) ``store.join`` the pending version;
2. write every record (whole tensors through ``CheckpointWriter.write``, shards through
   ``write_shard``), flushing every ``inflight_bytes`` so memory stays bounded, with a progress bar;
   a source may yield a *group* (a tuple of records: one parameter's states), which the progress bar
   counts as one step and a flush never splits; with ``prefetch`` the records are produced in a background
   thread (``_window.prefetch``, bounded bytes ahead) while the caller's thread writes;
3. ``source.objects()`` (called only after ``records()`` is exhausted, so a source may collect what it
   saw), merged over ranks (:func:`merge_objects`: equal content once, content that differs across ranks
   per rank with the importing topology, never one rank's alone) and written by rank 0;
4. commit (rank 0, after every rank's arrays are durable) or abort everywhere on any error.

Nothing is listed before step 4 succeeds. Under ``torch.distributed`` each rank's source yields its own
share (the adapter decides the split); the ranks agree through ``ucp_store.distributed.commit``.

A *sink* is the reverse: it takes a committed :class:`~ucp_store.registry.checkpoint.Checkpoint` and writes a
foreign layout (a torch file, a universal folder, a DCP folder, an HF folder). Sinks write under a
temporary name and rename at the end, so a crash never leaves a folder a foreign loader would accept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Protocol,
    runtime_checkable,
)

from ucp_store import config, typed_json
from ucp_store._killpoints import killpoint
from ucp_store.errors import SourceFormatError, UcpError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

    from ucp_store.registry.checkpoint import Checkpoint
    from ucp_store.save.writer import CheckpointWriter
    from ucp_store.store import Store

__all__ = ["ShardSpec", "TensorRecord", "RecordGroup", "Source", "Sink", "import_source", "write_records",
           "merge_objects", "group_nbytes", "parse_json", "MAX_JSON_DEPTH", "destination"]


#: the deepest nesting a foreign JSON document (a Hugging Face config or index, a safetensors header, a name
#: map, ``--config``) may have. Real ones nest a handful of levels; a deeper one is refused where it is read,
#: before Python's recursive encoders, decoders and reprs (the catalog's JSON columns included) meet it.
MAX_JSON_DEPTH = 100


def _too_deep(value: Any) -> bool:
    """Whether ``value`` nests lists/objects more than ``MAX_JSON_DEPTH`` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > MAX_JSON_DEPTH:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def destination(path: Any, what: str) -> str:
    """An export's destination as given (``os.fspath``), refusing an empty one: ``os.path.abspath("")`` is the
    current folder, which an export would then write into or refuse with a message about the wrong path."""
    import os

    text = os.fspath(path) if path is not None else ""
    if not text:
        from ucp_store.errors import ConfigurationError

        raise ConfigurationError(f"cannot write {what} to '': expected a path (the destination is empty)")
    return text


def parse_json(raw: str | bytes, what: str, *, error: type[UcpError] = SourceFormatError,
               object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """``json.loads`` of a foreign document, refusing with ``error`` (naming ``what``: the file) what the
    standard decoder would raise as something else or accept and break on later: invalid JSON or UTF-8,
    nesting past ``MAX_JSON_DEPTH`` (the decoder itself raises RecursionError near 1000 levels), and an
    integer of more digits than Python converts (4300 by default: ValueError)."""
    try:
        value = json.loads(raw, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise error(f"{what}: JSON nested more than {MAX_JSON_DEPTH} levels deep (lists/objects); "
                    "real ones nest a few") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and the integer digit limit
        text = str(exc)
        if "integer string conversion" in text:
            text = "it holds an integer with more digits than Python converts (4300)"
        raise error(f"{what} is not valid JSON ({text})") from None
    if _too_deep(value):
        raise error(f"{what}: JSON nested more than {MAX_JSON_DEPTH} levels deep (lists/objects); "
                    "real ones nest a few")
    return value


@dataclass(frozen=True)
class ShardSpec:
    """Where a record's tensor sits when it is one rank's share, not the whole logical tensor.

    The fields are ``CheckpointWriter.write_shard``'s: the logical ``shape``, the source ``topology`` and
    ``rank``, and for a ZeRO flat fragment its ``fragment`` (start/numel in the rank's flat buffer)."""

    shape: tuple[int, ...]
    topology: Any
    rank: int
    fragment: Any = None
    targets: tuple = ()


@dataclass(frozen=True)
class TensorRecord:
    """One tensor-state of a source.

    ``tensor`` is the whole logical tensor (``shard is None``) or one rank's share (``shard`` set).
    ``position`` orders tensor-states in the version (ZeRO group layouts follow it); ``None`` means the
    order of writing. Under torch.distributed every rank must pass the global order."""

    name: str
    state: str
    tensor: "torch.Tensor | np.ndarray"
    pattern: dict | None = None
    position: int | None = None
    shard: ShardSpec | None = None

    @property
    def nbytes(self) -> int:
        t = self.tensor
        return int(t.nbytes) if hasattr(t, "nbytes") else t.numel() * t.element_size()  # type: ignore[union-attr]


#: what ``Source.records`` yields: one record, or a group of records written and counted together
RecordGroup = TensorRecord | Sequence[TensorRecord]


def _group(item: RecordGroup) -> Sequence[TensorRecord]:
    return (item,) if isinstance(item, TensorRecord) else item


def group_nbytes(item: RecordGroup) -> int:
    """Bytes of a record or a group of records (the prefetch window's measure)."""
    return sum(r.nbytes for r in _group(item))


@runtime_checkable
class Source(Protocol):
    """A checkpoint to import. Call order: ``describe``/``provenance`` (any time), ``records`` once,
    then ``objects`` once (it may depend on what ``records`` yielded)."""

    #: provenance ``source_kind`` (``deepspeed``, ``torch_file``, ``dcp``, ``hf``, ``dist``, ...)
    kind: str

    def describe(self) -> str:
        """A short human name for progress bars and messages (usually the path)."""
        ...

    def provenance(self) -> Mapping[str, Any]:
        """``source_path``, ``source_topology``, ``source_hashes``, ``library_versions``, ``extra``."""
        ...

    def records(self) -> Iterable[RecordGroup]:
        """Every tensor-state this rank contributes (records, or tuples of records written together).

        Optional attributes ``import_source`` reads: ``total`` (number of items ``records`` yields, for
        the progress bar), ``prefetch`` (True: produce records in a background thread) and
        ``objects_partitioned`` (True: under torch.distributed the ranks' ``objects`` are shares of one set,
        see :func:`merge_objects`)."""
        ...

    def objects(self) -> Mapping[str, Any]:
        """JSON objects to store beside the tensors (config, scheduler, step counters, ...)."""
        ...


@runtime_checkable
class Sink(Protocol):
    """A foreign layout to export into: ``write(checkpoint, dest, **options)`` returns a summary."""

    kind: str

    def write(self, checkpoint: "Checkpoint", dest: str, **options: Any) -> Mapping[str, Any]:
        ...


def _content(value: Any) -> Any:
    """A comparable stand-in for an object's content: canonical JSON, or dtype, shape and bytes of an array."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().contiguous().numpy()
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
        import hashlib

        return ("array", str(value.dtype), tuple(value.shape), hashlib.blake2b(value.tobytes()).hexdigest())
    try:  # the stored form: a tuple and a list, or 1 and "1" as keys, are different content
        return json.dumps(typed_json.encode(value), sort_keys=True, allow_nan=True)
    except (TypeError, ValueError, UcpError):  # not storable at all: compared by their repr
        return repr(value)


def _shares(values: list[Any]) -> dict | None:
    """Several ranks' dict shares of one object merged (entries in rank order), or None when two ranks hold
    different content under one entry (then nothing may be merged away)."""
    merged: dict = {}
    for v in values:
        for kk, vv in v.items():
            if kk in merged and _content(merged[kk]) != _content(vv):
                return None
            merged.setdefault(kk, vv)
    return merged


def merge_objects(parts: Sequence[Mapping[str, Any]], *, partitioned: bool = False,
                  global_ranks: Sequence[int] | None = None, kind: str | None = None) -> dict[str, Any]:
    """Objects from the ranks of one import (``parts[r]``: rank r's), merged without losing any rank's content.

    An object every rank holds with equal content is stored once. With ``partitioned`` (the source splits
    its objects over the ranks: rank 0 reads the shared ones, the others add what only they saw), an object
    only some ranks hold is stored once too, and dict objects several ranks hold are merged entry by entry
    when no entry differs. Any other object -- content that differs across ranks, or (without
    ``partitioned``) held by only some ranks -- is per-rank state (issue 28): each distinct content is
    stored once under ``rank_record.object_name(owner, i)`` and the per-rank record
    (``rank_record.RECORD_OBJECT``, source ``import``) lists every holding rank's entry with the importing
    ranks' topology (``global_ranks``, default ``0..world-1``), as ``ucp_store.distributed.save`` does."""
    from ucp_store.catalog.rank_record import RECORD_OBJECT, object_name

    world = len(parts)
    order: dict[str, None] = {}
    for part in parts:
        order.update(dict.fromkeys(part))
    out: dict[str, Any] = {}
    per_rank: list[str] = []
    for k in order:
        holders = [r for r in range(world) if k in parts[r]]
        values = [parts[r][k] for r in holders]
        if len({_content(v) for v in values}) == 1 and (partitioned or len(holders) == world):
            out[k] = values[0]
            continue
        if partitioned and all(isinstance(v, dict) for v in values):
            merged = _shares(values)
            if merged is not None:
                out[k] = merged
                continue
        per_rank.append(k)
    if not per_rank:
        return out
    clash = sorted(k for k in order if k == RECORD_OBJECT or k.startswith(RECORD_OBJECT + "/"))
    if clash:
        raise UcpError(f"import ({kind or 'source'}): object(s) {per_rank[:5]} differ across the importing ranks and "
                       f"must be stored per rank, but the source writes its own per-rank record ({clash[:3]})")
    from ucp_store.distributed.rankstate import PerRankEntry, PerRankKey, PerRankManifest, RankTopology, key_order

    keys = []
    for i, k in enumerate(sorted(per_rank, key=lambda k: key_order((k,)))):
        owners: dict[Any, int] = {}
        entries = []
        for r in range(world):
            if k not in parts[r]:
                continue
            v = parts[r][k]
            owner = owners.setdefault(_content(v), r)
            if owner == r:
                out[object_name(owner, i)] = v
            is_array = isinstance(_content(v), tuple)
            entries.append(PerRankEntry(r, "tensor" if is_array else "value", object_name(owner, i)))
        keys.append(PerRankKey((k,), tuple(entries)))
    topo = RankTopology.flat(world, None if global_ranks is None else tuple(global_ranks))
    out[RECORD_OBJECT] = {"source": "import", "import_kind": kind, **PerRankManifest(topo, tuple(keys)).to_json()}
    return out


def _default_inflight() -> int:
    return config.current().import_inflight_bytes


def write_records(writer: "CheckpointWriter", records: Iterable[RecordGroup], *, inflight_bytes: int | None = None,
                  progress: bool = False, description: str = "import", total: int | None = None,
                  on_record: Callable[[TensorRecord], None] | None = None) -> int:
    """Write records (or groups of records) into an open writer, flushing once ``inflight_bytes`` were
    written since the last flush (never inside a group); returns bytes written."""
    from ucp_store.progress import track

    limit = _default_inflight() if inflight_bytes is None else inflight_bytes
    n = since = 0
    for item in track(records, description, enabled=progress, total=total):
        for rec in _group(item):
            t: Any = rec.tensor  # a torch.Tensor or a numpy array (the writer takes both)
            if hasattr(t, "is_contiguous") and not t.is_contiguous():
                t = t.contiguous()
            if rec.shard is None:
                writer.write(rec.name, rec.state, t, pattern=rec.pattern, position=rec.position)
            else:
                s = rec.shard
                writer.write_shard(rec.name, rec.state, t, shape=s.shape, pattern=rec.pattern, topology=s.topology,
                                   rank=s.rank, fragment=s.fragment, targets=s.targets)
            nb = rec.nbytes
            n += nb
            since += nb
            if on_record is not None:
                on_record(rec)
        if since >= limit:
            writer.flush()
            since = 0
    return n


def _records(source: Source, prefetch: bool | None) -> Iterable[RecordGroup]:
    recs = source.records()
    if prefetch if prefetch is not None else getattr(source, "prefetch", False):
        from ucp_store.io.window import prefetch as ahead

        return ahead(recs, nbytes=group_nbytes, name=f"ucp-{source.kind}-reader")
    return recs


def _dist_group(distributed: bool | None, group: Any):
    """(dist module, rank, world) when this import runs over torch.distributed, else (None, 0, 1)."""
    if distributed is False:
        return None, 0, 1
    try:
        import torch.distributed as dist
    except Exception:  # pragma: no cover - torch without distributed
        return None, 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        if distributed:
            from ucp_store.errors import ConfigurationError

            raise ConfigurationError("distributed=True, but torch.distributed is not initialised "
                                     "(call dist.init_process_group first, or run under torchrun)")
        return None, 0, 1
    world = dist.get_world_size(group)
    if world == 1:
        return None, 0, 1
    return dist, dist.get_rank(group), world


def _gather_objects(objs: Mapping[str, Any], group: Any, rank: int) -> list[bytes] | None:
    """Every rank's objects on rank 0 (None elsewhere): one gather of JSON bytes (``coord.to_wire``: tuples,
    bytes, tensors and arrays tagged; never a pickle). A rank whose objects cannot travel sends its error
    instead, so that no rank is left waiting; :func:`_decode_objects` on rank 0 raises it."""
    from ucp_store.distributed import coord

    try:
        data = coord.encode({"objects": coord.to_wire(dict(objs), f"rank {rank}'s import objects")})
    except Exception as exc:  # noqa: BLE001 - raised on rank 0 after the gather
        data = coord.encode(coord.error_payload(exc))
    return coord.gather_bytes(data, group)


def _decode_objects(parts: list[bytes] | None) -> list[dict]:
    from ucp_store.distributed import coord

    assert parts is not None  # rank 0's gather
    out = []
    for r, p in enumerate(parts):
        answer = coord.decode(p)
        if "error" in answer:
            raise UcpError(f"import: rank {r}'s objects cannot be gathered: {answer['error']}")
        out.append(coord.from_wire(answer["objects"]))
    return out


def import_source(store: "Store | Callable[[], Store]", source: Source, run: str, step: int, *,
                  message: str | None = None, parent: str | None = "auto", progress: bool = True,
                  distributed: bool | None = None, group: Any = None, inflight_bytes: int | None = None,
                  total: int | None = None, prefetch: bool | None = None) -> str:
    """Store ``source`` as ``run@step``; returns the committed version id (the same on every rank).

    ``distributed=None`` runs over torch.distributed when it is initialised with more than one rank
    (every rank must call this with its own share); ``False`` forces a single-process import. On any error,
    on any rank, every rank raises and nothing is listed. ``total``/``prefetch`` default to the source's
    attributes of that name (see :class:`Source`)."""
    from ucp_store.errors import ImportFailedError

    dist, rank, world = _dist_group(distributed, group)
    prov = dict(source.provenance())
    msg = message or f"import of {source.kind} checkpoint {source.describe()}"
    description = f"import {source.describe()}"
    show = progress and rank == 0
    if total is None:
        total = getattr(source, "total", None)
    if dist is None:
        if callable(store):
            store = store()
        writer = store.begin(run, step, parent=parent, message=msg, provenance=prov)
        try:
            write_records(writer, _records(source, prefetch), inflight_bytes=inflight_bytes, progress=show,
                          description=description, total=total)
            killpoint("import.after_records")
            for k, v in source.objects().items():
                writer.write_object(k, v)
        except BaseException:
            writer.abort()
            raise
        return writer.commit().id

    from ucp_store.distributed.commit import all_ok, distributed_begin, distributed_commit

    writer = distributed_begin(store, run, step, group=group, parent=parent, message=msg, provenance=prov)
    error: BaseException | None = None
    objs: Mapping[str, Any] = {}
    try:
        write_records(writer, _records(source, prefetch), inflight_bytes=inflight_bytes, progress=show,
                      description=description, total=total)
        objs = source.objects()
    except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
        error = exc
    if not all_ok(error is None, group):
        writer.abort()
        raise ImportFailedError(f"import of {source.describe()} failed on some rank; aborted (nothing listed)") \
            from error
    # every rank's objects to rank 0 alone, as JSON bytes (never a pickle); rank 0 merges and writes them
    gathered = _gather_objects(objs, group, rank)
    if rank == 0:
        try:
            parts = _decode_objects(gathered)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
            merged = merge_objects(parts, partitioned=bool(getattr(source, "objects_partitioned", False)),
                                   global_ranks=ranks, kind=source.kind)
            for k, v in merged.items():
                writer.write_object(k, v)
        except BaseException as exc:  # noqa: BLE001
            error = exc
    if not all_ok(error is None, group):
        writer.abort()
        raise ImportFailedError(f"import of {source.describe()} failed while writing its objects; aborted") from error
    return distributed_commit(writer, group=group)
