"""Ray's token authentication, for the local instance a run starts and for joining a cluster whose
nodes run with it (scripts/start_ray.sh starts them so): Ray reads the token from a file.

A local instance gets a new random token in a file of its own under the run's cache (0600, folder
0700; removed when the driver exits); a cluster's token file is named by the user. Either way only
the file's path goes into this process's environment (RAY_AUTH_TOKEN_PATH), which every process of
a local instance inherits: the token shows neither in ``ps`` nor in a logged config, and Ray
writes none under $HOME (~/.ray/auth_token, its default for a new local instance)."""

from __future__ import annotations

import atexit
import os
import secrets
import tempfile
from pathlib import Path

from colocate_rl.config import ConfigError, PlacementConfig
from colocate_rl.private import cache_dir

# The variable scripts/start_ray.sh and docker/run.sh name the token file by.
TOKEN_FILE_ENV = "COLOCATE_RL_RAY_TOKEN_FILE"


def default_token_file() -> Path:
    """Where scripts/start_ray.sh keeps the token when given neither --token-file nor --state-dir
    (its default state dir: $COLOCATE_RL_CACHE/ray-node, else ~/.cache/colocate_rl/ray-node)."""
    root = os.environ.get("COLOCATE_RL_CACHE") or Path.home() / ".cache" / "colocate_rl"
    return Path(root) / "ray-node" / "auth_token"


def cluster_token_file(pl: PlacementConfig) -> Path | None:
    """The token file for joining placement.ray_address: placement.ray_token_file, else
    $COLOCATE_RL_RAY_TOKEN_FILE, else the script's default file where it exists; None: the
    cluster is joined without a token (one started with authentication off)."""
    named = [(f, v) for f, v in (("placement.ray_token_file", pl.ray_token_file),
                                  (TOKEN_FILE_ENV, os.environ.get(TOKEN_FILE_ENV, ""))) if v]
    if named:
        field, value = named[0]
        path = Path(value).expanduser()
        if not path.is_file():
            raise ConfigError(f"{field}: no token file at {path} (copy the head's token file here)")
        return path.resolve()
    path = default_token_file()
    return path.resolve() if path.is_file() else None


def local_token_file() -> Path:
    """A new token (256 random bits as hex) for a local instance, in a file of its own that is 0600 from
    its creation, in $COLOCATE_RL_CACHE/ray-auth (0700); removed when this process exits."""
    folder = cache_dir() / "ray-auth"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    fd, name = tempfile.mkstemp(prefix="local-", suffix=".token", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    path = Path(name)
    atexit.register(path.unlink, missing_ok=True)
    return path


def use_token_file(path: Path) -> None:
    """Token mode with the token in ``path``, for this process and the Ray processes it starts."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    os.environ.pop("RAY_AUTH_TOKEN", None)  # Ray would prefer it to the file
    # Ray caches the mode and the token on first use; a process that has read them already (an
    # earlier instance with authentication off, or another token) must reload both to see the change.
    from ray._raylet import AuthenticationTokenLoader
    from ray._raylet import Config as RayConfig

    RayConfig.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def authenticate(pl: PlacementConfig) -> None:
    """Before ``ray.init(address=placement.ray_address)``: token mode with the cluster's token file."""
    path = cluster_token_file(pl)
    if path is not None:
        use_token_file(path)
