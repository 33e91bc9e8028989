"""Numbers the tensor commands compute and print: ``ucp stats``'s std on inputs where ``E[x^2] - mean^2``
cancels (checked against numpy in float64), complex tensors in ``read --json`` and ``diff`` (both parts
count), and every ``--json`` output is strict JSON (NaN/Infinity as strings).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ucp_store.registry.checkpoint import compute_stats, diff


def strict(text: str):
    """``json.loads`` that refuses the NaN/Infinity tokens Python's json would accept."""
    def refuse(token):
        raise ValueError(f"bare {token} in --json output: not JSON")

    return json.loads(text, parse_constant=refuse)


# --------------------------------------------------------------------------------------------- stats
def _hard_inputs() -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(7)
    return {
        # mean 1e8 against a spread of 1e-3: E[x^2] - mean^2 was 15x too high
        "f64_offset": torch.from_numpy(1e8 + rng.standard_normal(200_000) * 1e-3),
        "f64_negative_offset": torch.from_numpy(-3e9 + rng.standard_normal((400, 300)) * 1e-2),
        "f32_offset": torch.from_numpy((1e4 + rng.standard_normal((300, 500))).astype(np.float32)),
        "f32_large_offset": torch.from_numpy((3e6 + rng.standard_normal((256, 700)) * 4).astype(np.float32)),
        "bf16_offset": (torch.from_numpy(rng.standard_normal((400, 300))).float() * 0.1 + 8).to(torch.bfloat16),
        "i64_offset": torch.from_numpy(rng.integers(2**40, 2**40 + 10, size=(300, 100))),
    }


