"""A save to the fast tier, replicated to another node, drained to the durable tier (issue 38).

    res = ucpd.save(sd, store=url, run="gpt", step=100, tier="fast", replicas=1, fast_tier="/dev/shm/ucp/{node}")
    res.safety                  # "replicated": every object on two nodes' fast tiers when save returns
    res.wait("durable", timeout=600)

The phases, on every rank of the job (one catalog client: group rank 0):

1. **Write** (the ordinary save, ``saver.write_plan``): every rank writes its boxes into its node's fast-tier
   folder instead of the store's location (``TierSave.relocate_facts``: the same keys ``arrays/<ckpt>/...``),
   one writer per object as always, nothing deduplicated (every object of a tiered version is its own).
2. **Commit** (``distributed_commit``, after every rank's files are in place): the ranks of a node split the
   node's new objects between them (:meth:`TierSave.before_commit`), each reads its share once for its crc32c,
   and the coordinator records them as ``complete`` fast copies inside the commit's transaction, with safety
   ``local``: the version is never listed without the rows that say where it is.
3. **Replicate** (``replicas=1``, :func:`replicate`): each rank sends its share to its partner, the rank of the
   same local index on the next node (``NodeMap``), in rounds of at most ``round_bytes`` of raw bytes (one
   ``all_to_all_single`` per round on the bounded-timeout gloo group; no pickle); the partner checks each
   object's crc32c, writes it to its own fast tier, and the coordinator records those copies and the safety
   (``replicated``) in one transaction, after every rank reported its writes.
4. **Drain** (a background thread per process, in save order, on its own gloo group): each rank PUTs its share
   once to the durable location (folder or S3); the coordinator records the durable copies and the safety
   (``durable``), then evicts the fast copies of this run's durable versions beyond the newest ``fast_keep``
   (rows first, then each node's first rank deletes the folder), never the last copy of a version that is
   not durable.

A rank killed in phase 3 or 4 leaves its version at the level its rows show (``local`` / ``replicated``); the
survivors' collectives fail within ``UCP_DIST_TIMEOUT``. On GPUs the bytes still travel host to host over the
gloo group: the fast tier is host memory or local NVMe, so there is no device copy to make.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucp_store._killpoints import killpoint
from ucp_store.errors import ConfigurationError, UcpError
from ucp_store.io.location import ARRAYS_DIR, Location
from ucp_store.tiers import node as tnode
from ucp_store.tiers import objects as tobj
from ucp_store.tiers import placement as tplace
from ucp_store.tiers.placement import ObjectInfo

__all__ = ["NodeMap", "TierSave", "TierSetup", "TieredResult", "save", "setup", "option_names", "replicate", "node_map",
           "drain_idle", "DEFAULT_ROUND_BYTES", "DEFAULT_FAST_KEEP", "LAST_TIMINGS"]

DEFAULT_ROUND_BYTES = 256 << 20  # raw bytes one rank sends its partner per all_to_all round
#: the timings of this process's last tiered save (``TieredResult.timings``; tools/bench_tier_save.py)
LAST_TIMINGS: dict[str, float] = {}
DEFAULT_FAST_KEEP = 2  # durable versions of a run whose fast copies are kept (the newest)
_SKIP_SUFFIXES = (".part", ".__lock")


# --------------------------------------------------------------------------------- who is where
@dataclass(frozen=True)
class NodeMap:
    """Every rank's node (by group rank), learnt with one collective at a group's first tiered save."""

    nodes: tuple[str, ...]

    @property
    def order(self) -> list[str]:
        """The distinct nodes, in the order of their first rank."""
        return list(dict.fromkeys(self.nodes))

    def ranks_on(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def partner(self, rank: int) -> int | None:
        """The rank that keeps ``rank``'s replica: the same local index (modulo) on the next node; None on a
        single node."""
        order = self.order
        if len(order) < 2:
            return None
        here = self.nodes[rank]
        local = self.ranks_on(here).index(rank)
        there = self.ranks_on(order[(order.index(here) + 1) % len(order)])
        return there[local % len(there)]


_NODE_MAPS: dict[tuple, NodeMap] = {}


def node_map(group, node: str) -> NodeMap:
    """The job's :class:`NodeMap` (a collective on ``group`` the first time for this group and node name)."""
    import torch.distributed as dist

    from ucp_store.distributed.commit import agree, collective_errors

    if group is None:
        return NodeMap((node,))
    key = (tuple(dist.get_process_group_ranks(group)), node)
    if key not in _NODE_MAPS:
        with collective_errors("tiered save: learning every rank's node"):
            _NODE_MAPS[key] = NodeMap(tuple(agree(node, lambda names: names, group)))
    return _NODE_MAPS[key]


