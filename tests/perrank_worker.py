"""Roles of tests/test_perrank.py's real gloo ranks (run by tests/dist_worker.py with ``"module": "perrank_worker"``).

Each rank holds per-rank RNG states (the global CPU generator and a ``torch.Generator``), a stateful
sampler (``Sampler``, a ``torch.utils.data.Sampler`` with ``state_dict``) read through a ``DataLoader``,
torchtitan-style keys only some ranks hold (``tt.dp_rank_<d>``), a DTensor weight and a replicated step.

- ``save``: TP=2 x DP=2; consume batches, save (and ``async_save``), then record the uninterrupted
  continuation (the next draws of both generators and the next batches);
- ``same``: resume on the same mesh (no policy), record the continuation, verify clean, then one rank
  changes its position and verifies again;
- ``reshard``: resume on DP=4 with ``reshard`` re-splitting the sampler position, read to the end;
- ``nopolicy``: resume on DP=4 without a policy, and without a live key some ranks saved: two errors;
- ``bycoord``: resume on TP=1 x DP=2 with ``by-coordinate`` (dp), record the continuation;
- ``repro``: issue 28's two-rank case.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler

N = 96  # samples in the data set
BATCH = 4
CONSUMED = 3  # batches read before the save
NEXT = 2  # batches compared after it


class PositionSampler(Sampler[int]):
    """One DP rank's share of a fixed permutation from ``start``: ``perm[start:][dp_rank::dp]``, read from
    ``pos``; its state is what a checkpoint must carry for the data order to continue."""

    def __init__(self, dp: int, dp_rank: int, seed: int = 7):
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self.perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed)).tolist()
        self.start, self.pos = 0, 0

    def _mine(self) -> list[int]:
        return self.perm[self.start:][self.dp_rank::self.dp]

    def __iter__(self):
        mine = self._mine()
        while self.pos < len(mine):
            self.pos += 1
            yield mine[self.pos - 1]

    def __len__(self) -> int:
        return len(self._mine()) - self.pos

    def state_dict(self) -> dict:
        return {"dp": self.dp, "dp_rank": self.dp_rank, "start": self.start, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, sd: dict) -> None:
        if (sd["dp"], sd["dp_rank"], sd["seed"]) != (self.dp, self.dp_rank, self.seed):
            raise ValueError(f"sampler state {sd} is not for dp={self.dp} dp_rank={self.dp_rank}")
        self.start, self.pos = sd["start"], sd["pos"]


def resplit(saved, target):
    """``reshard`` callback: every saved DP rank consumed ``pos`` samples of its share of the stream; the
    new DP ranks split what is left, from the first unread sample on."""
    by_dp: dict[int, dict] = {}
    for s in saved:
        first = by_dp.setdefault(s.value["dp_rank"], s.value)
        if s.value != first:
            raise ValueError(f"saved ranks of dp {s.value['dp_rank']} disagree: {s.value} vs {first}")
    states = list(by_dp.values())
    if len({s["pos"] for s in states}) != 1 or len({s["start"] for s in states}) != 1:
        raise ValueError(f"the saved DP ranks read unequal amounts: {states}")
    consumed = sum(s["pos"] for s in states)
    return {"dp": target.topology.shape[target.topology.dims.index("dp")], "dp_rank": target.coords["dp"],
            "start": states[0]["start"] + consumed, "pos": 0, "seed": states[0]["seed"]}


def _mesh(dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1 and dp == dist.get_world_size() and dp == 4:
        return init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _state(mesh, dp: int, dp_rank: int, seed: int) -> tuple[dict, PositionSampler, torch.Generator]:
    """A fresh training state for this rank: RNGs seeded from ``seed``, sampler at 0, DTensor weight."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    torch.manual_seed(seed + rank)
    gen = torch.Generator().manual_seed(seed * 10 + dp_rank)  # equal within a DP rank's TP group
    sampler = PositionSampler(dp, dp_rank)
    placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    w = distribute_tensor(torch.arange(32, dtype=torch.float32).reshape(8, 4) * (seed + 1), mesh, placements)
    sd = {"model": {"w": w}, "step": 3, "rng": {"cpu": torch.get_rng_state(), "gen": gen.get_state()},
          "dataloader": sampler.state_dict(), "tt": {f"dp_rank_{dp_rank}": {"pos": 0}}}
    return sd, sampler, gen


def _continuation(sampler: PositionSampler, gen: torch.Generator, loader_iter=None) -> dict:
    """The next draws of both generators, then the next batches (a new DataLoader iterator draws its base
    seed from the global generator, so the resumed run makes it after the draws)."""
    out = {"cpu": torch.rand(4).tolist(), "gen": torch.rand(4, generator=gen).tolist()}
    it = loader_iter if loader_iter is not None else iter(DataLoader(list(range(N)), batch_size=BATCH,
                                                                     sampler=sampler))
    out["batches"] = [next(it).tolist() for _ in range(NEXT)]
    return out


def _restore(sd: dict, sampler: PositionSampler, gen: torch.Generator) -> None:
    torch.set_rng_state(sd["rng"]["cpu"])
    gen.set_state(sd["rng"]["gen"])
    sampler.load_state_dict(sd["dataloader"])


