"""PyTorch Distributed Checkpoint (DCP) folders in and out: ``ucp import dcp`` / ``ucp export dcp``.

A DCP folder (what ``torch.distributed.checkpoint.save`` and torchtitan-style jobs leave) is a pickled
``.metadata`` plus ``__<rank>_<n>.distcp`` data files. The metadata lists, per flattened key, either a
tensor (logical size, dtype, and the boxes -- "chunks" -- that ranks saved) or a ``BytesStorageMetadata``
(a ``torch.save`` blob of a non-tensor value), and where each chunk or blob sits (file, offset, length).

Import (:class:`DcpSource`, on the adapter interface of :mod:`ucp_store.formats.base`):

* ``.metadata`` is read through :func:`ucp_store.safe_pickle.load_dcp_metadata` (an allow-list of DCP's
  own dataclasses and torch types only): a file naming any other global is refused before anything runs.
* Each tensor key becomes one logical tensor-state. Its saved chunks (any number of ranks, any boxes) are
  read and placed into a logical tensor assembled in host memory, which ``CheckpointWriter.write`` then
  stores. We assemble rather than write boxes one by one because ``write`` hashes the whole content
  first: an unchanged tensor is deduplicated before any byte is written, and a box-by-box write would
  have to read the array back to hash it (``finish_shards`` does exactly that), doubling the I/O. Peak
  memory is the largest tensor plus the writer's in-flight bytes; a key saved as one whole chunk is used
  as read, without a copy.
* Both serializations: per-chunk ``torch.save`` archives (read with ``torch.load(weights_only=True)``;
  stream transforms such as zstd go through DCP's own extension registry), and
  ``SerializationFormat.SAFETENSORS``, where a rank file ends in one safetensors blob whose header we parse
  ourselves and whose data we map without copying.
* Keys map to (name, state): the nested layout (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``) and the
  flat layout torchtitan writes (model FQNs unprefixed, ``optimizer.state.<fqn>.exp_avg``,
  ``optimizer.param_groups.<fqn>.lr``). Model tensors are state ``weight``; optimizer tensors keep their
  state name (``exp_avg``, ``exp_avg_sq``, ``step``). Other tensors (RNG state, counters) become array
  objects under their key.
* Non-tensor entries are decoded with torch's weights-only unpickler when they hold plain values and
  stored as JSON objects named by their key (tuples, non-string keys and small tensors tagged as in
  :func:`ucp_store.safe_pickle.to_jsonable`). A blob that needs any other global, or would not survive
  JSON exactly, stays opaque: its bytes are stored as a ``uint8`` array object, never unpickled, listed as
  opaque in ``ucp show``, and written back byte-identical on export.
* Per-rank entries (a non-tensor-state key that names a rank, torchtitan's ``dataloader.dp_rank_<i>``, or
  matches ``per_rank`` patterns) are kept under their keys and recorded with their saving rank and the
  saving topology in the version's per-rank record (:mod:`.dcp_perrank`, :mod:`ucp_store.catalog.rank_record`).
* The object ``_dcp`` records the key layout (key -> tensor-state, value or opaque blob, and DCP's
  ``planner_data`` nesting), so an export rebuilds exactly the keys and nesting the job saved.

Export (:func:`export_dcp`) uses DCP's own ``FileSystemWriter`` with a ``DefaultSavePlanner`` subclass
that reads each tensor from the store only when DCP asks for it (memory: one tensor at a time) and hands
opaque blobs back as the original bytes. It writes into a temporary folder beside the destination and
renames it at the end, so a crash never leaves a folder that ``dcp.load`` would accept.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import json
import math
import mmap
import os
import shutil
import struct
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
import torch

from ucp_store import inputs, typed_json
from ucp_store._killpoints import killpoint
from ucp_store.errors import SourceFormatError, UcpError, UnsafePickleError
from ucp_store.formats.base import TensorRecord, destination, import_source
from ucp_store.io import space
from ucp_store.records import model_order
from ucp_store.save.writer import MAX_ELEMENTS

__all__ = ["INDEX_OBJECT", "DcpSource", "export_dcp", "import_dcp", "opaque_entries", "read_dcp_metadata",
           "tiling_problem"]

#: name of the object that records the DCP key layout of an imported checkpoint
from ucp_store.formats.dcp.index import INDEX_OBJECT, opaque_entries, path_of, read_index

_METADATA = ".metadata"
_MODEL_STATE = "weight"
_OPTIM_PREFIXES = ("optim", "optimizer", "optimizers", "opt", "optimizer_state")
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


# ------------------------------------------------------------------------------------------ metadata
def read_dcp_metadata(folder: str) -> Any:
    """The ``Metadata`` of a DCP folder, read through the allow-list unpickler.

    A missing folder, a folder without ``.metadata`` (with a hint when it looks like a Hugging Face or
    DeepSpeed checkpoint), an unsafe or corrupt ``.metadata`` each raise a clear error."""
    from ucp_store.safe_pickle import load_dcp_metadata

    if not os.path.isdir(folder):
        raise SourceFormatError(f"DCP checkpoint folder {folder} does not exist (or is not a folder)")
    path = os.path.join(folder, _METADATA)
    if not inputs.present(path, "DCP metadata file"):
        entries = sorted(os.listdir(folder))
        hint = ""
        if any(e.endswith(".safetensors") or e == "model.safetensors.index.json" for e in entries):
            hint = "; it looks like a Hugging Face folder: use 'ucp import hf'"
        elif "latest" in entries or any(e.startswith("global_step") for e in entries):
            hint = "; it looks like a DeepSpeed checkpoint: use 'ucp import deepspeed'"
        elif "zero" in entries:
            hint = "; it looks like a DeepSpeed universal folder: use 'ucp import deepspeed-universal'"
        shown = ", ".join(entries[:8]) + (", ..." if len(entries) > 8 else "") or "nothing"
        raise SourceFormatError(f"{folder} is not a DCP checkpoint folder: it has no {_METADATA} file "
                                f"(expected .metadata plus __<rank>_<n>.distcp files; found {shown}){hint}")
    md = load_dcp_metadata(path)
    from ucp_store.safe_pickle import DcpMetadata

    if not isinstance(md, DcpMetadata) or not isinstance(md.state_dict_metadata, dict):
        raise SourceFormatError(f"{path}: holds a {type(md).__name__}, expected DCP's Metadata with a "
                                "state_dict_metadata dict")
    if not isinstance(md.storage_data, dict):
        raise SourceFormatError(f"{path}: DCP metadata without storage_data (written by a storage layer ucp "
                                "does not know); expected FileSystemWriter's")
    return md


@dataclass
class _Entry:
    key: str
    kind: str  # "tensor" (a tensor-state), "array" (tensor object), "value" (JSON object), "opaque"
    name: str | None = None
    state: str | None = None


def classify(md: Any, optim_prefixes: Iterable[str] | None, model_prefix: str | None) -> dict[str, _Entry]:
    """Every key -> what it becomes (tensor-state, array object, or a non-tensor value decided later)."""
    from ucp_store.safe_pickle import DcpTensorStorageMetadata as TensorStorageMetadata

    sdm = md.state_dict_metadata
    tensor_keys = [k for k, v in sdm.items() if isinstance(v, TensorStorageMetadata)]
    paths = {k: path_of(md, k) for k in sdm}
    # optimizer prefixes: a top-level component with `state.<fqn>.<state>` tensors and param_groups entries
    heads: dict[str | int, list[str]] = {}
    for k in sdm:
        p = paths[k]
        head = p[0] if len(p) > 1 else k.split(".", 1)[0]
        heads.setdefault(head, []).append(k)
    optim: list[str | int]
    if optim_prefixes is None:
        optim = []
        for head, keys in heads.items():
            has_state = any(k.startswith(f"{head}.state.") for k in keys)
            has_groups = any(k.startswith(f"{head}.param_groups") for k in keys)
            if has_state and (has_groups or head in _OPTIM_PREFIXES):
                optim.append(head)
    else:
        optim = list(optim_prefixes)
    out: dict[str, _Entry] = {}
    optim_fqns: set[str] = set()
    for k in tensor_keys:
        for head in optim:
            state_prefix = f"{head}.state."
            if k.startswith(state_prefix):
                p = paths[k]
                if len(p) == 4 and p[0] == head and p[1] == "state" and isinstance(p[2], str):
                    fqn, state = p[2], str(p[3])  # nested: the path holds the FQN whole
                else:
                    rest = k[len(state_prefix):]
                    if "." not in rest:
                        break
                    fqn, state = rest.rsplit(".", 1)
                out[k] = _Entry(k, "tensor", fqn, state)
                optim_fqns.add(fqn)
                break
    rest_keys = [k for k in tensor_keys if k not in out]
    if model_prefix is None:
        model_prefix = ""
        # an optimizer's own state_dict() keys its states by parameter number (torchtune saves it so): those
        # name no parameter, so the model prefix is found as when there is no optimizer state
        named = {f for f in optim_fqns if not f.isdigit()}
        for cand in ("model", "model_state", "module"):
            if named and any(f"{cand}.{f}" in sdm for f in named):
                model_prefix = cand
                break
            if not named and cand in heads and rest_keys and all(
                    paths[k][0] == cand and len(paths[k]) == 2 for k in rest_keys):
                model_prefix = cand
                break
    for k in rest_keys:
        if model_prefix and k.startswith(model_prefix + "."):
            out[k] = _Entry(k, "tensor", k[len(model_prefix) + 1:], _MODEL_STATE)
        elif not model_prefix and not any(k.startswith(f"{h}.") for h in optim) and len(paths[k]) == 1:
            # flat layout: model FQNs sit at the top level; a tensor nested under another top-level key
            # (train_state.step, rng states) is not a parameter and becomes an array object
            out[k] = _Entry(k, "tensor", k, _MODEL_STATE)
        else:
            out[k] = _Entry(k, "array")
    for k in sdm:
        if k not in out:
            out[k] = _Entry(k, "value")
    return out


# ------------------------------------------------------------------------------------------- reading
class _Files:
    """Memory maps of the data files, opened once each; clear errors for missing or short files."""

    def __init__(self, folder: str):
        self.folder = folder
        self._maps: dict[str, mmap.mmap | bytes] = {}
        self._st_headers: dict[tuple[str, int], tuple[dict, int]] = {}

    def view(self, rel: str, offset: int, length: int, what: str) -> memoryview:
        if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
            raise SourceFormatError(f"{self.folder}/{_METADATA}: {what} names file {rel!r} outside the folder")
        m = self._maps.get(rel)
        if m is None:
            path = os.path.join(self.folder, rel)
            if not inputs.present(path, f"data file of {what}"):
                raise SourceFormatError(f"{path}: data file of {what} is missing (named in {_METADATA})")
            with inputs.open_regular(path, f"data file of {what}") as f:
                size = os.fstat(f.fileno()).st_size
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            self._maps[rel] = m
        if offset < 0 or length < 0 or offset + length > len(m):
            raise SourceFormatError(
                f"{os.path.join(self.folder, rel)}: {what} is stored at bytes [{offset}, {offset + length}) but the "
                f"file has {len(m)} bytes: the file is truncated")
        return memoryview(m)[offset:offset + length]

    def prefetch(self, rel: str, offset: int, length: int) -> None:
        """Ask the kernel to read a range ahead (``MADV_WILLNEED``, asynchronous), so the disk reads of the
        next tensor overlap the assembly and hashing of this one instead of faulting page by page."""
        m = self._maps.get(rel)
        if not isinstance(m, mmap.mmap) or length < (1 << 20) or not hasattr(mmap, "MADV_WILLNEED"):
            return
        start = offset - offset % mmap.PAGESIZE
        end = min(len(m), offset + length)
        try:
            m.madvise(mmap.MADV_WILLNEED, start, end - start)
        except (OSError, ValueError):  # advice only
            pass

    def safetensors_header(self, rel: str, offset: int, what: str) -> tuple[dict, int]:
        key = (rel, offset)
        if key not in self._st_headers:
            m = self._maps[rel]
            path = os.path.join(self.folder, rel)
            if offset + 8 > len(m):
                raise SourceFormatError(f"{path}: safetensors blob of {what} at byte {offset} is truncated")
            (n,) = struct.unpack_from("<Q", m, offset)
            if n > 100_000_000 or offset + 8 + n > len(m):
                raise SourceFormatError(f"{path}: safetensors header of {what} at byte {offset} claims {n} bytes; "
                                        f"the file has {len(m)} (truncated or corrupt)")
            try:
                header = json.loads(bytes(m[offset + 8:offset + 8 + n]))
            except ValueError as exc:
                raise SourceFormatError(f"{path}: {what} at byte {offset} is neither a torch.save archive nor a "
                                        f"safetensors blob (header not JSON: {exc}); the file is corrupt") from None
            self._st_headers[key] = (header, offset + 8 + n)
        return self._st_headers[key]

    def close(self) -> None:
        for m in self._maps.values():
            if isinstance(m, mmap.mmap):
                try:
                    m.close()
                except BufferError:  # a tensor still views it; the map goes with the last view
                    pass
        self._maps.clear()


def _untransform(files: _Files, rel: str, off: int, length: int, descriptors, what: str) -> bytes:
    """The bytes DCP wrote before its stream transforms (e.g. zstd), through DCP's own extension registry."""
    from torch.distributed.checkpoint._extension import (
        ExtensionRegistry,
        StreamTransformExtension,
    )

    raw = io.BytesIO(bytes(files.view(rel, off, length, what)))
    try:
        stream: IO[bytes] = raw
        for ex in ExtensionRegistry().from_descriptor_list(list(descriptors)):
            if isinstance(ex, StreamTransformExtension):
                stream = ex.transform_from(stream)
        return stream.read(-1)
    except Exception as exc:  # noqa: BLE001 - an unknown extension or a corrupt compressed stream
        raise SourceFormatError(f"{os.path.join(files.folder, rel)}: {what}: stream transform "
                                f"{list(descriptors)} failed ({exc})") from None