# --------------------------------------------------------------------------------- one save's tier facts
@dataclass
class TierSave:
    """One tiered save on one rank: where its node's fast tier is, its share of the node's objects, and on the
    coordinator the catalog and every node's objects. Rides on the store opener (``.tier``) into
    ``distributed_begin`` and on the writer into ``distributed_commit``."""

    root: Path
    node: str
    nodes: NodeMap
    rank: int
    replicas: int = 1
    fast_keep: int = DEFAULT_FAST_KEEP
    round_bytes: int = DEFAULT_ROUND_BYTES
    durable: Location | None = None
    store: Any = None  # the coordinator's store (its catalog); None elsewhere
    run: str = ""
    checkpoint_id: str = ""
    mine: list[ObjectInfo] = field(default_factory=list)
    everyone: dict[str, list[ObjectInfo]] = field(default_factory=dict)  # coordinator: node -> objects
    shares: list[list[ObjectInfo]] = field(default_factory=list)  # coordinator: each rank's share
    timings: dict[str, float] = field(default_factory=dict)

    def view(self, st) -> Any:
        """On the coordinator: ``st`` (the store, its durable location) as a store whose location is this node's
        fast tier and whose ``begin`` hands the writer to this save (:meth:`joined`)."""
        self.durable, self.store = st.location, st
        return _view(st, self)

    def location(self, catalog_url: str = "") -> Location:
        return Location(url=str(self.root), kind="file", root=str(self.root), catalog_url=catalog_url)

    def durable_facts(self) -> dict:
        """On the coordinator: the durable location, for the other ranks' drains (no catalog URL: it may hold a
        password, and they never connect)."""
        assert self.durable is not None
        return {"location": {**_fields(self.durable), "catalog_url": ""}}

    def relocate_facts(self, facts: dict, durable: dict) -> dict:
        """A joined rank's store facts with this node's fast tier as the location; ``durable``: the
        coordinator's :meth:`durable_facts`."""
        self.durable = Location(**durable["location"])
        return {**facts, "location": _fields(self.location())}

    def joined(self, writer) -> None:
        """``writer`` writes this save: nothing deduplicated, and this object rides along to the commit."""
        writer.tier = self
        writer.dedup.enabled = False
        self.checkpoint_id = writer.id
        if len(self.nodes.nodes) == 1 and not writer.commit_hooks:  # one process: record inside its commit
            writer.commit_hooks.append(self._record_alone)

    def _record_alone(self, session) -> None:
        self.mine = self._describe_share()
        self.everyone = {self.node: self.mine}
        self._record_fast(session)

    def _describe_share(self) -> list[ObjectInfo]:
        """This rank's share of the node's objects of this version (the node's ranks split them by index)."""
        ranks = self.nodes.ranks_on(self.node)
        keys = [k for k in tobj.walk_objects(self.root, f"{ARRAYS_DIR}/{self.checkpoint_id}") if _is_object(k)]
        return [tobj.describe(self.root, k) for k in keys[ranks.index(self.rank)::len(ranks)]]

    def _record_fast(self, session) -> None:
        for node, objs in self.everyone.items():
            tplace.record(session, self.checkpoint_id, tplace.FAST, node, objs, "complete")
        tplace.refresh_safety(session, self.checkpoint_id)

    def before_commit(self, writer, group, error: BaseException | None) -> BaseException | None:
        """A collective of the save's ranks, after every rank's files are in place and before the rows gather:
        the files an origin rank must read back for a content hash are copied to its node (:meth:`_to_origins`),
        then each rank describes its share of its node's objects and the coordinator has them recorded in the
        commit's transaction. Returns this rank's error (every rank learns of it in the rows gather)."""
        t0 = time.perf_counter()
        error = self.to_origins(writer, group, error)
        self.timings["to_origins_s"] = time.perf_counter() - t0
        if error is None:
            try:
                self.mine = self._describe_share()
            except BaseException as exc:  # noqa: BLE001 - every rank learns of it in the rows gather
                error = exc
        self.timings["before_commit_s"] = time.perf_counter() - t0
        if self.gather_shares(group) and error is None:
            writer.commit_hooks.append(self._record_fast)
        return error

    def gather_shares(self, group) -> bool:
        """A collective of ``group``: every rank sends its share (``mine``); the coordinator learns every node's
        objects (``everyone``) and every rank's share (``shares``). True on the coordinator."""
        from ucp_store.distributed import coord

        mine = {"node": self.node, "objects": [[o.key, o.nbytes, o.crc32c] for o in self.mine]}
        parts = coord.gather_bytes(coord.encode(mine), group)
        if parts is None:
            return False
        self.everyone, self.shares = {}, []
        for p in parts:
            d = coord.decode(p)
            objs = [ObjectInfo(k, n, c) for k, n, c in d["objects"]]
            self.everyone.setdefault(d["node"], []).extend(objs)
            self.shares.append(objs)
        return True

    def describe_node(self) -> list[ObjectInfo]:
        """Every object of this version in this node's fast-tier folder (complete files: no temporaries)."""
        keys = tobj.walk_objects(self.root, f"{ARRAYS_DIR}/{self.checkpoint_id}")
        return [tobj.describe(self.root, k) for k in keys if _is_object(k)]

    def record_at_commit(self, writer, reported: dict[str, list[ObjectInfo]]) -> None:
        """The fast copies of a version another writer commits (the DCP backend's ``finish``), recorded inside
        ``writer``'s commit transaction: ``reported`` (node -> the objects its ranks wrote) merged with this
        node's folder as walked in the commit (what the commit itself wrote there too)."""
        def hook(session) -> None:
            merged = {node: {o.key: o for o in objs} for node, objs in reported.items()}
            merged.setdefault(self.node, {}).update({o.key: o for o in self.describe_node()})
            self.everyone = {node: list(objs.values()) for node, objs in merged.items()}
            self._record_fast(session)

        writer.commit_hooks.append(hook)

    def to_origins(self, writer, group, error: BaseException | None,
                   origin_rank: int | None = None) -> BaseException | None:
        """The origin rank of an array hashes it from every rank's unit digests; the units no rank held whole (an
        uneven or a small split) it reads back from the files, which on a fast tier lie on the nodes that wrote
        them. So every other node that wrote files of such an array sends them to the origin first (one rank per
        node; the coordinator decides from every rank's unit ids), and the origin's node holds them too.
        ``origin_rank``: the origin of every array (the DCP backend: its coordinator hashes them all in
        ``finish``); None: the rank whose writer holds the array's origin box. ``writer``: None after ``error``."""
        from ucp_store.distributed.commit import all_ok, collective_errors, settle
        from ucp_store.io import format as fmt

        mine: dict = {"failed": error is not None, "arrays": [], "origin": []}
        if error is None and writer is not None:
            digests = writer.region_digests()
            for key, d in digests.items():
                _, rel, layout, _ = writer.shards.sharded[key]
                mine["arrays"].append([rel, layout.dtype, list(layout.shape), None if d is None else sorted(d)])
            mine["origin"] = [writer.shards.sharded[k][1] for k in writer.shards.origin]
        nodes = self.nodes.nodes

        def decide(parts: list) -> list:
            if any(p["failed"] for p in parts):
                return [{}] * len(parts)
            origin: dict[str, int | None] = {rel: r for r, p in enumerate(parts) for rel in p["origin"]}
            units: dict[str, Any] = {}
            writers: dict[str, list[int]] = {}
            for r, p in enumerate(parts):
                for rel, dtype, shape, us in p["arrays"]:
                    writers.setdefault(rel, []).append(r)
                    got = units.setdefault(rel, (dtype, shape, set()))
                    merged = None if us is None or got[2] is None else got[2] | set(us)
                    units[rel] = (dtype, shape, merged)
            sends: list[dict] = [{} for _ in parts]
            for rel, (dtype, shape, us) in units.items():
                o = origin.get(rel, origin_rank)
                if o is None or (us is not None and not fmt.missing_units(dtype, shape, dict.fromkeys(us, b""))):
                    continue
                senders = {nodes[w]: w for w in sorted(writers[rel], reverse=True) if nodes[w] != nodes[o]}
                for w in senders.values():
                    sends[w].setdefault(str(o), []).append(rel)
            return sends

        what = f"tiered save {self.checkpoint_id}: the files origin ranks read back"
        with collective_errors(what):
            plan = settle(mine, decide, group)
        outgoing: dict[int, list[ObjectInfo]] = {}
        if error is None:
            try:
                for dest, rels in plan.items():
                    outgoing[int(dest)] = [tobj.describe(self.root, k) for rel in rels
                                           for k in tobj.walk_objects(self.root, rel) if _is_object(k)]
            except BaseException as exc:  # noqa: BLE001 - it takes part in the move, sending nothing
                error, outgoing = exc, {}
        _, moved = _move(self, group, outgoing, what)
        with collective_errors(what):  # every copy is written before any rank of a node lists the node's folder
            all_ok(error is None and moved is None, group)
        return error or moved


