"""The DeepSpeed tag-folder reader: layout, metadata and a streaming iterator over logical parameters.

Reads ZeRO 1/2 (bf16, fp16 and fp32 optimizers, ``BF16_Optimizer``), ZeRO 3 (any number of
sub-groups), tensor-parallel (``mp_rank_XX``, AutoTP) and pipeline-parallel (``layer_XX[-model_YY]``)
folders without importing DeepSpeed: every pickle goes through :mod:`ucp_store.safe_pickle`.

Streaming: files are memory-mapped (``torch.load(mmap=True, weights_only=True)``); a parameter is
assembled from its fragments (a parameter may straddle two DP partitions), copied out, and the
mapped pages it came from are released (:func:`release_pages`, ``madvise``), so memory stays bounded by
a few parameters, not by the checkpoint. Merging follows ``deepspeed_merge``; file names
``deepspeed_files``.
"""

from __future__ import annotations

import ctypes
import math
import mmap as _mmap
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.files import (
    DS_MODEL_KEYS,
    EXPERT_RE,
    LAYER_RE,
    MODEL_RE,
    OPTIM_RE,
    SHARDED_KEYS,
    UCI,
    ZERO3_MODEL_RE,
    pipeline_placement,
)
from ucp_store.deepspeed.merge import ParamRecord, Rule, UniversalInfo, merge_tp_slices, numel_of, pattern_for
from ucp_store.deepspeed.merge import with_placement as _with_placement
from ucp_store.errors import SourceFormatError
from ucp_store.patterns import Averaged

__all__ = ["DeepSpeedTagFolder", "DeepSpeedReader", "read_zero_checkpoint", "release_pages"]


_PAGE = _mmap.PAGESIZE
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _MADV_DONTNEED = 4
except Exception:  # pragma: no cover - not Linux
    _madvise = None  # type: ignore[assignment]


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



