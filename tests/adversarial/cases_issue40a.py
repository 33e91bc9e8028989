"""Issue 40, part A, as data: a store never deletes what another store owns, the catalog is read-only where
it says so, and no secret is printed (``issue="40.N"``, N the item; ``40.s`` the smaller ones), with
variants of each.

The PostgreSQL side of the same items (and the escapes of ``ucp query`` a superuser could use) is in
``tests/test_issue40_ownership.py``, which runs on both catalogs; the corpus runs on its SQLite templates.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ucp_store
from ucp_store.errors import QueryError, ReferenceNotFound
from ucp_store.registry.identity import IDENTITY_FILE, MismatchedStoreError

from .framework import CLEAN_ERROR, EXACT_ROUNDTRIP, EXIT_FAIL, NOTHING_DELETED, Case, Ctx
from .framework import nothing as nothing_but_folder

SEEDED = ("r@1", "r@2", "r@3")
W = torch.arange(24.0).reshape(4, 6)  # the seeded store's r@1 'w'
SECRET = "hunter2"
NOT_ONE = "are not one store"


def other(ctx: Ctx) -> Path:
    return ctx.tmp / "other"


def cat_of(folder: Path) -> str:
    return f"sqlite:///{folder}/catalog.db"


def seeded_and_other(ctx: Ctx) -> None:
    """The seeded store, and a second store beside it (b@1) whose catalog is not the seeded one's."""
    ctx.seed()
    store = ucp_store.open_store(str(other(ctx)), create=True)
    store.save("b", 1, {"w": torch.arange(5.0)})
    store.catalog.engine.dispose()


def on_other(*argv: str) -> Callable[[Ctx], list[str]]:
    """A command line against the other store's location with the seeded store's catalog."""
    return lambda ctx: ["--store", str(other(ctx)), "--catalog", cat_of(ctx.store), *argv]


def on_seeded(*argv: str) -> Callable[[Ctx], list[str]]:
    """A command line against the seeded store's location with the other store's catalog."""
    return lambda ctx: ["--store", str(ctx.store), "--catalog", cat_of(other(ctx)), *argv]


def mismatched_api(call: Callable[[Any], Any]) -> Callable[[Ctx], Any]:
    def run(ctx: Ctx) -> Any:
        store = ucp_store.open_store(str(other(ctx)), catalog=cat_of(ctx.store))
        ctx.extra.setdefault("closers", []).append(store.catalog.engine.dispose)
        return call(store)
    return run


def torch_file(ctx: Ctx) -> None:
    seeded_and_other(ctx)
    torch.save({"x": torch.ones(3)}, ctx.inp / "m.pt")


def nested_store(name: str) -> Callable[[Ctx], None]:
    """The seeded store with a whole store (catalog, arrays, identity) made inside its arrays/ folder."""
    def build(ctx: Ctx) -> None:
        ctx.seed()
        inner = ucp_store.open_store(str(ctx.store / "arrays" / name), create=True)
        inner.save("i", 1, {"w": torch.arange(7.0)})
        inner.catalog.engine.dispose()
    return build


def inner_read(name: str) -> Callable[[Ctx, Any], Any]:
    def got(ctx: Ctx, _out: Any) -> Any:
        inner = ucp_store.open_store(str(ctx.store / "arrays" / name))
        try:
            assert inner.checkpoint("i@1").verify() == []
            return inner.checkpoint("i@1").read("w")
        finally:
            inner.catalog.engine.dispose()
    return got


def foreign_entries(ctx: Ctx) -> None:
    """Foreign things under arrays/: a file, a folder of another name, a link out of the store named like a
    version folder, a version-shaped folder holding a file that is no array."""
    ctx.seed()
    arrays = ctx.store / "arrays"
    (arrays / "README.txt").write_text("mine\n")
    (arrays / "notes").mkdir()
    (arrays / "notes" / "a.bin").write_bytes(b"x" * 10)
    (arrays / "feedfacefeedface").symlink_to(ctx.outside, target_is_directory=True)
    (arrays / "0badc0de0badc0de").mkdir()
    (arrays / "0badc0de0badc0de" / "keep.me").write_bytes(b"y" * 7)


