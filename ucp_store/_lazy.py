"""A module that imports on first attribute access, without touching ``sys.modules`` before then.

``torch = lazy_module("torch")`` at the top of a module keeps the code reading like a plain import while
the cost (torch: seconds) is paid only by the functions that use it, so the catalog-only commands never
pay it. Unlike ``importlib.util.LazyLoader`` nothing is registered in ``sys.modules`` until the real
import runs, so "is torch loaded?" (``"torch" in sys.modules``) keeps its plain meaning.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["lazy_module"]


class _LazyModule:
    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{' (loaded)' if self._module is not None else ''}>"


def lazy_module(name: str) -> Any:
    """A stand-in for ``import name`` that imports on first attribute access (absolute names only)."""
    return _LazyModule(name)
