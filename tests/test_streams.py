"""`Branch` on a GPU: work on the side stream is done before what follows `join` reads it, eagerly and replayed
from a CUDA graph, and the main stream's work between fork and join does not wait for it; the side streams'
priority policy (on the CPU)."""

from __future__ import annotations

import pytest
import torch

from moebox.ops.cuda_graphs import capture
from moebox.ops.streams import Branch

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A slow chain on the side stream (its result read after the join) and a quick one on the main stream. The
    branch's input is dropped by its caller before the main stream allocates a tensor of its size: only the
    branch's hold on it keeps that tensor from taking its memory."""
    y = a @ a
    with Branch(a, "test", reads=(y,)) as branch:
        for _ in range(30):                     # ~30 dependent 2048^3 products: long enough to lose a race
            y = torch.tanh(y @ a)
    z = b * 2 + (a * 3).sum(dim=1)
    branch.join()
    return y.sum(dim=1) + z


@pytest.mark.gpu
@needs_gpu
def test_branch_result_is_complete_after_join_eager_and_in_a_graph(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2048, 2048, device="cuda", generator=gen) / 45
    b = torch.randn(2048, device="cuda", generator=gen)
    monkeypatch.setenv("MOEBOX_OVERLAP", "0")
    want = _step(a, b)
    monkeypatch.setenv("MOEBOX_OVERLAP", "1")
    assert Branch(a, "test").on
    torch.testing.assert_close(_step(a, b), want)
    graph, out = capture(lambda: _step(a, b))
    for scale in (1.0, 0.5):                       # new inputs each replay: a stale read would show
        a.mul_(scale)
        b.add_(1.0)
        monkeypatch.setenv("MOEBOX_OVERLAP", "0")
        want = _step(a, b)
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out, want)


@pytest.mark.gpu
@needs_gpu
def test_a_branch_entered_again_goes_on_after_the_main_streams_work_since(monkeypatch):
    """The key branch's shape (moebox/model/attention.py): a first body that needs only the input, main-stream
    work, then a second body that reads what the main stream made in between; eager and replayed from a graph,
    the same result as on one stream."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(2048, 2048, device="cuda", generator=gen) / 45

    def step() -> torch.Tensor:
        branch = Branch(a, "test", reads=(a,))
        with branch:
            y = a
            for _ in range(10):
                y = torch.tanh(y @ a)
        m = a @ a                               # the main stream's product, which the second body reads
        for _ in range(10):
            m = torch.tanh(m @ a)
        branch.hold(m)
        with branch:
            y = y + m * 2
        branch.join()
        return y.sum(dim=1) - m.sum(dim=1)

    monkeypatch.setenv("MOEBOX_OVERLAP", "0")
    want = step()
    monkeypatch.setenv("MOEBOX_OVERLAP", "1")
    torch.testing.assert_close(step(), want)
    graph, out = capture(step)
    for scale in (0.5, 2.0):
        a.mul_(scale)
        monkeypatch.setenv("MOEBOX_OVERLAP", "0")
        want = step()
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out, want)


@pytest.mark.gpu
@needs_gpu
def test_branch_is_off_on_the_cpu_and_when_disabled():
    t = torch.ones(3)
    with Branch(t, "test") as branch:
        pass
    branch.join()
    assert not branch.on
    assert not Branch(t.cuda(), "test", enabled=False).on


def test_side_priority_follows_the_measured_batch_sizes(monkeypatch):
    """Side streams outrank the main one, except the shared expert's at 2-7 tokens (where batch 2 lost 0.3 ms on
    the H200); MOEBOX_SIDE_PRIORITY=0 / 1 / a list of names: never / always / for those branches."""
    from moebox.ops import streams
    monkeypatch.delenv("MOEBOX_SIDE_PRIORITY", raising=False)
    assert [streams.side_priority(n, "moe") for n in (1, 2, 4, 7, 8, 64)] == [-1, 0, 0, 0, -1, -1]
    for name in ("attention", "mhc", "pack"):
        assert [streams.side_priority(n, name) for n in (1, 2, 7, 8)] == [-1, -1, -1, -1]
    for value, want in (("0", 0), ("1", -1)):
        monkeypatch.setenv("MOEBOX_SIDE_PRIORITY", value)
        assert streams.side_priority(1, "moe") == want and streams.side_priority(2, "attention") == want
    monkeypatch.setenv("MOEBOX_SIDE_PRIORITY", "attention,mhc")
    assert [streams.side_priority(2, name) for name in ("attention", "mhc", "moe", "pack")] == [-1, -1, 0, 0]


@pytest.mark.gpu
@needs_gpu
def test_side_streams_outrank_the_main_stream(monkeypatch):
    """A one-token branch's kernels go ahead of the main stream's queued programs (see moebox/ops/streams.py):
    its side stream has a higher priority (a lower number) than the default stream and a graph capture's."""
    monkeypatch.delenv("MOEBOX_SIDE_PRIORITY", raising=False)
    a = torch.ones(1, 4, device="cuda")
    with Branch(a, "test", purpose="test-priority") as branch:
        side = torch.cuda.current_stream().priority
    branch.join()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capturing = torch.cuda.current_stream().priority
        b = a * 2
    assert side < torch.cuda.current_stream().priority and side < capturing
    del b
