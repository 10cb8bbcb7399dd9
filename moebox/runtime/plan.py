"""The memory plan: what a model needs in memory, computed from its config.json alone (no weight is read).

`plan_for(cfg, memory_bytes, ...)` adds up, in bytes:
- dense weights: every tensor of the official schema that is not a routed expert of a main layer, at its stored
  precision (FP8 weights + E8M0 block scales, BF16, FP32, int tables as int32): embed, head, attention, compressors,
  indexers, routers, shared experts, norms, mHC;
- routed experts of the main layers: `experts="native"` at checkpoint precision (FP4 + one E8M0 scale per 32 =
  4.25 bits/weight, or FP8 + block scales for an FP8-expert checkpoint), `experts="w2"` as 2-bit planes at
  exactly `moebox.quant.w2.BITS_PER_WEIGHT` (2.25) bits/weight;
- the MTP block(s) (`mtp.*`), dense part and experts reported separately, left out with `with_mtp=False`;
- the KV cache: `moebox.model.cache.cache_bytes_per_slot` (the exact bytes `KVCache` allocates per sequence slot)
  for `max_model_len`, times `max_num_seqs`; its per-token growth is measured from the same function over one
  period of the compression rates (bytes(L + P) - bytes(L)) / P, so it matches the allocator, not a formula;
- a workspace estimate (see `workspace_bytes`);
- a safety margin: 1 GiB + 2 % of everything above (CUDA context, allocator fragmentation, Python, tokenizer).

`MemoryPlan.fits` compares the total with the budget; `kv_tokens_left` is how many more context tokens (summed
over sequences) the leftover memory would hold at the cache's per-token growth. `check()` turns an impossible plan
into a one-line `MoeboxError` that says by how much it overflows and which knob would make it fit.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from moebox.config import SLIDING, ModelConfig
from moebox.errors import MoeboxError
from moebox.weights.schema import official_schema

GiB = 2 ** 30
EXPERT_MODES = ("w2", "native")
_EXPERT_RE = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.")
_KV_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
              "fp32": "float32", "float32": "float32"}
MARGIN_FIXED = GiB
MARGIN_SHARE = 0.02


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _torch_dtype(kv_dtype: Any):  # -> torch.dtype
    import torch
    if isinstance(kv_dtype, torch.dtype):
        return kv_dtype
    name = _KV_DTYPES.get(str(kv_dtype).lower().removeprefix("torch."))
    if name is None:
        raise MoeboxError(f"kv dtype {kv_dtype!r} is not supported; use one of {sorted(_KV_DTYPES)}")
    return getattr(torch, name)


def workspace_bytes(cfg: ModelConfig, num_tokens: int, num_logit_rows: int, act_bytes: int) -> int:
    """Activation memory of one forward step over `num_tokens` flattened tokens (an estimate, not an allocator
    count). Covers: the residual hyper-connection streams, input and output of a block (2 x hc*H per token) in
    fp32 (mHC mixes in fp32); the largest per-token intermediate, input and output of the op alive together
    (2 x max(q heads n_h*d, grouped o_lora o_groups*r_o, routed+shared expert width (k+n_shared)*2*I, indexer
    queries n_I*d_I) in the activation dtype); fp32 logits vocab x `num_logit_rows`. Not covered: attention score
    buffers (the reference CPU attention materialises [tokens, heads, keys] scores; the fused kernels must not),
    and the caching allocator's slack (the safety margin is for that)."""
    hc_h = cfg.hc_mult * cfg.hidden_size
    widest = max(cfg.num_heads * cfg.head_dim, cfg.o_groups * cfg.o_lora_rank,
                 (cfg.num_experts_per_tok + cfg.n_shared_experts) * 2 * cfg.moe_intermediate_size,
                 cfg.index_n_heads * cfg.index_head_dim)
    return num_tokens * (2 * hc_h * 4 + 2 * widest * act_bytes) + num_logit_rows * cfg.vocab_size * 4


