"""The end of ``ucp demo``: the `ucp` commands a user would type to look at what the demo stored.

Each command is printed as typed (`$ ucp --store ... ls`) and then run through `ucp_store.cli.main` in
this process (the same code as the `ucp` command, without paying for a new interpreter per command). A
command that fails fails the demo.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys

from .procs import DemoError

__all__ = ["tour"]


def _ucp(console, store: str, *argv: str, capture: bool = False) -> str:
    """Print `ucp --store STORE ARGV...` as typed, run it; returns its stdout when `capture` (else prints it)."""
    from ..cli import main as ucp_main

    shown = os.path.relpath(store) if not os.path.relpath(store).startswith("..") else store
    console.print(f"\n[bold cyan]$ {shlex.join(['ucp', '--store', shown, *argv])}[/]", soft_wrap=True)
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


def tour(console, store: str, run: str, step: int, topology) -> None:
    """ls, show, verify, a partial read, plan for `topology` and a query, on version `run@step`."""
    from .. import open_store

    ref = f"{run}@{step}"
    infos = open_store(store).checkpoint(ref).tensors()
    emb = next((i for i in infos if "tok_embeddings" in i.name and len(i.shape) == 2), None) or \
        max(infos, key=lambda i: (len(i.shape), i.nbytes))
    rows, cols = emb.shape[0], emb.shape[-1]
    console.print("\n[bold]a tour of the store[/] (each command as you would type it)")
    _ucp(console, store, "ls")
    _ucp(console, store, "ls", run)
    _ucp(console, store, "show", ref)
    _ucp(console, store, "verify", ref)
    _ucp(console, store, "read", ref, emb.name, "--state", emb.state,
         "--slice", f"{min(2, rows)}:{min(5, rows)},0:{min(6, cols)}")
    _ucp(console, store, "plan", ref, "--tp", str(topology.tp), "--dp", str(topology.dp))
    _ucp(console, store, "query",
         "SELECT c.step, COUNT(*) AS tensor_states, SUM(t.nbytes) AS bytes, "
         "COUNT(DISTINCT t.content_hash) AS distinct_arrays FROM tensors t JOIN checkpoints c ON c.id = t.checkpoint_id JOIN runs r ON r.id = c.run_id "
         f"WHERE r.name = '{run}' AND c.status = 'committed' GROUP BY c.step ORDER BY c.step")
