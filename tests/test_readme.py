"""The README's Python tour runs as written (it is the first code a newcomer copies)."""

from __future__ import annotations

import re

import torch

from ucp_test_helpers import REPO


def test_readme_python_api_block_runs(tmp_path, monkeypatch):
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no ```python block"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102 - our own README
    assert (tmp_path / "ckpts" / "catalog.db").exists()
    shard = scope["shard"]
    buf = shard.buffers["default/fp32"]  # ZeRO-1 rank 3: its half of TP rank 1's (250, 64) vocab shard
    assert buf.dtype == torch.bfloat16 and buf.numel() == 250 * 64 // 2 and buf.abs().sum() > 0
    assert scope["rows"].shape == (10, 64)
