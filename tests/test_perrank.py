"""Per-rank state in ucp_store.distributed (issue 28): detected by content at save, stored per rank with its
coordinates, restored by a declared policy on load.

Pure parts (``ucp_store.distributed.rankstate``, ``perrank.decide``) are property-tested; the rest runs on real
gloo ranks (tests/perrank_worker.py through tests/dist_worker.py): per-rank RNG states and a stateful
sampler saved on TP=2 x DP=2, resumed on the same mesh, on DP=4 with ``reshard``, on TP=1 x DP=2 with
``by-coordinate``, and without a policy; and the issue's two-rank case.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ucp_store
import ucp_store.distributed as ucpd
from ucp_store.distributed import perrank
from ucp_store.distributed.rankstate import (
    PerRankKey,
    PerRankManifest,
    RankTopology,
    by_coordinate,
    choose_source,
    parse_policy,
    policy_for,
    unit_of,
)
from ucp_store.errors import ConfigurationError, TopologyError

from ucp_test_helpers import REPO, run_python


# ----------------------------------------------------------------------------------------- pure
@st.composite
def topologies(draw, max_dims: int = 3):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=max_dims)))
    world = 1
    for s in shape:
        world *= s
    mesh = tuple(draw(st.permutations(range(world))))
    dims = tuple(f"d{i}" for i in range(len(shape)))
    return RankTopology.from_mesh(dims, shape, mesh)


@settings(max_examples=200, deadline=None)
@given(topologies())
def test_coordinates_are_a_bijection(topo):
    seen = set()
    for r in range(topo.world):
        c = topo.coords(r)
        assert all(0 <= c[d] < s for d, s in zip(topo.dims, topo.shape))
        assert topo.rank_at(c) == r
        seen.add(tuple(c[d] for d in topo.dims))
        # row-major: the mesh position of rank r's global rank
        flat = topo.mesh.index(topo.global_ranks[r])
        assert flat == sum(c[d] * _stride(topo, i) for i, d in enumerate(topo.dims))
    assert seen == set(itertools.product(*(range(s) for s in topo.shape)))
    assert RankTopology.from_json(json.loads(json.dumps(topo.to_json()))) == topo


def _stride(topo, i):
    n = 1
    for s in topo.shape[i + 1:]:
        n *= s
    return n


def test_topology_refuses_a_mesh_that_does_not_cover_the_ranks():
    with pytest.raises(TopologyError, match="does not cover"):
        RankTopology(4, (0, 1, 2, 3), ("dp",), (2,), (0, 1))
    with pytest.raises(TopologyError, match="distinct"):
        RankTopology(2, (0, 0))
    assert RankTopology.from_mesh(("dp", "tp"), (2, 2), (0, 1, 2, 3)).describe() == "4 ranks, mesh dp=2 x tp=2"
    assert RankTopology.flat(2).describe() == "2 ranks, no mesh"


_DIGEST = st.sampled_from([b"a", b"b", b"c"])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5).flatmap(lambda w: st.lists(
    st.dictionaries(st.sampled_from(["x", "y", "z"]), st.tuples(st.sampled_from(["tensor", "value"]), _DIGEST)),
    min_size=w, max_size=w)))
def test_decide_stores_each_distinct_content_once_and_every_holder_finds_it(ranks):
    world = len(ranks)
    everyone = [[((k,), kind, d) for k, (kind, d) in held.items()] for held in ranks]
    topo = RankTopology.flat(world)
    decisions = [perrank.decide(everyone, topo, r) for r in range(world)]
    first = decisions[0]
    assert all(d.manifest == first.manifest and d.replicated == first.replicated for d in decisions)
    keys = {k for held in ranks for k in held}
    for k in keys:
        holders = {r: held[k] for r, held in enumerate(ranks) if k in held}
        if len(holders) == world and len(set(holders.values())) == 1:
            assert (k,) in first.replicated and (k,) not in first.index
            continue
        key = first.manifest.keys[first.index[(k,)]]
        assert [e.rank for e in key.entries] == sorted(holders)  # every holder, no one else
        for e in key.entries:  # equal contents share one object, owned by their lowest holder
            same = [r for r in holders if holders[r] == holders[e.rank]]
            assert e.object == key.entry(min(same)).object and e.kind == holders[e.rank][0]
        assert len({e.object for e in key.entries}) == len(set(holders.values()))
    written = [name for d in decisions for name, _ in d.writes]
    assert sorted(written) == sorted({e.object for k in first.manifest.keys for e in k.entries})  # once each
    assert PerRankManifest.from_json(json.loads(json.dumps(first.manifest.to_json()))) == first.manifest


def _key(saved, contents):
    """A per-rank key every saved rank holds, rank r with content ``contents(r)``."""
    everyone = [[(("k",), "value", contents(r))] for r in range(saved.world)] + [[]]  # one more rank lacks it
    d = perrank.decide(everyone, saved, 0)
    return PerRankKey(("k",), d.manifest.keys[0].entries)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))
def test_by_coordinate_gives_each_rank_its_dp_coordinate(dp, tp_saved, tp_live):
    saved = RankTopology.from_mesh(("dp", "tp"), (dp, tp_saved), range(dp * tp_saved))
    live = RankTopology.from_mesh(("dp", "tp"), (dp, tp_live), range(dp * tp_live))
    key = _key(saved, lambda r: bytes([saved.coords(r)["dp"]]))  # equal within a DP rank's TP group
    for r in range(live.world):
        src = choose_source(by_coordinate("dp"), key, saved, live, r)
        assert saved.coords(src)["dp"] == live.coords(r)["dp"]
    # contents that differ within a DP group: refined by tp when its size is unchanged, else refused
    per_rank = _key(saved, lambda r: bytes([r]))
    for r in range(live.world):
        if tp_saved == tp_live:
            assert saved.coords(choose_source(by_coordinate("dp"), per_rank, saved, live, r)) == live.coords(r)
        elif tp_saved > 1:
            with pytest.raises(ConfigurationError, match="hold different states"):
                choose_source(by_coordinate("dp"), per_rank, saved, live, r)


def test_policies_and_their_errors():
    saved = RankTopology.from_mesh(("dp", "tp"), (2, 2), range(4))
    live = RankTopology.from_mesh(("dp",), (4,), range(4))
    key = _key(saved, lambda r: bytes([r]))
    with pytest.raises(ConfigurationError, match=r"saved on 4 ranks, mesh dp=2 x tp=2, loading on 4 ranks, mesh dp=4"):
        choose_source(parse_policy("same"), key, saved, live, 0)
    assert choose_source(parse_policy("same"), key, saved, saved, 3) == 3
    assert choose_source(parse_policy("rank0"), key, saved, live, 3) == 0
    with pytest.raises(ConfigurationError, match="no saved rank has rank 2's coordinates"):
        choose_source(parse_policy("by-coordinate:dp"), _key(saved, lambda r: bytes([r // 2])), saved, live, 2)
    with pytest.raises(ConfigurationError, match=r"dim\(s\) \['pp'\]"):
        choose_source(by_coordinate("pp"), key, saved, live, 0)
    assert parse_policy("by-coordinate:dp, pp").dims == ("dp", "pp")
    assert parse_policy(len).kind == "reshard"
    for bad in ("by-coordinate", "rank1", 3):
        with pytest.raises(ConfigurationError, match="per_rank policy"):
            parse_policy(bad)


def test_policy_patterns_pick_the_highest_matching_node():
    assert unit_of(("dataloader", "pos"), ["dataloader"]) == (0, ("dataloader",))
    assert unit_of(("dataloader", "pos"), ["dataloader.*"]) == (0, ("dataloader", "pos"))
    assert unit_of(("dataloader", "pos"), ["data*"]) == (0, ("dataloader",))
    assert unit_of(("tt", "dp_rank_3", "pos"), ["rng", "tt.dp_rank_*"]) == (1, ("tt", "dp_rank_3"))
    assert unit_of(("optim", "state"), ["rng"]) is None
    found = policy_for(("rng", "cpu"), {"rng.*": parse_policy("fresh"), "rng": parse_policy("rank0")})
    assert found is not None and found[0] == "rng.*" and found[1].kind == "fresh"  # the first pattern wins


# ----------------------------------------------------------------------------------------- one process
def test_one_process_records_the_topology_and_refuses_bad_policies(tmp_path):
    sd = {"w": torch.arange(6.0), "rng": torch.get_rng_state(), "lr": 0.1}
    ucpd.save(sd, store=tmp_path / "s", run="r", step=1, progress=False)
    ck = ucp_store.open_store(str(tmp_path / "s")).checkpoint("r@1")
    manifest = ck.objects()[ucpd.STATE_DICT_OBJECT]
    assert manifest["format"] == 2 and manifest["per_rank"] == {"topology": RankTopology.flat(1).to_json(), "keys": []}
    assert ck.manifest()["provenance"]["extra"]["dist"]["per_rank_keys"] == []
    sd2 = {"w": torch.zeros(6), "rng": torch.zeros_like(sd["rng"]), "lr": 0.0}
    res = ucpd.load(sd2, store=tmp_path / "s", ref="r@1", progress=False, per_rank={"rng": "rank0"})
    assert torch.equal(sd2["rng"], sd["rng"]) and sd2["lr"] == 0.1 and res.per_rank == []
    with pytest.raises(ConfigurationError, match=r"per_rank\['rng'\] 'first'"):
        ucpd.load(sd2, store=tmp_path / "s", ref="r@1", progress=False, per_rank={"rng": "first"})
    # fresh leaves a key as the caller built it, replicated or not
    sd3 = {"w": torch.zeros(6), "rng": torch.zeros_like(sd["rng"]), "lr": 0.0}
    res = ucpd.load(sd3, store=tmp_path / "s", ref="r@1", progress=False, per_rank={"rng": ucpd.fresh()})
    assert not sd3["rng"].any() and torch.equal(sd3["w"], sd["w"]) and res.per_rank == ["rng: fresh (left as built)"]


# ----------------------------------------------------------------------------------------- real gloo ranks
def _launch(tmp_path, name, world, jobs, timeout=300):
    out = tmp_path / name
    spec = {"world": world, "module": "perrank_worker", "jobs": jobs, "store": str(tmp_path / "store"),
            "out": str(out), "timeout": timeout - 30}
    proc = run_python([str(REPO / "tests" / "dist_worker.py"), json.dumps(spec)], timeout=timeout,
                      UCP_DIST_TIMEOUT="60")
    results = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else None for r in range(world)]
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in results:
        assert r is not None and "crash" not in r, (r or {}).get("crash", proc.stderr[-3000:])
    return [r["jobs"] for r in results]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One launch of 4 ranks (save on TP=2 x DP=2, resume same mesh, DP=4 reshard, no policy) and one of 2
    (TP=1 x DP=2 by-coordinate, the issue's case)."""
    base = tmp_path_factory.mktemp("perrank")
    four = _launch(base, "four", 4, [{"role": "save"}, {"role": "same", "ref": "pr@1"},
                                     {"role": "reshard", "ref": "pr@1"}, {"role": "nopolicy", "ref": "pr@1"}])
    two = _launch(base, "two", 2, [{"role": "bycoord", "ref": "pr@1"}, {"role": "repro"}])
    return base, four, two


