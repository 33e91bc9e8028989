"""When a writer's array files become durable: at once (TensorStore's fsync per file), or, deferred, in one
parallel fsync pass before any row names them (``CheckpointWriter.defer_durability``)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

from ucp_store.errors import WriteError
from ucp_store.io import localwrite
from ucp_store.io.pools import LazyPool
from ucp_store.registry.context import StoreContext

__all__ = ["SYNC_WORKERS", "Durability"]

SYNC_WORKERS = 16  # concurrent fsyncs of a deferred-durability pass (the journal commits them together)
# one pool for every pass: a pool made per pass started its 16 threads on every save (tens of ms)
_SYNC_POOL = LazyPool("ucp-fsync", "sync_threads", lambda cpus: SYNC_WORKERS)


class Durability:
    """The durability of one writer's files: the TensorStore context its arrays are written with, the array
    folders not yet made durable (deferred), and the folders whose entries ``localwrite`` changed (synced
    once, when the writes in flight have returned: :meth:`sync_dirs`)."""

    def __init__(self, ctx: StoreContext, checkpoint_id: str):
        self.ctx = ctx
        self.id = checkpoint_id
        self._context: Any = None
        self._unsynced: set[str] | None = None
        self._files: set[tuple[str, str]] = set()  # (array folder, file name): fsynced alone (``touch_file``)
        #: folders whose entries the local write path changed while deferred (new sub-folders, renamed shard
        #: files): fsynced by the next pass; the write pool's threads add to it
        self.changed_dirs: set[str] = set()
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

    def touch_file(self, rel: str, name: str) -> None:
        """Only file ``name`` of array folder ``rel`` was written: the next pass fsyncs it and the folders that
        hold it, not every file under ``rel``. Why: the origin writes each zarr.json last, into folders that
        every rank's shard files fill; walking them made the commit fsync the whole save again."""
        if self._unsynced is not None:
            self._files.add((rel, name))

    def _take(self) -> tuple[list[str], list[tuple[str, str]], list[str]]:
        rels, files = sorted(self._unsynced or ()), sorted(self._files)
        if self._unsynced is not None:
            self._unsynced = set()
        self._files = set()
        dirs = sorted(set(self.changed_dirs))  # copied, then cleared: the set object stays the writers'
        self.changed_dirs.difference_update(dirs)
        return rels, files, dirs

    def make_durable(self) -> None:
        """fsync every file and folder under the array folders written since the last pass, each file touched
        alone, and the folders that hold them (the checkpoint's folder, the arrays folder), in parallel."""
        rels, files, dirs = self._take()
        if rels or files or dirs:
            self._sync_rels(rels, files, dirs)

    def make_durable_async(self) -> Future:
        """Start the pass over what was written until now on a thread; returns its Future (``result()``
        re-raises a failure). What is written later goes to the next pass."""
        rels, files, dirs = self._take()
        done: Future = Future()
        if not rels and not files and not dirs:
            done.set_result(None)
            return done

        def run() -> None:
            try:
                self._sync_rels(rels, files, dirs)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the pass
                done.set_exception(exc)
            else:
                done.set_result(None)

        threading.Thread(target=run, name="ucp-durable", daemon=True).start()
        return done

    def _sync_rels(self, rels: list[str], files: list[tuple[str, str]], dirs: list[str]) -> None:
        root = self.ctx.location.root
        paths: list[str] = []
        for rel in rels:
            top = os.path.join(root, rel)
            for folder, _, names in os.walk(top):
                paths.extend(os.path.join(folder, f) for f in names)
                paths.append(folder)
        for rel, name in files:
            paths += [os.path.join(root, rel, name), os.path.join(root, rel)]
        paths.extend(dirs)
        every = rels + [rel for rel, _ in files]
        if every:
            paths.extend(sorted({os.path.dirname(os.path.join(root, rel).rstrip("/")) for rel in every}))
            paths.append(os.path.join(root, os.path.dirname(os.path.dirname(every[0].rstrip("/")))))
        paths = list(dict.fromkeys(paths))  # each path fsynced once (a walked file, a folder named twice)

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
            if len(paths) <= 2:
                for path in paths:
                    sync(path)
            else:
                list(_SYNC_POOL.get().map(sync, paths))
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
