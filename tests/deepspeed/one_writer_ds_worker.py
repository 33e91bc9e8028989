"""One rank of tests/deepspeed/test_one_writer_ds.py (under torchrun, CPU, gloo, 4 ranks): ZeRO saves whose flat
fragments cut parameters mid-row (the ``mlp`` model's odd sizes over dp=4), through the DeepSpeed engine
(``attach``) and through a multi-rank ``ucp import deepspeed`` of DeepSpeed's own files (what torchrun runs), with
``localwrite.record_writes`` on. Writes ``<out>/rank<r>.json``: per case and path, the array objects this rank
wrote, the version id, and what the one-writer exchange moved (``distributed.commit.EXCHANGES``).

    torchrun --nproc_per_node=4 tests/deepspeed/one_writer_ds_worker.py SPEC.json
"""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str) -> int:
    import deepspeed
    import deepspeed.comm as dist
    import torch

    import ucp_store.deepspeed as ucpds
    from ucp_store.deepspeed import source
    from ucp_store.demo import ds_train
    from ucp_store.distributed.commit import EXCHANGES
    from ucp_store.io import localwrite

    with open(spec_path) as f:
        spec = json.load(f)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out: dict = {}
    for zero in spec["zero"]:
        job = {"model": "mlp", "zero": zero, "dtype": "fp32"}
        engine, dp_rank, dp, micro, gas = ds_train.make_engine(job)
        ds_train.train_steps(engine, job, 0, 2, dp_rank, dp, micro, gas)
        files = os.path.join(spec["files"], f"z{zero}")
        engine.save_checkpoint(files, tag="files")  # DeepSpeed's own files, for the imports
        case: dict = {}
        for path in ("engine", "import"):
            before = dict(EXCHANGES)
            log = localwrite.record_writes(rank)
            assert log is not None
            if path == "engine":
                ce = ucpds.attach(engine, store=spec["store"], run=f"direct{zero}", progress=False)
                engine.save_checkpoint()
                case_id = ce.last_id
                ucpds.detach(engine)
            else:
                source.main([spec["store"], os.path.join(files, "files"), "--run", f"imported{zero}"])
                case_id = None
            written = sorted(log.entries)
            localwrite.record_writes(None)
            case[path] = {"written": written, "id": case_id,
                          "moved": {k: EXCHANGES[k] - before[k] for k in EXCHANGES}}
        out[str(zero)] = case
        dist.barrier()
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)
    dist.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
