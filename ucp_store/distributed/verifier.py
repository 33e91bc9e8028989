"""``verify``: a live DTensor / FSDP2 / TP state dict compared with a version bit for bit, on every rank; the
report (every differing tensor, box and per-rank key) is the same on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ucp_store import dtypes
from ucp_store.distributed.context import Ctx, raise_failures
from ucp_store.distributed.loader import CatalogView, view_everywhere
from ucp_store.distributed.statedict import Leaf, flatten, path_text
from ucp_store.distributed.tensors import LocalTensor, describe_leaf, host_copy
from ucp_store.errors import ConfigurationError

__all__ = ["Mismatch", "VerifyReport", "verify"]


@dataclass
class Mismatch:
    """One box of one tensor that differs from the checkpoint (or a key/shape problem when ``box`` is None)."""

    name: str
    state: str
    path: str
    rank: int
    box: list | None
    differing: int
    first: list | None = None
    reason: str = "values differ"

    def __str__(self) -> str:
        where = f" box {self.box}" if self.box is not None else ""
        first = f", first at {self.first}" if self.first is not None else ""
        return (f"tensor {self.name!r} state {self.state!r} ({self.path}) on rank {self.rank}{where}: {self.reason}"
                f" ({self.differing} element(s){first})")


@dataclass
class VerifyReport:
    """``verify``'s answer, the same on every rank: ``ok`` and every differing tensor and box."""

    checkpoint_id: str
    mismatches: list[Mismatch]
    checked_elements: int

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def __str__(self) -> str:
        if self.ok:
            return f"checkpoint {self.checkpoint_id}: every box matches ({self.checked_elements} elements)"
        lines = [f"checkpoint {self.checkpoint_id}: {len(self.mismatches)} mismatch(es)"]
        lines += [f"  {m}" for m in self.mismatches]
        return "\n".join(lines)


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a.view(np.uint8)


def verify(state_dict: dict, ref: str, *, store: Any = None, group=None, progress: bool = True,
           per_rank: dict | None = None, mesh=None, node: str | None = None, fast_tier: Any = None) -> VerifyReport:
    """Compare a live (sharded) state dict with version ``ref``, bit for bit; call on every rank.

    Each rank checks its own boxes and its per-rank state (against its own stored entry on the saving
    topology, or the entry ``per_rank``'s policies pick, as in ``load``; ``reshard`` and ``fresh`` keys are
    not compared). The report (gathered, the same on every rank) names every tensor, box and per-rank key
    that differs, and keys or shapes that do not match. A version on the fast tiers is read from the nearest
    copies, as ``load`` reads it (``node``, ``fast_tier``)."""
    from ucp_store.distributed import perrank
    from ucp_store.distributed.loader import hydrate_view, restores_from_tiers
    from ucp_store.progress import track

    ctx = Ctx(group)
    error: BaseException | None = None
    mine: list[Mismatch] = []
    checked = 0
    ck_id = ""
    view: CatalogView | None = None
    leaves: list[Leaf] = []
    live = None
    try:
        view = view_everywhere(store, ref, ctx, f"verify of {ref}")
        leaves = flatten(state_dict)
        live = perrank.live_topology(leaves, mesh, ctx, what=f"verify {ref}")
    except BaseException as exc:  # noqa: BLE001
        error = exc
    if view is not None and restores_from_tiers(view, fast_tier):  # the same on every rank (the broadcast)
        every = None if error is not None else [describe_leaf(leaf) for leaf in leaves if leaf.is_tensor]
        view, error, _ = hydrate_view(ctx, view, every, False, error, node, fast_tier, f"verify of {ref}")
    try:
        if error is not None:
            raise error
        assert view is not None
        ck, infos = view.ck, view.infos
        ck_id = ck.id
        handled = _verify_per_rank(view, leaves, live, ctx.rank, perrank.parse_policies(per_rank), mine)
        for leaf in leaves:  # replicated values (a learning rate, a position all ranks share)
            if not leaf.is_tensor and leaf.path not in handled and leaf.path in view.values:
                why = perrank.compare(leaf.value, view.values[leaf.path])
                if why is not None:
                    text = path_text(leaf.path)
                    mine.append(Mismatch(text, "value", text, ctx.rank, None, 0, reason=why))
        tensors = [describe_leaf(leaf) for leaf in leaves if leaf.is_tensor and leaf.path not in handled]
        for t in track(tensors, f"verify {ref}", enabled=progress and ctx.rank == 0):
            checked += _verify_tensor(ck, infos, t, ctx.rank, mine)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    # one round: every rank's error, mismatches and count to the coordinator; the failures and the report back
    failures, everything, total = ctx.agree(
        [None if error is None else f"{type(error).__name__}: {error}", [m.__dict__ for m in mine], checked],
        _verify_outcome, f"verify of {ref}")
    raise_failures(failures, error, f"verify of {ref}")
    return VerifyReport(ck_id, [Mismatch(**d) for d in everything], total)


