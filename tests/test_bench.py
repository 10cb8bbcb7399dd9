"""`moebox bench` through the real CLI on the tiny preset (CPU): the command runs, measures every requested
row and counts the bytes a step reads from the model's own weights and routing."""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from moebox.bench.decode import _step_batch, distinct_experts, expert_bytes, resident_bytes
from moebox.bench.synthetic import synthetic_weights
from moebox.config import parse_config
from moebox.model.deepseek_v4 import DeepseekV4
from moebox.ops.triton.runtime import HAVE_TRITON
from moebox.weights.synth import preset_config
from tests.interpreter import ROOT


def _run(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "moebox.cli", "bench", *args, "--preset", "tiny", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| context") and not line.startswith("| prompt")]


def test_bench_decode_cli_reports_each_row(tmp_path):
    timeline = tmp_path / "timeline.tsv"
    out = _run("decode", "--batch", "1", "3", "--context", "40", "90", "--steps", "2", "--verify", "2",
               "--kernels", "4", "--timeline", str(timeline))
    decode, _, rest = out.partition("speculative verify steps")
    verify, _, kernels = rest.partition("CPU ops of a decode step, batch 1, context 40")
    rows = _table_rows(decode)
    assert [(r[0], r[1]) for r in rows] == [("40", "1"), ("40", "3"), ("90", "1"), ("90", "3")]
    for r in rows:
        assert float(r[4]) > 0 and float(r[5]) > 0          # step ms, tok/s
    vrows = [r for r in _table_rows(verify) if r[0] != "batch"]
    assert [(r[0], r[1]) for r in vrows] == [("1", "2"), ("3", "2")]
    for r in vrows:
        assert float(r[2]) > 0 and float(r[3]) > 0 and float(r[4]) > 0
    krows = [r for r in _table_rows(kernels) if r[0] != "op"]       # the costliest 4, costliest first
    assert len(krows) == 4 and all(r[0].startswith("aten::") and float(r[1]) > 0 for r in krows)
    us = [float(r[2]) for r in krows]
    shares = [float(r[3].rstrip("%")) for r in krows]
    assert us == sorted(us, reverse=True) and shares == sorted(shares, reverse=True) and sum(shares) <= 100.05
    # one step's ops in launch order, each with its duration and the idle time before it
    header, *lines = timeline.read_text().splitlines()
    assert header.split("\t") == ["start_us", "dur_us", "idle_us", "stream", "name"]
    assert f"{len(lines)} rows in {timeline}" in out
    starts = [float(line.split("\t")[0]) for line in lines]
    assert len(lines) > 50 and starts[0] == 0 and starts == sorted(starts)
    assert any("linear" in line or "mm" in line for line in lines)
    assert all(float(line.split("\t")[1]) >= 0 and float(line.split("\t")[2]) >= 0 for line in lines)
    assert all(line.split("\t")[3].lstrip("-").isdigit() for line in lines)


def test_bench_tiled_codes_is_refused_on_the_cpu():
    """--tiled-codes prices the CUDA kernels that read that order; on the CPU it is refused before any work, with
    the flag named."""
    out = subprocess.run([sys.executable, "-m", "moebox.cli", "bench", "decode", "--preset", "tiny", "--device",
                          "cpu", "--tiled-codes"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--tiled-codes" in out.stderr and "--device cuda" in out.stderr, out.stderr
    assert "model:" not in out.stdout


def test_a_layer_with_codes_tile_by_tile_gives_the_same_output():
    """A layer whose buffer's codes were relaid tile by tile (`tile_layer_codes`, which its per-expert views share)
    gives the row-major layer's output: here through the reference (CPU), which reads row-major copies."""
    from moebox.ops.triton.w2_moe import tile_layer_codes
    cfg = parse_config(preset_config("small", 1))       # experts of 1024 x 512: two K tiles a row either way
    model = DeepseekV4(cfg, synthetic_weights(cfg, "cpu", progress=False).pop, qat=False, dtype=torch.float32,
                       load_mtp=False)
    moe = model.layers[0].ffn
    x, tokens = torch.randn(3, cfg.hidden_size), torch.tensor([1, 2, 3])
    want = moe.routed(x, tokens)
    codes = moe.experts[0][0].codes.clone()
    tile_layer_codes(moe.layer_planes, cfg.hidden_size, cfg.moe_intermediate_size)
    assert not torch.equal(moe.experts[0][0].codes, codes)     # the views see the new order
    moe.tiled_codes = True
    assert torch.equal(moe.routed(x, tokens), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_decode_on_codes_tile_by_tile_runs_each_batch():
    """The small preset's decode and prefill with every layer's codes relaid tile by tile: each row runs (the
    kernels' numbers against the reference are tests/test_triton_w2*.py's); the tiny preset's shapes are refused."""
    cmd = [sys.executable, "-m", "moebox.cli", "bench", "--device", "cuda", "--tiled-codes"]
    out = subprocess.run(cmd + ["decode", "--preset", "small", "--batch", "1", "3", "8", "--context", "64",
                                "--steps", "2", "--no-breakdown"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "codes tile by tile" in out.stdout
    assert [r[1] for r in _table_rows(out.stdout.partition("peak GPU memory")[0])] == ["1", "3", "8"]
    out = subprocess.run(cmd + ["prefill", "--preset", "small", "--prompt", "300"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and len(_table_rows(out.stdout)) == 1, out.stderr[-2000:]
    out = subprocess.run(cmd + ["decode", "--preset", "tiny"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "multiples of 256" in out.stderr, out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_decode_peak_memory_is_the_runs_not_the_copy_tests():
    """The peak GPU memory that the decode bench compares with the memory plan is the run's: the copy-bandwidth
    test before it allocates 4 GiB of buffers, far above what the tiny model's run needs."""
    out = subprocess.run([sys.executable, "-m", "moebox.cli", "bench", "decode", "--preset", "tiny", "--device",
                          "cuda", "--batch", "1", "2", "--context", "64", "--steps", "2", "--no-breakdown"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(li for li in out.stdout.splitlines() if li.startswith("peak GPU memory"))
    peak_gib = float(line.split()[3])
    assert 0 < peak_gib < 1, line


def test_bench_prefill_cli_reports_each_prompt():
    rows = _table_rows(_run("prefill", "--prompt", "50", "130", "--chunk", "64"))
    assert [r[0] for r in rows] == ["50", "130"]


def test_step_bytes_follow_the_routing():
    """Weight bytes of a step: the dense weights once plus one plane set per distinct (layer, expert) the step
    routed to; more sequences can only add experts."""
    cfg = parse_config(preset_config("tiny"))
    weights = synthetic_weights(cfg, "cpu", progress=False)
    model = DeepseekV4(cfg, weights.__getitem__, qat=False, dtype=torch.float32, load_mtp=False)
    cache = model.new_cache(8, 64, "cpu")
    hits = [distinct_experts(model, _step_batch(cfg, b, 30, "cpu"), cache) for b in (1, 8)]
    k = cfg.num_experts_per_tok
    assert hits[0] == cfg.num_layers * k                            # one token: k distinct experts per layer
    assert hits[0] < hits[1] <= cfg.num_layers * min(8 * k, cfg.n_routed_experts)
    assert expert_bytes(cfg) * 8 == 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2.25


def test_weight_bytes_count_each_plane_buffer_once():
    """The model line's weight bytes: the per-expert tensors are views of each layer's plane buffer, so they add
    nothing; every other tensor (FP8 data and scales included) counts once."""
    cfg = parse_config(preset_config("tiny"))
    weights = synthetic_weights(cfg, "cpu", progress=False)
    views = [n for n in weights if ".ffn.experts." in n and not n.endswith(".planes")]
    buffer = {n: weights[n.split(".ffn.experts.")[0] + ".ffn.experts.planes"].untyped_storage().data_ptr()
              for n in views}
    assert views and all(t.untyped_storage().data_ptr() == buffer[n]
                         for n in views for t in (weights[n].codes, weights[n].scales))
    own = [w for n, w in weights.items() if n not in views]
    expected = sum(w.data.nbytes + w.scale.nbytes if hasattr(w, "scale") else w.nbytes for w in own)
    planes = [w for n, w in weights.items() if n.endswith(".planes")]
    assert len(planes) == cfg.num_layers
    assert resident_bytes(weights) == expected
    assert resident_bytes(weights) < sum(w.nbytes for w in weights.values())   # the old double count


def test_bench_spec_cli_compares_mtp_with_plain_on_the_demo():
    """`moebox bench spec` on the shipped demo (greedy): one row per concurrency, a speedup that is the ratio of
    the two measured rates, and acceptance numbers that are rates."""
    out = _run("spec", "--concurrency", "1", "2", "--requests", "2", "--max-tokens", "8", "--mtp", "2")
    rows = [r for r in _table_rows(out) if r[0] != "concurrency"]
    assert [r[0] for r in rows] == ["1", "2"]
    for c, plain, mtp, plain_slot, mtp_slot, speedup, acceptance, per_step in rows:
        assert float(plain) > 0 and float(mtp) > 0
        # the printed rates are rounded to 0.1 and the speedup to 0.01: it lies in the ratio's rounding interval
        lo, hi = (float(mtp) - 0.05) / (float(plain) + 0.05), (float(mtp) + 0.05) / max(float(plain) - 0.05, 1e-9)
        assert lo - 0.005 <= float(speedup.rstrip("x")) <= hi + 0.005, (plain, mtp, speedup)
        assert 0 <= float(acceptance) <= 1 and 1 <= float(per_step) <= 3


def test_induction_probe_scores_both_runs_of_each_length(tiny_ckpt):
    """The probe's table on the tiny random model: one row per length, finite losses near the uniform
    log(vocab) for a model that has learnt nothing (random weights neither predict a run nor copy it)."""
    out = subprocess.run([sys.executable, "-m", "bench.induction_probe", str(tiny_ckpt), "--lengths", "4", "9",
                          "--trials", "2"], capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [r for r in _table_rows(out) if r[0].isdigit()]
    assert [r[0] for r in rows] == ["4", "9"]
    uniform = math.log(parse_config(json.loads((tiny_ckpt / "config.json").read_text())).vocab_size)
    for _, first, repeat in rows:
        assert 0.5 * uniform < float(first) < 2 * uniform and 0.5 * uniform < float(repeat) < 2 * uniform


def test_copy_learning_splits_each_row_into_runs_and_repeats():
    """A row is BOS then (run, same run) pairs, and the loss halves are read where they are: an oracle that knows
    every repeat (and guesses uniformly elsewhere) scores ~0 on the repeats and log(alphabet) on the first runs."""
    from bench.copy_learning import copy_rows, losses_by_half
    g = torch.Generator().manual_seed(0)
    rows = copy_rows(g, rows=3, run_len=5, alphabet=7, first_id=20, bos=0, pairs=4)
    assert rows.shape == (3, 1 + 2 * 5 * 4) and (rows[:, 0] == 0).all()
    pairs = rows[:, 1:].view(3, 4, 2, 5)
    assert torch.equal(pairs[:, :, 0], pairs[:, :, 1]) and ((pairs >= 20) & (pairs < 27)).all()

    def oracle(seqs: torch.Tensor) -> torch.Tensor:
        logits = torch.full((*seqs.shape, 32), -1e4)
        logits[..., 20:27] = 0.0                                          # uniform over the alphabet
        nxt = torch.cat([seqs[:, 1:], seqs[:, :1]], 1)
        second = torch.zeros_like(seqs, dtype=torch.bool)
        second[:, 1:] = (torch.arange(seqs.shape[1] - 1) // 5 % 2 == 1)    # tokens of each repeat
        known = torch.cat([second[:, 1:], second[:, :1]], 1)               # the next token is a repeat's
        logits[known] = logits[known].scatter(1, nxt[known][:, None], 1e4)
        return logits.flatten(0, 1)

    _, first, repeat = losses_by_half(oracle, rows, run_len=5)
    assert abs(first - math.log(7)) < 1e-4 and repeat < 1e-4


def test_timeline_waits_measure_the_gap_after_the_query_rope(tmp_path, capsys):
    """bench/timeline_waits.py on a hand-written timeline: a CSA layer whose query RoPE ends at 20 us and whose
    indexer scores start at 32 (wait 12), an HCA layer whose RoPE ends at 60 and attention starts at 61 (wait 1,
    with a side-stream kernel in between that does not count), and a RoPE with nothing after it."""
    from bench.timeline_waits import key_branch_waits, main
    rows = [("0", "5", "_fp8_gemv_kernel"), ("15", "5", "_query_rope_kernel"), ("18", "10", "_compress_kernel"),
            ("32", "3", "_index_scores_kernel"), ("36", "9", "_topk_kernel"), ("40", "15", "_attend_kernel"),
            ("57", "3", "_query_rope_kernel"), ("59", "4", "triton_poi_fused_index_put"), ("61", "8", "_attend_kernel"),
            ("80", "2", "_query_rope_kernel")]
    waits = key_branch_waits([dict(start_us=a, dur_us=b, name=c) for a, b, c in rows])
    assert waits.csa == [12.0] and waits.other == [1.0]
    path = tmp_path / "t.tsv"
    path.write_text("start_us\tdur_us\tidle_us\tstream\tname\n" + "".join(f"{a}\t{b}\t0\t7\t{c}\n" for a, b, c in rows))
    main([str(path)])
    assert "CSA 1 layers, 12.0 us each; others 1 layers, 1.0 us each; 13 us" in capsys.readouterr().out


def test_timeline_output_spans_follow_the_combine_on_its_stream():
    """From each attention combine's start to the end of the second FP8 product after it on its own stream: the
    other stream's product and a combine with one product after it do not count."""
    from bench.timeline_waits import output_spans
    rows = [("10", "4", "1", "_combine_kernel"), ("12", "3", "2", "_fp8_gemv_kernel"),
            ("13", "5", "1", "_fp8_gemv_kernel"), ("15", "2", "1", "_inverse_rope_kernel"),
            ("19", "6", "1", "_fp8_gemv_kernel"), ("40", "4", "1", "_combine_kernel"),
            ("45", "5", "1", "_fp8_gemv_kernel")]
    assert output_spans([dict(start_us=a, dur_us=b, stream=c, name=d) for a, b, c, d in rows]) == [15.0]


def test_timeline_kernels_sum_each_kernel_per_file(tmp_path, capsys):
    """bench/timeline_kernels.py on two hand-written timelines: launches and busy us per kernel name (arguments
    cut), ordered by a kernel's largest time in either file, a kernel missing from a file shown as `-`."""
    from bench.timeline_kernels import main
    header = "start_us\tdur_us\tidle_us\tstream\tname\n"
    a, b = tmp_path / "a.tsv", tmp_path / "b.tsv"
    a.write_text(header + "0\t5\t0\t7\t_fp8_gemv_kernel\n6\t2.5\t1\t7\tvoid gather<16, long>(char*, long)\n"
                 "9\t4\t0.5\t7\t_fp8_gemv_kernel\n")
    b.write_text(header + "0\t7\t0\t7\t_fp8_mma_kernel\n8\t3\t1\t7\t_fp8_gemv_kernel\n")
    main([str(a), str(b), "--top", "5"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0].lstrip("| ") for r in rows] == ["_fp8_gemv_kernel", "_fp8_mma_kernel", "void gather<16, long>", "all"]
    assert [r[1:] for r in rows[:3]] == [["2 / 9.0", "1 / 3.0 |"], ["-", "1 / 7.0 |"], ["1 / 2.5", "- |"]]
    assert rows[3][1:] == ["11.5", "10.0 |"]


OPCODES = {"lop3": "LOP3", "shf": "SHF", "prmt": "PRMT", "cvt_e4m3": "F2FP", "hfma2_bf16": "HFMA2",
           "hfma2_f16": "HFMA2", "imad": "IMAD", "imad_hi": "IMAD", "imad_wide": "IMAD", "hadd2_h1": "HADD2",
           "hmma": "HMMA", "imma": "IMMA", "bmma": "BMMA", "i2f": "I2FP"}


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_pipe_probe_times_the_instructions_it_names():
    """Each pair and mix of bench/pipe_probe.py, built for sm_90 on this machine, has in its loop as many of the
    SASS instructions it is named for as it counts (ptxas neither folds a chain away, packs two into one, turns
    a run-time multiply into a shift, nor emulates an mma: the b1 one is a native BMMA) and little else, so the
    rates it prints are those instructions' rates."""
    from bench import pipe_probe as pp
    per_op = pp.REPEAT * pp.ELEMS                  # one op of a step list, per loop iteration and thread
    cases = [[a, b] for a, b in pp.PAIRS] + list(pp.MIXES.values())
    for ops in cases:
        counts, spills, looped = pp.sass_ops(ops)
        if any(o.endswith("mma") for o in ops):   # ptxas pads mma runs with never-run uniform no-ops (@!UPT)
            counts.pop("UIADD3", None)
        want = collections.Counter(OPCODES[o] for o in ops)
        assert looped and spills == 0, (ops, counts)
        for opcode, n in want.items():   # IMAD may also count a few register moves and the loop's counter
            assert per_op * n <= counts.get(opcode, 0) <= per_op * n + 8, (ops, opcode, counts)
        assert sum(counts.values()) <= per_op * len(ops) + 16, (ops, counts)   # + the loop's own few


def test_bitplane_probe_planes_give_the_exact_product():
    """bench/bitplane_probe.py's plane-by-plane sum (3 / 5 times the popcounts of a code's two bits against each x
    bit plane, the sign plane negative, minus 4 times the group's x) is the levels' dot product: exact for x that
    its integers hold (small integers at 16 bits), equal to the plain integer dot for any x, and its error against
    the fp64 product is x's rounding, below the bf16 output's at 16 bits and above it at 8."""
    from bench.bitplane_probe import integer_dot, plane_dot, random_w2, table
    w = random_w2(32, 256)
    ref = w.dequantize(torch.float64)
    x = torch.randint(-100, 101, (256,)).double()
    assert torch.equal(plane_dot(w, x, 16), ref @ x)
    xb = torch.randn(256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).double()
    for bits in (8, 12, 16):
        assert torch.equal(plane_dot(w, xb, bits), integer_dot(w, xb, bits)), bits
    for row in table(64, 512, [8, 16]):
        assert row[16] < row["bf16 output"] / 10 < row[8], row


def test_bitplane_gate_up_layouts_hold_the_planes_and_x():
    """bench/bitplane_gate_up.py's copies: the weight words give back every level (3 b0 + 5 b1 - 4 = LEVELS[code]) and
    the scale bytes in w2 order, and the paired scale words hold w1's then w3's; x's planes, read as 16-bit two's
    complement, are its quantized integers, the corrections are -4 times their group sums and the exponent bits
    (e - 15) << 23."""
    from bench.bitplane_gate_up import (levels_of_bitplanes, pack_x_planes, pair_scale_words, quantize_x,
                                        scales_of_bitplanes, to_bitplanes)
    from moebox.ops.triton.w2_moe import random_planes
    from moebox.quant.w2 import LEVELS, W2Tensor
    codes, scales = random_planes(3, 256, 64, seed=4)[:2]
    words, sb = to_bitplanes(codes, scales)
    want = LEVELS[torch.stack([W2Tensor(codes[e], scales[e]).level_codes() for e in range(3)]).long()]
    assert torch.equal(levels_of_bitplanes(words), want)
    assert torch.equal(scales_of_bitplanes(sb), scales.view(torch.uint8))
    paired = pair_scale_words(sb, sb.flip(0)).view(torch.uint8)                    # [E, rb, step, g, 16 bytes]
    assert torch.equal(paired[..., :8], sb) and torch.equal(paired[..., 8:], sb.flip(0))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 3, 256)
    xq, corr = pack_x_planes(x)
    q, e = quantize_x(x)
    assert (q.double() * torch.exp2(e - 15.0).repeat_interleave(32, -1) - x.double()).abs().max() \
        <= torch.exp2(e - 16.0).repeat_interleave(32, -1).max()
    planes = torch.cat([xq[..., 0], xq[..., 2]], dim=-1).long() & 0xFFFFFFFF        # [N, step, group, plane]
    bits = (planes[..., None] >> torch.arange(32)) & 1                            # [..., plane, column]
    u = (bits << torch.arange(16)[:, None]).sum(-2)
    assert torch.equal((u - ((u >> 15) << 16)).reshape(2, 256), q)
    assert torch.equal(corr[..., 0].reshape(2, -1).long(), -4 * q.reshape(2, -1, 32).sum(-1))
    assert torch.equal(corr[..., 2], corr[..., 0]) and not corr[..., [4, 6]].any()
    for slot in (1, 3, 5, 7):
        assert torch.equal(corr[..., slot].reshape(2, -1).long(), (e - 15) << 23)


def test_bitplane_asm_gives_each_row_and_group_its_scaled_dot_in_the_ptx_emulator():
    """bench/bitplane_gate_up.py's inline asm, run for one warp by tests/ptx_warp.py on the layouts' own words (lane
    (g, t) gets the quads of its rows g, g + 8 for two groups, x's plane quads, the corrections (lanes t = 0) and
    exponent bits, the paired scale words of w1 and w3, m and f = +-512): for either matrix and pair of groups the
    lanes' slot results, weighted 4^t over t as the kernel folds them, are each row's dequantized weights times
    quantized x over the group, exactly; the accumulator is added with one fp32 rounding and slots 2, 3 pass
    through."""
    import numpy as np

    from bench.bitplane_gate_up import bitplane_asm, pack_x_planes, pair_scale_words, quantize_x, to_bitplanes
    from moebox.ops.triton.w2_moe import random_planes
    from moebox.quant.w2 import W2Tensor
    from tests.ptx_warp import f32, f32_bits, run_warp
    codes, scales = random_planes(2, 128, 8, seed=7)[:2]             # w1, w3: 16 rows, one K step of 4 groups each
    (words, sb), (_, sb3) = to_bitplanes(codes, scales), to_bitplanes(codes.flip(0), scales.flip(0))
    scale_words = pair_scale_words(sb, sb3)[0, 0, 0]                 # [g, 4]: w1's two words, then w3's
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(8)) * torch.logspace(-2, 2, 128)
    xq, corr = pack_x_planes(x)
    q, e = quantize_x(x)
    xs = q.double() * torch.exp2(e - 15.0).repeat_interleave(32, -1)
    u32 = lambda t: [int(v) & 0xFFFFFFFF for v in t.reshape(-1).tolist()]   # noqa: E731
    for matrix, pair in ((0, 0), (0, 1), (1, 0), (1, 1)):           # the asm's rho 0, 1 = groups 2 pair, 2 pair + 1
        ref = (W2Tensor(codes[matrix], scales[matrix]).dequantize(torch.float64) * xs).reshape(16, 4, 32).sum(-1)
        groups = slice(2 * pair, 2 * pair + 2)
        acc = torch.randn(32, 8, generator=torch.Generator().manual_seed(pair))
        outs = {}
        for name, acc_in in (("zero", torch.zeros(32, 8)), ("acc", acc)):
            inputs = []
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                inputs.append(u32(words[matrix, 0, 0, groups, g]) + u32(xq[0, 0, groups, g])
                              + u32(corr[0, 0, groups, 4 * (t != 0):4 * (t != 0) + 4])
                              + u32(scale_words[g].repeat(2)) + [pair] * 8
                              + [(-512 if t == 3 else 512) & 0xFFFFFFFF] * 8 + [f32_bits(float(v)) for v in acc_in[lane]])
            outs[name] = np.array([[f32(v) for v in lane] for lane in run_warp(bitplane_asm(matrix), inputs, 8, 8)])
        zero = outs["zero"].reshape(8, 4, 2, 4)                      # [g, t, rho, slot]
        got = (zero[..., :2] * (4.0 ** np.arange(4))[None, :, None, None]).sum(1)   # [g, rho, half]
        assert np.array_equal(got.transpose(2, 0, 1).reshape(16, 2), ref[:, groups].numpy()), (matrix, pair)
        assert not zero[..., 2:].any()
        sums = (outs["zero"] + acc.numpy()).astype(np.float32).reshape(32, 2, 4)
        want = np.where(np.arange(4) < 2, sums, acc.numpy().reshape(32, 2, 4))
        assert np.array_equal(outs["acc"].reshape(32, 2, 4), want.astype(np.float32)), (matrix, pair)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_bitplane_gate_up_builds_for_sm90():
    """The bit-plane kernel's sm_90 build: the asm's packs are one lane's quads in the mma fragment lane map, no
    shared-memory layout conversion or spill in the loop, and two native BMMAs a group and matrix (4 groups x 2
    matrices an iteration)."""
    from bench.bitplane_gate_up import sass_report
    rep = sass_report(2)
    assert rep["asm_layout"] == {"sizePerThread": [1, 4], "threadsPerWarp": [8, 4], "warpsPerCTA": [2, 1],
                                 "order": [1, 0]}, rep
    assert rep["looped"] and rep["spills"] == 0 and "STS" not in rep["loop_ops"], rep
    assert rep["loop_ops"]["BMMA"] == 16 and rep["loop_ops"]["I2FP"] == 16, rep


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bitplane_gate_up_matches_reference():
    """The bit-plane gate-up on the GPU against the fp64 reference: with x quantized as the kernel takes it only the
    fp32 sums differ; against exact x the 16-bit rounding stays below the bf16 output's."""
    from bench.bitplane_gate_up import check
    got = check()
    assert got["finite"] and got["quantized"] < 1e-5 and got["exact"] < 1e-3, got


_DROP_SCRIPT = """
import sys
sys.path.append(sys.argv[1])            # the repository's tests (the tiny model), after the hooked tree
from tests.interpreter import count_calls, tiny_model
from moebox.bench.decode import _step_batch
import moebox.model.moe as moe
calls = count_calls(moe.MoE, "routed")
cfg, model = tiny_model()
cache = model.new_cache(2, 64, "cpu")
for _ in range(2):
    model.forward(_step_batch(cfg, 2, 8, "cpu"), cache)
import moebox.drop as drop
print(len(calls), cfg.num_layers, drop.SITE[0])
"""


def test_drop_probe_hooks_skip_the_part_they_name(tmp_path):
    """bench/drop_probe.py's tree applies every part's hook to this checkout, and a dropped part (the routed
    experts) runs once per layer in two decode steps, where the default tree runs it in each step."""
    from bench.drop_probe import PATCHES, build
    dest = build(tmp_path / "drop")
    assert (dest / "moebox" / "drop.py").exists() and set(PATCHES) >= {"experts", "attn", "wo", "mix", "post"}
    runs = {}
    for drop in ("", "experts"):
        out = subprocess.run([sys.executable, "-c", _DROP_SCRIPT, str(ROOT)], cwd=dest, capture_output=True,
                             text=True, env={**os.environ, "MOEBOX_DROP": drop, "PYTHONPATH": str(dest)},
                             timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[drop] = out.stdout.split()
    layers = int(runs[""][1])
    assert int(runs[""][0]) == 2 * layers and int(runs["experts"][0]) == layers
    assert runs[""][2] == "ffn"          # the mixffn part's site hook: a block's last mHC site is its FFN's


_MIX_PART_SCRIPT = """
import moebox.drop as drop
calls = []
for site in ("ffn", "attn", "ffn", "attn"):
    drop.SITE[0] = site
    part = drop.mix_part()
    if part in drop.DROP:
        drop.cached(part, (1, 8), lambda: calls.append(site))
print(",".join(calls) or "-")
"""


def test_drop_probe_mix_parts_launch_nothing_after_the_first_step(tmp_path):
    """Kernel B's x drop at one site kind (mixffn / mixattn) is cached under the part that is dropped: its
    random stand-in is made once per shape and only at that site kind, not launched at every call (a hook
    keyed by `mixx` did that, and timed a launch swapped for another)."""
    from bench.drop_probe import build
    dest = build(tmp_path / "drop")
    seen = {}
    for drop in ("mixffn", "mixattn", "mixx", ""):
        out = subprocess.run([sys.executable, "-c", _MIX_PART_SCRIPT], cwd=dest, capture_output=True, text=True,
                             env={**os.environ, "MOEBOX_DROP": drop, "PYTHONPATH": str(dest)}, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        seen[drop] = out.stdout.strip()
    assert seen == {"mixffn": "ffn", "mixattn": "attn", "mixx": "ffn", "": "-"}


def test_read_probe_kernels_read_every_word_once_in_the_interpreter():
    """bench/read_probe.py's kernels xor exactly the words each program owns: the flat read against its numpy
    reference, the tile read against each row group's xor, and the blocked layout (128 x 128-byte blocks stored
    contiguously) of a matrix against the plain layout of the same matrix."""
    from tests.interpreter import run_in_interpreter
    out = run_in_interpreter("""
import sys; sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from bench.read_probe import _tile_read_kernel, read_call, read_reference
g = torch.Generator().manual_seed(0)
src = torch.randint(-2 ** 31, 2 ** 31 - 1, (256 * 64,), generator=g, dtype=torch.int32)
flat = torch.zeros(16, dtype=torch.int32)
read_call(src, flat, 6, 1024, 4)                      # 6 programs: the last one's chunk is padded
ok = [torch.equal(flat[:6], read_reference(src, 6, 1024))]
m = src.view(256, 64)
groups = torch.from_numpy(np.bitwise_xor.reduce(m.view(16, 16 * 64).numpy(), axis=1))
blocked = m.view(2, 128, 2, 32).permute(0, 2, 1, 3).contiguous().view(-1)
for buf, is_blocked in ((src, False), (blocked, True)):
    out = torch.zeros(16, dtype=torch.int32)
    _tile_read_kernel[(16,)](buf, out, 64, R=16, BW=32, BLOCKED=is_blocked, PDL=False)
    ok.append(torch.equal(out, groups))
print("OK", ok)
""")
    assert "OK [True, True, True]" in out, out


def words_gemv_results(cases: list, dev: str) -> list[dict]:
    """The probe's words GEMV against fp8_linear_reference for each ((out, in, r, bw), ahead, cvt) on `dev`, as
    `check_in_interpreter` rows (plus `worst`: the largest error relative to the element, floored at 1% of the
    largest |ref|): every finite e4m3 code (subnormals and -0 included) among the weights and the scale bytes
    varied per block, so that a wrong bit move or a wrong block lookup shows."""
    from bench.read_probe import words_gemv
    from moebox.bench.synthetic import _fp8
    from moebox.ops.triton.fp8_linear import fp8_linear_reference
    from moebox.weights.schema import TensorSpec
    g = torch.Generator().manual_seed(0)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)   # every e4m3 but NaN
    res = []
    for (out_f, in_f, r, bw), ahead, cvt in cases:
        w = _fp8(TensorSpec("w", (out_f, in_f), "fp8"), g, torch.device("cpu"))
        w.data.view(torch.uint8)[0, :codes.numel()] = codes
        w.scale.view(torch.uint8).copy_(torch.randint(110, 125, w.scale.shape, generator=g, dtype=torch.uint8))
        w = type(w)(w.kind, w.data.to(dev), w.scale.to(dev), w.block)
        x = torch.randn(1, in_f, generator=g).to(torch.bfloat16).to(dev)
        y, ref = words_gemv(x, w.data, w.scale, r, bw, 4, ahead, cvt).float(), fp8_linear_reference(x, w).float()
        res.append(dict(same_buffer=True, finite=bool(torch.isfinite(y).all()),
                        rel=float((y - ref).norm() / ref.norm()),
                        worst=float(((y - ref).abs() / (ref.abs() + 1e-2 * ref.abs().max())).max()),
                        ref_norm=float(ref.norm()), tol=1e-2))
    return res


def test_read_probe_words_gemv_matches_the_fp8_reference_in_the_interpreter():
    """The probe's words GEMV (4 e4m3 weights an int32 word, their bits moved into f32s; with and without the next
    step's words loaded ahead) computes fp8_linear_reference (`words_gemv_results`)."""
    from tests.interpreter import check_in_interpreter
    cases = [((256, 512, 16, 64), False, False), ((128, 1024, 8, 128), True, False), ((256, 256, 32, 32), True, False)]
    check_in_interpreter(f"""
import sys, json; sys.path.insert(0, sys.argv[1])
from tests.test_bench import words_gemv_results
print("RESULT " + json.dumps(words_gemv_results({cases!r}, "cpu")))
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_read_probe_words_gemv_matches_the_fp8_reference_on_the_gpu():
    """The words GEMV's PTX conversion (cvt.rn.f16x2.e4m3x2, which the interpreter cannot run) and its bit moves,
    ahead or not, at the tilings the probe times, against fp8_linear_reference on the GPU."""
    cases = [((shape[0], shape[1], r, bw), ahead, cvt) for shape in ((4096, 4096), (32768, 1024))
             for r, bw in ((8, 256), (32, 256), (16, 128)) for ahead in (False, True) for cvt in (False, True)]
    for r in words_gemv_results(cases, "cuda"):
        assert r["finite"] and r["rel"] < 1e-2 and r["worst"] < 0.05, r


def test_flag_probe_chain_matches_its_reference_in_the_interpreter():
    """bench/flag_probe.py's chain (plain launches: the interpreter has no PDL) computes its torch reference, so
    the probe's GPU check of the wait and flag modes against plain is a check against the reference."""
    from tests.interpreter import run_in_interpreter
    out = run_in_interpreter("""
import sys; sys.path.insert(0, sys.argv[1])
import torch
from bench.flag_probe import chain, chain_reference
run, first, last = chain("plain", 3, 8, n=64, device="cpu")
run()
ref = chain_reference(first, 3, 8, n=64)
print("ERR", float((last - ref).abs().max() / ref.abs().max()))
""")
    assert float(out.split("ERR ")[1]) < 1e-6


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_flag_probe_flag_mode_spins_after_letting_the_next_launch():
    """The flag mode's sm_90 build: launch_dependents first, then an acquire load of the counter in a loop, and a
    release add after the slice's stores (what the probe means to time)."""
    from bench.flag_probe import _link_kernel
    from moebox.ops.triton.runtime import build_sm90
    sig = {"src_ptr": "*fp32", "dst_ptr": "*fp32", "cin_ptr": "*i32", "cout_ptr": "*i32", "epoch_ptr": "*i32",
           "G_IN": "i32"}
    ptx = build_sm90(_link_kernel, sig, dict(N=4096, SLICE=16, MODE=2, FIRST=False),
                     ["src_ptr", "dst_ptr"], num_warps=4).asm["ptx"]
    launch, spin = ptx.find("griddepcontrol.launch_dependents"), ptx.find("ld.global.gpu.acquire")
    store, release = ptx.rfind("st.global"), ptx.find("red.global.gpu.release.add")
    assert "griddepcontrol.wait" not in ptx and 0 <= launch < spin < store < release
