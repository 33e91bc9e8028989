"""Hugging Face folders in and out: ``ucp import hf`` (:class:`HfSource`) and ``ucp export hf`` (:func:`export_hf`).

Import reads a folder that ``save_pretrained`` wrote: ``model.safetensors``, or shards named by
``model.safetensors.index.json``. Every safetensors header (8-byte little-endian length, then JSON
``{name: {dtype, shape, data_offsets}}``) is parsed and checked here, against the file's real size,
*before* anything is written: a truncated shard, offsets that overrun the data, a shard the index names
but the folder lacks, or a dtype the store cannot hold is a :class:`~ucp_store.errors.SourceFormatError`
naming the file and tensor, and the import never begins. Tensors are then read straight from a
memory map (no full-file load, no copy before the store's own write). ``config.json`` and
``generation_config.json`` become the objects ``hf.config`` and ``hf.generation_config``.

Export writes what ``save_pretrained`` writes: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
shards split in tensor order at ``max_shard_size`` (the same greedy rule as ``huggingface_hub``) plus
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), ``config.json`` and
``generation_config.json``. Files are written by us (header, then each tensor ``pwrite`` at its
offset, read from the store concurrently in bounded batches), into a temporary folder beside the
destination that is renamed at the end, so no loader ever sees a half-written model. A name map
(:mod:`ucp_store.formats.hf.names`) renames stored tensors and splits fused ones (QKV with GQA,
SwiGLU gate/up) on the way out.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import shutil
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ucp_store import config, dtypes, inputs, names
from ucp_store._killpoints import killpoint
from ucp_store.errors import ConfigurationError, DTypeError, InvalidNameError, SourceFormatError, UcpError
from ucp_store.formats.base import TensorRecord, destination, import_source, parse_json
from ucp_store.formats.hf.names import NameMap, Piece, load_map, plan_outputs
from ucp_store.io import space
from ucp_store.io.window import read_failed

if TYPE_CHECKING:
    import torch

__all__ = ["HfSource", "SafetensorsHeader", "read_header", "import_hf", "export_hf", "parse_size",
           "ST_DTYPES", "CONFIG_OBJECT", "GENERATION_CONFIG_OBJECT"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_OBJECT = "hf.config"
GENERATION_CONFIG_OBJECT = "hf.generation_config"
_JSON_FILES = {"config.json": CONFIG_OBJECT, "generation_config.json": GENERATION_CONFIG_OBJECT}
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
MAX_ELEMENTS = 1 << 48  # writer.MAX_ELEMENTS, the most a tensor-state holds (named here: the writer loads torch)
_IMPORT_FLUSH_BYTES = 1 << 30  # the writer's bound on bytes in flight (writer._MAX_INFLIGHT_BYTES)

# safetensors dtype code -> the store's (zarr) dtype name
ST_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
             "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "C64": "complex64",
             "F64": "float64", "I64": "int64", "U64": "uint64"}
_ST_CODE = {v: k for k, v in ST_DTYPES.items()}
# safetensors codes that exist but that the store cannot hold bit-exactly (yet)
_ST_UNSTORABLE = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}
_CAST = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
         "fp32": "float32", "float32": "float32"}


# ------------------------------------------------------------------------------------------- headers
class SafetensorsHeader:
    """One safetensors file's parsed, checked header.

    ``entries`` maps tensor name -> (store dtype, shape, start, end) with offsets relative to
    ``data_start``; ``metadata`` is the ``__metadata__`` string map."""

    def __init__(self, path: str, data_start: int, entries: dict[str, tuple[str, tuple[int, ...], int, int]],
                 metadata: dict[str, str], size: int):
        self.path = path
        self.data_start = data_start
        self.entries = entries
        self.metadata = metadata
        self.size = size

    def in_file_order(self) -> list[str]:
        return sorted(self.entries, key=lambda n: self.entries[n][2])


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out

def read_header(path: str) -> SafetensorsHeader:
    """Parse and check a safetensors header against the file's size; SourceFormatError names file and tensor."""
    try:
        with inputs.open_regular(path, "safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise SourceFormatError(f"safetensors file {path} is truncated: {size} bytes, shorter than the "
                                        "8-byte header length")
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER:
                raise SourceFormatError(f"safetensors file {path}: header length {n} exceeds safetensors' limit of "
                                        f"{_MAX_HEADER} bytes (not a safetensors file, or corrupt)")
            if 8 + n > size:
                raise SourceFormatError(f"safetensors file {path} is truncated: its header needs {8 + n} bytes, "
                                        f"the file has {size}")
            raw = f.read(n)
    except OSError as exc:
        raise SourceFormatError(f"safetensors file {path} cannot be read: {exc.strerror or exc}") from None
    try:
        header = parse_json(raw, f"safetensors file {path}: header", object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as exc:
        raise SourceFormatError(f"safetensors file {path}: header names {exc.args[0]!r} twice (a JSON object with "
                                "duplicate keys: which entry is meant is ambiguous)") from None
    if not isinstance(header, dict):
        raise SourceFormatError(f"safetensors file {path}: header is a {type(header).__name__}, expected an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SourceFormatError(f"safetensors file {path}: __metadata__ must be an object of strings (as "
                                "safetensors itself requires)")
    data_start = 8 + n
    data_len = size - data_start
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, e in header.items():
        what = f"safetensors file {path} tensor {name!r}"
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise SourceFormatError(f"{what}: header entry must have dtype, shape and data_offsets, got "
                                    f"{reprlib.repr(e)}")
        code, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(code, str):
            raise SourceFormatError(f"{what}: dtype {reprlib.repr(code)} is not a safetensors dtype code")
        if code in _ST_UNSTORABLE:
            raise SourceFormatError(f"{what}: dtype {code} cannot be stored bit-exactly by ucp_store (supported: "
                                    f"{', '.join(ST_DTYPES)})")
        if code not in ST_DTYPES:
            raise SourceFormatError(f"{what}: unknown dtype {code!r}; Hugging Face safetensors dtypes the store "
                                    f"holds: {', '.join(ST_DTYPES)}")
        if (not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                   for s in shape)):
            raise SourceFormatError(f"{what}: shape {reprlib.repr(shape)} is not a list of non-negative integers")
        if any(s > MAX_ELEMENTS for s in shape) or math.prod(shape) > MAX_ELEMENTS:
            # a dimension past 2^48 is refused even when another is 0 (no elements): numpy cannot make it
            raise SourceFormatError(f"{what}: shape {shape} is too large: a tensor-state holds at most 2^48 "
                                    "elements, and no dimension may exceed that")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) and not isinstance(o, bool)
                                                                    for o in offs) or not 0 <= offs[0] <= offs[1]):
            raise SourceFormatError(f"{what}: data_offsets {reprlib.repr(offs)} must be [start, end] with "
                                    "0 <= start <= end")
        dtype = ST_DTYPES[code]
        need = math.prod(shape) * dtypes.itemsize(dtype)
        if offs[1] - offs[0] != need:
            raise SourceFormatError(f"{what}: data_offsets {offs} span {offs[1] - offs[0]} bytes, but shape {shape} "
                                    f"of {code} needs {need}")
        if offs[1] > data_len:
            raise SourceFormatError(f"{what}: data_offsets {offs} overrun the file: its data section has only "
                                    f"{data_len} bytes (file of {size} bytes truncated, or header corrupt)")
        entries[name] = (dtype, tuple(shape), offs[0], offs[1])
    _check_tiling(path, entries, data_len)
    return SafetensorsHeader(path, data_start, entries, {str(k): str(v) for k, v in metadata.items()}, size)


