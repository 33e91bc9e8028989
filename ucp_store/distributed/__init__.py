"""ucp_store.distributed: save, load, verify and async-save DTensor / FSDP2 / TP training state from every rank.

Mirrors ``torch.distributed.checkpoint``: switch by changing one import::

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import ucp_store.distributed as ucpd

    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    ucpd.save(sd, store="ckpts", run="gpt", step=100)          # every rank
    ucpd.load(sd, store="ckpts", ref="gpt@latest")             # any mesh, in place
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert ucpd.verify(sd, "gpt@latest", store="ckpts").ok

Each rank writes only the boxes of its shards (replicas once) into one logical array per tensor-state,
and on load reads only the chunks its own shards need, whatever mesh saved them.

State that differs across ranks (RNG states, dataloader positions) is detected by content and stored per
rank with its mesh coordinates; ``load`` gives each rank its own on the saving mesh, and follows a declared
policy on another (``per_rank={"dataloader*": "by-coordinate:dp", "rng": ucpd.reshard(fn)}``)::

    ucpd.save(sd, store="ckpts", run="gpt", step=100, mesh=mesh)
    ucpd.load(sd, store="ckpts", ref="gpt@latest", mesh=new_mesh, per_rank={"dataloader": "by-coordinate:dp",
                                                                            "rng": "fresh"})
"""

from ucp_store.distributed.asyncsave import async_save, close, prepare_async
from ucp_store.distributed.checkpointer import Checkpointer
from ucp_store.distributed.inflight import AsyncSaveHandle, wait
from ucp_store.distributed.loader import LoadResult, load
from ucp_store.distributed.rankstate import (
    Policy,
    RankTarget,
    RankTopology,
    SavedRankState,
    by_coordinate,
    fresh,
    rank0,
    reshard,
    same,
)
from ucp_store.distributed.saver import save
from ucp_store.distributed.statedict import STATE_DICT_OBJECT
from ucp_store.distributed.verifier import Mismatch, VerifyReport, verify

__all__ = ["STATE_DICT_OBJECT", "AsyncSaveHandle", "Checkpointer", "LoadResult", "Mismatch", "Policy", "RankTarget",
           "RankTopology", "SavedRankState", "VerifyReport", "async_save", "by_coordinate", "close", "fresh", "load",
           "prepare_async", "rank0", "reshard", "same", "save", "verify", "wait"]
