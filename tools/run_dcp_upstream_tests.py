"""Run PyTorch's own DCP tests with ucp_store substituted for DCP's filesystem storage (issue 29).

    .venv/bin/python tools/run_dcp_upstream_tests.py [--cache DIR] [--only FILE ...] [--baseline] [-- PYTEST_ARGS]

The test files come from the PyTorch release that matches the installed torch (tag ``v<torch version>``),
downloaded at run time from raw.githubusercontent.com into a cache outside the repository
(``~/.cache/ucp_store/pytorch-tests/<tag>``, or ``--cache``); they are never committed. Without network,
put the files there by other means (the layout is the repository's: ``test/distributed/checkpoint/...``;
a ``SOURCE`` file in the cache says where they came from).

The shim (:func:`install`, this file's only coupling to the tests): each test file is copied into a
temporary folder with ONE line prepended, ``import run_dcp_upstream_tests; run_dcp_upstream_tests.install()``,
which replaces ``torch.distributed.checkpoint.FileSystemWriter`` / ``FileSystemReader`` (the package names
the tests import, and the ones ``dcp.save(checkpoint_id=PATH)`` picks in ``_storage_utils``) by
:class:`ShimWriter` / :class:`ShimReader`: subclasses of the ucp backend that take DCP's folder path as a
ucp store (created on first use) holding run ``dcp``. Each save commits the next step of that run; each
load reads ``dcp@latest``. Filesystem-only options (``thread_count``, ``sync_files``, ``_extensions``,
``serialization_format``, ...) are accepted and ignored. Because the line is part of the module, the
spawned rank processes of ``MultiProcessTestCase`` run it too.

``--baseline`` runs the same files unpatched (DCP's own filesystem storage), to tell a failure of the
backend from a test that fails on this torch anyway (the line is prepended there too, with ``backend=False``:
it then only adds the test helpers a newer test file imports and this torch lacks). ``--allow-cpu`` lifts
upstream's GPU gates (``skip_if_lt_x_gpu(n)`` becomes ``skip_if_lt_x_gpu(n, allow_cpu=True)``, with or
without ``--baseline``): most DTensor tests are gated on 2 or 4 GPUs although they use ``self.device_type``
(``cpu`` here, gloo), so without it they skip on a CPU host. Tests that call ``.cuda()`` then fail on both
sides. The script prints pass/skip/fail counts per file and each failure's last error line;
docs/dcp-backend.md records a run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

FILES = [
    "test/distributed/checkpoint/test_file_system_checkpoint_cpu.py",
    "test/distributed/checkpoint/test_dtensor_resharding.py",
    "test/distributed/checkpoint/test_dtensor_checkpoint.py",
    "test/distributed/checkpoint/e2e/test_e2e_save_and_load.py",
    "test/distributed/checkpoint/test_save_load_api.py",
]
SHIM_LINE = "import run_dcp_upstream_tests; run_dcp_upstream_tests.install({args})  # ucp_store shim\n"
RUN = "dcp"


# ------------------------------------------------------------------------------------------------ shim
def _store_at(path: Any):
    """The ucp store in DCP's checkpoint folder ``path`` (created on first use; rank 0 first when ranks run)."""
    import torch.distributed as dist

    from ucp_store import open_store

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_rank() == 0:
            st = open_store(path, create=True)
        dist.barrier()
        if dist.get_rank() != 0:
            st = open_store(path)
        return st
    return open_store(path, create=True)


def _shim_classes():
    from ucp_store.formats.dcp.storage import UcpStorageReader, UcpStorageWriter

    class ShimWriter(UcpStorageWriter):
        """``FileSystemWriter(path, ...)`` -> the next step of run ``dcp`` in the store at ``path``."""

        def __init__(self, path: Any = None, *args: Any, **kwargs: Any):
            self._path = path
            super().__init__(_store_at(path), run=RUN, step=0)

        def reset(self, checkpoint_id: Any = None) -> None:
            super().reset()
            if checkpoint_id is not None and os.fspath(checkpoint_id) != os.fspath(self._path):
                self.__init__(checkpoint_id)  # type: ignore[misc]

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return isinstance(checkpoint_id, (str, os.PathLike))

        def prepare_global_plan(self, plans):  # the coordinator picks the step after the latest
            runs = {r["run"]: r for r in self.store.runs()}
            latest = runs.get(RUN, {}).get("latest_step")
            self.step = 0 if latest is None else int(latest) + 1
            return super().prepare_global_plan(plans)

    class ShimReader(UcpStorageReader):
        """``FileSystemReader(path, ...)`` -> ``dcp@latest`` of the store at ``path``."""

        def __init__(self, path: Any = None, *args: Any, **kwargs: Any):
            self._path = path
            super().__init__(_store_at(path), f"{RUN}@latest")

        def reset(self, checkpoint_id: Any = None) -> None:
            if checkpoint_id is not None and os.fspath(checkpoint_id) != os.fspath(self._path):
                self.__init__(checkpoint_id)  # type: ignore[misc]
            super().reset()

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return isinstance(checkpoint_id, (str, os.PathLike))

    return ShimWriter, ShimReader


