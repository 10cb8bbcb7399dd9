"""DeepSeek-V4 attention over a flat batch: sliding window, CSA (compressed + lightning indexer) and HCA.

Per token t the keys are the window (positions t-W+1..t) plus, in compressed layers, entries of closed
windows w < (t+1)//ratio (HCA: all of them; CSA: the indexer's top-k). Keys are also the values.
Cache I/O happens per segment: a segment reads what earlier steps stored for its slot, attends over that
plus its own new rows, then stores its newest rows (see model/cache.py for why rollback is free).
A `DecodeBatch` (one token per sequence, indices on the device) takes a shape-static path instead that a CUDA
graph can capture: whole rings and entry tables are read and masked by position, the entry of a window that
does not close at this token goes to the table's scratch row, and the indexer's top-k runs over the table.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from moebox.config import CSA, SLIDING, ModelConfig
from moebox.model.batch import DecodeBatch, FlatBatch, Segment
from moebox.model.cache import LayerCache, as_stored, ring_read, ring_write
from moebox.model.decode_attention import (attend, compress_step, index_select, rope_keys, store_keys,
                                           window_step)
from moebox.ops.attention import local_sink_attention, sink_attention, tf32_products
from moebox.ops.compress import pool_windows
from moebox.ops.linear import SharedInputLinear, Weight, grouped_linear, linear
from moebox.ops.qat import round_index_vectors, round_kv_nope
from moebox.ops.rope import inverse_rope, norm_rope, query_rope, rope_inv_freq
from moebox.ops.streams import Branch
from moebox.ops.triton.runtime import kernel_or_fallback, kernel_switched_on

WeightSource = Callable[[str], Weight]


def attention_kernel_takes(q: torch.Tensor, ring: object, entries: object) -> bool:
    """Whether a decode step's attention read runs as the fused Triton kernel (moebox/ops/triton/
    decode_attention.py): CUDA tensors in plain (not FP8-row) caches, unless MOEBOX_ATTENTION_KERNEL=0. The
    kernel's own `supported` check still applies; anything else takes the compiled torch `attend`."""
    if not kernel_switched_on(q, "MOEBOX_ATTENTION_KERNEL"):
        return False
    return isinstance(ring, torch.Tensor) and (entries is None or isinstance(entries, torch.Tensor))


def attend_decode(q, ring, slot, visible, sink, scale, entries, rows, valid, rope, query=None,
                  query_early=False) -> torch.Tensor:
    from moebox.ops.triton.decode_attention import attend_decode as kernel_or_torch
    return kernel_or_torch(q, ring, slot, visible, sink, scale, entries, rows, valid, rope, query, query_early)


