"""Data types: torch <-> numpy <-> zarr v3 names, bit-exact.

Every dtype maps to a zarr v3 core name, except bfloat16, which is the zarr-extensions ``bfloat16``
(numpy side ``ml_dtypes.bfloat16``). Conversions go through same-width views, never through a cast, so
NaN payloads and signed zeros survive.

The names and item sizes come from ``dtype_table`` (torch-free, shared with the planner); this module adds
the torch and numpy sides, and checks at import that the two tables agree.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from . import dtype_table
from .errors import DTypeError, ValidationError

__all__ = ["SUPPORTED", "zarr_name", "torch_dtype", "numpy_dtype", "itemsize", "to_numpy", "to_torch"]

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
}
_BY_TORCH = {t: name for name, (t, _) in _TABLE.items()}
_BY_NUMPY = {n: name for name, (_, n) in _TABLE.items()}
# torch views used to hand tensors to numpy without a cast (numpy has no bf16; some uints are partial)
_VIEW_AS = {torch.bfloat16: torch.int16, torch.uint16: torch.int16, torch.uint32: torch.int32,
            torch.uint64: torch.int64}

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
    name = zarr_name(tensor.dtype, what=what)
    if tensor.layout != torch.strided:
        raise ValidationError(f"{what}: a {tensor.layout} tensor cannot be stored; convert it with .to_dense() first")
    if tensor.device.type == "meta":
        raise ValidationError(f"{what}: a tensor on the meta device has no data to store (shape "
                              f"{list(tensor.shape)}); materialise it first")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    view = _VIEW_AS.get(t.dtype)
    if view is not None:
        return t.view(view).numpy().view(numpy_dtype(name))
    return t.numpy()


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
    view = _VIEW_AS.get(target)
    if view is not None:
        carrier = {torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}[view]
        return torch.from_numpy(array.view(carrier)).view(target)
    return torch.from_numpy(array)
