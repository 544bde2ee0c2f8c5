"""Multi-turn rollouts with tool calls (rollout.agent) through the real engine on CPU: a tiny
random-weight model whose turns are scripted by a vLLM logits processor (scripted_policy.py), so
that vLLM really samples the calls a policy might write, good and bad, and the real parser, tools
and sandbox take them.

- bad input never stops the run: malformed JSON, an unknown tool, wrong arguments, and python
  programs that hang, print without end, reach for the network or fork without end are results the
  model reads, counted as errors; every such sample goes on to its next turn and the step trains;
- one row per conversation: the policy's turns on loss_mask with the sampler's logprobs, the tool
  turns off it, the ids those of the whole conversation rendered at once;
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
    "7005": ([python("while True:\n    pass"), "hung"], "[stopped: no result within 3 s]"),
    "7006": ([python("while True:\n    print('x' * 4096)"), "flood"], "[stopped: the output passed 8192 bytes]"),
    "7007": ([python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)"), "net"], "[exit code 1]"),
    "7008": ([python("import os\nwhile True:\n    os.fork()"), "forks"], "Resource temporarily unavailable"),
}
ALWAYS_CALLS = "7009"  # calls a tool in every turn: stopped by rollout.agent.max_turns
OWN = "7010"  # a scripted call, then the model's own turn (its sampler logprobs are the model's)
LONG = "7011"  # a scripted call, then an answer longer than the room left: stopped by length
LONG_ANSWER = "1234567890" * 60  # one token a digit: 600 tokens


def data_file(tmp: Path, markers) -> Path:
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": m, "label": "42"}) + "\n" for m in markers))
    return path


def scripted(tmp: Path, model: Path, cases: dict) -> None:
    os.environ[SCRIPT] = str(write_script(tmp / "script.json", load_tokenizer(model, "model.path"), cases))


@pytest.fixture
def script_env():
    yield
    os.environ.pop(SCRIPT, None)


def agent_cfg(tmp_path, model: Path, markers, **over):
    return tiny_cfg(tmp_path, lambda _: model, **{
        "data.train": str(data_file(tmp_path, markers)), "data.apply_chat_template": "true",
        "data.max_prompt_tokens": "1024", "data.prompts_per_step": str(len(markers)), "rollout.n": "2",
        "rollout.max_response_tokens": "512", "rollout.agent.enabled": "true", "rollout.agent.max_turns": "3",
        "rollout.agent.max_result_tokens": "128", "rollout.engine_kwargs": PROCESSOR, "tools.names": "[calculator,python]",
        "tools.timeout_s": "3", "tools.max_concurrency": "4", "reward.name": "arithmetic", **over})


@pytest.mark.slow  # engine start, and the hanging program's 3 s, twice
def test_bad_calls_and_hanging_tools_never_stop_the_run(tmp_path, tiny_model, script_env):
    model = tiny_model(SHAPE)
    cases = {m: turns for m, (turns, _) in CASES.items()}
    cases[ALWAYS_CALLS] = [call("calculator", {"expression": "1+1"})]
    cases[OWN] = [call("calculator", {"expression": "6*7"}), None]
    cases[LONG] = [call("calculator", {"expression": "6*7"}), LONG_ANSWER]
    scripted(tmp_path, model, cases)
    s = start_session(*planned(agent_cfg(tmp_path, model, [*CASES, ALWAYS_CALLS, OWN, LONG])))
    try:
        tok, chat = s.tokenizer, s.turns.chat
        batch = s.buffer.generate(s.train_samples, seed=11)
        assert batch.size == 2 * len(cases) and batch.conversations is not None
        own = []
        for i in range(batch.size):
            marker = batch.samples[i].meta["messages"][-1]["content"]
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
                own.append(i)
                if marker == LONG:
                    assert batch.finish_reasons[i] == "length" and bool(batch.truncated[i]) and conv.turns == 2
                    assert end - start == 512 and policy.startswith(cases[LONG][0] + "<|im_end|>1234567890")
                continue
            turns, says = CASES[marker]
            # Each sample went on to its second turn after its call's result, whatever the call did.
            assert batch.finish_reasons[i] == "stop" and conv.turns == 2 and conv.tool_calls == 1, (marker, conv)
            assert policy == turns[0] + "<|im_end|>" + turns[1] + "<|im_end|>", marker
            assert says in template and template.count("<tool_response>") == 1, (marker, template)
            assert conv.tool_errors == (marker != "7001") and batch.responses[i] == turns[1]
        assert 3.0 <= max(c.tool_seconds for c in batch.conversations) < 3 * 60  # the hang, stopped
        assert "[cut: " in tok.decode(batch.tokens[batch.samples.index(
            next(x for x in batch.samples if x.meta["messages"][-1]["content"] == "7006"))].tolist())

        # The ids of a conversation are those of the conversation rendered whole.
        good = batch.samples.index(next(x for x in batch.samples if x.meta["messages"][-1]["content"] == "7001"))
        whole = chat.render([*batch.samples[good].meta["messages"],
                             {"role": "assistant", "content": "", "tool_calls": [
                                 {"type": "function", "function": {"name": "calculator",
                                                                   "arguments": {"expression": "6*7"}}}]},
                             {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}],
                            add_generation_prompt=False)
        n = int(batch.attention_mask[good].sum())
        assert batch.tokens[good, :n].tolist() == tok.encode(whole, add_special_tokens=False)[:n]

        # The actor scores each conversation in one forward; on the model's own turn (after the
        # scripted call and its result) its logprobs are the sampler's, token for token. The scripted
        # turn's are 0 in the sampler (one token left to sample) and the model's own below 0.
        lp = s.actor.compute_logprobs(batch)
        for i in own:
            start, end = int(batch.prompt_lens[i]), int(batch.attention_mask[i].sum())
            first = len(tok.encode(cases[OWN][0], add_special_tokens=False)) + 1
            second = batch.loss_mask[i].clone()
            second[:start + first] = False
            assert not batch.rollout_logprobs[i, start:start + first].any()
            if batch.samples[i].meta["messages"][-1]["content"] == OWN:
                assert second.any() and (batch.rollout_logprobs[i][second] < 0).all()
                assert (lp[i][second] - batch.rollout_logprobs[i][second]).abs().max() < 1e-4

        # The step trains on the same prompts (sampled again with the step's seed) and reports the tools.
        m = loop.step(s)
        b = batch.size  # the OWN rows' second turn is the model's: 2 or 3 turns, 1 or 2 calls
        assert m["update_skipped"] == 0 and torch.isfinite(torch.tensor(m["loss"]))
        turns = (2 * 2 * len(CASES) + 2 * 3 + 2 * 2) / b
        assert turns + 2 * 2 / b <= m["rollout/turns"] <= turns + 2 * 3 / b
        calls = (2 * len(CASES) + 2 * 2 + 2 * 1) / b
        assert calls + 2 / b <= m["rollout/tool_calls"] <= calls + 2 * 2 / b
        assert (2 * (len(CASES) - 1)) / b <= m["rollout/tool_errors"] <= (2 * (len(CASES) - 1) + 2) / b
        assert round(m["rollout/truncated_turns"] * b) in (2, 3, 4) and m["rollout/tool_s"] >= 6.0
        assert round(m["rollout/truncated"] * b) >= 2  # the LONG rows
    finally:
        s.close()


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
