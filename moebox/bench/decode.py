"""`moebox bench decode|prefill`: step time of the model against the device's own bandwidth and matmul rate.

Decode at batch 1-16 is bounded by bytes: each step must read the dense weights once (FP8 + the bf16 head)
and the planes of every distinct routed expert its tokens picked, plus the cache rows attention reads. The
bench measures the device copy bandwidth in the same process, counts those bytes for each measured step
(experts from the routing the step actually made), and reports the step time against that floor. Prefill is
bounded by matmul work: it reports TFLOP/s against a measured bf16 matmul rate.

The model is the synthetic full-size one from `moebox.bench.synthetic` (or the tiny/small preset shapes);
the cache starts empty and every sequence sits at position `context`, which makes a step read the same
bytes as after a real prefill of that length (the values differ, the amount does not).
A per-component breakdown replays each part of one real step (attention, routed experts, shared experts,
head) from its own CUDA graph; the full step minus their sum is everything else (mHC, norms, embedding).
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from moebox.config import ModelConfig, parse_config
from moebox.model.batch import DecodeBatch, FlatBatch
from moebox.model.deepseek_v4 import DeepseekV4
from moebox.model.moe import DECODE_TOKENS
from moebox.model.cache import cache_bytes_per_slot
from moebox.ops.cuda_graphs import capture
from moebox.runtime.graphs import DecodeGraphs
from moebox.weights.synth import PRESETS, preset_config

log = logging.getLogger("moebox")
GB = 1e9


# ----------------------------------------------------------------------------------------- device rates
def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds per call (CUDA events on a GPU, wall clock on the CPU), after one warm-up call."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / repeats


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, read + written bytes over time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, 20)


def matmul_rate(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of a bf16 n x n x n matmul."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n ** 3 / _timed(lambda: a @ b, device, 10)


# ----------------------------------------------------------------------------------------- bytes a step reads
def _nbytes(w: object) -> int:
    return w.nbytes if hasattr(w, "nbytes") else 0


def resident_bytes(weights: dict[str, object]) -> int:
    """Device bytes the weights hold, each storage once: the synthetic model's per-expert tensors are views of its
    layer plane buffers, which a plain sum of nbytes counted twice (164.66 GB for the ~87 GB V4-Flash)."""
    seen: dict[tuple[str, int], int] = {}
    for w in weights.values():
        parts = (w,) if isinstance(w, torch.Tensor) else (v for v in vars(w).values() if isinstance(v, torch.Tensor))
        for t in parts:             # a tensor, or the tensors of a QuantTensor / W2Tensor
            storage = t.untyped_storage()
            seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def dense_bytes(weights: dict[str, object]) -> int:
    """Non-expert weight bytes a step reads, but the embedding (the step reads one row of it per sequence):
    counted from the weights before the model is built (the model stacks some of them and the loader drops the
    originals)."""
    return sum(_nbytes(w) for name, w in weights.items() if ".ffn.experts." not in name and name != "embed.weight")


def expert_bytes(cfg: ModelConfig) -> int:
    """Plane bytes of one routed expert (3 matrices at 2.25 bits/weight)."""
    n = cfg.hidden_size * cfg.moe_intermediate_size
    return 3 * (n // 4 + n // 32)


def distinct_experts(model: DeepseekV4, batch: DecodeBatch, cache) -> int:
    """Distinct (layer, expert) pairs one eager decode step routes to."""
    hit: list[int] = []
    for layer in model.layers:
        layer.ffn.on_route = lambda idx: hit.append(int(idx.unique().numel()))
    try:
        model.forward(batch, cache)
    finally:
        for layer in model.layers:
            layer.ffn.on_route = None
    return sum(hit)


def cache_read_bytes(cfg: ModelConfig, context: int, dtype: torch.dtype) -> int:
    """Cache bytes a decode step at `context` must read per sequence: its windows and compressed entries (the
    whole table in HCA layers; the indexer keys plus top-k entries in CSA layers). A bound by the cache's size
    at that length is simple and close: the per-slot cache holds about exactly these rows."""
    return cache_bytes_per_slot(cfg, context, dtype, with_mtp=False)


# ----------------------------------------------------------------------------------------- decode
@dataclass
class DecodeRow:
    context: int
    batch: int
    step_s: float
    weight_bytes: int
    cache_bytes: int
    copy_bw: float

    @property
    def tok_s(self) -> float:
        return self.batch / self.step_s

    @property
    def floor_s(self) -> float:
        return (self.weight_bytes + self.cache_bytes) / self.copy_bw

    @property
    def fraction(self) -> float:
        return self.floor_s / self.step_s

    def cells(self) -> list[str]:
        return [f"{self.context}", f"{self.batch}", f"{self.weight_bytes / GB:.2f}", f"{self.cache_bytes / GB:.3f}",
                f"{self.step_s * 1e3:.2f}", f"{self.tok_s:.1f}", f"{self.floor_s * 1e3:.2f}", f"{self.fraction:.0%}"]


DECODE_HEADER = ["context", "batch", "weights GB", "cache GB", "step ms", "tok/s", "floor ms", "of floor"]


def _step_batch(cfg: ModelConfig, batch: int, context: int, device: torch.device, rows: int = 1) -> DecodeBatch:
    """A decode step of `batch` sequences at position `context`, `rows` consecutive tokens each (rows > 1: the
    last token plus drafts, as a speculative verify step feeds them)."""
    g = torch.Generator().manual_seed(batch * 100 + rows)
    return DecodeBatch(torch.randint(0, cfg.vocab_size, (batch * rows,), generator=g).to(device),
                       (context + torch.arange(rows)).repeat(batch).to(device),
                       torch.arange(batch).repeat_interleave(rows).to(device))


def _step_call(model: DeepseekV4, batch: DecodeBatch, cache, graphs: DecodeGraphs | None) -> Callable[[], object]:
    """One decode step of `batch` as a call: a replay of its captured graph, or the eager forward."""
    if graphs is None:
        return lambda: model.forward(batch, cache)
    ids, pos, slots = batch.tokens.tolist(), batch.positions.tolist(), batch.slots.tolist()
    return lambda: graphs.run(ids, pos, slots)


def bench_decode(model: DeepseekV4, dense: int, batches: Sequence[int], contexts: Sequence[int],
                 copy_bw: float, steps: int = 20, use_graphs: bool = True) -> list[DecodeRow]:
    cfg, device = model.cfg, model.embed.device
    rows = []
    for context in contexts:
        cache = model.new_cache(max(batches) + 1, context + 1, device)   # + the graphs' scratch slot
        graphs = DecodeGraphs(model, cache, max(batches), batches) if use_graphs else None
        for b in batches:
            batch = _step_batch(cfg, b, context, device)
            step = _timed(_step_call(model, batch, cache, graphs), device, steps)
            moved = dense + b * cfg.hidden_size * model.embed.element_size() + \
                distinct_experts(model, batch, cache) * expert_bytes(cfg)
            rows.append(DecodeRow(context, b, step, moved, b * cache_read_bytes(cfg, context, model.dtype), copy_bw))
            log.info("decode context %d batch %d: %.2f ms", context, b, step * 1e3)
        graphs = cache = None                    # free this context's cache before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------- speculative verify
@dataclass
class VerifyRow:
    batch: int
    k: int
    one_s: float        # a step of one token per sequence
    verify_s: float     # a step of k+1 tokens per sequence (the last token + k drafts)

    def cells(self) -> list[str]:
        ratio = self.verify_s / self.one_s
        return [f"{self.batch}", f"{self.k}", f"{self.one_s * 1e3:.2f}", f"{self.verify_s * 1e3:.2f}", f"{ratio:.2f}",
                f"{ACCEPTED_LENGTH / ratio:.2f}x"]


ACCEPTED_LENGTH = 2.6       # tokens per verify step reported for V4-Flash's MTP head at k=2 (field notes)
VERIFY_HEADER = ["batch", "k", "1-token step ms", "k+1-token step ms", "ratio", f"speedup at {ACCEPTED_LENGTH} tok/step"]


def bench_verify(model: DeepseekV4, batches: Sequence[int], context: int, k: int, steps: int,
                 use_graphs: bool) -> list[VerifyRow]:
    """Step time of k+1 tokens per sequence against 1 token per sequence (the verify step alone; the k MTP-layer
    forwards that draft are not in it). With graphs, only steps of at most 16 rows (what is captured)."""
    device = model.embed.device
    cache = model.new_cache(max(batches) + 1, context + k + 1, device, spec_slack=k)
    sizes = sorted({b * r for b in batches for r in (1, k + 1)})
    if use_graphs:
        sizes = [n for n in sizes if n <= DECODE_TOKENS]
    graphs = DecodeGraphs(model, cache, max(batches), sizes) if use_graphs else None
    out = []
    for b in batches:
        if b * (k + 1) not in sizes:
            continue
        times = []
        for rows in (1, k + 1):
            batch = _step_batch(model.cfg, b, context, device, rows)
            times.append(_timed(_step_call(model, batch, cache, graphs), device, steps))
        out.append(VerifyRow(b, k, *times))
        log.info("verify batch %d k %d: %.2f vs %.2f ms", b, k, times[1] * 1e3, times[0] * 1e3)
    return out


# ----------------------------------------------------------------------------------------- breakdown
class _Recorder:
    """Calls a model part and keeps the arguments of every call, to replay them later."""

    def __init__(self, part: Callable) -> None:
        self.part, self.calls = part, []

    def __call__(self, *args):
        self.calls.append(args)
        return self.part(*args)


def _graph_seconds(calls: list[tuple[Callable, tuple]], device: torch.device, steps: int) -> float:
    """Seconds per replay of one CUDA graph that makes all `calls` in order."""
    graph, _ = capture(lambda: [part(*args) for part, args in calls])
    return _timed(graph.replay, device, steps)


def breakdown(model: DeepseekV4, batch: DecodeBatch, cache, steps: int = 10) -> dict[str, float]:
    """Seconds per step of each component, each replayed alone from its own CUDA graph with the arguments one
    real step gave it: the attention of all layers (projections, cache, core), the routed experts (routing and
    the w2 kernels), the shared experts, the head. What the full step takes beyond their sum is the rest
    (mHC, norms, embedding) plus the joins between them."""
    parts = {"attention": [(layer, "attn") for layer in model.layers],
             "routed experts": [(layer.ffn, "routed") for layer in model.layers],
             "shared experts": [(layer.ffn, "shared_expert") for layer in model.layers if layer.ffn.shared_in],
             "head": [(model, "out")]}
    recorders = {name: [(obj, attr, _Recorder(getattr(obj, attr))) for obj, attr in items]
                 for name, items in parts.items()}
    installed = [(obj, attr, attr in vars(obj), rec) for items in recorders.values() for obj, attr, rec in items]
    for obj, attr, _, rec in installed:
        setattr(obj, attr, rec)
    try:
        model.forward(batch, cache)
    finally:
        for obj, attr, own, rec in installed:      # an instance attribute comes back; a method override goes
            if own:
                setattr(obj, attr, rec.part)
            else:
                delattr(obj, attr)
    device = model.embed.device
    return {name: _graph_seconds([(rec.part, args) for _, _, rec in items for args in rec.calls], device, steps)
            for name, items in recorders.items()}


def _profiled(step: Callable[[], object], device: torch.device, steps: int):
    """torch.profiler over `steps` calls of `step` (CUDA activity too on a GPU), after one unprofiled call
    (compilation, capture)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    _timed(step, device, 1)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    return prof