def foreign_still_there(ctx: Ctx, _out: Any) -> Any:
    arrays = ctx.store / "arrays"
    return ((arrays / "README.txt").read_text(), (arrays / "notes" / "a.bin").read_bytes(),
            os.readlink(arrays / "feedfacefeedface") == str(ctx.outside),
            (arrays / "0badc0de0badc0de" / "keep.me").read_bytes())


def foreign_want(ctx: Ctx) -> Any:
    return ("mine\n", b"x" * 10, True, b"y" * 7)


def identity_file(content: Callable[[Path], None]) -> Callable[[Ctx], None]:
    def build(ctx: Ctx) -> None:
        ctx.seed()
        path = ctx.store / IDENTITY_FILE
        path.unlink()
        content(path)
    return build


def removed_after_open(loaded: bool) -> Callable[[Ctx], None]:
    """r@1 opened (its rows read first with ``loaded``), then removed by another handle."""
    def build(ctx: Ctx) -> None:
        ctx.seed()
        reader = ctx.open()
        ck = reader.checkpoint("r@1")
        if loaded:
            ck.tensors()
        writer = ctx.open()
        writer.rm("r@1")
        writer.catalog.engine.dispose()
        ctx.extra["ck"] = ck
        ctx.extra.setdefault("closers", []).append(reader.catalog.engine.dispose)
    return build


def err(id: str, surface: str, kind: str, build, expect, needle, *, issue: str, **call) -> Case:
    return Case(id, surface, kind, build, CLEAN_ERROR, expect=expect, needle=needle, issue=issue, **call)


def S(*argv: str) -> Callable[[Ctx], list[str]]:
    return lambda ctx: [a.format(**ctx.fields()) for a in argv] + ["--store", str(ctx.store)]


ESCAPES_SQLITE = ["END; UPDATE checkpoints SET status='pending'", "COMMIT; DELETE FROM tags",
                  "ROLLBACK; DELETE FROM tensors", "SELECT 1; DELETE FROM tags", "PRAGMA query_only = OFF",
                  "ATTACH DATABASE '{tmp}/x.db' AS x", "WITH x AS (SELECT 1) DELETE FROM tags",
                  "DELETE FROM checkpoints", "   "]
SECRET_CATALOGS = [f"postgresql+psycopg2://127.0.0.1:1/ucp?password={SECRET}&user=x&connect_timeout=2",
                   f"postgresql+psycopg2://x:{SECRET}@127.0.0.1:1/ucp?connect_timeout=2",
                   f"x:{SECRET}@localhost/ucp", f"postgresql+psycopg2://x:{SECRET}@h:port/ucp"]
WILDCARDS = ["%", "r_", "_" * 16, "%%", "_%"]
STEPS = ["1_0", "\u0661", "\uff11", "+1", "01", " 1"]