def _check_tiling(path: str, entries: dict[str, tuple[str, tuple[int, ...], int, int]], data_len: int) -> None:
    """The tensors' byte ranges tile the data section exactly, as the safetensors reference requires
    (``validate``: sorted by offsets, each starts where the previous ended, the last ends at the file's end):
    no two names on the same bytes, no overlap, no gap, nothing after the last tensor."""
    pos, prev = 0, None
    for name, (_, _, start, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if start < pos:
            assert prev is not None  # pos > 0 only after a tensor
            kind = "the same bytes as" if entries[prev][2:] == (start, end) else "bytes of"
            raise SourceFormatError(f"safetensors file {path}: tensor {name!r} (data_offsets [{start}, {end}]) "
                                    f"overlaps {kind} tensor {prev!r} (data_offsets {list(entries[prev][2:])}); "
                                    "each tensor must own its bytes")
        if start > pos:
            after = f"after tensor {prev!r}" if prev is not None else "at the start of the data section"
            raise SourceFormatError(f"safetensors file {path}: a gap of {start - pos} bytes [{pos}, {start}) {after}, "
                                    f"before tensor {name!r}; the tensors' data_offsets must tile the data section")
        pos, prev = end, name
    if pos != data_len:
        raise SourceFormatError(f"safetensors file {path}: {data_len - pos} bytes after the last tensor "
                                f"({prev!r}, ending at {pos}) that no tensor names; the tensors' data_offsets must "
                                "tile the data section")


# ------------------------------------------------------------------------------------------- import
def _read_bytes(path: str) -> bytes:
    return inputs.read_regular(path)


class HfSource:
    """A Hugging Face model folder (``model.safetensors`` or shards + index), read through memory maps.

    Every header is parsed and checked in ``__init__``, so a bad folder fails before an import begins."""

    kind = "hf"

    def __init__(self, path: str | os.PathLike, *, state: str = "weight", hash_sources: bool = True):
        self.path = os.path.abspath(os.fspath(path))
        self.state = state
        self.hash_sources = hash_sources
        if self.path.endswith(".safetensors") and inputs.present(self.path, "safetensors file"):
            self.root, files, weight_map = os.path.dirname(self.path), [os.path.basename(self.path)], None
        elif os.path.isdir(self.path):
            self.root = self.path
            files, weight_map = self._files()
        elif os.path.exists(self.path):
            inputs.check_regular(self.path, "Hugging Face input")
            raise SourceFormatError(f"Hugging Face input {self.path} is neither a folder nor a .safetensors file")
        else:
            raise SourceFormatError(f"Hugging Face folder {self.path} does not exist")
        self.files = files
        self.headers = [read_header(os.path.join(self.root, f)) for f in files]
        seen: dict[str, str] = {}
        for f, h in zip(files, self.headers):
            for name in h.entries:
                try:
                    names.tensor_name(name)  # checked before the import begins, not half-way through it
                except InvalidNameError as exc:
                    raise InvalidNameError(f"safetensors file {h.path}: {exc}") from None
                if name in seen:
                    raise SourceFormatError(f"tensor {name!r} appears in two shards of {self.root}: {seen[name]} "
                                            f"and {f}")
                seen[name] = f
        if weight_map is not None:
            for name, f in weight_map.items():
                if seen.get(name) != f:
                    where = f"it is in {seen[name]}" if name in seen else "no shard holds it"
                    raise SourceFormatError(f"{os.path.join(self.root, INDEX_NAME)}: weight_map puts tensor {name!r} "
                                            f"in {f}, but {where}")
        self._objects: dict[str, Any] = {}
        for fname, obj in _JSON_FILES.items():
            p = os.path.join(self.root, fname)
            if os.path.lexists(p):
                value = parse_json(_read_bytes(p), p)
                if not isinstance(value, dict):
                    raise SourceFormatError(f"{p} is a JSON {type(value).__name__}, expected an object (a Hugging "
                                            "Face config is a JSON object of settings)")
                self._objects[obj] = value
        meta = next((h.metadata for h in self.headers if h.metadata), None)
        if meta:
            self._objects["hf.safetensors_metadata"] = meta

    def _files(self) -> tuple[list[str], dict[str, str] | None]:
        index = os.path.join(self.root, INDEX_NAME)
        if inputs.present(index):
            data = parse_json(_read_bytes(index), index)
            wm = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(wm, dict) or not wm:
                raise SourceFormatError(f"{index}: expected a non-empty 'weight_map' object of tensor -> shard file")
            # shards in file-name order (model-00001-of-... first): the index's own order is by tensor name
            files = sorted(set(wm.values()), key=str)
            for f in files:
                if not isinstance(f, str) or os.path.basename(f) != f or f in ("", ".", ".."):
                    raise SourceFormatError(f"{index}: shard {f!r} is not a plain file name in {self.root} "
                                            "(a shard never lives outside the model folder)")
                if not inputs.present(os.path.join(self.root, f), "safetensors shard"):
                    held = [n for n, g in wm.items() if g == f]
                    raise SourceFormatError(f"{index}: shard {f} (holding {len(held)} tensor(s), e.g. {held[0]!r}) "
                                            f"is missing from {self.root}")
            return files, wm
        if inputs.present(os.path.join(self.root, SINGLE_NAME), "safetensors file"):
            return [SINGLE_NAME], None
        found = sorted(os.listdir(self.root))
        st = [f for f in found if f.endswith(".safetensors")]
        if len(st) == 1:
            return st, None
        hint = (f"{len(st)} safetensors files but no {INDEX_NAME}" if st else
                "found: " + (", ".join(found[:8]) or "nothing") + (" (PyTorch .bin weights are not read: they are "
                                                                    "pickles)" if any(f.endswith(".bin") for f in found)
                                                                   else ""))
        raise SourceFormatError(f"Hugging Face folder {self.root} has no {SINGLE_NAME} or {INDEX_NAME}; {hint}")

    def describe(self) -> str:
        return os.path.basename(self.path.rstrip("/")) or self.path

    @property
    def nbytes(self) -> int:
        return sum(e[3] - e[2] for h in self.headers for e in h.entries.values())

    def __len__(self) -> int:
        return sum(len(h.entries) for h in self.headers)

    def provenance(self) -> dict:
        hashes: dict[str, str] = {}
        if self.hash_sources:
            hashes = _hash_files(self.root, self.files + [f for f in (INDEX_NAME, *_JSON_FILES)
                                                          if os.path.isfile(os.path.join(self.root, f))])
        return {"source_kind": self.kind, "source_path": self.path, "source_hashes": hashes,
                "extra": {"files": len(self.files), "tensors": len(self)}}

    def records(self) -> Iterator[TensorRecord]:
        for h in self.headers:
            # np.memmap: a read-only mapping of the whole file; each tensor is a view of it (no copy)
            mm = np.memmap(h.path, dtype=np.uint8, mode="r") if h.size > h.data_start else None
            for name in h.in_file_order():
                dtype, shape, start, end = h.entries[name]
                np_dtype = dtypes.numpy_dtype(dtype)
                if end == start:
                    arr = np.zeros(shape, dtype=np_dtype)
                else:
                    if mm is None:  # read_header checked every entry against the data section's size
                        raise SourceFormatError(f"safetensors file {h.path} tensor {name!r}: the file has no data "
                                                f"after its header, the tensor needs bytes [{start}, {end})")
                    if os.path.getsize(h.path) < h.data_start + end:
                        raise SourceFormatError(f"safetensors file {h.path} tensor {name!r}: the file shrank to "
                                                f"{os.path.getsize(h.path)} bytes while being read")
                    arr = mm[h.data_start + start:h.data_start + end].view(np_dtype).reshape(shape)
                yield TensorRecord(name, self.state, arr)

    def objects(self) -> dict[str, Any]:
        return dict(self._objects)


def _hash_files(root: str, files: list[str]) -> dict[str, str]:
    """``{file: "xxh3-128:<hex>"}`` of whole files, as ``deepspeed_files.hash_files`` writes them, but hashed
    from a memory map of each file (no copy into a read buffer; the import maps the same pages), files in
    parallel threads."""
    import mmap

    import xxhash

    def one(f: str) -> tuple[str, str]:
        h = xxhash.xxh3_128()
        with inputs.open_regular(os.path.join(root, f)) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size:
                with mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mm:
                    view = memoryview(mm)
                    try:
                        for pos in range(0, size, 64 << 20):
                            h.update(view[pos:pos + (64 << 20)])
                    finally:
                        view.release()
        return f, "xxh3-128:" + h.hexdigest()

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(files), os.cpu_count() or 1))) as ex:
        return dict(ex.map(one, files))


