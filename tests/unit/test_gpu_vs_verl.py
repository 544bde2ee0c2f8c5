"""benchmarks/peers/gpu_vs_verl.py without verl: its options, the overrides and environment verl's run
gets, the model folder and prompts file both sides read, and its reading of verl's records into a
result; where verl is importable, verl's own config checks and prompt tokenization on top."""

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "peers" / "gpu_vs_verl.py"
HAVE_VERL = all(importlib.util.find_spec(m) is not None for m in ("verl", "hydra"))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_vs_verl", SCRIPT)
    saved = list(sys.path)  # the script puts benchmarks/peers and benchmarks/ on it
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved
    return mod


@pytest.fixture
def site(tmp_path):
    (tmp_path / "site" / "verl").mkdir(parents=True)
    return tmp_path / "site"


def overrides(bench, site, *argv):
    """verl's overrides for these options, and them as a dict (the last of a key wins, as in hydra)."""
    args = bench.parse_args(["--verl-site", str(site), *argv])
    ov = bench.verl_overrides(args, Path("/m"), Path("/d.parquet"), site.parent / "work", Path("/tmp/verl-ray-x"))
    return ov, {k.lstrip("+"): v for k, v in (o.split("=", 1) for o in ov)}


def test_options_default_to_the_trl_benchmarks_workload(bench, site):
    a = bench.parse_args(["--verl-site", str(site)])
    assert (a.shape, a.prompts, a.n, a.tokens, a.steps, a.micro, a.gpu_mem) == ("qwen3-0.6b", 64, 8, 256, 3, 16, 0.5)
    assert a.verl_profile == "recommended" and a.verl_set == []


@pytest.mark.parametrize("argv, field", [(["--verl-site", "{missing}"], "--verl-site"),
                                         (["--verl-set", "trainer.nnodes"], "--verl-set")])
def test_a_bad_option_stops_with_one_line_naming_it(bench, site, capsys, argv, field):
    argv = [a.format(missing=site.parent / "nowhere") for a in argv]
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--verl-site", str(site), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and field in err.splitlines()[-1]


def test_summarizing_needs_no_verl(bench, tmp_path):
    a = bench.parse_args(["--summarize", str(tmp_path), "--verl-site", str(tmp_path / "nowhere")])
    assert a.summarize == tmp_path


def test_verls_run_does_ours_work(bench, site):
    _, o = overrides(bench, site, "--tokens", "1024", "--prompts", "32", "--n", "4", "--steps", "2", "--lr", "2e-6")
    ar, r = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
    assert (o["data.train_batch_size"], o["data.max_response_length"], o[r + "n"]) == ("32", "1024", "4")
    assert o[ar + "ppo_mini_batch_size"] == "32" and o[ar + "ppo_epochs"] == "1"  # one optimizer step a batch
    assert o[r + "ignore_eos"] == "true" and o[r + "temperature"] == "1.0"
    assert (o[ar + "optim.lr"], o[ar + "optim.weight_decay"], o[ar + "grad_clip"]) == ("2e-06", "0.0", "1.0")
    assert (o[ar + "clip_ratio_low"], o[ar + "clip_ratio_high"], o[ar + "use_kl_loss"]) == ("0.2", "0.28", "false")
    assert o["algorithm.adv_estimator"] == "grpo" and o[ar + "strategy"] == "fsdp"
    assert o["trainer.total_training_steps"] == "3"  # a warm-up step and the timed ones
    assert o[r + "max_model_len"] == str(bench.MAX_PROMPT_TOKENS + 1024)
    assert o["actor_rollout_ref.model.custom_chat_template"] == f'"{bench.PASS_THROUGH_TEMPLATE}"'


def test_verl_binds_loopback_and_reaches_nothing_outside(bench, site):
    _, o = overrides(bench, site)
    assert o["ray_kwargs.ray_init._node_ip_address"] == "127.0.0.1"
    assert o["ray_kwargs.ray_init.include_dashboard"] == "false"
    assert "wandb" not in o["trainer.logger"] and o["trainer.val_before_train"] == "false"
    work = str(site.parent / "work")
    assert o["hydra.run.dir"].startswith(work) and o["trainer.default_local_dir"].startswith(work)
    assert o["ray_kwargs.ray_init._temp_dir"] == "/tmp/verl-ray-x"


