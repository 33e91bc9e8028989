"""ucp_store.config: one home for every setting; overrides restore, bad values name the setting, and the
documented environment variables are read there, when asked, with a setting winning over its variable."""

from __future__ import annotations

import os
import threading

import pytest

from ucp_store import config
from ucp_store.errors import ConfigurationError


def test_defaults_and_override_restores():
    before = config.current()
    assert before.local_read and before.local_write and before.export_threads is None
    assert before.import_inflight_bytes == config.DEFAULT_IMPORT_INFLIGHT_BYTES
    with config.override(local_read=False, export_threads=3) as now:
        assert now is config.current() and not now.local_read and now.export_threads == 3
        with config.override(local_read=True):
            assert config.current().local_read and config.current().export_threads == 3
        assert not config.current().local_read
    assert config.current() is before
    with pytest.raises(RuntimeError), config.override(local_write=False):
        raise RuntimeError("boom")
    assert config.current() is before  # restored when the block raises too


def test_set_returns_the_previous_settings():
    previous = config.set(import_inflight_bytes=1 << 20)
    try:
        assert config.current().import_inflight_bytes == 1 << 20 and previous.import_inflight_bytes != 1 << 20
    finally:
        config.set(previous)
    assert config.current() is previous


def test_settings_are_process_wide():
    """Pool threads see an override made by the caller (the I/O paths decide on their own threads)."""
    seen = []
    with config.override(local_read=False):
        t = threading.Thread(target=lambda: seen.append(config.current().local_read))
        t.start()
        t.join()
    assert seen == [False]


@pytest.mark.parametrize("changes, match", [
    ({"local_reed": False}, r"unknown setting local_reed; known: store, catalog"),
    ({"local_read": "no"}, r"local_read='no': expected True or False"),
    ({"export_threads": 0}, r"export_threads=0: expected a number of threads"),
    ({"import_inflight_bytes": -1}, r"import_inflight_bytes=-1: expected a number of bytes"),
    ({"dist_timeout": 0}, r"dist_timeout=0: expected a positive number of seconds"),
    ({"progress": "1"}, r"progress='1': expected True, False or None"),
])
def test_bad_settings_name_the_setting(changes, match):
    before = config.current()
    with pytest.raises(ConfigurationError, match=match):
        config.set(**changes)
    assert config.current() is before


def test_environment_fallbacks(monkeypatch):
    for var in ("UCP_STORE", "UCP_CATALOG", "UCP_PROGRESS", "UCP_DIST_TIMEOUT", "UCP_KILL_AT"):
        monkeypatch.delenv(var, raising=False)
    assert (config.store_url(), config.catalog_url(), config.progress(), config.kill_at()) == (None,) * 4
    assert config.dist_timeout() == config.DEFAULT_DIST_TIMEOUT
    monkeypatch.setenv("UCP_STORE", "/s")
    monkeypatch.setenv("UCP_CATALOG", "sqlite:///c.db")
    monkeypatch.setenv("UCP_PROGRESS", "1")
    monkeypatch.setenv("UCP_DIST_TIMEOUT", "12.5")
    monkeypatch.setenv("UCP_KILL_AT", "commit.after:2")
    assert (config.store_url(), config.catalog_url(), config.progress(), config.kill_at()) == (
        "/s", "sqlite:///c.db", True, "commit.after:2")
    assert config.dist_timeout() == 12.5
    with config.override(store="/t", catalog="sqlite:///d.db", progress=False, dist_timeout=7, kill_at="rm.after_row"):
        assert (config.store_url(), config.catalog_url(), config.progress(), config.kill_at()) == (
            "/t", "sqlite:///d.db", False, "rm.after_row")
        assert config.dist_timeout() == 7.0  # a setting wins over its variable
    monkeypatch.setenv("UCP_PROGRESS", "maybe")
    assert config.progress() is None  # neither 0 nor 1: the caller decides, as before
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("UCP_DIST_TIMEOUT", bad)
        with pytest.raises(ConfigurationError, match=rf"UCP_DIST_TIMEOUT='{bad}': expected a"):
            config.dist_timeout()


def test_modules_ask_config():
    """The paths that used to read their own switches take them from the current settings."""
    from ucp_store import progress
    from ucp_store.distributed.commit import default_timeout
    from ucp_store.formats.base import _default_inflight
    from ucp_store.formats.hf.adapter import _export_threads

    with config.override(progress=True, dist_timeout=42, import_inflight_bytes=5 << 20, export_threads=5):
        assert progress.wanted(False) is True
        assert default_timeout() == 42.0
        assert _default_inflight() == 5 << 20
        assert _export_threads() == 5
    with config.override(progress=False):
        assert progress.wanted(True) is False


def test_pool_sizes_come_from_config_else_the_cpu_count():
    from ucp_store.io.pools import LazyPool

    pool = LazyPool("ucp-test", "read_threads", lambda cpus: 1000 + cpus)
    assert pool.size() == 1000 + (os.cpu_count() or 1)
    with config.override(read_threads=3):
        assert pool.size() == 3
    with pytest.raises(ConfigurationError, match=r"setting write_threads=0: expected a number of threads"):
        config.set(write_threads=0)
