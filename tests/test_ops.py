"""Torch reference ops against independent definitions: explicit matrices and loops, hand-computed values,
and transformers' DeepSeek-V4 RoPE (deepseek_v4.md §2)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from moebox.config import YarnScaling
from moebox.ops.attention import sink_attention
from moebox.ops.compress import pool_windows
from moebox.ops.mhc import hc_post, hc_pre
from moebox.ops.moe import route
from moebox.ops.qat import fp4_round, fp8_round, hadamard
from moebox.ops.rope import apply_rope, rope_inv_freq
from moebox.weights.formats import fp4_codes_from_values, fp4_values_from_codes, quant_fp4

warnings.filterwarnings("ignore", message=".*[Yy]a[Rr][Nn].*")

FP4_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---------------------------------------------------------------- Hadamard
def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("n", [1, 2, 8, 32, 128])
def test_hadamard_is_the_normalised_sylvester_matrix(n):
    x = torch.randn(5, 3, n, generator=torch.Generator().manual_seed(n))
    H = sylvester(n) / math.sqrt(n)
    y = hadamard(x)                          # computed in fp32
    assert torch.allclose(y.double(), x.double() @ H.T, atol=1e-5)
    # orthonormal and an involution: norms kept, applying it twice gives x back
    assert torch.allclose(H @ H.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(hadamard(y), x, atol=1e-5)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4)


def test_hadamard_keeps_dtype_and_first_row():
    x = torch.randn(4, 16)
    y = hadamard(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y[:, 0], x.sum(-1) / 4, atol=1e-6)   # row 0 of H is all ones


# ---------------------------------------------------------------- FP8 e4m3 rounding (QAT)
def e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, from the bit layout (bias 7, no inf, only S.1111.111 is NaN)."""
    vals = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals.update((v, -v))
    return torch.tensor(sorted(vals), dtype=torch.float64)


def test_e4m3_table_max_is_448():
    assert e4m3_values().max() == 448 and len(e4m3_values()) == 253   # 254 values, +0 and -0 merged


