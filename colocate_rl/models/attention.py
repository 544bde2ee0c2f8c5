"""Causal core attention through torch's scaled_dot_product_attention, for the local (no-TE) spec.

Megatron's own local ``DotProductAttention`` materialises the [b, heads, s, s] score matrix plus a
mask and repeats K/V for GQA; SDPA picks a flash / memory-efficient kernel on GPU and a fused one
on CPU, handles GQA without the copy (``enable_gqa``), and matches HF's default attention path.
Sequences are right-padded, so causal attention alone keeps real tokens from seeing padding: no
mask tensor is built.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron.core.transformer.dot_product_attention.DotProductAttention (causal only).

    query [sq, b, heads/tp, hd], key/value [sk, b, groups/tp, hd] → context [sq, b, heads/tp * hd].
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.heads_per_group = divide(config.num_attention_heads, config.num_query_groups)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention takes neither packed sequences nor an attention bias")
        sq, b, heads, hd = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, n, s, hd]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=self.heads_per_group > 1,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hd)
