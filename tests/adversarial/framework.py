"""The corpus's machinery: a :class:`Case` is data (an input, one call, the expected outcome); :func:`run_case`
makes the call and :func:`check` holds it to its outcome.

A case builds its input under ``ctx.inp`` or into the store (``build``), then makes one call: an API call
(``api``: a function of the context) or a ``ucp`` command line (``cli``: a function returning argv), run
in-process through ``ucp_store.cli.main`` with stdout and stderr captured (``subprocess=True``: in a real
process, for the few inputs that could hang one: FIFOs). Its expected outcome is one of

- ``clean_error``: the exception class (API) or exit code (CLI: ``ucp: error: ...`` on one line, or
  argparse's usage error for exit code 2) and a substring naming the thing (any of ``needle`` when it is a
  tuple; ``str.format``-ed with the context's fields), and nothing left behind: no catalog row, no file;
- ``exact_roundtrip``: the value read back (``got``, by default what the API call returned) equals
  ``want`` type- and bit-exact (:func:`same`), and every listed version verifies;
- ``nothing_deleted``: the call either succeeds or fails cleanly, every listed version verifies, and the
  sentinel tree outside the store is byte-identical afterwards.

Every case, whatever its outcome, is also held to: no ``Traceback`` and no exception escaping
``cli.main``, no pickle payload ran (``ctx.marker``), the sentinel tree outside the store untouched, and
where ``listed`` is given, exactly those versions committed and nothing pending (``nothing_listed``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ucp_store

CLEAN_ERROR = "clean_error"
EXACT_ROUNDTRIP = "exact_roundtrip"
NOTHING_DELETED = "nothing_deleted"
OUTCOMES = (CLEAN_ERROR, EXACT_ROUNDTRIP, NOTHING_DELETED)
#: where the input comes from: a command line, an API call, a foreign checkpoint, the store's own files
SURFACES = ("cli", "api", "foreign", "store")

EXIT_FAIL = 1
EXIT_USAGE = 2

#: the most seconds an unreachable catalog server or bucket may take to fail (the design bounds are the
#: 10 s PostgreSQL connect timeout and about 3 s of S3 backoff; the rest is slack for a loaded machine)
UNREACHABLE_LIMIT_S = 60.0
SIDE_FILES = ("catalog.db-wal", "catalog.db-shm", "catalog.db-journal")
TABLES = ("runs", "checkpoints", "arrays", "tensors", "provenance", "objects", "tags", "settings")


class Payload:
    """Unpickling this runs ``os.system('touch <marker>')``: if the marker exists afterwards, code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@dataclass
class Ctx:
    tmp: Path
    store: Path
    inp: Path
    marker: Path
    outside: Path                 # the sentinel tree: no call may change it
    good_dcp: Path
    templates: dict[str, Path]
    extra: dict = field(default_factory=dict)

    def open(self, **kw):
        return ucp_store.open_store(str(self.store), **kw)

    def fields(self) -> dict:
        return {"tmp": self.tmp, "store": self.store, "inp": self.inp, "marker": self.marker,
                "outside": self.outside, **self.extra}

    def seed(self, name: str = "seeded") -> None:
        """Replace the empty store by a copy of a template made once per session (see ``templates``)."""
        shutil.rmtree(self.store)
        shutil.copytree(self.templates[name], self.store, symlinks=True)

    def ucp(self, *argv: Any) -> tuple[int, str, str]:
        """Run a ``ucp`` command line in-process (for builds); (exit code, stdout, stderr)."""
        from ucp_store import cli

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main([str(a) for a in argv])
            except SystemExit as e:
                rc = int(e.code or 0)
        return rc, out.getvalue(), err.getvalue()


