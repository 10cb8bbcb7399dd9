"""Build a runnable DeepseekV4 from a checkpoint directory.

Weights stay in their stored format (FP8/FP4 QuantTensor or float) and are placed on the target device
once; the model asks for them by canonical name. The QAT roundings (FP8 KV, Hadamard+FP4 indexer) follow
the checkpoint unless `kv_cache_dtype` forces them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from moebox.errors import MoeboxError
from moebox.model.deepseek_v4 import DeepseekV4
from moebox.ops.linear import Weight
from moebox.weights.checkpoint import Checkpoint

log = logging.getLogger("moebox")
KV_CACHE_DTYPES = ("auto", "fp8", "model")


def resolve_qat(kv_cache_dtype: str, layout: str) -> bool:
    """'auto': the official layout was trained with FP8 KV / FP4 indexer rounding, so simulate it; an HF-layout
    model computes without it (as transformers does). 'fp8' forces it on, 'model' (model dtype) off."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise MoeboxError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of {KV_CACHE_DTYPES}")
    if kv_cache_dtype == "auto":
        return layout == "official"
    return kv_cache_dtype == "fp8"


def load_model(model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               kv_cache_dtype: str = "auto", load_mtp: bool = True,
               progress: bool = True) -> tuple[DeepseekV4, Checkpoint]:
    ckpt = Checkpoint(model_dir)
    ckpt.validate()
    cfg = ckpt.config
    names = ckpt.names()
    has_mtp = any(n.startswith("mtp.") for n in names)
    if load_mtp and cfg.num_mtp_layers and not has_mtp:
        log.warning("%s: config declares %d MTP layer(s) but the checkpoint has no mtp.* tensors; running without "
                    "the MTP block", model_dir, cfg.num_mtp_layers)
    use_mtp = load_mtp and has_mtp
    wanted = [n for n in names if use_mtp or not n.startswith("mtp.")]
    weights: dict[str, Weight] = {}
    for name in tqdm(wanted, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        weights[name] = ckpt.get(name).to(device)
    qat = resolve_qat(kv_cache_dtype, ckpt.layout)
    model = DeepseekV4(cfg, weights.__getitem__, qat=qat, dtype=dtype, load_mtp=use_mtp)
    log.info("loaded %s (%s layout, %d layers, %d tensors, QAT rounding %s)", model_dir, ckpt.layout,
             cfg.num_layers, len(weights), "on" if qat else "off")
    return model, ckpt
