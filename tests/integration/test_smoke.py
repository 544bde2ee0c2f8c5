"""scripts/smoke.sh, run for real: a few steps of the tiny recipe and the script's own checks of
what the run wrote; a bad override fails it. Apart from test_scripts.py, whose Ray nodes make it
wait for the phase of scripts/test.sh that runs Ray modules alone: this one starts no Ray."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from test_scripts import ROOT, script_env  # noqa: E402 - same folder


def smoke(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/smoke.sh"), "--out", str(tmp_path), *args], capture_output=True,
                          text=True, env=script_env(OMP_NUM_THREADS="1"), timeout=400)


@pytest.mark.slow  # ~50 s on 2 cores: vLLM engine start, Megatron set-up, 3 colocated steps
def test_smoke_runs_the_tiny_recipe(tmp_path):
    start = time.time()
    proc = smoke(tmp_path, "--steps", "2", "rollout.n=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[smoke] ok: 2 steps" in proc.stdout
    (run,) = tmp_path.iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    cfg = (run / "config.yaml").read_text()
    assert re.search(r"^rollout:\n  'n': 4$", cfg, re.M), "the key=value override did not reach the recipe"
    # A quiet start (console.py): the config and plan once, then the run's own lines; vLLM's INFO
    # records, megatron-core's and torch's warnings are in the run's log, not on the console.
    assert proc.stdout.count("resolved config:") == 1 and "\nkernels: " in proc.stdout
    console = proc.stdout + proc.stderr
    for library_line in (r"\bINFO\b", r"\bWARNING\b", r"GPTModel IS DEPRECATED", r"\] Warning: ", r"^wandb:",
                         r"UserWarning", r"Loading safetensors"):
        assert not re.search(library_line, console, re.M), (library_line, console[-3000:])
    log = run / "run.log"
    assert log.stat().st_mode & 0o777 == 0o600
    assert re.search(r" INFO vllm\.", log.read_text()) and "GPTModel IS DEPRECATED" in log.read_text()
    print(f"smoke: {time.time() - start:.0f} s")


def test_smoke_fails_on_a_bad_override(tmp_path):
    proc = smoke(tmp_path, "rollout.temprature=1.0")
    assert proc.returncode != 0
    assert "rollout.temprature" in proc.stderr + proc.stdout
    assert "[smoke] ok" not in proc.stdout
