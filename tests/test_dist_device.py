"""ucp_store.distributed on real ranks of a device mesh: tests/dist_device_check.py run as a subprocess.

The same script runs on CPU ranks (gloo) everywhere and on CUDA ranks (NCCL) where there are GPUs: DTensor
parameters (FSDP2, TP from 4 ranks) trained 2 AdamW steps on the device, then ``save``, ``async_save``
(thread and process mode, the state mutated right after the call), ``load`` in place into the zeroed
state dict (bit for bit, on the device and through ``.cpu()``, same objects, devices, meshes and
placements) and ``verify``; ``--cross`` loads the checkpoint on CPU ranks of another world and layout and
compares it with the logical tensors. Each rank's checks are asserted here one by one, and the script's
own failure paths (a corrupted element, a crashed rank, a hung rank, too few GPUs) must fail it.

The CUDA tests skip without CUDA or NCCL (hardware gating). On the GPU machine (python3 there already holds
a CUDA torch; nothing can be downloaded there), first here, in the repository root, fetch ucp_store's
dependencies that its image lacks (``/.whl/`` is git-ignored, so ``carry`` must name it)::

    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1

then run, with ``carry: [".whl"]`` and ``timeout_s: 480``, this one line::

    set -o pipefail; python3 -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), "gpus", torch.cuda.device_count()); sys.exit(0 if torch.cuda.is_available() else 3)' || { echo "python3 has no CUDA torch; nothing can be installed on this machine"; exit 3; }; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 5; export PYTHONPATH=/tmp/site UCP_PROGRESS=0 PYTHONUNBUFFERED=1 UCP_DEVICE_CHECK_KEEP=$OUT; nvidia-smi -L; python3 -m pytest -v -p no:cacheprovider tests/test_dist_device.py 2>&1 | tee $OUT/pytest.log

The CUDA test's summary and per-rank JSON (torch version, backend, device name, timings, every check) come
back in ``$OUT`` beside the log.
"""  # noqa: E501 - the two commands above are single lines to copy as they are

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ucp_test_helpers import REPO, run_python

SCRIPT = REPO / "tests" / "dist_device_check.py"

MAIN_CHECKS = {
    "backend", "control_group_beside_default_pg", "params_are_dtensors_on_device", "state_dict_on_device",
    "verify_after_save",
    "catalog_has_every_tensor", "async_thread_is_state_at_call", "async_thread_mutation_detected",
    "async_thread_equals_save", "async_process_is_state_at_call", "async_process_mutation_detected",
    "async_lazy_is_state_at_call", "async_lazy_mutation_detected",
    "load_in_place", "load_bit_equal_on_device", "load_bit_equal_host", "load_stays_on_device", "verify_after_load",
    "trains_after_load",
}
CROSS_CHECKS = {"backend", "control_group_beside_default_pg", "cross_load_equals_logical", "cross_stays_on_device",
                "cross_verify"}

pytestmark = pytest.mark.xdist_group("dist_device")  # one worker: the ranks of two runs would share 2 cores


