"""Triton, when it can be imported: off Linux or without it the torch references run instead."""

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAVE_TRITON = False

import functools
import inspect
import logging
import os
import subprocess
import tempfile
from typing import Any, Callable, Sequence, TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger("moebox")
_failed: dict[str, str] = {}          # kernel name -> why it was given up in this process


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    """A CUDA device's properties, read once: kernel launches ask for them on every call."""
    return torch.cuda.get_device_properties(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the grid sizing unit); 132, an H200's count, for the
    interpreter's CPU tensors."""
    if device.type != "cuda":
        return 132
    return _properties(_index(device)).multi_processor_count


def compute_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's (major, minor), from its properties read once."""
    props = _properties(_index(device))
    return props.major, props.minor


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_switched_on() -> bool:
    """Programmatic dependent launch, unless MOEBOX_PDL=0. On by default since the seventh session's decode
    benches on the H200, with inductor's kernels also launched so: batch 1 9.15 -> 8.94 ms and 9.23 -> 9.08 ms
    in two runs; batch 16 32.77 -> 30.50 ms in one and 30.38 -> 30.69 ms in the other (docs/benchmarks.md).
    A small gain at batch 1, none shown at batch 16."""
    return os.environ.get("MOEBOX_PDL", "1") != "0"


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with programmatic dependent launch (Hopper+, see `pdl_switched_on`).

    A decode step is a chain of ~2 000 small dependent kernels, each a few microseconds (docs/benchmarks.md,
    sixth session). With PDL a kernel lets the next one launch as soon as all its programs have started, and
    the next one's programs wait in `pdl_start` until it has finished and its writes are visible: the launch
    and scheduling of a kernel overlap its predecessor."""
    return HAVE_TRITON and t.is_cuda and pdl_switched_on() and _properties(_index(t.device)).major >= 9


PDL_HOLD = 2     # a kernel's PDL flag when it waits for the kernel before but lets the one after launch only at its end


def pdl_held(kernel: Any) -> bool:
    """Whether MOEBOX_PDL_HOLD (a comma list of kernel names, e.g. `_attend_kernel,_fp8_gemv_kernel`) names
    `kernel` (a Triton kernel): a probe switch, to find the kernels whose dependents, launched at their start,
    slow them or the chain after them (as the rotating combine's did: docs/benchmarks.md, twenty-second session).
    Read as the launch is made, so a CUDA graph keeps the value it was captured with."""
    return getattr(kernel, "fn", kernel).__name__ in os.environ.get("MOEBOX_PDL_HOLD", "").split(",")


def opt_in(switch: str) -> bool:
    """Whether the environment turns on a path that is off by default: `switch` (e.g. MOEBOX_TILED_CODES) is 1."""
    return os.environ.get(switch, "0") == "1"


def default_hold(when: bool, switch: str) -> bool:
    """A hold that measurements made a kernel's default (`pdl_args`' `hold`): `when`, unless the environment sets
    `switch` (e.g. MOEBOX_GEMV_HOLD) to 0, which lets the dependent launch at the kernel's start again."""
    return when and os.environ.get(switch) != "0"


EARLY_LOADS_MAX_N = 2


def early_loads(tokens: int) -> bool:
    """Whether mHC's chain post kernel and the fused router load their weights (the next site's fn slice, the
    gate rows) before their PDL wait at this many tokens: up to EARLY_LOADS_MAX_N, or the bound that
    MOEBOX_EARLY_LOADS_MAX_N sets (0: never). On the H200 (twenty-sixth session, docs/benchmarks.md) the early
    loads went with batch 1 5.00-5.04 -> 4.91 ms and batch 2 6.34 -> 6.24 (with the rank top-k), and with batch 8
    11.61-11.65 -> 11.69-11.82, where nothing else had changed: past 2 tokens the loads come after the wait, as
    they did before."""
    return tokens <= env_count("MOEBOX_EARLY_LOADS_MAX_N", EARLY_LOADS_MAX_N, "a token count (0: never)")


def env_count(name: str, default: int, must: str, least: int | None = None) -> int:
    """The count an environment switch sets (a bound on the batch a path takes, a tile count, ...), else
    `default`; not an integer, or below `least`: a ValueError saying the variable `must` be so."""
    value = os.environ.get(name, str(default))
    try:
        count = int(value)
    except ValueError:
        count = None
    if count is None or (least is not None and count < least):
        raise ValueError(f"{name} must be {must}, got {value!r}")
    return count


