"""One GPU: seconds per GRPO step of our colocated loop vs verl 0.9.1 (its PPO trainer with GRPO
advantages, the FSDP actor, vLLM rollout in its hybrid engine, its own Ray), started as
``python -m verl.trainer.main_ppo`` with hydra overrides, on the same model, prompts, samples per
prompt and response length; and each side's trainer/sampler gap.

    python benchmarks/peers/gpu_vs_verl.py --tokens 256 --pairs 3 --out gpu_vs_verl_256.json

verl runs from its own folder of packages (benchmarks/peers/verl_requirements.txt, installed by
scripts/verl_bundle.sh's install script; ``--verl-site``, default $VERL_SITE or /tmp/verl/site),
first on the path of its process only, beside the project's vLLM 0.26 and Ray.

Model: the random-weight Qwen3-0.6B shape in bf16 (the weights gpu_vs_trl.py uses) in a folder
both sides load, whose tokenizer (the tiny 300-token one) is padded to the model's 151,936 rows with
tokens no text encodes to: verl's vLLM server masks every logit past len(tokenizer), so with 300
tokens it would sample among 300 and normalise its rollout logprobs over them while its actor
normalises over every row. Prompts: the arithmetic train set with the same token ids on both sides
(verl's agent loop always applies a chat template; it is given one that passes the text through).
64 prompts x 8 samples, temperature 1, every response ``--tokens`` long: verl with
rollout.ignore_eos, ours with nothing to stop it (the random model meets its EOS about once in
150k tokens); each side's mean response length is recorded. Adam lr 1e-6 constant, no weight
decay, grad clip 1.0, clip 0.2/0.28, no KL, token-mean loss, one optimizer step per batch, bf16.

verl's settings, ``--verl-profile``: ``recommended`` is its GRPO/FSDP example on one GPU (gradient
checkpointing, dynamic batch size by tokens, vLLM at 0.6 of the card); ``matched`` takes ours'
(micro-batches of ``--micro`` completions, no recompute, vLLM at ``--gpu-mem``, vLLM's own batch
limits, importance weights capped at 2 as ours). verl still computes the old logprobs in a forward
pass of its own that ours does not (its gap metric comes from it); ``--verl-set
algorithm.rollout_correction.bypass_mode=true`` drops both. ``verl_overrides`` says what each setting
is for.

Pairs, as gpu_vs_trl.py: ``--pairs 3`` runs alternating pairs in ABBA order; ``--sides N`` continues
this machine's series (under $COLOCATE_RL_CACHE/gpu_vs_verl/<profile>/<tokens>/pairK/) by its next N
runs; ``--summarize DIR`` rebuilds a result from a pair's or a series' records; ``--smoke`` runs verl's
side alone, once. The first step of
each side is warm-up and not counted. verl's step time is the wall time between its per-step
records (its timing_s/step, which leaves out the logging, is kept too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_vs_trl.py, our side's job
import gpu_vs_trl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REWARD = Path(__file__).with_name("verl_reward.py")
MAX_PROMPT_TOKENS = 32  # data.max_prompt_tokens in our side's overrides (common/loop_overrides.py)
# Renders a one-message conversation as its text: the prompt's tokens are the ones ours reads.
PASS_THROUGH_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
VERSIONS = ("verl", "vllm", "torch", "transformers", "tokenizers", "ray", "tensordict", "TransferQueue",
            "hydra-core", "omegaconf")


def verl_overrides(args, model: Path, data: Path, work: Path, ray_dir: Path) -> list[str]:
    """The hydra overrides of verl's run: the workload (as ours'), what verl needs on this machine,
    then the profile's settings and ``--verl-set``, later ones winning. ``ray_dir``: Ray's session
    folder, short (its socket paths must stay under 108 bytes)."""
    a, r, m = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
    workload = [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "algorithm.norm_adv_by_std_in_grpo=true",
        f"data.train_files={data}", f"data.val_files={data}", f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={MAX_PROMPT_TOKENS}", f"data.max_response_length={args.tokens}",
        "data.shuffle=true", "data.seed=0",
        f"{m}.path={model}", f'{m}.custom_chat_template="{PASS_THROUGH_TEMPLATE}"',
        f"{a}.strategy=fsdp", f"{a}.optim.lr={args.lr}", f"{a}.optim.weight_decay=0.0",
        f"{a}.optim.lr_scheduler_type=constant", f"{a}.grad_clip=1.0",
        f"{a}.ppo_mini_batch_size={args.prompts}", f"{a}.ppo_epochs=1",  # one optimizer step per batch
        f"{a}.clip_ratio_low=0.2", f"{a}.clip_ratio_high=0.28", f"{a}.loss_agg_mode=token-mean",
        f"{a}.use_kl_loss=false", f"{a}.entropy_coeff=0",
        f"{r}.name=vllm", f"{r}.n={args.n}", f"{r}.temperature=1.0", f"{r}.top_p=1.0", f"{r}.top_k=-1",
        f"{r}.ignore_eos=true", f"{r}.tensor_model_parallel_size=1", f"{r}.calculate_log_probs=true",
        f"{r}.max_model_len={MAX_PROMPT_TOKENS + args.tokens}",  # ours' (verl's default: the model's 40960)
        f"reward.custom_reward_function.path={REWARD}", "reward.custom_reward_function.name=compute_score",
    ]
    machine = [
        # verl's actor asks transformers for flash_attention_2 (workers/config/model.py:185) and
        # packs sequences for its varlen kernel; the machine has no flash-attn, and sdpa over a
        # packed batch would attend across sequences, so the batch stays padded
        f"{m}.use_remove_padding=false", f"+{m}.override_config.attn_implementation=sdpa",
        # one GPU, nothing outside this machine (console and a metrics file: the default adds wandb),
        # a bounded run that neither validates nor saves nor resumes
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.logger=[console,file]",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", f"trainer.total_training_steps={args.steps + 1}", "trainer.total_epochs=1000",
        "trainer.project_name=gpu_vs_verl", f"trainer.experiment_name={args.verl_profile}_{args.tokens}",
        f"trainer.default_local_dir={work / 'checkpoints'}",
        # Ray, its vLLM HTTP server and TransferQueue's sockets bind the Ray node's address: loopback;
        # no dashboard (the token that Ray's processes need comes through the environment)
        f"ray_kwargs.ray_init.num_cpus={os.cpu_count() or 1}", "+ray_kwargs.ray_init.include_dashboard=false",
        "+ray_kwargs.ray_init._node_ip_address=127.0.0.1", f"+ray_kwargs.ray_init._temp_dir={ray_dir}",
        f"hydra.run.dir={work / 'hydra'}", "hydra.output_subdir=null",
    ]
    return workload + machine + PROFILES[args.verl_profile](args) + list(args.verl_set)


def recommended(args) -> list[str]:
    """verl's GRPO/FSDP example (examples/grpo_trainer/run_qwen3_8b_fsdp.sh, its GPU branch) on one
    GPU: rollout TP 1 instead of 2, the rest as it sets them; vLLM's batch limits are verl's."""
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return ["actor_rollout_ref.model.enable_gradient_checkpointing=true",
            f"{a}.use_dynamic_bsz=true", f"{a}.ppo_max_token_len_per_gpu=24576",
            f"{r}.log_prob_use_dynamic_bsz=true", f"{r}.log_prob_max_token_len_per_gpu=24576",
            f"{r}.gpu_memory_utilization=0.6",
            f"{a}.fsdp_config.param_offload=false", f"{a}.fsdp_config.optimizer_offload=false"]


def matched(args) -> list[str]:
    """Ours' settings in this run: --micro completions per forward/backward and per logprob pass, no
    activation recompute, vLLM at --gpu-mem with vLLM's own batch limits on an H200 (1024 sequences,
    16384 tokens: what ours runs with; verl passes 256 and 8192), nothing offloaded (ours' memory
    plan moves nothing at this shape), token importance weights capped at 2 (ours' algorithm.is_clamp)."""
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return ["actor_rollout_ref.model.enable_gradient_checkpointing=false",
            f"{a}.use_dynamic_bsz=false", f"{a}.ppo_micro_batch_size_per_gpu={args.micro}",
            f"{r}.log_prob_use_dynamic_bsz=false", f"{r}.log_prob_micro_batch_size_per_gpu={args.micro}",
            f"{r}.gpu_memory_utilization={args.gpu_mem}", f"{r}.max_num_seqs=1024", f"{r}.max_num_batched_tokens=16384",
            f"{a}.fsdp_config.param_offload=false", f"{a}.fsdp_config.optimizer_offload=false",
            "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"]


PROFILES = {"recommended": recommended, "matched": matched}


def verl_env(site: Path, work: Path, token_file: Path) -> dict[str, str]:
    """verl's process environment: its package folder first, the rest of ours' path but our checkout
    (verl's wheel ships top-level `tests` and `scripts` packages of its own), Ray's token from a file,
    and its actor's process group formed through a file (verl reads DIST_INIT_METHOD) rather than a
    TCPStore, whose master listens on every interface whatever address it is given."""
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env.pop("RAY_AUTH_TOKEN", None)  # Ray would prefer it to the file
    env.update(PYTHONPATH=os.pathsep.join([str(site), *rest]), RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN_PATH=str(token_file), RAY_USAGE_STATS_ENABLED="0",
               DIST_INIT_METHOD=f"file://{work / 'torch-store'}", VERL_FILE_LOGGER_PATH=str(work / "metrics.jsonl"),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(work / "hf-datasets"),
               WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    return env


def padded_tokenizer(folder: Path, vocab_size: int) -> int:
    """Pads folder's tokenizer.json to ``vocab_size`` ids with BPE entries no merge produces (so no text
    encodes to them; each decodes to its own name, with no digits the reward could read); returns
    how many it added. The existing ids keep their tokens."""
    from colocate_rl.private import write_text

    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    for t in tok.get("added_tokens", []):  # no gap below the fillers: transformers renumbers past one
        vocab.setdefault(t["content"], t["id"])
    n = 1 + max(vocab.values())
    if n > vocab_size:
        raise ValueError(f"{path} has {n} ids, more than the model's vocab_size {vocab_size}")
    added, k = 0, 0
    while n < vocab_size:
        name = f"<unused_{_letters(k)}>"
        k += 1
        if name not in vocab:
            vocab[name], n, added = n, n + 1, added + 1
    write_text(path, json.dumps(tok, ensure_ascii=False))
    return added


def _letters(k: int) -> str:
    s = ""
    while True:
        k, d = divmod(k, 26)
        s = chr(97 + d) + s
        if k == 0:
            return s
        k -= 1


def full_vocab_model(base: Path, dst: Path) -> Path:
    """``base``'s weights (linked, else copied) and config in ``dst`` with the padded tokenizer."""
    from colocate_rl.private import private_dir, seal

    if (dst / "config.json").is_file():
        return dst
    staging = dst.with_name(dst.name + ".build")
    shutil.rmtree(staging, ignore_errors=True)
    private_dir(staging)
    for f in sorted(base.iterdir(), key=lambda f: f.name == "config.json"):  # config.json last: complete
        if f.suffix == ".safetensors":
            try:
                os.link(f, staging / f.name)
            except OSError:
                shutil.copy2(f, staging / f.name)
        elif f.is_file():
            shutil.copy2(f, staging / f.name)
    padded_tokenizer(staging, json.loads((base / "config.json").read_text())["vocab_size"])
    seal(staging)
    staging.rename(dst)
    return dst


def write_prompts(path: Path, problems: list[tuple[str, str]]) -> None:
    """The prompts as verl's RLHF dataset reads them: a chat message per row, the label as its
    rule reward's ground truth."""
    import pandas as pd

    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": p}], "ability": "arithmetic",
             "reward_model": {"style": "rule", "ground_truth": label}, "extra_info": {"index": i}}
            for i, (p, label) in enumerate(problems)]
    pd.DataFrame(rows).to_parquet(path)
    os.chmod(path, 0o600)


