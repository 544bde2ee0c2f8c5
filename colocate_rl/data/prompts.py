"""Prompt datasets: a hub id, a local .parquet/.jsonl/.json file, or the synthetic arithmetic task,
read with HF ``datasets`` and turned into token ids (colocate_rl.types.Sample).

Three row schemas are understood, detected per file from its columns when ``format=auto``:

    verl:   {"prompt": [{"role": "user", "content": "..."}, ...], "reward_model": {"ground_truth": "..."}}
    slime:  {"prompt": "...", "label": "..."}
    math:   {"problem": "...", "answer": "..."}      (AIME-2024, MATH-500 and most math eval sets)

``prompt_key`` / ``label_key`` override the columns (a dotted key reaches into a nested dict). A
prompt may be a string or a list of chat messages in either schema; a string becomes one user
message when the chat template is applied.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import datasets

from colocate_rl.config import ConfigError, DataConfig
from colocate_rl.errors import error_line, first_line
from colocate_rl.private import cache_dir
from colocate_rl.data.arithmetic import arithmetic_problems, with_tool_demos
from colocate_rl.tools.chat import ChatFormat
from colocate_rl.types import Sample

logger = logging.getLogger(__name__)

LABEL_KEYS = {"verl": "reward_model.ground_truth", "slime": "label", "math": "answer"}
PROMPT_KEYS = {"verl": "prompt", "slime": "prompt", "math": "problem"}
_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


@dataclass
class PromptDataset:
    samples: list[Sample]
    source: str
    skipped: dict[str, int] = field(default_factory=dict)  # reason (malformed | too_long) → rows skipped

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)


class _BadRow(ValueError):
    """A row that cannot be a prompt; the message starts with the field it is about."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _read(source: str, split: str) -> tuple[Sequence[dict[str, Any]], list[str]]:
    """A hub id or a local file → (rows, column names)."""
    builder = _FILE_BUILDERS.get(Path(source).suffix)
    if builder is None:  # a hub id: HF's cache (HF_HOME), so that a pre-downloaded set is found offline
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as e:  # noqa: BLE001 - not a file, and not a data set the hub gave us
            raise ConfigError(f"{source} is not a .parquet/.jsonl/.json file, and the Hugging Face hub did not "
                              f"give it (split {split!r}: {error_line(e)})") from None
    elif not Path(source).is_file():
        raise ConfigError(f"data file not found: {source}")
    else:
        try:
            # datasets keeps an Arrow copy of a local file: in the run-local cache, not the shared HF one.
            cache = str(cache_dir() / "datasets")
            ds = datasets.load_dataset(builder, data_files=source, split="train", cache_dir=cache)
        except Exception as e:  # noqa: BLE001 - datasets' own message is buried under its fallbacks
            raise ConfigError(f"{source}: cannot be read as {builder}: {_first_bad_line(source) or first_line(e)}") \
                from None
    return ds, list(ds.column_names)


def _first_bad_line(path: str) -> str:
    """For a JSON-lines file: which line is not JSON ("" when every line parses)."""
    if not path.endswith(".jsonl"):
        return ""
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            try:
                if line.strip():
                    json.loads(line.rstrip("\n"))
            except json.JSONDecodeError as e:
                return f"line {n} is not JSON ({e.msg}, column {e.colno})"
    return ""


