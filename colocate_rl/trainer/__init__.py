"""The Megatron actor (L2): logprobs, GRPO / SFT steps, offload, HF-named weight export."""

from colocate_rl.trainer.actor import Actor
from colocate_rl.trainer.distributed import run_on_ranks

__all__ = ["Actor", "run_on_ranks"]
