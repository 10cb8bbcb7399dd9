"""Mixture-of-experts routing and the routed/shared expert MLPs (torch reference)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moebox.ops.fuse import fused
from moebox.ops.linear import Weight, linear


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


@fused
def router_logits(x: torch.Tensor, gate_weight: Weight) -> torch.Tensor:
    """[N, E] fp32: the router's product, in fp32 as the reference does."""
    return linear(x.float(), gate_weight)


@fused
def route(x: torch.Tensor, gate_weight: Weight, *, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
          tokens: torch.Tensor, top_k: int, scoring_func: str, norm_topk_prob: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (expert ids [N, k] long, weights [N, k] fp32). Hash layers pick experts by token id; the bias
    only steers selection, never the weights."""
    return route_from_logits(router_logits(x, gate_weight), bias=bias, tid2eid=tid2eid, tokens=tokens,
                             top_k=top_k, scoring_func=scoring_func, norm_topk_prob=norm_topk_prob,
                             scaling=scaling)


def route_from_logits(logits: torch.Tensor, *, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                      tokens: torch.Tensor | None, top_k: int, scoring_func: str, norm_topk_prob: bool,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` after the router's product (moebox/ops/triton/route.py is this for decode batches)."""
    scores = expert_scores(logits, scoring_func)
    if tid2eid is not None:
        idx = tid2eid[tokens].long()
    else:
        sel = scores if bias is None else scores + bias.float()
        idx = sel.topk(top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, w * scaling


@fused
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit); `limit=None` for the unclamped shared expert."""
    if limit:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def mlp(x: torch.Tensor, w1: Weight, w3: Weight, w2: Weight, limit: float | None,
        row_scale: torch.Tensor | None = None) -> torch.Tensor:
    h = swiglu(linear(x, w1), linear(x, w3), limit)
    if row_scale is not None:
        h = h * row_scale[:, None].to(h.dtype)
    return linear(h, w2)


ExpertWeights = Callable[[int], tuple[Weight, Weight, Weight]]


def routed_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts: ExpertWeights,
                   limit: float) -> torch.Tensor:
    """sum_k weights[:, k] * Expert_{idx[:, k]}(x), looping over the experts that are hit.

    Gate/up run in fp32 and the routing weight is applied before the down projection (the reference order).
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_idx = idx.flatten()
    order = torch.argsort(flat_idx, stable=True)
    hit, counts = torch.unique_consecutive(flat_idx[order], return_counts=True)
    for e, rows in zip(hit.tolist(), torch.split(order, counts.tolist())):
        tok = rows // idx.shape[1]
        w1, w3, w2 = experts(e)
        y = mlp(x[tok].float(), w1, w3, w2, limit, row_scale=weights.flatten()[rows])
        out.index_add_(0, tok, y.to(out.dtype))      # bf16 under training autocast
    return out.to(x.dtype)
