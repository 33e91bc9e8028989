"""``ucp demo``: train in parallel, save, resume on other meshes, compare the losses (``ucp_store.demo``).

The command only parses options and hands over; ``ucp_store.demo`` imports torch when a demo runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from ucp_store.cli.common import Command

__all__ = ["COMMANDS", "cmd_demo"]


def cmd_demo(args: Any) -> int:
    """Run the demo (or ``--deepspeed``'s story); exit non-zero when a resumed run diverges."""
    from ucp_store.demo import main as demo_main

    return demo_main(args)


def _arguments(sp: argparse.ArgumentParser) -> None:
    from ucp_store.demo import add_arguments

    add_arguments(sp)


COMMANDS = {
    "demo": Command(cmd_demo, "train in parallel, save, resume on other meshes, compare the losses", _arguments,
                    json_flag=False),
}
