"""Gloo ranks of tests/test_tiers_restore.py: restores from the nearest copies (issue 38) on simulated nodes.

Run as ``python tests/restore_ranks.py SPEC_JSON`` (plain rank processes, ``tests/ucp_test_helpers``). Rank ``r``
is on node ``spec["nodes"][r]`` (``UCP_NODE``); each node's fast tier is its own folder (``spec["fast"]``, a
``{node}`` template). The ranks hold a state of DTensors on a 1-D mesh (``Shard(0)``) or a 2-D ``dp x tp`` mesh
(``Shard(0), Shard(1)``), and a replicated one, and then:

- ``"save"``: save ``steps`` with ``tier="fast", replicas=1`` (``drain``: each waits until ``durable``;
  ``drain_steps``: those steps only);
- ``"load"``: load ``ref`` (``"latest"``: ``Checkpointer.load_latest`` with ``tier="fast"``, which
  resumes from ``newest_restorable``'s pick) into zeros and compare every local
  shard with the saved tensor, bit for bit; with ``scenarios`` (``name``, ``nodes``, ``fast``, ``refs``), each
  scenario's refs in turn, rank ``r`` on node ``nodes[r]`` with that scenario's fast-tier folders (one launch
  for several restores).

Each rank writes ``<out>/rank<r>.json``: the versions saved, or what the load reported (its tier bytes, bad
copies, the version and the note) and the tensors that differ.
"""

from __future__ import annotations

import json
import os
import traceback

from ucp_test_helpers import rank_main_or_launch

SHAPES = {"w1": (48, 40), "w2": (96, 24), "b": (240,)}


def full_tensor(name: str, step: int):
    """The logical tensor ``name`` at ``step`` (what every version must load back, bit for bit)."""
    import torch

    shape = SHAPES.get(name, (240,))
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(n, generator=g).reshape(shape)


def _local(full, mesh_shape: list[int], coord: tuple[int, ...]):
    if len(mesh_shape) == 1:
        return full.chunk(mesh_shape[0], 0)[coord[0]]
    part = full.chunk(mesh_shape[0], 0)[coord[0]]
    return part.chunk(mesh_shape[1], 1)[coord[1]] if full.dim() > 1 else part


def state(mesh, step: int, zeros: bool = False) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape = list(mesh.shape)
    coord = tuple(mesh.get_coordinate())
    sd: dict = {"model": {}, "step": 0 if zeros else step}
    for name in [*SHAPES, "rep"]:
        full = full_tensor(name, step)
        if name == "rep":
            local, places = full, [Replicate()] * len(shape)
        else:
            local = _local(full, shape, coord)
            places = [Shard(0)] if len(shape) == 1 else [Shard(0), Shard(1) if full.dim() > 1 else Replicate()]
        local = torch.zeros_like(local) if zeros else local.clone()
        sd["model"][name] = DTensor.from_local(local.contiguous(), mesh, places, run_check=False,
                                               shape=full.shape, stride=full.stride())
    return sd


def _save(spec: dict, mesh, out: dict) -> None:
    import ucp_store.distributed as ucpd
    from ucp_store.distributed import tiered

    kill = spec.get("kill") or {}
    for step in spec["steps"]:
        if kill.get("rank") == int(os.environ["RANK"]) and kill.get("step") == step:
            from ucp_store import _killpoints

            _killpoints.rearm(kill["point"])  # this rank SIGKILLs itself there (this save or its drain)
        drain = step in spec["drain_steps"] if "drain_steps" in spec else spec.get("drain", False)
        res = ucpd.save(state(mesh, step), store=spec["store"], run="r", step=step, tier="fast", replicas=1,
                        fast_tier=spec["fast"], progress=False, drain=drain, fast_keep=spec.get("fast_keep", 2))
        rec = {"step": step, "id": str(res), "safety": res.safety}
        if drain:
            rec["waited"] = res.wait("durable", timeout=120)
        out["saved"].append(rec)
    tiered.drain_idle(120)


def _load(spec: dict, mesh, out: dict) -> None:
    if "scenarios" in spec:  # several restores in one launch, each on its own nodes and fast-tier folders
        rank = int(os.environ["RANK"])
        out["scenarios"] = {}
        for sc in spec["scenarios"]:
            got = out["scenarios"][sc["name"]] = {"loads": []}
            one = {**spec, "fast": sc["fast"], "node": sc["nodes"][rank]}
            for ref in sc["refs"]:
                got["loads"].append({})
                _load_one(one, ref, mesh, got["loads"][-1])
        return
    if "refs" not in spec:
        _load_one(spec, spec["ref"], mesh, out)
        return
    out["loads"] = []
    for ref in spec["refs"]:
        out["loads"].append({})
        _load_one(spec, ref, mesh, out["loads"][-1])


def _load_one(spec: dict, ref: str, mesh, out: dict) -> None:
    import torch

    import ucp_store.distributed as ucpd

    node = spec.get("node")  # else UCP_NODE
    if ref == "latest":  # what a training loop calls: Checkpointer.load_latest with the fast tier's options
        sd = state(mesh, 0, zeros=True)
        ck = ucpd.Checkpointer(spec["store"], "r", tier="fast", fast_tier=spec["fast"], node=node)
        step = ck.load_latest(sd)
        out.update(ref=f"r@{step}", note=ck.last_note, step=sd["step"])
        want = state(mesh, step)
        out["differ"] = [name for name, t in sd["model"].items() if not torch.equal(
            t.to_local().view(torch.int32), want["model"][name].to_local().view(torch.int32))]
        return
    step = int(ref.rsplit("@", 1)[1])
    sd = state(mesh, step, zeros=True)
    res = ucpd.load(sd, store=spec["store"], ref=ref, fast_tier=spec["fast"], progress=False, node=node)
    out.update(ref=ref, id=res.checkpoint_id, tier_bytes=res.tier_bytes, job=res.job_tier_bytes,
               bad=res.bad_copies, step=sd["step"])
    report = ucpd.verify(sd, ref, store=spec["store"], fast_tier=spec["fast"], progress=False, node=node)
    out["verified"] = [report.ok, str(report)[:500]]
    want = state(mesh, step)
    out["differ"] = [name for name, t in sd["model"].items() if not torch.equal(
        t.to_local().view(torch.int32), want["model"][name].to_local().view(torch.int32))]


def _rank_main(rank: int, spec: dict, port: int) -> None:
    world = spec["world"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      UCP_NODE=spec["nodes"][rank], UCP_DIST_TIMEOUT=str(spec.get("timeout_s", 60)))
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    mesh = init_device_mesh("cpu", tuple(spec["mesh"]))
    out: dict = {"saved": []}
    try:
        (_save if spec["action"] == "save" else _load)(spec, mesh, out)
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()[-3000:]
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank_main_or_launch(__file__, _rank_main)
