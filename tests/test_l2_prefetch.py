"""The L2 prefetch kernel (moebox/ops/triton/l2_prefetch.py) reads every word of a tensor exactly once: the XOR of
its sink is the XOR of the tensor's int32 words. CPU: in Triton's interpreter (a subprocess), sizes around the
step and program boundaries. GPU (marker `gpu`): large tensors. The model's captured decode step with the
prefetches on: tests/test_cuda.py::test_decode_graphs_replay_the_eager_step."""

from __future__ import annotations

import textwrap

import pytest
import torch

from moebox.ops.triton.runtime import HAVE_TRITON
from tests.interpreter import run_in_interpreter

_CHECK = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from moebox.ops.triton.l2_prefetch import BLOCK_WORDS, l2_prefetch, xor_of, xor_reference
    g = torch.Generator().manual_seed(0)
    for words, dtype, programs in ((1, torch.int32, 4), (BLOCK_WORDS - 1, torch.float32, 1),
                                   (2 * BLOCK_WORDS + 37, torch.bfloat16, 3), (3 * BLOCK_WORDS, torch.uint8, 2),
                                   (5 * BLOCK_WORDS + 1, torch.int32, 66), (5 * BLOCK_WORDS, torch.int32, 4)):
        w = torch.randint(-2**31, 2**31 - 1, (words,), generator=g, dtype=torch.int32)
        t = w.view(dtype)
        sink = l2_prefetch(t, programs)
        assert 1 <= sink.numel() <= min(programs, -(-words // BLOCK_WORDS)), (words, programs, sink.numel())
        assert xor_of(sink) == xor_reference(t) == xor_of(w), (words, dtype, programs)
    try:
        l2_prefetch(torch.zeros(3, 4)[:, :3])
    except ValueError as e:
        assert "contiguous" in str(e)
    else:
        raise AssertionError("a strided tensor was taken")
    print("OK")
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton; Linux only)")
def test_prefetch_reads_every_word_once_in_triton_interpreter() -> None:
    assert run_in_interpreter(_CHECK).strip().endswith("OK")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("nbytes", [4, 1 << 20, (40 << 20) + 12])
def test_prefetch_reads_every_word_once_on_the_gpu(nbytes: int) -> None:
    from moebox.ops.triton.l2_prefetch import l2_prefetch, xor_of, xor_reference
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    for programs in (1, 66, 132):
        assert xor_of(l2_prefetch(t, programs)) == xor_reference(t)
