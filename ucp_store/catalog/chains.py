"""Delta chains in the catalog (issue 39): an ``xor`` array's bases, down to its keyframe, and chain depths.

``arrays.base_array_id`` links an ``xor`` array to its base (a foreign key: no base row can go while a delta
names it). :func:`base_chains` follows the links for many arrays at once, one query per level, and returns
each array's bases as :class:`~ucp_store.records.ArrayRef` records nearest first, the plain keyframe last;
readers hand them to ``io/deltaio.DeltaArray``. :func:`needed_arrays` is the closure gc keeps: the arrays
rows reference, plus every base of those, recursively.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Text, cast, select

from ucp_store.catalog import models as m
from ucp_store.errors import CatalogError
from ucp_store.records import ArrayRef

__all__ = ["MAX_DEPTH", "base_chains", "chain_depth", "needed_arrays", "stored_bytes"]

#: the longest chain followed; the writer's keyframes keep chains far shorter (``config.delta_keyframe_every``)
MAX_DEPTH = 1024


def _json(text: Any) -> Any:
    import json

    return json.loads(text) if isinstance(text, (str, bytes)) else text


def base_chains(conn: Any, bases: dict[str, str | None]) -> dict[str, tuple[ArrayRef, ...]]:
    """``{array id: its bases, nearest first, the plain keyframe last}`` for the ``xor`` arrays in ``bases``
    (``{array id: base_array_id}``; plain arrays map to None and get ``()``). ``conn``: a SQLAlchemy
    connection or session. A link to a missing row or a chain past :data:`MAX_DEPTH` is a CatalogError."""
    a = m.Array
    known: dict[str, tuple[str, str, Any, str, str | None]] = {}
    frontier = {b for b in bases.values() if b}
    for _ in range(MAX_DEPTH + 1):
        todo = sorted(frontier - set(known))
        if not todo:
            break
        for i in range(0, len(todo), 500):
            q = select(a.id, a.path, cast(a.codecs, Text), a.encoding, a.base_array_id).where(a.id.in_(todo[i:i + 500]))
            for aid, path, codecs, enc, base in conn.execute(q):
                known[aid] = (aid, path, _json(codecs), enc, base)
        missing = [t for t in todo if t not in known]
        if missing:
            raise CatalogError(f"delta chain broken: base array {missing[0]} has no arrays row")
        frontier = {b for t in todo if (b := known[t][4])}
    out: dict[str, tuple[ArrayRef, ...]] = {}
    refs: dict[str, ArrayRef] = {k: ArrayRef(v[1], v[0], v[2], v[3]) for k, v in known.items()}
    for aid, base in bases.items():
        chain: list[ArrayRef] = []
        while base:
            if len(chain) > MAX_DEPTH:
                raise CatalogError(f"delta chain of array {aid} is longer than {MAX_DEPTH} (a cycle?)")
            chain.append(refs[base])
            base = known[base][4]
        out[aid] = tuple(chain)
    return out


def chain_depth(encoding: str, bases: Iterable[ArrayRef]) -> int:
    """0 for a plain array, else how many xor arrays a read XORs over the keyframe."""
    return 0 if encoding != "xor" else 1 + sum(1 for b in bases if b.encoding == "xor")


def needed_arrays(conn: Any, ids: Iterable[str]) -> set[str]:
    """``ids`` and every base of them, recursively (what a kept version reads)."""
    a = m.Array
    need = set(ids)
    frontier = set(need)
    for _ in range(MAX_DEPTH + 1):
        if not frontier:
            break
        nxt: set[str] = set()
        todo = sorted(frontier)
        for i in range(0, len(todo), 500):
            nxt |= {b for b in conn.execute(select(a.base_array_id).where(
                a.id.in_(todo[i:i + 500]), a.base_array_id.is_not(None))).scalars()}
        frontier = nxt - need
        need |= nxt
    return need


def stored_bytes(conn: Any, checkpoint_ids: Iterable[str]) -> dict[str, int]:
    """``{checkpoint id: bytes of the arrays that version wrote}`` (its own folder ``arrays/<id>/``: deltas at
    their stored size, arrays deduplicated from earlier versions not counted; an array whose stored size is
    not recorded counts its logical bytes). One grouped query per 500 versions."""
    from sqlalchemy import func, literal

    t, a = m.Tensor, m.Array
    ids = sorted(set(checkpoint_ids))
    out = dict.fromkeys(ids, 0)
    for i in range(0, len(ids), 500):
        own = (select(t.checkpoint_id.label("ck"), a.id.label("aid"),
                      func.coalesce(a.stored_nbytes, a.nbytes).label("n"))
               .join(a, t.array_id == a.id)
               .where(t.checkpoint_id.in_(ids[i:i + 500]),
                      a.path.like(literal("arrays/") + t.checkpoint_id + literal("/%")))
               .distinct().subquery())
        for ck, n in conn.execute(select(own.c.ck, func.sum(own.c.n)).group_by(own.c.ck)):
            out[ck] = int(n or 0)
    return out
