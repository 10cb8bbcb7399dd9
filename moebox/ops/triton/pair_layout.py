"""The pair layout in which x and h reach the mma decode kernels (`w2_moe` module doc, "Layout the kernels take"):
bf16 terms, two columns to an int32 slot, ordered so that the 4 lanes loading one mma B fragment read 64
contiguous bytes. Its writers (`w2_moe`'s x pack and mma gate-up, `w2_fp8`'s gate-up) and readers share these
helpers, so that the layout is defined once."""

from __future__ import annotations

from moebox.ops.triton.runtime import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    @triton.jit
    def _pair_offset(j):
        """int32 offset of pair j of a word from the word's slot of pair 0 (see `_pair_slot`)."""
        return 16 * (j // 4) + j % 4

    @triton.jit
    def _pair_slot(w, j):
        """int32 slot of pair j (0..7) of word w of x or h in the pair layout: in each K tile of 16 words (128
        slots), word 4 t + i, pair 4 rho + jj sits at 32 i + 16 rho + 4 t + jj, so the 4 lanes t that load
        one B-fragment register set (word i, rep rho) read 64 contiguous bytes, one L1 line, not 4."""
        wl = w % 16
        return (w // 16) * 128 + 32 * (wl % 4) + 4 * (wl // 4) + _pair_offset(j)

    @triton.jit
    def _column_slot(k):
        """int16 slot of column k in one term: column c = k % 16 of word k // 16 is in pair (c & 3) + 4 (c >> 3),
        half (c >> 2) & 1."""
        c = k % 16
        return 2 * _pair_slot(k // 16, (c & 3) + 4 * (c >> 3)) + ((c >> 2) & 1)

    @triton.jit
    def _store_bf16_terms(ptr16, off, v, T: tl.constexpr, TERM_STRIDE):
        """v fp32 -> T bf16 terms (round to nearest even; v - sum of the terms is below 2^-8T |v|), stored
        as int16 bit patterns at ptr16 + off + tau * TERM_STRIDE."""
        r = v
        for tau in tl.static_range(T):
            b = r.to(tl.int32, bitcast=True)
            bits = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
            tl.store(ptr16 + off + tau * TERM_STRIDE, bits.to(tl.int16))
            r = r - (bits << 16).to(tl.float32, bitcast=True)
