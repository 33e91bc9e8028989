"""Streaming: mapped pages a parameter came from are handed back, and the reader thread is bounded."""

from __future__ import annotations

import threading

import pytest
import torch

from ucp_store import safe_pickle as sp
from ucp_store.deepspeed.source import ParamRecord, _prefetch, release_pages


def _rss() -> int:
    psutil = pytest.importorskip("psutil")
    return psutil.Process().memory_info().rss


def test_release_pages_drops_touched_mmap_pages(tmp_path):
    path = tmp_path / "big.pt"
    torch.save({"flat": torch.randn(16 << 20)}, path)  # 64 MiB
    flat = sp.load(path)["flat"]  # mmap: nothing read yet
    base = _rss()
    total = float(flat.sum())  # touch every page
    touched = _rss()
    assert touched - base > 48 << 20
    release_pages(flat)
    assert _rss() - base < 16 << 20
    assert float(flat.sum()) == total  # a later touch re-reads the same bytes from the file


def test_prefetch_is_bounded_and_propagates_errors():
    made = []

    def gen():
        for i in range(50):
            made.append(i)
            yield ParamRecord(name=f"p{i}", states={"fp32": torch.zeros(1 << 18)})  # 1 MiB each

    it = _prefetch(gen(), max_bytes=4 << 20, max_items=64)
    first = next(it)
    assert first.name == "p0"
    threading.Event().wait(0.3)
    assert len(made) <= 7  # the reader waits for the consumer: at most ~4 MiB ahead
    assert [r.name for r in it][-1] == "p49"

    def bad():
        yield ParamRecord(name="ok", states={})
        raise RuntimeError("reader failed")

    with pytest.raises(RuntimeError, match="reader failed"):
        list(_prefetch(bad()))
