"""Every row of docs/errors.md's table: its bad input, built as the row says, stops what the
command line runs before it starts anything (load, plan, model folder, tokenizer, data) with a
ConfigError whose one line is the row's. A row whose input cannot be built fails here, so the
table holds no line that is not checked."""

from __future__ import annotations

import datasets
import pytest

from bad_inputs import GOOD_ROW, Row, build, first_error, rows
from colocate_rl.config import ConfigError

ROWS = rows()


@pytest.fixture(autouse=True)
def _in_a_folder_of_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the table's paths are relative: model, rows.jsonl
    monkeypatch.setenv("COLOCATE_RL_CACHE", str(tmp_path / "cache"))  # datasets' Arrow copies
    datasets.disable_progress_bars()


def test_the_table_covers_each_kind_of_input():
    cells = " ".join(r.cell for r in ROWS)
    assert len(ROWS) >= 30
    for what in ("=nan", "=inf", "reward.workers=", "whose config.json is", "whose config.json lacks",
                 "whose config.json has", "lacks `tokenizer.json`", "lacks `chat_template.jinja`", "whose row",
                 "RolloutEngine`"):
        assert what in cells, what


@pytest.mark.parametrize("row", ROWS, ids=[r.cell.replace(" ", "_")[:60] for r in ROWS])
def test_bad_input_stops_in_its_line(row: Row, tiny_model, tmp_path):
    build(row, tmp_path, tiny_model("qwen3-tiny"))
    with pytest.raises(ConfigError) as e:
        first_error(row)
    assert str(e.value) == row.line


def test_the_setup_the_rows_share_stops_nowhere(tiny_model, tmp_path):
    """The tiny preset on a copy of the tiny model, with good data rows, reads all it reads and
    stops nowhere: each row's error comes from its own bad input."""
    row = Row(f"`data.train=rows.jsonl` whose row 3 is `{GOOD_ROW}`", "")
    build(row, tmp_path, tiny_model("qwen3-tiny"))
    plan, tokenizer, train, eval_sets = first_error(row)
    assert [s.meta["row"] for s in train] == [0, 1, 2] and train[0].label == "2" and eval_sets == {}
