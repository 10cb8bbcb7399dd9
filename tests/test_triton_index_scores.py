"""The indexer's score kernel (moebox/ops/triton/index_scores.py) against the torch function it stands in for
(`moebox.model.decode_attention.index_scores`).

CPU: the kernel in Triton's interpreter (fp32, fp16) on odd shapes (heads and dim padded, a partial last entry
block, slots out of order, a sequence with no valid entry, NaN in the table's invalid rows, which must not leak),
its output poisoned first; the tiny model's decode steps with MOEBOX_INDEX_KERNEL=1 against the torch scores;
what `supported` refuses and that the dispatch keeps the torch function unless switched on. GPU (marker `gpu`):
V4-Flash shapes (64 heads of 128, 1 025 and 16 385 entries, batch 1 and 16) in bf16, poisoned outputs, a CUDA
graph replay.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from tests.interpreter import check_in_interpreter

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def case(b: int, h: int, d: int, e: int, slots: int, dtype: torch.dtype, seed: int,
         device: str = "cpu") -> dict:
    """Random indexer inputs: sequence i on slot slots - 1 - i (out of order; slots >= b), ~30% of entries
    invalid (all of sequence 1's when b > 1), NaN in the invalid rows of the used slots."""
    g = torch.Generator().manual_seed(seed)
    slot = torch.arange(slots - 1, slots - 1 - b, -1)
    valid = torch.rand(b, e, generator=g) > 0.3
    if b > 1:
        valid[1] = False
    keys = torch.randn(slots, e, d, generator=g)
    for i in range(b):
        keys[slot[i], ~valid[i]] = float("nan")
    return {k: v.to(device) for k, v in dict(
        qi=torch.randn(b, h, d, generator=g).to(dtype), wi=torch.randn(b, h, generator=g).to(dtype),
        index_keys=keys.to(dtype), slot=slot, valid=valid).items()} | dict(scale=d ** -0.5 * h ** -0.5)


def reference(inp: dict) -> torch.Tensor:
    """The torch function (compiled on CUDA; its wrapper takes positional arguments)."""
    from moebox.model.decode_attention import index_scores
    return index_scores(*(inp[k] for k in ("qi", "wi", "scale", "index_keys", "slot", "valid")))


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """rel: the largest error over the finite scores relative to the row's norm; same_buffer: -inf exactly where
    the reference has it; finite: no NaN."""
    got, want = got.float().cpu(), want.float().cpu()
    masked = torch.isneginf(want)
    fin = ~masked
    norm = float(want[fin].norm()) if fin.any() else 1.0
    rel = float((got[fin] - want[fin]).abs().max() / norm) if fin.any() else 0.0
    return dict(same_buffer=bool(torch.equal(torch.isneginf(got), masked)), finite=not bool(got.isnan().any()),
                rel=rel, ref_norm=norm)


_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, sys.argv[1])
    import moebox.ops.triton.index_scores as kernel
    from tests.test_triton_index_scores import case, compare, reference
    results = []
    shapes = [(3, 4, 32, 37, 5, torch.float32), (2, 20, 24, 130, 3, torch.float32),
              (3, 16, 16, 70, 4, torch.float16), (1, 64, 128, 65, 1, torch.float16)]
    for i, (b, h, d, e, slots, dt) in enumerate(shapes):
        inp = case(b, h, d, e, slots, dt, seed=i)
        out = torch.full((b, e), float("nan"))
        got = kernel.index_scores_triton(**inp, out=out)
        results.append(dict(case=[b, h, d, e, str(dt)], **compare(got, reference(inp)),
                            tol=1e-5 if dt == torch.float32 else 1e-3))
        assert got.data_ptr() == out.data_ptr()

    # qi as the raw product, rotated by the kernel (`rope`) against the torch scores of apply_rope(qi): a rope
    # part of the whole head and of its tail, a head padded in registers (24 -> 32)
    from moebox.ops.rope import apply_rope, rope_inv_freq
    for i, (b, h, d, e, rd, dt) in enumerate([(3, 4, 32, 37, 16, torch.float32), (2, 20, 24, 70, 24, torch.float32),
                                              (1, 16, 32, 65, 8, torch.float16)]):
        inp = case(b, h, d, e, b + 1, dt, seed=10 + i)
        rope = (torch.tensor([7, 4093, 70000])[:b], rope_inv_freq(rd, 10000.0, None))
        out = torch.full((b, e), float("nan"))
        got = kernel.index_scores_triton(**inp, out=out, rope=rope)
        want = reference(dict(inp, qi=apply_rope(inp["qi"], *rope)))
        results.append(dict(case=[b, h, d, e, rd, str(dt), "rope"], **compare(got, want),
                            tol=1e-5 if dt == torch.float32 else 1e-3))

    # the tiny model's decode steps: the kernel's scores against torch's (the top-k then picks the same rows)
    from tests.interpreter import count_calls, switch_result, tiny_model
    calls = count_calls(kernel, "index_scores_triton")
    os.environ.update(MOEBOX_ATTENTION_KERNEL="0", MOEBOX_COMPRESS_KERNEL="0", MOEBOX_PREFILL_ATTENTION_KERNEL="0",
                      MOEBOX_TOPK_KERNEL="0")
    cfg, model = tiny_model()
    results.append(switch_result(model, cfg, "MOEBOX_INDEX_KERNEL", 8))
    csa = sum(1 for kind in cfg.attn_types if kind == "csa")
    assert csa and len(calls) == 8 * csa, (len(calls), csa)
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_index_scores_kernel_in_the_interpreter() -> None:
    check_in_interpreter(_SCRIPT, default_tol=1e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_what_the_kernel_refuses_and_the_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    import moebox.ops.triton.index_scores as kernel
    from moebox.model.decode_attention import index_select
    from moebox.ops.triton.index_scores import index_scores_triton, supported
    from tests.interpreter import count_calls
    inp = case(2, 4, 32, 20, 3, torch.float32, seed=0)
    args = [inp[k] for k in ("qi", "wi", "index_keys", "slot", "valid")]
    assert supported(*args)
    bad = [dict(index_keys=inp["index_keys"].half()), dict(qi=inp["qi"][:, :, :16]), dict(valid=inp["valid"].int()),
           dict(slot=inp["slot"].float()), dict(wi=inp["wi"][:1]), dict(qi=torch.zeros(2, 200, 32))]
    for change in bad:
        changed = {**inp, **change}
        assert not supported(*[changed[k] for k in ("qi", "wi", "index_keys", "slot", "valid")]), change
    with pytest.raises(ValueError):
        index_scores_triton(**{**inp, "index_keys": inp["index_keys"].half()})
    calls = count_calls(kernel, "index_scores_triton")
    for flag in (None, "0", "1"):       # on CPU outside the interpreter the kernel never runs, on or off
        if flag is None:
            monkeypatch.delenv("MOEBOX_INDEX_KERNEL", raising=False)
        else:
            monkeypatch.setenv("MOEBOX_INDEX_KERNEL", flag)
        rows, _ = index_select(inp["qi"], inp["wi"], inp["scale"], inp["index_keys"], inp["slot"], inp["valid"], 4)
        assert rows.shape == (2, 4) and not calls, flag

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("entries", [1025, 16385])
@pytest.mark.parametrize("batch", [1, 16])
def test_gpu_v4_shapes_against_torch_and_in_a_graph(batch: int, entries: int) -> None:
    from moebox.ops.cuda_graphs import capture
    from moebox.ops.triton.index_scores import index_scores_triton
    inp = case(batch, 64, 128, entries, batch + 1, torch.bfloat16, seed=batch, device="cuda")
    want = reference(inp)
    out = torch.full((batch, entries), float("nan"), device="cuda")
    r = compare(index_scores_triton(**inp, out=out), want)
    assert r["same_buffer"] and r["finite"] and r["rel"] < 1e-5, r
    graph, got = capture(lambda: index_scores_triton(**inp))
    got.fill_(float("nan"))
    graph.replay()
    r = compare(got, want)
    assert r["same_buffer"] and r["finite"] and r["rel"] < 1e-5, r


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 16])
def test_gpu_raw_qi_rotated_in_the_kernel(batch: int) -> None:
    """`rope`: the raw qi rotated in the kernel (V4-Flash's 64 rope channels of 128, positions up to 64K) against
    the torch scores of apply_rope(qi)."""
    from moebox.ops.rope import apply_rope, rope_inv_freq
    from moebox.ops.triton.index_scores import index_scores_triton
    inp = case(batch, 64, 128, 1025, batch + 1, torch.bfloat16, seed=batch, device="cuda")
    rope = (torch.randint(0, 65536, (batch,), device="cuda"), rope_inv_freq(64, 10000.0, None).cuda())
    want = reference(dict(inp, qi=apply_rope(inp["qi"], *rope)))
    out = torch.full((batch, 1025), float("nan"), device="cuda")
    r = compare(index_scores_triton(**inp, out=out, rope=rope), want)
    assert r["same_buffer"] and r["finite"] and r["rel"] < 1e-3, r
