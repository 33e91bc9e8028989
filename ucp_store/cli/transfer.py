"""``ucp import`` and ``ucp export``: torch files, DeepSpeed ZeRO folders, DeepSpeed universal folders, DCP
folders and Hugging Face folders.

The adapters do the work; a command picks one, passes the options and prints what it did.
"""

from __future__ import annotations

import argparse
from typing import Any

from ucp_store.cli.common import EXIT_OK, Command, add_common, open_from_args, progress_wanted
from ucp_store.cli.output import fmt_bytes
from ucp_store.errors import UcpError

__all__ = ["COMMANDS", "cmd_import", "cmd_export", "IMPORT_KINDS", "EXPORT_KINDS"]

IMPORT_KINDS = ("torch", "deepspeed", "deepspeed-universal", "hf")
EXPORT_KINDS = ("torch", "deepspeed-universal", "hf")


def cmd_import(args: Any) -> int:
    """Import a checkpoint of ``args.kind`` as a new version of ``--run``."""
    store = open_from_args(args, create=True)
    if args.kind == "dcp":
        from ucp_store.formats.dcp.cli import cli_import as dcp_import

        return int(dcp_import(store, args))
    if args.kind == "torch":
        from ucp_store.formats.torch_file import import_torch_file

        if args.step is None:
            raise UcpError("ucp import torch FILE: --step N is required")
        ck = import_torch_file(store, args.source, args.run, args.step, state=args.state or "weight",
                               message=args.message, progress=progress_wanted(args))
        cid = ck.id
    elif args.kind == "hf":
        from ucp_store.formats.hf.cli import cli_import as hf_import

        cid = hf_import(store, args)
    elif args.kind == "deepspeed":
        from ucp_store.deepspeed.source import import_deepspeed

        cid = import_deepspeed(store, args.source, args.run, args.step, message=args.message,
                               progress=progress_wanted(args), experts=getattr(args, "experts", "separate"))
    else:
        from ucp_store.deepspeed.universal import import_universal

        cid = import_universal(store, args.source, args.run, args.step)
    cid = getattr(cid, "id", cid)
    ck = store.checkpoint(cid)
    print(f"imported {args.source} as {ck.run}@{ck.step} ({ck.id}, {len(ck.tensors())} tensor-states, "
          f"{fmt_bytes(ck.nbytes)})")
    return EXIT_OK


def cmd_export(args: Any) -> int:
    """Export a version as ``args.kind``."""
    store = open_from_args(args)
    ck = store.checkpoint(args.ref)
    if args.kind == "dcp":
        from ucp_store.formats.dcp.cli import cli_export as dcp_export

        return int(dcp_export(ck, args))
    if args.kind == "torch":
        from ucp_store.formats.torch_file import export_torch_file

        n = export_torch_file(ck, args.dest, state=args.state, progress=progress_wanted(args))
        print(f"wrote {n} tensors to {args.dest}")
    elif args.kind == "hf":
        from ucp_store.formats.hf.cli import cli_export as hf_export

        print(hf_export(ck, args))
    else:
        from ucp_store.deepspeed.universal import export_universal

        path = export_universal(ck, args.dest, tag=args.tag)
        print(f"wrote DeepSpeed universal checkpoint {path}")
    return EXIT_OK


def _kinds(verb: str, kinds: tuple[str, ...]) -> Any:
    def arguments(sp: argparse.ArgumentParser) -> None:
        sub = sp.add_subparsers(dest="kind", required=True, metavar="KIND")
        for kind in kinds:
            kp = sub.add_parser(kind, help=f"{verb} {kind}")
            add_common(kp, top=False)
            if verb == "import":
                kp.add_argument("source")
                kp.add_argument("--run", required=True)
                kp.add_argument("--step", type=int, default=None)
                kp.add_argument("--message", default=None)
                kp.add_argument("--state", default=None)
                if kind == "deepspeed":
                    kp.add_argument("--experts", choices=["separate", "fused"], default="separate",
                                    help="MoE experts: one tensor per expert (expert_member, default) or one "
                                         "[E, ...] tensor per layer and parameter (expert)")
            else:
                kp.add_argument("ref")
                kp.add_argument("dest")
                kp.add_argument("--state", default=None)
                kp.add_argument("--tag", default=None)
            if kind == "hf":
                from ucp_store.formats.hf.cli import add_cli_arguments

                add_cli_arguments(kp, verb)
        from ucp_store.formats.dcp.cli import add_cli_parser

        add_cli_parser(sub, verb, add_common)
    return arguments


COMMANDS = {
    "import": Command(cmd_import, "import checkpoints", _kinds("import", IMPORT_KINDS), json_flag=False),
    "export": Command(cmd_export, "export checkpoints", _kinds("export", EXPORT_KINDS), json_flag=False),
}
