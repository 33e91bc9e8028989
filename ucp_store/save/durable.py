"""When a writer's array files become durable: at once (TensorStore's fsync per file), or, deferred, in one
parallel fsync pass before any row names them (``CheckpointWriter.defer_durability``)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ucp_store.errors import WriteError
from ucp_store.io import localwrite
from ucp_store.registry.context import StoreContext

__all__ = ["SYNC_WORKERS", "Durability"]

SYNC_WORKERS = 16  # concurrent fsyncs of a deferred-durability pass (the journal commits them together)


class Durability:
    """The durability of one writer's files: the TensorStore context its arrays are written with, the array
    folders not yet made durable (deferred), and the folders whose entries ``localwrite`` changed (synced
    once, when the writes in flight have returned: :meth:`sync_dirs`)."""

    def __init__(self, ctx: StoreContext, checkpoint_id: str):
        self.ctx = ctx
        self.id = checkpoint_id
        self._context: Any = None
        self._unsynced: set[str] | None = None
        #: folders whose entries localwrite changed: fsynced once in ``sync_dirs``
        self.local_dirs: set[str] = set()

    @property
    def deferred(self) -> bool:
        """Whether files are made durable by :meth:`make_durable` passes instead of one by one."""
        return self._unsynced is not None

    def array_context(self) -> Any:
        """The TensorStore context this writer's arrays are written with."""
        return self._context if self._context is not None else self.ctx.context

    def defer(self) -> None:
        """From now on, write without an fsync per file (the caller drained the writes in flight first)."""
        if self._unsynced is None:
            self._context = self.ctx.unsynced_context
            self._unsynced = set()

    def touch(self, rel: str) -> None:
        """The array folder ``rel`` was written to (the next pass makes it durable, when deferred)."""
        if self._unsynced is not None:
            self._unsynced.add(rel)

    def make_durable(self) -> None:
        """fsync every file and folder under the array folders written since the last pass, and the folders
        that hold them (the checkpoint's folder, the arrays folder), in parallel."""
        if not self._unsynced:
            return
        rels, self._unsynced = sorted(self._unsynced), set()
        self._sync_rels(rels)

    def make_durable_async(self) -> Future:
        """Start the pass over what was written until now on a thread; returns its Future (``result()``
        re-raises a failure). What is written later goes to the next pass."""
        rels = sorted(self._unsynced or ())
        if self._unsynced is not None:
            self._unsynced = set()
        done: Future = Future()
        if not rels:
            done.set_result(None)
            return done

        def run() -> None:
            try:
                self._sync_rels(rels)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the pass
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=run, name="ucp-durable", daemon=True).start()
        return done

    def _sync_rels(self, rels: list[str]) -> None:
        root = self.ctx.location.root
        paths: list[str] = []
        for rel in rels:
            top = os.path.join(root, rel)
            for folder, _, files in os.walk(top):
                paths.extend(os.path.join(folder, f) for f in files)
                paths.append(folder)
        paths.extend(sorted({os.path.dirname(os.path.join(root, rel).rstrip("/")) for rel in rels}))
        paths.append(os.path.join(root, os.path.dirname(os.path.dirname(rels[0].rstrip("/")))))

        def sync(path: str) -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # another rank's temporary file, renamed meanwhile (that rank syncs it)
                return
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        try:
            with ThreadPoolExecutor(SYNC_WORKERS, thread_name_prefix="ucp-fsync") as pool:
                list(pool.map(sync, paths))
        except OSError as exc:
            raise WriteError(f"making the arrays of checkpoint {self.id} durable failed: {exc}") from None

    def sync_dirs(self) -> None:
        """fsync the folders whose entries the local write path changed (the renamed shard files' entries:
        durable before anyone relies on them). Call once the writes in flight have returned."""
        if self.local_dirs:
            dirs, self.local_dirs = self.local_dirs, set()
            try:
                localwrite.sync_dirs(dirs)
            except OSError as exc:
                raise WriteError(f"checkpoint {self.id}: syncing its array folders failed: {exc}") from None
