"""What a run holds, built once (``start_session``) from the config and its plan: run folder, data,
reward, the actor and the engines (placement), the handoff between them, the buffer of rollouts,
the metrics log and the checkpoints. State only: the loop orders the phases, each component keeps
its own policy."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

import torch

from colocate_rl import config as C
from colocate_rl.checkpoint import CheckpointStore, copies_on_disk, space_warning
from colocate_rl.data import PromptDataset, PromptSampler, load_prompts
from colocate_rl.handoff import HANDOFFS, Handoff
from colocate_rl.memory import checkpoint_bytes
from colocate_rl.metrics import MetricsLog, plot, read, summary
from colocate_rl.models.registry import (chat_encoding, load_tokenizer, model_folder, read_hf_config,
                                         tool_call_parser)
from colocate_rl.models.tiny import ensure_model
from colocate_rl.placement import check_shared_folder, launch
from colocate_rl.plan import RunPlan
from colocate_rl.private import private_dir, write_text
from colocate_rl.rewards import RewardScorer
from colocate_rl.rollout.agent import MultiTurn, SingleTurn, Turns
from colocate_rl.rollout.base import Rollout
from colocate_rl.rollout.buffer import Buffer
from colocate_rl.rollout.partial import PartialRollouts
from colocate_rl.rollout.engine import stop_ids
from colocate_rl.tools import SandboxUnavailable, ToolExecutor
from colocate_rl.tools.chat import ChatFormat
from colocate_rl.trainer import NonfiniteGuard, SignalWatch
from colocate_rl.types import Sample
from colocate_rl.workers import Actor, Workers


@dataclass
class Session:
    cfg: C.Config
    plan: RunPlan
    run_dir: Path
    tokenizer: Any
    sampler: PromptSampler
    train_samples: list[Sample]
    eval_sets: dict[str, list[Sample]]
    scorer: RewardScorer
    workers: Workers
    handoff: Handoff
    buffer: Buffer
    log: MetricsLog
    checkpoints: CheckpointStore
    guard: NonfiniteGuard
    signal: SignalWatch  # a warning when no group's rewards differ for a few steps
    turns: Turns  # one turn per row, or conversations with tools (rollout.agent)
    step: int = 0  # steps completed
    started: float = field(default_factory=time.perf_counter)

    @property
    def actor(self) -> Actor:
        return self.workers.actor

    @property
    def rollout(self) -> Rollout:
        return self.workers.rollout

    def finish(self) -> dict:
        out = {"run_dir": str(self.run_dir), "steps": self.step, "seconds": time.perf_counter() - self.started}
        measured = self.handoff.machine.peak_used()
        if any(measured.values()):  # predicted vs measured bytes per phase (GPU runs)
            print(self.plan.memory.table(measured), flush=True)
            write_text(self.run_dir / "memory.json", json.dumps(
                {"predicted": self.plan.memory.peaks(), "measured": measured, "parts": self.plan.memory.parts,
                 "offload": list(self.plan.memory.offload), "capacity": self.plan.capacity}, indent=1))
        if (self.run_dir / "metrics.jsonl").exists():
            rows = read(self.run_dir / "metrics.jsonl")
            print("\n".join(summary(rows, out["seconds"], warm_started=self.cfg.sft.steps > 0)), flush=True)
        if self.cfg.logging.plot and (self.run_dir / "metrics.jsonl").exists():
            png = plot(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
            out["plot"] = str(png) if png else None
        print(f"run folder: {self.run_dir} (metrics.jsonl, curves.png, config.yaml)", flush=True)
        return out

    def close(self) -> None:
        self.buffer.close()
        self.turns.close()
        self.log.close()
        self.scorer.close()
        self.workers.shutdown()


def start_session(cfg: C.Config, plan: RunPlan) -> Session:
    """The run's state, from its config and the plan resolved from it (plan.resolve, once)."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    run_dir = private_dir(Path(cfg.logging.run_dir) / plan.resolved.run_name)
    write_text(run_dir / "config.yaml", C.to_yaml(cfg))
    executor = tool_executor(cfg)
    tokenizer, train, eval_sets = read_inputs(cfg, executor)
    turns = multi_turn(cfg, plan, tokenizer, executor) if executor else SingleTurn()
    scorer = RewardScorer.from_config(cfg.reward)
    checkpoints = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
    check_shared_folder(cfg.placement, plan.resolved.launcher, checkpoints)  # every node of a cluster uses it
    if plan.size:
        each = checkpoint_bytes(cfg.model, cfg.actor, cfg.algorithm, plan.size)
        if line := space_warning(checkpoints, each, copies_on_disk(cfg.checkpoint, cfg.steps)):
            _say(line)
    workers = launch(cfg.placement, plan.build())  # colocated or disaggregated, by placement.mode
    handoff = HANDOFFS[plan.resolved.handoff](workers, plan.memory, plan.resolved, cfg.sync,
                                              plan.scheduling.max_engine_restarts, measure=workers.device_used)
    log = MetricsLog(run_dir, C.to_dict(cfg), cfg.logging.wandb_project, cfg.logging.wandb_mode, run_dir.name)
    s = Session(
        cfg=cfg, plan=plan, run_dir=run_dir, tokenizer=tokenizer,
        sampler=PromptSampler(train, cfg.data.prompts_per_step, seed=cfg.data.shuffle_seed),
        train_samples=list(train), eval_sets=eval_sets, scorer=scorer, workers=workers, handoff=handoff,
        buffer=workers.make_buffer(handoff.on_rollout, turns), log=log,
        checkpoints=CheckpointStore(checkpoints, cfg.checkpoint.keep, log=_say),
        guard=NonfiniteGuard(cfg.actor.max_nonfinite_in_row), signal=SignalWatch(), turns=turns,
    )
    handoff.step = lambda: s.step + 1  # the step in progress, for fault points and messages
    if plan.scheduling.partial:  # the rows in flight between steps; extra prompts drawn where the step's are
        s.buffer.partial = PartialRollouts(plan.scheduling, plan.sampling, cfg.data.prompts_per_step,
                                           s.sampler.next_batch)
    return s