def _is_zip(buf: memoryview) -> bool:
    return bytes(buf[:4]) == b"PK\x03\x04"


def _load_chunk(files: _Files, info: Any, fqn: str, what: str) -> torch.Tensor:
    """One saved chunk as a CPU tensor (torch.save archive or safetensors blob)."""
    descriptors = getattr(info, "transform_descriptors", None) or ()
    rel, off, length = info.relative_path, int(info.offset), int(info.length)
    if descriptors:
        blob = io.BytesIO(_untransform(files, rel, off, length, descriptors, what))
        return _torch_load(blob, files, rel, what)
    head = files.view(rel, off, min(length, 8) if length else 8, what)
    if _is_zip(head):
        view = files.view(rel, off, length, what)
        try:
            return _torch_chunk_in_place(view)
        except Exception:  # noqa: BLE001 - anything unusual: torch.load decides, with its own checks and errors
            return _torch_load(io.BytesIO(view), files, rel, what)
    # SerializationFormat.SAFETENSORS: the chunk lives in the safetensors blob that starts at `off`
    header, data_start = files.safetensors_header(rel, off, what)
    entry = header.get(fqn)
    if not isinstance(entry, dict):
        raise SourceFormatError(f"{os.path.join(files.folder, rel)}: the safetensors blob at byte {off} has no "
                                f"entry {fqn!r} for {what}")
    code = entry.get("dtype")
    dt = _ST_DTYPES.get(code) if isinstance(code, str) else None
    if dt is None:
        raise SourceFormatError(f"{os.path.join(files.folder, rel)}: {what}: safetensors dtype "
                                f"{entry.get('dtype')!r} is not supported")
    a, b = (int(x) for x in entry["data_offsets"])
    shape = [int(s) for s in entry["shape"]]
    nbytes = math.prod(shape) * torch.empty((), dtype=dt).element_size()
    if b - a != nbytes:
        raise SourceFormatError(f"{os.path.join(files.folder, rel)}: {what}: safetensors entry spans {b - a} bytes, "
                                f"its shape {shape} and dtype need {nbytes}")
    buf = files.view(rel, data_start + a, b - a, what)
    if not nbytes:
        return torch.empty(shape, dtype=dt)
    with warnings.catch_warnings():  # the map is read-only; nothing writes through this view
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dt).reshape(shape)


