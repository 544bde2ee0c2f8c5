"""The quiet console (colocate_rl/console.py): the libraries' records and warnings go to the run's
log, 0600, and only errors (and the project's own warnings) to the console, one line each; the
processes the run starts read the same settings; everything is as it was afterwards."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

from colocate_rl import console

ENV = (*console.QUIET_ENV, console.CONFIG_ENV, "VLLM_LOGGING_CONFIG_PATH")


def test_libraries_log_to_the_run_folder_and_errors_reach_the_console(tmp_path, capfd, monkeypatch):
    for k in (*ENV, "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.delenv(k, raising=False)
    before = {name: logging.getLogger(name).handlers[:] for name in console.LOGGERS}  # vLLM's own, once imported
    with console.Quiet() as quiet:
        assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR" and os.environ["WANDB_SILENT"] == "true"
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning)
        log = quiet.to_file(tmp_path)
        assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == os.environ[console.CONFIG_ENV] == str(tmp_path / "logging.json")
        assert set(console.child_env()) == set(ENV)
        logging.getLogger("vllm.config.model").info("Resolved architecture: Qwen3ForCausalLM")
        logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel IS DEPRECATED")
        warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)
        logging.getLogger("vllm.v1.engine.core").error("EngineCore failed to start.\nTraceback (most recent call last):")
        logging.getLogger("colocate_rl.data.prompts").warning("skipped 2 rows")
        line = quiet.crashed(RuntimeError("boom\nsecond line"))
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == ["ERROR vllm.v1.engine.core: EngineCore failed to start. Traceback (most recent call "
                                "last):", "WARNING colocate_rl.data.prompts: skipped 2 rows"]
    assert line == f"RuntimeError: boom (traceback in {log})"
    text = log.read_text()
    for record in ("INFO vllm.config.model: Resolved architecture", "WARNING megatron.core.models.gpt.gpt_model: GPTModel",
                   "WARNING py.warnings:", "reduce_op` is deprecated", "ERROR vllm.v1.engine.core: EngineCore failed",
                   "skipped 2 rows", "RuntimeError: boom\nsecond line"):
        assert record in text, record
    assert "Transformer Engine" not in text  # the plan's kernels line says it
    assert {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()} == {"run.log": 0o600, "logging.json": 0o600}
    # as it was before
    assert not any(k in os.environ for k in ENV)
    assert {name: logging.getLogger(name).handlers for name in console.LOGGERS} == before
    logging.getLogger("vllm.config.model").info("after the run")
    assert "after the run" not in log.read_text()


def test_a_process_the_run_starts_logs_to_the_same_file(tmp_path, monkeypatch):
    """Ray's worker setup hook (console.configure) in a fresh interpreter, with what a worker gets:
    its library records and warnings land in the run's log; its console only shows errors."""
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    with console.Quiet() as quiet:
        log = quiet.to_file(tmp_path)
        env = {**os.environ, **console.child_env()}
    code = ("import logging, warnings\nfrom colocate_rl import console\nconsole.configure()\n"
            "logging.getLogger('megatron.core.optimizer').info('worker setup')\n"
            "warnings.warn('absl.logging is not installed')\n"
            "logging.getLogger('ray.worker').error('worker error')\n")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "" and p.stderr == "ERROR ray.worker: worker error\n"
    text = log.read_text()
    assert "INFO megatron.core.optimizer: worker setup" in text and "absl.logging is not installed" in text
    assert "ERROR ray.worker: worker error" in text
    # vLLM reads the same settings file, as JSON that dictConfig takes
    assert json.loads(Path(env["VLLM_LOGGING_CONFIG_PATH"]).read_text())["handlers"]["file"]["filename"] == str(log)


def test_the_users_own_settings_win(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "false")
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")  # vLLM would refuse a settings file
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    with console.Quiet() as quiet:
        quiet.to_file(tmp_path)
        assert os.environ["WANDB_SILENT"] == "false" and "VLLM_LOGGING_CONFIG_PATH" not in os.environ
    assert os.environ["WANDB_SILENT"] == "false"
