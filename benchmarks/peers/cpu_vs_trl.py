"""CPU: our colocated GRPO loop vs TRL's GRPOTrainer, same tiny model, task, warm-start and batch.

    python benchmarks/peers/cpu_vs_trl.py       # ~8 min on 2 cores (longer while it waits for a low load)
    python benchmarks/peers/cpu_vs_trl.py --budget-s 30 --lengths 6,64 --sweep-steps 3   # quicker

Both sides start from one warm-started HF folder: the tiny preset's SFT warm-start (recipes/
qwen3_grpo.yaml, 60 steps through our actor) is run once and its weights saved; then each side
trains GRPO from that folder with a fresh optimizer. Same prompts (the arithmetic train set), same
held-out eval set (64 problems, greedy), same exact-match reward, n=8, temperature 1.0, lr, Adam,
clip 0.2/0.28, no KL, one optimizer step per batch, token-mean loss (TRL's loss_type="dapo" is a
token mean over the whole batch, as ours). TRL runs in its own venv (benchmarks/peers/trl_requirements.txt,
created under .cache/bench-trl/venv when missing), generating with HF generate on CPU
(use_vllm=False), through benchmarks/peers/trl_runner.py.

Measured, each side in a fresh process, one after the other:
  1. accuracy at equal wall-clock: GRPO for --budget-s seconds of training (evals and process start
     not counted), held-out greedy accuracy at marks every --eval-every-s seconds and at the end;
  2. seconds per step as completions lengthen (--lengths, at --sweep-prompts x 8): every response
     is forced to the full length (ours: the stop token is moved to an id the model never emits;
     TRL: min_new_tokens), since only the timing matters there. s/step extrapolated to zero tokens
     through the two shortest lengths is each side's fixed per-step cost.
Our per-phase times come from the loop's own time/<phase> metrics.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "bench-trl"
VENV = CACHE / "venv"
REQUIREMENTS = Path(__file__).with_name("trl_requirements.txt")
RUNNER = Path(__file__).with_name("trl_runner.py")
RESULT = Path(__file__).resolve().parents[1] / "results" / "cpu_vs_trl.json"
RECIPE = ROOT / "recipes" / "qwen3_grpo.yaml"
# Phases whose cost does not grow with the response length: the fixed part of our step.
FIXED_PHASES = ("sleep", "reward", "onload", "offload", "wake_weights", "sync", "wake_kv")
PHASES = ("generate", "sleep", "reward", "onload", "logprobs", "train", "offload", "wake_weights", "sync", "wake_kv")


def env(threads: int) -> dict[str, str]:
    cache = ROOT / ".cache"
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    return {
        **os.environ, "COLOCATE_RL_CACHE": str(cache), "TMPDIR": str(cache / "tmp"),
        "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "HF_HUB_OFFLINE": "1", "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
    }


# ---------------------------------------------------------------- TRL's venv


def ensure_trl_venv() -> Path:
    """TRL's venv, created or updated from trl_requirements.txt; a copy of the file marks it done."""
    py, stamp = VENV / "bin" / "python", VENV / ".requirements.txt"
    if py.exists() and stamp.is_file() and stamp.read_text() == REQUIREMENTS.read_text():
        return py
    if not py.exists():
        base = shutil.which("python3.11") or sys.executable
        print(f"[trl venv] creating {VENV} with {base}", flush=True)
        subprocess.run([base, "-m", "venv", str(VENV)], check=True)
    print(f"[trl venv] pip install -r {REQUIREMENTS.relative_to(ROOT)} (torch is the CPU wheel)", flush=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)], check=True)
    stamp.write_text(REQUIREMENTS.read_text())
    return py


# ---------------------------------------------------------------- our side (runs in a child process)


