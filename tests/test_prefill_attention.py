"""Prefill attention through the decode attention kernel (the CUDA default; MOEBOX_PREFILL_ATTENTION_KERNEL=0:
dense, moebox/model/attention.py `_attend_segment`): each query's window read through a strided view of the segment's keys, its
selected entries through the table broadcast with stride 0. The whole tiny model, prefilled in chunks into a
cache (so chunks after the first read old window rows and entries back from it: sliding, CSA with the indexer's
top-3 and HCA layers), must give the hidden states of the dense torch path. In Triton's interpreter (CPU, fp32),
in a subprocess since TRITON_INTERPRET is read when triton is imported."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.interpreter import check_in_interpreter

_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, sys.argv[1])
    from moebox.model.batch import FlatBatch
    import moebox.ops.triton.decode_attention as kernel
    from tests.interpreter import count_calls, tiny_model

    calls = count_calls(kernel, "attend_triton")   # the kernel must really run
    cfg, model = tiny_model()
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    hidden = {}
    for switch in ("0", "1"):
        os.environ["MOEBOX_PREFILL_ATTENTION_KERNEL"] = switch
        cache = model.new_cache(2, 80, "cpu")
        rows = []
        for start in range(0, 70, 25):          # chunks of 25, 25, 20 tokens into slot 1
            out = model.forward(FlatBatch.build([(1, start, ids[start:start + 25])], "cpu"), cache)
            rows.append(out.hidden)
        hidden[switch] = torch.cat(rows)
    assert len(calls) == 3 * cfg.num_layers, len(calls)    # every layer of every chunk took the kernel
    ref, got = hidden["0"], hidden["1"]
    print("RESULT " + json.dumps([dict(case="tiny model, 3 chunks", same_buffer=True,
                                       finite=bool(torch.isfinite(got).all()),
                                       rel=float((got - ref).norm() / ref.norm()), ref_norm=float(ref.norm()))]))
""")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_prefill_attention_kernel_matches_the_dense_path_in_the_interpreter() -> None:
    check_in_interpreter(_SCRIPT, default_tol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_attention_kernel_matches_the_dense_path(monkeypatch) -> None:
    """The `small` preset on CUDA, a 300-token prompt in chunks of 128. In fp32 the kernel must give the dense
    path's hidden states; in bf16 it must be as close to the fp32 states as the dense bf16 path is (bf16 alone
    moves the small preset's hidden states by ~9% after 8 layers, so a direct bf16 comparison says little)."""
    import torch

    import moebox.ops.triton.decode_attention as kernel
    from moebox.bench.synthetic import synthetic_weights
    from moebox.config import parse_config
    from moebox.model.batch import FlatBatch
    from moebox.model.deepseek_v4 import DeepseekV4
    from moebox.weights.synth import preset_config
    calls = []
    attend = kernel.attend_triton
    monkeypatch.setattr(kernel, "attend_triton", lambda *a, **kw: calls.append(1) or attend(*a, **kw))
    cfg = parse_config(preset_config("small"))
    ids = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    hidden = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = DeepseekV4(cfg, synthetic_weights(cfg, "cuda", progress=False).pop, qat=False, dtype=dtype,
                           load_mtp=False)
        with torch.inference_mode():
            for switch in ("0", "1"):
                monkeypatch.setenv("MOEBOX_PREFILL_ATTENTION_KERNEL", switch)
                cache = model.new_cache(2, 320, "cuda")
                hidden[dtype, switch] = torch.cat([
                    model.forward(FlatBatch.build([(1, s, ids[s:s + 128])], "cuda"), cache).hidden.float()
                    for s in range(0, 300, 128)])
    assert len(calls) == 2 * 3 * cfg.num_layers      # the kernel ran in every layer of every chunk
    ref = hidden[torch.float32, "0"]

    def rel(key) -> float:
        return float((hidden[key] - ref).norm() / ref.norm())

    assert torch.isfinite(hidden[torch.bfloat16, "1"]).all()
    assert rel((torch.float32, "1")) < 1e-4
    assert rel((torch.bfloat16, "1")) < 1.5 * rel((torch.bfloat16, "0")) + 1e-3
