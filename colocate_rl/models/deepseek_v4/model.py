"""DeepSeek-V4 as megatron-core modules (megatron-core 0.19.2 has none of its blocks).

Shapes: b batch, s sequence, s' this rank's tokens (s/tp under sequence parallelism, else s),
hc = hc_mult residual streams, D hidden, H heads (H/tp on a rank), d head_dim, r rope_dim, n
compressed entries. The decoder keeps the residual as hc streams [s', b, hc, D] (mHC; Megatron's
sequence-first layout), so it cannot be GPTModel's TransformerBlock; the routed MoE is Megatron's
MoELayer (token dispatcher, SequentialMLP experts, shared expert) with a router that adds hash
routing; projections that split over tensor parallelism are Megatron's Row/ColumnParallelLinear
(o up-projection, head) or HeadSplitLinear (q up-projection: its input is already whole).

What each block computes (numerically the same order as transformers' deepseek_v4, the reference):
  mHC       pre/post/comb weights from the flattened streams (unweighted RMSNorm, one linear),
            comb projected on doubly-stochastic matrices by Sinkhorn; block input = Σ pre·stream;
            new streams = post ⊗ block output + combᵀ · streams.
  attention low-rank q (q_lora_rank) with per-head unweighted RMSNorm, one shared K=V head,
            interleaved RoPE on the trailing rope_dim channels (undone on the output), a learned
            per-head sink logit, a sliding window on every layer, plus compressed entries:
            C4 (ratio 4, overlapping windows, top-k picked by the lightning indexer) or C128
            (ratio 128, all causal entries); grouped low-rank output projection (o_groups).
  MoE       sqrtsoftplus scores, noaux_tc (a frozen bias picks the top-k, unbiased scores weight
            them), routed_scaling_factor, SwiGLU clamped at swiglu_limit, one shared expert; the
            first num_hash_layers pick experts by a frozen token-id → expert table.
Parallelism:
  tensor    heads (q up-projection rows, sinks, o-groups of the grouped o-projection, the row-parallel
            o up-projection), vocabulary (embedding, head) and the shared expert split; the shared
            K=V head, q down-projection, compressor and indexer are small and replicated.
  sequence  required with tensor parallelism (Megatron's MoE trains with TP only under it): the mHC
            mixing, the norms, the router and the routed experts work on this rank's s/tp tokens;
            attention gathers the whole sequence at its entry (every head reads every position) and
            its o up-projection reduce-scatters back. Parameters of the per-token parts get partial
            gradients, summed over the tensor-parallel group by Megatron's finalize_model_grads.
  pipeline  a stage holds a run of decoder layers; the tensor between stages is the streams,
            [s', b, hc·D] (Megatron's p2p carries 3-D tensors); token ids reach every stage (hash
            routing), the embedding is on the first, hc_head/norm/head on the last.
  expert    routed experts split over expert-parallel ranks (Megatron's all-to-all dispatcher),
            whole per rank (expert tensor parallelism 1).
"""

from __future__ import annotations

import functools
import re
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from colocate_rl.models.deepseek_v4.config import Hparams, rope_inv_freq
from colocate_rl.models.deepseek_v4.fp8_emulation import GEMM_GROUP, KV_GROUP, fp8_rounded
from colocate_rl.models.deepseek_v4.ops import (apply_rope, hc_merge, hc_mix_weights, normed_linear,
                                                 rope_cos_sin, unweighted_rms_norm)
from colocate_rl.models.norm import rms_norm_backward
from colocate_rl.models.grouped_experts import with_grouped_experts
from colocate_rl.models.swiglu import SwiGLU, with_activation


# Queries per attention / indexer block: bounds the score tensors at long context.
QUERY_CHUNK = 1024


def _device(config):
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


def _param(config, *shape, dtype=None) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype or config.params_dtype, device=_device(config)))


def _split_param(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """Marks ``p`` as split by rows (dim 0) over tensor parallelism (grad-norm, optimizer, checkpoint)."""
    tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)
    return p


