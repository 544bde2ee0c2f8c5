"""Partial rollouts: a step stops generating once enough prompt groups are complete, instead of
waiting for its slowest sample (``rollout.partial``).

Each step keeps ``data.prompts_per_step + rollout.partial.over_sample`` groups in flight: the rows
carried over from earlier steps first, then new prompts. Every row is one vLLM request (n = 1,
seeded as vLLM seeds the k-th of n samples, so a new group samples what a whole-batch generate
would). Once ``data.prompts_per_step`` groups are complete the engine aborts the other requests;
their rows keep the tokens and logprobs they have, each token with the weights version that
sampled it, and a later step continues them from those tokens (prompt + tokens so far as its
prompt). Only complete groups train: a group's advantages need all of its n rewards.

Staleness (``rollout.max_staleness``, k): a continued row trains on weights newer than the ones
that began it. When the oldest of its trained tokens would lag more than k versions behind the
update that trains it, the row is regenerated from its prompt (its tokens are discarded and
counted). Regenerating, not dropping: dropping a row drops its group's finished rows with it, and
the groups that keep a long row would be the ones never trained (a bias towards short answers).
With ``rollout.partial.mask_offpolicy`` a continued row's earlier tokens stay out of the loss, so
only its last segment trains and it is never regenerated for its age.

Two halves: ``generate_until`` runs inside an engine's process (``RolloutEngine.generate_partial``;
behind the router each engine stops at its share of the groups), ``PartialRollouts`` in the
trainer's, between the buffer and the engines (rollout/buffer.py). A checkpoint keeps the rows in
flight and the prompts drawn for them (``state_dict``) when no batch is requested ahead (colocated
always); with batches requested ahead (disaggregated) a resumed run starts with none in flight.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

from colocate_rl.resolved import Sampling, Scheduling
from colocate_rl.types import RolloutBatch, Sample


@dataclass
class RowRequest:
    prefix: list[int]  # the row's response tokens so far: generation continues after them
    max_tokens: int  # what is left of rollout.max_response_tokens
    seed: Optional[int]


@dataclass
class GroupRequest:
    prompt_ids: list[int]  # the router reads it to spread groups by length
    rows: list[RowRequest]  # the group's unfinished rows


@dataclass
class Segment:
    """What one request added to its row."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the sampler's, one per token
    finish: Optional[str] = None  # vLLM's finish reason; None: aborted before it finished
    text: str = ""  # the whole response (prefix + tokens) decoded, once finished


# ---------------------------------------------------------------- in the engine's process

_CALLS = itertools.count()


