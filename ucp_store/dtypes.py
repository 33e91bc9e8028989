"""Data types: torch <-> numpy <-> zarr v3 names, bit-exact.

Every dtype maps to a zarr v3 core name, except bfloat16, float8_e4m3fn and float8_e5m2, which are the
zarr-extensions names (numpy side ``ml_dtypes``). Conversions go through same-width views, never through a cast, so
NaN payloads and signed zeros survive.

The names and item sizes come from ``dtype_table`` (torch-free, shared with the planner); this module adds
the torch and numpy sides, and checks at import that the two tables agree.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from ucp_store import dtype_table
from ucp_store.errors import DTypeError, ValidationError

__all__ = ["SUPPORTED", "zarr_name", "torch_dtype", "numpy_dtype", "itemsize", "to_numpy", "to_torch", "from_numpy_as",
           "numpy_view"]

# zarr v3 name -> (torch dtype, numpy dtype)
_TABLE: dict[str, tuple[torch.dtype, np.dtype]] = {
    "bool": (torch.bool, np.dtype(np.bool_)),
    "int8": (torch.int8, np.dtype(np.int8)),
    "int16": (torch.int16, np.dtype(np.int16)),
    "int32": (torch.int32, np.dtype(np.int32)),
    "int64": (torch.int64, np.dtype(np.int64)),
    "uint8": (torch.uint8, np.dtype(np.uint8)),
    "uint16": (torch.uint16, np.dtype(np.uint16)),
    "uint32": (torch.uint32, np.dtype(np.uint32)),
    "uint64": (torch.uint64, np.dtype(np.uint64)),
    "float16": (torch.float16, np.dtype(np.float16)),
    "bfloat16": (torch.bfloat16, np.dtype(ml_dtypes.bfloat16)),
    "float32": (torch.float32, np.dtype(np.float32)),
    "float64": (torch.float64, np.dtype(np.float64)),
    "complex64": (torch.complex64, np.dtype(np.complex64)),
    "complex128": (torch.complex128, np.dtype(np.complex128)),
    "float8_e4m3fn": (torch.float8_e4m3fn, np.dtype(ml_dtypes.float8_e4m3fn)),
    "float8_e5m2": (torch.float8_e5m2, np.dtype(ml_dtypes.float8_e5m2)),
}
_BY_TORCH = {t: name for name, (t, _) in _TABLE.items()}
_BY_NUMPY = {n: name for name, (_, n) in _TABLE.items()}
# The one table of carriers: torch dtypes numpy has no type for (bf16) or that torch does not hand to or
# take from numpy on every supported version (uint16/32/64 before torch 2.3), viewed through a signed
# integer of their width, so the bits pass untouched both ways
_VIEW_AS = {torch.bfloat16: torch.int16, torch.uint16: torch.int16, torch.uint32: torch.int32,
            torch.uint64: torch.int64, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
_NUMPY_OF = {torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
             torch.uint8: np.dtype(np.uint8)}

SUPPORTED = dtype_table.SUPPORTED
if tuple(_TABLE) != SUPPORTED or any(n.itemsize != dtype_table.ITEMSIZE[k] for k, (_, n) in _TABLE.items()):
    raise ImportError("ucp_store.dtypes and ucp_store.dtype_table disagree on the storable dtypes")


def zarr_name(dtype: torch.dtype | np.dtype | str, *, what: str = "tensor") -> str:
    """The zarr v3 data type name for a torch or numpy dtype (or a name); DTypeError if unsupported."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in _TABLE:
            return name
    elif isinstance(dtype, torch.dtype):
        if dtype in _BY_TORCH:
            return _BY_TORCH[dtype]
    else:
        np_dtype = np.dtype(dtype)
        if np_dtype.byteorder == ">":
            np_dtype = np_dtype.newbyteorder("<")
        if np_dtype in _BY_NUMPY:
            return _BY_NUMPY[np_dtype]
    raise DTypeError(f"{what}: dtype {dtype} cannot be stored bit-exactly; supported: {', '.join(SUPPORTED)}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a stored dtype name."""
    return _TABLE[zarr_name(name)][0]


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a stored dtype name (``ml_dtypes.bfloat16`` for bfloat16)."""
    return _TABLE[zarr_name(name)][1]


def itemsize(name: str) -> int:
    """Bytes per element of a stored dtype name (from ``dtype_table``)."""
    return dtype_table.ITEMSIZE[zarr_name(name)]


def to_numpy(tensor: torch.Tensor, *, what: str = "tensor") -> np.ndarray:
    """A C-contiguous numpy array with the tensor's exact bits (a view where possible)."""
    zarr_name(tensor.dtype, what=what)  # refuses a dtype the store cannot hold, naming the tensor
    if tensor.layout != torch.strided:
        raise ValidationError(f"{what}: a {tensor.layout} tensor cannot be stored; convert it with .to_dense() first")
    if tensor.device.type == "meta":
        raise ValidationError(f"{what}: a tensor on the meta device has no data to store (shape "
                              f"{list(tensor.shape)}); materialise it first")
    # a lazy conjugate or negative view (``x.conj()``) holds other bits than its values: store the values
    t = tensor.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return numpy_view(t)


# numpy dtypes torch.from_numpy takes as they are (bf16 and partial uints go through a carrier view)
_FROM_NUMPY = frozenset(n for name, (t, n) in _TABLE.items() if t not in _VIEW_AS and n.byteorder != ">")


def _c_strides(array: np.ndarray) -> tuple[int, ...]:
    strides, step = [], array.itemsize
    for n in reversed(array.shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A torch tensor with the array's exact bits (shares memory where possible)."""
    if array.ndim == 1 and array.strides[0] == array.itemsize and array.dtype in _FROM_NUMPY:
        return torch.from_numpy(array)  # dense 1-d of a dtype torch shares as it is: the checks below pass
    name = zarr_name(array.dtype)
    target = torch_dtype(name)
    array = np.require(array, requirements="C")  # ascontiguousarray would turn 0-d into 1-d
    if array.strides != _c_strides(array):
        # numpy calls a strided size-1 dim "C-contiguous"; torch would keep the odd stride, and e.g.
        # ``.view(torch.uint8)`` then fails on the returned tensor
        array = array.copy(order="C")
    return from_numpy_as(array, target)


def from_numpy_as(array: np.ndarray, target: torch.dtype) -> torch.Tensor:
    """``torch.from_numpy`` of ``array`` (any strides torch takes), seen as ``target``, a torch dtype of the
    same width (the array's own, or the stored one of raw bytes): through the carrier for the dtypes that
    need one. Shares memory."""
    view = _VIEW_AS.get(target)
    if view is None:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(_NUMPY_OF[view])).view(target)


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy, any strides) of a CPU tensor with its exact bits; bf16 as ``ml_dtypes``."""
    view = _VIEW_AS.get(tensor.dtype)
    if view is None:
        return tensor.numpy()
    return tensor.view(view).numpy().view(_TABLE[_BY_TORCH[tensor.dtype]][1])
