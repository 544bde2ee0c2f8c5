"""Everything a run holds, built once: run folder, data, reward, actor, rollout engine, handoff
state machine and metrics log. The loop orders phases; the session only owns the parts."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from colocate_rl import config as C
from colocate_rl.checkpoint import CheckpointStore, Loaded, rng_state, set_rng_state
from colocate_rl.data import load_prompts, PromptSampler
from colocate_rl.eval import summarize
from colocate_rl.memory import Handoff
from colocate_rl.metrics import MetricsLog, plot
from colocate_rl.models.tiny import ensure_model
from colocate_rl.placement import launch
from colocate_rl.rewards import RewardScorer
from colocate_rl.types import RolloutBatch, Sample


@dataclass
class Session:
    cfg: C.Config
    run_dir: Path
    tokenizer: Any
    sampler: PromptSampler
    train_samples: list[Sample]
    eval_sets: dict[str, list[Sample]]
    scorer: Any
    workers: Any  # placement's LocalColocated, RayColocated or RayDisaggregated: .actor, .rollout, .sync(), .shutdown()
    handoff: Handoff
    log: MetricsLog
    checkpoints: CheckpointStore
    step: int = 0
    nonfinite_in_row: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def actor(self):
        return self.workers.actor

    @property
    def rollout(self):
        return self.workers.rollout

    def sync_weights(self):
        """The actor's new weights → vLLM (IPC handles keyed by device UUID)."""
        stats = self.workers.sync(self.cfg.rollout.sync_bucket_mb)
        every = self.cfg.rollout.verify_sync_every
        if every and self.step % every == 0:
            self.workers.verify()  # raises WeightMismatch naming the tensor
        return stats

    def evaluate(self) -> dict[str, float]:
        ev = self.cfg.eval
        out: dict[str, float] = {}
        for name, samples in self.eval_sets.items():
            seed = self.step_seed()
            batch = self.rollout.generate(samples, n=ev.n_samples, temperature=ev.temperature,
                                          max_tokens=ev.max_response_tokens or None,
                                          seed=None if seed is None else seed + 500_009)
            rewards, _ = self.scorer.score(batch)
            prefix = "eval" if len(self.eval_sets) == 1 else f"eval/{name}"
            out.update(summarize(batch, rewards, prefix))
        return out

    def step_seed(self) -> int | None:
        """Sampling seed of this step's rollout (None: the engine's own generator)."""
        r = self.cfg.rollout
        return r.seed * 1_000_003 + self.step * 7_919_003 if r.seed_each_step else None

    def trainer_state(self) -> dict:
        """What a checkpoint holds besides the actor: enough to continue exactly where the run was."""
        return {"step": self.step, "sampler": self.sampler.state_dict(), "rng": rng_state(),
                "config": C.to_dict(self.cfg)}

    def restore(self, loaded: Loaded) -> None:
        """The trainer state of a loaded checkpoint; metrics rows after its step are dropped (redone)."""
        self.step = loaded.step
        self.sampler.load_state_dict(loaded.state["sampler"])
        set_rng_state(loaded.state["rng"])
        dropped = self.log.truncate(self.step)
        print(f"resumed from {loaded.path} at step {self.step}"
              + (f" ({dropped} metrics rows after it dropped: they are redone)" if dropped else ""), flush=True)

    def check_update(self, metrics: dict) -> None:
        """Counts optimizer updates skipped in a row (NaN/inf loss or gradients); raises at the limit."""
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if metrics.get("update_skipped") else 0
        if self.nonfinite_in_row >= self.cfg.actor.max_nonfinite_in_row:
            raise FloatingPointError(
                f"{self.nonfinite_in_row} updates in a row skipped for NaN/inf loss or gradients (last at step "
                f"{self.step}): stopping; lower actor.lr, check the rewards, or resume from a checkpoint")

    def checkpoint_due(self) -> bool:
        c = self.cfg.checkpoint
        return bool(c.every and self.step % c.every == 0) or (c.at_end and self.step == self.cfg.steps)

    def save_checkpoint(self) -> None:
        """Needs the actor onloaded (loop.with_actor)."""
        self.checkpoints.save(self.step, self.actor.save_checkpoint, self.trainer_state())

    def sft_batch(self, size: int, seed: int) -> RolloutBatch:
        """Prompt + label + EOS rows for the supervised warm-start; the loss covers label and EOS."""
        rng = random.Random(self.cfg.seed * 1_000_003 + seed)
        rows = rng.sample(self.train_samples, min(size, len(self.train_samples)))
        eos = self.tokenizer.eos_token_id
        answers = [self.tokenizer(s.label, add_special_tokens=False).input_ids + [eos] for s in rows]
        return RolloutBatch.from_rows([s.prompt_ids for s in rows], answers, rows, self.tokenizer.pad_token_id)

    def finish(self) -> dict:
        out = {"run_dir": str(self.run_dir), "steps": self.step, "seconds": time.perf_counter() - self.started}
        if self.cfg.logging.plot and (self.run_dir / "metrics.jsonl").exists():
            png = plot(self.run_dir / "metrics.jsonl", self.run_dir / "curves.png")
            out["plot"] = str(png) if png else None
        print(f"run folder: {self.run_dir} (metrics.jsonl, curves.png, config.yaml)", flush=True)
        return out

    def close(self) -> None:
        self.log.close()
        self.scorer.close()
        self.workers.shutdown()


