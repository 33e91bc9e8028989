"""Issue 30's adversarial pass as data: one case per reproduction of items 1-11 (``issue="30.N"``), and their
neighbours (other names, values, dtypes, shapes, store files and commands of the same kind).

Inputs come from the real producers (``torch.save``, safetensors, ``torch.distributed.checkpoint.save``,
real symlinks and FIFOs); every hostile store file is made by hand from a store this library wrote.
"""

from __future__ import annotations

import glob
import json
import math
import os
import pickle
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ucp_store
from ucp_store.errors import (
    CatalogError,
    ConfigurationError,
    DuplicateEntryError,
    InvalidNameError,
    SourceFormatError,
    UcpError,
    ValidationError,
)

from .framework import (
    CLEAN_ERROR,
    EXACT_ROUNDTRIP,
    EXIT_FAIL,
    EXIT_USAGE,
    NOTHING_DELETED,
    Case,
    Ctx,
    Outcome,
    close_to,
    nothing,
)

FAILS = (EXIT_FAIL, EXIT_USAGE)  # an option's value refused by argparse (2) or by the command (1)
BAD_SETTING = (ValidationError, ConfigurationError)  # a value out of range: the data's fault or the setting's
W = torch.arange(24.0).reshape(4, 6)  # the seeded store's r@1 'w' (framework.seed_store)
SEEDED = ("r@1", "r@2", "r@3")  # the seeded store's versions


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def S(ctx: Ctx) -> list[str]:
    return ["--store", str(ctx.store)]


def seeded(ctx: Ctx) -> None:
    ctx.seed()


def cli(*argv: str) -> Callable[[Ctx], list[str]]:
    """A command line against the case's store; ``{inp}``, ``{store}``, ... are filled from the context."""
    return lambda ctx: [a.format(**ctx.fields()) for a in argv] + S(ctx)


def err(id: str, surface: str, kind: str, build, expect, needle, *, issue: str = "", **call) -> Case:
    return Case(id, surface, kind, build, CLEAN_ERROR, expect=expect, needle=needle, issue=issue, **call)


def exact(id: str, surface: str, kind: str, build, want, *, issue: str = "", **call) -> Case:
    return Case(id, surface, kind, build, EXACT_ROUNDTRIP, want=want, issue=issue, **call)


def kept(id: str, surface: str, kind: str, build, *, issue: str = "", **call) -> Case:
    return Case(id, surface, kind, build, NOTHING_DELETED, issue=issue, **call)


def files_of(ctx: Ctx, ref: str, tensor: str | None = None) -> list[Path]:
    """The files of a version's arrays (of one tensor's array when ``tensor`` is given)."""
    store = ctx.open()
    ck = store.checkpoint(ref)
    arrays = [t.array for t in ck.tensors() if tensor is None or t.name == tensor]
    store.catalog.engine.dispose()
    return sorted(Path(p) for a in arrays for p in glob.glob(str(ctx.store / a / "**"), recursive=True)
                  if os.path.isfile(p))


def shard_of(ctx: Ctx, ref: str, tensor: str) -> Path:
    return next(p for p in files_of(ctx, ref, tensor) if "/c/" in str(p))


# --- item 1: the streaming writer and the caller's memory -------------------------------------------------------

def mutated_after_write(kind: str) -> Callable[[Ctx], Any]:
    """Issue 30's reproduction: change the tensor in place after write(), before the with block ends; then
    save the original values again (dedup) and read them back."""
    def call(ctx):
        s = ctx.open()
        base = torch.randn(512, 512, generator=gen(1))
        o = base.clone()
        u = {"plain": base, "view": base.t(), "numpy": base.numpy()}[kind]
        with s.begin("m", 1) as w:
            w.write("u", "weight", u)
            base.mul_(0)
        s.save("m", 2, {"u": o if kind != "view" else o.t()})
        return s.checkpoint("m@2").read("u")
    return call


def mutated_want(kind: str) -> Callable[[Ctx], Any]:
    o = torch.randn(512, 512, generator=gen(1))
    return lambda ctx: o.t().contiguous() if kind == "view" else o


# --- item 2: symlinks under arrays/ -----------------------------------------------------------------------------

def link_arrays_folder(ctx: Ctx) -> None:
    """`ln -s OUTSIDE store/arrays/feedfacefeedface` in a seeded store."""
    ctx.seed()
    os.symlink(ctx.outside, ctx.store / "arrays" / "feedfacefeedface")


def link_array_in_version(ctx: Ctx) -> None:
    """A symlink posing as an array folder inside r@1's checkpoint folder."""
    ctx.seed()
    cid = ctx.open().resolve("r@1")
    os.symlink(ctx.outside, ctx.store / "arrays" / cid / "deadbeefdeadbeefdeadbeefdeadbeef.zarr")


def link_relative_arrays_folder(ctx: Ctx) -> None:
    ctx.seed()
    os.symlink(os.path.relpath(ctx.outside, ctx.store / "arrays"), ctx.store / "arrays" / "0badc0de0badc0de")


def link_shard_file(ctx: Ctx) -> None:
    """r@2's shard file replaced by a symlink to a copy of it outside the store."""
    ctx.seed()
    shard = shard_of(ctx, "r@2", "w")
    target = ctx.outside / "nested" / "shard-copy"
    shutil.copyfile(shard, target)
    shard.unlink()
    os.symlink(target, shard)


# --- item 3: retention values -------------------------------------------------------------------------------------

def retention_api(**kw) -> Callable[[Ctx], Any]:
    return lambda ctx: ctx.open().set_retention("r", **kw)


def gc_api(**kw) -> Callable[[Ctx], Any]:
    return lambda ctx: ctx.open().gc(**kw)


def huge_retention_keeps_all(ctx):
    s = ctx.open()
    s.set_retention("r", keep_last=10**6, keep_every=10**6)
    s.gc()
    return sorted(f"{c['run']}@{c['step']}" for c in s.list_checkpoints())


# --- item 4: store folders with URL-like names ----------------------------------------------------------------

def odd_folder(name: str) -> Callable[[Ctx], Any]:
    """``ucp init`` a store in a folder named ``name``, save through the API, read back through a fresh open:
    the catalog and the arrays both land in that one folder, and nothing else appears beside it."""
    def call(ctx):
        root = ctx.tmp / "stores" / name
        rc, _, e = ctx.ucp("init", "--store", root)
        if rc:
            raise UcpError(e)
        ucp_store.open_store(str(root)).save("r", 1, {"w": W})
        got = ucp_store.open_store(str(root)).checkpoint("r@1").read("w")
        rc, out, e = ctx.ucp("read", "r@1", "w", "--json", "--store", root)
        if rc:
            raise UcpError(e)
        return got, json.loads(out)["values"], sorted(os.listdir(ctx.tmp / "stores")), (root / "catalog.db").is_file()
    return call


def odd_folder_want(name: str) -> Callable[[Ctx], Any]:
    return lambda ctx: (W, W.tolist(), [name], True)


# --- item 5: objects ---------------------------------------------------------------------------------------------

def object_roundtrip(value: Any) -> Callable[[Ctx], Any]:
    def call(ctx):
        s = ctx.open()
        s.save("o", 1, {"w": torch.ones(2)}, objects={"value": value})
        return ucp_store.open_store(str(ctx.store)).checkpoint("o@1").objects()["value"]
    return call


