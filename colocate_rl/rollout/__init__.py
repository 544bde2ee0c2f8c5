"""Rollout: the engines (vLLM; transformers' generate where vLLM cannot run), their worker extension,
the router over several engines and the buffer between rollout and training."""

from colocate_rl.rollout.base import BACKENDS, EngineDied, Rollout, make_rollout, sampling_seed
from colocate_rl.rollout.engine import RolloutEngine

__all__ = ["BACKENDS", "EngineDied", "Rollout", "RolloutEngine", "make_rollout", "sampling_seed"]
