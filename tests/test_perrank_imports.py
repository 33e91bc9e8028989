"""Issue 28 on the remaining import and DeepSpeed paths: per-rank state is never silently collapsed.

* ``import_source`` over torch.distributed: objects whose content differs across the importing ranks (or
  that only some ranks hold) are stored per rank with the saving topology (``ucp/per_rank``), equal ones once.
* ``ds_load.load(restore_rng=True)``: the per-rank RNG states follow the ``per_rank`` policies (``rng_state``).
* A universal folder's client state: every rank's model-states file is read, differing keys kept per rank.
"""

from __future__ import annotations

import base64
import json

import pytest
import torch

from ucp_store.errors import ConfigurationError


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _rng_objs(tp: int, pp: int, dp: int, ranks=None) -> dict:
    """What the ucp DeepSpeed engine records: one CPU RNG state per saving global rank, and the layout."""
    world = tp * pp * dp
    ranks = range(world) if ranks is None else ranks
    return {"deepspeed/layout": {"tp": tp, "pp": pp, "dp": dp},
            "deepspeed/rng": {"torch_cpu": {str(r): _b64(torch.full((6,), 10 + r, dtype=torch.uint8)) for r in ranks}}}


def test_restore_rng_follows_per_rank_policies():
    from ucp_store.ds_load import rng_state
    from ucp_store.ds_perrank import topology

    objs = _rng_objs(tp=1, pp=1, dp=2)
    saved = topology(tp=1, pp=1, dp=2)
    # the saving topology: each rank its own state, bit for bit
    assert [rng_state(objs, saved, r, None, what="t").tolist() for r in (0, 1)] == [[10] * 6, [11] * 6]
    # another world size: rank 2 has no saved state; without a policy that is an error naming the key and
    # both topologies (it used to skip the restore silently)
    wider = topology(tp=1, pp=1, dp=4)
    with pytest.raises(ConfigurationError, match=r"'rng'.*2 ranks, mesh pp=1 x dp=2 x tp=1.*4 ranks"):
        rng_state(objs, wider, 2, None, what="t")
    # ... and even rank 0, which has a saved state, does not take it without a policy on another topology
    with pytest.raises(ConfigurationError, match=r"'rng'"):
        rng_state(objs, wider, 0, None, what="t")
    assert rng_state(objs, wider, 3, {"rng": "rank0"}, what="t").tolist() == [10] * 6
    assert rng_state(objs, wider, 3, {"rng": "fresh"}, what="t") is None
    by_tp = topology(tp=2, pp=1, dp=2)  # TP added: rank 2 is dp 1
    assert [rng_state(objs, by_tp, r, {"rng": "by-coordinate:dp"}, what="t").tolist()[0]
            for r in range(4)] == [10, 10, 11, 11]

    def mix(states, target):
        return states[target.rank % len(states)].value + 100

    assert rng_state(objs, wider, 3, {"r*": mix}, what="t").tolist() == [111] * 6
    # a rank that saved no state on the same topology: an error, not a skip
    partial = _rng_objs(tp=1, pp=1, dp=2, ranks=[0])
    with pytest.raises(ConfigurationError, match=r"rank 1 did not hold it"):
        rng_state(partial, saved, 1, None, what="t")
    with pytest.raises(ConfigurationError, match=r"no RNG state"):
        rng_state({"deepspeed/layout": {"tp": 1, "pp": 1, "dp": 1}}, saved, 0, None, what="t")
