"""Roles of tests/test_lazy_async.py, run by tests/dist_worker.py (``"module": "lazy_worker"``) on real gloo ranks.

Each role writes ``<out>/<run>.rank<r>.json`` itself as soon as it is done, so that a later job that kills a
rank (``kill``) leaves the earlier jobs' results readable. Roles:

- ``inflight``: a lazy ``async_save`` whose snapshot is held back until after the next forward and backward;
  that step's optimizer step (gated) and three more run while the save is in flight; the stored version must
  equal a sync save of the state at the call, bit for bit, and loading either into fresh models must give
  the same state and the same next loss;
- ``mutate``: a parameter changed in place on one rank between the call and the copy (``case``: ``nograd``
  ``p.add_``, or ``data`` ``p.data.mul_``), or an ungated optimizer step (``step``): every rank's save fails,
  nothing is listed;
- ``kill``: rank ``victim`` is SIGKILLed by the ``async.mid_copy`` kill point during the background copy.
"""

from __future__ import annotations

import json
import os
import threading

from dist_worker import _compare, _local, _model, _sd, _set, _train


def _dump(spec, rank, out):
    with open(os.path.join(spec["out"], f"{spec['run']}.rank{rank}.json"), "w") as f:
        json.dump(out, f)
    return out


def _held():
    """Hold the next lazy snapshot back until the returned event is set (deterministic overlap)."""
    from ucp_store.distributed import snapshot

    ev = threading.Event()
    snapshot._before_run = ev.wait
    return ev


def role_inflight(spec, rank):
    import torch

    import ucp_store.distributed as ucpd
    from ucp_store import open_store
    from ucp_store.demo.model import batch
    from ucp_store.distributed import snapshot

    cfg, model, opt = _model(spec, 0)
    _train(spec, model, opt, cfg, rank, 0, 1)
    sd = _sd(model, opt)
    ucpd.save(sd, store=spec["store"], run=spec["run"] + "-ref", step=1, progress=False)  # the state at the call
    ev = _held()
    handle = ucpd.async_save(sd, store=spec["store"], run=spec["run"], step=1, optimizer=opt)
    lazy = handle.snapshot is not None
    # step 2's forward and backward run while nothing is copied yet; its optimizer step must wait at the gate
    from dist_worker import _dp_rank

    dr, ndp = _dp_rank(spec, rank)
    inputs, targets = batch(cfg, 1, dp_rank=dr, dp=ndp)
    opt.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    loss.backward()
    copied_before_step = handle.snapshot._copied if lazy else -1
    ev.set()
    opt.step()
    snapshot._before_run = None
    _train(spec, model, opt, cfg, rank, 2, 3)
    cid = handle.result()
    st = open_store(spec["store"])
    a = {(i.name, i.state): i.content_hash for i in st.checkpoint(f"{spec['run']}@1").tensors()}
    b = {(i.name, i.state): i.content_hash for i in st.checkpoint(f"{spec['run']}-ref@1").tensors()}
    # resumes: both versions loaded into fresh models equal each other, and so does the next step
    _, m1, o1 = _model(spec, 11)
    _, m2, o2 = _model(spec, 12)
    s1, s2 = _sd(m1, o1), _sd(m2, o2)
    ucpd.load(s1, store=spec["store"], ref=f"{spec['run']}@1", progress=False)
    ucpd.load(s2, store=spec["store"], ref=f"{spec['run']}-ref@1", progress=False)
    _set(m1, o1, s1)
    _set(m2, o2, s2)
    diffs = _compare(_sd(m1, o1), _sd(m2, o2))
    l1 = _train(spec, m1, o1, cfg, rank, 1, 1)
    l2 = _train(spec, m2, o2, cfg, rank, 1, 1)
    live_differs = not ucpd.verify(_sd(model, opt), f"{spec['run']}@1", store=spec["store"], progress=False).ok
    return _dump(spec, rank, {"id": cid, "lazy": lazy, "same": a == b, "n": len(a), "diffs": diffs,
                              "loss_lazy": l1, "loss_ref": l2, "copied_before_step": copied_before_step,
                              "live_differs": live_differs, "blocked_s": handle.blocked_s})


def role_mutate(spec, rank):
    import torch

    import ucp_store.distributed as ucpd
    from ucp_store import open_store
    from ucp_store.distributed import snapshot

    cfg, model, opt = _model(spec, 0)
    _train(spec, model, opt, cfg, rank, 0, 1)
    sd = _sd(model, opt)
    ev = _held()
    case = spec["case"]
    gate = None if case == "step" else opt  # "step": an optimizer without the gate steps before the copy
    # the plan of this layout made at setup (the last job's is another layout): the call below copies lazily
    ucpd.prepare_async(sd, optimizer=gate)
    handle = ucpd.async_save(sd, store=spec["store"], run=spec["run"], step=1, optimizer=gate, lazy=True)
    if rank == spec["culprit"]:
        p = model.layers["1"].feed_forward.w2.weight
        if case == "nograd":
            with torch.no_grad():
                p.add_(1.0)
        elif case == "data":
            p.data.mul_(2.0)
    if case == "step":
        _train(spec, model, opt, cfg, rank, 1, 1)
    ev.set()
    snapshot._before_run = None
    try:
        handle.result()
        error = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        error = {"type": type(exc).__name__, "message": str(exc)[:600]}
    runs = [r["run"] for r in open_store(spec["store"]).runs()]
    pending = [c["run"] for c in open_store(spec["store"]).list_checkpoints(include_pending=True)]
    _local(model.layers["1"].feed_forward.w2.weight)  # the model stays usable
    return _dump(spec, rank, {"error": error, "runs": runs, "pending": pending})


def role_kill(spec, rank):
    import ucp_store.distributed as ucpd
    from ucp_store import _killpoints

    cfg, model, opt = _model(spec, 0)
    _train(spec, model, opt, cfg, rank, 0, 1)
    sd = _sd(model, opt)
    if rank == spec["victim"]:
        _killpoints.rearm("async.mid_copy:3")  # the third box copied: the process dies, nothing begun
    handle = ucpd.async_save(sd, store=spec["store"], run=spec["run"], step=1, optimizer=opt)
    try:  # no training step here: its collectives would meet the dead rank before the save does
        handle.result()
        error = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        error = {"type": type(exc).__name__, "message": str(exc)[:600]}
    return _dump(spec, rank, {"error": error})