def pdl_args(t: torch.Tensor, kernel: Any, hold: bool = False) -> dict[str, bool | int]:
    """The keywords of a launch of `kernel` on t's device: its `PDL` flag (see `pdl_start`; `PDL_HOLD` with
    `hold` or where `pdl_held`) and, when on, Triton's `launch_pdl` (the interpreter takes no such keyword)."""
    if not pdl_enabled(t):
        return {"PDL": False}
    return {"PDL": PDL_HOLD if hold or pdl_held(kernel) else True, "launch_pdl": True}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(v: int) -> int:
    """The smallest power of two >= v (1 for v <= 1)."""
    return 1 << max(0, v - 1).bit_length()


def plain_tensor(t: object, dims: int) -> bool:
    """A torch tensor of `dims` dimensions (not, e.g., one of the FP8 cache's row objects)."""
    return isinstance(t, torch.Tensor) and t.dim() == dims


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def kernel_switched_on(t: torch.Tensor, switch: str, default: bool = True) -> bool:
    """Whether a model path may take its kernel: CUDA tensors (or the interpreter's CPU ones), unless the
    environment sets `switch` to 0 (a kernel that is off by default: when it sets `switch` to anything else)."""
    value = os.environ.get(switch)
    return (t.is_cuda or interpreting()) and (default if value is None else value != "0")


def decode_kernel_takes(x: torch.Tensor, switch: str, max_rows: int, *params: torch.Tensor | None) -> bool:
    """Whether a decode-size CUDA input takes a kernel that stands in for a torch function: x on CUDA with at
    most `max_rows` rows (over its last dim), outside torch.compile tracing (checked first: there the row count
    may be symbolic) and outside autograd (x or a param requiring grad: the kernels have no backward), triton
    present and `switch` not 0."""
    if torch.compiler.is_compiling() or not x.is_cuda or x.numel() > max_rows * x.shape[-1]:
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *params)):
        return False
    return HAVE_TRITON and kernel_switched_on(x, switch)


def versions() -> str:
    """The line a kernel bench prints first: torch, triton and the device it runs on."""
    return (f"torch {torch.__version__}, triton {triton.__version__ if HAVE_TRITON else None}, "
            f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}")


def bench_start() -> None:
    """A kernel bench's first step: print `versions()`; exit with a message without triton or a CUDA device."""
    print(versions(), flush=True)
    if not (HAVE_TRITON and torch.cuda.is_available()):
        raise SystemExit("the bench needs triton and a CUDA device")


def each_copy(fn: Callable[[int], object], copies: int) -> list[Callable[[], object]]:
    """fn(0), ..., fn(copies - 1) as calls for `graph_us` (each call on its own copy of the inputs)."""
    return [functools.partial(fn, i) for i in range(copies)]


def graph_us(calls: Sequence[Callable[[], object]], rep: int = 100) -> float:
    """Per-call time (us) of `calls` captured back to back in one CUDA graph, replayed (triton's do_bench:
    the L2 cache flushed before each replay)."""
    from moebox.ops.cuda_graphs import capture
    graph, _ = capture(lambda: [c() for c in calls])
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=rep)
    del graph
    return ms * 1e3 / len(calls)


def cubin_dump(cubin: bytes) -> tuple[str, str]:
    """(SASS, resource usage) of a compiled kernel, by the cuobjdump that ships with Triton (no GPU needed):
    what the kernels' `--sass` reports read registers, spills and instruction counts from."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass, usage = (subprocess.run([os.path.join(tools, "cuobjdump"), flag, f.name], capture_output=True,
                                      text=True, check=True).stdout
                       for flag in ("--dump-sass", "--dump-resource-usage"))
    return sass, usage


def build_sm90(fn, sig: dict[str, str], const: dict[str, object], aligned: Sequence[str], **options):
    """Compile a Triton kernel for sm_90 on any machine with Triton's NVIDIA backend (no GPU needed), specialised
    as a launch would be: `sig` the types of its runtime arguments by name, `const` its constexprs, the
    arguments named in `aligned` marked divisible by 16 (pointers, and integers a launch finds so); `options` as
    triton.compile takes them (num_warps, num_stages, ...); constexprs left out take their defaults, as at a launch;
    a Gluon kernel builds from its own source class. What the kernels' `sass_report`s build."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    names = fn.arg_names
    const = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
             **const}
    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in const}},
                    constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def packed_asm_layout(ttgir: str) -> dict[str, list[int]]:
    """The blocked layout (sizePerThread, threadsPerWarp, warpsPerCTA, order) Triton gave the result of a build's
    8-element-packed inline asm (`tl.inline_asm_elementwise(..., pack=8)`): the lane map an mma asm relies on."""
    import re
    enc = re.search(r"tt\.elementwise_inline_asm[^\n]*packed_element = 8[^\n]*-> tensor<[^,]*, (#\w+)>", ttgir)
    if enc is None:
        raise ValueError("no 8-element-packed inline asm in the build")
    line = re.search(rf"^{enc.group(1)} = (.*)$", ttgir, re.M).group(1)
    return {key: [int(v) for v in re.search(rf"{key} = \[([^\]]*)\]", line).group(1).split(",")]
            for key in ("sizePerThread", "threadsPerWarp", "warpsPerCTA", "order")}


