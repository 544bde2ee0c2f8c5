"""The one batch contract between rollout and training.

Every sequence is prompt + response in one right-padded row. Position t of every per-token
tensor refers to token ``tokens[:, t]``: ``rollout_logprobs[:, t]`` is the sampler's
log p(tokens[t] | tokens[:t]) and ``loss_mask[:, t]`` is True exactly on response tokens. Rows
of one prompt (its ``n`` samples) are adjacent and share a ``group_ids`` value, so group
statistics are reshapes, not gathers.

Shapes: B = prompts × samples per prompt, T = longest prompt + response in the batch.

MoE routing replay (R3, ``rollout.routing_replay``): ``routed_experts[:, t, l, j]`` is the j-th
expert the sampler routed token t to in the l-th MoE layer of the model (l counts only the decoder
layers with routed experts, in order: ``models.registry.MoeRouting.layers``). Prompt positions
are filled too (vLLM's prefill routes them); each row's last token, never fed through the sampler,
and padding hold 0 (k equal experts: no routing, the actor routes such a token by itself). Expert
ids are global (expert parallelism does not renumber them). dtype: uint8 when the model has at
most 256 experts, else int16 (``routing_dtype``), so the tensor takes B x T x L x top_k bytes (x2
for int16) of host memory: 384 bytes a token for Qwen3-30B-A3B (48 layers, top-8), 258 for
DeepSeek-V4-Flash (43 layers, top-6); a step of 256 rows of 8k tokens holds 0.8 GB and 0.54 GB.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


def routing_dtype(num_experts: int) -> torch.dtype:
    """dtype of RolloutBatch.routed_experts for a model of ``num_experts`` routed experts: the
    smallest that holds every expert id (vLLM returns uint8 up to 256 experts, uint16 above)."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    raise ValueError(f"{num_experts} routed experts do not fit the int16 expert ids of routing replay")


@dataclass
class Sample:
    """One prompt as it enters rollout: token ids plus what the reward needs to score it."""

    prompt_ids: list[int]
    label: str = ""  # ground truth for the reward function
    prompt_text: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # A warm-start demonstration of the whole answer (turns with tool calls and their results): its
    # ids after the prompt and which of them the policy writes (the SFT loss covers those only).
    # Empty: the warm start trains on label + EOS.
    demo_ids: list[int] = field(default_factory=list)
    demo_mask: list[bool] = field(default_factory=list)


@dataclass
class Conversation:
    """What a multi-turn rollout did in one row (rollout/agent.py)."""

    turns: int  # assistant turns the policy wrote
    tool_calls: int  # calls it made, malformed ones included
    tool_errors: int  # calls whose result was an error (malformed, unknown tool, bad arguments, a failure)
    tool_seconds: float  # the calls' wall time, summed