def profile_kernels(step: Callable[[], object], device: torch.device, steps: int,
                    top: int) -> tuple[list[list[str]], float]:
    """The `top` kernels of `step` by device time (CPU ops on the CPU), from torch.profiler over `steps` calls
    after two unprofiled ones (compilation, capture): rows of name, launches per call, us per call, share of the
    profiled time; and the profiled time per call in seconds. Where a step's time goes, kernel by kernel: the
    breakdown says which component, this says which launches."""
    cuda = device.type == "cuda"
    prof = _profiled(step, device, steps)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0 and
              (not cuda or e.device_type == torch.autograd.DeviceType.CUDA)]
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) / steps      # us
    rows = [[e.key[:80], f"{e.count / steps:g}", f"{getattr(e, attr) / steps:.1f}",
             f"{getattr(e, attr) / steps / total:.1%}"] for e in events[:top]]
    return rows, total * 1e-6


def kernel_timeline(step: Callable[[], object], device: torch.device, path: str) -> int:
    """Write one profiled `step`'s device activity in launch order to `path` (tab-separated: start us from the
    first, duration us, idle us since the ones before ended, the CUDA stream (the CPU thread for CPU ops), name;
    on the CPU: its ops, nested ones included) and return the number of rows. The profile's totals say which
    kernels cost most; this says in what order they run, on which stream (the main stream's chain is the
    step's critical path; side-stream branches run beside it) and where the device waits between them."""
    from torch.autograd import DeviceType
    kind = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    events = sorted((e for e in _profiled(step, device, 1).events() if e.device_type == kind),
                    key=lambda e: e.time_range.start)
    t0 = end = events[0].time_range.start
    with open(path, "w") as f:
        f.write("start_us\tdur_us\tidle_us\tstream\tname\n")
        for e in events:
            start, stop = e.time_range.start, e.time_range.end
            f.write(f"{start - t0:.2f}\t{stop - start:.2f}\t{max(0.0, start - end):.2f}\t{e.device_resource_id}\t"
                    f"{e.name[:120]}\n")
            end = max(end, stop)
    return len(events)