def quota(needed: int, total: int, mine: int) -> int:
    """Groups an engine holding ``mine`` of a call's ``total`` groups completes before it stops:
    its share of ``needed``, rounded up, so the engines' shares add up to at least ``needed``."""
    return min(mine, -(-needed * mine // total)) if total else 0


def generate_until(llm_engine: Any, groups: list[GroupRequest], needed: int, total: int, eos_ids: list[int],
                   decode: Callable[[list[int]], str], temperature: float, top_p: float) -> list[list[Segment]]:
    """Steps vLLM's engine (``LLM.llm_engine``) over every row of ``groups`` until its share of
    ``needed`` complete groups (of the call's ``total``, see ``quota``) is in, then aborts the rest.
    Returns each group's rows' segments, in order."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    call = next(_CALLS)
    where: dict[str, tuple[int, int]] = {}
    for g, group in enumerate(groups):
        for r, row in enumerate(group.rows):
            rid = f"crl-partial-{call}-{g}-{r}"
            params = SamplingParams(n=1, temperature=temperature, top_p=top_p, max_tokens=row.max_tokens, logprobs=0,
                                    seed=row.seed, stop_token_ids=eos_ids, detokenize=False,
                                    output_kind=RequestOutputKind.DELTA)
            llm_engine.add_request(rid, {"prompt_token_ids": list(group.prompt_ids) + list(row.prefix)}, params)
            where[rid] = (g, r)
    out = [[Segment() for _ in group.rows] for group in groups]
    left = [len(group.rows) for group in groups]
    stop_at, complete = quota(needed, total, len(groups)), 0
    try:
        while complete < stop_at and llm_engine.has_unfinished_requests():
            for o in llm_engine.step():
                g, r = where[o.request_id]
                c, seg = o.outputs[0], out[g][r]
                seg.tokens += c.token_ids
                seg.logprobs += [float(c.logprobs[j][tok].logprob) for j, tok in enumerate(c.token_ids)]
                if o.finished:
                    seg.finish = str(c.finish_reason)
                    seg.text = decode(groups[g].rows[r].prefix + seg.tokens)
                    left[g] -= 1
                    complete += left[g] == 0
    finally:  # the engine holds nothing of this call afterwards, however it ended
        unfinished = [rid for rid, (g, r) in where.items() if out[g][r].finish is None]
        if unfinished:
            llm_engine.abort_request(unfinished)
    return out


def in_group_order(parts: list[tuple[list[int], list]], num_groups: int) -> list:
    """The router's join for ``generate_partial``: each engine's results back in the call's order."""
    out: list = [None] * num_groups
    for groups, results in parts:
        for g, res in zip(groups, results):
            out[g] = res
    return out


# ---------------------------------------------------------------- in the trainer's process


@dataclass(eq=False)
class _Row:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights version that sampled each token
    finish: Optional[str] = None
    text: str = ""
    resumed_at: int = 0  # where its latest segment starts (mask_offpolicy leaves the tokens before it out)
    carried: bool = False  # it waited in the buffer for a later step (unfinished, or its group was)


@dataclass(eq=False)
class _Group:
    sample: Sample
    rows: list[_Row]

    @property
    def complete(self) -> bool:
        return all(r.finish is not None for r in self.rows)


GeneratePartial = Callable[..., list[list[Segment]]]  # (groups, needed=, total=) -> segments per group


class PartialRollouts:
    """The rows in flight between steps. ``extra_prompts`` (where the step's prompts are drawn)
    says how many prompts to draw beyond the step's own; ``produce`` runs one step's generation
    and returns its complete groups as a RolloutBatch, with token versions."""

    def __init__(self, scheduling: Scheduling, sampling: Sampling, prompts_per_step: int,
                 draw: Callable[[int], list[Sample]]) -> None:
        self.target, self.in_flight = prompts_per_step, prompts_per_step + scheduling.over_sample
        self.max_staleness, self.mask = scheduling.max_staleness, scheduling.mask_offpolicy
        self.sampling, self.draw = sampling, draw
        self.carried: list[_Group] = []  # groups with unfinished rows, oldest first
        self.reserve: list[Sample] = []  # prompts drawn and not started yet
        self._lock = threading.Lock()  # produce may run on the buffer's thread

    def extra_prompts(self) -> list[Sample]:
        """Prompts a request adds to its data.prompts_per_step so that in_flight groups generate.
        Counted from the rows in flight now: exact when the previous batch is produced (colocated,
        one step ahead), an estimate further ahead (the reserve evens it out)."""
        with self._lock:
            have = len(self.carried) + len(self.reserve)
        want = self.in_flight - self.target - have
        return self.draw(want) if want > 0 else []

    def state_dict(self, version: int) -> dict:
        """The groups in flight and the prompts drawn for them, as plain data (a checkpoint's), at
        weights ``version``: a resumed run counts versions from its own start."""
        with self._lock:
            carried = [{"sample": asdict(g.sample), "rows": [asdict(r) for r in g.rows]} for g in self.carried]
            return {"version": version, "reserve": [asdict(s) for s in self.reserve], "carried": carried}

    def load_state_dict(self, state: dict, version: int) -> None:
        shift = version - state["version"]
        with self._lock:
            self.reserve = [Sample(**s) for s in state["reserve"]]
            self.carried = [_Group(Sample(**g["sample"]), [_Row(**{**r, "versions": [v + shift for v in r["versions"]]})
                                                           for r in g["rows"]]) for g in state["carried"]]

    def produce(self, fresh: list[Sample], generate: GeneratePartial, seed: Optional[int], version: int,
                trains_at: int) -> tuple[RolloutBatch, dict[str, float]]:
        """One step's generation at weights ``version`` for the update at version ``trains_at``:
        the carried groups, then new ones from the reserve and ``fresh`` up to in_flight groups."""
        with self._lock:
            waiting = self.reserve + list(fresh)
            room = max(0, self.in_flight - len(self.carried))
            groups = self.carried + [_Group(s, [_Row() for _ in range(self.sampling.n)]) for s in waiting[:room]]
        discarded, regenerated = self._bound(groups, trains_at)
        todo = [(j, g) for j, g in enumerate(groups) if not g.complete]
        requests = self._requests(todo, seed)
        segments = generate(requests, needed=min(self.target, len(todo)), total=len(todo)) if todo else []
        resumed = self._apply([g for _, g in todo], segments, version)
        done = [g for g in groups if g.complete]
        with self._lock:
            self.carried = [g for g in groups if not g.complete]
            self.reserve = waiting[room:]
        for g in self.carried:
            for r in g.rows:
                r.carried = True
        metrics = {"partial/groups": float(len(done)), "partial/resumed": float(resumed),
                   "partial/regenerated": float(regenerated), "partial/tokens_discarded": float(discarded),
                   "partial/tokens": float(sum(len(s.tokens) for group in segments for s in group)),
                   "partial/carried": float(sum(r.finish is None for g in self.carried for r in g.rows)),
                   **self._ages(done, trains_at)}
        return self._batch(done), metrics

    def _trained_from(self, row: _Row) -> Optional[int]:
        """Index of the row's first token the loss will train on (None: none yet, or with
        mask_offpolicy an unfinished row, whose earlier tokens will be masked once it continues)."""
        if not row.tokens or (self.mask and row.finish is None):
            return None
        return row.resumed_at if self.mask else 0

    def _bound(self, groups: list[_Group], trains_at: int) -> tuple[int, int]:
        """Rows whose oldest trained token would lag more than max_staleness versions start again
        from their prompt. Returns (tokens discarded, rows restarted)."""
        discarded = restarted = 0
        for g in groups:
            for i, row in enumerate(g.rows):
                first = self._trained_from(row)
                if first is not None and trains_at - row.versions[first] > self.max_staleness:
                    discarded, restarted = discarded + len(row.tokens), restarted + 1
                    g.rows[i] = _Row()
        return discarded, restarted

    def _requests(self, todo: list[tuple[int, _Group]], seed: Optional[int]) -> list[GroupRequest]:
        """Row k of the group at position j of this step is seeded seed + j·n + k, as vLLM seeds
        the k-th of n samples of prompt j: a step of new groups samples what generate would."""
        n, cap = self.sampling.n, self.sampling.max_response_tokens
        return [GroupRequest(g.sample.prompt_ids, [
            RowRequest(list(r.tokens), cap - len(r.tokens), None if seed is None else seed + j * n + k)
            for k, r in enumerate(g.rows) if r.finish is None]) for j, g in todo]

    @staticmethod
    def _apply(todo: list[_Group], segments: list[list[Segment]], version: int) -> int:
        """Appends each segment to its row; returns how many rows continued from earlier tokens."""
        resumed = 0
        for g, segs in zip(todo, segments):
            for row, seg in zip([r for r in g.rows if r.finish is None], segs):
                resumed += bool(row.tokens)
                row.resumed_at = len(row.tokens)
                row.tokens += seg.tokens
                row.logprobs += seg.logprobs
                row.versions += [version] * len(seg.tokens)
                row.finish, row.text = seg.finish, seg.text
        return resumed

    @staticmethod
    def _ages(done: list[_Group], trains_at: int) -> dict[str, float]:
        """Of the rows trained now that waited in the buffer for this step: how many, and their age
        (versions between their first token and this update)."""
        ages = [trains_at - r.versions[0] for g in done for r in g.rows if r.carried]
        return {"partial/finished_carried": float(len(ages)), "partial/carried_age_max": float(max(ages, default=0)),
                "partial/carried_age_mean": sum(ages) / len(ages) if ages else 0.0}

    def _batch(self, done: list[_Group]) -> RolloutBatch:
        rows = [(g.sample, r) for g in done for r in g.rows]
        batch = RolloutBatch.from_rows([s.prompt_ids for s, _ in rows], [r.tokens for _, r in rows],
                                       [s for s, _ in rows], pad_id=0, response_logprobs=[r.logprobs for _, r in rows],
                                       finish_reasons=[r.finish or "" for _, r in rows],
                                       responses=[r.text for _, r in rows], n=self.sampling.n)
        versions = torch.zeros_like(batch.tokens)
        for i, (s, r) in enumerate(rows):
            p = len(s.prompt_ids)
            versions[i, p: p + len(r.tokens)] = torch.tensor(r.versions, dtype=torch.long)
            if self.mask:
                batch.loss_mask[i, p: p + r.resumed_at] = False
        batch.token_versions = versions
        return batch


def version_lag(batch: RolloutBatch, trainer_version: int, batch_version: int) -> dict[str, float]:
    """How many weights versions the tokens the loss trains on lag the update (max and mean over
    them); a batch without token versions was sampled whole at ``batch_version``."""
    if batch.token_versions is None:
        lag = torch.full((1,), float(trainer_version - batch_version))
    else:
        lag = (trainer_version - batch.token_versions[batch.loss_mask]).float()
    return {"rollout/staleness_max": float(lag.max()) if lag.numel() else 0.0,
            "rollout/staleness_mean": float(lag.mean()) if lag.numel() else 0.0}


__all__ = ["GroupRequest", "PartialRollouts", "RowRequest", "Segment", "generate_until", "in_group_order",
           "quota", "version_lag"]
