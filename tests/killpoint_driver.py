"""Kill-point matrix driver: every named kill point (``ucp_store/_killpoints.py``) tried in a real process.

Run as ``python tests/killpoint_driver.py --work DIR --catalog sqlite|postgresql+psycopg2://... --backend
folder|http://moto-endpoint [--points a,b]``; prints one JSON line per case. tests/test_killpoints.py and
tools/fault_table.py run it.

The driver imports torch, TensorStore and ucp_store once and then forks, per case, three children: one
that builds the store (committed versions the op must not disturb), one that runs the operation with
``UCP_KILL_AT`` armed (it must die by SIGKILL), and one that checks what the kill left behind. The
driver itself never opens a store, so no TensorStore or database thread is alive when it forks.

After each kill the checker asserts:
- every version committed before the op resolves, verifies (``Checkpoint.verify() == []``) and reads
  back bit-exact;
- the version the op was making is neither listed nor resolvable, unless the kill came after its commit
  (then it is listed and verifies);
- ``ucp gc`` exits 0 and brings the store back: every array file and every catalog row exactly as before
  the op when the op did not take effect; when it did (a kill after the commit of a save, an rm or a gc),
  exactly the files of the arrays the catalog still references, byte for byte as before, and no row
  that was not there before or made by the op;
- a killed export left nothing under the destination name (so no loader sees a half folder);
- a rerun of the same op succeeds (its result verifies, or for an export loads), and a last gc leaves no
  file no row knows about.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("UCP_PROGRESS", "0")
os.environ.pop("UCP_KILL_AT", None)

import tensorstore as ts  # noqa: E402,F401  (loaded before the forks)
import torch  # noqa: E402

import ucp_store
from ucp_store import _killpoints


def _prewarm() -> None:
    """Import and build, once in the driver, what every forked child would otherwise redo (no threads)."""
    import importlib

    for mod in ("ucp_store.patterns", "ucp_store.topology", "ucp_store.registry.retention", "ucp_store.io.read",
                "ucp_store.io.localread", "ucp_store.cli", "ucp_store.cli.maintenance", "ucp_store.distributed",
                "ucp_store.formats.dcp.adapter", "ucp_store.formats.hf.adapter", "ucp_store.deepspeed.universal",
                "ucp_store.catalog.db", "torch.distributed.checkpoint", "safetensors.torch",
                "sqlalchemy.dialects.sqlite"):
        importlib.import_module(mod)
    from ucp_store import schema

    for kind in ("pattern", "provenance", "topology", "manifest"):
        schema.load_schema(kind)


_prewarm()

BUCKET = "ucp-kill"

# (point, op, effect): effect "none" = the op must leave no trace after gc; "done" = the kill came after
# the op took effect (a commit, an rm's or gc's row transaction), so gc must finish it instead
CASES = [
    ("save.after_begin", "save", "none"),
    ("write.array_created", "save", "none"),
    ("write.array_written:2", "save", "none"),
    ("write.shard_box", "save", "none"),
    ("flush.before_rows", "save", "none"),
    ("flush.mid_rows", "save", "none"),
    ("flush.after_rows", "save", "none"),
    ("commit.in_txn", "save", "none"),
    ("commit.after", "save", "done"),
    ("abort.after_row", "save_fail", "none"),
    ("import.after_records", "import", "none"),
    ("dist.mid_write", "dist", "none"),
    ("async.mid_copy", "async", "none"),
    ("gc.after_rows", "gc", "done"),
    ("sweep.mid:2", "gc", "done"),
    ("rm.after_row", "rm", "done"),
    ("sweep.mid", "rm", "done"),
    ("export.torch", "export_torch", "none"),
    ("export.universal", "export_universal", "none"),
    ("export.dcp", "export_dcp", "none"),
    ("export.hf", "export_hf", "none"),
]


def _t(seed: int, shape=(8, 6), dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _sha(t: torch.Tensor) -> str:
    fresh = torch.empty(t.shape, dtype=t.dtype)
    fresh.copy_(t)
    return hashlib.sha256(fresh.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


# --- the case's store --------------------------------------------------------------------------------

class Case:
    def __init__(self, work: str, n: int | str, catalog: str, backend: str):
        self.dir = os.path.join(work, f"case{n}")
        os.makedirs(self.dir, exist_ok=True)
        self.pg_schema = None
        if catalog == "sqlite":
            self.catalog = f"sqlite:///{self.dir}/catalog.db"
        else:
            self.pg_schema = f"ucp_kill_{os.getpid()}_{n}"
            from sqlalchemy.engine import make_url
            self.catalog = make_url(catalog).update_query_dict(
                {"options": f"-csearch_path={self.pg_schema}"}).render_as_string(hide_password=False)
        if backend == "folder":
            self.url = os.path.join(self.dir, "store")
        else:
            self.url = f"s3://{BUCKET}/kill/{os.getpid()}/case{n}?endpoint={backend}&region=us-east-1"
        self.dest = os.path.join(self.dir, "export")

    def open(self, create: bool = False):
        return ucp_store.open_store(self.url, create=create, catalog=self.catalog)


def snapshot(store) -> dict:
    """Every file under the store's arrays (key -> sha256) and every catalog row (table -> sorted rows)."""
    from sqlalchemy import select

    from ucp_store.catalog import models as m

    kv = ts.KvStore.open(store.location.kvstore("arrays")).result()
    files = {}
    for key in kv.list().result():
        raw = kv.read(key).result()
        files[key.decode()] = hashlib.sha256(bytes(raw.value)).hexdigest()
    rows: dict[str, list] = {}
    with store.catalog.engine.connect() as conn:
        for name, table in sorted(m.Base.metadata.tables.items()):
            rows[name] = sorted(json.dumps([str(v) for v in r], sort_keys=True)
                                for r in conn.execute(select(table)))
    return {"files": files, "rows": rows}


