"""The layout's rules (issue 26), checked from the AST by ``tools/structure.py``: imports point one way (no
cycle, function-level imports included), no function over 100 lines, no class over 30 methods, the map's
rows stay short, and the linter sees every file."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ucp_test_helpers import REPO, tools_on_path

tools_on_path()
import structure  # noqa: E402


@pytest.fixture(scope="module")
def mods():
    return structure.load_modules()


def test_no_import_cycle(mods):
    assert structure.cycles(mods) == []


def test_the_checker_sees_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "ucp_store"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from ucp_store.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ucp_store import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ucp_store import a\n")
    (pkg / "d.py").write_text("from .sub import b\n")
    found = structure.load_modules(tmp_path)
    assert structure.cycles(found) == [["ucp_store.a", "ucp_store.sub.b"]]
    assert found["ucp_store.c"].imports == set()  # TYPE_CHECKING-only imports never run
    assert found["ucp_store.d"].imports == {"ucp_store.sub.b"}  # relative imports resolve
    assert found["ucp_store.sub.b"].deferred == {"ucp_store.a"}


def test_no_function_over_100_lines(mods):
    assert [f"{x.where}.{x.name}: {x.size}" for x in structure.long_functions(mods)] == []


def test_no_class_over_30_methods(mods):
    assert [f"{x.where}.{x.name}: {x.size}" for x in structure.wide_classes(mods)] == []


def test_no_private_name_is_imported_from_another_module(mods):
    assert [f"{x.where} <- {x.name}" for x in structure.private_imports(mods)] == []


def test_one_package_per_integration(mods):
    """Every DeepSpeed module lives in ucp_store.deepspeed (the demo's DeepSpeed story and its training
    harness belong to ``ucp demo``); the torch.distributed API is not named ``dist`` (a name .gitignore
    templates and ruff's default excludes skip)."""
    for name in mods:
        leaf = name.rsplit(".", 1)[-1]
        if ("deepspeed" in leaf or leaf.startswith("ds_")) and not name.startswith("ucp_store.demo."):
            assert name.startswith("ucp_store.deepspeed"), name
        assert ".dist." not in name + "." or name.startswith("ucp_store.distributed"), name


def test_architecture_rows_are_at_most_two_lines():
    """ARCHITECTURE.md is a map: a table row says what a module does and why, in at most two lines (200
    characters of cell text); measurements live in docs/perf.md."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("|") and not re.match(r"^\|[\s\-:|]+\|$", line)]
    assert rows, "ARCHITECTURE.md has no module table"
    long = [row[:80] for row in rows if len(row) > 240]
    assert long == []


def test_ruff_sees_every_python_file_of_the_package_tests_and_tools():
    listed = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "ucp_store", "tests", "tools"],
                            cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0 and "No module named ruff" in listed.stderr:
        listed = subprocess.run([str(REPO / ".venv" / "bin" / "ruff"), "check", "--show-files", "ucp_store", "tests",
                                 "tools"], cwd=REPO, capture_output=True, text=True)
    seen = {line.strip() for line in listed.stdout.splitlines() if line.strip().endswith(".py")}
    files = {str(p) for d in ("ucp_store", "tests", "tools") for p in (REPO / d).rglob("*.py")
             if "__pycache__" not in p.parts}
    assert files, "no files found"
    assert sorted(files - seen) == []
