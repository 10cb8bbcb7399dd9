"""The MoE feed-forward of every DeepSeek-V4 block: routed experts (hash or scored routing) + shared expert.

Routed experts run through the torch reference (`ops.moe.routed_experts`), except for w2 experts on CUDA, which
take Triton kernels over the plane store's layer buffer (zero-copy views): the fused decode kernels for a few
tokens, the grouped prefill GEMM for more (MOEBOX_W2_PREFILL_KERNEL=0 keeps the reference there). A decode
batch on CUDA also routes in one Triton kernel."""

from __future__ import annotations

from typing import Callable

import torch

from moebox.config import ModelConfig
from moebox.model.attention import WeightSource
from moebox.ops.linear import SharedInputLinear, linear, logits_linear
from moebox.ops.moe import route, route_from_logits, routed_experts, swiglu
from moebox.ops.streams import Branch
from moebox.ops.triton.runtime import kernel_or_fallback, kernel_switched_on, opt_in


DECODE_TOKENS = 16     # up to this many tokens, w2 experts on CUDA run the fused Triton decode kernels
# up to this many tokens the router's product and routing are one launch: on the H200 (V4-Flash, 4K context) it
# gained 0.06-0.28 ms a step at batch 2-8, tied at 1 and lost 0.2-1.0 ms at 16 (each token's programs read the
# whole gate weight again)
ROUTER_KERNEL_TOKENS = 8


