"""The end of ``ucp demo``: the `ucp` commands a user would type to look at what the demo stored.

Each command is printed as typed (`$ ucp --store ... ls`) and then run through `ucp_store.cli.main` in
this process (the same code as the `ucp` command, without paying for a new interpreter per command). A
command that fails fails the demo.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from collections.abc import Callable

from rich.markup import escape

from ucp_store.demo.procs import DemoError

__all__ = ["UcpMain", "tour"]

#: the `ucp` entry point (`ucp_store.cli.main`): argv in, exit status out
UcpMain = Callable[[list[str]], int]


def _shell_join(argv: list[str]) -> str:
    """A command line a user can paste into a POSIX shell, SQL in double quotes where that stays literal."""
    out = []
    for a in argv:
        if shlex.quote(a) == a or "'" not in a:
            out.append(shlex.quote(a))
        elif not re.search(r'["\\`!]|\$[A-Za-z_{(]', a):
            out.append(f'"{a}"')
        else:
            out.append(shlex.quote(a))
    return " ".join(out)


def run_ucp(ucp_main: UcpMain, console, store: str, *argv: str, capture: bool = False) -> str:
    """Print `ucp --store STORE ARGV...` as typed, run it with `ucp_main` (the CLI's entry point, handed down
    by `ucp demo` so that the demo does not import the CLI that imports it); returns its stdout when `capture`
    (else prints it)."""
    shown = os.path.relpath(store) if not os.path.relpath(store).startswith("..") else store
    console.print(f"\n[bold cyan]$ {escape(_shell_join(['ucp', '--store', shown, *argv]))}[/]", soft_wrap=True)
    sys.stdout.flush()
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf) if capture else contextlib.nullcontext():
            rc = ucp_main(["--store", store, "--no-progress", *argv])
    except Exception as exc:  # a bug, not bad input: still one line naming the command
        raise DemoError(f"tour command crashed: ucp {shlex.join(argv)}: {type(exc).__name__}: {exc}") from exc
    sys.stdout.flush()
    if rc != 0:
        raise DemoError(f"tour command failed with exit code {rc}: ucp {shlex.join(argv)}")
    return buf.getvalue()


def tour(ucp_main: UcpMain, console, store: str, run: str, step: int, topology,
         loaded: tuple[str, dict] | None = None) -> None:
    """ls, show, verify, a partial read, plan for `topology` and a query, on version `run@step`.

    `loaded` is (label, info) of the resumed run on `topology`: what its rank 0 really read, said after
    `ucp plan` (whose planner reads tensors saved by ucp_store.distributed whole: their patterns are `dtensor`)."""
    from ucp_store import open_store

    ref = f"{run}@{step}"
    ck = open_store(store).checkpoint(ref)
    infos = ck.tensors()
    # the embedding's state by the one rule (records.main_state: its weight), else the largest tensor's
    name = next((i.name for i in infos if "tok_embeddings" in i.name and len(i.shape) == 2), None) or \
        max(infos, key=lambda i: (len(i.shape), i.nbytes)).name
    emb = ck.info(name)
    rows, cols = emb.shape[0], emb.shape[-1]
    console.print("\n[bold]a tour of the store[/] (each command as you would type it)")
    run_ucp(ucp_main, console, store, "ls")
    run_ucp(ucp_main, console, store, "ls", run)
    run_ucp(ucp_main, console, store, "show", ref)
    run_ucp(ucp_main, console, store, "verify", ref)
    run_ucp(ucp_main, console, store, "read", ref, emb.name, "--state", emb.state,
         "--slice", f"{min(2, rows)}:{min(5, rows)},0:{min(6, cols)}")
    run_ucp(ucp_main, console, store, "plan", ref, "--tp", str(topology.tp), "--dp", str(topology.dp))
    if loaded is not None:
        label, info = loaded
        total = sum(i.nbytes for i in infos)
        console.print(f"(ucp plan plans TP/PP/DP/ZeRO layouts from patterns; tensors saved by ucp_store.distributed "
                      f"carry a 'dtensor' pattern, which it reads whole. ucp_store.distributed.load reads the live "
                      f"DTensors' boxes "
                      f"instead: rank 0 of the resumed {label} run read {info.get('bytes_read', 0) / 2**20:.1f} MiB "
                      f"of the {total / 2**20:.1f} MiB; plan.png shows its chunks)")
    run_ucp(ucp_main, console, store, "query",
         "SELECT t.name, json_extract(t.pattern, '$.mesh.dims') AS mesh, json_extract(t.pattern, '$.placements') "
         "AS placements FROM tensors t JOIN checkpoints c ON c.id = t.checkpoint_id JOIN runs r ON r.id = c.run_id "
         f"WHERE r.name = '{run}' AND c.step = {step} AND t.state = 'weight' AND t.name NOT LIKE '%norm%' "
         "ORDER BY t.name")
