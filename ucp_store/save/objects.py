"""The objects side of a save: non-tensor state stored as JSON in the catalog, or as an array. Never pickle."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from ucp_store import dtypes, names
from ucp_store.catalog import models as m
from ucp_store.errors import DuplicateEntryError, ValidationError
from ucp_store.save.arrays import ArrayWriter

__all__ = ["ObjectWriter", "check_json"]


def check_json(name: str, value: Any) -> Any:
    """``value`` as the catalog will give it back (``json``'s view: tuples become lists, ``1.0``, ``-0.0``,
    big integers and NaN/Infinity stay what they are), or a ValidationError naming the object. A dict whose
    keys ``json`` makes equal (``1`` and ``"1"``) is refused: the catalog would keep only one of them."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):  # only converted keys can repeat: a Python dict has no duplicate keys
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise ValidationError(f"object {name!r}: two keys of one dict are both stored as the JSON key "
                                          f"{key!r} (e.g. 1 and '1'); one of them would be lost")
                seen.add(key)
        return out

    try:
        return json.loads(m.encode_json(value), object_pairs_hook=unique)
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"object {name!r} is not JSON-serialisable ({exc}); store tensors as arrays, "
                              "never pickle") \
            from None
    except RecursionError:
        raise ValidationError(f"object {name!r} is nested too deeply to store as JSON") from None


class ObjectWriter:
    """Writes the named objects of one pending checkpoint: a tensor or array through ``arrays`` (copied,
    hashed, deduplicated like a tensor-state), anything else as a JSON value; each appends its row to the
    writer's shared ``rows``."""

    def __init__(self, checkpoint_id: str, arrays: ArrayWriter, rows: list):
        self.id = checkpoint_id
        self.arrays = arrays
        self.rows = rows
        self._names: set[str] = set()

    def write(self, name: str, value: Any) -> None:
        """``CheckpointWriter.write_object``: one object, by name (each name once)."""
        names.object_name(name)
        if name in self._names:
            raise DuplicateEntryError(f"object {name!r} was already written to checkpoint {self.id}")
        if isinstance(value, (torch.Tensor, np.ndarray)):
            array = dtypes.to_numpy(value, what=f"object {name!r}") if isinstance(value, torch.Tensor) else value
            dtype = dtypes.zarr_name(array.dtype, what=f"object {name!r}")
            aid, _, _ = self.arrays.put_array(np.require(array, requirements="C"), dtype, None, f"object {name!r}")
            row = m.StoredObject(checkpoint_id=self.id, name=name, kind="array", array_id=aid)
        else:
            row = m.StoredObject(checkpoint_id=self.id, name=name, kind="json", value=check_json(name, value))
        self._names.add(name)
        self.rows.append(row)