def read_timeline(path: str) -> list[dict[str, str]]:
    """The rows of a `kernel_timeline` file, each a dict of its columns (start_us, dur_us, idle_us, stream, name)."""
    with open(path) as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _profiled_step(model: DeepseekV4, batch_size: int, context: int, use_graphs: bool) -> Callable[[], object]:
    """One decode step as a call (a CUDA-graph replay when `use_graphs`) with its own cache."""
    cfg, device = model.cfg, model.embed.device
    cache = model.new_cache(batch_size + 1, context + 1, device)
    graphs = DecodeGraphs(model, cache, batch_size, [batch_size]) if use_graphs else None
    return _step_call(model, _step_batch(cfg, batch_size, context, device), cache, graphs)


def kernel_profile(model: DeepseekV4, batch_size: int, context: int, steps: int, use_graphs: bool,
                   top: int) -> tuple[list[list[str]], float]:
    """`profile_kernels` of one decode step (CUDA-graph replays when `use_graphs`)."""
    step = _profiled_step(model, batch_size, context, use_graphs)
    return profile_kernels(step, model.embed.device, steps, top)


# ----------------------------------------------------------------------------------------- prefill
@dataclass
class PrefillRow:
    tokens: int
    seconds: float
    flops: float
    matmul_rate: float

    def cells(self) -> list[str]:
        return [f"{self.tokens}", f"{self.seconds:.2f}", f"{self.tokens / self.seconds:.0f}",
                f"{self.flops / self.seconds / 1e12:.1f}", f"{self.matmul_rate / 1e12:.0f}",
                f"{self.flops / self.seconds / self.matmul_rate:.1%}"]


