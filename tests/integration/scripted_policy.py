"""A vLLM logits processor that has a random-weight model write scripted turns, so that a real
engine produces real tool calls (good, malformed, hanging) for the multi-turn tests.

vLLM loads it by name (``rollout.engine_kwargs={logits_processors: ["scripted_policy:ScriptedPolicy"]}``)
in each engine's process; the script is a JSON file named by $COLOCATE_RL_TEST_SCRIPT:

    {"turn_mark": id, "cases": [{"marker": [ids], "turns": [[ids], [ids], ...]}, ...]}

A request whose prompt holds a case's marker ids (in a row) writes that case's turn k, k being how
many times ``turn_mark`` (the tool-response token) occurs in its prompt: every other token's logit
is set to -inf, so the sampler, its logprobs and the engine's stop on EOS are vLLM's own. A turn
that is null, and a prompt of no case, are the model's own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

SCRIPT = "COLOCATE_RL_TEST_SCRIPT"


def _holds(seq: list[int], part: tuple[int, ...]) -> bool:
    n = len(part)
    return any(tuple(seq[i:i + n]) == part for i in range(len(seq) - n + 1))


class ScriptedPolicy(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        script = json.loads(Path(os.environ[SCRIPT]).read_text())
        self.mark = int(script["turn_mark"])
        self.cases = [(tuple(c["marker"]), c["turns"]) for c in script["cases"]]
        self.rows: dict[int, tuple[list[int], list[int]]] = {}  # batch index -> (forced ids, its output so far)

    def is_argmax_invariant(self) -> bool:
        return False  # greedy sampling must see it too

    def _forced(self, prompt: list[int]) -> list[int] | None:
        for marker, turns in self.cases:
            if _holds(prompt, marker):
                return turns[min(prompt.count(self.mark), len(turns) - 1)] or None
        return None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, _params, prompt, output in batch_update.added:
            forced = self._forced(list(prompt or []))
            if forced is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = (forced, output)
        for a, b, how in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if how == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, (forced, output) in self.rows.items():
            token = forced[min(len(output), len(forced) - 1)]
            logits[i] = float("-inf")
            logits[i, token] = 0.0
        return logits


def write_script(path: Path, tokenizer, cases: dict[str, list[str | None]]) -> Path:
    """The script file: each case's marker (the text a prompt holds) and its turns, each turn's text
    ending with the tokenizer's EOS (None: the model writes that turn)."""
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    script = {"turn_mark": tokenizer.convert_tokens_to_ids("<tool_response>"),
              "cases": [{"marker": ids(marker),
                         "turns": [None if t is None else ids(t) + [tokenizer.eos_token_id] for t in turns]}
                        for marker, turns in cases.items()]}
    path.write_text(json.dumps(script))
    return path
