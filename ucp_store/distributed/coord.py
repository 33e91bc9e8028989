"""One catalog client per job: the coordinator (rank 0 of the group) alone touches the catalog.

A multi-rank save or load opens one catalog connection, whatever the rank count (PostgreSQL's default
``max_connections`` is 100; a 1,000-rank job fetching every tensor row per rank is 1,000 copies of one
query). The coordinator opens the store, begins, resolves and reads the rows; the other ranks get what they
need in one broadcast and send what the coordinator records in one gather. Those payloads are JSON bytes
in a uint8 tensor, never pickles: a rank unpickling another rank's bytes would run whatever they name.

- :func:`broadcast_bytes`, :func:`gather_bytes`, :func:`scatter_bytes`: bytes over a (gloo) group, length
  first (two collectives each: gloo's tensors have fixed sizes);
- :func:`encode` / :func:`decode`: compact JSON;
- :func:`store_facts` / :func:`detached_store`: a store's location and settings, and a :class:`Store` on a
  non-coordinator rank built from them that does array I/O with no catalog (any catalog use is an error
  naming the rank's role);
- :func:`detached_checkpoint`: a committed version's rows and objects as the coordinator read them;
  :func:`version_everywhere`: a version on every rank, opened and read by the coordinator alone;
- :func:`to_wire` / :func:`from_wire`: records with tuples, tuple-keyed dicts, bytes and small tensors as JSON
  values (tagged), for the ranks' exchanges that carry more than plain JSON.

Every collective here runs on the group the caller passes: the bounded-timeout gloo control group of
``ucp_store.distributed.commit.control_group``, so a dead rank is an error, never a hang.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ucp_store import typed_json
from ucp_store.errors import UcpError

__all__ = ["NoCatalog", "broadcast_bytes", "decode", "detached_checkpoint", "detached_store", "encode",
           "from_wire", "from_coordinator", "gather_bytes", "info_from_json", "info_to_json", "scatter_bytes",
           "store_facts", "to_wire", "version_everywhere", "version_payload"]

#: counters of this process's coordinator payloads (tools/bench_scale.py real reports them)
STATS: dict[str, int] = {"broadcast_bytes": 0, "gathered_bytes": 0, "scattered_bytes": 0}


def encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    return json.loads(data.decode())


def _src(group, rank: int = 0) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _as_tensor(data: bytes, size: int | None = None) -> torch.Tensor:
    t = torch.zeros(size if size is not None else len(data), dtype=torch.uint8)
    if data:
        t[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t


def broadcast_bytes(data: bytes | None, group=None) -> bytes:
    """Group rank 0's ``data`` on every rank (the others pass None): its length, then the bytes."""
    me = dist.get_rank(group)
    n = torch.tensor([len(data) if me == 0 and data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src=_src(group), group=group)
    size = int(n.item())
    buf = _as_tensor(data if me == 0 and data is not None else b"", size)
    if size:
        dist.broadcast(buf, src=_src(group), group=group)
    STATS["broadcast_bytes"] += size
    return bytes(buf.numpy().tobytes()) if me != 0 else (data or b"")


def _framed(data: bytes, size: int) -> torch.Tensor:
    """``data`` after its 8-byte length, zero-padded to ``size`` bytes."""
    return _as_tensor(len(data).to_bytes(8, "little") + data, size)


def _unframe(t: torch.Tensor) -> bytes:
    raw = t.numpy().tobytes()
    n = int.from_bytes(raw[:8], "little")
    return bytes(raw[8:8 + n])


def gather_bytes(data: bytes, group=None) -> list[bytes] | None:
    """Every rank's ``data`` on group rank 0 (None elsewhere): the longest length (an all_reduce of one
    integer), then every rank's bytes, framed by their length and padded to the longest (gloo gathers equal
    sizes). Two collectives."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    top = torch.tensor([len(data) + 8], dtype=torch.int64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    longest = int(top.item())
    parts = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)] if me == 0 else None
    dist.gather(_framed(data, longest), parts, dst=_src(group), group=group)
    STATS["gathered_bytes"] += len(data)
    return None if parts is None else [_unframe(p) for p in parts]


def scatter_bytes(parts: list[bytes] | None, group=None) -> bytes:
    """Group rank 0's ``parts[r]`` on rank ``r`` (the others pass None): the longest part's length (one
    broadcast), then every part framed by its length and padded to it. Two collectives; no rank but the
    coordinator receives more than the longest single part."""
    me = dist.get_rank(group)
    head = torch.tensor([max((len(p) for p in parts or ()), default=0) + 8 if me == 0 else 0], dtype=torch.int64)
    dist.broadcast(head, src=_src(group), group=group)
    longest = int(head.item())
    out = torch.zeros(longest, dtype=torch.uint8)
    dist.scatter(out, [_framed(p, longest) for p in parts] if me == 0 and parts is not None else None,
                 src=_src(group), group=group)
    mine = _unframe(out)
    STATS["scattered_bytes"] += len(mine)
    return mine


def all_to_all_bytes(parts: list[list[Any]], recv: list[int], group=None) -> list[memoryview]:
    """Each rank's ``parts[r]`` (numpy arrays, sent as their raw bytes, in order) to rank ``r``, in one
    ``all_to_all_single``; ``recv[s]``: the bytes this rank gets from rank ``s`` (the caller knows them).
    Returns, per sending rank, what arrived."""
    import numpy as np

    send = [sum(int(a.nbytes) for a in p) for p in parts]
    inp = torch.empty(sum(send), dtype=torch.uint8)
    pos = 0
    for p in parts:
        for a in p:
            n = int(a.nbytes)
            inp[pos:pos + n] = torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            pos += n
    out = torch.empty(sum(recv), dtype=torch.uint8)
    dist.all_to_all_single(out, inp, list(recv), send, group=group)
    STATS["all_to_all_bytes"] = STATS.get("all_to_all_bytes", 0) + sum(send)
    raw, arrived, pos = out.numpy().data, [], 0
    for n in recv:
        arrived.append(raw[pos:pos + n])
        pos += n
    return arrived


def from_coordinator(work: Callable[[], tuple[Any, dict]], group, what: str) -> tuple[Any, dict]:
    """``(value, answer)`` on every rank of ``group``: group rank 0 alone runs ``work()``, which returns its own
    ``value`` and the ``answer`` (a JSON dict) the others need, and broadcasts that answer; the other ranks
    get ``(None, answer)``. A failure of ``work`` raises on every rank: in its own class on rank 0, through
    :func:`raise_remote` naming ``what`` elsewhere. A collective of ``group``."""
    value, error, payload = None, None, None
    if dist.get_rank(group) == 0:
        try:
            value, answer = work()
            payload = encode(answer)
        except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
            error = exc
            payload = encode(error_payload(exc))
    answer = decode(broadcast_bytes(payload, group))
    if error is not None:
        raise error
    if "error" in answer:
        raise_remote(answer, what)
    return value, answer


def error_payload(exc: BaseException) -> dict:
    """The coordinator's failure, for the other ranks: its class name and message."""
    return {"error": f"{type(exc).__name__}: {exc}", "kind": type(exc).__name__, "message": str(exc)}


def raise_remote(answer: dict, what: str) -> None:
    """Raise, on a non-coordinator rank, the coordinator's error in its own class (a ``ucp_store.errors``
    class; ``UcpError`` for any other), so every rank raises alike."""
    from ucp_store import errors

    cls = getattr(errors, str(answer.get("kind")), None)
    if isinstance(cls, type) and issubclass(cls, errors.UcpError):
        raise cls(f"{answer.get('message')} (on the coordinator, rank 0, during {what})")
    raise UcpError(f"{what}: the coordinator (rank 0) failed: {answer['error']}")


# ----------------------------------------------------------------------------------------- detached stores
class NoCatalog:
    """The catalog of a store on a non-coordinator rank: there is none; any use is a bug, named as such."""

    dialect = "none"

    def __getattr__(self, name: str) -> Any:
        raise UcpError(f"catalog.{name}: this rank is not the coordinator of a multi-rank call and has no catalog "
                       "connection (only group rank 0 touches the catalog; the others get rows by broadcast)")


def store_facts(store) -> dict:
    """What a non-coordinator rank needs to do array I/O on ``store``: its location (no catalog URL: it may
    hold a password, and the rank never connects) and its settings."""
    loc = {f.name: getattr(store.location, f.name) for f in dataclasses.fields(store.location)}
    loc["catalog_url"] = ""
    return {"location": loc, "settings": dict(store.settings)}


def detached_store(facts: dict):
    """A :class:`~ucp_store.store.Store` for array I/O alone, from :func:`store_facts` (no catalog)."""
    from ucp_store.io.location import Location
    from ucp_store.store import Store

    st = Store.__new__(Store)
    st.location = Location(**facts["location"])
    st.catalog = NoCatalog()
    st.created = False
    st._context = None
    st.settings = dict(facts["settings"])
    st.detached = True  # type: ignore[attr-defined]
    return st


def info_to_json(i) -> list:
    row = [i.name, i.state, list(i.shape), i.dtype, i.pattern, list(i.chunk_shape), list(i.shard_shape), i.array,
           i.array_id, i.codecs, i.nbytes, i.content_hash, i.position]
    if i.encoding != "plain":  # a delta's chain travels with it (issue 39)
        row += [i.encoding, [b.to_json() for b in i.bases]]
    return row


def info_from_json(row: list):
    from ucp_store.records import ArrayRef, TensorInfo

    (name, state, shape, dtype, pattern, chunk, shard, array, aid, codecs, nbytes, h, pos) = row[:13]
    enc, bases = (row[13], tuple(ArrayRef.from_json(b) for b in row[14])) if len(row) > 13 else ("plain", ())
    return TensorInfo.from_catalog(name, state, tuple(shape), dtype, pattern, tuple(chunk), tuple(shard), array, aid,
                                   codecs, nbytes, h, pos, enc, bases)


def detached_checkpoint(store, facts: dict):
    """A :class:`~ucp_store.registry.checkpoint.Checkpoint` built from the coordinator's answer (``id``, ``run``,
    ``step``, ``infos`` rows, ``objects``: name -> ``["json", value]`` or ``["array", array row]``), reading
    arrays through ``store`` (a detached store) and never the catalog."""
    from ucp_store.registry.checkpoint import Checkpoint

    ck = Checkpoint.__new__(Checkpoint)
    ck.store = store
    ck.id = facts["id"]
    ck.run, ck.step, ck.status = facts.get("run"), facts.get("step"), "committed"
    ck.created_at = ck.committed_at = ck.parent = ck.message = None
    ck.nbytes, ck.tags, ck.provenance = 0, [], None
    infos = [info_from_json(r) for r in facts["infos"]]
    ck._infos = {(i.name, i.state): i for i in infos}
    ck._handles = {}
    ck.prefetched_objects = facts.get("objects", {})  # type: ignore[attr-defined]
    return ck


def object_rows(ck, names) -> dict:
    """``{name: ["json", value] | ["array", {path, dtype, shape, chunk_shape, shard_shape, codecs}]}`` of the
    stored objects ``names`` of ``ck`` (the coordinator's catalog read, for :func:`detached_checkpoint`)."""
    from sqlalchemy import select

    from ucp_store.catalog import models as m

    wanted = sorted(set(names))
    out: dict[str, list] = {}
    if not wanted:
        return out
    with ck.store.catalog.session() as s:
        for i in range(0, len(wanted), 500):
            for o in s.scalars(select(m.StoredObject).where(m.StoredObject.checkpoint_id == ck.id,
                                                            m.StoredObject.name.in_(wanted[i:i + 500]))):
                if o.kind == "json":
                    out[o.name] = ["json", o.value]
                else:
                    a = o.array
                    out[o.name] = ["array", {"path": a.path, "dtype": a.dtype, "shape": list(a.shape),
                                             "chunk_shape": list(a.chunk_shape), "shard_shape": list(a.shard_shape),
                                             "codecs": a.codecs}]
    return out


def read_prefetched(ck, names) -> dict:
    """The objects ``names`` of a :func:`detached_checkpoint` (JSON values, or tensors read from their arrays)."""
    import numpy as np

    from ucp_store import dtypes
    from ucp_store.io import format as fmt
    from ucp_store.io import localread

    out: dict[str, Any] = {}
    store = ck.store
    for name in names:
        row = ck.prefetched_objects.get(name)
        if row is None:
            continue
        kind, value = row
        if kind == "json":
            out[name] = typed_json.decode(value)
            continue
        layout = fmt.ArrayLayout.from_catalog(value["dtype"], value["shape"], value["chunk_shape"],
                                              value["shard_shape"], value["codecs"])
        h = localread.open_reader(store.location, value["path"], layout, store.context, codecs=value["codecs"])
        data = fmt.read_box(h, layout, tuple((0, n) for n in value["shape"]), what=f"object {name!r}",
                            array_url=store.array_url(value["path"]))
        out[name] = dtypes.to_torch(np.asarray(data))
    return out


# ----------------------------------------------------------------------------------------- tagged JSON
# The records ranks exchange (a DeepSpeed save's per-rank parts and reports) hold tuples, dicts keyed by
# tuples or integers, byte digests and scalar step tensors: JSON has none of them. ``to_wire`` spells each
# as a one-key dict (the tags below) so that ``from_wire`` rebuilds the same Python values, and refuses
# anything else by name: a pickle is never the fallback.
_TUPLE, _MAP, _BYTES = "__ucp_tuple__", "__ucp_map__", "__ucp_bytes__"
_TENSOR, _NDARRAY = "__ucp_tensor__", "__ucp_np__"
_TAGS = (_TUPLE, _MAP, _BYTES, _TENSOR, _NDARRAY)
_WIRE_TENSOR_MAX = 64 << 20  # bytes: steps, RNG states and small objects travel; model state never does


def to_wire(obj: Any, where: str = "payload") -> Any:
    """``obj`` as plain JSON values, with tuples, non-string-keyed dicts, bytes and small tensors and numpy
    arrays (their exact bytes) tagged;
    anything else raises ``UcpError`` naming ``where`` (the path in the record)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (bytes, bytearray)):
        return {_BYTES: bytes(obj).hex()}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        if t.numel() * t.element_size() > _WIRE_TENSOR_MAX:
            raise UcpError(f"{where}: a tensor of {t.numel() * t.element_size()} bytes cannot travel in a coordinator "
                           f"payload (at most {_WIRE_TENSOR_MAX})")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {_TENSOR: [str(t.dtype).removeprefix("torch."), list(t.shape), raw.hex()]}
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "tobytes"):
        import numpy as np

        a = np.ascontiguousarray(obj)
        if a.nbytes > _WIRE_TENSOR_MAX or a.dtype.hasobject:
            raise UcpError(f"{where}: a numpy {a.dtype} array of {a.nbytes} bytes cannot travel in a coordinator "
                           "payload")
        return {_NDARRAY: [a.dtype.str, list(a.shape), a.tobytes().hex()]}
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return {_TUPLE: [to_wire(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_wire(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: to_wire(v, f"{where}.{k}") for k, v in obj.items()}
        return {_MAP: [[to_wire(k, f"{where} key"), to_wire(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise UcpError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot travel in a coordinator "
                   "payload (JSON values, tuples, bytes and small tensors only; never a pickle)")


def from_wire(obj: Any) -> Any:
    """The value :func:`to_wire` encoded."""
    if isinstance(obj, list):
        return [from_wire(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, value), = obj.items()
        if tag == _TUPLE:
            return tuple(from_wire(v) for v in value)
        if tag == _MAP:
            return {_hashable(from_wire(k)): from_wire(v) for k, v in value}
        if tag == _BYTES:
            return bytes.fromhex(value)
        if tag == _TENSOR:
            dtype, shape, raw = value
            data = bytes.fromhex(raw)
            dt = getattr(torch, dtype)
            flat = torch.frombuffer(bytearray(data), dtype=dt) if data else torch.empty(0, dtype=dt)
            return flat.reshape(shape)
        if tag == _NDARRAY:
            import numpy as np

            dtype, shape, raw = value
            return np.frombuffer(bytes.fromhex(raw), dtype=np.dtype(dtype)).reshape(shape).copy()
    return {k: from_wire(v) for k, v in obj.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


# ----------------------------------------------------------------------------------------- versions
def version_payload(ck, objects: bool = True) -> dict:
    """The coordinator's answer that :func:`detached_checkpoint` rebuilds a committed version from on the
    other ranks: its store's facts, id, run, step, every tensor row and (``objects``) every stored object."""
    from sqlalchemy import select

    from ucp_store.catalog import models as m

    names: list[str] = []
    if objects:
        with ck.store.catalog.session() as s:
            names = list(s.scalars(select(m.StoredObject.name).where(m.StoredObject.checkpoint_id == ck.id)))
    return {"store": store_facts(ck.store), "id": ck.id, "run": ck.run, "step": ck.step,
            "infos": [info_to_json(i) for i in ck.tensors()], "objects": object_rows(ck, names)}


def version_everywhere(open_version, group, what: str):
    """``(checkpoint, objects)`` of one committed version on every rank of ``group``, with ONE catalog client.

    Group rank 0 calls ``open_version()`` (opening the store and resolving the reference: its catalog alone
    is touched), reads the version's rows and objects and broadcasts them (JSON bytes); the other ranks get a
    :func:`detached_checkpoint` reading arrays with no catalog, and the objects read from the answer. A
    failure on the coordinator raises on every rank (in its own class). A collective of ``group``."""
    def work():
        opened = open_version()
        return opened, version_payload(opened)

    ck, answer = from_coordinator(work, group, what)
    if ck is None:
        ck = detached_checkpoint(detached_store(answer["store"]), answer)
        return ck, read_prefetched(ck, list(answer["objects"]))
    return ck, ck.objects()

