"""Programmatic dependent launch (on by default, MOEBOX_PDL=0 turns it off): a kernel launched early must wait
for its predecessor before it reads anything that kernel may write, or it races with it. Only constant inputs
(weights, and the decode experts' ids, which the routing wrote two launches earlier) may be read before the
wait. Checked on the sources of every kernel, and in the sm_90 build of one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from moebox.ops.triton.runtime import HAVE_TRITON, pdl_enabled

KERNEL_DIR = Path(__file__).resolve().parents[1] / "moebox" / "ops" / "triton"


def _kernels() -> dict[str, ast.FunctionDef]:
    out = {}
    for path in sorted(KERNEL_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                out[f"{path.name}:{node.name}"] = node
    return out


def _launches() -> list[tuple[str, ast.Call]]:
    """`kernel[grid](...)` calls."""
    out = []
    for path in sorted(KERNEL_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                out.append((f"{path.name}:{ast.unparse(node.func.value)}", node))
    return out


# The pointer arguments a kernel reads before its PDL wait: weights only (their loads overlap the kernel before:
# the matrices, mHC's next fn slice, the router's gate rows).
# The routed experts' down kernels also read the expert ids: the routing wrote them before gate-up, the kernel
# between, could start.
# The decode attention kernel reads q with `query_early`: in CSA layers the indexer's two kernels run after q's
# product, before it.
READ_BEFORE_WAIT = {
    "decode_attention.py:_attend_kernel": {"q_ptr", "qpos_ptr", "qinv_ptr"},
    "decode_attention.py:_combine_kernel": {"sink_ptr", "pos_ptr", "inv_ptr"},
    "fp8_linear.py:_fp8_gemv_kernel": {"w_ptr", "s_ptr"},
    "fp8_mma.py:_fp8_mma_kernel": {"w_ptr", "s_ptr"},
    "mhc.py:_mix_kernel": {"base_ptr", "scale_ptr", "norm_ptr"},
    "mhc.py:_post_kernel": {"fn_ptr"},
    "route.py:_route_kernel": {"bias_ptr"},
    "route.py:_router_route_kernel": {"g_ptr", "bias_ptr"},
    "w2_moe.py:_down_mma_kernel": {"w2c_ptr", "w2s_ptr", "ids_ptr"},
    "w2_fp8_down.py:_fp8_down_kernel": {"w2c_ptr", "w2s_ptr", "ids_ptr"},
}


def _read_before_wait(fn: ast.FunctionDef, helpers: set[str]) -> set[str]:
    """The pointer arguments (`*_ptr`) that fn's loads and helper calls (which may load) reach before its
    top-level `pdl_start(PDL)`, following the assignments before it."""
    body = [n for n in fn.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    wait = next(i for i, n in enumerate(body) if ast.unparse(n) == "pdl_start(PDL)")
    deps: dict[str, set[str]] = {a.arg: {a.arg} for a in fn.args.args}

    def reach(node: ast.AST) -> set[str]:
        return set().union(*(deps.get(n.id, set()) for n in ast.walk(node) if isinstance(n, ast.Name)))

    read: set[str] = set()
    for stmt in body[:wait]:
        for node in ast.walk(stmt):   # assignments (in nested ifs too) in source order
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for name in (n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                    deps[name] = reach(node.value) | (deps.get(name, set()) if isinstance(node, ast.AugAssign)
                                                      else set())
            if isinstance(node, ast.Call) and ast.unparse(node.func) in helpers | {"tl.load", "gl.load"}:
                read |= set().union(*(reach(a) for a in [*node.args, *(k.value for k in node.keywords)]))
    return {a for a in read if a.endswith("_ptr")}


def test_every_launched_kernel_waits_for_its_predecessor_before_reading_its_output():
    kernels = _kernels()
    helpers = {name.split(":")[1] for name in kernels}
    launched = {name for name, _ in _launches()}
    assert len(launched) >= 14
    assert set(READ_BEFORE_WAIT) <= launched
    for name in launched:
        fn = kernels[name]
        assert "PDL" in [a.arg for a in fn.args.args], f"{name} takes no PDL flag"
        assert "pdl_start(PDL)" in [ast.unparse(n) for n in fn.body], f"{name} never calls pdl_start(PDL)"
        early = _read_before_wait(fn, helpers)
        assert early <= READ_BEFORE_WAIT.get(name, set()), f"{name} reads {early} before its PDL wait"
        assert early == READ_BEFORE_WAIT.get(name, set()), f"{name}: READ_BEFORE_WAIT is stale ({early})"
    for name, call in _launches():
        spread = [k.value for k in call.keywords if k.arg is None]
        pdl = [v for v in spread if isinstance(v, ast.Call) and ast.unparse(v.func) == "pdl_args"]
        assert len(pdl) == 1, f"{name}: launched without **pdl_args(...) (its PDL flag and launch option)"
        assert ast.unparse(pdl[0].args[1]) == ast.unparse(call.func.value), \
            f"{name}: pdl_args names another kernel (MOEBOX_PDL_HOLD would hold the wrong one)"


def test_pdl_hold_names_kernels(monkeypatch):
    """MOEBOX_PDL_HOLD holds the dependents of the kernels it names, by their Python names, and no others."""
    from moebox.ops.triton import decode_attention, fp8_linear
    from moebox.ops.triton.runtime import pdl_held
    monkeypatch.delenv("MOEBOX_PDL_HOLD", raising=False)
    assert not pdl_held(fp8_linear._fp8_gemv_kernel)
    monkeypatch.setenv("MOEBOX_PDL_HOLD", "_attend_kernel,_fp8_gemv_kernel")
    assert pdl_held(fp8_linear._fp8_gemv_kernel) and pdl_held(decode_attention._attend_kernel)
    assert not pdl_held(fp8_linear._fp8_linear_kernel) and not pdl_held(decode_attention._combine_kernel)


def test_early_loads_up_to_two_tokens_unless_switched(monkeypatch):
    from moebox.ops.triton.runtime import early_loads
    monkeypatch.delenv("MOEBOX_EARLY_LOADS_MAX_N", raising=False)
    assert early_loads(1) and early_loads(2) and not early_loads(3)
    monkeypatch.setenv("MOEBOX_EARLY_LOADS_MAX_N", "0")
    assert not early_loads(1)
    monkeypatch.setenv("MOEBOX_EARLY_LOADS_MAX_N", "all")
    with pytest.raises(ValueError, match="MOEBOX_EARLY_LOADS_MAX_N"):
        early_loads(1)


def test_pdl_is_on_unless_switched_off_and_never_for_cpu_tensors(monkeypatch):
    from moebox.ops.triton.runtime import pdl_switched_on
    monkeypatch.delenv("MOEBOX_PDL", raising=False)
    assert pdl_switched_on()
    assert not pdl_enabled(torch.zeros(1))          # CPU tensors: never
    monkeypatch.setenv("MOEBOX_PDL", "0")
    assert not pdl_switched_on()


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_the_hopper_build_waits_before_its_first_load():
    """mHC's post kernel built for sm_90 (no GPU needed): with PDL the PTX waits on the grid dependency before its
    first global load and then lets dependents launch; with `PDL_HOLD` it waits and never lets them launch early
    (they launch at its end); without PDL neither instruction is there."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moebox.ops.triton import mhc
    from moebox.ops.triton.runtime import PDL_HOLD, triton

    fn = mhc._post_kernel
    ptrs = ("o_ptr", "a_ptr", "X_ptr", "post_ptr", "comb_ptr", "y_ptr", "fn_ptr", "ws_ptr")
    for pdl in (True, PDL_HOLD, False):
        const = dict(HC=4, HC_PAD=4, M=24, M_PAD=32, W_PAD=64, BLOCK_H=1024, POST=True, ADD=False, PARTIALS=False,
                     EARLY=True, PDL=pdl)
        sig = {a: "*bf16" if a in ("o_ptr", "a_ptr", "X_ptr", "y_ptr") else "*fp32" if a in ptrs else
               "constexpr" if a in const else "i32" for a in fn.arg_names}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in const.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        first_load = re.search(r"\bld\.global", ptx).start()
        if pdl is True:
            assert 0 <= wait < launch < first_load
        elif pdl == PDL_HOLD:
            assert 0 <= wait < first_load and launch < 0
        else:
            assert wait < 0 and launch < 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_dependent_chain_in_a_cuda_graph_gives_the_same_bits_with_pdl(monkeypatch):
    """30 mHC sites, each reading what the one before wrote (pre, post, pre, ...), captured in a CUDA graph:
    with PDL every kernel starts early and must still see its predecessor's output, so the bits equal the run
    without PDL and the eager run; so do they with the mHC kernels' dependents held (MOEBOX_PDL_HOLD)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs Hopper or newer")
    from moebox.ops.cuda_graphs import capture
    from moebox.ops.triton.mhc import _mix_kernel, hc_post_triton, hc_pre_triton, random_site
    from moebox.ops.triton.runtime import PDL_HOLD, pdl_args

    X0, fn, base, scale = random_site(4)
    kw = dict(iters=20, eps=1e-6, norm_eps=1e-6)

    def chain() -> torch.Tensor:
        X = X0
        for _ in range(30):
            x, post, comb = hc_pre_triton(X, fn, base, scale, **kw)
            X = hc_post_triton(torch.tanh(x), X, post, comb)   # a torch kernel in between, as in the model
        return X

    results = {}
    for pdl, held in (("0", ""), ("1", ""), ("1", "_mix_kernel,_post_kernel")):
        monkeypatch.setenv("MOEBOX_PDL", pdl)
        monkeypatch.setenv("MOEBOX_PDL_HOLD", held)
        assert pdl_args(X0, _mix_kernel)["PDL"] == (PDL_HOLD if held else pdl == "1")
        eager = chain()
        graph, out = capture(chain)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), (pdl, held)
        results[pdl, held] = out.clone()
    assert all(torch.equal(results["0", ""], out) for out in results.values())