def import_hf(store, path: str | os.PathLike, run: str, step: int = 0, *, state: str = "weight",
              message: str | None = None, progress: bool = True, hash_sources: bool = True) -> str:
    """Import a Hugging Face folder as ``run@step``; returns the committed version id."""
    source = HfSource(path, state=state, hash_sources=hash_sources)
    # the records are views of memory maps (no memory of their own): flush rows at the writer's own window
    # of writes in flight rather than every 256 MiB, so the writes are not drained four times per GiB
    return import_source(store, source, run, step, message=message, progress=progress, distributed=False,
                         total=len(source), inflight_bytes=_IMPORT_FLUSH_BYTES)


# ------------------------------------------------------------------------------------------- export
def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"500MiB"`` -> 500 * 2**20, ints as given (``huggingface_hub``'s rule)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ConfigurationError(f"max_shard_size must be positive, got {size}")
        return size
    units = {"TIB": 1 << 40, "GIB": 1 << 30, "MIB": 1 << 20, "KIB": 1 << 10, "TB": 10**12, "GB": 10**9,
             "MB": 10**6, "KB": 10**3, "B": 1}
    text = str(size).strip().upper()
    for unit, mult in units.items():
        if text.endswith(unit):
            num = text[:-len(unit)].strip()
            try:
                value = float(num)
            except ValueError:
                break
            if value > 0 and math.isfinite(value):  # float() also reads "inf" and "nan"
                return int(value * mult)
            break
    else:
        if text.isdigit() and int(text) > 0:
            return int(text)
    raise ConfigurationError(f"max_shard_size {size!r} is not a size like 5GB, 500MB or 2GiB")


def _shards(pieces: list[Piece], nbytes: list[int], limit: int) -> list[list[int]]:
    """Greedy split in tensor order, as ``huggingface_hub.split_state_dict_into_shards_factory``: a
    tensor above the limit gets a shard of its own; otherwise a shard closes before it would overflow."""
    shards: list[list[int]] = []
    cur: list[int] = []
    cur_size = 0
    for i, n in enumerate(nbytes):
        if n > limit:
            shards.append([i])
            continue
        if cur_size + n > limit and cur:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(i)
        cur_size += n
    if cur:
        shards.append(cur)
    return shards


def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int, int]], metadata: dict) -> bytes:
    head: dict[str, Any] = {"__metadata__": metadata}
    for name, dtype, shape, start, end in entries:
        head[name] = {"dtype": _ST_CODE[dtype], "shape": list(shape), "data_offsets": [start, end]}
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so the data starts 8-aligned
    return len(raw).to_bytes(8, "little") + raw


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


