"""TRL's side of benchmarks/peers/cpu_vs_trl.py (in that benchmark's own venv, trl_requirements.txt) and of
benchmarks/peers/gpu_vs_trl.py (on the GPU machine, beside vLLM).

    python benchmarks/peers/trl_runner.py spec.json out.json

GRPOTrainer, one optimizer step per generation batch: on CPU with HF generate (use_vllm=False); with
spec "gpu" on the GPU with vLLM in colocate mode (sleep mode on, as our loop), bf16 autocast over
fp32 weights (TRL's mixed precision) and micro-batches of spec "micro_batch" completions.
Training stops after ``max_steps`` or once ``budget_s`` seconds of training have passed (eval time
excluded). Greedy eval responses are returned as text, so the caller scores both sides with the
same reward function. Nothing here imports colocate_rl: this venv has TRL, not our stack.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

T_START = time.perf_counter()

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402

import transformers  # noqa: E402
import trl  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

_INT = re.compile(r"-?\d+")


def exact_match(completions, label, **_):
    """The training reward: colocate_rl.rewards.arithmetic's rule (first integer equals the label)."""
    out = []
    for text, lab in zip(completions, label):
        m = _INT.search(text)
        out.append(float(m is not None and int(m.group()) == int(lab)))
    return out


@torch.no_grad()
def greedy(model, tok, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy completions of prompts, left-padded in one batch as TRL's own generation pads."""
    was_training = model.training
    model.eval()
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model.train(was_training)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


class Clock(TrainerCallback):
    """Per-step wall time (on_step_end to on_step_end), greedy evals at training-time marks (their
    time is taken out of the clock), and the stop once the budget is spent."""

    def __init__(self, spec, tok, eval_prompts):
        self.spec, self.tok, self.eval_prompts = spec, tok, eval_prompts
        self.train_s, self.step_s, self.evals, self.logs = 0.0, [], [], []
        self.next_mark = spec["eval_every_s"] or float("inf")
        self.last = None

    def _eval(self, model, step):
        t = time.perf_counter()
        responses = greedy(model, self.tok, self.eval_prompts, self.spec["eval_max_tokens"])
        self.evals.append({"step": step, "train_s": self.train_s, "responses": responses,
                           "eval_s": time.perf_counter() - t})

    def on_train_begin(self, args, state, control, model=None, **kw):
        if self.eval_prompts:
            self._eval(model, 0)
        self.last = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs or {}))

    def on_step_end(self, args, state, control, model=None, **kw):
        now = time.perf_counter()
        self.step_s.append(now - self.last)
        self.train_s += now - self.last
        budget = self.spec["budget_s"]
        if budget and self.train_s >= budget:
            control.should_training_stop = True
        if self.eval_prompts and (self.train_s >= self.next_mark or control.should_training_stop
                                  or state.global_step >= args.max_steps):
            self._eval(model, state.global_step)
            while self.next_mark <= self.train_s:
                self.next_mark += self.spec["eval_every_s"]
        self.last = time.perf_counter()


def timed(phases: dict, name: str, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            phases.setdefault(name, []).append(time.perf_counter() - t)
    return wrapper


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    gpu = spec.get("gpu", False)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    train = Dataset.from_list([{"prompt": p, "label": lab} for p, lab in spec["train"]])
    ids = tok([p for p, _ in spec["train"][:8]])["input_ids"]
    if ids != spec["train_prompt_ids"][:8]:
        raise SystemExit(f"prompt token ids differ from colocate_rl's: {ids[:2]} vs {spec['train_prompt_ids'][:2]}")
    n, prompts = spec["n"], spec["prompts_per_step"]
    gen_kwargs = {"min_new_tokens": spec["max_tokens"]} if spec["force_length"] else None
    micro = spec.get("micro_batch", prompts * n)
    vllm_args = dict(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True,
                     vllm_gpu_memory_utilization=spec.get("vllm_gpu_memory_utilization", 0.5),
                     vllm_max_model_length=spec.get("max_model_len"),
                     gradient_checkpointing=False) if gpu else {}  # memory is ample: no recompute, as ours
    args = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=not gpu, bf16=gpu, fp16=False, seed=spec["seed"], report_to="none",
        per_device_train_batch_size=micro, gradient_accumulation_steps=prompts * n // micro, num_generations=n,
        **vllm_args,
        max_completion_length=spec["max_tokens"], temperature=spec["temperature"], top_p=1.0,
        generation_kwargs=gen_kwargs,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=spec["grad_clip"],
        beta=0.0, epsilon=spec["eps_low"], epsilon_high=spec["eps_high"], num_iterations=1,
        loss_type="dapo", scale_rewards="group",
        max_steps=spec["max_steps"], logging_steps=1 if gpu else 10**9, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, shuffle_dataset=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=train,
                          processing_class=tok)
    phases: dict[str, list[float]] = {}
    trainer._generate = timed(phases, "generate", trainer._generate)
    trainer._calculate_rewards = timed(phases, "reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed(phases, "generate_and_score",
                                                    trainer._generate_and_score_completions)
    clock = Clock(spec, tok, [p for p, _ in spec["eval"]])
    trainer.add_callback(clock)
    startup_s = time.perf_counter() - T_START
    trainer.train()
    out = {
        "startup_s": startup_s, "steps": len(clock.step_s), "train_s": clock.train_s, "step_s": clock.step_s,
        "phases": phases, "evals": clock.evals, "logs": clock.logs, "threads": torch.get_num_threads(),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "python": sys.version.split()[0]},
        "loss_type": args.loss_type, "optim": str(args.optim),
    }
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1], sys.argv[2])
