"""Device check of ucp_store.distributed: real ranks on CPU (gloo) or CUDA (NCCL), one verdict.

Run as::

    python tests/dist_device_check.py --device {cpu,cuda} --world N --out DIR [--cross]

It starts ``N`` rank processes (plain subprocesses, like tests/dist_worker.py, so one rank dying leaves
the others to report). Each rank, on a DeviceMesh of ``--device`` over the N ranks:

- builds the demo transformer (ucp_store/demo/model.py) on the device with DTensor parameters: FSDP2
  ``fully_shard`` over ``dp`` and tensor parallelism over ``tp`` where the world allows (a 1-rank mesh
  for world 1, so the parameters are DTensors on the device all the same), and trains 2 AdamW steps;
- ``save`` of ``{"model": ..., "optim": ...}`` from ``get_state_dict`` (device tensors, staged to host);
- ``async_save`` in thread and process mode: the state is mutated right after the call returns and the
  committed version must still be the state at the call; and the lazy snapshot (``lazy``: the optimizer's
  step gated on the background copy), with a training step right after the call;
- zeroes the state dict, ``load`` in place, and checks every tensor bit for bit (on the device and through
  ``.cpu()``), that the loaded tensors are the same objects, on the same device, with the same mesh and
  placements, and that ``verify`` is clean;
- records the torch version, the backend in use, the device name and the timings.

With ``--cross`` (after a passing first phase) the same checkpoint is loaded by ``--cross-world`` CPU/gloo
ranks on another layout (TP instead of FSDP), each tensor compared with the logical (full) tensors the
first phase wrote: re-sharding across device and mesh.

Each rank writes ``DIR/<phase>/rank<r>.json``; the parent prints one summary JSON line (also
``DIR/summary.json``) and exits 0 when every rank of every phase passed every check, 1 when a check
failed or a rank crashed, 2 when the request cannot run here (``--device cuda`` with fewer GPUs than
ranks, or no NCCL), 4 when ranks hung past ``--timeout`` (the parent then dumps their stacks and kills them).

Bounded everywhere: ``UCP_DIST_TIMEOUT`` (ucp_store's own gloo collectives, default 60 s here), the process
group's timeout (120 s), and the parent's wall clock per phase; when one rank exits with an error, the
others get ``--grace`` seconds to report before they are killed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback

from ucp_test_helpers import free_port

PG_TIMEOUT_S = 120
RUN = "dev"
STEPS = 2


def _layout(world: int, kind: str) -> dict:
    """``{"tp": .., "dp": ..}`` for ``world`` ranks: ``fsdp`` (all dp), ``tp`` (all tp) or ``auto``
    (FSDP, and 2-way TP x FSDP from 4 ranks on)."""
    if kind == "fsdp":
        return {"tp": 1, "dp": world}
    if kind == "tp":
        return {"tp": world, "dp": 1}
    if world >= 4 and world % 2 == 0:
        return {"tp": 2, "dp": world // 2}
    return {"tp": 1, "dp": world}


# ----------------------------------------------------------------------------------------- rank side
class Checks:
    """Named pass/fail results of one rank, each with a detail naming what differed."""

    def __init__(self) -> None:
        self.results: dict[str, dict] = {}

    def add(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results[name] = {"ok": bool(ok), "detail": detail[:2000]}
        return bool(ok)

    def failed(self) -> list[str]:
        return [n for n, r in self.results.items() if not r["ok"]]


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t):
    return t.to_local() if _is_dtensor(t) else t


def _clone(obj):
    """A deep copy of a state dict: every tensor (DTensors stay DTensors, on their device) cloned."""
    import torch

    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    return obj


def _tensor_leaves(sd) -> list:
    from ucp_store.distributed.statedict import flatten

    return [leaf for leaf in flatten(sd) if leaf.is_tensor]


def _bytes_equal(a, b) -> bool:
    """Bit-for-bit equality of two plain tensors on one device (NaNs and -0.0 included)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _host_bytes(t):
    """The bytes of a plain tensor as a numpy uint8 array (device tensors through ``.cpu()`` first)."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _compare(live, want, *, host: bool) -> list[str]:
    """Leaves where two state dicts of one structure differ: placements, mesh, device, local bytes."""
    import numpy as np

    from ucp_store.distributed.statedict import flatten, path_text

    la, lb = flatten(live), flatten(want)
    if [x.path for x in la] != [x.path for x in lb]:
        return [f"structure differs: {[path_text(x.path) for x in la][:5]} vs {[path_text(x.path) for x in lb][:5]}"]
    out = []
    for x, y in zip(la, lb):
        what = path_text(x.path)
        if not x.is_tensor:
            if x.value != y.value:
                out.append(f"{what}: {x.value!r} vs {y.value!r}")
            continue
        if _is_dtensor(x.value) != _is_dtensor(y.value):
            out.append(f"{what}: DTensor {_is_dtensor(x.value)} vs {_is_dtensor(y.value)}")
            continue
        if _is_dtensor(x.value) and (x.value.placements != y.value.placements
                                     or x.value.device_mesh != y.value.device_mesh):
            out.append(f"{what}: placements {x.value.placements} on {x.value.device_mesh} vs {y.value.placements} "
                       f"on {y.value.device_mesh}")
            continue
        u, v = _local(x.value), _local(y.value)
        if u.device != v.device:
            out.append(f"{what}: on {u.device}, expected {v.device}")
        elif host:
            a, b = _host_bytes(u), _host_bytes(v)
            if u.shape != v.shape or u.dtype != v.dtype or not np.array_equal(a, b):
                out.append(f"{what}: local shards differ (host bytes; {u.dtype}{list(u.shape)} vs "
                           f"{v.dtype}{list(v.shape)})")
        elif not _bytes_equal(u, v):
            out.append(f"{what}: local shards differ (on {u.device}; {u.dtype}{list(u.shape)} vs "
                       f"{v.dtype}{list(v.shape)})")
    return out


def _mutate(sd) -> int:
    """Add 1 to every floating tensor of ``sd`` in place (its local shard, on its device); returns how many."""
    import torch

    n = 0
    with torch.no_grad():
        for leaf in _tensor_leaves(sd):
            local = _local(leaf.value)
            if local.is_floating_point():
                local.add_(1.0)
                n += 1
    return n


def _build(spec, device: str, seed: int, rank: int):
    """The demo model on ``device`` with DTensor parameters on a mesh of the spec's layout, and AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ucp_store.demo.model import ModelConfig, build_model, build_optimizer, parallelize

    tp, dp = spec["tp"], spec["dp"]
    dims = [(n, s) for n, s in (("dp", dp), ("tp", tp)) if s > 1] or [("dp", 1)]
    mesh = init_device_mesh(device, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
    cfg = ModelConfig()
    model = build_model(cfg, seed, device=device)
    if tp > 1 or dp > 1:
        parallelize(model, mesh, tp=tp, dp=dp)
    else:  # one rank: FSDP2 over a 1-rank mesh all the same, so every parameter is a DTensor on the device
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return cfg, mesh, model, build_optimizer(model)


def _state_dict(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    return {"model": m, "optim": o}


def _placements_summary(sd) -> dict:
    out = {}
    for leaf in _tensor_leaves(sd)[:6]:
        v = leaf.value
        out[".".join(map(str, leaf.path))] = (f"{list(v.placements)} on {v.device_mesh.device_type} "
                                              f"{list(v.device_mesh.mesh.shape)}" if _is_dtensor(v) else
                                              f"plain {v.device}")
    return out


def role_main(spec, rank, out, checks: Checks):
    import torch

    import ucp_store
    import ucp_store.distributed as ucpd
    from ucp_store.demo.model import batch, train_step

    device, cuda = spec["device"], spec["device"] == "cuda"
    store, timings = spec["store"], out["timings"]
    cfg, mesh, model, opt = _build(spec, device, 0, rank)
    dp_rank = rank // spec["tp"]
    out["losses"] = [train_step(model, opt, *batch(cfg, s, dp_rank=dp_rank, dp=spec["dp"], device=device))
                     for s in range(STEPS)]
    params = list(model.named_parameters())
    bad = [n for n, p in params if not _is_dtensor(p) or p.device.type != device or p.to_local().device.type != device]
    checks.add("params_are_dtensors_on_device", not bad and bool(params),
               f"not DTensors on {device}: {bad[:5]}" if bad else f"{len(params)} parameters")

    sd = _state_dict(model, opt)
    leaves = _tensor_leaves(sd)
    out["n_tensors"] = len(leaves)
    out["placements"] = _placements_summary(sd)
    dts = [leaf for leaf in leaves if _is_dtensor(leaf.value)]
    off = [".".join(map(str, leaf.path)) for leaf in dts if _local(leaf.value).device.type != device]
    moments = [leaf for leaf in dts if leaf.key[1] in ("exp_avg", "exp_avg_sq")]
    checks.add("state_dict_on_device", not off and len(moments) == 2 * len(params),
               f"{len(dts)} DTensors, {len(moments)} moments for {len(params)} params; off {device}: {off[:5]}")
    snap = _clone(sd)  # the state at the save below

    # ---- save
    _sync(cuda)
    t0 = time.perf_counter()
    cid = ucpd.save(sd, store=store, run=RUN, step=STEPS, progress=False)
    _sync(cuda)
    timings["save_s"] = time.perf_counter() - t0
    ref = f"{RUN}@{STEPS}"
    out["checkpoint"] = cid
    if spec.get("fault") == "crash" and rank == spec["world"] - 1:
        raise RuntimeError("injected crash (--fault crash) after the save")
    if spec.get("fault") == "hang" and rank == spec["world"] - 1:
        time.sleep(3600)
    rep = ucpd.verify(sd, ref, store=store, progress=False)
    checks.add("verify_after_save", rep.ok, str(rep))
    st = ucp_store.open_store(store)
    sync_hashes = {(i.name, i.state): i.content_hash for i in st.checkpoint(ref).tensors()}
    checks.add("catalog_has_every_tensor", len(sync_hashes) == len(leaves),
               f"{len(sync_hashes)} tensor-states in {ref}, {len(leaves)} in the state dict")

    # ---- async saves: the committed version is the state at the call, whatever happens after it returns
    for i, mode in enumerate(spec["modes"]):
        at_call = _clone(sd)
        run = f"{RUN}-async-{mode}"
        _sync(cuda)
        t0 = time.perf_counter()
        if mode == "lazy":  # the lazy snapshot (on a GPU: a side stream into pinned memory, events, no sync)
            handle = ucpd.async_save(sd, store=store, run=run, step=STEPS, mode="thread", optimizer=opt, lazy=True)
        else:
            handle = ucpd.async_save(sd, store=store, run=run, step=STEPS, mode=mode)
        timings[f"async_{mode}_blocked_s"] = time.perf_counter() - t0
        if mode == "lazy":  # training goes on: forward and backward beside the copy, the step gated on it
            train_step(model, opt, *batch(cfg, STEPS, dp_rank=dp_rank, dp=spec["dp"], device=device))
            n = len(leaves)
        else:
            n = _mutate(sd)  # training goes on: every floating tensor changes in place, on the device
        _sync(cuda)
        acid = handle.result(timeout=spec["async_timeout"])
        ucpd.wait()
        timings[f"async_{mode}_total_s"] = time.perf_counter() - t0
        timings[f"async_{mode}_reported_blocked_s"] = handle.blocked_s
        aref = f"{run}@{STEPS}"
        same = ucpd.verify(at_call, aref, store=store, progress=False)
        checks.add(f"async_{mode}_is_state_at_call", same.ok and bool(acid), f"{acid}: {same}")
        later = ucpd.verify(sd, aref, store=store, progress=False)
        checks.add(f"async_{mode}_mutation_detected", n > 0 and not later.ok,
                   f"{n} tensors mutated; verify of the mutated state: {len(later.mismatches)} mismatch(es)")
        if i == 0:  # nothing changed between the save and this call: the same content, array for array
            ahashes = {(t.name, t.state): t.content_hash for t in st.checkpoint(aref).tensors()}
            diff = sorted(k for k in sync_hashes if ahashes.get(k) != sync_hashes[k])
            checks.add(f"async_{mode}_equals_save", not diff and ahashes.keys() == sync_hashes.keys(),
                       f"content hashes differ from {ref}: {diff[:5]}")

    # ---- load in place into a zeroed state dict
    with torch.no_grad():
        for leaf in leaves:
            _local(leaf.value).zero_()
    before = {leaf.path: (id(leaf.value), id(_local(leaf.value)), _local(leaf.value).data_ptr()) for leaf in leaves}
    _sync(cuda)
    t0 = time.perf_counter()
    res = ucpd.load(sd, store=store, ref=ref, progress=False)
    _sync(cuda)
    timings["load_s"] = time.perf_counter() - t0
    out["bytes_read"] = res.bytes_read
    moved = [".".join(map(str, leaf.path)) for leaf in _tensor_leaves(sd)
             if before.get(leaf.path, (None,))[0] != id(leaf.value)
             or before[leaf.path][2] != _local(leaf.value).data_ptr()]
    checks.add("load_in_place", not moved and res.checkpoint_id == cid, f"replaced or reallocated: {moved[:5]}")
    if spec.get("fault") == "corrupt" and rank == spec["world"] - 1:  # one element of one loaded shard
        with torch.no_grad():
            _local(sd["model"]["norm.weight"]).view(-1)[0] += 1.0
    diffs = _compare(sd, snap, host=False)
    checks.add("load_bit_equal_on_device", not diffs, "; ".join(diffs[:5]))
    diffs = _compare(sd, snap, host=True)
    checks.add("load_bit_equal_host", not diffs, "; ".join(diffs[:5]))
    off = [".".join(map(str, leaf.path)) for leaf in _tensor_leaves(sd)
           if _is_dtensor(leaf.value) and _local(leaf.value).device.type != device]
    checks.add("load_stays_on_device", not off, f"off {device}: {off[:5]}")
    rep = ucpd.verify(sd, ref, store=store, progress=False)
    checks.add("verify_after_load", rep.ok, str(rep))

    # the loaded state trains on: set_state_dict and one more step on the device
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    loss = train_step(model, opt, *batch(cfg, STEPS, dp_rank=dp_rank, dp=spec["dp"], device=device))
    out["loss_after_load"] = loss
    checks.add("trains_after_load", loss == loss and abs(loss) < 1e6, f"loss {loss}")

    if spec.get("logical"):  # the full tensors of the saved state, for the cross-device load
        full = {}
        for leaf in _tensor_leaves(snap):
            v = leaf.value.full_tensor() if _is_dtensor(leaf.value) else leaf.value
            full["|".join(leaf.key)] = v.detach().cpu().clone()
        if rank == 0:
            torch.save(full, spec["logical"])
    out["ref"] = ref


def role_cross(spec, rank, out, checks: Checks):
    """Load the first phase's checkpoint on another device and mesh; compare with its logical tensors."""
    import torch

    import ucp_store.distributed as ucpd

    device = spec["device"]
    _cfg, _mesh, model, opt = _build(spec, device, 123, rank)
    sd = _state_dict(model, opt)
    out["placements"] = _placements_summary(sd)
    t0 = time.perf_counter()
    res = ucpd.load(sd, store=spec["store"], ref=spec["ref"], progress=False)
    out["timings"]["load_s"] = time.perf_counter() - t0
    out["bytes_read"] = res.bytes_read
    logical = torch.load(spec["logical"], map_location="cpu", weights_only=True)
    leaves = _tensor_leaves(sd)
    bad, missing = [], []
    for leaf in leaves:
        key = "|".join(leaf.key)
        v = leaf.value.full_tensor() if _is_dtensor(leaf.value) else leaf.value  # a collective: every rank
        if key not in logical:
            missing.append(key)
        elif not _bytes_equal(v.detach().cpu(), logical[key]):
            bad.append(key)
    checks.add("cross_load_equals_logical", not bad and not missing and len(leaves) == len(logical),
               f"{len(leaves)} tensors here, {len(logical)} saved; differ: {bad[:5]}; missing: {missing[:5]}")
    off = [".".join(map(str, leaf.path)) for leaf in leaves
           if _is_dtensor(leaf.value) and _local(leaf.value).device.type != device]
    checks.add("cross_stays_on_device", not off, f"off {device}: {off[:5]}")
    rep = ucpd.verify(sd, spec["ref"], store=spec["store"], progress=False)
    checks.add("cross_verify", rep.ok, str(rep))


def _write(spec: dict, rank: int, out: dict, checks: Checks) -> None:
    out["checks"] = checks.results
    out["failed"] = checks.failed()
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


def _control_group_check(checks: Checks) -> None:
    """ucp_store's own gloo group beside the default process group (with NCCL and a bound device: the
    ``new_group`` path every multi-rank save and load takes), made even for one rank, and a vote on it."""
    import torch.distributed as dist

    from ucp_store.distributed.commit import all_ok, control_group, gather_errors

    try:
        group = control_group(tag="device-check")
        ok = all_ok(True, group) and gather_errors(None, group) == [] and not all_ok(False, group)
        detail = f"gloo group of {dist.get_world_size(group)} rank(s) beside {dist.get_backend()!r}: votes ok={ok}"
    except Exception as exc:  # noqa: BLE001 - a failed check, named
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    checks.add("control_group_beside_default_pg", ok, detail)


def _rank_main(rank: int, spec: dict, port: int) -> int:
    import datetime
    import faulthandler

    faulthandler.enable(all_threads=True)  # stacks on a fatal signal (an abort in native code included)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks before killing a hang
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(spec["world"]), LOCAL_RANK=str(rank))
    out: dict = {"rank": rank, "phase": spec["phase"], "device": spec["device"], "timings": {}}
    checks = Checks()
    cuda = spec["device"] == "cuda"
    code = 0
    dist = None
    try:
        import torch
        import torch.distributed as dist

        out["torch"] = torch.__version__
        torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // spec["world"])))
        kwargs: dict = {"backend": spec["backend"], "rank": rank, "world_size": spec["world"],
                        "timeout": datetime.timedelta(seconds=PG_TIMEOUT_S)}
        if cuda:
            torch.cuda.set_device(rank)  # before the process group: NCCL binds this rank to its GPU
            kwargs["device_id"] = torch.device("cuda", rank)
            out["device_name"] = torch.cuda.get_device_name(rank)
            out["cuda"] = torch.version.cuda
            v = torch.cuda.nccl.version()  # a tuple on current torch, an int on old ones
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        else:
            import platform

            out["device_name"] = platform.processor() or platform.machine()
        t0 = time.perf_counter()
        dist.init_process_group(**kwargs)
        out["timings"]["init_process_group_s"] = time.perf_counter() - t0
        out["backend"] = str(dist.get_backend())
        want = "nccl" if cuda else "gloo"
        checks.add("backend", want in out["backend"], f"dist.get_backend() = {out['backend']!r}, expected {want}")
        if cuda:  # a collective on a device tensor goes through the default group's cuda backend (NCCL)
            x = torch.full((4,), float(rank + 1), device=torch.device("cuda", rank))
            dist.all_reduce(x)
            torch.cuda.synchronize()
            want_sum = spec["world"] * (spec["world"] + 1) / 2
            try:
                pg = dist.distributed_c10d._get_default_group()
                out["cuda_backend"] = type(pg._get_backend(torch.device("cuda", rank))).__name__
            except Exception as exc:  # noqa: BLE001 - private API: a record, not a check
                out["cuda_backend"] = f"unknown ({type(exc).__name__})"
            checks.add("device_all_reduce", x.device.type == "cuda" and x.cpu().tolist() == [want_sum] * 4,
                       f"all_reduce on {x.device} via {out['cuda_backend']}: {x.cpu().tolist()}, expected {want_sum}")
        globals()["role_" + spec["role"]](spec, rank, out, checks)
        _write(spec, rank, out, checks)  # what ran so far stays on record should the check below hang
        _control_group_check(checks)
    except BaseException as exc:  # noqa: BLE001 - recorded; the parent reports it
        out["crash"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        print(f"dist_device_check: rank {rank} of phase {spec['phase']} crashed: {out['crash']}", file=sys.stderr)
        code = 3
    _write(spec, rank, out, checks)
    if not code and out["failed"]:
        code = 1
    if code == 3:
        os._exit(code)  # no teardown collectives after a crash: the others must not wait for this rank
    try:
        import ucp_store.distributed as ucpd

        ucpd.close()  # stop the async writer processes
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        print(f"rank {rank}: teardown failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return code


# ----------------------------------------------------------------------------------------- parent side
def _run_phase(spec: dict, args) -> dict:
    """Start ``spec["world"]`` ranks, wait (bounded), and collect their JSON."""
    os.makedirs(spec["out"], exist_ok=True)
    port = free_port()
    env = dict(os.environ)
    env.setdefault("UCP_DIST_TIMEOUT", "60")
    env.setdefault("UCP_PROGRESS", "0")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # a timed-out NCCL collective aborts, never hangs
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r), json.dumps(spec),
                               str(port)], env=env) for r in range(spec["world"])]
    deadline = t0 + args.timeout
    first_error = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_error is None and any(p.returncode not in (None, 0) for p in procs):
            first_error = now
        if now > deadline or (first_error is not None and now > first_error + args.grace):
            break
        time.sleep(0.1)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    why = (f"{args.grace:g} s after another rank failed" if first_error is not None else
           f"the --timeout of {args.timeout:g} s")
    for r in hung:
        print(f"dist_device_check: rank {r} of phase {spec['phase']} still running after {why}; its stacks "
              "follow, then it is killed", file=sys.stderr)
        try:
            procs[r].send_signal(signal.SIGUSR1)
        except OSError:
            pass
        time.sleep(1)  # one rank's stacks at a time
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    ranks = []
    for r, p in enumerate(procs):
        path = os.path.join(spec["out"], f"rank{r}.json")
        res = None
        if os.path.exists(path):
            with open(path) as f:
                res = json.load(f)
        ranks.append({"rank": r, "rc": p.returncode, "hung": r in hung, "result": res})
    failed = {}
    for item in ranks:
        res, r = item["result"], item["rank"]
        if item["hung"]:
            failed[r] = f"killed: still running after {why}"
        elif res is None:
            failed[r] = f"exited {item['rc']} without a report"
        elif res.get("crash"):
            failed[r] = "crash: " + res["crash"].splitlines()[0][:300]
        elif res.get("failed"):
            failed[r] = "failed checks: " + ", ".join(f"{n} ({res['checks'][n]['detail'][:200]})"
                                                      for n in res["failed"])
        elif item["rc"] != 0:
            failed[r] = f"exited {item['rc']}"
    r0 = (ranks[0]["result"] or {}) if ranks else {}
    return {"phase": spec["phase"], "device": spec["device"], "world": spec["world"], "layout":
            {"tp": spec["tp"], "dp": spec["dp"]}, "ok": not failed, "hung": bool(hung) and first_error is None,
            "failed": failed,
            "seconds": round(time.monotonic() - t0, 2), "torch": r0.get("torch"), "backend": r0.get("backend"),
            "device_name": r0.get("device_name"), "nccl": r0.get("nccl"), "cuda_backend": r0.get("cuda_backend"),
            "timings": {k: round(v, 4) for k, v in (r0.get("timings") or {}).items()},
            "checks": sorted((r0.get("checks") or {}).keys())}


