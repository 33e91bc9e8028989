"""DeepSpeed tag and universal folders: file names, the keys DeepSpeed writes, and source hashing.

Everything here is about *where* things are in a DeepSpeed checkpoint, not what they mean: the file-name
patterns of model/optimizer/layer files, the model-state keys DeepSpeed itself writes (the rest is client
state), the ``universal_checkpoint_info`` key names, the pipeline placement a parameter's name and stages
imply (:func:`pipeline_placement`, shared by the tag-folder and the universal-folder readers), and
:func:`hash_files` (provenance hashes of source files).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ucp_store import inputs
from ucp_store.patterns import Placement

__all__ = [
    "MODEL_RE", "ZERO3_MODEL_RE", "OPTIM_RE", "LAYER_RE", "EXPERT_RE", "UNIVERSAL_MODEL_FILE_RE", "SHARDED_KEYS",
    "DS_MODEL_KEYS", "UCI", "PATTERN_LIST_KEYS", "hash_files", "pipeline_placement", "find_param_dirs",
]

MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL_RE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
EXPERT_RE = re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$"
                       r"|^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$")

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


#: model-state files of a universal folder (``ds_to_universal`` copies the tag folder's model states)
UNIVERSAL_MODEL_FILE_RE = re.compile(
    r"^(?:mp_rank_(\d+)|(?:(?:bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+))_model_states\.pt$")
_LAYER_PREFIX = re.compile(r"^(\d+)\.")


def pipeline_placement(name: str, stages: Iterable[int], pp: int, *, layered: bool) -> dict | None:
    """The pattern placement record of parameter ``name`` held by pipeline ``stages`` of ``pp``.

    A parameter on several stages is tied (embeddings shared by the first and last stage): stored once,
    placed on the first/last stage it is held by. Otherwise, where the checkpoint is laid out by layers
    (``layered``: PipelineModule names carry the global layer index, ``3.mlp.weight``), its layer. Else
    no placement (replicated on every stage)."""
    held = sorted(set(stages))
    if pp > 1 and len(held) > 1:
        labels = tuple(lab for lab, s in (("first", 0), ("last", pp - 1)) if s in held)
        return Placement(stages=labels).to_json() if labels else None
    if layered:
        m = _LAYER_PREFIX.match(name)
        if m:
            return Placement(layer=int(m.group(1))).to_json()
    return None


def find_param_dirs(zero: str) -> list[str]:
    """Parameter folders under a universal folder's ``zero/`` (any folder holding ``.pt`` files), sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(zero):
        if any(f.endswith(".pt") for f in filenames) and dirpath != zero:
            out.append(os.path.relpath(dirpath, zero).replace(os.sep, "/"))
        dirnames.sort()
    return sorted(out)


def hash_files(root: str, files: Sequence[str], *, workers: int | None = None) -> dict[str, str]:
    """``{relpath: "xxh3-128:<hex>"}`` of whole files, in parallel threads."""
    import xxhash

    def one(f):
        h = xxhash.xxh3_128()
        with inputs.open_regular(os.path.join(root, f), "DeepSpeed file") as fh:
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


