"""The bad-input corpus (issue 16): every case of bad_input_cases.CASES is refused with the error it names,
and leaves nothing behind: no catalog row, no file, no run payload.

Decisions the corpus pins down:
- Unicode names: tensor and object names must be NFC; an NFD spelling is refused naming its NFC form
  (so two spellings of one visible name never become two tensors), and bidirectional controls
  (right-to-left marks, overrides, isolates) are refused.
- Absurd shapes: a tensor-state holds at most 2^48 elements (``writer.MAX_ELEMENTS``); a stride-0 view or
  a meta tensor of 2^62 elements is refused before anything is hashed or allocated.
- Unreachable peers fail within a bounded time: PostgreSQL's connect timeout is 10 s (the URL's own
  ``connect_timeout`` wins), and S3 requests retry 4 times over about 3 s.
"""

from __future__ import annotations

import pytest
import torch
from bad_input_cases import CASES, check, make_ctx, run_case


@pytest.fixture(scope="session")
def good_dcp(tmp_path_factory):
    """One small DCP folder written by torch.distributed.checkpoint itself (copied and broken per case)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("good_dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}, "step": 7},
                 checkpoint_id=str(folder))
    return folder


def test_corpus_is_large_and_covers_every_surface():
    kinds = {c.kind for c in CASES}
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)
    assert {"torch", "deepspeed", "universal", "hf", "dcp", "cli", "api"} <= kinds
    assert sum(1 for c in CASES if c.cli is not None) >= 10 and any(c.subprocess for c in CASES)


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory):
    """An empty store made once; each case gets a copy (creating a catalog runs the migrations)."""
    import ucp_store

    path = tmp_path_factory.mktemp("template") / "store"
    ucp_store.open_store(str(path), create=True).catalog.engine.dispose()
    return path


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.subprocess else c for c in CASES],
                         ids=[c.id for c in CASES])
def test_bad_input_is_refused_and_leaves_nothing(case, tmp_path, good_dcp, empty_store, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "corpus")  # the unreachable-bucket cases: no credential lookups
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "corpus")
    ctx = make_ctx(tmp_path / "case", good_dcp, empty_store)
    check(run_case(case, ctx), ctx)