class Compressor:
    """Pools every `ratio` tokens into one entry of width `dim` (the main compressor or the indexer's)."""

    def __init__(self, get: WeightSource, prefix: str, *, ratio: int, overlap: bool, inv_freq: torch.Tensor,
                 eps: float, finish: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Its projections `wkv` and `wgate` run with the attention's other projections of x (`Attention.from_x`);
        the compressor takes their output rows (widened to fp32 where it pools them; `ape` is added then)."""
        self.ape, self.norm = get(prefix + "ape"), get(prefix + "norm.weight")
        self.ratio, self.overlap, self.inv_freq, self.eps, self.finish = ratio, overlap, inv_freq, eps, finish

    def entries_for(self, seg: Segment, kv: torch.Tensor, gate: torch.Tensor, ring_kv: torch.Tensor | None,
                    ring_gate: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries of the windows that close inside `seg` -> (window ids [nw], entries [nw, dim]).

        kv/gate are this segment's rows; earlier rows a window still needs come from the rings, which are
        then updated with the segment's rows.
        """
        r = self.ratio
        kv, gate = kv.float(), gate.float()
        w_lo, w_hi = seg.start // r, (seg.end + 1) // r - 1
        windows = torch.arange(w_lo, w_hi + 1, device=kv.device)
        dev = kv.device
        if windows.numel():
            first = max(0, (w_lo - (1 if self.overlap else 0)) * r)
            if first < seg.start:
                assert ring_kv is not None and ring_gate is not None, "positions before the segment need a cache"
                old = torch.arange(first, seg.start, device=dev)
                kv_rows = torch.cat([ring_read(ring_kv, seg.slot, old), kv])
                gate_rows = torch.cat([ring_read(ring_gate, seg.slot, old), gate])
            else:
                kv_rows, gate_rows = kv, gate
            pos = torch.arange(first, seg.end + 1, device=dev)
            gate_rows = gate_rows + self.ape.float()[pos % r]
            entries = self._finish(pool_windows(kv_rows, gate_rows, first, windows, r, self.overlap), windows,
                                   out_dtype)
        else:
            entries = kv.new_zeros((0, kv.shape[-1] // (2 if self.overlap else 1)), dtype=out_dtype)
        if ring_kv is not None:
            positions = torch.arange(seg.start, seg.end + 1, device=dev)
            ring_write(ring_kv, seg.slot, positions, kv)
            ring_write(ring_gate, seg.slot, positions, gate)
        return windows, entries

    def fresh_entries(self, kv: torch.Tensor, gate: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """`entries_for` of B cache-free sequences of T tokens from position 0 at once: kv/gate [B, T, C] ->
        entries [B, T // ratio, dim]."""
        b, t, _ = kv.shape
        windows = torch.arange(t // self.ratio, device=kv.device)
        kv, gate = kv.float(), gate.float()
        gate = gate + self.ape.float()[torch.arange(t, device=kv.device) % self.ratio]
        pooled = pool_windows(kv, gate, 0, windows, self.ratio, self.overlap)               # [B, nw, dim]
        e = self._finish(pooled.flatten(0, 1), windows.repeat(b), out_dtype)
        return e.view(b, windows.numel(), e.shape[-1])

    def _finish(self, pooled: torch.Tensor, windows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        e = norm_rope(pooled, self.norm, self.eps, windows * self.ratio, self.inv_freq)
        if self.finish is not None:
            e = self.finish(e)
        return e.to(out_dtype)


def _visible_entries(store: torch.Tensor | None, slot: int, windows: torch.Tensor, new: torch.Tensor,
                     n_visible: int) -> torch.Tensor:
    """Entries 0..n_visible-1 of a slot: write the new ones into the cache (if any) and read them all back."""
    if store is None:
        return new[:n_visible]
    if windows.numel():
        store[slot, windows] = new
    return store[slot, :n_visible]


class Attention:
    def __init__(self, cfg: ModelConfig, get: WeightSource, prefix: str, kind: str, ratio: int, qat: bool) -> None:
        self.cfg, self.kind, self.ratio, self.qat = cfg, kind, ratio, qat
        g = lambda n: get(prefix + n)  # noqa: E731
        self.q_norm, self.kv_norm = g("q_norm.weight"), g("kv_norm.weight")
        self.wo_a, self.wo_b, self.sink = g("wo_a.weight"), g("wo_b.weight"), g("attn_sink")
        # the projections of x (the query latent and K=V; the compressors' and the indexer's), then those of the
        # q latent qr, each set as few products as the formats allow
        self.from_x = SharedInputLinear(g("wq_a.weight"), g("wkv.weight"))
        pool_names = (["compressor.wkv", "compressor.wgate"] if kind != SLIDING else []) + (
            ["indexer.weights_proj", "indexer.compressor.wkv", "indexer.compressor.wgate"] if kind == CSA else [])
        self.pool_from_x = SharedInputLinear(*(g(n + ".weight") for n in pool_names)) if pool_names else None
        qr_names = ["wq_b"] + (["indexer.wq_b"] if kind == CSA else [])
        self.from_qr = SharedInputLinear(*(g(n + ".weight") for n in qr_names))
        theta, yarn = cfg.layer_rope(kind)
        self.inv_freq = rope_inv_freq(cfg.rope_head_dim, theta, yarn).to(self.sink.device)
        self.compressor = self.indexer = None
        eps = cfg.rms_norm_eps
        if kind != SLIDING:
            finish = (lambda e: round_kv_nope(e, cfg.nope_head_dim)) if qat else None
            self.compressor = Compressor(get, prefix + "compressor.", ratio=ratio, overlap=kind == CSA,
                                         inv_freq=self.inv_freq, eps=eps, finish=finish)
        if kind == CSA:
            self.index_scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5      # of the head weights
            self.indexer = Compressor(get, prefix + "indexer.compressor.", ratio=ratio, overlap=True,
                                      inv_freq=self.inv_freq, eps=eps, finish=round_index_vectors if qat else None)

    # ------------------------------------------------------------------ projections over the whole batch
    def __call__(self, x: torch.Tensor, batch: FlatBatch | DecodeBatch, cache: LayerCache | None) -> torch.Tensor:
        cfg, pos = self.cfg, batch.positions
        n = x.shape[0]
        decode = isinstance(batch, DecodeBatch)
        # a decode step pools the compressors' entries (their bf16 products of x included) and stores its keys on
        # a side stream, next to the queries. The branch forks before the main stream's first product (kv): the
        # pooling products read x alone, and forked after it they queued behind the query latent's programs (a
        # batch-1 step's main stream then waited for the branch, 8-12 us a layer on the H200); the branch waits
        # for kv only where it stores the keys. MOEBOX_EARLY_FORK=0 forks after kv (batch 1: +0.07 ms a step)
        keys_branch = Branch(x, "attention", reads=(x,), enabled=decode)
        early = keys_branch.on and os.environ.get("MOEBOX_EARLY_FORK", "1") == "1"
        if early:
            with keys_branch:
                rest = self._pool_rows(x)
        q_a, kv = self.from_x(x)
        keys_branch.hold(kv)
        with keys_branch:
            if not early:
                rest = self._pool_rows(x)
            comp = (rest[0], rest[1]) if self.compressor else None
            icomp = (rest[3], rest[4]) if self.indexer else None
            if decode:
                assert cache is not None, "a DecodeBatch needs a KVCache"
                stored = self._store_decode(batch, kv, comp, icomp, cache)     # norms and rotates kv itself
            else:
                kv = self._keys(kv, pos)
        q, *index_q = self.from_qr(q_a, norm=(self.q_norm, cfg.rms_norm_eps))
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        qi = index_q[0].view(n, cfg.index_n_heads, cfg.index_head_dim) if self.indexer is not None else None
        raw = decode and self._raw_queries(q, stored)
        if not raw:
            q, qi = query_rope(q, qi, pos, self.inv_freq, cfg.rms_norm_eps)
        idx = None
        if self.indexer is not None:
            if self.qat:
                qi = round_index_vectors(qi)
            idx = (qi, rest[2], icomp)
        keys_branch.join()

        if decode:   # the inverse RoPE applied
            out = self._attend_decode(batch, q, idx, stored, cache, raw)
        else:
            if cache is None and (t := batch.uniform_length()) is not None:
                out = self._fresh(t, q, kv, comp, idx)
            else:
                out = torch.empty_like(q)
                for seg in batch.segments:
                    out[seg.rows] = self._segment(seg, q[seg.rows], kv[seg.rows], comp, idx, cache).to(out.dtype)
            out = inverse_rope(out, pos, self.inv_freq)
        o = grouped_linear(out.reshape(n, cfg.o_groups, -1), self.wo_a, cfg.o_groups)   # [N, g, o_lora_rank]
        return linear(o.flatten(1), self.wo_b)

    def _pool_rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The compressors' and the indexer's products of x (empty in sliding layers), in x's dtype (on the GPU:
        bf16 products with fp32 accumulation); their users widen them to fp32, inside the decode step's fused
        functions and kernels."""
        return self.pool_from_x(x) if self.pool_from_x is not None else []

    def _qat_nope_dim(self) -> int | None:
        """The no-RoPE width the keys are QAT-rounded over (None without QAT)."""
        return self.cfg.nope_head_dim if self.qat else None

    def _keys(self, kv: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The K=V rows of kv's product (`rope_keys`)."""
        return rope_keys(kv, self.kv_norm, self.cfg.rms_norm_eps, pos, self.inv_freq, self._qat_nope_dim())

    # ------------------------------------------------------------------ B cache-free rows of T tokens (training)
    def _fresh(self, t: int, q: torch.Tensor, kv: torch.Tensor, comp, idx) -> torch.Tensor:
        """What `_segment` computes for each of B sequences of T tokens from position 0, without a cache, as
        one batch of ops whatever B is: a training step costs the same number of kernels for 2 rows or 32."""
        cfg = self.cfg
        n, nh, d = q.shape
        b = n // t
        entries = ent_visible = None
        if self.compressor is not None:
            entries = self.compressor.fresh_entries(comp[0].view(b, t, -1), comp[1].view(b, t, -1), kv.dtype)
            closed = (torch.arange(t, device=q.device) + 1) // self.ratio                 # entries token t sees
            ent_visible = (torch.arange(entries.shape[1], device=q.device)[None, :] < closed[:, None])[None]
            if self.indexer is not None:
                qi, wi, (ikv, igate) = idx
                keys = self.indexer.fresh_entries(ikv.view(b, t, -1), igate.view(b, t, -1), qi.dtype)
                scores = torch.relu(torch.einsum("bthd,bed->bthe", qi.view(b, t, *qi.shape[1:]).float(),
                                                 keys.float()))
                scores = (scores * (wi.float() * self.index_scale).view(b, t, -1, 1)).sum(dim=2)
                scores = scores.masked_fill(~ent_visible, float("-inf"))
                chosen = torch.zeros(scores.shape, dtype=torch.bool, device=q.device)
                if (k := min(cfg.index_topk, entries.shape[1])):
                    chosen.scatter_(2, scores.topk(k, dim=-1).indices, True)
                ent_visible = ent_visible & chosen
        out = local_sink_attention(q.view(b, t, nh, d), kv.view(b, t, -1), cfg.sliding_window, self.sink,
                                   cfg.head_dim ** -0.5, entries, ent_visible)
        return out.reshape(n, nh, d)

    # ------------------------------------------------------------------ one sequence's keys and attention
    def _segment(self, seg: Segment, q: torch.Tensor, kv: torch.Tensor, comp, idx,
                 cache: LayerCache | None) -> torch.Tensor:
        W, dev = self.cfg.sliding_window, q.device
        t = torch.arange(seg.start, seg.end + 1, device=dev)
        old_from = max(0, seg.start - W + 1)
        new = kv if cache is None else as_stored(cache.window, kv)    # as a decode step reads it back
        if cache is not None and old_from < seg.start:
            old = torch.arange(old_from, seg.start, device=dev)
            keys = torch.cat([ring_read(cache.window, seg.slot, old).to(kv.dtype), new])
            first = old_from
        else:
            keys, first = new, seg.start
        if cache is not None:
            ring_write(cache.window, seg.slot, t, kv)

        entries = ent_visible = rows = None
        if self.compressor is not None:
            ckv, cgate = comp[0][seg.rows], comp[1][seg.rows]
            windows, new = self.compressor.entries_for(seg, ckv, cgate, cache and cache.raw_kv,
                                                       cache and cache.raw_gate, kv.dtype)
            n_vis = (seg.end + 1) // self.ratio
            entries = _visible_entries(cache and cache.entries, seg.slot, windows, new, n_vis).to(keys.dtype)
            ent_visible = torch.arange(n_vis, device=dev)[None, :] < ((t + 1) // self.ratio)[:, None]
            if self.indexer is not None:
                rows = self._select(seg, t, idx, cache, n_vis, ent_visible)
        return self._attend_segment(seg, q, keys, first, t, entries, ent_visible, rows)

    def _attend_segment(self, seg: Segment, q: torch.Tensor, keys: torch.Tensor, first: int, t: torch.Tensor,
                        entries: torch.Tensor | None, ent_visible: torch.Tensor | None,
                        rows: torch.Tensor | None) -> torch.Tensor:
        """Sink attention of a segment's queries (positions t) over the window keys (positions first..seg.end)
        and, in compressed layers, the entries they see (`ent_visible`), only the indexer's `rows` in CSA.

        The torch path (CPU, or MOEBOX_PREFILL_ATTENTION_KERNEL=0) scores every query against all of the
        segment's keys and masks (dense). On CUDA the decode attention kernel reads, per query, only its window
        (a strided view of the keys: query i's ring is rows i..i+W-1 of the keys padded with W-1 rows in front)
        and its selected entries (the table broadcast over queries with stride 0): 1.5x / 1.8x the prefill
        tok/s of the dense path at 2K / 16K on the H200 (docs/benchmarks.md, eighth session)."""
        cfg, W = self.cfg, self.cfg.sliding_window
        scale = cfg.head_dim ** -0.5
        valid = None
        if entries is not None and rows is not None:
            valid = ent_visible.gather(1, rows)
        elif entries is not None:
            valid = ent_visible

        def dense() -> torch.Tensor:
            kpos = torch.arange(first, seg.end + 1, device=q.device)
            visible = (kpos[None, :] <= t[:, None]) & (kpos[None, :] > t[:, None] - W)
            keys_all = keys
            if entries is not None:
                ent_mask = ent_visible
                if rows is not None:
                    ent_mask = torch.zeros_like(ent_visible).scatter_(1, rows, valid)
                keys_all = torch.cat([keys, entries])
                visible = torch.cat([visible, ent_mask], dim=1)
            return sink_attention(q, keys_all, visible, self.sink, scale)

        if not kernel_switched_on(q, "MOEBOX_PREFILL_ATTENTION_KERNEL"):
            return dense()
        n, d = q.shape[0], keys.shape[1]
        padded = torch.cat([keys.new_zeros(W - 1, d), keys])[seg.start - first:]
        ring = padded.as_strided((n, W, d), (d, d, 1))
        window_visible = (t[:, None] - W + 1 + torch.arange(W, device=q.device)[None, :]) >= first
        slot = torch.arange(n, device=q.device, dtype=torch.int32)
        table = None
        if entries is not None and entries.shape[0]:
            table = entries.unsqueeze(0).expand(n, -1, -1)
        else:
            valid = rows = None
        from moebox.ops.triton import decode_attention as kernel
        if not kernel.supported(q, ring, slot, window_visible, self.sink, table, rows, valid):
            return dense()
        return kernel_or_fallback("prefill attention", "MOEBOX_PREFILL_ATTENTION_KERNEL", lambda: (
            kernel.attend_triton(q, ring, slot, window_visible, self.sink, scale, table, rows, valid)), dense)

    def _select(self, seg: Segment, t: torch.Tensor, idx, cache: LayerCache | None, n_vis: int,
                valid: torch.Tensor) -> torch.Tensor | None:
        """Lightning indexer: per query the rows [L, k] of the top-k entries by sum_h w_h * relu(q_h . K_w)
        (None when no entry is visible yet). Where fewer than k are valid, the others come along: masked later."""
        qi, wi, (ikv, igate) = idx
        windows, new = self.indexer.entries_for(seg, ikv[seg.rows], igate[seg.rows], cache and cache.index_raw_kv,
                                                cache and cache.index_raw_gate, qi.dtype)
        keys = _visible_entries(cache and cache.index_keys, seg.slot, windows, new, n_vis)
        with tf32_products(qi):
            scores = torch.relu(torch.einsum("lhd,kd->lhk", qi[seg.rows].float(), keys.float()))
        scores = (scores * (wi[seg.rows].float() * self.index_scale).unsqueeze(-1)).sum(dim=1)
        scores = scores.masked_fill(~valid, float("-inf"))
        k = min(self.cfg.index_topk, n_vis)
        return scores.topk(k, dim=-1, sorted=False).indices if k else None

    # ------------------------------------------------------------------ shape-static decode (DecodeBatch)
    def _store_decode(self, batch: DecodeBatch, kv: torch.Tensor, comp, icomp,
                      cache: LayerCache) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The key half of a decode step: store each sequence's K=V row (kv's product row, normed and rotated
        here) in its window ring and, in compressed layers, pool and store the compressors' entries -> what
        `_attend_decode` reads: (the ring's keys read out [B, R, d], None when the attention kernel reads the ring
        itself; which ring rows are inside the window [B, R]; which entries are visible [B, E] or None)."""
        cfg, pos, slot = self.cfg, batch.positions, batch.slots
        valid = None
        if self.compressor is not None:
            valid = self._compress(self.compressor, comp, batch, cache.raw_kv, cache.raw_gate, cache.entries,
                                   "kv" if self.qat else None)
            if self.indexer is not None:
                self._compress(self.indexer, icomp, batch, cache.index_raw_kv, cache.index_raw_gate,
                               cache.index_keys, "index" if self.qat else None)
        if not attention_kernel_takes(kv, cache.window, cache.entries if self.compressor else None):
            return *window_step(self._keys(kv, pos), pos, slot, cache.window, cfg.sliding_window), valid
        return None, store_keys(kv, self.kv_norm, cfg.rms_norm_eps, pos, self.inv_freq, slot, cache.window,
                                cfg.sliding_window, self._qat_nope_dim()), valid

    def _raw_queries(self, q: torch.Tensor, stored: tuple) -> bool:
        """Whether a decode step leaves its queries raw for the kernels that read them to norm and rotate
        (`rope_tile`: q in the attention kernel, qi in the indexer's score kernel), one launch (`query_rope`)
        fewer before them: in CSA layers (where the attention kernel reads q before its PDL wait, beside the
        indexer's kernels) whose attention kernel takes the step (`_store_decode` returned no keys: the kernel
        reads the ring) and whose index vectors need no QAT rounding after their rotation.
        MOEBOX_QUERY_IN_ATTENTION=0 / 1: in no layer / in every such layer."""
        every_layer = os.environ.get("MOEBOX_QUERY_IN_ATTENTION", "csa") != "csa"
        return (stored[0] is None and kernel_switched_on(q, "MOEBOX_QUERY_IN_ATTENTION")
                and (every_layer or self.indexer is not None) and not (self.indexer is not None and self.qat))

    def _attend_decode(self, batch: DecodeBatch, q: torch.Tensor, idx, stored: tuple,
                       cache: LayerCache, raw: bool) -> torch.Tensor:
        """The query half of a decode step: the indexer's top-k (CSA), then attention over the window and the
        selected (CSA) or all (HCA) entries, then the inverse RoPE; `stored` is what `_store_decode` returned.
        The kernel path leaves the inverse RoPE to `attend_decode` (which can apply it in the kernel). `raw`
        (`_raw_queries`): q and qi are the products, normed and rotated by the kernels that read them."""
        cfg, slot, pos = self.cfg, batch.slots, batch.positions
        scale = cfg.head_dim ** -0.5
        keys, visible, valid = stored
        entries = rows = None
        if self.compressor is not None:
            if self.indexer is not None:
                qi, wi, _ = idx
                rows, valid = index_select(qi, wi, self.index_scale, cache.index_keys, slot, valid, cfg.index_topk,
                                           rope=(pos, self.inv_freq) if raw else None)
            entries = cache.entries
        if keys is None:
            # the indexer's kernels run between q's product and the attention kernel: q can be read early
            return attend_decode(q, cache.window, slot, visible, self.sink, scale, entries, rows, valid,
                                 (pos, self.inv_freq), (pos, self.inv_freq, cfg.rms_norm_eps) if raw else None,
                                 self.indexer is not None)
        if entries is not None and rows is None:                  # HCA: every entry row
            rows = torch.arange(valid.shape[1], device=slot.device)[None, :]
        return inverse_rope(attend(q, keys, visible, self.sink, scale, entries, slot, rows, valid), pos,
                            self.inv_freq)

    def _compress(self, c: Compressor, proj: tuple[torch.Tensor, torch.Tensor], batch: DecodeBatch, ring_kv,
                  ring_gate, entries, finish: str | None) -> torch.Tensor:
        step = compress_step
        if kernel_switched_on(proj[0], "MOEBOX_COMPRESS_KERNEL"):
            from moebox.ops.triton.compress_decode import compress_decode as step   # one launch where it can
        return step(proj[0], proj[1], batch.positions, batch.slots, ring_kv, ring_gate, entries, c.ape,
                             c.norm, c.inv_freq, c.ratio, c.overlap, c.eps, finish, self.cfg.nope_head_dim)