def _fields(loc: Location) -> dict:
    return {f.name: getattr(loc, f.name) for f in dataclasses.fields(Location)}


def _is_object(key: str) -> bool:
    """Not a temporary of a write in flight (``.part``, TensorStore's lock, ``tiers.objects``' own)."""
    return not key.rsplit("/", 1)[-1].startswith(tobj.TMP_PREFIX) and not key.endswith(_SKIP_SUFFIXES)


class _Opener:
    """The store opener of a tiered save: the coordinator opens the store and writes through a view of it whose
    location is its node's fast tier; ``.tier`` tells ``distributed_begin`` to relocate the other ranks too."""

    def __init__(self, store, create: bool, tier: TierSave):
        self.store, self.create, self.tier = store, create, tier

    def __call__(self):
        from ucp_store.distributed.context import resolve_store

        return self.tier.view(resolve_store(self.store, create=self.create))


def _view(st, tier: TierSave):
    """``st`` with its location swapped for ``tier``'s folder; its ``begin`` hands the writer to ``tier``."""
    from ucp_store.store import Store

    class TierStoreView(Store):
        def begin(self, *args, **kwargs):
            writer = super().begin(*args, **kwargs)
            tier.joined(writer)
            return writer

        def _owned(self, **kwargs) -> None:  # the store's identity is on its durable location, not a fast tier
            owned = getattr(st, "_owned", None)
            if owned is not None:
                owned(**kwargs)

    view = TierStoreView.__new__(TierStoreView)
    view.__dict__.update(st.__dict__)
    view.location = tier.location(st.location.catalog_url)
    return view


