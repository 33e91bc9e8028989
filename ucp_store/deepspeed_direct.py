"""DeepSpeed without a conversion step: save straight into a ucp store, resume straight from it.

The public face of :mod:`ucp_store.ds_engine` (the checkpoint engine and ``attach``) and
:mod:`ucp_store.ds_load` (``load``)::

    import ucp_store.deepspeed_direct as ucpds

    engine, *_ = deepspeed.initialize(...)
    ucpds.attach(engine, store="/ckpt/store", run="llama")          # every rank, once
    engine.save_checkpoint()                                          # llama@<global_steps>, no files
    ...
    client_state = ucpds.load(new_engine, "llama@1000", store="/ckpt/store")   # any DP / ZeRO / PP / TP

``attach(..., background=True)`` returns from ``save_checkpoint`` once the state is staged in host memory.
Tensor-parallel engines (ZeRO-1/2, Megatron rank order: pipe3d-style ``PipelineModule`` grids, an mpu, AutoTP)
are saved too; see :mod:`ucp_store.ds_engine` for what stays refused (ZeRO-3 x TP, MoE).
"""

# What a save or a load runs is imported here, next to DeepSpeed, and not inside the first save_checkpoint
# or load (the catalog's SQLAlchemy, TensorStore, the planner: seconds on a loaded machine). Only ``import
# ucp_store`` itself stays light; this module needs torch and DeepSpeed anyway.
from . import checkpoint, distributed, ds_write, io, planner, store, writer  # noqa: F401
from .ds_engine import ENGINE_NAME, UcpCheckpointEngine, attach, detach, engine_topology
from .ds_load import load

__all__ = ["ENGINE_NAME", "UcpCheckpointEngine", "attach", "detach", "engine_topology", "load"]
