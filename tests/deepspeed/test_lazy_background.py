"""Issue 31: the DeepSpeed engine's background save overlaps the next forward and backward, gated on the
engine's optimizer step, and an in-place change before that step fails the save (tests/lazy_ds_worker.py)."""

from __future__ import annotations

import json

import pytest

from ucp_test_helpers import REPO, torchrun


@pytest.mark.slow
def test_background_save_is_gated_and_guarded(tmp_path):
    pytest.importorskip("deepspeed")
    from ucp_store import open_store

    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    torchrun([str(REPO / "tests" / "lazy_ds_worker.py"), str(store), str(out)], 2, timeout=600, cwd=tmp_path)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    st = open_store(str(store))
    sync = {(t.name, t.state): t.content_hash for t in st.checkpoint("sync@3").tensors()}
    bg = {(t.name, t.state): t.content_hash for t in st.checkpoint("bg@3").tensors()}
    assert sync == bg and len(sync) > 4  # step 4 ran while the save was in flight; stored = step 3, bit for bit
    for r in results:
        assert r["staged_before_step"] and r["stats"]["step_waits"] >= 1  # the step did wait at the gate
        assert r["bg"] == st.resolve("bg@3")
        assert r["bad"] is not None and "nothing listed" in r["bad"], r
    assert "SnapshotChangedError" in results[1]["bad"] and "changed in place" in results[1]["bad"]
    assert "rank 1" in results[0]["bad"]
    assert "bad" not in [c["run"] for c in st.list_checkpoints(include_pending=True)]