def setup(case: Case, op: str) -> dict:
    """Committed versions the op runs against; returns what the checker needs to know about them."""
    store = case.open(create=True)
    shared = _t(1)
    store.save("base", 1, {"shared": shared, "only1": _t(2)}, objects={"meta": {"lr": 0.1}})
    store.save("base", 2, {"shared": shared, "only2": _t(3, (5, 7)), "opt": {"fp32": _t(4), "exp_avg": _t(5)}})
    if op == "gc":
        store.save("base", 3, {"shared": shared, "only3": _t(6)})
        store.set_retention("base", keep_last=1)
    if op == "import":
        torch.save({"a": _t(7), "b": {"c": _t(8, (3,))}, "step": 4}, os.path.join(case.dir, "src.pt"))
    expect = {}
    for c in store.list_checkpoints():
        ck = store.checkpoint(c["id"])
        expect[f"{c['run']}@{c['step']}"] = {f"{i.name}/{i.state}": _sha(ck.read(i.name, i.state))
                                            for i in ck.tensors()}
    return {"expect": expect, "before": snapshot(store)}


# --- the operations ------------------------------------------------------------------------------------

OP_TARGET = {"save": "fresh@1", "save_fail": "fresh@1", "import": "imp@5", "dist": "dst@1", "async": "asy@1"}
REMOVED = {"gc": ["base@1", "base@2"], "rm": ["base@1"]}


