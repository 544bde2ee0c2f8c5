"""A recipe whose model.path is a hub id runs wherever the Hugging Face hub gives the model: the
actor and the engine each resolve the id to its snapshot on their own machine
(registry.model_folder). The hub is stood in for by its cache, read offline; an id it cannot give
stops the run in one line naming model.path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colocate_rl.metrics import read

ROOT = Path(__file__).resolve().parents[2]
REPO = "colocate-rl/qwen3-tiny"


def cache_with(model: Path, root: Path) -> Path:
    """A Hugging Face hub cache holding ``model`` as REPO's main revision (the layout the hub's
    downloads leave: refs/main names a snapshot folder)."""
    commit = "0" * 40
    repo = root / ("models--" + REPO.replace("/", "--"))
    shutil.copytree(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


def run(cache: Path, run_dir: Path, model: str) -> subprocess.CompletedProcess:
    args = {"model.path": model, "model.synthesize": "''", "logging.run_dir": str(run_dir), "logging.run_name": "hub",
            "logging.wandb_mode": "disabled", "logging.progress": "false", "logging.plot": "false",
            "data.prompts_per_step": "4", "rollout.n": "2", "sft.steps": "0", "eval.every": "0", "steps": "2",
            "checkpoint.at_end": "false"}
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "recipes/qwen3_grpo.py"), "preset=tiny",
                           *(f"{k}={v}" for k, v in args.items())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


# Slow: two recipe commands (one starts vLLM and megatron-core, ~30 s on 2 cores).
@pytest.mark.slow
def test_a_hub_id_runs_from_the_hubs_cache_and_an_unknown_one_stops_in_one_line(tiny_model, tmp_path):
    cache = cache_with(tiny_model("qwen3-tiny"), tmp_path / "hub")
    p = run(cache, tmp_path / "runs", REPO)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    rows = [r for r in read(tmp_path / "runs" / "hub" / "metrics.jsonl") if "sync/bytes" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["sync/bytes"] > 0 for r in rows), rows

    p = run(cache, tmp_path / "runs2", "colocate-rl/no-such-model")
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert "model.path=colocate-rl/no-such-model is not a folder, and the Hugging Face hub did not give it" in p.stderr, \
        p.stderr[-3000:]
