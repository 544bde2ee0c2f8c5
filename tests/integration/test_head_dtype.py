"""model.head_dtype=float32 on both sides: the actor's output layer and vLLM's lm_head give fp32
logits, sums of the 16-bit products, instead of logits rounded to the model dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from colocate_rl.models.build import build_and_load, fp32_output_layer
from colocate_rl.types import Sample

from batches import build_engine
from test_rollout import PROMPTS, make_cfg


def test_actor_output_layer_gives_fp32_logits_and_trains_the_16_bit_weight(world, tiny_model):
    model, _, _ = build_and_load(tiny_model("qwen3-tiny-tied"), torch.bfloat16, use_cpu_initialization=True,
                                 perform_initialization=False)
    seen = {}
    model.output_layer.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (2, 9), generator=g)
    positions = torch.arange(9).expand(2, 9)
    bf16 = model(tokens, positions, None)
    fp32_output_layer(model)
    logits = model(tokens, positions, None)

    weight = model.shared_embedding_or_output_weight()  # tied: the embedding's bf16 weight
    assert bf16.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(seen["x"].float(), weight.float()).transpose(0, 1))
    # The same sums, not rounded to bf16: apart by at most half a bf16 step (2^-8 of the value).
    assert not torch.equal(logits, bf16.float())
    assert ((logits - bf16.float()).abs() <= logits.abs() * 2**-8).all()
    logits.logsumexp(-1).sum().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16 and weight.grad.abs().sum() > 0


def test_vllm_head_dtype_float32_scores_with_fp32_logits(tiny_model):
    """vLLM's logprobs with head_dtype=float32 sit closer to a transformers forward whose head is fp32
    than to the same forward with its logits rounded to bf16."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("qwen3-tiny")
    cfg = make_cfg(path, "bfloat16")
    cfg.model.head_dtype = "float32"
    engine = build_engine(cfg, multiprocess=False)
    try:
        assert engine.llm.llm_engine.model_config.head_dtype == torch.float32
        samples = [Sample(prompt_ids=engine.tokenizer.encode(p), prompt_text=p, label="") for p in PROMPTS]
        batch = engine.generate(samples)
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    with torch.no_grad():
        hidden = hf.model(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).last_hidden_state
        head32 = F.linear(hidden.float(), hf.lm_head.weight.float())
    diffs = []
    for logits in (head32, head32.bfloat16().float()):
        lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
        diffs.append(float((F.pad(lp, (1, 0)) - batch.rollout_logprobs)[batch.loss_mask].abs().mean()))
    print(f"vLLM head_dtype=float32 vs a transformers forward: fp32 head {diffs[0]:.2e}, bf16 logits {diffs[1]:.2e}")
    assert diffs[0] < diffs[1], diffs
