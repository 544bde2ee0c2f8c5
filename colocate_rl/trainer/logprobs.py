"""Per-token logprobs from (vocab-parallel) logits, aligned as in colocate_rl.types.

The vocabulary is the widest axis in the model (151,936 for Qwen3), so the loss's own tensors are
a large share of a step's activations. Taking log_softmax of an fp32 copy of the logits through
autograd keeps that fp32 softmax for the backward: 4 bytes per vocabulary entry and token, on top
of the 16-bit logits alive while it is made. Here the logprobs are computed in row chunks from the
logits as they are, and only the logits and two floats per token (max and log-sum-exp) are kept;
the backward recomputes each chunk's softmax. Half the bytes kept in a 16-bit model, and the fp32
temporaries never exceed one chunk (benchmarks/memory/activation_census.py measures it).

Under tensor parallelism each rank holds a slice of the vocabulary: max and sum-exp are all-reduced
over the tensor-parallel group and the target's logit comes from the rank that holds it, so the
whole vocabulary is never gathered (as megatron-core's vocab_parallel_cross_entropy does it).

The chunks still write and re-read fp32 copies: ~74 bytes of memory traffic per logit for the
forward and backward together, about 6 TB a step at 64 x 8 x 1024 tokens of a 151,936-word
vocabulary. ``fused=True`` computes the same quantities through torch.compile'd kernels that read
the 16-bit logits and keep every fp32 value in registers: the row max, the sum of exponentials
and the target's logit each in one pass over the rows, the gradient in one (~8 bytes per logit),
and no fp32 temporaries at all; several times as fast on a GPU (docs/performance.md,
actor.logprob_kernel).
actor.logprob_kernel picks the path (auto: fused on a GPU, chunked on the CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from colocate_rl.platform import compiled

# fp32 elements of one chunk's temporaries (256 MiB): rows per chunk = this // the vocabulary slice.
CHUNK_ELEMENTS = 1 << 26
# Logits per chunk when finding the sampler's support (top-k / top-p): its sort, softmax and sums
# take ~6 temporaries of this many fp32 values, over whole rows of the vocabulary.
SUPPORT_CHUNK_ELEMENTS = 1 << 24


def _tp_group():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_tensor_model_parallel_world_size() == 1:
        return None, 0
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


def _chunks(n: int, width: int, elements: int = 0):
    rows = max(1, (elements or CHUNK_ELEMENTS) // max(width, 1))
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


def _scaled(logits: torch.Tensor, rows: slice, temperature: float) -> torch.Tensor:
    """A fresh fp32 copy of rows of the logits, divided by the temperature (free to write into)."""
    x = logits[rows].to(torch.float32, copy=True)
    if temperature != 1.0:
        x /= temperature
    return x


def _row_max(logits, temperature):
    """logits [N, V] → [N] float32: each row's max of logits / temperature."""
    return (logits.float() / temperature).amax(dim=-1)


def _sum_exp_and_target(logits, peak, index, local, temperature):
    """→ ([N] sum of exp(x - peak), [N] x[target] - peak where this rank holds the target, else 0),
    x = logits / temperature in fp32."""
    x = logits.float() / temperature - peak[:, None]
    return x.exp().sum(dim=-1), torch.where(local, x.gather(1, index)[:, 0], 0.0)


def _input_grad(logits, index, local, peak, log_sum_exp, grad, temperature):
    """[N, V] in the logits' dtype: grad times d log p(target) / d logit_j = ([j = target] - softmax_j)
    / temperature."""
    x = logits.float() / temperature
    g = grad.float()[:, None]
    d = -torch.exp(x - peak[:, None] - log_sum_exp[:, None]) * g
    hit = (torch.arange(logits.shape[1], device=logits.device) == index) & local[:, None]
    return (torch.where(hit, d + g, d) / temperature).to(logits.dtype)


