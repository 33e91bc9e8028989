"""``ucp_store.pull``: move tensors a process holds from version M to version N in place, reading only what changed.

The front of ``registry/pull.py`` for one process: the held tensors come as a dict keyed by stored name (or by
Hugging Face name through a name map, as ``ucp export hf`` takes), each the whole tensor or the ``boxes[key]``
slice of it (a TP rank's shard). Each key becomes a ``PullTarget`` of its stored tensor-state and box; a name
map's split pieces (``q_proj`` of a fused ``qkv_proj``) are boxes of the fused stored tensor. Ranks of a job
pull through ``ucp_store.distributed.pull`` (one catalog client, DTensors too).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ucp_store.errors import ValidationError
from ucp_store.geometry import Box
from ucp_store.registry.pull import PullResult, PullTarget, apply_pull, plan_pull

__all__ = ["pull", "resolve_targets", "as_box", "dtensor_targets", "verify_boxes"]


def as_box(value: Any, what: str) -> Box:
    """A box from a ``Box``, ``[[start, stop], ...]`` or a tuple of slices with explicit bounds."""
    if isinstance(value, Box):
        return value
    try:
        ranges = []
        for r in value:
            if isinstance(r, slice):
                if r.start is None or r.stop is None or r.step not in (None, 1):
                    raise ValueError("a slice needs a start and a stop, step 1")
                ranges.append((int(r.start), int(r.stop)))
            else:
                a, b = r
                ranges.append((int(a), int(b)))
        return Box(tuple(ranges))
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"pull: boxes[{what!r}] = {value!r} is not a box ([[start, stop], ...] per dim or "
                              f"slices with bounds): {exc}") from None


def _pieces(checkpoint, state: str, name_map: Any, config: Mapping[str, Any] | None) -> dict[str, tuple]:
    """HF name -> (stored name, dim, start) through ``name_map`` (stored name -> itself without one)."""
    infos = checkpoint.tensors(state=state)
    if name_map is None:
        return {i.name: (i.name, None, 0, 0) for i in infos}
    from ucp_store.formats.hf.names import load_map

    return {p.name: (p.source.name, p.dim, p.start, p.stop) for p in load_map(name_map).plan(infos, config)}


def resolve_targets(checkpoint, tensors: Mapping[str, Any], *, boxes: Mapping[str, Any] | None = None,
                    state: str = "weight", name_map: Any = None, config: Mapping[str, Any] | None = None
                    ) -> list[PullTarget]:
    """``PullTarget`` per key of ``tensors``: its stored tensor-state in ``checkpoint`` (the version pulled to)
    and box (``boxes[key]`` in the key's own coordinates, shifted into the stored tensor's for a split piece)."""
    pieces = _pieces(checkpoint, state, name_map, config)
    boxes = boxes or {}
    unknown = [k for k in boxes if k not in tensors]
    if unknown:
        raise ValidationError(f"pull: boxes name {unknown[:3]} that are not among the tensors")
    out = []
    for key, tensor in tensors.items():
        piece = pieces.get(key) or pieces.get(key.rsplit("#", 1)[0])  # a DTensor's region i is "key#i"
        if piece is None:
            raise ValidationError(f"pull: {key!r} is not a tensor of version {checkpoint.run}@{checkpoint.step} "
                                  f"[{state}]" + (" after the name map" if name_map is not None else ""))
        name, dim, start, stop = piece
        whole = Box.full(checkpoint.info(name, state).shape)
        if dim is not None:
            whole = whole.with_dim(dim, start, stop)
        box = whole
        if key in boxes:
            box = as_box(boxes[key], key)
            if dim is not None:
                if box.ndim != whole.ndim or box.ranges[dim][1] > stop - start:
                    raise ValidationError(f"pull: boxes[{key!r}] = {box.to_json()} is not within {key!r} "
                                          f"(shape {list(whole.shape)})")
                box = box.with_dim(dim, box.ranges[dim][0] + start, box.ranges[dim][1] + start)
        out.append(PullTarget(name, state, tensor, box, key))
    return out


def dtensor_targets(tensors: Mapping[str, Any], boxes: dict[str, Any]) -> dict[str, Any]:
    """DTensors of ``tensors`` as their local shards' regions: ``{key: local view}`` with ``boxes[key]`` set to
    the region's box (a strided shard's several regions become keys ``key#i``); other values pass through."""
    mod = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (importing costs)
    if mod is None or not any(isinstance(t, mod.DTensor) for t in tensors.values()):
        return dict(tensors)
    from ucp_store.distributed import layout as lay
    from ucp_store.distributed.tensors import is_dtensor

    out: dict[str, Any] = {}
    for key, t in tensors.items():
        if not is_dtensor(t):
            out[key] = t
            continue
        coord = t.device_mesh.get_coordinate()
        if coord is None:  # not on this DTensor's mesh: holds nothing
            continue
        placements = [lay.placement_json(p) for p in t.placements]
        regions = lay.local_regions(tuple(t.shape), lay.mesh_facts(t.device_mesh).shape, placements, tuple(coord),
                                    what=key)
        local = t.to_local()
        for i, r in enumerate(regions):
            k = key if len(regions) == 1 else f"{key}#{i}"
            out[k] = local[r.local_slices()]
            boxes[k] = [list(x) for x in r.global_box]
    return out


