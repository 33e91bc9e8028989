"""The ``dcp`` branches of ``ucp import`` / ``ucp export`` and the opaque-entry lines of ``ucp show``.

Options and glue only (the work is in :mod:`.adapter`); kept apart so that building the ``ucp`` parser
imports neither torch nor numpy.
"""

from __future__ import annotations

from ucp_store.formats.dcp.index import opaque_entries

__all__ = ["add_cli_parser", "cli_export", "cli_import", "show_lines"]


def add_cli_parser(kinds, verb: str, common) -> None:
    """Add ``ucp import dcp`` / ``ucp export dcp`` to the ``kinds`` subparsers of ``verb``."""
    kp = kinds.add_parser("dcp", help=f"{verb} a PyTorch Distributed Checkpoint (DCP) folder")
    common(kp, top=False)
    if verb == "import":
        kp.add_argument("source", metavar="DIR", help="DCP folder (.metadata plus __<rank>_<n>.distcp files)")
        kp.add_argument("--run", required=True)
        kp.add_argument("--step", type=int, default=None)
        kp.add_argument("--message", default=None)
        kp.add_argument("--optim-prefix", action="append", default=None, metavar="KEY",
                        help="top-level key of the optimizer state (default: detected; repeatable)")
        kp.add_argument("--model-prefix", default=None, metavar="KEY",
                        help="top-level key of the model state ('' for FQNs at the top level; default: detected)")
        kp.add_argument("--per-rank", action="append", default=None, metavar="PATTERN",
                        help="keys (fnmatch over dotted DCP keys) holding per-rank state, besides those whose name "
                             "names a rank (dataloader.dp_rank_<i>); repeatable")
    else:
        kp.add_argument("ref")
        kp.add_argument("dest", metavar="DIR")
        kp.add_argument("--states", default=None, help="comma-separated tensor-states to export (default: all)")
        kp.add_argument("--threads", type=int, default=1, help="DCP writer threads (default 1)")


def cli_import(store, args) -> int:
    """``ucp import dcp DIR --run R --step N``."""
    from ucp_store.errors import UcpError
    from ucp_store.formats.dcp.adapter import import_dcp

    if args.step is None:
        raise UcpError("ucp import dcp DIR: --step N is required (a DCP folder carries no step)")
    ck = import_dcp(store, args.source, args.run, args.step, message=args.message, progress=not args.no_progress,
                    optim_prefixes=args.optim_prefix, model_prefix=args.model_prefix, per_rank=args.per_rank)
    from ucp_store.catalog.rank_record import describe_topology, read_record
    n_opaque = len(opaque_entries(ck))
    rec = read_record(ck)
    per_rank = "" if rec is None else (f", {len(rec['keys'])} per-rank entr{'y' if len(rec['keys']) == 1 else 'ies'} "
                                       f"saved on {describe_topology(rec['topology'])}")
    print(f"imported {args.source} as {ck.run}@{ck.step} ({ck.id}, {len(ck.tensors())} tensor-states, "
          f"{ck.nbytes} bytes, {n_opaque} opaque non-tensor entr{'y' if n_opaque == 1 else 'ies'}{per_rank})")
    return 0


def cli_export(checkpoint, args) -> int:
    """``ucp export dcp REF DIR [--states a,b]``."""
    from ucp_store.formats.dcp.adapter import export_dcp

    states = [s.strip() for s in args.states.split(",") if s.strip()] if args.states else None
    from ucp_store.catalog.rank_record import read_record

    s = export_dcp(checkpoint, args.dest, states=states, progress=not args.no_progress, thread_count=args.threads)
    rec = read_record(checkpoint)
    per_rank = "" if rec is None else f", {len(rec['keys'])} per-rank key(s) with every saving rank's entry"
    print(f"wrote DCP folder {s['path']}: {s['tensors']} tensors, {s['opaque']} opaque entries written back as "
          f"stored{per_rank}")
    return 0


def show_lines(checkpoint) -> list[str]:
    """Lines for ``ucp show``: the opaque (never unpickled) non-tensor entries of a DCP import."""
    if (checkpoint.provenance or {}).get("source_kind") != "dcp":
        return []
    rows = opaque_entries(checkpoint)
    return [f"opaque DCP entry {r['key']}: {r['nbytes']} bytes, sha256 {r['sha256'][:16]}..., kept as bytes "
            f"({r['why']})" for r in rows]
