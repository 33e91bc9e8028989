"""Publish and pull on 2 gloo ranks (issue 39): ``ucp_store.distributed.save(delta="auto")`` stores each version as
deltas of its parent from every rank's own boxes (a keyframe every 3 versions), and a TP=2 puller moves between
versions in place, one step, across a keyframe and backwards, as plain tensors with boxes and as DTensors,
bit-exact, reading exactly the shard indexes and the stored delta chunks of its boxes (harness:
tests/pull_ranks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ucp_test_helpers import REPO


def test_publish_and_pull_on_two_ranks(tmp_path):
    env = {**os.environ, "UCP_PROGRESS": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("UCP_CATALOG", None)
    spec = {"store": str(tmp_path / "store"), "out": str(tmp_path / "out")}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "pull_ranks.py"), json.dumps(spec)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    r0 = ranks[0]
    # what was published: deltas after the first version, a keyframe at 3 (chains of at most 2 deltas)
    enc = r0["encodings"]
    assert all(v == "plain" for v in enc[0].values())
    for step in (1, 2, 4, 5):
        assert enc[step] == {"a": "xor", "c": "xor", "n": "xor"}, (step, enc[step])
    assert all(v == "plain" for v in enc[3].values()), enc[3]
    assert r0["verify"] == [[]] * 6  # every version's reconstruction matches its content hash
    for rank, res in enumerate(ranks):
        # after the first publish each rank keeps its boxes in memory (the next delta's base, no read-back)
        assert res["kept_in_memory"][0] > 0, res["kept_in_memory"]
        for rec in res["pulls"]:
            assert rec["exact"], (rank, rec)
            # the ranks' boxes, digested where they are and merged on rank 0, hash to the version's content hash;
            # column halves of 'c' cut every unit of its hash (rows of 1 KiB), so no rank can vouch for one: None
            assert rec["verified"] == {"a": True, "c": None, "n": True}, (rank, rec["verified"])
            # every rank reports where its time went: the plan it waited for, its reads, the collective verify
            assert {"plan", "prepare", "execute", "decode", "apply", "verify"} <= set(rec["phases"]), rec["phases"]
            assert all(v >= 0 for v in rec["phases"].values()) and rec["phases"]["plan"] > 0
            hop = (rec["have"], rec["want"])
            kinds = set(rec["kinds"].values())
            assert kinds == ({"full"} if hop == (2, 5) else {"delta"}), (rank, hop, rec["kinds"])
            independent = r0["pulls"][res["pulls"].index(rec)]["independent"][rank]
            for k, n in rec["bytes"].items():
                if rec["kinds"][k] == "delta":
                    # exactly the shard indexes and the stored delta chunks within this rank's box
                    assert n == independent[k], (rank, hop, k, n, independent[k])
                    assert rec["delta_bytes"][k] > 0 and n <= rec["delta_bytes"][k] + independent[k]
        assert res["dtensor"]["exact"], (rank, res["dtensor"])
        assert set(res["dtensor"]["kinds"].values()) == {"delta"}
