"""The objects side of a save: non-tensor state stored as JSON in the catalog, or as an array. Never pickle."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ucp_store import dtypes, names, typed_json
from ucp_store.catalog import models as m
from ucp_store.errors import DuplicateEntryError, ValidationError
from ucp_store.save.arrays import ArrayWriter

__all__ = ["ObjectWriter", "check_json"]


def check_json(name: str, value: Any) -> Any:
    """``value`` as the catalog stores it: plain JSON, with tuples, non-string dict keys and numpy scalars
    tagged (``typed_json``) so that :meth:`Checkpoint.objects` gives back the same types (``1.0`` stays a
    float, ``-0.0`` keeps its sign, big integers and NaN/Infinity stay what they are). What cannot be kept
    exactly (a set, an enum, a lone surrogate, ...) is a ValidationError naming the path inside the object."""
    try:
        encoded = typed_json.encode(value, f"objects[{name!r}]")
        m.encode_json(encoded)  # NaN/Infinity, integers of any size: what the column writes
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"object {name!r} is not JSON-serialisable ({exc}); store tensors as arrays, "
                              "never pickle") from None
    except RecursionError:
        raise ValidationError(f"object {name!r} is nested too deeply to store as JSON") from None
    return encoded


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
