"""Shared fixtures: tiny random-weight models built once per test session, and run-local caches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Engines write caches and temp files; keep them in the project (setup_env.sh sets the same).
_cache = ROOT / ".cache"
for var, sub in [("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("HF_HOME", "hf"),
                 ("TRITON_CACHE_DIR", "triton"), ("RAY_TMPDIR", "ray"), ("MPLCONFIGDIR", "mpl")]:
    os.environ.setdefault(var, str(_cache / sub))
os.environ.setdefault("COLOCATE_RL_CACHE", str(_cache))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
# First generate otherwise spends 15-19 s in torch.compile on CPU.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# One intra-op thread per process (before torch is imported; the processes the tests start inherit
# it): two pytest-xdist workers, a test's spawned ranks and engine processes share 2 cores, and
# torch's default of one thread per core had them spin-waiting on each other (three modules of
# spawned ranks measured 244 s with it, 164 s without, side by side on two workers). The tiny
# models gain nothing from a second thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model("qwen3-tiny") -> Path of an HF folder (config, safetensors, tokenizer), built once."""
    from colocate_rl.models.tiny import ensure_model

    root = tmp_path_factory.mktemp("models")

    def get(shape: str = "qwen3-tiny", dtype: str = "float32") -> Path:
        return ensure_model(shape, root / f"{shape}-{dtype}", seed=0, dtype=dtype)

    return get


# Under pytest-xdist, as scripts/test.sh runs the suite (`-n 2 --dist loadfile --no-loadscope-reorder`):
# - a module is one unit of work: its module-scoped fixtures (an engine, a Ray instance, spawned
#   ranks) start once, on one worker;
# - the modules that start Ray instances, clusters or nodes are one unit: they run one after
#   another on one worker, as they do without xdist (scripts/test.sh runs them in a phase of their own);
# - the units holding slow tests come first, so that a long one does not start last.
RAY_MODULES = {"test_disaggregated.py", "test_multinode.py", "test_partial_disaggregated.py", "test_ray_auth.py",
               "test_ray_colocated.py", "test_scripts.py"}


@pytest.fixture
def compiling(monkeypatch):
    """torch.compile for real in this test (the suite turns it off above, so a compiled path would
    otherwise run its Python eagerly and a comparison with the eager path check nothing); fails the
    test when nothing was compiled."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from colocate_rl.platform import compiled

    monkeypatch.delenv("TORCHDYNAMO_DISABLE")  # read by each torch.compile call
    compiled.cache_clear()  # drop functions wrapped while it was off
    torch._dynamo.reset()
    yield
    graphs = counters["stats"]["unique_graphs"]
    compiled.cache_clear()
    torch._dynamo.reset()
    assert graphs > 0, "nothing went through torch.compile"


def _unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "ray" if module.rsplit("/", 1)[-1] in RAY_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleScheduling(config, log)


def pytest_ignore_collect(collection_path, config):
    # scripts/test.sh's Ray phase imports only the Ray modules, the other phase all but them:
    # collecting the whole tree imports torch, vLLM and megatron-core into the process (~20 s).
    phase = os.environ.get("TEST_RAY_MODULES", "")
    if phase in ("skip", "only") and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return (collection_path.name in RAY_MODULES) != (phase == "only") or None
    return None


def pytest_collection_modifyitems(config, items):
    # scripts/test.sh's two phases: TEST_RAY_MODULES=skip (the rest, on xdist workers), then =only
    # (the Ray modules alone: a Ray node waits a fixed 30 s for its raylet, which a loaded machine
    # running another heavy module beside it may not start in time).
    phase = os.environ.get("TEST_RAY_MODULES", "")
    if phase in ("skip", "only"):
        keep = [i for i in items if (_unit(i.nodeid) == "ray") == (phase == "only")]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    if not hasattr(config, "workerinput"):  # not an xdist worker: the order as collected
        return
    slow = {_unit(i.nodeid) for i in items if i.get_closest_marker("slow")}
    first: dict[str, int] = {}
    for k, item in enumerate(items):
        first.setdefault(_unit(item.nodeid), k)
    order = {id(item): k for k, item in enumerate(items)}
    items.sort(key=lambda i: (_unit(i.nodeid) not in slow, first[_unit(i.nodeid)], order[id(i)]))
