"""The L2 prefetch kernel (moebox/ops/triton/l2_prefetch.py) reads every word of a tensor exactly once: the XOR of
its sink is the XOR of the tensor's int32 words. CPU: in Triton's interpreter (a subprocess), sizes around the
step and program boundaries. GPU (marker `gpu`): large tensors, and the model's captured decode step with the
prefetches on gives the eager step's logits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moebox.ops.triton.runtime import HAVE_TRITON
from tests.interpreter import ROOT

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
    proc = subprocess.run([sys.executable, "-c", _CHECK, str(ROOT)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("nbytes", [4, 1 << 20, (40 << 20) + 12])
def test_prefetch_reads_every_word_once_on_the_gpu(nbytes: int) -> None:
    from moebox.ops.triton.l2_prefetch import l2_prefetch, xor_of, xor_reference
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    for programs in (1, 66, 132):
        assert xor_of(l2_prefetch(t, programs)) == xor_reference(t)


@pytest.mark.gpu
@needs_cuda
def test_decode_graph_with_l2_prefetch_replays_the_eager_step(tiny_ckpt, tmp_path, monkeypatch) -> None:
    """Every prefetch part on (they fork a stream and join it again inside the captured step): the captured decode
    step still gives the eager step's logits and leaves the cache as the eager step does."""
    from moebox.model.batch import DecodeBatch, FlatBatch
    from moebox.runtime.graphs import DecodeGraphs
    from moebox.runtime.loader import load_model
    monkeypatch.setenv("MOEBOX_L2_PREFETCH", "1")
    model, _ = load_model(tiny_ckpt, device="cuda", kv_cache_dtype="model", experts="w2",
                          store_dir=tmp_path / "store", progress=False)
    assert model.layers[0].attn.query_weights and model.layers[0].attn.output_weights
    ids = torch.randint(2, model.cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    caches = [model.new_cache(3, 64, "cuda") for _ in range(2)]
    for cache in caches:
        model.forward(FlatBatch.build([(1, 0, ids[:10])], "cuda"), cache)
    graphs = DecodeGraphs(model, caches[0], scratch_slot=2, batch_sizes=[1])
    for pos in range(10, 20):
        got = graphs.run([ids[pos]], [pos], [1]).logits.float().cpu()
        want = model.forward(DecodeBatch(*(torch.tensor([v], device="cuda") for v in (ids[pos], pos, 1))),
                             caches[1]).logits.float().cpu()
        assert (got - want).abs().max().item() <= 1e-5, pos
