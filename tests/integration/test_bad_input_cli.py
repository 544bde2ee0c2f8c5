"""Rows of docs/errors.md's table through the real command line, ``recipes/qwen3_grpo.py
preset=tiny``: exit code 2, the row's line on stderr after ``error: `` as its last and only error
line, no traceback. A config or model-folder error stops a dry run; a tokenizer or data error is
found by a real run, which stops before any engine or actor rank starts. Supervised, the run is not
restarted on it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bad_inputs import BASE, RECIPE, ROOT, build, rows

# Cells of the table's rows run here, and the words each run adds.
CLI_ROWS = {
    "`reward.timeout_s=nan`": ["dry_run=true"],
    '`model.path=model` whose config.json is `{"model_type": "qwen3",,}`': ["dry_run=true"],
    "`model.path=model` whose config.json lacks `num_attention_heads`": ["dry_run=true"],
    "`model.path=model` whose folder lacks `tokenizer.json`": [],
    "`model.path=model data.apply_chat_template=true` whose folder lacks `chat_template.jinja`": [],
    '`data.train=rows.jsonl` whose row 2 is `{"prompt": "", "label": "4"}`': [],
    '`data.train=rows.jsonl` whose row 2 is `{"prompt": "2+2=", "label": " "}`': ["supervise.max_restarts=2"],
}
TABLE = {r.cell: r for r in rows()}


def test_every_cli_row_is_in_the_table():
    assert [c for c in CLI_ROWS if c not in TABLE] == []


@pytest.mark.parametrize("cell", list(CLI_ROWS), ids=[c.replace(" ", "_")[:60] for c in CLI_ROWS])
def test_command_line_stops_in_one_line(cell, tiny_model, tmp_path):
    row = TABLE[cell]
    build(row, tmp_path, tiny_model("qwen3-tiny"))
    cmd = [sys.executable, str(RECIPE), "preset=tiny", *BASE, *row.overrides, *CLI_ROWS[cell]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLOCATE_RL_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = r.stderr.splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert [x for x in lines if x.startswith("error:")] == [f"error: {row.line}"] and lines[-1] == f"error: {row.line}"
    assert "[supervisor]" not in r.stdout  # supervised: no restart after a config error
