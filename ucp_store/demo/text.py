"""The demo's training text: generated here from a small seeded grammar, so nothing is downloaded.

The demo must train on text a user can read, not on uniform random tokens (whose loss cannot fall), and
it must see the same global batch at a given step on every mesh. `corpus(seed)` builds a few thousand
sentences about checkpoints from fixed word lists with a seeded generator; characters are the tokens
(`VOCAB`, 32 symbols, which fits the model's 64-entry embedding with room to split it over TP ranks).
`batch(cfg, step, ...)` has the contract of `ucp_store.demo.model.batch`: the global batch of a step
depends only on (cfg, seed, step), and data-parallel rank `dp_rank` of `dp` takes its contiguous rows.

`Sampler` is a data-parallel rank's stateful view of that stream (issue 28): its state is the index of its
next sample (``next``), which differs across DP ranks, so ``ucp_store.distributed.save`` stores it per rank. On the
mesh that saved, each rank gets its own position back (the default policy); where DP changes, `resplit` (a
``reshard`` callback) re-splits the saved positions over the new DP ranks so no sample is repeated or skipped;
where only TP changes, ``by-coordinate:dp`` gives ranks of one DP coordinate the same position.
"""

from __future__ import annotations

import functools
import random

import torch

from ucp_store.errors import ConfigurationError

__all__ = ["VOCAB", "Sampler", "batch", "corpus", "decode", "encode", "resplit"]

VOCAB = "\n abcdefghijklmnopqrstuvwxyz.,'-"
_INDEX = {c: i for i, c in enumerate(VOCAB)}

_SUBJECTS = ["the model", "a rank", "every rank", "the optimizer", "the planner", "the catalog", "a worker",
             "the trainer", "the store", "one process", "the new mesh", "the old mesh"]
_VERBS = ["saves", "loads", "reads", "writes", "checks", "shards", "resumes", "plans", "verifies", "keeps"]
_OBJECTS = ["the checkpoint", "its shard", "every chunk", "the weights", "the moments", "a slice",
            "the loss", "the state", "one tensor", "the array", "the step", "the catalog row"]
_ENDS = ["at once", "in order", "without a pickle", "bit for bit", "on a new mesh", "chunk by chunk",
         "after a crash", "in the background", "with a checksum", "from the store"]


@functools.lru_cache(maxsize=4)
def corpus(seed: int = 0, sentences: int = 4000) -> torch.Tensor:
    """The token ids of `sentences` generated sentences (one int64 tensor, deterministic in `seed`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.6:
            words.append(rng.choice(_ENDS))
        out.append(" ".join(words) + (".\n" if rng.random() < 0.3 else ". "))
    return torch.tensor(encode("".join(out)), dtype=torch.int64)


def encode(text: str) -> list[int]:
    """Characters to token ids; a character outside `VOCAB` is an error that names it."""
    try:
        return [_INDEX[c] for c in text]
    except KeyError as exc:
        raise ConfigurationError(f"demo text: character {exc.args[0]!r} is not in the vocabulary {VOCAB!r}") from None


def decode(ids) -> str:
    """Token ids back to characters."""
    return "".join(VOCAB[int(i)] for i in ids)


def batch(cfg, step: int, *, seed: int = 0, dp_rank: int = 0, dp: int = 1,
          device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) of `step` for data-parallel rank `dp_rank` of `dp`: windows of the corpus.

    The window offsets come from a generator seeded by (seed, step), so the same step draws the same
    global batch on any mesh; each dp rank takes `cfg.batch_size // dp` contiguous rows of it.
    """
    if cfg.vocab < len(VOCAB):
        raise ConfigurationError(f"demo text: cfg.vocab={cfg.vocab} is smaller than the {len(VOCAB)} characters")
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ConfigurationError(f"demo text: dp_rank={dp_rank} must lie in [0, dp={dp})")
    if cfg.batch_size % dp:
        raise ConfigurationError(f"demo text: batch_size={cfg.batch_size} must be divisible by dp={dp}")
    ids = corpus(seed)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, ids.numel() - cfg.seq - 1, (cfg.batch_size,), generator=gen)
    per = cfg.batch_size // dp
    rows = torch.stack([ids[s : s + cfg.seq + 1] for s in starts[dp_rank * per : (dp_rank + 1) * per].tolist()])
    rows = rows.to(device)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class Sampler:
    """DP rank `dp_rank` of `dp`'s position in the sample stream: global sample ``i`` is row ``i % batch_size``
    of step ``i // batch_size + 1``'s global batch (`batch`), and the rank reads its ``batch_size // dp`` rows
    of each step. ``state_dict``/``load_state_dict`` carry the position (plain ints: per-rank state)."""

    def __init__(self, cfg, *, seed: int = 0, dp_rank: int = 0, dp: int = 1, next_sample: int = 0):
        if dp < 1 or not 0 <= dp_rank < dp or cfg.batch_size % dp:
            raise ConfigurationError(f"demo sampler: dp_rank={dp_rank} of dp={dp} with batch_size={cfg.batch_size}")
        self.cfg, self.seed, self.dp_rank, self.dp = cfg, seed, dp_rank, dp
        self.next = next_sample

    @property
    def per(self) -> int:
        return self.cfg.batch_size // self.dp

    def step(self) -> int:
        """The train step whose rows this rank reads next."""
        return self.next // self.cfg.batch_size + 1

    def next_batch(self, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next step (what `batch` gives it), then advance to the next step's rows."""
        offset = self.next % self.cfg.batch_size
        if offset != self.dp_rank * self.per:
            raise ConfigurationError(f"demo sampler: position {self.next} is row {offset} of a step, but dp rank "
                                     f"{self.dp_rank} of {self.dp} starts at row {self.dp_rank * self.per}")
        out = batch(self.cfg, self.step(), seed=self.seed, dp_rank=self.dp_rank, dp=self.dp, device=device)
        self.next += self.cfg.batch_size
        return out

    def state_dict(self) -> dict:
        # batch_size is the same on every rank (stored once); next and dp_rank differ (stored per rank)
        return {"next": self.next, "dp_rank": self.dp_rank, "batch_size": self.cfg.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if int(state["dp_rank"]) != self.dp_rank:
            raise ConfigurationError(f"demo sampler: the state of dp rank {state['dp_rank']} loaded on dp rank "
                                     f"{self.dp_rank}")
        self.next = int(state["next"])


def resplit(saved, target) -> dict:
    """``ucp_store.distributed.reshard`` callback: the saved DP ranks' positions re-split over the loading mesh's DP
    ranks. Every saved rank must stand at the same step (at row ``dp_rank * per`` of it), so the samples
    before that step were read exactly once; the new rank starts at its own rows of that step."""
    if not saved:
        raise ConfigurationError("demo sampler: nothing saved to re-split")
    rows = int(saved[0].value["batch_size"])
    starts = {int(s.value["next"]) - int(s.value["next"]) % rows for s in saved}
    if len(starts) != 1:
        raise ConfigurationError(f"demo sampler: saved ranks stand at different steps ({sorted(starts)}); "
                                 "re-splitting would repeat or skip samples")
    dp = target.topology.shape[target.topology.dims.index("dp")] if "dp" in target.topology.dims else 1
    dp_rank = target.coords.get("dp", 0)
    return {"next": starts.pop() + dp_rank * (rows // dp), "dp_rank": dp_rank, "batch_size": rows}
