"""The catalog's record of where a version's objects have complete copies, and its safety level (issue 38).

One ``placements`` row per (version, tier, node, object) (migration 0006): ``tier`` ``fast`` (a node's
folder; ``node`` names it) or ``durable`` (the store's location; ``node`` is ``""``), the object's key
relative to the tier's root, its ``state`` (``writing`` -> ``complete`` -> ``evicted``), its size and the
crc32c (hex) of its whole bytes.

A version's safety (``checkpoints.safety``) follows from its complete rows alone (:func:`compute_safety`):

- ``durable``: every object of the version complete on the durable tier;
- ``replicated``: every object complete on the fast tiers of at least two distinct nodes, or on the durable
  tier (so one node's loss leaves a copy of each);
- ``local``: otherwise.

The version's objects are every object any of its rows names (any tier, any state): the first rows a save
records name all of them. :func:`refresh_safety` stores the level computed from the rows as they are in the
caller's transaction, so a version is never listed at a level its rows do not show; callers record the
``complete`` rows and refresh in one transaction (``record(..., refresh=True)``). The level can fall, when
copies are evicted or a node is forgotten (:func:`forget_node`).

All functions take a SQLAlchemy session (the caller's transaction; ``Catalog.run_write`` / ``write_session``
for writes) and work on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from sqlalchemy import select, update

from ucp_store.catalog import models as m
from ucp_store.errors import ValidationError

__all__ = ["ObjectInfo", "Copy", "DURABLE", "FAST", "record", "set_state", "compute_safety", "refresh_safety",
           "safety_of", "wait_for", "copies", "missing", "object_keys", "rows_of", "forget_node", "level_index",
           "reached", "fast_versions"]

FAST, DURABLE = "fast", "durable"


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key relative to a store root, its size and the crc32c (hex) of its bytes."""

    key: str
    nbytes: int
    crc32c: str | None = None


class Copy(NamedTuple):
    """One complete copy of an object: on ``tier`` (``fast`` | ``durable``), ``node`` (``""`` for durable)."""

    tier: str
    node: str
    crc32c: str | None
    nbytes: int


def level_index(level: str | None) -> int:
    """``local`` 0, ``replicated`` 1, ``durable`` 2; None (a version written straight to the durable tier) 2."""
    if level is None:
        return len(m.SAFETY_LEVELS) - 1
    if level not in m.SAFETY_LEVELS:
        raise ValidationError(f"safety level {level!r}: expected one of {', '.join(m.SAFETY_LEVELS)}")
    return m.SAFETY_LEVELS.index(level)


def reached(level: str | None, wanted: str) -> bool:
    """Whether a version at ``level`` (None: durable) has reached ``wanted``."""
    return level_index(level) >= level_index(wanted)


def _check(tier: str, node: str, state: str) -> None:
    if tier not in m.TIERS:
        raise ValidationError(f"tier {tier!r}: expected one of {', '.join(m.TIERS)}")
    if state not in m.PLACEMENT_STATES:
        raise ValidationError(f"placement state {state!r}: expected one of {', '.join(m.PLACEMENT_STATES)}")
    if (tier == DURABLE) != (node == ""):
        raise ValidationError(f"placement on tier {tier!r} with node {node!r}: the durable tier has node '' and "
                              "a fast tier names its node")


def record(session, checkpoint_id: str, tier: str, node: str, objects: Iterable[ObjectInfo], state: str, *,
           refresh: bool = False) -> int:
    """Record ``objects`` on (``tier``, ``node``) in ``state``: rows inserted, or updated where they exist
    (size and crc32c too, when given). ``refresh``: store the version's safety afterwards, in the same
    transaction. Returns the number of objects recorded."""
    _check(tier, node, state)
    items = {o.key: o for o in objects}
    if not items:
        return 0
    now = m.utcnow()
    existing = {p.object: p for p in session.scalars(select(m.Placement).where(
        m.Placement.checkpoint_id == checkpoint_id, m.Placement.tier == tier, m.Placement.node == node))}
    fresh = []
    for key, o in items.items():
        row = existing.get(key)
        if row is None:
            fresh.append(m.Placement(checkpoint_id=checkpoint_id, tier=tier, node=node, object=key, state=state,
                                     nbytes=int(o.nbytes), crc32c=o.crc32c, updated_at=now))
        else:
            row.state, row.updated_at = state, now
            row.nbytes = int(o.nbytes)
            if o.crc32c is not None:
                row.crc32c = o.crc32c
    session.add_all(fresh)
    session.flush()
    if refresh:
        refresh_safety(session, checkpoint_id)
    return len(items)


def set_state(session, checkpoint_id: str, tier: str, node: str, state: str, objects: Sequence[str] | None = None,
              *, refresh: bool = True) -> int:
    """Move the rows of (``tier``, ``node``) of a version (only ``objects``, when given) to ``state``; then, by
    default, refresh the version's safety in the same transaction. Returns the rows changed."""
    _check(tier, node, state)
    where = [m.Placement.checkpoint_id == checkpoint_id, m.Placement.tier == tier, m.Placement.node == node]
    changed = 0
    keys = None if objects is None else list(objects)
    for start in range(0, 1 if keys is None else len(keys), 500):
        cond = list(where)
        if keys is not None:
            cond.append(m.Placement.object.in_(keys[start:start + 500]))
        res = session.execute(update(m.Placement).where(*cond).values(state=state, updated_at=m.utcnow())
                              .execution_options(synchronize_session=False))
        changed += int(res.rowcount or 0)
    session.flush()
    if refresh:
        refresh_safety(session, checkpoint_id)
    return changed


