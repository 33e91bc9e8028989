"""Publishing from many ranks as deltas of the parent version (issue 39): ``ucp_store.distributed.save(delta=)``.

A trainer's ranks (DTensor / FSDP / TP boxes) save version N; with ``delta="auto"`` each tensor-state whose parent
version holds it (same shape and dtype, a sharded array of at least ``config.delta_min_bytes``, a chain not yet
due for a keyframe: ``save/delta.py``'s rules) may be stored as the XOR of its bits with the parent's, in the
parent's chunk and shard grid. Three steps, two collectives:

1. bases (``Ctx.agree``): every rank names its keys, shapes and dtypes; the coordinator (the only catalog
   client) answers with the parent's rows of the eligible ones (their chains included);
2. each rank XORs its own boxes with the parent's same boxes (from this process's memory when it published the
   parent itself, else read from the store, reconstructing a delta parent) and encodes them as whole shard
   files (``io/deltaio.encode_delta`` over the box), stopping past ``config.delta_max_fraction`` of the box;
   a box that is not a union of whole shard files of the parent's grid (another layout saved the parent)
   cannot be written by one rank alone and says so;
3. decide (``Ctx.agree``): a tensor-state is a delta when every box of it encoded and the sum stays under the
   fraction of the full array; every rank then writes its files, and the array's origin records the ``xor``
   row (``ShardWriter.open_delta`` / ``add_delta_box``). The rest go through ``write_region`` in full.

The content hash is the values' (each rank digests its boxes' values, merged as for any region save), so
dedup, ``verify`` and a pull's verification see values, never encodings.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ucp_store import config
from ucp_store.errors import ConfigurationError

__all__ = ["DELTA_MODES", "Published", "check_mode", "publish_deltas", "remember", "forget_published"]

DELTA_MODES = ("auto", "off")

# the values this process published last, per (store root, name, state, offset): (version id, shape, copy);
# a rank that published version N-1 XORs version N against them without reading the store
_published: dict[tuple, tuple[str, tuple[int, ...], np.ndarray]] = {}
_published_lock = threading.Lock()


def check_mode(mode: Any) -> str | None:
    if mode is not None and mode not in DELTA_MODES:
        raise ConfigurationError(f"save: delta={mode!r}: expected 'auto', 'off' or None (the run's setting)")
    return mode


def forget_published() -> None:
    """Drop the values kept from earlier publishes (the next delta save reads its base from the store)."""
    with _published_lock:
        _published.clear()


@dataclass
class Published:
    """What ``publish_deltas`` did on this rank: the keys stored as deltas (``kept``), those whose delta was
    not small enough (``refused``), and this rank's boxes (``pairs``) for :func:`remember`."""

    kept: set
    refused: set
    pairs: list


@dataclass
class _Box:
    key: tuple[str, str]
    offset: tuple[int, ...]
    values: np.ndarray
    origin: bool
    files: dict[str, bytes] | None = None
    nbytes: int = -1


def _eligible(writer, mode: str | None, everyone: list) -> dict:
    """The coordinator's answer of step 1: the mode in force, the parent's id and its eligible rows."""
    from ucp_store.catalog import models as m
    from ucp_store.distributed.coord import info_to_json

    ctx = writer.store_context
    with ctx.catalog.session() as s:
        ck = s.get(m.Checkpoint, writer.id)
        mode = mode or (ck.run.delta if ck is not None else None) or "off"
        parent = ck.parent_id if ck is not None else None
        if parent is not None and s.get(m.Checkpoint, parent).status != "committed":
            parent = None
    if mode != "auto" or parent is None:
        return {"mode": mode, "parent": None, "rows": []}
    from ucp_store.registry.checkpoint import Checkpoint

    base = {(i.name, i.state): i for i in Checkpoint(ctx, parent).tensors()}
    s = config.current()
    wanted = {(k[0], k[1]): (tuple(shape), dtype) for part in everyone for k, shape, dtype in part}
    rows = []
    for key, (shape, dtype) in wanted.items():
        b = base.get(key)
        if (b is None or b.dtype != dtype or tuple(b.shape) != shape or not shape or 0 in shape
                or b.nbytes < s.delta_min_bytes or b.depth + 1 >= s.delta_keyframe_every):
            continue
        rows.append(info_to_json(b))
    return {"mode": mode, "parent": parent, "rows": rows}


def _base_values(writer, parent: str, ck_holder: list, info, box: _Box) -> np.ndarray:
    root = writer.store_context.location.root
    with _published_lock:
        hit = _published.get((root, box.key, box.offset))
    if hit is not None and hit[0] == parent and hit[1] == tuple(box.values.shape):
        return hit[2]
    if not ck_holder:
        from ucp_store.distributed.coord import detached_checkpoint

        ck_holder.append(detached_checkpoint(writer.store, {"id": parent, "infos": []}))
    ck = ck_holder[0]
    ck._infos[box.key] = info
    index = tuple(slice(o, o + n) for o, n in zip(box.offset, box.values.shape))
    return np.asarray(ck.tensor(*box.key).read_numpy(index))