def start_session(cfg: C.Config) -> Session:
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    run_dir = Path(cfg.logging.run_dir) / (cfg.logging.run_name or
                                           f"{cfg.recipe or 'run'}-{cfg.preset or 'custom'}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(C.to_yaml(cfg))
    if cfg.model.synthesize:
        ensure_model(cfg.model.synthesize, cfg.model.path, seed=cfg.seed, dtype=cfg.model.dtype)
    C.validate(cfg)  # again, now that the model's config.json exists

    from transformers import AutoTokenizer

    check_model_folder(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.path)
    check_tokenizer_fits(tokenizer, cfg)
    train = load_prompts(cfg.data, tokenizer)
    # An eval set has its own schema (AIME: problem + answer) and every row needs its answer.
    eval_data = replace(cfg.data, format="auto", prompt_key="", label_key="", on_bad_row="error")
    eval_sets = {name: load_prompts(eval_data, tokenizer, source=name,
                                    split="eval" if name.startswith("arithmetic") else cfg.eval.split)
                 for name in cfg.eval.sets}
    scorer = RewardScorer.from_config(cfg.reward)
    workers = launch(cfg)  # colocated or disaggregated, by placement.mode
    log = MetricsLog(run_dir, C.to_dict(cfg), cfg.logging.wandb_project, cfg.logging.wandb_mode, run_dir.name)
    checkpoints = CheckpointStore(cfg.checkpoint.dir or run_dir / "checkpoints", cfg.checkpoint.keep, log=_say)
    return Session(
        cfg=cfg, run_dir=run_dir, tokenizer=tokenizer,
        sampler=PromptSampler(train, cfg.data.prompts_per_step, seed=cfg.data.shuffle_seed),
        train_samples=list(train), eval_sets={k: list(v) for k, v in eval_sets.items()}, scorer=scorer,
        workers=workers, handoff=Handoff(), log=log, checkpoints=checkpoints,
    )


def check_model_folder(path: str) -> None:
    """A local model folder must hold weights (hub ids are resolved by the engines themselves)."""
    p = Path(path)
    if p.is_dir() and not any(p.glob("*.safetensors")) and not (p / "model.safetensors.index.json").is_file():
        raise C.ConfigError(f"model.path={path} has no weights (no *.safetensors files)")


def check_tokenizer_fits(tokenizer, cfg: C.Config) -> None:
    """Token ids beyond the model's embedding table would index out of range deep inside vLLM."""
    vocab = C.model_info(cfg).get("vocab_size")
    if vocab and len(tokenizer) > vocab:
        raise C.ConfigError(
            f"tokenizer {cfg.model.tokenizer or cfg.model.path} has {len(tokenizer)} tokens but the model's "
            f"vocab_size is {vocab}: model.tokenizer does not belong to model.path")


def _say(line: str) -> None:
    print(line, flush=True)

