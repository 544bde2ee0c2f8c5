"""The rows of docs/errors.md's table (a bad input and the line it prints), and the files each needs.

A row's first cell is command-line overrides in backticks, then what a file they name holds:

    whose row N is `JSON`              the data file (.jsonl or .parquet): N - 1 good rows, then this one
    whose config.json is `TEXT`        the model folder's config.json is TEXT
    whose config.json lacks `FIELD`    ... is the tiny test model's without FIELD
    whose config.json has `"F": V`     ... is the tiny test model's with these fields
    whose folder lacks `A`, `B`        the model folder without these files

and, last, ", given to `RolloutEngine`" for a row that the engine's constructor meets (the Python
API) rather than a run. Every row runs in a working folder holding ``model``, a copy of the
tiny test model; the overrides below come first, so that a row's own override wins.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "errors.md"
RECIPE = ROOT / "recipes" / "qwen3_grpo.py"
# The tiny preset on the copied model, with a small training set and no eval set: a row's error is
# found in seconds.
BASE = ["model.path=model", "model.synthesize=''", "logging.run_dir=runs", "data.arithmetic.num_train=8",
        "eval.sets=[]"]
GOOD_ROW = '{"prompt": "1+1=", "label": "2"}'
ENGINE = ", given to `RolloutEngine`"


@dataclass(frozen=True)
class Row:
    cell: str  # the bad input as the table says it
    line: str  # what follows "error: " on stderr

    @property
    def overrides(self) -> list[str]:
        return _spans(self.cell)[0].split()

    @property
    def engine(self) -> bool:
        return self.cell.endswith(ENGINE)

    def __str__(self) -> str:
        return self.cell


def _spans(text: str) -> list[str]:
    return re.findall(r"`([^`]*)`", text)


def rows() -> list[Row]:
    """Every row of the table under "## What each bad input prints"."""
    text = TABLE.read_text().split("## What each bad input prints", 1)[1]
    out = []
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            assert len(cells) == 2 and cells[1].startswith("`") and cells[1].endswith("`"), line
            out.append(Row(cells[0], cells[1][1:-1]))
    return out


def build(row: Row, folder: Path, tiny_model: Path) -> None:
    """The files ``row`` describes, in ``folder`` (the run's working folder)."""
    model = folder / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    rest = row.cell.split("`", 2)[2].removesuffix(ENGINE).strip()
    if m := re.fullmatch(r"whose row (\d+) is `(.+)`", rest):
        data = folder / dict(o.split("=", 1) for o in row.overrides)["data.train"]
        lines = [GOOD_ROW] * (int(m[1]) - 1) + [m[2]]
        if data.suffix == ".parquet":
            import datasets

            datasets.Dataset.from_list([json.loads(x) for x in lines]).to_parquet(str(data))
        else:
            data.write_text("".join(x + "\n" for x in lines))
    elif m := re.fullmatch(r"whose config\.json is `(.+)`", rest):
        (model / "config.json").write_text(m[1])
    elif m := re.fullmatch(r"whose config\.json lacks `(\w+)`", rest):
        del config[m[1]]
        (model / "config.json").write_text(json.dumps(config))
    elif m := re.fullmatch(r"whose config\.json has `(.+)`", rest):
        (model / "config.json").write_text(json.dumps({**config, **json.loads("{" + m[1] + "}")}))
    elif m := re.fullmatch(r"whose folder lacks (`.+`)", rest):
        for name in _spans(m[1]):
            (model / name).unlink()
    else:
        assert rest == "", f"the table's row {row.cell!r}: no way to build '{rest}'"


def first_error(row: Row):
    """What the command line does before it starts anything (load, plan, read the model, tokenizer
    and data), or the engine's constructor: raises the row's ConfigError; returns the plan and what
    was read (session.read_inputs) if nothing stops."""
    from colocate_rl.cli import preset_config
    from colocate_rl.config import load
    from colocate_rl.plan import resolve

    cfg = load(preset_config(RECIPE.with_suffix(".yaml"), "tiny", recipe="qwen3_grpo"),
               overrides=BASE + row.overrides)
    plan = resolve(cfg)
    if row.engine:
        from colocate_rl.rollout.engine import RolloutEngine

        RolloutEngine(cfg.model, plan.engine, plan.sampling, plan.resolved).shutdown()
        return None
    from colocate_rl.session import read_inputs

    return (plan, *read_inputs(cfg))
