"""Harness of tests/test_pull_dist.py: 2 gloo ranks (forked) publish a run through ``ucp_store.distributed.save(
delta="auto")`` (a keyframe every 3 versions), then pull it as a TP=2 inference engine would: plain tensors of
their own boxes (rows of one weight, columns of another, a replicated norm) and, separately, DTensors.

Every version's full values are made the same on both ranks from one seed, so each rank knows what every box
must hold. Per rank, the records say: what each version stored (encoding per tensor-state, from rank 0's
catalog), whether each pull equals the expected values bit for bit, its routes, bytes read, and the bytes an
independent count gives (the shard indexes of the delta arrays on the route plus their stored chunks within the
rank's box, from ``io/delta.stored_entries``)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys

SHAPES = {"a": (1024, 256), "c": (256, 512), "n": (40000,)}
STEPS = 6


def _versions():
    import torch

    gen = torch.Generator().manual_seed(11)
    cur = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in SHAPES.items()}
    out = []
    for step in range(STEPS):
        out.append({k: v.clone() for k, v in cur.items()})
        for v in cur.values():
            flat = v.view(-1)
            idx = torch.randint(0, flat.numel(), (6 + step,), generator=gen)
            flat[idx] = flat[idx] + 1.0
    return out


def _boxes(rank: int) -> dict:
    return {"a": [[512 * rank, 512 * (rank + 1)], [0, 256]], "c": [[0, 256], [256 * rank, 256 * (rank + 1)]],
            "n": [[0, 40000]]}


def _cut(t, box):
    return t[tuple(slice(a, b) for a, b in box)]


def _independent(st, have: str, want: str, name: str, box) -> int:
    from ucp_store.io import delta as dl
    from ucp_store.io import deltaio
    from ucp_store.io import format as fmt
    from ucp_store.registry.pull import plan_pull

    tr = plan_pull(st, have, want, [(name, "weight")])[(name, "weight")]
    info = st.checkpoint(want).info(name, "weight")
    layout = fmt.ArrayLayout(info.dtype, info.shape, info.chunk_shape, info.shard_shape)
    total = 0
    for a in tr.deltas:
        kv = deltaio.open_kvstore(st.location, a.path)
        total += sum(e.nbytes for e in dl.stored_entries(kv, layout, box))
        shards = {dl.shard_of_chunk(layout, c)[0] for c in layout.chunks_touching(box)}
        total += len(shards) * dl.index_nbytes(layout)
    return total


def _publish(spec, rank, world, mesh, versions) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import ucp_store.distributed as ucpd
    from ucp_store.distributed import publish

    places = {"a": [Shard(0)], "c": [Shard(1)], "n": [Replicate()]}
    kept_in_memory = []
    for step, full in enumerate(versions):
        sd = {"model": {k: DTensor.from_local(_cut(v, _boxes(rank)[k]).clone(), mesh, places[k], run_check=False)
                        for k, v in full.items()}}
        ucpd.save(sd, store=spec["store"], run="pub", step=step, delta="auto", progress=False)
        kept_in_memory.append(len(publish._published))
    out: dict = {"kept_in_memory": kept_in_memory}
    if rank == 0:
        import ucp_store

        st = ucp_store.open_store(spec["store"])
        out["encodings"] = [{i.name: i.encoding for i in st.checkpoint(f"pub@{s}").tensors()} for s in range(STEPS)]
        out["verify"] = [st.checkpoint(f"pub@{s}").verify() for s in range(STEPS)]
    torch.distributed.barrier()
    return out


def _pulls(spec, rank, versions) -> list[dict]:
    import torch

    import ucp_store
    from ucp_store.puller import pull

    st = ucp_store.open_store(spec["store"]) if rank == 0 else None  # others never open the catalog
    boxes = _boxes(rank)
    held = {k: _cut(versions[0][k], boxes[k]).clone() for k in SHAPES}
    records = []
    for have, want in ((0, 1), (1, 2), (2, 5), (5, 4)):
        res = pull(spec["store"], f"pub@{have}", f"pub@{want}", held, boxes=boxes, verify=True)
        exact = all(torch.equal(held[k].view(torch.int16), _cut(versions[want][k], boxes[k]).view(torch.int16))
                    for k in SHAPES)
        rec = {"have": have, "want": want, "exact": exact, "kinds": {t.label: t.kind for t in res.tensors},
               "bytes": {t.label: t.bytes_read for t in res.tensors},
               "verified": {t.label: t.verified for t in res.tensors},
               "delta_bytes": {t.label: t.delta_bytes for t in res.tensors}, "phases": res.phases}
        if st is not None:  # for both ranks' boxes (rank 0 alone has the catalog)
            rec["independent"] = [{k: _independent(st, f"pub@{have}", f"pub@{want}", k,
                                                   tuple(map(tuple, _boxes(r)[k]))) for k in SHAPES}
                                  for r in range(2)]
        records.append(rec)
    return records


def _dtensor_pull(spec, rank, mesh, versions) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from ucp_store.puller import pull

    places = {"a": [Shard(0)], "c": [Shard(1)], "n": [Replicate()]}
    boxes = _boxes(rank)
    held = {k: DTensor.from_local(_cut(versions[1][k], boxes[k]).clone(), mesh, places[k], run_check=False)
            for k in SHAPES}
    res = pull(spec["store"], "pub@1", "pub@2", held)
    exact = all(torch.equal(held[k].to_local().view(torch.int16), _cut(versions[2][k], boxes[k]).view(torch.int16))
                for k in SHAPES)
    return {"exact": exact, "kinds": {t.label: t.kind for t in res.tensors}}


def rank_main(spec: dict, rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ucp_store import config

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_dt.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    versions = _versions()
    with config.override(delta_keyframe_every=3):
        out = _publish(spec, rank, world, mesh, versions)
    out["pulls"] = _pulls(spec, rank, versions)
    out["dtensor"] = _dtensor_pull(spec, rank, mesh, versions)
    dist.destroy_process_group()
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from one_writer_ranks import launch

    print(json.dumps(launch({"world": 2, **json.loads(sys.argv[1])}, rank_main)))