def _per_token(config, *modules) -> None:
    """Parameters of per-token parts (mHC, norms): under sequence parallelism each rank sees only its
    own tokens, so their gradients are partial; Megatron's finalize_model_grads sums the gradients of
    parameters flagged ``sequence_parallel`` over the tensor-parallel group."""
    for m in modules:
        for p in m.parameters():
            p.sequence_parallel = config.sequence_parallel


def _split_params_sharded_state(module, sd: dict, prefix: str, sharded_offsets) -> dict:
    """MegatronModule's default sharded state treats a module's own parameters as replicated; declare
    those split over tensor parallelism (``_split_param``) as sharded along their partition dim, so
    checkpoints reshard across tensor-parallel sizes."""
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    for name, p in module.named_parameters(recurse=False):
        if getattr(p, "tensor_model_parallel", False):
            sd[prefix + name] = make_tp_sharded_tensor_for_checkpoint(p, prefix + name, p.partition_dim,
                                                                      prepend_offsets=sharded_offsets)
    return sd


def _local_rows(t: torch.Tensor) -> torch.Tensor:
    """t [s, ...] → this rank's [s/tp, ...] under sequence parallelism (Megatron's contiguous split)."""
    tp = ps.get_tensor_model_parallel_world_size()
    n = t.shape[0] // tp
    r = ps.get_tensor_model_parallel_rank()
    return t[r * n:(r + 1) * n]


# ---------------------------------------------------------------- small pieces


