"""Build a runnable DeepseekV4 from a checkpoint directory.

Weights stay in their stored format (FP8/FP4 QuantTensor or float) and are placed on the target device
once; the model asks for them by canonical name. With `experts="w2"` the routed experts come from a plane
store instead (packed on first use); the checkpoint's expert tensors are then never read. The QAT roundings
(FP8 KV, Hadamard+FP4 indexer) follow the checkpoint unless `kv_cache_dtype` forces them.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from moebox.errors import MoeboxError
from moebox.model.deepseek_v4 import DeepseekV4
from moebox.ops.linear import Weight
from moebox.weights.checkpoint import Checkpoint

log = logging.getLogger("moebox")
KV_CACHE_DTYPES = ("auto", "fp8", "model")
EXPERT_FORMATS = ("native", "w2")


def resolve_qat(kv_cache_dtype: str, layout: str) -> bool:
    """'auto': the official layout was trained with FP8 KV / FP4 indexer rounding, so simulate it; an HF-layout
    model computes without it (as transformers does). 'fp8' forces it on and also stores the cache in that
    FP8/FP4 layout (model/cache.py); 'model' turns it off. Otherwise the cache holds the model dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise MoeboxError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of {KV_CACHE_DTYPES}")
    if kv_cache_dtype == "auto":
        return layout == "official"
    return kv_cache_dtype == "fp8"


def load_expert_planes(ckpt: Checkpoint, store_dir: str | Path | None, device: str | torch.device,
                       progress: bool) -> dict[str, Weight]:
    """Routed experts as 2-bit planes from the store, packing whatever layers it lacks first."""
    from moebox.store.pack import expert_layers, pack, prepare_store
    store = prepare_store(ckpt, store_dir)
    if store.missing_layers():
        log.info("plane store %s: %d of %d layers missing; packing them now", store.path,
                 len(store.missing_layers()), store.shape.layers)
        for line in pack(ckpt, store, progress=progress).lines():
            log.info("pack: %s", line)
    else:
        log.info("plane store %s: complete (%d layers); reading planes", store.path, store.shape.layers)
    weights: dict[str, Weight] = {}
    for layer, prefix in enumerate(tqdm(expert_layers(ckpt), desc="reading planes", unit="layer",
                                        disable=not progress, leave=False)):
        buf = store.read_layer(layer).to(device)
        weights[f"{prefix}planes"] = buf          # the whole layer, for the fused GPU kernel
        for e in range(store.shape.experts):
            for t, planes in zip(("w1", "w3", "w2"), store.expert_planes(buf, e)):
                weights[f"{prefix}{e}.{t}.weight"] = planes
    return weights


def load_model(model_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               kv_cache_dtype: str = "auto", load_mtp: bool = True, experts: str = "native",
               store_dir: str | Path | None = None, progress: bool = True,
               draft: Checkpoint | None = None) -> tuple[DeepseekV4, Checkpoint]:
    """`draft`: where the MTP head's tensors come from when not the model directory itself (a standalone MTP
    head checked by `runtime.speculative.draft_source`)."""
    if experts not in EXPERT_FORMATS:
        raise MoeboxError(f"experts={experts!r} is not supported; use one of {EXPERT_FORMATS}")
    ckpt = Checkpoint(model_dir)
    ckpt.validate()
    cfg = ckpt.config
    separate = draft is not None and draft.dir.resolve() != ckpt.dir.resolve()
    if separate:
        if experts == "w2":
            raise MoeboxError(f"an MTP head from another directory ({draft.dir}) runs with --experts native only "
                              f"for now: the plane store packs the experts of {ckpt.dir}")
        cfg = replace(cfg, num_mtp_layers=1)
    names = ckpt.names() + ([n for n in draft.names() if n.startswith("mtp.0.")] if separate else [])
    has_mtp = any(n.startswith("mtp.") for n in names)
    if load_mtp and cfg.num_mtp_layers and not has_mtp:
        log.warning("%s: config declares %d MTP layer(s) but the checkpoint has no mtp.* tensors; running without "
                    "the MTP block", model_dir, cfg.num_mtp_layers)
    use_mtp = load_mtp and has_mtp
    qat = resolve_qat(kv_cache_dtype, ckpt.layout)      # a bad value fails before any weight is read
    weights: dict[str, Weight] = {}
    if experts == "w2":
        weights.update(load_expert_planes(ckpt, store_dir, device, progress))
    wanted = [n for n in names if (use_mtp or not n.startswith("mtp.")) and n not in weights]
    for name in tqdm(wanted, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        weights[name] = (draft if separate and name.startswith("mtp.") else ckpt).get(name).to(device)
    # pop: the model keeps what it uses, and the weights it stacks (SharedInputLinear) are freed layer by layer
    model = DeepseekV4(cfg, weights.pop, qat=qat, dtype=dtype, load_mtp=use_mtp,
                       kv_layout="fp8" if kv_cache_dtype == "fp8" else "model")
    log.info("loaded %s (%s layout, %d layers, %s experts, QAT rounding %s)", model_dir, ckpt.layout,
             cfg.num_layers, experts, "on" if qat else "off")
    return model, ckpt
