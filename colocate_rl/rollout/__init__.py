"""Rollout: the engines (vLLM; transformers' generate where vLLM cannot run), their worker extension,
the router over several engines and the buffer between rollout and training."""

from colocate_rl.rollout.base import BACKENDS, Engine, EngineDied, RemoteEngine, Rollout, make_rollout
from colocate_rl.rollout.engine import RolloutEngine

__all__ = ["BACKENDS", "Engine", "EngineDied", "RemoteEngine", "Rollout", "RolloutEngine", "make_rollout"]
