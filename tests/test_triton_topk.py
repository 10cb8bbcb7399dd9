"""The indexer's top-k kernel (moebox/ops/triton/topk.py) against torch.topk.

A top-k is right when it takes k distinct rows, none left out scores above one taken (so the sorted values
equal torch.topk's), and each row's valid flag comes along. The rows themselves may differ from torch's among
equal scores. CPU: the kernel in Triton's interpreter under several tilings (the whole row held in registers,
padded; a held head plus streamed [TK, NT] chunks, TK 1 or more; 32-bit count fields), on exact ties across
chunks, -inf masks with fewer finite rows than k, k = E and k = 1, +-0, subnormals, NaN of either sign, +inf,
rows of few distinct values, and every such row through the rank kernel; the tilings `config` picks; what the kernel refuses; and the tiny model's decode
steps with MOEBOX_TOPK_KERNEL=1 against the torch top-k (the rank kernel, then with MOEBOX_TOPK_RANK=0 the radix
select). GPU (marker `gpu`): V4-Flash rows (k 512, E 1024 to
70000: held, held + a one-entry tail, streamed, 32-bit fields; batch 1-16) under `config`'s tiling and the
bench's sweep of tilings, outputs poisoned first, replayed from a CUDA graph; and the edge rows on the GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import textwrap

import pytest
import torch

from tests.interpreter import check_in_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def check_topk(scores: torch.Tensor, valid: torch.Tensor, k: int, rows: torch.Tensor, rvalid: torch.Tensor) -> None:
    """The properties above, row by row (NaN ranks first, as in torch)."""
    scores, valid, rows, rvalid = (t.cpu() for t in (scores, valid, rows, rvalid))
    assert rows.shape == (scores.shape[0], k) and rows.dtype == torch.int64 and rvalid.dtype == torch.bool
    for b in range(scores.shape[0]):
        r = rows[b]
        assert r.min() >= 0 and r.max() < scores.shape[1] and r.unique().numel() == k, r
        ref = scores[b].topk(k).values
        got = scores[b][r]
        assert torch.equal(got.nan_to_num(nan=3.3e38, posinf=3e38, neginf=-3e38).sort().values,
                           ref.nan_to_num(nan=3.3e38, posinf=3e38, neginf=-3e38).sort().values)
        assert torch.equal(rvalid[b], valid[b][r])


def cases(g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(scores, valid, k): masked random rows, rows of ties, and the edge values."""
    out = []
    for b, e, k in ((1, 64, 8), (3, 100, 17), (2, 300, 40), (2, 37, 37), (1, 5, 1)):
        s = torch.randn(b, e, generator=g)
        v = torch.rand(b, e, generator=g) > 0.3
        out.append((s.masked_fill(~v, float("-inf")), v, k))
    s = torch.tensor([[0.0, -0.0, 1.0, 1.0, 1.0, -2.0, 0.0, 3.0, float("-inf"), 1.0]])
    out += [(s, s > -1, 4), (s, s > -1, 6)]
    s = torch.full((2, 200), 0.5)                       # all equal: ties across chunks of 64
    s[1, 150] = 0.75
    out.append((s, torch.ones_like(s, dtype=torch.bool), 70))
    s = torch.full((1, 130), float("-inf"))             # fewer finite rows than k
    s[0, [3, 77, 129]] = torch.tensor([1.0, -1.0, 0.0])
    out.append((s, s > float("-inf"), 9))
    s = -torch.rand(2, 90, generator=g) * 1e-39          # subnormal negatives
    out.append((s, torch.ones_like(s, dtype=torch.bool), 30))
    s = torch.randn(1, 50, generator=g)
    s[0, [4, 9]] = float("nan")
    out.append((s, torch.ones_like(s, dtype=torch.bool), 5))
    s = torch.randn(2, 70, generator=g)                 # NaN with the sign bit set (x86's 0/0), +inf
    s[0, [3, 40]] = torch.tensor([0xFFC00000, 0xFFFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32)
    s[1, [5, 6]] = float("inf")
    out.append((s, torch.ones_like(s, dtype=torch.bool), 3))
    s = torch.randint(0, 4, (3, 150), generator=g).float()   # few distinct values: ties at every k
    for k in (1, 37, 149, 150):
        out.append((s, s > 0, k))
    s = torch.full((1, 90), float("-inf"))              # all masked
    out.append((s, s > 0, 20))
    s = torch.randn(1, 600, generator=g) * 1e3          # a longer row: many streamed chunks
    out.append((s, torch.rand(1, 600, generator=g) > 0.5, 512))
    return out


# cases() rows for the slow streamed tilings: k = E, few rows, ties, fewer finite rows than k, signed NaN /
# +inf, all masked; and in some tilings ties across chunks (7) or at k = 37 (13)
STREAMED_CASES = (3, 4, 5, 8, 11, 16)


def tilings():
    """Interpreter tilings (tiny NT so the rows above span several chunks): held and padded, held head +
    streamed chunks of 8 and 1 rows, several held chunks, 32-bit fields; None: `config`'s (all held, NT 256)."""
    from moebox.ops.triton.topk import Config
    return [None, Config(1, 8, 8, 4, 1, False), Config(2, 2, 1, 4, 1, False), Config(4, 8, 2, 2, 1, True),
            Config(1, 1, 1, 8, 1, False)]


_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, sys.argv[1])
    import moebox.ops.triton.topk as topk
    from tests.test_triton_topk import STREAMED_CASES, cases, check_topk, tilings
    results = []
    for i, cfg in enumerate(tilings()):
        picked = cases(torch.Generator().manual_seed(i))
        if i >= 1:   # the streamed tilings run ~1-9 s a case here: their chunk edges, not every row again
            picked = [c for j, c in enumerate(picked) if j in STREAMED_CASES + {1: (7,), 3: (7,), 4: (13,)}.get(i, ())]
        for s, v, k in picked:
            rows, rv = topk.index_topk_triton(s, v, k, cfg)
            check_topk(s, v, k, rows, rv)
            results.append(dict(case=[list(s.shape), k, str(cfg)], same_buffer=True, finite=True, rel=0.0,
                                ref_norm=1.0))
    for s, v, k in cases(torch.Generator().manual_seed(7)):    # the rank kernel: every row
        check_topk(s, v, k, *topk.index_topk_triton(s, v, k, rank=True))
        results.append(dict(case=[list(s.shape), k, "rank"], same_buffer=True, finite=True, rel=0.0, ref_norm=1.0))

    # the tiny model's decode steps: the kernel's rows against torch's (same logits: no ties in these scores)
    from tests.interpreter import count_calls, switch_result, tiny_model
    calls, ranked = count_calls(topk, "index_topk_triton"), count_calls(topk, "_rank_topk")
    os.environ.update(MOEBOX_ATTENTION_KERNEL="0", MOEBOX_COMPRESS_KERNEL="0", MOEBOX_PREFILL_ATTENTION_KERNEL="0")
    cfg, model = tiny_model()
    results.append(switch_result(model, cfg, "MOEBOX_TOPK_KERNEL", 12))     # its small rows: the rank kernel
    os.environ["MOEBOX_TOPK_RANK"] = "0"
    results.append(switch_result(model, cfg, "MOEBOX_TOPK_KERNEL", 12))     # the radix select
    csa = sum(1 for r, kind in zip(cfg.compress_ratios, cfg.attn_types) if kind == "csa")
    assert csa and len(calls) == 24 * csa and len(ranked) == 12 * csa, (len(calls), len(ranked), csa)
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_topk_kernel_in_the_interpreter() -> None:
    check_in_interpreter(_SCRIPT, default_tol=1e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_what_the_kernel_refuses() -> None:
    from moebox.ops.triton.topk import index_topk_triton, supported
    s = torch.randn(2, 50)
    v = torch.ones(2, 50, dtype=torch.bool)
    assert supported(s, v, 50) and not supported(s, v, 51) and not supported(s, v, 0)
    assert not supported(s.double(), v, 5) and not supported(s.t(), v.t(), 1) and not supported(s, v[:, :10], 5)
    with pytest.raises(ValueError, match="k 51"):
        index_topk_triton(s, v, 51)
    from moebox.ops.triton.topk import Config
    for bad in (Config(1, 16, 1, 4, 1, False), Config(1, 8, 16, 4, 1, False)):   # nibbles would overflow
        with pytest.raises(ValueError, match="cannot count"):
            index_topk_triton(s, v, 5, bad)


def test_the_tilings_config_picks() -> None:
    """Every entry is held or streamed, per-thread counts stay in their fields, and the V4-Flash rows get the
    tilings the sm_90 builds were checked at (1025: all held, padded; 4097 and 16385: a held power of two and a
    one-row tail; from 65536 entries 32-bit fields)."""
    from moebox.ops.triton.topk import HELD_KEYS, WIDE_FROM, Config, config, next_pow2
    for e in list(range(1, 5000, 37)) + [1024, 1025, 2048, 2049, 4096, 4097, 16384, 16385, 65535, 65536, 1 << 20]:
        for warps in (None, 4, 16):
            c = config(e, num_warps=warps)
            head = c.nch * c.hk * c.nt
            assert c.nt == 32 * c.num_warps and c.hk <= 8 and c.tk <= c.hk and c.nch == next_pow2(c.nch)
            assert c.nch * c.hk <= max(8, HELD_KEYS) and c.wide == (e >= WIDE_FROM)
            assert head >= e or c.hk == 8, c                   # a streamed row holds full chunks
            assert head <= max(c.nt, next_pow2(e)), c
    assert config(1025) == Config(1, 8, 8, 256, 8, False)
    assert config(4097) == Config(2, 8, 1, 256, 8, False)
    assert config(16385) == Config(8, 8, 1, 256, 8, False)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("entries", [1024, 1025, 2049, 4097, 5000, 16384, 16385, 40000, 70000])
@pytest.mark.gpu
@needs_cuda
def test_gpu_v4_rows(entries: int, batch: int) -> None:
    """V4-Flash's k = 512 over 4K-64K contexts' entries (and past: streamed chunks, 32-bit fields), a third
    masked (-inf), a run of ties, outputs poisoned, then the same call replayed from a CUDA graph on new scores;
    by the radix select and, on rows small enough, the rank kernel."""
    from moebox.ops.triton.topk import index_topk_triton
    for rank in (False, True) if batch * entries <= 16 * 5000 else (False,):
        _check_v4_rows(entries, batch, functools.partial(index_topk_triton, rank=rank))


def _check_v4_rows(entries: int, batch: int, kernel) -> None:
    g = torch.Generator(device="cuda").manual_seed(entries + batch)
    scores = torch.randn(batch, entries, device="cuda", generator=g)
    valid = torch.rand(batch, entries, device="cuda", generator=g) > 0.33
    scores[:, 100:400] = 1.5                                    # ties around the k-th value
    scores = scores.masked_fill(~valid, float("-inf"))
    torch.full((1 << 22,), -1, dtype=torch.int64, device="cuda")   # poison the allocator's free blocks
    rows, rv = kernel(scores, valid, 512)
    torch.cuda.synchronize()
    check_topk(scores, valid, 512, rows, rv)
    graph = torch.cuda.CUDAGraph()
    static = scores.clone()
    with torch.cuda.graph(graph):
        out = kernel(static, valid, 512)
    static.copy_(torch.randn(batch, entries, device="cuda", generator=g).masked_fill(~valid, float("-inf")))
    out[0].fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    check_topk(static, valid, 512, *out)


@pytest.mark.parametrize("entries", [1025, 4097, 16385])
@pytest.mark.gpu
@needs_cuda
def test_gpu_swept_tilings(entries: int) -> None:
    """Each tiling the bench's --sweep times (4-16 warps, 32 or 64 held keys) on indexer-like rows (relu'd:
    many exact zeros, so ties at the k-th value when few are positive) and on short contexts (most masked)."""
    from moebox.ops.triton.topk import index_topk_triton, random_scores, sweep_configs
    for cfg in sweep_configs(entries):
        for masked in (0.0, 0.9):
            scores, valid = random_scores(16, entries, "cuda", seed=entries, masked=masked)
            check_topk(scores, valid, 512, *index_topk_triton(scores, valid, 512, cfg))


@pytest.mark.gpu
@needs_cuda
def test_gpu_edge_rows() -> None:
    """The interpreter's edge rows (ties, -inf, NaN of both signs, k = E, k = 1, ...) on the GPU, under
    `config`'s tiling and the interpreter's."""
    from moebox.ops.triton.topk import index_topk_triton
    for cfg in tilings():
        for s, v, k in cases(torch.Generator().manual_seed(3)):
            check_topk(s, v, k, *index_topk_triton(s.cuda(), v.cuda(), k, cfg))
    for s, v, k in cases(torch.Generator().manual_seed(3)):
        check_topk(s, v, k, *index_topk_triton(s.cuda(), v.cuda(), k, rank=True))
