"""Multi-turn rollouts with tool calls (rollout.agent) through the real engine on CPU: a tiny
random-weight model whose turns are scripted by a vLLM logits processor (scripted_policy.py), so
that vLLM really samples the calls a policy might write, good and bad, and the real parser, tools
and sandbox take them.

- bad input never stops the run: malformed JSON, an unknown tool, wrong arguments, and python
  programs that hang, print without end, reach for the network, fork without end or allocate too
  much are results the model reads, counted as errors; every such sample goes on to its next turn
  and the step trains;
- one row per conversation: the policy's turns on loss_mask with the sampler's logprobs, the tool
  turns off it, the ids those of the whole conversation rendered at once, and the actor's one
  forward over it matching the sampler on the model's own turn;
- the same in disaggregated mode (engines in Ray actors, the conversations in the buffer's thread);
- a run SIGKILLed mid-run and resumed from its checkpoint gives the same metrics, step for step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from colocate_rl import loop
from colocate_rl.metrics import read
from colocate_rl.models.registry import load_tokenizer
from colocate_rl.session import start_session

from scripted_policy import SCRIPT, write_script  # noqa: E402 - same folder
from test_checkpoint import ROOT, comparable, finish, start  # noqa: E402
from test_loop import planned, tiny_cfg  # noqa: E402

SHAPE = "qwen3-tiny-2k"  # room for the system turn that lists the tools
PROCESSOR = '{logits_processors: ["scripted_policy:ScriptedPolicy"]}'


def call(name: str, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def python(code: str) -> str:
    return call("python", {"code": code})


# marker (the user's prompt) -> the policy's turns; what the tool result must say
CASES = {
    "7001": ([call("calculator", {"expression": "6*7"}), "42"], "42"),
    "7002": (['<tool_call>\n{"name": "calculator", "arguments": {"expression": }}\n</tool_call>', "oops"],
             "the tool call does not parse"),
    "7003": ([call("search", {"q": "x"}), "none"], "there is no tool 'search'"),
    "7004": ([call("calculator", {"expr": "6*7"}), "bad"], "calculator: bad arguments"),
    "7005": ([python("import time\ntime.sleep(3600)"), "hung"], "[stopped: no result within 20 s]"),
    "7006": ([python("while True:\n    print('x' * 4096)"), "flood"], "[stopped: the output passed 8192 bytes]"),
    "7007": ([python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)"), "net"], "[exit code 1]"),
    # Each process that cannot fork says why in one write, so any cut of the result keeps it.
    "7008": ([python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError as e:\n"
                     "        raise SystemExit(e.strerror)"), "forks"], "Resource temporarily unavailable"),
    "7012": ([python("x = bytearray(10 ** 10)"), "alloc"], "MemoryError"),
}
ALWAYS_CALLS = "7009"  # calls a tool in every turn: stopped by rollout.agent.max_turns
OWN = "7010"  # a scripted call, then the model's own turn (its sampler logprobs are the model's)
LONG = "7011"  # a scripted call, then an answer longer than the room left: stopped by length
LONG_ANSWER = "1234567890" * 60  # one token a digit: 600 tokens


SCRIPTED = {m: turns for m, (turns, _) in CASES.items()} | {
    ALWAYS_CALLS: [call("calculator", {"expression": "1+1"})],
    OWN: [call("calculator", {"expression": "6*7"}), None],
    LONG: [call("calculator", {"expression": "6*7"}), LONG_ANSWER]}


def data_file(tmp: Path, markers) -> Path:
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": m, "label": "42"}) + "\n" for m in markers))
    return path


@pytest.fixture
def script_env(monkeypatch):
    """scripted(tmp, model, cases): the script the engines read, and the folder of scripted_policy.py
    on PYTHONPATH (engines in Ray actors import it by name)."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))

    def scripted(tmp: Path, model: Path, cases: dict) -> None:
        monkeypatch.setenv(SCRIPT, str(write_script(tmp / "script.json", load_tokenizer(model, "model.path"), cases)))

    return scripted


def agent_cfg(tmp_path, model: Path, markers, **over):
    return tiny_cfg(tmp_path, lambda _: model, **{
        "data.train": str(data_file(tmp_path, markers)), "data.apply_chat_template": "true",
        "data.max_prompt_tokens": "1024", "data.prompts_per_step": str(len(markers)), "rollout.n": "2",
        "rollout.max_response_tokens": "512", "rollout.agent.enabled": "true", "rollout.agent.max_turns": "3",
        "rollout.agent.max_result_tokens": "128", "rollout.engine_kwargs": PROCESSOR, "tools.names": "[calculator,python]",
        # 20 s: only the hanging call may meet the wall clock, also on a loaded machine where the
        # others' interpreters start slowly (the flood must be stopped by its output cap).
        "tools.timeout_s": "20", "tools.max_concurrency": "4", "reward.name": "arithmetic", **over})


