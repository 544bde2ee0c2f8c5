"""Prompt datasets from files (both schemas), the synthetic arithmetic task, and the resumable sampler."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pytest

from colocate_rl.config import ArithmeticConfig, ConfigError, DataConfig
from colocate_rl.data import PromptSampler, arithmetic_problems, load_prompts

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SLIME = str(FIXTURES / "prompts_slime.jsonl")
MALFORMED = str(FIXTURES / "prompts_malformed.jsonl")

VERL_ROWS = [
    {
        "data_source": "toy",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {a}+{b}?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"index": i},
    }
    for i, (a, b) in enumerate([(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2)])
]


@pytest.fixture(autouse=True)
def _run_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATE_RL_CACHE", str(tmp_path / "cache"))
    datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def tokenizer():
    from colocate_rl.models.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture
def verl_parquet(tmp_path) -> str:
    path = tmp_path / "prompts_verl.parquet"
    datasets.Dataset.from_list(VERL_ROWS).to_parquet(str(path))
    return str(path)


def test_verl_parquet_auto_detected_with_chat_template(verl_parquet, tokenizer):
    ds = load_prompts(DataConfig(train=verl_parquet), tokenizer)
    assert len(ds) == 6 and ds.skipped == {}
    s = ds[1]
    assert s.label == "7"
    want = tokenizer.apply_chat_template(VERL_ROWS[1]["prompt"], add_generation_prompt=True, tokenize=False)
    assert s.prompt_text == want
    assert "Be brief." in s.prompt_text and s.prompt_text.rstrip().endswith("assistant")
    assert s.prompt_ids == tokenizer(s.prompt_text, add_special_tokens=False)["input_ids"]
    assert s.meta == {"source": verl_parquet, "row": 1, "data_source": "toy"}


def test_slime_jsonl_auto_detected(tokenizer):
    ds = load_prompts(DataConfig(train=SLIME), tokenizer)
    assert [s.label for s in ds.samples] == ["4", "\\frac{1}{2}", "7", "42", "4", "21"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ds[0].prompt_text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ds[0].prompt_text != "What is 2+2?"


def test_raw_prompt_without_chat_template(tokenizer, verl_parquet):
    cfg = DataConfig(train=SLIME, apply_chat_template=False)
    s = load_prompts(cfg, tokenizer)[2]
    assert s.prompt_text == "What is 3+4?"
    assert tokenizer.decode(s.prompt_ids) == "What is 3+4?"
    with pytest.raises(ValueError, match="prompts are chat messages but data.apply_chat_template=false"):
        load_prompts(DataConfig(train=verl_parquet, apply_chat_template=False), tokenizer)


def test_explicit_keys_and_format(tmp_path, tokenizer):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(3)))
    with pytest.raises(ValueError, match=r"qa.jsonl: cannot tell the format from its columns \['question', 'answer'\]"):
        load_prompts(DataConfig(train=str(path)), tokenizer)
    ds = load_prompts(DataConfig(train=str(path), prompt_key="question", label_key="answer"), tokenizer)
    assert [s.label for s in ds.samples] == ["1", "2", "3"]  # numeric labels become strings
    with pytest.raises(ValueError, match="qa.jsonl: no column 'prompt'"):
        load_prompts(DataConfig(train=str(path), format="slime"), tokenizer)


def test_malformed_row_names_file_and_row(tokenizer):
    """The row is counted from 1, as the file's lines are (the fixture's second line lacks its label)."""
    with pytest.raises(ConfigError) as e:
        load_prompts(DataConfig(train=MALFORMED), tokenizer)
    assert str(e.value) == f"{MALFORMED} row 2: 'label' is missing or null (data.on_bad_row=skip skips such rows)"


def test_skip_mode_counts_bad_rows(tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        ds = load_prompts(DataConfig(train=MALFORMED, on_bad_row="skip"), tokenizer)
    assert [s.meta["row"] for s in ds.samples] == [0, 4]
    assert ds.skipped == {"malformed": 3}
    assert "skipped 3 of 5 rows (malformed 3)" in caplog.text


def test_too_long_prompt(tokenizer):
    cfg = DataConfig(train=SLIME, max_prompt_tokens=20)
    lens = [len(s.prompt_ids) for s in load_prompts(DataConfig(train=SLIME), tokenizer).samples]
    first_long = next(i for i, n in enumerate(lens) if n > 20)
    with pytest.raises(ConfigError, match=rf"prompts_slime.jsonl row {first_long + 1}: 'prompt' has {lens[first_long]} "
                                          r"tokens > data.max_prompt_tokens=20"):
        load_prompts(cfg, tokenizer)
    cfg.on_bad_row = "skip"
    ds = load_prompts(cfg, tokenizer)
    assert ds.skipped == {"too_long": sum(n > 20 for n in lens)} and len(ds) == sum(n <= 20 for n in lens) > 0


def test_missing_file_and_unreadable_json(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="data file not found: .*nope.jsonl"):
        load_prompts(DataConfig(train=str(tmp_path / "nope.jsonl")), tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "label": "1"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: cannot be read as json: line 2 is not JSON \(Expecting value"):
        load_prompts(DataConfig(train=str(bad)), tokenizer)


def test_hub_id_goes_to_load_dataset_with_the_split(monkeypatch, tokenizer):
    calls = []

    def fake_load_dataset(path, split=None, **kw):
        calls.append((path, split))
        return datasets.Dataset.from_list([{"prompt": "1+1=", "label": "2"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_prompts(DataConfig(train="someorg/some-math", split="test"), tokenizer)
    assert calls == [("someorg/some-math", "test")] and ds[0].label == "2"
    load_prompts(DataConfig(train="someorg/some-math"), tokenizer, split="validation")
    assert calls[-1] == ("someorg/some-math", "validation")


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_is_deterministic_and_disjoint():
    cfg = ArithmeticConfig(num_train=300, num_eval=40, max_operand=20, ops="+-*", seed=7)
    train, evals = arithmetic_problems(cfg, "train"), arithmetic_problems(cfg, "eval")
    assert train == arithmetic_problems(cfg, "train") and evals == arithmetic_problems(cfg, "eval")
    assert len(train) == 300 and len(evals) == len(set(evals)) == 40
    assert not {p for p, _ in train} & {p for p, _ in evals}
    assert all(str(eval(p[:-1])) == label for p, label in train + evals)  # noqa: S307 - our own digits
    assert {p[-1] for p, _ in train} == {"="} and {op for p, _ in train for op in "+-*" if op in p} == set("+-*")
    assert arithmetic_problems(ArithmeticConfig(seed=8, num_train=300, max_operand=20, ops="+-*"), "train") != train


def test_arithmetic_small_space_holds_out_a_quarter(tokenizer):
    cfg = ArithmeticConfig(num_train=500, num_eval=128, max_operand=9, ops="+")  # 100 distinct problems
    evals, train = arithmetic_problems(cfg, "eval"), arithmetic_problems(cfg, "train")
    assert len(evals) == 25 and len({p for p, _ in train}) == 75
    data = DataConfig(train="arithmetic", apply_chat_template=False, arithmetic=cfg)
    ds = load_prompts(data, tokenizer, source="arithmetic:eval")
    assert [(s.prompt_text, s.label) for s in ds] == evals
    assert [s.label for s in load_prompts(data, tokenizer, source="arithmetic", split="eval")] == [a for _, a in evals]
    assert len(load_prompts(data, tokenizer)) == 500


# ---------------------------------------------------------------- sampler


def test_sampler_epochs_are_seeded_permutations():
    data = list(range(10))
    s = PromptSampler(data, batch_size=5, seed=3)
    e0 = next(s) + next(s)
    e1 = next(s) + next(s)
    assert sorted(e0) == sorted(e1) == data and e0 != e1
    assert s.state_dict() == {"epoch": 2, "index": 0}
    assert next(PromptSampler(data, 5, seed=3)) == e0[:5]
    assert next(PromptSampler(data, 5, seed=4)) != e0[:5]


def test_sampler_resume_gives_identical_batches():
    data = list(range(7))  # batches of 3 run across epoch ends
    s = PromptSampler(data, batch_size=3, seed=0)
    for _ in range(4):
        next(s)
    state = s.state_dict()
    assert state == {"epoch": 1, "index": 5}
    expected = [next(s) for _ in range(6)]
    resumed = PromptSampler(data, batch_size=3, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a round trip through a checkpoint
    assert [resumed.next_batch() for _ in range(6)] == expected
    with pytest.raises(ValueError, match="does not fit a dataset of 7 prompts"):
        resumed.load_state_dict({"epoch": 0, "index": 9})


def test_math_eval_set_schema_and_an_eval_set_without_answers(tmp_path, tokenizer):
    """AIME / MATH-style files ({"problem", "answer"}) are read as they are; a set without answers
    stops in one line naming the file, and a row with a missing answer names its row."""
    good = tmp_path / "aime.jsonl"
    good.write_text("".join(json.dumps({"problem": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(3)))
    ds = load_prompts(DataConfig(apply_chat_template=False), tokenizer, source=str(good))
    assert [s.label for s in ds.samples] == ["1", "2", "3"] and ds.samples[0].prompt_text == "What is 0+1?"

    no_answers = tmp_path / "no_answers.jsonl"
    no_answers.write_text(json.dumps({"problem": "What is 1+1?"}) + "\n")
    with pytest.raises(ValueError) as e:
        load_prompts(DataConfig(apply_chat_template=False), tokenizer, source=str(no_answers))
    assert "\n" not in str(e.value) and str(no_answers) in str(e.value) and "answer" in str(e.value)

    one_missing = tmp_path / "one_missing.jsonl"
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": None}]
    one_missing.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=rf"^{one_missing} row 2: 'answer' is missing or null"):
        load_prompts(DataConfig(apply_chat_template=False), tokenizer, source=str(one_missing))


def test_arithmetic_min_operand_bounds_both_operands():
    cfg = ArithmeticConfig(num_train=200, num_eval=20, min_operand=10, max_operand=99, ops="*")
    operands = [int(x) for p, _ in arithmetic_problems(cfg) for x in p.rstrip("=").split("*")]
    assert min(operands) >= 10 and max(operands) <= 99 and len(operands) == 400


def test_multi_turn_prompts_offer_the_tools_and_demos_mask_the_results(tokenizer):
    """With a chat format (rollout.agent): the prompt lists the tools and keeps its messages; a
    tool_demos share of the arithmetic rows carries a calculator demonstration whose warm-start
    loss covers the policy's two turns and not the tool's result."""
    from colocate_rl.config import ToolsConfig
    from colocate_rl.data.sampler import sft_batch
    from colocate_rl.tools import ToolExecutor
    from colocate_rl.tools.chat import ChatFormat

    with ToolExecutor(ToolsConfig(names=["calculator"])) as ex:
        chat = ChatFormat(tokenizer, ex.specs())
    cfg = DataConfig(train="arithmetic", apply_chat_template=True, max_prompt_tokens=512,
                     arithmetic=ArithmeticConfig(num_train=40, num_eval=4, min_operand=10, max_operand=99, ops="*",
                                                 tool_demos=0.5))
    rows = list(load_prompts(cfg, tokenizer, chat=chat))
    assert all('"name": "calculator"' in s.prompt_text and s.meta["messages"][-1]["role"] == "user" for s in rows)
    demos = [s for s in rows if s.demo_ids]
    assert 0 < len(demos) < len(rows)
    batch = sft_batch(demos, tokenizer, size=len(demos), seed=0)
    for i, s in enumerate(batch.samples):
        start, end = int(batch.prompt_lens[i]), int(batch.attention_mask[i].sum())
        mask = batch.loss_mask[i, start:end]
        written = tokenizer.decode(batch.tokens[i, start:end][mask].tolist())
        expression = s.meta["messages"][-1]["content"].rstrip("=")
        assert written == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression
                           + '"}}\n</tool_call><|im_end|>' + s.label + "<|im_end|>")
        assert f"<tool_response>\n{s.label}\n</tool_response>" in tokenizer.decode(
            batch.tokens[i, start:end][~mask].tolist())
    plain = sft_batch([s for s in rows if not s.demo_ids][:3], tokenizer, size=3, seed=0)
    assert all(int(plain.loss_mask[i].sum()) == len(tokenizer.encode(s.label)) + 1 for i, s in enumerate(plain.samples))
