"""Shared fixtures: tiny random-weight models built once per test session, and run-local caches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Engines write caches and temp files; keep them in the project (setup_env.sh sets the same).
_cache = ROOT / ".cache"
for var, sub in [("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("HF_HOME", "hf"),
                 ("TRITON_CACHE_DIR", "triton"), ("RAY_TMPDIR", "ray"), ("MPLCONFIGDIR", "mpl")]:
    os.environ.setdefault(var, str(_cache / sub))
os.environ.setdefault("COLOCATE_RL_CACHE", str(_cache))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# First generate otherwise spends 15-19 s in torch.compile on CPU.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model("qwen3-tiny") -> Path of an HF folder (config, safetensors, tokenizer), built once."""
    from colocate_rl.models.tiny import ensure_model

    root = tmp_path_factory.mktemp("models")

    def get(shape: str = "qwen3-tiny", dtype: str = "float32") -> Path:
        return ensure_model(shape, root / f"{shape}-{dtype}", seed=0, dtype=dtype)

    return get