def ours_job(spec: dict, out_path: str) -> None:
    """One run of our loop: "warm" (SFT warm-start, save the HF folder) or "grpo" (timed steps)."""
    t_start = time.perf_counter()
    import torch

    from colocate_rl.cli import preset_config
    from colocate_rl.config import load
    from colocate_rl.loop import evaluate, step, warm_start
    from colocate_rl.plan import resolve
    from colocate_rl.session import start_session

    torch.set_num_threads(spec["threads"])
    cfg = load(preset_config(RECIPE, "tiny", recipe="qwen3_grpo"), overrides=spec["overrides"])
    s = start_session(cfg, resolve(cfg))
    out: dict = {"startup_s": time.perf_counter() - t_start, "threads": torch.get_num_threads()}
    try:
        if spec["mode"] == "warm":
            t = time.perf_counter()
            warm_start(s)
            out["sft_s"] = time.perf_counter() - t
            out["eval"] = evaluate(s)
            with s.handoff.actor_owned(changes_weights=False):
                save_hf_folder(s.actor.export_hf_weights(), Path(cfg.model.path), Path(spec["save_to"]))
            out["train_ids"] = [list(x.prompt_ids) for x in s.train_samples[:8]]
        else:
            out.update(timed_grpo(s, spec, step, evaluate))
    finally:
        s.close()
    Path(out_path).write_text(json.dumps(out))


def timed_grpo(s, spec: dict, step, evaluate) -> dict:
    """GRPO steps (loop.step) until the budget, held-out accuracy (loop.evaluate) at the marks."""
    budget, every = spec["budget_s"], spec["eval_every_s"]
    steps, evals, train_s, next_mark = [], [], 0.0, every or float("inf")

    def mark(at_step: int) -> None:
        t = time.perf_counter()
        m = evaluate(s)
        evals.append({"step": at_step, "train_s": train_s, "accuracy": m["eval/accuracy"],
                      "eval_s": time.perf_counter() - t})

    if spec["eval"]:
        mark(0)
    for i in range(spec["max_steps"]):
        t = time.perf_counter()
        m = step(s)
        wall = time.perf_counter() - t
        s.step, train_s = i + 1, train_s + wall
        steps.append({"wall": wall, "reward": m["reward/mean"], "response_len": m["rollout/response_len"],
                      **{k[5:]: v for k, v in m.items() if k.startswith("time/")}})
        stop = bool(budget) and train_s >= budget
        if spec["eval"] and (train_s >= next_mark or stop or i + 1 == spec["max_steps"]):
            mark(i + 1)
            while next_mark <= train_s:
                next_mark += every
        if stop:
            break
    return {"steps": steps, "evals": evals, "train_s": train_s}


