#!/usr/bin/env bash
# The GPU checks of issues D, E and G, in phases that each fit one device call (<= 10 min on an H200); the
# numbers in docs/benchmarks.md come from these exact commands. Run from the repo root:
#   bash bench/gpu_session.sh tests     # GPU tests of every kernel and of the model, kernel benches
#   bash bench/gpu_session.sh decode    # full-size decode bench (4K, 64K, verify cost), then A/B of the switches
#   bash bench/gpu_session.sh train     # train the demo from a carried corpus (RUN_DIR, MINUTES), eval, pack
#   bash bench/gpu_session.sh spec      # MTP vs plain on the shipped demo, prefill bench
# Logs go to $OUT (the device tool's output folder) or ./runs/gpu; one log per phase, a summary line per step.
set -u
phase=${1:?usage: bash bench/gpu_session.sh tests|decode|train|spec}
out=${OUT:-runs/gpu}
mkdir -p "$out"
log="$out/$phase.log"
export PYTHONUNBUFFERED=1

step() {                      # step NAME CMD...: run, log everything, print a one-line result
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    echo "=== $name: $*" >>"$log"
    "$@" >>"$log" 2>&1
    rc=$?
    echo "$name: rc $rc, $(($(date +%s) - t0)) s" | tee -a "$out/summary.txt"
}

case $phase in
tests)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >>"$log" 2>&1
    step gpu-tests python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore -x \
        tests/test_triton_decode_attention.py tests/test_triton_compress_decode.py tests/test_triton_fp8.py \
        tests/test_triton_w2.py tests/test_triton_mhc.py tests/test_cuda.py
    step attention-kernel python3 -m moebox.ops.triton.decode_attention
    step compress-kernel python3 -m moebox.ops.triton.compress_decode
    step fp8-grouped python3 -m moebox.ops.triton.fp8_linear --grouped
    ;;
decode)
    step decode python3 -m moebox.bench.decode decode --context 4096 65536 --verify 2
    for switch in MOEBOX_ATTENTION_KERNEL=0 MOEBOX_COMPRESS_KERNEL=0 MOEBOX_STACK_LINEARS=0; do
        step "decode-$switch" env "$switch" python3 -m moebox.bench.decode decode --context 4096 --batch 1 16 \
            --no-breakdown
    done
    ;;
train)
    run_dir=${RUN_DIR:-runs/demo2}
    # the corpus is written on the CPU box and carried: it reads the local Python's stdlib sources, and the
    # GPU image's Python differs (CORPUS: a tar.xz of corpus/, tokenizer.json and config.json)
    if [ -n "${CORPUS:-}" ] && [ ! -d "$run_dir/corpus" ]; then mkdir -p "$run_dir" && tar xJf "$CORPUS" -C "$run_dir"; fi
    step train python3 -m moebox.cli train --run-dir "$run_dir" --device cuda --minutes "${MINUTES:-8}" \
        --batch-tokens 65536 --n-train 100000
    step eval python3 -m moebox.cli eval "$run_dir/model" --device cuda --n-per-kind 50
    tar cf - -C "$run_dir" model settings.json | split -b 15M - "$out/model.tar.part-"
    ;;
spec)
    step spec python3 -m moebox.bench.decode spec --device cuda
    step prefill python3 -m moebox.bench.decode prefill
    ;;
*)
    echo "unknown phase $phase" >&2
    exit 2
    ;;
esac
tail -n 60 "$log"