def _cuda_ready() -> str | None:
    """Why the CUDA tests cannot run here (None when they can)."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return f"torch {torch.__version__} has no NCCL backend"
    return None


def _run(tmp_path, *args, timeout=480):
    out = tmp_path / "out"
    proc = run_python([str(SCRIPT), *args, "--out", str(out)], timeout=timeout, UCP_DIST_TIMEOUT="60")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    summary = json.loads(lines[-1]) if lines else None
    return proc, summary, out


def _rank(out, phase, r):
    path = out / phase / f"rank{r}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _keep(out, tag):
    """Copy the summary and the per-rank JSON to ``$UCP_DEVICE_CHECK_KEEP`` (the device run's $OUT)."""
    keep = os.environ.get("UCP_DEVICE_CHECK_KEEP")
    if not keep or not out.exists():
        return
    os.makedirs(keep, exist_ok=True)
    if (out / "summary.json").exists():
        shutil.copy(out / "summary.json", os.path.join(keep, f"{tag}-summary.json"))
    for phase in ("main", "cross"):
        for path in sorted((out / phase).glob("rank*.json")) if (out / phase).exists() else ():
            shutil.copy(path, os.path.join(keep, f"{tag}-{phase}-{path.name}"))


def _passed(proc, summary, out, phases):
    """Every rank of every phase reported, none crashed, and every expected check ran and passed."""
    tail = proc.stderr[-4000:]
    assert summary is not None, f"no summary line (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{tail}"
    assert proc.returncode == 0 and summary["ok"] and summary["exit"] == 0, (summary, tail)
    assert [p["phase"] for p in summary["phases"]] == [name for name, _, _ in phases], summary
    for name, world, expected in phases:
        for r in range(world):
            res = _rank(out, name, r)
            assert res is not None, f"{name} rank {r} wrote no report\n{tail}"
            assert "crash" not in res, res["crash"]
            assert expected <= set(res["checks"]), f"{name} rank {r} skipped {sorted(expected - set(res['checks']))}"
            failed = {n: c["detail"] for n, c in res["checks"].items() if not c["ok"]}
            assert not failed, f"{name} rank {r}: {failed}"
            assert res["torch"] == torch.__version__ and res["timings"]["load_s"] > 0, res
    return summary


@pytest.mark.parametrize(("world", "cross"), [(1, True), (2, False)])
def test_cpu_ranks_save_async_load_verify(tmp_path, world, cross):
    proc, summary, out = _run(tmp_path, "--device", "cpu", "--world", str(world), *(["--cross"] if cross else []))
    phases = [("main", world, MAIN_CHECKS)] + ([("cross", 2, CROSS_CHECKS)] if cross else [])
    _passed(proc, summary, out, phases)
    main = summary["phases"][0]
    assert main["backend"] == "gloo" and main["layout"] == {"tp": 1, "dp": world}
    placements = _rank(out, "main", 0)["placements"]
    assert all("Shard(dim=0)" in p and f"on cpu [{world}]" in p for p in placements.values()), placements
    if cross:  # the checkpoint of a 1-rank FSDP mesh read by 2 TP ranks
        assert summary["phases"][1]["layout"] == {"tp": 2, "dp": 1}


def test_cpu_ranks_under_a_per_device_backend_string(tmp_path):
    # the form the cuda run uses ("cpu:gloo,cuda:nccl"): ucp_store's own gloo groups beside it
    proc, summary, out = _run(tmp_path, "--device", "cpu", "--world", "2", "--backend", "cpu:gloo,cuda:gloo",
                              "--modes", "thread")
    checks = MAIN_CHECKS - {"async_process_is_state_at_call", "async_process_mutation_detected",
                            "async_lazy_is_state_at_call", "async_lazy_mutation_detected"}
    _passed(proc, summary, out, [("main", 2, checks)])
    assert summary["phases"][0]["backend"] == "cpu:gloo,cuda:gloo"


def test_a_changed_element_fails_the_checks(tmp_path):
    proc, summary, out = _run(tmp_path, "--device", "cpu", "--world", "2", "--modes", "thread", "--fault", "corrupt")
    assert proc.returncode == 1 and summary["ok"] is False and summary["exit"] == 1, (summary, proc.stderr[-3000:])
    r1 = _rank(out, "main", 1)
    assert {"load_bit_equal_on_device", "load_bit_equal_host", "verify_after_load"} <= set(r1["failed"]), r1
    assert "model.norm.weight" in r1["checks"]["load_bit_equal_host"]["detail"]
    r0 = _rank(out, "main", 0)  # verify's report is gathered: rank 0 sees rank 1's mismatch too
    assert r0["failed"] == ["verify_after_load"] and "'norm.weight'" in r0["checks"]["verify_after_load"]["detail"]
    assert "1" in summary["phases"][0]["failed"] and "verify_after_load" in summary["phases"][0]["failed"]["0"]


def test_a_crashed_rank_fails_the_run_without_a_hang(tmp_path):
    proc, summary, out = _run(tmp_path, "--device", "cpu", "--world", "2", "--modes", "thread", "--fault", "crash",
                              "--grace", "10", timeout=240)
    assert proc.returncode == 1 and summary["exit"] == 1 and not summary["phases"][0]["hung"], summary
    assert "injected crash" in _rank(out, "main", 1)["crash"]
    assert "injected crash" in proc.stderr  # the rank's traceback is in the log too
    failed = summary["phases"][0]["failed"]
    assert set(failed) == {"0", "1"}, failed  # rank 0 fails its next collective (or is killed after the grace)


def test_a_hung_rank_is_killed_with_its_stacks(tmp_path):
    proc, summary, out = _run(tmp_path, "--device", "cpu", "--world", "2", "--modes", "thread", "--fault", "hang",
                              "--timeout", "20", timeout=240)
    assert proc.returncode == 4 and summary["exit"] == 4 and summary["phases"][0]["hung"], summary
    assert "killed" in summary["phases"][0]["failed"]["1"]
    assert "most recent call first" in proc.stderr and "role_main" in proc.stderr, proc.stderr[-3000:]


def test_cuda_with_fewer_gpus_than_ranks_is_refused(tmp_path):
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    proc, summary, _ = _run(tmp_path, "--device", "cuda", "--world", str(have + 1))
    assert proc.returncode == 2 and summary["exit"] == 2 and summary["phases"] == [], summary
    assert f"needs {have + 1} GPU(s)" in summary["refused"] and "NCCL cannot put two ranks on one GPU" in proc.stderr


@pytest.mark.skipif(_cuda_ready() is not None, reason=f"CUDA/NCCL: {_cuda_ready()}")
@pytest.mark.parametrize("world", [1, 2])
def test_cuda_nccl_ranks_save_async_load_verify_and_cross_load_on_cpu(tmp_path, world):
    if world > torch.cuda.device_count():
        pytest.skip(f"world {world} needs {world} GPUs, one per rank; this machine has {torch.cuda.device_count()}")
    proc, summary, out = _run(tmp_path, "--device", "cuda", "--world", str(world), "--cross")
    _keep(out, f"cuda-w{world}")
    _passed(proc, summary, out, [("main", world, MAIN_CHECKS), ("cross", 2, CROSS_CHECKS)])
    main, cross = summary["phases"]
    assert "nccl" in main["backend"] and "gloo" in main["backend"], main  # "cpu:gloo,cuda:nccl"
    assert main["device_name"] and main["nccl"] and main["cuda_backend"], main  # recorded (ProcessGroupNCCL)
    assert "device_all_reduce" in _rank(out, "main", 0)["checks"]  # passed: _passed checked every check
    placements = _rank(out, "main", 0)["placements"]
    assert all("on cuda" in p for p in placements.values()), placements
    assert cross["backend"] == "gloo" and cross["device"] == "cpu"