@pytest.mark.slow
def test_same_mesh_resume_is_the_uninterrupted_run(ranks):
    _, four, _ = ranks
    for r, (save, same, _, _) in enumerate(four):
        assert same["got"] == save["expected"], r  # both RNG streams and the next batches, bit for bit
        assert same["tt"] == {f"dp_rank_{r // 2}": {"pos": 12}}  # a key only some ranks held
        assert same["w"] == (torch.arange(32.0).reshape(8, 4) * 2).tolist()
        assert same["clean"], r
        assert [(m["name"], m["rank"]) for m in same["mismatches"]] == [("tt.dp_rank_1.pos", 3), ("dataloader.pos", 3)]
    # the ranks drew different numbers and read different data: nothing was collapsed to rank 0's
    assert len({json.dumps(s["expected"]["cpu"]) for s, *_ in four}) == 4
    assert four[0][0]["expected"]["batches"] != four[2][0]["expected"]["batches"]


@pytest.mark.slow
def test_catalog_records_per_rank_keys_and_topology(ranks):
    base, four, _ = ranks
    st_ = ucp_store.open_store(str(base / "store"))
    ck = st_.checkpoint("pr@1")
    manifest = perrank.read_entries(ck, [ucpd.STATE_DICT_OBJECT])[ucpd.STATE_DICT_OBJECT]
    pr = PerRankManifest.from_json(manifest["per_rank"])
    assert pr.topology.describe() == "4 ranks, mesh dp=2 x tp=2"
    assert [k.text for k in pr.keys] == ["dataloader.dp_rank", "rng.cpu", "rng.gen", "tt.dp_rank_0.pos",
                                         "tt.dp_rank_1.pos"]
    by_text = {k.text: k for k in pr.keys}
    # equal contents stored once: the generator is shared by a DP rank's TP ranks, the dp-local keys likewise
    assert len({e.object for e in by_text["rng.gen"].entries}) == 2
    assert len({e.object for e in by_text["rng.cpu"].entries}) == 4
    assert [e.rank for e in by_text["tt.dp_rank_1.pos"].entries] == [2, 3]
    # replicated leaves stay replicated; the DTensor is one array
    assert {"path": ["step"], "value": 3} in manifest["leaves"]
    assert {"path": ["dataloader", "pos"], "value": 12} in manifest["leaves"]
    assert [i.name for i in ck.tensors()] == ["w"]
    assert ck.manifest()["provenance"]["extra"]["dist"]["topology"]["dims"] == ["dp", "tp"]
    # async_save stores the same thing
    other = perrank.read_entries(st_.checkpoint("pr-async@1"), [ucpd.STATE_DICT_OBJECT])[ucpd.STATE_DICT_OBJECT]
    assert other["per_rank"] == manifest["per_rank"]
    _cols, rows = st_.query("SELECT r.name, o.name, o.kind, o.value, a.content_hash FROM objects o LEFT JOIN arrays "
                            "a ON a.id = o.array_id JOIN checkpoints c ON c.id = o.checkpoint_id JOIN runs r ON "
                            "r.id = c.run_id WHERE o.name LIKE 'dist.state_dict/%' ORDER BY o.name")
    objs = {run: [tuple(r[1:]) for r in rows if r[0] == run] for run in ("pr", "pr-async")}
    # one object per distinct content: dataloader.dp_rank 2, rng.cpu 4, rng.gen 2, tt.dp_rank_<d>.pos 1 each
    assert objs["pr"] == objs["pr-async"] and len(objs["pr"]) == 10