# --------------------------------------------------------------------------------- the result
class TieredResult(str):
    """The version id (a ``str``) of a tiered save, with its safety: ``safety`` (the level reached, as far as
    this rank has learnt), ``wait(level, timeout)`` (blocks until the level is reached; raises UcpError when the
    background drain failed before it, TimeoutError after ``timeout`` seconds)."""

    _events: dict[str, threading.Event]
    _level: str
    error: BaseException | None
    timings: dict[str, float]

    def __new__(cls, version: str):
        obj = super().__new__(cls, version)
        obj._events = {lvl: threading.Event() for lvl in ("local", "replicated", "durable")}
        obj._level = "local"
        obj.error = None
        #: seconds from the call on this rank: ``before_commit_s`` (copies to origins, describing the share),
        #: ``committed_s`` (listed ``local``), ``replicated_s``
        obj.timings = {}
        return obj

    def reached(self, level: str) -> None:
        if tplace.level_index(level) > tplace.level_index(self._level):
            self._level = level
        for lvl, ev in self._events.items():
            if tplace.reached(level, lvl):
                ev.set()

    def failed(self, error: BaseException) -> None:
        self.error = error
        for ev in self._events.values():
            ev.set()

    @property
    def safety(self) -> str:
        return self._level

    def wait(self, level: str = "durable", timeout: float | None = None) -> str:
        tplace.level_index(level)
        if not self._events[level].wait(timeout):
            raise TimeoutError(f"version {str(self)}: safety {level!r} not reached within {timeout} s "
                               f"(now {self._level!r})")
        if not tplace.reached(self._level, level):
            raise UcpError(f"version {str(self)}: safety {level!r} not reached ({self.error})") from self.error
        return self._level


# --------------------------------------------------------------------------------- replicate
def _rounds(objs: list[ObjectInfo], budget: int) -> list[list[ObjectInfo]]:
    """``objs`` cut into consecutive rounds of at most ``budget`` bytes (an object larger alone)."""
    out: list[list[ObjectInfo]] = []
    size = budget
    for o in objs:
        if size + o.nbytes > budget and (not out or out[-1]):
            out.append([])
            size = 0
        out[-1].append(o)
        size += o.nbytes
    return out