def role_save(spec, rank):
    import ucp_store.distributed as ucpd

    mesh = _mesh(2, 2)
    dp_rank = rank // 2
    sd, sampler, gen = _state(mesh, 2, dp_rank, seed=1)
    it = iter(DataLoader(list(range(N)), batch_size=BATCH, sampler=sampler))
    consumed = [next(it).tolist() for _ in range(CONSUMED)]
    torch.rand(3)
    torch.rand(5, generator=gen)  # both streams moved on since seeding
    sd["rng"] = {"cpu": torch.get_rng_state(), "gen": gen.get_state()}
    sd["dataloader"] = sampler.state_dict()
    sd["tt"] = {f"dp_rank_{dp_rank}": {"pos": sampler.pos}}
    cid = ucpd.save(sd, store=spec["store"], run="pr", step=1, mesh=mesh, progress=False)
    handle = ucpd.async_save(sd, store=spec["store"], run="pr-async", step=1, mesh=mesh)
    aid = handle.result()
    return {"id": cid, "async_id": aid, "consumed": consumed, "expected": _continuation(sampler, gen, it)}


def role_same(spec, rank):
    import ucp_store.distributed as ucpd

    mesh = _mesh(2, 2)
    dp_rank = rank // 2
    sd, sampler, gen = _state(mesh, 2, dp_rank, seed=5)  # another init: everything must come from the load
    res = ucpd.load(sd, store=spec["store"], ref=spec["ref"], mesh=mesh, progress=False)
    w = sd["model"]["w"].full_tensor().tolist()
    _restore(sd, sampler, gen)
    out = {"got": _continuation(sampler, gen), "tt": copy.deepcopy(sd["tt"]), "per_rank": res.per_rank, "w": w}
    out["clean"] = ucpd.verify(sd, spec["ref"], store=spec["store"], mesh=mesh, progress=False).ok
    if rank == 3:  # one per-rank and one replicated value
        sd["tt"]["dp_rank_1"]["pos"] += 1
        sd["dataloader"]["pos"] += 1
    dirty = ucpd.verify(sd, spec["ref"], store=spec["store"], mesh=mesh, progress=False)
    out["mismatches"] = [m.__dict__ for m in dirty.mismatches]
    return out


def role_reshard(spec, rank):
    import ucp_store.distributed as ucpd

    mesh = _mesh(4, 1)
    sd, sampler, gen = _state(mesh, 4, rank, seed=9)
    res = ucpd.load(sd, store=spec["store"], ref=spec["ref"], mesh=mesh, progress=False,
                    per_rank={"dataloader": ucpd.reshard(resplit), "rng.*": "fresh", "tt": "fresh"})
    sampler.load_state_dict(sd["dataloader"])
    rest = [b.tolist() for b in DataLoader(list(range(N)), batch_size=BATCH, sampler=sampler)]
    return {"rest": rest, "state": sd["dataloader"], "per_rank": res.per_rank,
            "w": sd["model"]["w"].full_tensor().tolist()}


def role_nopolicy(spec, rank):
    import ucp_store.distributed as ucpd

    out = {}
    mesh = _mesh(4, 1)
    for case in ("no_policy", "dropped"):
        sd, _, _ = _state(mesh, 4, rank, seed=9)
        policies = None
        if case == "dropped":  # the live state lacks the saved tt.dp_rank_<d> keys: they would be lost
            del sd["tt"]
            policies = {"dataloader": ucpd.reshard(resplit), "rng.*": "fresh"}
        try:
            ucpd.load(sd, store=spec["store"], ref=spec["ref"], mesh=mesh, progress=False, per_rank=policies)
            out[case] = {"error": None}
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            out[case] = {"error": type(exc).__name__, "message": str(exc)}
    return out


def role_bycoord(spec, rank):
    import ucp_store.distributed as ucpd

    mesh = _mesh(2, 1)
    sd, sampler, gen = _state(mesh, 2, rank, seed=11)
    res = ucpd.load(sd, store=spec["store"], ref=spec["ref"], mesh=mesh, progress=False,
                    per_rank={"dataloader": "by-coordinate:dp", "rng.gen": ucpd.by_coordinate("dp"),
                              "rng.cpu": ucpd.fresh(), "tt.*": "by-coordinate:dp"})
    _restore(sd, sampler, gen)
    report = ucpd.verify(sd, spec["ref"], store=spec["store"], mesh=mesh, progress=False,
                         per_rank={"dataloader": "by-coordinate:dp", "rng.gen": "by-coordinate:dp", "rng.cpu": "fresh",
                                   "tt.*": "by-coordinate:dp"})
    return {"got": _continuation(sampler, gen), "tt": sd["tt"], "per_rank": res.per_rank, "verify": report.ok}


def role_repro(spec, rank):
    import ucp_store.distributed as ucpd

    sd = {"model": {"w": torch.ones(4)}, "rng": torch.full((8,), rank, dtype=torch.uint8),
          "dataloader": {"pos": 100 + rank}}
    ucpd.save(sd, store=spec["store"], run="repro", step=1, progress=False)
    sd2 = {"model": {"w": torch.zeros(4)}, "rng": torch.zeros(8, dtype=torch.uint8), "dataloader": {"pos": -1}}
    ucpd.load(sd2, store=spec["store"], ref="repro@1", progress=False)
    return {"rng": sd2["rng"].tolist(), "pos": sd2["dataloader"]["pos"], "w": sd2["model"]["w"].tolist()}
