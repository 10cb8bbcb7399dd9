"""The Triton w2 routed-expert prefill kernels (moebox/ops/triton/w2_moe_prefill.py) against the torch reference.

- CPU: `align_pairs` against a plain loop; the kernels of both variants in Triton's interpreter (subprocess:
  TRITON_INTERPRET is read at import) on tiny shapes, fp32 and fp16 x, with and without the clamp, stacked planes
  and plane-store layer views; the sm_90 build of every tiling of the sweep (no GPU needed).
- GPU (marker `gpu`, skipped without CUDA): the V4-Flash expert shapes (H=4096, I=2048, E=256, k=6) at 17, 300
  and 2048 tokens in bf16, a small shape in fp32 / fp16, every tiling of the bench's sweep; every scratch buffer
  poisoned with NaN first.
  The model-level check is tests/test_cuda.py (a 20-token w2 prompt on CUDA vs the CPU).
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from moebox.ops.triton.w2_moe import random_planes, random_routing, w2_moe_decode_reference
from tests.interpreter import check_in_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")


@needs_triton
@pytest.mark.parametrize("n,k,experts,block_m", [(50, 3, 7, 16), (1, 2, 256, 64), (300, 6, 16, 64)])
def test_align_pairs_puts_every_pair_once_in_blocks_of_its_expert(n: int, k: int, experts: int, block_m: int):
    from moebox.ops.triton.w2_moe_prefill import align_pairs
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, experts, (n, k), generator=g)
    ids[0] = 3 % experts            # an expert taken several times by one token is still one pair each
    slots, block_expert = align_pairs(ids, experts, block_m)
    flat = ids.flatten().tolist()
    assert slots.numel() == block_expert.numel() * block_m
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        block = [p for p in slots[b * block_m:(b + 1) * block_m].tolist() if p != len(flat)]
        if e == experts:            # past the used blocks: all padding
            assert not block
            continue
        assert block and all(flat[p] == e for p in block)
        seen += block
    assert sorted(seen) == list(range(len(flat)))
    used = [e for e in block_expert.tolist() if e < experts]
    assert used == sorted(used)     # expert-major, so each expert's weights are read by consecutive blocks
    expected_blocks = sum(-(-flat.count(e) // block_m) for e in set(flat))
    assert len(used) == expected_blocks


_INTERPRETER = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton.w2_moe import layer_views, random_routing, stack_planes, w2_moe_decode_reference
    from moebox.ops.triton.w2_moe_prefill import PrefillConfig, w2_moe_prefill, w2_moe_prefill_split
    from moebox.quant.w2 import from_float
    from moebox.store.plane_store import StoreShape, slot_buffers
    results = []

    def experts_from_float(e, hidden, inter):
        g = torch.Generator().manual_seed(hidden + inter)
        return [tuple(from_float(torch.randn(s, generator=g) * 0.05) for s in ((inter, hidden), (inter, hidden),
                (hidden, inter))) for _ in range(e)]

    # several blocks per expert, partial blocks, row tiles past I / H (masks), K loops of several steps; both
    # variants (the weight tile as the dot's second operand, or as its first: "rows")
    tile = "tile"
    cases = [(64, 96, 5, 2, 40, 0.5, torch.float32, PrefillConfig(block_m=16, block_n=32, variant=tile), 1e-5),
             (128, 64, 4, 3, 9, None, torch.float32, PrefillConfig(block_m=16, block_n=64, block_k=32, variant=tile),
              1e-5),
             (64, 96, 6, 2, 20, 10.0, torch.float16, PrefillConfig(block_m=16, block_n=64, block_k=32, variant=tile),
              2e-3),
             (64, 96, 5, 2, 40, 0.5, torch.float32, PrefillConfig(block_m=16, block_n=32, variant="rows"), 1e-5),
             (128, 64, 4, 3, 9, None, torch.float16, PrefillConfig(block_m=16, block_n=64, variant="rows"), 2e-3)]
    for hidden, inter, e, k, n, limit, dtype, cfg, tol in cases:
        planes = stack_planes(experts_from_float(e, hidden, inter))
        ids, w = random_routing(n, e, k, seed=n)
        x = torch.randn(n, hidden).to(dtype)
        y = w2_moe_prefill(x, ids, w, *planes, limit, config=cfg)
        ref = w2_moe_decode_reference(x.float(), ids, w, *planes, limit)
        results.append(dict(case=[hidden, inter, e, k, n, limit, str(dtype), str(cfg)], tol=tol,
                            same_buffer=y.dtype == dtype and y.shape == x.shape,
                            finite=bool(torch.isfinite(y).all()), rel=float((y.float() - ref).norm() / ref.norm()),
                            ref_norm=float(ref.norm())))
    # codes stored tile by tile (the "rows" variant; H and I of two K tiles, so the order differs from row-major):
    # stacked planes, and a layer buffer relaid in place (`tile_layer_codes`) read through its views
    from moebox.ops.triton.w2_moe import tile_codes, tile_layer_codes
    hidden, inter, e, k, n = 512, 512, 3, 2, 20
    experts = experts_from_float(e, hidden, inter)
    planes = stack_planes(experts)
    shape = StoreShape(layers=1, experts=e, hidden=hidden, intermediate=inter)
    buf = torch.zeros(e, shape.stride, dtype=torch.uint8)
    for i, p in enumerate(experts):
        raw = b"".join(bytes(t) for t in slot_buffers(p, shape))
        buf[i, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    tile_layer_codes(buf, hidden, inter)
    ids, w = random_routing(n, e, k, seed=4)
    x = torch.randn(n, hidden)
    ref = w2_moe_decode_reference(x, ids, w, *planes, 10.0)
    rows = PrefillConfig(block_m=16, block_n=32, variant="rows")
    for case, y in (("tiled", w2_moe_prefill(x, ids, w, tile_codes(planes[0]), planes[1], tile_codes(planes[2]),
                                             planes[3], 10.0, config=rows, tiled=True)),
                    ("tiled layer views", w2_moe_prefill_split(x, ids, w, *layer_views(buf, hidden, inter), 10.0,
                                                               config=rows, tiled=True))):
        results.append(dict(case=case, same_buffer=True, finite=bool(torch.isfinite(y).all()),
                            rel=float((y - ref).norm() / ref.norm()), ref_norm=float(ref.norm())))
    # zero-copy plane-store layer views (expert stride = the slot)
    hidden, inter, e, k, n = 64, 64, 4, 2, 24
    experts = experts_from_float(e, hidden, inter)
    shape = StoreShape(layers=1, experts=e, hidden=hidden, intermediate=inter)
    buf = torch.zeros(e, shape.stride, dtype=torch.uint8)
    for i, planes in enumerate(experts):
        raw = b"".join(bytes(p) for p in slot_buffers(planes, shape))
        buf[i, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    ids, w = random_routing(n, e, k, seed=3)
    x = torch.randn(n, hidden)
    ref = w2_moe_decode_reference(x, ids, w, *stack_planes(experts), 10.0)
    y = w2_moe_prefill_split(x, ids, w, *layer_views(buf, hidden, inter), 10.0,
                             config=PrefillConfig(block_m=16, block_n=32))
    results.append(dict(case="layer views", same_buffer=True, finite=bool(torch.isfinite(y).all()),
                        rel=float((y - ref).norm() / ref.norm()), ref_norm=float(ref.norm())))
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@needs_triton
def test_prefill_kernels_in_triton_interpreter() -> None:
    check_in_interpreter(_INTERPRETER)


@needs_triton
def test_bad_shapes_are_refused_with_the_reason() -> None:
    from moebox.ops.triton.w2_moe_prefill import w2_moe_prefill
    planes = random_planes(2, 48, 32)
    ids, w = random_routing(3, 2, 1)
    with pytest.raises(ValueError, match="multiples of 32"):
        w2_moe_prefill(torch.randn(3, 48), ids, w, *planes, None)
    planes = random_planes(2, 64, 32)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        w2_moe_prefill(torch.randn(3, 64).double(), ids, w, *planes, None)
    from moebox.ops.triton.w2_moe_prefill import PrefillConfig
    with pytest.raises(ValueError, match="variant tile or rows"):
        PrefillConfig(variant="rows", block_k=64)
    planes = random_planes(2, 512, 256)      # codes tile by tile: the "rows" variant only, H and I of 256
    with pytest.raises(ValueError, match="tile by tile need the prefill variant 'rows'"):
        w2_moe_prefill(torch.randn(3, 512), ids, w, *planes, None, config=PrefillConfig(variant="tile"), tiled=True)
    with pytest.raises(ValueError, match="multiples of 256"):
        w2_moe_prefill(torch.randn(3, 64), ids, w, *random_planes(2, 64, 32), None, tiled=True)


# ---------------------------------------------------------------------------------------------- GPU
def _poison_allocator(nbytes: int) -> None:
    """Fill freed blocks of the caching allocator with NaN, so buffers the call allocates start as NaN and an
    element a kernel fails to write shows up in the output."""
    torch.empty(nbytes // 4, device="cuda").fill_(float("nan"))


@pytest.mark.parametrize("n,dtype,tol", [(17, torch.bfloat16, 1e-2), (300, torch.bfloat16, 1e-2),
                                         (2048, torch.bfloat16, 1e-2)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_matches_reference_at_v4_flash_shapes(n: int, dtype: torch.dtype, tol: float) -> None:
    from moebox.ops.triton.w2_moe_prefill import w2_moe_prefill
    hidden, inter, experts, k = 4096, 2048, 256, 6
    planes = random_planes(experts, hidden, inter, device="cuda", seed=n)
    ids, w = random_routing(n, experts, k, device="cuda", seed=n)
    x = torch.randn(n, hidden, device="cuda").to(dtype)
    ref = w2_moe_decode_reference(x.float(), ids, w, *planes, 3.0)
    _poison_allocator(2 << 30)
    y = w2_moe_prefill(x, ids, w, *planes, 3.0)
    torch.cuda.synchronize()
    assert y.dtype == dtype and torch.isfinite(y).all()
    rel = float((y.float() - ref).norm() / ref.norm())
    assert rel < tol, rel
    assert torch.equal(w2_moe_prefill(x, ids, w, *planes, 3.0), y)     # deterministic


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_small_shape_fp32_fp16_no_limit(dtype: torch.dtype, tol: float) -> None:
    from moebox.ops.triton.w2_moe_prefill import w2_moe_prefill
    hidden, inter, experts, k, n = 512, 320, 12, 3, 100     # I is not a multiple of the 128-row tile
    planes = random_planes(experts, hidden, inter, device="cuda", seed=2, scale_byte=(120, 124))
    ids, w = random_routing(n, experts, k, device="cuda", seed=2)
    x = torch.randn(n, hidden, device="cuda").to(dtype)
    ref = w2_moe_decode_reference(x.float(), ids, w, *planes, None)
    _poison_allocator(256 << 20)
    y = w2_moe_prefill(x, ids, w, *planes, None)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    assert float((y.float() - ref).norm() / ref.norm()) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_every_sweep_tiling_matches_reference() -> None:
    from moebox.ops.triton.w2_moe_prefill import SWEEP, w2_moe_prefill
    hidden, inter, experts, k, n = 1024, 512, 16, 4, 200
    planes = random_planes(experts, hidden, inter, device="cuda", seed=4, scale_byte=(120, 124))
    ids, w = random_routing(n, experts, k, device="cuda", seed=4)
    x = torch.randn(n, hidden, device="cuda").to(torch.bfloat16)
    ref = w2_moe_decode_reference(x.float(), ids, w, *planes, 3.0)
    for cfg in SWEEP:
        _poison_allocator(256 << 20)
        y = w2_moe_prefill(x, ids, w, *planes, 3.0, config=cfg)
        torch.cuda.synchronize()
        assert torch.isfinite(y).all(), cfg
        assert float((y.float() - ref).norm() / ref.norm()) < 1e-2, cfg


@pytest.mark.slow
@needs_triton
def test_every_sweep_tiling_builds_for_sm90_without_spills_in_the_rows_variant() -> None:
    """The sm_90 build (what a GPU run compiles) of each tiling the bench sweeps; the "rows" variant's point is
    fewer instructions a weight than the "tile" one, so the report must show it."""
    from moebox.ops.triton.w2_moe_prefill import SWEEP, PrefillConfig, sass_report
    tile = sass_report(PrefillConfig(block_n=128, variant="tile"))
    rows = sass_report(PrefillConfig(block_n=128, variant="rows"))
    assert rows["spills"] == 0 and rows["loop_ops"].get("HGMMA", 0) > 0, rows
    assert rows["instructions_per_weight"] < 0.7 * tile["instructions_per_weight"], (rows, tile)
    for cfg in SWEEP:
        assert sass_report(cfg)["loop_ops"], cfg