def _move(tier: TierSave, group, outgoing: dict[int, list[ObjectInfo]], what: str) -> tuple[list, Any]:
    """Send each rank's ``outgoing`` objects (destination rank -> objects, read from its fast tier) to their
    ranks, which check each one's crc32c and write it to their own fast tier. A collective: one ``settle`` of the
    descriptions through the coordinator, then rounds of one ``all_to_all_single`` of raw bytes, each at most
    ``round_bytes`` per sender and destination. Returns (what this rank wrote, its error or None); a failed
    collective raises UcpError."""
    import numpy as np

    from ucp_store.distributed import coord
    from ucp_store.distributed.commit import collective_errors, settle

    world, budget = len(tier.nodes.nodes), tier.round_bytes
    mine = {str(d): [[o.key, o.nbytes, o.crc32c] for o in objs] for d, objs in outgoing.items() if objs}

    def decide(parts: list) -> list:
        cuts = {(src, int(d)): _rounds([ObjectInfo(*x) for x in objs], budget)
                for src, p in enumerate(parts) for d, objs in p.items()}
        rounds = max((len(c) for c in cuts.values()), default=0)
        return [{"rounds": rounds, "recv": {str(src): [[[o.key, o.nbytes, o.crc32c] for o in rnd] for rnd in c]
                                            for (src, d), c in cuts.items() if d == r}} for r in range(world)]

    written: list[ObjectInfo] = []
    error: BaseException | None = None
    mine_cuts = {d: _rounds(objs, budget) for d, objs in outgoing.items() if objs}
    with collective_errors(what):
        plan = settle(mine, decide, group)
        for i in range(plan["rounds"]):
            parts: list[list] = [[] for _ in range(world)]
            for d, c in mine_cuts.items():
                if i < len(c):
                    parts[d] = [np.fromfile(tobj.object_path(tier.root, o.key), np.uint8) for o in c[i]]
            descs = {int(src): (rs[i] if i < len(rs) else []) for src, rs in plan["recv"].items()}
            recv = [sum(x[1] for x in descs.get(src, ())) for src in range(world)]
            arrived = coord.all_to_all_bytes(parts, recv, group)
            if error is None:
                error = _write_arrived(tier, descs, arrived, written)
    return written, error


def replicate(tier: TierSave, group) -> str:
    """Phase 3 on every rank (a collective of ``group``): send the objects of this rank's share that no second
    node holds to its partner, write what arrives, record it. Returns the version's safety as recorded."""
    from ucp_store.distributed.commit import collective_errors, settle

    world = len(tier.nodes.nodes)
    partners = [tier.nodes.partner(r) for r in range(world)]
    if any(p is None for p in partners):
        raise ConfigurationError(f"replicas={tier.replicas}: the job's ranks are all on node {tier.node!r}; a "
                                 "replica needs a second node (set UCP_NODE per node, or replicas=0)")
    what = f"tiered save {tier.checkpoint_id}: replicating to the partner nodes"

    names = [tier.nodes.nodes[p] for p in partners if p is not None]

    def decide(parts: list) -> list:  # the coordinator knows every node's objects (tier.everyone)
        held: dict[str, set[str]] = {}
        for node, objs in tier.everyone.items():
            for o in objs:
                held.setdefault(o.key, set()).add(node)
        return [[k for k, _, _ in p if len(held.get(k, ())) < 2 and names[r] not in held.get(k, ())]
                for r, p in enumerate(parts)]

    with collective_errors(what):
        keys = set(settle([[o.key, o.nbytes, o.crc32c] for o in tier.mine], decide, group))
    partner = partners[tier.rank]
    assert partner is not None
    written, error = _move(tier, group, {partner: [o for o in tier.mine if o.key in keys]}, what)
    return _record_replicas(tier, written, error, group, what)


def _write_arrived(tier: TierSave, descs: dict, arrived: list, written: list[ObjectInfo]) -> BaseException | None:
    try:
        for src, ds in sorted(descs.items()):
            pos = 0
            for key, nbytes, crc in ds:
                data = arrived[src][pos:pos + nbytes]
                pos += nbytes
                if tobj.crc_hex(data) != crc:
                    raise UcpError(f"replica of {key} from rank {src}: crc32c {tobj.crc_hex(data)}, sent as {crc}")
                written.append(tobj.write_object(tier.root, key, data, fsync=False))  # see "Tiers"
                killpoint("tier.replicate")
    except BaseException as exc:  # noqa: BLE001 - every rank learns of it in the agreement that follows
        return exc
    return None


def _record_replicas(tier: TierSave, written: list[ObjectInfo], error: BaseException | None, group,
                     what: str) -> str:
    from ucp_store.distributed.commit import agree, collective_errors

    mine = {"node": tier.node, "error": None if error is None else f"{type(error).__name__}: {error}",
            "written": [[o.key, o.nbytes, o.crc32c] for o in written]}

    def decide(parts: list) -> Any:
        failed = [f"rank {r}: {p['error']}" for r, p in enumerate(parts) if p["error"]]
        if failed:
            return {"failed": "; ".join(failed)}

        def rows(s):
            for p in parts:
                tplace.record(s, tier.checkpoint_id, tplace.FAST, p["node"],
                              [ObjectInfo(*w) for w in p["written"]], "complete")
            return tplace.refresh_safety(s, tier.checkpoint_id)

        return {"safety": tier.store.catalog.run_write(rows)}

    with collective_errors(what):
        answer = agree(mine, decide, group)
    if "failed" in answer:
        raise UcpError(f"{what} failed; the version stays listed 'local': {answer['failed']}") from error
    return str(answer["safety"])