OBJECTS_FLAT = {"lr": 1.0, "neg": -0.0, "big": 2**64 - 1, "small": -(2**63), "one": 1, "flag": True, "none": None,
                "tiny": 5e-324, "text": "1.0", "uni": "héllo ✓ 𝔘"}


def torch_with_objects(ctx):
    torch.save({"w": torch.ones(3), **OBJECTS_FLAT}, ctx.inp / "o.pt")


def torch_objects_import(ctx):
    from ucp_store.formats.torch_file import import_torch_file

    ck = import_torch_file(ctx.open(), str(ctx.inp / "o.pt"), "t", 1, progress=False)
    objs = ucp_store.open_store(str(ctx.store)).checkpoint(ck.id).objects()
    return {k: objs[k] for k in OBJECTS_FLAT}


def dcp_with_objects(ctx):
    import torch.distributed.checkpoint as dcp

    _quiet(lambda: dcp.save({"model": {"w": torch.ones(3)}, **OBJECTS_FLAT}, checkpoint_id=str(ctx.inp / "d")))


def dcp_objects_roundtrip(ctx):
    """import dcp, export dcp, and read the exported folder's values back with DCP's own loader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ucp_store.formats.dcp.adapter import export_dcp, import_dcp

    ck = import_dcp(ctx.open(), str(ctx.inp / "d"), "d", 1, progress=False)
    export_dcp(ucp_store.open_store(str(ctx.store)).checkpoint(ck.id), str(ctx.inp / "out"), progress=False)
    _quiet(lambda: dcp_to_torch_save(str(ctx.inp / "out"), str(ctx.inp / "back.pt")))
    back = torch.load(ctx.inp / "back.pt", weights_only=False)  # the test's own file, written just above
    return {k: back[k] for k in OBJECTS_FLAT}


def _quiet(fn):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to save in a single process"
        return fn()


def nested(depth: int) -> Any:
    v: Any = [1.0, -0.0]
    for i in range(depth):
        v = {f"k{i}": v} if i % 2 else [v]
    return v


# --- items 6 and 8: DCP chunks that do not tile the tensor, absurd declared sizes ------------------------------

def _dcp_two_chunks(ctx: Ctx, chunks: list[tuple[list[int], list[int]]], size=(4, 3)) -> Path:
    """A DCP folder whose tensor 'tiled' is declared as ``chunks`` ((offsets, sizes) per chunk), each chunk's
    storage taken from a real tensor written by dcp.save under a helper key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    d = ctx.inp / "dcp"
    parts = {f"part{i}": torch.arange(float(np.prod(sz))).reshape(sz) + 100 * i for i, (_, sz) in enumerate(chunks)}
    _quiet(lambda: dcp.save({"keep": torch.ones(2), **parts}, checkpoint_id=str(d)))
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own file, written by DCP a moment ago
    first = md.state_dict_metadata["part0"]
    first.size = torch.Size(size)
    first.chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(sz)) for o, sz in chunks]
    md.state_dict_metadata["tiled"] = first
    for i, (o, _) in enumerate(chunks):
        key = f"part{i}"
        info = md.storage_data.pop(MetadataIndex(key, torch.Size([0] * len(size))))
        md.storage_data[MetadataIndex("tiled", torch.Size(o))] = info
        if i:
            del md.state_dict_metadata[key]
    del md.state_dict_metadata["part0"]
    if md.planner_data:
        md.planner_data = {k: v for k, v in md.planner_data.items() if not k.startswith("part")}
        md.planner_data["tiled"] = ("tiled",)
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return d


def dcp_tiles(ctx):
    _dcp_two_chunks(ctx, [([0, 0], [2, 3]), ([2, 0], [2, 3])])


def dcp_duplicate_chunk(ctx):
    """Issue 30's reproduction: one chunk declared twice; the sizes add up, rows 2-3 are never written."""
    _dcp_two_chunks(ctx, [([0, 0], [2, 3]), ([0, 0], [2, 3])])


def dcp_overlap_and_gap(ctx):
    _dcp_two_chunks(ctx, [([0, 0], [3, 3]), ([1, 0], [1, 3])])


def dcp_chunk_outside(ctx):
    _dcp_two_chunks(ctx, [([0, 0], [2, 3]), ([3, 0], [2, 3])])


def dcp_declared_size(size: list[int]) -> Callable[[Ctx], None]:
    def build(ctx):
        """A DCP folder whose tensor 'tiled' declares ``size`` over one small chunk (refused before allocating)."""
        _dcp_two_chunks(ctx, [([0] * len(size), [2] + [1] * (len(size) - 1))], size=tuple(size))
    return build


def dcp_import(ctx):
    from ucp_store.formats.dcp.adapter import import_dcp

    ck = import_dcp(ctx.open(), str(ctx.inp / "dcp"), "imp", 1, progress=False)
    return ucp_store.open_store(str(ctx.store)).checkpoint(ck.id).read("tiled")


def tiled_want(ctx):
    return torch.cat([torch.arange(6.0).reshape(2, 3), torch.arange(6.0).reshape(2, 3) + 100])


# --- item 7: stats --------------------------------------------------------------------------------------------

STATS_X64 = (1e8 + 1e-3 * torch.randn(20000, generator=gen(7), dtype=torch.float64))
STATS_X32 = (1000.0 + 0.01 * torch.randn(20000, generator=gen(8))).float()


def save_stats_inputs(ctx):
    ctx.open().save("s", 1, {"x64": STATS_X64, "x32": STATS_X32})


def numpy_stats(t: torch.Tensor) -> dict:
    x = t.numpy().astype(np.float64)
    return {"mean": float(x.mean()), "std": float(x.std())}


def stats_api(name: str):
    def call(ctx):
        st = ctx.open().checkpoint("s@1").stats(name)[0]
        return {"mean": st.mean, "std": st.std}
    return call


def stats_json(ctx, out: Outcome):
    row = json.loads(out.stdout)[0]
    return {"mean": row["mean"], "std": row["std"]}


# --- item 8: inputs that crashed with a traceback -------------------------------------------------------------

def corrupt_catalog(ctx):
    ctx.seed()
    (ctx.store / "catalog.db").write_bytes(np.random.default_rng(30).bytes(64 * 1024))


def truncated_catalog(ctx):
    ctx.seed()
    db = ctx.store / "catalog.db"
    db.write_bytes(db.read_bytes()[:100])


def catalog_is_a_folder(ctx):
    ctx.seed()
    (ctx.store / "catalog.db").unlink()
    (ctx.store / "catalog.db").mkdir()


DEEP = 100_000


def deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


def _hf_folder(ctx) -> Path:
    from safetensors.torch import save_file

    d = ctx.inp / "hf"
    d.mkdir(exist_ok=True)
    save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, str(d / "model.safetensors"))
    return d


def hf_deep_config(ctx):
    (_hf_folder(ctx) / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "deep": ' + deep_json() + "}")


def hf_digits_config(ctx):
    (_hf_folder(ctx) / "config.json").write_text('{"vocab_size": ' + "7" * 5000 + "}")


def hf_deep_header(ctx):
    d = ctx.inp / "hf"
    d.mkdir()
    raw = ('{"__metadata__": {"deep": "x"}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "z": '
           + deep_json() + "}").encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))


