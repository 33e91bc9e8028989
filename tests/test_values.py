"""Non-tensor values come back exactly as they went in: through ``Store.save`` / ``Checkpoint.objects`` (on
SQLite and, with UCP_TEST_POSTGRES_URL, PostgreSQL), ``ucp import torch``, ``ucp import dcp`` / ``ucp export
dcp`` and the DTensor state dict API. Exactly means type and sign too: ``1.0`` is not ``1``, ``-0.0`` is not
``0.0``, ``2**64 - 1`` stays an integer. Names that two entries would share are refused, never merged.

Property tests (hypothesis) with small example counts: the DCP path writes and reads folders, so it runs
fewer examples.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ucp_store
from ucp_store.errors import SourceFormatError, ValidationError
from ucp_store.formats.torch_file import import_torch_file

from ucp_test_helpers import store_on

_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                         HealthCheck.data_too_large])


def same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down, floats by sign and NaN-ness, dicts in the same key order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return a == b


def test_same_tells_types_and_signs_apart():
    assert same([1.0, -0.0, {"a": math.nan}], [1.0, -0.0, {"a": math.nan}])
    assert not same(1.0, 1) and not same(-0.0, 0.0) and not same(True, 1) and not same({"a": 1, "b": 2},
                                                                                       {"b": 2, "a": 1})


# --------------------------------------------------------------------------------------------- strategies
_BIG = st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 2**64 - 1, 2**64, -(2**64), 10**30, -(10**40)])
_FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e16, 2.0**64,
                                                                            5e-324, 0.1])
_SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**200), max_value=2**200) | _BIG
            | _FLOATS | st.text(max_size=12)
            | st.text(st.sampled_from("\x00\x01\x7f\u00e9e\u0301\u200f\ufeff\uffff\U0001d518\U0010fffd"), max_size=6))
#: keys that make valid object names when a path flattens them into one (torch, DCP): no '.', '/', control
#: characters or other spellings of one name
_NAME_KEYS = st.text(st.sampled_from("abcxyz019_-\u00e9\u00df\u4e2d\U0001d518"), min_size=1, max_size=5)


def _json(keys: st.SearchStrategy[str], max_leaves: int = 12, min_dict: int = 0) -> st.SearchStrategy[Any]:
    return st.recursive(_SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(keys, c, min_size=min_dict,
                                                                                      max_size=4),
                        max_leaves=max_leaves)


def _deep(depth: int) -> Any:
    value: Any = -0.0
    for i in range(depth):
        value = [value, 1.0] if i % 2 else {"k": value, "n": 2**64}
    return value


# --------------------------------------------------------------------------------------------- Store.save
_EXAMPLES = [1.0, -0.0, 2**64 - 1, 2**63, -(2**64), math.nan, math.inf, -math.inf, 1e16, "a\x00b", "",
             [1, 1.0, -0.0, True, None], {"\x00": {"": [{}]}, "1": 1}, _deep(40)]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request, tmp_path):
    with store_on(request.param, tmp_path / "s") as st:
        yield st


def test_scalars_keep_their_type_and_sign(store):
    objects = {f"o{i}": v for i, v in enumerate(_EXAMPLES)}
    store.save("r", 1, {"w": torch.zeros(2)}, objects=objects)
    got = store.checkpoint("r@1").objects()
    for name, value in objects.items():
        assert same(got[name], value), (name, value, got[name])
    shown = store.checkpoint("r@1").manifest()["objects"]  # `ucp show --json` reads the same column
    assert same(shown["o0"]["value"], 1.0) and same(shown["o2"]["value"], 2**64 - 1)


_steps = itertools.count(1)


@settings(max_examples=30, **_SETTINGS)
@given(value=_json(st.text(max_size=6)))
@example(value=_deep(60))
@example(value=1.0)
@example(value=-0.0)
@example(value=2**64 - 1)
@example(value=[math.inf, "\x00"])
def test_any_json_value_round_trips_through_save(store, value):
    step = next(_steps)
    store.save("r", step, {"w": torch.zeros(1)}, objects={"v": value, "wrapped": {"x": [value]}})
    got = store.checkpoint(f"r@{step}").objects()
    assert same(got["v"], value) and same(got["wrapped"], {"x": [value]})


def test_keys_json_would_merge_are_kept_apart(store):
    """Issue 40.8: ``1`` and ``"1"`` (and tuples, ``True``, ``1.5`` keys) come back as saved, not merged."""
    value = {"a": [{1: "x", "1": "y", 1.5: "z", None: 0, (1, "b"): (2, 3)}], "t": (1, (2.0, "s"))}
    store.save("r", 1, {"w": torch.zeros(1)}, objects={"cfg": value})
    got = store.checkpoint("r@1").objects()["cfg"]
    assert same(got, value) and type(got["t"]) is tuple and type(got["t"][1]) is tuple
    assert list(got["a"][0]) == [1, "1", 1.5, None, (1, "b")]


def test_too_deep_is_a_clear_error(store):
    with pytest.raises(ValidationError, match="object 'deep' is nested too deeply"):
        store.save("r", 1, {"w": torch.zeros(1)}, objects={"deep": _deep(5000)})


# --------------------------------------------------------------------------------------------- import torch
def _flat(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The names ``ucp import torch`` gives: dicts by key, lists holding a dict by index, ``{}`` kept."""
    if isinstance(obj, dict) and (obj or not prefix):
        return [kv for k, v in obj.items() for kv in _flat(v, f"{prefix}{k}.")]
    if isinstance(obj, list) and any(isinstance(v, dict) for v in obj):
        return [kv for i, v in enumerate(obj) for kv in _flat(v, f"{prefix}{i}.")]
    return [(prefix[:-1], obj)]


