"""Plain torch state dicts: ``torch.load(weights_only=True)`` in, ``torch.save`` out.

A file that needs arbitrary pickled globals is refused: we never fall back to ``weights_only=False``,
which would execute whatever the file asks.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from ucp_store import inputs
from ucp_store._killpoints import killpoint
from ucp_store.errors import ConfigurationError, SourceFormatError, UnsafePickleError
from ucp_store.formats.base import TensorRecord, import_source
from ucp_store.io import space

__all__ = ["TorchFileSource", "TorchFileSink", "import_torch_file", "export_torch_file", "load_weights_only",
           "flatten", "unique_leaves"]


def load_weights_only(path: str) -> Any:
    """torch.load with weights_only=True; a refused global becomes UnsafePickleError naming it."""
    with inputs.open_regular(path, "torch file") as f:
        head = f.read(2)
    # torch.save writes a zip archive (PK) or, legacy, a pickle (protocol 2+ opens with 0x80): anything else
    # (an empty file, an image, text) is not a torch file, whatever torch.load would make of it
    if not head or not (head == b"PK" or head[:1] == b"\x80"):
        what = "is empty" if not head else f"starts with {head!r}"
        raise SourceFormatError(f"torch file {path} {what}: not a torch.save file (expected a zip archive or a "
                                "pickle)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=_zipfile(path))
    except pickle.UnpicklingError as exc:
        msg = str(exc)
        detail = next((ln.strip() for ln in msg.splitlines() if "GLOBAL" in ln or "Unsupported" in ln), msg[:200])
        raise UnsafePickleError(
            f"torch file {path} needs pickled globals outside the weights-only allow-list ({detail}); "
            "refusing to unpickle it (ucp never uses weights_only=False)") from None
    except (RuntimeError, EOFError, OSError, ValueError, IndexError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise SourceFormatError(f"torch file {path} cannot be read: {first[:200]} "
                                "(truncated or not a torch.save file?)") from None


def _zipfile(path: str) -> bool:
    with inputs.open_regular(path, "torch file") as f:
        return f.read(4) == b"PK\x03\x04"


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Nested dicts/lists of tensors -> (dotted name, leaf) pairs. An empty dict below the root is a leaf
    (``{}``), so that it is kept. Two entries may give one name (``{"cfg": {"lr": 1}}`` and ``{"cfg.lr": 2}``):
    :func:`unique_leaves` refuses that."""
    if isinstance(obj, dict) and (obj or not prefix):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}{k}.")
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, torch.Tensor)) for v in obj):
        for i, v in enumerate(obj):
            yield from flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], obj


def unique_leaves(leaves: list[tuple[str, Any]], what: str) -> list[tuple[str, Any]]:
    """``leaves`` if no two tensors and no two other values share a dotted name; else a SourceFormatError
    naming it (one of them would be silently lost)."""
    seen: set[tuple[bool, str]] = set()
    for name, value in leaves:
        key = (isinstance(value, torch.Tensor), name)
        if key in seen:
            kind = "tensors" if key[0] else "values"
            raise SourceFormatError(f"{what}: two {kind} flatten to the name {name!r} (e.g. {{'cfg': {{'lr': ...}}}} "
                                    f"and {{'cfg.lr': ...}}, or keys 1 and '1'); rename one of them, none is dropped")
        seen.add(key)
    return leaves


def _jsonable(value: Any, what: str = "") -> Any:
    """A non-tensor leaf as an object the store keeps exactly (``typed_json``: tuples, non-string keys and
    numpy scalars keep their types); a ``torch.Size`` becomes a tuple, anything else its ``repr``."""
    if type(value) in (str, int, float, bool, type(None)):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and hasattr(value, "dtype"):
        return value
    if type(value) is list:
        return [_jsonable(v, what) for v in value]
    if isinstance(value, tuple):  # torch.Size, a named tuple: their items as a plain tuple
        return tuple(_jsonable(v, what) for v in value)
    if isinstance(value, dict):
        return {k if type(k) in (str, int, float, bool, type(None), tuple) else repr(k): _jsonable(v, what)
                for k, v in value.items()}
    if isinstance(value, (str, int, float)):  # subclasses (an enum): their plain value
        return (str if isinstance(value, str) else float if isinstance(value, float) else int)(value)
    return repr(value)


