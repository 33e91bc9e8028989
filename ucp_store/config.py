"""Every setting of ucp_store in one place: a frozen :class:`Settings`, the process's current one
(:func:`current`), and :func:`set` / :func:`override` to change it (like zarr-python's ``zarr.config``).

Why one home: routes used to be picked by environment switches read at import time in several modules, so
a process got whatever the environment said when each module loaded, and tests chose a route by patching
module globals. Now the code that decides asks :func:`current` (or one of the resolvers below) at the
moment it decides, and a caller, a test or a benchmark picks a strategy by argument or here::

    from ucp_store import config

    with config.override(local_read=False):   # every read through TensorStore, for this block
        ...
    config.set(export_threads=4)               # from now on, in this process

The settings are process-wide, not per thread (the I/O paths read them from their own pool threads): an
override is meant for a test, a benchmark or a program's start, not for two threads at once.

Only documented configuration comes from the environment, and only through this module, read when asked
(a launcher's or a test's setting made after import still counts). A field of the current settings left
None falls back to its variable; a value set here wins:

==================  ========================  ==========================================================
variable            resolver                  meaning
==================  ========================  ==========================================================
``UCP_STORE``       :func:`store_url`         the store when none is named (``ucp --store``, ``open_store``)
``UCP_CATALOG``     :func:`catalog_url`       the catalog database URL, overriding any store's own
``UCP_PROGRESS``    :func:`progress`          ``0``: never draw progress bars, ``1``: always
``UCP_DIST_TIMEOUT`` :func:`dist_timeout`     seconds a ucp_store collective may wait (default 300)
``UCP_KILL_AT``     :func:`kill_at`           test-only crash injection (``ucp_store._killpoints``)
``UCP_NODE``        :func:`node`              this process's node name (tiers; default: the host name)
``UCP_FAST_TIER``   :func:`fast_tier`         the node-local fast tier's folder, ``{node}`` filled in (tiers)
==================  ========================  ==========================================================

The tuning fields (``local_read``, ``local_write``, ``import_inflight_bytes``, ``export_threads``, the pool
sizes) have no environment variable: they are chosen here or by argument.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ucp_store.errors import ConfigurationError

__all__ = ["Settings", "current", "set", "override", "store_url", "catalog_url", "progress", "dist_timeout",
           "kill_at", "node", "fast_tier", "DEFAULT_DIST_TIMEOUT", "DEFAULT_IMPORT_INFLIGHT_BYTES"]

DEFAULT_DIST_TIMEOUT = 300.0
DEFAULT_IMPORT_INFLIGHT_BYTES = 256 << 20


@dataclass(frozen=True)
class Settings:
    """One value for every setting; see the module docstring for which ones the environment can give.

    Documented configuration (None: its environment variable decides, when asked):

    - ``store``: the store URL or folder used when none is named (``$UCP_STORE``).
    - ``catalog``: the catalog database URL, overriding any store's own (``$UCP_CATALOG``).
    - ``progress``: True / False to always / never draw progress bars (``$UCP_PROGRESS`` ``1`` / ``0``);
      None leaves it to the caller's ``progress=`` and whether stderr is a terminal.
    - ``dist_timeout``: seconds a ucp_store collective may wait (``$UCP_DIST_TIMEOUT``, else 300).
    - ``kill_at``: the armed kill point, ``name[:N]`` (``$UCP_KILL_AT``; tests only).
    - ``node``: this process's node name (``$UCP_NODE``, else the host name; ``tiers.node``).
    - ``fast_tier``: the fast tier's folder template, ``{node}`` filled in (``$UCP_FAST_TIER``; ``tiers.node``).

    Strategies and sizes:

    - ``local_read`` (True): a folder store's arrays with the store's own uncompressed chain are read by
      ``io.localread`` (pread straight into place); False sends every read through TensorStore, the path
      S3 and compressed stores always take (tests and benchmarks compare the two).
    - ``local_write`` (True): whole shard files of such arrays are written by ``io.localwrite``; False
      sends every write through TensorStore.
    - ``import_inflight_bytes`` (256 MiB): bytes an import writes between flushes
      (``formats.base.write_records``; its ``inflight_bytes=`` argument wins).
    - ``export_threads`` (None): threads of the Hugging Face export's pool; None: twice the CPUs, 2 to 16.
    - ``read_threads``, ``small_read_threads``, ``stream_threads``, ``write_threads`` (None: sized by the
      CPU count, see ``io.pools``): the I/O thread pools, each sized once, when it is first used.
    - ``sync_threads`` (None: 16): concurrent fsyncs of a deferred-durability pass (``save.durable``; the
      journal commits them together, so more in flight costs one commit, not one each).

    Delta versions (issue 39, ``save/delta.py``; a save's or run's ``delta="auto"`` turns them on):

    - ``delta_max_fraction`` (0.25): a tensor-state is stored as a delta of its base only when the delta's
      files are smaller than this fraction of the full array's bytes; otherwise in full.
    - ``delta_keyframe_every`` (8): a full array (keyframe) at least every this many versions of a
      tensor-state, so a chain holds at most ``delta_keyframe_every - 1`` deltas over its keyframe (1: never).
    - ``delta_codec`` (``zstd``): the deltas' compressor, ``zstd`` or ``blosc`` (zstd after a byte shuffle).
    - ``delta_min_bytes`` (64 KiB): smaller tensor-states are stored in full (a delta saves too little).
    """

    store: str | None = None
    catalog: str | None = None
    progress: bool | None = None
    dist_timeout: float | None = None
    kill_at: str | None = None
    node: str | None = None
    fast_tier: str | None = None
    local_read: bool = True
    local_write: bool = True
    import_inflight_bytes: int = DEFAULT_IMPORT_INFLIGHT_BYTES
    export_threads: int | None = None
    read_threads: int | None = None
    small_read_threads: int | None = None
    stream_threads: int | None = None
    write_threads: int | None = None
    sync_threads: int | None = None
    delta_max_fraction: float = 0.25
    delta_keyframe_every: int = 8
    delta_codec: str = "zstd"
    delta_min_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for name in ("local_read", "local_write"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"setting {name}={getattr(self, name)!r}: expected True or False")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ConfigurationError(f"setting progress={self.progress!r}: expected True, False or None")
        if self.dist_timeout is not None:
            _positive_seconds(self.dist_timeout, "setting dist_timeout")
        _positive_int(self.import_inflight_bytes, "import_inflight_bytes", "a number of bytes")
        for name in ("export_threads", "read_threads", "small_read_threads", "stream_threads", "write_threads",
                     "sync_threads"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), name, "a number of threads (or None)")
        _check_delta(self)
        for name in ("store", "catalog", "kill_at", "node", "fast_tier"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigurationError(f"setting {name}={value!r}: expected a string or None")

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes``; an unknown name raises ConfigurationError naming the known ones."""
        unknown = sorted(k for k in changes if k not in _FIELDS)
        if unknown:
            raise ConfigurationError(f"unknown setting {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
        return dataclasses.replace(self, **changes)


def _check_delta(s: Settings) -> None:
    f = s.delta_max_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise ConfigurationError(f"setting delta_max_fraction={f!r}: expected a fraction of the full size, in (0, 1]")
    _positive_int(s.delta_keyframe_every, "delta_keyframe_every", "a number of versions")
    _positive_int(s.delta_min_bytes, "delta_min_bytes", "a number of bytes")
    if s.delta_codec not in ("zstd", "blosc"):
        raise ConfigurationError(f"setting delta_codec={s.delta_codec!r}: expected 'zstd' or 'blosc'")


def _positive_int(value: Any, name: str, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"setting {name}={value!r}: expected {what}, at least 1")


def _positive_seconds(value: Any, where: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{where}={value!r}: expected a number of seconds") from None
    if seconds <= 0:
        raise ConfigurationError(f"{where}={value!r}: expected a positive number of seconds")
    return seconds


_FIELDS = tuple(f.name for f in dataclasses.fields(Settings))
_current = Settings()
_lock = threading.Lock()


def current() -> Settings:
    """The process's settings now (a frozen object: read a field, never assign one)."""
    return _current


def set(settings: Settings | None = None, /, **changes: Any) -> Settings:  # zarr.config.set's name
    """Make ``settings`` (default: the current ones) with ``changes`` the process's settings; the previous
    settings are returned, so ``config.set(previous)`` puts them back."""
    global _current
    with _lock:
        previous = _current
        base = previous if settings is None else settings
        if not isinstance(base, Settings):
            raise ConfigurationError(f"config.set: expected a Settings object, got {type(base).__name__}")
        _current = base.replace(**changes) if changes else base
    return previous


@contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """``changes`` for the duration of a ``with`` block (yields the settings in force); the settings from
    before are restored on the way out, also when the block raises."""
    previous = set(**changes)
    try:
        yield _current
    finally:
        set(previous)


# --- resolvers of the documented configuration: the setting, else its environment variable ------------

def store_url() -> str | None:
    """The store used when none is named: the ``store`` setting, else ``$UCP_STORE``, else None."""
    return _current.store or os.environ.get("UCP_STORE") or None


def catalog_url() -> str | None:
    """The catalog URL that overrides a store's own: the ``catalog`` setting, else ``$UCP_CATALOG``, else None."""
    return _current.catalog or os.environ.get("UCP_CATALOG") or None


def progress() -> bool | None:
    """Forced progress bars: the ``progress`` setting, else ``$UCP_PROGRESS`` (``0``: False, ``1``: True),
    else None (any other value of the variable too: the caller decides)."""
    if _current.progress is not None:
        return _current.progress
    return {"0": False, "1": True}.get(os.environ.get("UCP_PROGRESS", ""))


def dist_timeout() -> float:
    """Seconds a ucp_store collective may wait: the ``dist_timeout`` setting, else ``$UCP_DIST_TIMEOUT``,
    else 300. A variable that is not a positive number raises ConfigurationError naming it."""
    if _current.dist_timeout is not None:
        return float(_current.dist_timeout)
    raw = os.environ.get("UCP_DIST_TIMEOUT")
    if raw is None:
        return DEFAULT_DIST_TIMEOUT
    return _positive_seconds(raw, "UCP_DIST_TIMEOUT")


def node() -> str | None:
    """This process's node name when one is configured: the ``node`` setting, else ``$UCP_NODE``, else None
    (``tiers.node.node_name`` then takes the host name)."""
    return _current.node or os.environ.get("UCP_NODE") or None


def fast_tier() -> str | None:
    """The fast tier's folder template: the ``fast_tier`` setting, else ``$UCP_FAST_TIER``, else None."""
    return _current.fast_tier or os.environ.get("UCP_FAST_TIER") or None


def kill_at() -> str | None:
    """The armed kill point spec (``name[:N]``): the ``kill_at`` setting, else ``$UCP_KILL_AT``, else None."""
    return _current.kill_at or os.environ.get("UCP_KILL_AT") or None