def check_prompt_ids(path: Path, cfg, n: int = 8) -> None:
    """verl's prompt tokens (the pass-through template, as its agent loop applies it) are ours'."""
    from colocate_rl.data.prompts import load_prompts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    for s in list(load_prompts(cfg.data, tok))[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": s.prompt_text}],
                                      chat_template=PASS_THROUGH_TEMPLATE, tokenize=True, add_generation_prompt=True,
                                      return_dict=False)
        if list(ids) != list(s.prompt_ids):
            raise SystemExit(f"verl would read {s.prompt_text!r} as {list(ids)}, ours as {list(s.prompt_ids)}")


_WRAPPED = re.compile(r"^[A-Za-z_][\w.]*\((.*)\)$")


def parse_console(text: str) -> list[dict]:
    """verl's console records (`step:N - key:value - ...`, one line a step, behind Ray's prefix),
    numeric values only, in step order."""
    out = {}
    for line in text.splitlines():
        i = line.find("step:")
        if i < 0 or (i and line[i - 1] not in " )"):
            continue
        fields = line[i:].split(" - ")
        try:
            step = int(fields[0][5:])
        except ValueError:
            continue
        metrics = {}
        for f in fields[1:]:
            key, _, value = f.rpartition(":")
            value = _WRAPPED.sub(r"\1", value.strip())  # numpy scalars print as np.float64(0.5)
            try:
                metrics[key] = float(value)
            except ValueError:
                pass
        out[step] = {"step": step, "metrics": metrics}
    return [out[k] for k in sorted(out)]


