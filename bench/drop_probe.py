"""What each part of a decode step costs on its critical path: the step timed with that part skipped.

A kernel's own time (the profiler, ncu) does not say what removing or speeding it up would gain: at batch 1 the
step is a chain of dependent launches with side streams beside it, and PDL overlaps each launch with the one
before. This writes a copy of the tree with hooks: `MOEBOX_DROP=part[,part]` makes each named part return what
its first call returned (cached per layer and batch size, so the eager step before the graph capture fills the
cache and the captured step launches nothing for it). The step time without the part, against the default, is
what the part costs where it sits. The outputs are then wrong (the hidden states differ), which does not matter
for the time at batch 1: every token routes to k experts whatever its values. At larger batches the number of
distinct experts changes with the hidden states, and so does the step's work: read those rows with the bench's
"weights GB" beside them.

    python -m bench.drop_probe .probe/drop        # on the CPU box (the device has no .git), then carry .probe:
    BASE_DIR=.probe/drop AB_BATCH=1 ORDER="base base:MOEBOX_DROP=experts base:MOEBOX_DROP=wo base" \\
        bash bench/gpu_session.sh versions
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Sequence

HOOK = '''"""Probe only (bench/drop_probe.py): MOEBOX_DROP=a,b skips those parts of a decode step."""
import os

DROP = set(filter(None, os.environ.get("MOEBOX_DROP", "").split(",")))
SITE = [""]     # the mHC site the block runs now: "attn" or "ffn" (the mixffn part's patch sets it)
_cache = {}


def cached(name, key, fn):
    """fn() unless `name` is dropped; then what its first call with this key returned."""
    if name not in DROP:
        return fn()
    if (name,) + key not in _cache:
        _cache[(name,) + key] = fn()
    return _cache[(name,) + key]


def mix_part():
    """The part that drops kernel B's x launch at the site running now: mixx (every site), else mixffn or
    mixattn by the site marker. The cache must be keyed by a dropped part, or every call launches its fn."""
    return "mixx" if "mixx" in DROP else "mix" + SITE[0]
'''

def _wrap(file: str, lhs: str, expr: str, part: str, key: str) -> tuple[str, str, str]:
    """The hook of a statement `lhs expr` (lhs: its indent and target): expr through cached(part, key, ...)."""
    return file, lhs + expr, f'{lhs}cached("{part}", {key}, lambda: {expr})'


LAYER_KEY = "(id(self), x.shape[0])"
ATTN_KEY = "(id(self), n)"

# part -> [(file, text, replacement)]: each text must occur exactly once in the tree; a patched file imports
# DROP and cached (IMPORT, after its `from __future__` line)
PATCHES: dict[str, list[tuple[str, str, str]]] = {
    "qrope": [("moebox/ops/rope.py", """    if _kernel_takes(q, qi):
        from moebox.ops.triton.rope import query_rope_triton""", """    if "qrope" in DROP and q.is_cuda:
        return q, qi
    if _kernel_takes(q, qi):
        from moebox.ops.triton.rope import query_rope_triton""")],
    "router": [_wrap("moebox/model/moe.py", "        idx, w = ", "self.route(x, tokens)", "router", LAYER_KEY)],
    "experts": [_wrap("moebox/model/moe.py", "        out = ", "self.routed(x, tokens)", "experts", LAYER_KEY),
                _wrap("moebox/model/moe.py", "            return ", "self.routed(x, tokens)", "experts", LAYER_KEY)],
    "shared": [_wrap("moebox/model/moe.py", "            shared = ", "self.shared_expert(x)", "shared", LAYER_KEY)],
    "attn": [_wrap("moebox/model/attention.py", "            out = ",
                   "self._attend_decode(batch, q, idx, stored, cache, raw)", "attn", ATTN_KEY)],
    "wqa": [_wrap("moebox/model/attention.py", "        q_a, kv = ", "self.from_x(x)", "wqa", ATTN_KEY)],
    "wqb": [_wrap("moebox/model/attention.py", "        q, *index_q = ",
                  "self.from_qr(q_a, norm=(self.q_norm, cfg.rms_norm_eps))", "wqb", ATTN_KEY)],
    "wo": [("moebox/model/attention.py", """        o = grouped_linear(out.reshape(n, cfg.o_groups, -1), self.wo_a, cfg.o_groups)   # [N, g, o_lora_rank]
        return linear(o.flatten(1), self.wo_b)""", """        return cached("wo", (id(self), n), lambda: linear(grouped_linear(
            out.reshape(n, cfg.o_groups, -1), self.wo_a, cfg.o_groups).flatten(1), self.wo_b))""")],
    # mHC's hc_pre at each site (its coefficients' side stream off with it) and hc_post
    "mix": [("moebox/model/block.py", """        coeffs = Branch(X, "mhc", enabled=decode, purpose="mhc")
        x, post, comb = hc_pre(X, *hc, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
                               coeffs_branch=coeffs if coeffs.on else None, norm=norm, partials=partials)""",
             """        coeffs = Branch(X, "mhc", enabled=decode and "mix" not in DROP, purpose="mhc")
        x, post, comb = cached("mix", (id(self), id(hc), X.shape[0]), lambda: hc_pre(
            X, *hc, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps,
            coeffs_branch=coeffs if coeffs.on else None, norm=norm, partials=partials))""")],
    # kernel B's x programs alone (the main stream's launch of hc_pre; the coefficients' side launch stays): x
    # is then a cached random tensor of the site's shape; mixffn: at the FFN sites only
    "mixx": [("moebox/ops/triton/mhc.py", """        _mix(X, ws, m, base, scale, x, None, None, cfg, iters, eps, norm_eps, **mix)
        with coeffs_branch:""", """        if mix_part() in DROP and X.is_cuda:
            x = cached(mix_part(), (n, hidden), lambda: torch.randn_like(x))
        else:
            _mix(X, ws, m, base, scale, x, None, None, cfg, iters, eps, norm_eps, **mix)
        with coeffs_branch:""")],
    # kernel B's x launch at one site kind: the mixx hook above, by the site marker this patch sets
    "mixffn": [("moebox/model/block.py", """        cfg = self.cfg