class _MemFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (no copy), for zipfile's directory reads."""

    def __init__(self, mv: memoryview):
        self.mv, self.pos = mv, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.mv) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self.mv) - self.pos))
        b[:n] = self.mv[self.pos:self.pos + n]
        self.pos += n
        return n


def _torch_chunk_in_place(view: memoryview) -> torch.Tensor:
    """A ``torch.save``d tensor read straight from the mapped file: torch's weights-only unpickler
    rebuilds it (the same allow-list ``torch.load(weights_only=True)`` uses) around storages that view
    the archive's stored (uncompressed) records, so the bytes are not copied on the way."""
    import zipfile

    from torch import _weights_only_unpickler as wou

    zf = zipfile.ZipFile(_MemFile(view))
    pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
    prefix = pkl[:-len("data.pkl")]
    if f"{prefix}byteorder" in zf.namelist() and zf.read(f"{prefix}byteorder") != sys_byteorder().encode():
        raise ValueError("byte order differs from this machine's")

    def load_storage(pid):
        typename, storage_type, key, _location, numel = pid
        if typename != "storage":
            raise ValueError(f"persistent id {typename!r}")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        info = zf.getinfo(f"{prefix}data/{key}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError("compressed record")
        name_len, extra_len = struct.unpack_from("<HH", view, info.header_offset + 26)
        start = info.header_offset + 30 + name_len + extra_len
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if info.file_size != nbytes or start + nbytes > len(view):
            raise ValueError("record size")
        if nbytes:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                untyped = torch.frombuffer(view[start:start + nbytes], dtype=torch.uint8).untyped_storage()
        else:
            untyped = torch.UntypedStorage(0)
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    class _Unpickler(wou.Unpickler):
        def persistent_load(self, pid):
            return load_storage(pid)

    t = _Unpickler(io.BytesIO(zf.read(pkl)), encoding="utf-8").load()
    if not isinstance(t, torch.Tensor):
        raise TypeError("not a tensor")
    return t


def sys_byteorder() -> str:
    import sys

    return sys.byteorder


def _torch_load(blob: io.BytesIO, files: _Files, rel: str, what: str) -> torch.Tensor:
    try:
        t = torch.load(blob, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a weights-only refusal or a corrupt archive
        import pickle

        cls = UnsafePickleError if isinstance(exc, pickle.UnpicklingError) else SourceFormatError
        msg = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise cls(f"{os.path.join(files.folder, rel)}: {what} cannot be read as a torch.save tensor ({msg}); the "
                  "file is truncated or corrupt") from None
    if not isinstance(t, torch.Tensor):
        raise SourceFormatError(f"{os.path.join(files.folder, rel)}: {what} holds a {type(t).__name__}, expected a "
                                "tensor")
    return t


def _decode_bytes(blob: bytes) -> tuple[bool, Any, str]:
    """(plain, JSON value or None, why opaque). Plain means: a torch.save archive that the weights-only
    unpickler accepts, whose value survives the JSON encoding exactly."""
    from ucp_store.safe_pickle import from_jsonable, to_jsonable

    if not blob.startswith(b"PK\x03\x04"):
        return False, None, "not a torch.save archive (raw bytes)"
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(blob))
    except Exception as exc:  # noqa: BLE001
        return False, None, f"its pickle cannot be disassembled ({type(exc).__name__})"
    if unsafe:
        return False, None, "needs global(s) " + ", ".join(sorted(unsafe))
    try:
        value = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        return False, None, f"refused by the weights-only unpickler ({str(exc).splitlines()[0][:120]})"
    notes: list[str] = []
    enc = to_jsonable(value, notes=notes)
    if notes:
        return False, None, "; ".join(notes)[:300]
    try:
        text = json.dumps(enc, allow_nan=True)
        back = from_jsonable(json.loads(text))
    except (TypeError, ValueError) as exc:
        return False, None, f"not JSON-encodable ({exc})"
    if not _same(back, value):
        return False, None, "does not survive the JSON encoding exactly"
    return True, enc, ""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


# ----------------------------------------------------------------------------------------- chunk tiling
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of one saved chunk


def _overlap(a: Box, b: Box) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))