def _verify_outcome(parts: list[list]) -> list:
    """The coordinator's answer to every rank's ``[error message | None, mismatches, elements checked]``: the
    ``[rank, message]`` of each failure, every rank's mismatches (in rank order) and the elements checked."""
    return [[[r, m] for r, (m, _, _) in enumerate(parts) if m is not None], [d for _, ms, _ in parts for d in ms],
            sum(c for _, _, c in parts)]


def _verify_tensor(ck, infos: dict, t: LocalTensor, rank: int, mine: list[Mismatch]) -> int:
    """Compare one live tensor's boxes with the stored array; returns the elements checked."""
    path = path_text(t.leaf.path)
    info = infos.get(t.key)
    if info is None:
        mine.append(Mismatch(t.key[0], t.key[1], path, rank, None, 0, reason="not in the checkpoint"))
        return 0
    if tuple(info.shape) != t.shape or info.dtype != t.dtype:
        mine.append(Mismatch(t.key[0], t.key[1], path, rank, None, 0,
                             reason=f"is {t.dtype}{list(t.shape)} live but {info.dtype}{list(info.shape)} stored"))
        return 0
    checked = 0
    handle = ck.tensor(*t.key)
    for region in t.regions:
        stored = handle.read_numpy(region.global_slices()) if region.global_box else handle.read_numpy(())
        live = dtypes.to_numpy(host_copy(t.local[region.local_slices()] if region.local_box else t.local), what=t.what)
        diff = _bits(stored) != _bits(live)
        checked += int(live.size)
        n = int(diff.sum())
        if n:
            first = np.unravel_index(int(np.argmax(diff.reshape(-1))), diff.shape) if diff.ndim else ()
            mine.append(Mismatch(t.key[0], t.key[1], path, rank, [list(b) for b in region.global_box], n,
                                 [int(lo + i) for (lo, _), i in zip(region.global_box, first)]))
    return checked


def _verify_per_rank(view: CatalogView, leaves: list[Leaf], live, rank: int, policies: dict,
                     mine: list[Mismatch]) -> set[tuple]:
    """Compare this rank's live per-rank leaves with the stored entries their policy picks; returns their paths."""
    from ucp_store.distributed import perrank
    from ucp_store.distributed.rankstate import choose_source, parse_policy, policy_for

    if view.manifest is None:
        return set()
    index = view.manifest.by_path()
    todo: list[tuple[Leaf, str]] = []
    handled: set[tuple] = set()
    for leaf in leaves:
        i = index.get(leaf.path)
        if i is None:
            continue
        handled.add(leaf.path)
        found = policy_for(leaf.path, policies)
        policy = found[1] if found is not None else parse_policy("same")
        if policy.kind in ("reshard", "fresh"):
            continue  # computed or left as built on purpose: nothing stored to compare with
        key = view.manifest.keys[i]
        try:
            src = choose_source(policy, key, view.manifest.topology, live, rank)
        except ConfigurationError as exc:
            mine.append(Mismatch(key.text, "per-rank", key.text, rank, None, 0, reason=str(exc)))
            continue
        todo.append((leaf, key.entry(src).object))  # type: ignore[union-attr]
    got = perrank.read_entries(view.ck, {name for _, name in todo})
    for leaf, name in todo:
        why = perrank.compare(leaf.value, got[name])
        if why is not None:
            text = path_text(leaf.path)
            mine.append(Mismatch(text, "per-rank", text, rank, None, 0 if leaf.is_tensor is False else 1,
                                 reason=f"per-rank state differs from stored {name}: {why}"))
    return handled
