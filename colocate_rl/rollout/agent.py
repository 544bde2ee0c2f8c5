"""Multi-turn rollouts with tool calls (``rollout.agent``): the policy writes, calls a tool, reads
the result, writes again, all in one row of the batch.

``MultiTurn.over(generate)`` wraps a rollout's ``generate`` (the engine's through the handoff in
colocated mode, the router's in disaggregated mode, the eval's) with the same signature, so every
mode's generation runs the same loop:

    turn 1     generate(prompts, n)                 the step's samples, as a single-turn rollout
    parse      each finished turn, by vLLM's tool-call parser of the model's family
    tools      every call of the turn, across all samples, through one ToolExecutor.run
    append     the results as the chat template writes them after the turn's end token, their
               ids tokenised on their own (loss_mask False, logprob 0)
    turn k     generate(conversations so far, n=1)  only the rows still going, from their exact ids

A row ends when a turn calls no tool ("stop"), when its last turn (``rollout.agent.max_turns``)
still calls one ("turns"; those calls are not run), or when its response (everything after the
prompt, the results included) reaches the call's ``max_tokens``, or the next result would leave no
room for a token ("length"). A call that does not parse, names no tool or has arguments the tool
refuses, and a tool that fails, hangs or is killed by its sandbox, are results the model reads
with ``error`` set: nothing a model writes stops the run.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from colocate_rl.config import AgentConfig
from colocate_rl.resolved import Sampling
from colocate_rl.tools import ToolCall, ToolExecutor, ToolResult, parse_tool_calls
from colocate_rl.tools.chat import ChatFormat, tool_call
from colocate_rl.types import Conversation, RolloutBatch, Sample

Generate = Callable[..., RolloutBatch]
TURN_SEED_STRIDE = 1_000_033  # turn k's requests are seeded apart from turn 1's rows (seed + row)


class Turns(Protocol):
    """How a rollout's rows are produced from its ``generate``: SingleTurn or MultiTurn."""

    def over(self, generate: Generate) -> Generate: ...

    def close(self) -> None: ...


class SingleTurn:
    """One turn per row: ``over`` hands ``generate`` back as it is."""

    def over(self, generate: Generate) -> Generate:
        return generate

    def close(self) -> None:
        pass


@dataclass
class _Row:
    sample: Sample
    ids: list[int] = field(default_factory=list)  # after the prompt
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)
    routing: Optional[torch.Tensor] = None  # the sampler's experts of the row's tokens so far (R3)
    finish: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # the turn's, waiting for their results
    log: Conversation = field(default_factory=lambda: Conversation(0, 0, 0, 0.0))

    @property
    def history(self) -> list[dict]:
        """The prompt as chat messages (rendered before each tool turn)."""
        return self.sample.meta.get("messages") or [{"role": "user", "content": self.sample.prompt_text}]


