"""DeepSpeed universal checkpoint folders (the output of ``ds_to_universal``): import and export.

Export writes ``OUT_ROOT/TAG/`` with the layout ``ds_to_universal`` writes and DeepSpeed's
``{"checkpoint": {"load_universal": true}}`` loader reads, plus ``OUT_ROOT/latest_universal``:

- ``zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt``: ``{**meta, "param": full logical fp32 tensor}``
  with the same keys ``ds_to_universal`` writes (``cat_dim``, ``param_n_sub_params``, ``vocab_tensor``),
  or raw flat tensors (ZeRO-3 sources, as ``ds_to_universal`` writes them; no ``step.pt``);
  frozen parameters and buffers get ``fp32.pt`` = ``{"param": weight.float()}`` like ds_to_universal;
- ``zero/optimizer_state.pt``: the common optimizer state (hyperparameters in ``param_groups``, clip_grad,
  ds_version, ...);
- the ``mp_rank_*_model_states.pt`` (or ZeRO-3 ``zero_pp_rank_*``) files rebuilt from the stored objects and
  weights (iteration, scheduler, client state, module weights).

Every file written loads with ``torch.load(..., weights_only=True)``: no DeepSpeed class is pickled.
Where DeepSpeed's loader wants a DeepSpeed object, the plain form is given or the key is left out:

- ``zero_stage``: a plain ``int`` (``ZeroStageEnum`` is an ``int`` subclass; nothing on the load path
  needs the enum);
- ``loss_scaler``: DeepSpeed's ``_load_global_state`` assigns ``sd["loss_scaler"]`` as the optimizer's loss
  scaler object, so a plain dict would break training; the key is left out and the engine keeps the scaler
  it built from its own config. For bf16/fp32 (static scale 1) nothing is lost; for fp16 with dynamic loss
  scaling the current scale restarts at ``initial_scale_power``. ``deepspeed_objects=True`` writes the
  real ``DynamicLossScaler`` with its saved state instead (needs deepspeed importable; the file is then no
  longer weights-only);
- ``sub_param_shape`` (``SubparamShape`` dataclass): fused parameters with equal sub-parameters are written
  as ``cat_dim`` + ``param_n_sub_params`` (plain ints, which the loader treats identically); unequal
  sub-parameters (GQA q/k/v) need the class for a TP>1 target, so only ``deepspeed_objects=True`` writes it.

Parameter names become folder names: each is validated with ``ucp_store.names.tensor_name`` and the
resolved path must stay under ``OUT_ROOT``.

Import reads such a folder back: :class:`UniversalFolderReader` (layout, metadata, a stream of
``ParamRecord``) and :class:`UniversalSource` (the reader as a ``Source`` for ``import_source``).
:class:`UniversalSink` is the export as a ``Sink``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ucp_store import inputs
from ucp_store import names as _names
from ucp_store import safe_pickle as sp
from ucp_store._killpoints import killpoint
from ucp_store.deepspeed.files import (
    DS_MODEL_KEYS,
    UCI,
    UNIVERSAL_MODEL_FILE_RE,
    find_param_dirs,
    hash_files,
    pipeline_placement,
)
from ucp_store.deepspeed.merge import ParamRecord, UniversalInfo, pattern_for, with_placement
from ucp_store.deepspeed.source import param_groups
from ucp_store.errors import ConfigurationError, ConflictError, DTypeError, InvalidNameError, SourceFormatError
from ucp_store.formats.base import destination, import_source
from ucp_store.io import space
from ucp_store.patterns import Averaged, Fused, Partitioned, Replicated, Vocab, parse_pattern

__all__ = ["export_universal", "import_universal", "read_universal", "plan_export", "UniversalFolderReader",
           "UniversalSource", "UniversalSink", "safe_dir", "replace_dir"]

STATE_FILES = ("fp32", "exp_avg", "exp_avg_sq")


# ============================================================================================ export
def plan_export(checkpoint, target: Any = None) -> list[tuple[str, str]]:
    """What an export reads: ``(name, state)`` pairs. A DeepSpeed universal folder holds full logical
    tensors, so this is every tensor-state; ``target`` (a topology) is the hook for planner-driven exports
    (``ucp_store.plan.planner``) that read only a rank's slices."""
    return [(i.name, i.state) for i in checkpoint.tensors()]


def safe_dir(root_real: str, base: str, name: str) -> str:
    """``base/name`` resolved, refusing an invalid tensor name and a path that leaves ``root_real`` (through
    ``..`` or a symlink) or is the root itself: an export writes one folder per parameter name."""
    _names.tensor_name(name)
    path = os.path.realpath(os.path.join(base, name))
    if os.path.commonpath([root_real, path]) != root_real or path == root_real:
        raise InvalidNameError(f"tensor name {name!r} would write outside the export root {root_real}")
    return path


def _save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _ds_classes():
    try:
        from deepspeed.checkpoint.universal_checkpoint import SubparamShape
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
    except ImportError as exc:  # pragma: no cover
        raise ConfigurationError(f"deepspeed_objects=True needs deepspeed importable ({exc})") from None
    return LossScaler, DynamicLossScaler, ZeroStageEnum, SubparamShape


def _decode_objects(deepspeed_objects: bool):
    """from_jsonable hook: what stand-ins become in exported files."""
    def hook(path, state):
        if deepspeed_objects:
            LossScaler, DynamicLossScaler, _, SubparamShape = _ds_classes()
            if path.endswith("loss_scaler.DynamicLossScaler"):
                obj = DynamicLossScaler.__new__(DynamicLossScaler)
                obj.__dict__.update(state)
                return obj
            if path.endswith("loss_scaler.LossScaler"):
                obj = LossScaler.__new__(LossScaler)
                obj.__dict__.update(state)
                return obj
            if path.endswith("SubparamShape"):
                return SubparamShape(**state)
        if path == "argparse.Namespace":
            return dict(state)
        return state
    return hook


