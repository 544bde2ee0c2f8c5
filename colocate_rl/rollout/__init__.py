"""Rollout: the vLLM engine wrapper and its worker extension."""

from colocate_rl.rollout.engine import RolloutEngine

__all__ = ["RolloutEngine"]
