"""Which token file a driver joining placement.ray_address authenticates with, and that its default
is the file scripts/start_ray.sh writes (asked of the script itself, which names the file it
misses). The cluster itself is tests/integration/test_ray_auth.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colocate_rl.config import ConfigError, PlacementConfig
from colocate_rl.placement.ray_auth import TOKEN_FILE_ENV, cluster_token_file, default_token_file

ROOT = Path(__file__).resolve().parents[2]


def token(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("ab" * 32)
    path.chmod(0o600)
    return path


def cfg_with(token_file: str = "") -> PlacementConfig:
    return PlacementConfig(ray_address="10.0.0.1:6379", ray_token_file=token_file)


def test_field_then_variable_then_the_scripts_default(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATE_RL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    assert cluster_token_file(cfg_with()) is None  # nothing anywhere: joined without a token
    default = token(tmp_path / "cache/ray-node/auth_token")
    assert default_token_file() == default
    assert cluster_token_file(cfg_with()) == default
    from_env = token(tmp_path / "env_token")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(from_env))
    assert cluster_token_file(cfg_with()) == from_env
    named = token(tmp_path / "named")
    assert cluster_token_file(cfg_with(str(named))) == named


def test_a_named_file_that_is_missing_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"^placement\.ray_token_file: no token file at .*/nope"):
        cluster_token_file(cfg_with(str(tmp_path / "nope")))
    monkeypatch.setenv(TOKEN_FILE_ENV, str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match=rf"^{TOKEN_FILE_ENV}: no token file at .*/gone"):
        cluster_token_file(cfg_with())


@pytest.mark.parametrize("cache", [True, False], ids=["COLOCATE_RL_CACHE", "home"])
def test_default_is_where_start_ray_looks(tmp_path, monkeypatch, cache):
    env = {k: v for k, v in os.environ.items() if k not in ("COLOCATE_RL_CACHE", TOKEN_FILE_ENV)}
    env.update(HOME=str(tmp_path / "home"), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
    if cache:
        env["COLOCATE_RL_CACHE"] = str(tmp_path / "cache")
    proc = subprocess.run(["bash", str(ROOT / "scripts/start_ray.sh"), "worker", "--address", "127.0.0.1:1"],
                          capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 2, proc.stderr
    monkeypatch.setenv("HOME", env["HOME"])
    if cache:
        monkeypatch.setenv("COLOCATE_RL_CACHE", env["COLOCATE_RL_CACHE"])
    else:
        monkeypatch.delenv("COLOCATE_RL_CACHE", raising=False)
    assert f"no token file {default_token_file()}:" in proc.stderr
