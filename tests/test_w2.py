"""The w2 codec: the FP4 -> 2-bit mapping of field_notes.md §3, the float path, and the byte count."""

from __future__ import annotations

import math

import torch

from moebox.quant.w2 import W2Tensor, error_stats, from_float, from_fp4, pack_levels

# field_notes.md §3, written out per FP4 nibble (bit 3 = sign; magnitudes 0,.5,1,1.5,2 -> 1 and 3,4,6 -> 4)
EXPECTED_LEVEL = {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 4, 6: 4, 7: 4,
                  8: -1, 9: -1, 10: -1, 11: -1, 12: -1, 13: -4, 14: -4, 15: -4}


def packed_from_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Official FP4 packing, written independently: logical column 2c is the low nibble of byte c."""
    n = nibbles.to(torch.int32)
    return (n[:, 0::2] | (n[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)


def scales(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(110, 130, (rows, cols // 32), generator=gen).to(torch.uint8).view(torch.float8_e8m0fnu)


def test_every_nibble_maps_to_its_level_and_scales_are_kept():
    gen = torch.Generator().manual_seed(0)
    rows, cols = 16, 64
    nibbles = torch.randint(0, 16, (rows, cols), generator=gen)
    nibbles[0, :16] = torch.arange(16)                      # every code at least once
    s = scales(rows, cols, gen)
    t = from_fp4(packed_from_nibbles(nibbles), s)
    assert torch.equal(t.scales.view(torch.uint8), s.view(torch.uint8))
    expected_levels = torch.tensor([[EXPECTED_LEVEL[int(v)] for v in row] for row in nibbles], dtype=torch.float32)
    scale_vals = torch.tensor([[2.0 ** (int(b) - 127) for b in row] for row in s.view(torch.uint8)])
    expected = expected_levels * scale_vals.repeat_interleave(32, dim=1)
    assert torch.equal(t.dequantize(torch.float32), expected)


def test_signed_zeros_follow_their_sign_bit_when_mixed():
    nibbles = torch.tensor([[0, 8] * 16 + [3] * 32])        # 50% +0, 50% -0
    t = from_fp4(packed_from_nibbles(nibbles), torch.full((1, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    vals = t.dequantize()[0]
    assert vals[0:32:2].eq(1).all() and vals[1:32:2].eq(-1).all()


def test_zeros_alternate_by_position_when_over_95_percent_share_a_sign():
    cols = 64
    nibbles = torch.full((2, cols), 6)                      # non-zeros: +4 everywhere
    nibbles[:, :50] = 0                                     # 100 zeros, all +0 -> the rule applies
    nibbles[0, 60] = 8                                      # ...plus one -0: 100/101 = 99% share +0
    t = from_fp4(packed_from_nibbles(nibbles), torch.full((2, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu))
    vals = t.dequantize()
    flat_pos = torch.arange(2 * cols).view(2, cols)
    zero = (nibbles & 7) == 0
    expected_zero = torch.where(flat_pos % 2 == 0, 1.0, -1.0)
    assert torch.equal(vals[zero], expected_zero[zero])
    assert vals[~zero].eq(4).all()

    mixed = nibbles.clone()
    mixed[1, :50:2] = 8                                     # 75 of 101 zeros share a sign: below 95%, signs kept
    vals = from_fp4(packed_from_nibbles(mixed),
                    torch.full((2, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)).dequantize()
    z = (mixed & 7) == 0
    assert torch.equal(vals[z], torch.where((mixed[z] & 8) != 0, -1.0, 1.0))


def test_plane_layout_puts_column_4j_plus_c_in_bits_2c():
    levels = torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]])
    packed = pack_levels(levels)
    assert packed.tolist() == [[0b11100100, 0b00011011]]
    assert torch.equal(W2Tensor(packed, torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu))
                       .level_codes(), levels.to(torch.uint8))


def test_exactly_2_25_bits_per_weight():
    t = from_float(torch.randn(256, 512))
    assert t.nbytes * 8 / (256 * 512) == 2.25
    assert t.codes.numel() == 256 * 512 // 4 and t.scales.numel() == 256 * 512 // 32


def test_from_float_scale_exponent_and_round_trip_error():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(128, 256, generator=gen) * 0.02
    t = from_float(w)
    blocks = w.view(128, 8, 32)
    for r, b in [(0, 0), (5, 3), (127, 7)]:
        amax = blocks[r, b].abs().max().item()
        assert int(t.scales.view(torch.uint8)[r, b]) - 127 == round(math.log2(amax / 6))
    stats = error_stats(w, t.dequantize())
    print(f"\nw2 from_float on N(0, 0.02^2): rel RMS {stats.rel_rmse:.4f}, max abs {stats.max_abs:.5f}, "
          f"cosine {stats.cosine:.4f}")
    assert stats.rel_rmse < 0.45 and stats.cosine > 0.9
    # sign is never lost: every weight keeps its sign (levels have no zero)
    nonzero = w != 0
    assert torch.equal(torch.sign(t.dequantize())[nonzero], torch.sign(w)[nonzero])


def test_table_path_equals_the_per_element_rule():
    from moebox.quant.w2 import _codes_from_fp4_nibbles
    from moebox.weights.formats import unpack_fp4
    gen = torch.Generator().manual_seed(2)
    packed = torch.randint(-128, 128, (64, 128), generator=gen, dtype=torch.int8)
    fast = from_fp4(packed, scales(64, 256, gen))
    assert torch.equal(fast.codes, pack_levels(_codes_from_fp4_nibbles(unpack_fp4(packed))))
