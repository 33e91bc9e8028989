"""An allow-list loader for foreign torch files (DeepSpeed checkpoints), built on torch's own
``weights_only`` unpickler.

DeepSpeed's optimizer files are not weights-only: they pickle a few DeepSpeed objects
(``LossScaler`` / ``DynamicLossScaler``, ``ZeroStageEnum``, the ``fragment_address`` record,
``SubparamShape`` in universal folders), and Megatron-DeepSpeed model files pickle an
``argparse.Namespace`` and numpy RNG state. A loader that falls back to ``weights_only=False``
executes whatever a crafted file asks for. Here every such global is mapped, by its exact
``module.qualname`` path, to an inert stand-in defined in this module (plain data holders: no
methods run on load, DeepSpeed need not be installed and is never imported), registered through
``torch.serialization.safe_globals`` for the duration of one ``torch.load(..., weights_only=True)``.
Anything else is refused with :class:`ucp_store.errors.UnsafePickleError` naming the file and the global.

``load(path)`` is the one entry point; ``mmap=True`` (the default) maps the file so tensors are read
lazily, page by page, when touched. ``to_jsonable`` turns what was loaded (stand-ins included) into
JSON-serialisable values; ``from_jsonable`` undoes the encoding for exporters.
"""

from __future__ import annotations

import argparse
import enum
import math
import os
import threading
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from ucp_store import inputs
from ucp_store.errors import SourceFormatError, UnsafePickleError

__all__ = [
    "load", "scan_globals", "allowed_globals", "allow", "to_jsonable", "from_jsonable",
    "FragmentAddress", "ZeroStageEnum", "LossScalerStandIn", "DynamicLossScalerStandIn", "SubparamShape",
    "NamespaceStandIn", "StandIn", "load_dcp_metadata", "dcp_allowed_globals", "DcpRecord",
]


