"""A direct DeepSpeed save at TP > 1 (or of a model with ``universal_checkpoint_info`` patterns), ZeRO-1/2.

:class:`TPPlan` splits the parameters into the ones every rank writes in place and the ones gathered to
their stage's first rank, which merges them by the file importer's own rules (``DeepSpeedReader.merge_param``
and its weight records, run by :class:`_Merger` over slices gathered from the ranks instead of read from
files) and writes the result whole. Used by :func:`ucp_store.deepspeed.write.write_rank_share`.
"""

from __future__ import annotations

from typing import Any

import torch

from ucp_store.deepspeed.merge import UniversalInfo, pattern_for
from ucp_store.deepspeed.reader import DeepSpeedReader
from ucp_store.deepspeed.write_plan import ParamSpec, RankPart, RankSnapshot, ShareResult, StagedFiles, numel
from ucp_store.errors import ConfigurationError, SourceFormatError, UcpError
from ucp_store.topology import Topology

__all__ = ["TPPlan"]

Entry = tuple[str, str, str, int]  # (parameter name, state, dtype, elements) of a gathered fragment


class _Merger(DeepSpeedReader):
    """The file importer's per-parameter merge (``DeepSpeedReader.merge_param``: the TP rule from
    ``universal_checkpoint_info`` or inferred, ``merge_tp_slices``, the pattern, ``averaged`` deviations, the
    step check, the low-precision weight check) over TP slices gathered from the ranks, not read from files:
    the same code, so the same arithmetic and the same bytes. A subclass because that code reads the module
    weights through ``_module_entries``, which here are the gathered ones (``lp``) instead of a file's."""

    def __init__(self, info: UniversalInfo, tp: int, pp: int, zero_stage: int, stages_of: dict, layered: bool,
                 optim_files: dict):
        self.tag_dir = "<ucp engine>"
        self.lp_weights = "auto"
        self.notes = []
        self.info, self.tp, self.pp, self.zero_stage = info, tp, pp, zero_stage
        self.stages_of = stages_of
        self.layer_files = {(0, 0): "layers"} if layered else {}
        self.optim_files = optim_files
        self.lp: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def _module_entries(self, pp: int, tp: int) -> dict[str, torch.Tensor]:
        return self.lp.get((pp, tp), {})


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat (what travels between ranks)."""
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(-1)


def _itemsize(dt: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dt)).element_size()


class TPPlan:
    """A save at TP > 1 (or of a model with ``universal_checkpoint_info`` patterns), ZeRO-1/2.

    Every parameter gets the file importer's rule (``UniversalInfo.rule``). A parameter the rule concatenates
    along one dimension in equal widths (column- and row-parallel weights) is *direct*: each rank writes its
    ZeRO fragments of its TP slice through ``write_shard`` with the ``partitioned`` pattern. Every other one
    (TP-replicated norms and biases, averaged, fused sub-parameters, vocabularies, affine maps, and every
    parameter of a TP model without patterns, whose rule depends on the data) is *gathered*: its fragments
    travel (bytes over the save's gloo group, point to point, bounded by its timeout) to the stage's first rank
    (tp 0, dp 0), which runs the importer's own merge (:class:`_Merger`) and writes the result whole. Only the
    gathered parameters move, and in Megatron models they are the small ones. Frozen parameters and buffers
    travel the same way (``gather_weights``) and are merged by the importer's ``_weight_records``."""

    def __init__(self, parts: list[RankPart], topo: Topology):
        self.topo = topo
        self.parts = {int(p.rank): p for p in parts}
        if topo.zero_stage >= 3:
            raise ConfigurationError("the ucp engine saves ZeRO-3 only at TP=1 and without universal_checkpoint_info "
                                     "patterns; save with DeepSpeed's engine and `ucp import deepspeed`")
        uci = next((self.parts[r].uci_raw for r in sorted(self.parts) if self.parts[r].uci_raw), None)
        self.info = UniversalInfo(uci, topo.tp)
        self.notes: list[str] = []
        self.direct: dict[str, tuple[dict | None, dict]] = {}  # name -> (pattern, universal meta)
        self.gather: list[ParamSpec] = []
        self._stages_of: dict = {}
        self._layered = False
        self._buffers: list[str] = []

    def _rank(self, stage: int, dp: int, tp: int) -> int:
        return tp + self.topo.tp * (dp + self.topo.dp * stage)

    # ------------------------------------------------------------------------- plan
    def plan(self, params: list[ParamSpec], buffers: list[str], stages_of: dict, layered: bool) -> None:
        """Split ``params`` into direct and gathered ones; give each spec its per-TP ``shapes`` and, if direct,
        its logical ``shape``."""
        topo = self.topo
        self._stages_of, self._layered = stages_of, layered
        self._buffers = list(buffers)
        for spec in params:
            spec.shapes = self._tp_shapes(spec)
            shapes = spec.shapes
            rule = self.info.rule(spec.name)
            if self.info.has_patterns and rule.kind == "cat" and not rule.vocab:
                d = rule.cat_dim
                pat = pattern_for(spec.name, rule, self.info, [torch.empty(s, device="meta") for s in shapes],
                                  topo.tp)
                same = all(len(s) == len(shapes[0]) and all(a == b for i, (a, b) in enumerate(zip(s, shapes[0]))
                                                            if i != d) for s in shapes)
                if same and ((pat is None and topo.tp == 1) or
                             (pat is not None and pat.get("kind") == "partitioned" and "widths" not in pat
                              and pat.get("dim") == d)):
                    logical = list(shapes[0])
                    if topo.tp > 1:
                        logical[d] = sum(s[d] for s in shapes)
                    spec.shape = tuple(logical)
                    self.direct[spec.name] = (pat, {"cat_dim": d})
                    continue
            self.gather.append(spec)

    def _tp_shapes(self, spec: ParamSpec) -> list[tuple[int, ...]]:
        """``spec``'s shape on every TP rank of its stage (from the first rank of each with model states)."""
        shapes = []
        for t in range(self.topo.tp):
            holder = next((p for r, p in sorted(self.parts.items()) if p.stage == spec.stage
                           and p.tp == t and p.param_shapes is not None), None)
            if holder is None or holder.param_shapes is None:
                raise UcpError(f"no model states for pipeline stage {spec.stage} TP rank {t}")
            grp = holder.param_shapes[spec.group] if spec.group < len(holder.param_shapes) else []
            found = dict(grp).get(spec.name)
            if found is None:
                raise SourceFormatError(f"{holder.model_file}: param_shapes lacks {spec.name!r} which TP "
                                        "rank 0 has")
            shapes.append(tuple(found))
        return shapes

    def _merger(self) -> _Merger:
        topo = self.topo
        optim_files = {(p.stage * topo.tp + p.tp, p.dp): p.optim_file for p in self.parts.values()}
        return _Merger(self.info, topo.tp, topo.pp, topo.zero_stage, self._stages_of, self._layered, optim_files)

    # ------------------------------------------------------------------------- frozen parameters and buffers
    def gather_weights(self, group: Any, writer, entries: dict[str, torch.Tensor], rank: int, stage: int,
                       position: dict[str, int], kinds: dict[str, str]) -> None:
        """Frozen parameters and buffers (whole module tensors, from DP rank 0 of every TP rank of a stage): sent to
        the stage's first rank, which merges their TP copies as the importer's ``_weight_records`` does (the
        same code) and writes them."""
        import torch.distributed as dist

        topo = self.topo
        dst = self._rank(stage, 0, 0)
        mine = self.parts[rank].weights or []
        if rank != dst:
            if mine:
                payload = torch.cat([_bytes(entries[n]) for n, _, _ in mine])
                if payload.numel():
                    dist.send(payload, dst=dst, group=group)
            return
        merger = self._merger()
        merger.params, merger.buffers = [], self._buffers
        for t in range(topo.tp):
            r = self._rank(stage, 0, t)
            ents = self.parts[r].weights or []
            if r == rank:
                merger.lp[(stage, t)] = {n: entries[n].detach().cpu() for n, _, _ in ents}
                continue
            sizes = [numel(shape) * _itemsize(dt) for _, dt, shape in ents]
            buf = torch.empty(sum(sizes), dtype=torch.uint8)
            if buf.numel():
                dist.recv(buf, src=r, group=group)
            got, off = {}, 0
            for (n, dt, shape), nb in zip(ents, sizes):
                got[n] = buf[off:off + nb].clone().view(getattr(torch, dt)).reshape(shape)
                off += nb
            merger.lp[(stage, t)] = got
        for rec in merger._weight_records(None):
            writer.write(rec.name, "weight", rec.states["weight"], pattern=rec.pattern_for("weight"),
                         position=position.get(rec.name, len(position)) * 16)
            kinds[rec.name] = rec.kind
        self.notes.extend(merger.notes)

    # ------------------------------------------------------------------------- gathered parameters
    def _entries(self, part: RankPart, specs: list[ParamSpec]) -> list[Entry]:
        """What ``part``'s rank sends for the gathered parameters ``specs``, in order: (name, state, dtype,
        elements); state ``__lp__`` is its low-precision module weight (from DP rank 0 only)."""
        out = []
        for spec in specs:
            g = spec.group
            m = part.mapping(g, spec.name)
            if m is not None:
                for st, dt in (part.flat or [])[g]:
                    out.append((spec.name, st, dt, int(m[1])))
        if part.dp == 0 and part.lp_dtype is not None:
            for spec in specs:
                out.append((spec.name, "__lp__", part.lp_dtype, numel(spec.shapes[part.tp])))
        return out

    def gather_merge_write(self, group: Any, writer, files: StagedFiles, snap: RankSnapshot, position: dict[str, int],
                           result: ShareResult) -> None:
        """Send this rank's fragments of the gathered parameters of its stage to the stage's first rank; there,
        merge each with the importer's rules and write it."""
        import torch.distributed as dist

        rank, stage = snap.rank, snap.stage
        specs = [s for s in self.gather if s.stage == stage]
        if not specs:
            return
        payload = self._payload(files, snap, specs)
        if rank != self._rank(stage, 0, 0):
            if payload.numel():
                dist.send(payload, dst=self._rank(stage, 0, 0), group=group)
            return
        data = self._receive(group, rank, stage, specs, payload)
        merger = self._merger()
        for t in range(self.topo.tp):
            r0 = self._rank(stage, 0, t)
            merger.lp[(stage, t)] = {n: v.reshape(spec.shapes[t]) for spec in specs
                                     for (n, st), v in data.get(r0, {}).items() if st == "__lp__" and n == spec.name}
        for spec in specs:
            self._merge_write(merger, writer, spec, data, position, result)
        self.notes.extend(merger.notes)

    def _payload(self, files: StagedFiles, snap: RankSnapshot, specs: list[ParamSpec]) -> torch.Tensor:
        """This rank's bytes of the gathered parameters ``specs``, in the order of ``_entries``."""
        pieces = []
        for name, st, _dt, n in self._entries(self.parts[snap.rank], specs):
            spec = next(s for s in specs if s.name == name)
            if st == "__lp__":
                lp = snap.lp.get(name)
                if lp is None:
                    raise UcpError(f"rank {snap.rank}: no module weight {name!r} to compare with its fp32 master")
                t = lp.detach().reshape(-1)
            else:
                g = spec.group
                start = int(files.osd["param_slice_mappings"][g][name].start)
                t = files.flat_states(g)[0][st].narrow(0, start, n)
            pieces.append(_bytes(t))
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)

    def _receive(self, group: Any, rank: int, stage: int, specs: list[ParamSpec],
                 payload: torch.Tensor) -> dict[int, dict[tuple[str, str], torch.Tensor]]:
        """On the stage's first rank: every rank of the stage's fragments, by rank and (name, state)."""
        import torch.distributed as dist

        data: dict[int, dict[tuple[str, str], torch.Tensor]] = {}
        for r in sorted(self.parts):
            part = self.parts[r]
            if part.stage != stage:
                continue
            ents = self._entries(part, specs)
            size = sum(n * _itemsize(dt) for _, _, dt, n in ents)
            if r == rank:
                buf = payload
            else:
                buf = torch.empty(size, dtype=torch.uint8)
                if size:
                    dist.recv(buf, src=r, group=group)
            if buf.numel() != size:
                raise UcpError(f"rank {r} sent {buf.numel()} bytes of TP fragments, expected {size}")
            off = 0
            got: dict[tuple[str, str], torch.Tensor] = {}
            for name, st, dt, n in ents:
                dtype = getattr(torch, dt)
                nb = n * torch.empty(0, dtype=dtype).element_size()
                got[(name, st)] = buf[off:off + nb].clone().view(dtype)
                off += nb
            data[r] = got
        return data

    def _merge_write(self, merger: _Merger, writer, spec: ParamSpec,
                     data: dict[int, dict[tuple[str, str], torch.Tensor]], position: dict[str, int],
                     result: ShareResult) -> None:
        """Merge one gathered parameter's slices with the importer's rules and write every state of it."""
        topo = self.topo
        name, g, stage = spec.name, spec.group, spec.stage
        per_state: dict[str, list[torch.Tensor]] = {}
        step_list: list = []
        for t in range(topo.tp):
            frags: dict[str, list[torch.Tensor]] = {}
            count = 0
            for d in range(topo.dp):
                r = self._rank(stage, d, t)
                part = self.parts[r]
                m = part.mapping(g, name)
                if m is None:
                    continue
                for st, _dt in (part.flat or [])[g]:
                    frags.setdefault(st, []).append(data[r][(name, st)])
                count += int(m[1])
                step_list.append(((part.gsteps or [])[g], (stage * topo.tp + t, d)))
            if count == 0:
                per_state = {}
                break
            if count != numel(spec.shapes[t]):
                raise SourceFormatError(f"the fragments of {name!r} on TP rank {t} cover {count} of its "
                                        f"{numel(spec.shapes[t])} elements")
            for k, fs in frags.items():
                per_state.setdefault(k, []).append(torch.cat(fs).reshape(spec.shapes[t]))
        rec = merger.merge_param(name, {"name": name, "stage": stage, "group": g, "shapes": spec.shapes},
                                 per_state, step_list, [])
        base = position[name] * 16
        for j, (state, value) in enumerate(rec.states.items()):
            writer.write(name, state, value, pattern=rec.pattern_for(state), position=base + j)
        if "fp32" in rec.states:
            result.metas[name] = rec.meta
        if rec.step_type:
            result.steps[name] = rec.step_type
        result.kinds[name] = rec.kind
