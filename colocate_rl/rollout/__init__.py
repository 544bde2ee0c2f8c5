"""Rollout: the vLLM engine wrapper and its worker extension."""

from colocate_rl.rollout.engine import EngineDied, RolloutEngine

__all__ = ["EngineDied", "RolloutEngine"]