def _refusal(args) -> str | None:
    """Why ``args`` cannot run on this machine (None when it can). Only the cuda path asks CUDA."""
    if args.world < 1:
        return f"--world {args.world}: needs at least one rank"
    if args.device != "cuda":
        return None
    import torch
    import torch.distributed as dist

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < args.world:
        return (f"--device cuda --world {args.world} needs {args.world} GPU(s), one per rank (NCCL cannot put two "
                f"ranks on one GPU); this machine has {n} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    if not dist.is_nccl_available():
        return f"--device cuda: torch {torch.__version__} has no NCCL backend"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--rank":
        code = _rank_main(int(argv[1]), json.loads(argv[2]), int(argv[3]))
        # the report is written and the process group destroyed: skip the interpreter's and native static
        # teardown, where a gloo rank aborted now and then ("terminate called without an active exception",
        # no Python frame left; torch 2.13 CPU) after passing every check
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), required=True)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--out", required=True, help="folder for the store, per-rank JSON and summary.json")
    ap.add_argument("--layout", choices=("auto", "fsdp", "tp"), default="auto")
    ap.add_argument("--modes", default="thread,process,lazy",
                    help="async_save modes to check (comma-separated; lazy: the lazy snapshot in thread mode)")
    ap.add_argument("--cross", action="store_true",
                    help="then load the checkpoint on CPU/gloo ranks of another world size and layout")
    ap.add_argument("--cross-world", type=int, default=2)
    ap.add_argument("--backend", default=None,
                    help="process-group backend (default: 'cpu:gloo,cuda:nccl' for cuda, 'gloo' for cpu)")
    ap.add_argument("--fault", choices=("crash", "hang", "corrupt"), default=None,
                    help="for the tests of this script: the last rank crashes or hangs after the save, or changes "
                         "one loaded element before the comparisons")
    ap.add_argument("--timeout", type=float, default=180, help="wall-clock seconds per phase before ranks are killed")
    ap.add_argument("--grace", type=float, default=30,
                    help="seconds the other ranks get to report after one rank exits with an error")
    args = ap.parse_args(argv)
    summary: dict = {"ok": False, "device": args.device, "world": args.world, "cross": args.cross, "phases": []}
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    def finish(code: int) -> int:
        summary["exit"] = code
        line = json.dumps(summary, default=str)
        with open(os.path.join(out, "summary.json"), "w") as f:
            f.write(line + "\n")
        print(line, flush=True)
        return code

    why = _refusal(args)
    if why is not None:
        summary["refused"] = why
        print(f"dist_device_check: refused: {why}", file=sys.stderr)
        return finish(2)
    store = os.path.join(out, "store")
    backend = args.backend or ("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
    modes = [m for m in args.modes.split(",") if m]
    main_layout = _layout(args.world, args.layout)
    spec = {"phase": "main", "role": "main", "device": args.device, "world": args.world, "backend": backend,
            "store": store, "out": os.path.join(out, "main"), "modes": modes, "async_timeout": args.timeout,
            "fault": args.fault, "logical": os.path.join(out, "logical.pt") if args.cross else None, **main_layout}
    phase = _run_phase(spec, args)
    summary["phases"].append(phase)
    code = 0 if phase["ok"] else 4 if phase["hung"] else 1
    if args.cross and phase["ok"]:
        # another device and another layout: TP where the main phase used FSDP, FSDP otherwise
        kind = "tp" if main_layout["tp"] == 1 and args.cross_world > 1 else "fsdp"
        cspec = {"phase": "cross", "role": "cross", "device": "cpu", "world": args.cross_world, "backend": "gloo",
                 "store": store, "out": os.path.join(out, "cross"), "ref": f"{RUN}@{STEPS}",
                 "logical": spec["logical"], **_layout(args.cross_world, kind)}
        cphase = _run_phase(cspec, args)
        summary["phases"].append(cphase)
        if not cphase["ok"]:
            code = 4 if cphase["hung"] else 1
    summary["ok"] = code == 0
    return finish(code)


if __name__ == "__main__":
    sys.exit(main())
