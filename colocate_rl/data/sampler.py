"""Batches of prompts in a seeded order, with a cursor that a checkpoint can save and restore; the
rows of a supervised warm-start."""

from __future__ import annotations

import random
from typing import Any, Sequence

import torch

from colocate_rl.types import RolloutBatch, Sample


class PromptSampler:
    """Yields batches of ``batch_size`` samples forever. Epoch e visits every sample once, in the
    order ``randperm(len, seed + e)``; a batch may run across the end of one epoch into the next
    (no sample is dropped, and a dataset smaller than a batch still works).

    ``state_dict()`` is the position of the next sample, ``{"epoch", "index"}``: after
    ``load_state_dict`` the sampler yields exactly the batches that would have come next.
    """

    def __init__(self, dataset: Sequence[Sample], batch_size: int, seed: int = 0):
        if len(dataset) == 0 or batch_size < 1:
            raise ValueError(f"PromptSampler needs samples and batch_size >= 1 (got {len(dataset)}, {batch_size})")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.index = 0, 0
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, permutation) cache

    def order(self, epoch: int) -> list[int]:
        """The dataset indices in epoch ``epoch``'s order."""
        if self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(len(self.dataset), generator=g).tolist())
        return self._order[1]

    def __iter__(self) -> "PromptSampler":
        return self

    def __next__(self) -> list[Sample]:
        return self.next_batch()

    def next_batch(self, size: int | None = None) -> list[Sample]:
        """The next ``size`` samples (default batch_size)."""
        size = self.batch_size if size is None else size
        batch: list[Sample] = []
        while len(batch) < size:
            take = self.order(self.epoch)[self.index : self.index + size - len(batch)]
            batch += [self.dataset[i] for i in take]
            self.index += len(take)
            if self.index == len(self.dataset):
                self.epoch, self.index = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not 0 <= state["index"] < len(self.dataset):
            raise ValueError(f"sampler state {state} does not fit a dataset of {len(self.dataset)} prompts")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def sft_batch(samples: Sequence[Sample], tokenizer: Any, size: int, seed: int) -> RolloutBatch:
    """Rows for a supervised warm-start, ``size`` samples drawn with ``seed``: prompt + label + EOS
    (the loss covers label and EOS), or prompt + a sample's demonstration (a conversation with tool
    calls and their results: the loss covers the policy's tokens only, ``Sample.demo_mask``)."""
    rng = random.Random(seed)
    rows = rng.sample(list(samples), min(size, len(samples)))
    eos = tokenizer.eos_token_id
    answers = [s.demo_ids or tokenizer(s.label, add_special_tokens=False).input_ids + [eos] for s in rows]
    masks = [s.demo_mask or [True] * len(a) for s, a in zip(rows, answers)]
    return RolloutBatch.from_rows([s.prompt_ids for s in rows], answers, rows, tokenizer.pad_token_id,
                                  response_masks=masks)