def _f64(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().astype(np.float64)


@pytest.fixture(scope="module")
def hard(tmp_path_factory):
    import ucp_store

    tensors = _hard_inputs()
    store = ucp_store.open_store(str(tmp_path_factory.mktemp("hard") / "s"), create=True,
                                 chunk_target_bytes=128 * 1024)
    store.save("h", 1, tensors)
    return store, tensors


@pytest.mark.parametrize("name", list(_hard_inputs()))
@pytest.mark.parametrize("slab_bytes", [64 * 1024, 64 << 20])  # several slabs (combined), or one
def test_stats_std_matches_numpy_in_float64(hard, name, slab_bytes):
    store, tensors = hard
    handle = store.checkpoint("h@1").tensor(name, "weight")
    if slab_bytes < handle.info.nbytes:
        assert sum(1 for _ in handle.slabs(slab_bytes)) >= 4  # the per-slab results are combined
    s = compute_stats(handle, slab_bytes=slab_bytes)
    x = _f64(tensors[name])
    # numpy's own mean rounds its sum near 2**53 (the int64 case); on shifted data it is exact enough
    assert s.std == pytest.approx(np.std(x - x.flat[0]), rel=1e-9, abs=0)
    assert s.std == pytest.approx(np.std(x), rel=1e-6, abs=0)
    assert s.mean == pytest.approx(np.mean(x), rel=1e-12, abs=0)
    assert (s.min, s.max) == (x.min(), x.max())
    assert s.norm == pytest.approx(np.linalg.norm(x), rel=1e-9)


def test_stats_cli_std_on_a_large_mean(hard, ucp):
    store, tensors = hard
    rc, out, _ = ucp("stats", "h@1", "f64_offset", "--json", "--store", store.location.root)
    (s,) = strict(out)
    assert rc == 0 and s["std"] == pytest.approx(np.std(_f64(tensors["f64_offset"])), rel=1e-7)


def test_stats_with_nan_and_inf_keeps_the_stable_std(store):
    x = 5e7 + torch.arange(1000, dtype=torch.float64) * 1e-4
    x[3], x[500], x[999] = float("nan"), float("inf"), float("-inf")
    store.save("s", 1, {"x": x})
    s = store.checkpoint("s@1").stats("x")[0]
    fin = x.numpy()[np.isfinite(x.numpy())]
    assert (s.nan, s.inf) == (1, 2)
    assert s.std == pytest.approx(np.std(fin), rel=1e-7)


# --------------------------------------------------------------------------------------------- complex
def test_read_json_prints_both_parts_of_complex(store, store_path, ucp):
    z = torch.tensor([[1 + 2j, -3.5 - 0.25j], [0 + 1e-3j, 4 + 0j]], dtype=torch.complex64)
    store.save("c", 1, {"z": z, "z128": z.to(torch.complex128) * 1j, "s": torch.tensor(2 - 1j)})
    rc, out, _ = ucp("read", "c@1", "z", "--json", "--store", store_path)
    doc = strict(out)
    assert rc == 0 and doc["shape"] == [2, 2] and doc["dtype"] == "complex64"
    assert doc["values"] == [[[1.0, 2.0], [-3.5, -0.25]], [[0.0, pytest.approx(1e-3)], [4.0, 0.0]]]
    rc, out, _ = ucp("read", "c@1", "z128", "--slice", "0", "--json", "--store", store_path)
    assert strict(out)["values"] == [[-2.0, 1.0], [0.25, -3.5]]
    rc, out, _ = ucp("read", "c@1", "s", "--json", "--store", store_path)
    assert strict(out)["values"] == [2.0, -1.0]
    rc, out, _ = ucp("read", "c@1", "z", "--store", store_path)  # text: numpy prints complex values whole
    assert rc == 0 and out.count("j") == 4 and "-3.5" in out


def test_diff_counts_the_imaginary_part(store, store_path, ucp):
    a = torch.complex(torch.arange(1.0, 7.0), torch.zeros(6))
    b = a + 1j * torch.full((6,), 0.5)  # the real part is unchanged
    store.save("c", 1, {"z": a, "w": a.to(torch.complex128)})
    store.save("c", 2, {"z": b, "w": a.to(torch.complex128) * (1 + 1j)})
    rows = {r["name"]: r for r in diff(store.checkpoint("c@1"), store.checkpoint("c@2"))}
    an, bn = a.numpy().astype(np.complex128), b.numpy().astype(np.complex128)
    want = np.linalg.norm(bn - an) / np.linalg.norm(an)
    assert rows["z"]["status"] == "changed" and rows["z"]["relative_change"] == pytest.approx(want, rel=1e-12)
    assert rows["w"]["relative_change"] == pytest.approx(1.0, rel=1e-12)  # |z * (1+1j) - z| = |z|
    rc, out, _ = ucp("diff", "c@1", "c@2", "--json", "--store", store_path)
    assert rc == 0 and {r["name"]: r["relative_change"] for r in strict(out)} == pytest.approx(
        {"z": want, "w": 1.0}, rel=1e-12)


# --------------------------------------------------------------------------------------------- strict JSON
def test_every_json_output_is_strict_json(store, store_path, ucp):
    """NaN, Infinity and -Infinity print as the strings "NaN", "Infinity", "-Infinity" everywhere."""
    nan, inf = float("nan"), float("inf")
    x, big = torch.tensor([nan, inf, -inf, 1.5]), torch.tensor([1e300, -1e300], dtype=torch.float64)
    store.save("j", 1, {"x": x, "big": big, "y": torch.ones(3)},
               objects={"cfg": {"lr": nan, "clip": inf, "floor": -inf, "ok": 1.0}})
    store.save("j", 2, {"x": x, "big": big, "y": torch.tensor([1.0, inf, 1.0])})
    outputs = {}
    for argv in (["read", "j@1", "x"], ["stats", "j@1"], ["diff", "j@1", "j@2", "--all"], ["show", "j@1"],
                 ["query", "SELECT 9e999 AS up, -9e999 AS down"], ["ls", "j"], ["verify", "j@1"]):
        rc, out, err = ucp(*argv, "--json", "--store", store_path)
        assert rc == 0, (argv, err)
        outputs[argv[0]] = strict(out)
    assert outputs["read"]["values"] == ["NaN", "Infinity", "-Infinity", 1.5]
    stats = {s["name"]: s for s in outputs["stats"]}
    assert (stats["big"]["norm"], stats["big"]["std"]) == ("Infinity", "Infinity")  # squares overflow float64
    assert stats["x"]["mean"] == 1.5
    assert {r["name"]: r["relative_change"] for r in outputs["diff"]} == {"x": 0.0, "big": 0.0, "y": "Infinity"}
    assert outputs["show"]["objects"]["cfg"]["value"] == {"lr": "NaN", "clip": "Infinity", "floor": "-Infinity",
                                                          "ok": 1.0}
    assert outputs["query"] == [{"up": "Infinity", "down": "-Infinity"}]