def marker_of(batch, i: int) -> str:
    return batch.samples[i].meta["messages"][-1]["content"]


def check_rows(batch, tok, chat, cases: dict) -> list[int]:
    """Each row against its script: what the policy wrote (on the mask, the sampler's logprobs),
    what the template and tools wrote (off it, logprob 0), how it ended. Returns the OWN rows."""
    assert batch.size == 2 * len(cases) and batch.conversations is not None
    own = []
    for i in range(batch.size):
        marker = marker_of(batch, i)
        conv, start, end = batch.conversations[i], int(batch.prompt_lens[i]), int(batch.attention_mask[i].sum())
        mask = batch.loss_mask[i, start:end]
        policy = tok.decode(batch.tokens[i, start:end][mask].tolist())
        template = tok.decode(batch.tokens[i, start:end][~mask].tolist())
        assert not batch.rollout_logprobs[i, start:end][~mask].any()  # 0 off the mask
        assert not batch.loss_mask[i, :start].any() and not batch.loss_mask[i, end:].any()
        if marker == ALWAYS_CALLS:
            assert batch.finish_reasons[i] == "turns" and conv.turns == 3 and conv.tool_calls == 2
            assert template.count("<tool_response>") == 2  # the last turn's call is not run
            continue
        if marker in (OWN, LONG):
            first = tok.encode(cases[marker][0], add_special_tokens=False) + [chat.end_id]
            assert batch.tokens[i, start:start + len(first)].tolist() == first and conv.tool_calls >= 1
            assert not batch.rollout_logprobs[i, start:start + len(first)].any()  # forced: one token left
            if marker == OWN:
                own.append(i)
            else:
                assert batch.finish_reasons[i] == "length" and bool(batch.truncated[i]) and conv.turns == 2
                assert end - start == 512 and policy.startswith(cases[LONG][0] + "<|im_end|>1234567890")
            continue
        turns, says = CASES[marker]
        # Each sample went on to its second turn after its call's result, whatever the call did.
        assert batch.finish_reasons[i] == "stop" and conv.turns == 2 and conv.tool_calls == 1, (marker, conv)
        assert policy == turns[0] + "<|im_end|>" + turns[1] + "<|im_end|>", marker
        assert says in template and template.count("<tool_response>") == 1, (marker, template)
        assert conv.tool_errors == (marker != "7001") and batch.responses[i] == turns[1]
    return own


def check_whole(batch, tok, chat) -> None:
    """The ids of a conversation are those of the conversation rendered whole."""
    good = next(i for i in range(batch.size) if marker_of(batch, i) == "7001")
    whole = chat.render([*batch.samples[good].meta["messages"],
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": "calculator",
                                                               "arguments": {"expression": "6*7"}}}]},
                         {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}],
                        add_generation_prompt=False)
    n = int(batch.attention_mask[good].sum())
    assert batch.tokens[good, :n].tolist() == tok.encode(whole, add_special_tokens=False)[:n]


def check_rescored(s, batch, own: list[int], tok) -> None:
    """The actor scores each conversation in one forward; on the model's own turn (after the
    scripted call and its result) its logprobs are the sampler's, token for token."""
    lp = s.actor.compute_logprobs(batch)
    first = len(tok.encode(SCRIPTED[OWN][0], add_special_tokens=False)) + 1
    assert own
    for i in own:
        second = batch.loss_mask[i].clone()
        second[:int(batch.prompt_lens[i]) + first] = False
        assert second.any() and (batch.rollout_logprobs[i][second] < 0).all()
        assert (lp[i][second] - batch.rollout_logprobs[i][second]).abs().max() < 1e-4


def check_step_metrics(m: dict, cases: dict) -> None:
    """The step's tool metrics: every scripted row exactly, the OWN rows' second turn (the model's)
    within its bounds (a third turn and a second call, maybe a failed one)."""
    b, errors = 2 * len(cases), sum(m != "7001" for m in CASES.keys() & cases.keys())
    fixed = {"turns": 0, "calls": 0}
    for marker in cases:
        fixed["turns"] += 2 * (3 if marker == ALWAYS_CALLS else 2)
        fixed["calls"] += 2 * (2 if marker == ALWAYS_CALLS else 1)
    assert m["update_skipped"] == 0 and torch.isfinite(torch.tensor(m["loss"]))
    assert fixed["turns"] / b <= m["rollout/turns"] <= (fixed["turns"] + 2) / b
    assert fixed["calls"] / b <= m["rollout/tool_calls"] <= (fixed["calls"] + 2) / b
    assert 2 * errors / b <= m["rollout/tool_errors"] <= (2 * errors + 2) / b
    assert round(m["rollout/truncated_turns"] * b) in (2, 3, 4)  # ALWAYS_CALLS, maybe OWN
    assert round(m["rollout/truncated"] * b) >= 2 * (LONG in cases)
    assert m["rollout/tool_s"] > 0


