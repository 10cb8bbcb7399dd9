"""Deterministic synthetic DeepSeek-V4 checkpoints in the official layout.

Real weights are 160 GB and cannot live in CI, yet every loader, kernel and server path must be exercised on
the exact official format (FP8 block scales, packed FP4 experts, sharded index, tokenizer). `write_synthetic`
writes such a checkpoint at any size, from random values scaled so that a forward pass stays finite and
non-degenerate, and randomises the parameters that a zero init would hide (sinks, APE, mHC bases, router bias,
hash routing tables). Each tensor has its own generator seeded by (seed, name): the bytes depend only on the
seed, and a layer is the same whether 2 or 40 layers are written. Shards are generated and written one at a
time, so memory stays around one shard even for real-size layers.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from moebox.config import ModelConfig, parse_config
from moebox.errors import MoeboxError
from moebox.weights.checkpoint import INDEX_FILE
from moebox.weights.formats import FP4_BLOCK, exponent_to_e8m0, quant_fp8_block
from moebox.weights.schema import TensorSpec, schema_units
from moebox.weights.tokenizer import build_tokenizer, save_tokenizer

PRESETS = ("tiny", "demo", "small", "flash")
_DEFAULT_SHARD_MB = {"tiny": 0.25, "demo": 16.0, "small": 64.0, "flash": 2048.0}
_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
          "weight_block_size": [128, 128]}


def _preset(preset: str) -> tuple[dict[str, Any], list[int], int]:
    """(shape keys, per-layer compress ratios, hash layer count) of a preset at its full depth."""
    if preset == "tiny":   # deepseek_v4.md §7.2 shapes, vocab widened to fit the tokenizer
        return dict(vocab_size=320, hidden_size=64, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                    q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8, n_shared_experts=1,
                    num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8, index_n_heads=8,
                    index_head_dim=32, index_topk=3, max_position_embeddings=1024,
                    rope_scaling=dict(type="yarn", factor=16.0, original_max_position_embeddings=64,
                                      beta_fast=32, beta_slow=1)), [0, 4, 8, 4, 8, 0], 2
    if preset == "demo":   # the shipped trained model (issue G): every V4 feature, <= 40 MB in the official layout
        return dict(vocab_size=4096, hidden_size=512, num_attention_heads=8, head_dim=64, qk_rope_head_dim=16,
                    q_lora_rank=256, o_groups=2, o_lora_rank=128, n_routed_experts=16, n_shared_experts=1,
                    num_experts_per_tok=2, moe_intermediate_size=128, sliding_window=64, index_n_heads=4,
                    index_head_dim=32, index_topk=16, max_position_embeddings=4096,
                    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=1024,
                                      beta_fast=32, beta_slow=1)), [0, 4, 16, 4, 16, 0], 1
    if preset == "small":  # a few hundred MB: CPU memory/throughput tests
        return dict(vocab_size=4096, hidden_size=1024, num_attention_heads=8, head_dim=128, qk_rope_head_dim=32,
                    q_lora_rank=256, o_groups=4, o_lora_rank=128, n_routed_experts=32, n_shared_experts=1,
                    num_experts_per_tok=4, moe_intermediate_size=512, sliding_window=64, index_n_heads=8,
                    index_head_dim=64, index_topk=16, max_position_embeddings=65536,
                    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=4096,
                                      beta_fast=32, beta_slow=1)), [0, 4, 32, 4, 32, 4, 32, 0], 2
    if preset == "flash":  # the real DeepSeek-V4-Flash shapes (deepseek_v4.md §0)
        return dict(vocab_size=129280, hidden_size=4096, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
                    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, n_routed_experts=256, n_shared_experts=1,
                    num_experts_per_tok=6, moe_intermediate_size=2048, sliding_window=128, index_n_heads=64,
                    index_head_dim=128, index_topk=512, max_position_embeddings=1048576,
                    rope_scaling=dict(type="yarn", factor=16.0, original_max_position_embeddings=65536,
                                      beta_fast=32, beta_slow=1)), [0, 0] + [4, 128] * 20 + [4], 3
    raise MoeboxError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


def preset_config(preset: str, layers: int | None = None) -> dict[str, Any]:
    """The official-dialect config.json of a preset, optionally cut to its first `layers` layers (+1 MTP)."""
    shapes, ratios, n_hash = _preset(preset)
    n = len(ratios) if layers is None else layers
    if not 1 <= n <= len(ratios):
        raise MoeboxError(f"--layers {n}: preset {preset!r} has 1 to {len(ratios)} layers")
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        **{k: v for k, v in shapes.items() if k not in ("rope_scaling", "max_position_embeddings")},
        "num_hidden_layers": n,
        "num_key_value_heads": 1,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "num_hash_layers": min(n_hash, n),
        "compress_ratios": ratios[:n] + [0],
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": shapes["rope_scaling"],
        "max_position_embeddings": shapes["max_position_embeddings"],
        "num_nextn_predict_layers": 1,
        "quantization_config": dict(_QUANT),
        "expert_dtype": "fp4",
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    }


def tensor_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def initial_values(spec: TensorSpec, cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """Random values for one logical tensor, at a scale that keeps activations O(1)."""
    name, shape = spec.name, spec.shape

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    if name.endswith("tid2eid"):   # distinct experts per token: a random permutation slice per token id
        order = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen).argsort(dim=1)
        return order[:, :cfg.num_experts_per_tok].to(torch.int32)
    if name.endswith(("attn_sink", ".ape", "_base")):
        return normal(0.5)
    if name.endswith("_scale"):     # mHC scales (hc_attn_scale, hc_head_scale, ...)
        return normal(0.1, 1.0)
    if name.endswith("_fn"):        # mHC mixing: small, so the streams mix but do not saturate the sigmoids
        return normal(0.5 / math.sqrt(shape[1]))
    if name.endswith("ffn.gate.bias"):
        return normal(0.1)
    if len(shape) == 1:             # RMSNorm weights
        return normal(0.1, 1.0)
    if name == "embed.weight":
        return normal(1.0)
    return normal(1.0 / math.sqrt(shape[1]))   # linear [out, in]: N(0, 1/fan_in)


# mean of the squared FP4 e2m1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}: the RMS of uniformly random codes is its root
_FP4_MEAN_SQUARE = 68.5 / 8


def _random_fp4(spec: TensorSpec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """FP4 experts as the checkpoint stores them, drawn directly: uniform codes (both zero signs included) and
    per-32 scales around N(0, 1/fan_in) RMS with a +-1 exponent jitter. Drawing codes is ~100x faster than
    quantizing random floats, which matters for multi-GiB `flash` checkpoints."""
    rows, cols = spec.shape
    codes = torch.randint(0, 256, (rows, cols // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    base = round(math.log2(1.0 / (math.sqrt(_FP4_MEAN_SQUARE) * math.sqrt(cols))))
    exps = base + torch.randint(-1, 2, (rows, cols // FP4_BLOCK), generator=gen)
    return {spec.name: codes.view(torch.int8), spec.scale_name: exponent_to_e8m0(exps)}


def _stored(spec: TensorSpec, cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The on-disk tensors (weight, and scale if quantized) of one spec."""
    if spec.kind == "fp4":
        return _random_fp4(spec, tensor_generator(seed, spec.name))
    w = initial_values(spec, cfg, tensor_generator(seed, spec.name))
    if spec.kind == "fp8":
        q, s = quant_fp8_block(w, spec.block)
        return {spec.name: q, spec.scale_name: s}
    if spec.kind == "bf16":
        return {spec.name: w.to(torch.bfloat16)}
    return {spec.name: w}


