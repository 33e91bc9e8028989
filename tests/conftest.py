"""Fixtures of the foundation tests (format, store, CLI, crash, concurrency, security).

Plain helper functions live in ``tests/ucp_test_helpers.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ucp_store
from ucp_store import cli
from ucp_store.io import format as fmt
from ucp_store.save.writer import CheckpointWriter

# Re-exported for modules that still write ``from conftest import ...`` (e.g. tests/test_distributed.py);
# that form is ambiguous once tests/deepspeed/conftest.py exists: import from ucp_test_helpers instead.
from ucp_test_helpers import (  # noqa: E402,F401
    REPO,
    array_folders,
    bits,
    flip_byte,
    flip_chunk_byte,
    python_env,
    random_bits,
    run_python,
    shard_file_and_range,
    tree_digest,
    wait_for,
)


@pytest.fixture(autouse=True)
def _ucp_env(monkeypatch):
    """No progress bars, and no store / catalog leaking in from the environment."""
    monkeypatch.setenv("UCP_PROGRESS", "0")
    monkeypatch.delenv("UCP_STORE", raising=False)
    monkeypatch.delenv("UCP_CATALOG", raising=False)
    yield
    snap = sys.modules.get("ucp_store.distributed.snapshot")
    if snap is not None:  # a test's optimizer gate would make every later async_save in this worker lazy
        snap.remove_gate()


@pytest.fixture
def store_path(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_path):
    """A fresh, empty store in tmp_path."""
    return ucp_store.open_store(str(store_path), create=True)


@pytest.fixture
def ucp(capsys):
    """Run ``ucp ARGS...`` in-process; returns (exit code, stdout, stderr)."""

    def run(*argv):
        capsys.readouterr()
        rc = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture
def small_chunks(monkeypatch):
    """Make writers use tiny explicit chunk/shard shapes so that small tensors span many chunks.

    ``small_chunks(chunk_fn)``: ``chunk_fn(shape) -> (chunk_shape, shard_shape)``. The catalog records
    what was used, so readers see the real layout.
    """

    def install(chunk_fn):
        def _layout(self, shape, dtype, pattern, boundaries=None, shard_shape=None):
            shape = tuple(int(s) for s in shape)
            if not shape or 0 in shape:
                return fmt.plan_layout(shape, dtype, compression=self.store.settings["compression"])
            chunk, shard = chunk_fn(shape)
            return fmt.ArrayLayout(dtype, shape, tuple(chunk), tuple(shard), self.store.settings["compression"])

        monkeypatch.setattr(CheckpointWriter, "_layout", _layout)

    return install