def parse_jsonl(text: str) -> list[dict]:
    """verl's file logger records ({"step": N, "data": {...}}, a line a step; lines of one step
    merged), numeric values only, in step order."""
    out: dict[int, dict] = {}
    for line in text.splitlines():
        if line.strip():
            rec = json.loads(line)
            step = int(rec["step"])
            data = {k: float(v) for k, v in rec["data"].items() if isinstance(v, (int, float))}
            out.setdefault(step, {"step": step, "metrics": {}})["metrics"].update(data)
    return [out[k] for k in sorted(out)]


class Stamps(threading.Thread):
    """When each of verl's per-step records lands in its metrics file (polled every 20 ms), by step."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.times, self.done, self.seen = path, {}, threading.Event(), 0

    def run(self):
        while not self.done.wait(0.02):
            self.poll()
        self.poll()

    def poll(self):
        if not self.path.is_file():
            return
        lines = self.path.read_bytes().split(b"\n")[:-1]  # complete lines: the logger writes each at once
        now = time.monotonic()
        for line in lines[self.seen:]:
            step = int(json.loads(line)["step"])
            if step not in self.times:
                self.times[step] = now
                print(f"[verl] step {step} recorded", flush=True)
        self.seen = len(lines)


class CardMemory:
    """GiB in use on the whole card while a side runs (every process), sampled every 0.1 s through
    NVML; ``result`` is None where NVML is missing."""

    def __init__(self):
        self.peak = self.base = None
        self.done = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(int(dev) if dev.isdigit() else 0)
            self.used = lambda: pynvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**30
        except Exception:  # no NVML here: the record says so (None)
            self.used = None

    def __enter__(self):
        if self.used:
            self.base = self.peak = self.used()
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()
        return self

    def _poll(self):
        while not self.done.wait(0.1):
            self.peak = max(self.peak, self.used())

    def __exit__(self, *exc):
        self.done.set()
        if self.used:
            self.thread.join()

    @property
    def result(self) -> dict | None:
        return None if self.base is None else {"before_gib": self.base, "peak_gib": self.peak}


def versions(env: dict) -> dict:
    """The packages verl's process imports, read in that environment."""
    code = ("import importlib.metadata as m, json, sys; v = {}\n"
            "for n in sys.argv[1:]:\n"
            "    try: v[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: v[n] = None\n"
            "print(json.dumps(v))")
    out = subprocess.run([sys.executable, "-c", code, *VERSIONS], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run_verl(args, path: Path, root: Path, work: Path) -> None:
    """verl's side of a pair, in its own process group, into work/verl.json (its console in verl.log
    and on ours)."""
    from colocate_rl.config import ArithmeticConfig, Config, ModelConfig, load
    from colocate_rl.data.arithmetic import arithmetic_problems
    from colocate_rl.placement.ray_auth import local_token_file
    from colocate_rl.private import write_text

    cfg = load(Config(model=ModelConfig(path=str(path))), overrides=gpu_vs_trl.our_overrides(args, path, root))
    check_prompt_ids(path, cfg)
    data = work / "prompts.parquet"
    write_prompts(data, arithmetic_problems(ArithmeticConfig(), "train"))
    for stale in ("metrics.jsonl", "verl.log", "torch-store"):  # a file store must start empty
        (work / stale).unlink(missing_ok=True)
    ray_dir = Path(tempfile.mkdtemp(prefix="verl-ray-", dir="/tmp"))  # 0700; removed after the run
    overrides = verl_overrides(args, path, data, work, ray_dir)
    write_text(work / "verl.overrides", "\n".join(overrides) + "\n")
    env = verl_env(args.verl_site, work, local_token_file())
    stamps = Stamps(work / "metrics.jsonl")
    print(f"[verl] {args.verl_profile}: python -m verl.trainer.main_ppo ({len(overrides)} overrides)", flush=True)
    t0 = time.perf_counter()
    with open(work / "verl.log", "w", opener=_private) as log, CardMemory() as mem:
        stamps.start()
        proc = subprocess.Popen([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], cwd=work, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, umask=0o077)
        tee = threading.Thread(target=_tee, args=(proc.stdout, log), daemon=True)
        tee.start()
        try:
            rc = proc.wait(timeout=args.verl_timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _end_group(proc)
            tee.join(timeout=30)
            stamps.done.set()
            stamps.join()
            shutil.rmtree(ray_dir, ignore_errors=True)
    wall = time.perf_counter() - t0
    log_text = (work / "verl.log").read_text(errors="replace")
    metrics = (work / "metrics.jsonl")
    steps = parse_jsonl(metrics.read_text()) if metrics.is_file() else parse_console(log_text)
    if rc != 0 or len(steps) < args.steps + 1:
        tail = "\n".join(log_text.splitlines()[-40:])
        raise SystemExit(f"{tail}\nverl {'timed out' if rc is None else f'exited {rc}'} after {wall:.0f}s with "
                         f"{len(steps)} of {args.steps + 1} steps (log: {work / 'verl.log'})")
    t0 = min(stamps.times.values(), default=0.0)
    for s in steps:
        if s["step"] in stamps.times:
            s["t"] = stamps.times[s["step"]] - t0  # seconds since the first step's record
    record = {"steps": steps, "wall_s": wall, "versions": versions(env), "profile": args.verl_profile,
              "overrides": overrides, "card_memory": mem.result}
    write_text(work / "verl.json", json.dumps(record))
    print(f"[verl] done in {wall:.0f}s", flush=True)


def _tee(stream, log) -> None:
    """verl's console, line by line, into its log and ours (a command cut short keeps what it printed)."""
    for line in iter(stream.readline, b""):
        log.write(line.decode(errors="replace"))
        log.flush()
        sys.stdout.buffer.write(line)
        sys.stdout.flush()


def _private(path, flags):
    from colocate_rl.private import opener

    return opener(path, flags)


def _end_group(proc: subprocess.Popen) -> None:
    """Stops what is left of the process group the verl run started: a driver still running first
    gets SIGINT (Python then shuts its Ray down), then the group SIGTERM, SIGKILL after 30 s."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)


def run_ours(args, path: Path, root: Path, work: Path) -> None:
    """Our side of a pair, in its own process, into work/ours.json, with the card's memory beside it."""
    keys = ("shape", "prompts", "n", "tokens", "steps", "micro", "lr", "fp32_residual", "gpu_mem")
    argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    with CardMemory() as mem:
        gpu_vs_trl.child([sys.executable, str(Path(__file__).resolve()), *argv, "--job", str(work / "ours.json")],
                         "ours")
    from colocate_rl.private import write_text

    record = json.loads((work / "ours.json").read_text())
    write_text(work / "ours.json", json.dumps({**record, "card_memory": mem.result}))


def next_run(series: Path) -> tuple[int, str]:
    """(pair, side) of the series' next run in ABBA order: pair 0 ours then verl, pair 1 verl then
    ours, …; a run counts once its record (ours.json, verl.json) is written."""
    k = 0
    while True:
        for side in ("ours", "verl")[:: 1 if k % 2 == 0 else -1]:
            if not (series / f"pair{k}" / f"{side}.json").is_file():
                return k, side
        k += 1


def finished_pairs(series: Path) -> list[Path]:
    return sorted((f.parent for f in series.glob("pair*/verl.json") if (f.parent / "ours.json").is_file()),
                  key=lambda d: int(d.name[4:]))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def verl_step_seconds(steps: list[dict]) -> list[float]:
    """Each timed step's seconds: the wall time from the previous step's record to its own where
    both were stamped, else verl's timing_s/step."""
    out = []
    for prev, cur in zip(steps, steps[1:]):
        if "t" in prev and "t" in cur:
            out.append(cur["t"] - prev["t"])
        else:
            out.append(cur["metrics"]["timing_s/step"])
    return out


def verl_side(verl: dict) -> dict:
    """verl's part of a result from its record: medians (gap metrics: means) over the timed steps."""
    vm = [s["metrics"] for s in verl["steps"][1:]]
    seconds = verl_step_seconds(verl["steps"])
    timing = sorted({k for m in vm for k in m if k.startswith("timing_s/")})
    return {
        "verl_s_per_step": statistics.median(seconds),
        "verl_timing_step_s": _median(m.get("timing_s/step") for m in vm),
        "verl_phase_s": {k[len("timing_s/"):]: _median(m.get(k) for m in vm) for k in timing},
        # the mean |probability trainer - probability sampler| per token (ours reports the same of
        # logprobs), and verl's off-policy diagnostics
        "verl_rollout_probs_diff_mean": _mean(m.get("training/rollout_probs_diff_mean") for m in vm),
        "verl_rollout_probs_diff_max": _mean(m.get("training/rollout_probs_diff_max") for m in vm),
        "verl_rollout_corr_k3_kl": _mean(m.get("rollout_corr/k3_kl") for m in vm),
        "verl_rollout_corr_log_ppl_abs_diff": _mean(m.get("rollout_corr/log_ppl_abs_diff") for m in vm),
        "verl_response_len": _mean(m.get("response_length/mean") for m in vm),
        "verl_card_peak_gib": (verl.get("card_memory") or {}).get("peak_gib"),
        "verl_actor_max_allocated_gib": _median(m.get("perf/max_memory_allocated_gb") for m in vm),
        "verl_steps_s": seconds,
        "verl_startup_s": verl["wall_s"] - sum(seconds),
    }


def summarize(ours: dict, verl: dict) -> dict:
    """The result from each side's record: medians over the steps after the warm-up one."""
    timed = ours["steps"][1:]
    ours_s, v = statistics.median(x["wall"] for x in timed), verl_side(verl)
    return {
        "benchmark": "gpu_vs_verl",
        "machine": {**ours.get("machine", {}), "verl_side": verl["versions"]},
        "settings": {**{k: v for k, v in ours.get("settings", {}).items() if not k.startswith("verl_")},
                     "verl_profile": verl["profile"], "verl_overrides": verl["overrides"]},
        "ours_s_per_step": ours_s,
        "step_s_vs_verl": v["verl_s_per_step"] / ours_s,
        "ours_phase_s": {k: statistics.median(x[k] for x in timed) for k in timed[0]
                         if k not in ("wall", "lp_diff", "response_len")},
        "ours_logprob_abs_diff_mean": statistics.fmean(x["lp_diff"] for x in timed),  # mean |logprob diff|
        "ours_response_len": statistics.fmean(x["response_len"] for x in timed),
        "ours_card_peak_gib": (ours.get("card_memory") or {}).get("peak_gib"),
        **v,
        "ours_steps": ours["steps"],
    }


def summarize_dir(folder: Path) -> dict:
    ours, verl = (json.loads((folder / f).read_text()) for f in ("ours.json", "verl.json"))
    order = folder / "order"
    return {**summarize(ours, verl), "order": order.read_text().split() if order.is_file() else ["ours", "verl"]}


def pairs_summary(results: list[dict]) -> dict:
    """Alternating pairs: each pair's ratio (verl's seconds per step over ours), their median and
    spread, each side's seconds, gap and card peak per pair; every pair's full result beside them."""
    ratios = [r["step_s_vs_verl"] for r in results]
    per_pair = lambda key: [r[key] for r in results]  # noqa: E731
    return {
        "benchmark": "gpu_vs_verl, alternating pairs",
        "machine": results[0]["machine"], "settings": {**results[0]["settings"], "pairs": len(results)},
        "step_s_vs_verl_median": statistics.median(ratios),
        "step_s_vs_verl_spread": [min(ratios), max(ratios)],
        "step_s_vs_verl_per_pair": ratios,
        **{f"{k}_per_pair": per_pair(k) for k in (
            "ours_s_per_step", "verl_s_per_step", "ours_logprob_abs_diff_mean", "verl_rollout_probs_diff_mean",
            "ours_card_peak_gib", "verl_card_peak_gib")},
        "pairs": results,
    }


def series_result(series: Path) -> dict | None:
    results = [summarize_dir(d) for d in finished_pairs(series)]
    return (results[0] if len(results) == 1 else pairs_summary(results)) if results else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side, after one warm-up step")
    ap.add_argument("--micro", type=int, default=16, help="ours' completions per forward/backward (verl's too "
                    "with --verl-profile matched)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--fp32-residual", choices=("auto", "true", "false"), default="auto",
                    help="our actor.fp32_residual (auto: unset, on for a bf16 actor)")
    ap.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM's share of the card while awake: ours, "
                    "and verl's with --verl-profile matched")
    ap.add_argument("--verl-profile", choices=tuple(PROFILES), default="recommended")
    ap.add_argument("--verl-set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="more hydra overrides for verl's run, after the profile's")
    ap.add_argument("--verl-site", type=Path, default=Path(os.environ.get("VERL_SITE", "/tmp/verl/site")),
                    help="the folder verl's packages are installed in (scripts/verl_bundle.sh)")
    ap.add_argument("--verl-timeout", type=float, default=540, help="seconds verl's run may take")
    ap.add_argument("--smoke", action="store_true", help="only verl's side, once (checks that it runs here)")
    ap.add_argument("--pairs", type=int, default=1, help="a new series of this many alternating pairs (ABBA order)")
    ap.add_argument("--sides", type=int, metavar="N",
                    help="continue this machine's series by its next N runs (one side each) instead")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--summarize", type=Path, metavar="DIR",
                    help="only rebuild the result from a pair's ours.json and verl.json in DIR, or a series' "
                         "from its pair*/ folders")
    args = ap.parse_args(argv)
    for kv in args.verl_set:
        if "=" not in kv:
            ap.error(f"--verl-set: {kv!r} is not KEY=VALUE")
    if not args.summarize and not args.job and not (args.verl_site / "verl").is_dir():
        ap.error(f"--verl-site: no verl in {args.verl_site} (bash scripts/verl_bundle.sh builds it; its install "
                 "script installs it there)")
    return args


def write(args, result: dict) -> None:
    print(json.dumps({k: v for k, v in result.items() if k not in ("pairs", "ours_steps")}, indent=1))
    if args.out:
        from colocate_rl.private import write_text

        write_text(args.out, json.dumps(result, indent=1) + "\n")


def main() -> None:
    args = parse_args()
    if args.summarize:
        result = series_result(args.summarize) if any(args.summarize.glob("pair*/")) else summarize_dir(args.summarize)
        if result is None:
            raise SystemExit(f"no pair of {args.summarize} has finished")
        return write(args, result)

    from colocate_rl.models.tiny import ensure_model
    from colocate_rl.private import private_dir

    root = Path(os.environ.get("COLOCATE_RL_CACHE", ".cache")).resolve()
    base = ensure_model(args.shape, root / "models" / f"{args.shape}-bf16", dtype="bfloat16")
    path = full_vocab_model(base, root / "models" / f"{args.shape}-bf16-fullvocab")
    if args.job:
        args.verl_site = str(args.verl_site)  # the record's settings are JSON
        return gpu_vs_trl.ours_job(args, path, root, args.job)
    if args.smoke:
        work = private_dir(root / "gpu_vs_verl" / "smoke")
        run_verl(args, path, root, work)
        verl = json.loads((work / "verl.json").read_text())
        return write(args, {"benchmark": "gpu_vs_verl, verl alone", "versions": verl["versions"],
                            "settings": {"verl_profile": verl["profile"], "verl_overrides": verl["overrides"]},
                            **verl_side(verl)})
    series = root / "gpu_vs_verl" / args.verl_profile / str(args.tokens)
    if args.sides is None:  # a new series
        shutil.rmtree(series, ignore_errors=True)
    for _ in range(args.sides if args.sides is not None else 2 * args.pairs):
        k, side = next_run(series)
        work = private_dir(series / f"pair{k}")
        (run_ours if side == "ours" else run_verl)(args, path, root, work)
        with open(work / "order", "a", opener=_private) as f:  # which side ran first, for the result
            f.write(side + "\n")
    if result := series_result(series):
        return write(args, result)
    k, side = next_run(series)
    print(f"no pair of {series} has finished yet; its next run is pair {k}, {side}")


if __name__ == "__main__":
    main()
