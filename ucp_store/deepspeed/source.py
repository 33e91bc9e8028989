"""Direct import of a DeepSpeed ``save_checkpoint`` tag folder (no ``ds_to_universal`` step).

For every parameter the import stores the logical (TP-merged, padding-stripped) fp32 master, the
optimizer moments (``exp_avg``, ``exp_avg_sq``, or whatever per-element state the optimizer keeps) and
``step``, merged exactly the way ``ds_to_universal`` merges them (bit for bit), plus a per-tensor pattern
record converted from ``universal_checkpoint_info`` or inferred from shapes and fragment mappings. Frozen
parameters and buffers come from the module state (state ``weight``); so do low-precision weights that
differ from ``fp32`` cast down. The pieces, by job:

- ``deepspeed_files``: file names, DeepSpeed's own keys, pipeline placement, source hashing;
- ``deepspeed_merge``: merge rules (``UniversalInfo``, ``Rule``, ``merge_tp_slices``, ``pattern_for``)
  and ``ParamRecord``;
- ``deepspeed_reader``: ``DeepSpeedReader``, streaming logical parameters out of memory-mapped files;
- this module: :class:`DeepSpeedSource` (the reader as a :class:`~ucp_store.formats.base.Source`) and
  :func:`import_deepspeed`, which hands it to ``import_source``.

    reader = DeepSpeedReader("ckpt/global_step100")
    for rec in reader.records():          # ParamRecord(name, states={"fp32": ..., ...}, pattern, ...)
        ...
    import_deepspeed(store, "ckpt/global_step100", run="r")       # -> checkpoint id

Under ``torchrun`` (torch.distributed initialised) ``import_deepspeed`` splits the parameters and the
source files across ranks (byte-balanced, contiguous shares; positions in the global order so ZeRO group
layouts are the same as a single-process import); rank 0 also writes the frozen parameters and buffers;
objects are gathered from every rank; rank 0 commits once after a barrier.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.autoep import DeepSpeedAutoEPReader, is_autoep_tag
from ucp_store.deepspeed.files import (
    DS_MODEL_KEYS,
    EXPERT_RE,
    LAYER_RE,
    MODEL_RE,
    OPTIM_RE,
    SHARDED_KEYS,
    UCI,
    ZERO3_MODEL_RE,
    hash_files,
    pipeline_placement,
)
from ucp_store.deepspeed.merge import (
    SCALE_POWER,
    ParamRecord,
    Rule,
    UniversalInfo,
    merge_tp_slices,
    numel_of,
    pattern_for,
    with_placement,
)
from ucp_store.deepspeed.moe import open_tag_reader
from ucp_store.deepspeed.reader import DeepSpeedReader, read_zero_checkpoint, release_pages
from ucp_store.errors import SourceFormatError
from ucp_store.formats.base import TensorRecord, import_source
from ucp_store.formats.base import write_records as _write_groups
from ucp_store.io.window import prefetch

__all__ = [
    "ParamRecord", "DeepSpeedReader", "DeepSpeedSource", "UniversalInfo", "read_zero_checkpoint", "import_deepspeed",
    "merge_tp_slices", "hash_files", "write_records", "param_groups", "pattern_for", "release_pages", "Rule",
    "pipeline_placement", "with_placement", "SCALE_POWER", "DS_MODEL_KEYS", "SHARDED_KEYS", "UCI", "MODEL_RE",
    "ZERO3_MODEL_RE", "OPTIM_RE", "LAYER_RE", "EXPERT_RE",
]

_with_placement = with_placement  # old private name, still imported by callers on other branches


def param_groups(records: Iterable[ParamRecord], positions: dict[str, int] | None = None,
                 on_record: Callable[[ParamRecord], None] | None = None) -> Iterator[tuple[TensorRecord, ...]]:
    """Each ``ParamRecord`` as one group of ``TensorRecord`` (its states, with their patterns).

    With ``positions`` (name -> global index) state ``k`` of parameter ``i`` gets position ``16 i + k``:
    under torchrun every rank writes a share, and the global order keeps ZeRO group layouts."""
    for rec in records:
        base = None if positions is None else positions.get(rec.name)
        group = tuple(TensorRecord(rec.name, state, t, pattern=rec.pattern_for(state),
                                   position=None if base is None else base * 16 + k)
                      for k, (state, t) in enumerate(rec.states.items()))
        if on_record is not None:
            on_record(rec)
        yield group


def _prefetch(gen: Iterator[ParamRecord], max_bytes: int = 96 << 20, max_items: int = 64) -> Iterator[ParamRecord]:
    """Run ``gen`` in a background thread, at most ``max_bytes`` ahead (``_window.prefetch``)."""
    return prefetch(gen, nbytes=lambda r: r.nbytes, max_bytes=max_bytes, max_items=max_items,
                    name="ucp-deepspeed-reader")


def write_records(writer, records: Iterable[ParamRecord], *, progress: bool = False, total: int | None = None,
                  on_record: Callable[[ParamRecord], None] | None = None, inflight_bytes: int | None = None,
                  positions: dict[str, int] | None = None) -> int:
    """Write every state of every ``ParamRecord`` into a CheckpointWriter; returns bytes written.

    Kept for callers of the old API: ``import_source`` is the way to import a source."""
    return _write_groups(writer, param_groups(records, positions, on_record), inflight_bytes=inflight_bytes,
                         progress=progress, total=total)


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


class DeepSpeedSource:
    """A DeepSpeed tag folder as a :class:`~ucp_store.formats.base.Source`: one group of records per
    parameter (its states), read in a background thread; objects are the JSON-able model/optimizer state
    plus what a universal export needs (per-parameter ``ds_to_universal`` keys, step types, kinds).

    With ``world > 1`` this rank yields its byte-balanced share of the optimizer-owned parameters (rank 0
    also the frozen parameters and buffers), hashes its share of the files, and ``provenance`` gathers the
    hashes from every rank (a collective: every rank calls it, as ``import_source`` does)."""

    kind = "deepspeed"
    prefetch = True
    #: rank 0 reads the folder's shared objects, the other ranks add the notes of their share only
    objects_partitioned = True

    def __init__(self, tag_dir: str | os.PathLike, *, lp_weights: str = "auto", hash_sources: bool = True,
                 workers: int | None = None, rank: int = 0, world: int = 1, group: Any = None,
                 experts: str = "separate"):
        self.t0 = time.time()
        self.tag_dir = os.path.abspath(os.fspath(tag_dir))
        # AutoEP (fused experts, ZeRO-1/2 and ZeRO-3) before classic MoE: both write expert files under ZeRO-1/2
        self.reader = (DeepSpeedAutoEPReader(self.tag_dir, lp_weights=lp_weights) if is_autoep_tag(self.tag_dir)
                       else open_tag_reader(self.tag_dir, lp_weights=lp_weights, experts=experts))
        self.hash_sources = hash_sources
        self.workers = workers
        self.rank, self.world, self.group = rank, world, group
        self._provenance: dict | None = None
        self._metas: dict[str, Any] = {}
        self._steps: dict[str, str] = {}
        self._kinds: dict[str, str] = {}
        r = self.reader
        self.total = len(r.params) + len(r.frozen) + len(r.buffers)

    @property
    def step(self) -> int:
        """The checkpoint's ``global_steps`` (the default step of the imported version)."""
        if self.reader.global_steps is None:
            raise SourceFormatError(f"{self.tag_dir}: model states carry no global_steps; pass step=")
        return int(self.reader.global_steps)

    def describe(self) -> str:
        return self.tag_dir

    def provenance(self) -> dict:
        if self._provenance is None:
            r = self.reader
            files = r.source_files
            hashes: dict[str, str] = {}
            if self.hash_sources:
                mine = _share(files, [os.path.getsize(os.path.join(self.tag_dir, f)) for f in files], self.rank,
                              self.world)
                hashes = hash_files(self.tag_dir, mine, workers=self.workers)
                if self.world > 1:
                    # every rank's share to rank 0 alone (JSON bytes, never a pickle): only the coordinator
                    # records the provenance (distributed_begin); the others keep their own share's hashes
                    from ucp_store.distributed import coord

                    parts = coord.gather_bytes(coord.encode(hashes), self.group)
                    if parts is not None:
                        hashes = {k: v for p in parts for k, v in coord.decode(p).items()}
            self._provenance = {
                "source_kind": self.kind, "source_path": self.tag_dir, "source_topology": r.topology,
                "source_hashes": hashes, "library_versions": {"deepspeed": r.ds_version},
                "extra": {"zero_stage": r.zero_stage, "lp_dtype": sp._dtype_name(r.lp_dtype), "files": len(files),
                          "ranks": self.world},
            }
        return self._provenance

    def _note(self, rec: ParamRecord) -> None:
        if "fp32" in rec.states:
            self._metas[rec.name] = rec.meta
        if rec.step_type:
            self._steps[rec.name] = rec.step_type
        self._kinds[rec.name] = rec.kind

    def records(self) -> Iterator[tuple[TensorRecord, ...]]:
        r = self.reader
        if self.world == 1:
            return param_groups(r.records(), None, self._note)
        order = r.param_names()
        sizes = [numel_of(p["shapes"][0]) for p in r.params]
        mine = set(_share(order, sizes, self.rank, self.world))
        recs: Iterator[ParamRecord] = r.records(names=mine, include_weights=False)
        if self.rank == 0:
            recs = _chain(recs, r._weight_records(None))
        everything = list(order) + list(r.frozen) + list(r.buffers)
        positions = {n: i for i, n in enumerate(dict.fromkeys(everything))}
        return param_groups(recs, positions, self._note)

    def objects(self) -> dict[str, Any]:
        notes = {"deepspeed/universal_meta": self._metas, "deepspeed/step_types": self._steps,
                 "deepspeed/kinds": self._kinds}
        if self.rank != 0:
            return notes  # rank 0 reads the shared state; the others add what only they saw
        objs = self.reader.objects()
        objs.update(notes)
        objs["deepspeed/layout"]["import_seconds"] = round(time.time() - self.t0, 3)
        return objs