CASES: list[Case] = [
    # item 1: a catalog and a location that are not one store's: every write or delete refused, both named
    *[err(f"store-other-catalog-{'-'.join(argv)}", "store", "identity", seeded_and_other, EXIT_FAIL, NOT_ONE,
          cli=on_other(*argv), listed=SEEDED, issue="40.1")
      for argv in (("gc",), ("gc", "--dry-run"), ("gc", "--keep-last", "1"), ("rm", "r@1"), ("tag", "r@1", "t"),
                   ("tag", "r:t", "--delete"), ("retention", "r", "--keep-last", "1"))],
    *[err(f"store-other-location-{'-'.join(argv)}", "store", "identity", seeded_and_other, EXIT_FAIL, NOT_ONE,
          cli=on_seeded(*argv), listed=SEEDED, issue="40.1")
      for argv in (("gc",), ("rm", "b@1"))],
    err("store-other-catalog-import", "store", "identity", torch_file, EXIT_FAIL, NOT_ONE,
        cli=lambda ctx: on_other("import", "torch", str(ctx.inp / "m.pt"), "--run", "x", "--step", "1")(ctx),
        listed=SEEDED, issue="40.1"),
    err("api-other-catalog-gc", "api", "identity", seeded_and_other, MismatchedStoreError, NOT_ONE,
        api=mismatched_api(lambda st: st.gc()), listed=SEEDED, issue="40.1"),
    err("api-other-catalog-save", "api", "identity", seeded_and_other, MismatchedStoreError, NOT_ONE,
        api=mismatched_api(lambda st: st.save("x", 1, {"w": torch.ones(2)})), listed=SEEDED, issue="40.1"),
    err("api-other-catalog-begin", "api", "identity", seeded_and_other, MismatchedStoreError, NOT_ONE,
        api=mismatched_api(lambda st: st.begin("x", 1)), listed=SEEDED, issue="40.1"),
    err("api-other-catalog-retention", "api", "identity", seeded_and_other, MismatchedStoreError, NOT_ONE,
        api=mismatched_api(lambda st: st.set_retention("r", keep_last=1)), listed=SEEDED, issue="40.1"),
    err("store-init-new-catalog-for-a-store", "store", "identity", seeded_and_other, EXIT_FAIL,
        "refusing to create a second catalog",
        cli=lambda ctx: ["--store", str(ctx.store), "--catalog", cat_of(ctx.tmp), "init"], listed=SEEDED,
        issue="40.1"),
    err("store-catalog-on-its-own-arrays-folder", "store", "identity", seeded_and_other, EXIT_FAIL,
        "the location has no version folder",
        cli=lambda ctx: ["--store", str(ctx.store / "arrays"), "--catalog", cat_of(ctx.store), "gc"],
        listed=SEEDED, issue="40.1"),
    # variants: the identity file itself hostile
    err("store-identity-file-garbage", "store", "identity", identity_file(lambda p: p.write_text("{]")), EXIT_FAIL,
        "is not a ucp store identity file", cli=S("gc"), listed=SEEDED, issue="40.1"),
    err("store-identity-file-no-id", "store", "identity",
        identity_file(lambda p: p.write_text(json.dumps({"store_id": 7}))), EXIT_FAIL,
        "is not a ucp store identity file", cli=S("rm", "r@1"), listed=SEEDED, issue="40.1"),
    err("store-identity-file-other-id", "store", "identity",
        identity_file(lambda p: p.write_text(json.dumps({"store_id": "f" * 32}))), EXIT_FAIL, NOT_ONE,
        cli=S("gc"), listed=SEEDED, issue="40.1"),
    err("store-identity-file-huge", "store", "identity",
        identity_file(lambda p: p.write_bytes(b" " * (1 << 20))), EXIT_FAIL, "is not a regular file of at most",
        cli=S("gc"), listed=SEEDED, issue="40.1"),
    err("store-identity-file-fifo", "store", "identity", identity_file(lambda p: os.mkfifo(p)), EXIT_FAIL,
        "is not a regular file", cli=S("tag", "r@1", "t"), listed=SEEDED, issue="40.1"),
    err("store-identity-file-link", "store", "identity",
        identity_file(lambda p: p.symlink_to(p.parent.parent / "outside" / "keep.bin")), EXIT_FAIL,
        "cannot be opened as a regular file", cli=S("gc"), listed=SEEDED, issue="40.1"),
    # item 3: gc deletes only what it can tie to its catalog
    Case("store-nested-store-in-arrays-gc", "store", "identity", nested_store("inner"), EXACT_ROUNDTRIP,
         want=lambda ctx: torch.arange(7.0), cli=S("gc"), got=inner_read("inner"), listed=SEEDED, issue="40.3"),
    Case("store-nested-store-version-named-gc", "store", "identity", nested_store("0123456789abcdef"),
         EXACT_ROUNDTRIP, want=lambda ctx: torch.arange(7.0), cli=S("gc", "--keep-last", "1"),
         got=inner_read("0123456789abcdef"), listed=("r@3",), issue="40.3"),
    Case("store-nested-store-rm", "store", "identity", nested_store("inner"), EXACT_ROUNDTRIP,
         want=lambda ctx: torch.arange(7.0), cli=S("rm", "r@2"), got=inner_read("inner"), listed=("r@1", "r@3"),
         issue="40.3"),
    Case("store-foreign-entries-gc", "store", "identity", foreign_entries, EXACT_ROUNDTRIP, want=foreign_want,
         cli=S("gc", "--json"), got=foreign_still_there, listed=SEEDED, issue="40.3"),
    Case("api-foreign-entries-gc-reported", "api", "identity", foreign_entries, EXACT_ROUNDTRIP,
         want=lambda ctx: ["arrays/0badc0de0badc0de", "arrays/README.txt", "arrays/feedfacefeedface",
                           "arrays/notes"],
         api=lambda ctx: sorted(ctx.open().gc().left), listed=SEEDED, issue="40.3"),
    # item 2: ucp query cannot write (SQLite here; PostgreSQL's escapes in test_issue40_ownership)
    *[err(f"cli-query-escape-{i}", "cli", "query", lambda ctx: ctx.seed(), EXIT_FAIL, "query",
          cli=S("query", sql), listed=SEEDED, issue="40.2") for i, sql in enumerate(ESCAPES_SQLITE)],
    # item 11: a bounded query
    err("cli-query-recursive-cte-timeout", "cli", "query", lambda ctx: ctx.seed(), EXIT_FAIL, "time bound of 0.5 s",
        cli=S("query", "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c) SELECT count(*) FROM c",
              "--timeout", "0.5"), listed=SEEDED, issue="40.11"),
    err("api-query-timeout-nan", "api", "query", lambda ctx: ctx.seed(), QueryError, "query timeout",
        api=lambda ctx: ctx.open().query("SELECT 1", timeout=float("nan")), issue="40.11"),
    # items 4 and 5: no secret printed (the corpus checks the masked form is what is shown)
    *[err(f"postgres-secret-{i}-{cmd}", "cli", "secrets", nothing_but_folder, EXIT_FAIL,
          ("password=***", "x:***@"), cli=lambda ctx, u=url, c=cmd: ["--store", str(ctx.store), "--catalog", u,
                                                                    *c.split("+")],
          issue="40.4" if "password=" in url else "40.5")
      for i, url in enumerate(SECRET_CATALOGS) for cmd in ("ls", "init", "query+SELECT 1", "gc")],
    # item 6: % and _ are no wildcards
    *[err(f"cli-wildcard-{cmd}-{i}", "cli", "references", lambda ctx: ctx.seed(), EXIT_FAIL,
          "matches no committed checkpoint", cli=S(cmd, ref), listed=SEEDED, issue="40.6")
      for i, ref in enumerate(WILDCARDS) for cmd in ("show", "rm")],
    # item 7: a version removed after it was opened
    err("api-verify-removed-version", "api", "removed", removed_after_open(False), ReferenceNotFound,
        "was removed after it was opened", api=lambda ctx: ctx.extra["ck"].verify(), issue="40.7"),
    err("api-verify-removed-version-rows-loaded", "api", "removed", removed_after_open(True), ReferenceNotFound,
        "was removed after it was opened", api=lambda ctx: ctx.extra["ck"].verify(), issue="40.7"),
    err("api-read-removed-version", "api", "removed", removed_after_open(True), ReferenceNotFound,
        "was removed after it was opened", api=lambda ctx: ctx.extra["ck"].read("w"), issue="40.7"),
    err("api-state-dict-removed-version", "api", "removed", removed_after_open(True), ReferenceNotFound,
        "was removed after it was opened", api=lambda ctx: ctx.extra["ck"].state_dict("weight"), issue="40.7"),
    # smaller ones: steps in ASCII digits only; a port that is no number
    *[err(f"cli-step-spelling-{i}", "cli", "references", lambda ctx: ctx.seed(), EXIT_FAIL, "ASCII digits",
          cli=S("rm", f"r@{step}"), listed=SEEDED, issue="40.s") for i, step in enumerate(STEPS)],
    err("cli-catalog-port-not-a-number", "cli", "catalog", nothing_but_folder, EXIT_FAIL, "port is not a number",
        cli=lambda ctx: ["--store", str(ctx.store), "--catalog", "postgresql+psycopg2://u:p@h:abc/db", "ls"],
        issue="40.s"),
    Case("store-gc-json-keeps-versions", "store", "identity", foreign_entries, NOTHING_DELETED, cli=S("gc"),
         listed=SEEDED, issue="40.3"),
]