@pytest.mark.parametrize("d", [64, 128, 100, 40])
def test_fp8_round_is_nearest_e4m3_with_pow2_block_scale(d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(6, d, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[0, : min(d, 64) // 2] *= 1e-3          # a block with a wide dynamic range
    y = fp8_round(x)
    grid = e4m3_values()
    for r in range(x.shape[0]):
        for b0 in range(0, d, 64):
            xb, yb = x[r, b0:b0 + 64].double(), y[r, b0:b0 + 64].double()
            amax = xb.abs().max().item()
            s = 2.0 ** math.ceil(math.log2(amax / 448))      # smallest power of two with amax / s <= 448
            assert amax / s <= 448 and amax / s > 224
            q = yb / s
            assert torch.isin(q, grid).all()                  # exactly representable after the division
            nearest = grid[(xb[:, None] / s - grid[None, :]).abs().argmin(dim=1)]
            assert torch.equal(q, nearest)
            # error bound: half an e4m3 ulp, i.e. 2^-4 relative for normals, 2^-10 s absolute for subnormals
            assert ((yb - xb).abs() <= torch.maximum(xb.abs() * 2 ** -4, torch.full_like(xb, s * 2 ** -10))).all()


def test_fp8_round_partial_last_block_stands_alone():
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    x[:, :64] *= 1000          # a large first block must not change the scale of the last 36 channels
    y = fp8_round(x)
    assert torch.equal(y[:, 64:], fp8_round(x[:, 64:].contiguous()))
    assert torch.equal(y[:, :64], fp8_round(x[:, :64].contiguous()))
    # half an e4m3 ulp at the last block's own scale: 2^-4 relative for normals, 2^-10 s absolute for subnormals
    # (a bound of 2^-4 relative + 1e-6 failed now and then: a randn value below the block's smallest normal)
    tail = x[:, 64:]
    s = torch.exp2(torch.ceil(torch.log2(tail.abs().amax(dim=1, keepdim=True) / 448)))
    assert ((y[:, 64:] - tail).abs() <= torch.maximum(tail.abs() * 2 ** -4, s * 2 ** -10)).all()


# ---------------------------------------------------------------- FP4 e2m1 rounding and packing
def test_fp4_round_by_hand_with_ties_to_even():
    # one 32-block with amax 6 (scale 1): ties go to the even code (0, 1.0, 2.0, 2.0, 4.0, 4.0)
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.9, -0.2, -5.0, -2.5, 1.0, 0.0, -0.0]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, -0.0, -4.0, -2.0, 1.0, 0.0, -0.0]
    x = torch.tensor(vals + [0.0] * 16)
    y = fp4_round(x)
    assert y[:16].tolist() == want
    assert torch.signbit(y[10]) and torch.signbit(y[15]) and not torch.signbit(y[14])   # signed zeros kept
    # amax 12 -> scale 2: 1.0 is 0.5 on the grid, 0.5 -> 0.25 ties down to 0, 1.5 -> 0.75 ties up to 1 -> 2.0
    x2 = torch.tensor([12.0, 1.0, 0.5, 1.5, 7.0, 9.0] + [0.0] * 26)
    assert fp4_round(x2)[:6].tolist() == [12.0, 1.0, 0.0, 2.0, 8.0, 8.0]   # 3.5 -> 4 and 4.5 -> 4 (x2)
    # amax 0.75 -> scale 1/8; a second block is scaled on its own
    x3 = torch.cat([torch.tensor([0.75, 0.1, -0.3] + [0.0] * 29), torch.tensor([60.0, 10.0] + [0.0] * 30)])
    y3 = fp4_round(x3)
    assert y3[:3].tolist() == [0.75, 0.125, -0.25]
    assert y3[32:34].tolist() == [64.0, 8.0]   # amax 60 -> scale 16: 3.75 -> 4, 0.625 -> 0.5


def ref_code(v: float) -> int:
    """The plain per-element definition: nearest e2m1 magnitude (|v| clamped to 6, NaN as +6), ties to the even
    code, sign bit for negative values and -0.0."""
    if math.isnan(v):
        return 7
    m = min(abs(v), 6.0)
    dist = [abs(m - g) for g in FP4_GRID]
    best = min(dist)
    cands = [i for i, dd in enumerate(dist) if dd == best]
    code = cands[0] if len(cands) == 1 else next(i for i in cands if i % 2 == 0)
    return code | (8 if math.copysign(1.0, v) < 0 else 0)


def special_values(g: torch.Generator, n: int) -> torch.Tensor:
    mids = [(a + b) / 2 for a, b in zip(FP4_GRID, FP4_GRID[1:])]
    pool = torch.tensor(FP4_GRID + mids + [-v for v in FP4_GRID + mids] + [-0.0, 0.0, 1e-40, -1e-40])
    x = torch.randn(n, generator=g) * 3
    pick = torch.rand(n, generator=g) < 0.4
    x[pick] = pool[torch.randint(len(pool), (int(pick.sum()),), generator=g)]
    return x


def test_fp4_codes_match_per_element_reference():
    g = torch.Generator().manual_seed(3)
    x = torch.cat([special_values(g, 3000),
                   torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 7.0, -100.0,
                                 5.999, 6.001, 4.999999, 5.000001, 0.2499999, 0.2500001])])
    got = fp4_codes_from_values(x).tolist()
    assert got == [ref_code(v) for v in x.tolist()]


def test_fp4_values_of_every_code():
    """Code c: sign bit 8, magnitude FP4_GRID[c & 7]; -0.0 for code 8."""
    got = fp4_values_from_codes(torch.arange(16, dtype=torch.uint8))
    assert got.dtype == torch.float32
    assert [(v, math.copysign(1.0, v)) for v in got.tolist()] == \
        [(g, 1.0) for g in FP4_GRID] + [(-g, -1.0) for g in FP4_GRID]


