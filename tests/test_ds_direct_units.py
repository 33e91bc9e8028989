"""The DeepSpeed engine's building blocks without DeepSpeed (issue 14): the writer hashes ZeRO fragments from
the digests of the content hash's units taken while writing, and the loader reads group buffers straight into
given tensors."""

import pytest
import torch

import ucp_store
from ucp_store import patterns as pat
from ucp_store.io import format as fmt
from ucp_store.io.read import execute
from ucp_store.plan.planner import plan
from ucp_store.topology import Topology

SHAPES = {"big": (384, 1024), "odd": (7, 13), "bias": (1024,)}


def _logical():
    g = torch.Generator().manual_seed(5)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def _write_dp2(store, run, logical, *, tamper=False, open_first=True, on_flush=None):
    """Both DP ranks' ZeRO-1 fragments through one writer, digested, merged as ds_write merges them."""
    topo = Topology(dp=2, zero_stage=1)
    names = list(SHAPES)
    group = pat.zero_group_layout([logical[n].numel() for n in names], 2, 1)
    w = store.begin(run, 1)
    if on_flush is not None:
        on_flush(w)
    # the engine opens every array of a save together before writing (one durable metadata write each)
    if open_first:
        w.open_shards([(n, "fp32", SHAPES[n], torch.float32, None) for n in names], topology=topo)
        with pytest.raises(ucp_store.errors.ShapeMismatch, match=r"'odd'.*declares float64.*open_shards float32"):
            w.write_shard("odd", "fp32", torch.zeros(91, dtype=torch.float64), shape=SHAPES["odd"], pattern=None,
                          topology=topo, rank=0, fragment=group.fragment(1, 0) or group.fragment(1, 1))
    for rank in range(2):
        for i, n in enumerate(names):
            f = group.fragment(i, rank)
            if f is None or f.slot == 0:
                continue
            w.write_shard(n, "fp32", logical[n].reshape(-1)[f.start:f.stop], shape=SHAPES[n], pattern=None,
                          topology=topo, rank=rank, fragment=f, position=i, digest=True)
    digests = w.shard_digests()
    for key, d in digests.items():
        if tamper and key[0] == "big":
            d[next(iter(d))] = b"\0" * 16
        w.set_chunk_digests(key[0], key[1], d)
    return w.commit(), digests


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    store = ucp_store.open_store(str(tmp_path_factory.mktemp("dsu") / "store"), create=True)
    logical = _logical()
    ck, digests = _write_dp2(store, "z", logical)
    return store, ck, logical, digests


def test_fragments_are_hashed_from_their_chunk_digests(saved):
    store, ck, logical, digests = saved
    infos = {t.name: t for t in ck.tensors()}
    # "big" spans several units of the content hash, each written whole by one rank but the one the DP boundary
    # cuts (mid-row)
    n_units = len(fmt.missing_units("float32", SHAPES["big"], {}))
    assert 1 < len(digests[("big", "fp32")]) < n_units  # the cut unit is read back by the origin rank
    for name, t in infos.items():
        # the one scheme of every save path: what a whole-tensor write of the same bits records
        assert t.content_hash == fmt.content_hash(logical[name].numpy()), name
        assert torch.equal(ck.read(name, "fp32"), logical[name])
    assert ck.verify() == []  # every hash recomputed from the stored bytes matches the one recorded


def test_a_wrong_digest_is_caught_by_verify(saved):
    store, _, logical, _ = saved
    ck, _ = _write_dp2(store, "tampered", logical, tamper=True, open_first=False)  # arrays opened one by one
    problems = ck.verify()
    assert problems and {p["tensor"] for p in problems} == {"big"}


