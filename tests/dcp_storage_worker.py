"""Gloo ranks of tests/test_dcp_storage.py: ``dcp.save`` / ``async_save`` / ``load`` through ucp_store's
DCP storage backend, side by side with DCP's own ``FileSystemWriter`` / ``FileSystemReader``.

Run as ``python tests/dcp_storage_worker.py SPEC_JSON``: it starts ``world`` plain rank processes (one that
dies leaves the others to report) that each run every scenario of ``spec["scenarios"]`` in order and write
``<out>/rank<r>.json``: ``{scenario: result}``, where a scenario that raised records ``{"error": ...}``.

Scenarios (the demo GPT of ``ucp_store.demo.model``: TP via ``parallelize_module``, FSDP2 via ``fully_shard``,
a torchtitan-style loop):

- ``save``: train on FSDP2 (dp=2), ``dcp.save`` the model + optimizer + non-tensor extras (BYTE_IO, a 0-d
  tensor, an RNG state) through the backend and through ``FileSystemWriter``; keep training (the
  uninterrupted losses);
- ``load_same`` / ``load_tp``: fresh models on dp=2 / tp=2 load both copies (``UcpStorageReader`` and
  ``FileSystemReader``): every tensor bit for bit equal, extras equal; then train on: the losses of the
  resumed run on the same mesh equal the uninterrupted run's, on tp=2 they are close;
- ``async_thread``: ``dcp.async_save`` with the thread executor, tensors changed right after the call; the
  committed version holds the state at the call;
- ``bad``: a missing ref, a run name escaping the store, a shape mismatch on load, a rank failing in
  ``write_data``; each a clear error and nothing listed.
"""

from __future__ import annotations

import json
import os
import traceback

from ucp_test_helpers import rank_main_or_launch

STEPS = 2


def _model(mesh_kind: str, seed: int):
    from ucp_store.demo.model import ModelConfig, build_model, build_optimizer, make_mesh, parallelize

    cfg = ModelConfig()
    tp, dp = (2, 1) if mesh_kind == "tp" else (1, 2)
    model = build_model(cfg, seed)
    mesh = make_mesh(tp=tp, dp=dp, device_type="cpu")
    parallelize(model, mesh, tp=tp, dp=dp)
    return cfg, model, build_optimizer(model)


def _train(model, opt, cfg, mesh_kind, rank, start, n):
    from ucp_store.demo.model import batch, train_step

    dr, ndp = (0, 1) if mesh_kind == "tp" else (rank, 2)
    return [train_step(model, opt, *batch(cfg, s, dp_rank=dr, dp=ndp)) for s in range(start, start + n)]


def _sd(model, opt, extras=None):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m, o = get_state_dict(model, opt)
    sd = {"model": m, "optim": o}
    if extras is not None:
        sd["extras"] = extras
    return sd


def _extras(rank):
    import torch

    return {"note": {"step": STEPS, "tags": ["a", "b"]}, "counter": torch.tensor(7, dtype=torch.int64),
            "rng": torch.Generator().manual_seed(5).get_state(), f"per_rank_{rank}": {"rank": rank}}


