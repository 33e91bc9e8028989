"""Restore from the nearest copies, into any mesh (issue 38, the restore side): "hydrate, then read".

A version saved to the fast tiers (``placements`` rows) may have lost the node that held a copy, or every
copy but the durable one. ``load`` then, before it reads, makes the node's fast-tier folder hold every object
its ranks' plans touch (:func:`hydrate`), and reads from that folder as the store root: a node's folder holds
the same keys as the durable location, so the planner and the readers work as always; only where the bytes
come from changes. Per object, the nearest good copy:

1. this node's fast tier, when the catalog lists a complete copy there and its size and crc32c check out;
2. another surviving node's fast tier (a node with a rank in this job): a rank ON that node reads it, checks
   it, and sends it over ``torch.distributed`` (one ``all_to_all_single`` of raw bytes per round; the
   decisions are JSON bytes through the coordinator: no pickle); a rank never reads another node's folder;
3. the durable tier (folder or S3), read by the needing node's rank, in parallel.

What arrives is checked against the catalog's crc32c before it is written (atomically) into the node's fast
tier; a bad copy (a crc32c or size that does not match, a missing file) is reported in one line and the next
round takes the next copy. Every collective runs on the load's bounded-timeout control group. The bytes per
tier land on the load's result (``LoadResult.tier_bytes``: this rank; ``job_tier_bytes``: every rank).

:func:`newest_restorable` picks the version a restarted job resumes from: the newest committed version of a
run whose every object still has a complete copy on a surviving node or the durable tier, and says in one line
when that is not the newest (e.g. two nodes lost under a ``replicated`` version: the newest ``durable`` one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucp_store.distributed.context import Ctx
from ucp_store.errors import ConfigurationError, UcpError
from ucp_store.io.location import ARRAYS_DIR, Location
from ucp_store.tiers import nearest
from ucp_store.tiers import node as tnode

__all__ = ["TierCopies", "Restorable", "array_keys", "hydrate", "newest_restorable", "tier_copies", "fast_location"]

log = logging.getLogger("ucp_store.tiers")

_MAX_ROUNDS = 6  # each round excludes the copies found bad; an object has a few copies at most
_DURABLE_THREADS = 16


@dataclass
class TierCopies:
    """What the coordinator tells every rank about a tiered version: every object's complete copies
    (``key -> [[tier, node, crc32c, nbytes], ...]``) and the durable location's facts (no catalog URL)."""

    copies: dict[str, list[list]]
    durable: dict
    version: str = ""  # the version's id: a file of its own folder that no row lists is not one of its objects

    def to_json(self) -> dict:
        return {"copies": self.copies, "durable": self.durable, "version": self.version}

    @classmethod
    def from_json(cls, d: dict) -> TierCopies:
        return cls({k: [list(c) for c in v] for k, v in d["copies"].items()}, d["durable"], d.get("version", ""))


def tier_copies(ck) -> TierCopies | None:
    """The coordinator's read of a version's placements: None for a version written straight to the durable
    tier (no rows), else every object's complete copies."""
    from ucp_store.tiers import placement as tplace

    with ck.store.catalog.session() as s:
        if tplace.safety_of(s, ck.id) is None:
            return None
        got = tplace.copies(s, ck.id)
    loc = dict(ck.store.location.__dict__)
    loc["catalog_url"] = ""
    return TierCopies({k: [[c.tier, c.node, c.crc32c, c.nbytes] for c in cs] for k, cs in got.items()}, loc, ck.id)


def fast_location(root: Path) -> Location:
    """A node's fast-tier folder as a store location (the same keys as the durable one)."""
    return Location(url=str(root), kind="file", root=str(root))