PREFILL_HEADER = ["prompt", "seconds", "tok/s", "TFLOP/s", "bf16 matmul TFLOP/s", "of matmul"]


def active_matmul_params(cfg: ModelConfig, weights: dict[str, object]) -> int:
    """Weights one token multiplies: every 2-D non-expert weight but the embedding, plus k routed experts.
    The head counts too (the bench computes logits for the last token only; its share is small)."""
    n = 0
    for name, w in weights.items():
        if ".ffn.experts." in name or name == "embed.weight" or name == "head.weight":
            continue
        shape = getattr(w, "shape", ())
        if len(shape) == 2:
            n += shape[0] * shape[1]
    return n + cfg.num_layers * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def _prefill_call(model: DeepseekV4, n: int, chunk: int) -> Callable[[], None]:
    """A prompt of n random tokens prefilled in chunks of `chunk` into a fresh one-slot cache."""
    cfg, device = model.cfg, model.embed.device
    cache = model.new_cache(1, n, device)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()

    def run() -> None:
        for start in range(0, n, chunk):
            model.forward(FlatBatch.build([(0, start, ids[start:start + chunk])], device), cache)
    return run


def bench_prefill(model: DeepseekV4, matmul_params: int, prompts: Sequence[int], chunk: int,
                  rate: float) -> list[PrefillRow]:
    device = model.embed.device
    rows = []
    for n in prompts:
        seconds = _timed(_prefill_call(model, n, chunk), device, 1)
        rows.append(PrefillRow(n, seconds, 2.0 * matmul_params * n, rate))
        log.info("prefill %d tokens: %.2f s", n, seconds)
    return rows


