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


# ------------------------------------------------------------------ how the suite is spread over xdist workers
# One unit of work per test file (xdist's loadscope, by file), so a module's costly fixture is made once; a
# unit given by test is split over both workers and made twice or more. (pytest 9 ignores xdist_group: the
# mark renames items after they are reported, so it cannot be relied on.)

#: files whose tests share a session fixture (tests/deepspeed/conftest.py ``ds``, ``resumes``): one unit
SHARED_UNITS = dict.fromkeys(("tests/deepspeed/test_bad_input.py", "tests/deepspeed/test_zero_import.py",
                              "tests/deepspeed/test_universal_and_distributed.py"), "deepspeed-session")

#: worker seconds of the longest units (a full run's --durations, rounded): they start first, so that no long
#: unit is left to run alone at the end while the other worker idles
UNIT_SECONDS = {
    "tests/test_dist.py": 220, "tests/test_scale_faults.py": 200, "tests/test_killpoints.py": 135,
    "deepspeed-session": 140, "tests/deepspeed/test_direct.py": 130, "tests/test_demo.py": 120,
    "tests/test_dist_device.py": 115, "tests/test_dcp_storage.py": 110, "tests/test_tiers_restore.py": 100,
    "tests/test_scale.py": 90, "tests/test_perrank.py": 80, "tests/deepspeed/test_moe.py": 80,
    "tests/test_tiers_dist.py": 80, "tests/test_issue40_inputs.py": 65, "tests/deepspeed/test_3d.py": 65,
    "tests/test_dcp_tiers.py": 60, "tests/deepspeed/test_one_writer_ds.py": 55,
    "tests/deepspeed/test_direct_tp.py": 50, "tests/deepspeed/test_one_client.py": 50,
    "tests/deepspeed/test_autoep.py": 45, "tests/test_dcp_roundtrip.py": 40, "tests/test_one_writer.py": 35,
    "tests/deepspeed/test_moe_tp.py": 30, "tests/test_perrank_paths.py": 30, "tests/test_arch_b_cli.py": 30,
    "tests/test_distributed.py": 28, "tests/test_perrank_imports.py": 28,
}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the shared unit of files that share a fixture."""
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: none without xdist (or with -p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False  # the order is the collection's, longest units first (below)
    return FileUnits(config, log)



def pytest_collection_modifyitems(config, items):
    """Longest units first (``UNIT_SECONDS``); the collection's order otherwise (a stable sort)."""
    items.sort(key=lambda item: -UNIT_SECONDS.get(unit_of(item.nodeid), 0))