@pytest.mark.slow  # engine start, and the hanging program's 3 s, twice
def test_bad_calls_and_hanging_tools_never_stop_the_run(tmp_path, tiny_model, script_env):
    model = tiny_model(SHAPE)
    script_env(tmp_path, model, SCRIPTED)
    s = start_session(*planned(agent_cfg(tmp_path, model, list(SCRIPTED))))
    try:
        tok, chat = s.tokenizer, s.turns.chat
        batch = s.buffer.generate(s.train_samples, seed=11)
        own = check_rows(batch, tok, chat, SCRIPTED)
        assert 3.0 <= max(c.tool_seconds for c in batch.conversations) < 3 * 60  # the hang, stopped
        flood = next(i for i in range(batch.size) if marker_of(batch, i) == "7006")
        assert "[cut: " in tok.decode(batch.tokens[flood].tolist())
        check_whole(batch, tok, chat)
        check_rescored(s, batch, own, tok)
        # The step trains on the same prompts (sampled again with the step's seed) and reports the tools.
        m = loop.step(s)
        check_step_metrics(m, SCRIPTED)
        assert m["rollout/tool_s"] >= 6.0  # the two hanging calls
    finally:
        s.close()


@pytest.mark.slow  # Ray, an actor process and an engine process
def test_disaggregated_mode_runs_the_same_conversations(tmp_path, tiny_model, script_env):
    """The engines in Ray actors behind the router, the conversations produced in the buffer's
    thread: the same rows, the actor's re-score of them, and a step."""
    import ray

    model = tiny_model(SHAPE)
    cases = {m: SCRIPTED[m] for m in ("7001", "7002", "7003", "7004", "7007", ALWAYS_CALLS, OWN)}
    script_env(tmp_path, model, cases)
    s = start_session(*planned(agent_cfg(tmp_path, model, list(cases), **{
        "placement.mode": "disaggregated", "rollout.num_engines": "1"})))
    try:
        tok, chat = s.tokenizer, s.turns.chat
        batch = s.buffer.generate(s.train_samples, seed=11)
        own = check_rows(batch, tok, chat, cases)
        check_whole(batch, tok, chat)
        check_rescored(s, batch, own, tok)
        m = loop.step(s, last=True)
        check_step_metrics(m, cases)
        assert m["sync/bytes"] > 0 and m["rollout/engine_restarts"] == 0
    finally:
        s.close()
        ray.shutdown()


def recipe(model: Path, run_dir: Path, name: str, data: Path, **over) -> list[str]:
    import sys

    args = {"model.path": str(model), "model.synthesize": "''", "logging.run_dir": str(run_dir),
            "logging.run_name": name, "logging.wandb_mode": "disabled", "logging.progress": "false",
            "logging.plot": "false", "data.train": str(data), "data.prompts_per_step": "4", "rollout.n": "4",
            "data.max_prompt_tokens": "512", "rollout.max_response_tokens": "160", "tools.names": "[calculator]",
            "rollout.engine_kwargs": PROCESSOR, "sft.steps": "0", "steps": "4", "eval.every": "2", "eval.sets": "[]",
            "checkpoint.every": "2", "reward.name": "fault_rewards:even_length", **over}
    return [sys.executable, str(ROOT / "recipes/qwen3_grpo.py"), "preset=agent-tiny",
            *(f"{k}={v}" for k, v in args.items())]


@pytest.mark.slow  # two runs of the recipe command, one of them twice
def test_a_multi_turn_run_resumed_mid_run_gives_the_same_metrics(tmp_path, tiny_model):
    """The first turn is scripted (a calculator call), the answer after its result is the model's own,
    so rewards vary and every step changes the weights."""
    model = tiny_model(SHAPE)
    cases = {f"80{i}": [call("calculator", {"expression": f"{i}*7"}), None] for i in range(4)}
    env = {SCRIPT: str(write_script(tmp_path / "script.json", load_tokenizer(model, "model.path"), cases))}
    data = data_file(tmp_path, cases)
    logs = {n: tmp_path / f"{n}.log" for n in ("full", "killed")}
    full = start(recipe(model, tmp_path, "full", data), logs["full"], **env)
    killed = start(recipe(model, tmp_path, "killed", data, **{"supervise.max_restarts": "1"}), logs["killed"],
                   COLOCATE_RL_FAULT="kill@train:3", **env)
    finish(full, logs["full"])
    out = finish(killed, logs["killed"])
    assert "resumed from" in out and "step_00000002 at step 2" in out, out[-3000:]
    a, b = comparable(read(tmp_path / "full/metrics.jsonl")), comparable(read(tmp_path / "killed/metrics.jsonl"))
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert a[step] == b[step], f"step {step}: {set(a[step].items()) ^ set(b[step].items())}"
        assert a[step]["rollout/turns"] >= 2 and a[step]["rollout/tool_calls"] >= 1 and a[step]["grad_norm"] > 0
