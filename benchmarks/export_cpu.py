"""The actor's HF export of a MoE model with Qwen3-30B-A3B's tensor count (12 layers of 128 experts:
4,719 tensors) at tiny widths, so what is timed is the export's own walk, not its bytes: the first
export of a model, which builds the name maps, against the later ones, which reuse them
(models/mapping.py), each alone and followed by the bucket writer.

    python benchmarks/export_cpu.py   # -> benchmarks/results/export_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _cpu_results import add_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/export_cpu.json")
    a = ap.parse_args()
    from batches import make_actor

    from colocate_rl.models import mapping, tiny
    from colocate_rl.weight_sync.buckets import pack

    tiny.SHAPES["qwen3-moe-many"] = {**tiny.SHAPES["qwen3-moe-tiny"], "num_experts": a.experts,
                                     "num_experts_per_tok": 8, "num_hidden_layers": a.layers,
                                     "moe_intermediate_size": 16}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(tiny.ensure_model("qwen3-moe-many", Path(tmp) / "m", dtype="bfloat16"))
        actor = make_actor(path, {}, dtype="bfloat16")

        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        export = lambda: sum(1 for _ in actor.export_hf_weights())  # noqa: E731
        first, tensors = [], export()
        for _ in range(a.repeat):  # maps dropped before each: every export builds them again
            mapping._EXPORT_MAPS.clear()
            first.append(timed(export))
        later = [timed(export) for _ in range(a.repeat)]
        with_pack = [timed(lambda: sum(1 for _ in pack(actor.export_hf_weights(), 256))) for _ in range(a.repeat)]
    run = {"tensors": tensors, "repeat": a.repeat,
           "export_s_building_maps": statistics.median(first), "export_s_reusing_maps": statistics.median(later),
           "export_and_pack_s_reusing_maps": statistics.median(with_pack)}
    run["reuse_speedup"] = run["export_s_building_maps"] / run["export_s_reusing_maps"]
    print(run)
    add_run(a.out, "export_cpu", f"qwen3-moe {a.layers} layers x {a.experts} experts, tiny widths", run)


if __name__ == "__main__":
    main()