def hf_deep_index(ctx):
    d = _hf_folder(ctx)
    (d / "model.safetensors").rename(d / "a.safetensors")
    (d / "model.safetensors.index.json").write_text(
        '{"metadata": {"deep": ' + deep_json() + '}, "weight_map": {"model.embed_tokens.weight": "a.safetensors"}}')


def hf_huge_shape(ctx):
    d = ctx.inp / "hf"
    d.mkdir()
    raw = json.dumps({"wide": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


def hf_import(ctx):
    from ucp_store.formats.hf.adapter import import_hf

    return import_hf(ctx.open(), str(ctx.inp / "hf"), "imp", 1, progress=False)


def deep_config_file(ctx):
    ctx.seed()
    (ctx.inp / "config.json").write_text('{"deep": ' + deep_json() + "}")


def digits_config_file(ctx):
    ctx.seed()
    (ctx.inp / "config.json").write_text('{"vocab_size": ' + "9" * 5000 + "}")


def conj_torch_file(ctx):
    t = torch.complex(torch.arange(4.0), torch.arange(4.0) + 10).conj()
    assert t.is_conj()
    torch.save({"c": t}, ctx.inp / "c.pt")


def torch_import_read(name: str, path: str = "w.pt"):
    def call(ctx):
        from ucp_store.formats.torch_file import import_torch_file

        ck = import_torch_file(ctx.open(), str(ctx.inp / path), "imp", 1, progress=False)
        return ucp_store.open_store(str(ctx.store)).checkpoint(ck.id).read(name)
    return call


CONJ = torch.complex(torch.arange(4.0), -(torch.arange(4.0) + 10))


# --- item 10: one content hash for every save path -------------------------------------------------------------

def two_save_paths(ctx):
    """The same tensor saved through the engine's digest path (write_shard + chunk digests) and through save."""
    from ucp_store.topology import Topology

    t = torch.randn(64, 96, generator=gen(10))
    s = ctx.open()
    w = s.begin("eng", 1)
    w.write_shard("w", "fp32", t, shape=tuple(t.shape), pattern=None, topology=Topology(), rank=0, digest=True)
    for key, d in w.shard_digests().items():
        w.set_chunk_digests(key[0], key[1], d)
    w.commit()
    s.save("imp", 1, {"w": {"fp32": t.clone()}})


def diff_and_dedup(ctx):
    s = ctx.open()
    a, b = s.checkpoint("eng@1"), s.checkpoint("imp@1")
    from ucp_store.registry.checkpoint import diff

    return [r["status"] for r in diff(a, b)], a.info("w", "fp32").array == b.info("w", "fp32").array


# --- item 11 --------------------------------------------------------------------------------------------------

COMPLEX = torch.complex(torch.tensor([1.0, -2.5, 0.0]), torch.tensor([3.0, 0.5, -1.0]))
SPECIAL = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), -0.0])


def save_tensors(**tensors) -> Callable[[Ctx], None]:
    return lambda ctx: ctx.open().save("x", 1, tensors)


def strict_json(text: str) -> Any:
    """json.loads that refuses bare NaN / Infinity (not JSON)."""
    def bad(name):
        raise ValueError(f"bare {name} in the JSON output")
    return json.loads(text, parse_constant=bad)


def _number(v: Any) -> Any:
    """A JSON number back to Python: lists of two for complex, the usual spellings of non-finite floats."""
    if isinstance(v, str):
        words = {"nan": float("nan"), "infinity": float("inf"), "inf": float("inf"), "-infinity": -float("inf"),
                 "-inf": -float("inf")}
        return words.get(v.lower(), complex(v.replace(" ", "")) if "j" in v else float(v))
    if isinstance(v, dict):
        return complex(_number(v.get("real", v.get("re"))), _number(v.get("imag", v.get("im"))))
    if v is None:
        return float("nan")
    return v


def read_json_values(dtype: torch.dtype, pairs: bool = False) -> Callable[[Ctx, Outcome], Any]:
    def got(ctx, out):
        values = strict_json(out.stdout)["values"]
        flat = [_number(v) if not (isinstance(v, list) and len(v) == 2) else complex(*map(_number, v))
                for v in values]
        return torch.tensor(flat, dtype=dtype)
    return got


def stats_nonfinite(ctx, out):
    row = strict_json(out.stdout)[0]
    return row["nan"], row["inf"], _number(row["max"])


def diff_statuses(ctx, out):
    """name -> (status, whether the relative change is a positive number) from ``ucp diff --json``."""
    rows = strict_json(out.stdout)
    return {r["name"]: (r["status"], isinstance(r.get("relative_change"), float) and r["relative_change"] > 0)
            for r in rows}


def diff_nan(ctx, out):
    row = next(r for r in strict_json(out.stdout) if r["name"] == "n")
    return row["status"], math.isnan(_number(row["relative_change"]))


def save_nan_pair(ctx):
    s = ctx.open()
    s.save("n", 1, {"n": torch.tensor([1.0, float("nan")])})
    s.save("n", 2, {"n": torch.tensor([2.0, float("nan")])})


def zstd_store(ctx):
    """A zstd-compressed store (read through TensorStore, not localread) holding r@1 'w'."""
    shutil.rmtree(ctx.store)
    ucp_store.open_store(str(ctx.store), create=True, compression="zstd").save("r", 1, {"w": W})


def fifo_in_zstd(which: str) -> Callable[[Ctx], None]:
    def build(ctx):
        zstd_store(ctx)
        f = next(p for p in files_of(ctx, "r@1", "w") if ("/c/" in str(p)) == (which == "shard"))
        f.unlink()
        os.mkfifo(f)
    return build


def corrupt_w(ctx):
    """r@1's 'w' with one byte flipped inside its only chunk: every read of it fails its crc32c."""
    ctx.seed()
    shard = shard_of(ctx, "r@1", "w")
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 0x40
    shard.write_bytes(bytes(raw))


def swapped_shard(ctx):
    """r@1's 'v' shard file replaced by 'w''s (same shape, dtype and layout: every crc32c matches)."""
    ctx.seed()
    shutil.copyfile(shard_of(ctx, "r@1", "w"), shard_of(ctx, "r@1", "v"))


def swapped_chunks(ctx):
    """Two inner chunks of one shard file exchanged with their crc32c (each chunk checks, at the wrong place)."""
    from ucp_test_helpers import shard_file_and_range

    s = ctx.open()
    s.save("big", 1, {"x": torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024)})
    info = s.checkpoint("big@1").info("x")
    s.catalog.engine.dispose()
    path, a, n = shard_file_and_range(ctx.store, info, (0, 0))
    path_b, b, n_b = shard_file_and_range(ctx.store, info, (1, 0) if info.chunk_shape[0] < 256 else (0, 1))
    assert path == path_b and n == n_b, "the case needs two chunks of one shard file"
    raw = bytearray(path.read_bytes())
    raw[a:a + n], raw[b:b + n] = raw[b:b + n], raw[a:a + n]
    path.write_bytes(bytes(raw))


def fifo_in(ref: str, which: str) -> Callable[[Ctx], None]:
    def build(ctx):
        ctx.seed()
        f = next(p for p in files_of(ctx, ref, "w") if ("/c/" in str(p)) == (which == "shard"))
        f.unlink()
        os.mkfifo(f)
    return build


