"""DeepSpeed merge rules: how per-rank slices become one logical tensor, and the pattern that says so.

:class:`UniversalInfo` turns a source's ``universal_checkpoint_info`` (Megatron-DeepSpeed regex lists,
AutoTP affine maps) into a :class:`Rule` per parameter; :func:`merge_tp_slices` merges the TP slices of
one state exactly as ``ds_to_universal`` does (bit for bit); :func:`pattern_for` gives the pattern record
(ARCHITECTURE.md) of the merged tensor, built from the pattern classes. :class:`ParamRecord` is what the
DeepSpeed readers yield: one logical parameter with all its states.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.files import (
    K_AFFINE,
    K_AVERAGE,
    K_EXPERT,
    K_ORIG_VOCAB,
    K_PIPE_REPL,
    K_ROW,
    K_SUB,
    K_TP_REPL,
    K_TWO_SUB,
    K_UNSUPPORTED,
    K_VERSION,
    K_VOCAB,
    K_WIDTHS,
    PATTERN_LIST_KEYS,
)
from ucp_store.errors import SourceFormatError
from ucp_store.patterns import Averaged, Fused, Partitioned, Replicated, Vocab

__all__ = ["SCALE_POWER", "ParamRecord", "Rule", "UniversalInfo", "merge_tp_slices", "pattern_for",
           "with_placement"]

SCALE_POWER = {"fp32": 1, "exp_avg": -1, "exp_avg_sq": -2, "weight": 1}


@dataclass
class ParamRecord:
    """One logical tensor of the source: its states, pattern and what a universal export needs."""

    name: str
    states: dict[str, torch.Tensor]
    pattern: dict | None = None
    kind: str = "param"  # "param" (optimizer-owned), "frozen", "buffer"
    shape: tuple[int, ...] = ()
    group: int | None = None  # param group (ZeRO-1/2) or sub-group (ZeRO-3)
    stage: int = 0  # pipeline stage it came from
    meta: dict = field(default_factory=dict)  # keys ds_to_universal writes next to 'param' (JSON form)
    state_patterns: dict[str, dict | None] = field(default_factory=dict)  # per-state override (averaged)
    step_type: str | None = None  # "tensor", "int" or "float": what step.pt held

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.states.values())

    def pattern_for(self, state: str) -> dict | None:
        t = self.states.get(state)
        if t is not None and t.dim() == 0:
            # step: a scalar has no layout, but it lives on its parameter's pipeline stage(s)
            return with_placement(None, (self.pattern or {}).get("placement"))
        return self.state_patterns.get(state, self.pattern)



# ------------------------------------------------------------------------------- universal_checkpoint_info
@dataclass
class Rule:
    kind: str  # "affine", "replicated", "average", "two_sub", "sub_param", "cat"
    cat_dim: int = 0
    vocab: bool = False
    sub: sp.SubparamShape | None = None
    sub_pattern: str | None = None
    affine: dict | None = None
    explicit: bool = False  # a pattern list named it (otherwise: the default / inferred)
    category: str | None = None  # for "affine": the category list that also names it (for the pattern)


class UniversalInfo:
    """``universal_checkpoint_info`` of a source: regex categories -> per-parameter merge rules."""

    def __init__(self, info: dict | None, tp: int, *, allow_experts: bool = False):
        self.raw = info or {}
        self.tp = tp
        self.has_patterns = any(self.raw.get(k) for k in PATTERN_LIST_KEYS) or bool(
            (self.raw.get(K_AFFINE) or {}).get("params"))
        self.version = float(self.raw.get(K_VERSION, 0.0) or 0.0)
        self.unmatched: set[str] = set()
        for k in (K_VOCAB, K_TP_REPL, K_AVERAGE, K_ROW, K_TWO_SUB):
            self.unmatched.update(self.raw.get(k) or [])
        self.subs = [self._subparam(s) for s in (self.raw.get(K_SUB) or [])]
        for s in self.subs:
            self.unmatched.update(s.patterns)
        unsupported = self.raw.get(K_UNSUPPORTED) or {}
        if unsupported:
            raise SourceFormatError(
                "universal_checkpoint_info lists AutoTP parameters whose layout cannot be converted: "
                + ", ".join(f"{p}: {r}" for p, r in sorted(unsupported.items())))
        if self.raw.get(K_EXPERT) and not allow_experts:
            raise SourceFormatError("universal_checkpoint_info lists expert (MoE) parameters "
                                    f"{self.raw.get(K_EXPERT)}; expert-parallel checkpoints are not supported yet")
        affine = self.raw.get(K_AFFINE) or {}
        if int(affine.get("version", 1)) > 1:
            raise SourceFormatError(f"affine_map version {affine.get('version')} is newer than this reader (1)")
        self.affine = affine.get("params") or {}

    @staticmethod
    def _subparam(s) -> sp.SubparamShape:
        if isinstance(s, sp.SubparamShape):
            return s
        if isinstance(s, dict):
            return sp.SubparamShape(patterns=list(s.get("patterns", [])), shape=tuple(s.get("shape", ())),
                                    partition_dim=int(s.get("partition_dim", 0)))
        raise SourceFormatError(f"parameter_with_sub_params entry {s!r} is not a SubparamShape record")

    def _match(self, key: str, name: str) -> str | None:
        hits = [p for p in (self.raw.get(key) or []) if re.match(p, name)]
        if len(hits) > 1:
            raise SourceFormatError(f"parameter {name!r} matches {len(hits)} {key} patterns {hits}; "
                                    "expected at most one")
        if hits:
            self.unmatched.discard(hits[0])
            return hits[0]
        return None

    def pipeline_replicated(self, name: str) -> bool:
        return any(re.match(p, name) for p in (self.raw.get(K_PIPE_REPL) or []))

    def rule(self, name: str) -> Rule:
        """The merge rule ``ds_to_universal.merge_tp_slices`` applies to ``name`` (same precedence)."""
        vocab = self._match(K_VOCAB, name) is not None
        aff = [p for p in self.affine if re.match(p, name)]
        if len(aff) > 1:
            raise SourceFormatError(f"parameter {name!r} matches several affine_map patterns {aff}")
        sub_hit = None
        for s in self.subs:
            for p in s.patterns:
                if re.match(p, name):
                    sub_hit = (s, p)
                    self.unmatched.discard(p)
                    break
            if sub_hit:
                break
        repl = self._match(K_TP_REPL, name)
        avg = self._match(K_AVERAGE, name)
        two = self._match(K_TWO_SUB, name)
        row = self._match(K_ROW, name)
        if aff:
            r = Rule("affine", affine=self.affine[aff[0]], vocab=vocab, explicit=True)
            # the pattern is still derived from the categories (below) when one names the parameter
            r.cat_dim = 1 if row else 0
            r.sub, r.sub_pattern = (sub_hit or (None, None))
            r.category = ("replicated" if repl else "average" if avg else "two_sub" if two
                                      else "sub_param" if sub_hit else "cat" if (row or vocab) else None)
            return r
        if repl:
            return Rule("replicated", vocab=vocab, explicit=True)
        if avg:
            return Rule("average", vocab=vocab, explicit=True)
        if two:
            return Rule("two_sub", cat_dim=0, vocab=vocab, explicit=True)
        if sub_hit:
            return Rule("sub_param", sub=sub_hit[0], sub_pattern=sub_hit[1], vocab=vocab, explicit=True)
        return Rule("cat", cat_dim=1 if row else 0, vocab=vocab, explicit=bool(row or vocab))


# ------------------------------------------------------------------------------------------- merging
def _affine_rebuild(amap: dict, slices: Sequence[torch.Tensor], state: str, name: str) -> torch.Tensor:
    logical = [int(x) for x in amap["logical_shape"]]
    ranks = amap["ranks"]
    if isinstance(ranks, dict):
        ranks = {int(k): v for k, v in ranks.items()}
    else:
        ranks = dict(enumerate(ranks))
    power = SCALE_POWER.get(state, 1)
    full = torch.empty(math.prod(logical), dtype=slices[0].dtype)
    written: set[int] = set()
    for r, entry in sorted(ranks.items()):
        if r >= len(slices):
            raise SourceFormatError(f"{name}: affine map names TP rank {r} but the checkpoint has {len(slices)}")
        shard = slices[r].reshape(-1)
        if shard.numel() != math.prod(int(x) for x in entry.get("shard_shape", [shard.numel()])):
            raise SourceFormatError(f"{name}: TP rank {r} holds {shard.numel()} elements, the affine map "
                                    f"describes {entry.get('shard_shape')}")
        for piece in entry.get("pieces", []):
            shape = [int(x) for x in piece["shape"]]
            (so, ss), (do, ds_) = piece["source"], piece["dest"]
            scale = float(piece.get("scale", 1.0))
            if scale != 1.0 and power != 1:
                raise SourceFormatError(f"{name}: optimizer state {state} through a scaled affine piece "
                                        "is not supported (neither by DeepSpeed)")
            src = torch.as_strided(shard, shape, [int(x) for x in ds_], int(do))
            if scale != 1.0:
                src = src / scale
            dst = torch.as_strided(full, shape, [int(x) for x in ss], int(so))
            if len(piece.get("locations", [r])) > 1 and int(so) in written:
                if not torch.equal(dst, src):
                    raise SourceFormatError(f"{name}: TP ranks {piece.get('locations')} hold different data for "
                                            f"a replicated block at offset {so}")
                continue
            dst.copy_(src)
            written.add(int(so))
    return full.view(logical)


def merge_tp_slices(name: str, slices: list[torch.Tensor], rule: Rule, info: UniversalInfo, state: str,
                    tp_shapes: Sequence[Sequence[int]] | None = None) -> tuple[torch.Tensor, dict]:
    """Combine the TP slices of one state exactly like ``ds_to_universal.merge_tp_slices``.

    Returns the logical tensor and the keys ``ds_to_universal`` writes next to ``param`` (JSON form)."""
    meta: dict[str, Any] = {}
    tp = len(slices)
    if rule.kind == "affine":
        assert rule.affine is not None  # an "affine" rule always carries its map
        param = _affine_rebuild(rule.affine, slices, state, name)
    elif rule.kind == "replicated":
        if tp > 1 and not all(torch.equal(slices[0], s) for s in slices[1:]):
            raise SourceFormatError(f"{name} ({state}): listed as TP-replicated but the {tp} TP slices differ")
        param = slices[0]
    elif rule.kind == "average":
        param = sum(slices) / len(slices)  # type: ignore[assignment]  # a sum of tensors is a tensor
    elif rule.kind == "two_sub":
        chunks = [torch.chunk(s, 2, dim=0) for s in slices]
        param = torch.cat([torch.cat([c[0] for c in chunks], dim=0), torch.cat([c[1] for c in chunks], dim=0)], dim=0)
        meta = {"cat_dim": 0, "param_n_sub_params": 2}
    elif rule.kind == "sub_param":
        param, normalized = _merge_sub_params(name, slices, rule, info)
        meta = {"sub_param_shape": sp.to_jsonable(normalized)}
    else:
        param = torch.cat(slices, dim=rule.cat_dim) if tp > 1 else slices[0]
        meta = {"cat_dim": rule.cat_dim}
    if rule.vocab:
        orig = info.raw.get(K_ORIG_VOCAB)
        if orig is None:
            raise SourceFormatError(f"{name}: matches a vocabulary pattern but universal_checkpoint_info has no "
                                    "original_vocab_size")
        param = param.narrow(0, 0, int(orig))
        meta["vocab_tensor"] = True
    return param, meta


def _sub_widths(name, rule: Rule, info: UniversalInfo, slices):
    s = rule.sub
    assert s is not None  # a "sub_param" rule always carries its SubparamShape
    pd = s.partition_dim
    spec = s.shape[pd]
    tp = len(slices)
    if info.version >= 0.4:
        sizes = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
        widths = (info.raw.get(K_WIDTHS) or {}).get(rule.sub_pattern)
        if widths is None:
            raise SourceFormatError(f"{name}: universal checkpoint version {info.version} records no "
                                    f"sub_param_shard_widths for pattern {rule.sub_pattern}")
        normalized = s
    else:
        if isinstance(spec, (tuple, list)):
            sizes = tuple(spec)
            normalized = s
        else:
            full = sum(t.shape[pd] for t in slices)
            if spec <= 0 or full % spec:
                raise SourceFormatError(f"{name}: legacy sub-parameter count {spec} does not divide {full}")
            sizes = (full // spec,) * spec
            shp = list(s.shape)
            shp[pd] = sizes
            normalized = sp.SubparamShape(patterns=list(s.patterns), shape=tuple(shp), partition_dim=pd)
        if any(x % tp for x in sizes):
            raise SourceFormatError(f"{name}: sub-parameter sizes {sizes} not divisible by TP {tp} and no widths")
        widths = [[x // tp] * tp for x in sizes]
    widths = [[int(w) for w in ws] for ws in widths]
    if len(widths) != len(sizes) or any(len(ws) != tp or sum(ws) != sz for ws, sz in zip(widths, sizes)):
        raise SourceFormatError(f"{name}: sub-parameter widths {widths} do not fit sizes {sizes} over TP {tp}")
    return pd, [int(x) for x in sizes], widths, normalized


def _merge_sub_params(name, slices, rule: Rule, info: UniversalInfo):
    pd, sizes, widths, normalized = _sub_widths(name, rule, info, slices)
    assert rule.sub is not None
    logical = [sum(d) if isinstance(d, (tuple, list)) else d for d in rule.sub.shape]
    logical[pd] = sum(sizes)
    total = sum(s.numel() for s in slices)
    holes = [i for i, d in enumerate(logical) if d is not None and d < 0]
    if holes:
        known = math.prod(d for i, d in enumerate(logical) if i not in holes)
        logical[holes[0]] = total // known
    views = []
    for r, t in enumerate(slices):
        shp = list(logical)
        shp[pd] = sum(ws[r] for ws in widths)
        if math.prod(shp) != t.numel():
            raise SourceFormatError(f"{name}: TP rank {r} holds {t.numel()} elements, its widths describe {shp}")
        views.append(t.reshape(shp))
    merged, offs = [], [0] * len(views)
    for ws in widths:
        pieces = []
        for r, v in enumerate(views):
            pieces.append(v.narrow(pd, offs[r], ws[r]))
            offs[r] += ws[r]
        merged.append(torch.cat(pieces, dim=pd))
    return torch.cat(merged, dim=pd), normalized


def pattern_for(name: str, rule: Rule, info: UniversalInfo, slices: Sequence[torch.Tensor], tp: int) -> dict | None:
    """Our pattern record (ARCHITECTURE.md) for a parameter merged with ``rule``."""
    kind: str | None = rule.kind
    if kind == "affine":
        assert rule.affine is not None
        kind = rule.category or _affine_kind(rule.affine)
        if kind is None:
            return None
    if rule.vocab:
        return Vocab(dim=0, original_size=int(info.raw[K_ORIG_VOCAB])).to_json()
    if not info.has_patterns and tp == 1:
        return None
    if kind == "replicated":
        return Replicated().to_json()
    if kind == "average":
        return Averaged(max_deviation=0.0).to_json()
    if kind == "two_sub":
        halves = [(-(-s.shape[0] // 2), s.shape[0] - -(-s.shape[0] // 2)) for s in slices]
        sizes = (sum(h[0] for h in halves), sum(h[1] for h in halves))
        ws = (tuple(h[0] for h in halves), tuple(h[1] for h in halves))
        uneven = any(len(set(w)) > 1 for w in ws) or any(x % tp for x in sizes)
        return Fused(dim=0, sizes=sizes, widths=((tp, ws),) if uneven else ()).to_json()
    if kind == "sub_param":
        pd, sizes, widths, _ = _sub_widths(name, rule, info, slices)
        fused_widths = ((tp, tuple(tuple(w) for w in widths)),) if any(len(set(w)) > 1 for w in widths) else ()
        return Fused(dim=pd, sizes=tuple(sizes), widths=fused_widths).to_json()
    if kind == "cat":
        if tp == 1 and not rule.explicit:
            return None  # a TP=1 source says nothing about unlisted parameters
        d = rule.cat_dim
        if slices and slices[0].dim() <= d:
            return None
        cat_ws = tuple(int(s.shape[d]) for s in slices)
        return Partitioned(dim=d, widths=((tp, cat_ws),) if len(set(cat_ws)) > 1 else ()).to_json()
    return None


def _affine_kind(amap: dict) -> str | None:
    ranks = amap.get("ranks") or {}
    entries = list(ranks.values()) if isinstance(ranks, dict) else list(ranks)
    logical = list(amap.get("logical_shape", []))
    if entries and all(len(e.get("pieces", [])) == 1 and list(e["pieces"][0]["shape"]) == logical for e in entries):
        return "replicated"
    return None


def with_placement(pattern: dict | None, placement: dict | None) -> dict | None:
    """``pattern`` (None: replicated) with its pipeline ``placement`` record (None: unchanged)."""
    if placement is None:
        return pattern
    out = dict(pattern) if pattern else Replicated().to_json()
    out["placement"] = placement
    return out


def numel_of(shape) -> int:
    return int(math.prod(int(x) for x in shape))


_with_placement = with_placement  # the name the universal-folder reader used
