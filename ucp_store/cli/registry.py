"""Catalog commands: ``init``, ``ls``, ``show``, ``log``, ``tag``, ``rm``, ``query``.

They read or change the catalog only, so this module imports no torch, TensorStore, zarr or numpy (a
test runs ``ucp ls`` and ``ucp show`` and checks ``sys.modules``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ucp_store.cli.common import EXIT_OK, Command, mib_bytes, open_from_args
from ucp_store.cli.output import fmt_bytes, print_json, table
from ucp_store.errors import UcpError

if TYPE_CHECKING:  # pragma: no cover
    from ucp_store.registry.checkpoint import Checkpoint

__all__ = ["COMMANDS", "cmd_init", "cmd_ls", "cmd_show", "cmd_log", "cmd_tag", "cmd_rm", "cmd_query"]


def cmd_init(args: Any) -> int:
    """Create a store (and its catalog). On an existing store: a no-op when the options match its settings,
    an error naming the setting when one differs (a store's settings never change)."""
    store = open_from_args(args, create=True, compression=args.compression,
                           chunk_target_bytes=mib_bytes(args.chunk_mib, "--chunk-mib"))
    what = "store ready at" if store.created else "store already exists, settings unchanged:"
    print(f"{what} {store.location.url} (catalog {store.catalog.display_url}, "
          f"compression {store.settings['compression']}, chunk target "
          f"{fmt_bytes(store.settings['chunk_target_bytes'])})")
    return EXIT_OK


def cmd_ls(args: Any) -> int:
    """Runs, or the versions of one run (``--all``: of every run)."""
    store = open_from_args(args)
    if args.run is None and not args.all:
        runs = store.runs()
        if args.json:
            print_json(runs)
        else:
            table([[r["run"], r["checkpoints"], r["latest_step"]] for r in runs], ["run", "versions", "latest step"])
        return EXIT_OK
    rows = store.list_checkpoints(args.run, include_pending=args.pending)
    if args.json:
        print_json(rows)
    else:
        table([[r["run"], r["step"], r["id"], r["status"], r["safety"], fmt_bytes(r["nbytes"]),
                fmt_bytes(r["stored_nbytes"]), ",".join(r["tags"]), r["parent"], r["created_at"][:19], r["message"]]
               for r in rows],
              ["run", "step", "id", "status", "safety", "bytes", "stored", "tags", "parent", "created", "message"])
    return EXIT_OK


def cmd_show(args: Any) -> int:
    """A version's manifest: its tensors, patterns and arrays, and its per-rank keys with their saving topology."""
    from ucp_store.catalog.rank_record import read_record, show_json
    from ucp_store.catalog.rank_record import show_lines as per_rank_lines
    from ucp_store.schema import validate

    ck = open_from_args(args).checkpoint(args.ref)
    manifest = ck.manifest()
    record = read_record(ck)
    if record is not None:  # per-rank keys with their saving topology (ucp_store.distributed, DCP, DeepSpeed)
        manifest["per_rank"] = show_json(record)
    validate("manifest", manifest)
    if args.json:
        print_json(manifest)
        return EXIT_OK
    print(f"{ck.run}@{ck.step}  id {ck.id}  safety: {ck.store.safety(ck.id)}  {fmt_bytes(ck.nbytes)}  "
          f"tags: {', '.join(ck.tags) or '-'}  "
          f"parent: {ck.parent or '-'}  source: {(ck.provenance or {}).get('source_kind')}")
    table([[t["name"], t["state"], "x".join(map(str, t["shape"])) or "()", t["dtype"],
            (t["pattern"] or {}).get("kind", "-"), fmt_bytes(t["nbytes"]), t["encoding"], t["depth"], t["array"]]
           for t in manifest["tensors"]],
          ["name", "state", "shape", "dtype", "pattern", "bytes", "encoding", "depth", "array"])
    from ucp_store.formats.dcp.cli import show_lines

    for line in show_lines(ck):
        print(line)
    for line in per_rank_lines(record):
        print(line)
    _show_experts(ck)
    return EXIT_OK


def _show_experts(ck: Any) -> None:
    """Expert placement as saved (the source's ep and expert-group rule, from provenance), when the version has
    MoE experts."""
    from ucp_store.cli.plan import source_ep_over
    from ucp_store.errors import TopologyError
    from ucp_store.plan.experts import expert_groups, placement_rows
    from ucp_store.topology import Topology

    groups = expert_groups(ck.tensors())
    if not groups:
        return
    src = (ck.provenance or {}).get("source_topology") or {}
    tp, sp, dp, ep = (int(src.get(k, 1) or 1) for k in ("tp", "sp", "dp", "ep"))
    try:  # one pipeline stage: the placement repeats on every stage
        topo = Topology(tp=tp, sp=sp, dp=dp, ep=ep, ep_over=source_ep_over(ck.provenance))
    except TopologyError as exc:
        print(f"experts: {len(groups)} group(s); saved topology {src}: {exc}")
        return
    if topo.ep_over == "stage" and topo.tp * topo.sp > 1:
        # DeepSpeed's default expert groups with a tensor-parallel dense part and whole experts span the whole
        # tp x dp world (tp fastest): global rank g is ep rank g % ep (Topology(ep_over="stage"))
        print(f"experts: {len(groups)} group(s), saved at ep={topo.ep} over tp={topo.tp} x dp={topo.dp} ranks (tp "
              "fastest); ep rank r holds its experts on global ranks g with g % ep == r")
        table(placement_rows(groups, topo), ["expert group", "stored", "ep rank", "experts", "ranks"])
        return
    print(f"experts: {len(groups)} group(s), saved at ep={topo.ep} (dp={topo.dp}); ep rank r holds its experts on dp "
          "ranks d with d % ep == r")
    table(placement_rows(groups, topo), ["expert group", "stored", "ep rank", "experts", "dp ranks"])


def cmd_log(args: Any) -> int:
    """Lineage: a version and its ancestors through ``parent``."""
    store = open_from_args(args)
    ck: Checkpoint | None = store.checkpoint(args.ref)
    chain = []
    while ck is not None:
        chain.append({"id": ck.id, "run": ck.run, "step": ck.step, "tags": ck.tags, "message": ck.message,
                      "source": (ck.provenance or {}).get("source_kind")})
        ck = store.checkpoint(ck.parent) if ck.parent else None
    if args.json:
        print_json(chain)
    else:
        table([[c["run"], c["step"], c["id"], ",".join(c["tags"]), c["source"], c["message"]] for c in chain],
              ["run", "step", "id", "tags", "source", "message"])
    return EXIT_OK


def cmd_tag(args: Any) -> int:
    """Tag a version, move a tag (``--force``) or remove one (``--delete``)."""
    store = open_from_args(args)
    if args.delete:
        run, _, tag = args.ref.partition(":")
        store.untag(run, tag or args.tag)
        print(f"removed tag {run}:{tag or args.tag}")
        return EXIT_OK
    if not args.tag:
        raise UcpError("ucp tag REF TAG: missing TAG")
    cid = store.tag(args.ref, args.tag, force=args.force)
    print(f"tagged {cid} as {args.tag}")
    return EXIT_OK


def cmd_rm(args: Any) -> int:
    """Remove versions (their arrays go at the next ``gc`` once unreferenced)."""
    from ucp_store.registry.room import rm_victims, with_room

    for ref in args.refs:  # on a full disk, the version's own files go first to make room (registry/room.py)
        cid = with_room(lambda: open_from_args(args), lambda: open_from_args(args, read_only=True),
                        rm_victims([ref], args.force), lambda store: store.rm(ref, force=args.force))  # noqa: B023
        print(f"removed {ref} ({cid})")
    return EXIT_OK


def cmd_query(args: Any) -> int:
    """Read-only SQL against the catalog."""
    cols, rows = open_from_args(args).query(args.sql, timeout=args.timeout)
    if args.json:
        print_json([dict(zip(cols, r)) for r in rows])
    else:
        table([list(r) for r in rows], cols)
    return EXIT_OK


def _init_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--compression", choices=["none", "zstd", "blosc"], default=None)
    sp.add_argument("--chunk-mib", type=float, default=None, help="inner chunk target, 0.125 to 8 MiB")


def _ls_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("run", nargs="?")
    sp.add_argument("--all", action="store_true", help="every version of every run")
    sp.add_argument("--pending", action="store_true", help="include unfinished saves")


def _ref_arg(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("ref")


def _tag_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("ref")
    sp.add_argument("tag", nargs="?")
    sp.add_argument("--force", action="store_true", help="move an existing tag")
    sp.add_argument("--delete", action="store_true", help="remove tag RUN:TAG")


def _rm_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("refs", nargs="+")
    sp.add_argument("--force", action="store_true", help="remove even if tagged")


def _query_args(sp: argparse.ArgumentParser) -> None:
    from ucp_store.catalog.query import DEFAULT_QUERY_TIMEOUT_S

    sp.add_argument("sql")
    sp.add_argument("--timeout", type=float, default=DEFAULT_QUERY_TIMEOUT_S, metavar="SECONDS",
                    help=f"stop the query after this many seconds (default {DEFAULT_QUERY_TIMEOUT_S:g})")


COMMANDS = {
    "init": Command(cmd_init, "create a store", _init_args, json_flag=False),
    "ls": Command(cmd_ls, "list runs, or the versions of RUN", _ls_args),
    "show": Command(cmd_show, "show a version's tensors, patterns and arrays", _ref_arg),
    "tag": Command(cmd_tag, "tag a version (RUN:TAG names it afterwards)", _tag_args, json_flag=False),
    "rm": Command(cmd_rm, "remove versions (arrays are freed when nothing else references them)", _rm_args,
                  json_flag=False),
    "log": Command(cmd_log, "lineage of a version", _ref_arg),
    "query": Command(cmd_query, "run read-only SQL against the catalog", _query_args),
}