def test_execute_reads_group_buffers_into_given_tensors(saved):
    _, ck, logical, _ = saved
    records = ck.plan_records(Topology(dp=2, zero_stage=1), 1)
    p = plan(records, Topology(dp=2, zero_stage=1), 1)
    plain = execute(ck, p, infos=records)
    (key, buf), = plain.buffers.items()
    dest = torch.full_like(buf, float("nan"))  # zeroed first: padding must not keep old values
    got = execute(ck, p, infos=records, into={key: dest})
    assert got.buffers[key].data_ptr() == dest.data_ptr()
    assert torch.equal(dest, buf)
    with pytest.raises(ucp_store.errors.UcpError, match=r"buffer .*float64.*plan needs torch.float32"):
        execute(ck, p, infos=records, into={key: dest.double()})
    # with ``only``, buffers of other states are not even allocated
    assert execute(ck, p, infos=records, only=[]).buffers == {}


def test_zero3_tp_and_moe_engines_are_refused_with_the_reason():
    from types import SimpleNamespace

    from ucp_store.deepspeed.engine import engine_topology
    from ucp_store.errors import ConfigurationError

    base = {"module": SimpleNamespace(), "zero_optimization": lambda: True, "zero_optimization_stage": lambda: 2,
            "dp_world_size": 2}
    # TP with ZeRO-1/2 is saved (tests/deepspeed/test_direct_tp.py); ZeRO-3 x TP is not
    assert engine_topology(SimpleNamespace(**base, mp_world_size=2, has_moe_layers=False))["tp"] == 2
    z3 = {**base, "zero_optimization_stage": lambda: 3}
    with pytest.raises(ConfigurationError, match=r"ZeRO-3 with tensor parallelism \(tp=2\).*ucp import deepspeed"):
        engine_topology(SimpleNamespace(**z3, mp_world_size=2, has_moe_layers=False))
    with pytest.raises(ConfigurationError, match=r"MoE engines .*ucp import deepspeed"):
        engine_topology(SimpleNamespace(**base, mp_world_size=1, has_moe_layers=True))
    assert engine_topology(SimpleNamespace(**base, mp_world_size=1, has_moe_layers=False))["dp"] == 2


def test_step_scalars_keep_their_parameters_pipeline_placement():
    # the optimizer step of a pipeline parameter is loaded by the stage that owns the parameter: its 0-d array
    # carries the parameter's placement (no layout), both in `ucp import deepspeed` and in the direct engine
    from ucp_store.deepspeed.merge import ParamRecord, with_placement

    states = {"fp32": torch.zeros(4), "step": torch.tensor(3.0)}
    piped = ParamRecord("2.weight", states, pattern=with_placement(None, {"layer": 2}))
    assert piped.pattern_for("fp32") == {"kind": "replicated", "placement": {"layer": 2}}
    assert piped.pattern_for("step") == {"kind": "replicated", "placement": {"layer": 2}}
    tied = ParamRecord("embed.weight", states, pattern={"kind": "partitioned", "dim": 0, "tp": 2,
                                                        "placement": {"stages": ["first", "last"]}})
    assert tied.pattern_for("step") == {"kind": "replicated", "placement": {"stages": ["first", "last"]}}
    assert ParamRecord("w", states).pattern_for("step") is None  # no pipeline: still no pattern
    # the planner places it like its parameter: only the stage holding layer 2 loads the step
    topo = Topology(pp=2, layers=4, zero_stage=1)
    rec = {"name": "2.weight", "state": "step", "shape": [], "dtype": "float32", "chunk_shape": [],
           "pattern": piped.pattern_for("step")}
    loads = {r: [t.name for t in plan([rec], topo, r).tensors] for r in range(topo.world_size)}
    assert loads == {r: ["2.weight"] if topo.coords(r)["pp"] == topo.stage_of_layer(2) else []
                     for r in range(topo.world_size)}


