"""A full-size DeepSeek-V4 with random weights built directly in device memory: the bench's model.

Writing and loading an 87 GB checkpoint to time a decode step would cost more than the bench itself, and the
bytes a step reads do not depend on the weight values. So every tensor of the official schema is drawn on
the device in its serving format: FP8 e4m3 with E8M0 block scales for the FP8 weights, bf16/fp32 for the
rest, and the routed experts as one plane-store-shaped w2 layer buffer per layer, exactly as the loader gives
them (random codes, scales near 2^-7; one random layer buffer is drawn and copied to the others, which is
what makes 78 GB fast to build).
Scales are chosen so activations stay finite through 43 layers.
"""

from __future__ import annotations

import math
import re

import torch
from tqdm import tqdm

from moebox.config import ModelConfig
from moebox.model.deepseek_v4 import DeepseekV4
from moebox.ops.linear import Weight
from moebox.ops.triton.w2_moe import layer_views
from moebox.store.plane_store import EXPERT_TENSORS, StoreShape, slot_views
from moebox.weights.formats import QuantTensor
from moebox.weights.schema import TensorSpec, official_schema

_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.")
_ONES = re.compile(r"(norm\.weight|_scale)$")            # RMSNorm weights and mHC scales


def _fp8(spec: TensorSpec, g: torch.Generator, device: torch.device) -> QuantTensor:
    out, inp = spec.shape
    data = torch.randn((out, inp), generator=g, device=device, dtype=torch.bfloat16).mul_(64).to(torch.float8_e4m3fn)
    # values ~N(0, 64^2) times 2^(s-127): pick s so that rows have unit gain, 64 * 2^(s-127) * sqrt(in) ~ 1
    s = 127 - 6 - round(math.log2(math.sqrt(inp)))
    scale = torch.full((-(-out // 128), -(-inp // 128)), s, dtype=torch.uint8, device=device)
    return QuantTensor("fp8", data, scale.view(torch.float8_e8m0fnu), (128, 128))


def _plain(spec: TensorSpec, g: torch.Generator, device: torch.device) -> torch.Tensor:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[spec.kind]
    if _ONES.search(spec.name):
        return torch.ones(spec.shape, dtype=dtype, device=device)
    if len(spec.shape) == 1 or spec.name.endswith("ape"):
        return torch.zeros(spec.shape, dtype=dtype, device=device)
    return torch.randn(spec.shape, generator=g, device=device, dtype=dtype).mul_(spec.shape[-1] ** -0.5)


def _store_shape(cfg: ModelConfig) -> StoreShape:
    return StoreShape(cfg.num_layers, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)


def _layer_planes(cfg: ModelConfig, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """One w2 layer buffer [experts, slot bytes]: random codes, E8M0 scales in 2^-8..2^-6."""
    shape = _store_shape(cfg)
    buf = torch.randint(0, 256, (shape.experts, shape.stride), generator=g, device=device, dtype=torch.uint8)
    for scales in layer_views(buf, cfg.hidden_size, cfg.moe_intermediate_size)[1::2]:
        scales.copy_(torch.randint(119, 122, scales.shape, generator=g, device=device, dtype=torch.uint8))
    return buf


def synthetic_weights(cfg: ModelConfig, device: torch.device | str, seed: int = 0, with_mtp: bool = False,
                      progress: bool = True) -> dict[str, Weight]:
    """Every tensor the model asks for, by official name, with w2 planes as `<layer>.ffn.experts.planes`."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, Weight] = {}
    specs = [s for s in official_schema(cfg).values()
             if not _EXPERT.match(s.name) and (with_mtp or not s.name.startswith("mtp."))]
    for spec in tqdm(specs, desc="random dense weights", unit="tensor", disable=not progress, leave=False):
        if spec.kind == "fp8":
            weights[spec.name] = _fp8(spec, g, device)
        elif spec.kind == "int":           # hash routing: k distinct experts per token id
            scores = torch.rand((spec.shape[0], cfg.n_routed_experts), generator=g, device=device)
            weights[spec.name] = scores.topk(spec.shape[1], dim=-1).indices.to(torch.int32)
        else:
            weights[spec.name] = _plain(spec, g, device)
    prefixes = [f"layers.{i}.ffn.experts." for i in range(cfg.num_layers)]
    prefixes += [f"mtp.{j}.ffn.experts." for j in range(cfg.num_mtp_layers if with_mtp else 0)]
    first = _layer_planes(cfg, g, device)
    for i, prefix in enumerate(tqdm(prefixes, desc="w2 expert planes", unit="layer", disable=not progress,
                                    leave=False)):
        buf = weights[prefix + "planes"] = first if i == 0 else first.clone()
        for e in range(cfg.n_routed_experts):          # per-expert views, for the torch path (prefill, CPU)
            for name, planes in zip(EXPERT_TENSORS, slot_views(buf[e], _store_shape(cfg))):
                weights[f"{prefix}{e}.{name}.weight"] = planes
    return weights


def synthetic_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                    seed: int = 0, progress: bool = True) -> DeepseekV4:
    """The model over `synthetic_weights` (QAT off, model-dtype cache, no MTP)."""
    return DeepseekV4(cfg, synthetic_weights(cfg, device, seed, progress=progress).pop, qat=False, dtype=dtype,
                      load_mtp=False)