def _set(model, opt, sd):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _bits_equal(a, b) -> list[str]:
    """Keys where two flattened state dicts differ (local shards bit for bit)."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor import DTensor

    fa, _ = flatten_state_dict(a)
    fb, _ = flatten_state_dict(b)
    out = [f"keys differ: {sorted(set(fa) ^ set(fb))[:5]}"] if set(fa) != set(fb) else []
    for k in sorted(set(fa) & set(fb)):
        x, y = fa[k], fb[k]
        if isinstance(x, DTensor):
            x, y = x.to_local(), y.to_local()
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(
                    x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8)):
                out.append(f"{k}: differs")
        elif x != y:
            out.append(f"{k}: {x!r} vs {y!r}")
    return out


def sc_save(spec, rank, state):
    import torch.distributed.checkpoint as dcp

    from ucp_store.formats.dcp.storage import UcpStorageWriter

    cfg, model, opt = _model("dp", 0)
    losses = _train(model, opt, cfg, "dp", rank, 0, STEPS)
    sd = _sd(model, opt, _extras(rank))
    dcp.save(sd, storage_writer=UcpStorageWriter(spec["store"], run="r", step=STEPS))
    dcp.save(sd, checkpoint_id=spec["dcp"])
    after = _train(model, opt, cfg, "dp", rank, STEPS, 2)
    state["uninterrupted"] = after
    return {"losses": losses, "after": after}


def _resume(spec, rank, mesh_kind, state):
    import torch.distributed.checkpoint as dcp

    from ucp_store.formats.dcp.storage import UcpStorageReader

    cfg, mu, ou = _model(mesh_kind, 123)
    _, md, od = _model(mesh_kind, 456)
    sdu, sdd = _sd(mu, ou, _extras(rank)), _sd(md, od, _extras(rank))
    for sd in (sdu, sdd):
        sd["extras"]["note"] = {"step": -1, "tags": []}  # overwritten by the load
    dcp.load(sdu, storage_reader=UcpStorageReader(spec["store"], f"r@{STEPS}"))
    dcp.load(sdd, checkpoint_id=spec["dcp"])
    _set(mu, ou, sdu)
    _set(md, od, sdd)
    diffs = _bits_equal(_sd(mu, ou, sdu["extras"]), _sd(md, od, sdd["extras"]))
    lu = _train(mu, ou, cfg, mesh_kind, rank, STEPS, 2)
    ld = _train(md, od, cfg, mesh_kind, rank, STEPS, 2)
    return {"diffs": diffs, "note": sdu["extras"]["note"], "counter": int(sdu["extras"]["counter"]),
            "loss_ucp": lu, "loss_dcp": ld, "uninterrupted": state.get("uninterrupted")}


def sc_load_same(spec, rank, state):
    return _resume(spec, rank, "dp", state)


def sc_load_tp(spec, rank, state):
    return _resume(spec, rank, "tp", state)


def sc_async_thread(spec, rank, state):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from ucp_store import open_store
    from ucp_store.formats.dcp.storage import UcpStorageWriter

    cfg, model, opt = _model("dp", 0)
    _train(model, opt, cfg, "dp", rank, 0, 1)
    sd = _sd(model, opt)
    expect = {k: v.to_local().clone() for k, v in sd["model"].items()}
    fut = dcp.async_save(sd, storage_writer=UcpStorageWriter(spec["store"], run="async", step=1),
                         async_checkpointer_type=AsyncCheckpointerType.THREAD)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)  # after the call: the checkpoint must not see it
    fut.result(timeout=120)
    torch.distributed.barrier()
    ck = open_store(spec["store"]).checkpoint("async@1")
    wrong = []
    for k, local in expect.items():
        full = ck.read(k, "weight")
        dt = sd["model"][k]
        if not torch.equal(full[tuple(slice(o, o + n) for o, n in zip(_offsets(dt), local.shape))], local):
            wrong.append(k)
    return {"wrong": wrong}


def sc_async_process(spec, rank, state):
    """``dcp.async_save`` with DCP's process executor: the writer is pickled into a spawned checkpoint process
    (its own gloo group), which opens the store from its URL; the version holds the state at the call."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from ucp_store import open_store
    from ucp_store.formats.dcp.storage import UcpStorageWriter

    cfg, model, opt = _model("dp", 0)
    _train(model, opt, cfg, "dp", rank, 0, 1)
    sd = _sd(model, opt, {"note": {"rank0": "only"}})
    expect = {k: v.to_local().clone() for k, v in sd["model"].items()}
    fut = dcp.async_save(sd, storage_writer=UcpStorageWriter(spec["store"], run="aproc", step=1),
                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)  # after the call: the checkpoint must not see it
    fut.result(timeout=180)
    torch.distributed.barrier()
    ck = open_store(spec["store"]).checkpoint("aproc@1")
    wrong = []
    for k, local in expect.items():
        full = ck.read(k, "weight")
        if not torch.equal(full[tuple(slice(o, o + n) for o, n in zip(_offsets(sd["model"][k]), local.shape))], local):
            wrong.append(k)
    return {"wrong": wrong, "objects": sorted(n for n in ck.objects() if n.startswith("extras."))}