def _multi_rank(group) -> Any:
    """The bounded control group when ``group`` (default: the world) has several ranks, else None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(group) < 2:
        return None
    from ucp_store.distributed.commit import control_group

    return control_group(group)


def pull(store, have: str | None, want: str, tensors: Mapping[str, Any], *, boxes: Mapping[str, Any] | None = None,
         state: str = "weight", name_map: Any = None, config: Mapping[str, Any] | None = None,
         verify: bool = False, keys: Sequence[str] | None = None, group: Any = None) -> PullResult:
    """Bring ``tensors`` (holding version ``have``'s values, each the whole tensor or ``boxes[key]`` of it, in the
    stored dtype, on any device) to version ``want`` in place, reading only the delta chunks that intersect
    each box (or ``want``'s values where a keyframe lies between). ``store``: a ``Store`` or its path/URL.
    ``name_map`` (a shipped map's name, a file, a dict) and ``config`` (the HF ``config.json`` values it
    needs): keys are HF names. ``verify``: each whole tensor's content hash checked against ``want``'s (across
    ranks: their boxes' digests merged, ``verify_boxes``).
    DTensor values stand for their local shards' boxes. Under ``torch.distributed`` with several ranks in
    ``group`` (every rank calls it), group rank 0 alone opens the catalog and plans (``store`` is a path or URL
    there; other ranks may pass the same) and broadcasts the plan; each rank reads its own boxes.
    Returns a :class:`~ucp_store.registry.pull.PullResult` (per key: route, changed chunks, bytes read)."""
    boxes = dict(boxes or {})
    chosen = {k: tensors[k] for k in keys} if keys is not None else dict(tensors)
    chosen = dtensor_targets(chosen, boxes)
    control = _multi_rank(group)
    if control is None:
        t0 = time.perf_counter()
        if isinstance(store, str):
            from ucp_store.store import open_store

            store = open_store(store)
        ck = store.checkpoint(want)
        targets = resolve_targets(ck, chosen, boxes=boxes, state=state, name_map=name_map, config=config)
        routes = plan_pull(store, have, want, {(t.name, t.state) for t in targets})
        planned = time.perf_counter() - t0
        result = apply_pull(store.location, routes, targets, have=str(have), want=want, verify=verify)
        result.phases["plan"] = planned
        return result
    return _pull_ranks(store, have, want, chosen, boxes, state=state, name_map=name_map, config=config,
                       verify=verify, control=control)


def _pull_ranks(store, have, want, chosen, boxes, *, state, name_map, config, verify, control) -> PullResult:
    from ucp_store.distributed import coord

    def work():
        st = store
        if isinstance(st, str):
            from ucp_store.store import open_store

            st = open_store(st)
        ck = st.checkpoint(want)
        routes = plan_pull(st, have, want, [(i.name, i.state) for i in ck.tensors(state=state)])
        payload = coord.version_payload(ck, objects=False)
        payload["routes"] = [r.to_json() for r in routes.values()]
        return (st, ck, routes), payload

    t0 = time.perf_counter()
    value, answer = coord.from_coordinator(work, control, f"pull {have} -> {want}")
    if value is not None:
        st, ck, routes = value
    else:
        st = coord.detached_store(answer["store"])
        ck = coord.detached_checkpoint(st, answer)
        from ucp_store.registry.pull import TensorRoute

        routes = {(r["name"], r["state"]): TensorRoute.from_json(r) for r in answer["routes"]}
    targets = resolve_targets(ck, chosen, boxes=boxes, state=state, name_map=name_map, config=config)
    planned = time.perf_counter() - t0  # rank 0's catalog work and the broadcast, as every rank waited for it
    result = apply_pull(st.location, routes, targets, have=str(have), want=want, verify=False)
    result.phases["plan"] = planned
    if verify:
        t1 = time.perf_counter()
        verify_boxes(routes, targets, result, control, f"pull {have} -> {want}")
        result.phases["verify"] = time.perf_counter() - t1
    return result


def verify_boxes(routes: Mapping, targets: Sequence[PullTarget], result: PullResult, control, what: str) -> None:
    """A collective: every rank digests the units of the content hash wholly inside its boxes (from memory), the
    coordinator merges them per tensor-state and compares the hash with the version's; each target gets
    ``verified`` True/False (None where some unit lay in no rank's box whole, e.g. uneven splits). A mismatch
    raises ``ChecksumError`` on every rank."""
    from ucp_store import dtypes
    from ucp_store.distributed.commit import agree
    from ucp_store.errors import ChecksumError
    from ucp_store.io import format as fmt

    mine: dict[str, dict] = {}
    for tg in targets:
        tr = routes[(tg.name, tg.state)]
        digests: dict = {}
        box = tg.box or Box.full(tr.shape)
        fmt.box_unit_digests(tr.dtype, tr.shape, box.start, dtypes.to_numpy(tg.tensor.detach().cpu(), what=tg.label),
                             digests)
        got = mine.setdefault(f"{tg.name}\0{tg.state}", {})
        got.update({str(u): d.hex() for u, d in digests.items()})

    def decide(everyone: list) -> dict:
        merged: dict[str, dict] = {}
        for part in everyone:
            for k, d in part.items():
                merged.setdefault(k, {}).update(d)
        out: dict[str, bool | None] = {}
        for k, d in merged.items():
            tr = routes[tuple(k.split("\0", 1))]
            h = fmt.units_hash(tr.dtype, tr.shape, {int(u): bytes.fromhex(v) for u, v in d.items()})
            out[k] = None if h is None else h == tr.content_hash
        return out

    verdict = agree(mine, decide, control)
    for t, tg in zip(result.tensors, targets):
        t.verified = verdict.get(f"{tg.name}\0{tg.state}")
    bad = sorted({k.replace("\0", " [") + "]" for k, v in verdict.items() if v is False})
    if bad:
        raise ChecksumError(f"{what}: after the pull, the ranks' boxes of {', '.join(bad[:5])} do not hash to the "
                            "version's content hash (did every rank hold the version it pulled from?)")