def lp_dtype(ds_config: dict | None) -> torch.dtype:
    cfg = ds_config or {}
    if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled"):
        return torch.bfloat16
    if (cfg.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def step_value(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone(), "tensor"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None, None
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64), "int"
    return torch.tensor(v, dtype=torch.float64), "float"


class DeepSpeedTagFolder:
    """A DeepSpeed tag folder's layout and metadata: which files hold what (``_scan``), the model states,
    parameter shapes, groups and fragment mappings (``_load_metadata``, ``_plan``), the topology, and the
    JSON-able non-tensor state (``objects``). Reading tensors is :class:`DeepSpeedReader`'s job."""

    reads_experts = False  # whether universal_checkpoint_info may list expert parameters (the AutoEP reader)

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
                self._expert_file(f)
                continue
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
            raise SourceFormatError(f"{self.tag_dir}: unknown layout: no model-state files "
                                    "('mp_rank_<mp>_model_states.pt'"
                                    " or 'zero_pp_rank_<dp>_mp_rank_<mp>_model_states.pt')")
        if len(prefixes) > 1:
            raise SourceFormatError(f"{self.tag_dir}: optimizer files with mixed prefixes {sorted(prefixes)}: two "
                                    "different saves share one folder")
        self.prefix = prefixes.pop()
        if unknown:
            self.notes.append(f"ignored files: {', '.join(unknown)}")

    def _expert_file(self, fname: str) -> None:
        """An MoE expert file: ``deepspeed_moe.DeepSpeedMoEReader`` reads them; this reader refuses them."""
        raise SourceFormatError(f"{self._path(fname)}: a DeepSpeed MoE expert file; read MoE checkpoints with "
                                "ucp_store.deepspeed.moe.DeepSpeedMoEReader (import_deepspeed picks it)")

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
                    prefix = f"{self.prefix}_" if self.prefix else ""
                    expect = f"{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"
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
        self.lp_dtype = lp_dtype(self.ds_config)
        self.global_steps = first_ms.get("global_steps")
        uci = None
        for sd in self.model_states.values():
            if isinstance(sd.get(UCI), dict):
                uci = sd[UCI]
                break
        self.info = UniversalInfo(uci, self.tp, allow_experts=self.reads_experts)
        self.uci = uci
        # versions: every model file here; optimizer files as they are opened (and checked up front below)
        self.ds_version: str | None = None
        self._version_from: str | None = None
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
                for name, _shape in group.items():
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
        return pipeline_placement(name, self.stages_of.get(name, ()), self.pp, layered=bool(self.layer_files))

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
        # every saved copy's client state: keys that differ across ranks are per-rank (issue 28), never rank 0's
        from ucp_store.deepspeed.perrank import file_ranks, split_client, topology

        ranks = file_ranks(self)
        clients = {ranks[f]: sp.to_jsonable({k: v for k, v in sd.items() if k not in DS_MODEL_KEYS},
                                            notes=notes if sd is first else [], where=f"{f}:client_state")
                   for f, sd in self.model_states.items()}
        out["client_state"], per_rank = split_client(clients, topology(self.tp, self.pp, self.dp))
        out.update(per_rank)
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



class DeepSpeedReader(DeepSpeedTagFolder):
    """A DeepSpeed tag folder: its layout and metadata (:class:`DeepSpeedTagFolder`) and a streaming
    iterator over logical parameters (ZeRO-1/2 flat groups, ZeRO-3 partitions, module weights)."""

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
            states = bos["state"]
            st = states.get(g, states.get(str(g), {})) if isinstance(states, dict) else states[g]
        elif isinstance(bos, list):  # elastic checkpoint: one lean state per group
            st = bos[g] if g < len(bos) else {}
        else:
            raise SourceFormatError(f"{self._path(self.optim_files[key])}: base_optimizer_state has an unknown form")
        if g >= len(fp32):
            raise SourceFormatError(f"{self._path(self.optim_files[key])}: {len(fp32)} fp32 groups, "
                                    f"param_shapes names group {g}")
        flat = {"fp32": fp32[g]}
        assert st is not None, f"{self.optim_files[key]}: no optimizer state for group {g}"
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor) and v.dim() == 1:
                flat[k] = v
        step = st.get("step", osd.get("base_optimizer_state_step"))
        mapping = osd["param_slice_mappings"][g] if g < len(osd["param_slice_mappings"]) else {}
        return flat, step, mapping

    def _gather_fragments(self, keys, g: int, local: str, label: str, steps: list,
                          used: list) -> tuple[dict[str, list[torch.Tensor]], int]:
        """The flat-partition fragments of the parameter named ``local`` in group ``g`` of the optimizer files
        ``keys`` ((mp, dp) pairs, in order): per state the fragment views, and how many elements they cover.
        Appends each file's step to ``steps`` and each view's (tensor, start, numel) to ``used``."""
        frags: dict[str, list[torch.Tensor]] = {}
        got = 0
        for key in keys:
            flat, step, mapping = self._flat_states(key, g)
            addr = mapping.get(local)
            if addr is None:
                continue
            start, numel = int(addr.start), int(addr.numel)
            for k, t in flat.items():
                if start + numel > t.numel():
                    raise SourceFormatError(
                        f"{self._path(self.optim_files[key])}: fragment of {label} [{start}, {start + numel})"
                        f" lies outside the flat {k} partition of group {g} ({t.numel()} elements)")
                frags.setdefault(k, []).append(t.narrow(0, start, numel))
                used.append((t, start, numel))
            steps.append((step, key))
            got += numel
        return frags, got

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
        steps: list = []
        used: list[tuple[torch.Tensor, int, int]] = []
        for tp in range(self.tp):
            mp = pp * self.tp + tp
            want = numel_of(spec["shapes"][tp])
            frags, got = self._gather_fragments([(mp, dp) for dp in range(self.dp)], g, name, repr(name),
                                                steps, used)
            if got == 0:
                per_state = {}
                break
            if got != want:
                raise SourceFormatError(f"{self.tag_dir}: the fragments of {name!r} on mp rank {mp} cover {got} of its "
                                        f"{want} elements: a DP rank file is missing or from another save")
            for k, fs in frags.items():
                per_state.setdefault(k, []).append(torch.cat(fs).reshape(spec["shapes"][tp]))
        rec = self.merge_param(name, spec, per_state, steps, used)
        for t, s, n in used:
            release_pages(t, s, n)
        return rec

    def merge_param(self, name, spec, per_state, steps, used=None) -> ParamRecord:
        """One optimizer-owned parameter from its TP slices (``per_state``: state -> slice per TP rank) and the
        optimizer steps of its files (``steps``): the TP rule, the merge, the pattern, the low-precision weight
        check. Public: the direct engine runs it over slices gathered from the ranks (``deepspeed.write_tp``)."""
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
                state_patterns[k] = Averaged(max_deviation=dev).to_json()  # pattern_for's kind: averaged
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
            t, typ = step_value(v)
            if t is not None:
                vals.append((t, typ, key))
        if not vals:
            return None, None
        t0, typ0, k0 = vals[0]
        for t, _typ, key in vals[1:]:
            if not torch.equal(t.double(), t0.double()):
                raise SourceFormatError(f"{name}: optimizer step {t.item()} in {self.optim_files[key]} differs from "
                                        f"{t0.item()} in {self.optim_files[k0]}")
        return t0, typ0

    # ZeRO-3 ---------------------------------------------------------------------------------------
    def _records_zero3(self, wanted) -> Iterator[ParamRecord]:
        # offsets per (tp, sub-group) walk param_shapes in order; partition = ceil(numel / dp)
        shapes_tp = [self._ms(tp, 0).get("param_shapes") or [] for tp in range(self.tp)]
        order = []
        offsets: list[dict[tuple[int, str], int]] = []
        for tp in range(self.tp):
            offs = {}
            for sg, group in enumerate(shapes_tp[tp]):
                off = 0
                for name, shape in group.items():
                    offs[(sg, name)] = off
                    off += math.ceil(numel_of(shape) / self.dp)
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
                n = numel_of(spec["shapes"][tp])
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
                rec = self.merge_param(name, spec, per_state, steps)
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
            for name, _t0 in mods[0].items():
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
                n = numel_of(shp)
                part = math.ceil(n / self.dp)
                frs = []
                for dp in range(self.dp):
                    fr = (self._ms(tp, dp).get("frozen_param_fragments") or {}).get(name)
                    if fr is None:
                        where = self._path(self._model_file_name(tp, dp))
                        raise SourceFormatError(f"{where}: no frozen_param_fragments"
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


