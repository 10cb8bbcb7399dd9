#!/usr/bin/env bash
# The GPU checks of issues D, E and G, in phases that each fit one device call (<= 10 min on an H200); the
# numbers in docs/benchmarks.md come from these exact commands. Run from the repo root:
#   bash bench/gpu_session.sh tests     # GPU tests of every kernel and of the model (no stop at a failure;
#                                       # TESTS: files, TESTS_K: a -k expression)
#   bash bench/gpu_session.sh kernels   # the kernel benches (attention, compressor step, grouped FP8, w2 experts
#                                       # at decode, and their prefill GEMM's tilings)
#   bash bench/gpu_session.sh decode    # the full-size decode bench (4K, 64K, verify cost, the costliest kernels
#                                       # of a batch-1 step), then the prefill bench (2K and 16K prompts, the
#                                       # costliest kernels of a 2K chunk), again with dense prefill attention
#   bash bench/gpu_session.sh decode4k  # the decode bench at context 4K alone (batch 1-16 and the breakdown)
#   bash bench/gpu_session.sh ab        # the decode bench at batch 1 and 16 with each switch of the fast path off,
#                                       # or with each of AB (e.g. AB="MOEBOX_PDL=0 MOEBOX_PDL=1
#                                       # MOEBOX_PDL=1,TORCHINDUCTOR_ENABLE_PDL=1 MOEBOX_ROUTE_KERNEL=0"; AB_BATCH
#                                       # and AB_CONTEXT change the batch sizes and the context; `default`: no
#                                       # switch; AB_LAYERS: fewer main layers, e.g. 36 to fit an H100)
#   bash bench/gpu_session.sh probetests # the GPU tests of the side streams' priority, the key store and router
#                                       # kernels, the early fork (MOEBOX_SIDE_PRIORITY, MOEBOX_KEYS_KERNEL,
#                                       # MOEBOX_ROUTER_KERNEL, MOEBOX_EARLY_FORK)
#   bash bench/gpu_session.sh probes    # decode at 4K (AB_BATCH, default 1 8 16) with each of those four off and
#                                       # all of them off against the default, twice (ROUNDS="1 2")
#   bash bench/gpu_session.sh ropeprobe # the inverse RoPE in the attention's combine: the attention -> output
#                                       # products chain alone, decode at batch 1-16 with MOEBOX_COMBINE_HOLD=0,
#                                       # MOEBOX_ATTENTION_ROPE=0 and =1, batch-1 timelines held and not
#   bash bench/gpu_session.sh priorityprobe # decode at batch 1, 2 and 16 with the side-stream priority for one
#                                       # branch at a time (MOEBOX_SIDE_PRIORITY=attention, mhc, moe, pack)
#   bash bench/gpu_session.sh holdprobe # decode at batch 1, 2, 8 with each kernel's dependents held to its end
#                                       # (MOEBOX_PDL_HOLD), HOLD_GROUP=1 / 2: the first / second ten kernels
#   bash bench/gpu_session.sh overlapprobe # decode at batch 1, 2, 8 with the shared expert on the main stream and
#                                       # with no side streams against the default, twice; batch-1 kernel times
#   bash bench/gpu_session.sh kerneltimes # one decode step's kernels at batch 1, 2, 3 (AB_BATCH), PDL on and off,
#                                       # summed per kernel side by side (bench/timeline_kernels.py)
#   bash bench/gpu_session.sh versions  # the decode bench of a base tree against this one, alternating in one call
#                                       # (BASE_DIR: the base's copy, carried; ORDER, AB_BATCH, AB_CONTEXT)
#   bash bench/gpu_session.sh timeline  # one batch-1 step's kernels in launch order with the idle time between
#                                       # them, PDL off and on ($OUT/timeline-pdl0.tsv, timeline-pdl1.tsv)
#   bash bench/gpu_session.sh train     # train the demo from a carried corpus (CORPUS, RUN_DIR, MINUTES or
#                                       # STEPS + PAUSE, and TRAIN_ARGS: more `moebox train` flags, JSON without
#                                       # spaces); on one GPU run it alone (next to the tests its cold compile
#                                       # took 221 s), on two see `pair`
#   bash bench/gpu_session.sh copycheck # the copy-learning bench on CUDA (the CPU learns it in ~300 steps)
#   bash bench/gpu_session.sh spec      # eval of the shipped demo, and MTP vs plain on it
#   bash bench/gpu_session.sh experts   # the routed-expert decode kernels' sweep (W2_ARGS: other flags of
#                                       # `python -m moebox.ops.triton.w2_moe`, e.g. "--tokens 1 --k 4 6 8")
#   bash bench/gpu_session.sh fp8sweep  # the FP8 decode GEMV's tilings on the V4-Flash shapes (prints TUNED_DECODE;
#                                       # SWEEP_ARGS: more flags, e.g. "--tokens 1 --kernels gemv")
#   bash bench/gpu_session.sh mhc       # the mHC kernels (hc_pre, hc_post and the decode chain against the torch
#                                       # references), then the chain's hc_post tilings (CHAIN_BLOCK_H)
#   bash bench/gpu_session.sh topk      # the indexer's top-k kernel against torch.topk (1025 to 16385 entries)
#   bash bench/gpu_session.sh attnsweep # the decode attention's tilings at batch 8 and 16 (CSA, HCA; AB_BATCH
#                                       # other sizes, KINDS other layer kinds, e.g. hca4k)
#   bash bench/gpu_session.sh index     # the indexer's score kernel against the torch function, then decode at 4K
#                                       # and 64K with it off / on (MOEBOX_INDEX_KERNEL)
#   bash bench/gpu_session.sh pipes     # warp instructions a cycle and SM of PRMT, LOP3, SHF, F2FP, HFMA2, IMAD,
#                                       # the bf16 / s8 / b1 mma.sync... alone, paired and in the gate-up loop's
#                                       # mix (bench/pipe_probe.py)
#   bash bench/gpu_session.sh ncu       # Nsight Compute on the expert and FP8 decode kernels (bench/kernel_probe.py)
#   bash bench/gpu_session.sh profile   # the kernels of a decode step with PDL off (PDL blurs per-kernel times)
#   bash bench/gpu_session.sh pair      # on nvidia-h200-x2: the phases in PHASES0 (default "train") on GPU 0 in
#                                       # the background (their logs and model parts under $OUT/gpu0) while
#                                       # those in PHASES (default "tests") run one after another on GPU 1
# Logs go to $OUT (the device tool's output folder) or ./runs/gpu; one log per phase, a summary line per step.
set -u
usage="usage: bash bench/gpu_session.sh tests|kernels|experts|pipes|fp8sweep|mhc|topk|attnsweep|index|ncu|profile|timeline|decode|decode4k|ab|versions|probetests|probes|ropeprobe|priorityprobe|holdprobe|overlapprobe|kerneltimes|train|copycheck|spec|pair"
phase=${1:?$usage}
out=${OUT:-runs/gpu}
mkdir -p "$out"
log="$out/$phase.log"
export PYTHONUNBUFFERED=1