# --------------------------------------------------------------------------------- drain
@dataclass
class _DrainJob:
    tier: TierSave
    result: TieredResult
    group: Any


_QUEUE: queue.Queue[_DrainJob] = queue.Queue()
_WORKER: list[threading.Thread] = []
_IDLE = threading.Condition()
_BUSY = [0]


def _enqueue(job: _DrainJob) -> None:
    with _IDLE:
        _BUSY[0] += 1
    if not _WORKER or not _WORKER[0].is_alive():
        _WORKER[:] = [threading.Thread(target=_drain_loop, name="ucp-tier-drain", daemon=True)]
        _WORKER[0].start()
    _QUEUE.put(job)


def drain_idle(timeout: float | None = None) -> bool:
    """Wait until this process has no drain queued or running; True when idle."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _IDLE:
        while _BUSY[0]:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            _IDLE.wait(left)
    return True


def _drain_loop() -> None:
    while True:
        job = _QUEUE.get()
        try:
            level = drain(job.tier, job.group)
            job.result.reached(level)
        except BaseException as exc:  # noqa: BLE001 - the caller learns it from result.wait
            job.result.failed(exc)
        finally:
            with _IDLE:
                _BUSY[0] -= 1
                _IDLE.notify_all()


def _drain_assignment(tier: TierSave) -> list[list[str]]:
    """On the coordinator: each object to one rank whose share holds it (the one with the fewest bytes assigned
    so far), so it is PUT once and the ranks share the work."""
    shares = tier.shares or [list(tier.mine)]
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for r, share in enumerate(shares):
        for o in share:
            holders.setdefault(o.key, []).append(r)
            size[o.key] = o.nbytes
    load = [0] * len(shares)
    out: list[list[str]] = [[] for _ in shares]
    for key in sorted(holders, key=lambda k: -size[k]):
        r = min(holders[key], key=lambda x: load[x])
        out[r].append(key)
        load[r] += size[key]
    return out


def drain(tier: TierSave, group) -> str:
    """Phase 4 on every rank (a collective of ``group``): PUT the objects the coordinator assigns this rank (each
    object once) to the durable tier, record the copies and the safety, evict beyond ``fast_keep``. Returns the
    safety recorded."""
    from ucp_store.distributed.commit import agree, collective_errors, settle

    assert tier.durable is not None
    what = f"tiered save {tier.checkpoint_id}: the drain to the durable tier"

    def assign(parts: list) -> list:  # the coordinator: the durable copies are being written
        every = [o for objs in tier.everyone.values() for o in objs]
        tier.store.catalog.run_write(lambda s: tplace.record(s, tier.checkpoint_id, tplace.DURABLE, "",
                                                             {o.key: o for o in every}.values(), "writing"))
        return _drain_assignment(tier)

    if group is None:
        keys = set(assign([None])[0])
    else:
        with collective_errors(what):
            keys = set(settle(None, assign, group))
    error: BaseException | None = None
    done: list[ObjectInfo] = []
    try:
        for o in tier.mine:
            if o.key in keys:
                data = tobj.read_checked(tier.root, o.key, o.crc32c, o.nbytes)
                done.append(tobj.put_durable(tier.durable, o.key, data))
                killpoint("tier.drain")
    except BaseException as exc:  # noqa: BLE001 - every rank learns of it in the agreement
        error = exc
    mine = {"error": None if error is None else f"{type(error).__name__}: {error}",
            "done": [[o.key, o.nbytes, o.crc32c] for o in done]}

    def decide(parts: list) -> Any:
        failed = [f"rank {r}: {p['error']}" for r, p in enumerate(parts) if p["error"]]
        if failed:
            return {"failed": "; ".join(failed)}
        objs = [ObjectInfo(*d) for p in parts for d in p["done"]] + _drain_metadata(tier)
        return tier.store.catalog.run_write(lambda s: _durable_and_evict(s, tier, objs))

    if group is None:
        answer = decide([mine])
    else:
        with collective_errors(what):
            answer = agree(mine, decide, group)
    if "failed" in answer:
        raise UcpError(f"drain of {tier.checkpoint_id} failed; it stays at its level: {answer['failed']}") from error
    if tier.nodes.ranks_on(tier.node)[0] == tier.rank:  # the node's first rank removes the evicted folders
        for ck in answer["evict"]:
            killpoint("tier.evict")
            tobj.remove_version(tier.root, ck)
    return str(answer["safety"])


def _drain_metadata(tier: TierSave) -> list[ObjectInfo]:
    """On the coordinator: each array of the version gets its zarr.json on the durable tier, made from the
    catalog's layout (the bytes TensorStore writes), so the drained copy is a complete Zarr store for any reader;
    the fast tiers need none (the store's readers take the layout from the catalog)."""
    from sqlalchemy import select

    from ucp_store.catalog.models import Array, StoredObject, Tensor
    from ucp_store.io import format as fmt

    assert tier.durable is not None
    own = f"{ARRAYS_DIR}/{tier.checkpoint_id}/"
    with tier.store.catalog.session() as s:
        rows = list(s.scalars(select(Array).where(Array.id.in_(
            select(Tensor.array_id).where(Tensor.checkpoint_id == tier.checkpoint_id).union(
                select(StoredObject.array_id).where(StoredObject.checkpoint_id == tier.checkpoint_id,
                                                    StoredObject.array_id.is_not(None)))))))
    done = []
    for a in rows:
        if a.path.startswith(own):  # the version's own arrays (a tiered save deduplicates nothing)
            layout = fmt.ArrayLayout.from_catalog(a.dtype, a.shape, a.chunk_shape, a.shard_shape, a.codecs)
            done.append(tobj.put_durable(tier.durable, f"{a.path}/zarr.json", fmt.zarr_json(layout)))
    return done


def _durable_and_evict(s, tier: TierSave, objs: list[ObjectInfo]) -> dict:
    from ucp_store.tiers import retention as tret

    tplace.record(s, tier.checkpoint_id, tplace.DURABLE, "", objs, "complete")
    level = tplace.refresh_safety(s, tier.checkpoint_id)
    evicted = tret.evict_fast(s, run=tier.run, keep=tier.fast_keep)
    return {"safety": level, "evict": evicted}


# --------------------------------------------------------------------------------- save
@dataclass
class TierSetup:
    """What a tiered save settles at the call, on the caller's thread (:func:`setup`): this node, its folder, the
    job's :class:`NodeMap` and the drain's gloo group (collectives that must run in one order on every rank);
    :meth:`run` then writes, replicates and queues the drain, on any thread (``async_save``'s writer too)."""

    root: Path
    node: str
    nodes: NodeMap
    replicas: int
    fast_keep: int
    round_bytes: int
    drain: bool
    drain_group: Any

    def run(self, write, plan, staged, ctx, *, store: Any, create: bool, run: str, step: int,
            message: str | None, parent: str | None, progress: bool, t0: float | None = None) -> TieredResult:
        """Phases 1-3 on every rank of ``ctx`` (``write`` is ``saver.write_plan``), then phase 4 queued."""
        t0 = time.perf_counter() if t0 is None else t0
        tier = TierSave(root=self.root, node=self.node, nodes=self.nodes, rank=ctx.rank, replicas=self.replicas,
                        fast_keep=self.fast_keep, round_bytes=self.round_bytes, run=run)
        version = write(_Opener(store, create, tier), plan, staged, ctx, run=run, step=step, message=message,
                        parent=parent, progress=progress)
        return self.spread(tier, ctx, version, t0)

    def committed(self, ctx, *, checkpoint_id: str, run: str, durable: Location, store: Any = None) -> TieredResult:
        """Phases 3-4 of a version another writer committed with its fast copies recorded (the DCP backend's
        ``UcpStorageWriter.replicate``, after ``dcp.save`` returned), on every rank of ``ctx``: each rank
        describes its share of its node's objects (one gather to the coordinator), then :meth:`spread`.
        ``store``: the coordinator's (its catalog); None elsewhere."""
        t0 = time.perf_counter()
        tier = TierSave(root=self.root, node=self.node, nodes=self.nodes, rank=ctx.rank, replicas=self.replicas,
                        fast_keep=self.fast_keep, round_bytes=self.round_bytes, durable=durable, store=store, run=run,
                        checkpoint_id=checkpoint_id)
        tier.mine = tier._describe_share()
        if ctx.group is None:
            tier.everyone, tier.shares = {tier.node: tier.mine}, [tier.mine]
        else:
            from ucp_store.distributed.commit import collective_errors

            with collective_errors(f"tiered save {checkpoint_id}: every rank's share"):
                tier.gather_shares(ctx.group)
        return self.spread(tier, ctx, checkpoint_id, t0)

    def spread(self, tier: TierSave, ctx, version: str, t0: float) -> TieredResult:
        """After the commit (``local``): phase 3 (``replicas=1``) on every rank of ``ctx``, phase 4 queued."""
        result = TieredResult(version)
        result.timings.update(tier.timings, committed_s=time.perf_counter() - t0)
        result.reached("local")
        if self.replicas:
            result.reached(replicate(tier, ctx.group))
            result.timings["replicated_s"] = time.perf_counter() - t0
        if self.drain:
            _enqueue(_DrainJob(tier, result, self.drain_group))
        LAST_TIMINGS.clear()
        LAST_TIMINGS.update(result.timings)
        return result


def setup(ctx, *, replicas: int = 1, node: str | None = None, fast_tier: str | None = None,
          fast_keep: int = DEFAULT_FAST_KEEP, round_bytes: int = DEFAULT_ROUND_BYTES, drain: bool = True) -> TierSetup:
    """Check a tiered save's options and settle what needs the caller's thread (a collective on ``ctx``'s
    group at the job's first tiered save: every rank's node; the drain's group)."""
    if replicas not in (0, 1):
        raise ConfigurationError(f"replicas={replicas!r}: expected 0 or 1 (copies on other nodes' fast tiers)")
    if isinstance(fast_keep, bool) or not isinstance(fast_keep, int) or fast_keep < 0:
        raise ConfigurationError(f"fast_keep={fast_keep!r}: expected a number of versions, 0 or more")
    if isinstance(round_bytes, bool) or not isinstance(round_bytes, int) or round_bytes < 1:
        raise ConfigurationError(f"round_bytes={round_bytes!r}: expected a positive number of bytes")
    name = tnode.node_name(node)
    root = tnode.fast_tier_root(fast_tier, name)
    if root is None:
        raise ConfigurationError("tier='fast' needs a fast tier: pass fast_tier= (a folder; may contain {node}) "
                                 "or set UCP_FAST_TIER")
    nodes = node_map(ctx.group, name)
    if replicas and len(nodes.order) < 2:
        raise ConfigurationError(f"replicas={replicas}: every rank of the job is on node {name!r}; a replica "
                                 "needs a second node (UCP_NODE per node), or pass replicas=0")
    return TierSetup(root, name, nodes, replicas, fast_keep, round_bytes, drain, _drain_group(ctx) if drain else None)


def option_names() -> tuple[str, ...]:
    """The fast tier's options a save, ``async_save`` or ``Checkpointer`` takes: ``setup``'s keyword parameters."""
    import inspect

    return tuple(p for p in inspect.signature(setup).parameters if p != "ctx")


def save(state_dict: dict, *, write: Any, store: Any = None, run: str, step: int, message: str | None = None,
         parent: str | None = "auto", group=None, progress: bool = True, create: bool = True, mesh=None,
         **options: Any) -> TieredResult:
    """``ucp_store.distributed.save(..., tier="fast")``, which passes its ``write_plan`` as ``write``: see the
    module docstring; ``options``: :func:`setup`'s. Returns a :class:`TieredResult` once the version is
    ``replicated`` (``local`` with ``replicas=0``); the drain to the durable tier goes on in the background
    (``drain=False``: not started)."""
    from ucp_store.distributed.context import Ctx
    from ucp_store.distributed.inflight import wait
    from ucp_store.distributed.planner import forget_plan, plan_save
    from ucp_store.distributed.tensors import host_copy
    from ucp_store.errors import StalePlanError

    wait()  # an async save in flight commits first
    t0 = time.perf_counter()
    ctx = Ctx(group)
    tiers = setup(ctx, **options)
    for _ in range(2):
        plan = plan_save(state_dict, ctx, mesh, cache=True)
        staged = [host_copy(src[sl] if sl else src) for src, sl in plan.sources]
        try:
            return tiers.run(write, plan, staged, ctx, store=store, create=create, run=run, step=step,
                             message=message, parent=parent, progress=progress, t0=t0)
        except StalePlanError:
            forget_plan(ctx)
    raise UcpError(f"save of {run}@{step}: planning did not settle")  # pragma: no cover - a fresh plan is never checked


def _drain_group(ctx):
    """The drain's own gloo group (made on the caller's thread: every rank creates groups in one order)."""
    if ctx.dist is None:
        return None
    from ucp_store.distributed.commit import control_group

    return control_group(ctx.group, tag="tier-drain")