def run_op(case: Case, op: str) -> None:
    store = case.open()
    if op in ("save", "save_fail"):
        from ucp_store.patterns import Partitioned
        from ucp_store.topology import Topology

        w = store.begin("fresh", 1, message="killed?")
        w.write("shared", "weight", _t(1))  # dedups against base
        w.write("n1", "weight", _t(11))
        w.write("n2", "fp32", _t(12, (4, 4), torch.bfloat16))
        w.flush()
        w.write("n3", "weight", _t(13))
        full = _t(14, (8, 4))
        pattern = Partitioned(dim=0).to_json()
        for rank in range(2):
            w.write_shard("tp", "fp32", full[rank * 4:(rank + 1) * 4], shape=(8, 4), pattern=pattern,
                          topology=Topology(tp=2), rank=rank)
        w.write_object("o", {"k": 1})
        if op == "save_fail":
            try:
                w.write("n1", "weight", _t(15))  # a duplicate: the writer's caller aborts
            except ucp_store.errors.DuplicateEntryError:
                w.abort()
                return
            raise AssertionError("a duplicate write was accepted")
        w.commit()
    elif op == "import":
        from ucp_store.formats.torch_file import import_torch_file

        import_torch_file(store, os.path.join(case.dir, "src.pt"), "imp", 5, progress=False)
    elif op == "dist":
        from ucp_store import distributed as dist

        dist.save({"model": {"w": _t(21), "b": _t(22, (6,))}, "lr": 0.5}, store=store, run="dst", step=1,
                  progress=False)
    elif op == "async":  # a lazy async save, killed while its background snapshot copies
        from ucp_store import distributed as dist

        dist.async_save({"model": {"w": _t(21), "b": _t(22, (6,))}, "lr": 0.5}, store=store, run="asy", step=1,
                        lazy=True).result()
    elif op == "gc":
        store.gc()
    elif op == "rm":
        store.rm("base@1")
    elif op == "export_torch":
        from ucp_store.formats.torch_file import export_torch_file

        export_torch_file(store.checkpoint("base@2"), case.dest, state="fp32", progress=False)
    elif op == "export_universal":
        from ucp_store.deepspeed.universal import export_universal

        export_universal(store.checkpoint("base@2"), case.dest, tag="t", progress=False, workers=1)
    elif op == "export_dcp":
        from ucp_store.formats.dcp.adapter import export_dcp

        export_dcp(store.checkpoint("base@2"), case.dest, progress=False)
    elif op == "export_hf":
        from ucp_store.formats.hf.adapter import export_hf

        export_hf(store.checkpoint("base@1"), case.dest, config={"architectures": ["Tiny"], "model_type": "tiny"},
                  progress=False)
    else:
        raise ValueError(op)


def export_loads(case: Case, op: str) -> bool:
    """The export's destination is a complete, loadable output (True), or absent (False)."""
    if op == "export_torch":
        if not os.path.exists(case.dest):
            return False
        sd = torch.load(case.dest, weights_only=True)
        return set(sd) == {"opt"}
    if op == "export_universal":
        final = os.path.join(case.dest, "t")
        if not os.path.exists(final):
            return False
        assert open(os.path.join(case.dest, "latest_universal")).read() == "t"
        got = torch.load(os.path.join(final, "zero", "opt", "fp32.pt"), weights_only=False)
        return _sha(got["param"]) == _sha(_t(4))
    if op == "export_dcp":
        if not os.path.exists(case.dest):
            return False
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        md = FileSystemReader(case.dest).read_metadata()
        keys = list(md.state_dict_metadata)
        sd = {k: torch.empty(md.state_dict_metadata[k].size, dtype=md.state_dict_metadata[k].properties.dtype)
              for k in keys if hasattr(md.state_dict_metadata[k], "size")}
        dcp.load(sd, storage_reader=FileSystemReader(case.dest), no_dist=True)
        return any(_sha(v) == _sha(_t(4)) for v in sd.values())
    if op == "export_hf":
        if not os.path.exists(case.dest):
            return False
        from safetensors.torch import load_file

        files = [f for f in os.listdir(case.dest) if f.endswith(".safetensors")]
        sd = {}
        for f in files:
            sd.update(load_file(os.path.join(case.dest, f)))
        return _sha(sd["only1"]) == _sha(_t(2))
    raise ValueError(op)


# --- the checks ---------------------------------------------------------------------------------------