def _expert_nbytes(spec, experts: str) -> int:
    if experts == "native":
        return spec.stored_nbytes()
    from moebox.quant.w2 import BITS_PER_WEIGHT
    return round(math.prod(spec.shape) * BITS_PER_WEIGHT / 8)


@dataclass(frozen=True)
class MemoryPlan:
    memory_bytes: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    experts: str
    kv_dtype: str
    with_mtp: bool
    num_layers: int
    dense_bytes: int            # main model, everything but routed experts
    expert_bytes: int           # routed experts of the main layers
    mtp_dense_bytes: int
    mtp_expert_bytes: int
    kv_bytes_per_seq: int       # cache_bytes_per_slot at max_model_len
    kv_bytes_per_token: float   # growth of the cache per context token (amortised over the compression period)
    workspace_bytes: int
    margin_bytes: int
    w2_expert_bytes: int        # main-layer routed experts as w2 planes (what --experts w2 would need)
    w2_mtp_expert_bytes: int    # MTP routed experts as w2 planes (0 without MTP)
    cfg: ModelConfig | None = field(default=None, repr=False, compare=False)   # for the advice's what-ifs
    spec_slack: int = 0
    kv_layout: str = "model"    # "fp8": DeepSeek's FP8/FP4 cache layout (model/cache.py)

    def _total_with(self, max_model_len: int, max_num_seqs: int) -> int:
        """The total this plan would have at another context length / sequence count (KV and workspace redone)."""
        from moebox.model.cache import cache_bytes_per_slot
        assert self.cfg is not None
        dtype = _torch_dtype(self.kv_dtype)
        kv = cache_bytes_per_slot(self.cfg, max_model_len, dtype, self.spec_slack, self.with_mtp,
                                  self.kv_layout) * max_num_seqs
        work = workspace_bytes(self.cfg, self.max_num_batched_tokens, max_num_seqs, dtype.itemsize)
        need = self.weight_bytes + kv + work
        return need + MARGIN_FIXED + round(need * MARGIN_SHARE)

    def _largest(self, hi: int, total_at) -> int:
        """Largest n in [1, hi] with total_at(n) within budget, 0 if none (total_at grows with n)."""
        if total_at(1) > self.memory_bytes:
            return 0
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if total_at(mid) <= self.memory_bytes else (lo, mid - 1)
        return lo

    @property
    def mtp_bytes(self) -> int:
        return self.mtp_dense_bytes + self.mtp_expert_bytes

    @property
    def weight_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes + self.mtp_bytes

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_seq * self.max_num_seqs

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.workspace_bytes + self.margin_bytes

    @property
    def free_bytes(self) -> int:
        """Budget minus total; negative when the plan does not fit."""
        return self.memory_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.free_bytes >= 0

    @property
    def kv_tokens_left(self) -> int:
        """More context tokens (summed over sequences) the leftover memory would hold; 0 when it does not fit."""
        if not self.fits or self.kv_bytes_per_token <= 0:
            return 0
        return int(self.free_bytes // self.kv_bytes_per_token)

    def table(self) -> str:
        bits = "2.25 bits/weight" if self.experts == "w2" else "checkpoint precision"
        rows = [
            ("dense weights (attention, shared experts, embed, head, norms)", self.dense_bytes),
            (f"routed experts, {self.experts} ({bits})", self.expert_bytes),
        ]
        if self.with_mtp:
            rows.append((f"MTP block (dense {self.mtp_dense_bytes / GiB:.2f} + experts "
                         f"{self.mtp_expert_bytes / GiB:.2f})", self.mtp_bytes))
        else:
            rows.append(("MTP block (off)", 0))
        rows += [
            (f"KV cache ({self.kv_bytes_per_seq / GiB:.2f} GiB/seq x {self.max_num_seqs}, "
             f"{self.kv_bytes_per_token:.0f} B/token, {'fp8 layout' if self.kv_layout == 'fp8' else self.kv_dtype})", self.kv_bytes),
            (f"workspace ({self.max_num_batched_tokens} batched tokens)", self.workspace_bytes),
            (f"safety margin (1 GiB + {MARGIN_SHARE:.0%})", self.margin_bytes),
            ("total", self.total_bytes),
            ("memory budget", self.memory_bytes),
        ]
        width = max(len(r[0]) for r in rows)
        head = (f"memory plan: {self.num_layers} layers, experts {self.experts}, max_model_len {self.max_model_len}"
                f" x {self.max_num_seqs} seq(s)")
        lines = [head] + [f"  {name:<{width}}  {n / GiB:>8.2f} GiB" for name, n in rows]
        if self.fits:
            lines.append(f"  {'left over':<{width}}  {self.free_bytes / GiB:>8.2f} GiB"
                         f"  -> fits; room for {self.kv_tokens_left:,} more KV tokens")
        else:
            lines.append(f"  {'over budget':<{width}}  {-self.free_bytes / GiB:>8.2f} GiB  -> does NOT fit")
        return "\n".join(lines)

    def advice(self) -> list[str]:
        """What would make an over-budget plan fit, each lever on its own (with what it saves)."""
        over = -self.free_bytes
        out: list[str] = []
        if self.experts == "native" and self.expert_bytes:
            saved = self.expert_bytes + self.mtp_expert_bytes - self.w2_expert_bytes - self.w2_mtp_expert_bytes
            out.append(f"--experts w2 (saves {_gib(saved * (1 + MARGIN_SHARE))})")
        if self.with_mtp and self.mtp_bytes:
            out.append(f"--no-mtp (saves {_gib(self.mtp_bytes * (1 + MARGIN_SHARE))})")
        if self.cfg is not None:
            n_len = self._largest(self.max_model_len, lambda n: self._total_with(n, self.max_num_seqs))
            if n_len:
                out.append(f"--max-model-len {n_len} or less")
            if self.max_num_seqs > 1:
                n_seqs = self._largest(self.max_num_seqs, lambda n: self._total_with(self.max_model_len, n))
                if n_seqs:
                    out.append(f"--max-num-seqs {n_seqs} or less")
        only_mtp = all(lever.startswith("--no-mtp") for lever in out)
        if not out or (only_mtp and self.mtp_bytes * (1 + MARGIN_SHARE) < over):
            out.append("--experts w2 --no-mtp with a shorter --max-model-len / fewer --max-num-seqs / "
                       "--max-num-batched-tokens (no single flag is enough)")
        return out

    def check(self) -> "MemoryPlan":
        """Raise a one-line MoeboxError when the plan does not fit in the budget; return self otherwise."""
        if self.fits:
            return self
        floor = self.dense_bytes + self.w2_expert_bytes + MARGIN_FIXED
        if floor > self.memory_bytes:
            fix = (f"no setting fits: the weights alone need {_gib(floor)} even with --experts w2 --no-mtp (incl. "
                   f"the 1 GiB margin); use a machine with more memory, or raise --memory if more is really free")
        else:
            fix = f"to fit, use {' / '.join(self.advice())}, or raise --memory if more is really free"
        raise MoeboxError(
            f"memory plan does not fit: needs {_gib(self.total_bytes)} (weights {_gib(self.weight_bytes)}, "
            f"KV cache {_gib(self.kv_bytes)}, workspace {_gib(self.workspace_bytes)}, margin "
            f"{_gib(self.margin_bytes)}) but the budget is {_gib(self.memory_bytes)}: over by "
            f"{_gib(-self.free_bytes)}; {fix}")


def plan_for(cfg: ModelConfig, memory_bytes: int, max_model_len: int, max_num_seqs: int = 1,
             max_num_batched_tokens: int = 2048, experts: str = "w2", kv_dtype: Any = "bf16",
             with_mtp: bool = True, spec_slack: int = 0, kv_layout: str = "model") -> MemoryPlan:
    """The memory plan of `cfg` for a budget of `memory_bytes` (see the module docstring for what it counts)."""
    from moebox.model.cache import cache_bytes_per_slot

    if experts not in EXPERT_MODES:
        raise MoeboxError(f"experts={experts!r} is not supported; use one of {EXPERT_MODES}")
    for name, v in (("max-model-len", max_model_len), ("max-num-seqs", max_num_seqs),
                    ("max-num-batched-tokens", max_num_batched_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MoeboxError(f"--{name} must be a positive integer, got {v!r}")
    if max_model_len > cfg.max_position_embeddings:
        raise MoeboxError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
                          f"{cfg.max_position_embeddings}")
    with_mtp = with_mtp and cfg.num_mtp_layers > 0
    dtype = _torch_dtype(kv_dtype)

    dense = experts_b = mtp_dense = mtp_experts = w2_b = w2_mtp = 0
    for name, spec in official_schema(cfg).items():
        is_mtp = name.startswith("mtp.")
        if is_mtp and not with_mtp:
            continue
        if _EXPERT_RE.match(name):
            nb = _expert_nbytes(spec, experts)
            w2 = _expert_nbytes(spec, "w2") if experts != "w2" else nb
            if is_mtp:
                mtp_experts += nb
                w2_mtp += w2
            else:
                experts_b += nb
                w2_b += w2
        elif is_mtp:
            mtp_dense += spec.stored_nbytes()
        else:
            dense += spec.stored_nbytes()

    per_seq = cache_bytes_per_slot(cfg, max_model_len, dtype, spec_slack, with_mtp, kv_layout)
    period = math.lcm(*[r for r, k in zip(cfg.compress_ratios, cfg.attn_types) if k != SLIDING] or [1])
    growth = (cache_bytes_per_slot(cfg, max_model_len + period, dtype, spec_slack, with_mtp, kv_layout)
              - per_seq) / period
    act_bytes = dtype.itemsize
    work = workspace_bytes(cfg, max_num_batched_tokens, max_num_seqs, act_bytes)
    need = dense + experts_b + mtp_dense + mtp_experts + per_seq * max_num_seqs + work
    margin = MARGIN_FIXED + round(need * MARGIN_SHARE)
    return MemoryPlan(
        memory_bytes=int(memory_bytes), max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, experts=experts, kv_dtype=str(dtype).removeprefix("torch."),
        kv_layout=kv_layout,
        with_mtp=with_mtp, num_layers=cfg.num_layers, dense_bytes=dense, expert_bytes=experts_b,
        mtp_dense_bytes=mtp_dense, mtp_expert_bytes=mtp_experts, kv_bytes_per_seq=per_seq,
        kv_bytes_per_token=growth, workspace_bytes=work, margin_bytes=margin, w2_expert_bytes=w2_b,
        w2_mtp_expert_bytes=w2_mtp, cfg=cfg, spec_slack=spec_slack)


def available_memory(device: Any = "cpu") -> int:
    """Bytes free for moebox now: CPU: MemAvailable of /proc/meminfo (page cache that can be dropped counts as
    available); CUDA: the free bytes torch.cuda.mem_get_info reports for that device."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    if kind == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise MoeboxError("device 'cuda' but no CUDA device is available; use device='cpu'")
        return int(torch.cuda.mem_get_info(device if str(device) != "cuda" else None)[0])
    if kind != "cpu":
        raise MoeboxError(f"device {device!r}: cannot tell its free memory; pass the memory budget explicitly")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        raise MoeboxError("cannot tell how much memory is available (no /proc/meminfo); pass --memory") from None


_UNITS = {"": 1, "b": 1, "byte": 1, "bytes": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: Any, flag: str = "--memory") -> int:
    """'121.7GiB', '80GB', '512MiB', '1e9', 123456 -> bytes. GiB/MiB/KiB/TiB are powers of 2, GB/MB/KB/TB of 10."""
    if isinstance(text, bool):
        raise MoeboxError(f"{flag} {text!r}: not a size; give e.g. 121.7GiB, 80GB, 512MiB or a byte count")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _SIZE_RE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise MoeboxError(f"{flag} {text!r}: not a size; give e.g. 121.7GiB, 80GB, 512MiB or a byte count")
        value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value * _UNITS[unit]) or value * _UNITS[unit] < 1:
        raise MoeboxError(f"{flag} {text!r}: the size must be a positive, finite number of bytes")
    return int(value * _UNITS[unit])
