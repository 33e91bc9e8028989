"""Issue 40, part B, as data (``issue="40.N"``, N the item; ``40.s`` the smaller ones): objects keep their
types or are refused by path, safetensors whose offsets do not tile, FIFOs as inputs, exports onto a full
disk, a read-only store, look-alike names and the universal export's path clash, with variants of each.

The full-disk store (``rm``/``gc`` making room), the immutable catalog file and the DCP-backend save left
pending by a spawned coordinator are in ``tests/test_issue40_inputs.py`` (they need a filled filesystem or
real ranks, which a case's single call cannot hold).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ucp_store.errors import InvalidNameError, ValidationError

from .framework import CLEAN_ERROR, EXACT_ROUNDTRIP, EXIT_FAIL, NOTHING_DELETED, Case, Ctx, nothing

SEEDED = ("r@1", "r@2", "r@3")
FIFO = "is not a regular file (a FIFO)"


def S(ctx: Ctx) -> list[str]:
    return ["--store", str(ctx.store)]


def cli(*argv: str) -> Callable[[Ctx], list[str]]:
    return lambda ctx: [a.format(**ctx.fields()) for a in argv] + S(ctx)


def err(id: str, surface: str, kind: str, build, expect, needle, *, issue: str, **call) -> Case:
    return Case(id, surface, kind, build, CLEAN_ERROR, expect=expect, needle=needle, issue=issue, **call)


# --- item 8: objects -----------------------------------------------------------------------------------------
TYPED = {
    "tuples": {"betas": (0.9, 0.999), "nested": [(1, (2.0, "x")), ()]},
    "int-float-none-keys": {1: "a", "1": "b", 1.5: "c", None: "d", False: "e"},
    "tuple-keys": {(1, "a"): [1], (2, (3, 4)): (5,)},
    "numpy-scalars": {"f": np.float64(0.1), "i": np.int64(-3), "h": np.float16(1.5), "b": np.bool_(True)},
    "tag-lookalikes": {"__ucp_tuple__": [1, 2], "x": {"__ucp_map__": [[1, 2]]}},
    "keys-json-would-merge-nested": {"a": [{1: "int", "1": "str"}]},
}


def saved_object(value: Any) -> Callable[[Ctx], Any]:
    def call(ctx: Ctx) -> Any:
        s = ctx.open()
        s.save("o", 1, {"w": torch.zeros(2)}, objects={"cfg": value})
        return ctx.open().checkpoint("o@1").objects()["cfg"]
    return call


REFUSED = {
    "set": ({"layers": [0, 1, 2, {1, 2}]}, "objects['cfg']['layers'][3] is a builtins.set"),
    "bytes": ({"raw": b"\x00"}, "objects['cfg']['raw'] is a builtins.bytes"),
    "frozenset-key": ({"k": {frozenset({1}): 1}}, "objects['cfg']['k'] key frozenset({{1}})"),
    "namedtuple": ({"p": os.stat_result(range(10))}, "objects['cfg']['p'] is a os.stat_result"),
    "lone-surrogate": ({"s": ["ok", "a\ud800"]}, "objects['cfg']['s'][1] holds a string with a lone surrogate"),
    "lone-surrogate-key": ({"\udc80": 1}, "lone surrogate U+DC80"),
    "float-subclass": ({"v": type("F", (float,), {})(1.0)}, "objects['cfg']['v'] is a"),
}


def refused_object(value: Any) -> Callable[[Ctx], Any]:
    return lambda ctx: ctx.open().save("o", 1, {"w": torch.zeros(2)}, objects={"cfg": value})


# --- names -----------------------------------------------------------------------------------------------------
TWINS = {"zwj": "ln\u200df", "zwsp": "ln\u200bf", "nbsp": "ln\u00a0f", "bom": "\ufefflnf", "soft-hyphen": "ln\u00adf",
         "hangul-filler": "lnf\u3164", "variation-selector": "lnf\ufe0f", "tag-char": "lnf\U000e0041"}


def twin_tensor(name: str) -> Callable[[Ctx], Any]:
    return lambda ctx: ctx.open().save("n", 1, {"lnf": torch.zeros(2), name: torch.ones(2)})


# --- item 9: safetensors ---------------------------------------------------------------------------------------
def safetensors_with(offsets: dict[str, list[int]], size: int) -> Callable[[Ctx], None]:
    def build(ctx: Ctx) -> None:
        d = ctx.inp / "hf"
        d.mkdir()
        head = {k: {"dtype": "F32", "shape": [(v[1] - v[0]) // 4], "data_offsets": v} for k, v in offsets.items()}
        raw = json.dumps(head).encode()
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(size))
    return build


def hf_config(text: str) -> Callable[[Ctx], None]:
    def build(ctx: Ctx) -> None:
        from safetensors.torch import save_file

        d = ctx.inp / "hf"
        d.mkdir()
        save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, str(d / "model.safetensors"))
        (d / "config.json").write_text(text)
    return build


def config_file(text: str) -> Callable[[Ctx], None]:
    def build(ctx: Ctx) -> None:
        ctx.seed()
        (ctx.inp / "cfg.json").write_text(text)
    return build


# --- item 10: FIFOs --------------------------------------------------------------------------------------------
def hf_fifo(name: str) -> Callable[[Ctx], None]:
    def build(ctx: Ctx) -> None:
        from safetensors.torch import save_file

        d = ctx.inp / "hf"
        d.mkdir()
        if name != "model.safetensors":
            save_file({"model.embed_tokens.weight": torch.ones(4, 2)}, str(d / "model.safetensors"))
        os.mkfifo(d / name)
    return build


def fifo_at(rel: str, seed: bool = False) -> Callable[[Ctx], None]:
    def build(ctx: Ctx) -> None:
        if seed:
            ctx.seed()
        p = ctx.inp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(p)
    return build


def map_fifo(ctx: Ctx) -> None:
    ctx.seed()
    (ctx.inp / "cfg.json").write_text("{}")
    os.mkfifo(ctx.inp / "map.json")


def ds_tag_fifo(ctx: Ctx) -> None:
    tag = ctx.inp / "ds" / "global_step1"
    tag.mkdir(parents=True)
    os.mkfifo(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    os.mkfifo(tag / "mp_rank_00_model_states.pt")


def dcp_data_fifo(ctx: Ctx) -> None:
    """A real DCP folder whose data file was replaced by a FIFO."""
    shutil.copytree(ctx.good_dcp, ctx.inp / "dcp")
    data = next(p for p in (ctx.inp / "dcp").iterdir() if p.name.endswith(".distcp"))
    data.unlink()
    os.mkfifo(data)


# --- item 13: exports onto a full disk (a real tmpfs too small for the version) ---------------------------------
def _mount(ctx: Ctx, name: str, size: str) -> Path:
    d = ctx.tmp / name
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True).returncode:
        d.rmdir()
        pytest.skip("mounting a tmpfs is not permitted here (needs root)")
    ctx.extra.setdefault("closers", []).append(lambda: subprocess.run(["umount", "-l", str(d)], check=False))
    return d


def big_version_small_disk(ctx: Ctx) -> None:
    s = ctx.open()
    with s.begin("big", 1) as w:  # 256 KiB as a weight (torch, dcp, hf, read) and an fp32 master (universal)
        w.write("w", "weight", torch.arange(65536.0))
        w.write("w", "fp32", torch.arange(65536.0))
        w.write_object("hf.config", {"model_type": "llama"})
    s.catalog.engine.dispose()
    _mount(ctx, "small", "64k")


# --- item 15: a read-only store (a tmpfs remounted read-only) ---------------------------------------------------
def read_only_store(ctx: Ctx) -> None:
    d = _mount(ctx, "ro", "4m")
    shutil.copytree(ctx.templates["seeded"], d / "store", symlinks=True)
    subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)


def on_ro(*argv: str) -> Callable[[Ctx], list[str]]:
    return lambda ctx: [a.format(**ctx.fields()) for a in argv] + ["--store", str(ctx.tmp / "ro" / "store")]


def ro_listing(ctx: Ctx, out) -> Any:
    return sorted(f"{r['run']}@{r['step']}" for r in json.loads(out.stdout))


# --- smaller: the universal export's path clash -----------------------------------------------------------------
def clashing(names: tuple[str, ...]) -> Callable[[Ctx], None]:
    def build(ctx: Ctx) -> None:
        s = ctx.open()
        with s.begin("c", 1) as w:
            for n in names:
                w.write(n, "fp32", torch.ones(2))
        s.catalog.engine.dispose()
    return build


HF = ("import", "hf", "{inp}/hf", "--run", "imp", "--step", "1", "--no-progress")

CASES: list[Case] = [
    *[Case(f"api-object-keeps-{k}", "api", "objects", nothing, EXACT_ROUNDTRIP, want=lambda ctx, v=v: v,
           api=saved_object(v), listed=("o@1",), issue="40.8") for k, v in TYPED.items()],
    *[err(f"api-object-refused-{k}", "api", "objects", nothing, ValidationError, needle, api=refused_object(v),
          listed=(), issue="40.8") for k, (v, needle) in REFUSED.items()],
    *[err(f"api-name-invisible-{k}", "api", "names", nothing, InvalidNameError, "invisible character",
          api=twin_tensor(name), listed=(), issue="40.s") for k, name in TWINS.items()],
    err("api-object-name-zero-width", "api", "names", nothing, InvalidNameError, "U+200B",
        api=lambda ctx: ctx.open().save("n", 1, {"w": torch.zeros(1)}, objects={"cfg\u200b": 1}), issue="40.s"),
    # item 9: offsets that do not tile the data section, and configs that are no object
    err("foreign-safetensors-overlap", "foreign", "hf", safetensors_with({"a": [0, 16], "b": [8, 24]}, 24),
        EXIT_FAIL, "overlaps bytes of tensor 'a'", cli=cli(*HF), listed=(), issue="40.9"),
    err("foreign-safetensors-alias", "foreign", "hf", safetensors_with({"a": [0, 16], "b": [0, 16]}, 16),
        EXIT_FAIL, "overlaps the same bytes as tensor 'a'", cli=cli(*HF), listed=(), issue="40.9"),
    err("foreign-safetensors-gap", "foreign", "hf", safetensors_with({"a": [0, 8], "b": [12, 20]}, 20),
        EXIT_FAIL, "a gap of 4 bytes [8, 12) after tensor 'a'", cli=cli(*HF), listed=(), issue="40.9"),
    err("foreign-safetensors-leading-gap", "foreign", "hf", safetensors_with({"a": [4, 12]}, 12),
        EXIT_FAIL, "at the start of the data section", cli=cli(*HF), listed=(), issue="40.9"),
    err("foreign-safetensors-trailing-bytes", "foreign", "hf", safetensors_with({"a": [0, 8]}, 9),
        EXIT_FAIL, "1 bytes after the last tensor", cli=cli(*HF), listed=(), issue="40.9"),
    err("foreign-safetensors-contained", "foreign", "hf", safetensors_with({"a": [0, 32], "b": [8, 16]}, 32),
        EXIT_FAIL, "tensor 'b' (data_offsets [8, 16]) overlaps", cli=cli(*HF), listed=(), issue="40.9"),
    err("foreign-hf-config-list", "foreign", "hf", hf_config("[1, 2, 3]"), EXIT_FAIL,
        "config.json is a JSON list, expected an object", cli=cli(*HF), listed=(), issue="40.9"),
    err("foreign-hf-config-string", "foreign", "hf", hf_config('"llama"'), EXIT_FAIL, "is a JSON str, expected",
        cli=cli(*HF), listed=(), issue="40.9"),
    err("cli-export-hf-config-list", "cli", "hf", config_file("[]"), EXIT_FAIL, "is a JSON list, expected an object",
        cli=cli("export", "hf", "r@1", "{inp}/out", "--config", "{inp}/cfg.json"), issue="40.9"),
    # item 10: FIFOs as inputs answer at once (real processes: a block fails the case by its timeout)
    *[err(f"foreign-hf-fifo-{n.replace('.', '-')}", "foreign", "hf", hf_fifo(n), EXIT_FAIL, f"{n} {FIFO}",
          cli=cli(*HF), subprocess=True, timeout=90, listed=(), issue="40.10")
      for n in ("model.safetensors", "config.json", "generation_config.json", "model.safetensors.index.json")],
    err("foreign-torch-fifo", "foreign", "torch", fifo_at("x.pt"), EXIT_FAIL, f"x.pt {FIFO}",
        cli=cli("import", "torch", "{inp}/x.pt", "--run", "imp", "--step", "1"), subprocess=True, timeout=90,
        listed=(), issue="40.10"),
    err("foreign-dcp-metadata-fifo", "foreign", "dcp", fifo_at("dcp/.metadata"), EXIT_FAIL, f".metadata {FIFO}",
        cli=cli("import", "dcp", "{inp}/dcp", "--run", "imp", "--step", "1"), subprocess=True, timeout=90,
        listed=(), issue="40.10"),
    err("foreign-dcp-data-file-fifo", "foreign", "dcp", dcp_data_fifo, EXIT_FAIL, FIFO,
        cli=cli("import", "dcp", "{inp}/dcp", "--run", "imp", "--step", "1"), subprocess=True, timeout=90,
        listed=(), issue="40.10"),
    err("foreign-deepspeed-fifo", "foreign", "deepspeed", ds_tag_fifo, EXIT_FAIL, f"optim_states.pt {FIFO}",
        cli=cli("import", "deepspeed", "{inp}/ds/global_step1", "--run", "imp", "--step", "1"), subprocess=True,
        timeout=90, listed=(), issue="40.10"),
    err("foreign-universal-fifo", "foreign", "universal", fifo_at("u/zero/optimizer_state.pt"), EXIT_FAIL,
        f"optimizer_state.pt {FIFO}", cli=cli("import", "deepspeed-universal", "{inp}/u", "--run", "imp", "--step",
                                              "1"), subprocess=True, timeout=90, listed=(), issue="40.10"),
    err("cli-export-hf-config-fifo", "cli", "hf", fifo_at("cfg.json", seed=True), EXIT_FAIL, f"cfg.json {FIFO}",
        cli=cli("export", "hf", "r@1", "{inp}/out", "--config", "{inp}/cfg.json"), subprocess=True, timeout=90,
        listed=SEEDED, issue="40.10"),
    err("cli-export-hf-name-map-fifo", "cli", "hf", map_fifo, EXIT_FAIL, f"map.json {FIFO}",
        cli=cli("export", "hf", "r@1", "{inp}/out", "--map", "{inp}/map.json", "--config", "{inp}/cfg.json"),
        subprocess=True, timeout=90, listed=SEEDED, issue="40.10"),
    # item 13: exports onto a disk too small for them: one line, nothing left there
    *[err(f"cli-export-{k}-full-disk", "cli", k, big_version_small_disk, EXIT_FAIL, "no space left on {tmp}/small/",
          cli=cli(*argv), issue="40.13")
      for k, argv in (("torch", ("export", "torch", "big@1", "{tmp}/small/x.pt")),
                      ("universal", ("export", "deepspeed-universal", "big@1", "{tmp}/small/u")),
                      ("dcp", ("export", "dcp", "big@1", "{tmp}/small/d")),
                      ("hf", ("export", "hf", "big@1", "{tmp}/small/h")),
                      ("read-out", ("read", "big@1", "w", "--out", "{tmp}/small/w.npy")))],
    # item 15: a store on a read-only mount is listed, shown, verified and exported from
    Case("store-read-only-mount-ls", "store", "readonly", read_only_store, EXACT_ROUNDTRIP,
         want=lambda ctx: sorted(SEEDED), cli=on_ro("ls", "r", "--json"), got=ro_listing, issue="40.15"),
    Case("store-read-only-mount-verify", "store", "readonly", read_only_store, NOTHING_DELETED,
         cli=on_ro("verify", "r@1"), issue="40.15"),
    Case("store-read-only-mount-export", "store", "readonly", read_only_store, NOTHING_DELETED,
         cli=on_ro("export", "torch", "r@2", "{inp}/r2.pt"), issue="40.15"),
    Case("store-read-only-mount-rm", "store", "readonly", read_only_store, NOTHING_DELETED, cli=on_ro("rm", "r@1"),
         issue="40.15"),  # refused in one line ("read-only filesystem": tests/test_issue40_inputs.py)
    # smaller: a tensor folder that is another tensor's file in a universal export
    err("cli-export-universal-name-clash", "cli", "universal", clashing(("x", "x/fp32.pt")), EXIT_FAIL,
        "tensor 'x/fp32.pt' needs zero/x/fp32.pt as a folder, but tensor 'x' writes the file",
        cli=cli("export", "deepspeed-universal", "c@1", "{inp}/u"), issue="40.s"),
    err("cli-export-universal-optimizer-state-name", "cli", "universal", clashing(("optimizer_state.pt",)), EXIT_FAIL,
        "needs zero/optimizer_state.pt as a folder", cli=cli("export", "deepspeed-universal", "c@1", "{inp}/u"),
        issue="40.s"),
]
