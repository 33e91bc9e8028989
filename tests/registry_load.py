"""Registry under load (issue 16): one launcher process forks savers, readers and a gc/rm racer.

``python tests/registry_load.py STORE CATALOG OUT.json`` (or :func:`run`): the launcher imports ucp_store
and torch once, then forks (before any catalog or TensorStore use, so children share no connection or
thread) ``SAVERS`` savers, ``READERS`` readers and one racer, and writes what each saw to ``OUT.json``.

- saver ``i`` saves ``r{i}@0..SAVES-1`` (retrying a save only when a concurrent rm/gc made it abort with
  ``CommitRaceError``), and at three points contends with every other saver for ``shared@1..3`` and for
  the tag ``shared:best`` (pointed at ``shared@{1 + i % 3}``, never forced);
- readers list committed versions of the ``r*`` and ``shared`` runs while the saves run, resolve, read
  and check each chosen version's tensors and chunk checksums;
- the racer saves ``scratch@n`` versions holding the same deduplicated tensor as every save, removes
  them with ``ucp rm`` and runs ``ucp gc`` in between, until the savers are done.

Every tensor is a function of (saver, step), so any reader can check any version it lists.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback

SAVERS, SAVES, READERS = 8, 25, 1
CONTESTED = (5, 12, 19)  # a saver's own step after which it contends for shared@1, @2, @3


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


def saver(store_url: str, catalog: str | None, i: int, go: str, out: dict) -> None:
    import ucp_store
    from ucp_store.errors import CommitRaceError, ConflictError, TagInUseError

    store = ucp_store.open_store(store_url, catalog=catalog)
    _wait(go)
    out.update(saved=[], retries=0, contested={}, tag=None)
    for j in range(SAVES):
        while True:
            try:
                store.save(f"r{i}", j, tensors(i, j), objects={"who": [i, j]})
                out["saved"].append(j)
                break
            except CommitRaceError as e:  # a concurrent rm/gc swept an array this save deduplicated against
                out["retries"] += 1
                out.setdefault("retry_errors", []).append(str(e)[:200])
        if j in CONTESTED:
            k = 1 + CONTESTED.index(j)
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


def racer(store_url: str, catalog: str | None, go: str, done: str, out: dict) -> None:
    import ucp_store
    from ucp_store import cli

    store = ucp_store.open_store(store_url, catalog=catalog)
    common = ["--store", store_url] + (["--catalog", catalog] if catalog else [])
    out.update(saves=0, rms=0, gcs=0, errors=[])
    _wait(go)
    n = 0
    while not os.path.exists(done):
        n += 1
        try:
            store.save("scratch", n, tensors(99, n), objects={"who": [99, n]})
            out["saves"] += 1
        except Exception as e:  # noqa: BLE001
            out["errors"].append(f"save scratch@{n}: {type(e).__name__}: {e}")
        if n > 1:
            rc = cli.main(["rm", f"scratch@{n - 1}", *common])
            out["rms"] += rc == 0
            if rc != 0:
                out["errors"].append(f"ucp rm scratch@{n - 1}: exit {rc}")
        if n % 3 == 0:
            rc = cli.main(["gc", *common])
            out["gcs"] += rc == 0
            if rc != 0:
                out["errors"].append(f"ucp gc: exit {rc}")


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


def run(store_url: str, catalog: str | None, workdir: str, timeout: float = 600.0) -> dict:
    """Fork everyone, wait, return {"savers": [...], "readers": [...], "racer": {...}, "seconds": ...}."""
    import multiprocessing as mp

    import ucp_store
    import ucp_store.writer  # noqa: F401 (torch, TensorStore: imported once, before the fork)

    ucp_store.open_store(store_url, catalog=catalog, create=True).catalog.engine.dispose()
    ctx = mp.get_context("fork")
    go, done = os.path.join(workdir, "go"), os.path.join(workdir, "done")
    res = lambda name: os.path.join(workdir, f"{name}.json")
    savers = [ctx.Process(target=_child, args=(saver, res(f"s{i}"), store_url, catalog, i, go))
              for i in range(SAVERS)]
    others = [ctx.Process(target=_child, args=(reader, res(f"q{r}"), store_url, catalog, r, go, done))
              for r in range(READERS)]
    others.append(ctx.Process(target=_child, args=(racer, res("racer"), store_url, catalog, go, done)))
    for p in savers + others:
        p.start()
    t0 = time.monotonic()
    open(go, "w").close()
    deadline = t0 + timeout
    for p in savers:
        p.join(max(1.0, deadline - time.monotonic()))
    seconds = time.monotonic() - t0
    open(done, "w").close()
    for p in others:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in savers + others:
        if p.is_alive():
            p.kill()
            p.join()
    load = lambda name: json.load(open(res(name))) if os.path.exists(res(name)) else {"crash": "no result"}
    return {"savers": [load(f"s{i}") for i in range(SAVERS)], "readers": [load(f"q{r}") for r in range(READERS)],
            "racer": load("racer"), "seconds": seconds}


def check(result: dict, store_url: str, catalog: str | None) -> dict:
    """The issue's assertions on a finished run; returns the counts for the closing note."""
    import ucp_store

    for who in result["savers"] + result["readers"] + [result["racer"]]:
        assert "crash" not in who, who["crash"]
    store = ucp_store.open_store(store_url, catalog=catalog)
    assert [c for c in store.list_checkpoints(include_pending=True) if c["status"] != "committed"] == [], \
        "a pending version outlived its save"
    listed = store.list_checkpoints()
    own = [c for c in listed if c["run"].startswith("r")]
    # none lost, none duplicated: every saver's 25 steps exactly once
    for i, s in enumerate(result["savers"]):
        assert s["saved"] == list(range(SAVES)), f"saver {i} saved {s['saved']}"
        assert sorted(c["step"] for c in own if c["run"] == f"r{i}") == list(range(SAVES))
    assert len(own) == SAVERS * SAVES and len({c["id"] for c in own}) == len(own)
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
    racer = result["racer"]
    assert racer["errors"] == [], racer["errors"][:5]
    assert racer["rms"] >= 1 and racer["gcs"] >= 1
    # afterwards (and after one more gc) every remaining version verifies, bit-exact
    report = store.gc()
    assert report.removed_checkpoints == [] and report.removed_pending == []
    for c in store.list_checkpoints():
        if c["run"] != "scratch":
            check_version(store, c["id"])
    return {"committed": len(own) + len(shared), "own": len(own), "contested_won": len(shared),
            "step_conflicts": conflicts, "tag_conflicts": tag_conflicts, "retries": sum(s["retries"] for s in
                                                                                       result["savers"]),
            "reads": reads, "racer_saves": racer["saves"], "rms": racer["rms"], "gcs": racer["gcs"],
            "seconds": round(result["seconds"], 1)}


if __name__ == "__main__":
    store_url, catalog, out_path = sys.argv[1], sys.argv[2] or None, sys.argv[3]
    result = run(store_url, catalog, os.path.dirname(os.path.abspath(out_path)))
    with open(out_path, "w") as f:
        json.dump(result, f)