def check(case: Case, point: str, op: str, effect: str, info: dict) -> list[str]:
    from ucp_store import cli
    from ucp_store.errors import ReferenceNotFound

    fails: list[str] = []
    before = info["before"]
    store = case.open()
    removed = set(REMOVED.get(op, [])) if effect == "done" else set()

    def verify_versions(where: str) -> None:
        for ref, tensors in info["expect"].items():
            if ref in removed:
                try:
                    store.resolve(ref)
                    fails.append(f"{where}: {ref} was removed by the op yet still resolves")
                except ReferenceNotFound:
                    pass
                continue
            ck = store.checkpoint(ref)
            problems = ck.verify()
            if problems:
                fails.append(f"{where}: {ref} does not verify: {problems[:2]}")
            got = {f"{i.name}/{i.state}": _sha(ck.read(i.name, i.state)) for i in ck.tensors()}
            if got != tensors:
                fails.append(f"{where}: {ref} does not read back bit-exact")

    for ref in info["expect"]:
        if ref not in removed:
            store.resolve(ref)  # still there right after the kill (verified bit for bit after gc)
    target = OP_TARGET.get(op)
    listed = {f"{c['run']}@{c['step']}" for c in store.list_checkpoints()}
    if target is not None:
        if effect == "none":
            if target in listed:
                fails.append(f"the killed version {target} is listed")
            try:
                store.resolve(target)
                fails.append(f"the killed version {target} resolves")
            except ReferenceNotFound:
                pass
        elif target not in listed or store.checkpoint(target).verify():
            fails.append(f"{target} was committed before the kill but is not listed or does not verify")
    if op.startswith("export") and export_loads(case, op):
        fails.append(f"the killed export left a complete-looking output at {case.dest}")
    if op.startswith("export") and os.path.exists(case.dest) and os.listdir(case.dest) and op != "export_universal":
        fails.append(f"the killed export left {case.dest}")

    old_env = os.environ.get("UCP_CATALOG")
    os.environ["UCP_CATALOG"] = case.catalog
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(["gc", "--json", "--store", case.url])
    finally:
        if old_env is None:
            os.environ.pop("UCP_CATALOG", None)
        else:
            os.environ["UCP_CATALOG"] = old_env
    if rc != 0:
        fails.append(f"ucp gc exited {rc}")
    after = snapshot(store)
    if effect == "none":
        for kind in ("files", "rows"):
            if after[kind] != before[kind]:
                fails.append(f"after gc the {kind} differ from before the op: " + _delta(before[kind], after[kind]))
    else:
        fails += _forward_ok(store, before, after)
    verify_versions("after gc")

    # a rerun of the op succeeds
    try:
        if op in ("rm", "gc") and effect == "done":
            if op == "rm":
                try:
                    store.resolve("base@1")
                    run_op(case, op)
                except ReferenceNotFound:
                    pass  # done already: a second rm names nothing
            else:
                run_op(case, op)
        elif point == "commit.after":
            pass  # committed: rerunning the same step would be a step conflict by design
        else:
            run_op(case, op)
    except Exception as exc:  # noqa: BLE001
        fails.append(f"the rerun failed: {type(exc).__name__}: {exc}")
    else:
        if target is not None and op != "save_fail":
            if store.checkpoint(target).verify():
                fails.append(f"the rerun's {target} does not verify")
        if op.startswith("export") and not export_loads(case, op):
            fails.append("the rerun's export does not load")
    store.gc()
    final = snapshot(store)
    known = _array_paths(store)
    stray = sorted(k for k in final["files"] if k.rsplit(".zarr/", 1)[0] + ".zarr" not in known)
    if stray:
        fails.append(f"files no row knows about after the last gc: {stray[:3]}")
    pending = [c["id"] for c in store.list_checkpoints(include_pending=True) if c["status"] == "pending"]
    if pending:
        fails.append(f"pending versions after the last gc: {pending}")
    return fails


def _array_paths(store) -> set[str]:
    from sqlalchemy import select

    from ucp_store.catalog import models as m

    with store.catalog.session() as s:
        return {p.split("/", 1)[1] for p in s.scalars(select(m.Array.path))}


def _forward_ok(store, before: dict, after: dict) -> list[str]:
    """The op took effect: files are exactly the referenced arrays' files, unchanged; rows no newer."""
    fails = []
    known = _array_paths(store)
    for key, digest in after["files"].items():
        array = key.rsplit(".zarr/", 1)[0] + ".zarr"
        if array not in known:
            fails.append(f"file {key} belongs to no array row after gc")
        elif key in before["files"] and before["files"][key] != digest:
            fails.append(f"file {key} changed")
    for array in known:
        if not any(k.startswith(array + "/") for k in after["files"]):
            fails.append(f"array {array} has a row but no files after gc")
    return fails


