"""A nested training state dict as a flat list of leaves, each tensor with its catalog key (pure).

``get_state_dict(model, optimizer)`` gives nested dicts and lists: model parameters keyed by FQN, and an
optimizer dict ``{"state": {fqn: {"step", "exp_avg", ...}}, "param_groups": [...]}`` (or its flattened
form ``{"state.<fqn>.exp_avg": ..., "param_groups.<fqn>.lr": ...}``). Each tensor becomes one catalog
tensor-state ``(name, state)`` so that ``ucp show`` lists a parameter with all its states:

- a tensor under an optimizer dict's ``state[fqn][s]`` -> ``(fqn, s)``; when the optimizer dict sits
  somewhere other than the root or a top-level ``optim``/``optimizer`` key, the state is prefixed with
  its path (``(fqn, "opt2.exp_avg")``) so two optimizers never collide;
- any other tensor -> ``(dotted path, "weight")``, where a leading top-level ``model`` key is dropped.

Everything else (numbers, strings, lists of plain values, None) is a JSON leaf stored by its path.
Paths keep their element types (a list index stays an int), so a load finds each leaf again.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ucp_store import names
from ucp_store.errors import ConfigurationError, InvalidNameError

__all__ = ["STATE_DICT_OBJECT", "Leaf", "flatten", "from_json", "json_value", "path_text", "set_leaf"]

#: name of the JSON object holding the state dict's structure (tensor keys and non-tensor values by path)
STATE_DICT_OBJECT = "dist.state_dict"

_OPT_ROOTS = {(), ("optim",), ("optimizer",)}


@dataclass
class Leaf:
    """One leaf: its ``path`` in the nested dict, its value, and for tensors the catalog ``key``."""

    path: tuple
    value: Any
    key: tuple[str, str] | None = None

    @property
    def is_tensor(self) -> bool:
        return self.key is not None


def path_text(path: tuple) -> str:
    """A path as text for messages and JSON (``optim.param_groups.0.lr``)."""
    return ".".join(str(p) for p in path)


def _is_optimizer(d: dict) -> bool:
    return isinstance(d.get("state"), dict) and isinstance(d.get("param_groups"), list)


def _is_flat_optimizer(d: dict) -> bool:
    return bool(d) and all(isinstance(k, str) and (k.startswith(("state.", "param_groups.")))
                           for k in d) and any(k.startswith("state.") for k in d)


def _state_name(prefix: tuple, s: str) -> str:
    return s if prefix in _OPT_ROOTS else f"{path_text(prefix)}.{s}"


def flatten(state_dict: Any) -> list[Leaf]:
    """Every leaf of ``state_dict`` in a deterministic order (dict insertion order, list order).

    Raises ``ConfigurationError`` when two tensors would share a catalog key, ``InvalidNameError`` for a
    name that could escape the store."""
    if not isinstance(state_dict, dict):
        raise ConfigurationError(f"state_dict must be a dict (as get_state_dict returns), got "
                                 f"{type(state_dict).__name__}")
    leaves: list[Leaf] = []

    def walk(obj: Any, path: tuple, opt: tuple | None, opt_prefix: tuple) -> None:
        if isinstance(obj, dict):
            if opt is None and _is_optimizer(obj):
                for k, v in obj.items():
                    walk(v, path + (k,), ("nested",), path)
                return
            if opt is None and _is_flat_optimizer(obj):
                for k, v in obj.items():
                    walk(v, path + (k,), ("flat",), path)
                return
            for k, v in obj.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise ConfigurationError(f"state dict key {k!r} at {path_text(path) or '<root>'}: keys must be "
                                             "strings or integers")
                walk(v, path + (k,), opt, opt_prefix)
            return
        if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in obj):
            for i, v in enumerate(obj):
                walk(v, path + (i,), opt, opt_prefix)
            return
        if isinstance(obj, torch.Tensor):
            leaves.append(Leaf(path, obj, _tensor_key(path, opt, opt_prefix)))
        else:
            leaves.append(Leaf(path, obj))

    walk(state_dict, (), None, ())
    seen: dict[tuple[str, str], tuple] = {}
    for leaf in leaves:
        if leaf.key is None:
            continue
        other = seen.get(leaf.key)
        if other is not None:
            raise ConfigurationError(f"state dict entries {path_text(other)!r} and {path_text(leaf.path)!r} both map "
                                     f"to tensor {leaf.key[0]!r} state {leaf.key[1]!r}; rename one of them")
        seen[leaf.key] = leaf.path
        try:
            _check_key(leaf.key)
        except InvalidNameError as exc:
            raise InvalidNameError(f"state dict entry {path_text(leaf.path)!r}: {exc}") from None
    return leaves


@functools.lru_cache(maxsize=1 << 16)
def _check_key(key: tuple[str, str]) -> None:
    """The names' checks, once per key (every save of a state dict checks the same keys again; a failed check
    raises and is not cached)."""
    names.tensor_name(key[0])
    names.state_name(key[1])


@functools.lru_cache(maxsize=1 << 16)
def _tensor_key(path: tuple, opt: tuple | None, opt_prefix: tuple) -> tuple[str, str]:
    rel = path[len(opt_prefix):]
    if opt == ("nested",) and len(rel) == 3 and rel[0] == "state":
        return str(rel[1]), _state_name(opt_prefix, str(rel[2]))
    if opt == ("flat",) and len(rel) == 1 and str(rel[0]).startswith("state."):
        fqn, _, s = str(rel[0])[len("state."):].rpartition(".")
        if fqn:
            return fqn, _state_name(opt_prefix, s)
    if len(path) > 1 and path[0] == "model":
        return path_text(path[1:]), "weight"
    return path_text(path), "weight"


def json_value(leaf: Leaf) -> Any:
    """A non-tensor leaf as JSON (tuples become lists); raises naming the path if it is not JSON."""
    v = leaf.value
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    raise ConfigurationError(f"state dict entry {path_text(leaf.path)!r} holds a {type(v).__name__}, which is "
                             "neither a tensor nor JSON (numbers, strings, lists of them, None); ucp_store never "
                             "pickles")


def from_json(stored: Any, current: Any) -> Any:
    """A stored JSON leaf back in the type of the live one (tuples stay tuples, inf/nan floats come back)."""
    if isinstance(current, tuple) and isinstance(stored, list):
        return tuple(stored)
    if isinstance(current, float) and isinstance(stored, str):
        return float(stored)
    return stored


def set_leaf(root: Any, path: tuple, value: Any) -> None:
    """Replace the leaf at ``path`` (its parent must be a dict or a list)."""
    parent = root
    for p in path[:-1]:
        parent = parent[p]
    if isinstance(parent, tuple):
        raise ConfigurationError(f"state dict entry {path_text(path)!r} sits in a tuple; cannot load it in place")
    parent[path[-1]] = value
