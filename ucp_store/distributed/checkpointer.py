"""``Checkpointer``: periodic (optionally asynchronous) saves with retention, and resume from the newest.

The way torchtitan's ``CheckpointManager`` is used in a training loop::

    ckpt = Checkpointer("ckpts", "gpt", every=100, keep_last=3, async_mode="thread")
    start = ckpt.load_latest(state) or 0          # newest committed version, on whatever mesh this job has
    for step in range(start, steps):
        train_step(...)
        ckpt.maybe_save(step + 1, state)          # every `every` steps; async: returns once staged
    ckpt.close()                                  # wait for the last save, apply retention

Retention goes through the registry: the run's stored policy (``Store.set_retention``, the same one
``ucp retention`` sets) and ``Store.gc`` after each commit, on rank 0 only.

With ``tier="fast"`` (issue 38) every save goes to the nodes' fast tiers (``replicas``, ``fast_tier``, ``node``,
``fast_keep``, ``drain``: as ``save(tier="fast")`` takes them), and ``load_latest`` resumes from the newest
version this job can restore from its surviving nodes' copies or the durable tier (``newest_restorable``; one
line says so when that is not the newest), reading each object from the nearest copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ucp_store.distributed.context import Ctx, resolve_store
from ucp_store.distributed.loader import load
from ucp_store.distributed.saver import save
from ucp_store.errors import ConfigurationError, ReferenceNotFound

if TYPE_CHECKING:
    from ucp_store.distributed.asyncsave import AsyncSaveHandle

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves ``run`` every ``every`` steps into ``store``, keeps the newest ``keep_last`` (and every
    ``keep_every``-th step), and resumes from the newest committed version.

    ``async_mode``: ``None`` (synchronous ``save``), ``"thread"`` or ``"process"`` (``async_save``).
    ``tier``: ``"durable"`` (default) or ``"fast"``, with the fast tier's options in ``tiered``."""

    def __init__(self, store: Any, run: str, *, every: int = 1, keep_last: int | None = None,
                 keep_every: int | None = None, async_mode: str | None = None, group=None, create: bool = True,
                 mesh=None, tier: str = "durable", **tiered: Any):
        from ucp_store.names import run_name

        run_name(run)
        if not isinstance(every, int) or every < 1:
            raise ConfigurationError(f"Checkpointer: every must be an integer >= 1, got {every!r}")
        for what, v in (("keep_last", keep_last), ("keep_every", keep_every)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigurationError(f"Checkpointer: {what} must be an integer >= 1 or None, got {v!r}")
        if async_mode not in (None, "thread", "process"):
            raise ConfigurationError(f"Checkpointer: async_mode={async_mode!r}; expected None, 'thread' or 'process'")
        if tier not in ("durable", "fast"):
            raise ConfigurationError(f"Checkpointer: tier={tier!r}; expected 'durable' or 'fast'")
        from ucp_store.distributed.tiered import option_names

        known = option_names()
        unknown = sorted(set(tiered) - set(known))
        if unknown or (tiered and tier != "fast"):
            raise ConfigurationError(f"Checkpointer: {', '.join(unknown or sorted(tiered))} "
                                     + ("are not options" if unknown else "need tier='fast'")
                                     + f"; the fast tier's options are {', '.join(known)}")
        self.tier, self.tiered = tier, dict(tiered)
        self.store_arg, self.run, self.every = store, run, every
        self.keep_last, self.keep_every, self.async_mode = keep_last, keep_every, async_mode
        self.group, self.create, self.mesh = group, create, mesh  # mesh: keys per-rank state (see dist.save)
        self._pending: AsyncSaveHandle | None = None  # the save in flight
        self._policy_set = False
        self.last_id: str | None = None
        self.last_note: str | None = None  # load_latest's line when it passed over newer versions

    # --- saving ---------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether ``maybe_save`` saves at ``step``."""
        return step % self.every == 0

    def maybe_save(self, step: int, state_dict: dict, *, force: bool = False):
        """Save at every ``every``-th step (or when ``force``): the version id, the async handle, or None."""
        if not (force or self.due(step)):
            return None
        self._finish_pending()
        if self.async_mode is None:
            self.last_id = str(save(state_dict, store=self.store_arg, run=self.run, step=step, group=self.group,
                                    create=self.create, progress=False, mesh=self.mesh, **self._tier_args()))
            self._retain()
            return self.last_id
        from ucp_store.distributed.asyncsave import async_save

        self._pending = async_save(state_dict, store=self.store_arg, run=self.run, step=step, group=self.group,
                                   mode=self.async_mode, create=self.create, mesh=self.mesh, **self._tier_args())
        return self._pending

    def _tier_args(self) -> dict:
        return {"tier": "fast", **self.tiered} if self.tier == "fast" else {}

    def _finish_pending(self) -> None:
        if self._pending is not None:
            handle, self._pending = self._pending, None
            self.last_id = str(handle.result())  # raises the background error here, on every rank
            self._retain()

    def _retain(self) -> None:
        if self.keep_last is None and self.keep_every is None:
            return
        ctx = Ctx(self.group)
        if ctx.rank != 0:
            return
        st = resolve_store(self.store_arg, create=False)
        if not self._policy_set:
            st.set_retention(self.run, keep_last=self.keep_last, keep_every=self.keep_every)
            self._policy_set = True
        st.gc(run=self.run)

    def wait(self) -> str | None:
        """Wait for the save in flight (raising its error) and apply retention; the newest saved id."""
        self._finish_pending()
        return self.last_id

    def close(self) -> None:
        """``wait`` (call at the end of training)."""
        self.wait()

    # --- resuming -------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        """The newest committed step of the run, or None when it has none (or the store does not exist)."""
        from ucp_store.errors import CatalogError

        try:
            st = resolve_store(self.store_arg, create=False)
            versions = st.list_checkpoints(self.run)
        except (ReferenceNotFound, CatalogError):
            return None
        return max((v["step"] for v in versions), default=None)

    def load_latest(self, state_dict: dict, *, strict: bool = True, per_rank: dict | None = None,
                    mesh=None) -> int | None:
        """Load the newest committed version into ``state_dict`` in place; returns its step (None: nothing).
        ``per_rank`` and ``mesh``: as ``ucp_store.distributed.load`` takes them. With ``tier="fast"``: the newest
        version restorable from this job's nodes (``restore.newest_restorable``), from the nearest copies."""
        self._finish_pending()
        if self.tier == "fast":
            return self._load_restorable(state_dict, strict, per_rank, mesh)
        # the coordinator alone asks the catalog (one client per job); the others take its answer
        step = self._latest_step_agreed()
        if step is None:
            return None
        load(state_dict, store=self.store_arg, ref=f"{self.run}@{step}", strict=strict, group=self.group,
             progress=False, per_rank=per_rank, mesh=self.mesh if mesh is None else mesh)
        return step

    def _load_restorable(self, state_dict: dict, strict: bool, per_rank: dict | None, mesh) -> int | None:
        from ucp_store.distributed.restore import newest_restorable

        if self._latest_step_agreed() is None:
            return None
        node = self.tiered.get("node")
        pick = newest_restorable(self.store_arg, self.run, group=self.group, node=node)
        self.last_note = pick.note
        load(state_dict, store=self.store_arg, ref=pick.ref, strict=strict, group=self.group, progress=False,
             per_rank=per_rank, mesh=self.mesh if mesh is None else mesh, node=node,
             fast_tier=self.tiered.get("fast_tier"))
        return pick.step

    def _latest_step_agreed(self) -> int | None:
        """``latest_step`` asked by the coordinator alone and given to every rank (a collective)."""
        ctx = Ctx(self.group)
        return ctx.agree(self.latest_step() if ctx.rank == 0 else None, lambda everyone: everyone[0])
