"""Attention with a learnable per-head sink, where keys double as values (DeepSeek-V4's single K=V head)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from moebox.ops.fuse import fused


@contextlib.contextmanager
def matmul_tf32(enabled: bool) -> Iterator[None]:
    """torch's CUDA fp32 matmuls with TF32 tensor cores on or off for the duration, restored after."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


@contextlib.contextmanager
def tf32_products(q: torch.Tensor) -> Iterator[None]:
    """TF32 tensor cores for the fp32 products of a bf16/fp16 attention on CUDA. The scores are products of
    bf16/fp16 values, which TF32 holds exactly (11 significant bits), so q.k stays exact in fp32 and only the
    probabilities are rounded (to 11 bits) for p.v. Without it a 2048-token prefill chunk spent ~60% of its
    time in fp32 FFMA GEMMs of the attention (seventh session's prefill profile). fp32 runs keep IEEE fp32."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or torch.compiler.is_compiling():
        yield
        return
    with matmul_tf32(True):
        yield


def sink_attention(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [L, nh, d], keys [K, d] shared by the L queries or [L, K, d] per query, visible [L, K] bool,
    sinks [nh] -> [L, nh, d].

    softmax over (scores of visible keys, sink logit); the sink only enlarges the denominator.
    """
    with tf32_products(q):
        return _sink_attention(q, keys, visible, sinks, scale)


def local_sink_attention(q: torch.Tensor, kv: torch.Tensor, window: int, sinks: torch.Tensor, scale: float,
                         entries: torch.Tensor | None = None, ent_visible: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """`sink_attention` for B sequences of T tokens from position 0 at once, without a cache: q [B, T, nh, d],
    kv [B, T, d]; token t sees keys t-window+1..t and the entries [B, E, d] where `ent_visible` [B or 1, T, E]
    says so. -> [B, T, nh, d].

    Queries go in chunks of `window` tokens, each against the keys of its own and the previous chunk, so the
    window part costs T x 2*window scores, not T x T (what keeps a long training row affordable)."""
    with tf32_products(q):
        return _local_sink_attention(q, kv, window, sinks, scale, entries, ent_visible)


@fused
def _sink_attention(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor,
                    scale: float) -> torch.Tensor:
    k = "lkd" if keys.dim() == 3 else "kd"
    s = torch.einsum(f"lhd,{k}->lhk", q.float(), keys.float()) * scale
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(s.shape[0], -1, 1)
    logits = torch.cat([s, sink], dim=-1)
    p = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum(f"lhk,{k}->lhd", p, keys.float()).to(q.dtype)


@fused
def _local_sink_attention(q: torch.Tensor, kv: torch.Tensor, window: int, sinks: torch.Tensor, scale: float,
                          entries: torch.Tensor | None, ent_visible: torch.Tensor | None) -> torch.Tensor:
    b, t, nh, d = q.shape
    c = -(-t // window)                                                    # chunks
    pad = c * window - t
    qf = q.float()
    qc = torch.nn.functional.pad(qf, (0, 0, 0, 0, 0, pad)).view(b, c, window, nh, d)
    kvp = torch.nn.functional.pad(kv.float(), (0, 0, window, pad))         # [B, window + c*window, d]
    keys = kvp.unfold(1, 2 * window, window).transpose(-1, -2)             # [B, c, 2*window, d]
    qpos = torch.arange(c * window, device=q.device).view(c, window, 1)
    kpos = (torch.arange(c, device=q.device) * window - window).view(c, 1, 1) + torch.arange(
        2 * window, device=q.device).view(1, 1, -1)
    visible = (kpos <= qpos) & (kpos > qpos - window) & (kpos >= 0)        # [c, window, 2*window]
    s = torch.einsum("bcihd,bcjd->bcihj", qc, keys) * scale
    s = s.masked_fill(~visible[None, :, :, None, :], float("-inf"))
    parts = [s]
    if entries is not None:
        ent = entries.float()
        se = torch.einsum("bthd,bed->bthe", qf, ent) * scale
        se = se.masked_fill(~ent_visible[:, :, None, :], float("-inf"))
        parts.append(torch.nn.functional.pad(se, (0, 0, 0, 0, 0, pad)).view(b, c, window, nh, -1))
    parts.append(sinks.float().view(1, 1, 1, nh, 1).expand(b, c, window, nh, 1))
    logits = torch.cat(parts, dim=-1)
    p = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)
    out = torch.einsum("bcihj,bcjd->bcihd", p[..., :2 * window], keys)
    if entries is not None:
        pe = p[..., 2 * window:-1].reshape(b, c * window, nh, -1)
        out = out.view(b, c * window, nh, d) + torch.einsum("bthe,bed->bthd", pe, ent)
    return out.reshape(b, c * window, nh, d)[:, :t].to(q.dtype)
