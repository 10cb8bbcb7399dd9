"""One DeepSeek-V4 decoder block: mHC around attention, then mHC around the MoE."""

from __future__ import annotations

from typing import Callable

import torch

from moebox.config import ModelConfig
from moebox.model.attention import Attention, WeightSource
from moebox.model.batch import DecodeBatch, FlatBatch
from moebox.model.cache import LayerCache
from moebox.model.moe import MoE
from moebox.ops.mhc import MixedSite, Site, hc_post_chain, hc_pre
from moebox.ops.streams import Branch
from moebox.ops.triton.l2_prefetch import prefetch_branch


class Block:
    def __init__(self, cfg: ModelConfig, get: WeightSource, prefix: str, *, kind: str, ratio: int, is_hash: bool,
                 qat: bool) -> None:
        self.cfg = cfg
        g = lambda n: get(prefix + n)  # noqa: E731
        self.attn = Attention(cfg, get, prefix + "attn.", kind, ratio, qat)
        self.ffn = MoE(cfg, get, prefix + "ffn.", is_hash)
        self.attn_site, self.ffn_site = (Site(g(f"hc_{s}_fn"), g(f"hc_{s}_base"), g(f"hc_{s}_scale"),
                                              g(f"{s}_norm.weight"), cfg.hc_eps, cfg.rms_norm_eps)
                                         for s in ("attn", "ffn"))
        self.next_site: Site | None = None   # the mHC site after this block's (the model sets it)

    def __call__(self, X: torch.Tensor, batch: FlatBatch | DecodeBatch, cache: LayerCache | None,
                 partials: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """X [N, hc, H] -> (the new streams, the partials of the next block's first mHC site: see `_site`)."""
        decode = isinstance(batch, DecodeBatch)
        # the query product's weight asked for in L2 while the attention site's mHC and wq_a run (off by default)
        prefetch = prefetch_branch(X, self.attn.from_qr.stacked()[0], "wq_b") if decode else None

        def attention(x: torch.Tensor) -> tuple[torch.Tensor, None]:
            out = self.attn(x, batch, cache)
            if prefetch is not None:   # after wo_b's launch: the edge lands on hc_post, beside the coefficients'
                prefetch.join()
            return out, None

        X, partials = self._site(X, self.attn_site, attention, decode, partials, self.ffn_site)
        return self._site(X, self.ffn_site, lambda x: self.ffn.parts(x, batch.tokens), decode, partials,
                          self.next_site)

    def _site(self, X: torch.Tensor, site: Site,
              sub_block: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]], decode: bool,
              partials: torch.Tensor | MixedSite | None, next_site: Site | None,
              ) -> tuple[torch.Tensor, torch.Tensor | MixedSite | None]:
        """One mHC site around a sub-block: hc_pre with the sub-block's RMSNorm, the sub-block (its output: one
        tensor or two to add), hc_post. At decode mHC's post/comb (the Sinkhorn chain) run on a side stream next
        to the sub-block, joined before hc_post, and the site is one or two launches of mHC: hc_pre reads
        `partials` (the logits and norms of X, which the hc_post before wrote, and at 1-2 tokens x itself), and
        hc_post writes those of `next_site` (None: the last site of the model, whose head computes its own)."""
        coeffs = Branch(X, "mhc", enabled=decode, purpose="mhc")
        x, post, comb = hc_pre(X, site.fn, site.base, site.scale, iters=self.cfg.hc_sinkhorn_iters, eps=site.eps,
                               norm_eps=site.norm_eps, coeffs_branch=coeffs if coeffs.on else None, norm=site.norm,
                               partials=partials)
        out, addend = sub_block(x)
        coeffs.join()
        return hc_post_chain(out, X, post, comb, addend=addend, next_site=next_site if decode else None)
