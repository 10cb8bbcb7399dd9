"""Would the w2 planes lose less if each 32-block could move its scale exponent? An experiment on the demo.

The w2 format keeps the FP4 checkpoint's E8M0 scale bytes and buckets the FP4 magnitudes into the levels 1 and 4
(field_notes.md §3; `moebox.quant.w2.from_fp4`). The format itself allows any exponent per 32-block: here each
block takes the one of s - 1, s, s + 1 whose nearest levels (same sign rule, same symmetric levels) leave the
smallest squared error. Nothing else changes: 2.25 bits a weight, the kernels as they are. The script prints the
relative RMS error of both quantizers over a model's routed experts, then `moebox eval`'s table with the searched
planes (native and w2, held-out items; a fresh plane store under --store).

    python -m bench.w2_exponent_search moebox/demo_model --n-per-kind 20      # ~15 min on 2 CPU cores

Not the project's quantizer: this is the experiment behind docs/benchmarks.md (eighth session). It patches the
packer's `from_fp4` for the run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from moebox.quant.w2 import LEVELS, W2Tensor, from_fp4, pack_levels
from moebox.weights.formats import FP4_BLOCK, dequant_fp4, unpack_fp4


def from_fp4_searched(packed: torch.Tensor, scales: torch.Tensor) -> W2Tensor:
    """`from_fp4` with each block's exponent picked from s - 1, s, s + 1 by squared error (ties keep s)."""
    ref = dequant_fp4(packed, scales)
    rows, cols = ref.shape
    blocks = ref.view(rows, cols // FP4_BLOCK, FP4_BLOCK)
    negative = ((unpack_fp4(packed) & 8) != 0).view(blocks.shape)     # the sign rule of from_fp4, zeros too
    s = scales.view(torch.uint8).to(torch.int32)
    best = None
    for shift in (0, -1, 1):
        exp = (s + shift).clamp(0, 254)
        scale = torch.exp2(exp.float() - 127)[..., None]
        big = (blocks / scale).abs() > 2.5
        codes = torch.where(negative, 1 - big.to(torch.uint8), 2 + big.to(torch.uint8))
        err = (LEVELS[codes.long()] * scale - blocks).square().sum(-1)
        if best is None:
            best = [err, codes, exp]
            continue
        better = err < best[0]
        best = [torch.where(better, err, best[0]), torch.where(better[..., None], codes, best[1]),
                torch.where(better, exp, best[2])]
    return W2Tensor(pack_levels(best[1].reshape(rows, cols)), best[2].to(torch.uint8).view(torch.float8_e8m0fnu))


def expert_errors(model: Path) -> dict[str, float]:
    """Relative RMS error over all routed experts of the model's (single-file) FP4 checkpoint, per quantizer."""
    sq = {"kept": 0.0, "searched": 0.0}
    norm = 0.0
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in sorted({k.rsplit(".", 1)[0] for k in f.keys() if ".experts." in k}):
                packed, scales = f.get_tensor(name + ".weight"), f.get_tensor(name + ".scale")
                ref = dequant_fp4(packed, scales)
                norm += ref.square().sum().item()
                for key, fn in (("kept", from_fp4), ("searched", from_fp4_searched)):
                    sq[key] += (fn(packed, scales).dequantize() - ref).square().sum().item()
    return {k: (v / norm) ** 0.5 for k, v in sq.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--n-per-kind", type=int, default=20)
    p.add_argument("--store", type=Path, default=None, help="plane store directory (default: a temporary one)")
    args = p.parse_args()
    print("relative RMS error of the routed experts:", expert_errors(args.model), flush=True)
    import moebox.store.pack as pack
    from moebox.train.evaluate import run_eval
    pack.from_fp4 = from_fp4_searched
    with tempfile.TemporaryDirectory() as tmp:
        print(run_eval(args.model, ["native", "w2"], n_per_kind=args.n_per_kind, store_dir=args.store or tmp))


if __name__ == "__main__":
    main()
