"""The adversarial corpus (issues 16 and 30) in CI: every case of ``adversarial.CASES`` holds its expected
outcome (a clean error, an exact round trip, nothing deleted outside the store); see ``framework``.

Decisions the corpus pins down (issue 16):
- Unicode names: tensor and object names must be NFC; an NFD spelling is refused naming its NFC form
  (so two spellings of one visible name never become two tensors), and bidirectional controls
  (right-to-left marks, overrides, isolates) are refused.
- Absurd shapes: a tensor-state holds at most 2^48 elements (``writer.MAX_ELEMENTS``); a stride-0 view or
  a meta tensor of 2^62 elements is refused before anything is hashed or allocated.
- Unreachable peers fail within a bounded time: PostgreSQL's connect timeout is 10 s (the URL's own
  ``connect_timeout`` wins), and S3 requests retry 4 times over about 3 s.

``tools/fault_table.py --corpus`` runs the same cases and prints the counts by outcome and surface.
"""

from __future__ import annotations

import collections

import pytest

from adversarial import CASES
from adversarial.framework import OUTCOMES, SURFACES, check, make_ctx, make_fixtures, run_case


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory):
    """A small DCP folder and the template stores, made once; each case gets copies."""
    return make_fixtures(tmp_path_factory.mktemp("corpus-fixtures"))


def test_corpus_is_large_and_covers_every_surface_and_outcome():
    assert len(CASES) >= 100 and len({c.id for c in CASES}) == len(CASES)
    by = collections.Counter((c.surface, c.outcome) for c in CASES)
    assert {s for s, _ in by} == set(SURFACES) and {o for _, o in by} == set(OUTCOMES)
    assert {c.kind for c in CASES} >= {"torch", "deepspeed", "universal", "hf", "dcp"}
    assert sum(c.via == "cli" for c in CASES) >= 30 and any(c.subprocess for c in CASES)
    # every item of issue 30 is held by a case; item 8 by each of its inputs
    items = collections.Counter(c.issue for c in CASES)
    assert {f"30.{i}" for i in range(1, 12)} <= set(items), sorted(items)
    assert items["30.8"] >= 10


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.subprocess else c for c in CASES],
                         ids=[c.id for c in CASES])
def test_case_holds_its_expected_outcome(case, tmp_path, fixtures, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "corpus")  # the unreachable-bucket cases: no credential lookups
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "corpus")
    good_dcp, templates = fixtures
    ctx = make_ctx(tmp_path / "case", good_dcp, templates)
    check(run_case(case, ctx), ctx)