def _encode(box: _Box, info, base: np.ndarray, fraction: float) -> None:
    """The box's delta as whole shard files of the parent's grid (keys of the whole array), or nbytes -1."""
    from ucp_store.io import delta as dl
    from ucp_store.io import deltaio, localwrite
    from ucp_store.io import format as fmt

    layout = deltaio.delta_layout(fmt.ArrayLayout.from_catalog(info.dtype, info.shape, info.chunk_shape,
                                                               info.shard_shape, info.codecs),
                                  config.current().delta_codec)
    shape = tuple(box.values.shape)
    if not localwrite.whole_shards(layout, box.offset, shape):
        return
    sub = fmt.ArrayLayout(layout.dtype, shape, layout.chunk_shape, layout.shard_shape, layout.compression)
    limit = int(fraction * box.values.nbytes)
    encoded = deltaio.encode_delta(sub, dl.xor(np.ascontiguousarray(box.values), base), limit)
    if encoded is None:
        return
    first = [o // sh for o, sh in zip(box.offset, layout.shard_shape)]
    files = {}
    for key, data in encoded.files.items():
        idx = [int(p) for p in key.split("/")[1:]]
        files[layout.shard_file_key([i + f for i, f in zip(idx, first)])] = data
    box.files, box.nbytes = files, encoded.nbytes


def _decide(everyone: list, sizes: dict) -> dict:
    """Step 3 on the coordinator: ``{key: total bytes}`` of the tensor-states stored as deltas."""
    fraction = config.current().delta_max_fraction
    totals: dict[str, int] = {}
    refused: set[str] = set()
    for part in everyone:
        for k, n in part.items():
            if n < 0:
                refused.add(k)
            totals[k] = totals.get(k, 0) + n
    return {k: n for k, n in totals.items() if k not in refused and n < fraction * sizes[k]}


def _wire(key: tuple[str, str]) -> str:
    return f"{key[0]}\0{key[1]}"


def publish_deltas(writer, pairs: Sequence[tuple[Any, Any]], ctx, mode: str | None, what: str) -> Published:
    """Steps 1-3 for this rank's ``pairs`` (plan item, staged tensor); the keys stored as deltas have their boxes
    written and registered; the caller writes the others in full. Collectives of ``ctx``."""
    from ucp_store import dtypes
    from ucp_store.distributed.coord import info_from_json

    mine = [[[it.name, it.state], list(it.shape), dtypes.zarr_name(data.dtype, what=it.name)] for it, data in pairs]
    answer = ctx.agree(mine, lambda everyone: _eligible(writer, check_mode(mode), everyone), f"{what} (delta bases)")
    if answer["mode"] != "auto" or not answer["rows"]:
        return Published(set(), set(), list(pairs) if answer["mode"] == "auto" else [])
    parent = answer["parent"]
    infos = {(i.name, i.state): i for i in (info_from_json(r) for r in answer["rows"])}
    fraction = config.current().delta_max_fraction
    boxes: list[_Box] = []
    holder: list = []
    for it, data in pairs:
        key = (it.name, it.state)
        if key not in infos:
            continue
        values = dtypes.to_numpy(data.detach().cpu() if data.device.type != "cpu" else data, what=it.name)
        box = _Box(key, tuple(int(o) for o in it.offset), values, bool(it.origin))
        _encode(box, infos[key], _base_values(writer, parent, holder, infos[key], box), fraction)
        boxes.append(box)
    sizes = {_wire(k): i.nbytes for k, i in infos.items()}
    sent: dict[str, int] = {}
    for b in boxes:
        k = _wire(b.key)
        sent[k] = -1 if b.nbytes < 0 or sent.get(k, 0) < 0 else sent.get(k, 0) + b.nbytes
    kept = ctx.agree(sent, lambda everyone: _decide(everyone, sizes), f"{what} (delta sizes)")
    chosen = {k: infos[k] for k in infos if _wire(k) in kept}
    patterns = {(it.name, it.state): it.pattern for it, _ in pairs}
    for key, info in chosen.items():
        if key in patterns:  # this rank writes boxes of it
            writer.shards.open_delta(key[0], key[1], info, pattern=patterns[key], codec=config.current().delta_codec,
                                     stored_nbytes=int(kept[_wire(key)]))
    for b in boxes:
        if b.key in chosen:
            assert b.files is not None
            writer.shards.add_delta_box(b.key[0], b.key[1], b.values, offset=b.offset, files=b.files, origin=b.origin)
    return Published(set(chosen), set(infos) - set(chosen), list(pairs))


def remember(writer, published: Published, version: str) -> None:
    """Keep copies of what this rank published as ``version`` (the next delta save's base values, read from
    memory instead of the store), except the tensor-states whose delta was refused (dense changes: fp32 master
    weights and moments; their next delta is refused too); a rank keeps only its latest publish."""
    from ucp_store import dtypes

    root = writer.store_context.location.root
    fresh = {}
    for it, data in published.pairs:
        if (it.name, it.state) in published.refused:
            continue
        values = dtypes.to_numpy(data.detach().cpu() if data.device.type != "cpu" else data, what=it.name)
        fresh[(root, (it.name, it.state), tuple(int(o) for o in it.offset))] = (version, tuple(values.shape),
                                                                                values.copy())
    with _published_lock:
        for k in [k for k in _published if k[0] == root]:
            del _published[k]
        _published.update(fresh)