# ----------------------------------------------------------------------------------------- CLI
def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def configure(p: argparse.ArgumentParser) -> None:
    from moebox.bench import spec
    p.add_argument("what", choices=("decode", "prefill", "spec"),
                   help="which regime to measure (spec: MTP vs plain on a real model, per concurrency)")
    p.add_argument("--preset", default="flash", choices=PRESETS, help="model shapes (flash: real V4-Flash)")
    p.add_argument("--layers", type=int, default=None, help="main layers (default: the preset's, 43 for flash)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="decode batch sizes")
    p.add_argument("--context", type=int, nargs="+", default=[4096, 65536], help="decode context lengths")
    p.add_argument("--prompt", type=int, nargs="+", default=[2048, 16384], help="prefill prompt lengths")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max-num-batched-tokens)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per row")
    p.add_argument("--enforce-eager", action="store_true", help="time eager steps instead of CUDA graphs")
    p.add_argument("--no-breakdown", action="store_true", help="skip the per-component breakdown")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also profile the decode step at the first batch size and context (prefill: the first "
                        "prompt's first chunk): its N costliest kernels (CPU ops on the CPU)")
    p.add_argument("--timeline", metavar="FILE", default=None,
                   help="also write the device activity of one decode step at the first batch size and context, in "
                        "launch order with the idle time between launches, to FILE (tab-separated)")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="also time speculative verify steps (K drafts + 1 token per sequence) at the first context")
    p.add_argument("--tiled-codes", action="store_true",
                   help="relay every layer's expert codes tile by tile as the model is built (MOEBOX_TILED_CODES=1, "
                        "the expert kernels' other layout); CUDA only")
    spec.configure(p.add_argument_group("spec"))


