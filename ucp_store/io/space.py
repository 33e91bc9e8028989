"""Free space for what an export or ``read --out`` writes outside the store: checked before the first byte
(``require``), and a write that still runs out (the disk filled meanwhile) said as such (``guard``).

A full disk surfaces in many spellings: ``OSError(ENOSPC)``, torch's zip writer ("unexpected pos 768 vs
662"), numpy ("131072 requested and 81888 written"), DCP's writer wrapping either. ``guard`` turns any
failure while the destination's filesystem has less room than the write needed into one
:class:`~ucp_store.errors.WriteError`: ``no space left on <path>: ... needs about N bytes, F free``. The
caller removes its partial output (the exporters' temporary names) as before.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from ucp_store.errors import UcpError, WriteError

__all__ = ["free_bytes", "require", "guard", "is_no_space"]

_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _existing(path: str) -> str:
    """``path`` or its nearest existing ancestor (the filesystem a new file there lands on)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still put on ``path``'s filesystem (None when unknown)."""
    try:
        st = os.statvfs(_existing(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _message(path: str, needed: int, free: int | None, what: str) -> str:
    have = f"{free:,} bytes free" if free is not None else "the disk is full"
    return f"no space left on {path}: {what} needs about {needed:,} bytes, {have}"


def require(path: str, needed: int, what: str) -> None:
    """WriteError before anything is written when ``path``'s filesystem has less than ``needed`` bytes free."""
    free = free_bytes(path)
    if free is not None and free < needed:
        raise WriteError(_message(path, needed, free, what))


def is_no_space(exc: BaseException) -> bool:
    """An ``ENOSPC``/``EDQUOT`` OSError anywhere in ``exc``'s chain."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def guard(path: str, needed: int, what: str) -> Iterator[None]:
    """Run a write to ``path``; a failure is re-raised as ``no space left on <path>`` when it is ENOSPC, or
    when the filesystem, partial output still on it, has less free than the write needed (the writers that
    lose the errno: torch's zip writer, numpy)."""
    before = free_bytes(path)
    try:
        yield
    except (UcpError, OSError, RuntimeError, ValueError) as exc:
        if isinstance(exc, WriteError) and str(exc).startswith("no space left on "):
            raise
        free = free_bytes(path)
        if is_no_space(exc) or (free is not None and free < max(needed, 1)):
            raise WriteError(_message(path, needed, before, what)) from None
        raise
