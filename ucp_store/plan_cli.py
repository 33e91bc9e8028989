"""``ucp plan`` (moved to ``ucp_store.cli.plan``; drawing to ``ucp_store.cli.plot``): the old names stay importable."""

from __future__ import annotations

from .cli.plan import infer_layers as _infer_layers
from .cli.plan import run_plan, topology_from_args
from .cli.plot import draw_plan

__all__ = ["run_plan", "topology_from_args", "draw_plan"]

_ = _infer_layers  # the old private name, imported by tests written against this module
