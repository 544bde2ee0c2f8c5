"""The multi-turn loop (rollout/agent.py) over a scripted ``generate`` (the seam an engine, the
router or the eval plugs into; the real engines run it in tests/integration/test_agent.py): each
turn's calls, across every row still going, are one ToolExecutor.run on the executor's threads;
rows end by answer, by rollout.agent.max_turns or by length; the metrics count what happened."""

from __future__ import annotations

import json
import threading

import pytest

from colocate_rl.config import AgentConfig, ToolsConfig
from colocate_rl.models.tiny import build_tokenizer
from colocate_rl.resolved import Sampling
from colocate_rl.rollout.agent import MultiTurn, conversation_metrics
from colocate_rl.tools import Tool, ToolExecutor, ToolResult, make_tools
from colocate_rl.tools.chat import ChatFormat
from colocate_rl.types import RolloutBatch, Sample

LOGPROB = -0.25  # what the scripted sampler reports for every token it writes


def call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Recording(ToolExecutor):
    """The executor, noting how many calls each run took and on which threads they ran."""

    def __init__(self, parties: int):
        barrier = threading.Barrier(parties, timeout=120)
        self.threads: list[str] = []

        def meet(args: dict) -> ToolResult:
            self.threads.append(threading.current_thread().name)
            barrier.wait()  # returns only once `parties` calls are running at the same time
            return ToolResult("met")

        rendezvous = Tool("rendezvous", "Waits for the others.", {"type": "object", "properties": {}}, meet)
        cfg = ToolsConfig(names=["calculator"], max_concurrency=parties)
        super().__init__(cfg, {"rendezvous": rendezvous, **make_tools(cfg)})
        self.batches: list[int] = []

    def run(self, calls):
        self.batches.append(len(calls))
        return super().run(calls)


def scripted_generate(tok, script: dict[str, list[str]]):
    """generate(samples, n, ...): each row writes its prompt's script turn k (k: the tool results
    in its prompt so far), closed by the end token, or cut at max_tokens."""
    mark = tok.convert_tokens_to_ids("<tool_response>")

    def generate(samples, n=1, max_tokens=None, **_):
        rows = [s for s in samples for _ in range(n)]
        out, reasons = [], []
        for s in rows:
            turns = script[s.meta["messages"][-1]["content"]]
            ids = tok.encode(turns[min(s.prompt_ids.count(mark), len(turns) - 1)], add_special_tokens=False)
            ids.append(tok.convert_tokens_to_ids("<|im_end|>"))
            reasons.append("length" if len(ids) > max_tokens else "stop")
            out.append(ids[:max_tokens])
        return RolloutBatch.from_rows([s.prompt_ids for s in rows], out, rows, tok.pad_token_id,
                                      response_logprobs=[[LOGPROB] * len(r) for r in out], finish_reasons=reasons, n=n)

    return generate


def setup(script: dict[str, list[str]], parties: int, max_turns: int = 3, budget: int = 400):
    tok = build_tokenizer()
    executor = Recording(parties)
    chat = ChatFormat(tok, executor.specs())
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, top_k=0, max_response_tokens=budget, seed=0, seed_each_step=False)
    agent = MultiTurn(AgentConfig(enabled=True, max_turns=max_turns), sampling, chat, executor, "hermes",
                      [chat.end_id])
    samples = []
    for marker in script:
        messages = [{"role": "user", "content": marker}]
        text, ids = chat.prompt_ids(messages)
        samples.append(Sample(ids, "5", text, {"messages": messages}))
    return tok, executor, agent.over(scripted_generate(tok, script)), samples


def test_a_turns_calls_run_at_once_across_rows_off_the_calling_thread():
    script = {"a": [call("rendezvous", {}), call("calculator", {"expression": "2+3"}), "5"],
              "b": [call("rendezvous", {}), "done"]}
    tok, executor, generate, samples = setup(script, parties=4)
    batch = generate(samples)
    # Turn 1: the four rows' calls in one run (the barrier of four passed: they ran at once); turn 2:
    # the two rows of "a" still calling. On the executor's threads, not the caller's.
    assert executor.batches == [4, 2]
    assert len(executor.threads) == 4 and all(t.startswith("tool") for t in executor.threads)
    assert [c.turns for c in batch.conversations] == [3, 3, 2, 2]
    assert [c.tool_calls for c in batch.conversations] == [2, 2, 1, 1]
    assert batch.finish_reasons == ["stop"] * 4 and batch.responses == ["5", "5", "done", "done"]
    for i in range(4):
        start, end = int(batch.prompt_lens[i]), int(batch.attention_mask[i].sum())
        mask = batch.loss_mask[i, start:end]
        written = "<|im_end|>".join(script["ab"[i // 2]]) + "<|im_end|>"
        assert tok.decode(batch.tokens[i, start:end][mask].tolist()) == written
        assert (batch.rollout_logprobs[i, start:end][mask] == LOGPROB).all()
        assert not batch.rollout_logprobs[i, start:end][~mask].any()
        results = tok.decode(batch.tokens[i, start:end][~mask].tolist())
        assert results.count("<tool_response>\nmet\n</tool_response>") == 1
        assert results.count("<tool_response>\n5\n</tool_response>") == (i < 2)
    assert conversation_metrics(batch) == {"rollout/turns": 2.5, "rollout/tool_calls": 1.5,
                                           "rollout/tool_errors": 0.0, "rollout/truncated_turns": 0.0,
                                           "rollout/tool_s": pytest.approx(sum(c.tool_seconds
                                                                               for c in batch.conversations))}


def test_rows_end_by_turns_and_by_length_and_bad_calls_are_counted():
    script = {"always": [call("calculator", {"expression": "1+1"})],  # calls in every turn
              "bad": ['<tool_call>\n{"name": "calculator", "arguments": }\n</tool_call>', "ok"],
              "long": [call("calculator", {"expression": "1+1"}), "7" * 500]}
    tok, executor, generate, samples = setup(script, parties=1, max_turns=2, budget=300)
    batch = generate(samples)
    # The last turn's calls are not run: turn 1 ran every row's call, turn 2 none.
    assert executor.batches == [6]
    assert batch.finish_reasons == ["turns", "turns", "stop", "stop", "length", "length"]
    assert [c.tool_calls for c in batch.conversations] == [1, 1, 1, 1, 1, 1]
    assert [c.tool_errors for c in batch.conversations] == [0, 0, 1, 1, 0, 0]
    assert batch.truncated.tolist() == [False] * 4 + [True] * 2
    assert (batch.response_lens[4:] == 300).all() and (batch.response_lens[:4] < 300).all()
    m = conversation_metrics(batch)
    assert m["rollout/truncated_turns"] == pytest.approx(2 / 6) and m["rollout/tool_errors"] == pytest.approx(2 / 6)
