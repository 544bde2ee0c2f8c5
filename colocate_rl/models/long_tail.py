"""A Qwen3 whose answers are long-tailed by construction, for partial rollouts' tests and their
GPU benchmark (benchmarks/step/partial_gpu.py): any Qwen3 model folder written with the tiny
tokenizer (models/tiny.py), at any width, becomes one.

Its attention and MLP write nothing (o_proj and down_proj are zero), so each next token depends on
the current token alone, through the embedding and lm_head written here. Every token but the loop
tokens has one embedding: after it the model stops (a token of STOP, the EOS ids of its
generation_config) with probability ``stop``, enters the loop with probability ``enter``, and
otherwise says one of the other words. After a loop token it says loop tokens (16 of them, at
random) for as long as it may. So most answers are a few words, and about enter / (stop + enter)
of them run to rollout.max_response_tokens: the slow sample a step would wait for.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from colocate_rl.private import private_dir, seal

LOOP, STOP = range(100, 116), range(200, 240)
WORDS = 300  # the tiny tokenizer's tokens; the ids above it are never sampled


def long_tail_model(src: Path, dst: Path, stop: float = 0.3, enter: float = 0.02) -> Path:
    """A copy of the model folder ``src`` at ``dst`` with the weights described above (untied:
    the embedding and the head differ)."""
    src, dst = Path(src), private_dir(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    w = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    vocab, hidden = w["model.embed_tokens.weight"].shape
    dtype = w["model.embed_tokens.weight"].dtype
    basis, _ = torch.linalg.qr(torch.randn(hidden, 2, generator=torch.Generator().manual_seed(0)))
    word, loop = basis[:, 0], basis[:, 1]  # orthonormal; the final norm scales either to sqrt(hidden)
    emb = word.repeat(vocab, 1)
    emb[list(LOOP)] = loop
    w["model.embed_tokens.weight"] = 0.16 * emb
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    # After a word: logits log(p·Z/|set|) for STOP and LOOP, 0 for the other words, so that the
    # other words take 1 - stop - enter.
    z = (WORDS - len(LOOP) - len(STOP)) / (1 - stop - enter)
    scale = math.sqrt(hidden)
    head = torch.zeros(vocab, hidden)
    head[list(STOP)] = word * math.log(stop * z / len(STOP)) / scale
    head[list(LOOP)] = word * math.log(enter * z / len(LOOP)) / scale + loop * 20 / scale
    head[WORDS:] = -(word + loop) * 80 / scale
    w["lm_head.weight"] = head.to(dtype)
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"].to(dtype)
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=1))
    config = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": list(STOP)}))
    seal(dst)  # the user's alone, as every model folder the project writes
    return dst