@dataclass
class RolloutBatch:
    tokens: torch.Tensor  # [B, T] int64, prompt + response, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, T] bool, True on real tokens
    loss_mask: torch.Tensor  # [B, T] bool, True on response tokens
    rollout_logprobs: torch.Tensor  # [B, T] float32, sampler logprob of tokens[:, t]; 0 off loss_mask
    prompt_lens: torch.Tensor  # [B] int64
    response_lens: torch.Tensor  # [B] int64
    group_ids: torch.Tensor  # [B] int64, index of the prompt in this step; n adjacent rows share it
    truncated: torch.Tensor  # [B] bool, stopped by max response length rather than EOS/stop
    finish_reasons: list[str]  # [B] vLLM's finish reason ("stop", "length", ...)
    responses: list[str]  # [B] decoded response text ("" when no tokenizer)
    samples: list[Sample]  # [B] the prompt each row came from (repeated n times)
    rewards: torch.Tensor | None = None  # [B] float32, filled by the reward phase
    advantages: torch.Tensor | None = None  # [B] float32, filled by the advantage phase
    routed_experts: torch.Tensor | None = None  # [B, T, L_moe, top_k] uint8 / int16: the sampler's experts (R3)
    # [B, T] int64: the weights version that sampled each response token (0 elsewhere); set by
    # partial rollouts, whose continued rows mix versions (rollout/partial.py)
    token_versions: torch.Tensor | None = None
    # [B] multi-turn rows: each row's turns and tool calls (None: one turn per row). Their tool
    # results and template tokens are in the row but off loss_mask.
    conversations: list[Conversation] | None = None

    def __post_init__(self) -> None:
        b, t = self.tokens.shape
        for f in ("attention_mask", "loss_mask", "rollout_logprobs"):
            if getattr(self, f).shape != (b, t):
                raise ValueError(f"RolloutBatch.{f} has shape {tuple(getattr(self, f).shape)}, expected {(b, t)}")
        for f in ("prompt_lens", "response_lens", "group_ids", "truncated"):
            if getattr(self, f).shape != (b,):
                raise ValueError(f"RolloutBatch.{f} has shape {tuple(getattr(self, f).shape)}, expected {(b,)}")
        for f in ("finish_reasons", "responses", "samples", "conversations"):
            if getattr(self, f) is not None and len(getattr(self, f)) != b:
                raise ValueError(f"RolloutBatch.{f} has {len(getattr(self, f))} entries, expected {b}")
        r = self.routed_experts
        if r is not None and (r.dim() != 4 or r.shape[:2] != (b, t)):
            raise ValueError(f"RolloutBatch.routed_experts has shape {tuple(r.shape)}, expected {(b, t)} + "
                             "(MoE layers, top_k)")

    @classmethod
    def from_rows(
        cls,
        prompt_ids: list[list[int]],
        response_ids: list[list[int]],
        samples: list[Sample],
        pad_id: int,
        response_logprobs: list[list[float]] | None = None,
        finish_reasons: list[str] | None = None,
        responses: list[str] | None = None,
        n: int = 1,
        routed_experts: list[torch.Tensor] | None = None,
        response_masks: list[list[bool]] | None = None,
    ) -> "RolloutBatch":
        """Right-pads B = len(prompt_ids) rows of prompt + response; rows come in groups of n adjacent rows.
        ``routed_experts[i]`` [n_i, L_moe, top_k]: the experts of row i's first n_i tokens (n_i <= its
        length), zero after them. ``response_masks[i]``: which of row i's response tokens the loss
        covers (default: all of them)."""
        b = len(prompt_ids)
        if b % n:
            raise ValueError(f"{b} rows do not split into groups of n={n}")
        lens = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
        t = max(lens, default=0)
        tokens = torch.full((b, t), pad_id, dtype=torch.long)
        loss_mask = torch.zeros((b, t), dtype=torch.bool)
        logprobs = torch.zeros((b, t), dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
            tokens[i, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
            loss_mask[i, len(p) : len(p) + len(r)] = True if response_masks is None else \
                torch.tensor(response_masks[i], dtype=torch.bool)
            if response_logprobs is not None:
                logprobs[i, len(p) : len(p) + len(r)] = torch.tensor(response_logprobs[i], dtype=torch.float32)
        routing = None
        if routed_experts:
            if len(routed_experts) != b:
                raise ValueError(f"routed_experts has {len(routed_experts)} rows, expected {b}")
            first = routed_experts[0]
            routing = torch.zeros((b, t, *first.shape[1:]), dtype=first.dtype)
            for i, r in enumerate(routed_experts):
                if r.shape[0] > lens[i] or r.shape[1:] != first.shape[1:]:
                    raise ValueError(f"routed_experts of row {i} has shape {tuple(r.shape)}: more than its "
                                     f"{lens[i]} tokens, or other (layers, top_k) than row 0's "
                                     f"{tuple(first.shape[1:])}")
                routing[i, : r.shape[0]] = r
        reasons = finish_reasons or ["stop"] * b
        return cls(
            tokens=tokens,
            attention_mask=torch.arange(t)[None, :] < torch.tensor(lens)[:, None],
            loss_mask=loss_mask,
            rollout_logprobs=logprobs,
            prompt_lens=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
            response_lens=torch.tensor([len(r) for r in response_ids], dtype=torch.long),
            group_ids=torch.arange(b) // n,
            truncated=torch.tensor([f == "length" for f in reasons], dtype=torch.bool),
            finish_reasons=list(reasons),
            responses=list(responses) if responses is not None else [""] * b,
            samples=list(samples),
            routed_experts=routing,
        )

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_per_group(self) -> int:
        """Samples per prompt (all groups have the same size by construction)."""
        return int(self.size // (int(self.group_ids.max()) + 1)) if self.size else 0

    def select(self, rows: slice | torch.Tensor) -> "RolloutBatch":
        """Rows of the batch (a micro-batch, say); columns are trimmed to the longest row kept."""
        idx = torch.arange(self.size)[rows] if isinstance(rows, slice) else rows
        keep_t = int(self.attention_mask[idx].sum(1).max()) if len(idx) else 0
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v[idx]
                if v.dim() >= 2:
                    v = v[:, :keep_t]
            elif isinstance(v, list):
                v = [v[i] for i in idx.tolist()]
            out[f.name] = v
        return replace(self, **out)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """The same rows with every tensor on ``device`` (lists stay on the host)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    @staticmethod
    def concat(batches: list["RolloutBatch"], pad_id: int = 0) -> "RolloutBatch":
        """Join batches row-wise (e.g. the outputs of several engines), re-padding to one T.

        group_ids are renumbered so that groups stay distinct and adjacent.
        """
        if not batches:
            raise ValueError("RolloutBatch.concat needs at least one batch")
        t = max(b.tokens.shape[1] for b in batches)
        out: dict[str, Any] = {}
        offset = 0
        gids = []
        for b in batches:
            gids.append(b.group_ids + offset)
            offset += int(b.group_ids.max()) + 1 if b.size else 0
        out["group_ids"] = torch.cat(gids)
        for f in fields(RolloutBatch):
            if f.name == "group_ids":
                continue
            vals = [getattr(b, f.name) for b in batches]
            if any(v is None for v in vals) and any(v is not None for v in vals):
                raise ValueError(f"RolloutBatch.concat: {f.name} is set in some batches and None in others")
            if vals[0] is None:
                out[f.name] = None
            elif isinstance(vals[0], list):
                out[f.name] = [x for v in vals for x in v]
            elif vals[0].dim() >= 2:
                fill = pad_id if f.name == "tokens" else 0
                out[f.name] = torch.cat(
                    [torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, t - v.shape[1]), value=fill) for v in vals]
                )
            else:
                out[f.name] = torch.cat(vals)
        return RolloutBatch(**out)
