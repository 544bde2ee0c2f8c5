"""The Megatron actor (L2): logprobs, GRPO / SFT steps, offload, HF-named weight export."""

from colocate_rl.trainer.actor import Actor
from colocate_rl.trainer.distributed import run_on_ranks
from colocate_rl.trainer.guard import NonfiniteGuard, SignalWatch

__all__ = ["Actor", "NonfiniteGuard", "SignalWatch", "run_on_ranks"]
