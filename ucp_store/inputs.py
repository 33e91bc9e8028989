"""Foreign input files (a torch file, a safetensors shard, a config, a DCP ``.metadata``, DeepSpeed files):
regular files only, checked before anything reads them.

Opening a FIFO for reading waits for a writer, forever; a socket or a device is no checkpoint either. So
every foreign input is stat-ed first (links followed: a Hugging Face cache links its snapshots to blobs)
and opened with ``O_NONBLOCK`` (a FIFO swapped in after the check opens at once and is refused by
``fstat``), the way the store treats its own files (``Location.check_regular``). The error says
``<path> is not a regular file (a FIFO)``, never "does not exist" or a hang.
"""

from __future__ import annotations

import os
import stat
from typing import Any, BinaryIO

from ucp_store.errors import SourceFormatError, UcpError

__all__ = ["file_kind", "present", "check_regular", "open_regular", "read_regular", "check_destination",
           "check_outside"]

_NONBLOCK = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (``a FIFO``)."""
    for test, words in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return words
    return f"mode {stat.filemode(mode)}"


def _refuse(path: str, mode: int, what: str, error: type[UcpError]) -> UcpError:
    label = f"{what} {path}" if what else path
    return error(f"{label} is not a regular file ({file_kind(mode)}); it is refused unread")


def present(path: str, what: str = "", error: type[UcpError] = SourceFormatError) -> bool:
    """True for a regular file (links followed), False when nothing is there (or a dangling link), and
    ``error`` for anything else there (a FIFO, socket, device or folder): ``os.path.isfile`` for inputs, minus
    the silent skip of a FIFO."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise error(f"{what + ' ' if what else ''}{path} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, st.st_mode, what, error)
    return True


def check_regular(path: str, what: str = "", error: type[UcpError] = SourceFormatError) -> None:
    """``error`` unless ``path`` is a regular file: missing, or something else (named)."""
    if not present(path, what, error):
        raise error(f"{what + ' ' if what else ''}{path} does not exist")


def open_regular(path: str, what: str = "", error: type[UcpError] = SourceFormatError) -> BinaryIO:
    """``open(path, "rb")`` of a regular file, refusing anything else without blocking."""
    try:
        fd = os.open(path, _NONBLOCK)
    except FileNotFoundError:
        raise error(f"{what + ' ' if what else ''}{path} does not exist") from None
    except OSError as exc:
        raise error(f"{what + ' ' if what else ''}{path} cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, st.st_mode, what, error)
        if _NONBLOCK & os.O_NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, what: str = "", error: type[UcpError] = SourceFormatError) -> bytes:
    """The whole of a regular file (:func:`open_regular`)."""
    with open_regular(path, what, error) as f:
        try:
            return f.read()
        except OSError as exc:
            raise error(f"{what + ' ' if what else ''}{path} cannot be read: {exc.strerror or exc}") from None


def check_destination(path: str, what: str = "", error: type[UcpError] = UcpError) -> None:
    """Refuse an output path that exists and is no regular file: a FIFO, a device such as ``/dev/null``, a
    socket, or a symbolic link (``/dev/stdout`` is one). Exporters write a temporary file and rename it over
    the destination, which would replace that node or link itself, not write through it."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there: the rename makes the file
    except OSError as exc:
        raise error(f"{what + ' ' if what else ''}{path} cannot be checked: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        raise error(f"{what + ' ' if what else ''}{path} exists and is not a regular file ({file_kind(st.st_mode)}); "
                    "the output is written under a temporary name and renamed over it, which would replace it "
                    "rather than write through it: give the path of a file")


def check_outside(path: str, location: Any, what: str = "", error: type[UcpError] = UcpError) -> None:
    """Refuse an output path inside a folder store's root (``location``: the store's ``Location``; a bucket
    has nothing to check): an export or ``read --out`` there would replace the store's own files
    (``catalog.db``, an array) or leave files in it that no catalog row names."""
    if getattr(location, "kind", None) != "file":
        return
    root = location.root
    base = os.path.realpath(root)
    target = os.path.realpath(os.path.abspath(path))
    if target == base or target.startswith(base.rstrip(os.sep) + os.sep):
        raise error(f"{what + ' ' if what else ''}{path} is inside the store {root}; outputs are written outside "
                    "the store, never over or among its own files")
