"""Lazy async_save (issue 31): the snapshot overlaps the next forward and backward, gated on the optimizer step.

Fast tests (one process): the copy order and the gate's share, BatchNorm statistics and ``eager=`` buffers
copied at the call while forward changes them, the version guard and the ``.data`` guard. One slow test
(real gloo ranks, tests/dist_worker.py with tests/lazy_worker.py's roles): FSDP2 and TP x FSDP2 training
with step N+1 run while save N is in flight, in-place changes caught on every rank, a rank killed during
the background copy.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

import ucp_store
import ucp_store.distributed as ucpd
from ucp_store.distributed import snapshot
from ucp_store.distributed.snapshot import Job, SnapshotChangedError, order_jobs

from ucp_test_helpers import REPO, run_python


@pytest.fixture
def held():
    """Holds the next lazy snapshot back until the event is set (the overlap is then certain, not timed)."""
    ev = threading.Event()
    snapshot._before_run = ev.wait
    yield ev
    ev.set()
    snapshot._before_run = None


def _hashes(store, ref):
    return {(i.name, i.state): i.content_hash for i in ucp_store.open_store(str(store)).checkpoint(ref).tensors()}


def test_order_puts_the_gated_optimizer_first_in_parameter_order():
    a, b, frozen = (torch.nn.Parameter(torch.ones(3) * i) for i in range(3))
    opt = torch.optim.Adam([b, a])
    opt.zero_grad()
    (a.sum() + b.sum()).backward()
    opt.step()
    state_b = opt.state[b]["exp_avg"]
    jobs = [Job(i, t, t, t._version, str(i)) for i, t in enumerate([frozen.detach(), a.detach(), state_b, b.detach()])]
    ordered, gates = order_jobs(jobs, [opt])
    assert [j.index for j in ordered] == [3, 2, 1, 0]  # b, b's moment, a, then the frozen one
    assert gates == {id(opt): 3}  # the step waits for three boxes, not for the frozen parameter


def test_batchnorm_statistics_are_taken_at_the_call(tmp_path, held):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model.register_buffer("ema", torch.zeros(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = {k: v.clone() for k, v in sd["model"].items()}
    h = ucpd.async_save(sd, store=tmp_path / "s", run="bn", step=1, optimizer=opt, eager=["model.ema"])
    assert h.snapshot is not None  # lazy by default once a gate is installed
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()  # changes running_mean/var and num_batches_tracked in place
    with torch.no_grad():
        model.ema.add_(1)  # a buffer the caller updates before the step: named in eager=
    held.set()
    opt.step()  # gated
    h.result()
    ck = ucp_store.open_store(str(tmp_path / "s")).checkpoint("bn@1")
    for k, v in want.items():
        assert torch.equal(ck.tensor(k, "weight").read(), v), k


def test_changes_outside_the_gate_fail_the_save(tmp_path, held):
    w = torch.nn.Parameter(torch.ones(64, 8))
    opt = torch.optim.SGD([w], lr=0.1)
    for case in ("nograd", "data", "ungated"):
        sd = {"w": w.detach(), "x": torch.arange(5.0)}
        held.clear()
        h = ucpd.async_save(sd, store=tmp_path / "s", run=case, step=1, lazy=True,
                            optimizer=opt if case != "ungated" else None)
        if case == "nograd":
            with torch.no_grad():
                w.mul_(3)
        elif case == "data":
            w.data.mul_(2)  # its own version counter: caught by the sampled elements
        else:  # no gate was installed on this optimizer
            opt2 = torch.optim.SGD([w], lr=0.1)
            w.grad = torch.ones_like(w)
            opt2.step()
        held.set()
        with pytest.raises(SnapshotChangedError, match="'w'"):
            h.result()
    st = ucp_store.open_store(str(tmp_path / "s"), create=True)
    assert st.list_checkpoints(include_pending=True) == []  # nothing begun, nothing listed
    with pytest.raises(ucp_store.errors.ConfigurationError, match="eager"):
        ucpd.async_save({"w": w.detach()}, store=tmp_path / "s", run="e", step=1, eager="w*")


@pytest.mark.slow
def test_lazy_async_save_on_gloo_ranks(tmp_path):
    store = str(tmp_path / "store")
    jobs = [{"role": "inflight", "run": "fsdp", "dp": 4, "tp": 1},
            {"role": "inflight", "run": "tpfsdp", "dp": 2, "tp": 2},
            {"role": "mutate", "run": "mnograd", "dp": 4, "tp": 1, "case": "nograd", "culprit": 1},
            {"role": "mutate", "run": "mdata", "dp": 2, "tp": 2, "case": "data", "culprit": 2},
            {"role": "mutate", "run": "mstep", "dp": 4, "tp": 1, "case": "step", "culprit": -1},
            {"role": "kill", "run": "k", "dp": 4, "tp": 1, "victim": 1}]
    out = tmp_path / "out"
    spec = {"world": 4, "module": "lazy_worker", "store": store, "jobs": jobs, "out": str(out), "timeout": 400}
    proc = run_python([str(REPO / "tests" / "dist_worker.py"), json.dumps(spec)], timeout=450,
                      UCP_DIST_TIMEOUT="60")
    assert proc.returncode != 0  # rank 1 was killed by the last job

    def res(run, r):
        path = out / f"{run}.rank{r}.json"
        assert path.exists(), (run, r, proc.stderr[-3000:])
        return json.loads(path.read_text())

    for run in ("fsdp", "tpfsdp"):
        for r in range(4):
            x = res(run, r)
            assert x["lazy"] and x["copied_before_step"] == 0  # forward and backward ran before any copy
            assert x["same"] and x["n"] == 104 and x["diffs"] == [] and x["loss_lazy"] == x["loss_ref"], x
            assert x["live_differs"]  # training went on: the stored state is the call's, not the live one
    for run, culprit in (("mnograd", 1), ("mdata", 2), ("mstep", None)):
        for r in range(4):
            x = res(run, r)
            assert x["error"] is not None, (run, r)
            if culprit is None or r == culprit:
                assert x["error"]["type"] == "SnapshotChangedError", x
                assert "'model.layers.1.feed_forward.w2.weight'" in x["error"]["message"] or culprit is None, x
            else:
                assert f"rank {culprit}" in x["error"]["message"], x
            assert run not in x["runs"] and run not in x["pending"]
    for r in (0, 2, 3):
        assert res("k", r)["error"] is not None
    assert not (out / "k.rank1.json").exists()
    st = ucp_store.open_store(store)
    assert "k" not in [c["run"] for c in st.list_checkpoints(include_pending=True)]
