"""The L2 prefetch (moebox/ops/triton/l2_prefetch.py): its switch, its sm_90 build (one bulk prefetch a thread,
after the PDL wait), and on the GPU that it runs eagerly and inside a CUDA graph without touching the data."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def test_the_switch_names_targets_and_megabytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from moebox.ops.triton.l2_prefetch import prefetch_bytes, prefetch_branch
    monkeypatch.delenv("MOEBOX_L2_PREFETCH", raising=False)
    assert prefetch_bytes("wo_a") == prefetch_bytes("wq_b") == 0
    monkeypatch.setenv("MOEBOX_L2_PREFETCH", "wo_a:24,wq_b:0.5")
    assert prefetch_bytes("wo_a") == 24 << 20 and prefetch_bytes("wq_b") == 1 << 19
    assert prefetch_branch(torch.zeros(1), torch.zeros(4, 4), "wo_a") is None   # CPU, not FP8: nothing to do
    for bad in ("wo_a=24", "wo_b:8", "wo_a:lots"):
        monkeypatch.setenv("MOEBOX_L2_PREFETCH", bad)
        with pytest.raises(ValueError, match="MOEBOX_L2_PREFETCH must be target:MB"):
            prefetch_bytes("wo_a")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_the_sm90_build_issues_one_bulk_prefetch_a_thread_after_the_wait() -> None:
    from moebox.ops.triton import l2_prefetch
    from moebox.ops.triton.runtime import build_sm90, cubin_dump
    compiled = build_sm90(l2_prefetch._l2_prefetch_kernel, {"ptr": "*u8", "nbytes": "i64"},
                          {"CHUNK": l2_prefetch.CHUNK, "PDL": True}, ["ptr"], num_warps=1)
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1
    assert 0 <= ptx.find("griddepcontrol.wait") < ptx.find("cp.async.bulk.prefetch")
    sass = cubin_dump(compiled.asm["cubin"])[0]
    assert len(re.findall(r"UBLKPF\.L2", sass)) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefetch_eager_and_in_a_graph() -> None:
    """Sizes past a program's 32 chunks, with a tail, and past the tensor (clamped); on a side stream inside a
    captured graph, as the model launches it. The data is read, never written."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the bulk prefetch is sm_90's")
    from moebox.ops.cuda_graphs import capture
    from moebox.ops.streams import Branch
    from moebox.ops.triton.l2_prefetch import l2_prefetch
    w = torch.randint(0, 255, (40 << 20,), dtype=torch.uint8, device="cuda")
    ref = w.clone()
    for nbytes in (16, (3 << 20) + 48, 24 << 20, 1 << 30):
        l2_prefetch(w, nbytes)
    torch.cuda.synchronize()

    def step() -> torch.Tensor:
        branch = Branch(w, "prefetch", purpose="prefetch")
        with branch:
            l2_prefetch(w, 24 << 20)
        out = w[:1024].float().sum()
        branch.join()
        return out

    graph, out = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, ref) and float(out) == float(ref[:1024].float().sum())
