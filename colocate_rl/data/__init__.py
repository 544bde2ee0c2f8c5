"""Prompt datasets (HF datasets: hub id, local parquet/jsonl, synthetic arithmetic) and their sampler."""

from colocate_rl.data.arithmetic import arithmetic_problems
from colocate_rl.data.prompts import PromptDataset, load_prompts
from colocate_rl.data.sampler import PromptSampler, sft_batch

__all__ = ["PromptDataset", "PromptSampler", "arithmetic_problems", "load_prompts", "sft_batch"]
