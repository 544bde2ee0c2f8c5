"""benchmarks/gpu_vs_trl.py rebuilds its result from the records each side wrote: one pair's folder,
or a series run a pair per command (pair0/, pair1/, …), from the committed H200 records."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "benchmarks" / "gpu_vs_trl.py"


def summarize(folder: Path) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPT), "--summarize", str(folder)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def test_one_folder_gives_the_committed_result():
    got = summarize(RESULTS / "gpu_vs_trl_h200_raw")
    committed = json.loads((RESULTS / "gpu_vs_trl_h200.json").read_text())
    assert got["step_s_vs_trl"] == committed["step_s_vs_trl"] > 1


def test_a_series_of_pair_folders_reports_each_pair_and_the_median(tmp_path):
    raws = ["gpu_vs_trl_h200_raw", "gpu_vs_trl_h200_micro64_raw", "gpu_vs_trl_h200_unfused_norm_raw"]
    for k, raw in enumerate(raws):
        shutil.copytree(RESULTS / raw, tmp_path / f"pair{k}")
    (tmp_path / "pair3").mkdir()  # a pair that did not finish: no records, left out
    got = summarize(tmp_path)
    singles = [summarize(RESULTS / raw)["step_s_vs_trl"] for raw in raws]
    assert got["step_s_vs_trl_per_pair"] == singles
    assert got["step_s_vs_trl_median"] == sorted(singles)[1]
    assert got["step_s_vs_trl_spread"] == [min(singles), max(singles)]
    assert len(got["pairs"]) == 3
