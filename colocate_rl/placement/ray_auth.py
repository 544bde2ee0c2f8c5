"""Joining a Ray cluster whose nodes run with token authentication (scripts/start_ray.sh starts
them so): the driver names the cluster's token file to Ray, which reads the token from it.

The token itself never passes through here: only its file's path goes into this process's
environment (RAY_AUTH_TOKEN_PATH), so it shows neither in ``ps`` nor in a logged config."""

from __future__ import annotations

import os
from pathlib import Path

from colocate_rl.config import Config, ConfigError

# The variable scripts/start_ray.sh and docker/run.sh name the token file by.
TOKEN_FILE_ENV = "COLOCATE_RL_RAY_TOKEN_FILE"


def default_token_file() -> Path:
    """Where scripts/start_ray.sh keeps the token when given neither --token-file nor --state-dir
    (its default state dir: $COLOCATE_RL_CACHE/ray-node, else ~/.cache/colocate_rl/ray-node)."""
    root = os.environ.get("COLOCATE_RL_CACHE") or Path.home() / ".cache" / "colocate_rl"
    return Path(root) / "ray-node" / "auth_token"


def cluster_token_file(cfg: Config) -> Path | None:
    """The token file for joining placement.ray_address: placement.ray_token_file, else
    $COLOCATE_RL_RAY_TOKEN_FILE, else the script's default file where it exists; None: the
    cluster is joined without a token (one started with authentication off)."""
    named = [(f, v) for f, v in (("placement.ray_token_file", cfg.placement.ray_token_file),
                                  (TOKEN_FILE_ENV, os.environ.get(TOKEN_FILE_ENV, ""))) if v]
    if named:
        field, value = named[0]
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(f"{field}: no token file at {path} (copy the head's token file here)")
        return path.resolve()
    path = default_token_file()
    return path.resolve() if path.is_file() else None


def authenticate(cfg: Config) -> None:
    """Before ``ray.init(address=placement.ray_address)``: token mode with the cluster's token file."""
    path = cluster_token_file(cfg)
    if path is None:
        return
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    os.environ.pop("RAY_AUTH_TOKEN", None)  # Ray would prefer it to the file
    # Ray caches the mode and the token on first use; a process that has read them already (an
    # earlier local instance runs with the mode "disabled") must reload both to see the change.
    from ray._raylet import AuthenticationTokenLoader
    from ray._raylet import Config as RayConfig

    RayConfig.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
