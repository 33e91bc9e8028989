"""The save side of delta versions (issue 39): which tensor-states a save stores as a delta, and of what.

A save's ``delta`` (``Store.begin``/``save``, ``CheckpointWriter``, imports) is ``"auto"``, ``"off"`` or None
(the run's setting, ``Store.run_delta``; none: off). With ``auto``, a whole tensor-state that is not a
dedup hit is stored as the XOR of its bits with the same tensor-state of the *base* version (the save's
parent: the run's previous version, or ``parent=``), when all of these hold:

- the base holds the tensor-state with the same shape and dtype, in a sharded array (not 0-d) of at least
  ``config.delta_min_bytes``;
- the chain stays short: the base's depth + 1 < ``config.delta_keyframe_every`` (else this version is a
  keyframe: stored in full);
- the delta's files are smaller than ``config.delta_max_fraction`` of the full array (encoding stops as soon
  as they pass it, and the tensor is stored in full: never more than the full size).

The delta takes its base's chunk and shard grid (reads XOR chunk by chunk in one plan) and the content hash
stays the reconstructed tensor's (the hash of what ``write`` was given), so dedup and ``verify`` see values,
never encodings. The base's values are read back through the store (``Checkpoint``, itself reconstructing
a delta base), once per tensor-state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ucp_store import config
from ucp_store.catalog import models as m
from ucp_store.errors import ConfigurationError, UcpError
from ucp_store.io import delta as dl
from ucp_store.io import deltaio
from ucp_store.io import format as fmt
from ucp_store.records import TensorInfo
from ucp_store.registry.context import StoreContext

__all__ = ["DELTA_MODES", "check_mode", "DeltaChoice", "DeltaPlanner"]

DELTA_MODES = ("auto", "off")


def check_mode(mode: Any, where: str = "delta") -> str | None:
    """``mode`` if it is ``"auto"``, ``"off"`` or None, else a ConfigurationError naming ``where``."""
    if mode is not None and mode not in DELTA_MODES:
        raise ConfigurationError(f"{where}={mode!r}: expected 'auto', 'off' or None (the run's setting)")
    return mode


@dataclass
class DeltaChoice:
    """A delta to write: its layout, encoded files and base."""

    layout: fmt.ArrayLayout
    encoded: deltaio.EncodedDelta
    base: TensorInfo
    #: the tensor's values as ``write`` was given them (kept to write it in full if the base is swept)
    values: np.ndarray


class DeltaPlanner:
    """Per save: whether deltas are on, the base version's rows, and :meth:`choose` per tensor-state."""

    def __init__(self, ctx: StoreContext, checkpoint_id: str, mode: str | None):
        self.ctx = ctx
        self.id = checkpoint_id
        self.mode = check_mode(mode)
        self._base_infos: dict[tuple[str, str], TensorInfo] | None = None
        self._base_ck: Any = None
        self.kept = 0  # tensor-states stored as deltas by this save
        self.full = 0  # tensor-states that could have been deltas but were stored in full

    def _resolve(self) -> None:
        """The mode (the run's when None) and the base version, read once from the catalog."""
        if self._base_infos is not None:
            return
        self._base_infos = {}
        if self.ctx.detached:
            self.mode = "off"
            return
        with self.ctx.catalog.session() as s:
            ck = s.get(m.Checkpoint, self.id)
            if ck is None:
                self.mode = "off"
                return
            if self.mode is None:
                self.mode = ck.run.delta or "off"
            parent = ck.parent_id
            if parent is not None and s.scalar(select_status(parent)) != "committed":
                parent = None
        if self.mode != "auto" or parent is None:
            return
        from ucp_store.registry.checkpoint import Checkpoint

        self._base_ck = Checkpoint(self.ctx, parent)
        self._base_infos = {(i.name, i.state): i for i in self._base_ck.tensors()}

    @property
    def active(self) -> bool:
        self._resolve()
        return self.mode == "auto" and bool(self._base_infos)

    def choose(self, key: tuple[str, str] | None, array: np.ndarray, dtype: str,
               source: np.ndarray | None = None) -> DeltaChoice | None:
        """The delta to store for tensor-state ``key`` holding ``array`` (the writer's snapshot), or None: store
        it in full (no base, a keyframe is due, or the delta is not small enough). ``source``: the caller's
        array the snapshot was taken from (kept in the choice; default ``array``)."""
        source = array if source is None else source
        if key is None or not self.active:
            return None
        assert self._base_infos is not None
        base = self._base_infos.get(key)
        settings = config.current()
        if (base is None or base.dtype != dtype or tuple(base.shape) != tuple(array.shape) or not base.shape
                or base.nbytes < settings.delta_min_bytes or 0 in base.shape):
            return None
        if base.depth + 1 >= settings.delta_keyframe_every:
            self.full += 1
            return None  # a keyframe: the chain would pass its bound
        base_layout = fmt.ArrayLayout.from_catalog(base.dtype, base.shape, base.chunk_shape, base.shard_shape,
                                                   base.codecs)
        if not base_layout.sharded:
            return None
        try:
            values = self._base_ck.tensor(*key).read_numpy()
        except (UcpError, ValueError):  # the base went (a concurrent rm/gc) or is damaged: never chain onto it
            self.full += 1
            return None
        layout = deltaio.delta_layout(base_layout, settings.delta_codec)
        limit = int(settings.delta_max_fraction * base_layout.nbytes)
        encoded = deltaio.encode_delta(layout, dl.xor(np.ascontiguousarray(array), values), limit)
        if encoded is None:
            self.full += 1
            return None
        self.kept += 1
        return DeltaChoice(layout, encoded, base, source)


def select_status(checkpoint_id: str) -> Any:
    from sqlalchemy import select

    return select(m.Checkpoint.status).where(m.Checkpoint.id == checkpoint_id)