class TorchFileSource:
    """A plain state dict in one ``torch.save`` file: tensors become tensor-states, the rest JSON objects.

    The file is read once with ``torch.load(weights_only=True)`` (memory-mapped when it is a zip file)."""

    kind = "torch_file"

    def __init__(self, path: str, *, state: str = "weight"):
        self.path = os.path.abspath(path)
        self.state = state
        data = load_weights_only(path)
        if isinstance(data, torch.Tensor):
            data = {"tensor": data}
        if not isinstance(data, dict):
            raise SourceFormatError(f"torch file {path} holds a {type(data).__name__}, expected a state dict")
        leaves = unique_leaves(list(flatten(data)), f"torch file {path}")
        self._tensors = [(n, v) for n, v in leaves if isinstance(v, torch.Tensor)]
        self._others = {n: _jsonable(v, f"torch file {path} entry {n!r}")
                        for n, v in leaves if not isinstance(v, torch.Tensor)}

    def describe(self) -> str:
        return os.path.basename(self.path)

    def provenance(self) -> dict:
        h = hashlib.sha256()
        with inputs.open_regular(self.path, "torch file") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        return {"source_kind": self.kind, "source_path": self.path,
                "source_hashes": {os.path.basename(self.path): "sha256:" + h.hexdigest()}}

    def records(self) -> Iterator[TensorRecord]:
        for name, tensor in self._tensors:
            yield TensorRecord(name, self.state, tensor)

    def objects(self) -> dict[str, Any]:
        return dict(self._others)


def import_torch_file(store, path: str, run: str, step: int, *, state: str = "weight", message: str | None = None,
                      progress: bool = True):
    """Import a plain state dict: tensors become tensor-states, everything else JSON objects."""
    source = TorchFileSource(path, state=state)
    ck_id = import_source(store, source, run, step, message=message, progress=progress, distributed=False)
    return store.checkpoint(ck_id)


def export_torch_file(checkpoint, path: str, *, state: str | None = None, progress: bool = True) -> int:
    """Write ``name -> tensor`` for one state (default: ``weight``, else ``fp32``) with torch.save."""
    from ucp_store.progress import track

    states = {i.state for i in checkpoint.tensors()}
    chosen = state or ("weight" if "weight" in states else "fp32" if "fp32" in states else None)
    if chosen is None or chosen not in states:
        raise SourceFormatError(f"checkpoint {checkpoint.run}@{checkpoint.step} has no state {chosen!r}; "
                                f"states: {', '.join(sorted(states))}")
    path = os.fspath(path)
    # the destination is checked before anything is read: "" or a folder would fail only at the rename,
    # after the whole version was read and a temporary file written
    if not path or path.endswith(os.sep) or os.path.isdir(path):
        raise ConfigurationError(f"cannot write torch file {path!r}: expected the path of a file (it is "
                                 f"{'empty' if not path else 'a folder'})")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigurationError(f"cannot write torch file {path}: folder {parent} does not exist")
    inputs.check_destination(path, "torch file", ConfigurationError)
    inputs.check_outside(path, checkpoint.store.location, "torch file", ConfigurationError)
    infos = checkpoint.tensors(state=chosen)
    needed = sum(i.nbytes for i in infos)
    what = f"the torch file of {checkpoint.run}@{checkpoint.step}"
    space.require(path, needed, what)  # before anything is read
    out = {i.name: checkpoint.read(i.name, i.state)
           for i in track(infos, "export", enabled=progress, weight=lambda i: i.nbytes)}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with space.guard(path, needed, what):
            torch.save(out, tmp)
        killpoint("export.torch")
        os.replace(tmp, path)  # never leave a half-written file under the final name
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return len(out)


class TorchFileSink:
    """The torch-file export as a :class:`~ucp_store.formats.base.Sink`:
    ``TorchFileSink().write(checkpoint, path, state=...)`` -> ``{"kind", "path", "tensors"}``."""

    kind = "torch_file"

    def write(self, checkpoint, dest: str, **options: Any) -> dict[str, Any]:
        n = export_torch_file(checkpoint, dest, **options)
        return {"kind": self.kind, "path": os.path.abspath(dest), "tensors": n}

