"""Real DeepSpeed checkpoints (CPU, 2 gloo processes under torchrun), generated once per session.

Every checkpoint here is written by DeepSpeed itself (``ucp_store/demo/ds_train.py``), including the tensor-parallel
one (AutoTP training, ``tensor_parallel.autotp_size = 2``) and the pipeline one (``PipelineModule`` with 2
stages); each is also converted by ``python -m deepspeed.checkpoint.ds_to_universal`` for comparison.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ucp_test_helpers import fork_jobs, torchrun

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["-m", "ucp_store.demo.ds_train"]  # the harness `ucp demo --deepspeed` runs
STEPS = 3
TAG = f"global_step{STEPS}"
UTAG = f"{TAG}_universal"

# name -> training job (all 2 processes; DP=2 unless TP/PP use the processes)
CONFIGS: dict[str, dict] = {
    "z1_bf16": {"model": "mlp", "zero": 1, "dtype": "bf16"},
    # bf16 + ZeRO-1 + fp32 gradient accumulation: DeepSpeed's BF16_Optimizer (padded fp32 partitions)
    "z1_bf16opt": {"model": "mlp", "zero": 1, "dtype": "bf16", "grad_accum_dtype": "fp32"},
    "z2_fp32": {"model": "mlp", "zero": 2, "dtype": "fp32"},
    "z2_fp16": {"model": "mlp", "zero": 2, "dtype": "fp16"},
    "z3_bf16": {"model": "mlp", "zero": 3, "dtype": "bf16", "sub_group_size": 10},
    "z3_fp32": {"model": "mlp", "zero": 3, "dtype": "fp32", "sub_group_size": 10},
    # AutoTP must come after the plain engines and the pipeline engine last: both leave model-parallel
    # groups behind in DeepSpeed's process-global state
    "tp2_bf16": {"model": "tp", "tp": 2, "zero": 1, "dtype": "bf16"},
    "pp2_bf16": {"model": "pipe", "stages": 2, "zero": 1, "dtype": "bf16"},
}
# how each checkpoint is resumed (the target model at TP=1, PP=1: DP = number of processes)
RESUME_AS = {
    "tp2_bf16": {"model": "tp", "tp": 1},
    "pp2_bf16": {"model": "pipe", "stages": 1},
}


def run_jobs(jobs: list[dict], nproc: int, where: Path, name: str, *, timeout: int = 600) -> None:
    """``nproc`` ranks of the ``ucp demo --deepspeed`` harness running ``jobs`` in order (``fork_jobs``)."""
    fork_jobs(jobs, nproc, where, name, timeout=timeout)


class DSSession:
    configs = CONFIGS
    steps = STEPS
    utag = UTAG

    def __init__(self, root: Path):
        self.root = root
        self.store_path = root / "store"
        self._store = None

    @staticmethod
    def torchrun(args: list[str], nproc: int, **kw) -> subprocess.CompletedProcess:
        return torchrun(args, nproc, **kw)

    def tag_dir(self, name: str) -> Path:
        return self.root / name / TAG

    def ds_universal(self, name: str) -> Path:
        return self.root / name / UTAG

    def export_root(self, name: str) -> Path:
        return self.root / f"export_{name}"

    def ucp_universal(self, name: str) -> Path:
        return self.export_root(name) / UTAG

    def train_result(self, name: str) -> dict:
        return json.loads((self.root / f"train_{name}.json").read_text())

    @property
    def store(self):
        if self._store is None:
            from ucp_store import open_store

            self._store = open_store(str(self.store_path), create=True)
        return self._store


@pytest.fixture(scope="session")
def ds(tmp_path_factory) -> DSSession:
    """Train, save and ds_to_universal-convert every config (one torchrun launch), import each into one
    store (run = config name) and export it as a universal folder."""
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("ds")
    sess = DSSession(root)
    jobs = []
    for name, cfg in CONFIGS.items():
        jobs.append({"kind": "train", **cfg, "steps": STEPS, "save_dir": str(root / name), "tag": TAG,
                     "convert": True, "next_steps": 2, "out": str(root / f"train_{name}.json")})
    run_jobs(jobs, 2, root, "train_jobs")
    from ucp_store.deepspeed.source import import_deepspeed
    from ucp_store.deepspeed.universal import export_universal

    for name in CONFIGS:
        import_deepspeed(sess.store, str(sess.tag_dir(name)), name, progress=False)
        export_universal(sess.store.checkpoint(f"{name}@{STEPS}"), str(sess.export_root(name)), tag=UTAG,
                         progress=False)
    return sess


@pytest.fixture(scope="session")
def resumes(ds: DSSession) -> dict:
    """Resume every config from DeepSpeed's universal folder and from ours, at DP 2 and DP 1 (target
    TP=1, PP=1), plus the AutoTP checkpoint into an AutoTP TP=2 target (2 processes).

    Returns {(config, "ds"|"ucp", dp): result json}; the TP=2 target is under config "tp2_bf16@tp2"."""
    out = {}
    for nproc in (2, 1):
        jobs, keys = [], []
        plan = [(name, {**cfg, **RESUME_AS.get(name, {})}) for name, cfg in CONFIGS.items()]
        if nproc == 2:  # AutoTP target, before the pipeline engine (see CONFIGS)
            plan.insert(len(plan) - 1, ("tp2_bf16@tp2", dict(CONFIGS["tp2_bf16"])))
        for key, cfg in plan:
            name = key.split("@")[0]
            for who, root in (("ds", ds.root / name), ("ucp", ds.export_root(name))):
                fname = ds.root / f"resume_{key.replace('@', '_')}_{who}_{nproc}.json"
                jobs.append({"kind": "resume", **cfg, "load_dir": str(root), "tag": UTAG, "steps": 2,
                             "out": str(fname)})
                keys.append(((key, who, nproc), fname))
        run_jobs(jobs, nproc, ds.root, f"resume_jobs_{nproc}")
        for k, fname in keys:
            out[k] = json.loads(fname.read_text())
    return out


# ------------------------------------------------------------------------------------ comparisons
def tensors_equal(a, b) -> bool:
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


def ds_universal_files(folder: Path) -> dict[str, Path]:
    """relpath -> path of every per-parameter file under zero/ (optimizer_state.pt excluded)."""
    zero = folder / "zero"
    return {str(p.relative_to(folder)): p for p in sorted(zero.rglob("*.pt")) if p.name != "optimizer_state.pt"}


@pytest.fixture(scope="session")
def cmp():
    class H:
        equal = staticmethod(tensors_equal)
        files = staticmethod(ds_universal_files)
        run_jobs = staticmethod(run_jobs)
        torchrun = staticmethod(torchrun)
    return H


def pytest_generate_tests(metafunc):
    """``ds_name``: every DeepSpeed config above; ``ds_dp``: the DP degrees resumed at."""
    if "ds_name" in metafunc.fixturenames:
        metafunc.parametrize("ds_name", list(CONFIGS))
    if "ds_dp" in metafunc.fixturenames:
        metafunc.parametrize("ds_dp", [1, 2])
