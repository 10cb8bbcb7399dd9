"""Official <-> transformers (`DeepseekV4ForCausalLM`) names, state dicts and config.json.

People hold DeepSeek-V4 weights in either layout (the official release, or an HF `save_pretrained` copy), and the
HF model is our numerical oracle in tests. The name table here was checked against the real `state_dict()` of
transformers 5.17's `DeepseekV4ForCausalLM`. HF has no MTP block, so `mtp.*` tensors have no HF name.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from moebox.config import CSA, HCA, SLIDING, ModelConfig
from moebox.errors import CheckpointError, ConfigError
from moebox.weights.schema import tensor_group

_HF_LAYER_TYPE = {SLIDING: "sliding_attention", CSA: "compressed_sparse_attention", HCA: "heavily_compressed_attention"}

_GLOBAL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
# per-layer suffix, official -> HF; quantized entries are given by their weight/stem (see `_SCALED`)
_LAYER = {
    "attn.attn_sink": "self_attn.sinks",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
}
_LAYER_REV = {v: k for k, v in _LAYER.items()}
_GLOBAL_REV = {v: k for k, v in _GLOBAL.items()}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
HF_GATE_UP = "mlp.experts.gate_up_proj"
HF_DOWN = "mlp.experts.down_proj"


def official_to_hf_name(name: str) -> str | None:
    """HF name of an official non-expert tensor (`.scale` -> `.weight_scale_inv`); None for `mtp.*` and experts."""
    stem_scale = name.endswith(".scale")
    key = name.removesuffix(".scale") + ".weight" if stem_scale else name
    if key in _GLOBAL:
        hf = _GLOBAL[key]
    else:
        m = _LAYER_RE.match(key)
        if not m or m.group(2) not in _LAYER:
            return None
        hf = f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return hf.removesuffix(".weight") + ".weight_scale_inv" if stem_scale else hf


def hf_to_official_name(hf: str) -> str | None:
    """Official name of an HF non-stacked tensor; None if it is not one.

    Accepts both HF dialects: the module names of `DeepseekV4ForCausalLM.state_dict()` (`.weight_scale_inv` ->
    `.scale`), and what `save_pretrained` writes by default (`save_original_format=True`): official names under a
    `model.` prefix with per-expert tensors, except that its reverse renames leave `embed_tokens`, `hc_head.hc_*`
    and turn `attn.kv_norm` into `attn.norm`.
    """
    scaled = hf.endswith(".weight_scale_inv")
    key = hf.removesuffix("_scale_inv") if scaled else hf
    if key in _GLOBAL_REV:
        name = _GLOBAL_REV[key]
    elif (m := _HF_LAYER_RE.match(key)) and m.group(2) in _LAYER_REV:
        name = f"layers.{m.group(1)}.{_LAYER_REV[m.group(2)]}"
    else:
        return _saved_to_official_name(hf)
    return name.removesuffix(".weight") + ".scale" if scaled else name


_SAVED_FIXUPS = [
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^lm_head\.weight$"), "head.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^layers\.(\d+)\.attn\.norm\.weight$"), r"layers.\1.attn.kv_norm.weight"),
    (re.compile(r"\.weight_scale_inv$"), ".scale"),
]


def _saved_to_official_name(hf: str) -> str | None:
    name = hf.removeprefix("model.")
    for pattern, repl in _SAVED_FIXUPS:
        name = pattern.sub(repl, name)
    try:
        tensor_group(name)
    except CheckpointError:
        return None
    return name


def expert_source(name: str, intermediate: int) -> tuple[str, int, slice] | None:
    """Where an official routed-expert weight lives in HF's stacked tensors: (hf name, expert, row slice)."""
    m = _EXPERT_RE.match(name)
    if not m:
        return None
    layer, e, w = m.group(1), int(m.group(2)), m.group(3)
    if w == "w2":
        return f"model.layers.{layer}.{HF_DOWN}", e, slice(None)
    rows = slice(0, intermediate) if w == "w1" else slice(intermediate, 2 * intermediate)
    return f"model.layers.{layer}.{HF_GATE_UP}", e, rows


def official_to_hf_state(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantized official tensors -> an HF state dict (experts stacked; `mtp.*` dropped, HF has no MTP)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith("mtp.") or _EXPERT_RE.match(name):
            continue
        hf = official_to_hf_name(name)
        if hf is None:
            raise KeyError(f"official tensor {name!r} has no transformers equivalent")
        out[hf] = t
    E = cfg.n_routed_experts
    for i in range(cfg.num_layers):
        p = f"layers.{i}.ffn.experts."
        if f"{p}0.w1.weight" not in tensors:
            continue
        out[f"model.layers.{i}.{HF_GATE_UP}"] = torch.stack(
            [torch.cat([tensors[f"{p}{e}.w1.weight"], tensors[f"{p}{e}.w3.weight"]]) for e in range(E)])
        out[f"model.layers.{i}.{HF_DOWN}"] = torch.stack([tensors[f"{p}{e}.w2.weight"] for e in range(E)])
    return out


def hf_to_official_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """An HF state dict -> official names, stacked experts split per expert; non-weight entries are skipped."""
    out: dict[str, torch.Tensor] = {}
    I = cfg.moe_intermediate_size
    for hf, t in hf_state.items():
        m = _HF_LAYER_RE.match(hf)
        if m and m.group(2) == HF_GATE_UP:
            for e in range(t.shape[0]):
                out[f"layers.{m.group(1)}.ffn.experts.{e}.w1.weight"] = t[e, :I]
                out[f"layers.{m.group(1)}.ffn.experts.{e}.w3.weight"] = t[e, I:]
        elif m and m.group(2) == HF_DOWN:
            for e in range(t.shape[0]):
                out[f"layers.{m.group(1)}.ffn.experts.{e}.w2.weight"] = t[e]
        elif (name := hf_to_official_name(hf)) is not None:
            out[name] = t
    return out


def _one_rate(cfg: ModelConfig, kind: str, default: int) -> int:
    rates = {r for k, r in zip(cfg.attn_types, cfg.compress_ratios) if k == kind}
    if len(rates) > 1:
        raise ConfigError(f"transformers' config holds one compress rate per attention type, but the {kind} layers "
                          f"use {sorted(rates)}")
    return rates.pop() if rates else default


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers `DeepseekV4Config(**d)` dict for `cfg` (HF dialect; `parse_config` reads it back equal,
    except `quant`, which HF configs of dequantized weights do not carry)."""
    rope_parameters: dict[str, Any] = {"rope_type": "default"}
    if cfg.rope_scaling is not None:
        y = cfg.rope_scaling
        rope_parameters = {"rope_type": "yarn", "factor": y.factor,
                           "original_max_position_embeddings": y.original_max_position_embeddings,
                           "beta_fast": y.beta_fast, "beta_slow": y.beta_slow}
    return {
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "partial_rotary_factor": cfg.rope_head_dim / cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": cfg.scoring_func,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "swiglu_limit": cfg.swiglu_limit,
        "layer_types": [_HF_LAYER_TYPE[k] for k in cfg.attn_types],
        "mlp_layer_types": ["hash_moe" if h else "moe" for h in cfg.hash_layers],
        "compress_rates": {"compressed_sparse_attention": _one_rate(cfg, CSA, 4),
                           "heavily_compressed_attention": _one_rate(cfg, HCA, 128)},
        "sliding_window": cfg.sliding_window,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": cfg.compress_rope_theta,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_nextn_predict_layers": cfg.num_mtp_layers,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else cfg.eos_token_ids[0],
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
