"""torchrun worker of tests/deepspeed/test_lazy_background.py: the DeepSpeed engine's background save, gated.

Run as ``torchrun --nproc_per_node=2 tests/lazy_ds_worker.py STORE OUT``. ZeRO-2 bf16 (CPU, gloo): train 3
steps; save step 3 synchronously (run ``sync``) and in background mode (run ``bg``) with the staging held
back until step 4's forward and backward are done, so step 4's optimizer step waits at the gate; train on;
then a background save (run ``bad``) during which rank 1 changes a module parameter in place before the
step: every rank's ``wait()`` must raise and nothing be listed. Writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading


def main() -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch
    import torch.nn.functional as F

    import ucp_store.deepspeed as ucpds
    from ucp_store.demo import ds_train

    deepspeed.init_distributed(dist_backend="gloo")
    store, out = sys.argv[1], sys.argv[2]
    job = {"model": "mlp", "zero": 2, "dtype": "bf16"}
    engine, dp_rank, dp, micro, gas = ds_train.make_engine(job)
    rank = dist.get_rank()
    ds_train.train_steps(engine, job, 0, 3, dp_rank, dp, micro, gas)
    ucpds.attach(engine, store=store, run="sync", progress=False, timeout_s=60)
    engine.save_checkpoint()
    ucpds.detach(engine)

    def held_save(run: str):
        ce = ucpds.attach(engine, store=store, run=run, background=True, progress=False, timeout_s=60)
        ev = threading.Event()
        ce._before_stage = ev.wait
        engine.save_checkpoint()
        return ce, ev

    ce, ev = held_save("bg")
    x, y = ds_train.global_batch(3, engine.module.din, engine.module.dout, 7)
    lo = dp_rank * micro
    loss = F.mse_loss(engine(x[lo:lo + micro].to(torch.bfloat16)).float(), y[lo:lo + micro])
    engine.backward(loss)  # forward and backward of step 4 while nothing is staged yet
    staged_before_step = not ce._released.is_set()
    ev.set()
    engine.step()  # gated: waits for the staging
    later = ds_train.train_steps(engine, job, 4, 2, dp_rank, dp, micro, gas)
    result = {"bg": ce.wait(), "staged_before_step": staged_before_step, "stats": dict(ce.stats), "later": later}
    ucpds.detach(engine)

    ce, ev = held_save("bad")
    if rank == 1:
        with torch.no_grad():
            next(engine.module.parameters()).add_(1.0)
    ev.set()
    try:
        ce.wait()
        result["bad"] = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        cause = exc.__cause__ or exc
        result["bad"] = f"{type(exc).__name__}: {exc} <- {type(cause).__name__}: {cause}"
    ucpds.detach(engine)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
