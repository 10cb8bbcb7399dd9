"""The independent reference: transformers' DeepseekV4ForCausalLM (fp32, CPU) fed the same weights.

transformers has no MTP block; `HFMTPReference` composes one from transformers' own parts
(DeepseekV4DecoderLayer, RMSNorm, HyperHead, nn.Linear) following deepseek_v4.md §2.9.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from moebox.config import ModelConfig
from moebox.weights.checkpoint import Checkpoint
from moebox.weights.formats import QuantTensor
from moebox.weights.hf import hf_config_dict, official_to_hf_name, official_to_hf_state

warnings.filterwarnings("ignore", message=".*[Yy]a[Rr][Nn].*")

from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hfm  # noqa: E402


def dequantized(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    out = {}
    for n in ckpt.names():
        t = ckpt.get(n)
        out[n] = t.dequantize(torch.float32) if isinstance(t, QuantTensor) else \
            (t if not t.is_floating_point() else t.float())
    return out


def hf_config(cfg: ModelConfig, extra_sliding_layer: bool = False) -> DeepseekV4Config:
    d = hf_config_dict(cfg)
    if extra_sliding_layer:  # room for the MTP block as layer `num_layers` (sliding, non-hash)
        d["num_hidden_layers"] += 1
        d["layer_types"] = d["layer_types"] + ["sliding_attention"]
        d["mlp_layer_types"] = d["mlp_layer_types"] + ["moe"]
    c = DeepseekV4Config(**d)
    c._attn_implementation = "eager"
    return c


def hf_model_from_checkpoint(model_dir: str | Path) -> tuple[DeepseekV4ForCausalLM, dict[str, torch.Tensor]]:
    """HF model holding the checkpoint's weights, dequantized to fp32 (QAT is not part of HF)."""
    ckpt = Checkpoint(model_dir)
    weights = dequantized(ckpt)
    model = DeepseekV4ForCausalLM(hf_config(ckpt.config)).float().eval()
    missing, unexpected = model.load_state_dict(official_to_hf_state(weights, ckpt.config), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model, weights


def randomize_hidden_paths(model: nn.Module, seed: int) -> None:
    """HF's init zeroes sinks, compressor position biases, mHC bases, router bias and tid2eid (every token ->
    expert 0): randomize them so every code path is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("scale", "hc_scale")) and p.numel() <= 3:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("tid2eid"):
                n_exp = model.config.n_routed_experts
                p.copy_(torch.stack([torch.randperm(n_exp, generator=g)[:p.shape[1]] for _ in range(p.shape[0])]))


class HFMTPReference(nn.Module):
    """The MTP block of §2.9 built from transformers parts, loaded with `mtp.0.*` weights."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        hcfg = hf_config(cfg, extra_sliding_layer=True)
        self.layer_idx = cfg.num_layers
        self.layer = hfm.DeepseekV4DecoderLayer(hcfg, self.layer_idx)
        H = cfg.hidden_size
        self.e_proj, self.h_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.enorm = hfm.DeepseekV4RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = hfm.DeepseekV4RMSNorm(H, cfg.rms_norm_eps)
        self.norm = hfm.DeepseekV4RMSNorm(H, cfg.rms_norm_eps)
        self.hc_head = hfm.DeepseekV4HyperHead(hcfg)
        self.rotary = hfm.DeepseekV4RotaryEmbedding(hcfg)
        self.window = cfg.sliding_window
        p = "mtp.0."
        layer_state = {}
        for n, t in weights.items():
            if n.startswith(p) and ".experts." not in n:
                hf = official_to_hf_name("layers.0." + n[len(p):])
                if hf is not None and hf.startswith("model.layers.0."):
                    layer_state[hf[len("model.layers.0."):]] = t
        E = cfg.n_routed_experts
        layer_state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{p}ffn.experts.{e}.w1.weight"], weights[f"{p}ffn.experts.{e}.w3.weight"]])
             for e in range(E)])
        layer_state["mlp.experts.down_proj"] = torch.stack([weights[f"{p}ffn.experts.{e}.w2.weight"] for e in range(E)])
        missing, unexpected = self.layer.load_state_dict(layer_state, strict=False)
        assert not unexpected and not missing, (missing, unexpected)
        with torch.no_grad():
            self.e_proj.weight.copy_(weights[p + "e_proj.weight"])
            self.h_proj.weight.copy_(weights[p + "h_proj.weight"])
            for m, n in ((self.enorm, "enorm"), (self.hnorm, "hnorm"), (self.norm, "norm")):
                m.weight.copy_(weights[f"{p}{n}.weight"])
            self.hc_head.hc_fn.copy_(weights[p + "hc_head_fn"])
            self.hc_head.hc_base.copy_(weights[p + "hc_head_base"])
            self.hc_head.hc_scale.copy_(weights[p + "hc_head_scale"])
        self.lm_head = weights["head.weight"]
        self.embed = weights["embed.weight"]

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """hidden [S, hc, H] (final main residual at positions 0..S-1), next_tokens [S] -> logits [S, V]."""
        S = hidden.shape[0]
        e = self.enorm(self.embed[next_tokens])
        x = self.e_proj(e).unsqueeze(1) + self.h_proj(self.hnorm(hidden))
        pos = torch.arange(S).unsqueeze(0)
        i, j = pos[0][:, None], pos[0][None, :]
        mask = torch.zeros(1, 1, S, S).masked_fill(~((j <= i) & (j > i - self.window)), float("-inf"))
        pe = {k: self.rotary(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        y = self.layer(x.unsqueeze(0), input_ids=next_tokens.unsqueeze(0), position_embeddings=pe, position_ids=pos,
                       attention_mask=mask, past_key_values=None)[0]
        return torch.nn.functional.linear(self.norm(self.hc_head(y.unsqueeze(0)))[0], self.lm_head)


def hf_final_residual(model: DeepseekV4ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The last decoder layer's output [S, hc, H] (the pre-HC-head residual the MTP block reads)."""
    captured = []
    hook = model.model.layers[-1].register_forward_hook(lambda mod, args, out: captured.append(out))
    try:
        model(ids.unsqueeze(0))
    finally:
        hook.remove()
    return captured[0][0]
