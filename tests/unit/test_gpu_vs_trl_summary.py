"""benchmarks/peers/gpu_vs_trl.py rebuilds its result from the records each side wrote: one pair's folder,
or a series run over several commands (pair0/, pair1/, …), from the committed H200 records; and a
series runs its sides in ABBA order."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "benchmarks" / "peers" / "gpu_vs_trl.py"


def summarize(folder: Path) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPT), "--summarize", str(folder)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def test_one_folder_gives_the_committed_result():
    got = summarize(RESULTS / "gpu_vs_trl_h200_raw")
    committed = json.loads((RESULTS / "gpu_vs_trl_h200.json").read_text())
    assert got["step_s_vs_trl"] == committed["step_s_vs_trl"] > 1
    assert got["order"] == ["ours", "trl"]  # recorded before the order alternated


def test_a_series_of_pair_folders_reports_each_pair_and_the_median(tmp_path):
    raws = ["gpu_vs_trl_h200_raw", "gpu_vs_trl_h200_micro64_raw", "archive/gpu_vs_trl_h200_unfused_norm_raw"]
    for k, raw in enumerate(raws):
        shutil.copytree(RESULTS / raw, tmp_path / f"pair{k}")
    (tmp_path / "pair1" / "order").write_text("trl\nours\n")
    (tmp_path / "pair3").mkdir()  # a pair that did not finish: one side's record, left out
    shutil.copy(RESULTS / raws[0] / "trl.json", tmp_path / "pair3")
    got = summarize(tmp_path)
    singles = [summarize(RESULTS / raw)["step_s_vs_trl"] for raw in raws]
    assert got["step_s_vs_trl_per_pair"] == singles
    assert got["step_s_vs_trl_median"] == sorted(singles)[1]
    assert got["step_s_vs_trl_spread"] == [min(singles), max(singles)]
    assert [p["order"] for p in got["pairs"]] == [["ours", "trl"], ["trl", "ours"], ["ours", "trl"]]


def test_a_series_alternates_which_side_runs_first(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_vs_trl", SCRIPT)
    saved = list(sys.path)  # the script puts benchmarks/ on it for its common/ helpers
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved
    runs = []
    for _ in range(6):
        k, side = mod.next_run(tmp_path)
        runs.append((k, side))
        (tmp_path / f"pair{k}").mkdir(exist_ok=True)
        (tmp_path / f"pair{k}" / f"{side}.json").write_text("{}")
    assert runs == [(0, "ours"), (0, "trl"), (1, "trl"), (1, "ours"), (2, "ours"), (2, "trl")]
