"""``ucp demo``: the project's main job as one command, on the embedded default (a folder with SQLite).

`ucp demo` trains a small GPT in real torch.distributed processes (TP x FSDP2), saves through
`ucp_store.distributed`, resumes on other meshes and proves with the losses that nothing was lost (`run.py`);
`ucp demo --deepspeed` runs the DeepSpeed story instead (`deepspeed_story.py`). This module stays light:
the CLI imports it to build its parser, and torch is imported only when a demo runs.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `ucp demo`."""
    from ucp_store.demo.run import DEFAULT_STEPS

    p.add_argument("--dir", default="ucp-demo", help="folder for the store and the pictures (default ./ucp-demo)")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"training steps of the first run (default {DEFAULT_STEPS}); it saves every steps // 4")
    p.add_argument("--deepspeed", action="store_true",
                   help="run the DeepSpeed story instead (needs pip install 'ucp_store[deepspeed]')")
    # test hook: scale one tensor of one resumed run after its load, so that the demo must fail
    p.add_argument("--perturb", default=None, metavar="RUN", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    """Run the demo that `args` (from `add_arguments`) asks for; returns the exit code."""
    if args.deepspeed:
        from ucp_store.demo.deepspeed_story import main as deepspeed_main

        return deepspeed_main(args)
    from ucp_store.demo.run import run_demo

    return run_demo(args)
