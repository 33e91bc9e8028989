"""ucp_store: universal checkpoints as chunked Zarr v3 arrays with a SQL catalog.

The public names load on first use (PEP 562 ``__getattr__``): ``import ucp_store`` costs a few
milliseconds and pulls in no torch, TensorStore or zarr, so the catalog-only commands (``ucp ls``,
``show``, ``log``, ...) answer at once. ``open_store`` needs only SQLAlchemy; reading or writing tensors
loads torch and TensorStore when it starts.

zarr-python learns the store's ``bfloat16`` data type (``zarr_compat``) whenever zarr is imported after
``ucp_store`` (or at once if it was imported before), so every array the store writes opens with zarr too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from ucp_store.errors import ReferenceNotFound, UcpError
    from ucp_store.io.read import load_shard
    from ucp_store.puller import pull
    from ucp_store.registry.checkpoint import Checkpoint
    from ucp_store.store import Store, open_store
    from ucp_store.topology import Topology

__all__ = ["Store", "open_store", "Checkpoint", "Topology", "load_shard", "UcpError", "ReferenceNotFound", "pull",
           "__version__"]

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "Store": "store", "open_store": "store", "Checkpoint": "registry.checkpoint", "Topology": "topology",
    "load_shard": "io.read", "UcpError": "errors", "ReferenceNotFound": "errors",
    "UcpStorageWriter": "formats.dcp.storage", "UcpStorageReader": "formats.dcp.storage",
    "pull": "puller",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _register_bfloat16() -> None:
    from ucp_store.io.zarr_compat import register_bfloat16

    register_bfloat16()


class _AfterZarrLoader(importlib.abc.Loader):
    """zarr's own loader, then the bfloat16 registration."""

    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__spec__.loader = module.__loader__ = self._inner  # zarr sees its own loader (resources)
        self._inner.exec_module(module)
        _register_bfloat16()


class _ZarrHook(importlib.abc.MetaPathFinder):
    """Registers bfloat16 right after the first ``import zarr`` (then leaves ``sys.meta_path``)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "zarr":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _AfterZarrLoader(spec.loader)
        return spec


if "zarr" in sys.modules:
    _register_bfloat16()
elif not any(isinstance(f, _ZarrHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _ZarrHook())