""", """        cfg = self.cfg
        SITE[0] = "ffn" if hc is self.hc_ffn else "attn"
""")],
    "mixattn": [],
    "post": [_wrap("moebox/model/block.py", "        return ",
                   "hc_post_chain(out, X, post, comb, addend=addend, next_fn=next_fn if decode else None)", "post",
                   "(id(self), id(hc), X.shape[0])")],
    "head": [("moebox/model/deepseek_v4.py", """        y = hc_head(X, *self.hc, eps=self.cfg.hc_eps, norm_eps=self.cfg.rms_norm_eps)
        return logits_linear(rms_norm(y, self.norm, self.cfg.rms_norm_eps), self.head)""", """        return cached("head", (id(self), X.shape[0]), lambda: logits_linear(rms_norm(
            hc_head(X, *self.hc, eps=self.cfg.hc_eps, norm_eps=self.cfg.rms_norm_eps), self.norm,
            self.cfg.rms_norm_eps), self.head))""")],
}


IMPORT = "from moebox.drop import DROP, SITE, cached, mix_part  # noqa: F401 - the probe's hooks\n"


def build(dest: Path, source: Path | None = None) -> Path:
    """Write the tree of `source`'s HEAD (the repository this file is in by default) to dest with the hooks of
    every part; dest is replaced. Raises ValueError naming the part whose text the tree no longer has."""
    source = source or Path(__file__).resolve().parent.parent
    tar = subprocess.run(["git", "-C", str(source), "archive", "HEAD", "moebox", "bench", "pyproject.toml"],
                         capture_output=True, check=True).stdout
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    shutil.rmtree(dest / "moebox" / "demo_model", ignore_errors=True)   # the bench builds its own weights
    (dest / "moebox" / "drop.py").write_text(HOOK)
    future = "from __future__ import annotations\n"
    for part, edits in PATCHES.items():
        for file, text, replacement in edits:
            path = dest / file
            src = path.read_text()
            if src.count(text) != 1 or future not in src:
                raise ValueError(f"drop part {part!r}: {file} no longer has the text its hook replaces "
                                 f"({src.count(text)} matches) or its __future__ import; update bench/drop_probe.py")
            if IMPORT not in src:
                src = src.replace(future, future + IMPORT, 1)
            path.write_text(src.replace(text, replacement))
    return dest


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dest", type=Path, help="the folder to write the hooked tree to (replaced)")
    args = p.parse_args(argv)
    print(f"wrote {build(args.dest)}; parts: {', '.join(PATCHES)}")


if __name__ == "__main__":
    main()
