"""What one dependent launch costs in a chain, with PDL's grid wait and with a counter the programs spin on.

Why: at batch 1 a V4-Flash decode step is a chain of ~600 dependent launches, and every drop probe so far priced
a launch at ~1.7-2.1 us on the critical path beyond its bytes (docs/benchmarks.md); moving a kernel's loads
earlier inside its program did not move batch 1 (thirty-third session). A launch under PDL starts early, but its
programs pass `griddepcontrol.wait` only once the whole grid before has ended and its writes are flushed. The
other way: the kernel after lets its dependents launch at once, and each of its programs spins (acquire) on a
counter that every program of the kernel before bumps (release) after its stores, so it goes on as soon as the
data it needs is there, not when the grid's end has been signalled. This measures both on a synthetic chain.

Chain: L links; each of a link's G programs reads all of the previous link's vector (N fp32, as a GEMV reads its
input), sums it and writes its 16-element slice of its own vector. Modes: `plain` (no PDL), `wait` (pdl_start:
wait, then let the next launch), `flag` (next launch first, then the spin). The counters only grow; the target
is G x the epoch, a device scalar that the chain's first kernel (a plain launch) increments, so a CUDA graph's
frozen arguments serve every replay. Each mode's last vector is checked against `plain`'s.

    python -m bench.flag_probe [--links 200] [--programs 4 128 768]
"""

from __future__ import annotations

import argparse

import torch

from moebox.ops.triton.runtime import HAVE_TRITON, tl, triton

SLICE = 16
MODES = {"plain": 0, "wait": 1, "flag": 2}

if HAVE_TRITON:
    @triton.jit
    def _tick_kernel(epoch_ptr):
        tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)

    @triton.jit
    def _link_kernel(src_ptr, dst_ptr, cin_ptr, cout_ptr, epoch_ptr, G_IN, N: tl.constexpr, SLICE: tl.constexpr,
                     MODE: tl.constexpr, FIRST: tl.constexpr):
        p = tl.program_id(0)
        if MODE == 1 or (MODE == 2 and FIRST):
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        elif MODE == 2:
            tl.extra.cuda.gdc_launch_dependents()
            target = tl.load(epoch_ptr) * G_IN          # written by the tick, launches back
            seen = tl.atomic_add(cin_ptr, 0, sem="acquire", scope="gpu")
            while seen < target:
                seen = tl.atomic_add(cin_ptr, 0, sem="acquire", scope="gpu")
        offs = tl.arange(0, N)
        s = tl.sum(tl.load(src_ptr + offs, cache_modifier=".cg"), axis=0)
        cols = p * SLICE + tl.arange(0, SLICE)
        own = tl.load(src_ptr + cols % N, cache_modifier=".cg")
        tl.store(dst_ptr + cols, own * 0.5 + s * (1.0 / N))
        if MODE == 2:
            tl.debug_barrier()                            # every thread's stores before the release
            tl.atomic_add(cout_ptr, 1, sem="release", scope="gpu")


def chain(mode: str, links: int, programs: int, n: int = 4096, device: str = "cuda"):
    """(a callable that launches the chain once, its first vector, its last vector)."""
    width = max(n, programs * SLICE)
    vecs = [torch.randn(width, device=device, generator=torch.Generator(device).manual_seed(0))]
    vecs += [torch.zeros(width, device=device) for _ in range(links)]
    counters = torch.zeros(links + 1, dtype=torch.int32, device=device)
    epoch = torch.zeros(1, dtype=torch.int32, device=device)
    m = MODES[mode]
    pdl = {"launch_pdl": True} if m else {}

    def run() -> None:
        _tick_kernel[(1,)](epoch)
        for i in range(links):
            _link_kernel[(programs,)](vecs[i], vecs[i + 1], counters[i:], counters[i + 1:], epoch, programs,
                                      N=n, SLICE=SLICE, MODE=m, FIRST=i == 0, num_warps=4, **pdl)
    return run, vecs[0], vecs[-1]


def chain_reference(first: torch.Tensor, links: int, programs: int, n: int = 4096) -> torch.Tensor:
    """The chain's last vector in torch: each link's slice p*16.. is the previous vector there (mod n) / 2 plus the
    mean of its first n elements."""
    v = first
    cols = torch.arange(programs * SLICE, device=first.device)
    for _ in range(links):
        nxt = torch.zeros_like(v)
        nxt[cols] = v[cols % n] * 0.5 + v[:n].sum() / n
        v = nxt
    return v


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", type=int, default=200)
    ap.add_argument("--programs", type=int, nargs="+", default=[4, 128, 768])
    args = ap.parse_args(argv)
    from moebox.ops.cuda_graphs import capture
    print("| programs a link | plain us a link | wait us a link | flag us a link | flag's output = plain's |")
    print("|---|---|---|---|---|")
    for g in args.programs:
        row, outs = {}, {}
        for mode in MODES:
            run, _, last = chain(mode, args.links, g)
            run()
            torch.cuda.synchronize()
            graph, _ = capture(lambda: run())
            graph.replay()
            torch.cuda.synchronize()
            outs[mode] = last.clone()
            row[mode] = triton.testing.do_bench(graph.replay, warmup=5, rep=200) * 1e3 / (args.links + 1)
            del graph
        same = bool(torch.equal(outs["flag"], outs["plain"]) and torch.equal(outs["wait"], outs["plain"]))
        print(f"| {g} | {row['plain']:.2f} | {row['wait']:.2f} | {row['flag']:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
