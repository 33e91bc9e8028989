"""Direct import of a DeepSpeed ``save_checkpoint`` tag folder (no ``ds_to_universal`` step).

Reads ZeRO 1/2 (bf16, fp16 and fp32 optimizers, ``BF16_Optimizer``), ZeRO 3 (any number of
sub-groups), tensor-parallel (``mp_rank_XX``, AutoTP) and pipeline-parallel (``layer_XX[-model_YY]``)
folders without importing DeepSpeed: every pickle goes through :mod:`ucp_store.safe_pickle`.

For every parameter it yields the logical (TP-merged, padding-stripped) fp32 master, the optimizer
moments (``exp_avg``, ``exp_avg_sq``, or whatever per-element state the optimizer keeps) and ``step``,
merged exactly the way ``ds_to_universal`` merges them (bit for bit), plus a per-tensor pattern record
(ARCHITECTURE.md) converted from ``universal_checkpoint_info`` (Megatron-DeepSpeed regex lists, AutoTP
affine maps) or inferred from shapes and fragment mappings. Frozen parameters and buffers come from
the module state (state ``weight``); so do low-precision weights that differ from ``fp32`` cast down.

Streaming: files are memory-mapped (``torch.load(mmap=True, weights_only=True)``); a parameter is
assembled from its fragments (a parameter may straddle two DP partitions), copied out, and the
mapped pages it came from are released (``madvise``), so memory stays bounded by a few parameters,
not by the checkpoint. A reader thread assembles parameters while the caller's thread writes them.

    reader = DeepSpeedReader("ckpt/global_step100")
    for rec in reader.records():          # ParamRecord(name, states={"fp32": ..., ...}, pattern, ...)
        ...
    import_deepspeed(store, "ckpt/global_step100", run="r")       # -> checkpoint id

Under ``torchrun`` (torch.distributed initialised) ``import_deepspeed`` splits the parameters and the
source files across ranks; rank 0 commits once after a barrier (``ucp_store.distributed``).
"""

from __future__ import annotations

import ctypes
import math
import mmap as _mmap
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .. import safe_pickle as sp
from ..errors import SourceFormatError, UcpError

__all__ = [
    "ParamRecord", "DeepSpeedReader", "UniversalInfo", "read_zero_checkpoint", "import_deepspeed",
    "merge_tp_slices", "hash_files", "write_records",
]

# ------------------------------------------------------------------------------------------ file names
MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL_RE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
EXPERT_RE = re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$|^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$")

# optimizer-state keys that are sharded (ds_to_universal drops them from optimizer_state.pt)
SHARDED_KEYS = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
# model-state keys DeepSpeed itself writes (everything else is client state)
DS_MODEL_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info", "num_experts", "ds_autoep_layers", "folding",
}

# universal_checkpoint_info keys (deepspeed/checkpoint/constants.py)
UCI = "universal_checkpoint_info"
K_VOCAB = "vocabulary_parameter_patterns"
K_PIPE_REPL = "pipeline_replicated_parameter_patterns"
K_TP_REPL = "tp_replicated_parameter_patterns"
K_AVERAGE = "parameter_to_average_patterns"
K_ROW = "parameter_with_row_parallelism_patterns"
K_TWO_SUB = "parameter_with_2_sub_params_cat_dim_0"
K_SUB = "parameter_with_sub_params"
K_WIDTHS = "sub_param_shard_widths"
K_AFFINE = "affine_map"
K_ORIG_VOCAB = "original_vocab_size"
K_VERSION = "universal_checkpoint_version"
K_UNSUPPORTED = "autotp_unsupported_parameter_patterns"
K_EXPERT = "expert_parameter_patterns"
PATTERN_LIST_KEYS = (K_VOCAB, K_PIPE_REPL, K_TP_REPL, K_AVERAGE, K_ROW, K_TWO_SUB, K_SUB)

SCALE_POWER = {"fp32": 1, "exp_avg": -1, "exp_avg_sq": -2, "weight": 1}


# ------------------------------------------------------------------------------------------- records
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
            return None  # step: a scalar has no layout
        return self.state_patterns.get(state, self.pattern)


# ------------------------------------------------------------------------------------- page release
_PAGE = _mmap.PAGESIZE
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _MADV_DONTNEED = 4
except Exception:  # pragma: no cover - not Linux
    _madvise = None