@dataclass(frozen=True)
class Case:
    id: str
    surface: str                  # one of SURFACES
    kind: str                     # a finer label: torch, deepspeed, universal, hf, dcp, names, retention, ...
    build: Callable[[Ctx], None]
    outcome: str                  # one of OUTCOMES
    # clean_error: the exception class(es) (API) or the exit code(s) (CLI)
    expect: type[BaseException] | tuple[type[BaseException], ...] | int | tuple[int, ...] | None = None
    needle: str | tuple[str, ...] = ""
    api: Callable[[Ctx], Any] | None = None
    cli: Callable[[Ctx], list[str]] | None = None
    want: Callable[[Ctx], Any] | None = None                 # exact_roundtrip: the value that went in
    got: Callable[[Ctx, Outcome], Any] | None = None         # exact_roundtrip: the value read back
    compare: Callable[[Any, Any], str | None] | None = None  # default: same (type- and bit-exact)
    listed: tuple[str, ...] | None = None  # nothing_listed: exactly these versions committed afterwards
    report: bool = False          # a CLI failure reported as ``FAIL ...`` lines (``ucp verify``), not an error line
    subprocess: bool = False
    timeout: float = 120.0        # subprocess cases: a hang fails the case instead of the run
    issue: str = ""               # where the case comes from, e.g. "30.2" (issue 30, item 2)

    @property
    def via(self) -> str:
        return "cli" if self.cli is not None else "api"

    def __post_init__(self):
        assert self.surface in SURFACES and self.outcome in OUTCOMES, self.id
        assert (self.api is None) != (self.cli is None), f"{self.id}: one call, API or CLI"
        if self.outcome == CLEAN_ERROR:
            assert self.expect is not None and self.needle, f"{self.id}: a clean error names its class and thing"
        if self.outcome == EXACT_ROUNDTRIP:
            assert self.want is not None, f"{self.id}: a round trip names the value that went in"


@dataclass
class Outcome:
    case: Case
    error: BaseException | None = None   # what the API call raised
    exit_code: int | None = None
    stdout: str = ""
    text: str = ""                       # stderr, or the API error's message
    crash: str | None = None             # an exception that escaped cli.main (a traceback), or a hang
    value: Any = None                    # what the API call returned
    seconds: float = 0.0
    before: Any = None                   # the snapshot taken after the build, before the call
    committed_before: set[str] = field(default_factory=set)


# --- inputs --------------------------------------------------------------------------------------------------

def nothing(ctx: Ctx) -> None:
    pass


def make_sentinel(root: Path) -> None:
    """A small tree that no call may touch: files, a nested folder, an empty file, a relative symlink."""
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "keep.bin").write_bytes(hashlib.sha256(b"sentinel").digest() * 64)
    (root / "nested" / "notes.txt").write_text("outside the store\n")
    (root / "nested" / "deeper" / "empty").write_bytes(b"")
    os.symlink("keep.bin", root / "link-to-keep")


def tree_state(root: Path) -> dict[str, str]:
    """relative path -> what it is (file digest, link target, folder, other); FIFOs are never opened."""
    out: dict[str, str] = {}
    if not os.path.lexists(root):
        return out
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link:" + os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    out[rel] = "file:" + hashlib.sha256(f.read()).hexdigest()
            else:
                out[rel] = f"other:{stat.S_IFMT(st.st_mode)}"
    return out


def snapshot(ctx: Ctx) -> tuple[set[str], dict[str, Any]]:
    """Every path under the case's folder (SQLite side files aside) and every catalog row."""
    import sqlite3

    files = {rel for rel in tree_state(ctx.tmp) if os.path.basename(rel) not in SIDE_FILES}
    rows: dict[str, Any] = {}
    db = ctx.store / "catalog.db"
    if db.is_file():
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                for t in TABLES:
                    rows[t] = sorted(map(repr, con.execute(f"SELECT * FROM {t}")))  # noqa: S608 (fixed names)
            finally:
                con.close()
        except sqlite3.Error:  # a corrupt catalog (a case's input): its bytes stand for its rows
            rows = {"bytes": hashlib.sha256(db.read_bytes()).hexdigest()}
    return files, rows