# ------------------------------------------------------------------------------------------ stand-ins
class StandIn:
    """Base of the inert stand-ins: keeps constructor arguments and pickled state, runs nothing."""

    __ucp_path__ = ""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.__dict__["_args"] = list(args)
        return obj

    def __init__(self, *args, **kwargs):  # REDUCE calls cls(*args); keep them, do nothing else
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (state[1] is None or isinstance(state[1], dict)):
            state, slots = state
            if slots:
                self.__dict__.update(slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif state is not None:
            self.__dict__["_state"] = state

    def state(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not (k == "_args" and not v)}

    def __repr__(self) -> str:
        return f"<stand-in {self.__ucp_path__} {self.state()!r}>"

    def __eq__(self, other):
        return type(self) is type(other) and self.state() == other.state()

    __hash__ = object.__hash__


class LossScalerStandIn(StandIn):
    """``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (static scale): ``cur_scale``, ``dynamic``."""

    __ucp_path__ = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScalerStandIn(StandIn):
    """``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``: ``cur_scale``, ``cur_iter``, ..."""

    __ucp_path__ = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class NamespaceStandIn(StandIn):
    """``argparse.Namespace`` (Megatron ``args``): attributes only."""

    __ucp_path__ = "argparse.Namespace"


class ZeroStageEnum(int, enum.Enum):
    """Same values as ``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


@dataclass
class FragmentAddress:
    """``deepspeed.utils.tensor_fragment.fragment_address``: ``numel`` elements from ``start``."""

    numel: int = 0
    start: int = 0

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.numel = int(state.get("numel", 0))
            self.start = int(state.get("start", 0))


@dataclass
class SubparamShape:
    """``deepspeed.checkpoint.universal_checkpoint.SubparamShape``."""

    patterns: list = field(default_factory=list)
    shape: tuple = ()
    partition_dim: int = 0

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.patterns = state.get("patterns", [])
            self.shape = state.get("shape", ())
            self.partition_dim = state.get("partition_dim", 0)


def _fragment_address_new(*args):
    # old DeepSpeed pickled fragment_address as a namedtuple: REDUCE(cls, (numel, start))
    return FragmentAddress(*args)


_ALLOW: dict[str, Any] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerStandIn,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScalerStandIn,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "deepspeed.checkpoint.universal_checkpoint.SubparamShape": SubparamShape,
    "deepspeed.checkpoint.constants.SubparamShape": SubparamShape,
    "argparse.Namespace": NamespaceStandIn,
}


def _numpy_globals() -> dict[str, Any]:
    """numpy arrays/scalars (Megatron's ``np.random.get_state()`` RNG state). Rebuilding an ndarray
    from its bytes runs no user code."""
    out: dict[str, Any] = {}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return out
    try:
        from numpy._core import multiarray as ma  # numpy >= 2
    except ImportError:  # pragma: no cover
        from numpy.core import multiarray as ma  # type: ignore[no-redef]
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[f"{mod}._reconstruct"] = ma._reconstruct
        out[f"{mod}.scalar"] = ma.scalar
    out["numpy.ndarray"] = np.ndarray
    out["numpy.dtype"] = np.dtype
    for name in dir(getattr(np, "dtypes", object)):
        if name.endswith("DType"):
            out[f"numpy.dtypes.{name}"] = getattr(np.dtypes, name)
    return out


_ALLOW.update(_numpy_globals())
_LOCK = threading.Lock()


def allowed_globals() -> dict[str, Any]:
    """The allow-list (``module.qualname`` -> stand-in) on top of torch's weights-only defaults."""
    return dict(_ALLOW)


def allow(path: str, stand_in: type | None = None) -> type:
    """Allow one more global, mapped to an inert stand-in (a new :class:`StandIn` subclass by default).

    For client classes in foreign files (e.g. a Megatron enum inside ``args``); the stand-in records the
    arguments and state it is given and never runs the real class."""
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"expected 'module.QualName', got {path!r}")
    if stand_in is None:
        stand_in = type(path.rsplit(".", 1)[1], (StandIn,), {"__ucp_path__": path})
    _ALLOW[path] = stand_in
    return stand_in


# ------------------------------------------------------------------------------------------- loading
def _torch_default_globals() -> set[str]:
    try:
        from torch import _weights_only_unpickler as wou

        return set(wou._get_allowed_globals().keys())
    except Exception:  # pragma: no cover - private API moved
        return set()


def _read_pickle_bytes(path: str) -> bytes:
    inputs.check_regular(path, "torch file")
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not names:
                raise SourceFormatError(f"{path}: a zip file without data.pkl; expected a file written by torch.save")
            return zf.read(names[0])
    except zipfile.BadZipFile as exc:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        raise SourceFormatError(
            f"{path}: not a readable torch.save zip archive ({exc}; {size} bytes): the file is truncated or "
            "corrupt, or was written by torch < 1.6 (legacy format, unsupported)") from None


def scan_globals(path: str) -> list[str]:
    """Every global the pickle in ``path`` names (static disassembly, no unpickling)."""
    import io

    from torch import _weights_only_unpickler as wou

    data = _read_pickle_bytes(path)
    try:
        return sorted(wou.get_globals_in_pkl(io.BytesIO(data)))
    except Exception as exc:
        raise SourceFormatError(f"{path}: its pickle stream cannot be disassembled ({exc}); the file is corrupt") \
            from None


def _unsafe(path: str) -> list[str]:
    ok = _torch_default_globals() | set(_ALLOW)
    return [g for g in scan_globals(path) if g not in ok]


def load(path: str | os.PathLike, *, mmap: bool = True, what: str | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` with the DeepSpeed stand-ins allowed; CPU tensors.

    Raises :class:`UnsafePickleError` (naming the file and global) for anything outside the allow-list,
    :class:`SourceFormatError` for a missing, truncated or non-torch file. Never unpickles unsafely."""
    path = os.fspath(path)
    label = what or "file"
    if not inputs.present(path, label):
        raise SourceFormatError(f"{path}: {label} is missing")
    bad = _unsafe(path)
    if bad:
        raise UnsafePickleError(
            f"{path}: refusing to unpickle global(s) {', '.join(bad)}: not in the allow-list of "
            f"ucp_store.safe_pickle (torch weights-only types + {len(_ALLOW)} DeepSpeed/numpy stand-ins); "
            "the file may be crafted to run code. If it is trusted and the class is plain data, register a "
            "stand-in with ucp_store.safe_pickle.allow('module.Name')")
    pairs: list[Any] = [(obj, name) for name, obj in _ALLOW.items()]
    try:
        with _LOCK, torch.serialization.safe_globals(pairs):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except UnsafePickleError:
        raise
    except __import__("pickle").UnpicklingError as exc:
        raise UnsafePickleError(f"{path}: the weights-only unpickler refused it: {exc}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SourceFormatError(f"{path}: cannot read {label} ({msg}); the file is truncated or corrupt") from None


# ------------------------------------------------------------------------------ JSON (non-tensor) state
SMALL_TENSOR = 4096


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def to_jsonable(obj: Any, *, notes: list[str] | None = None, where: str = "", small_tensor: int = SMALL_TENSOR,
                keep_tensors: Callable[[str, torch.Tensor], bool] | None = None) -> Any:
    """A JSON-serialisable encoding of pickled non-tensor state (never pickle).

    Plain dicts (string keys), lists, str, int, float (nan/inf kept), bool and None stay as they are.
    Anything JSON cannot say is tagged so that :func:`from_jsonable` can restore it:
    ``{"__tuple__": [...]}``, ``{"__dict__": [[key, value], ...]}`` (non-string keys), ``{"__size__": [...]}``
    (torch.Size), ``{"__dtype__": "bfloat16"}``, ``{"__enum__": path, "value": v}``, ``{"__object__": path,
    "state": {...}}`` (stand-ins, Namespace), ``{"__tensor__": {"dtype", "shape", "data"}}`` for tensors of at
    most ``small_tensor`` elements; bigger tensors become ``{"__skipped_tensor__": {"dtype", "shape"}}`` and a
    note is appended to ``notes``."""
    def enc(o, w):
        if o is None or isinstance(o, (bool, str)):
            return o
        if isinstance(o, enum.Enum):
            path = _ALLOW_PATH.get(type(o), f"{type(o).__module__}.{type(o).__qualname__}")
            return {"__enum__": path, "value": enc(o.value, w)}
        if isinstance(o, int):
            return int(o)
        if isinstance(o, float):
            return float(o)
        if isinstance(o, torch.Size):
            return {"__size__": [int(x) for x in o]}
        if isinstance(o, torch.dtype):
            return {"__dtype__": _dtype_name(o)}
        if isinstance(o, torch.Tensor):
            if o.numel() <= small_tensor:
                t = o.detach().cpu()
                data = t.float().tolist() if t.dtype in (torch.bfloat16, torch.float16) else t.tolist()
                return {"__tensor__": {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "data": data}}
            if notes is not None:
                notes.append(f"{w or '<root>'}: tensor {tuple(o.shape)} {_dtype_name(o.dtype)} not kept as JSON "
                             f"(more than {small_tensor} elements)")
            return {"__skipped_tensor__": {"dtype": _dtype_name(o.dtype), "shape": list(o.shape)}}
        if isinstance(o, dict):
            if all(isinstance(k, str) for k in o.keys()) and not any(k.startswith("__") and k.endswith("__")
                                                                       for k in o.keys()):
                return {k: enc(v, f"{w}.{k}" if w else k) for k, v in o.items()}
            return {"__dict__": [[enc(k, w), enc(v, f"{w}[{k!r}]")] for k, v in o.items()]}
        if isinstance(o, tuple):
            return {"__tuple__": [enc(v, f"{w}[{i}]") for i, v in enumerate(o)]}
        if isinstance(o, (list, set, frozenset)):
            items = list(o) if isinstance(o, list) else sorted(o, key=repr)
            return [enc(v, f"{w}[{i}]") for i, v in enumerate(items)]
        if isinstance(o, FragmentAddress):
            return {"__object__": "deepspeed.utils.tensor_fragment.fragment_address",
                    "state": {"numel": o.numel, "start": o.start}}
        if isinstance(o, SubparamShape):
            return {"__object__": "deepspeed.checkpoint.universal_checkpoint.SubparamShape",
                    "state": {"patterns": enc(list(o.patterns), w), "shape": enc(tuple(o.shape), w),
                              "partition_dim": int(o.partition_dim)}}
        if isinstance(o, StandIn):
            return {"__object__": o.__ucp_path__, "state": enc(o.state(), w)}
        if isinstance(o, argparse.Namespace):
            return {"__object__": "argparse.Namespace", "state": enc(vars(o), w)}
        try:
            import numpy as np

            if isinstance(o, np.ndarray):
                return enc(torch.from_numpy(np.ascontiguousarray(o)), w)
            if isinstance(o, np.generic):
                return enc(o.item(), w)
        except ImportError:  # pragma: no cover
            pass
        if notes is not None:
            notes.append(f"{w or '<root>'}: {type(o).__module__}.{type(o).__qualname__} kept as its repr")
        return {"__repr__": repr(o)[:2000]}

    return enc(obj, where)


_ALLOW_PATH = {ZeroStageEnum: "deepspeed.runtime.zero.config.ZeroStageEnum"}


_DTYPES = {_dtype_name(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                        torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def from_jsonable(obj: Any, *, objects: Callable[[str, Any], Any] | None = None) -> Any:
    """Undo :func:`to_jsonable` with plain Python/torch types only (so ``torch.save`` output stays
    weights-only loadable): tuples, non-string-keyed dicts, ``torch.Size``, dtypes and small tensors come
    back; enums become their value; objects become ``objects(path, state)`` (default: the state dict)."""
    def dec(o):
        if isinstance(o, list):
            return [dec(v) for v in o]
        if not isinstance(o, dict):
            return o
        if len(o) == 1:
            (k, v), = o.items()
            if k == "__tuple__":
                return tuple(dec(x) for x in v)
            if k == "__dict__":
                return {_hashable(dec(a)): dec(b) for a, b in v}
            if k == "__size__":
                return torch.Size(v)
            if k == "__dtype__":
                return _DTYPES.get(v, v)
            if k == "__tensor__":
                dt = _DTYPES.get(v["dtype"], torch.float32)
                return torch.tensor(v["data"], dtype=dt).reshape(v["shape"]) if v["shape"] else \
                    torch.tensor(v["data"], dtype=dt)
            if k == "__skipped_tensor__":
                return None
            if k == "__repr__":
                return v
        if set(o) == {"__enum__", "value"}:
            return dec(o["value"])
        if set(o) == {"__object__", "state"}:
            st = dec(o["state"])
            return objects(o["__object__"], st) if objects else st
        return {k: dec(v) for k, v in o.items()}

    return dec(obj)


def _hashable(v):
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    return v


def is_finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def iter_tensors(obj: Any, prefix: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor nested in dicts/lists/tuples."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}[{i}]")



# ------------------------------------------------------------------------ DCP ``.metadata`` (plain pickle)
class DcpRecord:
    """Base of the inert stand-ins for DCP's metadata dataclasses: fields only, no DCP code runs.

    Unpickling builds them with ``__new__`` plus ``__setstate__`` (a dict of fields), or calls them with the
    fields in order; either way they only store values. They mirror the attribute names of
    ``torch.distributed.checkpoint.metadata`` so code reading a ``Metadata`` works on them unchanged, and
    reading a folder never imports ``torch.distributed.checkpoint`` (whose import pulls in DTensor)."""

    _fields: tuple = ()
    _defaults: dict = {}

    def __init__(self, *args, **kwargs):
        for f in self._fields:
            v = self._defaults.get(f)
            object.__setattr__(self, f, list(v) if isinstance(v, list) else v)
        for f, v in zip(self._fields, args):
            object.__setattr__(self, f, v)
        for k, v in kwargs.items():
            object.__setattr__(self, k, v)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state, slots = state
            state = {**(state or {}), **(slots or {})}
        if not isinstance(state, dict):
            raise SourceFormatError(f"DCP metadata: {type(self).__name__} has state {type(state).__name__}, "
                                    "expected a dict of fields")
        for f in self._fields:
            if f not in self.__dict__:
                v = self._defaults.get(f)
                object.__setattr__(self, f, list(v) if isinstance(v, list) else v)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f, None)!r}' for f in self._fields)})"

    def __eq__(self, other):
        return type(self) is type(other) and all(getattr(self, f, None) == getattr(other, f, None)
                                                 for f in self._fields)

    # no __hash__: defining __eq__ alone sets it to None, so records are unhashable (MetadataIndex adds its own)

    if TYPE_CHECKING:  # fields are set per record type from ``_fields``; to the type checker, any attribute
        def __getattr__(self, name: str) -> Any: ...


def _record(name: str, fields: str, defaults: dict | None = None, **extra) -> type[DcpRecord]:
    return type(name, (DcpRecord,), {"_fields": tuple(fields.split()), "_defaults": defaults or {}, **extra})


class DcpMemFormat(enum.Enum):
    """``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING`` (same values)."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


def _tensor_properties_setstate(self, state):
    # TensorProperties pickles (dtype, layout, requires_grad, memory-format enum, pin_memory)
    if isinstance(state, tuple) and len(state) == 5:
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
    else:
        DcpRecord.__setstate__(self, state)


def _index_hash(self):
    return hash((self.fqn, getattr(self, "offset", None)))


def _index_eq(self, other):
    return (type(self) is type(other) and self.fqn == other.fqn
            and getattr(self, "offset", None) == getattr(other, "offset", None))


DcpMetadata = _record("Metadata", "state_dict_metadata planner_data storage_data storage_meta version")
DcpTensorStorageMetadata = _record("TensorStorageMetadata", "properties size chunks")
DcpBytesStorageMetadata = _record("BytesStorageMetadata", "")
DcpChunkStorageMetadata = _record("ChunkStorageMetadata", "offsets sizes")
DcpTensorProperties = _record("TensorProperties", "dtype layout requires_grad memory_format pin_memory",
                              __setstate__=_tensor_properties_setstate)
DcpMetadataIndex = _record("MetadataIndex", "fqn offset index", __hash__=_index_hash, __eq__=_index_eq)
DcpStorageMeta = _record("StorageMeta", "checkpoint_id save_id load_id modules", {"modules": []})
DcpStorageInfo = _record("_StorageInfo", "relative_path offset length transform_descriptors")
DcpHFStorageInfo = _record("_HFStorageInfo", "relative_path shape dtype")

_DCP = "torch.distributed.checkpoint"
_DCP_STAND_INS: dict[str, Any] = {
    f"{_DCP}.metadata.Metadata": DcpMetadata,
    f"{_DCP}.metadata.TensorStorageMetadata": DcpTensorStorageMetadata,
    f"{_DCP}.metadata.BytesStorageMetadata": DcpBytesStorageMetadata,
    f"{_DCP}.metadata.ChunkStorageMetadata": DcpChunkStorageMetadata,
    f"{_DCP}.metadata.TensorProperties": DcpTensorProperties,
    f"{_DCP}.metadata.MetadataIndex": DcpMetadataIndex,
    f"{_DCP}.metadata.StorageMeta": DcpStorageMeta,
    f"{_DCP}.metadata._MEM_FORMAT_ENCODING": DcpMemFormat,
    f"{_DCP}.filesystem._StorageInfo": DcpStorageInfo,
    f"{_DCP}._hf_utils._HFStorageInfo": DcpHFStorageInfo,
    # torch <= 2.1 kept TensorProperties beside ShardedTensor
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties": DcpTensorProperties,
    "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING": DcpMemFormat,
}


def _dcp_allow() -> dict[str, Any]:
    """DCP's metadata dataclasses (as the inert stand-ins above) and the torch types they hold, by exact
    ``module.qualname``. Paths become pure paths (no filesystem access); dtypes and layouts are torch's."""
    import collections
    import pathlib

    out: dict[str, Any] = dict(_DCP_STAND_INS)
    out["torch.Size"] = torch.Size
    out["torch.serialization._get_layout"] = torch.serialization._get_layout
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout)):
            out[f"torch.{name}"] = obj
    out["pathlib.PosixPath"] = out["pathlib.PurePosixPath"] = pathlib.PurePosixPath
    out["pathlib.WindowsPath"] = out["pathlib.PureWindowsPath"] = pathlib.PureWindowsPath
    out["collections.OrderedDict"] = collections.OrderedDict
    return out


def dcp_allowed_globals() -> dict[str, Any]:
    """The allow-list :func:`load_dcp_metadata` uses (``module.qualname`` -> object)."""
    return _dcp_allow()


def load_dcp_metadata(path: str | os.PathLike) -> Any:
    """Read a DCP ``.metadata`` pickle with an allow-list unpickler; returns the ``Metadata`` object.

    Every global the pickle names is resolved through :func:`dcp_allowed_globals` only (``find_class``
    never imports anything): a crafted file naming anything else (``os.system``, ``builtins.eval``, ...)
    raises :class:`UnsafePickleError` naming the file and the global, before any of its reduces can run,
    because the whole stream is disassembled first. A truncated or non-pickle file is a
    :class:`SourceFormatError`."""
    import io
    import pickle
    import pickletools

    path = os.fspath(path)
    if not inputs.present(path, "DCP metadata file"):
        raise SourceFormatError(f"{path}: DCP metadata file is missing")
    data = inputs.read_regular(path, "DCP metadata file")
    allow = _dcp_allow()
    # static pass first: every global named anywhere in the stream must be allowed, so nothing runs
    bad: list[str] = []
    try:
        recent: list[Any] = []  # what the last opcodes pushed (strings, or None), to resolve STACK_GLOBAL
        memo: dict[int, Any] = {}
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("GLOBAL", "INST"):
                mod, _, qual = str(arg).partition(" ")
                if f"{mod}.{qual}" not in allow:
                    bad.append(f"{mod}.{qual}")
                recent.append(None)
            elif name == "STACK_GLOBAL":
                mod_arg, qual_arg = recent[-2:] if len(recent) >= 2 else (None, None)
                g = (f"{mod_arg}.{qual_arg}" if isinstance(mod_arg, str) and isinstance(qual_arg, str)
                     else "<computed global>")
                if g not in allow:
                    bad.append(g)
                recent.append(None)
            elif name in ("EXT1", "EXT2", "EXT4"):
                bad.append(f"<copyreg extension {arg}>")
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[cast(int, arg)] = recent[-1] if recent else None  # pickletools decodes it as an int
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(cast(int, arg)))
            elif name in ("FRAME", "PROTO", "MARK", "STOP"):
                pass
            else:
                recent.append(arg if isinstance(arg, str) else None)
            del recent[:-4]
    except Exception as exc:  # noqa: BLE001 - any disassembly failure means a corrupt file
        raise SourceFormatError(f"{path}: DCP metadata is not a readable pickle ({exc}); the file is truncated "
                                "or corrupt") from None
    if bad:
        raise UnsafePickleError(
            f"{path}: refusing to unpickle DCP metadata naming global(s) {', '.join(sorted(set(bad)))}: not in the "
            "allow-list of DCP's own metadata dataclasses and torch types (ucp_store.safe_pickle."
            "dcp_allowed_globals); the file may be crafted to run code")

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module, name):  # the dynamic check: a memo trick cannot reach another global
            g = f"{module}.{name}"
            if g not in allow:
                raise UnsafePickleError(f"{path}: refusing to unpickle DCP metadata global {g}: not in the "
                                        "allow-list (ucp_store.safe_pickle.dcp_allowed_globals)")
            return allow[g]

        def persistent_load(self, pid):
            raise UnsafePickleError(f"{path}: DCP metadata uses persistent ids; refusing it")

    try:
        return _Unpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a corrupt stream raises
        raise SourceFormatError(f"{path}: DCP metadata cannot be unpickled ({type(exc).__name__}: {exc}); the file "
                                "is truncated or corrupt") from None
