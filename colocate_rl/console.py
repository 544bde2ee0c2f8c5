"""A run's console, quiet unless ``logging.verbose=true``: the resolved config and plan once, the
progress bar, a line per step, and an error in one line. What vLLM, megatron-core, Ray, torch and
wandb log goes to ``<run folder>/run.log`` (0600) instead, through each library's own switch:
Python logging (vLLM's processes read the same settings through VLLM_LOGGING_CONFIG_PATH, Ray's
workers through their setup hook), TORCH_CPP_LOG_LEVEL for torch's C++ warnings, WANDB_SILENT."""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import os
import re
import traceback
import warnings
from pathlib import Path

from colocate_rl.errors import error_line
from colocate_rl.private import opener, write_text

# megatron-core's notices of the optional packages it runs without (the plan's "kernels:" line says
# them once) and two notices about itself (its experimental module, its default's deprecation),
# each given at import, before the run folder and its log exist.
LIBRARY_NOTICES = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                   "absl.logging is not installed", "MimoModelConfig is experimental", "full scope is deprecated")
# Read when a process starts (torch's C++ logging when torch loads): set before the run imports torch.
QUIET_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR", "WANDB_SILENT": "true"}
CONFIG_ENV = "COLOCATE_RL_LOG_CONFIG"  # the run's logging settings (a JSON file in its folder)
LOGGERS = ("", "colocate_rl", "vllm", "ray", "py.warnings")  # what ``settings`` configures ("" the root)


class OneLine(logging.Formatter):
    """A record as one line on the console: its message's lines joined (a traceback stays in the file)."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname} {record.name}: {' '.join(record.getMessage().split())}"


def settings(log: Path) -> dict:
    """``logging.config.dictConfig``'s settings: every record at INFO and above to ``log``; on stderr
    errors, and the project's own warnings. vLLM's and Ray's loggers, which come with a console
    handler of their own, pass their records to the root's."""
    console = {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "one_line"}
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"file": {"format": "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"},
                       "one_line": {"()": f"{__name__}.OneLine"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log), "formatter": "file"},
                     "errors": {**console, "level": "ERROR"}, "warnings": {**console, "level": "WARNING"}},
        "root": {"level": "INFO", "handlers": ["file", "errors"]},
        "loggers": {"colocate_rl": {"handlers": ["file", "warnings"], "propagate": False},
                    "vllm": {"propagate": True}, "ray": {"propagate": True}},
    }


def configure() -> None:
    """This process logs as its run's settings (CONFIG_ENV) say, Python's warnings with it. Also
    Ray's worker setup hook: a worker on a node that does not mount the run folder keeps Ray's logs."""
    path = os.environ.get(CONFIG_ENV, "")
    if path and os.path.isfile(path):
        logging.config.dictConfig(json.loads(Path(path).read_text()))
        logging.captureWarnings(True)


def child_env() -> dict[str, str]:
    """What the processes a run starts on other machines (Ray's workers) need to be as quiet."""
    return {k: os.environ[k] for k in (*QUIET_ENV, CONFIG_ENV, "VLLM_LOGGING_CONFIG_PATH") if k in os.environ}


class Quiet(contextlib.ExitStack):
    """The quiet console of ``cli.main`` while the context lasts: QUIET_ENV and LIBRARY_NOTICES' filters
    from the start, the log file once the run folder is known (``to_file``). The environment,
    warning filters and logging are as they were afterwards."""

    log: Path | None = None

    def __enter__(self) -> "Quiet":
        super().__enter__()
        self.setenv({k: v for k, v in QUIET_ENV.items() if k not in os.environ})  # the user's own win
        self.enter_context(warnings.catch_warnings())
        for notice in LIBRARY_NOTICES:
            warnings.filterwarnings("ignore", message=re.escape(notice), category=UserWarning)
        return self

    def setenv(self, env: dict[str, str]) -> None:
        self.callback(_restore_env, {k: os.environ.get(k) for k in env})
        os.environ.update(env)

    def to_file(self, run_dir: Path) -> Path:
        """``run_dir/run.log`` from now on, for this process and those it starts."""
        self.log = (run_dir / "run.log").resolve()
        os.close(opener(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND))  # 0600 before a library opens it
        path = self.log.with_name("logging.json")
        write_text(path, json.dumps(settings(self.log), indent=1))
        env = {CONFIG_ENV: str(path)}
        if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":  # vLLM refuses a settings file then
            env["VLLM_LOGGING_CONFIG_PATH"] = os.environ.get("VLLM_LOGGING_CONFIG_PATH", str(path))
        self.setenv(env)
        saved = [(lg, lg.level, lg.handlers[:], lg.propagate) for lg in map(logging.getLogger, LOGGERS)]
        self.callback(_restore, saved)
        configure()
        return self.log

    def crashed(self, e: BaseException) -> str:
        """The error's line for the console, its traceback appended to the log file (``to_file``'s)."""
        with open(self.log, "a", opener=opener) as f:
            f.write("".join(traceback.format_exception(e)))
        return f"{error_line(e)} (traceback in {self.log})"


def _restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _restore(saved: list) -> None:
    logging.captureWarnings(False)
    for lg, level, handlers, propagate in saved:
        for h in lg.handlers[:]:
            lg.removeHandler(h)
            if h not in handlers:
                h.close()
        lg.setLevel(level)
        lg.propagate = propagate
        for h in handlers:
            lg.addHandler(h)
