"""Would the query up-projection (wq_b) at 2-4 tokens gain from the GEMV, which fuses the q norm, over the mma?

At 2-8 tokens TUNED_DECODE sends wq_b ([32768 | 40960, 1024] FP8) to the mma kernel, which won the product
alone; but the mma cannot fuse the RMSNorm before it, so a batch-2 step runs 43 more `_rms_norm_kernel` launches
than a batch-1 step (twenty-second session's timelines, `python -m bench.timeline_kernels`). This runs the
decode bench with wq_b's entries for 1 < N <= MAXN (env: 0 = none, 2, 4) swapped to a GEMV tiling (up to 4
tokens x 16 rows a program, K step 512, the norm fused), everything else as shipped.

    MAXN=2 python -m bench.wq_b_gemv_probe decode --context 4096 --batch 1 2 3 4 --no-breakdown   # CUDA only

H200, twenty-second session: MAXN 0 / 2 / 4 at batch 2 6.73 / 6.78 / 6.79 ms, batch 3-4 7.25 / 7.25 / 7.65 and
8.12 / 8.12 / 8.53 (twice each): the mma stays.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from moebox.bench.decode import configure, run
from moebox.ops.triton import fp8_linear
from moebox.ops.triton.fp8_linear import Fp8Config

WQ_B_SHAPES = ((32768, 1024), (40960, 1024))      # wq_b, and wq_b stacked with the indexer's (CSA layers)


def use_gemv_up_to(max_n: int) -> None:
    """Swap wq_b's TUNED_DECODE entries for 1 < N <= max_n to the GEMV tiling."""
    for shape in WQ_B_SHAPES:
        fp8_linear.TUNED_DECODE[shape] = tuple(
            (n, Fp8Config(block_n=min(4, n), block_o=16, num_stages=1, kernel="gemv", block_k=512))
            if 1 < n <= max_n else (n, cfg) for n, cfg in fp8_linear.TUNED_DECODE[shape])


if __name__ == "__main__":
    use_gemv_up_to(int(os.environ.get("MAXN", "0")))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s moebox %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="wq_b_gemv_probe")
    configure(parser)
    sys.exit(run(parser.parse_args()))