def test_deferred_durability_fsyncs_every_file_and_folder_before_any_row(tmp_path, monkeypatch):
    # the engine's writer skips TensorStore's fsync per file and makes all it wrote durable in one parallel
    # pass in flush(), before recording rows: every file and folder of the version's arrays is fsynced by then
    import os

    from ucp_store.catalog import models as m

    store = ucp_store.open_store(str(tmp_path / "store"), create=True)
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    seen_at_rows: list[set] = []
    from ucp_store.io import localwrite

    local_files: list[str] = []
    real_submit = localwrite.submit
    monkeypatch.setattr(localwrite, "submit", lambda fn, folder, *a: (local_files.append(folder),
                                                                       real_submit(fn, folder, *a))[1])

    def arm(w):
        assert w.defer_durability() and w.durability.array_context() is store.unsynced_context
        real_insert = type(w)._insert_rows

        def insert_rows(s, rows, lost, self=w):  # the one place rows are recorded (flush's and commit's txn)
            if any(isinstance(r, (m.Array, m.Tensor)) or (isinstance(r, dict) and r["_table"] != "object")
                   for r in rows):
                seen_at_rows.append(set(synced))
            real_insert(self, s, rows, lost)
        w._insert_rows = insert_rows

    ck, _ = _write_dp2(store, "d", _logical(), on_flush=arm)
    assert seen_at_rows
    top = os.path.join(store.location.root, "arrays", ck.id)
    written = {top, os.path.dirname(top)}
    for folder, _, files in os.walk(top):
        written.add(folder)
        written.update(os.path.join(folder, f) for f in files)
    assert len(written) > 3 * len(SHAPES)  # zarr.json and shard files of every array, and their folders
    assert written <= seen_at_rows[0]  # durable before the first row that names them
    assert ck.verify() == []
    assert local_files  # whole shards went the local write path (and verify read them back above)
    # the write pool digested the chunks of the shard files it wrote: the same digests as the main thread's
    # (a writer without deferred durability goes through TensorStore and digests in write_shard)
    _, digests_main = _write_dp2(store, "main-thread-digests", _logical())
    _, digests_pool = _write_dp2(store, "pool-digests", _logical(), on_flush=lambda w: w.defer_durability())
    assert digests_pool == digests_main and all(digests_main.values())
    # open_shards wrote each zarr.json itself: the very bytes TensorStore writes when it creates the array
    import tensorstore as ts

    jsons = [os.path.join(f, "zarr.json") for f, _, files in os.walk(top) if "zarr.json" in files]
    assert len(jsons) == len(SHAPES)
    for path in jsons:
        raw = open(path, "rb").read()
        meta = fmt.read_metadata(store.location, os.path.relpath(os.path.dirname(path), store.location.root))
        layout = fmt.ArrayLayout(meta["data_type"], tuple(meta["shape"]),
                                 tuple(meta["codecs"][0]["configuration"]["chunk_shape"]),
                                 tuple(meta["chunk_grid"]["configuration"]["chunk_shape"]), "none")
        ref = tmp_path / "ref" / os.path.basename(os.path.dirname(path))
        ts.open(fmt.array_spec(ucp_store.io.location.Location.parse(str(ref)), "", layout), create=True).result()
        assert raw == (ref / "zarr.json").read_bytes()
    # the arrays were written through a context without TensorStore's own fsync per file (the pass replaces it)
    assert store.unsynced_context.spec.to_json()["file_io_sync"] is False
    assert store.context.spec.to_json().get("file_io_sync", True) is True


def test_background_staging_keeps_shapes_as_torch_size():
    # DeepSpeed's param_shapes hold torch.Size values; the background mode's staged copy must keep them, or the
    # stored model-state objects encode them as plain tuples and differ from `ucp import deepspeed` of the files
    from collections import OrderedDict

    from ucp_store import safe_pickle as sp
    from ucp_store.deepspeed.engine import _Stager

    sd = {"param_shapes": [OrderedDict([("w", torch.Size([2, 3]))])], "pair": (1, 2), "t": torch.arange(4.0)}
    staged = _Stager(workers=1).stage(sd)
    assert type(staged["param_shapes"][0]["w"]) is torch.Size and staged["pair"] == (1, 2)
    assert sp.to_jsonable(staged["param_shapes"]) == sp.to_jsonable(sd["param_shapes"])
    assert torch.equal(staged["t"], sd["t"]) and staged["t"].data_ptr() != sd["t"].data_ptr()
