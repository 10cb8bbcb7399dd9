"""One DeepSeek-V4 decoder block: mHC around attention, then mHC around the MoE."""

from __future__ import annotations

import torch

from moebox.config import ModelConfig
from moebox.model.attention import Attention, WeightSource
from moebox.model.batch import DecodeBatch, FlatBatch
from moebox.model.cache import LayerCache
from moebox.model.moe import MoE
from moebox.ops.mhc import hc_post, hc_pre
from moebox.ops.norm import rms_norm
from moebox.ops.streams import Branch


class Block:
    def __init__(self, cfg: ModelConfig, get: WeightSource, prefix: str, *, kind: str, ratio: int, is_hash: bool,
                 qat: bool) -> None:
        self.cfg = cfg
        g = lambda n: get(prefix + n)  # noqa: E731
        self.attn = Attention(cfg, get, prefix + "attn.", kind, ratio, qat)
        self.ffn = MoE(cfg, get, prefix + "ffn.", is_hash)
        self.attn_norm, self.ffn_norm = g("attn_norm.weight"), g("ffn_norm.weight")
        self.hc_attn = (g("hc_attn_fn"), g("hc_attn_base"), g("hc_attn_scale"))
        self.hc_ffn = (g("hc_ffn_fn"), g("hc_ffn_base"), g("hc_ffn_scale"))

    def __call__(self, X: torch.Tensor, batch: FlatBatch | DecodeBatch, cache: LayerCache | None) -> torch.Tensor:
        cfg = self.cfg
        kw = dict(iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        decode = isinstance(batch, DecodeBatch)
        # decode: mHC's post/comb (the Sinkhorn chain) on a side stream, next to the sub-block, until its hc_post
        coeffs = Branch(X, "mhc", enabled=decode, purpose="mhc")
        x, post, comb = hc_pre(X, *self.hc_attn, **kw, coeffs_branch=coeffs if coeffs.on else None)
        x = rms_norm(x, self.attn_norm, cfg.rms_norm_eps)
        out = self.attn(x, batch, cache)
        coeffs.join()
        X = hc_post(out, X, post, comb)
        coeffs = Branch(X, "mhc", enabled=decode, purpose="mhc")
        x, post, comb = hc_pre(X, *self.hc_ffn, **kw, coeffs_branch=coeffs if coeffs.on else None)
        x = rms_norm(x, self.ffn_norm, cfg.rms_norm_eps)
        out = self.ffn(x, batch.tokens)
        coeffs.join()
        return hc_post(out, X, post, comb)
