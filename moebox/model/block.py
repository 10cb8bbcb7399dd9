"""One DeepSeek-V4 decoder block: mHC around attention, then mHC around the MoE."""

from __future__ import annotations

from typing import Callable

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
        decode = isinstance(batch, DecodeBatch)
        X = self._site(X, self.hc_attn, self.attn_norm, lambda x: self.attn(x, batch, cache), decode)
        return self._site(X, self.hc_ffn, self.ffn_norm, lambda x: self.ffn(x, batch.tokens), decode)

    def _site(self, X: torch.Tensor, hc: tuple[torch.Tensor, ...], norm: torch.Tensor,
              sub_block: Callable[[torch.Tensor], torch.Tensor], decode: bool) -> torch.Tensor:
        """One mHC site around a sub-block: hc_pre, the sub-block's RMSNorm and the sub-block, hc_post. At decode
        mHC's post/comb (the Sinkhorn chain) run on a side stream next to the sub-block, joined before hc_post."""
        cfg = self.cfg
        coeffs = Branch(X, "mhc", enabled=decode, purpose="mhc")
        x, post, comb = hc_pre(X, *hc, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                               coeffs_branch=coeffs if coeffs.on else None)
        out = sub_block(rms_norm(x, norm, cfg.rms_norm_eps))
        coeffs.join()
        return hc_post(out, X, post, comb)