def run(args: argparse.Namespace) -> int:
    from moebox.bench.synthetic import synthetic_weights
    from moebox.errors import MoeboxError
    from moebox.ops.triton.w2_moe import tile_order_fits
    if args.what == "spec":
        from moebox.bench import spec
        return spec.run(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MoeboxError("--device cuda but no CUDA device is available; use --device cpu (tiny/small presets)")
    if args.tiled_codes and device.type != "cuda":
        raise MoeboxError("--tiled-codes: the kernels that read codes tile by tile run on CUDA (on the CPU the "
                          "reference reads row-major copies: nothing to time); use --device cuda or drop the flag")
    cfg = parse_config(preset_config(args.preset, args.layers))
    if args.tiled_codes and not tile_order_fits(cfg.hidden_size, cfg.moe_intermediate_size):
        raise MoeboxError(f"--tiled-codes: the {args.preset} preset's experts ({cfg.hidden_size} x "
                          f"{cfg.moe_intermediate_size}) are not multiples of 256, which the kernels that read codes "
                          "tile by tile need; use --preset small or flash")
    if args.tiled_codes:
        os.environ["MOEBOX_TILED_CODES"] = "1"      # each layer relays its buffer as the model is built
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    weights = synthetic_weights(cfg, device)
    total, dense, matmul_params = resident_bytes(weights), dense_bytes(weights), \
        active_matmul_params(cfg, weights)
    model = DeepseekV4(cfg, weights.pop, qat=False, dtype=dtype, load_mtp=False)
    del weights
    print(f"model: {args.preset}, {cfg.num_layers} layers, {total / GB:.2f} GB of weights on {device} "
          f"(built in {time.perf_counter() - t0:.0f} s{', codes tile by tile' if args.tiled_codes else ''})")
    with torch.inference_mode():
        if args.what == "decode":
            _report_decode(args, model, dense, cfg, device)
        else:
            rate = matmul_rate(device) if device.type == "cuda" else 1e11
            rows = bench_prefill(model, matmul_params, args.prompt, args.chunk, rate)
            print(table(PREFILL_HEADER, [r.cells() for r in rows]))
            if args.kernels:
                n = min(args.prompt[0], args.chunk)
                rows_k, total = profile_kernels(_prefill_call(model, n, args.chunk), device, 1, args.kernels)
                print(f"\nkernels of a {n}-token prefill ({total * 1e3:.1f} ms profiled):")
                print(table(["kernel", "calls", "us", "of profiled"], rows_k))
    return 0


def _report_decode(args: argparse.Namespace, model: DeepseekV4, dense: int, cfg: ModelConfig,
                   device: torch.device) -> None:
    from moebox.runtime.plan import plan_for
    on_gpu = device.type == "cuda"
    bw = copy_bandwidth(device) if on_gpu else 10 * GB
    if on_gpu:   # the copy's 4 GiB of buffers are the bench's, not the run's: the peak compared with the plan below
        torch.cuda.reset_peak_memory_stats(device)      # starts from the resident weights
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s" + ("" if on_gpu else " (assumed on CPU)"))
    rows = bench_decode(model, dense, args.batch, args.context, bw, args.steps, on_gpu and not args.enforce_eager)
    print(table(DECODE_HEADER, [r.cells() for r in rows]))
    if args.verify:
        verify = bench_verify(model, args.batch, args.context[0], args.verify, args.steps,
                              on_gpu and not args.enforce_eager)
        print(f"\nspeculative verify steps, context {args.context[0]} (drafting not included):")
        print(table(VERIFY_HEADER, [r.cells() for r in verify]))
    if args.kernels:
        b, context = args.batch[0], args.context[0]
        rows_k, total = kernel_profile(model, b, context, args.steps, on_gpu and not args.enforce_eager, args.kernels)
        print(f"\n{'kernels' if on_gpu else 'CPU ops'} of a decode step, batch {b}, context {context} (profiled: "
              f"{total * 1e3:.2f} ms of {'device' if on_gpu else 'CPU'} time per step):")
        print(table(["kernel" if on_gpu else "op", "per step", "us per step", "of profiled"], rows_k))
    if args.timeline:
        step = _profiled_step(model, args.batch[0], args.context[0], on_gpu and not args.enforce_eager)
        n = kernel_timeline(step, device, args.timeline)
        print(f"\ntimeline of a decode step, batch {args.batch[0]}, context {args.context[0]}: {n} rows in "
              f"{args.timeline}")
    if not on_gpu:
        return
    if not args.no_breakdown:
        context = args.context[0]
        for b in sorted({min(args.batch), max(args.batch)}):
            cache = model.new_cache(b, context + 1, device)
            parts = breakdown(model, _step_batch(cfg, b, context, device), cache)
            del cache
            step = next(r.step_s for r in rows if r.context == context and r.batch == b)
            parts["everything else"] = step - sum(parts.values())
            cells = [[k, f"{v * 1e3:.2f}", f"{v / step:.0%}"] for k, v in parts.items()]
            print(f"\nbreakdown, context {context}, batch {b} (each part replayed alone from its own graph; "
                  f"full graph step {step * 1e3:.2f} ms):")
            print(table(["component", "ms", "of graph step"], cells))
    peak = torch.cuda.max_memory_allocated(device)
    plan = plan_for(cfg, peak, max(args.context) + 1, max(args.batch) + 1, max(args.batch), experts="w2",
                    kv_dtype=model.dtype, with_mtp=False)
    planned = plan.weight_bytes + plan.kv_bytes + plan.workspace_bytes
    print(f"\npeak GPU memory {peak / 2**30:.2f} GiB; the memory plan for this run (context {max(args.context)}, "
          f"{max(args.batch) + 1} slots, no margin) {planned / 2**30:.2f} GiB: {peak / planned - 1:+.1%}")


if __name__ == "__main__":          # `python -m moebox.bench.decode decode ...` (no server dependencies needed)
    import sys
    logging.basicConfig(level=logging.INFO, format="%(asctime)s moebox %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="moebox bench")
    configure(parser)
    sys.exit(run(parser.parse_args()))
