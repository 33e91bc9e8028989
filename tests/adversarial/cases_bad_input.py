"""Issue 16's bad-input corpus: one ``clean_error`` case per bad input (see ``framework``).

Each names what must come out: the exception class (API) or the exit code (CLI), and a substring of the
error that names the offending thing (``str.format``-ed with the context's fields: ``{inp}``, ``{store}``,
``{marker}``, ...); the runner checks that, that nothing was left behind in the catalog or the arrays, and
that no pickle payload ran.

Inputs are tiny and built from the real producers where one exists (``torch.save``, safetensors,
``torch.distributed.checkpoint.save``); DeepSpeed tag/universal folders are the files DeepSpeed's
layout names, holding what the case needs (the real-DeepSpeed corruptions live in tests/deepspeed/).
"""

from __future__ import annotations

import json
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
    DTypeError,
    DuplicateEntryError,
    InvalidNameError,
    ReferenceNotFound,
    SchemaVersionError,
    SourceFormatError,
    UnsafePickleError,
    ValidationError,
)

from .framework import CLEAN_ERROR, EXIT_FAIL, Case, Ctx, Payload, nothing

FOREIGN = ("torch", "deepspeed", "universal", "hf", "dcp")


def refused(id: str, kind: str, build: Callable[[Ctx], None], expect: type[BaseException] | int, needle: str, *,
            api: Callable[[Ctx], Any] | None = None, cli: Callable[[Ctx], list[str]] | None = None,
            subprocess: bool = False, surface: str | None = None) -> Case:
    """An issue-16 case: the input is refused with ``expect`` naming ``needle``, and nothing is left behind."""
    surface = surface or ("foreign" if kind in FOREIGN else kind)
    return Case(id, surface, kind, build, CLEAN_ERROR, expect=expect, needle=needle, api=api, cli=cli,
                subprocess=subprocess, issue="16")


def seed(ctx: Ctx) -> None:
    """The seeded store: r@1 holds a 4x6 tensor 'w' (for reads, refs and slices)."""
    ctx.seed()


# --- torch files ----------------------------------------------------------------------------------

def torch_empty(ctx):
    (ctx.inp / "w.pt").write_bytes(b"")


def torch_truncated(ctx):
    torch.save({"w": torch.ones(1000)}, ctx.inp / "full.pt")
    (ctx.inp / "w.pt").write_bytes((ctx.inp / "full.pt").read_bytes()[:300])
    (ctx.inp / "full.pt").unlink()


def torch_foreign(ctx):
    (ctx.inp / "w.pt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))


def torch_pickle(ctx):
    torch.save({"w": torch.ones(3), "payload": Payload(ctx.marker)}, ctx.inp / "w.pt")


def torch_legacy_pickle(ctx):
    torch.save({"w": torch.ones(3), "payload": Payload(ctx.marker)}, ctx.inp / "w.pt",
               _use_new_zipfile_serialization=False)


def torch_raw_pickle(ctx):
    with open(ctx.inp / "w.pt", "wb") as f:
        pickle.dump({"payload": Payload(ctx.marker)}, f, protocol=2)


def torch_good(ctx):
    torch.save({"w": torch.ones(3)}, ctx.inp / "w.pt")


def torch_bad_name(ctx):
    torch.save({"ok": torch.ones(2), "../../escape": torch.ones(2)}, ctx.inp / "w.pt")


def torch_unsupported_dtype(ctx):
    torch.save({"ok": torch.ones(2), "f8": torch.ones(2).to(torch.float8_e4m3fnuz)}, ctx.inp / "w.pt")


def torch_import(ctx, **kw):
    from ucp_store.formats.torch_file import import_torch_file

    return import_torch_file(ctx.open(), str(ctx.inp / "w.pt"), "imp", 1, progress=False, **kw)


def ucp_import(kind: str, src: str, *extra: str):
    return lambda ctx: ["import", kind, src.format(**ctx.fields()), "--run", "imp", "--step", "1",
                        "--store", str(ctx.store), "--no-progress", *extra]


# --- DeepSpeed tag folders ------------------------------------------------------------------------

OPTIM0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL0 = "mp_rank_00_model_states.pt"


def _ds_dir(ctx) -> Path:
    d = ctx.inp / "global_step1"
    d.mkdir(exist_ok=True)
    return d


def _ds_model(d: Path) -> None:
    torch.save({"module": {"w": torch.ones(4)}, "param_shapes": [{"w": torch.Size([4])}], "dp_world_size": 2,
                "mp_world_size": 1, "global_steps": 1, "ds_version": "0.16.0"}, d / MODEL0)


def _ds_optim(d: Path, dp: int) -> None:
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "partition_count": 2, "loss_scaler": None,
                                         "single_partition_of_fp32_groups": [torch.ones(2)]},
                "ds_version": "0.16.0"}, d / f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt")


