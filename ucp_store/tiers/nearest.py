"""Where a restore takes each object from (issue 38, the restore side): pure decisions over placement rows.

A restore needs, per node of the restarted job, the objects its ranks' plans touch that the node's fast tier
does not hold intact. For each, :func:`assign` picks the nearest good copy: a complete copy on another
*surviving* node's fast tier (a node with a rank in the job; that rank reads it and sends it), spread over
the holders' ranks by bytes; else the durable tier. Copies found bad (a crc32c or size that does not match the
catalog, or a missing file) are excluded, so the next round takes the next copy. :func:`unreachable` says
which objects of a version no surviving node and no durable copy holds: the version is then not restorable.

Pure: no torch, no I/O. ``copies`` is :func:`ucp_store.tiers.placement.copies` as plain lists
``key -> [[tier, node, crc32c, nbytes], ...]`` (the form that crosses a broadcast).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Assignment", "assign", "crc_of", "size_of", "unreachable"]

FAST, DURABLE = "fast", "durable"


@dataclass
class Assignment:
    """One round's decision for one rank: what it sends (``[key, to rank, nbytes]``), receives (``[key, from rank,
    from node, nbytes, crc32c]``) and reads from the durable tier (``[key, nbytes | None, crc32c | None]``)."""

    send: list[list] = field(default_factory=list)
    recv: list[list] = field(default_factory=list)
    durable: list[list] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"send": self.send, "recv": self.recv, "durable": self.durable}


def crc_of(copies: Sequence[Sequence]) -> str | None:
    """The object's crc32c as the catalog records it (every complete copy of an object has the same bytes)."""
    return next((c[2] for c in copies if c[2]), None)


def size_of(copies: Sequence[Sequence]) -> int | None:
    return next((int(c[3]) for c in copies), None)


def unreachable(copies: Mapping[str, Sequence[Sequence]], surviving: Iterable[str]) -> list[str]:
    """The objects without a complete copy on a surviving node's fast tier or on the durable tier (sorted)."""
    alive = set(surviving)
    return sorted(k for k, cs in copies.items()
                  if not any(c[0] == DURABLE or (c[0] == FAST and c[1] in alive) for c in cs))


def assign(wants: Sequence[tuple[str, Sequence[str]]], copies: Mapping[str, Sequence[Sequence]],
           bad: Iterable[Sequence[str]] = ()) -> tuple[list[Assignment], list[str]]:
    """One round of a restore: ``wants[r]`` is rank ``r``'s ``(node, keys it needs that its node lacks)``.

    Each (node, key) is fetched once, by the node's requesting rank with the fewest bytes so far; from a good
    complete copy on another node of the job (its least-loaded rank sends it), else from the durable tier (also
    for a key the catalog does not list: an object outside the version's placements, read where the store
    keeps it). ``bad``: ``(key, node)`` pairs found bad (``""``: the durable copy). Returns every rank's
    :class:`Assignment` and the keys with no good copy left (``"key: reason"``)."""
    world = len(wants)
    ranks_on: dict[str, list[int]] = {}
    for r, (node, _) in enumerate(wants):
        ranks_on.setdefault(node, []).append(r)
    excluded = {(k, n) for k, n in bad}
    out = [Assignment() for _ in range(world)]
    recv_load, send_load = [0] * world, [0] * world
    lost: list[str] = []
    needed: dict[tuple[str, str], list[int]] = {}
    for r, (node, keys) in enumerate(wants):
        for k in keys:
            needed.setdefault((node, k), []).append(r)
    for (node, key), askers in sorted(needed.items()):
        cs = copies.get(key)
        size = size_of(cs) if cs else None
        nbytes = size or 0
        to = min(askers, key=lambda r: (recv_load[r], r))
        recv_load[to] += nbytes
        if cs is None:  # not a placed object of the version: where the store keeps it
            out[to].durable.append([key, None, None])
            continue
        crc = crc_of(cs)
        holders = [c[1] for c in cs
                   if c[0] == FAST and c[1] != node and c[1] in ranks_on and (key, c[1]) not in excluded]
        if holders:
            frm = min((s for n in holders for s in ranks_on[n]), key=lambda s: (send_load[s], s))
            send_load[frm] += nbytes
            out[frm].send.append([key, to, nbytes])
            out[to].recv.append([key, frm, wants[frm][0], nbytes, crc])
        elif any(c[0] == DURABLE for c in cs) and (key, "") not in excluded:
            out[to].durable.append([key, nbytes, crc])
        else:
            recv_load[to] -= nbytes
            held = sorted({c[1] for c in cs if c[0] == FAST}) or ["none"]
            lost.append(f"{key}: no good copy on the job's nodes ({', '.join(sorted(ranks_on))}) or the durable tier "
                        f"(fast copies on {', '.join(held)})")
    return out, lost
