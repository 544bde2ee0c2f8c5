"""The actor's HF export of a MoE model with Qwen3-30B-A3B's tensor count (12 layers of 128 experts:
4,719 tensors) at tiny widths, so what is timed is the export's own work, not its bytes.

    python benchmarks/sync/export_cpu.py          # one rank: the first export of a model, which builds the
                                             # name maps, against the later ones, which reuse them
    python benchmarks/sync/export_cpu.py --ep 2   # two gloo ranks, experts split: one collective per
                                             # parameter against runs of parameters (mapping.RUN_BYTES)
    # -> benchmarks/results/export_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common/
from common.cpu_results import add_run  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_rank(path: str, repeat: int) -> dict:
    from batches import make_actor

    from colocate_rl.models import mapping
    from colocate_rl.weight_sync.buckets import pack

    actor = make_actor(path, {}, dtype="bfloat16")
    export = lambda: sum(1 for _ in actor.export_hf_weights())  # noqa: E731
    first, tensors = [], export()
    for _ in range(repeat):  # maps dropped before each: every export builds them again
        mapping._EXPORT_MAPS.clear()
        first.append(timed(export))
    later = [timed(export) for _ in range(repeat)]
    with_pack = [timed(lambda: sum(1 for _ in pack(actor.export_hf_weights(), 256))) for _ in range(repeat)]
    run = {"tensors": tensors, "repeat": repeat,
           "export_s_building_maps": statistics.median(first), "export_s_reusing_maps": statistics.median(later),
           "export_and_pack_s_reusing_maps": statistics.median(with_pack)}
    run["reuse_speedup"] = run["export_s_building_maps"] / run["export_s_reusing_maps"]
    return run


def expert_parallel(path: str, ep: int, repeat: int) -> dict:
    """On each of ``ep`` ranks: the export with every parameter in its own collective (RUN_BYTES = 0)
    against the default runs; rank 0's timings, collective counts and whether the two exports agree."""
    import torch

    from batches import make_actor

    from colocate_rl.models import mapping

    actor = make_actor(path, {"ep": ep}, dtype="bfloat16")
    real, calls = mapping.dist, {"n": 0}

    class Counting:  # torch.distributed with its collectives counted
        def __getattr__(self, name):
            return getattr(real, name)

        def broadcast(self, *a, **k):
            calls["n"] += 1
            return real.broadcast(*a, **k)

        def all_gather(self, *a, **k):
            calls["n"] += 1
            return real.all_gather(*a, **k)

    mapping.dist, default = Counting(), mapping.RUN_BYTES
    run, exported = {"ranks": ep, "repeat": repeat, "run_bytes": default}, {}
    try:
        for label, run_bytes in (("one_collective_per_parameter", 0), ("runs", default)):
            mapping.RUN_BYTES = run_bytes
            mapping._EXPORT_MAPS.clear()  # the runs are cut when the maps are built
            calls["n"] = 0
            exported[label] = {n: t.clone() for n, t in actor.export_hf_weights()}
            run[f"collectives_{label}"] = calls["n"]
            run[f"export_s_{label}"] = statistics.median(
                timed(lambda: sum(1 for _ in actor.export_hf_weights())) for _ in range(repeat))
    finally:
        mapping.dist, mapping.RUN_BYTES = real, default
        mapping._EXPORT_MAPS.clear()
    a, b = exported.values()
    run["tensors"] = len(b)
    run["same_tensors"] = a.keys() == b.keys() and len(b) > 0 and all(torch.equal(a[n], b[n]) for n in a)
    run["speedup"] = run["export_s_one_collective_per_parameter"] / run["export_s_runs"]
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (gloo processes)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/export_cpu.json")
    a = ap.parse_args()
    from colocate_rl.models import tiny

    tiny.SHAPES["qwen3-moe-many"] = {**tiny.SHAPES["qwen3-moe-tiny"], "num_experts": a.experts,
                                     "num_experts_per_tok": 8, "num_hidden_layers": a.layers,
                                     "moe_intermediate_size": 16}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(tiny.ensure_model("qwen3-moe-many", Path(tmp) / "m", dtype="bfloat16"))
        if a.ep > 1:
            from colocate_rl.trainer import run_on_ranks

            run = run_on_ranks(expert_parallel, a.ep, path, a.ep, a.repeat)
            assert run["same_tensors"], "the two exports differ"
            key = f"qwen3-moe {a.layers} layers x {a.experts} experts, tiny widths, EP={a.ep} (gloo)"
        else:
            run = one_rank(path, a.repeat)
            key = f"qwen3-moe {a.layers} layers x {a.experts} experts, tiny widths"
    print(run)
    add_run(a.out, "export_cpu", key, run)


if __name__ == "__main__":
    main()
