"""Every DeepSpeed path in one package, with one public face.

- DeepSpeed checkpoint folders in and universal folders out: ``source`` (``import_deepspeed``), ``reader``,
  ``merge``, ``files``, ``moe``, ``autoep``, ``universal`` (``export_universal``); torch only.
- No conversion step: save straight into a ucp store, resume straight from it: ``engine`` (the checkpoint
  engine and ``attach``), ``write`` (what each rank stores), ``load``, ``perrank`` (client state per rank)::

    import ucp_store.deepspeed as ucpds

    engine, *_ = deepspeed.initialize(...)
    ucpds.attach(engine, store="/ckpt/store", run="llama")          # every rank, once
    engine.save_checkpoint()                                          # llama@<global_steps>, no files
    ...
    client_state = ucpds.load(new_engine, "llama@1000", store="/ckpt/store")   # any DP / ZeRO / PP / TP

``attach(..., background=True)`` returns from ``save_checkpoint`` once the state is staged in host memory.
Tensor-parallel engines (ZeRO-1/2, Megatron rank order: pipe3d-style ``PipelineModule`` grids, an mpu, AutoTP)
are saved too; see :mod:`ucp_store.deepspeed.engine` for what stays refused (ZeRO-3 x TP, MoE).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ENGINE_NAME", "UcpCheckpointEngine", "attach", "detach", "engine_topology", "export_universal",
           "import_deepspeed", "load"]

# public name -> the submodule that defines it, imported on first use: reading a DeepSpeed folder needs
# torch but not DeepSpeed, and ``ucp import deepspeed`` should not pay for the engine's imports
_LAZY = {"ENGINE_NAME": "engine", "UcpCheckpointEngine": "engine", "attach": "engine", "detach": "engine",
         "engine_topology": "engine", "load": "load", "import_deepspeed": "source",
         "export_universal": "universal"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
