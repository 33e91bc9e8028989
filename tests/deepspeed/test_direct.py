"""Issue 14: DeepSpeed saves straight into the store and resumes straight from it (real DeepSpeed, gloo).

One module fixture runs three phases of ranks forked by tools/fork_ranks.py (harness tools/ds_direct.py):

1. 2 processes (DP=2, or PP=2 for the pipeline engine): train ZeRO-1/2/3 bf16 and a 2-stage pipeline, save the
   same step twice: to files with DeepSpeed's own engine (+ ``ds_to_universal``), and through the ucp engine;
   plus a background-mode save;
2. 1 process: resume at DP=1 through ``ucp_store.deepspeed.load`` and through DeepSpeed's
   ``load_universal`` of the converted folder (same target engines), also into another ZeRO stage and the
   pipeline checkpoint into a 1-stage pipeline;
3. 4 processes: the same at DP=4;
4. 2 processes: rank 1 dies in the middle of a ucp save.

Checks: every stored array of a direct save is bit-equal (content hash, dtype, shape, pattern) to
``ucp import deepspeed`` of the files of the same step; the loaded optimizer state is bit-equal to
``load_universal``'s on every rank and the next losses are the same; nothing is written to disk by the
ucp engine; a dead rank leaves no listed version.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ucp_test_helpers import tools_on_path, torchrun

# one xdist worker runs the module: its fixture (four torchrun launches, about a minute) would run on each
pytestmark = pytest.mark.xdist_group("ds_direct")

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tools" / "ds_direct.py"
TAG = "global_step3"
UTAG = f"{TAG}_universal"

Z3 = {"model": "mlp", "zero": 3, "dtype": "bf16", "sub_group_size": 10}
SAVES = {
    "z1": {"model": "mlp", "zero": 1, "dtype": "bf16"},
    "z2": {"model": "mlp", "zero": 2, "dtype": "bf16"},
    "z3": Z3,
    "z2fp16": {"model": "mlp", "zero": 2, "dtype": "fp16"},
    "z1fp32": {"model": "mlp", "zero": 1, "dtype": "fp32"},
    "pp2": {"model": "pipe", "stages": 2, "zero": 1, "dtype": "bf16"},  # last: the pipeline engine leaves groups
}
# (saved config, target engine, world size): DP changes (2 -> 1, 2 -> 4), ZeRO-stage changes (1 -> 2, 3 -> 2,
# 2 -> 3), fp16 and fp32 engines and a PP change (2 stages -> 1).
RESUMES = [
    ("z1", {"model": "mlp", "zero": 1, "dtype": "bf16"}, 1),
    ("z3", Z3, 1),
    ("z1", {"model": "mlp", "zero": 2, "dtype": "bf16"}, 1),
    ("z3", {"model": "mlp", "zero": 2, "dtype": "bf16"}, 1),
    ("z2", Z3, 1),
    ("z2fp16", {"model": "mlp", "zero": 2, "dtype": "fp16"}, 1),
    ("z1fp32", {"model": "mlp", "zero": 1, "dtype": "fp32"}, 1),
    ("pp2", {"model": "pipe", "stages": 1, "zero": 1, "dtype": "bf16"}, 1),
    ("z2", {"model": "mlp", "zero": 2, "dtype": "bf16"}, 4),
]


def _cross(name, target) -> bool:
    """A switch between ZeRO-3 and ZeRO-1/2. DeepSpeed's load_universal cannot do it: a ZeRO-3 target globs
    zero_pp_rank_*_model_states.pt, and ds_to_universal of a ZeRO-1/2 save has only mp_rank_*_model_states.pt
    (and the other way round). The reference is then the ds_to_universal folder of the same checkpoint itself:
    every parameter's fp32 master and moments, as the loaded engine's own safe_get_full_* accessors return them."""
    return (SAVES[name]["zero"] == 3) != (target["zero"] == 3)


def _key(name, target, world) -> str:
    return f"{name}_to_z{target['zero']}_{target['model']}_dp{world}"


def _launch(jobs: list[dict], nproc: int, where: Path, name: str, *, check: bool = True) -> subprocess.CompletedProcess:
    path = where / f"{name}.json"
    path.write_text(json.dumps(jobs, indent=1))
    cwd = where / f"cwd_{name}"
    cwd.mkdir()
    proc = torchrun([str(DRIVER), "--jobs", str(path)], nproc, timeout=1200, cwd=cwd, check=check)
    return proc


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("dsdirect")
    store = str(root / "store")
    jobs = []
    for name, cfg in SAVES.items():
        if name == "pp2":  # the background save before the pipeline engine; training goes on right after the
            # call, and the staging is held back so that the next optimizer step has to wait for it
            jobs.append({"kind": "save", **SAVES["z2"], "steps": 3, "store": store, "run": "z2bg", "background": True,
                         "next_steps": 2, "stage_delay_s": 0.5, "out": str(root / "save_z2bg.json")})
        # z1: durability="background": save_checkpoint returns once the bytes are written; the next two steps run
        # while a thread makes them durable and commits (the bit-equality test below then covers that path)
        jobs.append({"kind": "save", **cfg, "steps": 3, "save_dir": str(root / name), "tag": TAG, "convert": True,
                     "store": store, "run": name, "next_steps": 2, "out": str(root / f"save_{name}.json"),
                     **({"durability": "background"} if name == "z1" else {})})
    phases = [{"ranks": 2, "jobs": jobs, "harness": "ds_direct"}]
    for world in (1, 4):
        jobs = []
        for name, target, w in RESUMES:
            if w != world:
                continue
            key = _key(name, target, world)
            jobs.append({"kind": "resume_direct", **target, "store": store, "ref": f"{name}@3", "steps": 2,
                         "out": str(root / f"direct_{key}.json"), "state_prefix": str(root / f"direct_{key}"),
                         "param_states_out": str(root / f"params_{key}.pt")})
            if not _cross(name, target):
                jobs.append({"kind": "resume_ds", **target, "load_dir": str(root / name), "tag": UTAG, "steps": 2,
                             "out": str(root / f"ds_{key}.json"), "state_prefix": str(root / f"ds_{key}")})
        phases.append({"ranks": world, "jobs": jobs, "harness": "ds_direct"})
    # every rank forked from one interpreter that imported torch and DeepSpeed once (tools/fork_ranks.py), the
    # launch folder (the ranks' working directory) holding nothing else
    tools_on_path()
    from fork_ranks import launch

    (root / "launch").mkdir()
    try:
        launch(phases, root / "launch", 1200)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    return root


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SAVES))
def test_direct_save_is_bit_equal_to_import_of_the_files(direct, name):
    import torch

    from ucp_store import open_store
    from ucp_store.deepspeed.source import import_deepspeed

    imported = open_store(str(direct / f"imported_{name}"), create=True)
    import_deepspeed(imported, str(direct / name / TAG), name, progress=False)
    a = open_store(str(direct / "store")).checkpoint(f"{name}@3")
    b = imported.checkpoint(f"{name}@3")
    ta = {(t.name, t.state): t for t in a.tensors()}
    tb = {(t.name, t.state): t for t in b.tensors()}
    assert set(ta) == set(tb)
    assert len(ta) >= 4 * 4  # every parameter's fp32, exp_avg, exp_avg_sq and step at least
    schemes = set()
    for key in ta:
        x, y = ta[key], tb[key]
        assert (x.dtype, tuple(x.shape), x.pattern) == (y.dtype, tuple(y.shape), y.pattern), key
        # the bytes of every array (the tensors are tiny)
        assert a.read(*key).view(-1).view(torch.uint8).equal(b.read(*key).view(-1).view(torch.uint8)), key
        # one content-hash scheme for every save path (issue 30 item 10): the engine hashes its sharded arrays
        # from the unit digests it took while writing, the importer from whole tensors, and they agree
        schemes.add(x.content_hash.split(":")[0])
        assert x.content_hash == y.content_hash, key
    assert schemes == {"xxh3-128-tiles"}
    from ucp_store.registry.checkpoint import diff

    assert {r["status"] for r in diff(a, b)} == {"same"}
    # every array the engine wrote carries the zarr.json TensorStore itself would have written (the engine writes
    # it directly) and opens from it alone
    from ucp_store.io import format as fmt

    sa = open_store(str(direct / "store"))
    for x in ta.values():
        layout = fmt.ArrayLayout.from_catalog(x.dtype, x.shape, x.chunk_shape, x.shard_shape, x.codecs)
        assert (direct / "store" / x.array / "zarr.json").read_bytes() == fmt.zarr_json(layout), x.array
        assert fmt.metadata_mismatch(sa.location, x.array, layout, sa.context) is None
    if name == "pp2":  # every optimizer step scalar sits on its parameter's pipeline stage, as the parameter does
        steps = [k for k in ta if k[1] == "step"]
        assert steps and all(ta[k].pattern is not None and ta[k].pattern == ta[(k[0], "fp32")].pattern
                             and "placement" in ta[k].pattern for k in steps), [ta[k].pattern for k in steps]
    # those hashes name the stored bytes: verify recomputes every one of them from the arrays
    assert a.verify() == []
    oa, ob = a.objects(), b.objects()
    assert set(ob) <= set(oa)
    assert {"deepspeed/rng", "deepspeed/direct"} <= set(oa)
    for k in ob:
        if k in ("deepspeed/layout",):
            assert {**oa[k], "import_seconds": 0} == {**ob[k], "import_seconds": 0}
        else:
            assert oa[k] == ob[k], k


@pytest.mark.slow
def test_durability_in_background_commits_the_saved_step(direct):
    # z1 was saved with durability="background" and trained on at once: the version is step 3's state (bit-equal
    # to the files, test above), listed once the thread made it durable and committed it, and the call returned
    # before that
    from ucp_store import open_store

    res = _json(direct / "save_z1.json")
    assert res["version"] == open_store(str(direct / "store")).resolve("z1@3")
    st = res["ucp_stats"]
    assert 0 < st["returned_s"] < st["durable_committed_s"] and st["commit_s"] > st["objects_s"]
    assert len(res["losses"]) == 2  # the next steps ran before wait()


@pytest.mark.slow
def test_ucp_engine_writes_no_files(direct):
    # save_checkpoint through the ucp engine defaults save_dir to "ucp-store:<run>": nothing may appear there,
    # nor a 'latest' file or DeepSpeed's recovery script in the launch folder
    assert [p.name for p in (direct / "launch").iterdir()] == ["phases.json"]
    assert not list(direct.rglob("ucp-store:*"))
    # the background save had no file save beside it: its run left no folder
    assert not (direct / "z2bg").exists()


@pytest.mark.slow
def test_background_save_equals_the_synchronous_one(direct):
    from ucp_store import open_store

    store = open_store(str(direct / "store"))
    a = {(t.name, t.state): t.content_hash for t in store.checkpoint("z2@3").tensors()}
    b = {(t.name, t.state): t.content_hash for t in store.checkpoint("z2bg@3").tensors()}
    assert a == b  # same chunk layout and bytes: same hashes, so the background save deduplicated every array
    sync, bg = _json(direct / "save_z2.json"), _json(direct / "save_z2bg.json")
    # training after the background save sees the same state: the staged copy, not live tensors, was written
    assert sync["losses_hex"] == bg["losses_hex"]
    assert bg["version"] == store.resolve("z2bg@3")
    # the optimizer step right after save_checkpoint did wait for the staging (else the stored state would be
    # torn: the hashes above would be those of the next step's parameters and moments)
    assert bg["ucp_stats"]["step_waits"] >= 1
    assert bg["ucp_stats"]["staged_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name,target,world", [r for r in RESUMES if r[0] != "pp2" and r[2] == 1],
                         ids=[_key(*r) for r in RESUMES if r[0] != "pp2" and r[2] == 1])
def test_loaded_state_equals_the_ds_to_universal_folder(direct, name, target, world):
    import torch

    key = _key(name, target, world)
    got = torch.load(direct / f"params_{key}.pt", weights_only=True)
    zero = direct / name / UTAG / "zero"
    names = sorted({k.rsplit(".", 1)[0] for k in got})
    # every trainable parameter (the folder also holds the frozen one)
    assert len(names) == 6 and set(names) <= {p.name for p in zero.iterdir() if p.is_dir()}
    for k, t in got.items():
        pname, state = k.rsplit(".", 1)
        ref = torch.load(zero / pname / f"{state}.pt", weights_only=True)
        if isinstance(ref, dict):
            ref = ref["param"]
        else:  # ds_to_universal of a ZeRO-3 save writes the bare flat tensor
            ref = ref.detach().reshape(t.shape)
        assert t.dtype == ref.dtype == torch.float32 and t.shape == ref.shape, k
        assert torch.equal(t, ref), k
    if _cross(name, target):
        # no load_universal to compare the losses with; the resumed run continues the saved one (another
        # ZeRO stage reduces in another order, so not bit for bit)
        ours, cont = _json(direct / f"direct_{key}.json"), _json(direct / f"save_{name}.json")["losses"]
        assert ours["global_steps"] == 3
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(ours["losses"], cont)), (ours["losses"], cont)


@pytest.mark.slow
@pytest.mark.parametrize("name,target,world", [r for r in RESUMES if not _cross(r[0], r[1])],
                         ids=[_key(*r) for r in RESUMES if not _cross(r[0], r[1])])
def test_load_equals_deepspeed_load_universal(direct, name, target, world):
    import torch

    key = _key(name, target, world)
    ours, theirs = _json(direct / f"direct_{key}.json"), _json(direct / f"ds_{key}.json")
    assert ours["global_steps"] == theirs["global_steps"] == 3
    assert ours["lr"] == theirs["lr"]
    if target["zero"] == 3:
        # DeepSpeed's ZeRO-3 universal load empties the inner optimizer's param lists (stage3.py,
        # load_hp_checkpoint_state_from_checkpoint_dir_stage3: param_group['params'] = []), so from the second
        # step on its run drifts from the uninterrupted one; ours must stay at least as close to it
        assert ours["losses_hex"][0] == theirs["losses_hex"][0]
        cont = _json(direct / f"save_{name}.json")["losses"][1]
        assert abs(float.fromhex(ours["losses_hex"][1]) - cont) <= abs(float.fromhex(theirs["losses_hex"][1]) - cont)
    else:
        assert ours["losses_hex"] == theirs["losses_hex"]
    for r in range(world):
        a = torch.load(direct / f"direct_{key}_rank{r}.pt", weights_only=True)
        b = torch.load(direct / f"ds_{key}_rank{r}.pt", weights_only=True)
        assert sorted(a) == sorted(b)
        assert any(k.endswith(".exp_avg") for k in a)
        for k in a:
            if k.endswith(".step"):
                assert float(a[k]) == float(b[k]) == 3.0, k
                continue
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), (r, k)


@pytest.mark.slow
def test_a_rank_killed_mid_save_leaves_no_listed_version(direct):
    from ucp_store import open_store

    store = str(direct / "store")
    job = {"kind": "save", **SAVES["z1"], "steps": 1, "store": store, "run": "killed", "kill_rank": 1,
           "timeout_s": 60, "out": str(direct / "save_killed.json")}
    proc = _launch([job], 2, direct, "killed", check=False)
    assert proc.returncode != 0
    s = open_store(store)
    assert "killed" not in {r["run"] for r in s.runs()} or s.list_checkpoints("killed") == []
    assert all(c["run"] != "killed" for c in s.list_checkpoints())