def committed(ctx: Ctx) -> tuple[set[str], set[str]]:
    """(committed RUN@STEP, other statuses) of the case's store, read through a fresh open."""
    if not (ctx.store / "catalog.db").is_file():
        return set(), set()
    store = ctx.open()
    try:
        rows = store.list_checkpoints(include_pending=True)
    finally:
        store.catalog.engine.dispose()
    done = {f"{c['run']}@{c['step']}" for c in rows if c["status"] == "committed"}
    return done, {f"{c['run']}@{c['step']}:{c['status']}" for c in rows if c["status"] != "committed"}


# --- comparison ----------------------------------------------------------------------------------------------

def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def same(got: Any, want: Any, where: str = "value") -> str | None:
    """None when ``got`` equals ``want`` type- and bit-exact (-0.0 is not 0.0, 1.0 is not 1, NaN equals a
    NaN of the same bits), else what differs first."""
    import numpy as np
    import torch

    if type(got) is not type(want):
        return f"{where}: {type(got).__name__} {got!r:.80}, expected {type(want).__name__} {want!r:.80}"
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return f"{where}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
        if tensor_bits(got) != tensor_bits(want):
            return f"{where}: the bits differ ({got.reshape(-1)[:6].tolist()} vs {want.reshape(-1)[:6].tolist()})"
        return None
    if isinstance(want, np.ndarray):
        if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
            return f"{where}: {got.dtype} {got.shape} differs from {want.dtype} {want.shape}"
        return None
    if isinstance(want, float):
        return None if _float_bits(got) == _float_bits(want) else f"{where}: {got!r}, expected {want!r}"
    if isinstance(want, complex):
        return None if (_float_bits(got.real), _float_bits(got.imag)) == (_float_bits(want.real),
                                                                           _float_bits(want.imag)) \
            else f"{where}: {got!r}, expected {want!r}"
    if isinstance(want, dict):
        if list(got) != list(want) and set(got) != set(want):
            return f"{where}: keys {sorted(map(str, got))[:8]}, expected {sorted(map(str, want))[:8]}"
        for k in want:
            d = same(got[k], want[k], f"{where}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return f"{where}: {len(got)} items, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = same(g, w, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if got == want else f"{where}: {got!r:.200}, expected {want!r:.200}"


def tensor_bits(t) -> bytes:
    """The exact bytes of a tensor in C order, whatever its strides, conj or neg bits."""
    import torch

    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    fresh = torch.empty(t.shape, dtype=t.dtype)
    fresh.copy_(t)
    return fresh.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def close_to(rel: float) -> Callable[[Any, Any], str | None]:
    """A comparison for computed values (stats): every float within ``rel`` of the reference."""
    def compare(got: Any, want: Any) -> str | None:
        if isinstance(want, dict):
            for k, w in want.items():
                d = compare(got.get(k) if isinstance(got, dict) else None, w)
                if d:
                    return f"[{k!r}] {d}"
            return None
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return f"{got!r}, expected about {want!r}"
        if math.isnan(want):
            return None if math.isnan(got) else f"{got!r}, expected NaN"
        ok = got == want or abs(got - want) <= rel * max(abs(want), 1e-300)
        return None if ok else f"{got!r}, expected {want!r} (relative error {abs(got - want) / abs(want):.2e})"
    return compare


# --- the runner ----------------------------------------------------------------------------------------------

def make_ctx(tmp: Path, good_dcp: Path, templates: dict[str, Path]) -> Ctx:
    """A fresh case folder: an empty store (a copy of the ``empty`` template), the input folder and the
    sentinel tree outside the store."""
    ctx = Ctx(tmp=tmp, store=tmp / "store", inp=tmp / "in", marker=tmp / "marker", outside=tmp / "outside",
              good_dcp=good_dcp, templates=templates)
    ctx.inp.mkdir(parents=True)
    make_sentinel(ctx.outside)
    shutil.copytree(templates["empty"], ctx.store)
    return ctx


def _run_cli(case: Case, ctx: Ctx, argv: list[str], out: Outcome) -> None:
    from ucp_store import cli

    if case.subprocess:
        env = {**os.environ, "UCP_PROGRESS": "0"}
        try:
            p = subprocess.run([sys.executable, "-m", "ucp_store.cli", *argv], capture_output=True, text=True,
                               env=env, timeout=case.timeout)
            out.exit_code, out.stdout, out.text = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            out.crash = f"hung: no answer within {case.timeout:.0f} s"
            out.stdout = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return
    err, std = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            out.exit_code = cli.main(argv)
        except SystemExit as e:  # argparse usage errors
            out.exit_code = int(e.code) if isinstance(e.code, int) else EXIT_FAIL
        except BaseException:  # noqa: BLE001 (a traceback: what the corpus exists to catch)
            out.crash = traceback.format_exc()
    out.text, out.stdout = err.getvalue(), std.getvalue()


def run_case(case: Case, ctx: Ctx) -> Outcome:
    """Build the input, make the call, return what came out (the checks are :func:`check`'s)."""
    case.build(ctx)
    out = Outcome(case, before=snapshot(ctx))
    if case.listed is not None:
        out.committed_before = committed(ctx)[0]
    ctx.extra["sentinel"] = tree_state(ctx.outside)
    t0 = time.monotonic()
    try:
        if case.cli is not None:
            _run_cli(case, ctx, [str(a) for a in case.cli(ctx)], out)
        else:
            assert case.api is not None
            try:
                out.value = case.api(ctx)
            except Exception as e:  # noqa: BLE001 (the outcome is checked by the caller)
                out.error, out.text = e, str(e)
                if not isinstance(e, ucp_store.errors.UcpError):
                    out.text += "\n" + "".join(traceback.format_exception(e))
    finally:
        out.seconds = time.monotonic() - t0
        for close in ctx.extra.pop("closers", []):
            close()
    return out


def _needles(case: Case, ctx: Ctx) -> list[str]:
    raw = case.needle if isinstance(case.needle, tuple) else (case.needle,)
    return [n.format(**ctx.fields()) for n in raw]


def _check_clean_error(out: Outcome, ctx: Ctx) -> None:
    case = out.case
    if isinstance(case.expect, type) or (isinstance(case.expect, tuple) and isinstance(case.expect[0], type)):
        assert out.error is not None, f"{case.id}: no error raised (returned {out.value!r:.200})"
        assert isinstance(out.error, case.expect), \
            f"{case.id}: {type(out.error).__name__}: {out.text[-1500:]}; expected {case.expect}"
    else:
        codes = case.expect if isinstance(case.expect, tuple) else (case.expect,)
        assert out.exit_code in codes, f"{case.id}: exit {out.exit_code}, expected {codes}: {out.text[-1500:]!r}"
        _check_error_text(out)
    needles = _needles(case, ctx)
    assert any(n in out.text for n in needles), f"{case.id}: none of {needles!r} in the error: {out.text[-2000:]!r}"
    assert snapshot(ctx) == out.before, f"{case.id}: something was left behind in the catalog or the files"


def _check_error_text(out: Outcome) -> None:
    """A failed command says so on one line (``ucp: error: ...``; argparse: usage, then ``...: error: ...``)."""
    case, lines = out.case, out.text.strip().splitlines()
    if case.report:
        assert lines and all(ln.startswith(("FAIL ", "ucp: error: ")) for ln in lines), \
            f"{case.id}: not a report of failures: {out.text!r}"
        return
    if out.exit_code == EXIT_USAGE and lines and lines[0].startswith("usage:"):
        assert ": error: " in lines[-1], f"{case.id}: not a usage error: {out.text!r}"
    else:
        assert out.text.startswith("ucp: error: ") and len(lines) == 1, f"{case.id}: not one error line: {out.text!r}"


def _check_roundtrip(out: Outcome, ctx: Ctx) -> None:
    case = out.case
    assert out.error is None, f"{case.id}: {type(out.error).__name__}: {out.text[-1500:]}"
    if case.cli is not None:
        assert out.exit_code == 0, f"{case.id}: exit {out.exit_code}: {out.text[-1500:]!r}"
    assert case.want is not None
    want = case.want(ctx)
    got = case.got(ctx, out) if case.got is not None else out.value
    diff = (case.compare or same)(got, want)
    assert diff is None, f"{case.id}: read back differs: {diff}"
    _check_listed_verify(case, ctx)


def _check_nothing_deleted(out: Outcome, ctx: Ctx) -> None:
    case = out.case
    if case.cli is not None and out.exit_code != 0:
        _check_error_text(out)
    if out.error is not None:
        assert isinstance(out.error, ucp_store.errors.UcpError), \
            f"{case.id}: {type(out.error).__name__}: {out.text[-1500:]}"
    _check_listed_verify(case, ctx)


def _check_listed_verify(case: Case, ctx: Ctx) -> None:
    """Every version the store lists verifies (chunk checksums and content hashes)."""
    if not (ctx.store / "catalog.db").is_file():
        return
    store = ctx.open()
    try:
        for c in store.list_checkpoints():
            bad = store.checkpoint(c["id"]).verify()
            assert bad == [], f"{case.id}: listed version {c['run']}@{c['step']} does not verify: {bad}"
    finally:
        store.catalog.engine.dispose()


def check(out: Outcome, ctx: Ctx) -> None:
    """The corpus's assertions for one case."""
    case = out.case
    assert out.crash is None, f"{case.id}: {out.crash[-3000:]}"
    assert "Traceback" not in out.stdout + (out.text if out.error is None else ""), \
        f"{case.id}: a traceback in the output: {(out.stdout + out.text)[-3000:]}"
    assert not ctx.marker.exists(), f"{case.id}: a pickle payload ran"
    {CLEAN_ERROR: _check_clean_error, EXACT_ROUNDTRIP: _check_roundtrip,
     NOTHING_DELETED: _check_nothing_deleted}[case.outcome](out, ctx)
    assert tree_state(ctx.outside) == ctx.extra["sentinel"], f"{case.id}: the tree outside the store changed"
    if case.listed is not None:
        done, other = committed(ctx)
        assert other == set(), f"{case.id}: half-written versions in the catalog: {sorted(other)}"
        assert done == set(case.listed), f"{case.id}: committed {sorted(done)}, expected {sorted(case.listed)}"
    if case.id.startswith(("postgres-", "s3-")):
        assert out.seconds < UNREACHABLE_LIMIT_S, f"{case.id}: took {out.seconds:.0f} s"


def failure(out: Outcome, ctx: Ctx) -> str | None:
    """:func:`check` as a value: None when the case holds, else the first broken expectation."""
    try:
        check(out, ctx)
    except AssertionError as e:
        return str(e)
    return None


# --- shared inputs, made once per session ------------------------------------------------------------------

def seed_store(store) -> None:
    """The ``seeded`` template: r@1 (4x6 'w' and 'v', an object), r@2 and r@3 (one 4x6 'w' each)."""
    import torch

    w = torch.arange(24.0).reshape(4, 6)
    store.save("r", 1, {"w": w, "v": -w - 1}, objects={"cfg": {"lr": 0.5, "name": "seed"}})
    store.save("r", 2, {"w": w + 100})
    store.save("r", 3, {"w": w + 200})


def make_fixtures(root: Path) -> tuple[Path, dict[str, Path]]:
    """(a small DCP folder written by torch.distributed.checkpoint, {template name: store folder})."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    good = root / "good_dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}, "step": 7},
                 checkpoint_id=str(good))
    templates = {"empty": root / "empty", "seeded": root / "seeded"}
    ucp_store.open_store(str(templates["empty"]), create=True).catalog.engine.dispose()
    store = ucp_store.open_store(str(templates["seeded"]), create=True)
    seed_store(store)
    store.catalog.engine.dispose()
    return good, templates
