"""Names that come from users: runs, tensors, states, tags.

Array paths never derive from these names (arrays live at ``location.array_path``), but exporters
write folders named after tensors (DeepSpeed's ``zero/<param>/``), so a name must never be able to
escape a root: no absolute paths, no ``..`` or ``.`` components, no empty components, no backslashes,
no control characters.

Unicode: tensor and object names must be in NFC form (a name in NFD or another non-NFC spelling is
refused, naming its NFC form), so two spellings of one visible name can never become two tensors;
bidirectional controls (right-to-left marks and overrides, isolates) are refused because they make a
name display differently from what it is, and so are invisible characters (zero-width joiners and spaces,
other format characters, variation selectors, fillers, spaces other than U+0020, lone surrogates): a name
with one looks identical to the name without it.
"""

from __future__ import annotations

import re
import unicodedata

from ucp_store.errors import InvalidNameError

__all__ = ["tensor_name", "object_name", "run_name", "tag_name", "state_name"]

_RUN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_STATE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_FILLERS = frozenset("\u115f\u1160\u3164\uffa0\u034f")
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _invisible(name: str) -> str | None:
    """The first character of ``name`` that shows nothing or looks like a space: format characters (Cf: zero
    width joiners and spaces, soft hyphen, BOM, tag characters), lone surrogates, variation selectors, the
    Hangul fillers and every space other than U+0020."""
    for ch in name:
        cat = unicodedata.category(ch)
        if cat in ("Cf", "Cs", "Zl", "Zp") or (cat == "Zs" and ch != " ") or ch in _FILLERS \
                or 0xFE00 <= ord(ch) <= 0xFE0F or 0xE0100 <= ord(ch) <= 0xE01EF or 0x180B <= ord(ch) <= 0x180F:
            return ch
    return None


def _check_path_like(kind: str, name: str, max_len: int) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidNameError(f"{kind} name must be a non-empty string, got {name!r}")
    if len(name) > max_len:
        raise InvalidNameError(f"{kind} name {name[:60]!r}... is longer than {max_len} characters")
    if _CONTROL.search(name):
        raise InvalidNameError(f"{kind} name {name!r} contains control characters")
    bidi = _BIDI.search(name)
    if bidi:
        raise InvalidNameError(f"{kind} name {name!r} contains the bidirectional control U+{ord(bidi.group()):04X}; "
                               "it would display differently from what it names")
    hidden = _invisible(name)
    if hidden is not None and unicodedata.category(hidden) == "Cs":
        raise InvalidNameError(f"{kind} name {ascii(name)} contains the lone surrogate U+{ord(hidden):04X}, which "
                               "UTF-8 (and so the catalog) cannot store")
    if hidden is not None:
        raise InvalidNameError(f"{kind} name {ascii(name)} contains the invisible character U+{ord(hidden):04X} "
                               f"({unicodedata.name(hidden, unicodedata.category(hidden))}); two names differing only "
                               "in it would look the same")
    nfc = unicodedata.normalize("NFC", name)
    if nfc != name:
        raise InvalidNameError(f"{kind} name {ascii(name)} is not in Unicode NFC form; use {ascii(nfc)} (NFC and NFD "
                               "spellings of one name must not become two tensors)")
    if "\\" in name:
        raise InvalidNameError(f"{kind} name {name!r} contains a backslash; use '/' or '.' as separator")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name) or name.startswith("~"):
        raise InvalidNameError(f"{kind} name {name!r} is an absolute path; it would escape the store")
    for part in name.split("/"):
        if part in ("", ".", ".."):
            raise InvalidNameError(
                f"{kind} name {name!r} has a {part or 'empty'!r} path component; it would escape the store"
            )
    return name


def tensor_name(name: str) -> str:
    """Validate a tensor (parameter) name such as ``layers.0.attn.qkv.weight``."""
    return _check_path_like("tensor", name, 1024)


def object_name(name: str) -> str:
    return _check_path_like("object", name, 1024)


def run_name(name: str) -> str:
    """Run names are plain identifiers: letters, digits, ``.``, ``_``, ``-``; no ``..``."""
    if not isinstance(name, str) or not _RUN_RE.match(name) or ".." in name:
        raise InvalidNameError(
            f"run name {name!r} is invalid: use 1-200 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit, without '..' (run names never become paths outside the store)"
        )
    return name


def tag_name(name: str) -> str:
    if not isinstance(name, str) or not _RUN_RE.match(name) or ".." in name:
        raise InvalidNameError(f"tag name {name!r} is invalid: use 1-200 letters, digits, '.', '_' or '-'")
    return name


def state_name(name: str) -> str:
    if not isinstance(name, str) or not _STATE_RE.match(name):
        raise InvalidNameError(f"state name {name!r} is invalid: use letters, digits, '_', '.', '-' (max 64)")
    return name
