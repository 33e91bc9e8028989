"""Stored objects as JSON that keeps Python's types: tuples, dicts with non-string keys and numpy scalars
come back as what was saved, never as lists, ``"1"`` keys or plain floats.

A JSON value stays exactly what ``json`` writes (so the catalog text of plain configs, and SQL over it, is
unchanged). What JSON cannot hold is spelled as a one-key object, the tags the coordinator's wire format
uses (``distributed/coord.py``):

- a tuple: ``{"__ucp_tuple__": [items]}``;
- a dict with a key that is not a string (``1``, ``True``, ``1.5``, ``None``, a tuple), or a string-keyed
  dict whose only key is one of the tags: ``{"__ucp_map__": [[key, value], ...]}`` (insertion order);
- a numpy scalar (``np.float64(0.1)``): ``{"__ucp_np__": [dtype, [], bytes as hex]}``.

Anything else (a set, a bytes value, an enum, a ``float`` or ``dict`` subclass, an object) is refused with
a :class:`~ucp_store.errors.ValidationError` naming the path inside the object
(``objects['cfg']['layers'][3]``), and so is a string that UTF-8 cannot hold (a lone surrogate). Never a
pickle. A row stored before this encoding whose own dict is exactly one tag key is read as that tag.
"""

from __future__ import annotations

from typing import Any

from ucp_store.errors import ValidationError

__all__ = ["encode", "decode", "TUPLE", "MAP", "NP_SCALAR"]

TUPLE, MAP, NP_SCALAR = "__ucp_tuple__", "__ucp_map__", "__ucp_np__"
_TAGS = (TUPLE, MAP, NP_SCALAR)
_PLAIN = (bool, int, float, str, type(None))


def _check_text(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(f"{where} holds a string with a lone surrogate U+{ord(s[exc.start]):04X} at "
                              f"index {exc.start}, which UTF-8 (and so the catalog) cannot store") from None


def _numpy_scalar(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and getattr(value, "shape", None) == ()


def _key(k: Any, where: str) -> Any:
    """A dict key: a plain scalar, or a tuple of keys (anything hashable that :func:`decode` rebuilds)."""
    if type(k) in _PLAIN:
        if isinstance(k, str):
            _check_text(k, where)
        return k
    if type(k) is tuple:
        return {TUPLE: [_key(x, f"{where}[{i}]") for i, x in enumerate(k)]}
    raise ValidationError(f"{where} is a key of type {type(k).__module__}.{type(k).__qualname__}; object keys "
                          "must be str, int, float, bool, None or tuples of them")


def encode(value: Any, where: str = "object") -> Any:
    """``value`` as plain JSON values with the tags above; ``where`` names it in errors
    (``objects['cfg']``), extended by each step into it."""
    t = type(value)
    if t in _PLAIN:
        if t is str:
            _check_text(value, where)
        return value
    if t is list:
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if t is tuple:
        return {TUPLE: [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if t is dict:
        if all(type(k) is str for k in value) and not (len(value) == 1 and next(iter(value)) in _TAGS):
            out = {}
            for k, v in value.items():
                _check_text(k, f"{where} key {k!r}")
                out[k] = encode(v, f"{where}[{k!r}]")
            return out
        return {MAP: [[_key(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if _numpy_scalar(value) and not value.dtype.hasobject:
        return {NP_SCALAR: [value.dtype.str, [], value.tobytes().hex()]}
    raise ValidationError(f"{where} is a {t.__module__}.{t.__qualname__}, which is not stored exactly (objects hold "
                          "JSON values, tuples, dicts with scalar or tuple keys and numpy scalars; store tensors as "
                          "arrays; never a pickle)")


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def decode(value: Any) -> Any:
    """The value :func:`encode` encoded (a plain JSON value decodes to itself)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        try:
            if tag == TUPLE and isinstance(inner, list):
                return tuple(decode(v) for v in inner)
            if tag == MAP and isinstance(inner, list):
                return {_hashable(decode(k)): decode(v) for k, v in inner}
            if tag == NP_SCALAR and isinstance(inner, list) and len(inner) == 3:
                import numpy as np

                dtype, _, raw = inner
                return np.frombuffer(bytes.fromhex(raw), dtype=np.dtype(dtype))[0]
        except (TypeError, ValueError, IndexError):
            pass  # not this encoding's (a row written before it, or by hand): the plain JSON value
    return {k: decode(v) for k, v in value.items()}