@pytest.mark.slow
def test_dp4_reshard_reads_every_sample_once(ranks):
    _, four, _ = ranks
    before = four[0][0]["consumed"] + four[2][0]["consumed"]  # DP ranks 0 and 1 (TP rank 0 of each)
    after = [i for r in range(4) for b in four[r][2]["rest"] for i in b]
    seen = [i for b in before for i in b] + after
    assert sorted(seen) == list(range(96))  # no sample repeated or skipped
    for r in range(4):
        assert four[r][2]["state"]["start"] == 24 and four[r][2]["state"]["dp"] == 4
        assert four[r][2]["w"] == (torch.arange(32.0).reshape(8, 4) * 2).tolist()


@pytest.mark.slow
def test_no_policy_is_a_clear_error(ranks):
    _, four, _ = ranks
    for r in range(4):
        no, dropped = four[r][3]["no_policy"], four[r][3]["dropped"]
        assert no["error"] == "ConfigurationError", no
        for part in ("4 ranks, mesh dp=2 x tp=2", "4 ranks, mesh dp=4", "rng.cpu", "dataloader.dp_rank", "per_rank="):
            assert part in no["message"], (part, no["message"])
        assert dropped["error"] == "ConfigurationError" and "tt.dp_rank_0.pos" in dropped["message"] \
            and "loaded by no rank" in dropped["message"], dropped


@pytest.mark.slow
def test_tp1_dp2_by_coordinate_keeps_the_data_order(ranks):
    _, four, two = ranks
    for d in range(2):
        got, expected = two[d][0]["got"], four[2 * d][0]["expected"]
        assert got["batches"] == expected["batches"]  # DP rank d reads on where DP rank d stopped
        assert got["gen"] == expected["gen"]  # the generator shared by DP rank d's TP ranks
        assert two[d][0]["tt"] == {f"dp_rank_{d}": {"pos": 12}}
        assert two[d][0]["verify"]


@pytest.mark.slow
def test_issue_two_rank_case_does_not_collapse(ranks):
    _, _, two = ranks
    for r in range(2):
        assert two[r][1] == {"rng": [r] * 8, "pos": 100 + r, "w": [1.0] * 4}
