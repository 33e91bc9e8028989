#!/usr/bin/env python
"""Manual check (issue 14, TP): save real DeepSpeed engines through the ucp engine and to files on the same step,
``ucp import deepspeed`` the files, and compare every tensor-state (bytes, dtype, shape, pattern) and object.

    TORCH_EXTENSIONS_DIR=/tmp/te python tools/ds_direct_tp_check.py OUT NPROC 'CONFIGS_JSON'

``CONFIGS_JSON``: a list of ``tools/ds_direct.py`` save-job settings (``model``, ``tp``, ``stages``, ``zero``,
``dtype``, ``hidden``, ``blocks``, ``average_norms``; ``extra``: more job keys such as ``perturb``), each saved by
NPROC ranks forked by ``tools/fork_ranks.py``. E.g. AutoTP at TP=2 with ZeRO-1 and ZeRO-2::

    python tools/ds_direct_tp_check.py /tmp/tpcheck 2 '[{"model":"tp","tp":2,"zero":1},{"model":"tp","tp":2,"zero":2}]'

Prints one line per configuration (``bad``: the tensor-states that differ, ``badobj``: the objects) and exits 1
if any differs. The CI test is tests/deepspeed/test_direct_tp.py; this covers meshes too costly for it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    root, nproc, cfgs = Path(args[0]), int(args[1]), json.loads(args[2])
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    phases: list = []
    for i, cfg in enumerate(cfgs):
        name = f"c{i}"
        extra = cfg.pop("extra", {})
        job = {"kind": "save", "dtype": "bf16", **cfg, "steps": 3, "save_dir": str(root / name), "tag": "global_step3",
               "store": str(root / "store"), "run": name, "out": str(root / f"{name}.json"), **extra}
        phases.append({"ranks": nproc, "harness": "tools.ds_direct", "jobs": [job]})
        phases.append({"ucp": ["import", "deepspeed", str(root / name / "global_step3"), "--run", name, "--store",
                               str(root / "imported"), "--no-progress"]})
    from fork_ranks import launch  # tools/ is this script's folder

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    print("wall times (s):", launch(phases, root, 900, env=env))
    import torch

    from ucp_store import open_store

    failed = False
    for i, cfg in enumerate(cfgs):
        name = f"c{i}"
        a = open_store(str(root / "store")).checkpoint(f"{name}@3")
        b = open_store(str(root / "imported")).checkpoint(f"{name}@3")
        ta = {(t.name, t.state): t for t in a.tensors()}
        tb = {(t.name, t.state): t for t in b.tensors()}
        bad = sorted(set(ta) ^ set(tb))
        bad += [k for k in sorted(set(ta) & set(tb))
                if (ta[k].dtype, tuple(ta[k].shape), ta[k].pattern) != (tb[k].dtype, tuple(tb[k].shape), tb[k].pattern)
                or not a.read(*k).view(-1).view(torch.uint8).equal(b.read(*k).view(-1).view(torch.uint8))]
        oa, ob = a.objects(), b.objects()
        badobj = [k for k in ob if k != "deepspeed/layout" and oa.get(k) != ob[k]]
        failed |= bool(bad or badobj)
        print(name, json.dumps(cfg), "topology", a.provenance["source_topology"], "tensor-states", len(ta), "bad",
              bad[:5], "badobj", badobj, "verify", a.verify())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
