"""Pattern algebra (pure): how one logical tensor maps onto the ranks of a topology.

A *logical* tensor is the unsharded, unpadded tensor the store keeps. Its *pattern* (a JSON record,
``schemas/pattern.schema.json``, contract in ARCHITECTURE.md) says how a training job lays it out:

==============  ==============================================================================
kind            the TP-local tensor of TP rank ``r`` (out of ``tp``)
==============  ==============================================================================
replicated      the whole tensor
averaged        the whole tensor (replicas had drifted; the store holds their mean; see
                ``average_replicas``)
partitioned     slice ``r`` along ``dim``: ``widths[tp][r]`` rows if ``widths`` names this ``tp``,
                else ``size / tp`` (must divide)
vocab           rows of the vocabulary padded with zeros to ``round_up(original_size,
                vocab_multiple * tp)``, then split evenly; padding is zero in every state
fused           for each sub-parameter ``j`` (``sizes[j]`` rows along ``dim``) its slice ``r``
                (``widths[tp][j][r]`` or ``sizes[j] / tp``), concatenated in sub-parameter order:
                QKV under GQA ``[q_r; k_r; v_r]``, SwiGLU ``[gate_r; up_r]``
expert          experts ``[ep_rank * E/ep, (ep_rank+1) * E/ep)`` along ``dim``, each expert laid out
                by the ``inner`` pattern (whose dims exclude the expert dim)
expert_member   one expert's tensor stored on its own (``experts.<e>.w1``): held only by ep rank
                ``expert // (E/ep)``, laid out by ``inner`` there
==============  ==============================================================================

``placement`` (any kind) says which pipeline stages hold the tensor: ``{"layer": i}`` (the stage owning
global layer ``i``), ``{"stages": ["first", "last"]}`` (tied weights: stored once, materialised on
each listed stage) or nothing (every stage). ``placement.local_name`` optionally names the tensor as the
stage sees it: a template with ``{local}`` (stage-local layer index), ``{layer}`` (global index) and
``{stage}``, or an object ``{"first": ..., "last": ...}`` for tied tensors named differently per stage.

Coordinates. A ``Box`` is a tuple of half-open ``(start, stop)`` per dim. A ``Copy`` moves one logical box
to one box of the TP-local tensor of the same shape (no transposes ever). The TP-local tensor is what a
rank holds before ZeRO: ZeRO stages 1-3 further cut its *flattened* (row-major) form into fragments,
described by a ``Fragment`` (computed by ``ZeroGroupLayout``); ``fragment_layout`` turns a fragment into
``FlatCopy`` records (logical box -> contiguous range of the fragment), each logical box being
contiguous in the local tensor so that ``buffer[range] = logical[box].ravel()`` is exact.

Writers. Every logical element has replicas (over TP for replicated kinds, ``sp``, ``dp`` / ``edp``,
tied stages). ``is_writer`` picks exactly one: TP rank 0 for TP-replicated kinds, ``sp == 0``, ``dp == 0``
(``edp == 0`` for experts; ZeRO-flat states are disjoint over the ZeRO group, so no ``sp``/``dp``
condition), and the first stage of the placement. The reassembly tests prove the rule covers every
element exactly once.

Everything here is index arithmetic over tuples: no I/O, no tensors (``average_replicas`` excepted, which
only uses array arithmetic and works on numpy arrays and torch tensors alike).

Modules, one job each (every public name is re-exported here, so ``from ucp_store.patterns import X``
keeps working):

- ``kinds``: the typed pattern kinds and ``Placement`` (what a record *is*; ``layer``, ``split_dims``)
- ``parse``: records -> kinds, validation against the schema and the logical shape, memoised
- ``placement``: pipeline stages holding a tensor, stage-local names
- ``layout``: TP/EP layouts (forward map) and writer choice (inverse map)
- ``zero``: ZeRO group layout, fragments and their flat copies
- ``replicas``: the mean of drifted replicas (``averaged``)
- box and range geometry lives in ``ucp_store.geometry`` (shared with the planner and the format)
"""

from __future__ import annotations

from ucp_store.geometry import Box, FlatRange, flat_range_to_boxes, row_major_strides, split_contiguous
from ucp_store.patterns.kinds import (
    KINDS,
    REPLICATED,
    SCHEMA_FILE,
    STAGE_NAMES,
    TP_REPLICATED_KINDS,
    Averaged,
    DTensorSplit,
    Expert,
    ExpertMember,
    Fused,
    Partitioned,
    Pattern,
    Placement,
    Replicated,
    Vocab,
    is_expert,
)
from ucp_store.patterns.layout import (
    Copy,
    LocalLayout,
    clear_layout_caches,
    is_writer,
    local_layout,
    shard_copies,
    tp_layout,
    writer_copies,
)
from ucp_store.patterns.parse import (
    check_pattern,
    clear_parse_caches,
    parse_pattern,
    pattern_to_json,
    validate_pattern_record,
    without_placement,
)
from ucp_store.patterns.placement import (
    canonical_names,
    expert_held,
    holds,
    placement_stages,
    stage_local_name,
    stages_of_placement,
)
from ucp_store.patterns.replicas import average_replicas
from ucp_store.patterns.zero import (
    FlatCopy,
    FlatLayout,
    Fragment,
    ZeroGroupLayout,
    clear_flat_caches,
    flat_layout,
    fragment_layout,
    fragment_writer_copies,
    zero_group_layout,
)

__all__ = [
    # kinds
    "KINDS", "TP_REPLICATED_KINDS", "STAGE_NAMES", "SCHEMA_FILE", "Placement", "Pattern", "Replicated", "Averaged",
    "DTensorSplit", "Partitioned", "Vocab", "Fused", "Expert", "ExpertMember", "REPLICATED", "is_expert",
    # parsing and validation
    "parse_pattern", "pattern_to_json", "validate_pattern_record", "check_pattern", "without_placement",
    # placement
    "placement_stages", "stages_of_placement", "holds", "expert_held", "stage_local_name", "canonical_names",
    # geometry (re-exported from ucp_store.geometry)
    "Box", "FlatRange", "flat_range_to_boxes", "row_major_strides", "split_contiguous",
    # TP/EP layouts and writers
    "Copy", "LocalLayout", "tp_layout", "local_layout", "is_writer", "shard_copies", "writer_copies",
    # ZeRO
    "FlatCopy", "Fragment", "FlatLayout", "ZeroGroupLayout", "zero_group_layout", "fragment_layout", "flat_layout",
    "fragment_writer_copies",
    # replicas
    "average_replicas",
    "clear_caches",
]


def clear_caches() -> None:
    """Forget memoised parses and layouts (for benchmarks; results never depend on the caches)."""
    clear_parse_caches()
    clear_layout_caches()
    clear_flat_caches()