def release_pages(t: torch.Tensor | None, start: int = 0, numel: int | None = None) -> None:
    """Tell the kernel the mapped pages under ``t[start:start+numel]`` (a flat tensor of a file loaded by
    ``safe_pickle.load(mmap=True)``) are no longer needed. Clean file-backed pages are dropped and re-read
    on a later touch, so this only ever costs time, never correctness (nothing writes into the mapping).
    Only call it on mmap-backed tensors: on anonymous memory MADV_DONTNEED zeroes the pages."""
    if _madvise is None or t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return
    numel = t.numel() - start if numel is None else numel
    if numel <= 0:
        return
    lo = t.data_ptr() + start * t.element_size()
    hi = lo + numel * t.element_size()
    st = t.untyped_storage()
    lo, hi = max(lo, st.data_ptr()), min(hi, st.data_ptr() + st.nbytes())
    lo = -(-lo // _PAGE) * _PAGE
    hi = hi // _PAGE * _PAGE
    if hi > lo:
        _madvise(ctypes.c_void_p(lo), hi - lo, _MADV_DONTNEED)


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

    def __init__(self, info: dict | None, tp: int):
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
        if self.raw.get(K_EXPERT):
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
            raise SourceFormatError(f"parameter {name!r} matches {len(hits)} {key} patterns {hits}; expected at most one")
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
        param = _affine_rebuild(rule.affine, slices, state, name)
    elif rule.kind == "replicated":
        if tp > 1 and not all(torch.equal(slices[0], s) for s in slices[1:]):
            raise SourceFormatError(f"{name} ({state}): listed as TP-replicated but the {tp} TP slices differ")
        param = slices[0]
    elif rule.kind == "average":
        param = sum(slices) / len(slices)
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
    kind = rule.kind
    if kind == "affine":
        kind = rule.category or _affine_kind(rule.affine)
        if kind is None:
            return None
    if rule.vocab:
        return {"kind": "vocab", "dim": 0, "original_size": int(info.raw[K_ORIG_VOCAB])}
    if not info.has_patterns and tp == 1:
        return None
    if kind == "replicated":
        return {"kind": "replicated"}
    if kind == "average":
        return {"kind": "averaged", "max_deviation": 0.0}
    if kind == "two_sub":
        halves = [(-(-s.shape[0] // 2), s.shape[0] - -(-s.shape[0] // 2)) for s in slices]
        sizes = [sum(h[0] for h in halves), sum(h[1] for h in halves)]
        rec = {"kind": "fused", "dim": 0, "sizes": sizes}
        ws = [[h[0] for h in halves], [h[1] for h in halves]]
        if any(len(set(w)) > 1 for w in ws) or any(x % tp for x in sizes):
            rec["widths"] = {str(tp): ws}
        return rec
    if kind == "sub_param":
        pd, sizes, widths, _ = _sub_widths(name, rule, info, slices)
        rec = {"kind": "fused", "dim": pd, "sizes": sizes}
        if any(len(set(w)) > 1 for w in widths):
            rec["widths"] = {str(tp): widths}
        return rec
    if kind == "cat":
        if tp == 1 and not rule.explicit:
            return None  # a TP=1 source says nothing about unlisted parameters
        d = rule.cat_dim
        if slices and slices[0].dim() <= d:
            return None
        ws = [int(s.shape[d]) for s in slices]
        rec = {"kind": "partitioned", "dim": d}
        if len(set(ws)) > 1:
            rec["widths"] = {str(tp): ws}
        return rec
    return None


def _affine_kind(amap: dict) -> str | None:
    ranks = amap.get("ranks") or {}
    entries = list(ranks.values()) if isinstance(ranks, dict) else list(ranks)
    logical = list(amap.get("logical_shape", []))
    if entries and all(len(e.get("pieces", [])) == 1 and list(e["pieces"][0]["shape"]) == logical for e in entries):
        return "replicated"
    return None


def _with_placement(pattern: dict | None, placement: dict | None) -> dict | None:
    if placement is None:
        return pattern
    out = dict(pattern) if pattern else {"kind": "replicated"}
    out["placement"] = placement
    return out


# ------------------------------------------------------------------------------------------- the reader
def _numel(shape) -> int:
    return int(math.prod(int(x) for x in shape))


def _lp_dtype(ds_config: dict | None) -> torch.dtype:
    cfg = ds_config or {}
    if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled"):
        return torch.bfloat16
    if (cfg.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def _step_value(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone(), "tensor"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None, None
    return (torch.tensor(v, dtype=torch.int64), "int") if isinstance(v, int) else (torch.tensor(v, dtype=torch.float64), "float")


class DeepSpeedReader:
    """A DeepSpeed tag folder: layout, metadata and a streaming iterator over logical parameters."""

    def __init__(self, tag_dir: str | os.PathLike, *, lp_weights: str = "auto"):
        self.tag_dir = os.path.abspath(os.fspath(tag_dir))
        if lp_weights not in ("auto", "all", "none"):
            raise ValueError("lp_weights must be 'auto', 'all' or 'none'")
        self.lp_weights = lp_weights
        self.notes: list[str] = []
        if not os.path.isdir(self.tag_dir):
            raise SourceFormatError(f"{self.tag_dir}: not a folder; expected a DeepSpeed save_checkpoint tag folder "
                                    "(e.g. ckpt/global_step100)")
        self._scan()
        self._load_metadata()

    # --------------------------------------------------------------------------------- layout
    def _path(self, fname: str) -> str:
        return os.path.join(self.tag_dir, fname)

    def _scan(self) -> None:
        files = sorted(os.listdir(self.tag_dir))
        self.model_files: dict[int, str] = {}
        self.zero3_model_files: dict[tuple[int, int], str] = {}  # (mp, dp)
        self.optim_files: dict[tuple[int, int], str] = {}  # (mp, dp)
        self.layer_files: dict[tuple[int, int], str] = {}  # (layer, tp)
        prefixes = set()
        unknown = []
        for f in files:
            if not f.endswith(".pt"):
                continue
            if EXPERT_RE.match(f):
                raise SourceFormatError(f"{self._path(f)}: DeepSpeed MoE expert files are not supported yet "
                                        "(expected a dense ZeRO checkpoint)")
            if m := MODEL_RE.match(f):
                self.model_files[int(m.group(1))] = f
            elif m := ZERO3_MODEL_RE.match(f):
                self.zero3_model_files[(int(m.group(3)), int(m.group(2)))] = f
            elif m := OPTIM_RE.match(f):
                prefixes.add(m.group(1) or "")
                self.optim_files[(int(m.group(3)), int(m.group(2)))] = f
            elif m := LAYER_RE.match(f):
                self.layer_files[(int(m.group(1)), int(m.group(2) or 0))] = f
            else:
                unknown.append(f)
        if not self.optim_files:
            raise SourceFormatError(
                f"{self.tag_dir}: unknown layout: no ZeRO optimizer files "
                "('[bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt'); found "
                f"{', '.join(files[:12]) or 'nothing'}. Expected the tag folder written by engine.save_checkpoint "
                "with ZeRO (stage 1-3) or the bf16 optimizer")
        if not self.model_files and not self.zero3_model_files:
            raise SourceFormatError(f"{self.tag_dir}: unknown layout: no model-state files ('mp_rank_<mp>_model_states.pt'"
                                    " or 'zero_pp_rank_<dp>_mp_rank_<mp>_model_states.pt')")
        if len(prefixes) > 1:
            raise SourceFormatError(f"{self.tag_dir}: optimizer files with mixed prefixes {sorted(prefixes)}: two "
                                    "different saves share one folder")
        self.prefix = prefixes.pop()
        if unknown:
            self.notes.append(f"ignored files: {', '.join(unknown)}")

    def _load(self, fname: str, what: str):
        return sp.load(self._path(fname), what=what)

    def _load_metadata(self) -> None:
        # ZeRO stage from the first optimizer file (as ds_to_universal does)
        first = self.optim_files[min(self.optim_files)]
        sd0 = self._load(first, "ZeRO optimizer state")
        if not isinstance(sd0, dict) or "optimizer_state_dict" not in sd0:
            raise SourceFormatError(f"{self._path(first)}: unknown layout: no 'optimizer_state_dict' key "
                                    f"(keys: {list(sd0)[:10] if isinstance(sd0, dict) else type(sd0).__name__})")
        osd0 = sd0["optimizer_state_dict"]
        self.zero_stage = int(osd0.get("zero_stage", 1))
        del sd0, osd0
        mp_ids = sorted({mp for mp, _ in self.optim_files})
        dp_ids = sorted({dp for _, dp in self.optim_files})
        self.mp, self.dp = len(mp_ids), len(dp_ids)
        for mp in range(self.mp):
            for dp in range(self.dp):
                if (mp, dp) not in self.optim_files:
                    expect = f"{self.prefix + '_' if self.prefix else ''}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
                    raise SourceFormatError(f"{self._path(expect)}: missing: the folder has optimizer files for "
                                            f"{self.dp} data-parallel and {self.mp} model-parallel ranks, so every "
                                            "(dp, mp) pair must be present")
        if mp_ids != list(range(self.mp)) or dp_ids != list(range(self.dp)):
            raise SourceFormatError(f"{self.tag_dir}: optimizer files for mp ranks {mp_ids} and dp ranks {dp_ids}; "
                                    "expected consecutive ranks from 0")
        self.model_states: dict[str, dict] = {}
        if self.zero_stage >= 3:
            for mp in range(self.mp):
                for dp in range(self.dp):
                    if (mp, dp) not in self.zero3_model_files:
                        raise SourceFormatError(
                            f"{self._path(f'zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt')}: missing: ZeRO-3 "
                            "writes one model-state file per (dp, mp) rank")
            for key in sorted(self.zero3_model_files):
                f = self.zero3_model_files[key]
                self.model_states[f] = self._load(f, "ZeRO-3 model state")
        else:
            for mp in range(self.mp):
                if mp not in self.model_files:
                    raise SourceFormatError(f"{self._path(f'mp_rank_{mp:02d}_model_states.pt')}: missing: the "
                                            f"optimizer files name {self.mp} model-parallel ranks")
            for mp in sorted(self.model_files):
                f = self.model_files[mp]
                self.model_states[f] = self._load(f, "model state")
        for f, sd in self.model_states.items():
            if not isinstance(sd, dict) or "param_shapes" not in sd:
                raise SourceFormatError(f"{self._path(f)}: unknown layout: a model-state file without "
                                        "'param_shapes' (saved without a ZeRO optimizer?)")
        first_ms = self.model_states[next(iter(self.model_states))]
        # topology
        dims = first_ms.get("checkpoint_parallel_dimensions")
        if isinstance(dims, dict) and dims.get("tp_degree"):
            self.tp, self.pp = int(dims["tp_degree"]), int(dims.get("pp_degree", 1))
        elif self.layer_files:
            self.tp = len({tp for (layer, tp) in self.layer_files if layer == min(k[0] for k in self.layer_files)})
            self.pp = max(1, self.mp // self.tp)
        else:
            self.tp, self.pp = self.mp, 1
        if self.tp * self.pp != self.mp:
            raise SourceFormatError(f"{self.tag_dir}: {self.mp} model-parallel ranks do not factor as tp={self.tp} x "
                                    f"pp={self.pp}")
        dpws = first_ms.get("dp_world_size")
        if dpws is not None and int(dpws) != self.dp:
            raise SourceFormatError(f"{self.tag_dir}: model states say dp_world_size={dpws} but there are optimizer "
                                    f"files for {self.dp} DP ranks; some DP rank files are missing")
        self.ds_config = first_ms.get("ds_config") if isinstance(first_ms.get("ds_config"), dict) else {}
        self.lp_dtype = _lp_dtype(self.ds_config)
        self.global_steps = first_ms.get("global_steps")
        uci = None
        for sd in self.model_states.values():
            if isinstance(sd.get(UCI), dict):
                uci = sd[UCI]
                break
        self.info = UniversalInfo(uci, self.tp)
        self.uci = uci
        # versions: every model file here; optimizer files as they are opened (and checked up front below)
        self.ds_version = None
        self._version_from = None
        for f, sd in self.model_states.items():
            self._check_version(f, sd.get("ds_version"))
        self._optim_cache: dict[tuple[int, int], dict] = {}
        self._check_optim_files()
        self._plan()

    def _check_version(self, fname: str, v) -> None:
        if v is None:
            return
        if self.ds_version is None:
            self.ds_version, self._version_from = str(v), fname
        elif str(v) != self.ds_version:
            raise SourceFormatError(f"{self._path(fname)}: written by DeepSpeed {v}, but {self._version_from} by "
                                    f"{self.ds_version}: files from different saves are mixed in one folder")

    def _check_optim_files(self) -> None:
        """Open every optimizer file's structure once (mmap: no tensor bytes are read) and check it."""
        for key in sorted(self.optim_files):
            sd = self._optim(key)
            osd = sd["optimizer_state_dict"]
            self._check_version(self.optim_files[key], sd.get("ds_version", osd.get("ds_version")))
            stage = int(osd.get("zero_stage", 1))
            if stage != self.zero_stage:
                raise SourceFormatError(f"{self._path(self.optim_files[key])}: ZeRO stage {stage}, but "
                                        f"{self.optim_files[min(self.optim_files)]} has {self.zero_stage}")
            need = ("fp32_flat_groups", "optimizer_state_dict") if self.zero_stage >= 3 else \
                ("single_partition_of_fp32_groups", "base_optimizer_state", "param_slice_mappings")
            missing = [k for k in need if k not in osd]
            if missing:
                raise SourceFormatError(f"{self._path(self.optim_files[key])}: unknown layout: optimizer_state_dict "
                                        f"lacks {missing} (ZeRO stage {self.zero_stage})")
            self._optim_cache.pop(key, None)

    def _optim(self, key: tuple[int, int]) -> dict:
        sd = self._optim_cache.get(key)
        if sd is None:
            sd = self._load(self.optim_files[key], "ZeRO optimizer state")
            if not isinstance(sd, dict) or "optimizer_state_dict" not in sd:
                raise SourceFormatError(f"{self._path(self.optim_files[key])}: unknown layout: no optimizer_state_dict")
            self._optim_cache[key] = sd
        return sd

    def _drop_optim(self, keys: Iterable[tuple[int, int]]) -> None:
        for k in keys:
            self._optim_cache.pop(k, None)

    # --------------------------------------------------------------------------------- plan
    def _ms(self, mp: int, dp: int = 0) -> dict:
        if self.zero_stage >= 3:
            return self.model_states[self.zero3_model_files[(mp, dp)]]
        return self.model_states[self.model_files[mp]]

    def _plan(self) -> None:
        """Ordered list of optimizer-owned parameters: (name, stage, group, per-tp local shapes)."""
        self.params: list[dict] = []
        seen: dict[str, int] = {}
        self.stages_of: dict[str, list[int]] = {}
        for pp in range(self.pp):
            shapes_tp = [self._ms(pp * self.tp + tp).get("param_shapes") or [] for tp in range(self.tp)]
            base = shapes_tp[0]
            for g, group in enumerate(base):
                for name, shape in group.items():
                    per_tp = []
                    for tp in range(self.tp):
                        grp = shapes_tp[tp][g] if g < len(shapes_tp[tp]) else {}
                        if name not in grp:
                            raise SourceFormatError(f"{self._path(self._model_file_name(pp * self.tp + tp))}: "
                                                    f"param_shapes lacks {name!r} which TP rank 0 has")
                        per_tp.append(tuple(int(x) for x in grp[name]))
                    self.stages_of.setdefault(name, []).append(pp)
                    if name in seen:
                        continue  # tied across pipeline stages: stored once (first stage)
                    seen[name] = len(self.params)
                    self.params.append({"name": name, "stage": pp, "group": g, "shapes": per_tp})
        # weight-only entries: frozen params and buffers
        self.frozen: dict[str, dict] = {}
        self.buffers: list[str] = []
        for pp in range(self.pp):
            ms = self._ms(pp * self.tp)
            for name, shape in (ms.get("frozen_param_shapes") or {}).items():
                if name not in self.frozen and name not in seen:
                    self.frozen[name] = {"stage": pp, "shape": tuple(int(x) for x in shape)}
            for b in ms.get("buffer_names") or []:
                if b not in self.buffers:
                    self.buffers.append(b)

    def _model_file_name(self, mp: int, dp: int = 0) -> str:
        return self.zero3_model_files[(mp, dp)] if self.zero_stage >= 3 else self.model_files[mp]

    # --------------------------------------------------------------------------------- public metadata
    @property
    def topology(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "zero_stage": self.zero_stage}

    @property
    def source_files(self) -> list[str]:
        fs = list(self.model_files.values()) + list(self.zero3_model_files.values()) + \
            list(self.optim_files.values()) + list(self.layer_files.values())
        return sorted(fs)

    def param_names(self) -> list[str]:
        return [p["name"] for p in self.params]

    def _placement(self, name: str) -> dict | None:
        stages = sorted(set(self.stages_of.get(name, [])))
        if self.pp > 1 and len(stages) > 1:
            labels = []
            if 0 in stages:
                labels.append("first")
            if self.pp - 1 in stages:
                labels.append("last")
            return {"stages": labels} if labels else None
        if self.layer_files:
            m = re.match(r"^(\d+)\.", name)
            if m:
                return {"layer": int(m.group(1))}
        return None

    def objects(self) -> dict[str, Any]:
        """Non-tensor state as JSON-serialisable values (see :func:`ucp_store.safe_pickle.to_jsonable`)."""
        notes = self.notes
        out: dict[str, Any] = {}
        per_file = {}
        for f, sd in self.model_states.items():
            rec = {}
            for k, v in sd.items():
                if k == "module":
                    rec[k] = None if v is None else {"__ucp_module__": [
                        [n, sp._dtype_name(t.dtype), list(t.shape)] for n, t in v.items()]}
                elif k == "frozen_param_fragments":
                    rec[k] = None if v is None else {"__ucp_module__": [
                        [n, sp._dtype_name(t.dtype), list(t.shape)] for n, t in v.items()]}
                elif k == "optimizer" and isinstance(v, dict):
                    rec[k] = sp.to_jsonable(v, notes=notes, where=f"{f}:{k}")
                else:
                    rec[k] = sp.to_jsonable(v, notes=notes, where=f"{f}:{k}")
            per_file[f] = rec
        for f, rec in per_file.items():
            out[f"deepspeed/model_states/{f}"] = rec
        first = self.model_states[next(iter(self.model_states))]
        out["deepspeed/optimizer_state"] = self.common_optimizer_state()
        out["deepspeed/layout"] = {
            "format": "deepspeed", "zero_stage": self.zero_stage, "tp": self.tp, "pp": self.pp, "dp": self.dp,
            "prefix": self.prefix, "lp_dtype": sp._dtype_name(self.lp_dtype), "ds_version": self.ds_version,
            "model_files": sorted(self.model_states), "optim_files": sorted(self.optim_files.values()),
            "layer_files": sorted(self.layer_files.values()),
            "module_in_model_states": all(sd.get("module") is not None for sd in self.model_states.values()),
            "params": [[p["name"], p["stage"], p["group"]] for p in self.params],
            "frozen": sorted(self.frozen), "buffers": list(self.buffers),
        }
        for k in ("ds_config", "lr_scheduler", "global_steps", "global_samples", "skipped_steps", "ds_version",
                  "data_sampler", "random_ltd"):
            if k in first:
                out[k] = sp.to_jsonable(first[k], notes=notes, where=k)
        if self.uci is not None:
            out[UCI] = sp.to_jsonable(self.uci, notes=notes, where=UCI)
        client = {k: v for k, v in first.items() if k not in DS_MODEL_KEYS}
        out["client_state"] = sp.to_jsonable(client, notes=notes, where="client_state")
        common = out["deepspeed/optimizer_state"]
        if isinstance(common, dict):
            if "loss_scaler" in common:
                out["loss_scaler"] = common["loss_scaler"]
            if "param_groups" in common:
                out["param_groups"] = common["param_groups"]
        out["deepspeed/notes"] = list(notes)
        return out

    def common_optimizer_state(self) -> dict:
        """What ds_to_universal puts into ``zero/optimizer_state.pt`` (JSON form, tensor-free)."""
        sd = self._optim((0, 0))
        osd = sd["optimizer_state_dict"]
        if self.zero_stage >= 3:
            inner = osd.get("optimizer_state_dict") or {}
            states = {}
            for k, st in (inner.get("state") or {}).items():
                states[k] = {n: v for n, v in st.items() if n == "step"}
            out = {k: v for k, v in osd.items() if k not in ("fp32_flat_groups", "optimizer_state_dict")}
            out["optimizer_state_dict"] = {"state": states, "param_groups": inner.get("param_groups", [])}
            out["param_groups"] = inner.get("param_groups", [])
        else:
            out = {k: v for k, v in osd.items() if k not in SHARDED_KEYS}
            bos = osd.get("base_optimizer_state")
            if isinstance(bos, dict):
                out["param_groups"] = bos.get("param_groups", [])
            # ds_to_universal loads this through ZeROCheckpoint: paddings stripped, partition_count = dp
            if "group_paddings" in out:
                out["group_paddings"] = [0] * len(out["group_paddings"])
            if isinstance(out.get("partition_count"), list):
                out["partition_count"] = [self.dp] * len(out["partition_count"])
        return sp.to_jsonable(out, notes=self.notes, where="optimizer_state")

    # --------------------------------------------------------------------------------- streaming
    def records(self, *, names: Iterable[str] | None = None, include_weights: bool = True) -> Iterator[ParamRecord]:
        """Yield every (selected) parameter, then frozen parameters and buffers, one at a time."""
        wanted = None if names is None else set(names)
        if self.zero_stage >= 3:
            yield from self._records_zero3(wanted)
        else:
            yield from self._records_zero12(wanted)
        if include_weights:
            yield from self._weight_records(wanted)

    # ZeRO-1/2 (and BF16_Optimizer) ---------------------------------------------------------------
    def _flat_states(self, key: tuple[int, int], g: int) -> tuple[dict[str, torch.Tensor], Any, dict]:
        osd = self._optim(key)["optimizer_state_dict"]
        fp32 = osd["single_partition_of_fp32_groups"]
        bos = osd["base_optimizer_state"]
        if isinstance(bos, dict) and "state" in bos:
            st = bos["state"].get(g, bos["state"].get(str(g), {})) if isinstance(bos["state"], dict) else bos["state"][g]
        elif isinstance(bos, list):  # elastic checkpoint: one lean state per group
            st = bos[g] if g < len(bos) else {}
        else:
            raise SourceFormatError(f"{self._path(self.optim_files[key])}: base_optimizer_state has an unknown form")
        if g >= len(fp32):
            raise SourceFormatError(f"{self._path(self.optim_files[key])}: {len(fp32)} fp32 groups, "
                                    f"param_shapes names group {g}")
        flat = {"fp32": fp32[g]}
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor) and v.dim() == 1:
                flat[k] = v
        step = st.get("step", osd.get("base_optimizer_state_step"))
        mapping = osd["param_slice_mappings"][g] if g < len(osd["param_slice_mappings"]) else {}
        return flat, step, mapping

    def _records_zero12(self, wanted) -> Iterator[ParamRecord]:
        by_stage: dict[int, list[dict]] = {}
        for p in self.params:
            by_stage.setdefault(p["stage"], []).append(p)
        for pp in range(self.pp):
            keys = [(pp * self.tp + tp, dp) for tp in range(self.tp) for dp in range(self.dp)]
            for spec in by_stage.get(pp, []):
                if wanted is not None and spec["name"] not in wanted:
                    continue
                yield self._zero12_param(spec)
            self._drop_optim(keys)

    def _zero12_param(self, spec: dict) -> ParamRecord:
        name, pp, g = spec["name"], spec["stage"], spec["group"]
        per_state: dict[str, list[torch.Tensor]] = {}
        steps = []
        used: list[tuple[torch.Tensor, int, int]] = []
        for tp in range(self.tp):
            mp = pp * self.tp + tp
            want = _numel(spec["shapes"][tp])
            frags: dict[str, list[torch.Tensor]] = {}
            got = 0
            for dp in range(self.dp):
                flat, step, mapping = self._flat_states((mp, dp), g)
                addr = mapping.get(name)
                if addr is None:
                    continue
                start, numel = int(addr.start), int(addr.numel)
                for k, t in flat.items():
                    if start + numel > t.numel():
                        raise SourceFormatError(
                            f"{self._path(self.optim_files[(mp, dp)])}: fragment of {name!r} [{start}, {start + numel})"
                            f" lies outside the flat {k} partition of group {g} ({t.numel()} elements)")
                    frags.setdefault(k, []).append(t.narrow(0, start, numel))
                    used.append((t, start, numel))
                steps.append((step, (mp, dp)))
                got += numel
            if got == 0:
                per_state = {}
                break
            if got != want:
                raise SourceFormatError(f"{self.tag_dir}: the fragments of {name!r} on mp rank {mp} cover {got} of its "
                                        f"{want} elements: a DP rank file is missing or from another save")
            for k, fs in frags.items():
                per_state.setdefault(k, []).append(torch.cat(fs).reshape(spec["shapes"][tp]))
        rec = self._finish(name, spec, per_state, steps, used)
        for t, s, n in used:
            release_pages(t, s, n)
        return rec

    def _finish(self, name, spec, per_state, steps, used=None) -> ParamRecord:
        rule = self.info.rule(name)
        fp32_slices = per_state.get("fp32")
        if fp32_slices and rule.kind != "affine" and not self.info.has_patterns and len(fp32_slices) > 1:
            rule = self._infer_rule(name, fp32_slices)
        states: dict[str, torch.Tensor] = {}
        meta: dict = {}
        state_patterns: dict = {}
        pattern = None
        if not per_state:
            self.notes.append(f"{name}: no optimizer fragments (never updated); stored from the module weights")
        for k, slices in per_state.items():
            t, meta_k = merge_tp_slices(name, slices, rule, self.info, k, spec["shapes"])
            if k == "fp32" or not meta:
                meta = meta_k
            states[k] = t
            if pattern is None:
                pattern = pattern_for(name, rule, self.info, slices, len(slices))
            if rule.kind == "average" or rule.category == "average":
                dev = max(float((s.float() - t.float()).abs().max()) if s.numel() else 0.0 for s in slices)
                state_patterns[k] = dict(pattern or {"kind": "averaged"}, max_deviation=dev)
        step_t, step_type = self._merge_steps(name, steps)
        if step_t is not None and states:
            states["step"] = step_t
        if self.zero_stage < 3 and self.lp_weights != "none":
            lp = self._lp_weight(name, spec, rule, used)
            if lp is not None:
                fp32 = states.get("fp32")
                same = fp32 is not None and fp32.shape == lp.shape and self.lp_weights == "auto" and \
                    torch.equal(fp32.to(lp.dtype), lp)
                if not same:
                    if fp32 is not None and self.lp_weights == "auto":
                        self.notes.append(f"{name}: low-precision weight is not fp32 cast to {lp.dtype}; stored too")
                    states["weight"] = lp
                    if pattern is None and "fp32" not in states:
                        pattern = pattern_for(name, rule, self.info, [lp], self.tp)
        placement = self._placement(name)
        pattern = _with_placement(pattern, placement)
        state_patterns = {k: _with_placement(v, placement) for k, v in state_patterns.items()}
        first = states.get("fp32", states.get("weight"))
        shape = tuple(first.shape) if first is not None else ()
        return ParamRecord(name=name, states=states, pattern=pattern, kind="param", shape=shape, group=spec["group"],
                           stage=spec["stage"], meta=meta, state_patterns=state_patterns, step_type=step_type)

    def _lp_weight(self, name, spec, rule, used) -> torch.Tensor | None:
        """The merged low-precision module weight of an optimizer-owned parameter (None if not saved)."""
        slices = []
        for tp in range(self.tp):
            mod = self._module_entries(spec["stage"], tp)
            t = mod.get(name)
            if t is None:
                return None
            slices.append(t)
            if used is not None:
                used.append((t, 0, t.numel()))
        lp, _ = merge_tp_slices(name, [s.reshape(spec["shapes"][r]).clone() for r, s in enumerate(slices)],
                                rule, self.info, "weight")
        return lp

    def _infer_rule(self, name: str, slices: list[torch.Tensor]) -> Rule:
        """No universal_checkpoint_info at TP>1: identical slices are replicated, others split on dim 0."""
        if all(s.shape == slices[0].shape and torch.equal(s, slices[0]) for s in slices[1:]):
            self.notes.append(f"{name}: identical on all {len(slices)} TP ranks and no universal_checkpoint_info: "
                              "stored once as replicated (ds_to_universal would concatenate the copies)")
            return Rule("replicated")
        return Rule("cat", cat_dim=0)

    def _merge_steps(self, name, steps):
        vals = []
        for v, key in steps:
            t, typ = _step_value(v)
            if t is not None:
                vals.append((t, typ, key))
        if not vals:
            return None, None
        t0, typ0, k0 = vals[0]
        for t, typ, key in vals[1:]:
            if not torch.equal(t.double(), t0.double()):
                raise SourceFormatError(f"{name}: optimizer step {t.item()} in {self.optim_files[key]} differs from "
                                        f"{t0.item()} in {self.optim_files[k0]}")
        return t0, typ0

    # ZeRO-3 ---------------------------------------------------------------------------------------
    def _records_zero3(self, wanted) -> Iterator[ParamRecord]:
        # offsets per (tp, sub-group) walk param_shapes in order; partition = ceil(numel / dp)
        shapes_tp = [self._ms(tp, 0).get("param_shapes") or [] for tp in range(self.tp)]
        order = []
        offsets: list[dict[str, int]] = []
        for tp in range(self.tp):
            offs = {}
            for sg, group in enumerate(shapes_tp[tp]):
                off = 0
                for name, shape in group.items():
                    offs[(sg, name)] = off
                    off += math.ceil(_numel(shape) / self.dp)
            offsets.append(offs)
        for spec in self.params:
            if wanted is not None and spec["name"] not in wanted:
                continue
            order.append(spec)
        for spec in order:
            name, sg = spec["name"], spec["group"]
            per_state: dict[str, list[torch.Tensor]] = {}
            steps, used = [], []
            for tp in range(self.tp):
                n = _numel(spec["shapes"][tp])
                part = math.ceil(n / self.dp)
                off = offsets[tp][(sg, name)]
                frags: dict[str, list[torch.Tensor]] = {}
                for dp in range(self.dp):
                    osd = self._optim((tp, dp))["optimizer_state_dict"]
                    inner = osd["optimizer_state_dict"].get("state", {})
                    st = inner.get(sg, inner.get(str(sg), {}))
                    flat = {"fp32": osd["fp32_flat_groups"][sg]}
                    for k, v in st.items():
                        if k != "step" and isinstance(v, torch.Tensor) and v.dim() == 1:
                            flat[k] = v
                    real = max(0, min(part, n - dp * part))
                    for k, t in flat.items():
                        if off + real > t.numel():
                            raise SourceFormatError(f"{self._path(self.optim_files[(tp, dp)])}: {name!r} fragment "
                                                    f"[{off}, {off + real}) outside sub-group {sg} ({t.numel()})")
                        frags.setdefault(k, []).append(t.narrow(0, off, real))
                        used.append((t, off, part))
                    steps.append((st.get("step"), (tp, dp)))
                for k, fs in frags.items():
                    per_state.setdefault(k, []).append(torch.cat(fs).reshape(spec["shapes"][tp]))
            if self.tp == 1:
                states = {k: v[0] for k, v in per_state.items()}
                step_t, step_type = self._merge_steps(name, steps)
                if step_t is not None:
                    states["step"] = step_t
                rec = ParamRecord(name=name, states=states, pattern=_with_placement(None, self._placement(name)),
                                  kind="param", shape=tuple(spec["shapes"][0]), group=sg, stage=0,
                                  meta={"raw": True}, step_type=step_type)
            else:
                rec = self._finish(name, spec, per_state, steps)
            for t, s, n in used:
                release_pages(t, s, n)
            yield rec
        self._drop_optim(list(self.optim_files))

    # weights (frozen params, buffers, low-precision copies) ---------------------------------------
    def _module_entries(self, pp: int, tp: int) -> dict[str, torch.Tensor]:
        """name -> lp tensor of (stage, tp) from the model file or the pipeline layer files (mmap)."""
        ms = self._ms(pp * self.tp + tp)
        mod = ms.get("module")
        if mod is not None:
            return mod
        cache = self.__dict__.setdefault("_layer_cache", {})
        if (pp, tp) in cache:
            return cache[(pp, tp)]
        out: dict[str, torch.Tensor] = OrderedDict()
        cache[(pp, tp)] = out
        for (layer, ltp), f in sorted(self.layer_files.items()):
            if ltp != tp:
                continue
            sd = self._load(f, "pipeline layer state")
            for k, v in (sd or {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"{layer}.{k}"] = v
        return out

    def _weight_records(self, wanted) -> Iterator[ParamRecord]:
        if self.zero_stage >= 3:
            yield from self._weight_records_zero3(wanted)
            return
        owned = {p["name"] for p in self.params}
        names_done = set()
        for pp in range(self.pp):
            mods = [self._module_entries(pp, tp) for tp in range(self.tp)]
            for name, t0 in mods[0].items():
                if name in names_done or (wanted is not None and name not in wanted):
                    continue
                names_done.add(name)
                slices = []
                for tp in range(self.tp):
                    if name not in mods[tp]:
                        raise SourceFormatError(f"{self.tag_dir}: {name!r} is in the module state of TP rank 0 but "
                                                f"not of TP rank {tp}")
                    slices.append(mods[tp][name])
                if name in owned:
                    continue  # its low-precision copy was handled with its fp32 master
                kind = "buffer" if name in self.buffers else "frozen"
                rule = self.info.rule(name)
                if rule.kind != "affine" and not self.info.has_patterns and len(slices) > 1:
                    rule = self._infer_rule(name, slices)
                if kind == "buffer" and len(slices) > 1 and all(torch.equal(slices[0], s) for s in slices[1:]):
                    rule = Rule("replicated")
                t, meta = merge_tp_slices(name, [s.clone() for s in slices], rule, self.info, "weight")
                pattern = _with_placement(pattern_for(name, rule, self.info, slices, self.tp), self._placement(name))
                yield ParamRecord(name=name, states={"weight": t.clone()}, pattern=pattern, kind=kind,
                                  shape=tuple(t.shape), stage=pp)

    def _weight_records_zero3(self, wanted) -> Iterator[ParamRecord]:
        owned = {p["name"] for p in self.params}
        done = set()
        # frozen: fragments of ceil(n/dp) per dp file, clipped
        frozen_shapes = self._ms(0, 0).get("frozen_param_shapes") or {}
        for name, shape in frozen_shapes.items():
            if wanted is not None and name not in wanted:
                continue
            slices = []
            for tp in range(self.tp):
                shp = tuple(int(x) for x in (self._ms(tp, 0).get("frozen_param_shapes") or {}).get(name, shape))
                n = _numel(shp)
                part = math.ceil(n / self.dp)
                frs = []
                for dp in range(self.dp):
                    fr = (self._ms(tp, dp).get("frozen_param_fragments") or {}).get(name)
                    if fr is None:
                        raise SourceFormatError(f"{self._path(self._model_file_name(tp, dp))}: no frozen_param_fragments"
                                                f" entry for frozen parameter {name!r}")
                    real = max(0, min(part, n - dp * part))
                    frs.append(fr.reshape(-1).narrow(0, 0, real))
                slices.append(torch.cat(frs).reshape(shp))
            rule = self.info.rule(name) if self.info.has_patterns or self.tp == 1 else self._infer_rule(name, slices)
            t, meta = merge_tp_slices(name, slices, rule, self.info, "weight")
            done.add(name)
            yield ParamRecord(name=name, states={"weight": t.clone()}, kind="frozen", shape=tuple(t.shape),
                              pattern=_with_placement(pattern_for(name, rule, self.info, slices, self.tp),
                                                      self._placement(name)))
        mod = self._ms(0, 0).get("module") or {}
        for name, t in mod.items():
            if name in owned or name in done or (wanted is not None and name not in wanted) or t.numel() == 0:
                continue
            kind = "buffer" if name in self.buffers else "frozen"
            yield ParamRecord(name=name, states={"weight": t.clone()}, kind=kind, shape=tuple(t.shape),
                              pattern=_with_placement(None, self._placement(name)))


def read_zero_checkpoint(tag_dir: str | os.PathLike, **kwargs) -> Iterator[ParamRecord]:
    """Stream the logical parameters of a DeepSpeed tag folder (no store needed): optimizer-owned
    parameters first (in checkpoint order), then frozen parameters and buffers."""
    reader = DeepSpeedReader(tag_dir, **kwargs)
    yield from reader.records()


# ------------------------------------------------------------------------------------------- hashing
def hash_files(root: str, files: Sequence[str], *, workers: int | None = None) -> dict[str, str]:
    """``{relpath: "xxh3-128:<hex>"}`` of whole files, in parallel threads."""
    import xxhash

    def one(f):
        h = xxhash.xxh3_128()
        with open(os.path.join(root, f), "rb", buffering=0) as fh:
            buf = bytearray(8 << 20)
            view = memoryview(buf)
            while True:
                n = fh.readinto(buf)
                if not n:
                    break
                h.update(view[:n])
        return f, "xxh3-128:" + h.hexdigest()

    workers = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as ex:
        return dict(ex.map(one, files))


# ------------------------------------------------------------------------------------------- import
def _prefetch(gen: Iterator[ParamRecord], max_bytes: int = 96 << 20, max_items: int = 64) -> Iterator[ParamRecord]:
    """Run ``gen`` in a background thread (reading/merging overlaps the caller's writes)."""
    q: queue.Queue = queue.Queue()
    budget = threading.Semaphore(max_items)
    size = [0]
    cond = threading.Condition()
    done = object()
    stop = threading.Event()

    def work():
        try:
            for rec in gen:
                if stop.is_set():
                    return
                nb = rec.nbytes
                with cond:
                    while size[0] > 0 and size[0] + nb > max_bytes and not stop.is_set():
                        cond.wait(0.1)
                    size[0] += nb
                budget.acquire()
                q.put(rec)
            q.put(done)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            q.put(exc)

    th = threading.Thread(target=work, name="ucp-deepspeed-reader", daemon=True)
    th.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            budget.release()
            with cond:
                size[0] -= item.nbytes
                cond.notify_all()
            yield item
    finally:
        stop.set()
        with cond:
            cond.notify_all()
        while th.is_alive():
            try:
                q.get_nowait()
                budget.release()
            except queue.Empty:
                th.join(0.05)


INFLIGHT_BYTES = int(os.environ.get("UCP_IMPORT_INFLIGHT_MB", "256")) << 20


def write_records(writer, records: Iterable[ParamRecord], *, progress: bool = False, total: int | None = None,
                  on_record: Callable[[ParamRecord], None] | None = None,
                  inflight_bytes: int = INFLIGHT_BYTES, positions: dict[str, int] | None = None) -> int:
    """Write every state of every record into a CheckpointWriter; returns bytes written.

    Every ``inflight_bytes`` written the writer is flushed (its asynchronous array writes complete and
    their rows are recorded under the pending checkpoint), which bounds the memory the import holds."""
    from ..progress import track

    n = since = 0
    for rec in track(records, "import", enabled=progress, total=total):
        base = None if positions is None else positions.get(rec.name)
        for k, (state, t) in enumerate(rec.states.items()):
            # under torchrun every rank writes a share: the global parameter order keeps ZeRO layouts
            position = None if base is None else base * 16 + k
            writer.write(rec.name, state, t.contiguous(), pattern=rec.pattern_for(state), position=position)
            nb = t.numel() * t.element_size()
            n += nb
            since += nb
        if on_record is not None:
            on_record(rec)
        if since >= inflight_bytes:
            writer.flush()
            since = 0
    return n


def _dist_info():
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist, dist.get_rank(), dist.get_world_size()
    except Exception:  # pragma: no cover
        pass
    return None, 0, 1


def _share(items: Sequence, weights: Sequence[int], rank: int, world: int) -> list:
    """Contiguous, byte-balanced share of ``items`` for ``rank``."""
    total = sum(weights) or 1
    out, acc = [], 0
    for it, w in zip(items, weights):
        owner = min(world - 1, int(acc * world / total))
        if owner == rank:
            out.append(it)
        acc += w
    return out


def import_deepspeed(store, tag_dir: str | os.PathLike, run: str, step: int | None = None, *,
                     message: str | None = None, workers: int | None = None, progress: bool = True,
                     lp_weights: str = "auto", hash_sources: bool = True, distributed: bool | None = None,
                     parent: str | None = "auto") -> str:
    """Import a DeepSpeed tag folder into ``store`` as ``run@step``; returns the checkpoint id.

    ``step`` defaults to the checkpoint's ``global_steps``. Under ``torchrun`` (torch.distributed
    initialised; ``distributed=None`` detects it) every rank converts its share of the parameters and
    rank 0 commits after a barrier. On any error nothing is listed."""
    t0 = time.time()
    tag_dir = os.path.abspath(os.fspath(tag_dir))
    dist, rank, world = _dist_info()
    if distributed is False:
        dist, rank, world = None, 0, 1
    reader = DeepSpeedReader(tag_dir, lp_weights=lp_weights)
    if step is None:
        if reader.global_steps is None:
            raise SourceFormatError(f"{tag_dir}: model states carry no global_steps; pass step=")
        step = int(reader.global_steps)
    files = reader.source_files
    hashes: dict[str, str] = {}
    if hash_sources:
        mine = _share(files, [os.path.getsize(os.path.join(tag_dir, f)) for f in files], rank, world)
        hashes = hash_files(tag_dir, mine, workers=workers)
        if dist is not None and world > 1:
            parts = [None] * world
            dist.all_gather_object(parts, hashes)
            hashes = {k: v for p in parts for k, v in p.items()}
    provenance = {
        "source_kind": "deepspeed", "source_path": tag_dir, "source_topology": reader.topology,
        "source_hashes": hashes, "library_versions": {"deepspeed": reader.ds_version},
        "extra": {"zero_stage": reader.zero_stage, "lp_dtype": sp._dtype_name(reader.lp_dtype),
                  "files": len(files), "ranks": world},
    }
    msg = message or f"import of DeepSpeed checkpoint {tag_dir}"
    multi = dist is not None and world > 1
    if multi:
        from ..distributed import _all_ok, distributed_begin, distributed_commit

        writer = distributed_begin(store, run, step, parent=parent, message=msg, provenance=provenance)
    else:
        writer = store.begin(run, step, parent=parent, message=msg, provenance=provenance)
    metas: dict[str, Any] = {}
    steps: dict[str, str] = {}
    kinds: dict[str, str] = {}

    def note(rec: ParamRecord):
        if "fp32" in rec.states:
            metas[rec.name] = rec.meta
        if rec.step_type:
            steps[rec.name] = rec.step_type
        kinds[rec.name] = rec.kind

    def phase1():
        total = len(reader.params) + len(reader.frozen) + len(reader.buffers)
        if multi:
            order = reader.param_names()
            sizes = [_numel(p["shapes"][0]) for p in reader.params]
            mine = set(_share(order, sizes, rank, world))
            recs = reader.records(names=mine, include_weights=False)
            if rank == 0:
                recs = _chain(recs, reader._weight_records(None))
        else:
            recs = reader.records()
        everything = list(reader.param_names()) + list(reader.frozen) + list(reader.buffers)
        positions = {n: i for i, n in enumerate(dict.fromkeys(everything))} if multi else None
        write_records(writer, _prefetch(recs), progress=progress and rank == 0, total=total, on_record=note,
                      positions=positions)

    def phase2():
        objs = reader.objects()
        objs["deepspeed/universal_meta"] = metas
        objs["deepspeed/step_types"] = steps
        objs["deepspeed/kinds"] = kinds
        objs["deepspeed/layout"]["import_seconds"] = round(time.time() - t0, 3)
        for k, v in objs.items():
            writer.write_object(k, v)

    if not multi:
        try:
            phase1()
            phase2()
        except BaseException:
            writer.abort()
            raise
        return writer.commit().id

    error: BaseException | None = None
    try:
        phase1()
    except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
        error = exc
    if not _all_ok(error is None):
        writer.abort()
        raise UcpError(f"import of {tag_dir} failed on some rank; aborted (nothing listed)") from error
    parts = [None] * world
    dist.all_gather_object(parts, (metas, steps, kinds))
    metas, steps, kinds = {}, {}, {}
    for a_, b_, c_ in parts:
        metas.update(a_)
        steps.update(b_)
        kinds.update(c_)
    if rank == 0:
        try:
            phase2()
        except BaseException as exc:  # noqa: BLE001
            error = exc
    if not _all_ok(error is None):
        writer.abort()
        raise UcpError(f"import of {tag_dir} failed while writing its objects; aborted") from error
    return distributed_commit(writer)


def _chain(*gens):
    for g in gens:
        yield from g


def main(argv=None) -> int:
    """``python -m ucp_store.adapters.deepspeed STORE TAG_DIR --run R [--step N]`` (also under torchrun)."""
    import argparse
    import json

    from .. import open_store

    ap = argparse.ArgumentParser(description="import a DeepSpeed tag folder into a ucp store")
    ap.add_argument("store")
    ap.add_argument("tag_dir")
    ap.add_argument("--run", "--run-name", dest="run", required=True,
                    help="run name (spell it --run-name under torchrun, whose own --run-path clashes)")
    ap.add_argument("--step", type=int)
    ap.add_argument("--lp-weights", default="auto", choices=["auto", "all", "none"])
    ap.add_argument("--no-hash", action="store_true")
    ap.add_argument("--distributed", action="store_true", help="init torch.distributed (gloo) from torchrun env")
    args = ap.parse_args(argv)
    if args.distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        store = open_store(args.store, create=True)
        t0 = time.time()
        cid = import_deepspeed(store, args.tag_dir, args.run, args.step, lp_weights=args.lp_weights,
                               hash_sources=not args.no_hash, progress=False)
        _, rank, _ = _dist_info()
        if rank == 0:
            print(json.dumps({"checkpoint": cid, "seconds": round(time.time() - t0, 3)}), flush=True)
        if args.distributed:
            import torch.distributed as dist

            dist.barrier()  # no rank tears down while a peer is still in the commit's last collective
    finally:
        if args.distributed:
            # tear gloo down explicitly: a process group left to interpreter exit can abort
            # ("terminate called without an active exception") while a peer is still in its last collective
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