def import_deepspeed(store, tag_dir: str | os.PathLike, run: str, step: int | None = None, *,
                     message: str | None = None, workers: int | None = None, progress: bool = True,
                     lp_weights: str = "auto", hash_sources: bool = True, distributed: bool | None = None,
                     parent: str | None = "auto", experts: str = "separate") -> str:
    """Import a DeepSpeed tag folder into ``store`` as ``run@step``; returns the checkpoint id.

    ``step`` defaults to the checkpoint's ``global_steps``. Under ``torchrun`` (torch.distributed
    initialised; ``distributed=None`` detects it) every rank converts its share of the parameters and
    rank 0 commits after a barrier. On any error nothing is listed."""
    dist, rank, world = _dist_info()
    if distributed is False or dist is None:
        dist, rank, world = None, 0, 1
    source = DeepSpeedSource(tag_dir, lp_weights=lp_weights, hash_sources=hash_sources, workers=workers, rank=rank,
                             world=world, experts=experts)
    if step is None:
        step = source.step
    msg = message or f"import of DeepSpeed checkpoint {source.tag_dir}"
    return import_source(store, source, run, step, message=msg, parent=parent, progress=progress,
                         distributed=world > 1)


def _chain(*gens):
    for g in gens:
        yield from g


def main(argv=None) -> int:
    """``python -m ucp_store.deepspeed.source STORE TAG_DIR --run R [--step N]`` (also under torchrun)."""
    import argparse
    import json

    from ucp_store import open_store

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
        # an opener, not a store: under torchrun only the coordinator (rank 0) opens the catalog, inside the
        # import's begin; the other ranks get the store's location in its broadcast and never connect
        def store():
            return open_store(args.store, create=True)

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