def ds_empty(ctx):
    _ds_dir(ctx)


def ds_pickle(ctx):
    d = _ds_dir(ctx)
    _ds_model(d)
    torch.save({"optimizer_state_dict": Payload(ctx.marker), "ds_version": "0.16.0"}, d / OPTIM0)


def ds_truncated(ctx):
    d = _ds_dir(ctx)
    _ds_model(d)
    _ds_optim(d, 0)
    data = (d / OPTIM0).read_bytes()
    (d / OPTIM0).write_bytes(data[: len(data) // 3])


def ds_foreign(ctx):
    d = _ds_dir(ctx)
    _ds_model(d)
    (d / OPTIM0).write_text("this is not a torch file\n")


def ds_no_model_states(ctx):
    d = _ds_dir(ctx)
    _ds_optim(d, 0)


def ds_missing_shard(ctx):
    d = _ds_dir(ctx)
    _ds_model(d)
    _ds_optim(d, 0)
    _ds_optim(d, 2)  # dp rank 1's file is missing


def ds_import(ctx):
    from ucp_store.deepspeed.source import import_deepspeed

    return import_deepspeed(ctx.open(), str(ctx.inp / "global_step1"), "imp", 1, progress=False)


# --- universal folders ----------------------------------------------------------------------------

def _uni(ctx) -> Path:
    d = ctx.inp / "uni"
    (d / "zero" / "w").mkdir(parents=True, exist_ok=True)
    return d


def uni_empty(ctx):
    (ctx.inp / "uni").mkdir()


def uni_no_optimizer_state(ctx):
    d = _uni(ctx)
    torch.save({"param": torch.ones(4)}, d / "zero" / "w" / "fp32.pt")


def uni_pickle(ctx):
    d = _uni(ctx)
    torch.save({"param": torch.ones(4)}, d / "zero" / "w" / "fp32.pt")
    torch.save({"param_groups": [], "payload": Payload(ctx.marker)}, d / "zero" / "optimizer_state.pt")
    torch.save({"module": None, "ds_version": "0.16.0"}, d / MODEL0)


def uni_truncated_model(ctx):
    d = _uni(ctx)
    torch.save({"param": torch.ones(4)}, d / "zero" / "w" / "fp32.pt")
    torch.save({"param_groups": []}, d / "zero" / "optimizer_state.pt")
    torch.save({"module": None, "ds_version": "0.16.0", "pad": torch.ones(256)}, d / MODEL0)
    (d / MODEL0).write_bytes((d / MODEL0).read_bytes()[:200])


def uni_import(ctx):
    from ucp_store.deepspeed.universal import import_universal

    return import_universal(ctx.open(), str(ctx.inp / "uni"), "imp", 1, progress=False)


# --- Hugging Face folders -------------------------------------------------------------------------

def _st_write(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _hf(ctx) -> Path:
    d = ctx.inp / "hf"
    d.mkdir(exist_ok=True)
    return d


def hf_empty(ctx):
    _hf(ctx)


def hf_truncated(ctx):
    from safetensors.torch import save_file

    d = _hf(ctx)
    save_file({"w": torch.ones(64, 64)}, str(d / "model.safetensors"))
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])


def hf_foreign(ctx):
    (_hf(ctx) / "model.safetensors").write_bytes(b"PK\x03\x04" + bytes(200))


def hf_absurd_shape(ctx):
    _st_write(_hf(ctx) / "model.safetensors",
              {"huge": {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 16]}}, bytes(16))