def read_inputs(cfg: C.Config, tools: Optional[ToolExecutor] = None) -> tuple[Any, PromptDataset,
                                                                              dict[str, list[Sample]]]:
    """What a run reads before it starts anything: (tokenizer, training prompts, eval sets). Each is
    checked as it is read; a bad one is a ConfigError naming the field, file or row. With ``tools``
    (rollout.agent) the prompts offer them, in the model's chat format."""
    if cfg.model.synthesize:
        ensure_model(cfg.model.synthesize, cfg.model.path, seed=cfg.seed, dtype=cfg.model.dtype)
    # A hub id: its config and tokenizer fetched (or found in the cache) before anything starts; each
    # actor rank and engine fetches the weights on its own machine.
    folder = model_folder(cfg.model.path, weights=False)
    hf_config = check_model_folder(folder, weights=Path(cfg.model.path).is_dir())
    field = "model.tokenizer" if cfg.model.tokenizer else "model.path"
    tokenizer = load_tokenizer(cfg.model.tokenizer or folder, field, cfg.model.trust_remote_code)
    check_tokenizer_fits(tokenizer, cfg, hf_config)
    chat = chat_format(cfg, tokenizer, hf_config, tools) if tools else None
    train = load_prompts(cfg.data, tokenizer, chat=chat)
    # An eval set has its own schema (AIME: problem + answer) and every row needs its answer.
    eval_data = replace(cfg.data, format="auto", prompt_key="", label_key="", on_bad_row="error")
    eval_sets = {name: list(load_prompts(eval_data, tokenizer, source=name, chat=chat,
                                         split="eval" if name.startswith("arithmetic") else cfg.eval.split))
                 for name in cfg.eval.sets}
    return tokenizer, train, eval_sets


def tool_executor(cfg: C.Config) -> Optional[ToolExecutor]:
    """The tools of a multi-turn run (rollout.agent.enabled), built before anything else starts: a
    machine that cannot run the python sandbox stops here in one line. None without the agent."""
    if not cfg.rollout.agent.enabled:
        return None
    try:
        return ToolExecutor(cfg.tools)
    except (SandboxUnavailable, ValueError) as e:
        raise C.ConfigError(str(e)) from None


def chat_format(cfg: C.Config, tokenizer: Any, hf_config: dict, tools: ToolExecutor) -> ChatFormat:
    """The model's chat format with the tools offered (its family's encoding, tools/chat.py)."""
    try:
        return ChatFormat(tokenizer, tools.specs(), chat_encoding(hf_config))
    except ValueError as e:
        field = "model.tokenizer" if cfg.model.tokenizer else "model.path"
        raise C.ConfigError(f"rollout.agent.enabled=true: {field}: {e}") from None


def multi_turn(cfg: C.Config, plan: RunPlan, tokenizer: Any, tools: ToolExecutor) -> MultiTurn:
    """Conversations with tools over the run's generation (rollout/agent.py)."""
    hf_config = read_hf_config(model_folder(cfg.model.path, weights=False))
    chat = chat_format(cfg, tokenizer, hf_config, tools)
    agent = cfg.rollout.agent
    try:
        return MultiTurn(agent, plan.sampling, chat, tools, agent.tool_call_parser or tool_call_parser(hf_config),
                         stop_ids(model_folder(cfg.model.path, weights=False), tokenizer))
    except ValueError as e:
        raise C.ConfigError(f"rollout.agent.enabled=true: {e}") from None


def check_model_folder(path: str, weights: bool = True) -> dict:
    """The model's folder (a hub id's snapshot: registry.model_folder) must hold its config, name its
    model class, and hold its weights (``weights``: a local folder, not yet a hub id's). Returns the
    config."""
    p = Path(path)
    if weights and not any(p.glob("*.safetensors")) and not (p / "model.safetensors.index.json").is_file():
        raise C.ConfigError(f"model.path={path} has no weights (no *.safetensors files)")
    hf_config = read_hf_config(p)
    if not hf_config.get("architectures"):
        # vLLM picks its model class by this list; without it, it took a Qwen3 folder for an
        # embedding model and failed far from the cause.
        raise C.ConfigError(f"model.path={path}: config.json has no 'architectures' (the model class, "
                            "e.g. [\"Qwen3ForCausalLM\"])")
    return hf_config


def check_tokenizer_fits(tokenizer, cfg: C.Config, hf_config: dict) -> None:
    """Token ids beyond the model's embedding table would index out of range deep inside vLLM."""
    vocab = hf_config.get("vocab_size")
    if vocab and len(tokenizer) > vocab:
        raise C.ConfigError(
            f"tokenizer {cfg.model.tokenizer or cfg.model.path} has {len(tokenizer)} tokens but the model's "
            f"vocab_size is {vocab}: model.tokenizer does not belong to model.path")


def _say(line: str) -> None:
    print(line, flush=True)
