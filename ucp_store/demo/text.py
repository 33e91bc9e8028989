"""The demo's training text: generated here from a small seeded grammar, so nothing is downloaded.

The demo must train on text a user can read, not on uniform random tokens (whose loss cannot fall), and
it must see the same global batch at a given step on every mesh. `corpus(seed)` builds a few thousand
sentences about checkpoints from fixed word lists with a seeded generator; characters are the tokens
(`VOCAB`, 32 symbols, which fits the model's 64-entry embedding with room to split it over TP ranks).
`batch(cfg, step, ...)` has the contract of `ucp_store.demo.model.batch`: the global batch of a step
depends only on (cfg, seed, step), and data-parallel rank `dp_rank` of `dp` takes its contiguous rows.
"""

from __future__ import annotations

import functools
import random

import torch

from ..errors import ConfigurationError

__all__ = ["VOCAB", "batch", "corpus", "decode", "encode"]

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
