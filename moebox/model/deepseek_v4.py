"""The DeepSeek-V4 model over flat batches: embedding, 43 (or N) blocks, HC head, norm, lm head, MTP block.

Weights come from a `WeightSource` (canonical official tensor names -> tensors kept in their stored format),
so the same code runs a FP8/FP4 official checkpoint, a bf16/fp32 transformers checkpoint, or later 2-bit
expert planes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moebox.config import SLIDING, ModelConfig
from moebox.model.attention import WeightSource
from moebox.model.batch import DecodeBatch, FlatBatch
from moebox.model.block import Block
from moebox.model.cache import KVCache, LayerCache
from moebox.ops.linear import linear, logits_linear
from moebox.ops.mhc import hc_head
from moebox.ops.norm import rms_norm


@dataclass
class ForwardOutput:
    logits: torch.Tensor     # [rows, vocab] fp32
    hidden: torch.Tensor     # [N, hc, H] final residual streams (pre HC head): the MTP block's input


class OutputHead:
    """HC head -> RMSNorm -> lm head (fp32, as the reference computes it)."""

    def __init__(self, cfg: ModelConfig, hc: tuple[torch.Tensor, ...], norm: torch.Tensor, head) -> None:
        self.cfg, self.hc, self.norm, self.head = cfg, hc, norm, head

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        y = hc_head(X, *self.hc, eps=self.cfg.hc_eps, norm_eps=self.cfg.rms_norm_eps)
        return logits_linear(rms_norm(y, self.norm, self.cfg.rms_norm_eps), self.head)


class MTPBlock:
    """Multi-token prediction block (deepseek_v4.md §2.9): from the main model's final residual at t and
    token t+1, predicts token t+2. Shares the main embedding and lm head; owns a sliding-window layer."""

    def __init__(self, cfg: ModelConfig, get: WeightSource, prefix: str, qat: bool, embed, head) -> None:
        g = lambda n: get(prefix + n)  # noqa: E731
        self.cfg, self.embed = cfg, embed
        self.e_proj, self.h_proj = g("e_proj.weight"), g("h_proj.weight")
        self.enorm, self.hnorm = g("enorm.weight"), g("hnorm.weight")
        self.block = Block(cfg, get, prefix, kind=SLIDING, ratio=0, is_hash=False, qat=qat)
        self.out = OutputHead(cfg, (g("hc_head_fn"), g("hc_head_base"), g("hc_head_scale")), g("norm.weight"), head)

    def __call__(self, hidden: torch.Tensor, batch: FlatBatch | DecodeBatch, cache: LayerCache | None,
                 logits_rows: torch.Tensor | None = None) -> ForwardOutput:
        """hidden [N, hc, H] at positions batch.positions; batch.tokens are the tokens one step ahead."""
        eps = self.cfg.rms_norm_eps
        e = rms_norm(self.embed[batch.tokens].to(hidden.dtype), self.enorm, eps)
        h = rms_norm(hidden, self.hnorm, eps)
        X = linear(e, self.e_proj).unsqueeze(1) + linear(h, self.h_proj)
        X, _ = self.block(X, batch, cache)
        rows = batch.last_rows() if logits_rows is None else logits_rows
        return ForwardOutput(self.out(X[rows]), X)


class DeepseekV4:
    def __init__(self, cfg: ModelConfig, get: WeightSource, *, qat: bool, dtype: torch.dtype,
                 load_mtp: bool = True, kv_layout: str = "model") -> None:
        self.cfg, self.qat, self.dtype, self.kv_layout = cfg, qat, dtype, kv_layout
        self.embed = get("embed.weight")
        head = get("head.weight")
        self.out = OutputHead(cfg, (get("hc_head_fn"), get("hc_head_base"), get("hc_head_scale")),
                              get("norm.weight"), head)
        self.layers = [Block(cfg, get, f"layers.{i}.", kind=cfg.attn_types[i], ratio=cfg.compress_ratios[i],
                             is_hash=cfg.hash_layers[i], qat=qat) for i in range(cfg.num_layers)]
        for block, after in zip(self.layers, self.layers[1:]):
            block.next_fn = after.hc_attn[0]
        self.mtp = [MTPBlock(cfg, get, f"mtp.{j}.", qat, self.embed, head)
                    for j in range(cfg.num_mtp_layers if load_mtp else 0)]

    def forward(self, batch: FlatBatch | DecodeBatch, cache: KVCache | None = None,
                logits_rows: torch.Tensor | None = None) -> ForwardOutput:
        """Run a flat batch. Without a cache every segment must start at position 0 and nothing is kept.
        Logits are computed for `logits_rows` (default: each segment's last token)."""
        if cache is None and (isinstance(batch, DecodeBatch) or any(s.start for s in batch.segments)):
            raise ValueError("a DecodeBatch, or a segment starting after position 0, needs a KVCache")
        X = self.embed[batch.tokens].to(self.dtype)
        X = X.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        partials = None   # a decode step's mHC chain: each block's last hc_post feeds the next one's hc_pre
        for i, layer in enumerate(self.layers):
            X, partials = layer(X, batch, cache.layers[i] if cache is not None else None, partials)
        rows = batch.last_rows() if logits_rows is None else logits_rows
        return ForwardOutput(self.out(X[rows]), X)

    def mtp_forward(self, hidden: torch.Tensor, batch: FlatBatch | DecodeBatch, cache: KVCache | None = None,
                    depth: int = 0, logits_rows: torch.Tensor | None = None) -> ForwardOutput:
        layer_cache = cache.layers[self.cfg.num_layers + depth] if cache is not None else None
        return self.mtp[depth](hidden, batch, layer_cache, logits_rows)

    def new_cache(self, num_slots: int, max_len: int, device: torch.device | str, spec_slack: int = 0) -> KVCache:
        return KVCache(self.cfg, num_slots, max_len, self.dtype, device, spec_slack, with_mtp=bool(self.mtp),
                       kv_layout=self.kv_layout)
