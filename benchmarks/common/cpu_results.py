"""A CPU benchmark's results file that keeps one entry per configuration run (activation_census.py,
fp8_parts_cpu.py): a new run replaces the entry of the same configuration and leaves the others."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import torch


def add_run(out: str | Path, benchmark: str, key: str, run: dict, **fields) -> Path:
    """Writes ``run`` under ``runs[key]`` of the JSON file ``out`` (made if absent), with ``fields`` at
    the top level, this machine and today's date."""
    out = Path(out)
    result = json.loads(out.read_text()) if out.is_file() else {"benchmark": benchmark, "runs": {}}
    result["runs"][key] = run
    result.update(fields)
    result["machine"] = {"device": "cpu", "processor": platform.processor() or platform.machine(),
                         "torch": torch.__version__}
    result["date"] = datetime.date.today().isoformat()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return out