def save_hf_folder(weights, src: Path, dst: Path) -> None:
    """Exported HF-named tensors → dst/model.safetensors, with src's config and tokenizer files."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    save_file({n: t.detach().clone().contiguous() for n, t in weights}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})


# ---------------------------------------------------------------- orchestration (main venv)


def wait_for_quiet(max_load: float, max_wait_s: float) -> float:
    """Other work on this machine skews every timing: wait (bounded) until the 1-minute load is low."""
    t = time.perf_counter()
    if os.getloadavg()[0] > max_load:
        print(f"  load {os.getloadavg()[0]:.1f} > {max_load}: waiting up to {max_wait_s:.0f}s", flush=True)
    while os.getloadavg()[0] > max_load and time.perf_counter() - t < max_wait_s:
        time.sleep(5)
    return time.perf_counter() - t


WAIT = {"max_load": 2.5, "max_wait_s": 60.0, "waited_s": 0.0}


def run_child(cmd: list[str], threads: int, what: str) -> dict:
    WAIT["waited_s"] += wait_for_quiet(WAIT["max_load"], WAIT["max_wait_s"])
    t = time.perf_counter()
    load_before = os.getloadavg()[0]
    print(f"[{what}] ...", flush=True)
    proc = subprocess.run(cmd, env=env(threads), cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-6000:])
        raise SystemExit(f"{what} failed (exit {proc.returncode})")
    out = json.loads(Path(cmd[-1]).read_text())
    out["process_s"] = time.perf_counter() - t
    out["load_1m"] = [load_before, os.getloadavg()[0]]
    print(f"[{what}] done in {out['process_s']:.0f}s (load {load_before:.1f} -> {os.getloadavg()[0]:.1f})",
          flush=True)
    return out


def ours(args, tag: str, overrides: list[str], **spec) -> dict:
    work = CACHE / "work"
    work.mkdir(parents=True, exist_ok=True)
    base = [f"logging.run_dir={CACHE / 'runs'}", f"logging.run_name={tag}", "logging.wandb_mode=disabled",
            "logging.progress=false", "logging.plot=false", "eval.every=0"]
    spec = {"threads": args.threads, "overrides": base + overrides, "mode": "grpo", "eval": False,
            "budget_s": 0, "eval_every_s": 0, "max_steps": 10**6, **spec}
    (work / f"ours-{tag}.spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--job", str(work / f"ours-{tag}.spec.json"),
           str(work / f"ours-{tag}.out.json")]
    return run_child(cmd, args.threads, f"ours {tag}")


def trl(args, py: Path, tag: str, **spec) -> dict:
    work = CACHE / "work"
    spec = {"threads": args.threads, "seed": 0, "n": 8, "temperature": 1.0, "lr": 5e-4, "grad_clip": 1.0,
            "eps_low": 0.2, "eps_high": 0.28, "budget_s": 0, "eval_every_s": 0, "eval": [], "eval_max_tokens": 4,
            "force_length": False, "out_dir": str(work / f"trl-{tag}.trainer"), **spec}
    (work / f"trl-{tag}.spec.json").write_text(json.dumps(spec))
    return run_child([str(py), str(RUNNER), str(work / f"trl-{tag}.spec.json"), str(work / f"trl-{tag}.out.json")],
                     args.threads, f"trl {tag}")


def machine(trl_versions: dict) -> dict:
    import megatron.core
    import torch
    import transformers
    import vllm

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    return {
        "cpu": cpu, "cores": os.cpu_count(), "ram_gib": round(mem / 2**20, 1), "python": platform.python_version(),
        "torch": torch.__version__, "vllm": vllm.__version__, "megatron_core": megatron.core.__version__,
        "transformers": transformers.__version__, "trl_venv": trl_versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ours_summary(run: dict, skip: int = 1) -> dict:
    """Median seconds per step and per phase over the steps after the first ``skip`` (warm-up)."""
    steps = run["steps"][skip:] or run["steps"]
    phases = {p: median([st.get(p, 0.0) for st in steps]) for p in PHASES}
    return {"s_per_step": median([st["wall"] for st in steps]), "phases": phases,
            "unaccounted": median([st["wall"] - st["step"] for st in steps]),
            "rest": median([st["wall"] - sum(st.get(p, 0.0) for p in ("generate", "logprobs", "train", "sync"))
                            for st in steps]),
            "response_len": median([st["response_len"] for st in steps]), "steps": len(run["steps"])}


def trl_summary(run: dict, skip: int = 1) -> dict:
    n = len(run["step_s"])
    keep = range(min(skip, n - 1), n)
    ph = run["phases"]
    gen_score = [ph["generate_and_score"][i] for i in keep]
    return {"s_per_step": median([run["step_s"][i] for i in keep]),
            "phases": {"generate": median([ph["generate"][i] for i in keep]),
                       "reward": median([ph["reward"][i] for i in keep]),
                       "score_other": median([g - ph["generate"][i] - ph["reward"][i]
                                              for g, i in zip(gen_score, keep)]),
                       "loss_backward_optimizer": median([run["step_s"][i] - g for g, i in zip(gen_score, keep)])},
            "steps": n}


def intercept(rows: list[dict], key: str) -> dict:
    """s/step = a + b * length through the two shortest lengths: a is the fixed per-step cost
    (what a step costs before any token), b the cost of one more token in every response."""
    (x0, y0), (x1, y1) = sorted((r["max_tokens"], r[key]) for r in rows)[:2]
    b = (y1 - y0) / (x1 - x0)
    return {"fixed_s": y0 - b * x0, "s_per_token_of_length": b}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=90.0, help="seconds of GRPO training per side")
    ap.add_argument("--eval-every-s", type=float, default=15.0)
    ap.add_argument("--lengths", default="6,64,256", help="completion lengths of the s/step sweep")
    ap.add_argument("--sweep-prompts", type=int, default=8)
    ap.add_argument("--sweep-steps", type=int, default=4, help="steps per length and side (the first is warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on each side (2 cores, shared)")
    ap.add_argument("--max-load", type=float, default=2.5,
                    help="before each run, wait while the 1-minute load is above this (other work skews timings)")
    ap.add_argument("--max-wait-s", type=float, default=60.0, help="longest wait for a low load, per run")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--job", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return ours_job(json.loads(Path(args.job[0]).read_text()), args.job[1])

    t_all = time.perf_counter()
    WAIT.update(max_load=args.max_load, max_wait_s=args.max_wait_s)
    py = ensure_trl_venv()
    for k, v in env(args.threads).items():
        os.environ[k] = v
    from colocate_rl.cli import preset_config
    from colocate_rl.data.arithmetic import arithmetic_problems
    from colocate_rl.rewards.arithmetic import arithmetic_reward

    preset = preset_config(RECIPE, "tiny", recipe="qwen3_grpo")
    ar, n = preset.data.arithmetic, preset.rollout.n
    train, held_out = arithmetic_problems(ar, "train"), arithmetic_problems(ar, "eval")
    load_start = os.getloadavg()

    # 1. the warm-started folder both sides start from
    base, warm, sweep_model = CACHE / "base", CACHE / "warm", CACHE / "warm-no-stop"
    w = ours(args, "warm", [f"model.path={base}", "model.synthesize=qwen3-small"], mode="warm",
             save_to=str(warm))
    check_hf_folder(warm)
    shutil.copytree(warm, sweep_model, dirs_exist_ok=True)
    never_emitted = json.loads((warm / "config.json").read_text())["vocab_size"] - 1  # past the tokenizer's ids
    for name in ("config.json", "generation_config.json"):
        c = json.loads((sweep_model / name).read_text())
        c["eos_token_id"] = never_emitted
        (sweep_model / name).write_text(json.dumps(c))
    from_warm = [f"model.path={warm}", "model.synthesize=''", "sft.steps=0"]

    # 2. accuracy at equal wall-clock, recipe batch (32 prompts x 8, 4 tokens)
    P, L = preset.data.prompts_per_step, preset.rollout.max_response_tokens
    acc_ours = ours(args, "acc", from_warm, eval=True, budget_s=args.budget_s, eval_every_s=args.eval_every_s)
    acc_trl = trl(args, py, "acc", model=str(warm), train=train, eval=held_out, train_prompt_ids=w["train_ids"],
                  prompts_per_step=P, max_tokens=L, eval_max_tokens=L, budget_s=args.budget_s,
                  eval_every_s=args.eval_every_s, max_steps=100_000)
    labels = [lab for _, lab in held_out]
    for e in acc_trl["evals"]:
        e["accuracy"] = statistics.fmean(arithmetic_reward(r, lab) for r, lab in zip(e.pop("responses"), labels))

    # 3. s/step as completions lengthen (forced to full length)
    sweep = []
    for length in [int(x) for x in args.lengths.split(",")]:
        steps = max(args.sweep_steps, min(24, args.sweep_steps * 32 // length))  # short steps are noisy: more
        o = ours(args, f"len{length}", [f"model.path={sweep_model}", "model.synthesize=''", "sft.steps=0",
                                        f"rollout.max_response_tokens={length}",
                                        f"data.prompts_per_step={args.sweep_prompts}",
                                        f"actor.micro_batch_size={args.sweep_prompts * n}"],
                 max_steps=steps)
        t = trl(args, py, f"len{length}", model=str(warm), train=train, eval=[], train_prompt_ids=w["train_ids"],
                prompts_per_step=args.sweep_prompts, max_tokens=length, force_length=True,
                max_steps=steps)
        so, st = ours_summary(o), trl_summary(t)
        sweep.append({"max_tokens": length, "prompts": args.sweep_prompts, "n": n,
                      "ours_s_per_step": so["s_per_step"], "trl_s_per_step": st["s_per_step"],
                      "trl_over_ours": st["s_per_step"] / so["s_per_step"], "ours_response_len": so["response_len"],
                      "ours_phases": so["phases"], "ours_unaccounted": so["unaccounted"], "ours_rest": so["rest"],
                      "trl_phases": st["phases"], "load_1m_before_after": {"ours": o["load_1m"], "trl": t["load_1m"]}})

    so, st = ours_summary(acc_ours), trl_summary(acc_trl)
    final = lambda run: run["evals"][-1]  # noqa: E731
    result = {
        "benchmark": "cpu_vs_trl",
        "machine": machine(acc_trl["versions"]),
        "load": {"load_1m_at_start": load_start[0], "wait_rule": f"each run waits up to {args.max_wait_s:.0f}s "
                 f"for a 1-minute load <= {args.max_load}", "waited_s": WAIT["waited_s"],
                 "per_run_load_1m_before_after": {"ours_acc": acc_ours["load_1m"], "trl_acc": acc_trl["load_1m"]},
                 "note": "2 cores shared with other work; each row of s_per_step carries its own load"},
        "settings": {
            "model": "colocate_rl.models.tiny qwen3-small (2 layers, hidden 128, vocab 320), float32",
            "task": f"arithmetic a+b=, a in 0..{ar.max_operand}, b in 0..{ar.max_operand_b}; "
                    f"{len(train)} train problems, {len(held_out)} held-out problems (greedy eval)",
            "warm_start": "the tiny preset's SFT (60 steps, lr 2e-3, batch 64) through our actor, run once; "
                          "both sides start GRPO from the saved HF folder with a fresh optimizer",
            "reward": "exact match of the first integer (colocate_rl.rewards.arithmetic; TRL's runner mirrors it, "
                      "and its eval responses are scored here with ours)",
            "grpo": {"prompts_per_step": P, "n": n, "max_tokens": L, "temperature": 1.0, "lr": preset.actor.lr,
                     "optimizer": "Adam (betas 0.9/0.999, eps 1e-8, no weight decay), constant lr, grad clip 1.0",
                     "clip": [preset.algorithm.eps_low, preset.algorithm.eps_high], "kl": 0.0,
                     "optimizer_steps_per_batch": 1,
                     "loss": "token mean over the batch (ours token_mean; TRL loss_type='dapo')",
                     "advantage": "group-normalised; ours divides by the population std + 1e-6, TRL (stock) by "
                                  "the sample std + 1e-4",
                     "ours_extra": "token IS correction clamp 2.0 (weights are ~1 here: rollout and actor agree "
                                   "to ~1e-7 in fp32)"},
            "trl": "GRPOTrainer, use_vllm=False (HF generate on CPU), beta=0, num_iterations=1, "
                   "per_device_train_batch_size = prompts x n, gradient_accumulation_steps=1, optim adamw_torch",
            "ours": "recipes/qwen3_grpo.yaml preset tiny: Megatron actor + in-process vLLM, local launcher",
            "threads_per_side": args.threads,
            "budget_s": args.budget_s,
            "timing": "per step: wall time of one loop iteration (ours: loop.step; TRL: on_step_end to "
                      "on_step_end); medians over the steps after the first",
        },
        "warm_start_result": {"eval_accuracy": w["eval"].get("eval/accuracy"), "sft_s": w["sft_s"]},
        "accuracy_at_equal_wall_clock": {
            "budget_s": args.budget_s,
            "ours": {"accuracy": final(acc_ours)["accuracy"], "steps": len(acc_ours["steps"]),
                     "train_s": acc_ours["train_s"], "startup_s": acc_ours["startup_s"],
                     "curve": [[round(e["train_s"], 1), e["step"], e["accuracy"]] for e in acc_ours["evals"]]},
            "trl": {"accuracy": final(acc_trl)["accuracy"], "steps": acc_trl["steps"], "train_s": acc_trl["train_s"],
                    "startup_s": acc_trl["startup_s"],
                    "curve": [[round(e["train_s"], 1), e["step"], e["accuracy"]] for e in acc_trl["evals"]]},
            "curve_columns": ["train_s", "step", "held_out_accuracy"],
        },
        "s_per_step": [{"max_tokens": L, "prompts": P, "n": n, "ours_s_per_step": so["s_per_step"],
                        "trl_s_per_step": st["s_per_step"], "trl_over_ours": st["s_per_step"] / so["s_per_step"],
                        "ours_phases": so["phases"], "ours_unaccounted": so["unaccounted"],
                        "ours_rest": so["rest"], "trl_phases": st["phases"],
                        "note": "from the accuracy runs (recipe batch)"}] + sweep,
        "fixed_per_step_cost": {
            "ours": intercept(sweep, "ours_s_per_step"),
            "trl": intercept(sweep, "trl_s_per_step"),
            "ours_length_independent_phases_s": {
                f"{r['prompts']}x{r['n']}x{r['max_tokens']}": sum(r["ours_phases"][p] for p in FIXED_PHASES)
                for r in sweep},
            "note": f"intercept of s/step over the two shortest sweep lengths at {args.sweep_prompts} prompts x "
                    f"{n}; ours_length_independent_phases_s: {' + '.join(FIXED_PHASES)}",
        } if len(sweep) > 1 else {},
        "total_s": time.perf_counter() - t_all,
    }
    result["previous_runs"] = previous_runs(args.out, result["settings"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out} "
          f"({result['total_s']:.0f}s)")


def headline(r: dict) -> dict:
    a = r["accuracy_at_equal_wall_clock"]
    return {"date": r["machine"]["date"], "load_1m_at_start": r.get("load", {}).get("load_1m_at_start"),
            "accuracy": {"ours": a["ours"]["accuracy"], "trl": a["trl"]["accuracy"], "budget_s": a["budget_s"]},
            "s_per_step": {f"{x['prompts']}x{x['n']}x{x['max_tokens']}": [x["ours_s_per_step"], x["trl_s_per_step"]]
                           for x in r["s_per_step"]}}


def previous_runs(path: Path, settings: dict) -> list[dict]:
    """Headlines of up to 5 earlier runs with the same settings, from the file about to be replaced:
    on a shared 2-core machine one run's timings move by 20-30%, so the spread is part of the result."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if old.get("settings") != settings:
        return []
    return ([headline(old)] + old.get("previous_runs", []))[:5]