def _tp_shard(full: torch.Tensor, pattern: dict | None, tp: int, r: int, name: str,
              local_shape: tuple | None = None) -> torch.Tensor:
    """Rank ``r``'s TP-local tensor of a logical tensor (for rebuilding per-TP module weights)."""
    if tp == 1 or pattern is None:
        return full
    p = parse_pattern(pattern, name=name)
    if isinstance(p, (Replicated, Averaged)):
        return full
    if isinstance(p, Vocab) and local_shape:
        # the source's own padding: rows per rank as recorded, zero rows past the original vocabulary
        d = p.dim
        per = int(local_shape[d])
        lo, hi = min(r * per, full.shape[d]), min((r + 1) * per, full.shape[d])
        out = torch.zeros(local_shape, dtype=full.dtype)
        out.narrow(d, 0, hi - lo).copy_(full.narrow(d, lo, hi - lo))
        return out
    from ucp_store.patterns import tp_layout, without_placement

    lay = tp_layout(without_placement(p), tuple(full.shape), tp, r, name=name)
    out = torch.zeros(lay.shape, dtype=full.dtype)
    for c in lay.copies:
        out[c.local.slices()] = full[c.logical.slices()]
    return out


def _meta_from_pattern(pattern: dict | None, warnings: list[str], name: str) -> dict:
    """The keys ds_to_universal would write for a parameter with this pattern (non-DeepSpeed sources)."""
    if not pattern:
        return {"cat_dim": 0}
    p = parse_pattern(pattern, name=name)
    if isinstance(p, (Replicated, Averaged)):
        return {}
    if isinstance(p, Partitioned):
        return {"cat_dim": p.dim}
    if isinstance(p, Vocab):
        return {"cat_dim": 0, "vocab_tensor": True}
    if isinstance(p, Fused):
        sizes = list(p.sizes)
        if len(set(sizes)) == 1 and not p.widths:
            return {"cat_dim": p.dim, "param_n_sub_params": len(sizes)}
        warnings.append(f"{name}: fused with unequal sub-parameters {sizes}: DeepSpeed needs a SubparamShape "
                        "object to split it for TP>1 (use deepspeed_objects=True)")
        return {"sub_param_shape": {"__object__": "deepspeed.checkpoint.universal_checkpoint.SubparamShape",
                                    "state": {"patterns": [re.escape(name)], "shape": {"__tuple__": [
                                        {"__tuple__": sizes}, -1]}, "partition_dim": p.dim}}}
    return {"cat_dim": 0}


def _universal_meta(meta: dict, deepspeed_objects: bool, warnings: list[str], name: str) -> dict:
    out = {}
    for k, v in meta.items():
        if k == "raw":
            continue
        if k == "sub_param_shape":
            st = sp.from_jsonable(v)
            shape = st.get("shape", ()) if isinstance(st, dict) else ()
            pd = int(st.get("partition_dim", 0)) if isinstance(st, dict) else 0
            spec = shape[pd] if len(shape) > pd else None
            if deepspeed_objects:
                out[k] = sp.from_jsonable(v, objects=_decode_objects(True))
            elif isinstance(spec, (tuple, list)) and len(set(spec)) == 1:
                out["cat_dim"] = pd
                out["param_n_sub_params"] = len(spec)
            elif isinstance(spec, int):
                out["cat_dim"] = pd
                out["param_n_sub_params"] = spec
            else:
                warnings.append(f"{name}: sub_param_shape {spec} (unequal sub-parameters) left out: DeepSpeed "
                                "needs the SubparamShape class for a TP>1 target (deepspeed_objects=True)")
            continue
        out[k] = sp.from_jsonable(v)
    return out



def replace_dir(new: str, final: str) -> None:
    """Put the folder ``new`` at ``final``, which exists, and remove the old one. Where the kernel has it, one
    ``renameat2(RENAME_EXCHANGE)`` swaps the two, so a crash at any moment leaves the old folder or the new
    one at ``final``, never neither (two renames would leave a gap between them); elsewhere, two renames."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
        renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    except (OSError, AttributeError):
        renameat2 = None
    at_fdcwd, rename_exchange = -100, 2
    if renameat2 is not None and renameat2(at_fdcwd, os.fsencode(new), at_fdcwd, os.fsencode(final),
                                           rename_exchange) == 0:
        shutil.rmtree(new, ignore_errors=True)  # now the old folder
        return
    old = f"{new}.old"
    os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


@dataclass
class ExportPaths:
    """Where a universal export writes: it builds the tag folder as a partial sibling of its final place and
    moves it there once every file is written."""

    out_root: str  #: the export root as given, made absolute (``latest_universal`` goes here)
    root_real: str  #: the root with symlinks resolved: every parameter folder must stay under it
    tag: str
    final: str  #: ``root_real/tag``
    partial: str  #: ``root_real/.tag.partial-<pid>``, the folder being built

    @property
    def zero(self) -> str:
        """The partial folder's ``zero/``, which holds one folder per parameter."""
        return os.path.join(self.partial, "zero")


@dataclass
class ExportSettings:
    """How the parameters' files are written (shared by the export's worker threads)."""

    style: str  #: ``zero12``, ``zero3`` or ``portable`` (``auto`` resolved from the source's layout)
    raw: bool  #: raw flat tensors (ZeRO-3 style), no ``step.pt``
    weight_only_fallback: bool  #: a parameter without an fp32 master gets ``fp32.pt`` from its weight
    deepspeed_objects: bool
    metas: dict[str, Any]  #: ``deepspeed/universal_meta``: name -> the keys ds_to_universal wrote
    step_types: dict[str, Any]  #: ``deepspeed/step_types``: name -> how its step was stored (tensor, int, float)
    warnings: list[str] = field(default_factory=list)  #: what the export could not write as the source had it


@dataclass
class ExportJob:
    """One name's folder of a universal export."""

    name: str
    states: dict[str, Any]  #: state -> the stored TensorInfo
    folder: str  #: its folder under the partial export's ``zero/``, checked to stay under the root


