"""``ucp plan``: bytes and chunks per rank, read amplification, and (``--plot``, see ``plot``) who reads what.

The planner does the work (``Checkpoint.tensors`` + ``planner.plan``, pure and torch-free); this module
builds the target topology from the options and prints the totals.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from ucp_store.cli.common import EXIT_OK, Command, open_from_args
from ucp_store.cli.output import fmt_bytes, print_json, table
from ucp_store.errors import UcpError
from ucp_store.topology import EP_OVER, MAX_WORLD_SIZE, Topology

__all__ = ["COMMANDS", "cmd_plan", "run_plan", "topology_from_args", "infer_layers", "source_ep_over"]


def infer_layers(infos: Iterable[Any]) -> int:
    """The number of layers a checkpoint's patterns name (deepest ``placement.layer`` + 1), or 0."""
    from ucp_store.patterns import parse_pattern

    layers = [parse_pattern(i.pattern).layer for i in infos if i.pattern]
    known = [x for x in layers if x is not None]
    return max(known) + 1 if known else 0


def source_ep_over(provenance: Any) -> str:
    """The expert-group rule a version was saved under (``ep_over`` of its source topology; default ``dp``)."""
    topo = (provenance or {}).get("source_topology") or {}
    value = topo.get("ep_over", "dp") if isinstance(topo, dict) else "dp"
    return value if value in EP_OVER else "dp"


def topology_from_args(args: Any, infos: Iterable[Any], ep_over: str = "dp") -> Topology:
    """The target topology of ``--tp/--pp/--dp/--sp/--ep/--ep-over/--zero/--vocab-multiple/--layers``
    (``ep_over``: the rule when ``--ep-over`` is not given)."""
    layers = args.layers if args.layers is not None else infer_layers(infos)
    if args.pp > 1 and layers == 0:
        raise UcpError("--pp > 1 needs layers: the checkpoint's patterns name no layer placement; pass --layers N")
    return Topology(tp=args.tp, pp=args.pp, dp=args.dp, zero_stage=args.zero, sp=args.sp, ep=args.ep,
                    vocab_multiple=args.vocab_multiple, layers=layers,
                    ep_over=getattr(args, "ep_over", None) or ep_over)


def run_plan(args: Any, store: Any) -> int:
    """Plan every rank (or ``--rank``) of the target topology for ``args.ref`` and print the totals."""
    from ucp_store.plan.planner import plan as make_plan

    ck = store.checkpoint(args.ref)
    infos = ck.tensors()
    if getattr(args, "mesh", None):
        return _run_mesh_plan(args, ck, infos)
    topo = topology_from_args(args, infos, source_ep_over(ck.provenance))
    states = args.states.split(",") if args.states else None
    ranks = _ranks(args, topo.world_size, topo.describe())
    for r in ranks:
        if not 0 <= r < topo.world_size:
            raise UcpError(f"--rank {r} is outside the topology's {topo.world_size} ranks ({topo.describe()})")
    plans = [make_plan(infos, topo, r, states=states) for r in ranks]
    if args.json:
        if len(plans) == 1:
            print_json(plans[0].to_json())
        else:
            print_json({"topology": topo.to_json(), "ranks": [
                {"rank": p.rank, "coords": dict(p.coords), **p.to_json()["totals"]} for p in plans]})
    else:
        print(f"{ck.run}@{ck.step} -> {topo.describe()}")
        _print_rank_table(plans)
        _print_experts(infos, topo)
        n_dt = sum(1 for i in infos if isinstance(i.pattern, dict) and i.pattern.get("kind") == "dtensor")
        if n_dt:
            print(f"note: {n_dt} tensor-state(s) were saved from DTensors (dtensor pattern); this topology plan "
                  "treats them as replicated: every TP rank reads each one whole (ZeRO still partitions it). "
                  "A DTensor job (ucp_store.distributed.load) reads only its shards' boxes: "
                  "plan that with --mesh, e.g. --mesh dp=2,tp=2")
    if args.plot:
        from ucp_store.cli.plot import draw_plan

        drawn = draw_plan(ck, plans, args.param, args.plot, topology=topo)
        read = ", ".join(f"rank {r} {n}" for r, n in zip(drawn.ranks, drawn.chunks_read) if n >= 0)
        print(f"wrote {args.plot}: {drawn.label} {drawn.shape}, chunks {drawn.chunk_shape}"
              + (f"; chunks read: {read}" if read else ""))
    return EXIT_OK


#: the most ranks ``ucp plan`` plans and lists without ``--rank`` (each rank's plan is held for the table)
MAX_LISTED_RANKS = 1 << 16


def _ranks(args: Any, world: int, what: str) -> list[int]:
    """``[--rank]`` (the planners check it lies in the world), or every rank when there are at most
    ``MAX_LISTED_RANKS``."""
    if args.rank is not None:
        return [args.rank]
    if world > MAX_LISTED_RANKS:
        raise UcpError(f"{what} has {world} ranks; ucp plan lists at most {MAX_LISTED_RANKS} at once: pass "
                       "--rank R for one of them")
    return list(range(world))