class MoE:
    def __init__(self, cfg: ModelConfig, get: WeightSource, prefix: str, is_hash: bool) -> None:
        self.cfg = cfg
        self.gate = get(prefix + "gate.weight")
        self.bias = None if is_hash else get(prefix + "gate.bias")
        self.tid2eid = get(prefix + "gate.tid2eid") if is_hash else None
        self.shared_in = self.shared_out = None
        if cfg.n_shared_experts:      # gate and up read the same x: one product where their formats stack
            self.shared_in = SharedInputLinear(*(get(f"{prefix}shared_experts.{w}.weight") for w in ("w1", "w3")))
            self.shared_out = get(prefix + "shared_experts.w2.weight")
        self.experts = [tuple(get(f"{prefix}experts.{e}.{w}.weight") for w in ("w1", "w3", "w2"))
                        for e in range(cfg.n_routed_experts)]
        self.on_route: Callable[[torch.Tensor], None] | None = None   # observer of the chosen experts [N, k]
        try:                                    # a plane-store layer buffer [experts, slot] when experts are w2
            self.layer_planes = get(prefix + "experts.planes")
        except KeyError:
            self.layer_planes = None
        self.tiled_codes = self._tile_codes()

    def _tile_codes(self) -> bool:
        """With MOEBOX_TILED_CODES=1, a CUDA layer buffer's codes are relaid tile by tile here (and so its
        per-expert views', which the reference then reads through row-major copies): the order in which a warp's
        K step of the expert kernels is one contiguous KB. Off by default until a decode step shows it wins
        (docs/benchmarks.md); shapes that are not multiples of 256 (the fma kernels') stay row-major."""
        cfg, buf = self.cfg, self.layer_planes
        if not opt_in("MOEBOX_TILED_CODES") or buf is None or not buf.is_cuda:
            return False
        from moebox.ops.triton.w2_moe import tile_layer_codes, tile_order_fits
        if not tile_order_fits(cfg.hidden_size, cfg.moe_intermediate_size):
            return False
        tile_layer_codes(buf, cfg.hidden_size, cfg.moe_intermediate_size)
        return True

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        out, shared = self.parts(x, tokens)
        return out if shared is None else out + shared

    def parts(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the routed experts' output, the shared expert's or None): their sum is the layer's output, which the
        block's hc_post adds in its own launch."""
        if self.shared_in is None:
            return self.routed(x, tokens), None
        # at decode the shared expert runs on a side stream next to the routing and the routed experts
        with Branch(x, "moe", reads=(x,), enabled=x.shape[0] <= DECODE_TOKENS) as shared_branch:
            shared = self.shared_expert(x)
        out = self.routed(x, tokens)
        shared_branch.join()
        return out, shared

    def route(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k], weights [N, k] fp32). A decode batch of a scored layer on CUDA routes its logits in
        one Triton kernel (moebox/ops/triton/route.py; MOEBOX_ROUTE_KERNEL=0 keeps the torch code)."""
        cfg = self.cfg
        kw = dict(top_k=cfg.num_experts_per_tok, scoring_func=cfg.scoring_func, norm_topk_prob=cfg.norm_topk_prob,
                  scaling=cfg.routed_scaling_factor)
        if self.tid2eid is None and x.shape[0] <= DECODE_TOKENS and kernel_switched_on(x, "MOEBOX_ROUTE_KERNEL"):
            from moebox.ops.triton import route as kernel
            if self._fused_router_takes(x, kernel):
                return kernel_or_fallback(
                    "router", "MOEBOX_ROUTER_KERNEL", lambda: kernel.router_route_triton(x, self.gate, self.bias, **kw),
                    lambda: route(x, self.gate, bias=self.bias, tid2eid=None, tokens=tokens, **kw))
            logits = logits_linear(x, self.gate)     # bf16 x and gate on CUDA: one product, no fp32 copies
            if kernel.supported(logits, cfg.scoring_func, cfg.num_experts_per_tok):
                return kernel_or_fallback(
                    "routing", "MOEBOX_ROUTE_KERNEL", lambda: kernel.route_triton(logits, self.bias, **kw),
                    lambda: route_from_logits(logits, bias=self.bias, tid2eid=None, tokens=None, **kw))
        return route(x, self.gate, bias=self.bias, tid2eid=self.tid2eid, tokens=tokens, **kw)

    def _fused_router_takes(self, x: torch.Tensor, kernel) -> bool:
        """Whether the router's product and the routing run as one launch (`router_route_triton`): up to
        `ROUTER_KERNEL_TOKENS` tokens (MOEBOX_ROUTER_KERNEL=0 / 1: never / up to the kernel's limit), outside
        autograd, for a float gate weight."""
        return (kernel_switched_on(x, "MOEBOX_ROUTER_KERNEL", default=x.shape[0] <= ROUTER_KERNEL_TOKENS)
                and isinstance(self.gate, torch.Tensor)
                and not (torch.is_grad_enabled() and (x.requires_grad or self.gate.requires_grad))
                and kernel.router_supported(x, self.gate, self.cfg.scoring_func, self.cfg.num_experts_per_tok))

    def routed(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        kernels = self.layer_planes is not None and x.is_cuda
        if kernels:
            from moebox.ops.triton.w2_moe import layer_views, pack_x_ahead, w2_moe_decode_split
            views = layer_views(self.layer_planes, cfg.hidden_size, cfg.moe_intermediate_size)
            decode = x.shape[0] <= DECODE_TOKENS
            packed = pack_x_ahead(x, views[0], views[2], views[4]) if decode else None   # beside the routing
        idx, w = self.route(x, tokens)
        if self.on_route is not None:
            self.on_route(idx)
        reference = lambda: routed_experts(x, idx, w, self._expert, cfg.swiglu_limit)  # noqa: E731
        if not kernels:
            return reference()
        if decode:
            return w2_moe_decode_split(x, idx, w.float(), *views, cfg.swiglu_limit, packed=packed,
                                       tiled=self.tiled_codes)
        if not kernel_switched_on(x, "MOEBOX_W2_PREFILL_KERNEL"):
            return reference()
        from moebox.ops.triton.w2_moe_prefill import w2_moe_prefill_split
        return kernel_or_fallback(
            "w2 prefill", "MOEBOX_W2_PREFILL_KERNEL",
            lambda: w2_moe_prefill_split(x, idx, w, *views, cfg.swiglu_limit, tiled=self.tiled_codes), reference)

    def _expert(self, e: int) -> tuple:
        """Expert e's (w1, w3, w2) for the reference: row-major copies of its planes where the codes are tiled."""
        if not self.tiled_codes:
            return self.experts[e]
        from moebox.ops.triton.w2_moe import untile_codes
        from moebox.quant.w2 import W2Tensor
        return tuple(W2Tensor(untile_codes(t.codes[None])[0], t.scales) for t in self.experts[e])

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.shared_in(x)
        return linear(swiglu(gate, up, None), self.shared_out)   # the reference does not clamp the shared expert
