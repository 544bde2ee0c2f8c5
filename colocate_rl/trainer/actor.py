"""The Megatron actor: re-scores rollout tokens, takes GRPO (or SFT) optimizer steps, moves its
state to host memory and back, and exports HF-named weights for the rollout engine.

One ``Actor`` per process; a job of tp x pp x dp processes builds one on every rank, and every
rank is handed the same full batch (each picks its data-parallel share, see batching.py). All
public methods are collective: call them on every rank, in the same order.

Loss scaling, stated once: the policy loss of a micro-batch is normalised by the token (or
sequence) count of its whole mini-batch, so micro-batch losses *sum* to the mini-batch loss.
Megatron's schedule divides each returned loss by the number of micro-batches and its DDP averages
gradients over data-parallel ranks; the loss function multiplies by both to undo that.

With rollout.routing_replay (R3) the policy's MoE routers replay the sampler's experts
(RolloutBatch.routed_experts) in every forward over a rollout batch: re-scoring and training.
The reference policy and SFT steps route by themselves.

With algorithm.kl_coef > 0 the actor also holds the reference policy (trainer/reference.py): the
policy's weights when the first GRPO step runs (after any SFT warm-start), or those restored from
a checkpoint. train_step scores the batch with it; with kl_coef = 0 none is built.
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import time
from functools import partial
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from colocate_rl import platform
from colocate_rl.algorithms import gap_summary, global_counts, policy_loss
from colocate_rl.config import ActorConfig, AlgorithmConfig, ModelConfig
from colocate_rl.models.build import build_model
from colocate_rl.models import exact
from colocate_rl.models.grouped_experts import GroupedExperts, grouped_gemm_runs
from colocate_rl.models.mapping import export_hf_weights, load_hf_weights
from colocate_rl.models.norm import RMSNorm
from colocate_rl.models.registry import exact_samples_on_v2, family_for, model_folder, read_hf_config
from colocate_rl.models.replay import RoutingReplay
from colocate_rl.resolved import Resolved, Sampling
from colocate_rl.trainer.batching import minibatches, rank_micro_batches
from colocate_rl.trainer.census import SavedTensorCensus
from colocate_rl.trainer.distributed import init_model_parallel, init_process_group
from colocate_rl.trainer.host_adam import HostAdam
from colocate_rl.trainer.logprobs import greedy_hits, sampled_token_logprobs, token_logprobs
from colocate_rl.trainer.offload import HostOffload
from colocate_rl.trainer.reference import Reference
from colocate_rl.types import RolloutBatch
from colocate_rl.weight_sync import json_wire
from colocate_rl.weight_sync.verify import checksums

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoints: the reference policy's sharded keys are the policy's with this prefix, and the
# checkpoint's content metadata says whether it holds one.
_REF_PREFIX = "reference_policy."
_HAS_REFERENCE = "has_reference_policy"
_FINITE_CHECK_NUMEL = 1 << 26  # gradients per slice of the inf/NaN check (64 MiB of flags)


class Actor:
    """Built from ``model`` (HF folder, dtype), ``actor`` (parallelism, optimizer), ``algorithm``
    (loss), ``sampling`` (the logprobs are of the sampling distribution: its temperature and top-k /
    top-p filter, its longest response), ``resolved`` (the plan's kernels, exact mode, routing
    replay, the schedule's length) and ``seed`` (megatron-core's model-parallel RNG). A choice of
    ``resolved`` it cannot run raises.

    Public state (for checkpointing): ``model`` (Megatron DDP around the GPTModel), ``optimizer``
    (Megatron optimizer, or ``HostAdam`` with ``actor.optimizer_cpu_offload``), ``scheduler``
    (OptimizerParamScheduler), ``hf_config``, ``specs``, ``reference`` (the KL penalty's reference
    policy, see trainer/reference.py; None until the first GRPO step with algorithm.kl_coef > 0 or a
    checkpoint that holds one).
    """

    def __init__(self, model: ModelConfig, actor: ActorConfig, algorithm: AlgorithmConfig, sampling: Sampling,
                 resolved: Resolved, seed: int):
        self.cfg, self.algorithm, self.sampling, self.resolved = actor, algorithm, sampling, resolved
        a, kernels = actor, resolved.kernels
        platform.setup_platform()
        self.exact = resolved.exact
        if self.exact:  # before any CUDA matmul of this process
            exact.enable()
        self.model_path = model_folder(model.path)  # a hub id: its snapshot, fetched if absent
        self.hf_config = read_hf_config(self.model_path)
        self.family = family_for(self.hf_config)
        self._exact_v2 = exact_samples_on_v2(self.hf_config, resolved.routing_replay)
        self.dtype = DTYPES[model.dtype]
        self.fp32_head = model.head_dtype == "float32"
        # The layout was validated with the run's plan (colocate_rl.plan) before any process started.
        self.rank, world = init_process_group()
        self.dp = world // (a.tp * a.pp)
        init_model_parallel(a.tp, a.pp, a.ep, seed)
        from megatron.core import parallel_state as ps

        self._ps = ps
        self.dp_rank = ps.get_data_parallel_rank()
        self.device = platform.device()

        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
            if a.recompute else {}
        self.model_config = self.family.transformer_config(
            self.hf_config, self.dtype,
            tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
            expert_model_parallel_size=a.ep, expert_tensor_parallel_size=1, sequence_parallel=a.sequence_parallel,
            use_cpu_initialization=not platform.has_gpu(),
            perform_initialization=False,  # every parameter is overwritten from the checkpoint
            variable_seq_lengths=a.pp > 1,  # micro-batches are trimmed to their own length
            fp32_residual_connection=kernels.fp32_residual,
            **recompute,
        )
        module = build_model(self.family, self.hf_config, self.model_config, exact=self.exact, fp32_head=self.fp32_head)
        for m in module.modules():  # actor.norm_kernel (models/norm.py; exact mode stops at config time)
            if isinstance(m, RMSNorm):
                m.fused = kernels.norms == "fused"
        if kernels.experts == "grouped":
            self._group_experts(module)
        self.specs = self.family.params(self.hf_config)
        load_hf_weights(module, self.specs, self.model_path)
        if a.emulate_rollout_fp8:
            self.family.fp8_emulation(module, self.hf_config)
        self.model, self.optimizer, self.scheduler = self._wrap(module)
        self._replay = self._routing_replay(module) if resolved.routing_replay else None
        # Gradients are zeroed before every backward, so offloading them is freeing them.
        # The optimizer state is read only by the optimizer step: its onload may finish behind the
        # forward and backward (actor.overlap_onload).
        self._offload = HostOffload(
            {"params": self._param_tensors, "grads": self._grad_tensors, "optimizer": self._optimizer_tensors},
            scratch=("grads",), prefetched=("optimizer",) if a.overlap_onload else ())
        self.reference: Optional[Reference] = None

    # ------------------------------------------------------------ build

    def _group_experts(self, module) -> None:
        """Every GroupedExperts layer runs its experts in grouped GEMMs, as the plan resolved
        actor.expert_kernel; a layer or device that cannot stops here, naming why."""
        layers = [m for m in module.modules() if isinstance(m, GroupedExperts)]
        if not layers:  # a dense model (known to the plan only by its hub id): nothing to group
            return
        reasons = [m.why_not_grouped for m in layers]
        if not grouped_gemm_runs(self.device.type, self.dtype):
            reasons.insert(0, f"torch's grouped GEMM does not run for {self.dtype} on this {self.device.type}")
        why = next((r for r in reasons if r), None)
        if why:
            raise ValueError(f"actor.expert_kernel resolved to grouped, but {why}")
        for m in layers:
            m.grouped = True

    def _wrap(self, module):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        a = self.cfg
        ddp = DistributedDataParallel(
            self.model_config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                          use_distributed_optimizer=a.distributed_optimizer),
            module,
        )
        host = a.optimizer_cpu_offload
        if host and self.dtype == torch.float16:
            raise ValueError("actor.optimizer_cpu_offload=true trains in bfloat16 or float32 (no fp16 loss scaling)")
        if a.optimizer_state_dtype != "float32" and not host:
            raise ValueError(f"actor.optimizer_state_dtype={a.optimizer_state_dtype!r} needs actor.optimizer_cpu_"
                             "offload=true: megatron-core keeps bf16 moments only in TransformerEngine's FusedAdam")
        # With host Adam, Megatron's optimizer is built only for what it decides: parameter groups
        # (weight-decay exclusions, lr/wd multipliers) and gradient-norm groups. Built as the plain
        # fp32 optimizer it allocates nothing (torch's Adam creates state on its first step).
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay,
                adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, adam_eps=a.adam_eps, clip_grad=a.grad_clip,
                bf16=self.dtype == torch.bfloat16 and not host, fp16=self.dtype == torch.float16 and not host,
                params_dtype=self.dtype, use_distributed_optimizer=a.distributed_optimizer and not host,
            ),
            [ddp],
        )
        if host:
            optimizer = HostAdam(optimizer, ddp, clip_grad=a.grad_clip, state_dtype=a.optimizer_state_dtype,
                                 chunk_mb=a.optimizer_chunk_mb, distributed=a.distributed_optimizer)
        total_steps = self.resolved.lr_decay_steps
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=a.lr, min_lr=a.min_lr, lr_warmup_steps=a.lr_warmup_steps,
            lr_decay_steps=total_steps, lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay,
            end_wd=a.weight_decay, wd_incr_steps=total_steps, wd_incr_style="constant",
        )
        # What Megatron's training loop wires up: grad-sync hooks for the schedule, fp16 loss scaling.
        self.model_config.no_sync_func = ddp.no_sync
        self.model_config.finalize_model_grads_func = finalize_model_grads
        self.model_config.grad_scale_func = optimizer.scale_loss
        return ddp, optimizer, scheduler

    def _routing_replay(self, module) -> RoutingReplay:
        routing = self.family.moe_routing(self.hf_config)
        if routing is None:
            raise ValueError(f"rollout.routing_replay=true but the model ({self.hf_config.get('model_type')}) has "
                             "no routed experts to replay")
        self._moe_routing = routing
        replay = RoutingReplay(routing.layers, self.cfg.sequence_parallel)
        replay.install(module)
        return replay

    def _check_routing(self, batch: RolloutBatch) -> None:
        """With routing replay a rollout batch must carry the sampler's experts, in this model's shape."""
        if self._replay is None:
            return
        r, want = batch.routed_experts, self._moe_routing
        if r is None:
            raise ValueError("rollout.routing_replay=true but the batch carries no routed_experts (the sampler "
                             "returned none: vLLM on GPUs returns them, other samplers do not)")
        if tuple(r.shape[2:]) != (len(want.layers), want.topk):
            raise ValueError(f"RolloutBatch.routed_experts has {tuple(r.shape[2:])} (MoE layers, top_k) per token; "
                             f"the model has {(len(want.layers), want.topk)}")

    def _build_reference_module(self):
        """A bare model for the reference, on a copy of the config without the training hooks
        ``_wrap`` adds: it runs forward only, and megatron-core's SequentialMLP deep-copies its
        config, which the hooks (bound to the DDP and its process groups) cannot survive."""
        config = copy.copy(self.model_config)
        config.no_sync_func = config.finalize_model_grads_func = config.grad_scale_func = None
        return build_model(self.family, self.hf_config, config, exact=self.exact, fp32_head=self.fp32_head)

    # ------------------------------------------------------------ forward / backward plumbing

    def _token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """[b, t] logprobs from this rank's logits (trainer/logprobs.py), or as vLLM's sampler computes
        them in exact mode."""
        if self.exact:
            return exact.token_logprobs(logits, tokens, temperature, v2=self._exact_v2)
        return token_logprobs(logits, tokens, temperature, fused=self.resolved.kernels.logprobs == "fused")

    def _sampled_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[b, t] logprobs of the distribution the rollout samples from: at its temperature and, under
        rollout.top_k / top_p, renormalised over the tokens its filter keeps (as vLLM reports them)."""
        s = self.sampling
        if not s.truncated:  # exact mode never truncates (colocate_rl.plan)
            return self._token_logprobs(logits, tokens, s.temperature)
        return sampled_token_logprobs(logits, tokens, s.temperature, s.top_k, s.top_p,
                                      fused=self.resolved.kernels.logprobs == "fused")

    def _micro_batches(self, rows: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        """This rank's micro-batches of ``rows`` (trainer/batching.py), by actor.micro_batch_tokens or
        actor.micro_batch_size."""
        a = self.cfg
        return rank_micro_batches(rows, lengths, self.dp, self.dp_rank, a.micro_batch_size, a.micro_batch_tokens)

    def _check_onloaded(self, part: Optional[str] = None) -> None:
        if self._offload.offloaded(part):
            raise RuntimeError(f"the actor's {part or 'state'} is offloaded: call onload() first")

    def _forward_step(self, loss_fn: Callable, data_iterator, model):
        """Megatron forward_step_func: one micro-batch → (output, loss_func bound to it)."""
        item = next(data_iterator)
        tokens = item[0].tokens
        b, t = tokens.shape
        # Sequence parallelism splits the sequence evenly over the tensor-parallel ranks: pad it to a
        # multiple of tp on the right (causal attention leaves the real positions as they are) and
        # drop the padded positions' logits. Every stage gets the tokens (DeepSeek-V4's hash routing).
        pad = -t % self.cfg.tp if self.cfg.sequence_parallel else 0
        inputs = torch.nn.functional.pad(tokens, (0, pad)) if pad else tokens
        positions = torch.arange(t + pad, device=self.device).expand(b, t + pad)
        # Routing replay: every stage gets the whole [b, t, L, k] routing, each MoE layer reads its
        # own column (zeros on the padded positions: they route by themselves, models/replay.py).
        routing = item[0].routed_experts if self._replay is not None else None
        if routing is not None and pad:
            routing = torch.nn.functional.pad(routing, (0, 0, 0, 0, 0, pad))
        with self._replay.replaying(routing) if routing is not None else contextlib.nullcontext():
            output = model(inputs, positions, None)  # last stage: logits [b, t + pad, V/tp]; else hidden states
        if pad and self._ps.is_pipeline_last_stage():
            output = output[:, :t].contiguous()
        if routing is not None:
            self._replay.for_backward(output, routing)
        return output, partial(loss_fn, item, tokens)

    def _run(self, items: list, loss_fn: Callable, forward_only: bool, model=None) -> list:
        """Runs the micro-batches through Megatron's (pipeline) schedule on ``model`` (default: the
        policy); returns the loss_fn outputs collected on the last pipeline stage (empty elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        seq = max(i[0].tokens.shape[1] for i in items)
        try:
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn),
                data_iterator=iter(items),
                model=[self.model if model is None else model],
                num_microbatches=len(items),
                seq_length=seq,
                micro_batch_size=max(i[0].size for i in items),
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
        finally:
            if self._replay is not None:
                self._replay.clear()  # a recomputing backward set the last micro-batch's routing again

    def _last_stage_to_all(self, obj):
        """A JSON value (the step's metrics) from the last pipeline stage to every stage."""
        ps = self._ps
        if ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        return json_wire.broadcast(obj, ps.get_pipeline_model_parallel_world_size() - 1,
                                   ps.get_pipeline_model_parallel_group())

    # ------------------------------------------------------------ logprobs

    @torch.no_grad()
    def compute_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, T] float32 (cpu): logprob of tokens[:, t] given tokens[:, :t]; 0 at t = 0 and on padding."""
        self._check_onloaded()
        self._check_routing(batch)
        self.model.eval()
        return self._logprobs(self.model, batch).cpu()

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """compute_logprobs of the reference policy (brought to the device for the pass, and back)."""
        if self.reference is None:
            raise RuntimeError("no reference policy: it is taken at the first train_step with algorithm.kl_coef > 0")
        with self.reference.resident() as module:
            return self._logprobs(module, batch).cpu()

    def _logprobs(self, model, batch: RolloutBatch) -> torch.Tensor:
        """compute_logprobs of ``model`` (in eval mode), left on the device."""
        b, t = batch.tokens.shape
        lengths = batch.attention_mask.sum(1)
        mine = self._micro_batches(torch.arange(b), lengths)
        items = [(batch.select(rows).to(self.device), rows) for rows in mine]

        def logprobs_of(item, tokens, output, non_loss_data=False):
            return self._sampled_logprobs(output, tokens)

        outputs = self._run(items, logprobs_of, forward_only=True, model=model)
        out = torch.zeros(b, t, dtype=torch.float32, device=self.device)
        if self._ps.is_pipeline_last_stage():
            for (mb, rows), lp in zip(items, outputs):
                out[rows.to(self.device), : lp.shape[1]] = lp.float()
            if self.dp > 1:  # rows of different ranks are disjoint and zero elsewhere
                dist.all_reduce(out, group=self._ps.get_data_parallel_group())
        if self._ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(out, group_src=self._ps.get_pipeline_model_parallel_world_size() - 1,
                           group=self._ps.get_pipeline_model_parallel_group())
        return torch.where(batch.attention_mask.to(self.device), out, 0.0)

    # ------------------------------------------------------------ training

    def train_step(self, batch: RolloutBatch, old_logprobs: Optional[torch.Tensor] = None,
                   ref_logprobs: Optional[torch.Tensor] = None) -> dict[str, float]:
        """GRPO: ``actor.num_minibatches`` optimizer steps over ``batch``. old_logprobs [B, T]: the
        actor's before this call (compute_logprobs); None with one optimizer step, where the training
        forward's own logprobs, detached, are exactly those (no weight has changed yet when each
        micro-batch runs), which saves a forward pass over the batch. ref_logprobs [B, T]: the
        reference policy's, used only when algorithm.kl_coef > 0; None scores the batch with the
        actor's own reference (taken from the policy at the first such call unless a checkpoint
        restored one). Returns metrics averaged over the optimizer steps: loss, grad_norm, lr, the
        loss's own metrics (train_rollout_logprob_abs_diff; kl_ref, the KL estimator's mean over
        response tokens, when kl_coef > 0), tokens and tokens_per_s; with kl_coef > 0 also kl_coef
        and ref_time_s (the reference's forward pass, 0 when ref_logprobs were given)."""
        if batch.advantages is None:
            raise ValueError("RolloutBatch.advantages is None: compute advantages before train_step")
        if old_logprobs is None and self.cfg.num_minibatches > 1:
            raise ValueError(f"actor.num_minibatches={self.cfg.num_minibatches}: every optimizer step after "
                             "the first needs old_logprobs from before the first (compute_logprobs)")
        for name, lp in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
            if lp is not None and lp.shape != batch.tokens.shape:
                raise ValueError(f"{name} has shape {tuple(lp.shape)}, expected {tuple(batch.tokens.shape)}")
        self._check_routing(batch)
        alg, dev = self.algorithm, self.device
        ref_s = 0.0
        if alg.kl_coef > 0 and ref_logprobs is None:
            t0 = time.perf_counter()
            ref_logprobs = self._reference_logprobs(batch)
            ref_s = time.perf_counter() - t0

        def grpo_loss(counts, item, tokens, output):
            mb, old, ref = item
            lp = self._sampled_logprobs(output, tokens)
            loss, metrics = policy_loss(
                lp, lp.detach() if old is None else old, mb.rollout_logprobs, mb.advantages, mb.loss_mask, alg,
                ref_logprobs=ref, max_response_tokens=self.sampling.max_response_tokens, **counts,
            )
            return loss, metrics

        def item(mb: RolloutBatch, rows: torch.Tensor):
            t = mb.tokens.shape[1]
            return (mb, None if old_logprobs is None else old_logprobs[rows, :t].to(dev),
                    None if ref_logprobs is None else ref_logprobs[rows, :t].to(dev))

        out = self._steps(batch, self.cfg.num_minibatches, grpo_loss, item)
        if alg.kl_coef > 0:
            out.update(kl_coef=alg.kl_coef, ref_time_s=ref_s)
        return out

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, T] on the device: the reference's logprobs of the batch, the reference taken from the
        policy now if there is none yet. In host mode its device memory is given back before
        training, so it is never resident together with the activations of the backward pass."""
        self._check_onloaded()
        if self.reference is None:
            self.reference = Reference.snapshot(self._build_reference_module(), self.model.module,
                                                self.cfg.ref_on_device)
        with self.reference.resident() as module:
            out = self._logprobs(module, batch)
            if platform.has_gpu():
                torch.cuda.synchronize()  # the pass's seconds, not its launch's
        return out

    def sft_step(self, batch: RolloutBatch, lr: float) -> dict[str, float]:
        """One optimizer step of supervised NLL on the loss_mask tokens (token mean over the batch),
        at ``lr`` (sft.lr in a run); the RL learning-rate schedule does not advance."""

        def nll_loss(counts, item, tokens, output):
            mb = item[0]
            lp = self._token_logprobs(output, tokens)
            loss = -torch.where(mb.loss_mask, lp, 0).sum() / max(counts["global_token_count"], 1)
            # Rows greedy decoding would answer exactly, before this update: the warm start's accuracy.
            exact = (greedy_hits(output, tokens) | ~mb.loss_mask).all(dim=1)
            rows = exact.new_tensor(len(exact), dtype=torch.float)
            return loss, {"exact_total": exact.sum().float(), "rows_total": rows}

        saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        try:
            return self._steps(batch, 1, nll_loss, lambda mb, rows: (mb,), advance_schedule=False)
        finally:
            for g, v in zip(self.optimizer.param_groups, saved):
                g["lr"] = v

    def _steps(self, batch: RolloutBatch, num_minibatches: int, loss_fn: Callable, make_item: Callable,
               advance_schedule: bool = True) -> dict[str, float]:
        self._check_onloaded()
        self.model.train()
        t0 = time.perf_counter()
        lengths = batch.attention_mask.sum(1)
        steps = []
        for rows in minibatches(batch.size, num_minibatches, self.dp):
            counts = global_counts(batch.loss_mask[rows])
            mine = self._micro_batches(rows, lengths)
            # Every micro-batch goes to the device before the first runs: a host-to-device copy
            # waits for the GPU, so one per micro-batch would stall the queue of launched kernels.
            items = [make_item(batch.select(r).to(self.device), r) for r in mine]
            scale = len(items) * self.dp  # undo Megatron's 1/num_microbatches and DDP's 1/dp (module doc)

            def scaled(item, tokens, output):
                loss, metrics = loss_fn(counts, item, tokens, output)
                n = item[0].loss_mask.sum()
                return loss * scale, {"loss": loss.detach(), "n_tokens": n, **metrics}

            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            per_micro = self._run(items, scaled, forward_only=False)
            lr = self.optimizer.param_groups[0]["lr"]
            # Megatron checks for inf/NaN only under fp16 loss scaling; in bf16/fp32 a NaN gradient
            # would reach Adam and poison every weight. Skip such an update (counted by the loop).
            self._offload.ready()  # a prefetched optimizer state is on the device before the step reads it
            if self._grads_finite():
                ok, grad_norm, _ = self.optimizer.step()
            else:
                ok, grad_norm = False, float("nan")
            if advance_schedule and ok:
                self.scheduler.step(increment=1)
            m = self._reduce_metrics(per_micro)
            m.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=lr,
                     update_skipped=float(not ok), micro_batches=float(len(items)))
            steps.append(m)
        out = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        out["tokens"] = float(batch.attention_mask.sum())
        out["time_s"] = time.perf_counter() - t0
        out["tokens_per_s"] = out["tokens"] / out["time_s"]
        out["optimizer_steps"] = float(len(steps))
        prefetched = self._offload.prefetch_stats()
        if prefetched:  # the copies that ran behind the forward and backward, and their own rate
            out["onload_prefetch_bytes"], out["onload_prefetch_GBps"] = prefetched[0], prefetched[0] / prefetched[1] / 1e9
        return out

    def activation_census(self, batch: RolloutBatch) -> dict[str, int]:
        """Bytes the training forward of ``batch`` (one micro-batch: every row) keeps for its backward,
        by module (trainer/census.py); the logprob loss's own under '<loss>'. Runs the forward and the
        backward, not the optimizer: the weights do not change."""
        self._check_onloaded()
        self.model.train()
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        census = SavedTensorCensus(self.model, params)

        def nll(item, tokens, output):
            mb = item[0]
            lp = self._token_logprobs(output, tokens)
            return -torch.where(mb.loss_mask, lp, 0).sum() / max(int(mb.loss_mask.sum()), 1), {}

        self.model.zero_grad_buffer()
        with census.counting():
            self._run([(batch.to(self.device),)], nll, forward_only=False)
        self.model.zero_grad_buffer()
        return census.by_module()

    def _grads_finite(self) -> bool:
        """Every rank's gradient buffers hold only finite values (one flag, reduced over the world)."""
        ok = torch.ones((), device=self.device)
        for buf in self.model.buffers + self.model.expert_parallel_buffers:
            # In slices: isfinite over a whole buffer would allocate a byte per gradient (7.6 GiB for
            # an 8B model) at the step's peak.
            for part in buf.grad_data.view(-1).split(_FINITE_CHECK_NUMEL):
                ok = ok * torch.isfinite(part).all()
        if dist.get_world_size() > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok)

    def _reduce_metrics(self, per_micro: list[dict]) -> dict[str, float]:
        """Micro-batch metrics → mini-batch values on every rank: 'loss', '*_total' and '*_hist'
        (vectors) summed ('loss' is already normalised globally), '*_max' maxed, the rest averaged
        weighted by loss tokens; then algorithms.gap_summary turns the summed gap parts into floats."""
        ps = self._ps
        out = None
        if ps.is_pipeline_last_stage():
            keys = sorted(k for k in per_micro[0] if k != "n_tokens")
            n = torch.stack([torch.as_tensor(m["n_tokens"], dtype=torch.float64) for m in per_micro]).to(self.device)
            vals = {k: torch.stack([m[k].double() for m in per_micro]).to(self.device) for k in keys}
            summed = {k for k in keys if k == "loss" or k.endswith(("_total", "_hist"))}
            # One flat vector for one all-reduce: a scalar per key, a histogram's bins in a row.
            parts = [vals[k].sum(0) if k in summed else (vals[k] * n).sum() for k in keys]
            sums = torch.cat([x.reshape(-1) for x in parts] + [n.sum().reshape(1)])
            maxes = torch.stack([vals[k].max() for k in keys])
            if self.dp > 1:
                dist.all_reduce(sums, group=ps.get_data_parallel_group())
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
            total = max(float(sums[-1]), 1.0)
            out, at = {}, 0
            for i, k in enumerate(keys):
                size = parts[i].numel()
                if k.endswith("_hist"):
                    out[k] = sums[at:at + size].cpu()
                elif k.endswith("_max"):
                    out[k] = float(maxes[i])
                else:
                    out[k] = float(sums[at]) / (1.0 if k in summed else total)
                at += size
            out = gap_summary(out)
        return self._last_stage_to_all(out)

    # ------------------------------------------------------------ memory

    def _param_tensors(self) -> Iterator[torch.Tensor]:
        for p in self.model.module.parameters():
            yield p
        for buf in self.model.buffers + self.model.expert_parallel_buffers:
            yield buf.param_data  # the distributed optimizer's contiguous parameter buffer

    def _grad_tensors(self) -> Iterator[torch.Tensor]:
        for p in self.model.module.parameters():
            yield getattr(p, "main_grad", None)
            yield p.grad
        for buf in self.model.buffers + self.model.expert_parallel_buffers:
            yield buf.grad_data

    def _optimizer_tensors(self) -> Iterator[torch.Tensor]:
        """fp32 main parameters (bf16 training) and their .grad views, Adam moments; none with the
        host Adam, whose state never leaves host memory."""
        if isinstance(self.optimizer, HostAdam):
            yield from self.optimizer.device_tensors()
            return
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            for g in inner.param_groups:
                for p in g["params"]:
                    yield p
                    yield p.grad
            for state in inner.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def offload(self, parts: Optional[Sequence[str]] = None) -> tuple[int, float]:
        """Moves ``parts`` (default all of params, grads, optimizer) to host memory (pinned on GPU)
        and releases their device memory; the gradients are only released (they come back as zeros).
        Returns (bytes moved, seconds)."""
        return self._offload.offload(parts)

    def onload(self, parts: Optional[Sequence[str]] = None) -> tuple[int, float]:
        """Back to the device in place, every reference stays valid (default: all parts).
        Returns (bytes moved, seconds)."""
        return self._offload.onload(parts)

    def offloaded(self, part: Optional[str] = None) -> bool:
        """Is ``part`` (default: any part) on the host?"""
        return self._offload.offloaded(part)

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, LR schedule and the reference policy (when there is one) into the folder
        ``path`` through megatron-core's distributed checkpointing (collective: each rank writes its
        own shards; the result loads at another TP/PP/EP). Needs every part onloaded; a reference
        kept on the host visits the device for the save."""
        from megatron.core import dist_checkpointing

        from megatron.core.dist_checkpointing.strategies import filesystem_async

        self._check_onloaded()
        self._offload.ready()
        os.makedirs(path, exist_ok=True)
        # A synchronous save writes in threads of this process; megatron-core would otherwise start a
        # spawn-context multiprocessing Manager only to carry their results back, a process that
        # outlives a run ended by os._exit and needs import-safe __main__ modules.
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = queue.Queue()
        ref = self.reference
        with ref.resident() if ref else contextlib.nullcontext():
            dist_checkpointing.save(self._sharded_state(loading=False), str(path),
                                    content_metadata={_HAS_REFERENCE: ref is not None})

    def load_checkpoint(self, path: str) -> None:
        """The inverse of ``save_checkpoint``, resharding to this actor's layout where needed. A
        checkpoint without a reference policy drops this actor's (the next GRPO step with
        algorithm.kl_coef > 0 takes one); with kl_coef = 0 a saved reference is not loaded."""
        from megatron.core import dist_checkpointing

        self._check_onloaded()
        self._offload.ready()
        saved_ref = bool((dist_checkpointing.load_content_metadata(str(path)) or {}).get(_HAS_REFERENCE))
        if not (saved_ref and self.algorithm.kl_coef > 0):
            self.reference = None
        elif self.reference is None:  # its weights come from the checkpoint
            self.reference = Reference(self._build_reference_module(), self.cfg.ref_on_device)
        ref = self.reference
        # Loading optimizer state runs the same tensor-type checks as building the optimizer.
        cpu_types = contextlib.nullcontext() if platform.has_gpu() else platform.megatron_tensor_methods_on_cpu()
        with cpu_types, ref.resident(changed=True) if ref else contextlib.nullcontext():
            state = dist_checkpointing.load(self._sharded_state(loading=True), str(path))
            self.model.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if ref is not None:
                ref.module.load_state_dict(state["ref"])
        self.scheduler.load_state_dict(state["scheduler"])

    def _sharded_state(self, loading: bool) -> dict:
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

        model = self.model.module.sharded_state_dict()
        state = {"model": model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=loading),
                 "scheduler": self.scheduler.state_dict()}  # a plain dict: saved once, in common.pt
        if self.reference is not None:
            # Its own namespace of sharded keys: megatron-core reshards it like the policy's.
            ref = self.reference.module.sharded_state_dict()
            replace_prefix_for_sharding(ref, "", _REF_PREFIX)
            state["ref"] = ref
        return state

    # ------------------------------------------------------------ weights out

    def export_hf_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) one at a time, gathered over tp / ep / pp, on every rank (collective:
        every rank must exhaust the iterator), in ``dtype`` (default: model.dtype), on this rank's
        device. Tensors may share storage with the parameters.
        Needs only the parameters on the device (gradients and optimizer state may be offloaded)."""
        self._check_onloaded("params")
        return export_hf_weights(self.model.module, self.specs, dtype or self.dtype)

    def weight_checksums(self) -> dict[str, float]:
        """weight_sync.verify checksums of the tensors the model family names (Family.verify_names):
        compared with an engine's after a sync. Collective (walks the whole export)."""
        return checksums(self.export_hf_weights(), self.family.verify_names(self.hf_config))