def _get(row: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def _messages(prompt: Any) -> list[dict[str, str]] | None:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    return None


def _checked(row: dict[str, Any], keys: tuple[str, str]) -> tuple[list[dict[str, str]], str]:
    """A row's prompt as chat messages and its label as text, or _BadRow naming the field: missing,
    of the wrong type, empty (an empty prompt is 0 tokens, which vLLM rejects mid-step), or a label
    that is not a finite number (NaN would be stored as "nan", which no answer matches)."""
    prompt_key, label_key = keys
    prompt, label = _get(row, prompt_key), _get(row, label_key)
    for key, value in ((prompt_key, prompt), (label_key, label)):
        if value is None:
            raise _BadRow("malformed", f"'{key}' is missing or null")
    messages = _messages(prompt)
    if messages is None:
        raise _BadRow("malformed", f"'{prompt_key}' is {type(prompt).__name__}, not a string or a list of chat "
                                   "messages")
    if not any(m["content"].strip() for m in messages):
        raise _BadRow("malformed", f"'{prompt_key}' is empty")
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise _BadRow("malformed", f"'{label_key}' is {type(label).__name__}, not a string or a number")
    if isinstance(label, float) and not math.isfinite(label):
        raise _BadRow("malformed", f"'{label_key}' is {label}, not a finite number")
    if not str(label).strip():
        raise _BadRow("malformed", f"'{label_key}' is empty")
    return messages, str(label)


def _sample(row: dict[str, Any], keys: tuple[str, str], cfg: DataConfig, tokenizer, meta: dict,
            chat: Optional[ChatFormat] = None) -> Sample:
    messages, label = _checked(row, keys)
    prompt_key = keys[0]
    if chat is not None:  # a multi-turn rollout: the tools offered, the messages kept for its turns
        text = chat.render(messages)
        meta = {**meta, "messages": messages}
    elif cfg.apply_chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    elif isinstance(_get(row, prompt_key), str):
        text = messages[0]["content"]
    else:
        raise ConfigError(f"{meta['source']} row {meta['row'] + 1}: prompts are chat messages but "
                          f"data.apply_chat_template=false (set it true to render '{prompt_key}')")
    # A chat template already writes any BOS it wants; raw text gets the tokenizer's special tokens,
    # as vLLM does for a text prompt.
    ids = tokenizer(text, add_special_tokens=not cfg.apply_chat_template)["input_ids"]
    if not ids:
        raise _BadRow("malformed", f"'{prompt_key}' is 0 tokens (does the tokenizer have a vocabulary?)")
    if len(ids) > cfg.max_prompt_tokens:
        raise _BadRow("too_long", f"'{prompt_key}' has {len(ids)} tokens > data.max_prompt_tokens="
                                  f"{cfg.max_prompt_tokens}")
    if isinstance(row.get("data_source"), str):
        meta = {**meta, "data_source": row["data_source"]}
    sample = Sample(prompt_ids=list(ids), label=label, prompt_text=text, meta=meta)
    if chat is not None and row.get("demo"):
        sample.demo_ids, sample.demo_mask = demo_ids(chat, messages, row["demo"])
    return sample


def demo_ids(chat: ChatFormat, messages: list[dict], demo: list[dict]) -> tuple[list[int], list[bool]]:
    """A demonstration's ids after the prompt ``messages``, and which of them the policy writes: each
    assistant turn as the chat template writes it (its end token included), each run of tool results
    as a rollout appends them."""
    ids: list[int] = []
    mask: list[bool] = []
    history = list(messages)
    for i, m in enumerate(demo):
        if m["role"] == "assistant":
            turn = chat.assistant_ids(history, m)
            ids, mask = ids + turn, mask + [True] * len(turn)
        elif m["role"] == "tool" and (i == 0 or demo[i - 1]["role"] != "tool"):
            results = [r["content"] for r in demo[i:i + _run_length(demo, i)]]
            calls = history[-1].get("tool_calls", []) if history and history[-1]["role"] == "assistant" else []
            turn = chat.tool_turn_ids(history[:-1], calls, results)
            ids, mask = ids + turn, mask + [False] * len(turn)
        history.append(m)
    return ids, mask


def _run_length(messages: list[dict], start: int) -> int:
    n = 0
    while start + n < len(messages) and messages[start + n]["role"] == "tool":
        n += 1
    return n


def _keys(cfg: DataConfig, columns: list[str], source: str) -> tuple[str, str]:
    fmt = cfg.format
    if fmt == "auto":
        fmt = ("verl" if "reward_model" in columns else "slime" if "label" in columns
               else "math" if {"problem", "answer"} <= set(columns) else "")
    if not fmt and not cfg.label_key:
        raise ConfigError(
            f"{source}: cannot tell the format from its columns {columns}: expected 'reward_model' (verl), "
            f"'label' (slime) or 'problem' + 'answer' (math); set data.format, or data.prompt_key and data.label_key"
        )
    keys = (cfg.prompt_key or PROMPT_KEYS.get(fmt, "prompt"), cfg.label_key or LABEL_KEYS[fmt])
    for key in keys:
        if key.split(".")[0] not in columns:
            raise ConfigError(f"{source}: no column '{key.split('.')[0]}' (columns: {', '.join(columns)})")
    return keys


def load_prompts(
    cfg: DataConfig, tokenizer, source: Optional[str] = None, split: Optional[str] = None,
    chat: Optional[ChatFormat] = None,
) -> PromptDataset:
    """Prompts of ``source`` (default ``cfg.train``) as Samples, in file order.

    ``source``: a hub id (read with ``split``, default ``cfg.split``), a local .parquet/.jsonl/.json
    file (one split: ``split`` is ignored), or "arithmetic" (``cfg.arithmetic``'s problems; the
    held-out ones with "arithmetic:eval" or split="eval"; the default is train). A bad row
    (missing, mistyped or empty prompt or label, a label that is not a finite number, or more than
    ``cfg.max_prompt_tokens`` tokens) raises a ConfigError naming the source, the row (1-based, as
    a file's lines are counted) and the field, or with ``on_bad_row=skip`` is skipped and counted in
    ``PromptDataset.skipped``. ``Sample.meta["row"]`` is 0-based.

    ``chat`` (multi-turn rollouts with tools): prompts are written by it, with the tools offered,
    and keep their messages in ``meta["messages"]``; a row's "demo" (the turns after the prompt, as
    chat messages: the arithmetic task's calculator demonstrations) becomes ``Sample.demo_ids``.
    """
    source = source or cfg.train
    if not source:
        raise ConfigError("data.train is empty: give a hub id, a .parquet/.jsonl/.json file or 'arithmetic'")
    if cfg.apply_chat_template and chat is None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.apply_chat_template=true but the tokenizer at {tokenizer.name_or_path} has no chat "
                          "template: set data.apply_chat_template=false, or model.tokenizer to one that has a template")
    if source == "arithmetic" or source.startswith("arithmetic:"):
        which = source.partition(":")[2] or split or "train"
        problems = arithmetic_problems(cfg.arithmetic, which)
        rows: Sequence[dict[str, Any]] = [{"prompt": p, "label": a} for p, a in problems]
        if chat is not None and which == "train" and cfg.arithmetic.tool_demos:
            rows = with_tool_demos(problems, cfg.arithmetic)
        keys = ("prompt", "label")
    else:
        rows, columns = _read(source, split or cfg.split)
        keys = _keys(cfg, columns, source)

    samples, skipped = [], Counter()
    for i, row in enumerate(rows):
        try:
            samples.append(_sample(row, keys, cfg, tokenizer, {"source": source, "row": i}, chat))
        except _BadRow as e:
            if cfg.on_bad_row != "skip":
                raise ConfigError(f"{source} row {i + 1}: {e} (data.on_bad_row=skip skips such rows)") from None
            skipped[e.reason] += 1
    if skipped:
        detail = ", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
        logger.warning("%s: skipped %d of %d rows (%s)", source, sum(skipped.values()), len(rows), detail)
    if not samples:
        raise ConfigError(f"{source}: no usable prompts ({len(rows)} rows, skipped: {dict(skipped) or 'none'})")
    return PromptDataset(samples, source, dict(skipped))