def hf_bad_dtype(ctx):
    _st_write(_hf(ctx) / "model.safetensors", {"q": {"dtype": "Q4_K", "shape": [4], "data_offsets": [0, 4]}},
              bytes(4))


def hf_wrong_shape(ctx):
    _st_write(_hf(ctx) / "model.safetensors", {"w": {"dtype": "F32", "shape": [3, 3], "data_offsets": [0, 32]}},
              bytes(32))


def _hf_sharded(ctx, files: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    d = _hf(ctx)
    for fname, tensors in files.items():
        save_file(tensors, str(d / fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def hf_duplicate_key(ctx):
    """One safetensors header naming tensor 'w' twice (json.loads alone would keep the last silently)."""
    raw = (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
           b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}')
    (_hf(ctx) / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))


def hf_missing_shard(ctx):
    _hf_sharded(ctx, {"a.safetensors": {"w": torch.ones(2)}}, {"w": "a.safetensors", "v": "b.safetensors"})


def hf_escaping_shard(ctx):
    _hf_sharded(ctx, {"a.safetensors": {"w": torch.ones(2)}}, {"w": "../../etc/a.safetensors"})


def hf_pickle_bin(ctx):
    torch.save({"w": torch.ones(2), "payload": Payload(ctx.marker)}, _hf(ctx) / "pytorch_model.bin")


def hf_rtl_name(ctx):
    from safetensors.torch import save_file

    save_file({"ok": torch.ones(2), "layer\u202e.weight": torch.ones(2)}, str(_hf(ctx) / "model.safetensors"))


def hf_import(ctx):
    from ucp_store.formats.hf.adapter import import_hf

    return import_hf(ctx.open(), str(ctx.inp / "hf"), "imp", 1, progress=False)


# --- DCP folders ----------------------------------------------------------------------------------

def _dcp(ctx) -> Path:
    d = ctx.inp / "dcp"
    shutil.copytree(ctx.good_dcp, d)
    return d


def dcp_empty(ctx):
    (ctx.inp / "dcp").mkdir()


def dcp_truncated_metadata(ctx):
    d = _dcp(ctx)
    raw = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(raw[: len(raw) // 2])


def dcp_foreign_metadata(ctx):
    (_dcp(ctx) / ".metadata").write_text('{"state_dict_metadata": {}}')


def dcp_pickle_metadata(ctx):
    with open(_dcp(ctx) / ".metadata", "wb") as f:
        pickle.dump(Payload(ctx.marker), f)


def dcp_missing_shard(ctx):
    d = _dcp(ctx)
    for p in d.glob("*.distcp"):
        p.unlink()


def dcp_truncated_shard(ctx):
    d = _dcp(ctx)
    for p in d.glob("*.distcp"):
        p.write_bytes(p.read_bytes()[:40])


def dcp_absurd_shape(ctx):
    """.metadata re-pickled by DCP's own classes with one tensor's size set to 2^31 x 2^31."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    d = _dcp(ctx)
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)  # the test's own file, written by DCP a moment ago
    key = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
    md.state_dict_metadata[key].size = torch.Size([2**31, 2**31])
    ctx.extra["key"] = key
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)


def dcp_import(ctx):
    from ucp_store.formats.dcp.adapter import import_dcp

    return import_dcp(ctx.open(), str(ctx.inp / "dcp"), "imp", 1, progress=False)


# --- API -----------------------------------------------------------------------------------------

def save(tensors, **kw):
    return lambda ctx: ctx.open().save("r", 1, tensors, **kw)


def duplicate_write(ctx):
    with ctx.open().begin("r", 1) as w:
        w.write("w", "weight", torch.ones(2))
        w.write("w", "weight", torch.ones(2))


def newer_schema(ctx):
    import sqlite3

    ctx.open().save("r", 1, {"w": torch.ones(2)})
    con = sqlite3.connect(ctx.store / "catalog.db")
    with con:
        con.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    con.close()


def unreachable_bucket_url(ctx) -> str:
    return f"s3://nobucket/p?endpoint=http://127.0.0.1:1&region=us-east-1&catalog=sqlite:///{ctx.store}/catalog.db"


def silent_pg_server(ctx):
    """A TCP server that accepts and never answers: PostgreSQL's startup handshake would wait forever."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    ctx.extra["pg_port"] = srv.getsockname()[1]
    ctx.extra["closers"] = [srv.close]
    threading.Thread(target=lambda: _accept_forever(srv), daemon=True).start()


def _accept_forever(srv):
    held = []
    try:
        while True:
            held.append(srv.accept()[0])
    except OSError:
        for c in held:
            c.close()


def open_pg(port_key: str | None, *, port: int = 1, timeout: str = ""):
    def call(ctx):
        p = ctx.extra[port_key] if port_key else port
        return ucp_store.open_store(str(ctx.tmp / "pgstore"), create=True,
                                    catalog=f"postgresql+psycopg2://ucp:ucp@127.0.0.1:{p}/ucp{timeout}")
    return call


BIG = (2**31, 2**31)

CASES: list[Case] = [
    # torch files
    refused("torch-empty", "torch", torch_empty, SourceFormatError, "{inp}/w.pt", api=torch_import),
    refused("torch-truncated", "torch", torch_truncated, SourceFormatError, "{inp}/w.pt", api=torch_import),
    refused("torch-foreign", "torch", torch_foreign, SourceFormatError, "{inp}/w.pt", api=torch_import),
    refused("torch-missing", "torch", nothing, SourceFormatError, "{inp}/w.pt", api=torch_import),
    refused("torch-pickle-reduce", "torch", torch_pickle, UnsafePickleError, "{inp}/w.pt", api=torch_import),
    refused("torch-pickle-legacy-cli", "torch", torch_legacy_pickle, EXIT_FAIL, "{inp}/w.pt",
         cli=ucp_import("torch", "{inp}/w.pt")),
    refused("torch-pickle-raw-subprocess", "torch", torch_raw_pickle, EXIT_FAIL, "{inp}/w.pt",
         cli=ucp_import("torch", "{inp}/w.pt"), subprocess=True),
    refused("torch-escaping-name", "torch", torch_bad_name, InvalidNameError, "../../escape", api=torch_import),
    refused("torch-unsupported-dtype-cli", "torch", torch_unsupported_dtype, EXIT_FAIL, "float8_e4m3fnuz",
         cli=ucp_import("torch", "{inp}/w.pt")),
    # DeepSpeed tag folders
    refused("ds-empty-folder", "deepspeed", ds_empty, SourceFormatError, "{inp}/global_step1", api=ds_import),
    refused("ds-pickle-optimizer", "deepspeed", ds_pickle, UnsafePickleError, OPTIM0, api=ds_import),
    refused("ds-truncated-optimizer", "deepspeed", ds_truncated, SourceFormatError, OPTIM0, api=ds_import),
    refused("ds-foreign-optimizer-cli", "deepspeed", ds_foreign, EXIT_FAIL, OPTIM0,
         cli=ucp_import("deepspeed", "{inp}/global_step1")),
    refused("ds-no-model-states", "deepspeed", ds_no_model_states, SourceFormatError, "model-state", api=ds_import),
    refused("ds-missing-dp-shard", "deepspeed", ds_missing_shard, SourceFormatError,
         "zero_pp_rank_1_mp_rank_00_optim_states.pt", api=ds_import),
    # universal folders
    refused("universal-empty-folder", "universal", uni_empty, SourceFormatError, "zero/", api=uni_import),
    refused("universal-no-optimizer-state", "universal", uni_no_optimizer_state, SourceFormatError,
         "optimizer_state.pt", api=uni_import),
    refused("universal-pickle-cli", "universal", uni_pickle, EXIT_FAIL, "optimizer_state.pt",
         cli=ucp_import("deepspeed-universal", "{inp}/uni")),
    refused("universal-truncated-model-states", "universal", uni_truncated_model, SourceFormatError, MODEL0,
         api=uni_import),
    # Hugging Face folders
    refused("hf-empty-folder", "hf", hf_empty, SourceFormatError, "{inp}/hf", api=hf_import),
    refused("hf-truncated", "hf", hf_truncated, SourceFormatError, "model.safetensors", api=hf_import),
    refused("hf-foreign", "hf", hf_foreign, SourceFormatError, "model.safetensors", api=hf_import),
    refused("hf-absurd-shape", "hf", hf_absurd_shape, SourceFormatError, "huge", api=hf_import),
    refused("hf-unsupported-dtype-cli", "hf", hf_bad_dtype, EXIT_FAIL, "Q4_K", cli=ucp_import("hf", "{inp}/hf")),
    refused("hf-wrong-shape", "hf", hf_wrong_shape, SourceFormatError, "[3, 3]", api=hf_import),
    refused("hf-duplicate-key", "hf", hf_duplicate_key, SourceFormatError, "'w' twice", api=hf_import),
    refused("hf-missing-shard", "hf", hf_missing_shard, SourceFormatError, "b.safetensors", api=hf_import),
    refused("hf-escaping-shard", "hf", hf_escaping_shard, SourceFormatError, "../../etc/a.safetensors",
         api=hf_import),
    refused("hf-pickle-bin-only", "hf", hf_pickle_bin, SourceFormatError, "pickles", api=hf_import),
    refused("hf-rtl-mark-name", "hf", hf_rtl_name, InvalidNameError, "U+202E", api=hf_import),
    # DCP folders
    refused("dcp-empty-folder", "dcp", dcp_empty, SourceFormatError, ".metadata", api=dcp_import),
    refused("dcp-truncated-metadata", "dcp", dcp_truncated_metadata, SourceFormatError, ".metadata", api=dcp_import),
    refused("dcp-foreign-metadata", "dcp", dcp_foreign_metadata, SourceFormatError, ".metadata", api=dcp_import),
    refused("dcp-pickle-metadata-cli", "dcp", dcp_pickle_metadata, EXIT_FAIL, ".metadata",
         cli=ucp_import("dcp", "{inp}/dcp")),
    refused("dcp-missing-shard", "dcp", dcp_missing_shard, SourceFormatError, ".distcp", api=dcp_import),
    refused("dcp-truncated-shard", "dcp", dcp_truncated_shard, SourceFormatError, ".distcp", api=dcp_import),
    refused("dcp-absurd-shape", "dcp", dcp_absurd_shape, SourceFormatError, "{key}", api=dcp_import),
    # API: names
    refused("api-name-dotdot", "api", nothing, InvalidNameError, "../x", api=save({"../x": torch.ones(1)})),
    refused("api-name-absolute", "api", nothing, InvalidNameError, "/etc/passwd",
         api=save({"/etc/passwd": torch.ones(1)})),
    refused("api-name-nul", "api", nothing, InvalidNameError, "\\x00", api=save({"a\x00b": torch.ones(1)})),
    refused("api-name-backslash", "api", nothing, InvalidNameError, "backslash",
         api=save({"a\\..\\b": torch.ones(1)})),
    refused("api-name-nfd", "api", nothing, InvalidNameError, "NFC", api=save({"caf\u0065\u0301": torch.ones(1)})),
    refused("api-name-rtl-override", "api", nothing, InvalidNameError, "U+202E",
         api=save({"w\u202egpj.exe": torch.ones(1)})),
    refused("api-name-rtl-mark-object", "api", nothing, InvalidNameError, "U+200F",
         api=save({"w": torch.ones(1)}, objects={"cfg\u200f": {"a": 1}})),
    refused("api-run-name-escape", "api", nothing, InvalidNameError, "../r",
         api=lambda ctx: ctx.open().save("../r", 1, {"w": torch.ones(1)})),
    # API: shapes and dtypes
    refused("api-absurd-shape-view", "api", nothing, ValidationError, "2^62",
         api=save({"w": np.broadcast_to(np.zeros((), np.uint8), BIG)})),
    refused("api-absurd-shape-meta", "api", nothing, ValidationError, "2^62",
         api=save({"w": torch.empty(BIG, dtype=torch.uint8, device="meta")})),
    refused("api-meta-tensor", "api", nothing, ValidationError, "meta",
         api=save({"w": torch.empty(3, device="meta")})),
    refused("api-sparse-tensor", "api", nothing, ValidationError, "sparse",
         api=save({"w": torch.eye(3).to_sparse()})),
    refused("api-unsupported-dtype-float8", "api", nothing, DTypeError, "float8_e5m2fnuz",
         api=save({"w": torch.ones(2).to(torch.float8_e5m2fnuz)})),
    refused("api-unsupported-dtype-object", "api", nothing, DTypeError, "object",
         api=save({"w": np.array([object()])})),
    refused("api-not-a-tensor", "api", nothing, ValidationError, "str", api=save({"w": "weights"})),
    refused("api-duplicate-key", "api", nothing, DuplicateEntryError, "'w'", api=duplicate_write),
    refused("api-step-out-of-range", "api", nothing, ValidationError, "2^63",
         api=lambda ctx: ctx.open().save("r", 2**64, {"w": torch.ones(1)})),
    # references, URLs, slices
    refused("ref-step-not-int", "cli", seed, EXIT_FAIL, "'r@abc'", cli=lambda ctx: ["read", "r@abc", "w", "--store",
                                                                                 str(ctx.store)]),
    refused("ref-step-overflow", "api", seed, ReferenceNotFound, "out of range",
         api=lambda ctx: ctx.open().resolve("r@" + "9" * 30)),
    refused("ref-unknown-run", "api", seed, ReferenceNotFound, "'nosuch'",
         api=lambda ctx: ctx.open().checkpoint("nosuch@1")),
    refused("ref-empty-tag", "cli", seed, EXIT_FAIL, "'r:'", cli=lambda ctx: ["show", "r:", "--store", str(ctx.store)]),
    refused("url-unknown-scheme", "cli", nothing, EXIT_FAIL, "'ftp'", cli=lambda ctx: ["ls", "--store", "ftp://host/x"]),
    refused("url-s3-no-bucket", "api", nothing, ConfigurationError, "no bucket",
         api=lambda ctx: ucp_store.open_store("s3:///prefix?catalog=sqlite:///x.db")),
    refused("url-s3-no-catalog", "api", nothing, ConfigurationError, "catalog",
         api=lambda ctx: ucp_store.open_store("s3://bucket/prefix")),
    refused("url-no-store-here", "cli", nothing, EXIT_FAIL, "{tmp}/typo",
         cli=lambda ctx: ["ls", "--store", str(ctx.tmp / "typo")]),
    refused("slice-not-a-number", "cli", seed, EXIT_FAIL, "x", cli=lambda ctx: ["read", "r@1", "w", "--slice", "0:x",
                                                                              "--store", str(ctx.store)]),
    refused("slice-too-many-dims", "cli", seed, EXIT_FAIL, "3 entries",
         cli=lambda ctx: ["read", "r@1", "w", "--slice", "0,0,0", "--store", str(ctx.store)]),
    refused("slice-out-of-bounds", "cli", seed, EXIT_FAIL, "9",
         cli=lambda ctx: ["read", "r@1", "w", "--slice", "9", "--store", str(ctx.store)]),
    refused("slice-zero-step", "cli", seed, EXIT_FAIL, "step cannot be zero",
         cli=lambda ctx: ["read", "r@1", "w", "--slice", "0:4:0", "--store", str(ctx.store)]),
    # catalogs and backends
    refused("catalog-newer-schema", "cli", newer_schema, EXIT_FAIL, "9999_from_the_future", surface="store",
         cli=lambda ctx: ["ls", "--store", str(ctx.store)]),
    refused("catalog-newer-schema-api", "api", newer_schema, SchemaVersionError, "9999_from_the_future",
            surface="store", api=lambda ctx: ctx.open()),
    refused("postgres-refused", "api", nothing, CatalogError, "127.0.0.1", api=open_pg(None, port=1)),
    refused("postgres-silent-server", "api", silent_pg_server, CatalogError, "timeout expired",
         api=open_pg("pg_port", timeout="?connect_timeout=2")),
    # issue 40: a write first reads the store's identity (ucp-store.json), which names the bucket too
    refused("s3-unreachable-bucket-cli", "cli", torch_good, EXIT_FAIL,
            ("s3://nobucket/p/arrays/", "s3://nobucket/p/ucp-store.json cannot be read"),
        cli=lambda ctx: ["import", "torch", str(ctx.inp / "w.pt"), "--run", "imp", "--step", "1", "--store",
                         unreachable_bucket_url(ctx), "--no-progress"]),
]