def fifo_folder(ctx):
    ctx.seed()
    os.mkfifo(ctx.store / "arrays" / "f1f0f1f0f1f0f1f0")


def orphan_array(ctx):
    """An array folder no row names (what a killed save leaves): gc deletes it and says how much it freed."""
    ctx.seed()
    src = next(p.parent for p in files_of(ctx, "r@2", "w") if p.name == "zarr.json")
    dest = ctx.store / "arrays" / "0123456789abcdef" / "00112233445566778899aabbccddeeff.zarr"
    shutil.copytree(src, dest)


def gc_freed(ctx, out):
    report = strict_json(out.stdout)
    return report["removed_arrays"], report["freed_bytes"] > 0


def corrupt_w_with_config(ctx):
    corrupt_w(ctx)
    (ctx.inp / "config.json").write_text('{"architectures": ["Toy"], "model_type": "toy"}')


def init_existing(ctx):
    ctx.seed()


def existing_dest(ctx):
    ctx.seed()
    (ctx.inp / "taken").mkdir()
    (ctx.inp / "taken" / "keep.txt").write_text("not ours\n")


# --- neighbours: dtypes, shapes, strides -------------------------------------------------------------------------

def random_bits(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor whose bytes are random: NaN payloads, -0.0, Inf, subnormals."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen(seed)).bool()
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen(seed))
    return raw.view(dtype).reshape(shape)


def save_read(make: Callable[[], Any], name: str = "t") -> Callable[[Ctx], Any]:
    def call(ctx):
        ctx.open().save("d", 1, {name: make()})
        return ucp_store.open_store(str(ctx.store)).checkpoint("d@1").read(name)
    return call


def want_tensor(make: Callable[[], Any]) -> Callable[[Ctx], Any]:
    def want(ctx):
        v = make()
        t = torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v
        return t.resolve_conj().resolve_neg().contiguous()
    return want


def dtype_case(dtype: torch.dtype, seed: int) -> Case:
    make = lambda: random_bits((5, 7), dtype, seed)  # noqa: E731
    return exact(f"api-dtype-{str(dtype).removeprefix('torch.')}-random-bits", "api", "dtypes", nothing,
                 want_tensor(make), api=save_read(make))


def strided_case(id: str, make: Callable[[], Any]) -> Case:
    return exact(f"api-{id}", "api", "strides", nothing, want_tensor(make), api=save_read(make))


def shape_case(id: str, make: Callable[[], Any]) -> Case:
    return exact(f"api-{id}", "api", "shapes", nothing, want_tensor(make), api=save_read(make))


# --- neighbours: foreign round trips --------------------------------------------------------------------------

SHARED_BASE = torch.arange(40.0)


def torch_shared_storage(ctx):
    torch.save({"a": SHARED_BASE[:10], "b": SHARED_BASE[5:25].view(4, 5), "c": SHARED_BASE.view(8, 5).t()},
               ctx.inp / "w.pt")


def torch_shared_read(ctx):
    from ucp_store.formats.torch_file import import_torch_file

    ck = import_torch_file(ctx.open(), str(ctx.inp / "w.pt"), "imp", 1, progress=False)
    ck = ucp_store.open_store(str(ctx.store)).checkpoint(ck.id)
    return [ck.read(n) for n in ("a", "b", "c")]


def hf_odd_tensors(ctx):
    from safetensors.torch import save_file

    d = ctx.inp / "hf"
    d.mkdir()
    save_file({"empty": torch.zeros(0, 3), "bf": random_bits((3, 4), torch.bfloat16, 3),
               "scalar": torch.tensor(2.5)}, str(d / "model.safetensors"))


def hf_odd_read(ctx):
    ck = hf_import(ctx)
    ck = ucp_store.open_store(str(ctx.store)).checkpoint(ck if isinstance(ck, str) else ck.id)
    return [ck.read(n) for n in ("empty", "bf", "scalar")]


def tensor_collision(ctx):
    torch.save({"a": {"b": torch.ones(2)}, "a.b": torch.zeros(2)}, ctx.inp / "w.pt")


def object_collision(ctx):
    torch.save({"w": torch.ones(2), "cfg": {"lr": 0.1}, "cfg.lr": 0.2}, ctx.inp / "w.pt")


def torch_import(ctx):
    from ucp_store.formats.torch_file import import_torch_file

    return import_torch_file(ctx.open(), str(ctx.inp / "w.pt"), "imp", 1, progress=False)


def dcp_good_read(ctx):
    from ucp_store.formats.dcp.adapter import import_dcp

    ck = import_dcp(ctx.open(), str(ctx.good_dcp), "imp", 1, progress=False)
    ck = ucp_store.open_store(str(ctx.store)).checkpoint(ck.id)
    return ck.read("w"), ck.objects().get("step")


def save_complex_pair(ctx):
    s = ctx.open()
    s.save("c", 1, {"z": COMPLEX, "same": torch.ones(2)})
    s.save("c", 2, {"z": torch.complex(COMPLEX.real, COMPLEX.imag + 1), "same": torch.ones(2)})


def save_odd_dtypes(ctx):
    ctx.seed()
    ctx.open().save("u", 1, {"c": COMPLEX, "big": torch.tensor([2**64 - 1, 3], dtype=torch.uint64),
                             "flag": torch.tensor([True, False])})


def save_one(name: str, value: torch.Tensor) -> Callable[[Ctx], None]:
    return lambda ctx: ctx.open().save("u", 1, {name: value})


def in_window_rm(ctx):
    """Issue 30 item 9's window, made deterministic: the array a pending save deduplicated against is removed
    by rm between write() and commit(); the save still commits and reads back exactly."""
    s = ctx.open()
    t = torch.randn(16, 16, generator=gen(9))
    s.save("a", 1, {"x": t.clone()})
    w = s.begin("b", 1)
    w.write("x", "weight", t)
    s.rm("a@1")
    s.gc()
    w.commit()
    return ucp_store.open_store(str(ctx.store)).checkpoint("b@1").read("x")


def _truncate(ctx: Ctx, which: str) -> None:
    ctx.seed()
    f = next(p for p in files_of(ctx, "r@1", "w") if ("/c/" in str(p)) == (which == "shard"))
    f.write_bytes(f.read_bytes()[:7])


def _remove(ctx: Ctx, which: str) -> None:
    ctx.seed()
    next(p for p in files_of(ctx, "r@1", "w") if ("/c/" in str(p)) == (which == "shard")).unlink()


def _shard_folder(ctx: Ctx) -> None:
    ctx.seed()
    f = shard_of(ctx, "r@1", "w")
    f.unlink()
    f.mkdir()


LONG = "n" * 5000