_SYNC_FILE_RANGE_WRITE = 2
_sfr: Any = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start the disk writes of ``[offset, offset + nbytes)`` of ``fd`` now (Linux ``sync_file_range`` with
    ``SYNC_FILE_RANGE_WRITE``: it queues the dirty pages' writeback and returns; it makes nothing durable).
    The writeback of every block then runs while later blocks are read and copied, and the one ``fsync`` per
    file at the end finds little left to write. A no-op where the call does not exist; ``fsync`` alone
    still makes the file durable."""
    global _sfr
    if _sfr is None:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None) if os.name == "posix" else None
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _sfr = fn or False
    if _sfr and nbytes > 0:
        _sfr(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # ctypes releases the GIL; a failure is fsync's to report


# one export task reads and writes at most this much (whole stored chunks along dim 0): below localread's
# PARALLEL_BYTES, so each task's read runs in its own thread and the tasks, not the chunks, go in parallel
_TASK_BYTES = 8 << 20
_stage = threading.local()
# elements per cast call: below torch's grain size (32768), so torch casts each piece on the calling thread
# instead of an OpenMP team per block, which with every core busy (the other export threads, other jobs)
# waits for its slowest member
_CAST_PIECE = 30 * 1024


def _staging(slot: int, nbytes: int) -> "torch.Tensor":
    """This thread's staging buffer ``slot`` (0: bytes as stored, 1: after a cast), at least ``nbytes``."""
    import torch

    bufs = getattr(_stage, "bufs", None)
    if bufs is None:
        bufs = _stage.bufs = [None, None]
    buf = bufs[slot]
    if buf is None or buf.numel() < nbytes:
        buf = bufs[slot] = torch.empty(max(nbytes, _TASK_BYTES), dtype=torch.uint8)
    return buf[:nbytes]


def _export_threads() -> int:
    """The export pool's size: the ``export_threads`` setting, else twice the CPUs (2 to 16)."""
    chosen = config.current().export_threads
    if chosen is not None:
        return chosen
    return max(2, min(16, 2 * (os.cpu_count() or 1)))


def _piece_tasks(i: int, box: tuple[tuple[int, int], ...], chunk_shape, itemsize: int) -> list[tuple[int, int, int]]:
    """``(piece, row start, row stop)`` blocks of ``box`` along dim 0, at most ``_TASK_BYTES`` (at least one
    stored chunk row), cut on the stored chunk grid so every chunk lands whole in one block."""
    if not box:
        return [(i, 0, 0)]
    lo, hi = box[0]
    row = math.prod(b - a for a, b in box[1:]) * itemsize
    if hi <= lo or row == 0:
        return []
    c0 = max(1, int(chunk_shape[0])) if chunk_shape else hi
    step = max(1, _TASK_BYTES // row // c0) * c0
    tasks, a = [], lo
    while a < hi:
        b = min(hi, (a // step + 1) * step)
        tasks.append((i, a, b))
        a = b
    return tasks


def _write_shards(checkpoint, folder: str, layouts: list, pieces: list[Piece], out_dtypes: list[str],
                  file_of: list[str], offset_of: list[int], label: str, progress: bool) -> None:
    """Write every shard file of ``layouts`` into ``folder``: the header, then each piece read from the store
    into a per-thread staging buffer (the local read path: ``preadv`` of whole chunks, crc32c checked) and
    ``pwrite`` at its precomputed offset, blocks of all tensors in parallel threads; cast only where the
    output dtype differs. Each file is preallocated to its final size first and fsynced once at the end."""
    import torch

    from ucp_store.dtypes import numpy_view
    from ucp_store.io import format as fmt
    from ucp_store.io.deltaio import open_any
    from ucp_store.io.localread import LocalArray
    from ucp_store.progress import track

    store = checkpoint.store
    handles: dict[str, tuple[Any, Any]] = {}
    boxes: list[tuple[tuple[int, int], ...]] = []
    tasks: list[tuple[int, int, int]] = []
    for i, p in enumerate(pieces):
        info = p.source
        if info.array_id not in handles:
            layout = fmt.ArrayLayout.from_catalog(info.dtype, info.shape, info.chunk_shape, info.shard_shape,
                                                  info.codecs)
            handles[info.array_id] = (open_any(store.location, info, layout, store.context), layout)
        box = [(0, int(n)) for n in info.shape]
        if p.dim is not None:
            box[p.dim] = (p.start, p.stop)
        boxes.append(tuple(box))
        tasks += _piece_tasks(i, boxes[-1], info.chunk_shape, dtypes.itemsize(info.dtype))
    fds: dict[str, int] = {}

    def run(task: tuple[int, int, int]) -> int:
        i, a, b = task
        p = pieces[i]
        info = p.source
        handle, layout = handles[info.array_id]
        box = boxes[i]
        if box:
            row0 = box[0][0]
            box = ((a, b),) + box[1:]
        else:
            row0 = 0
        shape = tuple(hi - lo for lo, hi in box)
        n = math.prod(shape)
        src = _staging(0, n * dtypes.itemsize(info.dtype)).view(dtypes.torch_dtype(info.dtype)).view(shape)
        what = f"tensor {info.name!r} state {info.state!r} of checkpoint {checkpoint.id}"
        if isinstance(handle, LocalArray):
            try:
                handle.read_into(box, numpy_view(src))
            except ValueError as exc:  # name the array and the bad chunk exactly as every other read does
                fmt.read_box(handle, layout, box, what=what, array_url=store.array_url(info.array))
                raise read_failed(what, store.array_url(info.array), exc) from None
        else:  # S3, compressed or foreign chains: TensorStore
            data = fmt.read_box(handle, layout, box, what=what, array_url=store.array_url(info.array))
            numpy_view(src)[...] = data
        out = src
        want = dtypes.torch_dtype(out_dtypes[i])
        if want != src.dtype:
            out = _staging(1, n * dtypes.itemsize(out_dtypes[i])).view(want).view(shape)
            flat_out, flat_src = out.view(-1), src.view(-1)
            for k in range(0, n, _CAST_PIECE):  # below torch's grain size: each piece on this thread
                flat_out[k:k + _CAST_PIECE].copy_(flat_src[k:k + _CAST_PIECE])
        row = (math.prod(shape[1:]) * dtypes.itemsize(out_dtypes[i])) if shape else 0
        data_bytes = out.view(-1).view(torch.uint8).numpy()
        # numpy's stubs declare ndarray.__buffer__ for Python >= 3.12 only; 3.11 arrays are buffers too
        fd, at = fds[file_of[i]], offset_of[i] + (a - row0) * row
        _pwrite_all(fd, memoryview(data_bytes), at)  # type: ignore[arg-type]
        _start_writeback(fd, at, data_bytes.nbytes)
        killpoint("export.hf")
        return data_bytes.nbytes

    pool = ThreadPoolExecutor(max_workers=_export_threads(), thread_name_prefix="ucp-export")
    futures: list[tuple[Any, int]] = []
    try:
        for fname, header, total in layouts:
            fd = os.open(os.path.join(folder, fname), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            fds[fname] = fd
            os.ftruncate(fd, total)  # its final size up front: every block is a pwrite at a known offset
            _pwrite_all(fd, memoryview(header), 0)
        for t in tasks:
            i, a, b = t
            size = (b - a) * math.prod(hi - lo for lo, hi in boxes[i][1:]) if boxes[i] else 1
            futures.append((pool.submit(run, t), size * dtypes.itemsize(out_dtypes[i])))
        for fut, _ in track(futures, label, enabled=progress, weight=lambda f: f[1]):
            fut.result()
        for fd in fds.values():  # durable before the rename makes the folder visible
            os.fsync(fd)
    finally:
        for fut, _ in futures:
            fut.cancel()
        pool.shutdown(wait=True)  # no write is in flight when the files are closed (or removed)
        for fd in fds.values():
            os.close(fd)


def _choose_state(checkpoint, state: str | None) -> str:
    states = {i.state for i in checkpoint.tensors()}
    chosen = state or ("weight" if "weight" in states else "fp32" if "fp32" in states else None)
    if chosen is None or chosen not in states:
        raise SourceFormatError(f"checkpoint {checkpoint.run}@{checkpoint.step} has no state {chosen!r} to export; "
                                f"states: {', '.join(sorted(states)) or 'none'}")
    return chosen


def export_hf(checkpoint, dest: str | os.PathLike, *, state: str | None = None, dtype: str | None = None,
              max_shard_size: int | str = "5GB", name_map: "str | os.PathLike | Mapping | NameMap | None" = None,
              config: "str | os.PathLike | Mapping | None" = None, progress: bool = True) -> dict:
    """Write ``checkpoint`` as a Hugging Face folder at ``dest`` (must not exist, or be empty).

    ``state``: which tensor-state becomes the weights (default ``weight``, else ``fp32``); ``dtype``
    (``bf16``/``fp16``/``fp32``) casts floating tensors and sets ``config.json``'s ``dtype``;
    ``name_map``: a map file, shipped map name or dict (:mod:`ucp_store.formats.hf.names`); ``config``:
    a ``config.json`` to write instead of the stored ``hf.config`` object. Returns a summary."""
    dest = os.path.abspath(destination(dest, "a Hugging Face folder"))
    inputs.check_outside(dest, checkpoint.store.location, "Hugging Face folder")
    limit = parse_size(max_shard_size)
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        raise UcpError(f"cannot export to {dest}: folder {parent} does not exist")
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise UcpError(f"cannot export to {dest}: it exists and is not an empty folder (remove it or choose another)")
    target = None
    if dtype is not None:
        if dtype not in _CAST:
            raise ConfigurationError(f"export dtype {dtype!r} is not one of bf16, fp16, fp32")
        target = _CAST[dtype]
    chosen = _choose_state(checkpoint, state)
    objects = checkpoint.objects()
    cfg = _load_config(config) if config is not None else objects.get(CONFIG_OBJECT)
    if cfg is None:
        raise ConfigurationError(f"checkpoint {checkpoint.run}@{checkpoint.step} has no stored Hugging Face config "
                                 f"(object {CONFIG_OBJECT!r}; it was not imported from an HF folder): pass "
                                 "config=/--config FILE.json")
    if not isinstance(cfg, dict):
        raise ConfigurationError(f"the Hugging Face config must be a JSON object, got {type(cfg).__name__}")
    nmap = load_map(name_map) if name_map is not None else None
    infos = sorted(checkpoint.tensors(state=chosen), key=lambda i: i.position)
    pieces = plan_outputs(infos, nmap, cfg)
    if not pieces:
        raise ConfigurationError(f"nothing to export from {checkpoint.run}@{checkpoint.step} state {chosen!r}"
                                 + (f" after name map {nmap.origin}" if nmap else ""))
    out_dtypes = []
    for p in pieces:
        dt = p.source.dtype
        if target is not None and dt in ("float16", "bfloat16", "float32", "float64"):
            dt = target
        if dt not in _ST_CODE:
            raise DTypeError(f"tensor {p.source.name!r} (exported as {p.name!r}) has dtype {dt}, which Hugging Face "
                             f"safetensors cannot hold; cast it with --dtype, or supported: {', '.join(_ST_CODE)}")
        out_dtypes.append(dt)
    nbytes = [math.prod(p.shape) * dtypes.itemsize(dt) for p, dt in zip(pieces, out_dtypes)]
    groups = _shards(pieces, nbytes, limit)
    n = len(groups)
    file_of: list[str] = [""] * len(pieces)
    offset_of: list[int] = [0] * len(pieces)
    layouts = []
    for k, members in enumerate(groups):
        fname = SINGLE_NAME if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        # safetensors' own order: larger alignment first, then by name (keeps every tensor aligned)
        order = sorted(members, key=lambda i: (-dtypes.itemsize(out_dtypes[i]), pieces[i].name))
        entries, pos = [], 0
        for i in order:
            entries.append((pieces[i].name, out_dtypes[i], pieces[i].shape, pos, pos + nbytes[i]))
            pos += nbytes[i]
        header = _header_bytes(entries, {"format": "pt"})
        for i, e in zip(order, entries):
            file_of[i] = fname
            offset_of[i] = len(header) + e[3]
        layouts.append((fname, header, len(header) + pos))

    needed = sum(size for _, _, size in layouts)
    what = f"the Hugging Face folder of {checkpoint.run}@{checkpoint.step}"
    space.require(dest, needed, what)
    tmp = os.path.join(parent, f".{os.path.basename(dest)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        with space.guard(dest, needed, what):
            _write_shards(checkpoint, tmp, layouts, pieces, out_dtypes, file_of, offset_of,
                          f"export {os.path.basename(dest)}", progress)
            _write_configs(tmp, cfg, target, objects, pieces, file_of, nbytes)
        _fsync_dir(tmp)  # every file and the folder's entries durable before the rename shows them
        if os.path.isdir(dest):
            os.rmdir(dest)  # empty (checked above)
        os.replace(tmp, dest)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"dest": dest, "state": chosen, "tensors": len(pieces), "shards": n, "total_size": sum(nbytes),
            "files": [fname for fname, _, _ in layouts]}


def _write_configs(tmp: str, cfg: dict, target: str | None, objects: dict, pieces, file_of: list[str],
                   nbytes: list[int]) -> None:
    """``config.json`` (with the export's dtype), ``generation_config.json`` and, for several shards, the index."""
    cfg_out = dict(cfg)
    if target is not None:
        for key in ("dtype", "torch_dtype"):
            if key in cfg_out or key == "dtype":
                cfg_out[key] = target
    _write_json(os.path.join(tmp, "config.json"), cfg_out)
    gen = objects.get(GENERATION_CONFIG_OBJECT)
    if isinstance(gen, dict):
        _write_json(os.path.join(tmp, "generation_config.json"), gen)
    if len(set(file_of)) > 1:
        index = {"metadata": {"total_parameters": sum(math.prod(p.shape) for p in pieces),
                              "total_size": sum(nbytes)},
                 "weight_map": {p.name: file_of[i] for i, p in enumerate(pieces)}}
        _write_json(os.path.join(tmp, INDEX_NAME), index)


def _load_config(config: "str | os.PathLike | Mapping") -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    raw = inputs.read_regular(path, "config", ConfigurationError)
    value = parse_json(raw, f"config {path}", error=ConfigurationError)
    if not isinstance(value, dict):
        raise ConfigurationError(f"config {path} is a JSON {type(value).__name__}, expected an object (a Hugging Face "
                                 "config is a JSON object of settings)")
    return value


def _write_json(path: str, obj: Any) -> None:
    """``obj`` as ``save_pretrained`` writes its JSON files (2-space indent, sorted keys), fsynced."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
