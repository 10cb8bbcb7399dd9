"""Trained float parameters -> a checkpoint in DeepSeek's official layout, loadable like the real one.

Each tensor is stored as the official checkpoint stores it (the schema's kind): FP8 e4m3 with 128x128 E8M0
block scales for the dense projections, FP4 e2m1 with 1x32 E8M0 scales for the routed experts, bf16/fp32 for
the rest, the hash-routing table as int32, `mtp.0.*` for the MTP block. So the shipped model exercises exactly
the load, pack (w2) and kernel paths a real V4-Flash checkpoint does. `dequantized` gives the float values the
exported checkpoint holds (what a loader sees), for checking an export against the trained model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from moebox.config import parse_config
from moebox.weights.formats import QuantTensor, quant_fp4, quant_fp8_block
from moebox.weights.schema import TensorSpec, official_schema
from moebox.weights.synth import write_checkpoint


def stored_tensors(spec: TensorSpec, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one trained value (weight, and scale if quantized)."""
    w = value.detach().float().cpu()
    if spec.kind == "fp8":
        q, s = quant_fp8_block(w, spec.block)
        return {spec.name: q, spec.scale_name: s}
    if spec.kind == "fp4":
        packed, s = quant_fp4(w)
        return {spec.name: packed, spec.scale_name: s}
    if spec.kind == "bf16":
        return {spec.name: w.to(torch.bfloat16)}
    if spec.kind == "int":
        return {spec.name: value.detach().cpu().to(torch.int32)}
    return {spec.name: w}


def dequantized(spec: TensorSpec, value: torch.Tensor) -> torch.Tensor:
    """The float values the exported tensor holds."""
    stored = stored_tensors(spec, value)
    if spec.quantized:
        return QuantTensor(spec.kind, stored[spec.name], stored[spec.scale_name], spec.block).dequantize()
    return stored[spec.name].float() if stored[spec.name].is_floating_point() else stored[spec.name]


def export_checkpoint(out_dir: str | Path, raw_cfg: dict[str, Any], params: dict[str, torch.Tensor],
                      tokenizer: Tokenizer, shard_mb: float = 64.0, progress: bool = True) -> Path:
    """Write `params` (every name of the schema of `raw_cfg`) as an official-layout checkpoint in `out_dir`."""
    cfg = parse_config(raw_cfg, source="export config")
    missing = sorted(set(official_schema(cfg)) - set(params))
    if missing:
        raise KeyError(f"export: {len(missing)} tensor(s) missing, e.g. {missing[0]}")
    return write_checkpoint(out_dir, raw_cfg, lambda spec: stored_tensors(spec, params[spec.name]), tokenizer,
                            int(shard_mb * 2**20), "export", progress)
