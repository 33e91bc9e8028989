"""Test-only crash injection: ``killpoint("name")`` SIGKILLs this process when ``UCP_KILL_AT`` names it.

``UCP_KILL_AT=name`` kills at the first hit of point ``name``; ``UCP_KILL_AT=name:N`` at its N-th hit
(1-based). The variable is read once, at import (or by :func:`rearm`, for a forked test child), so an unset
variable costs one ``is None`` test per call. The process kills itself with SIGKILL: no ``finally``, no
``atexit``, no flushed buffers, exactly what a power cut or the OOM killer leaves behind.

The points (tests/test_killpoints.py tries every one on SQLite and PostgreSQL, folder and S3 stores;
``tools/fault_table.py`` prints the table):

==========================  ====================================================================
``save.after_begin``        ``Store.begin``: the pending checkpoint row is committed, nothing written
``write.array_created``     ``CheckpointWriter._put_array``: the array's zarr.json exists, no chunk yet
``write.array_written``     ``CheckpointWriter._complete_write``: an array write returned, its rows not yet
``write.shard_box``         ``CheckpointWriter.write_shard``: one box of a sharded array submitted
``flush.before_rows``       ``CheckpointWriter.flush``: arrays durable, their rows not inserted
``flush.mid_rows``          ``CheckpointWriter.flush``: inside the row transaction, array rows sent
``flush.after_rows``        ``CheckpointWriter.flush``: a row batch committed (still pending)
``commit.in_txn``           ``CheckpointWriter.commit``: status flipped and sent, transaction open
``commit.after``            ``CheckpointWriter.commit``: the version is committed
``abort.after_row``         ``CheckpointWriter.abort``: pending row deleted, arrays not swept
``import.after_records``    ``adapters.base.import_source``: every record written, objects/commit not
``dist.mid_write``          ``ucp_store.distributed`` save: one box written, the rest and the commit not
``async.mid_copy``          lazy ``ucp_store.distributed.async_save``: one box copied by the background snapshot
``gc.after_rows``           ``retention.gc``: victims' and dead pending rows deleted, no file swept
``rm.after_row``            ``Store.rm``: the version's rows deleted, no file swept
``sweep.mid``               ``retention.sweep_arrays``: one array deleted (row and files), more to go
``export.torch``            torch-file export: the temporary file written, not renamed
``export.universal``        universal export: one parameter's files written under the partial folder
``export.dcp``              DCP export: one tensor handed to DCP's writer
``export.hf``               Hugging Face export: one tensor written into the temporary folder
==========================  ====================================================================

Points of multi-rank saves, tried on real gloo ranks by their own tests (``RANK_POINTS``, not the
single-process matrix):

==========================  ====================================================================
``tier.replicate``          tiered save: a replica object written on the partner, its rows not yet
``tier.drain``              tiered save's drain: an object written to the durable tier, its rows not yet
``tier.evict``              tiered save's drain: fast copies marked evicted, their folders not yet deleted
==========================  ====================================================================
"""

from __future__ import annotations

import os
import signal

from ucp_store import config

__all__ = ["POINTS", "RANK_POINTS", "killpoint", "rearm"]

POINTS = ("save.after_begin", "write.array_created", "write.array_written", "write.shard_box",
          "flush.before_rows", "flush.mid_rows", "flush.after_rows", "commit.in_txn", "commit.after",
          "abort.after_row", "import.after_records", "dist.mid_write", "async.mid_copy",
          "gc.after_rows", "rm.after_row",
          "sweep.mid", "export.torch", "export.universal", "export.dcp", "export.hf")
#: points on the ranks of a multi-rank save (tests/test_tiers_dist.py tries them)
RANK_POINTS = ("tier.replicate", "tier.drain", "tier.evict")

_target: str | None = None
_hit_at = 1
_hits = 0


def rearm(spec: str | None = None) -> None:
    """(Re)read the target: ``spec``, or when None the ``kill_at`` setting / ``$UCP_KILL_AT``
    (``config.kill_at``). Raises on an unknown point name."""
    global _target, _hit_at, _hits
    spec = config.kill_at() if spec is None else spec
    _hits = 0
    if not spec:
        _target = None
        return
    name, _, n = spec.partition(":")
    if name not in POINTS + RANK_POINTS:
        raise ValueError(f"UCP_KILL_AT={spec!r}: unknown kill point {name!r}; known: {', '.join(POINTS + RANK_POINTS)}")
    try:
        _hit_at = int(n) if n else 1
    except ValueError:
        raise ValueError(f"UCP_KILL_AT={spec!r}: the hit count after ':' must be an integer") from None
    if _hit_at < 1:
        raise ValueError(f"UCP_KILL_AT={spec!r}: the hit count after ':' must be >= 1")
    _target = name


def killpoint(name: str) -> None:
    """SIGKILL this process if ``name`` is the armed point and this is its armed hit."""
    global _hits
    if _target is None or name != _target:
        return
    _hits += 1
    if _hits >= _hit_at:
        os.kill(os.getpid(), signal.SIGKILL)


rearm()
