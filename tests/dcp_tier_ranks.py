"""Gloo ranks of tests/test_dcp_tiers.py: tiered saves through the DCP backend (issue 38) on simulated nodes.

Run as ``python tests/dcp_tier_ranks.py SPEC_JSON``: ``world`` rank processes, rank ``r`` on node
``n<r // per_node>`` (``UCP_NODE``), each node's fast tier its own folder (``spec["fast"]``, a ``{node}``
template; ``kill``: ``{rank: "point[:N]"}`` arms ``UCP_KILL_AT`` there). Every rank saves ``steps`` versions of
tests/tier_ranks.py's DTensor state with ``dcp.save`` and a ``UcpStorageWriter(tier="fast")``, then calls
``writer.replicate()`` and waits for ``durable``; rank 0 reads the catalog's safety after each phase. Every rank
then loads each version back through ``UcpStorageReader`` and through ``ucp_store.distributed.load`` and
compares its shards bit for bit. Writes ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import traceback

from tier_ranks import SHAPES, finish, full_tensor, start, state

from ucp_test_helpers import rank_main_or_launch


def _zeros_like(sd: dict) -> dict:
    import torch

    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": -1}


def _exact(sd: dict, rank: int, world: int, step: int) -> list[str]:
    """The keys of ``sd`` whose local shard differs from the saved state at ``step``."""
    import torch

    bad = []
    for name, v in sd["model"].items():
        full = full_tensor("b", step + 100) if name == "rep" else full_tensor(name, step)
        want = full if name == "rep" else torch.chunk(full, world, 0)[rank]
        if not torch.equal(v.to_local().view(torch.int32), want.view(torch.int32)):
            bad.append(name)
    return bad


def _step_bad(sd: dict, step: int) -> list[str]:
    return [] if sd["step"] == step else ["step"]


def _safety(store_path: str, ck: str) -> str | None:
    import ucp_store
    from ucp_store.tiers import placement as tp

    store = ucp_store.open_store(store_path)
    with store.catalog.session() as s:
        return tp.safety_of(s, ck)


def _rank_main(rank: int, spec: dict, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ucp_store.distributed as ucpd
    from ucp_store.formats.dcp.storage import UcpStorageReader, UcpStorageWriter

    world = spec["world"]
    mesh = start(rank, spec, port)
    out: dict = {"steps": []}
    try:
        for step in spec["steps"]:
            rec: dict = {"step": step}
            out["steps"].append(rec)
            writer = UcpStorageWriter(spec["store"], run="t", step=step, tier="fast", replicas=1,
                                      fast_tier=spec["fast"], fast_keep=spec.get("fast_keep", 2))
            dcp.save(state(rank, world, mesh, step), storage_writer=writer)
            dist.barrier()
            ck = writer._tier.checkpoint_id
            if rank == 0:
                rec["after_save"] = _safety(spec["store"], ck)
            dist.barrier()
            res = writer.replicate()
            rec.update(id=str(res), safety=res.safety)
            if rank == 0:
                rec["after_replicate"] = _safety(spec["store"], ck)
            rec["waited"] = res.wait("durable", timeout=120)
            dist.barrier()
            if rank == 0:
                rec["after_wait"] = _safety(spec["store"], ck)
        for rec in out["steps"]:
            sd = _zeros_like(state(rank, world, mesh, rec["step"]))
            dcp.load(sd, storage_reader=UcpStorageReader(spec["store"], rec["id"]))
            rec["dcp_load_bad"] = _exact(sd, rank, world, rec["step"]) + _step_bad(sd, rec["step"])
            sd = _zeros_like(state(rank, world, mesh, rec["step"]))
            ucpd.load(sd, store=spec["store"], ref=rec["id"], progress=False)
            rec["ucpd_load_bad"] = _exact(sd, rank, world, rec["step"])  # "step": DCP bytes, opaque to ucpd.load
    except BaseException as exc:  # noqa: BLE001 - recorded for the test
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["trace"] = traceback.format_exc()[-3000:]
    finish(rank, spec, out)


assert SHAPES  # the state's tensors: tests/tier_ranks.py

if __name__ == "__main__":
    rank_main_or_launch(__file__, _rank_main)
