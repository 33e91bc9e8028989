"""Gloo ranks of tests/test_tiers_dist.py: tiered saves (issue 38) on simulated nodes of one machine.

Run as ``python tests/tier_ranks.py SPEC_JSON``: ``world`` plain rank processes (one killed leaves the others to
report), rank ``r`` on node ``n<r // per_node>`` (``UCP_NODE``), each node's fast tier its own folder
(``spec["fast"]``, a ``{node}`` template). Every rank saves ``steps`` versions of a DTensor state (Shard(0) over
the world, plus a replicated tensor) with ``ucp_store.distributed.save(..., tier="fast")`` (``async``:
``async_save``, the state changed right after the call) and writes
``<out>/rank<r>.json``: per step the version id, the safety when save returned and, with ``wait``, the level
``wait`` returned (or the error). ``kill``: ``{rank: "point[:N]"}`` arms ``UCP_KILL_AT`` on that rank.
"""

from __future__ import annotations

import json
import os
import traceback

from ucp_test_helpers import rank_main_or_launch

SHAPES = {"w1": (64, 96), "w2": (128, 33), "b": (256,), "big": (512, 384)}  # small ones: read back by the origin


def full_tensor(name: str, step: int):
    """The logical tensor ``name`` at ``step`` (what every version must load back, bit for bit)."""
    import torch

    shape = SHAPES[name]
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(n, generator=g).reshape(shape)


def state(rank: int, world: int, mesh, step: int) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sd: dict = {"model": {}, "step": step}
    for name in SHAPES:
        full = full_tensor(name, step)
        local = torch.chunk(full, world, 0)[rank].clone()  # DTensor's ceil split
        sd["model"][name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                               stride=full.stride())
    sd["model"]["rep"] = DTensor.from_local(full_tensor("b", step + 100), mesh, [Replicate()], run_check=False)
    return sd


def start(rank: int, spec: dict, port: int):
    """A rank of a tiered-save script (this one, tests/dcp_tier_ranks.py): its environment (node
    ``n<rank // per_node>``, ``timeout_s``, ``UCP_KILL_AT`` where ``kill`` names the rank), the gloo group and
    a 1-D mesh over the world, which it returns."""
    world = spec["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      UCP_NODE=f"n{rank // spec['per_node']}", UCP_DIST_TIMEOUT=str(spec.get("timeout_s", 30)))
    if str(rank) in spec.get("kill", {}):  # UCP_KILL_AT on that rank: killed there (SIGKILL)
        os.environ["UCP_KILL_AT"] = spec["kill"][str(rank)]
        from ucp_store import _killpoints

        _killpoints.rearm()  # read at import, and the launcher may have imported ucp_store before the fork
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    return init_device_mesh("cpu", (world,))


def finish(rank: int, spec: dict, out: dict) -> None:
    """Write ``out`` as ``<out>/rank<rank>.json``; without an error, wait for this rank's drains and leave the
    group together."""
    import torch.distributed as dist

    from ucp_store.distributed import tiered

    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if "error" not in out:
        tiered.drain_idle(120)
        dist.barrier()
        dist.destroy_process_group()


def _rank_main(rank: int, spec: dict, port: int) -> None:
    import ucp_store.distributed as ucpd

    world = spec["world"]
    mesh = start(rank, spec, port)
    out: dict = {"steps": []}
    try:
        for step in spec["steps"]:
            rec: dict = {"step": step}
            out["steps"].append(rec)
            options = {"replicas": spec.get("replicas", 1), "fast_tier": spec["fast"],
                       "fast_keep": spec.get("fast_keep", 2), "drain": spec.get("drain", True)}
            sd = state(rank, world, mesh, step)
            if spec.get("async"):  # async_save(tier="fast"): the state changed right after the call must not count
                handle = ucpd.async_save(sd, store=spec["store"], run="t", step=step, tier="fast", **options)
                for v in sd["model"].values():
                    v.to_local().add_(1.0)
                res = handle.result()
            else:
                res = ucpd.save(sd, store=spec["store"], run="t", step=step, tier="fast", progress=False, **options)
            rec.update(id=str(res), safety=res.safety)
            if spec.get("wait"):
                rec["waited"] = res.wait(spec["wait"], timeout=120)
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()[-3000:]
    finish(rank, spec, out)


if __name__ == "__main__":
    rank_main_or_launch(__file__, _rank_main)