@settings(max_examples=20, **_SETTINGS)
@given(data=st.dictionaries(_NAME_KEYS, _json(_NAME_KEYS), min_size=1, max_size=4))
@example(data={"lr": 1.0, "neg": -0.0, "big": 2**64 - 1, "cfg": {"empty": {}, "deep": _deep(30)}})
def test_any_json_value_round_trips_through_import_torch(tmp_path, data):
    step = next(_steps)
    path = tmp_path / f"v{step}.pt"
    torch.save({"weight": torch.ones(3), **data}, path)
    st_ = ucp_store.open_store(str(tmp_path / "s"), create=True)
    got = import_torch_file(st_, str(path), "t", step, progress=False).objects()
    want = _flat(data)
    assert sorted(got) == sorted(n for n, _ in want)
    for name, value in want:
        assert same(got[name], value), (name, value, got[name])


def test_import_torch_refuses_names_two_entries_share(tmp_path, capsys):
    from ucp_store import cli

    store = tmp_path / "s"
    ucp_store.open_store(str(store), create=True)
    cases = {"dotted": {"cfg": {"lr": 1.0}, "cfg.lr": 2.0},
             "int_and_str": {"groups": {1: 0.5, "1": 0.25}},
             "tensors": {"a": {"b": torch.ones(1)}, "a.b": torch.zeros(1)}}
    for case, sd in cases.items():
        path = tmp_path / f"{case}.pt"
        torch.save({"w": torch.ones(2), **sd}, path)
        with pytest.raises(SourceFormatError, match=r"flatten to the name '(cfg\.lr|groups\.1|a\.b)'"):
            import_torch_file(ucp_store.open_store(str(store)), str(path), "r", 1, progress=False)
        assert cli.main(["import", "torch", str(path), "--run", "r", "--step", "1", "--store", str(store)]) != 0
        assert "ucp: error:" in capsys.readouterr().err
    assert ucp_store.open_store(str(store)).list_checkpoints() == []
    # inside a value (a list), keys JSON would merge are kept apart, and tuples stay tuples (issue 40.8)
    torch.save({"w": torch.ones(2), "v": [[{1: "a", "1": "b"}]], "betas": (0.9, 0.999)}, tmp_path / "inner.pt")
    got = import_torch_file(ucp_store.open_store(str(store)), str(tmp_path / "inner.pt"), "r", 1,
                            progress=False).objects()
    assert got["v"] == [[{1: "a", "1": "b"}]] and type(got["betas"]) is tuple and got["betas"] == (0.9, 0.999)


# --------------------------------------------------------------------------------------------- DCP
def _dcp_save(folder, sd) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(folder), no_dist=True)


def _dcp_load(folder, sd) -> dict:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    return sd


@settings(max_examples=6, **_SETTINGS)
# no empty dicts: DCP drops them when it saves (its own loader then fails on a list that held one)
@given(data=st.dictionaries(_NAME_KEYS, _json(_NAME_KEYS, max_leaves=8, min_dict=1), min_size=1, max_size=3))
@example(data={"lr": 1.0, "neg": -0.0, "big": 2**64 - 1, "cfg": [{"x": [1.0, -0.0]}, 2**70, math.nan, "\x00"]})
def test_any_json_value_round_trips_through_dcp(tmp_path, data):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._traverse import set_element

    from ucp_store.formats.dcp.adapter import export_dcp, import_dcp
    from ucp_store.safe_pickle import from_jsonable

    step = next(_steps)
    src, out = tmp_path / f"src{step}", tmp_path / f"out{step}"
    sd = {"model": {"w": torch.arange(4.0)}, "extra": data}
    _dcp_save(src, sd)
    flat, mapping = flatten_state_dict(sd)  # DCP's own keys: what the folder holds
    st_ = ucp_store.open_store(str(tmp_path / "s"), create=True)
    ck = import_dcp(st_, str(src), "d", step, progress=False)
    objs = ck.objects()
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            assert same(from_jsonable(objs[key]), value), (key, value, objs[key])
    export_dcp(ck, str(out), progress=False)
    template = copy.deepcopy(sd)  # every value replaced, the containers kept (DCP walks them to find keys)
    for key, value in flat.items():
        set_element(template, mapping[key], torch.zeros_like(value) if isinstance(value, torch.Tensor) else "unset")
    back, _ = flatten_state_dict(_dcp_load(out, template))
    assert list(back) == list(flat)
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(back[key], value)
        else:
            assert same(back[key], value), (key, value, back[key])


# --------------------------------------------------------------------------------------------- DTensor API
def test_dist_state_dict_keeps_colliding_paths_apart(tmp_path):
    """The state dict API stores each value by its path (element types kept), so a ``cfg.lr`` key beside a
    nested ``cfg -> lr`` is two values, both restored exactly."""
    import ucp_store.distributed as ucpd

    sd = {"model": {"w": torch.arange(3.0)}, "cfg": {"lr": 1.0, 2: 2**64 - 1}, "cfg.lr": -0.0, "cfg.2": 1e16}
    ucpd.save(sd, store=tmp_path / "s", run="d", step=1, progress=False)
    fresh = {"model": {"w": torch.zeros(3)}, "cfg": {"lr": 0.5, 2: 0}, "cfg.lr": 0.5, "cfg.2": 0.5}
    ucpd.load(fresh, store=tmp_path / "s", ref="d@1", progress=False)
    assert torch.equal(fresh["model"]["w"], sd["model"]["w"])
    for got, want in ((fresh["cfg"]["lr"], 1.0), (fresh["cfg"][2], 2**64 - 1), (fresh["cfg.lr"], -0.0),
                      (fresh["cfg.2"], 1e16)):
        assert same(got, want), (got, want)