CASES: list[Case] = [
    # item 1: the writer hashes what it wrote, even when the caller changes the tensor after write()
    exact("api-tensor-changed-after-write", "api", "writer", nothing, mutated_want("plain"),
          api=mutated_after_write("plain"), listed=("m@1", "m@2"), issue="30.1"),
    exact("api-view-base-changed-after-write", "api", "writer", nothing, mutated_want("view"),
          api=mutated_after_write("view"), listed=("m@1", "m@2"), issue="30.1"),
    exact("api-numpy-changed-after-write", "api", "writer", nothing, mutated_want("plain"),
          api=mutated_after_write("numpy"), listed=("m@1", "m@2"), issue="30.1"),
    # item 2: no walk of the store leaves it
    kept("store-symlinked-array-folder-gc", "store", "symlinks", link_arrays_folder, cli=cli("gc"), listed=SEEDED,
         issue="30.2"),
    kept("store-symlinked-array-folder-gc-api", "store", "symlinks", link_arrays_folder, api=gc_api(), listed=SEEDED,
         issue="30.2"),
    kept("store-symlinked-array-folder-gc-retention", "store", "symlinks", link_arrays_folder,
         cli=cli("gc", "--run", "r", "--keep-last", "1"), listed=("r@3",), issue="30.2"),
    kept("store-symlinked-array-folder-rm", "store", "symlinks", link_arrays_folder, cli=cli("rm", "r@1"),
         listed=("r@2", "r@3"), issue="30.2"),
    kept("store-symlinked-array-folder-verify", "store", "symlinks", link_arrays_folder, cli=cli("verify", "r@1"),
         issue="30.2"),
    kept("store-symlinked-array-folder-ls", "store", "symlinks", link_arrays_folder, cli=cli("ls"), issue="30.2"),
    kept("store-symlinked-array-folder-export", "store", "symlinks", link_arrays_folder,
         cli=cli("export", "torch", "r@1", "{inp}/out.pt"), issue="30.2"),
    kept("store-symlinked-array-in-version-gc", "store", "symlinks", link_array_in_version, cli=cli("gc"),
         listed=SEEDED, issue="30.2"),
    kept("store-symlinked-array-in-version-rm", "store", "symlinks", link_array_in_version, cli=cli("rm", "r@1"),
         issue="30.2"),
    kept("store-relative-symlink-gc", "store", "symlinks", link_relative_arrays_folder, cli=cli("gc"), listed=SEEDED,
         issue="30.2"),
    kept("store-symlinked-shard-file-rm", "store", "symlinks", link_shard_file, cli=cli("rm", "r@2"), issue="30.2"),
    kept("store-symlinked-shard-file-verify", "store", "symlinks", link_shard_file, cli=cli("verify", "r@2"),
         issue="30.2"),
    # item 3: retention values out of range are refused, in the CLI and the API
    err("cli-retention-keep-every-0", "cli", "retention", seeded, FAILS, ("--keep-every", "keep_every"),
        cli=cli("retention", "r", "--keep-every", "0"), issue="30.3"),
    err("cli-retention-keep-last-minus-2", "cli", "retention", seeded, FAILS, ("--keep-last", "keep_last"),
        cli=cli("retention", "r", "--keep-last", "-2"), issue="30.3"),
    err("cli-retention-keep-last-0", "cli", "retention", seeded, FAILS, ("--keep-last", "keep_last"),
        cli=cli("retention", "r", "--keep-last", "0"), issue="30.3"),
    err("cli-retention-keep-every-minus-1", "cli", "retention", seeded, FAILS, ("--keep-every", "keep_every"),
        cli=cli("retention", "r", "--keep-every", "-1"), issue="30.3"),
    err("cli-retention-keep-last-not-an-integer", "cli", "retention", seeded, FAILS, ("--keep-last", "keep_last"),
        cli=cli("retention", "r", "--keep-last", "1.5"), issue="30.3"),
    err("cli-gc-keep-every-0", "cli", "retention", seeded, FAILS, ("--keep-every", "keep_every"),
        cli=cli("gc", "--keep-every", "0"), issue="30.3"),
    err("cli-gc-keep-last-minus-1", "cli", "retention", seeded, FAILS, ("--keep-last", "keep_last"),
        cli=cli("gc", "--run", "r", "--keep-last", "-1"), issue="30.3"),
    err("api-retention-keep-every-0", "api", "retention", seeded, BAD_SETTING, "keep_every",
        api=retention_api(keep_every=0), issue="30.3"),
    err("api-retention-keep-last-minus-1", "api", "retention", seeded, BAD_SETTING, "keep_last",
        api=retention_api(keep_last=-1), issue="30.3"),
    err("api-retention-keep-last-float", "api", "retention", seeded, BAD_SETTING, "keep_last",
        api=retention_api(keep_last=2.5), issue="30.3"),
    err("api-retention-keep-last-string", "api", "retention", seeded, BAD_SETTING, "keep_last",
        api=retention_api(keep_last="3"), issue="30.3"),
    err("api-gc-keep-last-0", "api", "retention", seeded, BAD_SETTING, "keep_last", api=gc_api(keep_last=0),
        issue="30.3"),
    err("api-gc-keep-every-minus-3", "api", "retention", seeded, BAD_SETTING, "keep_every",
        api=gc_api(keep_every=-3), issue="30.3"),
    exact("api-retention-huge-keeps-all", "api", "retention", seeded, lambda ctx: ["r@1", "r@2", "r@3"],
          api=huge_retention_keeps_all, listed=SEEDED, issue="30.3"),
    # item 4: a plain path is a path
    *[exact(f"cli-store-folder-{label}", "cli", "paths", nothing, odd_folder_want(name), api=odd_folder(name),
            issue="30.4")
      for label, name in (("percent-20", "p%20q"), ("question-mark", "x?y"), ("hash", "a#b"),
                          ("percent-2f", "c%2Fd"), ("space-and-semicolon", "s p;q"), ("at-sign", "u@v"))],
    # item 5: objects round-trip exactly: save, import torch, import dcp / export dcp
    *[exact(f"api-object-{label}", "api", "objects", nothing, lambda ctx, v=value: v, api=object_roundtrip(value),
            issue="30.5")
      for label, value in (("float-1.0", 1.0), ("minus-zero", -0.0), ("uint64-max", 2**64 - 1),
                           ("int64-min", -(2**63)), ("2-pow-53-plus-1", 2**53 + 1),
                           ("float-max", 1.7976931348623157e308),
                           ("subnormal", 5e-324), ("bool", True), ("none", None), ("string-like-number", "1.0"),
                           ("unicode", {"héllo": "✓ 𝔘", "日本": ["ü"]}), ("empties", {"a": {}, "b": [], "c": ""}),
                           ("nested-mixed", {"a": [1, 1.0, -0.0, {"b": [2**64 - 1, None, False]}]}),
                           ("deep-bounded", nested(60)))],
    exact("foreign-torch-objects-exact", "foreign", "torch", torch_with_objects, lambda ctx: OBJECTS_FLAT,
          api=torch_objects_import, issue="30.5"),
    exact("foreign-dcp-objects-import-export-exact", "foreign", "dcp", dcp_with_objects, lambda ctx: OBJECTS_FLAT,
          api=dcp_objects_roundtrip, issue="30.5"),
    # item 6: DCP chunks must tile the tensor
    exact("foreign-dcp-two-chunks-tile", "foreign", "dcp", dcp_tiles, tiled_want, api=dcp_import, listed=("imp@1",),
          issue="30.6"),
    err("foreign-dcp-duplicated-chunk", "foreign", "dcp", dcp_duplicate_chunk, SourceFormatError, "tiled",
        api=dcp_import, issue="30.6"),
    err("foreign-dcp-overlap-and-gap", "foreign", "dcp", dcp_overlap_and_gap, SourceFormatError, "tiled",
        api=dcp_import, issue="30.6"),
    err("foreign-dcp-chunk-outside-tensor", "foreign", "dcp", dcp_chunk_outside, SourceFormatError, "tiled",
        api=dcp_import, issue="30.6"),
    # item 7: stats std is numerically stable (numpy in float64 is the reference)
    exact("api-stats-float64-large-mean", "api", "stats", save_stats_inputs, lambda ctx: numpy_stats(STATS_X64),
          api=stats_api("x64"), compare=close_to(1e-6), issue="30.7"),
    exact("api-stats-float32-large-mean", "api", "stats", save_stats_inputs, lambda ctx: numpy_stats(STATS_X32),
          api=stats_api("x32"), compare=close_to(1e-6), issue="30.7"),
    exact("cli-stats-json-float64-large-mean", "cli", "stats", save_stats_inputs,
          lambda ctx: numpy_stats(STATS_X64), cli=cli("stats", "s@1", "x64", "--json"), got=stats_json,
          compare=close_to(1e-6), issue="30.7"),
    # item 8: each input that printed a traceback
    err("store-catalog-random-bytes", "store", "catalog", corrupt_catalog, EXIT_FAIL, "catalog.db",
        cli=cli("ls"), issue="30.8"),
    err("foreign-hf-config-deeply-nested", "foreign", "hf", hf_deep_config, EXIT_FAIL, "config.json",
        cli=cli("import", "hf", "{inp}/hf", "--run", "imp", "--step", "1", "--no-progress"), issue="30.8"),
    err("foreign-hf-safetensors-header-deeply-nested", "foreign", "hf", hf_deep_header, EXIT_FAIL,
        "model.safetensors", cli=cli("import", "hf", "{inp}/hf", "--run", "imp", "--step", "1", "--no-progress"),
        issue="30.8"),
    err("foreign-hf-index-deeply-nested", "foreign", "hf", hf_deep_index, EXIT_FAIL, "model.safetensors.index.json",
        cli=cli("import", "hf", "{inp}/hf", "--run", "imp", "--step", "1", "--no-progress"), issue="30.8"),
    err("cli-export-hf-config-deeply-nested", "cli", "hf", deep_config_file, EXIT_FAIL, "config.json",
        cli=cli("export", "hf", "r@1", "{inp}/out", "--config", "{inp}/config.json"), issue="30.8"),
    err("foreign-hf-config-5000-digit-integer", "foreign", "hf", hf_digits_config, EXIT_FAIL, "config.json",
        cli=cli("import", "hf", "{inp}/hf", "--run", "imp", "--step", "1", "--no-progress"), issue="30.8"),
    err("cli-export-hf-config-5000-digit-integer", "cli", "hf", digits_config_file, EXIT_FAIL, "config.json",
        cli=cli("export", "hf", "r@1", "{inp}/out", "--config", "{inp}/config.json"), issue="30.8"),
    err("foreign-hf-shape-0-by-2-pow-63", "foreign", "hf", hf_huge_shape, SourceFormatError, "wide", api=hf_import,
        issue="30.8"),
    err("foreign-dcp-declared-size-2-pow-40", "foreign", "dcp", dcp_declared_size([2**40]), SourceFormatError,
        "tiled", api=dcp_import, issue="30.8"),
    exact("foreign-torch-conj-bit-complex", "foreign", "torch", conj_torch_file, lambda ctx: CONJ,
          api=torch_import_read("c", "c.pt"), listed=("imp@1",), issue="30.8"),
    err("cli-init-chunk-mib-nan", "cli", "options", nothing, FAILS, ("--chunk-mib", "chunk"),
        cli=cli("init", "--chunk-mib", "nan"), issue="30.8"),
    err("cli-init-chunk-mib-inf", "cli", "options", nothing, FAILS, ("--chunk-mib", "chunk"),
        cli=cli("init", "--chunk-mib", "inf"), issue="30.8"),
    err("cli-export-hf-max-shard-size-inf", "cli", "options", seeded, FAILS, ("--max-shard-size", "infGB"),
        cli=cli("export", "hf", "r@1", "{inp}/out", "--max-shard-size", "infGB"), issue="30.8"),
    err("cli-export-torch-empty-destination", "cli", "paths", seeded, FAILS, ("''", "dest", "empty"),
        cli=cli("export", "torch", "r@1", ""), issue="30.8"),
    err("cli-plan-mesh-100000-squared", "cli", "options", seeded, FAILS, ("--mesh", "mesh"),
        cli=cli("plan", "r@1", "--mesh", "100000,100000"), issue="30.8"),
    # item 9: the window between deduplicating and inserting rows (the stress run is tests/test_registry_load.py)
    exact("api-dedup-target-removed-before-commit", "api", "concurrency", nothing,
          lambda ctx: torch.randn(16, 16, generator=gen(9)), api=in_window_rm, listed=("b@1",), issue="30.9"),
    # item 10: identical bits diff as "same" and dedup, whatever the save path
    exact("api-engine-and-import-hashes-agree", "api", "hashes", two_save_paths, lambda ctx: (["same"], True),
          api=diff_and_dedup, issue="30.10"),
    # item 11
    exact("cli-read-json-complex-keeps-imaginary", "cli", "json", save_tensors(z=COMPLEX), lambda ctx: COMPLEX,
          cli=cli("read", "x@1", "z", "--json"), got=read_json_values(torch.complex64), issue="30.11"),
    exact("cli-diff-json-imaginary-change", "cli", "json", save_complex_pair,
          lambda ctx: {"z": ("changed", True), "same": ("same", False)},
          cli=cli("diff", "c@1", "c@2", "--json", "--all"), got=diff_statuses, issue="30.11"),
    exact("cli-diff-json-nan-is-json", "cli", "json", save_nan_pair, lambda ctx: ("changed", True),
          cli=cli("diff", "n@1", "n@2", "--json"), got=diff_nan, issue="30.11"),
    err("cli-export-universal-complex", "cli", "export", save_one("c", COMPLEX), EXIT_FAIL, "'c'",
        cli=cli("export", "deepspeed-universal", "u@1", "{inp}/uni"), issue="30.11"),
    err("cli-export-universal-uint64", "cli", "export", save_one("big", torch.tensor([2**64 - 1], dtype=torch.uint64)),
        EXIT_FAIL, "'big'", cli=cli("export", "deepspeed-universal", "u@1", "{inp}/uni"), issue="30.11"),
    err("cli-export-universal-bool", "cli", "export", save_one("flag", torch.tensor([True, False])), EXIT_FAIL,
        "'flag'", cli=cli("export", "deepspeed-universal", "u@1", "{inp}/uni"), issue="30.11"),
    exact("cli-read-json-nan-inf-is-json", "cli", "json", save_tensors(s=SPECIAL), lambda ctx: SPECIAL,
          cli=cli("read", "x@1", "s", "--json"), got=read_json_values(torch.float32), issue="30.11"),
    exact("cli-stats-json-nan-inf-is-json", "cli", "json", save_tensors(s=SPECIAL),
          lambda ctx: (1, 2, 1.0), cli=cli("stats", "x@1", "s", "--json"), got=stats_nonfinite, issue="30.11"),
    err("foreign-torch-object-names-collide", "foreign", "torch", object_collision, (DuplicateEntryError,
        SourceFormatError), "cfg.lr", api=torch_import, issue="30.11"),
    err("foreign-torch-tensor-names-collide", "foreign", "torch", tensor_collision, (DuplicateEntryError,
        SourceFormatError), "a.b", api=torch_import, issue="30.11"),
    err("cli-query-fts3-tokenizer", "cli", "query", seeded, EXIT_FAIL, "fts3_tokenizer",
        cli=cli("query", "SELECT fts3_tokenizer('simple')"), issue="30.11"),
    err("cli-query-load-extension", "cli", "query", seeded, EXIT_FAIL, "load_extension",
        cli=cli("query", "SELECT load_extension('/tmp/x.so')")),
    err("cli-query-delete", "cli", "query", seeded, EXIT_FAIL, ("read-only", "readonly", "DELETE", "not authorized"),
        cli=cli("query", "DELETE FROM tags")),
    err("cli-query-attach", "cli", "query", seeded, EXIT_FAIL, ("ATTACH", "read-only", "not authorized"),
        cli=cli("query", "ATTACH DATABASE '{inp}/x.db' AS x")),
    err("cli-query-pragma-writable-schema", "cli", "query", seeded, EXIT_FAIL,
        ("PRAGMA", "writable_schema", "read-only", "not authorized"), cli=cli("query", "PRAGMA writable_schema=1")),
    err("cli-query-second-statement", "cli", "query", seeded, EXIT_FAIL,
        ("one statement", "statement", "read-only", "readonly"), cli=cli("query", "SELECT 1; DELETE FROM runs")),
    err("cli-export-torch-corrupt-chunk-leaves-nothing", "cli", "export", corrupt_w, EXIT_FAIL, "'w'",
        cli=cli("export", "torch", "r@1", "{inp}/out.pt"), issue="30.11"),
    err("cli-export-hf-corrupt-chunk-leaves-nothing", "cli", "export", corrupt_w_with_config, EXIT_FAIL, "'w'",
        cli=cli("export", "hf", "r@1", "{inp}/out", "--config", "{inp}/config.json"), issue="30.11"),
    err("cli-export-dcp-corrupt-chunk-leaves-nothing", "cli", "export", corrupt_w, EXIT_FAIL, "'w'",
        cli=cli("export", "dcp", "r@1", "{inp}/out"), issue="30.11"),
    err("cli-export-universal-corrupt-chunk-leaves-nothing", "cli", "export", corrupt_w, EXIT_FAIL, "'w'",
        cli=cli("export", "deepspeed-universal", "r@1", "{inp}/out"), issue="30.11"),
    err("cli-read-out-onto-a-folder-leaves-nothing", "cli", "export", existing_dest, EXIT_FAIL, "{inp}/taken",
        cli=cli("read", "r@1", "w", "--out", "{inp}/taken"), issue="30.11"),
    err("cli-export-dcp-onto-a-file-leaves-nothing", "cli", "export", existing_dest, EXIT_FAIL, "{inp}/taken",
        cli=cli("export", "dcp", "r@1", "{inp}/taken/keep.txt"), issue="30.11"),
    err("cli-init-existing-store-other-chunk-target", "cli", "options", init_existing, EXIT_FAIL, "{store}",
        cli=cli("init", "--chunk-mib", "1"), issue="30.11"),
    err("cli-init-existing-store-other-compression", "cli", "options", init_existing, EXIT_FAIL, "{store}",
        cli=cli("init", "--compression", "zstd"), issue="30.11"),
    err("store-fifo-shard-file-verify", "store", "fifo", fifo_in("r@1", "shard"), EXIT_FAIL, "arrays/",
        cli=cli("verify", "r@1"), report=True, subprocess=True, timeout=45, issue="30.11"),
    err("store-fifo-zarr-json-verify", "store", "fifo", fifo_in("r@1", "meta"), EXIT_FAIL, "zarr.json",
        cli=cli("verify", "r@1"), report=True, subprocess=True, timeout=45, issue="30.11"),
    err("store-fifo-zarr-json-compressed-verify", "store", "fifo", fifo_in_zstd("meta"), EXIT_FAIL, "zarr.json",
        cli=cli("verify", "r@1"), report=True, subprocess=True, timeout=45, issue="30.11"),
    err("store-fifo-shard-file-compressed-read", "store", "fifo", fifo_in_zstd("shard"), EXIT_FAIL,
        "not a regular file",
        cli=cli("read", "r@1", "w"), subprocess=True, timeout=45, issue="30.11"),
    kept("store-fifo-under-arrays-gc", "store", "fifo", fifo_folder, cli=cli("gc"), subprocess=True, timeout=45,
         issue="30.11"),
    exact("cli-gc-reports-bytes-freed", "cli", "gc", orphan_array, lambda ctx: (1, True),
          cli=cli("gc", "--json"), got=gc_freed, listed=SEEDED, issue="30.11"),
    # A chunk's crc32c is standard Zarr v3 (other readers must read it) and cannot name its array or position,
    # so a shard file copied from another array, or two chunks exchanged with their crc32c, read back the
    # other bytes; the content hash catches both, and verify is what reports them (ARCHITECTURE.md, format
    # invariants).
    err("store-shard-file-from-another-array", "store", "shards", swapped_shard, EXIT_FAIL, "v",
        cli=cli("verify", "r@1"), report=True, issue="30.11"),
    err("store-chunks-swapped-in-a-shard", "store", "shards", swapped_chunks, EXIT_FAIL, "x",
        cli=cli("verify", "big@1"), report=True, issue="30.11"),
    # neighbours: names
    err("api-tensor-name-dotdot-alone", "api", "names", nothing, InvalidNameError, "'..'",
        api=lambda ctx: ctx.open().save("r", 1, {"..": torch.ones(1)})),
    err("api-tensor-name-inner-dotdot", "api", "names", nothing, InvalidNameError, "a/../../b",
        api=lambda ctx: ctx.open().save("r", 1, {"a/../../b": torch.ones(1)})),
    err("api-tensor-name-very-long", "api", "names", nothing, InvalidNameError, "1024",
        api=lambda ctx: ctx.open().save("r", 1, {LONG: torch.ones(1)})),
    err("api-run-name-absolute", "api", "names", nothing, InvalidNameError, "/tmp/run",
        api=lambda ctx: ctx.open().save("/tmp/run", 1, {"w": torch.ones(1)})),
    err("api-run-name-nul", "api", "names", nothing, InvalidNameError, "\\x00",
        api=lambda ctx: ctx.open().save("r\x00x", 1, {"w": torch.ones(1)})),
    err("api-run-name-very-long", "api", "names", nothing, InvalidNameError, "1-200",
        api=lambda ctx: ctx.open().save("r" * 201, 1, {"w": torch.ones(1)})),
    err("api-state-name-dotdot", "api", "names", nothing, InvalidNameError, "../s",
        api=lambda ctx: ctx.open().save("r", 1, {"w": {"../s": torch.ones(1)}})),
    err("api-object-name-absolute", "api", "names", nothing, InvalidNameError, "/etc/o",
        api=lambda ctx: ctx.open().save("r", 1, {"w": torch.ones(1)}, objects={"/etc/o": 1})),
    err("cli-tag-name-dotdot", "cli", "names", seeded, EXIT_FAIL, "../x", cli=cli("tag", "r@1", "../x")),
    err("cli-tag-name-empty", "cli", "names", seeded, EXIT_FAIL, ("''", "TAG"), cli=cli("tag", "r@1", "")),
    err("cli-retention-run-name-dotdot", "cli", "names", seeded, EXIT_FAIL, "../r",
        cli=cli("retention", "../r", "--keep-last", "2")),
    err("cli-import-run-name-absolute", "cli", "names", torch_shared_storage, EXIT_FAIL, "/abs",
        cli=cli("import", "torch", "{inp}/w.pt", "--run", "/abs", "--step", "1", "--no-progress")),
    err("cli-read-ref-negative-step", "cli", "refs", seeded, EXIT_FAIL, "r@-1", cli=cli("read", "r@-1", "w")),
    err("cli-read-ref-fractional-step", "cli", "refs", seeded, EXIT_FAIL, "r@1.5", cli=cli("read", "r@1.5", "w")),
    # neighbours: dtypes (random bits: NaN payloads, -0.0, subnormals), shapes, strides
    *[dtype_case(dt, i) for i, dt in enumerate(
        (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool,
         torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32, torch.uint64))],
    shape_case("empty-1d", lambda: torch.zeros(0)),
    shape_case("empty-middle-dim", lambda: torch.zeros(3, 0, 5, dtype=torch.float16)),
    shape_case("zero-d-float", lambda: torch.tensor(-0.0)),
    shape_case("zero-d-int64", lambda: torch.tensor(-(2**63), dtype=torch.int64)),
    shape_case("size-one-dims", lambda: torch.full((1, 1, 1, 1), 3.5)),
    strided_case("transposed", lambda: torch.arange(35.0).reshape(5, 7).t()),
    strided_case("stepped-slice", lambda: torch.arange(120.0).reshape(10, 12)[::2, 1::3]),
    strided_case("expanded-stride-0", lambda: torch.arange(4.0).reshape(4, 1).expand(4, 6)),
    strided_case("channels-last", lambda: torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5).to(
        memory_format=torch.channels_last)),
    strided_case("offset-view", lambda: torch.arange(100.0)[37:61].view(4, 6)),
    strided_case("numpy-negative-strides", lambda: np.flip(np.arange(24.0).reshape(4, 6))),
    strided_case("numpy-fortran-order", lambda: np.asfortranarray(np.arange(24, dtype=np.int32).reshape(4, 6))),
    strided_case("conj-bit-complex", lambda: COMPLEX.conj()),
    strided_case("neg-bit-view", lambda: COMPLEX.conj().imag),
    # neighbours: foreign round trips
    exact("foreign-torch-shared-storage-views", "foreign", "torch", torch_shared_storage,
          lambda ctx: [SHARED_BASE[:10].clone(), SHARED_BASE[5:25].reshape(4, 5).clone(),
                       SHARED_BASE.view(8, 5).t().contiguous()], api=torch_shared_read),
    exact("foreign-hf-empty-bf16-and-scalar", "foreign", "hf", hf_odd_tensors,
          lambda ctx: [torch.zeros(0, 3), random_bits((3, 4), torch.bfloat16, 3), torch.tensor(2.5)],
          api=hf_odd_read),
    exact("foreign-dcp-written-by-dcp", "foreign", "dcp", nothing, lambda ctx: (torch.arange(12.0).reshape(3, 4), 7),
          api=dcp_good_read),
    # neighbours: the store's own files
    err("store-catalog-random-bytes-api", "store", "catalog", corrupt_catalog, CatalogError, "catalog.db",
        api=lambda ctx: ctx.open().list_checkpoints()),
    err("store-catalog-random-bytes-gc", "store", "catalog", corrupt_catalog, EXIT_FAIL, "catalog.db",
        cli=cli("gc")),
    err("store-catalog-truncated", "store", "catalog", truncated_catalog, EXIT_FAIL, "catalog.db", cli=cli("ls")),
    err("store-catalog-is-a-folder", "store", "catalog", catalog_is_a_folder, EXIT_FAIL, "catalog.db",
        cli=cli("ls")),
    err("store-shard-file-truncated", "store", "shards", lambda ctx: _truncate(ctx, "shard"), EXIT_FAIL, "'w'",
        cli=cli("read", "r@1", "w")),
    # reads take the layout from the catalog and never need zarr.json; verify checks it
    err("store-zarr-json-garbage-verify", "store", "shards", lambda ctx: _truncate(ctx, "meta"), EXIT_FAIL,
        "zarr.json", cli=cli("verify", "r@1"), report=True),
    err("store-zarr-json-missing-verify", "store", "shards", lambda ctx: _remove(ctx, "meta"), EXIT_FAIL,
        "zarr.json", cli=cli("verify", "r@1"), report=True),
    err("store-shard-file-is-a-folder", "store", "shards", _shard_folder, EXIT_FAIL, "w",
        cli=cli("verify", "r@1"), report=True),
    err("store-arrays-folder-missing-read", "store", "shards", lambda ctx: (ctx.seed(), shutil.rmtree(
        ctx.store / "arrays")), EXIT_FAIL, "'w'", cli=cli("read", "r@1", "w")),
    # neighbours: numeric options
    err("cli-init-chunk-mib-0", "cli", "options", nothing, FAILS, ("--chunk-mib", "chunk"),
        cli=cli("init", "--chunk-mib", "0")),
    err("cli-init-chunk-mib-1e309", "cli", "options", nothing, FAILS, ("--chunk-mib", "chunk"),
        cli=cli("init", "--chunk-mib", "1e309")),
    err("cli-export-hf-max-shard-size-negative", "cli", "options", seeded, FAILS, ("--max-shard-size", "-5GB"),
        cli=cli("export", "hf", "r@1", "{inp}/out", "--max-shard-size", "-5GB")),
    err("cli-export-hf-max-shard-size-nan", "cli", "options", seeded, FAILS, ("--max-shard-size", "nanGB"),
        cli=cli("export", "hf", "r@1", "{inp}/out", "--max-shard-size", "nanGB")),
    err("cli-export-dcp-empty-destination", "cli", "paths", seeded, FAILS, ("''", "dest", "empty", "DIR"),
        cli=cli("export", "dcp", "r@1", "")),
    err("cli-export-hf-empty-destination", "cli", "paths", seeded, FAILS, ("''", "dest", "empty"),
        cli=cli("export", "hf", "r@1", "")),
    err("cli-export-dcp-threads-0", "cli", "options", seeded, FAILS, "--threads",
        cli=cli("export", "dcp", "r@1", "{inp}/out", "--threads", "0")),
    err("cli-plan-mesh-named-huge", "cli", "options", seeded, FAILS, ("--mesh", "mesh"),
        cli=cli("plan", "r@1", "--mesh", "dp=100000,tp=100000")),
    err("cli-plan-mesh-zero", "cli", "options", seeded, FAILS, ("--mesh", "mesh", "dp=0"),
        cli=cli("plan", "r@1", "--mesh", "dp=0")),
    err("cli-plan-tp-zero", "cli", "options", seeded, FAILS, ("--tp", "tp"), cli=cli("plan", "r@1", "--tp", "0")),
    err("cli-plan-rank-out-of-range", "cli", "options", seeded, FAILS, ("--rank", "rank"),
        cli=cli("plan", "r@1", "--tp", "2", "--rank", "7")),
]