class _NormFn(torch.autograd.Function):
    """The norm below, keeping only x and the weight for the backward (autograd of the formula keeps
    three fp32 copies of x's size)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (weight.float() * h).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return (*rms_norm_backward(grad, x, weight, ctx.eps), None)


class RMSNorm(torch.nn.Module):
    """x [..., n] → same dtype; normalised in fp32 and multiplied by the weight in fp32 before the
    rounding (the released model keeps its norm weights in fp32)."""

    def __init__(self, config, n: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n, dtype=config.params_dtype, device=_device(config)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NormFn.apply(x, self.weight, self.eps)


class ReplicatedLinear(torch.nn.Module):
    """y = x Wᵀ with W [out, in] whole on every tensor-parallel rank (the shared K=V head, the
    q down-projection, the compressor and indexer: small, and every head needs all of them)."""

    def __init__(self, config, n_in: int, n_out: int):
        super().__init__()
        self.weight = _param(config, n_out, n_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class HeadSplitLinear(MegatronModule):
    """y [..., out/tp] = x Wᵀ with W [out, in] split by rows (this rank's heads) and x whole on every
    rank; x's gradient is summed over the ranks' heads (identity forward, all-reduce backward).
    Megatron's ColumnParallelLinear would all-gather a sequence-parallel input here; the attention
    has gathered the sequence once already."""

    def __init__(self, config, n_in: int, n_out: int):
        super().__init__(config=config)
        self.weight = _split_param(_param(config, n_out // ps.get_tensor_model_parallel_world_size(), n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(tensor_parallel.copy_to_tensor_model_parallel_region(x), self.weight)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return _split_params_sharded_state(self, sd, prefix, sharded_offsets)


# ---------------------------------------------------------------- mHC


class HyperConnection(MegatronModule):
    """mHC around one block: streams [s', b, hc, D] → (post, comb, block input [s', b, D]); per token,
    so the (s', b) order of the leading dims does not matter."""

    def __init__(self, config, h: Hparams):
        super().__init__(config=config)
        n = (2 + h.hc_mult) * h.hc_mult
        self.h = h
        self.fn = _param(config, n, h.hc_mult * h.hidden_size, dtype=torch.float32)
        self.base = _param(config, n, dtype=torch.float32)
        self.scale = _param(config, 3, dtype=torch.float32)

    def forward(self, streams: torch.Tensor):
        h = self.h
        pre, post, comb = hc_mix_weights(streams, self.fn, self.base, self.scale, h.hc_mult, h.hc_sinkhorn_iters,
                                         h.hc_eps, h.rms_norm_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


class HyperHead(MegatronModule):
    """Final merge of the hc streams [s', b, hc, D] → [s', b, D] (sigmoid weights, no Sinkhorn)."""

    def __init__(self, config, h: Hparams):
        super().__init__(config=config)
        self.h = h
        self.fn = _param(config, h.hc_mult, h.hc_mult * h.hidden_size, dtype=torch.float32)
        self.base = _param(config, h.hc_mult, dtype=torch.float32)
        self.scale = _param(config, 1, dtype=torch.float32)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixed = normed_linear(streams.flatten(2), self.fn, self.h.rms_norm_eps)
        pre = torch.sigmoid(mixed * self.scale.float() + self.base.float()) + self.h.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)


# ---------------------------------------------------------------- compressed attention


class Compressor(MegatronModule):
    """Pools every ``ratio`` tokens into one entry: softmax over the window of (gate + position
    bias) weights the projected tokens, then RMSNorm and RoPE at the window's first position.
    ``overlap`` (C4 and the indexer): each token projects two series, the entry of window w mixes
    window w-1's first series with window w's second (width 2·ratio, stride ratio)."""

    def __init__(self, config, h: Hparams, ratio: int, dim: int, overlap: bool):
        super().__init__(config=config)
        width = 2 * dim if overlap else dim
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        self.linear_kv = ReplicatedLinear(config, h.hidden_size, width)
        self.linear_gate = ReplicatedLinear(config, h.hidden_size, width)
        self.position_bias = _param(config, ratio, width, dtype=torch.float32)
        self.norm = RMSNorm(config, dim, h.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin_of) -> torch.Tensor:
        """x [b, s, D] → entries [b, n, dim] with n = s // ratio (a trailing partial window is dropped)."""
        b, s, _ = x.shape
        n, m, d = s // self.ratio, self.ratio, self.dim
        if n == 0:
            return x.new_zeros(b, 0, d)
        kv = self.linear_kv(x)[:, : n * m].view(b, n, m, -1)
        gate = self.linear_gate(x)[:, : n * m].view(b, n, m, -1) + self.position_bias
        if self.overlap:
            first_kv = torch.cat([kv.new_zeros(b, 1, m, d), kv[:, :-1, :, :d]], dim=1)
            first_gate = torch.cat([gate.new_full((b, 1, m, d), float("-inf")), gate[:, :-1, :, :d]], dim=1)
            kv = torch.cat([first_kv, kv[..., d:]], dim=2)
            gate = torch.cat([first_gate, gate[..., d:]], dim=2)
        pooled = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        positions = (torch.arange(n, device=x.device) * m).unsqueeze(0).expand(b, -1)
        cos, sin = cos_sin_of(positions, pooled.dtype)
        return apply_rope(pooled.unsqueeze(2), cos, sin).squeeze(2)


class Indexer(MegatronModule):
    """Lightning indexer of C4 layers: score(t, w) = Σ_h w_{t,h} · ReLU(q_{t,h} · k_w) over its own
    compressed keys; each query keeps the top index_topk causal entries (−1 marks a pick past
    the causal limit)."""

    def __init__(self, config, h: Hparams, ratio: int):
        super().__init__(config=config)
        self.h, self.ratio = h, ratio
        self.compressor = Compressor(config, h, ratio, h.index_head_dim, overlap=True)
        self.linear_q_up = ReplicatedLinear(config, h.q_lora_rank, h.index_n_heads * h.index_head_dim)
        self.linear_weights = ReplicatedLinear(config, h.hidden_size, h.index_n_heads)

    def forward(self, x, q_residual, positions, cos_sin_of, chunk: int) -> torch.Tensor:
        """Picks [b, s, min(index_topk, n)] (−1: none); queries scored ``chunk`` at a time, so the
        [b, chunk, heads, n] score block bounds the memory."""
        h = self.h
        b, s, _ = x.shape
        keys = self.compressor(x, cos_sin_of).float().transpose(-1, -2).unsqueeze(1)  # [b, 1, c, n]
        n = keys.shape[-1]
        q = self.linear_q_up(q_residual).view(b, s, h.index_n_heads, h.index_head_dim)
        cos, sin = cos_sin_of(positions, x.dtype)
        q = apply_rope(q, cos, sin)
        weights = self.linear_weights(x).float() * h.index_n_heads ** -0.5  # [b, s, heads]
        limit = (positions + 1) // self.ratio  # entries w < limit are complete before t
        entry = torch.arange(n, device=x.device).view(1, 1, -1)
        picks = []
        for q0 in range(0, s, chunk):
            sl = slice(q0, q0 + chunk)
            scores = F.relu(torch.matmul(q[:, sl].float(), keys)) * h.index_head_dim ** -0.5  # [b, c, heads, n]
            scores = (scores * weights[:, sl].unsqueeze(-1)).sum(dim=2)  # [b, c, n]
            lim = limit[:, sl].unsqueeze(-1)
            # A stable sort, not topk: equal scores (ReLU makes exact zeros common) go to the lowest
            # entry index. topk breaks such ties by the tensor's length, so a row's picks (and its
            # logprobs) would change with the padding of its micro-batch.
            scores = scores.masked_fill(entry >= lim, float("-inf"))
            top = scores.sort(dim=-1, descending=True, stable=True).indices[..., : min(h.index_topk, n)]
            picks.append(torch.where(top >= lim, torch.full_like(top, -1), top))
        return torch.cat(picks, dim=1)


class Attention(MegatronModule):
    """x [b, s, D] → [b, s, D] for one decoder layer (window, C4 or C128 by compress_ratios)."""

    def __init__(self, config, h: Hparams, layer: int):
        super().__init__(config=config)
        tp = ps.get_tensor_model_parallel_world_size()
        self.h, self.ratio = h, h.compress_ratios[layer]
        self.heads = h.num_heads // tp
        self.groups = h.o_groups // tp
        init = config.init_method
        self.linear_q_down = ReplicatedLinear(config, h.hidden_size, h.q_lora_rank)
        self.q_layernorm = RMSNorm(config, h.q_lora_rank, h.rms_norm_eps)
        self.linear_q_up = HeadSplitLinear(config, h.q_lora_rank, h.num_heads * h.head_dim)
        self.linear_kv = ReplicatedLinear(config, h.hidden_size, h.head_dim)
        self.kv_layernorm = RMSNorm(config, h.head_dim, h.rms_norm_eps)
        # Grouped output projection: group g maps its heads' H·d/G channels to o_lora_rank; the
        # groups (whole heads) split over tensor parallelism, then a row-parallel mix to D.
        self.linear_o_down = _split_param(
            _param(config, self.groups * h.o_lora_rank, h.num_heads * h.head_dim // h.o_groups))
        # Under sequence parallelism its output is reduce-scattered to this rank's tokens.
        self.linear_proj = tensor_parallel.RowParallelLinear(
            h.o_groups * h.o_lora_rank, h.hidden_size, config=config, init_method=init, bias=False,
            input_is_parallel=True, skip_bias_add=True)
        self.sinks = _split_param(_param(config, self.heads, dtype=torch.float32))
        self.register_buffer("inv_freq", rope_inv_freq(h, compress=self.ratio > 0), persistent=False)
        self.register_buffer("compress_inv_freq", rope_inv_freq(h, compress=True), persistent=False)
        self.compressor = Compressor(config, h, self.ratio, h.head_dim, overlap=self.ratio == 4) if self.ratio else None
        self.indexer = Indexer(config, h, self.ratio) if self.ratio == 4 else None
        self.query_chunk = QUERY_CHUNK
        self.fp8_inputs = False  # round wo_a's input as an FP8 engine does (emulate_fp8_engine)

    def _compress_cos_sin(self, positions, dtype):
        return rope_cos_sin(self.compress_inv_freq, positions, dtype)

    def _entries(self, x, positions, q_residual):
        """(compressed entries [b, n, d], their additive mask [b, s, n]) or (None, None)."""
        if self.compressor is None:
            return None, None
        b, s, _ = x.shape
        entries = self.compressor(x, self._compress_cos_sin)
        n = entries.shape[1]
        if self.indexer is None:  # C128: every entry whose window closed before the query
            limit = (positions + 1) // self.ratio
            hidden = torch.arange(n, device=x.device).view(1, 1, -1) >= limit.unsqueeze(-1)
            return entries, torch.zeros(b, s, n, dtype=x.dtype, device=x.device).masked_fill(hidden, float("-inf"))
        picks = self.indexer(x, q_residual, positions, self._compress_cos_sin, self.query_chunk)  # C4: its picks
        safe = torch.where(picks >= 0, picks, torch.full_like(picks, n))
        block = torch.full((b, s, n + 1), float("-inf"), dtype=x.dtype, device=x.device)
        return entries, block.scatter(-1, safe, 0.0)[..., :n]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return _split_params_sharded_state(self, sd, prefix, sharded_offsets)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [s', b, D], positions [b, s] (whole sequence) → [s', b, D]."""
        h = self.h
        if self.config.sequence_parallel:
            # Every head reads every position: gather the sequence. Below, every path from x into
            # this rank's heads all-reduces its gradient (linear_q_up, the K=V head and the entries),
            # so x's gradient is whole and equal on all ranks: the backward keeps this rank's part.
            x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        x = x.transpose(0, 1)  # [b, s, D]
        b, s, _ = x.shape
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        q_residual = self.q_layernorm(self.linear_q_down(x))
        q = self.linear_q_up(q_residual)
        q = unweighted_rms_norm(q.view(b, s, self.heads, h.head_dim), h.rms_norm_eps)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [b, H/tp, s, d]
        kv = apply_rope(self.kv_layernorm(self.linear_kv(x)).view(b, s, 1, h.head_dim), cos, sin).squeeze(2)
        entries, block = self._entries(x, positions, q_residual)
        # Every head reads the one shared K=V head: with heads split over tensor parallelism its
        # gradient is a sum over all ranks' heads (identity forward, all-reduce backward).
        kv = tensor_parallel.copy_to_tensor_model_parallel_region(kv)
        if entries is not None:
            entries = tensor_parallel.copy_to_tensor_model_parallel_region(entries)
        # Queries in chunks: a chunk reads only its window's keys (W - 1 before it) and the
        # compressed entries, so memory grows as s·(W + chunk + n), not s².
        sinks = self.sinks.float().view(1, -1, 1, 1)
        idx = torch.arange(s, device=x.device)
        outs = []
        for q0 in range(0, s, self.query_chunk):
            q1 = min(q0 + self.query_chunk, s)
            k0 = max(0, q0 - h.sliding_window + 1)
            keys = kv[:, k0:q1]
            qi, kj = idx[q0:q1, None], idx[None, k0:q1]
            allowed = (kj <= qi) & (kj > qi - h.sliding_window)
            mask = torch.zeros(q1 - q0, q1 - k0, dtype=x.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
            mask = mask.expand(b, 1, -1, -1)
            if entries is not None:
                keys = torch.cat([keys, entries], dim=1)
                mask = torch.cat([mask, block[:, None, q0:q1]], dim=-1)
            logits = torch.matmul(q[:, :, q0:q1], keys.transpose(1, 2).unsqueeze(1)) * h.head_dim ** -0.5 + mask
            # The sink logit is fp32 (the released model keeps it so): with it the softmax runs in
            # fp32; its column takes probability mass and adds nothing to the output.
            logits = torch.cat([logits.float(), sinks.expand(b, -1, q1 - q0, 1)], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
            outs.append(torch.matmul(probs, keys.unsqueeze(1)))
        out = torch.cat(outs, dim=2).transpose(1, 2)  # [b, s, H/tp, d]
        # K = V carries RoPE on its trailing channels: rotate the output back by the query position.
        out = apply_rope(out, cos, -sin)
        grouped = out.reshape(b, s, self.groups, -1)
        if self.fp8_inputs:
            grouped = fp8_rounded(grouped, GEMM_GROUP)
        w = self.linear_o_down.view(self.groups, h.o_lora_rank, -1)
        grouped = torch.einsum("bsgi,goi->bsgo", grouped, w).flatten(2)
        y, _ = self.linear_proj(grouped.transpose(0, 1))  # [s', b, D]
        return y


# ---------------------------------------------------------------- MoE


def _router_class():
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router import TopKRouter

    class Router(TopKRouter):
        """Megatron's TopKRouter (sqrtsoftplus, expert bias = noaux_tc's correction, held frozen)
        plus hash routing: with ``hash_vocab`` the experts come from ``tid2eid[token]`` and the
        learned gate only weights them (no bias)."""

        def __init__(self, config, pg_collection=None, is_mtp_layer=False, hash_vocab: int = 0):
            super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
            # RL keeps the released routing bias: Megatron would move it by bias_update_rate each step.
            self.frozen_expert_bias = True
            self.is_hash = hash_vocab > 0
            self.token_ids: Optional[torch.Tensor] = None  # [s, b], set by the layer before each call
            if self.is_hash:
                # int32, the released checkpoint's dtype (exported as it is).
                self.register_buffer("tid2eid", torch.zeros(hash_vocab, self.topk, dtype=torch.int32,
                                                            device=self.weight.device))

        def routing(self, logits: torch.Tensor, padding_mask=None):
            if not self.is_hash:
                return super().routing(logits, padding_mask)
            if self.token_ids is None:
                raise ValueError("hash-routed MoE layer called without token ids")
            logits = logits.view(-1, self.config.num_moe_experts)
            chosen = self.tid2eid[self.token_ids.reshape(-1)].long()
            return topk_routing_with_score_function(
                logits, self.topk, use_pre_softmax=False, scaling_factor=self.config.moe_router_topk_scaling_factor,
                score_function=self.score_function, precomputed_indices=chosen, fused=False)

    return Router


def moe_layer(config, h: Hparams, layer: int):
    """Megatron MoELayer with local SequentialMLP experts and a shared expert (no gate)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    spec = get_moe_module_spec(use_te=False, num_experts=h.num_experts, moe_grouped_gemm=False)
    sub = spec.keywords["submodules"]
    router = functools.partial(_router_class(), hash_vocab=h.vocab_size if h.is_hash(layer) else 0)
    sub = MoESubmodules(experts=sub.experts, shared_experts=functools.partial(sub.shared_experts, gate=False),
                        router=router)
    # Every expert's clamped SwiGLU keeps only its input for the backward (models/swiglu.py); the
    # experts can run grouped (models/grouped_experts.py, actor.expert_kernel).
    build = with_grouped_experts(with_activation(functools.partial(MoELayer, submodules=sub), SwiGLU))
    moe = build(config=config, layer_number=layer + 1)
    # Routed experts get an optimizer of their own at every layout. Megatron gives them one (its
    # expert-parallel parameters, allreduce=False) whenever EP > 1 or expert TP != TP, so for this
    # model at every layout but TP=1 x EP=1; the optimizer's checkpoint is structured by that
    # split, and with one structure everywhere a checkpoint reshards between any two layouts. At
    # TP=1 x EP=1 the expert data-parallel group is the data-parallel group: the same reductions.
    for p in moe.experts.parameters():
        p.allreduce = False
    return moe


# ---------------------------------------------------------------- decoder


class DecoderLayer(MegatronModule):
    """streams [s', b, hc, D] → streams: mHC(attention), then mHC(MoE). ``layer`` is the global index."""

    def __init__(self, config, h: Hparams, layer: int):
        super().__init__(config=config)
        self.layer_number = layer + 1
        self.attn_hc = HyperConnection(config, h)
        self.input_layernorm = RMSNorm(config, h.hidden_size, h.rms_norm_eps)
        self.self_attention = Attention(config, h, layer)
        self.mlp_hc = HyperConnection(config, h)
        self.pre_mlp_layernorm = RMSNorm(config, h.hidden_size, h.rms_norm_eps)
        self.mlp = moe_layer(config, h, layer)
        _per_token(config, self.attn_hc, self.input_layernorm, self.mlp_hc, self.pre_mlp_layernorm)

    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """token_ids [s', b] (this rank's tokens: the hash router's input), positions [b, s]."""
        post, comb, x = self.attn_hc(streams)
        streams = hc_merge(streams, self.self_attention(self.input_layernorm(x), positions), post, comb)
        post, comb, x = self.mlp_hc(streams)
        self.mlp.router.token_ids = token_ids
        y, _ = self.mlp(self.pre_mlp_layernorm(x))
        return hc_merge(streams, y, post, comb)


class Decoder(MegatronModule):
    """This pipeline stage's decoder layers (global numbering: Megatron's even or uneven split), and
    the final stream merge and norm on the last stage."""

    def __init__(self, config, h: Hparams, post_process: bool = True):
        super().__init__(config=config)
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        first = get_transformer_layer_offset(config)
        self.layers = torch.nn.ModuleList(
            [DecoderLayer(config, h, first + i) for i in range(get_num_layers_to_build(config))])
        if post_process:
            self.hc_head = HyperHead(config, h)
            self.final_layernorm = RMSNorm(config, h.hidden_size, h.rms_norm_eps)
            _per_token(config, self.hc_head, self.final_layernorm)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Checkpoint keys name layers by their global index (layers differ in kind: window / C4 /
        C128, hash or learned routing), so a checkpoint reshards across pipeline layouts."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import sharded_state_dict_default

        sd = {}
        for i, layer in enumerate(self.layers):
            local, glob = f"{prefix}layers.{i}.", f"{prefix}layers.{layer.layer_number - 1}."
            part = layer.sharded_state_dict(local, (), metadata)
            replace_prefix_for_sharding(part, local, glob)
            sd.update(part)
        for name, module in self.named_children():
            if module is not self.layers:
                # The group must be named: without it a replicated tensor's replica id says TP rank 0 on
                # every rank, and loading finds several main replicas.
                sd.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                     tp_group=ps.get_tensor_model_parallel_group()))
        return sd