def _delta(a: dict, b: dict) -> str:
    gone = sorted(set(a) - set(b))
    new = sorted(set(b) - set(a))
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    return f"gone {gone[:3]}, new {new[:3]}, changed {changed[:3]}"


# --- forking ------------------------------------------------------------------------------------------

def _in_child(fn, *args) -> tuple[int, object]:
    """Run ``fn(*args)`` in a forked child; returns (raw wait status, its JSON result or error text)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            out = json.dumps({"ok": fn(*args)})
        except BaseException:  # noqa: BLE001
            out = json.dumps({"error": traceback.format_exc()[-2000:]})
            code = 1
        with os.fdopen(w, "w") as f:
            f.write(out)
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    return status, (json.loads(text) if text else None)


def _killed_op(case: Case, op: str, point: str) -> None:
    os.environ["UCP_KILL_AT"] = point
    _killpoints.rearm()
    run_op(case, op)


_templates: dict[str, tuple] = {}


def run_case(n: int | str, point: str, op: str, effect: str, args) -> dict:
    case = Case(args.work, n, args.catalog, args.backend)
    result = {"point": point, "op": op, "catalog": "sqlite" if args.catalog == "sqlite" else "postgresql",
              "backend": "folder" if args.backend == "folder" else "s3", "killed": False, "survived": False,
              "failures": []}
    if case.pg_schema:
        from sqlalchemy import create_engine
        from sqlalchemy.pool import NullPool

        eng = create_engine(args.catalog, poolclass=NullPool)
        with eng.begin() as conn:
            conn.exec_driver_sql(f'CREATE SCHEMA "{case.pg_schema}"')
        eng.dispose()
    try:
        if args.catalog == "sqlite" and args.backend == "folder":
            # one setup per op, copied per case (a SQLite catalog and a folder copy exactly)
            if op not in _templates:
                template = Case(args.work, f"_template_{op}", args.catalog, args.backend)
                _templates[op] = (template, _in_child(setup, template, op))
            template, (status, info) = _templates[op]
            shutil.copytree(template.dir, case.dir, dirs_exist_ok=True)
        else:
            status, info = _in_child(setup, case, op)
        if status != 0 or not info or "ok" not in info:
            result["failures"].append(f"setup failed: {info}")
            return result
        status, out = _in_child(_killed_op, case, op, point)
        result["killed"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not result["killed"]:
            result["failures"].append(f"the op was not killed at {point} (status {status}, {out})")
        status, out = _in_child(check, case, point, op, effect, info["ok"])
        if status != 0 or not out or "ok" not in out:
            result["failures"].append(f"checker crashed: {out}")
        else:
            result["failures"] += out["ok"]
        result["survived"] = result["killed"] and not result["failures"]
        return result
    finally:
        if case.pg_schema:
            eng = create_engine(args.catalog, poolclass=NullPool)
            with eng.begin() as conn:
                conn.exec_driver_sql(f'DROP SCHEMA "{case.pg_schema}" CASCADE')
            eng.dispose()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=None)
    ap.add_argument("--catalog", default="sqlite")
    ap.add_argument("--backend", default="folder")
    ap.add_argument("--points", default=None, help="comma-separated points (default: all)")
    ap.add_argument("--combos", default=None,
                    help='JSON [[catalog, backend, [points] or null], ...]: several in one launch (one import)')
    args = ap.parse_args(argv)
    args.work = args.work or tempfile.mkdtemp(prefix="ucp-kill-")
    combos = (json.loads(args.combos) if args.combos
              else [[args.catalog, args.backend, args.points.split(",") if args.points else None]])
    for i, (catalog, backend, points) in enumerate(combos):
        combo = argparse.Namespace(work=args.work, catalog=catalog, backend=backend)
        if backend != "folder":
            import boto3

            os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                               "AWS_REGION": "us-east-1"})
            client = boto3.client("s3", endpoint_url=backend, region_name="us-east-1")
            if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
                client.create_bucket(Bucket=BUCKET)
            del client
        for n, (point, op, effect) in enumerate(CASES):
            if points is not None and point not in points:
                continue
            print(json.dumps(run_case(f"{i}_{n}", point, op, effect, combo)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