decode_row() {                # decode_row SIZES NAME: the last decode bench's ms a step at SIZES (or AB_BATCH)
    local sizes=${AB_BATCH:-$1}
    grep -E "^\| *[0-9]+ \| *[0-9]+ \|" "$log" | tail -n "$(echo "$sizes" | wc -w)" \
        | awk -F'|' -v s="$2" '{r = r $3 "/" $6} END {print s ":" r}' | tee -a "$out/summary.txt"
}

assignments() {               # assignments "A=1,B=x,y": the VAR=VALUE words of a comma list; a comma starts a new
                              # assignment only before NAME=, so a value may hold commas (MOEBOX_OVERLAP=moe,mhc)
    sed -E 's/,([A-Za-z_][A-Za-z0-9_]*=)/ \1/g' <<<"$1"
}

decode_switch() {             # decode_switch NAME SIZES SWITCH: the decode bench at AB_CONTEXT (4096) and SIZES (or
                              # AB_BATCH) with SWITCH's variables (A=1,B=2; `default`: none), its row in the summary
    local envs=""
    [ "$3" != default ] && envs=$(assignments "$3")
    # shellcheck disable=SC2086  # envs holds several assignments, the sizes several numbers
    step "decode-$1" env $envs python3 -m moebox.bench.decode decode --context "${AB_CONTEXT:-4096}" \
        --batch ${AB_BATCH:-$2} --no-breakdown ${AB_LAYERS:+--layers $AB_LAYERS}
    decode_row "$2" "$3"
}