def _print_experts(infos: Any, topo: Topology) -> None:
    """Which experts each ep rank of the target holds, and on which ranks (when there are experts)."""
    from ucp_store.plan.experts import expert_groups, placement_rows

    groups = expert_groups(infos)
    if not groups:
        return
    rule = ("ep_over=stage: DeepSpeed's expert groups, ep rank = rank % ep over each stage's ranks, experts whole"
            if topo.ep_over == "stage" else "ep_over=dp: ep rank = dp rank % ep")
    if topo.ep > 1:
        print(f"expert placement: {rule}")
    print(f"experts at ep={topo.ep} (expert ZeRO over {topo.zero_world(True)} rank(s) per ep rank):")
    table(placement_rows(groups, topo), ["expert group", "stored", "ep rank", "experts", "ranks"])


def _print_rank_table(plans: Any) -> None:
    """One row per rank (reads, chunks, bytes needed and read) and the all-ranks total: topology or mesh plans."""
    table([[p.rank, " ".join(f"{k}{v}" for k, v in p.coords.items()), len(p.tensors), p.num_reads,
            p.chunks_touched, fmt_bytes(p.bytes_needed), fmt_bytes(p.bytes_read), f"{p.read_amplification:.3f}"]
           for p in plans],
          ["rank", "coords", "tensor-states", "reads", "chunks", "bytes needed", "bytes read", "amplification"])
    needed = sum(p.bytes_needed for p in plans)
    read = sum(p.bytes_read for p in plans)
    print(f"all ranks: {fmt_bytes(read)} read for {fmt_bytes(needed)} needed "
          f"(amplification {read / needed if needed else 1.0:.3f})")


def _run_mesh_plan(args: Any, ck: Any, infos: list) -> int:
    """``ucp plan REF --mesh dp=2,tp=2``: what each rank of a DTensor mesh reads (``planner.plan_mesh``)."""
    from ucp_store.plan.planner import MESH_ASSUMPTION, parse_mesh, plan_mesh

    others = [f"--{f}" for f in ("tp", "pp", "dp", "sp", "ep") if getattr(args, f) != 1]
    others += ["--ep-over"] * bool(getattr(args, "ep_over", None))
    others += ["--zero"] * bool(args.zero) + ["--plot"] * bool(args.plot)
    if others:
        raise UcpError(f"--mesh plans a DTensor mesh; it does not combine with {', '.join(others)}")
    shape, dims = parse_mesh(args.mesh)
    world = 1
    for n in shape:
        world *= n
    if world > MAX_WORLD_SIZE:
        raise UcpError(f"--mesh {args.mesh} has {world} ranks; at most {MAX_WORLD_SIZE} (2^20) are supported")
    ranks = _ranks(args, world, f"mesh {args.mesh}")
    states = args.states.split(",") if args.states else None
    plans = [plan_mesh(infos, {"shape": shape, "dims": dims}, r, states=states) for r in ranks]
    if args.json:
        if len(plans) == 1:
            print_json(plans[0].to_json())
        else:
            print_json({"mesh": {"shape": list(shape), "dims": list(dims)}, "assumes": MESH_ASSUMPTION,
                        "ranks": [{"rank": p.rank, "coords": dict(p.coords), **p.to_json()["totals"]} for p in plans]})
        return EXIT_OK
    print(f"{ck.run}@{ck.step} -> DTensor mesh {args.mesh}")
    _print_rank_table(plans)
    print(f"assumes: {MESH_ASSUMPTION}")
    return EXIT_OK


def cmd_plan(args: Any) -> int:
    """``ucp plan``."""
    return run_plan(args, open_from_args(args))


def _plan_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("ref")
    for flag in ("tp", "pp", "dp", "sp", "ep"):
        sp.add_argument(f"--{flag}", type=int, default=1)
    sp.add_argument("--ep-over", choices=EP_OVER, default=None,
                    help="what ep ranks are carved out of: dp (ep rank = dp rank %% ep) or stage (DeepSpeed's expert "
                         "groups of whole experts: rank %% ep over each stage's ranks); default: the version's "
                         "source (stage for DeepSpeed MoE imports), else dp")
    sp.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    sp.add_argument("--vocab-multiple", type=int, default=1)
    sp.add_argument("--layers", type=int, default=None, help="number of layers (default: inferred)")
    sp.add_argument("--rank", type=int, default=None, help="one rank (default: all)")
    sp.add_argument("--states", default=None, help="comma-separated states (default: all)")
    sp.add_argument("--plot", default=None, metavar="FILE.png", help="draw which ranks read which chunks")
    sp.add_argument("--param", default=None, help="parameter to draw (default: the largest)")
    sp.add_argument("--mesh", default=None, metavar="DIM=N,...",
                    help="plan a DTensor mesh instead (e.g. dp=2,tp=2): each rank reads its shards' boxes, "
                         "the saved placements kept per mesh dim name (what ucp_store.distributed.load reads)")


COMMANDS = {"plan": Command(cmd_plan, "read plan of a version for a target topology", _plan_args)}