def sc_dead_rank(spec, rank, state):
    """The last rank stops answering inside ``write_data`` (``hang``: blocked until the others are done;
    ``exit``: the process ends). The others must get an error from ``dcp.save`` within the writer's
    ``timeout`` (the process group's own is far longer), and nothing may be listed."""
    import time

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ucp_store import open_store
    from ucp_store.formats.dcp.storage import UcpStorageWriter

    world, out = spec["world"], spec["out"]
    dead = world - 1
    released = os.path.join(out, "released")

    class Stuck(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if rank == dead:
                if spec["dead_mode"] == "exit":
                    os._exit(0)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and not all(
                        os.path.exists(os.path.join(out, f"survivor{r}")) for r in range(dead)):
                    time.sleep(0.05)
                with open(released, "w"):
                    pass
                raise RuntimeError("the stuck rank gives up")
            return super().resolve_data(write_item)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sd = {"model": {"w": distribute_tensor(torch.arange(world * 64.0).reshape(world * 8, 8), mesh, [Shard(0)])}}
    w = UcpStorageWriter(spec["store"], run="dead", step=1, timeout=spec["writer_timeout"])
    error = None
    try:
        dcp.save(sd, storage_writer=w, planner=Stuck())
    except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        error = f"{type(exc).__name__}: {exc}"[:2000]
    stuck_released = os.path.exists(released)
    with open(os.path.join(out, f"survivor{rank}"), "w"):
        pass
    w.reset()  # the coordinator drops its pending version (as the next save would)
    listed = sorted(f"{c['run']}@{c['step']}" for c in open_store(spec["store"]).list_checkpoints())
    return {"error": error, "stuck_released_first": stuck_released, "listed": listed}


def _offsets(dt):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)[1]


def sc_bad(spec, rank, state):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ucp_store import open_store
    from ucp_store.formats.dcp.storage import UcpStorageReader, UcpStorageWriter

    out = {}

    def error(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
            return f"{type(exc).__name__}: {exc}"
        return None

    out["missing_ref"] = error(lambda: UcpStorageReader(spec["store"], "r@999"))
    out["escaping_run"] = error(lambda: UcpStorageWriter(spec["store"], run="../evil", step=1))
    out["escaping_id"] = error(lambda: dcp.save({"x": torch.zeros(2)}, storage_writer=UcpStorageWriter(
        spec["store"]), checkpoint_id="../evil@1"))
    wrong = {"model": {"tok.weight": torch.zeros(3, 3)}}
    cfg, model, opt = _model("dp", 0)
    sd = _sd(model, opt)
    key = next(iter(sd["model"]))
    wrong = {"model": {key: torch.zeros(3, 3)}}
    out["shape"] = error(lambda: dcp.load(wrong, storage_reader=UcpStorageReader(spec["store"], f"r@{STEPS}")))
    out["missing_key"] = error(lambda: dcp.load({"model": {"nope.weight": torch.zeros(2)}},
                                                storage_reader=UcpStorageReader(spec["store"], f"r@{STEPS}")))

    class Failing(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if rank == 1:
                raise RuntimeError("rank 1 cannot stage its shard")
            return super().resolve_data(write_item)

    w = UcpStorageWriter(spec["store"], run="fail", step=1)
    out["rank_fails"] = error(lambda: dcp.save(sd, storage_writer=w, planner=Failing()))
    w.reset()  # drops the pending version on the coordinator (as the next save would)
    torch.distributed.barrier()
    st = open_store(spec["store"])
    out["listed"] = sorted(f"{c['run']}@{c['step']}" for c in st.list_checkpoints())
    out["pending_left"] = _pending(st)
    return out


def _pending(st) -> int:
    from sqlalchemy import func, select

    from ucp_store.catalog import models as m

    with st.catalog.session() as s:
        return int(s.scalar(select(func.count()).select_from(m.Checkpoint).where(m.Checkpoint.status == "pending")))


SCENARIOS = {"save": sc_save, "load_same": sc_load_same, "load_tp": sc_load_tp, "async_thread": sc_async_thread,
             "async_process": sc_async_process, "bad": sc_bad, "dead_rank": sc_dead_rank}
# scenarios after which the process group is broken: the rank writes its results and ends
BREAKS_GROUP = {"dead_rank"}


def _rank_main(rank, spec, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(spec["world"]), LOCAL_RANK=str(rank))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=spec["world"],
                            timeout=datetime.timedelta(seconds=spec.get("pg_timeout", 60)))
    results: dict = {}
    state: dict = {}
    try:
        for name in spec["scenarios"]:
            try:
                results[name] = SCENARIOS[name](spec, rank, state)
            except BaseException:  # noqa: BLE001 - recorded (DCP raises a BaseException); the test names it
                results[name] = {"error": traceback.format_exc()[-3000:]}
            if name in BREAKS_GROUP:
                break
            dist.barrier()
    finally:
        with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        if BREAKS_GROUP.isdisjoint(spec["scenarios"]):
            dist.destroy_process_group()
        else:
            os._exit(0)


def main() -> None:
    rank_main_or_launch(__file__, _rank_main)


if __name__ == "__main__":
    main()