timeline_step() {             # timeline_step NAME SIZE VAR=VALUE...: one decode step of SIZE sequences at context
                              # 4096 with those variables, its kernels to $out/timeline-NAME.tsv
    local name=$1 size=$2
    shift 2
    step "timeline-$name" env "$@" python3 -m moebox.bench.decode decode --context 4096 --batch "$size" \
        --no-breakdown --timeline "$out/timeline-$name.tsv"
}

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
    # kernels first, the model last; a hang leaves the log so far
    # shellcheck disable=SC2086  # TESTS: a subset of the test files (default: all of the GPU ones); TESTS_K: a
    # pytest -k expression (it may hold spaces, which TESTS, split on them, cannot); PYTEST_ARGS: more flags, e.g.
    # "-n 4" (the image has pytest-xdist)
    quiet=-q; [[ " ${PYTEST_ARGS:-} " == *" -v "* ]] && quiet=""   # -q would cancel a -v
    # shellcheck disable=SC2086  # quiet: one flag or none
    step gpu-tests timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest $quiet -m gpu -p no:cacheprovider -W ignore -rf \
        ${PYTEST_ARGS:-} ${TESTS_K:+-k "$TESTS_K"} ${TESTS:-tests/test_triton_compress_decode.py tests/test_triton_decode_attention.py tests/test_triton_fp8.py \
        tests/test_triton_w2.py tests/test_triton_w2_fp8.py tests/test_triton_w2_prefill.py tests/test_triton_mhc.py \
        tests/test_triton_route.py \
        tests/test_triton_pdl.py tests/test_prefill_attention.py tests/test_triton_topk.py tests/test_streams.py \
        tests/test_triton_rms_norm.py tests/test_triton_index_scores.py tests/test_triton_fp8_mma.py \
        tests/test_triton_fp8_norm.py tests/test_triton_rope.py tests/test_bench.py tests/test_cuda.py}
    ;;
experts)                      # the routed-expert decode kernels' sweep alone (or W2_ARGS' bench)
    # shellcheck disable=SC2086  # W2_ARGS: several flags
    step w2-experts python3 -m moebox.ops.triton.w2_moe ${W2_ARGS:---sweep}
    ;;
fp8sweep)
    step fp8-sweep python3 -m moebox.ops.triton.fp8_linear --sweep ${SWEEP_ARGS:-}
    ;;
mhc)
    step mhc-bench python3 -m moebox.ops.triton.mhc --sweep-chain
    ;;
topk)
    step topk-bench python3 -m moebox.ops.triton.topk
    ;;
attnsweep)
    # shellcheck disable=SC2086  # AB_BATCH, KINDS: several words
    step attention-sweep python3 -m moebox.ops.triton.decode_attention --batch ${AB_BATCH:-8 16} \
        --kind ${KINDS:-csa hca} --no-torch --sweep
    ;;
probetests)                   # the GPU tests of the twentieth session's four switches (~2 min)
    step new-kernel-tests timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore -rf \
        tests/test_triton_rope.py tests/test_streams.py tests/test_triton_route.py tests/test_triton_pdl.py \
        tests/test_cuda.py -k "not test_cuda or decode_graphs_replay"
    ;;
probes)                       # the twentieth session's four switches, one call: the decode bench with each and all
    # four off, alternating with the default
    for round in ${ROUNDS:-1 2}; do
        for switch in default MOEBOX_SIDE_PRIORITY=0 MOEBOX_KEYS_KERNEL=0 MOEBOX_EARLY_FORK=0 MOEBOX_ROUTER_KERNEL=0 \
            MOEBOX_SIDE_PRIORITY=0,MOEBOX_KEYS_KERNEL=0,MOEBOX_EARLY_FORK=0,MOEBOX_ROUTER_KERNEL=0; do
            decode_switch "$switch-$round" "1 8 16" "$switch"
        done
    done
    ;;
ropeprobe)                    # the inverse RoPE in the attention's combine lost 0.4 ms at batch 1 with PDL unless
    # the combine's dependent launches at its end: the attention -> wo_a -> wo_b chain alone, then decode with the
    # dependent launched early (MOEBOX_COMBINE_HOLD=0), without and with the rotation at every batch size, and
    # batch-1 timelines held and not
    step rope-combine-probe python3 -m bench.rope_combine_probe
    for switch in default MOEBOX_COMBINE_HOLD=0 MOEBOX_ATTENTION_ROPE=0 MOEBOX_ATTENTION_ROPE=1 default; do
        decode_switch "$switch" "1 2 4 8 16" "$switch"
    done
    for hold in 0 1; do
        timeline_step "hold$hold" 1 MOEBOX_ATTENTION_ROPE=1 MOEBOX_COMBINE_HOLD=$hold
    done
    python3 -m bench.timeline_waits "$out"/timeline-*.tsv | tee -a "$out/summary.txt"
    ;;