class MultiTurn:
    """Conversations with tools, over any ``generate(samples, n, temperature, max_tokens, seed,
    top_p)``. ``stop_ids``: the tokens the engines stop at (the chat's turn end must be one).
    Thread-safe: eval and the rollout buffer's thread may run conversations at once."""

    def __init__(self, agent: AgentConfig, sampling: Sampling, chat: ChatFormat, executor: ToolExecutor,
                 parser: str, stop_ids: list[int]):
        if chat.end_id not in stop_ids:
            raise ValueError(f"the chat template ends a turn with {chat.end_text!r} (id {chat.end_id}), which is not "
                             f"one of the tokens generation stops at ({stop_ids}): the model's generation_config "
                             "must name it in eos_token_id")
        self.agent, self.sampling, self.chat, self.executor, self.parser = agent, sampling, chat, executor, parser
        parse_tool_calls("", parser, chat.tokenizer, chat.tools)  # a parser vLLM lacks is a ValueError now
        tok = chat.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else chat.end_id
        self._lock = threading.Lock()  # a fast tokenizer may refuse concurrent use

    def over(self, generate: Generate) -> Generate:
        def conversations(samples: list[Sample], **kwargs: Any) -> RolloutBatch:
            return self.generate(generate, samples, **kwargs)

        return conversations

    def close(self) -> None:
        self.executor.close()

    # ------------------------------------------------------------ the loop

    def generate(self, generate: Generate, samples: list[Sample], n: Optional[int] = None,
                 temperature: Optional[float] = None, max_tokens: Optional[int] = None, seed: Optional[int] = None,
                 top_p: Optional[float] = None) -> RolloutBatch:
        n = self.sampling.n if n is None else n
        budget = self.sampling.max_response_tokens if max_tokens is None else max_tokens
        same = dict(temperature=temperature, top_p=top_p)
        batch = generate(samples, n=n, max_tokens=budget, seed=seed, **same)
        rows = [_Row(s) for s in batch.samples]
        live = list(range(len(rows)))
        for turn in range(1, self.agent.max_turns + 1):
            with self._lock:
                for j, i in enumerate(live):
                    self._take(rows[i], batch, j, budget, last=turn == self.agent.max_turns)
            live = [i for i in live if not rows[i].finish]
            if not live:
                break
            self._run_tools([rows[i] for i in live], budget)
            live = [i for i in live if not rows[i].finish]
            if not live:
                break
            cont = [Sample(rows[i].sample.prompt_ids + rows[i].ids, rows[i].sample.label, rows[i].sample.prompt_text,
                           rows[i].sample.meta) for i in live]
            room = max(budget - len(rows[i].ids) for i in live)
            batch = generate(cont, n=1, max_tokens=room, seed=None if seed is None else seed + turn * TURN_SEED_STRIDE,
                             **same)
        return self._batch(rows, n)

    def _take(self, row: _Row, batch: RolloutBatch, j: int, budget: int, last: bool) -> None:
        """Row ``row`` gets the turn batch's row ``j``: its tokens (cut at the row's budget), the
        calls it made, or how it ended."""
        start = int(batch.prompt_lens[j])
        new = batch.tokens[j, start:start + int(batch.response_lens[j])].tolist()
        lps = batch.rollout_logprobs[j, start:start + len(new)].tolist()
        room = budget - len(row.ids)
        cut = len(new) > room
        new, lps = new[:room], lps[:room]
        row.ids += new
        row.mask += [True] * len(new)
        row.logprobs += lps
        row.last_turn = new
        row.log.turns += 1
        if batch.routed_experts is not None:
            row.routing = batch.routed_experts[j, :start + len(new) - 1]
        if cut or batch.finish_reasons[j] == "length":
            row.finish = "length"
            return
        if not new or new[-1] != self.chat.end_id:  # stopped on another token, or aborted: an answer
            row.finish = "stop"
            return
        text = self.chat.tokenizer.decode(new[:-1], skip_special_tokens=False)
        row.calls = parse_tool_calls(text, self.parser, self.chat.tokenizer, self.chat.tools).calls
        if not row.calls:
            row.finish = "stop"
        elif last:
            row.finish, row.calls = "turns", []

    def _run_tools(self, rows: list[_Row], budget: int) -> None:
        """Every call of this turn, all rows at once; each row's results appended as one tool turn."""
        calls = [c for r in rows for c in r.calls]
        results = iter(self.executor.run(calls))
        with self._lock:
            for r in rows:
                got = [next(results) for _ in r.calls]
                self._append(r, got, budget)

    def _append(self, row: _Row, results: list[ToolResult], budget: int) -> None:
        row.log.tool_calls += len(results)
        row.log.tool_errors += sum(r.error for r in results)
        row.log.tool_seconds += sum(r.seconds for r in results)
        parsed = [tool_call(c.name, c.arguments) for c in row.calls if not c.error]
        ids = self.chat.tool_turn_ids(row.history, parsed, [self._cut(r.text) for r in results])
        row.calls = []
        if len(row.ids) + len(ids) >= budget:  # no room left for the answer
            row.finish = "length"
            return
        row.ids += ids
        row.mask += [False] * len(ids)
        row.logprobs += [0.0] * len(ids)

    def _cut(self, text: str) -> str:
        """A result of at most rollout.agent.max_result_tokens tokens: a longer one keeps its head and
        its tail (where a traceback's error and the sandbox's note are), a note between them."""
        limit, tok = self.agent.max_result_tokens, self.chat.tokenizer
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) <= limit:
            return text
        head, tail = ids[:limit // 2], ids[len(ids) - (limit - limit // 2):]
        return (tok.decode(head) + f"\n[cut: {len(ids) - limit} of the result's {len(ids)} tokens]\n"
                + tok.decode(tail))

    def _batch(self, rows: list[_Row], n: int) -> RolloutBatch:
        tok = self.chat.tokenizer
        routed = [r.routing for r in rows] if rows and rows[0].routing is not None else None
        out = RolloutBatch.from_rows(
            [r.sample.prompt_ids for r in rows], [r.ids for r in rows], [r.sample for r in rows], self.pad_id,
            response_logprobs=[r.logprobs for r in rows], finish_reasons=[r.finish for r in rows],
            responses=[tok.decode(r.last_turn, skip_special_tokens=True) for r in rows], n=n, routed_experts=routed,
            response_masks=[r.mask for r in rows])
        out.conversations = [r.log for r in rows]
        return out


def conversation_metrics(batch: RolloutBatch) -> dict[str, float]:
    """A multi-turn batch's step metrics ({} for single-turn rows): turns, tool calls and errors per
    sample, the calls' seconds summed, the share of rows stopped by rollout.agent.max_turns (those
    stopped by length are rollout/truncated)."""
    logs = batch.conversations
    if not logs:
        return {}
    b = len(logs)
    return {"rollout/turns": sum(c.turns for c in logs) / b,
            "rollout/tool_calls": sum(c.tool_calls for c in logs) / b,
            "rollout/tool_errors": sum(c.tool_errors for c in logs) / b,
            "rollout/tool_s": sum(c.tool_seconds for c in logs),
            "rollout/truncated_turns": sum(f == "turns" for f in batch.finish_reasons) / b}