def tiling_problem(size: tuple[int, ...], boxes: list[Box]) -> tuple[str, int, int, int] | None:
    """Whether ``boxes`` tile a tensor of ``size`` exactly (pure): None, or ``(kind, i, j, n)``:
    ``("outside", i, -1, 0)`` box ``i`` has the wrong rank or leaves the tensor; ``("overlap", i, j, 0)``
    boxes ``i`` and ``j`` share elements (a chunk listed twice included); ``("gap", -1, -1, n)`` ``n``
    elements lie in no box.

    Adding up the boxes' volumes alone is not enough: a duplicated chunk makes up for a missing one.
    Disjoint boxes inside the tensor whose volumes add up to its own cover it, so the check is bounds,
    then no overlap, then the volume. Overlaps are found by a sweep along the dimension with the most
    distinct offsets (boxes sorted by their start there, each compared only with the boxes still open at
    that start): O(n log n) for a split along one dimension, O(n * sqrt(n)) at worst for a grid."""
    nd = len(size)
    for i, (o, s) in enumerate(boxes):
        if len(o) != nd or len(s) != nd or any(x < 0 for x in o + s) or any(
                a + b > n for a, b, n in zip(o, s, size)):
            return ("outside", i, -1, 0)
    live = [i for i, (_, s) in enumerate(boxes) if all(s)]  # an empty box holds nothing and overlaps nothing
    if nd == 0:
        return ("overlap", live[0], live[1], 0) if len(live) > 1 else None if live else ("gap", -1, -1, 1)
    d = max(range(nd), key=lambda k: len({boxes[i][0][k] for i in live}))
    open_: list[tuple[int, int]] = []  # (end along d, box) of the boxes that may still overlap a later one
    for i in sorted(live, key=lambda i: boxes[i][0][d]):
        start = boxes[i][0][d]
        while open_ and open_[0][0] <= start:
            heapq.heappop(open_)
        for _, j in open_:
            if _overlap(boxes[i], boxes[j]):
                return ("overlap", j, i, 0)
        heapq.heappush(open_, (start + boxes[i][1][d], i))
    covered = sum(math.prod(boxes[i][1]) for i in live)
    total = math.prod(size)
    return None if covered == total else ("gap", -1, -1, total - covered)


