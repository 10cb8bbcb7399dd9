"""One DeepSeek-V4 decoder block: mHC around attention, then mHC around the MoE."""

from __future__ import annotations

from typing import Callable

import torch

from moebox.config import ModelConfig
from moebox.model.attention import Attention, WeightSource
from moebox.model.batch import DecodeBatch, FlatBatch
from moebox.model.cache import LayerCache
from moebox.model.moe import MoE
from moebox.ops.mhc import hc_post_chain, hc_pre
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
        self.next_fn: torch.Tensor | None = None   # the fn of the mHC site after this block's (the model sets it)

    def __call__(self, X: torch.Tensor, batch: FlatBatch | DecodeBatch, cache: LayerCache | None,
                 partials: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """X [N, hc, H] -> (the new streams, the partials of the next block's first mHC site: see `_site`)."""
        decode = isinstance(batch, DecodeBatch)
        X, partials = self._site(X, self.hc_attn, self.attn_norm, lambda x: (self.attn(x, batch, cache), None),
                                 decode, partials, self.hc_ffn[0])
        return self._site(X, self.hc_ffn, self.ffn_norm, lambda x: self.ffn.parts(x, batch.tokens), decode,
                          partials, self.next_fn)

    def _site(self, X: torch.Tensor, hc: tuple[torch.Tensor, ...], norm: torch.Tensor,
              sub_block: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]], decode: bool,
              partials: torch.Tensor | None, next_fn: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One mHC site around a sub-block: hc_pre with the sub-block's RMSNorm, the sub-block (its output: one
        tensor or two to add), hc_post. At decode mHC's post/comb (the Sinkhorn chain) run on a side stream next
        to the sub-block, joined before hc_post, and the site is two launches of mHC: hc_pre reads `partials`
        (the logits and norms of X, which the hc_post before wrote), and hc_post writes those of the next
        site's fn `next_fn` (None: the last site of the model, whose head computes its own)."""
        cfg = self.cfg
        coeffs = Branch(X, "mhc", enabled=decode, purpose="mhc")
        x, post, comb = hc_pre(X, *hc, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                               coeffs_branch=coeffs if coeffs.on else None, norm=norm, partials=partials)
        out, addend = sub_block(x)
        coeffs.join()
        return hc_post_chain(out, X, post, comb, addend=addend, next_fn=next_fn if decode else None)
