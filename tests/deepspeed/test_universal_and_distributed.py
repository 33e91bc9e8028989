"""``import deepspeed-universal`` (an existing ds_to_universal folder) and the distributed import
(torchrun, 2 gloo processes, one commit by rank 0)."""

from __future__ import annotations

import itertools

import pytest
import torch

from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.universal import export_universal, import_universal

pytestmark = pytest.mark.slow


def _hashes(ck) -> dict:
    return {(i.name, i.state): (i.content_hash, i.pattern) for i in ck.tensors()}


def test_import_universal_equals_tag_import(ds, cmp, ds_name, tmp_path):
    """The universal folder ds_to_universal wrote imports to the same tensors (content hashes) as our
    direct import of the tag folder, and exports back to the same files."""
    store = ds.store
    run = f"u-{ds_name.replace('_', '-')}"
    cid = import_universal(store, str(ds.ds_universal(ds_name)), run, progress=False)
    uni = store.checkpoint(cid)
    direct = store.checkpoint(f"{ds_name}@{ds.steps}")
    assert uni.provenance["source_kind"] == "deepspeed_universal"
    a, b = _hashes(uni), _hashes(direct)
    zero3 = ds.configs[ds_name]["zero"] == 3
    for key, (h, pattern) in a.items():
        assert key in b, key
        assert h == b[key][0], f"{key}: content differs"
        assert pattern == b[key][1], f"{key}: pattern {pattern} vs {b[key][1]}"
    # listed in the tag folder import's parameter order (param_shapes), each parameter's states together
    names_u = [n for n, _ in itertools.groupby(i.name for i in uni.tensors())]  # one run per parameter
    assert len(names_u) == len(set(names_u)), names_u
    params = {i.name for i in uni.tensors() if i.state == "fp32"}  # its parameter folders (frozen, buffers aside)
    names_d = [n for n in dict.fromkeys(i.name for i in direct.tensors()) if n in params]
    assert [n for n in names_u if n in params] == names_d, (names_u, names_d)
    missing = set(b) - set(a)
    if zero3:  # ds_to_universal drops ZeRO-3 frozen params/buffers: the direct import keeps them
        assert {n for n, _ in missing} == {"frozen.weight", "shift"}
    else:
        assert not missing
    out = export_universal(uni, str(tmp_path / "re"), tag=ds.utag, progress=False)
    files_a, files_b = cmp.files(tmp_path / "re" / ds.utag), cmp.files(ds.ds_universal(ds_name))
    assert set(files_a) == set(files_b)
    for rel in files_b:
        assert cmp.equal(torch.load(files_a[rel], weights_only=True), sp.load(files_b[rel], mmap=False)), rel
    assert out.endswith(ds.utag)


@pytest.mark.parametrize("name", ["z2_fp32", "tp2_bf16", "z3_bf16"])
def test_distributed_import_equals_single(ds, tmp_path, name):
    """Under torchrun each rank converts its share of the parameters, rank 0 writes the objects and
    commits once after a barrier: the same tensor-states (content hashes, patterns) as one process."""
    from ucp_store import open_store

    store_path = tmp_path / "store"
    open_store(str(store_path), create=True)
    proc = ds.torchrun(["-m", "ucp_store.deepspeed.source", str(store_path), str(ds.tag_dir(name)),
                        "--run-name", "dist", "--distributed"], 2)
    assert '"checkpoint"' in proc.stdout
    store = open_store(str(store_path))
    cks = store.list_checkpoints("dist")
    assert len(cks) == 1 and cks[0]["status"] == "committed"
    dist_ck = store.checkpoint("dist@latest")
    single = ds.store.checkpoint(f"{name}@{ds.steps}")
    assert _hashes(dist_ck) == _hashes(single)
    assert dist_ck.provenance["extra"]["ranks"] == 2
    assert set(dist_ck.provenance["source_hashes"]) == set(single.provenance["source_hashes"])
    objs_d, objs_s = dist_ck.objects(), single.objects()
    assert objs_d["deepspeed/universal_meta"] == objs_s["deepspeed/universal_meta"]
    assert objs_d["global_steps"] == objs_s["global_steps"]
