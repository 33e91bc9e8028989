"""DCP round trip with real torch.distributed (gloo) processes: a TP x FSDP2 job saves, ucp imports and
exports, DCP loads the export.

The job (a small MLP with tensor-parallel column/row linears, a replicated norm and head, FSDP2 over the
data-parallel mesh dimension, AdamW, a StepLR scheduler) trains three steps on a 2 x 2 (dp x tp) mesh of
four gloo processes and saves with DCP three ways: the nested layout (``model.*``, ``optim.state.*``),
the flat torchtitan layout (model FQNs at the top level, ``optimizer.state.*``,
``optimizer.param_groups.<fqn>.*``), and the nested layout in DCP's safetensors serialization. Beside
the tensors it saves non-tensor state: the scheduler, step counters, a data-loader-like dict, and a
``datetime`` that only a full unpickler can rebuild (so ucp must keep it opaque and return it
byte-identical).

``ucp import dcp`` and ``ucp export dcp`` run through the CLI. Then DCP loads, on the same 2 x 2 mesh
and on a 1 x 2 mesh of two processes, both the original folder and the export, into freshly built
models (``get_state_dict`` / ``set_state_dict``), and takes one more training step. The test asserts the
full model and optimizer state, the next-step loss and every non-tensor value are bit-equal between the
original and the export, and that ucp's tensors equal the job's own full tensors.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import ucp_store
from ucp_store import cli
from ucp_store.formats.dcp.adapter import opaque_entries

from ucp_test_helpers import run_python

pytestmark = pytest.mark.slow

JOB = r'''
import datetime, os, sys, torch, torch.nn as nn, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
mode, out = sys.argv[1], sys.argv[2]
dp, tp = int(sys.argv[3]), int(sys.argv[4])
mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
dp_rank = mesh["dp"].get_local_rank()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.head(self.norm(self.down(torch.relu(self.up(x)))))


def build():
    torch.manual_seed(0)
    m = Net()
    parallelize_module(m, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return m, opt, sched


def step(m, opt, sched, i):
    g = torch.Generator().manual_seed(1000 * i + dp_rank)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
    loss = ((m(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    return loss.detach().clone()


def full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


def extras(fill):
    if fill:
        return ({"step": 3, "tokens_seen": 3 * 4 * dp, "losses": [0.5, 0.25, float("nan")]},
                {"epoch": 1, "offset": 96, "order": (3, 1, 2), "source": "shard-0",
                 "started": datetime.datetime(2026, 12, 3, 17, 55, 0)})
    return ({"step": 0, "tokens_seen": 0, "losses": []},
            {"epoch": 0, "offset": 0, "order": (), "source": "", "started": None})


def state(m, opt, sched, layout, fill):
    flat = layout == "flat"
    msd, osd = get_state_dict(m, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    train, loader = extras(fill)
    rest = {"lr_scheduler": sched.state_dict(), "train_state": train, "dataloader": loader}
    return ({**msd, "optimizer": osd, **rest} if flat else {"model": msd, "optim": osd, **rest}), flat


def dump(m, opt, sched, sd, losses):
    msd, osd = get_state_dict(m, opt)
    model = {k: full(v) for k, v in msd.items()}
    optim = {f: {s: full(t) for s, t in st.items()} for f, st in osd["state"].items()}
    groups = [{k: v for k, v in g.items()} for g in osd["param_groups"]]
    if rank == 0:
        others = {k: v for k, v in sd.items() if k in ("lr_scheduler", "train_state", "dataloader")}
        torch.save({"model": model, "optim": optim, "groups": groups, "sched": sched.state_dict(),
                    "others": repr(others), "losses": losses}, out)


m, opt, sched = build()
if mode == "save":
    for i in range(3):
        step(m, opt, sched, i)
    for layout, folder, fmt in (("nested", "nested", "torch"), ("flat", "flat", "torch"),
                                ("nested", "nested_st", "safetensors")):
        sd, _ = state(m, opt, sched, layout, True)
        ser = SerializationFormat.SAFETENSORS if fmt == "safetensors" else SerializationFormat.TORCH_SAVE
        dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(os.path.dirname(out), folder),
                                                      serialization_format=ser))
    dump(m, opt, sched, state(m, opt, sched, "nested", True)[0], [])
else:  # load: sys.argv[5:] = folder layout dumpfile, repeated; a fresh model for each
    args = sys.argv[5:]
    for folder, layout, dumpfile in zip(args[0::3], args[1::3], args[2::3]):
        m, opt, sched = build()
        sd, flat = state(m, opt, sched, layout, False)
        dcp.load(sd, checkpoint_id=folder)
        if flat:
            msd = {k: v for k, v in sd.items() if k not in ("optimizer", "lr_scheduler", "train_state", "dataloader")}
            osd = sd["optimizer"]
        else:
            msd, osd = sd["model"], sd["optim"]
        set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd,
                       options=StateDictOptions(flatten_optimizer_state_dict=flat))
        sched.load_state_dict(sd["lr_scheduler"])
        out = dumpfile + ".loaded"
        dump(m, opt, sched, sd, [])  # the state as loaded, before any step
        out = dumpfile
        loss = step(m, opt, sched, 3)
        dump(m, opt, sched, sd, [loss])
dist.barrier()
dist.destroy_process_group()
'''


def _torchrun(tmp_path, nproc, *args, port_offset=0):
    script = tmp_path / "dcp_job.py"
    script.write_text(JOB)
    port = 29000 + (os.getpid() * 7 + port_offset) % 900
    res = run_python(["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port", str(port),
                      str(script), *map(str, args)], timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]


def _ucp(*argv) -> None:
    assert cli.main([*map(str, argv), "--no-progress"]) == 0


def _bits_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                           b.view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _bits_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _bits_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), (where, a, b)


def test_tp_fsdp2_dcp_round_trip(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    _torchrun(tmp_path, 4, "save", job / "truth.pt", 2, 2)
    truth = torch.load(job / "truth.pt", weights_only=True)
    store = tmp_path / "store"
    for step, folder in ((1, "nested"), (2, "flat"), (3, "nested_st")):
        _ucp("import", "dcp", job / folder, "--run", "job", "--step", step, "--store", store)
    st = ucp_store.open_store(str(store))
    cks = {f: st.checkpoint(f"job@{s}") for s, f in ((1, "nested"), (2, "flat"), (3, "nested_st"))}

    # ucp holds the job's full tensors, whatever the layout or serialization
    for f, ck in cks.items():
        for name, t in truth["model"].items():
            _bits_equal(ck.read(name, "weight"), t, f"{f}:{name}")
        for fqn, states in truth["optim"].items():
            for s, t in states.items():
                _bits_equal(ck.read(fqn, s), t, f"{f}:{fqn}.{s}")
        assert len(ck.tensors()) == len(truth["model"]) + sum(len(v) for v in truth["optim"].values())
        # plain values became JSON; the datetime needs a global outside the allow-list: opaque
        objs = ck.objects()
        assert objs["train_state.step"] == 3 and objs["dataloader.source"] == "shard-0"
        assert objs["lr_scheduler.last_epoch"] == 3
        assert [o["key"] for o in opaque_entries(ck)] == ["dataloader.started"], f
    # the two serializations of one state import to the same arrays (content hashes)
    h = {f: {(i.name, i.state): i.content_hash for i in ck.tensors()} for f, ck in cks.items()}
    assert h["nested"] == h["nested_st"] == h["flat"]

    for f in ("nested", "flat"):
        _ucp("export", "dcp", f"job@{1 if f == 'nested' else 2}", job / f"{f}_export", "--store", store)
    # the opaque blob went back byte-identical
    from ucp_store.safe_pickle import load_dcp_metadata

    for f in ("nested", "flat"):
        src, exp = load_dcp_metadata(job / f / ".metadata"), load_dcp_metadata(job / f"{f}_export" / ".metadata")
        assert set(src.state_dict_metadata) == set(exp.state_dict_metadata)
        assert src.planner_data == exp.planner_data

        def blob(folder, md, key="dataloader.started"):
            info = next(v for k, v in md.storage_data.items() if k.fqn == key)
            with open(folder / info.relative_path, "rb") as fh:
                fh.seek(info.offset)
                return fh.read(info.length)

        assert blob(job / f, src) == blob(job / f"{f}_export", exp)

    for nproc, dp, tp in ((4, 2, 2), (2, 1, 2)):
        folders = ("nested", "nested_export", "flat", "flat_export")
        args = []
        for which in folders:
            args += [job / which, "flat" if which.startswith("flat") else "nested", job / f"{which}_{dp}x{tp}.pt"]
        _torchrun(tmp_path, nproc, "load", job / "unused.pt", dp, tp, *args, port_offset=nproc)
        got = {w: torch.load(job / f"{w}_{dp}x{tp}.pt", weights_only=True) for w in folders}
        loaded = {w: torch.load(job / f"{w}_{dp}x{tp}.pt.loaded", weights_only=True) for w in folders}
        for f in ("nested", "flat"):
            # DCP really loaded the saved state (the job's own full tensors), from the original and the export
            for w in (f, f"{f}_export"):
                _bits_equal(loaded[w]["model"], truth["model"], f"loaded model {dp}x{tp} {w}")
                _bits_equal(loaded[w]["optim"], truth["optim"], f"loaded optim {dp}x{tp} {w}")
                _bits_equal(loaded[w]["sched"], truth["sched"], f"loaded scheduler {dp}x{tp} {w}")
            a, b = got[f], got[f"{f}_export"]
            _bits_equal(a["model"], b["model"], f"model {dp}x{tp} {f}")
            _bits_equal(a["optim"], b["optim"], f"optim {dp}x{tp} {f}")
            _bits_equal(a["groups"], b["groups"], f"groups {dp}x{tp} {f}")
            _bits_equal(a["sched"], b["sched"], f"sched {dp}x{tp} {f}")
            _bits_equal(a["losses"], b["losses"], f"next-step loss {dp}x{tp} {f}")
            assert a["others"] == b["others"] and "datetime.datetime(2026, 12, 3, 17, 55)" in a["others"]
            assert ("'tokens_seen': 24" in a["others"]) and "nan" in a["others"]
            assert not torch.equal(a["model"]["up.weight"], truth["model"]["up.weight"])  # the step did train