# ----------------------------------------------------------------------------------------- what a plan touches
def array_keys(array: str, layout, boxes: Iterable | None) -> set[str]:
    """The objects of array ``array`` (its path relative to the store root) that reading ``boxes`` (each a
    sequence of ``(lo, hi)`` per dim; None: the whole array) touches: the shard files the boxes intersect (never
    its ``zarr.json``: the store's readers take the layout from the catalog, and the drain makes the durable one
    from it, so a restore reads no durable byte for metadata)."""
    keys: set[str] = set()
    if not layout.sharded:
        keys.add(f"{array}/c")
        return keys
    shape, shard = layout.shape, layout.shard_shape
    if boxes is None:
        boxes = [tuple((0, n) for n in shape)]
    for box in boxes:
        if any(hi <= lo for lo, hi in box):
            continue
        ranges = [range(lo // s, (hi - 1) // s + 1) for (lo, hi), s in zip(box, shard)]
        for idx in _product(ranges):
            keys.add(f"{array}/{layout.shard_file_key(idx)}")
    return keys


def _product(ranges: list[range]) -> Iterable[tuple[int, ...]]:
    import itertools

    return itertools.product(*ranges)


def info_keys(info, boxes: Iterable | None) -> set[str]:
    """:func:`array_keys` of a tensor's array and, for a delta (issue 39), of every base it reads through."""
    from ucp_store.io import format as fmt

    layout = fmt.ArrayLayout.from_catalog(info.dtype, info.shape, info.chunk_shape, info.shard_shape, info.codecs)
    boxes = None if boxes is None else list(boxes)
    keys = array_keys(info.array, layout, boxes)
    for base in getattr(info, "bases", ()) or ():
        keys |= array_keys(base.array, layout, boxes)
    return keys


def object_keys(objects: dict) -> set[str]:
    """Every object of the stored objects kept as arrays (per-rank tensors: small, read whole)."""
    from ucp_store.io import format as fmt

    keys: set[str] = set()
    for kind, value in objects.values():
        if kind == "array":
            layout = fmt.ArrayLayout.from_catalog(value["dtype"], value["shape"], value["chunk_shape"],
                                                  value["shard_shape"], value["codecs"])
            keys |= array_keys(value["path"], layout, None)
    return keys


# ----------------------------------------------------------------------------------------- hydrate
@dataclass
class _Round:
    """One rank's state across the rounds of a hydration."""

    root: Path
    node: str
    copies: dict[str, list[list]]
    durable: Location
    own: str = ""  # the version's folder (``arrays/<id>/``): its objects are the rows' objects
    want: list[str] = field(default_factory=list)
    bad: list[list[str]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    bytes: dict[str, int] = field(default_factory=lambda: {"local": 0, "peer": 0, "durable": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"local": 0.0, "peer": 0.0, "durable": 0.0,
                                                               "decide": 0.0})

    def report_bad(self, key: str, node: str, why: str) -> None:
        where = f"node {node!r}'s fast tier" if node else "the durable tier"
        line = f"ucp_store: bad copy of {key} on {where} ({why}); taking another copy"
        log.warning(line)
        self.lines.append(line)
        self.bad.append([key, node])


def _check(data, key: str, nbytes: int | None, crc: str | None) -> str | None:
    """Why ``data`` is not the catalog's object (size or crc32c), or None."""
    from ucp_store.tiers.objects import crc_hex

    n = memoryview(data).nbytes
    if nbytes is not None and n != nbytes:
        return f"{n} bytes, the catalog records {nbytes}"
    if crc is not None and crc_hex(data) != crc:
        return f"crc32c {crc_hex(data)}, the catalog records {crc}"
    return None


def _local_pass(st: _Round, needed: set[str]) -> None:
    """Which needed objects this node's fast tier holds intact (counted ``local``); the rest are wanted."""
    from ucp_store.tiers.objects import read_object

    for key in sorted(needed):
        cs = st.copies.get(key)
        if cs is None:
            # not an object of the version (a file its save did not record, e.g. a zarr.json the readers do not
            # need: they take the layout from the catalog), or one outside its folder (a delta's base) here already
            if (st.own and key.startswith(st.own)) or _exists(st.root, key):
                continue
            st.want.append(key)
            continue
        if not any(c[0] == nearest.FAST and c[1] == st.node for c in cs):
            st.want.append(key)
            continue
        try:
            data = read_object(st.root, key)
            why = _check(data, key, nearest.size_of(cs), nearest.crc_of(cs))
        except FileNotFoundError:
            why = "the file is missing"
        if why is None:
            st.bytes["local"] += len(data)
            continue
        st.report_bad(key, st.node, why)
        st.want.append(key)


def _exists(root: Path, key: str) -> bool:
    from ucp_store.tiers.objects import object_path

    return object_path(root, key).is_file()


def _serve(st: _Round, send: list[list], world: int) -> list[list]:
    """The bytes this rank sends: each object read from its node's folder, checked; a bad one goes as zeros
    (the receiver's check names it) and is reported here."""
    import numpy as np

    from ucp_store.tiers.objects import read_object

    parts: list[list] = [[] for _ in range(world)]
    for key, to, nbytes in send:
        cs = st.copies.get(key, [])
        try:
            data = read_object(st.root, key)
            why = _check(data, key, nbytes, nearest.crc_of(cs))
        except FileNotFoundError:
            why, data = "the file is missing", b""
        if why is not None:
            st.report_bad(key, st.node, why)
            parts[to].append(np.zeros(nbytes, np.uint8))
        else:
            parts[to].append(np.frombuffer(data, np.uint8))
    return parts


def _take(st: _Round, recv: list[list], arrived: list) -> list[str]:
    """Check and write what arrived from peers; returns the keys to fetch again (a bad copy)."""
    from ucp_store.tiers.objects import write_object

    again: list[str] = []
    pos: dict[int, int] = {}
    for key, frm, frm_node, nbytes, crc in recv:
        at = pos.get(frm, 0)
        data = arrived[frm][at:at + nbytes]
        pos[frm] = at + nbytes
        why = _check(data, key, nbytes, crc)
        if why is not None:
            st.report_bad(key, frm_node, why)
            again.append(key)
            continue
        write_object(st.root, key, data, fsync=False)
        st.bytes["peer"] += nbytes
    return again


def _from_durable(st: _Round, todo: list[list]) -> list[str]:
    """Read objects from the durable tier (in parallel: an object store answers each GET with latency), check
    and write them; returns the keys whose durable copy was bad."""
    from ucp_store.tiers.objects import get_durable, write_object

    def one(item: list) -> tuple[str, str | None, int]:
        key, nbytes, crc = item
        try:
            data = get_durable(st.durable, key)
        except (FileNotFoundError, UcpError) as exc:
            if nbytes is None:  # not a placed object: it may not exist (an unwritten shard reads as fill)
                return key, None, 0
            return key, f"unreadable: {exc}", 0
        why = _check(data, key, nbytes, crc)
        if why is None:
            write_object(st.root, key, data, fsync=False)
        return key, why, len(data)

    again: list[str] = []
    if not todo:
        return again
    with ThreadPoolExecutor(min(_DURABLE_THREADS, len(todo)), thread_name_prefix="ucp-restore") as pool:
        for key, why, n in pool.map(one, todo):
            if why is not None:
                st.report_bad(key, "", why)
                again.append(key)
            else:
                st.bytes["durable"] += n
    return again


def hydrate(ctx: Ctx, tiers: TierCopies, needed: set[str] | None, error: BaseException | None, *,
            node: str | None = None, fast_tier: Any = None, what: str = "restore") -> dict:
    """Make this node's fast-tier folder hold, intact, every object in ``needed`` (a collective of ``ctx``:
    every rank calls it, also one whose ``needed`` failed: ``error``, which stops every rank's hydration).

    Returns ``{"root": folder, "bytes": this rank's {"local", "peer", "durable"}, "job": the sums over every
    rank, "bad": the lines reporting bad copies}``; raises on every rank when an object has no good copy left
    or any rank failed (naming it)."""
    st: _Round | None = None
    try:
        name = tnode.node_name(node)
        root = tnode.fast_tier_root(fast_tier, name)
        if root is None:
            raise ConfigurationError(f"{what}: the version is on the fast tiers; pass fast_tier= (a folder; may "
                                     "contain {node}) or set UCP_FAST_TIER, so this node has a folder to restore into")
        root.mkdir(parents=True, exist_ok=True)
        own = f"{ARRAYS_DIR}/{tiers.version}/" if tiers.version else ""
        st = _Round(root, name, tiers.copies, Location(**tiers.durable), own)
        if error is None and needed is not None:
            t0 = time.perf_counter()
            _local_pass(st, needed)
            st.seconds["local"] += time.perf_counter() - t0
    except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
        error = error or exc
    failed = None if error is None else f"{type(error).__name__}: {error}"
    for _ in range(_MAX_ROUNDS):
        mine = {"node": "" if st is None else st.node, "error": failed, "want": [] if st is None else st.want,
                "bad": [] if st is None else st.bad, "bytes": None if st is None else st.bytes}
        t0 = time.perf_counter()
        answer = ctx.settle(mine, lambda parts: _decide_round(parts, tiers.copies), f"{what} (nearest copies)")
        if st is not None:
            st.seconds["decide"] += time.perf_counter() - t0
        if "error" in answer:
            if error is not None:
                raise error
            raise UcpError(f"{what}: {answer['error']}")
        if answer.get("done"):
            assert st is not None
            return {"root": st.root, "bytes": dict(st.bytes), "job": answer["job"], "bad": list(st.lines),
                    "seconds": dict(st.seconds)}
        assert st is not None
        failed = _run_round(ctx, st, answer)
    raise UcpError(f"{what}: the nearest copies did not settle in {_MAX_ROUNDS} rounds (copies kept failing)")


def _run_round(ctx: Ctx, st: _Round, answer: dict) -> str | None:
    """One round on this rank: serve, receive (one all_to_all), read from the durable tier; the keys to
    fetch again become this rank's next wants. Returns this rank's error message, or None."""
    from ucp_store.distributed.commit import collective_errors

    st.want = []
    error = None
    t0 = time.perf_counter()
    try:
        parts = _serve(st, answer["send"], ctx.world)
    except BaseException as exc:  # noqa: BLE001 - the round's collective runs on every rank regardless
        import numpy as np

        parts = [[np.zeros(n, np.uint8) for _, to_, n in answer["send"] if to_ == r] for r in range(ctx.world)]
        error = exc
    recv_sizes = [0] * ctx.world
    for _, frm, _, nbytes, _ in answer["recv"]:
        recv_sizes[frm] += nbytes
    if ctx.dist is not None:
        from ucp_store.distributed import coord

        with collective_errors("restore (copies between nodes)"):
            arrived = coord.all_to_all_bytes(parts, recv_sizes, ctx.group)
    else:
        arrived = [memoryview(b"".join(bytes(a) for a in p)) for p in parts]
    try:
        st.want += _take(st, answer["recv"], arrived)
        t1 = time.perf_counter()
        st.seconds["peer"] += t1 - t0
        st.want += _from_durable(st, answer["durable"])
        st.seconds["durable"] += time.perf_counter() - t1
    except BaseException as exc:  # noqa: BLE001
        error = error or exc
    return None if error is None else f"{type(error).__name__}: {error}"


def _decide_round(parts: list[dict], copies: dict[str, list[list]]) -> list[dict]:
    """The coordinator's round: a failed rank stops every rank; no wants: done (with the byte sums); else each
    rank's :class:`~ucp_store.tiers.nearest.Assignment`, the bad copies reported so far excluded."""
    failed = [f"rank {r}: {p['error']}" for r, p in enumerate(parts) if p["error"]]
    if failed:
        return [{"error": f"failed on {len(failed)} rank(s): {'; '.join(failed)}"} for _ in parts]
    if not any(p["want"] for p in parts):
        job = {t: sum(p["bytes"][t] for p in parts) for t in ("local", "peer", "durable")}
        return [{"done": True, "job": job} for _ in parts]
    bad = {tuple(b) for p in parts for b in p["bad"]}
    plan, lost = nearest.assign([(p["node"], p["want"]) for p in parts], copies, bad)
    if lost:
        more = f" (and {len(lost) - 3} more)" if len(lost) > 3 else ""
        return [{"error": f"{len(lost)} object(s) have no good copy left: {'; '.join(lost[:3])}{more}"}
                for _ in parts]
    return [a.to_json() for a in plan]


# ----------------------------------------------------------------------------------------- which version
@dataclass
class Restorable:
    """The version a restarted job resumes from: its reference, id, step and safety; ``note``: the one line
    saying why it is not the run's newest committed version (None when it is)."""

    ref: str
    checkpoint_id: str
    step: int
    safety: str
    note: str | None = None


def newest_restorable(store: Any, run: str, *, group=None, node: str | None = None) -> Restorable:
    """The newest committed version of ``run`` that this job can restore: every object has a complete copy on
    the fast tier of a node with a rank in this job, or on the durable tier (a collective of ``group``: every
    rank sends its node; the coordinator alone reads the catalog). When that is not the newest version, one
    line says which was passed over and why (logged once, and in ``note``). ``ReferenceNotFound`` when the
    run has no restorable version."""
    from ucp_store.distributed.context import resolve_store

    ctx = Ctx(group)
    name = tnode.node_name(node)

    def decide(nodes: list[str]) -> Any:
        from ucp_store.distributed.coord import error_payload

        try:
            return _choose(resolve_store(store, create=False), run, sorted(set(nodes)))
        except UcpError as exc:
            if ctx.dist is None:
                raise
            return {"error": error_payload(exc)}

    answer = ctx.agree(name, decide, f"restore of {run} (which version)")
    if "error" in answer:
        from ucp_store.distributed.coord import raise_remote

        raise_remote(answer["error"], f"restore of {run}")
    found = Restorable(**answer)
    if found.note and ctx.rank == 0:
        log.warning(found.note)
    return found


def _choose(st, run: str, nodes: list[str]) -> dict:
    """The coordinator's pick (see :func:`newest_restorable`), as a JSON dict."""
    from sqlalchemy import select

    from ucp_store.catalog import models as m
    from ucp_store.errors import ReferenceNotFound
    from ucp_store.tiers import placement as tplace

    versions = st.list_checkpoints(run)
    passed: list[str] = []
    with st.catalog.session() as s:
        safety = dict(s.execute(select(m.Checkpoint.id, m.Checkpoint.safety).where(
            m.Checkpoint.id.in_([v["id"] for v in versions]))).all()) if versions else {}
        for v in sorted(versions, key=lambda v: (v["step"], v["created_at"]), reverse=True):
            level = safety.get(v["id"]) or "durable"
            lost = [] if level == "durable" else nearest.unreachable(
                {k: [[c.tier, c.node] for c in cs] for k, cs in tplace.copies(s, v["id"]).items()}, nodes)
            if lost:
                passed.append(f"{run}@{v['step']} ({level}: {len(lost)} object(s) without a copy on the surviving "
                              f"nodes {', '.join(nodes)} or the durable tier)")
                continue
            note = None
            if passed:
                note = (f"ucp_store: resuming {run} from {run}@{v['step']} ({level}), not the newest: "
                        f"{'; '.join(passed[:3])}{' ...' if len(passed) > 3 else ''}")
            return {"ref": f"{run}@{v['step']}", "checkpoint_id": v["id"], "step": int(v["step"]), "safety": level,
                    "note": note}
    raise ReferenceNotFound(f"run {run!r} has no version restorable on nodes {', '.join(nodes)}"
                            + (f": {'; '.join(passed[:3])}" if passed else " (it has no committed version)"))