holdprobe)                    # decode at AB_BATCH (default 1 2 8) with one kernel's dependents held to its end
    # (MOEBOX_PDL_HOLD), kernel after kernel, between two default runs; HOLD_GROUP 1 / 2: the first / second ten
    # of a decode step's kernels (one call each), or HOLD_KERNELS: a list of names
    group1="_fp8_gemv_kernel _fp8_mma_kernel _fp8_linear_kernel _split_sum_kernel _gate_up_mma_kernel \
        _down_mma_kernel _pack_x_kernel _mix_kernel _post_kernel _mix_logits_gemv_kernel"
    group2="_attend_kernel _combine_kernel _query_rope_kernel _inverse_rope_kernel _store_keys_kernel \
        _compress_kernel _topk_kernel _index_scores_kernel _router_route_kernel _rms_norm_kernel"
    [ "${HOLD_GROUP:-1}" = 2 ] && kernels=$group2 || kernels=$group1
    for switch in default ${HOLD_KERNELS:-$kernels} default; do
        [ "$switch" != default ] && switch=MOEBOX_PDL_HOLD=$switch
        decode_switch "$switch" "1 2 8" "$switch"
    done
    ;;
kerneltimes)                  # one decode step's kernels at each of AB_BATCH (default 1 2 3), PDL on and off, summed
    # per kernel side by side (where batch 2's extra 1.3 ms over the floor's growth goes)
    files=()
    for size in ${AB_BATCH:-1 2 3}; do
        for pdl in 1 0; do
            timeline_step "b$size-pdl$pdl" "$size" MOEBOX_PDL=$pdl
            files+=("$out/timeline-b$size-pdl$pdl.tsv")
        done
    done
    python3 -m bench.timeline_kernels "${files[@]}" | tee -a "$out/summary.txt"
    ;;
overlapprobe)                 # is the shared expert beside the routed experts a loss? (at batch 1 the pair took
    # 31 us a layer, the routed ones alone 27.7 us a call in the w2 bench): decode with it on the main stream
    # (MOEBOX_OVERLAP=attention,mhc,pack) and with no side streams, alternating, then batch-1 kernel times of both
    for round in ${ROUNDS:-1 2}; do
        for switch in default MOEBOX_OVERLAP=attention,mhc,pack MOEBOX_OVERLAP=0; do
            decode_switch "$switch-$round" "1 2 8" "$switch"
        done
    done
    for overlap in 1 attention,mhc,pack; do     # 1: the default (every branch)
        timeline_step "overlap-$overlap" 1 MOEBOX_OVERLAP=$overlap
    done
    python3 -m bench.timeline_kernels "$out"/timeline-overlap-*.tsv | tee -a "$out/summary.txt"
    ;;
priorityprobe)                # which branch's priority gains at batch 1 and 16 and loses at batch 2
    for switch in default MOEBOX_SIDE_PRIORITY=0 MOEBOX_SIDE_PRIORITY=attention MOEBOX_SIDE_PRIORITY=mhc \
        MOEBOX_SIDE_PRIORITY=moe MOEBOX_SIDE_PRIORITY=pack default; do
        decode_switch "$switch" "1 2 16" "$switch"
    done
    ;;
index)
    step index-bench python3 -m moebox.ops.triton.index_scores
    for flag in 0 1; do
        step "decode-index$flag" env MOEBOX_INDEX_KERNEL=$flag python3 -m moebox.bench.decode decode \
            --context 4096 65536 --batch 1 8 16 --no-breakdown
    done
    ;;
pipes)                        # issue rates of the unpack's candidate instructions, alone, paired and mixed
    step pipes python3 -m bench.pipe_probe
    ;;
ncu)                          # hardware counters: DRAM throughput, stall reasons, occupancy of each launch
    step ncu env MOEBOX_PDL=0 ncu --clock-control none --kernel-name "regex:${NCU_KERNELS:-mma_kernel|fp8_gemv}" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis_Tables \
        --section SourceCounters python3 -m bench.kernel_probe
    ;;
profile)                      # per-kernel device time of a decode step (PROFILE_BATCH: the batch size)
    step profile env MOEBOX_PDL=0 python3 -m moebox.bench.decode decode --context 4096 \
        --batch "${PROFILE_BATCH:-1}" --kernels 60 --no-breakdown
    ;;
timeline)
    for pdl in 0 1; do
        timeline_step "pdl$pdl" 1 MOEBOX_PDL=$pdl
    done
    ;;
kernels)
    step attention-kernel python3 -m moebox.ops.triton.decode_attention
    step compress-kernel python3 -m moebox.ops.triton.compress_decode
    step fp8-grouped python3 -m moebox.ops.triton.fp8_linear --grouped
    step w2-experts python3 -m moebox.ops.triton.w2_moe
    step w2-prefill python3 -m moebox.ops.triton.w2_moe_prefill --sweep
    ;;