def export_universal(checkpoint, out_root: str | os.PathLike, tag: str | None = None, *, style: str = "auto",
                     deepspeed_objects: bool = False, workers: int | None = None, progress: bool = True,
                     target: Any = None, overwrite: bool = False) -> str:
    """Write ``checkpoint`` as a DeepSpeed universal folder ``out_root/tag``; returns its path.

    ``style``: ``"auto"`` (what ds_to_universal writes for the source: dicts for ZeRO-1/2 and TP, raw flat
    tensors for a ZeRO-3 TP=1 source), ``"zero12"``, ``"zero3"``, or ``"portable"`` (dict files, ``step.pt``
    and both the ZeRO-1/2 and ZeRO-3 model-state and optimizer-state keys, so either loader resumes from it).

    The phases: check everything (the source, the settings, the paths, every name and fallback dtype) before
    writing anything; write the parameters' files, then the common optimizer state and the model states into
    a partial folder; move it into place; point ``latest_universal`` at it.
    """
    if style not in ("auto", "zero12", "zero3", "portable"):
        raise ValueError("style must be 'auto', 'zero12', 'zero3' or 'portable'")
    objs = checkpoint.objects()
    _refuse_expert_parallel(checkpoint, objs)
    settings = _export_settings(objs, style, deepspeed_objects)
    paths = _export_paths(checkpoint, out_root, tag, overwrite)
    by_name, jobs = _export_jobs(checkpoint, target, paths.root_real, paths.zero, settings.weight_only_fallback)
    needed = sum(_export_nbytes(states, settings.weight_only_fallback) for states in by_name.values())
    what = f"the universal folder of {checkpoint.run}@{checkpoint.step}"
    space.require(paths.root_real, needed, what)
    made_root = not os.path.isdir(paths.out_root)
    os.makedirs(paths.zero)  # after every check above: a refused export writes nothing (not even out_root)
    try:
        with space.guard(paths.root_real, needed, what):
            _write_params(checkpoint, jobs, settings, workers, progress)
            _write_common(checkpoint, objs, by_name, settings, paths.partial)
        if os.path.lexists(paths.final):
            replace_dir(paths.partial, paths.final)
        else:
            os.replace(paths.partial, paths.final)
    except BaseException:
        shutil.rmtree(paths.partial, ignore_errors=True)
        if made_root:
            with contextlib.suppress(OSError):
                os.rmdir(paths.out_root)  # made by this export, empty again
        raise
    tmp = os.path.join(paths.out_root, f".latest_universal.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(paths.tag)
    os.replace(tmp, os.path.join(paths.out_root, "latest_universal"))
    return paths.final


def _refuse_expert_parallel(checkpoint, objs: dict[str, Any]) -> None:
    """MoE and AutoEP versions cannot be universal folders (DeepSpeed's loader would mix up experts)."""
    if objs.get("deepspeed/moe") is not None:
        from ucp_store.deepspeed.moe import UNIVERSAL_REFUSAL

        raise ConfigurationError(f"{checkpoint.run}@{checkpoint.step}: {UNIVERSAL_REFUSAL}")
    if objs.get("deepspeed/autoep") is not None:
        from ucp_store.deepspeed.autoep import UNIVERSAL_REFUSAL as AUTOEP_REFUSAL

        raise ConfigurationError(f"{checkpoint.run}@{checkpoint.step}: {AUTOEP_REFUSAL}")


def _export_settings(objs: dict[str, Any], style: str, deepspeed_objects: bool) -> ExportSettings:
    """The export's settings from the source's layout: ``auto`` is what ds_to_universal writes for it."""
    layout = objs.get("deepspeed/layout") or {}
    src_zero = int(layout.get("zero_stage", 2))
    src_tp = int(layout.get("tp", 1))
    if style == "auto":
        style = "zero3" if (src_zero >= 3 and src_tp == 1) else "zero12"
    # a name stored without an fp32 master (frozen parameters and buffers of a ZeRO-1/2 source, whose module
    # weights are in its model states; any weight of a non-DeepSpeed source) gets fp32.pt from its weight, as
    # ds_to_universal writes frozen parameters
    weight_only_fallback = style in ("zero12", "portable") and (
        not layout or (layout.get("module_in_model_states") and src_zero < 3))
    return ExportSettings(style=style, raw=style == "zero3", weight_only_fallback=bool(weight_only_fallback),
                          deepspeed_objects=deepspeed_objects, metas=objs.get("deepspeed/universal_meta") or {},
                          step_types=objs.get("deepspeed/step_types") or {})


def _export_paths(checkpoint, out_root: str | os.PathLike, tag: str | None, overwrite: bool) -> ExportPaths:
    """The checked paths of an export (a valid tag; an existing tag folder only with ``overwrite``), with no
    partial folder of this process left from before."""
    tag = tag or f"global_step{checkpoint.step}_universal"
    _names.tag_name(tag)
    root = os.path.abspath(destination(out_root, "a DeepSpeed universal folder"))
    inputs.check_outside(root, checkpoint.store.location, "universal folder")
    root_real = os.path.realpath(root)  # the folder is made once every check has passed
    final = os.path.join(root_real, tag)
    if os.path.lexists(final) and not overwrite:
        raise ConflictError(f"{final} exists; choose another tag or pass overwrite=True")
    partial = os.path.join(root_real, f".{tag}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    return ExportPaths(out_root=root, root_real=root_real, tag=tag, final=final, partial=partial)


def _write_params(checkpoint, jobs: list[ExportJob], settings: ExportSettings, workers: int | None,
                  progress: bool) -> int:
    """Write every job's parameter files on ``workers`` threads; returns the bytes written."""
    from ucp_store.progress import track

    workers = workers or min(4, os.cpu_count() or 1)
    total = 0
    with ThreadPoolExecutor(max_workers=workers) as ex:
        for n in track(ex.map(lambda job: _write_param(checkpoint, job, settings), jobs), "export",
                       enabled=progress, total=len(jobs)):
            total += n
    return total


def _write_param(checkpoint, job: ExportJob, settings: ExportSettings) -> int:
    """One parameter's folder: a file per state with an fp32 master, else ``fp32.pt`` from its weight (the
    weight-only fallback), else nothing (its folder is removed again); returns the bytes written."""
    name, states, d = job.name, job.states, job.folder
    os.makedirs(d, exist_ok=True)
    written = 0
    if "fp32" in states:
        pattern = states["fp32"].pattern
        meta = settings.metas.get(name)
        ds_objects, warnings = settings.deepspeed_objects, settings.warnings
        meta = _universal_meta(meta, ds_objects, warnings, name) if meta is not None else \
            _universal_meta(_meta_from_pattern(pattern, warnings, name), ds_objects, warnings, name)
        for st in states:
            if st in ("weight",):
                continue
            t = checkpoint.read(name, st)
            path = os.path.join(d, f"{st}.pt")
            if st == "step":
                if settings.raw:
                    continue
                typ = settings.step_types.get(name, "tensor")
                val = t if typ == "tensor" else (int(t.item()) if typ == "int" else float(t.item()))
                _save(val, path)
            elif settings.raw:
                _save(t.reshape(-1), path)
            else:
                _save({**meta, "param": t}, path)
            written += t.numel() * t.element_size()
            killpoint("export.universal")
    elif "weight" in states and settings.weight_only_fallback:
        t = checkpoint.read(name, "weight")
        _save({"param": t.float()}, os.path.join(d, "fp32.pt"))
        written += t.numel() * 4
    else:
        try:
            os.rmdir(d)
        except OSError:
            pass
    return written


def _write_common(checkpoint, objs: dict[str, Any], by_name, settings: ExportSettings, out: str) -> None:
    """The files besides the parameters': ``zero/optimizer_state.pt``, the model states and the warnings."""
    step_value = _common_step(checkpoint, by_name)
    _save(_optimizer_state(objs, settings.style, settings.deepspeed_objects, step_value),
          os.path.join(out, "zero", "optimizer_state.pt"))
    for fname, sd in _model_states(checkpoint, objs, by_name, settings.style, settings.deepspeed_objects).items():
        _save(sd, os.path.join(out, fname))
    if settings.warnings:
        with open(os.path.join(out, "ucp_export_warnings.txt"), "w") as f:
            f.write("\n".join(sorted(set(settings.warnings))) + "\n")


def _export_jobs(checkpoint, target: Any, root_real: str, zero: str, weight_only_fallback: bool):
    """(name -> {state: info}, [ExportJob]) of a universal export, every name's folder and every fallback
    weight's dtype checked (nothing is written yet)."""
    by_name: "OrderedDict[str, dict[str, Any]]" = OrderedDict()
    wanted = set(plan_export(checkpoint, target)) if target is not None else None
    for info in checkpoint.tensors():
        if wanted is not None and (info.name, info.state) not in wanted:
            continue
        by_name.setdefault(info.name, {})[info.state] = info
    jobs = []
    for name, states in by_name.items():
        if "fp32" not in states and "weight" in states and weight_only_fallback:
            _check_fp32_cast(checkpoint, states["weight"])
        jobs.append(ExportJob(name, states, safe_dir(root_real, zero, name)))
    _refuse_path_clashes(checkpoint, by_name, weight_only_fallback)
    return by_name, jobs


def _export_nbytes(states: dict[str, Any], weight_only_fallback: bool) -> int:
    """The tensor bytes one parameter's universal files hold (the files' pickle framing aside)."""
    if "fp32" in states:
        return sum(i.nbytes for st, i in states.items() if st != "weight")
    if "weight" in states and weight_only_fallback:
        w = states["weight"]
        return math.prod(w.shape) * 4  # written as a float32 master
    return 0


def _refuse_path_clashes(checkpoint, by_name, weight_only_fallback: bool) -> None:
    """Refuse, naming both tensors, a version where one tensor's file under ``zero/`` is another tensor's
    folder (``x`` writes ``zero/x/fp32.pt``; a tensor ``x/fp32.pt`` needs that path as its folder), or a tensor
    folder is ``zero/optimizer_state.pt``: found before anything is written, not as "Is a directory"."""
    files = {"optimizer_state.pt": None}  # path under zero/ -> the tensor writing it (None: the export itself)
    for name, states in by_name.items():
        if "fp32" in states:
            files.update({f"{name}/{st}.pt": name for st in states if st != "weight"})
        elif "weight" in states and weight_only_fallback:
            files[f"{name}/fp32.pt"] = name
    for name in by_name:
        parts = name.split("/")
        for i in range(1, len(parts) + 1):
            folder = "/".join(parts[:i])
            if folder in files:
                owner = files[folder]
                whose = f"tensor {owner!r} writes" if owner is not None else "the export writes"
                raise ConflictError(
                    f"{checkpoint.run}@{checkpoint.step} cannot be a DeepSpeed universal folder: tensor {name!r} needs "
                    f"zero/{folder} as a folder, but {whose} the file zero/{folder}; rename one of them or export "
                    "with 'ucp export torch' or 'ucp export dcp'")


#: stored dtypes a weight may have to become a universal ``fp32.pt`` master (``float32``, as DeepSpeed keeps it)
_FLOAT_MASTER = ("float16", "bfloat16", "float32", "float64")


def _check_fp32_cast(checkpoint, info) -> None:
    """Refuse a weight the weight-only fallback would write as an fp32 master when float32 cannot stand for it:
    a complex tensor loses its imaginary part, an integer its values past 2^24 (uint64, int64) and a bool its
    type, and DeepSpeed's universal loader would take the result as a trained parameter."""
    if info.dtype not in _FLOAT_MASTER:
        raise DTypeError(
            f"tensor {info.name!r} state {info.state!r} of {checkpoint.run}@{checkpoint.step} is {info.dtype}: a "
            f"DeepSpeed universal folder holds each parameter as a float32 master (fp32.pt), and {info.dtype} "
            "cannot become one without changing its values or type; export it with 'ucp export torch' or "
            "'ucp export dcp', or leave it out of the version")


def _common_step(checkpoint, by_name) -> Any:
    for name, states in by_name.items():
        if "step" in states:
            return checkpoint.read(name, "step")
    return None


def _optimizer_state(objs: dict, style: str, deepspeed_objects: bool, step_value) -> dict:
    hook = _decode_objects(deepspeed_objects)
    common = objs.get("deepspeed/optimizer_state")
    if common is None:
        # a checkpoint that did not come from DeepSpeed: the minimum DeepSpeed's loaders read
        import importlib.metadata as md

        try:
            ver = md.version("deepspeed")
        except Exception:
            ver = "0.16.0"
        pgs = sp.from_jsonable(objs.get("param_groups") or [{}])
        common_sd = {"clip_grad": 0.0, "ds_version": ver, "param_groups": pgs}
    else:
        common_sd = sp.from_jsonable(common, objects=hook)
    if not deepspeed_objects:
        common_sd.pop("loss_scaler", None)
    if "zero_stage" in common_sd and not deepspeed_objects:
        common_sd["zero_stage"] = int(common_sd["zero_stage"])
    elif "zero_stage" in common_sd:
        common_sd["zero_stage"] = _ds_classes()[2](int(common_sd["zero_stage"]))
    pgs = common_sd.get("param_groups") or (common_sd.get("optimizer_state_dict") or {}).get("param_groups") or []
    for g in pgs:
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    if style in ("zero3", "portable") or "optimizer_state_dict" in common_sd:
        osd = common_sd.get("optimizer_state_dict") or {}
        state = osd.get("state") or {}
        if step_value is not None and not state:
            state = {0: {"step": step_value}}
        osd = {"state": state, "param_groups": osd.get("param_groups") or pgs}
        common_sd["optimizer_state_dict"] = osd
        common_sd.setdefault("param_groups", osd["param_groups"])
    if style == "portable":
        common_sd.setdefault("ds_version", "0.16.0")
        common_sd.setdefault("clip_grad", 0.0)
    return common_sd


def _module_from_index(checkpoint, index, by_name, pattern_tp, tp, tp_rank, lp_default, frag=None):
    """Rebuild a module (or frozen_param_fragments) dict from its recorded [name, dtype, shape] index."""
    module = OrderedDict()
    for name, dtype_name, shape in index:
        dt = sp._DTYPES.get(dtype_name, lp_default)
        numel = math.prod(shape)
        states = by_name.get(name, {})
        if numel == 0:
            module[name] = torch.empty(shape, dtype=dt)
            continue
        if "weight" in states:
            full = checkpoint.read(name, "weight")
        elif "fp32" in states:
            full = checkpoint.read(name, "fp32")
        else:
            module[name] = torch.zeros(shape, dtype=dt)
            continue
        local = _tp_shard(full, (states.get("fp32") or states.get("weight")).pattern, tp, tp_rank, name,
                          tuple(shape) if frag is None else None)
        if frag is not None:  # ZeRO-3 frozen fragment of DP rank frag[0] of frag[1]
            r, world = frag
            flat = local.reshape(-1)
            part = math.ceil(flat.numel() / world)
            piece = torch.zeros(part, dtype=flat.dtype)
            lo, hi = min(r * part, flat.numel()), min((r + 1) * part, flat.numel())
            piece[: hi - lo] = flat[lo:hi]
            local = piece
        module[name] = local.to(dt).reshape(shape).clone()
    return module


def _model_states(checkpoint, objs, by_name, style, deepspeed_objects) -> dict[str, dict]:
    hook = _decode_objects(deepspeed_objects)
    layout = objs.get("deepspeed/layout") or {}
    lp_default = sp._DTYPES.get(layout.get("lp_dtype", "float32"), torch.float32)
    tp = int(layout.get("tp", 1))
    files = {k[len("deepspeed/model_states/"):]: v for k, v in objs.items() if k.startswith("deepspeed/model_states/")}
    out: dict[str, dict] = {}
    if not files:
        files = {"mp_rank_00_model_states.pt": _synthetic_model_state(checkpoint, objs, by_name)}
    for fname, rec in files.items():
        m = re.match(r"^(?:(?:bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$", fname)
        m2 = re.match(r"^mp_rank_(\d+)_model_states\.pt$", fname)
        if m:
            dp_rank, mp = int(m.group(1)), int(m.group(2))
        elif m2:
            dp_rank, mp = 0, int(m2.group(1))
        else:
            raise SourceFormatError(f"stored model-state record {fname!r} has an unknown file name")
        tp_rank = mp % tp
        sd = {}
        for k, v in rec.items():
            if isinstance(v, dict) and "__ucp_module__" in v:
                frag = None
                if k == "frozen_param_fragments" and m:
                    frag = (dp_rank, int(layout.get("dp", 1)))
                sd[k] = _module_from_index(checkpoint, v["__ucp_module__"], by_name, None, tp, tp_rank, lp_default,
                                           frag)
            elif k in ("param_shapes",):
                sd[k] = [OrderedDict((n, torch.Size(s) if isinstance(s, (list, tuple)) else s)
                                     for n, s in (g.items() if isinstance(g, dict) else []))
                         for g in sp.from_jsonable(v)]
            elif k == "frozen_param_shapes" and v is not None:
                dec = sp.from_jsonable(v)
                sd[k] = OrderedDict((n, torch.Size(s) if isinstance(s, (list, tuple)) else s) for n, s in dec.items())
            else:
                sd[k] = sp.from_jsonable(v, objects=hook)
        if style == "zero3" and not m and not fname.startswith("zero_pp_rank_"):
            fname = f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt"
        out[fname] = sd
        if style == "portable":
            alt = f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt" if m2 else f"mp_rank_{mp:02d}_model_states.pt"
            if (m is None or dp_rank == 0) and alt not in files:
                out.setdefault(alt, sd)
    if style == "zero12":
        # a ZeRO-1/2 loader globs mp_rank_*; from a ZeRO-3 source keep one file per mp rank
        z3 = {f: sd for f, sd in out.items() if f.startswith("zero_pp_rank_") or "_zero_pp_rank_" in f}
        if z3 and not any(f.startswith("mp_rank_") for f in out):
            for f, sd in list(z3.items()):
                mm = re.match(r"^(?:(?:bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$", f)
                if mm and int(mm.group(1)) == 0:
                    out[f"mp_rank_{int(mm.group(2)):02d}_model_states.pt"] = sd
    return out


def _synthetic_model_state(checkpoint, objs, by_name) -> dict:
    """For checkpoints that did not come from DeepSpeed: the keys DeepSpeed's loader reads."""
    shapes = OrderedDict()
    module = []
    for name, states in by_name.items():
        info = states.get("fp32") or states.get("weight")
        if "fp32" in states:
            shapes[name] = {"__size__": list(info.shape)}
        module.append([name, (states.get("weight") or info).dtype, list(info.shape)])
    step = int(objs.get("global_steps", checkpoint.step) or checkpoint.step)
    return {
        "module": {"__ucp_module__": module}, "buffer_names": [], "optimizer": None,
        "param_shapes": [shapes], "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
        "lr_scheduler": objs.get("lr_scheduler"), "data_sampler": None, "random_ltd": None,
        "skipped_steps": int(objs.get("skipped_steps", 0) or 0), "global_steps": step,
        "global_samples": int(objs.get("global_samples", 0) or 0), "dp_world_size": 1, "mp_world_size": 1,
        "ds_config": objs.get("ds_config") or {}, "ds_version": objs.get("ds_version") or "0.16.0",
    }


# ============================================================================================ import
MODEL_FILE_RE = UNIVERSAL_MODEL_FILE_RE  # old name
_find_param_dirs = find_param_dirs  # old name


class UniversalFolderReader:
    """A universal folder (``ds_to_universal`` output): its layout and metadata on construction, then
    ``records()`` (one ``ParamRecord`` per ``zero/<param>/`` folder, streamed) and ``objects()`` (JSON
    state, including what ``records()`` saw: call it after them). ``info`` describes the source (folder,
    topology, ds_version, global_steps, files)."""

    def __init__(self, folder: str | os.PathLike):
        folder = os.path.abspath(os.fspath(folder))
        self.folder = folder
        self.zero = zero = os.path.join(folder, "zero")
        if not os.path.isdir(zero):
            raise SourceFormatError(f"{folder}: not a DeepSpeed universal folder: no zero/ subfolder (expected the "
                                    "output of ds_to_universal: zero/<param>/fp32.pt, zero/optimizer_state.pt, "
                                    "mp_rank_*_model_states.pt)")
        opt_path = os.path.join(zero, "optimizer_state.pt")
        if not inputs.present(opt_path, "universal optimizer state"):
            raise SourceFormatError(f"{opt_path}: missing (every universal folder has zero/optimizer_state.pt)")
        model_files = sorted(f for f in os.listdir(folder) if UNIVERSAL_MODEL_FILE_RE.match(f))
        if not model_files:
            raise SourceFormatError(f"{folder}: no mp_rank_*_model_states.pt or zero_pp_rank_*_model_states.pt files")
        self.notes: list[str] = []
        self.model_states = {f: sp.load(os.path.join(folder, f), what="model state") for f in model_files}
        self.first = first = self.model_states[model_files[0]]
        dims = first.get("checkpoint_parallel_dimensions") or {}
        z3 = any(f.startswith(("zero_pp_rank_", "bf16_zero", "fp16_zero")) for f in model_files)
        self.tp = tp = int(dims.get("tp_degree", 1)) if dims else (len(model_files) if not z3 else 1)
        self.pp = int(dims.get("pp_degree", 1)) if dims else 1
        self.uci = next((sd[UCI] for sd in self.model_states.values() if isinstance(sd.get(UCI), dict)), None)
        self.info_rules = UniversalInfo(self.uci, tp)
        self.shapes: dict[str, tuple] = {}
        self.stages_of: dict[str, set] = {}
        for f, sd in self.model_states.items():
            mm = UNIVERSAL_MODEL_FILE_RE.match(f)
            assert mm is not None  # model_files were selected by this pattern
            mp = int(mm.group(1) if mm.group(1) is not None else mm.group(3))
            for g in sd.get("param_shapes") or []:
                for n, shp in g.items():
                    self.shapes.setdefault(n, tuple(int(x) for x in shp))
                    self.stages_of.setdefault(n, set()).add(mp // max(tp, 1))
        self.module: dict[str, torch.Tensor] = {}
        self.buffers: set[str] = set()
        for sd in self.model_states.values():
            for n, t in (sd.get("module") or {}).items():
                self.module.setdefault(n, t)
            self.buffers.update(sd.get("buffer_names") or [])
        self.opt = opt = sp.load(opt_path, what="universal optimizer state")
        zero_stage = int(opt.get("zero_stage", 3 if z3 else 2))
        self.step_common = None
        if isinstance(opt.get("optimizer_state_dict"), dict):
            st0 = (opt["optimizer_state_dict"].get("state") or {}).get(0, {})
            self.step_common = st0.get("step")
        self.dirs = dirs = find_param_dirs(zero)
        self.dp = int(first.get("dp_world_size", 1) or 1)
        self.layout = {
            "format": "deepspeed_universal", "zero_stage": zero_stage, "tp": tp, "pp": self.pp,
            "dp": self.dp, "model_files": model_files,
            "module_in_model_states": all(sd.get("module") is not None for sd in self.model_states.values()),
            "lp_dtype": sp._dtype_name(next((t.dtype for n, t in self.module.items() if n in self.shapes),
                                            torch.float32))}
        self.metas: dict[str, dict] = {}
        self.step_types: dict[str, str] = {}
        self.kinds: dict[str, str] = {}
        self.info = {
            "folder": folder,
            "topology": {"tp": tp, "pp": self.pp, "dp": self.layout["dp"], "zero_stage": zero_stage},
            "ds_version": first.get("ds_version"), "global_steps": first.get("global_steps"),
            "files": ["zero/optimizer_state.pt"] + model_files +
                     [f"zero/{n}/{f}" for n in dirs for f in sorted(os.listdir(os.path.join(zero, n)))
                      if f.endswith(".pt")]}

    def _file_rank(self, fname: str) -> int:
        """The global rank that wrote model-states file ``fname`` (Megatron's order, tp fastest: ``mp_rank_XX``
        is DP rank 0 of model-parallel rank XX, ``zero_pp_rank_D_mp_rank_XX`` DP rank D of it)."""
        m = UNIVERSAL_MODEL_FILE_RE.match(fname)
        assert m is not None  # model_files were selected by this pattern
        tp, dp = max(self.tp, 1), self.dp
        mp, d = (int(m.group(1)), 0) if m.group(1) is not None else (int(m.group(3)), int(m.group(2)))
        rank = ((mp // tp) * dp + d) * tp + mp % tp
        if d >= dp or rank >= tp * self.pp * dp:
            raise SourceFormatError(f"{os.path.join(self.folder, fname)}: names DP rank {d} / model-parallel rank "
                                    f"{mp}, outside the folder's topology (tp={tp}, pp={self.pp}, dp={dp})")
        return rank

    def __iter__(self):
        """``records, objects, info = read_universal(folder)``: the old tuple form still unpacks."""
        return iter((self.records, self.objects, self.info))

    def placement(self, name: str) -> dict | None:
        """Pipeline placement, as for a tag folder (PipelineModule names carry the global layer index)."""
        return pipeline_placement(name, self.stages_of.get(name, ()), self.pp, layered=self.pp > 1)

    def records(self) -> Iterator[ParamRecord]:
        """One ``ParamRecord`` per parameter folder: in the model states' ``param_shapes`` order (DeepSpeed's
        parameter order, which a tag folder's import follows too), then any other folder in name order."""
        known = {n: i for i, n in enumerate(self.shapes)}
        for name in sorted(self.dirs, key=lambda n: (0, known[n]) if n in known else (1, 0)):
            yield self._record(name)

    def _record(self, name: str) -> ParamRecord:
        d = os.path.join(self.zero, name)
        files = sorted(f for f in os.listdir(d) if f.endswith(".pt"))
        states: dict[str, torch.Tensor] = {}
        meta: dict | None = None
        raw = False
        for f in files:
            st = f[:-3]
            _names.state_name(st)
            obj = sp.load(os.path.join(d, f), what=f"universal {st} state of {name}")
            if st == "step":
                t, typ = _step(obj)
                if t is not None:
                    states["step"] = t
                    self.step_types[name] = typ
                continue
            if isinstance(obj, dict):
                if "param" not in obj:
                    raise SourceFormatError(f"{os.path.join(d, f)}: a dict without 'param' (keys {list(obj)})")
                t = obj["param"]
                m = {k: sp.to_jsonable(v) for k, v in obj.items() if k != "param"}
                if meta is None or st == "fp32":
                    meta = m
            elif isinstance(obj, torch.Tensor):
                t = obj
                raw = True
                if name in self.shapes:
                    t = t.reshape(self.shapes[name])
            else:
                raise SourceFormatError(f"{os.path.join(d, f)}: neither a tensor nor a dict with 'param'")
            states[st] = t.detach().clone()
        if "step" not in states and self.step_common is not None and any(s in states for s in ("exp_avg",)):
            t, typ = _step(self.step_common)
            if t is not None:
                states["step"] = t
                self.step_types[name] = typ
        optimizer_owned = any(s in states for s in ("exp_avg", "exp_avg_sq")) or name in self.shapes
        if not optimizer_owned and set(states) <= {"fp32"}:
            # ds_to_universal's fallback for a frozen parameter / buffer: fp32.pt = weight.float()
            w = states.pop("fp32")
            lp = self.module.get(name)
            if lp is not None and lp.shape == w.shape and torch.equal(lp.float(), w):
                w = lp.clone()
            states["weight"] = w
            kind = "buffer" if name in self.buffers else "frozen"
        else:
            kind = "param"
        pattern = with_placement(_pattern(name, meta or {}, self.info_rules, self.tp, states), self.placement(name))
        if "fp32" in states:
            self.metas[name] = {"raw": True} if raw else (meta or {})
        self.kinds[name] = kind
        first_t = states.get("fp32", states.get("weight"))
        return ParamRecord(name=name, states=states, pattern=pattern, kind=kind,
                           shape=tuple(first_t.shape) if first_t is not None else (), meta=self.metas.get(name, {}))

    def objects(self) -> dict:
        """The folder's JSON state (model states, optimizer state, scheduler, ...) and what ``records``
        saw (per-parameter ``ds_to_universal`` keys, step types, kinds)."""
        notes, first, opt = self.notes, self.first, self.opt
        objs: dict[str, Any] = {}
        for f, sd in self.model_states.items():
            rec = {}
            for k, v in sd.items():
                if k in ("module", "frozen_param_fragments") and v is not None:
                    rec[k] = {"__ucp_module__": [[n, sp._dtype_name(t.dtype), list(t.shape)] for n, t in v.items()]}
                else:
                    rec[k] = sp.to_jsonable(v, notes=notes, where=f"{f}:{k}")
            objs[f"deepspeed/model_states/{f}"] = rec
        common = {k: v for k, v in opt.items() if k not in ("fp32_flat_groups",)}
        if isinstance(common.get("optimizer_state_dict"), dict):
            inner = common["optimizer_state_dict"]
            common["optimizer_state_dict"] = {
                "state": {k: {n: v for n, v in st.items() if n == "step"}
                          for k, st in (inner.get("state") or {}).items()},
                "param_groups": inner.get("param_groups", [])}
        objs["deepspeed/optimizer_state"] = sp.to_jsonable(common, notes=notes, where="optimizer_state")
        objs["deepspeed/layout"] = dict(self.layout)
        for k in ("ds_config", "lr_scheduler", "global_steps", "global_samples", "skipped_steps", "ds_version"):
            if k in first:
                objs[k] = sp.to_jsonable(first[k], notes=notes, where=k)
        if self.uci is not None:
            objs[UCI] = sp.to_jsonable(self.uci, notes=notes, where=UCI)
        # every model-states file's client state: keys that differ across ranks are per-rank (issue 28)
        from ucp_store.deepspeed.perrank import split_client, topology

        clients = {self._file_rank(f): sp.to_jsonable({k: v for k, v in sd.items() if k not in DS_MODEL_KEYS},
                                                      notes=notes if sd is first else [], where=f"{f}:client_state")
                   for f, sd in self.model_states.items()}
        objs["client_state"], per_rank = split_client(clients, topology(self.tp, self.pp, self.dp))
        objs.update(per_rank)
        if "param_groups" in opt:
            objs["param_groups"] = sp.to_jsonable(opt["param_groups"], notes=notes)
        if "loss_scaler" in opt:
            objs["loss_scaler"] = sp.to_jsonable(opt["loss_scaler"], notes=notes)
        objs["deepspeed/universal_meta"] = self.metas
        objs["deepspeed/step_types"] = self.step_types
        objs["deepspeed/kinds"] = self.kinds
        objs["deepspeed/notes"] = notes
        return objs


def read_universal(folder: str | os.PathLike) -> UniversalFolderReader:
    """Open a universal folder for reading (see :class:`UniversalFolderReader`)."""
    return UniversalFolderReader(folder)


def _step(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone(), "tensor"
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        return None, None
    if isinstance(obj, int):
        return torch.tensor(obj, dtype=torch.int64), "int"
    return torch.tensor(obj, dtype=torch.float64), "float"


def _pattern(name, meta, info: UniversalInfo, tp, states) -> dict | None:
    """Pattern of a universal-folder tensor: from universal_checkpoint_info (as for a tag folder, with the
    source TP degree from the model states), else from the per-file keys (vocab_tensor, sub-params)."""
    t = states.get("fp32", states.get("weight"))
    if t is None:
        return None
    if info.has_patterns:
        rule = info.rule(name)
        d = rule.sub.partition_dim if rule.sub is not None else (rule.cat_dim if rule.kind == "cat" else 0)
        if tp > 1 and t.dim() > d and t.shape[d] % tp == 0:
            slices = [t.narrow(d, 0, t.shape[d] // tp)] * tp  # the source's (even) TP slices, by shape
        else:
            slices, tp = [t], 1
        try:
            return pattern_for(name, rule, info, slices, tp)
        except SourceFormatError:
            return _fused_from_meta(meta, t)
    if meta.get("vocab_tensor"):
        return Vocab(dim=0, original_size=int(t.shape[0])).to_json()
    return _fused_from_meta(meta, t)


def _fused_from_meta(meta, t) -> dict | None:
    if meta.get("param_n_sub_params"):
        n = int(meta["param_n_sub_params"])
        d = int(meta.get("cat_dim", 0))
        if t.dim() > d and t.shape[d] % n == 0:
            return Fused(dim=d, sizes=(t.shape[d] // n,) * n).to_json()
    sps = meta.get("sub_param_shape")
    if sps:
        st = sp.from_jsonable(sps)
        shape, pd = st.get("shape", ()), int(st.get("partition_dim", 0))
        spec = shape[pd] if len(shape) > pd else None
        if isinstance(spec, (list, tuple)):
            return Fused(dim=pd, sizes=tuple(int(x) for x in spec)).to_json()
        if isinstance(spec, int) and t.dim() > pd and t.shape[pd] % spec == 0:
            return Fused(dim=pd, sizes=(t.shape[pd] // spec,) * spec).to_json()
    return None


class UniversalSource:
    """A universal folder as a :class:`~ucp_store.formats.base.Source` (one group of records per
    parameter, read in a background thread)."""

    kind = "deepspeed_universal"
    prefetch = True

    def __init__(self, folder: str | os.PathLike, *, hash_sources: bool = True):
        self.reader = UniversalFolderReader(folder)
        self.hash_sources = hash_sources
        self.total = len(self.reader.dirs)

    @property
    def step(self) -> int:
        """The folder's ``global_steps`` (the default step of the imported version)."""
        if self.reader.info["global_steps"] is None:
            raise SourceFormatError(f"{self.reader.folder}: model states carry no global_steps; pass step=")
        return int(self.reader.info["global_steps"])

    def describe(self) -> str:
        return self.reader.folder

    def provenance(self) -> dict:
        info = self.reader.info
        hashes = hash_files(info["folder"], info["files"]) if self.hash_sources else {}
        return {"source_kind": self.kind, "source_path": info["folder"], "source_topology": info["topology"],
                "source_hashes": hashes,
                "library_versions": {"deepspeed": None if info["ds_version"] is None else str(info["ds_version"])},
                "extra": {"format": "ds_to_universal output"}}

    def records(self):
        return param_groups(self.reader.records())

    def objects(self) -> dict:
        return self.reader.objects()


def import_universal(store, folder: str | os.PathLike, run: str, step: int | None = None, *,
                     message: str | None = None, progress: bool = True, hash_sources: bool = True,
                     parent: str | None = "auto") -> str:
    """Import an existing universal folder (ds_to_universal output) as ``run@step``; returns the id."""
    source = UniversalSource(folder, hash_sources=hash_sources)
    if step is None:
        step = source.step
    return import_source(store, source, run, step, message=message or f"import of universal folder {folder}",
                         parent=parent, progress=progress, distributed=False, total=None)


class UniversalSink:
    """The universal-folder export as a :class:`~ucp_store.formats.base.Sink`:
    ``UniversalSink().write(checkpoint, out_root, tag=..., style=...)`` -> ``{"path": ...}``."""

    kind = "deepspeed_universal"

    def write(self, checkpoint, dest: str, **options: Any) -> dict[str, Any]:
        return {"kind": self.kind, "path": export_universal(checkpoint, dest, **options)}