class Embedding(MegatronModule):
    def __init__(self, config, h: Hparams):
        super().__init__(config=config)
        # Under sequence parallelism the lookup's vocabulary-parallel sum is a reduce-scatter to
        # this rank's tokens ([b, s] ids → [s/tp, b, D]).
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            h.vocab_size, h.hidden_size, init_method=config.init_method, config=config,
            reduce_scatter_embeddings=config.sequence_parallel)


class DeepseekV4Model(MegatronModule):
    """tokens [b, s], positions [b, s] → logits [b, s, V/tp] (this rank's vocabulary slice), the
    contract of GPTModel's forward without labels; on a stage before the last, the streams
    [s', b, hc·D] for the next stage. Every stage takes the tokens (hash routing)."""

    def __init__(self, config, h: Hparams, pre_process: bool = True, post_process: bool = True):
        super().__init__(config=config)
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder  # read by Megatron's schedules
        # Read by finalize_model_grads under pipeline parallelism: the head is its own weight, so no
        # embedding gradient crosses stages.
        self.share_embeddings_and_output_weights = False
        self.h, self.pre_process, self.post_process = h, pre_process, post_process
        self.input_tensor: Optional[torch.Tensor] = None
        if pre_process:
            self.embedding = Embedding(config, h)
        self.decoder = Decoder(config, h, post_process)
        if post_process:
            # Under sequence parallelism it all-gathers the tokens first (and reduce-scatters back).
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                h.hidden_size, h.vocab_size, config=config, init_method=config.init_method, bias=False,
                gather_output=False, skip_bias_add=True)

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's schedules hand a stage after the first the previous stage's output here
        ([s', b, hc·D], or a one-element list of it) before each forward."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"deepseek_v4 takes one input tensor per stage, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def decoder_streams(self, input_ids: torch.Tensor, positions: torch.Tensor, upto: Optional[int] = None):
        """Streams [s', b, hc, D] after this stage's first ``upto`` decoder layers (all by default)."""
        h = self.h
        if self.pre_process:
            x = self.embedding.word_embeddings(input_ids)  # [s', b, D] under sequence parallelism, else [b, s, D]
            if not self.config.sequence_parallel:
                x = x.transpose(0, 1)
            streams = x.unsqueeze(2).expand(-1, -1, h.hc_mult, -1).contiguous()
        else:
            if self.input_tensor is None:
                raise ValueError("deepseek_v4 stage without embedding called before set_input_tensor")
            streams = self.input_tensor.view(*self.input_tensor.shape[:2], h.hc_mult, h.hidden_size)
        token_ids = input_ids.t()
        if self.config.sequence_parallel:
            token_ids = _local_rows(token_ids)
        full = self.config.recompute_granularity == "full" and self.training
        for layer in self.decoder.layers[:upto]:
            if full:
                streams = tensor_parallel.checkpoint(layer, False, streams, token_ids, positions)
            else:
                streams = layer(streams, token_ids, positions)
        return streams

    def hidden_streams(self, input_ids: torch.Tensor, positions: torch.Tensor, upto: Optional[int] = None):
        """Streams [b, s, hc, D] after ``upto`` decoder layers (a whole model on one rank: tests)."""
        return self.decoder_streams(input_ids, positions, upto).transpose(0, 1)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, attention_mask=None,
                **kwargs) -> torch.Tensor:
        """attention_mask must be None: rows are right-padded and attention is causal. Under sequence
        parallelism s must divide by the tensor-parallel size (the actor pads)."""
        if attention_mask is not None:
            raise ValueError("DeepseekV4Model takes no attention_mask (right-padded rows, causal attention)")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        streams = self.decoder_streams(input_ids, position_ids)
        if not self.post_process:
            return streams.flatten(2)
        logits, _ = self.output_layer(self.decoder.final_layernorm(self.decoder.hc_head(streams)))
        return logits.transpose(0, 1).contiguous()


# ---------------------------------------------------------------- an FP8 engine's roundings (fp8_emulation.py)

# Modules (below decoder.layers.N.) whose weight the released checkpoint holds as FP8 blocks: their
# input is rounded. wo_a is an einsum inside the attention, not a module (Attention.fp8_inputs).
FP8_LINEARS = re.compile(r"\.(self_attention\.(linear_q_down|linear_kv|linear_q_up|linear_proj|indexer\.linear_q_up)"
                         r"|mlp\.shared_experts\.linear_fc[12])$")
# Modules whose output vLLM caches: the K=V head's norm (RoPE only turns its trailing channels) and
# the attention's compressor (its entries); not the indexer's compressor, whose keys have a cache
# and a format of their own.
CACHED_KEYS = re.compile(r"\.self_attention\.(kv_layernorm|compressor)$")


def emulate_fp8_engine(model: torch.nn.Module, rope_dim: int, gemm_inputs: bool = True, kv_cache: bool = True):
    """Makes ``model``'s forward round as the FP8 engine does (fp8_emulation.py): the input of its
    FP8 linears and of the attention's wo_a (``gemm_inputs``), the keys it caches (``kv_cache``).
    Returns a function that takes the roundings out again. Raises if nothing matched (a renamed
    module would otherwise round nothing)."""
    hooks, attentions = [], []
    for name, m in model.named_modules():
        if gemm_inputs and FP8_LINEARS.search(name):
            hooks.append(m.register_forward_pre_hook(lambda m, args: (fp8_rounded(args[0], GEMM_GROUP), *args[1:])))
        elif kv_cache and CACHED_KEYS.search(name):
            hooks.append(m.register_forward_hook(
                lambda m, args, out: fp8_rounded(out, KV_GROUP, out.shape[-1] - rope_dim)))
        elif gemm_inputs and isinstance(m, Attention):
            m.fp8_inputs = True
            attentions.append(m)
    if not hooks and not attentions:
        raise ValueError("actor.emulate_rollout_fp8: no DeepSeek-V4 module to round in this model")

    def remove() -> None:
        for h in hooks:
            h.remove()
        for m in attentions:
            m.fp8_inputs = False

    return remove
