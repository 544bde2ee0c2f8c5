"""Build this rank's Megatron GPTModel for an HF model folder (parallel state must be initialised)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from colocate_rl import platform
from colocate_rl.models.mapping import load_hf_weights
from colocate_rl.models.registry import Family, family_for, read_hf_config


def te_available() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def build_model(family: Family, hf: dict, config, use_te: Optional[bool] = None, exact: bool = False,
                fp32_head: bool = False):
    """This pipeline stage's model: the family's own builder, else a GPTModel (embedding on the first
    stage, output on the last). ``exact``: the family's exact spec (rollout.exact, models/exact.py);
    ``fp32_head``: fp32 logits (model.head_dtype=float32, see fp32_output_layer)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    use_te = te_available() and platform.has_gpu() if use_te is None else use_te
    if exact:
        from colocate_rl.models import exact as E

        model = GPTModel(config, family.exact_layer_spec(config, hf), pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage(), **E.model_kwargs(family.model_kwargs(hf)))
    elif family.build is not None:
        model = family.build(hf, config, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    else:
        model = GPTModel(
            config,
            family.layer_spec(config, use_te),
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            **family.model_kwargs(hf),
        )
    if fp32_head:
        fp32_output_layer(model)
    if platform.has_gpu():
        # Some modules create parameters on the host whatever the config says (the MoE router
        # moves its weight lazily at its first forward, after the optimizer has wrapped it).
        model.cuda(torch.cuda.current_device())
    return model


def fp32_output_layer(model) -> None:
    """The last stage's output layer multiplies fp32 copies of its input and weight: fp32 sums of the
    16-bit products, as vLLM's head_dtype=float32 computes its logits. Gradients flow back through the
    casts to the 16-bit weight (tied or not) and hidden states."""
    layer = getattr(model, "output_layer", None)
    if layer is None:  # not the last pipeline stage
        return
    forward = layer.forward

    def fp32_forward(input_, weight=None, runtime_gather_output=None):
        weight = layer.weight if weight is None else weight
        return forward(input_.float(), weight=weight.float(), runtime_gather_output=runtime_gather_output)

    layer.forward = fp32_forward


def build_and_load(path: str | Path, params_dtype: torch.dtype, use_te: Optional[bool] = None, **runtime):
    """(model, family, hf_config) with the HF weights of ``path`` loaded; ``runtime`` goes to the config."""
    hf = read_hf_config(path)
    family = family_for(hf)
    config = family.transformer_config(hf, params_dtype, **runtime)
    model = build_model(family, hf, config, use_te)
    load_hf_weights(model, family.params(hf), path)
    return model, family, hf
