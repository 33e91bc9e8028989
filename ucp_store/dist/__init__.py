"""ucp_store.dist: save, load, verify and async-save DTensor / FSDP2 / TP training state from every rank.

Mirrors ``torch.distributed.checkpoint``: switch by changing one import::

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import ucp_store.dist as ucpd

    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    ucpd.save(sd, store="ckpts", run="gpt", step=100)          # every rank
    ucpd.load(sd, store="ckpts", ref="gpt@latest")             # any mesh, in place
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert ucpd.verify(sd, "gpt@latest", store="ckpts").ok

Each rank writes only the boxes of its shards (replicas once) into one logical array per tensor-state,
and on load reads only the chunks its own shards need, whatever mesh saved them.
"""

from .api import (
           STATE_DICT_OBJECT,
           LoadResult,
           Mismatch,
           VerifyReport,
           load,
           save,
           verify,
)
from .asyncsave import AsyncSaveHandle, async_save, close, prepare_async, wait
from .checkpointer import Checkpointer

__all__ = ["STATE_DICT_OBJECT", "AsyncSaveHandle", "Checkpointer", "LoadResult", "Mismatch", "VerifyReport",
           "async_save", "close", "load", "prepare_async", "save", "verify", "wait"]