def test_the_profiles(bench, site):
    _, rec = overrides(bench, site, "--micro", "32", "--gpu-mem", "0.4")
    _, mat = overrides(bench, site, "--verl-profile", "matched", "--micro", "32", "--gpu-mem", "0.4")
    ar, r = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
    assert rec[ar + "use_dynamic_bsz"] == "true" and rec[r + "gpu_memory_utilization"] == "0.6"
    assert rec["actor_rollout_ref.model.enable_gradient_checkpointing"] == "true"
    assert ar + "ppo_micro_batch_size_per_gpu" not in rec
    assert mat[ar + "use_dynamic_bsz"] == "false" and mat[r + "gpu_memory_utilization"] == "0.4"
    assert mat[ar + "ppo_micro_batch_size_per_gpu"] == mat[r + "log_prob_micro_batch_size_per_gpu"] == "32"
    assert mat["actor_rollout_ref.model.enable_gradient_checkpointing"] == "false"
    assert mat["algorithm.rollout_correction.rollout_is_threshold"] == "2.0"


@pytest.mark.parametrize("profile", ["recommended", "matched"])
def test_no_setting_is_given_twice_and_verl_set_comes_last(bench, site, profile):
    ov, _ = overrides(bench, site, "--verl-profile", profile)
    assert all("=" in o for o in ov)
    assert max(Counter(o.split("=", 1)[0].lstrip("+") for o in ov).values()) == 1
    extra = "actor_rollout_ref.rollout.gpu_memory_utilization=0.3"
    ov, o = overrides(bench, site, "--verl-profile", profile, "--verl-set", extra)
    assert ov[-1] == extra and o["actor_rollout_ref.rollout.gpu_memory_utilization"] == "0.3"