def plan_shards(cfg: ModelConfig, shard_bytes: int) -> list[list[TensorSpec]]:
    """Cut the schema into shards of about `shard_bytes`, at unit (layer) boundaries unless a unit is larger."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0

    def add(specs: list[TensorSpec], nbytes: int) -> None:
        nonlocal size
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(specs)
        size += nbytes

    for _, specs in schema_units(cfg):
        unit_bytes = sum(s.stored_nbytes() for s in specs)
        if unit_bytes <= shard_bytes:
            add(specs, unit_bytes)
        else:
            for s in specs:
                add([s], s.stored_nbytes())
    return shards


def write_checkpoint(out_dir: str | Path, raw_cfg: dict[str, Any], stored: Callable[[TensorSpec], dict],
                     tokenizer: Tokenizer, shard_bytes: int, desc: str, progress: bool = True) -> Path:
    """Write an official-layout checkpoint: config.json, generation_config.json, tokenizer, shards of the
    on-disk tensors `stored(spec)` gives for each spec of the schema (weight, and scale if quantized), index."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise MoeboxError(f"{out}: directory is not empty; choose a new output directory")
    cfg = parse_config(raw_cfg, source=desc)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    save_tokenizer(out, tokenizer)

    shards = plan_shards(cfg, shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    bar = tqdm(shards, desc=desc, unit="shard", disable=not progress or len(shards) == 1)
    for k, specs in enumerate(bar):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for spec in specs:
            tensors.update(stored(spec))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out


def write_synthetic(out_dir: str | Path, preset: str, seed: int = 0, layers: int | None = None,
                    shard_size_mb: float | None = None, progress: bool = True) -> Path:
    """Write a synthetic official-layout checkpoint (config, sharded weights, index, tokenizer) to `out_dir`."""
    raw_cfg = preset_config(preset, layers)
    cfg = parse_config(raw_cfg, source=f"preset {preset}")
    shard_mb = shard_size_mb if shard_size_mb is not None else _DEFAULT_SHARD_MB[preset]
    return write_checkpoint(out_dir, raw_cfg, lambda spec: _stored(spec, cfg, seed), build_tokenizer(cfg.vocab_size),
                            int(shard_mb * 2**20), f"synth {preset}", progress)