def rows_of(session, checkpoint_id: str) -> list[m.Placement]:
    """Every placement row of a version (any tier, node and state)."""
    return list(session.scalars(select(m.Placement).where(m.Placement.checkpoint_id == checkpoint_id)
                                .order_by(m.Placement.tier, m.Placement.node, m.Placement.object)))


def object_keys(session, checkpoint_id: str) -> list[str]:
    """The version's objects: every key any of its rows names (sorted)."""
    return sorted(set(session.scalars(select(m.Placement.object).where(
        m.Placement.checkpoint_id == checkpoint_id))))


def _level(rows: Iterable[tuple[str, str, str, str]]) -> str | None:
    """The safety of rows ``(object, tier, node, state)``; None when there are none."""
    objects: set[str] = set()
    durable: set[str] = set()
    fast: dict[str, set[str]] = {}
    for obj, tier, node, state in rows:
        objects.add(obj)
        if state != "complete":
            continue
        if tier == DURABLE:
            durable.add(obj)
        else:
            fast.setdefault(obj, set()).add(node)
    if not objects:
        return None
    if durable >= objects:
        return "durable"
    if all(o in durable or len(fast.get(o, ())) >= 2 for o in objects):
        return "replicated"
    return "local"


def compute_safety(session, checkpoint_id: str) -> str | None:
    """The safety level the version's rows show now (None: it has no placement rows, i.e. it was written
    straight to the durable tier)."""
    return _level(session.execute(select(m.Placement.object, m.Placement.tier, m.Placement.node, m.Placement.state)
                                  .where(m.Placement.checkpoint_id == checkpoint_id)))


def refresh_safety(session, checkpoint_id: str) -> str | None:
    """Store :func:`compute_safety` in ``checkpoints.safety`` (in the caller's transaction) and return it. A
    version without rows keeps its NULL (written durable directly)."""
    level = compute_safety(session, checkpoint_id)
    if level is not None:
        session.execute(update(m.Checkpoint).where(m.Checkpoint.id == checkpoint_id).values(safety=level)
                        .execution_options(synchronize_session=False))
    return level


def safety_of(session, checkpoint_id: str) -> str | None:
    """The stored safety of a version (None: written durable directly, or no such version)."""
    return session.scalar(select(m.Checkpoint.safety).where(m.Checkpoint.id == checkpoint_id))


def wait_for(catalog, checkpoint_id: str, level: str, *, timeout: float | None = None, poll: float = 0.2) -> str:
    """Poll ``catalog`` (every ``poll`` s, a read each) until the version has reached ``level``; returns its level
    (None stored: ``durable``), or TimeoutError after ``timeout`` s naming the level it has."""
    import time

    level_index(level)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with catalog.session() as s:
            now = safety_of(s, checkpoint_id) or "durable"
        if reached(now, level):
            return now
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"version {checkpoint_id}: safety {level!r} not reached within {timeout} s (it is "
                               f"{now!r})")
        time.sleep(poll)


def copies(session, checkpoint_id: str) -> dict[str, list[Copy]]:
    """Every object of the version -> its complete copies, durable last and fast copies by node name. An
    object with no complete copy maps to an empty list (it is lost unless a write is still under way)."""
    out: dict[str, list[Copy]] = {k: [] for k in object_keys(session, checkpoint_id)}
    rows = session.execute(select(m.Placement.object, m.Placement.tier, m.Placement.node, m.Placement.crc32c,
                                  m.Placement.nbytes).where(m.Placement.checkpoint_id == checkpoint_id,
                                                            m.Placement.state == "complete"))
    for obj, tier, node, crc, nbytes in rows:
        out[obj].append(Copy(tier, node, crc, int(nbytes)))
    for lst in out.values():
        lst.sort(key=lambda c: (c.tier == DURABLE, c.node))
    return out


def missing(session, checkpoint_id: str) -> list[str]:
    """The version's objects with no complete copy on any tier (sorted): lost, or still being written."""
    return sorted(k for k, c in copies(session, checkpoint_id).items() if not c)


def fast_versions(session, node: str | None = None) -> dict[str, set[str]]:
    """Version id -> the nodes holding complete fast copies of any of its objects (only ``node``, if given)."""
    q = select(m.Placement.checkpoint_id, m.Placement.node).where(m.Placement.tier == FAST,
                                                                  m.Placement.state == "complete").distinct()
    if node is not None:
        q = q.where(m.Placement.node == node)
    out: dict[str, set[str]] = {}
    for ck, n in session.execute(q):
        out.setdefault(ck, set()).add(n)
    return out


def forget_node(session, node: str) -> list[str]:
    """A node is lost (its fast tier with it): its complete and writing fast rows become ``evicted`` and every
    version it held has its safety recomputed, in the caller's transaction. Returns those versions' ids."""
    _check(FAST, node, "evicted")
    touched = sorted(set(session.scalars(select(m.Placement.checkpoint_id).where(
        m.Placement.tier == FAST, m.Placement.node == node, m.Placement.state != "evicted"))))
    for ck in touched:
        set_state(session, ck, FAST, node, "evicted")
    return touched
