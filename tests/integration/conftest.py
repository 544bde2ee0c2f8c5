import pytest

from colocate_rl.rewards import REWARDS, register


@pytest.fixture(scope="module")
def world():
    """One process's Megatron parallel state (gloo, TP = PP = EP = 1), for tests that build modules
    without an Actor."""
    from colocate_rl import platform
    from colocate_rl.trainer.distributed import init_model_parallel, init_process_group

    platform.setup_platform()
    init_process_group()
    init_model_parallel(1, 1, 1, 0)


@pytest.fixture(scope="module")
def even_length_reward():
    """A random-weight model scores 0 on arithmetic; this reward varies within every group, so each
    step really changes the weights and the weight-equality checks mean something. Registered only
    while a test needs it (the registry is global)."""

    @register("test_even_length", inline=True)
    def even_length(response: str, label: str) -> float:
        return float(len(response) % 2 == 0)

    yield "test_even_length"
    REWARDS.pop("test_even_length", None)


@pytest.fixture
def trained(session, monkeypatch):
    """The batches the module's ``session`` actor trains, each with the weights version it trains at."""
    s, seen = session, []
    train_step = s.actor.train_step

    def record(batch, *args, **kwargs):
        seen.append((batch, s.handoff.version))
        return train_step(batch, *args, **kwargs)

    monkeypatch.setattr(s.actor, "train_step", record, raising=False)
    return seen
