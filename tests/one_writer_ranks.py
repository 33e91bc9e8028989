"""Issue 27 item 0 harness: N gloo ranks (forked from one interpreter) save an unevenly split state through one
store with ``localwrite.record_writes`` on, load it back, and write ``out/rank<r>.json``: the array objects this
rank wrote (``zarr.json`` and shard files) and whether the load was bit-exact.

Run as ``python tests/one_writer_ranks.py '<spec json>'`` (tests/test_one_writer.py); the spec names ``world``,
``store`` (a folder or an s3:// URL; the catalog from ``UCP_CATALOG``), ``out`` and ``api``: ``"dist"``
(``ucp_store.distributed.save``/``load``) or ``"dcp"`` (``dcp.save``/``dcp.load`` through ``UcpStorageWriter``/
``UcpStorageReader``; DCP keeps one copy of a plain tensor and reads a top-level tensor beside ``model`` as
no model state, so that state has no ``rng``)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
import time
import traceback

# uneven Shard(dim) splits over 3 ranks (torch's ceil split: 4,4,2 / 3,3,1 / 334,334,332 ...)
SHAPES = {"a": ((10, 3), 0), "b": ((7,), 0), "c": ((5, 7), 1), "d": ((1000, 64), 0), "e": ((2, 9, 5), 1)}


def _full(name: str, shape, step: int):
    import torch

    n = 1
    for s in shape:
        n *= s
    seed = sum(map(ord, name))
    return (torch.arange(n, dtype=torch.float32).reshape(shape) * 1.5 + seed + step).contiguous()


def _state(rank: int, mesh, step: int, api: str = "dist") -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sd: dict = {"model": {}, "rng": torch.full((3,), float(rank) + step), "step": step}
    if api == "dcp":
        del sd["rng"]
    for name, (shape, dim) in SHAPES.items():
        full = _full(name, shape, step)
        local = torch.tensor_split(full, [min(shape[dim], i * -(-shape[dim] // 3)) for i in (1, 2)], dim)[rank]
        sd["model"][name] = DTensor.from_local(local.clone(), mesh, [Shard(dim)], run_check=False,
                                               shape=full.shape, stride=full.stride())
    sd["model"]["rep"] = DTensor.from_local(_full("rep", (33,), step), mesh, [Replicate()], run_check=False)
    return sd


def rank_main(spec: dict, rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ucp_store.distributed as ucpd
    from ucp_store.io import localwrite

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_dt.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    log = localwrite.record_writes(rank)
    assert log is not None
    api = spec.get("api", "dist")
    sd = _state(rank, mesh, 1, api)
    if api == "dcp":
        import torch.distributed.checkpoint as dcp

        from ucp_store.formats.dcp.storage import UcpStorageReader, UcpStorageWriter

        dcp.save(sd, storage_writer=UcpStorageWriter(spec["store"], run="one", step=1))
    else:
        ucpd.save(sd, store=spec["store"], run="one", step=1, progress=False)
    written = list(log.entries)
    localwrite.record_writes(None)
    fresh = _state(rank, mesh, -7, api)
    if api == "dcp":
        dcp.load(fresh, storage_reader=UcpStorageReader(spec["store"], "one@1"))
    else:
        ucpd.load(fresh, store=spec["store"], ref="one@1", progress=False)
    exact = all(torch.equal(fresh["model"][k].to_local().view(torch.int32), sd["model"][k].to_local().view(torch.int32))
                for k in sd["model"])
    exact = exact and ("rng" not in sd or torch.equal(fresh["rng"], sd["rng"])) and fresh["step"] == 1
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"written": written, "exact": bool(exact)}, f)
    dist.destroy_process_group()


def launch(spec: dict, main=None) -> list[dict]:
    """Fork ``spec["world"]`` ranks running ``main(spec, rank, world, port)`` (default: this file's
    ``rank_main``), each writing ``out/rank<r>.json``; returns those records (tests/plan_reuse_ranks.py too)."""
    import torch  # noqa: F401 - loaded once, before the forks
    import torch.distributed.tensor  # noqa: F401


    world = spec["world"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(spec["out"], exist_ok=True)
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                (main or rank_main)(spec, r, world, port)
                code = 0
            except BaseException:  # noqa: BLE001 - the parent reports the failed rank
                traceback.print_exc()
            finally:
                os._exit(code)
        pids.append(pid)
    failed, deadline = [], time.monotonic() + 300
    for r, pid in enumerate(pids):
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                if status:
                    failed.append(r)
                break
            if time.monotonic() > deadline:
                for p in pids:
                    try:
                        os.kill(p, 9)
                    except OSError:
                        pass
                raise RuntimeError(f"rank {r} still running after 300 s")
            time.sleep(0.05)
    if failed:
        raise RuntimeError(f"rank(s) {failed} failed (see stderr)")
    out = []
    for r in range(world):
        with open(os.path.join(spec["out"], f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


if __name__ == "__main__":
    print(json.dumps(launch(json.loads(sys.argv[1]))))