def loop_sass(cubin: bytes, around: str | None = None, first: bool = False) -> tuple[dict[str, int], int, int, bool]:
    """(op counts of the longest loop's body, registers, spill stack bytes, whether there is a loop) of a compiled
    kernel's SASS: what the `--sass` reports compare between tilings on a machine without a GPU. The loop is the
    longest span closed by a backward branch (the whole kernel when there is none); with `around` (an opcode),
    the shortest one that holds every instruction of that opcode (where a wait's retry loop spans the kernel), or
    with `first` its first instruction (an unrolled outer loop: the first of its inner loops)."""
    import collections
    import re
    sass, usage = cubin_dump(cubin)
    line = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?"   # address, optional predicate
    ins = [(int(a, 16), op) for a, op in re.findall(line + r"([A-Z][\w.]*)", sass)]
    back = [(int(t, 16), int(a, 16)) for a, t in re.findall(line + r"BRA[^;]*?0x([0-9a-f]+)", sass)
            if int(t, 16) < int(a, 16)]
    if around:
        at = [a for a, op in ins if op.split(".")[0] == around][:1 if first else None]
        back = [b for b in back if b[0] <= at[0] and at[-1] <= b[1]]
    pick = min if around else max
    lo, hi = pick(back, key=lambda b: b[1] - b[0]) if back else (0, ins[-1][0])
    ops = collections.Counter(op.split(".")[0] for a, op in ins if lo <= a <= hi)
    return (dict(ops.most_common()), int(re.search(r"REG:(\d+)", usage).group(1)),
            int(re.search(r"STACK:(\d+)", usage).group(1)), bool(back))


def kernel_or_fallback(name: str, switch: str, kernel: Callable[[], T], fallback: Callable[[], T]) -> T:
    """`kernel()` for a model path that has a torch equivalent `fallback()`: a kernel that fails to build or
    launch on a CUDA device (another Triton version, a GPU it was not built for) is reported once and the torch
    path serves from then on, so the engine keeps running. Under the interpreter (the tests) and inside a CUDA
    graph capture the error propagates. Launch errors come before the kernel runs: nothing is half written."""
    if name in _failed:
        return fallback()
    try:
        return kernel()
    except Exception as e:  # noqa: BLE001 - any build/launch error; reported below
        if interpreting() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            raise
        _failed[name] = f"{type(e).__name__}: {e}"
        log.warning("the %s kernel failed (%s); using the torch path from now on (%s=0 skips the kernel)",
                    name, _failed[name][:500], switch)
        return fallback()


if HAVE_TRITON:
    try:
        from triton.language.extra import libdevice
    except ImportError:  # pragma: no cover - older triton
        libdevice = None

    # exp, cos and sin as kernels that must match torch's fp32 results take them: PRECISE (CUDA) libdevice's, with
    # full range reduction; else tl's (the interpreter: numpy's, as accurate)
    @triton.jit
    def device_exp(x, PRECISE: tl.constexpr):
        if PRECISE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def device_cos(x, PRECISE: tl.constexpr):
        if PRECISE:
            return libdevice.cos(x)
        else:
            return tl.cos(x)

    @triton.jit
    def device_sin(x, PRECISE: tl.constexpr):
        if PRECISE:
            return libdevice.sin(x)
        else:
            return tl.sin(x)

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """With PDL, wait until the kernel before has finished (its writes visible), then let the kernel after
        launch. A kernel's first statement, or the first after loads of constant inputs (weights), which may
        overlap the kernel before: tests/test_triton_pdl.py lists the kernels that do (READ_BEFORE_WAIT). With
        PDL == 2 (`PDL_HOLD`) the kernel after launches only when this one has ended."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            if PDL != 2:
                tl.extra.cuda.gdc_launch_dependents()
else:
    pdl_start = device_exp = device_cos = device_sin = None


__all__ = ["HAVE_TRITON", "kernel_or_fallback", "kernel_switched_on", "opt_in", "decode_kernel_takes", "triton",
           "tl", "num_sms", "interpreting", "env_count", "early_loads", "versions", "bench_start", "graph_us",
           "build_sm90", "cubin_dump",
           "packed_asm_layout", "loop_sass", "cdiv", "next_pow2", "plain_tensor", "rel_err", "pdl_switched_on",
           "pdl_enabled", "pdl_args", "pdl_held", "default_hold", "pdl_start", "PDL_HOLD", "device_exp",
           "device_cos", "device_sin"]

