"""ucp_store: universal checkpoints as chunked Zarr v3 arrays with a SQL catalog."""

__version__ = "0.1.0"

from .zarr_compat import register_bfloat16 as _register_bfloat16

_register_bfloat16()

from .errors import UcpError  # noqa: E402
from .store import Store, open_store  # noqa: E402

__all__ = ["Store", "UcpError", "open_store", "__version__"]