class _VocabParallelLogprobs(torch.autograd.Function):
    """logits [N, V/tp], targets [N] (global ids) → [N] float32 log p(target) at ``temperature``: the
    same operations, in the same order, as megatron-core's vocab_parallel_cross_entropy, by chunks;
    or with ``fused``, the same quantities through compiled kernels (module docstring)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, fused):
        group, rank = _tp_group()
        n, width = logits.shape
        start = rank * width
        local = (targets >= start) & (targets < start + width)
        index = torch.where(local, targets - start, 0)[:, None]
        if fused:
            peak = compiled(_row_max)(logits, temperature)
            if group is not None:  # the max must be the group's before any exp
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            sum_exp, target = compiled(_sum_exp_and_target)(logits, peak, index, local, temperature)
        else:
            peak = torch.empty(n, dtype=torch.float32, device=logits.device)
            sum_exp, target = torch.empty_like(peak), torch.empty_like(peak)
            if group is not None:  # the max must be the group's before any exp
                for rows in _chunks(n, width):
                    peak[rows] = _scaled(logits, rows, temperature).max(dim=-1).values
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            for rows in _chunks(n, width):
                x = _scaled(logits, rows, temperature)
                if group is None:
                    peak[rows] = x.max(dim=-1).values
                x -= peak[rows, None]
                target[rows] = torch.where(local[rows], x.gather(1, index[rows])[:, 0], 0.0)
                sum_exp[rows] = x.exp_().sum(dim=-1)
        if group is not None:
            dist.all_reduce(sum_exp, group=group)
            dist.all_reduce(target, group=group)
        log_sum_exp = sum_exp.log_()
        ctx.save_for_backward(logits, local, index, peak, log_sum_exp)
        ctx.temperature, ctx.fused = temperature, fused
        return target - log_sum_exp

    @staticmethod
    def backward(ctx, grad):
        logits, local, index, peak, log_sum_exp = ctx.saved_tensors
        t = ctx.temperature
        if ctx.fused:
            return compiled(_input_grad)(logits, index, local, peak, log_sum_exp, grad, t), None, None, None
        out = torch.empty_like(logits)
        for rows in _chunks(*logits.shape):
            p = _scaled(logits, rows, t).sub_(peak[rows, None]).sub_(log_sum_exp[rows, None]).exp_()  # softmax
            g = grad[rows, None].float()
            d = p.mul_(-g)  # d log p(target) / d logit_j = [j = target] - softmax_j, times the incoming grad
            d.scatter_add_(1, index[rows], torch.where(local[rows, None], g, 0.0))
            out[rows] = d / t if t != 1.0 else d
        return out, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   fused: bool = False) -> torch.Tensor:
    """logits [b, t, V/tp] (this tensor-parallel rank's vocabulary slice), tokens [b, t] → [b, t]
    float32 with out[:, t] = log p(tokens[t] | tokens[:t]) and out[:, 0] = 0. ``fused``: through
    compiled kernels instead of fp32 chunks (module docstring)."""
    b, t, width = logits.shape
    # Position t predicts tokens[t + 1]; the last position predicts nothing (its target is a dummy).
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1)).reshape(-1)
    lp = _VocabParallelLogprobs.apply(logits.reshape(b * t, width), targets, float(temperature), fused).view(b, t)
    return torch.nn.functional.pad(lp[:, :-1], (1, 0))


def sampler_support(x: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """x [N, V] float32, the logits after the temperature → [N, V] bool: the tokens vLLM's sampler
    keeps, computed as its top-k then top-p filter computes them (vllm/v1/sample/ops/
    topk_topp_sampler.py, apply_top_k_top_p_pytorch: its CPU path). Top-k keeps every logit at
    least the k-th largest (all ties at the k-th). Top-p sorts the row ascending (torch's default
    sort, as vLLM calls it), drops the top-k cut, and then every token whose probability summed from
    the least likely up stays <= 1 - top_p (in fp32, as vLLM's float32 top_p tensor), never the most
    likely one; of tokens tied at that boundary, the sort's order decides which go first.
    top_k 0 or >= V, top_p 1: no filter."""
    vocab = x.shape[-1]
    top_k = top_k if 0 < top_k < vocab else 0
    if top_p >= 1.0:
        if not top_k:
            return torch.ones_like(x, dtype=torch.bool)
        return x >= x.topk(top_k, dim=-1).values[:, -1:]  # vLLM's top-k without a sort
    ascending, order = x.sort(dim=-1)
    if top_k:
        ascending = ascending.masked_fill(ascending < ascending[:, vocab - top_k, None], float("-inf"))
    mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = mass <= 1 - torch.tensor(top_p, dtype=torch.float32, device=x.device)
    drop[:, -1] = False
    kept = ascending.masked_fill(drop, float("-inf")).isfinite()
    return torch.empty_like(kept).scatter_(-1, order, kept)


@torch.no_grad()
def _sampled_support(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int,
                     top_p: float) -> torch.Tensor:
    """logits [N, V/tp], targets [N] (global ids) → [N, V/tp] bool: sampler_support of each row's
    whole vocabulary at ``temperature`` (gathered over the tensor-parallel group chunk by chunk),
    this rank's slice of it, with the target always kept: where the two sides' logits differ
    slightly the boundary can move, and a sampled token must keep a finite logprob."""
    group, rank = _tp_group()
    n, width = logits.shape
    world = 1 if group is None else dist.get_world_size(group)
    t = torch.full((1,), temperature, dtype=torch.float32, device=logits.device)  # divided as vLLM divides
    keep = torch.empty(n, width, dtype=torch.bool, device=logits.device)
    for rows in _chunks(n, width * world, SUPPORT_CHUNK_ELEMENTS):
        x = logits[rows].float()
        if group is not None:
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous(), group=group)
            x = torch.cat(parts, dim=-1)
        kept = sampler_support(x / t, top_k, top_p)
        kept[torch.arange(kept.shape[0], device=kept.device), targets[rows]] = True
        keep[rows] = kept[:, rank * width:(rank + 1) * width]
    return keep


def sampled_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_k: int = 0,
                           top_p: float = 1.0, fused: bool = False) -> torch.Tensor:
    """token_logprobs of the distribution vLLM samples from under top-k / top-p: the logits outside
    ``sampler_support`` are -inf, so each logprob is renormalised over the tokens the sampler kept,
    as vLLM's processed logprobs are. No gradient reaches the dropped logits. With neither filter
    this is token_logprobs itself."""
    if top_k <= 0 and top_p >= 1.0:
        return token_logprobs(logits, tokens, temperature, fused)
    b, t, width = logits.shape
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1)).reshape(-1)
    keep = _sampled_support(logits.reshape(b * t, width), targets, temperature, top_k, top_p).view(b, t, width)
    return token_logprobs(logits.masked_fill(~keep, float("-inf")), tokens, temperature, fused)


@torch.no_grad()
def greedy_hits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [b, t, V/tp], tokens [b, t] → [b, t] bool, aligned as token_logprobs: out[:, t] is
    whether tokens[t] is the most likely token after tokens[:t] (what greedy decoding would pick;
    out[:, 0] False). Under tensor parallelism the row max and the target's logit are all-reduced."""
    group, rank = _tp_group()
    width = logits.shape[-1]
    targets = torch.nn.functional.pad(tokens[:, 1:], (0, 1))
    peak = logits.amax(dim=-1)
    local = (targets >= rank * width) & (targets < (rank + 1) * width)
    index = (targets - rank * width).clamp(0, width - 1)
    target = torch.where(local, logits.gather(-1, index[..., None])[..., 0], float("-inf"))
    if group is not None:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(target, op=dist.ReduceOp.MAX, group=group)
    return torch.nn.functional.pad((target >= peak)[:, :-1], (1, 0))