def check_hf_folder(path: Path) -> None:
    """The saved folder loads in transformers with every weight present (a missing one would be random)."""
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"warm-started folder {path} does not load cleanly: {bad}")


def print_table(r: dict) -> None:
    a = r["accuracy_at_equal_wall_clock"]
    print(f"\nheld-out accuracy after {a['budget_s']:.0f}s of GRPO (warm-start: "
          f"{r['warm_start_result']['eval_accuracy']:.3f})")
    for side in ("ours", "trl"):
        x = a[side]
        curve = " ".join(f"{t:.0f}s:{acc:.2f}" for t, _, acc in x["curve"])
        print(f"  {side:5s} {x['accuracy']:.3f}  ({x['steps']} steps in {x['train_s']:.0f}s; curve {curve})")
    print("\nseconds per step (prompts x n x max tokens)")
    print(f"  {'shape':>9s} {'ours':>7s} {'TRL':>7s} {'TRL/ours':>8s} | ours: {'gen':>6s} {'logp':>6s} {'train':>6s} "
          f"{'sync':>6s} {'other':>6s} | TRL: {'gen':>6s} {'train':>6s}")
    for row in r["s_per_step"]:
        shape = f"{row['prompts']}x{row['n']}x{row['max_tokens']}"
        ph, tp = row["ours_phases"], row["trl_phases"]
        other = row["ours_rest"]
        print(f"  {shape:>9s} {row['ours_s_per_step']:7.3f} {row['trl_s_per_step']:7.3f} {row['trl_over_ours']:8.2f} |"
              f"       {ph['generate']:6.3f} {ph['logprobs']:6.3f} {ph['train']:6.3f} {ph['sync']:6.3f} {other:6.3f} |"
              f"      {tp['generate']:6.3f} {tp['loss_backward_optimizer']:6.3f}")
    f = r.get("fixed_per_step_cost")
    if f:
        print(f"\nfixed per-step cost (intercept at 0 tokens): ours {f['ours']['fixed_s']:.3f}s, "
              f"TRL {f['trl']['fixed_s']:.3f}s; per token of length: ours "
              f"{f['ours']['s_per_token_of_length'] * 1e3:.1f}ms, TRL {f['trl']['s_per_token_of_length'] * 1e3:.1f}ms")


if __name__ == "__main__":
    main()
