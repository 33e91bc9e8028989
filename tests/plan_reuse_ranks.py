"""Harness of tests/test_plan_reuse.py: 2 gloo ranks (forked) save a state dict several times through
``ucp_store.distributed`` and record, per save, whether its tensors were described afresh
(``planner._describe_leaves`` calls) and whether a load of that version equals the state at the save, bit for bit.

Between saves the state changes in place (the description is reused: the same storage), then a plain tensor and
a DTensor's shard are swapped for new storage (``.data = ...``: described afresh), then ``get_state_dict``-style
new wrapper objects over the same storage are handed in (reused). Prints the per-rank records as JSON
(the ranks forked by ``one_writer_ranks.launch``)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys


def rank_main(spec: dict, rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ucp_store.distributed as ucpd
    from ucp_store.distributed import planner

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_dt.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    described = [0]
    real = planner._describe_leaves

    def counting(*a, **k):
        described[0] += 1
        return real(*a, **k)

    planner._describe_leaves = counting
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank  # per-rank plain tensor
    full = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    d = DTensor.from_local(full.chunk(world)[rank].clone(), mesh, [Shard(0)], run_check=False)

    def state():  # new wrapper objects each call, over the same storage (as get_state_dict hands out)
        return {"model": {"w": w.detach(), "d": d.detach()}, "step": 1}

    records = []
    for step, change in enumerate(["", "inplace", "swap", "wrappers", "inplace"], start=1):
        if change == "inplace":
            w.add_(1.0)
            d.to_local().mul_(2.0)
        elif change == "swap":
            w.data = torch.full((3, 4), 7.0 + rank)  # new storage behind the same object
            d.data = DTensor.from_local(torch.full((8 // world, 5), 3.0 + rank), mesh, [Shard(0)], run_check=False)
        before = described[0]
        sd = state()
        ucpd.save(sd, store=spec["store"], run="reuse", step=step, progress=False)
        want = {k: v.to_local().clone() if isinstance(v, DTensor) else v.clone() for k, v in sd["model"].items()}
        fresh = {"model": {"w": torch.zeros(3, 4), "d": DTensor.from_local(torch.zeros(8 // world, 5), mesh, [Shard(0)],
                                                                            run_check=False)}, "step": 0}
        ucpd.load(fresh, store=spec["store"], ref=f"reuse@{step}", progress=False)
        got = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in fresh["model"].items()}
        exact = all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in want)
        records.append({"step": step, "change": change, "described": described[0] - before, "exact": bool(exact)})
    dist.destroy_process_group()
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"records": records}, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from one_writer_ranks import launch

    print(json.dumps(launch({"world": 2, **json.loads(sys.argv[1])}, rank_main)))
