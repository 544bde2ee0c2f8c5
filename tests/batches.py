"""Synthetic rollout batches for the actor tests: random tokens, right-padded, two samples per
prompt, advantages +1 / -1; and one GRPO step through the actor on such a batch (importable from
every test folder: tests/ holds the root conftest), and the actor a run of a config builds."""

from __future__ import annotations

import os

import torch

from colocate_rl.types import RolloutBatch, Sample


def synthetic_batch(lens: list[int], prompt_len: int = 3, vocab: int = 320, seed: int = 0,
                    pad_to: int = 0) -> RolloutBatch:
    """len(lens) rows of lens[i] tokens (the first prompt_len are the prompt), right-padded to
    max(max(lens), pad_to); rows 2k and 2k+1 are one prompt's group."""
    lens_t = torch.tensor(lens)
    b, longest = len(lens), int(lens_t.max())
    t = max(longest, pad_to)
    tokens = torch.randint(3, vocab, (b, longest), generator=torch.Generator().manual_seed(seed))
    tokens = torch.nn.functional.pad(tokens, (0, t - longest))
    attn = torch.arange(t)[None] < lens_t[:, None]
    tokens[~attn] = 0
    loss = attn.clone()
    loss[:, :prompt_len] = False
    return RolloutBatch(
        tokens=tokens, attention_mask=attn, loss_mask=loss, rollout_logprobs=torch.zeros(b, t),
        prompt_lens=torch.full((b,), prompt_len), response_lens=lens_t - prompt_len,
        group_ids=torch.arange(b) // 2, truncated=torch.zeros(b, dtype=torch.bool), finish_reasons=["stop"] * b,
        responses=[""] * b, samples=[Sample(list(range(1, prompt_len + 1)))] * b,
        advantages=torch.tensor([1.0, -1.0] * (b // 2)),
    )


def _on_gpus(cfg) -> bool:
    """The run is on this machine's GPUs (placement.gpus_per_node -1 or more, and it has some)."""
    from colocate_rl import platform

    return cfg.placement.gpus_per_node != 0 and platform.machine_gpus() > 0


def actor_plan(cfg, gpu_run: bool = False):
    """The plan of a run of ``cfg`` whose actor is built here, as one rank of this process's world
    (WORLD_SIZE ranks under run_on_ranks, else one; a GPU each where there are GPUs); what the rollout
    side would refuse is only listed (strict=False), and prompts are cut to fit the tiny models' 512
    positions (the actor never reads data.max_prompt_tokens). ``gpu_run``: the run is planned on GPUs
    even here, so that what the plan keeps to GPU runs (routing replay, the FP8 engine's emulation)
    builds its actor on this CPU, with the CPU's chunked logprobs."""
    from colocate_rl.plan import resolve

    a, world = cfg.actor, int(os.environ.get("WORLD_SIZE", "1"))
    a.dp = a.dp or world // (a.tp * a.pp)
    cfg.data.max_prompt_tokens = min(cfg.data.max_prompt_tokens, 128)
    if _on_gpus(cfg):
        cfg.placement.gpus_per_node = world
    elif gpu_run:
        cfg.placement.gpus_per_node = world
        if a.logprob_kernel == "auto":
            a.logprob_kernel = "chunked"
    return resolve(cfg, strict=False)


def build_actor(cfg, gpu_run: bool = False):
    """The actor a run of ``cfg`` builds, here (``actor_plan``)."""
    return actor_plan(cfg, gpu_run).build().make_actor()


def build_engine(cfg, **kwargs):
    """The engine a run of ``cfg`` builds, here (on the GPUs of one engine where there are GPUs);
    ``kwargs`` go to its constructor (RolloutEngine's, with rollout.backend=vllm)."""
    from colocate_rl.plan import resolve

    if _on_gpus(cfg):
        cfg.placement.gpus_per_node = cfg.rollout.tensor_parallel_size
    return resolve(cfg, strict=False).build().make_rollout(**kwargs)


def make_actor(path: str, overrides: dict, dtype: str = "float32"):
    """An actor on the model at ``path``: lr 1e-3, micro-batches of 2, ``overrides`` on cfg.actor."""
    from colocate_rl.config import Config, ModelConfig

    cfg = Config(model=ModelConfig(path=path, dtype=dtype))
    cfg.actor.lr, cfg.actor.micro_batch_size = 1e-3, 2
    for k, v in overrides.items():
        setattr(cfg.actor, k, v)
    return build_actor(cfg)


def step_view(actor, lens: list[int]) -> dict:
    """``actor`` scores synthetic_batch(lens, seed=1), exports, takes one GRPO step and scores and
    exports again. Collective when the layout spans ranks; returns this rank's view: logprobs
    before / after, the step's loss and grad norm, the exported tensors before / after."""
    batch = synthetic_batch(lens, seed=1)
    before = actor.compute_logprobs(batch)
    exported = {n: t.clone() for n, t in actor.export_hf_weights()}
    batch.rollout_logprobs = torch.where(batch.loss_mask, before, 0)
    m = actor.train_step(batch, before)
    return {"before": before, "after": actor.compute_logprobs(batch), "loss": m["loss"],
            "grad_norm": m["grad_norm"], "exported": exported,
            "exported_after": {n: t.clone() for n, t in actor.export_hf_weights()}}


def grpo_step_view(path: str, overrides: dict, lens: list[int]) -> dict:
    """step_view of an fp32 actor at ``overrides`` (cfg.actor fields) on the model at ``path``."""
    return step_view(make_actor(path, overrides), lens)