def ref_quant_fp4(w: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per-element reference of quant_fp4: bytes of packed codes, E8M0 bytes of the block exponents."""
    rows, cols = w.shape
    packed, scales = [], []
    for r in range(rows):
        row = w[r].tolist()
        codes = []
        for b0 in range(0, cols, 32):
            blk = row[b0:b0 + 32]
            amax = max(abs(v) for v in blk)
            lg = math.log2(max(amax, 2.0 ** -126) / 6.0)
            e = max(-127, min(127, 127 if math.isinf(lg) else math.ceil(lg)))
            scales.append(e + 127)
            codes += [ref_code(v / 2.0 ** e) for v in blk]
        packed += [codes[i] | (codes[i + 1] << 4) for i in range(0, cols, 2)]
    return packed, scales


def test_quant_fp4_matches_per_element_reference():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(13, 64, generator=g) * 0.02
    w[0] = special_values(g, 64)                   # exact grid ties (amax 6 -> scale 1), signed zeros
    w[1, :32] = torch.tensor(FP4_GRID * 4) * 0.125 * torch.tensor([1.0, -1.0]).repeat(16)   # scale 1/32
    w[1, 32:] = (torch.arange(32) - 16) * 0.25 * 2.0 ** -10     # ties at a tiny scale
    w[2] = 0.0
    w[2, 1::2] = -0.0                               # an all-zero block: smallest scale, signed zeros kept
    w[3, :32] *= 1e-38                              # subnormal inputs
    w[4, 5] = float("inf")
    packed, scale = quant_fp4(w)
    ref_packed, ref_scale = ref_quant_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (13, 32) and scale.shape == (13, 2)
    assert packed.view(torch.uint8).flatten().tolist() == ref_packed
    assert scale.view(torch.uint8).flatten().tolist() == ref_scale


def test_quant_fp4_accepts_bf16_and_non_contiguous():
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 40, generator=g)
    for src in (w.T, w.T.to(torch.bfloat16)):        # [40, 64], non-contiguous / bf16
        packed, scale = quant_fp4(src)
        ref_packed, ref_scale = ref_quant_fp4(src.float().contiguous())
        assert packed.view(torch.uint8).flatten().tolist() == ref_packed
        assert scale.view(torch.uint8).flatten().tolist() == ref_scale


def test_quant_fp4_keeps_thread_count():
    n = torch.get_num_threads()
    quant_fp4(torch.randn(4, 64))
    assert torch.get_num_threads() == n


# ---------------------------------------------------------------- RoPE against transformers
def hf_rotary(head_dim: int, rope_dim: int, theta: float, ctheta: float, yarn: dict):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding, apply_rotary_pos_emb
    cfg = DeepseekV4Config(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=head_dim, partial_rotary_factor=rope_dim / head_dim,
                           layer_types=["sliding_attention", "compressed_sparse_attention"],
                           mlp_layer_types=["hash_moe", "moe"], rope_theta=theta, compress_rope_theta=ctheta,
                           rope_parameters={"rope_type": "yarn", **yarn}, max_position_embeddings=1 << 20)
    return DeepseekV4RotaryEmbedding(cfg), apply_rotary_pos_emb


YARN_TINY = dict(factor=16.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1)
YARN_FLASH = dict(factor=16.0, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)


@pytest.mark.parametrize("head_dim, rope_dim, yarn", [(64, 16, YARN_TINY), (512, 64, YARN_FLASH),
                                                       (32, 8, dict(YARN_TINY, factor=8.0, beta_fast=16))])
def test_rope_inv_freq_equals_transformers(head_dim, rope_dim, yarn):
    rot, _ = hf_rotary(head_dim, rope_dim, 1e4, 1.6e5, yarn)
    main = rope_inv_freq(rope_dim, 1e4, None)
    comp = rope_inv_freq(rope_dim, 1.6e5, YarnScaling(**yarn))
    assert torch.allclose(main, rot.main_inv_freq, rtol=1e-6, atol=0)
    assert torch.allclose(comp, rot.compress_inv_freq, rtol=1e-6, atol=0)
    assert rot.compress_attention_scaling == 1.0


def test_rope_inv_freq_flash_ramp_by_hand():
    """§2.4: dim 64, base 1.6e5, L 65536: pairs 0..15 unchanged, 25..31 divided by 16."""
    f = rope_inv_freq(64, 1.6e5, YarnScaling(**YARN_FLASH)).double()
    plain = 1.0 / 1.6e5 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert torch.allclose(f[:16], plain[:16], rtol=1e-6)
    assert torch.allclose(f[25:], plain[25:] / 16, rtol=1e-6)
    ramp = (torch.arange(16, 25, dtype=torch.float64) - 15) / 10
    assert torch.allclose(f[16:25], plain[16:25] * (1 - ramp) + plain[16:25] / 16 * ramp, rtol=1e-6)


@pytest.mark.parametrize("kind", ["main", "compress"])
def test_apply_rope_equals_transformers_and_inverts(kind):
    rot, hf_apply = hf_rotary(64, 16, 1e4, 1.6e5, YARN_TINY)
    inv = rope_inv_freq(16, 1e4, None) if kind == "main" else rope_inv_freq(16, 1.6e5, YarnScaling(**YARN_TINY))
    g = torch.Generator().manual_seed(8)
    L, nh, D = 11, 3, 64
    x = torch.randn(L, nh, D, generator=g)
    pos = torch.arange(L) * 37 + 5
    cos, sin = rot(x, position_ids=pos[None], layer_type=kind)           # [1, L, 8]
    ref = hf_apply(x.transpose(0, 1)[None], cos, sin, unsqueeze_dim=1)[0].transpose(0, 1)   # HF: [B, nh, L, D]
    ours = apply_rope(x, pos, inv)
    assert torch.allclose(ours, ref, atol=1e-5)
    assert torch.equal(ours[..., :48], x[..., :48])                       # nope channels untouched
    assert not torch.allclose(ours[..., 48:], x[..., 48:], atol=1e-2)
    assert torch.allclose(apply_rope(ours, pos, inv, inverse=True), x, atol=1e-5)
    # a 2-D input (one vector per position) uses the same rotation
    assert torch.allclose(apply_rope(x[:, 0], pos, inv), ours[:, 0], atol=1e-6)


# ---------------------------------------------------------------- mHC (§2.2)
def explicit_hc_pre(X, fn, base, scale, iters, eps, norm_eps):
    """One token, plain loops in float64, exactly as written in §2.2."""
    hc, H = X.shape
    z = X.double().flatten()
    rs = 1 / math.sqrt(float((z * z).mean()) + norm_eps)
    m = [float(fn[i].double() @ z) * rs for i in range(fn.shape[0])]
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    pre = [sig(m[j] * float(scale[0]) + float(base[j])) + eps for j in range(hc)]
    post = [2 * sig(m[hc + j] * float(scale[1]) + float(base[hc + j])) for j in range(hc)]
    A = [[m[2 * hc + hc * j + k] * float(scale[2]) + float(base[2 * hc + hc * j + k]) for k in range(hc)]
         for j in range(hc)]
    C = []
    for j in range(hc):
        mx = max(A[j])
        ex = [math.exp(a - mx) for a in A[j]]
        C.append([e / sum(ex) + eps for e in ex])

    def col_norm():
        for k in range(hc):
            s = sum(C[j][k] for j in range(hc)) + eps
            for j in range(hc):
                C[j][k] /= s

    def row_norm():
        for j in range(hc):
            s = sum(C[j]) + eps
            C[j] = [c / s for c in C[j]]

    col_norm()
    for _ in range(iters - 1):
        row_norm()
        col_norm()
    x = sum(pre[j] * X[j].double() for j in range(hc))
    return x, torch.tensor(post, dtype=torch.float64), torch.tensor(C, dtype=torch.float64)


def random_hc(g, n=3, hc=4, H=16):
    X = torch.randn(n, hc, H, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * H, generator=g) * 0.1
    base = torch.randn((2 + hc) * hc, generator=g)
    scale = 1 + 0.5 * torch.rand(3, generator=g)
    return X, fn, base, scale


@pytest.mark.parametrize("hc", [4, 2])
def test_hc_pre_matches_explicit_sinkhorn_and_is_doubly_stochastic(hc):
    g = torch.Generator().manual_seed(9 + hc)
    X, fn, base, scale = random_hc(g, hc=hc)
    x, post, comb = hc_pre(X, fn, base, scale, iters=20, eps=1e-6, norm_eps=1e-6)
    assert x.shape == (3, 16) and post.shape == (3, hc) and comb.shape == (3, hc, hc)
    for t in range(3):
        ex, epost, ecomb = explicit_hc_pre(X[t], fn, base, scale, 20, 1e-6, 1e-6)
        assert torch.allclose(x[t].double(), ex, atol=1e-5)
        assert torch.allclose(post[t].double(), epost, atol=1e-6)
        assert torch.allclose(comb[t].double(), ecomb, atol=1e-6)
    assert torch.allclose(comb.sum(-1), torch.ones(3, hc), atol=1e-3)    # rows
    assert torch.allclose(comb.sum(-2), torch.ones(3, hc), atol=1e-4)    # columns (last pass)
    assert (post > 0).all() and (post < 2).all()


def test_hc_post_applies_comb_transposed():
    g = torch.Generator().manual_seed(11)
    n, hc, H = 2, 4, 8
    X = torch.randn(n, hc, H, generator=g)
    out = torch.randn(n, H, generator=g)
    post = torch.rand(n, hc, generator=g) * 2
    comb = torch.rand(n, hc, hc, generator=g)          # not symmetric: the orientation shows
    got = hc_post(out, X, post, comb)
    want = torch.zeros(n, hc, H)
    for t in range(n):
        for k in range(hc):
            want[t, k] = post[t, k] * out[t] + sum(comb[t, j, k] * X[t, j] for j in range(hc))
    assert torch.allclose(got, want, atol=1e-5)
    wrong = post.unsqueeze(-1) * out.unsqueeze(-2) + comb @ X
    assert not torch.allclose(got, wrong, atol=1e-2)


# ---------------------------------------------------------------- sink attention (§2.4)
def test_sink_attention_matches_per_head_loop():
    g = torch.Generator().manual_seed(12)
    L, nh, d, K = 4, 3, 8, 6
    q, keys = torch.randn(L, nh, d, generator=g), torch.randn(K, d, generator=g)
    sinks = torch.randn(nh, generator=g)
    visible = torch.rand(L, K, generator=g) < 0.6
    visible[0] = False                # only the sink: output 0
    visible[1] = True
    scale = d ** -0.5
    got = sink_attention(q, keys, visible, sinks, scale)
    for l in range(L):
        for h in range(nh):
            js = [j for j in range(K) if visible[l, j]]
            s = [float(q[l, h].double() @ keys[j].double()) * scale for j in js]
            M = max(s + [float(sinks[h])])
            num = torch.zeros(d, dtype=torch.float64)
            for sj, j in zip(s, js):
                num += math.exp(sj - M) * keys[j].double()
            den = sum(math.exp(sj - M) for sj in s) + math.exp(float(sinks[h]) - M)
            assert torch.allclose(got[l, h].double(), num / den, atol=1e-6), (l, h)
    assert torch.equal(got[0], torch.zeros(nh, d))
    # the sink is in the denominator only: weights over the keys sum to less than 1
    no_sink = sink_attention(q, keys, visible, torch.full((nh,), -1e9), scale)
    assert not torch.allclose(no_sink[1], got[1], atol=1e-3)


# ---------------------------------------------------------------- compressor pooling (§2.6, §2.7)
def explicit_pool(kv, gate, first_pos, w, ratio, overlap):
    d = kv.shape[1] // 2 if overlap else kv.shape[1]
    slots = []   # (value row, gate row) per slot
    if overlap and w > 0:
        for t in range((w - 1) * ratio, w * ratio):
            slots.append((kv[t - first_pos, :d], gate[t - first_pos, :d]))
    for t in range(w * ratio, (w + 1) * ratio):
        slots.append((kv[t - first_pos, -d:], gate[t - first_pos, -d:]))
    out = torch.zeros(d, dtype=torch.float64)
    for c in range(d):
        zs = [float(g[c]) for _, g in slots]
        mx = max(zs)
        ws = [math.exp(z - mx) for z in zs]
        out[c] = sum(wt * float(v[c]) for wt, (v, _) in zip(ws, slots)) / sum(ws)
    return out


@pytest.mark.parametrize("overlap, ratio, first_pos, windows, P", [
    (False, 4, 8, [2, 3, 4], 12),       # HCA-style, rows start at position 8
    (False, 8, 0, [0, 1], 16),
    (True, 4, 0, [0, 1, 2], 12),        # CSA: window 0 has no previous window
    (True, 4, 4, [2, 3], 12),           # CSA: rows start at 4, window 2 pools window 1's first halves
])
def test_pool_windows_matches_explicit_loop(overlap, ratio, first_pos, windows, P):
    g = torch.Generator().manual_seed(13 + ratio + first_pos)
    d = 6
    C = 2 * d if overlap else d
    kv, gate = torch.randn(P, C, generator=g), torch.randn(P, C, generator=g) * 2
    got = pool_windows(kv, gate, first_pos, torch.tensor(windows), ratio, overlap)
    assert got.shape == (len(windows), d)
    for i, w in enumerate(windows):
        assert torch.allclose(got[i].double(), explicit_pool(kv, gate, first_pos, w, ratio, overlap), atol=1e-6)


def test_csa_window_0_ignores_first_halves():
    kv, gate = torch.randn(8, 4), torch.randn(8, 4)
    a = pool_windows(kv, gate, 0, torch.tensor([0]), 4, True)
    kv2, gate2 = kv.clone(), gate.clone()
    kv2[:, :2] = 1e3
    gate2[:, :2] = 50.0
    assert torch.equal(a, pool_windows(kv2, gate2, 0, torch.tensor([0]), 4, True))
    b = pool_windows(kv2, gate2, 0, torch.tensor([1]), 4, True)    # ...but window 1 uses window 0's Ca
    assert (b > 100).all()


# ---------------------------------------------------------------- MoE routing (§2.8)
def sqrtsoftplus(v: float) -> float:
    return math.sqrt(math.log1p(math.exp(v)))


def test_route_hash_uses_table_and_normalised_scaled_scores():
    g = torch.Generator().manual_seed(14)
    N, H, E, k = 5, 8, 6, 2
    x, gw = torch.randn(N, H, generator=g), torch.randn(E, H, generator=g)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(10)]).to(torch.int32)
    tokens = torch.tensor([3, 7, 3, 0, 9])
    idx, w = route(x, gw, bias=None, tid2eid=tid2eid, tokens=tokens, top_k=k, scoring_func="sqrtsoftplus",
                   norm_topk_prob=True, scaling=1.5)
    assert torch.equal(idx, tid2eid[tokens].long())
    for t in range(N):
        s = [sqrtsoftplus(float(x[t] @ gw[e])) for e in idx[t].tolist()]
        assert torch.allclose(w[t].double(), torch.tensor([v / sum(s) * 1.5 for v in s], dtype=torch.float64),
                              atol=1e-6)


def test_route_bias_steers_selection_but_not_weights():
    g = torch.Generator().manual_seed(15)
    N, H, E, k = 4, 8, 6, 2
    x, gw = torch.randn(N, H, generator=g), torch.randn(E, H, generator=g)
    logits = (x.double() @ gw.double().T)
    scores = logits.apply_(sqrtsoftplus)
    bias = torch.zeros(E)
    bias[int(scores[0].argmin())] = 100.0               # forces the weakest expert of token 0 in
    idx, w = route(x, gw, bias=bias, tid2eid=None, tokens=torch.zeros(N, dtype=torch.long), top_k=k,
                   scoring_func="sqrtsoftplus", norm_topk_prob=True, scaling=2.5)
    for t in range(N):
        biased = scores[t] + bias.double()
        sel = sorted(range(E), key=lambda e: -float(biased[e]))[:k]
        got = dict(zip(idx[t].tolist(), w[t].tolist()))
        assert set(got) == set(sel)
        tot = sum(float(scores[t, e]) for e in sel)
        for e in sel:
            assert got[e] == pytest.approx(float(scores[t, e]) / tot * 2.5, rel=1e-5)
    assert int(scores[0].argmin()) in idx[0].tolist()
    # without normalisation the weights are the raw scores times the scaling
    idx2, w2 = route(x, gw, bias=None, tid2eid=None, tokens=torch.zeros(N, dtype=torch.long), top_k=k,
                     scoring_func="sqrtsoftplus", norm_topk_prob=False, scaling=2.5)
    for t in range(N):
        top = sorted(range(E), key=lambda e: -float(scores[t, e]))[:k]
        assert set(idx2[t].tolist()) == set(top)
        for e, wt in zip(idx2[t].tolist(), w2[t].tolist()):
            assert wt == pytest.approx(float(scores[t, e]) * 2.5, rel=1e-5)


def test_shared_input_linear_stacks_what_it_can_and_equals_separate_products():
    """Weights of one input run as one product per stackable set (FP8 in whole 128-row scale blocks; one float
    dtype), in the order given; FP8 rows that end mid block and trainable parameters stay apart, and gradients
    still reach a parameter."""
    from moebox.ops.linear import SharedInputLinear, linear
    from moebox.weights.formats import QuantTensor, quant_fp8_block
    g = torch.Generator().manual_seed(0)

    def fp8(rows: int) -> QuantTensor:
        return QuantTensor("fp8", *quant_fp8_block(torch.randn(rows, 192, generator=g)))

    param = torch.nn.Parameter(torch.randn(24, 192, generator=g))
    weights = [fp8(128), torch.randn(64, 192, generator=g).bfloat16(), fp8(256), fp8(100), param,
               torch.randn(32, 192, generator=g).bfloat16()]
    shared = SharedInputLinear(*weights)
    assert sorted(idx for idx, _ in shared.parts) == [[0, 2], [1, 5], [3], [4]]
    x = torch.randn(3, 192, generator=g)
    outs = shared(x)
    assert [o.shape[-1] for o in outs] == [128, 64, 256, 100, 24, 32]
    for o, w in zip(outs, weights):
        torch.testing.assert_close(o, linear(x, w), rtol=1e-5, atol=1e-5)
    outs[4].sum().backward()
    assert param.grad is not None and param.grad.abs().sum() > 0