# --------------------------------------------------------------------------------------------- source
# elements per torch copy call: below torch's grain size (32768), so one thread does each piece
_PIECE = 30 * 1024


def _place(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (same shape) in pieces small enough that torch copies each on the calling thread.

    One ``copy_`` of a saved chunk into its box of the assembled tensor is large enough for torch to split
    over an OpenMP team, and with the machine's cores busy (the store's own write threads, other jobs) the
    team waits for its slowest thread at every copy: under load that made the assembly several times
    slower than the copy itself. Pieces of whole rows (or, for rows longer than ``_PIECE``, row by row)
    keep every copy on this thread."""
    n = dst.numel()
    if n <= _PIECE or dst.dim() == 0:
        dst.copy_(src)
        return
    rows = dst.shape[0]
    per = n // rows
    if per > _PIECE:
        for i in range(rows):
            _place(dst[i], src[i])
        return
    step = max(1, _PIECE // per)
    for i in range(0, rows, step):
        dst[i:i + step].copy_(src[i:i + step])


def _chunk_name(box: Box) -> str:
    return f"chunk {list(box[0])}+{list(box[1])}"


class DcpSource:
    """A DCP checkpoint folder as a :class:`~ucp_store.formats.base.Source`.

    ``optim_prefixes`` / ``model_prefix`` override the layout detection (``None``: detect; the model
    prefix ``""`` means model FQNs at the top level)."""

    kind = "dcp"
    # records are produced (chunks read and assembled) in a background thread, a bounded window ahead of the
    # writer's hashing and submitting: the assembly of the next tensor overlaps the store's work on this one
    prefetch = True

    def __init__(self, folder: str, *, optim_prefixes: Iterable[str] | None = None, model_prefix: str | None = None,
                 per_rank: Iterable[str] | None = None):
        self.folder = os.path.abspath(folder)
        self.md = read_dcp_metadata(self.folder)
        self.entries = classify(self.md, optim_prefixes, model_prefix)
        self._storage: dict[tuple[str, tuple], Any] = {}
        self._bytes_info: dict[str, Any] = {}
        for idx, info in self.md.storage_data.items():
            fqn = getattr(idx, "fqn", None)
            if fqn is None or not hasattr(info, "relative_path"):
                raise SourceFormatError(f"{self.folder}/{_METADATA}: storage entry {idx!r} -> {info!r} is not "
                                        "FileSystemWriter's (file, offset, length)")
            off = getattr(idx, "offset", None)
            if off is None:
                self._bytes_info[fqn] = info
            else:
                self._storage[(fqn, tuple(int(x) for x in off))] = info
        seen: dict[tuple[str | None, str | None], str] = {}
        for e in self.entries.values():
            if e.kind == "tensor":
                if (e.name, e.state) in seen:
                    raise SourceFormatError(f"{self.folder}: keys {seen[(e.name, e.state)]!r} and {e.key!r} both map "
                                            f"to tensor {e.name!r} state {e.state!r}; pass model_prefix/optim_prefixes")
                seen[(e.name, e.state)] = e.key
        self._objects: dict[str, Any] = {}
        self._files = _Files(self.folder)
        # every key's chunks checked before an import begins (kept: read_key uses them)
        self._layouts = {e.key: self._layout(e.key) for e in self.tensor_entries()}
        from ucp_store.formats.dcp import perrank as dcp_perrank

        dcp_perrank.check_names(self)
        # per-rank entries (dataloader.dp_rank_<i>): key -> (saving rank, file), recorded with the topology
        self.per_rank = dcp_perrank.per_rank_keys(self, per_rank)

    def describe(self) -> str:
        return self.folder

    def data_files(self) -> list[str]:
        return sorted({i.relative_path for i in self.md.storage_data.values()})

    def provenance(self) -> dict:
        h = hashlib.sha256()
        h.update(inputs.read_regular(os.path.join(self.folder, _METADATA), "DCP metadata file"))
        sizes = {}
        for rel in self.data_files():
            p = os.path.join(self.folder, rel)
            sizes[rel] = os.path.getsize(p) if inputs.present(p, "DCP data file") else None
        import torch as _t

        return {"source_kind": self.kind, "source_path": self.folder,
                "source_hashes": {_METADATA: "sha256:" + h.hexdigest()},
                "library_versions": {"torch": _t.__version__},
                "extra": {"dcp_version": self.md.version, "data_files": sizes,
                          "keys": len(self.md.state_dict_metadata), "per_rank_keys": sorted(self.per_rank)}}

    def tensor_entries(self) -> list[_Entry]:
        return [e for e in self.entries.values() if e.kind in ("tensor", "array")]

    def _layout(self, key: str) -> tuple[tuple[int, ...], torch.dtype, list[tuple[Box, Any]]]:
        """(size, dtype, [(chunk box, storage entry)]) of one tensor key, checked against the metadata and the
        files before anything is allocated: the size is bounded, the chunks tile the tensor exactly, and each
        chunk's declared bytes fit in the bytes its file entry holds (so a crafted size cannot make the
        import allocate memory no file backs)."""
        where = f"{self.folder}/{_METADATA}"
        tmd = self.md.state_dict_metadata[key]
        try:
            size = tuple(int(s) for s in tmd.size)
            boxes: list[Box] = [(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes))
                                for c in tmd.chunks]
            dtype = tmd.properties.dtype
        except (AttributeError, TypeError, ValueError) as exc:
            raise SourceFormatError(f"{where}: tensor {key!r} has a malformed size or chunk list ({exc})") from None
        total = math.prod(size)
        if not isinstance(dtype, torch.dtype):
            raise SourceFormatError(f"{where}: tensor {key!r} has dtype {dtype!r}, not a torch dtype")
        if total > MAX_ELEMENTS or any(not 0 <= n <= MAX_ELEMENTS for n in size):
            raise SourceFormatError(f"{where}: tensor {key!r} has size {list(size)} ({total} elements); a tensor-state "
                                    "holds at most 2^48 elements, and no dimension may be negative or exceed that")
        if not boxes and total:
            raise SourceFormatError(f"{where}: tensor {key!r} {list(size)} lists no saved chunks")
        chunks = []
        for box in boxes:
            info = self._storage.get((key, box[0]))
            if info is None:
                raise SourceFormatError(f"{where}: {_chunk_name(box)} of {key!r} has no storage entry")
            chunks.append((box, info))
        problem = tiling_problem(size, boxes)
        if problem is not None:
            raise SourceFormatError(f"{where}: tensor {key!r} {list(size)}: {self._tiling_message(problem, chunks)}; "
                                    "the saved chunks must tile the tensor exactly (no overlap, no gap)")
        itemsize = torch.empty((), dtype=dtype).element_size()
        for box, info in chunks:
            need = math.prod(box[1]) * itemsize
            held = int(getattr(info, "length", 0) or 0)
            # a stream transform (compression) may hold fewer bytes than it expands to: read to know
            if not getattr(info, "transform_descriptors", None) and held < need:
                raise SourceFormatError(
                    f"{os.path.join(self.folder, info.relative_path)}: {_chunk_name(box)} of {key!r} declares "
                    f"{need} bytes ({str(dtype).replace('torch.', '')}{list(box[1])}) but its entry in the file holds "
                    f"{held} bytes (per {_METADATA}): the metadata is corrupt or the file is not this checkpoint's")
        return size, dtype, chunks

    def _tiling_message(self, problem: tuple[str, int, int, int], chunks: list[tuple[Box, Any]]) -> str:
        kind, i, j, n = problem

        def named(k: int) -> str:
            return f"{_chunk_name(chunks[k][0])} (in {chunks[k][1].relative_path})"

        if kind == "outside":
            return f"{named(i)} lies outside the tensor"
        if kind == "overlap":
            if chunks[i][0] == chunks[j][0]:
                return f"{named(i)} is listed twice"
            return f"{named(i)} and {named(j)} overlap"
        shown = ", ".join(named(k) for k in range(min(len(chunks), 8))) + (", ..." if len(chunks) > 8 else "")
        return f"{n} element(s) lie in no saved chunk (a rank's shard is missing); chunks: {shown or 'none'}"

    def read_key(self, key: str) -> torch.Tensor:
        """The logical tensor of one tensor key, assembled from its saved chunks (checked by ``_layout``)."""
        size, dtype, chunks = self._layouts[key] if key in self._layouts else self._layout(key)
        out: torch.Tensor | None = None
        for (offs, sizes), info in chunks:
            if not all(sizes):
                continue  # holds nothing
            what = f"{_chunk_name((offs, sizes))} of {key!r}"
            t = _load_chunk(self._files, info, key, what)
            if tuple(t.shape) != sizes or t.dtype != dtype:
                raise SourceFormatError(f"{os.path.join(self.folder, info.relative_path)}: {what} holds "
                                        f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}, the metadata says "
                                        f"{str(dtype).replace('torch.', '')}{list(sizes)}")
            if len(chunks) == 1 and sizes == size:
                return t
            if out is None:  # every chunk tiles the tensor (checked): no element stays uninitialised
                out = torch.empty(size, dtype=dtype)
            _place(out[tuple(slice(o, o + s) for o, s in zip(offs, sizes))], t)
        if out is None:
            out = torch.empty(size, dtype=dtype)
        return out

    def _prefetch_key(self, key: str) -> None:
        for c in self.md.state_dict_metadata[key].chunks:
            info = self._storage.get((key, tuple(int(x) for x in c.offsets)))
            if info is not None:
                self._files.prefetch(info.relative_path, int(info.offset), int(info.length))

    def records(self) -> Iterator[TensorRecord]:
        entries = self.tensor_entries()
        # the metadata's (state dict's) order, each tensor's states together: a DCP state dict lists every
        # model weight, then every optimizer state
        order = model_order((str(self.entries[k].name), str(self.entries[k].state)) for k in self.md.state_dict_metadata
                            if k in self.entries and self.entries[k].kind == "tensor")
        for i, e in enumerate(entries):
            if i + 1 < len(entries):
                self._prefetch_key(entries[i + 1].key)
            t = self.read_key(e.key)
            if e.kind == "array":
                self._objects[e.key] = t.clone() if t.data_ptr() else t
                continue
            if e.name is None or e.state is None:  # classify names every tensor entry
                raise UcpError(f"{self.folder}: DCP key {e.key!r} was classified as a tensor without a name/state")
            yield TensorRecord(e.name, e.state, t, position=order[(e.name, e.state)])

    def objects(self) -> dict[str, Any]:
        index: dict[str, Any] = {}
        objs: dict[str, Any] = {}
        if INDEX_OBJECT in self.entries:
            raise SourceFormatError(f"{self.folder}: a DCP key is named {INDEX_OBJECT!r}, the name ucp keeps its "
                                    "key index under")
        for key, e in self.entries.items():
            path = path_of(self.md, key)
            if e.kind == "tensor":
                index[key] = {"kind": "tensor", "name": e.name, "state": e.state, "path": path}
                continue
            if e.kind == "array":
                index[key] = {"kind": "array", "path": path}
                objs[key] = self._objects[key]
                continue
            info = self._bytes_info.get(key)
            if info is None:
                raise SourceFormatError(f"{self.folder}/{_METADATA}: non-tensor entry {key!r} has no storage entry")
            what = f"non-tensor entry {key!r}"
            descriptors = getattr(info, "transform_descriptors", None)
            if descriptors:  # kept as the bytes the job serialised (the export writes them untransformed)
                raw = _untransform(self._files, info.relative_path, int(info.offset), int(info.length),
                                   descriptors, what)
            else:
                raw = bytes(self._files.view(info.relative_path, int(info.offset), int(info.length), what))
            plain, value, why = _decode_bytes(raw)
            if plain:
                index[key] = {"kind": "value", "path": path}
                objs[key] = value
            else:
                index[key] = {"kind": "opaque", "path": path, "nbytes": len(raw),
                              "sha256": hashlib.sha256(raw).hexdigest(), "why": why,
                              "source_transforms": list(descriptors or [])}
                objs[key] = np.frombuffer(raw, dtype=np.uint8).copy()
        from ucp_store.formats.dcp import perrank as dcp_perrank

        per_rank = dcp_perrank.record(self, index, self.per_rank)  # notes each key's rank in the index too
        if per_rank is not None:
            objs[dcp_perrank.RECORD_OBJECT] = per_rank
        objs[INDEX_OBJECT] = {"format": "dcp", "version": self.md.version, "keys": index}
        self._files.close()
        return objs


def import_dcp(store, folder: str, run: str, step: int, *, message: str | None = None, progress: bool = True,
               optim_prefixes: Iterable[str] | None = None, model_prefix: str | None = None,
               per_rank: Iterable[str] | None = None):
    """Import a DCP checkpoint folder as ``run@step``; returns the committed :class:`Checkpoint`.

    Everything that can be checked before writing (metadata safety, key layout, files present and long
    enough) is checked first, so a bad folder fails before a version is begun."""
    if step is None:
        raise UcpError("ucp import dcp DIR: --step N is required (DCP folders carry no step)")
    source = DcpSource(folder, optim_prefixes=optim_prefixes, model_prefix=model_prefix, per_rank=per_rank)
    for info in source.md.storage_data.values():  # every file present and long enough, before begin
        source._files.view(info.relative_path, int(info.offset), int(getattr(info, "length", 0) or 0),
                            f"an entry of {info.relative_path}")
    ck_id = import_source(store, source, run, step, message=message, progress=progress, distributed=False,
                          total=sum(1 for e in source.entries.values() if e.kind == "tensor"))
    return store.checkpoint(ck_id)


# --------------------------------------------------------------------------------------------- export
def read_object(checkpoint, name: str) -> Any:
    """One stored object (JSON value or array) without reading every object of the checkpoint."""
    from sqlalchemy import select

    from ucp_store import dtypes
    from ucp_store.catalog import models as m
    from ucp_store.io import format as fmt

    with checkpoint.store.catalog.session() as s:
        o = s.scalars(select(m.StoredObject).where(m.StoredObject.checkpoint_id == checkpoint.id,
                                                   m.StoredObject.name == name)).first()
        if o is None:
            raise UcpError(f"checkpoint {checkpoint.run}@{checkpoint.step} lacks object {name!r} its DCP index names")
        if o.kind == "json":
            return typed_json.decode(o.value)
        a = o.array
        layout = fmt.ArrayLayout.from_catalog(a.dtype, a.shape, a.chunk_shape, a.shard_shape, a.codecs)
        h = fmt.open_array(checkpoint.store.location, a.path, layout, checkpoint.store.context)
        data = fmt.read_box(h, layout, tuple((0, n) for n in a.shape), what=f"object {name!r}",
                            array_url=checkpoint.store.array_url(a.path))
        return dtypes.to_torch(np.asarray(data))


class _Opaque:
    """Placeholder for an opaque blob in the state dict handed to DCP (a non-tensor -> a bytes item)."""

    def __init__(self, raw: bytes):
        self.raw = raw


def _plan(checkpoint, states: Iterable[str] | None) -> tuple[dict, dict[str, tuple[str, str]], dict[str, bytes]]:
    """(nested state dict with meta-tensor placeholders, key -> (name, state), key -> opaque bytes)."""
    from torch.distributed.checkpoint._traverse import set_element

    from ucp_store.safe_pickle import from_jsonable

    infos = {(i.name, i.state): i for i in checkpoint.tensors()}
    have = sorted({s for _, s in infos})
    wanted = set(states) if states else None
    if wanted:
        unknown = wanted - set(have)
        if unknown:
            import difflib

            near = {u: difflib.get_close_matches(u, have, n=1) for u in sorted(unknown)}
            hint = "".join(f"; did you mean {m[0]!r} for {u!r}?" for u, m in near.items() if m)
            raise UcpError(f"checkpoint {checkpoint.run}@{checkpoint.step} has no state(s) "
                           f"{', '.join(sorted(unknown))} (--states); states: {', '.join(have)}{hint}")
    index = read_index(checkpoint)
    sd: dict = {}
    tensors: dict[str, tuple[str, str]] = {}
    opaque: dict[str, bytes] = {}

    def placeholder(info):
        from ucp_store import dtypes

        return torch.empty(tuple(info.shape), dtype=dtypes.torch_dtype(info.dtype), device="meta")

    if index is None:  # not from DCP: get_state_dict's nested layout, {"model": ..., "optim": {"state": ...}}
        model_state = "fp32" if any(s == "fp32" for _, s in infos) else "weight"
        for (name, state), info in infos.items():
            if wanted and state not in wanted:
                continue
            path: tuple[str | int, ...]  # DCP's OBJ_PATH
            if state == model_state:
                path = ("model", name)
            elif state in ("fp32", "weight"):
                continue
            else:
                path = ("optim", "state", name, state)
            key = ".".join(map(str, path))
            set_element(sd, path, placeholder(info))
            tensors[key] = (name, state)
        from ucp_store.formats.dcp.perrank import export_entries

        for path, value in export_entries(checkpoint, {tuple(k.split(".")) for k in tensors}):
            set_element(sd, path, value)  # per-rank state: <key>.rank_<r>, never dropped
        return sd, tensors, opaque
    keys = index.get("keys", {})
    optim_heads = {v["path"][0] for v in keys.values() if v.get("kind") == "tensor" and v.get("state") != _MODEL_STATE
                   and len(v.get("path", [])) > 1}
    keep_optim = not wanted or any(s != _MODEL_STATE for s in wanted)
    for key, v in keys.items():
        path = tuple(v.get("path") or [key])  # DCP's OBJ_PATH is a tuple
        kind = v.get("kind")
        if kind == "tensor":
            ns = (v["name"], v["state"])
            if ns not in infos:
                raise UcpError(f"checkpoint {checkpoint.run}@{checkpoint.step}: DCP key {key!r} names tensor "
                               f"{ns[0]!r} state {ns[1]!r}, which the checkpoint lacks")
            if wanted and ns[1] not in wanted:
                continue
            set_element(sd, path, placeholder(infos[ns]))
            tensors[key] = ns
            continue
        if not keep_optim and path[0] in optim_heads:
            continue
        if kind == "array":
            set_element(sd, path, read_object(checkpoint, key))
        elif kind == "value":
            set_element(sd, path, from_jsonable(read_object(checkpoint, key)))
        elif kind == "opaque":
            raw = read_object(checkpoint, key)
            raw = raw.numpy().tobytes() if isinstance(raw, torch.Tensor) else bytes(raw)
            if "sha256" in v and hashlib.sha256(raw).hexdigest() != v["sha256"]:
                raise UcpError(f"checkpoint {checkpoint.run}@{checkpoint.step}: opaque DCP entry {key!r} does not "
                               "match its recorded sha256")
            set_element(sd, path, _Opaque(raw))
            opaque[key] = raw
        else:
            raise UcpError(f"checkpoint {checkpoint.run}@{checkpoint.step}: DCP index entry {key!r} has kind {kind!r}")
    return sd, tensors, opaque


def _inner_failure(exc: Any, dest: str) -> BaseException:
    """The error a ``CheckpointException`` wraps (DCP's save wraps every rank's failure in one, a
    ``BaseException`` that would escape ``except Exception`` and print DCP's traceback text): the ucp error
    or OS error itself where that is what failed, else a UcpError with its first line."""
    for inner, _trace in getattr(exc, "failures", {}).values():
        if isinstance(inner, (UcpError, OSError)):
            return inner
    first = next(iter(getattr(exc, "failures", {}).values()), (exc, None))[0]
    text = str(first).splitlines()[0][:300] if str(first) else type(first).__name__
    return UcpError(f"DCP's writer failed writing {dest}: {type(first).__name__}: {text}")


def export_dcp(checkpoint, dest: str, *, states: Iterable[str] | None = None, progress: bool = True,
               thread_count: int = 1) -> dict:
    """Write ``checkpoint`` as a DCP folder at ``dest`` with DCP's own ``FileSystemWriter``.

    The keys are the ones the source job saved (from the ``_dcp`` index of a DCP import); a checkpoint
    from elsewhere gets ``get_state_dict``'s nested layout (``model.<name>``, ``optim.state.<name>.<state>``;
    no param groups, which ucp does not know). ``states`` limits the tensor-states (``weight`` alone
    drops the optimizer's non-tensor entries too). Written under a temporary name, then renamed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItemType

    from ucp_store.progress import track

    dest = os.path.abspath(destination(dest, "a DCP folder"))
    inputs.check_outside(dest, checkpoint.store.location, "DCP folder")
    if not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1:
        raise UcpError(f"thread_count (--threads) must be an integer >= 1, got {thread_count!r}")
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        raise UcpError(f"cannot write DCP folder {dest}: folder {parent} does not exist")
    if os.path.lexists(dest):
        raise UcpError(f"cannot write DCP folder {dest}: it already exists (ucp never overwrites a checkpoint)")
    sd, tensors, opaque = _plan(checkpoint, states)
    if not tensors:
        raise UcpError(f"checkpoint {checkpoint.run}@{checkpoint.step}: no tensor-states to export")
    bar = iter(track(range(len(tensors)), f"export {os.path.basename(dest)}", enabled=progress))

    class _Planner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            fqn = write_item.index.fqn
            if write_item.type == WriteItemType.BYTE_IO and fqn in opaque:
                return io.BytesIO(opaque[fqn])
            if fqn in tensors:
                name, state = tensors[fqn]
                next(bar, None)
                killpoint("export.dcp")
                return checkpoint.read(name, state).contiguous()
            return super().resolve_data(write_item)

    sizes = {(i.name, i.state): i.nbytes for i in checkpoint.tensors()}
    needed = sum(sizes.get(k, 0) for k in tensors.values()) + sum(len(v) for v in opaque.values())
    what = f"the DCP folder of {checkpoint.run}@{checkpoint.step}"
    space.require(dest, needed, what)
    tmp = f"{dest}.tmp-{os.getpid()}"
    try:
        writer = FileSystemWriter(tmp, thread_count=thread_count, overwrite=False)
        with warnings.catch_warnings(), space.guard(dest, needed, what):
            # "torch.distributed is not initialised: single process" is the intent
            warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
            try:
                dcp.save(sd, storage_writer=writer, planner=_Planner(), no_dist=True)
            except CheckpointException as exc:  # a BaseException: raise what failed inside (a corrupt chunk...)
                raise _inner_failure(exc, dest) from None
        for _ in bar:
            pass
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": dest, "tensors": len(tensors), "opaque": len(opaque)}
