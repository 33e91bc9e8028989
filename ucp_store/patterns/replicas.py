"""Averaged replicas: the mean the store keeps for an ``averaged`` tensor and how far replicas drifted from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ucp_store.errors import PatternError

__all__ = ["average_replicas"]


def average_replicas(replicas: Sequence[Any]) -> tuple[Any, float]:
    """Mean of drifted replicas and the largest absolute deviation of any replica from it.

    Works on numpy arrays and torch tensors (computed in float64, returned in the replicas' dtype);
    ``max_deviation`` is measured against the returned (rounded) mean, i.e. the error a rank loading
    the averaged tensor sees relative to its own replica."""
    if not replicas:
        raise PatternError("average_replicas needs at least one replica")
    first = replicas[0]
    shapes = {tuple(r.shape) for r in replicas}
    if len(shapes) != 1:
        raise PatternError(f"replicas to average have different shapes {sorted(shapes)}")
    if hasattr(first, "double") and hasattr(first, "to"):  # torch
        wide = [r.double() for r in replicas]
        mean = (sum(wide[1:], wide[0].clone()) / len(wide)).to(first.dtype)
        mean_wide = mean.double()
        dev = max(float((w - mean_wide).abs().max()) if w.numel() else 0.0 for w in wide)
        return mean, dev
    import numpy as np

    arrays = [np.asarray(r) for r in replicas]
    wide = [a.astype(np.float64) for a in arrays]
    mean = (sum(wide[1:], wide[0].copy()) / len(wide)).astype(arrays[0].dtype)
    mean_wide = mean.astype(np.float64)
    dev = max(float(np.abs(w - mean_wide).max()) if w.size else 0.0 for w in wide)
    return mean, dev