def _allow_cpu() -> None:
    """``skip_if_lt_x_gpu(n)`` -> ``skip_if_lt_x_gpu(n, allow_cpu=True)`` for the test modules imported later."""
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed._tensor import common_dtensor

    gate = common_distributed.skip_if_lt_x_gpu

    def lifted(x, **kwargs):
        return gate(x, **{**kwargs, "allow_cpu": True})

    common_distributed.skip_if_lt_x_gpu = lifted  # type: ignore[assignment]
    common_dtensor.skip_if_lt_x_gpu = lifted  # type: ignore[attr-defined]


def _compat() -> None:
    """Helpers newer test files import from ``torch.testing._internal`` that the installed torch lacks, added
    with the meaning they have upstream (the stored test files are not all of the installed release)."""
    import torch
    from torch.testing._internal.distributed._tensor import common_dtensor

    if not hasattr(common_dtensor, "_get_device_type"):
        def _get_device_type(world_size: int) -> str:  # upstream: the accelerator when it has enough devices
            acc = torch.accelerator.current_accelerator()
            return acc.type if acc is not None and torch.accelerator.device_count() >= world_size else "cpu"

        common_dtensor._get_device_type = _get_device_type  # type: ignore[attr-defined]


def install(backend: bool = True, allow_cpu: bool = False) -> None:
    """Substitute the ucp backend for DCP's filesystem storage in this process (see the module doc);
    ``backend=False`` (``--baseline``) leaves DCP's storage; ``allow_cpu``: lift the GPU gates (``--allow-cpu``).
    Both add the test helpers the installed torch lacks (:func:`_compat`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import _storage_utils

    _compat()
    if allow_cpu:
        _allow_cpu()
    if not backend:
        return
    writer, reader = _shim_classes()
    for mod in (dcp, _storage_utils):
        mod.FileSystemWriter = writer  # type: ignore[attr-defined,misc]
        mod.FileSystemReader = reader  # type: ignore[attr-defined,misc]


# ----------------------------------------------------------------------------------------------- fetch
def _tag() -> str:
    import torch

    return "v" + torch.__version__.split("+")[0]


def fetch(cache: Path, tag: str, files: list[str]) -> None:
    """Each test file into ``cache`` (kept; downloaded once) from the release tag on GitHub."""
    for rel in files:
        dest = cache / rel
        if dest.exists():
            continue
        url = f"https://raw.githubusercontent.com/pytorch/pytorch/{tag}/{rel}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                data = r.read()
        except OSError as exc:
            sys.exit(f"run_dcp_upstream_tests: cannot download {url} ({exc}); without network put the file at "
                     f"{dest} (PyTorch's repository at {tag})")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        with open(cache / "SOURCE", "a") as f:
            f.write(f"{rel} {url}\n")


# ------------------------------------------------------------------------------------------------- run
_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|xfailed|xpassed)")


def run_file(cache: Path, rel: str, work: Path, baseline: bool, pytest_args: list[str],
             allow_cpu: bool = False) -> dict:
    src = (cache / rel).read_text()
    dest = work / Path(rel).name
    dest.write_text(SHIM_LINE.format(args=f"backend={not baseline}, allow_cpu={allow_cpu}") + src)
    # torch.testing's helpers need expecttest, which the project does not: `pip install --target
    # <cache>/../deps expecttest` puts it beside the cached files instead of into the environment
    deps = cache.parent / "deps"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), str(work), str(deps),
                                                        os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-n", "0",
                           str(dest), *pytest_args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    counts: dict[str, int] = {}
    for n, kind in _SUMMARY.findall(out.splitlines()[-1] if out.strip() else ""):
        counts[kind.rstrip("s") if kind == "errors" else kind] = int(n)
    failures = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"file": rel, "counts": counts, "failures": failures, "rc": proc.returncode, "tail": out[-4000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--only", action="append", default=None, help="a test file path (repeatable)")
    ap.add_argument("--baseline", action="store_true", help="run unpatched (DCP's own filesystem storage)")
    ap.add_argument("--verbose", action="store_true", help="print each file's pytest output tail")
    ap.add_argument("--allow-cpu", action="store_true", help="lift upstream's GPU gates (skip_if_lt_x_gpu)")
    ap.add_argument("pytest_args", nargs="*")
    args = ap.parse_args(argv)
    tag = _tag()
    cache = args.cache or Path.home() / ".cache" / "ucp_store" / "pytorch-tests" / tag
    files = args.only or FILES
    fetch(cache, tag, files)
    work = Path(tempfile.mkdtemp(prefix="ucp-dcp-upstream-"))
    total: dict[str, int] = {}
    try:
        for rel in files:
            r = run_file(cache, rel, work, args.baseline, args.pytest_args, args.allow_cpu)
            for k, n in r["counts"].items():
                total[k] = total.get(k, 0) + n
            print(f"{rel}: {r['counts']} (rc {r['rc']})")
            for line in r["failures"]:
                print(f"    {line}")
            if args.verbose or (r["rc"] not in (0, 1) and not r["counts"]):
                print(r["tail"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"total ({'baseline: DCP filesystem' if args.baseline else 'ucp backend'}, torch {tag}): {total}")
    return 0 if not total.get("failed") and not total.get("error") else 1


if __name__ == "__main__":
    sys.exit(main())
