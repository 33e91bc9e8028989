"""Multi-process worker of tests/test_dist.py: real gloo ranks training, saving and resuming the demo model.

Run as ``python tests/dist_worker.py SPEC_JSON``; it starts ``world`` rank processes (gloo, a free
port; plain subprocesses so that one rank dying leaves the others to report) that each run
``spec["role"]`` (of ``spec["module"]`` when given, e.g. tests/perrank_worker.py) and write
``<out>/rank<r>.json``. Roles:

- ``source``: train ``steps`` steps on the mesh, save with ``ucp_store.distributed.save`` and with DCP;
- ``resume``: build a differently initialised model on the target mesh, load one copy with
  ``ucp_store.distributed.load`` and one with ``dcp.load``, compare every model and optimizer tensor bit for bit,
  then train one step on both and record the two losses;
- ``verify``: load, check ``verify`` is clean, change one element of one rank's shard, verify again;
- ``async``: ``async_save`` then keep training (mutating the tensors) and compare the committed version
  with a copy taken at the call;
- ``bad``: one of the bad-input cases (``spec["case"]``), recording each rank's error;
- ``kill``: a rank exits hard in the middle of ``save``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from ucp_test_helpers import rank_main_or_launch


def _model(spec, seed):
    from ucp_store.demo.model import ModelConfig, build_model, build_optimizer, make_mesh, parallelize

    cfg = ModelConfig(**spec.get("cfg", {}))
    tp, dp, rep = spec.get("tp", 1), spec.get("dp", 1), spec.get("rep", 1)
    model = build_model(cfg, seed)
    mesh = make_mesh(tp=tp, dp=dp, replicate=rep) if tp * dp * rep > 1 else None
    parallelize(model, mesh, tp=tp, dp=dp, replicate=rep)
    return cfg, model, build_optimizer(model)


def _dp_rank(spec, rank):
    return rank // spec.get("tp", 1), spec.get("dp", 1) * spec.get("rep", 1)


def _sd(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o}


def _set(model, opt, sd):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _compare(a, b) -> list[str]:
    """Every leaf where two state dicts differ (tensors bit for bit, placements too)."""
    import torch

    from ucp_store.distributed.statedict import flatten, path_text

    la, lb = flatten(a), flatten(b)
    out = []
    if [x.path for x in la] != [x.path for x in lb]:
        return [f"structure differs: {[x.path for x in la][:5]} vs {[x.path for x in lb][:5]}"]
    for x, y in zip(la, lb):
        if x.is_tensor:
            if getattr(x.value, "placements", None) != getattr(y.value, "placements", None):
                out.append(f"{path_text(x.path)}: placements {x.value.placements} vs {y.value.placements}")
                continue
            u, v = _local(x.value), _local(y.value)
            if u.shape != v.shape or u.dtype != v.dtype or not torch.equal(u.reshape(-1).view(torch.uint8),
                                                                          v.reshape(-1).view(torch.uint8)):
                out.append(f"{path_text(x.path)}: local shards differ")
        elif x.value != y.value:
            out.append(f"{path_text(x.path)}: {x.value!r} vs {y.value!r}")
    return out


def _train(spec, model, opt, cfg, rank, start, n):
    from ucp_store.demo.model import batch, train_step

    dr, ndp = _dp_rank(spec, rank)
    return [train_step(model, opt, *batch(cfg, s, dp_rank=dr, dp=ndp)) for s in range(start, start + n)]


def role_source(spec, rank):
    import torch.distributed.checkpoint as dcp

    import ucp_store.distributed as ucpd

    cfg, model, opt = _model(spec, 0)
    losses = _train(spec, model, opt, cfg, rank, 0, spec["steps"])
    sd = _sd(model, opt)
    cid = ucpd.save(sd, store=spec["store"], run=spec["run"], step=spec["steps"], progress=False)
    dcp.save(sd, checkpoint_id=spec["dcp"])
    return {"losses": losses, "id": cid}


def role_resume(spec, rank):
    import torch.distributed.checkpoint as dcp

    import ucp_store.distributed as ucpd

    cfg, mu, ou = _model(spec, 123)
    _, md, od = _model(spec, 456)
    sdu, sdd = _sd(mu, ou), _sd(md, od)
    res = ucpd.load(sdu, store=spec["store"], ref=spec["ref"], progress=False)
    _set(mu, ou, sdu)
    dcp.load(sdd, checkpoint_id=spec["dcp"])
    _set(md, od, sdd)
    diffs = _compare(_sd(mu, ou), _sd(md, od))
    report = ucpd.verify(_sd(mu, ou), spec["ref"], store=spec["store"], progress=False)
    lu = _train(spec, mu, ou, cfg, rank, spec["steps"], 1)
    ld = _train(spec, md, od, cfg, rank, spec["steps"], 1)
    after = _compare(_sd(mu, ou), _sd(md, od))
    return {"diffs": diffs, "after": after, "loss_ucp": lu, "loss_dcp": ld, "verify_ok": report.ok,
            "bytes_read": res.bytes_read}


def role_verify(spec, rank):
    import torch

    import ucp_store.distributed as ucpd

    cfg, model, opt = _model(spec, 0)
    _train(spec, model, opt, cfg, rank, 0, 1)
    sd = _sd(model, opt)
    ucpd.save(sd, store=spec["store"], run=spec["run"], step=1, progress=False)
    clean = ucpd.verify(sd, f"{spec['run']}@1", store=spec["store"], progress=False)
    target = spec["target"]
    if rank == spec["bad_rank"]:
        with torch.no_grad():
            local = _local(sd["model"][target])
            local.view(-1)[3] += 1.0
    dirty = ucpd.verify(sd, f"{spec['run']}@1", store=spec["store"], progress=False)
    return {"clean": clean.ok, "mismatches": [m.__dict__ for m in dirty.mismatches], "text": str(dirty)}


def role_async(spec, rank):
    import torch

    import ucp_store.distributed as ucpd

    cfg, model, opt = _model(spec, 0)
    _train(spec, model, opt, cfg, rank, 0, 1)
    sd = _sd(model, opt)
    # what the state is at the moment of the call (a deep copy of every local shard)
    ucpd.save(sd, store=spec["store"], run=spec["run"] + "-ref", step=1, progress=False)
    if spec.get("prepare"):  # buffers, group and writer made at setup; the call below only copies
        ucpd.prepare_async(sd, mode=spec.get("mode", "thread"))
    handle = ucpd.async_save(sd, store=spec["store"], run=spec["run"], step=1, mode=spec.get("mode", "thread"))
    losses = _train(spec, model, opt, cfg, rank, 1, 3)  # mutates every parameter and moment in place
    with torch.no_grad():
        for p in model.parameters():
            _local(p).add_(1.0)
    cid = handle.result()
    ucpd.wait()
    from ucp_store import open_store

    st = open_store(spec["store"])
    a, b = st.checkpoint(f"{spec['run']}@1"), st.checkpoint(f"{spec['run']}-ref@1")
    ta = {(i.name, i.state): i.content_hash for i in a.tensors()}
    tb = {(i.name, i.state): i.content_hash for i in b.tensors()}
    later = _sd(model, opt)
    changed = ucpd.verify(later, f"{spec['run']}@1", store=spec["store"], progress=False)
    return {"id": cid, "same": ta == tb, "n": len(ta), "losses": losses,
            "later_differs": not changed.ok, "blocked_s": handle.blocked_s}


def role_bad(spec, rank):
    import ucp_store.distributed as ucpd

    _cfg, model, opt = _model(spec, 0)
    ucpd.save(_sd(model, opt), store=spec["store"], run=spec["run"], step=1, progress=False)
    return {"cases": {case: _bad_case({**spec, "case": case}, rank) for case in spec["cases"]}}


def _bad_case(spec, rank):
    import torch

    import ucp_store.distributed as ucpd

    case = spec["case"]
    _cfg, model, opt = _model(spec, 0)
    sd = _sd(model, opt)
    try:
        if case == "missing_ref":
            ucpd.load(sd, store=spec["store"], ref=spec["run"] + "@99", progress=False)
        elif case == "shape":
            sd["model"]["norm.weight"] = torch.zeros(41) if rank == 0 else sd["model"]["norm.weight"]
            ucpd.load(sd, store=spec["store"], ref=spec["run"] + "@latest", progress=False)
        elif case == "keys":
            sd["model"]["extra.weight"] = torch.zeros(3)
            ucpd.load(sd, store=spec["store"], ref=spec["run"] + "@latest", progress=False)
        elif case == "save_keys":
            if rank == 1:
                sd["model"]["only_on_rank1"] = torch.zeros(3)
            ucpd.save(sd, store=spec["store"], run=spec["run"] + "-keys", step=0, progress=False)
        elif case == "split":
            from torch.distributed.tensor import DTensor

            t = sd["model"]["layers.0.attention.wq.weight"]
            local = t.to_local()
            if rank == 0:  # a local shard the mesh's split cannot give (one row short)
                local = local[:-1]
            shape = t.shape
            sd["model"]["layers.0.attention.wq.weight"] = DTensor.from_local(local, t.device_mesh, t.placements,
                                                                            run_check=False, shape=shape,
                                                                            stride=t.stride())
            ucpd.load(sd, store=spec["store"], ref=spec["run"] + "@latest", progress=False)
        else:
            raise ValueError(case)
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def role_kill(spec, rank):
    import ucp_store.distributed as ucpd
    from ucp_store.save import writer as store_mod

    _cfg, model, opt = _model(spec, 0)
    sd = _sd(model, opt)
    if rank == spec["victim"]:
        real = store_mod.CheckpointWriter.write_region
        count = {"n": 0}

        def dying(self, *a, **k):
            count["n"] += 1
            if count["n"] == 3:
                os._exit(17)  # a hard crash mid-save: no cleanup, no exception
            return real(self, *a, **k)

        store_mod.CheckpointWriter.write_region = dying
    try:
        ucpd.save(sd, store=spec["store"], run=spec["run"], step=5, progress=False)
    except Exception as exc:  # noqa: BLE001
        return {"error": type(exc).__name__, "message": str(exc)[:500]}
    return {"error": None}


def _rank_main(rank, spec, port):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(spec["world"]), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if os.environ.get("UCP_TEST_TRACEBACK_AFTER"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["UCP_TEST_TRACEBACK_AFTER"]), exit=True)
    out = {"rank": rank}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=spec["world"])
        # roles of another worker module (tests/perrank_worker.py) run under this same launcher
        roles = vars(__import__(spec["module"])) if spec.get("module") else globals()
        if "jobs" in spec:  # several jobs of one world size, one after the other
            out["jobs"] = [roles["role_" + (job.get("role") or spec["role"])]({**spec, **job}, rank)
                           for job in spec["jobs"]]
        else:
            out.update(roles["role_" + spec["role"]](spec, rank))
    except BaseException as exc:  # noqa: BLE001
        out["crash"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if "crash" not in out:
        import ucp_store.distributed as ucpd

        ucpd.close()  # the async writer processes, before the process group goes
        if dist.is_initialized():
            dist.destroy_process_group()
    # leave without interpreter teardown: a gloo rank sometimes aborted there ("terminate called without an
    # active exception", no Python frame left) after passing every check; its outcome is in its JSON, and
    # the parent now reports any rank's non-zero exit or signal
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    rank_main_or_launch(__file__, _rank_main)


if __name__ == "__main__":
    main()