def test_verls_environment(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/vb/x/vllm", str(bench.ROOT), "/tmp/vb/site"]))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "in-the-environment")
    env = bench.verl_env(tmp_path / "site", tmp_path / "work", tmp_path / "token")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "site"), "/tmp/vb/x/vllm", "/tmp/vb/site"]
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "token")
    assert "RAY_AUTH_TOKEN" not in env
    assert env["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "work" / "metrics.jsonl")
    assert env["DIST_INIT_METHOD"] == f"file://{tmp_path / 'work' / 'torch-store'}"  # no TCPStore to listen


@pytest.fixture(scope="module")
def tiny(bench, tmp_path_factory):
    """A tiny model (320 rows, a 300-token tokenizer) and its full-vocabulary folder."""
    from colocate_rl.models.tiny import ensure_model

    d = tmp_path_factory.mktemp("models")
    base = ensure_model("qwen3-tiny", d / "base", dtype="bfloat16")
    return base, bench.full_vocab_model(base, d / "full")


def test_the_tokenizer_covers_every_row_and_encodes_text_as_before(tiny):
    from transformers import AutoTokenizer

    base, full = tiny
    old, new = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(full)
    rows = json.loads((full / "config.json").read_text())["vocab_size"]
    assert len(old) < rows == len(new)
    texts = ["12+7=", "3*4=-1", "<|im_start|>user\n5-2=<|im_end|>"]
    assert [new.encode(t) for t in texts] == [old.encode(t) for t in texts]
    fillers = new.decode(list(range(len(old), rows)))
    assert fillers.startswith("<unused_a><unused_b>") and not any(c.isdigit() for c in fillers)
    assert max(new.encode(fillers)) < len(old)  # no text encodes to the added ids


def test_the_folder_is_private_and_holds_the_same_weights(tiny):
    base, full = tiny
    assert oct(full.stat().st_mode & 0o777) == "0o700"
    assert {oct(f.stat().st_mode & 0o777) for f in full.iterdir()} == {"0o600"}
    for f in base.glob("*.safetensors"):
        assert (full / f.name).read_bytes() == f.read_bytes()
    assert (full / "config.json").read_bytes() == (base / "config.json").read_bytes()


def test_a_tokenizer_larger_than_the_model_is_refused(bench, tiny, tmp_path):
    _, full = tiny
    (tmp_path / "tokenizer.json").write_bytes((full / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="tokenizer.json has 320 ids, more than the model's vocab_size 300"):
        bench.padded_tokenizer(tmp_path, 300)


def our_config(bench, path, tmp_path):
    from colocate_rl.config import Config, ModelConfig, load

    args = bench.parse_args(["--summarize", str(tmp_path)])
    ov = bench.gpu_vs_trl.our_overrides(args, path, tmp_path)
    return load(Config(model=ModelConfig(path=str(path))), overrides=ov)


def test_verl_reads_the_prompts_as_ours_and_a_template_that_adds_tokens_is_caught(bench, tiny, tmp_path, monkeypatch):
    _, full = tiny
    cfg = our_config(bench, full, tmp_path)
    bench.check_prompt_ids(full, cfg)  # the pass-through template: the same ids
    header = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"
    monkeypatch.setattr(bench, "PASS_THROUGH_TEMPLATE", header)
    with pytest.raises(SystemExit, match="verl would read"):
        bench.check_prompt_ids(full, cfg)


def test_the_prompts_file_is_what_verls_dataset_reads(bench, tmp_path):
    import pandas as pd

    bench.write_prompts(tmp_path / "p.parquet", [("3+4=", "7"), ("9-2=", "7")])
    df = pd.read_parquet(tmp_path / "p.parquet")
    assert len(df) == 2 and oct((tmp_path / "p.parquet").stat().st_mode & 0o777) == "0o600"
    row = df.iloc[1]
    assert [dict(m) for m in row["prompt"]] == [{"role": "user", "content": "9-2="}]
    assert row["reward_model"]["ground_truth"] == "7" and row["data_source"] == "arithmetic"


def test_verls_reward_is_ours():
    from colocate_rl.rewards.arithmetic import arithmetic_reward

    spec = importlib.util.spec_from_file_location("verl_reward", SCRIPT.with_name("verl_reward.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cases = [("7", "7"), (" 7 apples", "7"), ("-3", "-3"), ("3", "-3"), ("no number", "1"), ("12 then 7", "7")]
    got = [mod.compute_score("arithmetic", text, label) for text, label in cases]
    assert got == [arithmetic_reward(text, label) for text, label in cases] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


# verl 0.9.1's console logger (verl/utils/logger/aggregate_logger.py), behind Ray's actor prefix
CONSOLE = """\
(TaskRunnerV1 pid=4242) Training Progress:  25%|██▌       | 1/4
(TaskRunnerV1 pid=4242) step:1 - timing_s/gen:12.5 - timing_s/step:20.25 - actor/lr:1e-06 - response_length/mean:256.0
(TaskRunnerV1 pid=4242) step:2 - timing_s/step:9.5 - training/rollout_probs_diff_mean:np.float64(0.0031)
(pid=7) prestep:9 - timing_s/step:1.0
"""


def test_console_records(bench):
    steps = bench.parse_console(CONSOLE)
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["metrics"] == {"timing_s/gen": 12.5, "timing_s/step": 20.25, "actor/lr": 1e-06,
                                   "response_length/mean": 256.0}
    assert steps[1]["metrics"]["training/rollout_probs_diff_mean"] == 0.0031


def test_file_records_merge_by_step_and_keep_numbers(bench):
    text = "\n".join(json.dumps(r) for r in [
        {"step": 2, "data": {"timing_s/step": 9.5, "note": "text"}},
        {"step": 1, "data": {"timing_s/step": 20.25, "timing_s/gen": 12.5}},
        {"step": 2, "data": {"perf/max_memory_allocated_gb": 31.0}}]) + "\n"
    steps = bench.parse_jsonl(text)
    assert steps == [{"step": 1, "metrics": {"timing_s/step": 20.25, "timing_s/gen": 12.5}},
                     {"step": 2, "metrics": {"timing_s/step": 9.5, "perf/max_memory_allocated_gb": 31.0}}]


def test_the_stamps_follow_the_metrics_file(bench, tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    stamps = bench.Stamps(path)
    stamps.poll()  # no file yet
    path.write_text(json.dumps({"step": 1, "data": {}}) + "\n" + '{"step": 2, "da')  # the second line half written
    stamps.poll()
    assert list(stamps.times) == [1]
    path.write_text(json.dumps({"step": 1, "data": {}}) + "\n" + json.dumps({"step": 2, "data": {}}) + "\n")
    stamps.poll()
    assert list(stamps.times) == [1, 2] and stamps.times[2] >= stamps.times[1]
    assert "[verl] step 2 recorded" in capsys.readouterr().out


def ours_record(walls, lp=0.005):
    return {"steps": [{"wall": w, "lp_diff": lp, "response_len": 256.0, "generate": w / 2, "train": w / 3}
                      for w in walls],
            "machine": {"gpu": "NVIDIA H200", "vllm": "0.26.0"}, "settings": {"tokens": 256, "verl_site": "/x"},
            "card_memory": {"before_gib": 0.5, "peak_gib": 80.0}}


def verl_record(times, step_s, diff=0.01):
    steps = [{"step": i + 1, "t": t, "metrics": {"timing_s/step": s, "timing_s/gen": s / 2,
                                                 "training/rollout_probs_diff_mean": diff,
                                                 "response_length/mean": 256.0, "perf/max_memory_allocated_gb": 20.0}}
             for i, (t, s) in enumerate(zip(times, step_s))]
    return {"steps": steps, "wall_s": 200.0, "versions": {"verl": "0.9.1", "vllm": "0.26.0"}, "profile": "matched",
            "overrides": ["trainer.nnodes=1"], "card_memory": {"before_gib": 0.5, "peak_gib": 90.0}}


def test_a_pairs_result(bench):
    # verl's records landed at 0, 12, 24.5 and 36 s: its timed steps took 12, 12.5 and 11.5 s
    r = bench.summarize(ours_record([30.0, 6.0, 5.0, 7.0]), verl_record([0.0, 12.0, 24.5, 36.0], [25, 11, 12, 11]))
    assert r["ours_s_per_step"] == 6.0 and r["verl_s_per_step"] == 12.0 and r["step_s_vs_verl"] == 2.0
    assert r["verl_steps_s"] == [12.0, 12.5, 11.5] and r["verl_timing_step_s"] == 11
    assert r["verl_phase_s"] == {"gen": 5.5, "step": 11} and r["ours_phase_s"] == {"generate": 3.0, "train": 2.0}
    assert r["verl_rollout_probs_diff_mean"] == 0.01 and r["ours_logprob_abs_diff_mean"] == 0.005
    assert (r["ours_card_peak_gib"], r["verl_card_peak_gib"]) == (80.0, 90.0)
    assert r["settings"]["verl_profile"] == "matched" and "verl_site" not in r["settings"]
    assert r["verl_startup_s"] == 200.0 - 36.0


def test_without_stamps_verls_own_step_time_is_used(bench):
    verl = verl_record([0.0, 0.0], [25, 11])
    for s in verl["steps"]:
        del s["t"]
    assert bench.verl_step_seconds(verl["steps"]) == [11]


def test_a_series_runs_abba_and_summarizes_its_finished_pairs(bench, tmp_path):
    runs = []
    for _ in range(6):
        k, side = bench.next_run(tmp_path)
        runs.append((k, side))
        (tmp_path / f"pair{k}").mkdir(exist_ok=True)
        walls = [30.0, 6.0 + k, 6.0 + k]
        rec = ours_record(walls) if side == "ours" else verl_record([0.0, 12.0, 24.0], [25, 12, 12])
        (tmp_path / f"pair{k}" / f"{side}.json").write_text(json.dumps(rec))
    assert runs == [(0, "ours"), (0, "verl"), (1, "verl"), (1, "ours"), (2, "ours"), (2, "verl")]
    (tmp_path / "pair3").mkdir()  # unfinished: left out
    (tmp_path / "pair3" / "ours.json").write_text(json.dumps(ours_record([1.0, 1.0])))
    out = subprocess.run([sys.executable, str(SCRIPT), "--summarize", str(tmp_path)], check=True,
                         capture_output=True, text=True).stdout
    got = json.loads(out)
    assert got["step_s_vs_verl_per_pair"] == [2.0, 12 / 7, 1.5]
    assert got["step_s_vs_verl_median"] == 12 / 7 and got["step_s_vs_verl_spread"] == [1.5, 2.0]


@pytest.mark.skipif(not HAVE_VERL, reason="verl and hydra-core are not installed (scripts/verl_bundle.sh)")
@pytest.mark.parametrize("profile", ["recommended", "matched"])
def test_verl_accepts_the_overrides(bench, site, profile):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    ov, _ = overrides(bench, site, "--verl-profile", profile)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[o for o in ov if not o.startswith("hydra.")])
    assert not need_reference_policy(cfg) and not need_critic(cfg)
    validate_config(config=cfg, use_reference_policy=False, use_critic=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert actor.ppo_mini_batch_size == 64 and rollout.ignore_eos and rollout.n == 8
    assert cfg.actor_rollout_ref.model.custom_chat_template == bench.PASS_THROUGH_TEMPLATE


@pytest.mark.skipif(not HAVE_VERL, reason="verl is not installed (scripts/verl_bundle.sh)")
def test_verls_agent_loop_tokenizes_the_prompts_as_ours(bench, tiny, tmp_path):
    from transformers import AutoTokenizer
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from colocate_rl.data.prompts import load_prompts

    _, full = tiny
    tok = AutoTokenizer.from_pretrained(full)
    tok.chat_template = bench.PASS_THROUGH_TEMPLATE  # what actor_rollout_ref.model.custom_chat_template sets
    builder = create_continuous_token_builder(tok, hf_model_type="qwen3")
    for s in list(load_prompts(our_config(bench, full, tmp_path).data, tok))[:8]:
        assert builder.build_initial_tokens([{"role": "user", "content": s.prompt_text}]) == list(s.prompt_ids)
