"""Registry under load (issues 16 and 30): one launcher process forks savers, readers, an rm loop and a gc loop.

``python tests/registry_load.py STORE CATALOG OUT.json [SAVERS SAVES]`` (or :func:`run`): the launcher
imports ucp_store and torch once, then forks (before any catalog or TensorStore use, so children share no
connection or thread) the savers (8 x 25 by default: issue 30's stress goal; CI runs fewer, through the
same code), ``READERS`` readers, the rm loop and the gc loop, and writes what each saw to ``OUT.json``.

- saver ``i`` saves ``r{i}@0..saves-1``, recording every save's outcome: committed, or the error it raised
  (a save is retried only after a ``CommitRaceError``, the one error a concurrent rm/gc may cause), and
  at three points contends with every other saver for ``shared@1..3`` and for the tag ``shared:best``
  (pointed at ``shared@{1 + i % 3}``, never forced);
- readers list committed versions of the ``r*`` and ``shared`` runs while the saves run, resolve, read
  and check each chosen version's tensors and chunk checksums;
- the rm loop saves ``scratch@n`` versions holding the same deduplicated tensor as every save and removes
  each with ``ucp rm`` right after the next; the gc loop runs ``ucp gc`` over and over; both until the
  savers are done.

Every tensor is a function of (saver, step), so any reader can check any version it lists; afterwards
:func:`check` runs ``ucp verify`` on every listed version.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import sys
import time
import traceback

SAVERS, SAVES, READERS = 8, 25, 1


def contested(saves: int) -> tuple[int, int, int]:
    """A saver's own steps after which it contends for shared@1, @2, @3 (5, 12, 19 of 25)."""
    steps = (saves // 5, saves // 2, 3 * saves // 4)
    assert len(set(steps)) == 3 and saves >= 4, f"{saves} saves leave no room for three contested steps"
    return steps


def tensors(i: int, j: int) -> dict:
    import torch

    g = lambda seed: torch.Generator().manual_seed(seed)
    return {"shared.emb": torch.randn(16, 16, generator=g(1)),            # one array for all (dedup)
            "own": torch.randn(8, 8, generator=g(100_000 + 1000 * i + j)),  # distinct per version
            "counter": torch.tensor(1000 * i + j)}


def check_version(store, ref: str) -> None:
    """Read every tensor of ``ref`` and compare with what its saver wrote; verify its checksums."""
    import torch

    ck = store.checkpoint(ref)
    i, j = ck.objects()["who"]
    want = tensors(i, j)
    for name, t in want.items():
        got = ck.read(name)
        if not torch.equal(got, t):
            raise AssertionError(f"{ref} ({ck.id}): tensor {name} differs from what saver {i} wrote at {j}")
    bad = ck.verify()
    if bad:
        raise AssertionError(f"{ref} ({ck.id}): verify reports {bad}")


def _wait(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.01)


def saver(store_url: str, catalog: str | None, i: int, saves: int, go: str, out: dict) -> None:
    import ucp_store
    from ucp_store.errors import CommitRaceError, ConflictError, TagInUseError

    store = ucp_store.open_store(store_url, catalog=catalog)
    steps = contested(saves)
    _wait(go)
    out.update(saved=[], retries=0, errors=[], contested={}, tag=None)
    for j in range(saves):
        while True:
            try:
                store.save(f"r{i}", j, tensors(i, j), objects={"who": [i, j]})
                out["saved"].append(j)
                break
            except CommitRaceError as e:  # a concurrent rm/gc swept an array this save deduplicated against
                out["retries"] += 1
                out["errors"].append([j, type(e).__name__, str(e)[:300]])
            except Exception as e:  # noqa: BLE001 (any other error: recorded, and check() fails on it)
                out["errors"].append([j, type(e).__name__, str(e)[:300]])
                break
        if j in steps:
            k = 1 + steps.index(j)
            try:
                store.save("shared", k, tensors(i, 100 + k), objects={"who": [i, 100 + k]})
                out["contested"][k] = "committed"
            except ConflictError as e:
                out["contested"][k] = f"{type(e).__name__}: {e}"
            if k == 3:
                target = f"shared@{1 + i % 3}"
                try:
                    out["tag"] = ["ok", target, store.tag(target, "best")]
                except TagInUseError as e:
                    out["tag"] = ["conflict", target, str(e)]


def reader(store_url: str, catalog: str | None, r: int, go: str, done: str, out: dict) -> None:
    import ucp_store

    store = ucp_store.open_store(store_url, catalog=catalog)
    rng = random.Random(r)
    out.update(reads=0, failures=[], max_listed=0)
    _wait(go)
    while True:
        finished = os.path.exists(done)
        listed = [c for c in store.list_checkpoints() if c["run"] != "scratch"]
        out["max_listed"] = max(out["max_listed"], len(listed))
        for c in rng.sample(listed, min(1, len(listed))):
            try:
                if c["status"] != "committed":
                    raise AssertionError(f"listed a {c['status']} version {c['id']}")
                check_version(store, c["id"])
                out["reads"] += 1
            except Exception as e:  # noqa: BLE001
                out["failures"].append(f"{c['run']}@{c['step']}: {type(e).__name__}: {e}")
        if finished:
            return
        time.sleep(0.1)  # leave the CPUs to the savers: the point is reading *during* the saves


def _common(store_url: str, catalog: str | None) -> list[str]:
    return ["--store", store_url] + (["--catalog", catalog] if catalog else [])


def rm_loop(store_url: str, catalog: str | None, go: str, done: str, out: dict) -> None:
    """Save scratch@n (sharing the savers' deduplicated tensor), then ``ucp rm`` scratch@n-1, until done."""
    import ucp_store
    from ucp_store import cli

    store = ucp_store.open_store(store_url, catalog=catalog)
    out.update(saves=0, rms=0, errors=[])
    _wait(go)
    n = 0
    while n < 2 or not os.path.exists(done):  # at least one rm, however fast the savers finish on a busy host
        n += 1
        try:
            store.save("scratch", n, tensors(99, n), objects={"who": [99, n]})
            out["saves"] += 1
        except Exception as e:  # noqa: BLE001
            out["errors"].append(f"save scratch@{n}: {type(e).__name__}: {e}")
        if n > 1:
            with contextlib.redirect_stdout(io.StringIO()):
                rc = cli.main(["rm", f"scratch@{n - 1}", *_common(store_url, catalog)])
            out["rms"] += rc == 0
            if rc != 0:
                out["errors"].append(f"ucp rm scratch@{n - 1}: exit {rc}")


def gc_loop(store_url: str, catalog: str | None, go: str, done: str, out: dict) -> None:
    """``ucp gc`` over and over until done (a short pause between runs leaves the CPUs to the savers)."""
    from ucp_store import cli

    out.update(gcs=0, errors=[])
    _wait(go)
    runs = 0
    while runs == 0 or not os.path.exists(done):  # at least one gc, however fast the savers finish
        runs += 1
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(["gc", *_common(store_url, catalog)])
        out["gcs"] += rc == 0
        if rc != 0:
            out["errors"].append(f"ucp gc: exit {rc}")
        time.sleep(0.05)


def _child(fn, path: str, *args) -> None:
    out: dict = {}
    code = 0
    try:
        fn(*args, out)
    except BaseException:  # noqa: BLE001
        out["crash"] = traceback.format_exc()
        code = 1
    with open(path, "w") as f:
        json.dump(out, f)
    os._exit(code)


def run(store_url: str, catalog: str | None, workdir: str, timeout: float = 600.0, *, savers: int = SAVERS,
        saves: int = SAVES) -> dict:
    """Fork everyone, wait, return {"savers": [...], "readers": [...], "rm": {...}, "gc": {...}, "seconds": ...}."""
    import multiprocessing as mp

    import ucp_store
    import ucp_store.save.writer

    ucp_store.open_store(store_url, catalog=catalog, create=True).catalog.engine.dispose()
    ctx = mp.get_context("fork")
    go, done = os.path.join(workdir, "go"), os.path.join(workdir, "done")
    res = lambda name: os.path.join(workdir, f"{name}.json")
    n_savers = savers
    savers_p = [ctx.Process(target=_child, args=(saver, res(f"s{i}"), store_url, catalog, i, saves, go))
                for i in range(n_savers)]
    others = [ctx.Process(target=_child, args=(reader, res(f"q{r}"), store_url, catalog, r, go, done))
              for r in range(READERS)]
    others += [ctx.Process(target=_child, args=(loop, res(name), store_url, catalog, go, done))
               for name, loop in (("rm", rm_loop), ("gc", gc_loop))]
    for p in savers_p + others:
        p.start()
    t0 = time.monotonic()
    open(go, "w").close()
    deadline = t0 + timeout
    for p in savers_p:
        p.join(max(1.0, deadline - time.monotonic()))
    seconds = time.monotonic() - t0
    open(done, "w").close()
    for p in others:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in savers_p + others:
        if p.is_alive():
            p.kill()
            p.join()
    load = lambda name: json.load(open(res(name))) if os.path.exists(res(name)) else {"crash": "no result"}
    return {"savers": [load(f"s{i}") for i in range(n_savers)], "readers": [load(f"q{r}") for r in range(READERS)],
            "rm": load("rm"), "gc": load("gc"), "saves": saves, "seconds": seconds}


def check(result: dict, store_url: str, catalog: str | None) -> dict:
    """The issues' assertions on a finished run; returns the counts for the closing note."""
    import ucp_store
    from ucp_store import cli

    saves, n_savers = result["saves"], len(result["savers"])
    for who in result["savers"] + result["readers"] + [result["rm"], result["gc"]]:
        assert "crash" not in who, who["crash"]
    store = ucp_store.open_store(store_url, catalog=catalog)
    assert [c for c in store.list_checkpoints(include_pending=True) if c["status"] != "committed"] == [], \
        "a pending version outlived its save"
    listed = store.list_checkpoints()
    own = [c for c in listed if c["run"].startswith("r")]
    # every save committed, or raised a clear error (a CommitRaceError: the one a concurrent rm/gc may cause,
    # which says to retry) and was retried: none lost, none duplicated, every saver's steps exactly once
    for i, s in enumerate(result["savers"]):
        for j, kind, text in s["errors"]:
            assert kind == "CommitRaceError" and "\n" not in text.strip(), (i, j, kind, text)
        assert s["saved"] == list(range(saves)), f"saver {i} saved {s['saved']}"
        assert sorted(c["step"] for c in own if c["run"] == f"r{i}") == list(range(saves))
    assert len(own) == n_savers * saves and len({c["id"] for c in own}) == len(own)
    # contested steps: one winner each, every loser told by a conflict error naming the run and step
    shared = {c["step"]: c for c in listed if c["run"] == "shared"}
    assert sorted(shared) == [1, 2, 3]
    conflicts = 0
    for k in (1, 2, 3):
        outcomes = [s["contested"][str(k)] for s in result["savers"]]
        assert outcomes.count("committed") == 1, outcomes
        for o in outcomes:
            if o != "committed":
                conflicts += 1
                assert o.startswith(("StepCommittedError", "CommitRaceError")) and "step" in o, o
                assert "'shared'" in o, o  # names the run
    # the tag: exactly one, and each tagger was either right about its target or told it was taken
    best = store.resolve("shared:best")
    tag_conflicts = 0
    for s in result["savers"]:
        status, target, detail = s["tag"]
        if status == "ok":
            assert detail == best == store.resolve(target)
        else:
            tag_conflicts += 1
            assert store.resolve(target) != best and "'best'" in detail and best in detail, s["tag"]
    # readers: they read while the saves ran, and never saw anything uncommitted or wrong
    reads = sum(r["reads"] for r in result["readers"])
    failures = [f for r in result["readers"] for f in r["failures"]]
    assert failures == [], failures[:5]
    assert reads > 0
    rm, gc = result["rm"], result["gc"]
    assert rm["errors"] == [] and gc["errors"] == [], (rm["errors"] + gc["errors"])[:5]
    assert rm["rms"] >= 1 and gc["gcs"] >= 1
    # afterwards (and after one more gc) every listed version reads back bit-exact and `ucp verify` passes it
    report = store.gc()
    assert report.removed_checkpoints == [] and report.removed_pending == []
    common = ["--store", store_url] + (["--catalog", catalog] if catalog else [])
    verified = 0
    for c in store.list_checkpoints():
        if c["run"] != "scratch":
            check_version(store, c["id"])
        with contextlib.redirect_stdout(io.StringIO()):  # its "ok: ..." line, once per version
            rc = cli.main(["verify", c["id"], *common])
        assert rc == 0, f"ucp verify {c['run']}@{c['step']} failed (exit {rc})"
        verified += 1
    return {"committed": len(own) + len(shared), "own": len(own), "contested_won": len(shared),
            "step_conflicts": conflicts, "tag_conflicts": tag_conflicts,
            "retries": sum(s["retries"] for s in result["savers"]), "reads": reads, "rm_saves": rm["saves"],
            "rms": rm["rms"], "gcs": gc["gcs"], "verified": verified, "seconds": round(result["seconds"], 1)}


if __name__ == "__main__":
    store_url, catalog, out_path = sys.argv[1], sys.argv[2] or None, sys.argv[3]
    size = {"savers": int(sys.argv[4]), "saves": int(sys.argv[5])} if len(sys.argv) > 5 else {}
    result = run(store_url, catalog, os.path.dirname(os.path.abspath(out_path)), **size)
    with open(out_path, "w") as f:
        json.dump(result, f)