decode)
    step decode python3 -m moebox.bench.decode decode --context 4096 65536 --verify 2 --kernels 40
    step prefill python3 -m moebox.bench.decode prefill --kernels 25
    step prefill-dense-attention env MOEBOX_PREFILL_ATTENTION_KERNEL=0 python3 -m moebox.bench.decode prefill \
        --kernels 25
    ;;
decode4k)
    step decode4k python3 -m moebox.bench.decode decode --context 4096
    ;;
ab)                           # AB="..." picks the switches (default: each part of the fast path off)
    for switch in ${AB:-default MOEBOX_ATTENTION_KERNEL=0 MOEBOX_COMPRESS_KERNEL=0 MOEBOX_STACK_LINEARS=0}; do
        decode_switch "$switch" "1 16" "$switch"
    done
    ;;
versions)                     # the decode bench of a base tree (BASE_DIR) against this one, alternating in one call
    # BASE_DIR: a copy of the base commit made on the CPU box and carried, e.g. `mkdir -p .probe/base && git archive
    # HEAD | tar x -C .probe/base` (the device gets no .git); ORDER: "base" / "new", each optionally ":A=1,B=2"
    for spec in ${ORDER:-base new base new}; do
        tree=${spec%%:*}; envs=""; [ "$spec" != "$tree" ] && envs=$(assignments "${spec#*:}")
        dir=.; [ "$tree" = base ] && dir=${BASE_DIR:?BASE_DIR: the base tree}
        # shellcheck disable=SC2086  # envs holds several assignments; AB_BATCH several sizes
        step "decode-$spec" env -C "$dir" $envs python3 -m moebox.bench.decode decode \
            --context ${AB_CONTEXT:-4096} --batch ${AB_BATCH:-1 2 4 8 16} --no-breakdown
        decode_row "1 2 4 8 16" "$spec"
    done
    ;;
train)
    run_dir=${RUN_DIR:-runs/demo2}
    # the corpus is written on the CPU box and carried: it reads the local Python's stdlib sources, and the
    # GPU image's Python differs (CORPUS: a tar.xz of corpus/ and tokenizer.json; a config.json in it is left)
    if [ -n "${CORPUS:-}" ] && [ ! -d "$run_dir/corpus" ]; then
        mkdir -p "$run_dir" && tar xJf "$CORPUS" -C "$run_dir" corpus tokenizer.json   # config: from the flags
    fi
    # a time budget (MINUTES), or a fixed count (STEPS) over several calls: each call pauses after PAUSE minutes,
    # and the next one (on the still-warm machine: run it within its 30 s idle release) resumes the run
    if [ -n "${STEPS:-}" ]; then length="--steps $STEPS --pause-after-minutes ${PAUSE:-8.5}"
    else length="--minutes ${MINUTES:-7}"; fi
    # shellcheck disable=SC2086  # TRAIN_ARGS and length hold several flags
    step train python3 -m moebox.cli train --run-dir "$run_dir" --device cuda $length \
        --batch-tokens 65536 --n-train 100000 ${TRAIN_ARGS:-}
    if [ -d "$run_dir/model" ]; then
        tar cf - -C "$run_dir" model settings.json | split -b 15M - "$out/model.tar.part-"
    fi
    # on the CPU box, after fetching: on CUDA every new prompt length compiles, and a call ran out of time here
    echo "next: python -m bench.induction_probe <model>" | tee -a "$out/summary.txt"
    ;;
copycheck)                    # does the compiled CUDA training path learn to copy as the CPU does (docs/benchmarks.md)?
    step copy-learning python3 -m bench.copy_learning --device cuda --layers 6 --steps 300 --variants '{}'
    ;;
spec)                         # after the trained model is shipped in moebox/demo_model
    step eval python3 -m moebox.cli eval moebox/demo_model --device cuda --n-per-kind 50
    step spec python3 -m moebox.bench.decode spec --device cuda
    ;;
pair)                         # the device budget counts held time, not GPUs: two GPUs do twice the work
    for p in ${PHASES0:-train}; do
        CUDA_VISIBLE_DEVICES=0 OUT="$out/gpu0" bash "$0" "$p" >/dev/null 2>&1
    done &
    for p in ${PHASES:-tests}; do
        CUDA_VISIBLE_DEVICES=1 OUT="$out" bash "$0" "$p" >/dev/null 2>&1
    done
    wait
    cat "$out/summary.txt" "$out/gpu0/summary.txt" 2>/dev/null
    exit 0
    ;;
*)
    echo "unknown phase $phase" >&2
    exit 2
    ;;
esac
tail -n 60 "$log"
