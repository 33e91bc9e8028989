"""The ``hf`` branches of ``ucp import`` / ``ucp export``: options and glue (the work is in :mod:`.hf`).

Kept apart from :mod:`.hf` so that building the ``ucp`` parser imports neither torch nor numpy.
"""

from __future__ import annotations

__all__ = ["add_cli_arguments", "cli_import", "cli_export"]


def add_cli_arguments(parser, verb: str) -> None:
    """The ``hf``-only options of ``ucp import hf`` / ``ucp export hf``."""
    if verb == "export":
        parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                            help="cast floating tensors (default: as stored)")
        parser.add_argument("--max-shard-size", default="5GB", help="largest shard file (default 5GB)")
        parser.add_argument("--map", default=None, metavar="FILE.json",
                            help="name map: rename rules and fused-parameter splits (or a shipped map: llama)")
        parser.add_argument("--config", default=None, metavar="FILE.json",
                            help="config.json to write (default: the stored one)")
    else:
        parser.add_argument("--no-hash", action="store_true", help="do not record content hashes of the files")


def cli_import(store, args) -> str:
    """``ucp import hf DIR --run R [--step N] [--state S]``; returns the version id."""
    from ucp_store.formats.hf.adapter import import_hf

    return import_hf(store, args.source, args.run, 0 if args.step is None else args.step,
                     state=args.state or "weight", message=args.message, progress=not args.no_progress,
                     hash_sources=not getattr(args, "no_hash", False))


def cli_export(checkpoint, args) -> str:
    """``ucp export hf REF DIR [...]``; returns the line to print."""
    from ucp_store.formats.hf.adapter import export_hf

    s = export_hf(checkpoint, args.dest, state=args.state, dtype=args.dtype, max_shard_size=args.max_shard_size,
                  name_map=args.map, config=args.config, progress=not args.no_progress)
    return (f"wrote Hugging Face folder {s['dest']}: {s['tensors']} tensors ({s['state']}) in {s['shards']} "
            f"shard(s), {s['total_size']} bytes")
