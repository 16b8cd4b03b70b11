#!/usr/bin/env bash
# One round on the H200 (device tool), stages run in order, each under its own time limit:
#   source .gpu/bootstrap.sh && bash benchmarks/gpu_round.sh STAGE[:SECONDS] ...
# Stages:
#   tests    GPU tests of the glue, the passes, FlashInfer and CUDA graphs (not the whole model)
#   matrix   registry matrix at real sizes (all GPU backends the machine can run)
#   fa4      FLASH_ATTN / COMPOSITE_SM90 / DIFFKV matrix, tests and CUDA graphs (needs both FA4
#            halves there)
#   model    benchmarks/bench_model_decode.py
#   grid     benchmarks/bench_gpu_attention.py --rounds 2
#   cgraph   benchmarks/bench_cudagraph_decode.py (graph decode against FlashInfer's graph mode)
#   triton   benchmarks/bench_triton_attention.py --rounds 1
#   builder  benchmarks/profile_builder.py
#   tsweep   benchmarks/sweep_kernel_configs.py --only triton-prefill (TRITON prefill tiles)
#   psweep   benchmarks/sweep_kernel_configs.py --only prefill $PSWEEP_ARGS (FA4 tiles and call
#            modes, SDPA; needs FA4)
#   dsweep   benchmarks/sweep_kernel_configs.py --only decode $DSWEEP_ARGS (FlashInfer splits, FA4
#            tiles, our op; needs FA4)
#   graphs   tests/test_model_graphs.py alone (whole-model CUDA graphs, every GPU backend here)
#   flex     FLEX_ATTENTION's tests and matrix (decode layout, page pruning, full blocks)
#   eager    benchmarks/profile_eager_op.py (an eager call's host time, layer by layer)
#   fi       FLASHINFER's tests: test_flashinfer.py, its CUDA-graph tests (no-split plans kept)
#   tfused   TRITON_ATTN / TREE_ATTN tests and matrix with the fused split combine forced on
#            (ATTN_OPS_TUNING=triton.fused_combine=true; by default it is on only from
#            Tuning.triton.fused_min_items work items, which small tests miss); about 420 s on
#            the H200
#   page128  benchmarks/bench_triton_attention.py at page 128 (FLEX_ATTENTION's Triton key tile is
#            at most its page: 16 keys at page 16), JSON bench_triton_attention_page128_h200.json
#   kvwrite  benchmarks/bench_kv_write.py (the cost of clearing entered pages' tails)
#   ops      tests/test_ops.py (opcheck of every op on the GPU)
#   tattn    tests/test_triton_attn.py alone (TRITON_ATTN's kernels, the split combine included)
#   memcheck compute-sanitizer memcheck over a subset of the TRITON_ATTN / TREE_ATTN tests
# A round with FA4 on a fresh machine is two calls (the 64 MiB carry limit): the first carries
# .gpu/bootstrap.sh, .gpu/site.tar.xz and .gpu-fa4-a and only sources bootstrap.sh -- importing
# flashinfer there creates its cache directory, and the second call's bootstrap then skips
# restoring the carried kernel cache (the stages would recompile it); the second carries
# .gpu/bootstrap.sh, .gpu/fi_cache.tar.xz.* and .gpu-fa4-b and runs the stages.
#   mla      tests/test_mla.py (the MLA family; real sizes, 200-batch CUDA-graph replays on the
#            GPU) and compute-sanitizer memcheck over its 16-head real-size cases
#   mlabench benchmarks/bench_mla_decode.py (TRITON_MLA against FlashInfer's MLA; MLA_ARGS)
#   mlaprefill benchmarks/bench_mla_prefill.py (the MHA form through the layer vs FA4 and
#            FlashInfer's ragged prefill called directly; the chunked merge's cost)
#   mlamodel benchmarks/bench_model_decode.py --mla --ctx 4096 (DeepSeek-V2-Lite-shaped decoder
#            against HF's DeepseekV3ForCausalLM)
#   ssm      tests/test_ssm.py and tests/test_hybrid_model.py (the recurrent-state family; its
#            Triton kernels compiled, 200-batch CUDA-graph replays; SSM_K selects)
#   ssmcheck compute-sanitizer memcheck over the recurrent-state kernels' real-size, mixed-step
#            and graph-replay tests (SSMCHECK_K: another pytest -k)
#   ssmsweep benchmarks/bench_ssm.py under each of SSM_SWEEP's ATTN_OPS_TUNING strings (space-
#            separated, "defaults" for none; default: the decode blocks and warps),
#            SSM_SWEEP_ARGS its arguments (default: decode, 5 batches, graph replays only),
#            each run under the stage's limit; JSON sweep_ssm_N.json
#            (N-th string; the JSON records the tuning)
#   ssmbench benchmarks/bench_ssm.py (GDN / Mamba2 decode and prefill against fla and
#            mamba-ssm in each of their layouts, outputs and final states cross-checked, CUDA
#            graphs and eager; SSM_ARGS, e.g. "--only decode")
#   ssmprof  benchmarks/profile_ssm_prefill.py (each chunked-prefill launch's device time) under
#            each of SSM_SWEEP's ATTN_OPS_TUNING strings in one process (default: the defaults),
#            SSM_PROF_CASES its cases (default: the script's), SSM_PROF_ARGS more arguments
#   sparse   tests/test_mla_sparse.py and tests/test_indexer.py (sparse MLA and its indexer: the
#            Triton kernels compiled, real sizes, CUDA-graph replays; SPARSE_K selects)
#   sparsecheck compute-sanitizer memcheck over the sparse MLA kernels' and the indexer's
#            real-size and device top-k tests
#   sparsebench benchmarks/bench_mla_sparse.py (a sparse MLA layer's decode step and prefill
#            against dense MLA; SPARSE_ARGS)
#   indexprof benchmarks/profile_indexer.py (each indexer launch's device time) under each of
#            INDEX_SWEEP's ATTN_OPS_TUNING strings (default: the defaults), INDEX_PROF_CASES
#   sparsesweep benchmarks/bench_mla_sparse.py under each of SPARSE_SWEEP's ATTN_OPS_TUNING
#            strings (default: TRITON_MLA_SPARSE tiles), SPARSE_SWEEP_ARGS its arguments
#            (default: decode at batch 8 and 128, 32k, TRITON_MLA as the dense contender);
#            JSON sweep_mla_sparse_N.json
#   prefix   benchmarks/bench_prefix_cache.py for each of PREFIX_KINDS (default: all four
#            recurrent kinds; 32 requests over a shared 8k prefix, cached against uncached),
#            each under the stage's limit; JSON bench_prefix_cache_KIND.json
#   tq       TurboQuant: tests/test_turboquant.py, the matrix, device-index, opcheck and CUDA-graph
#            cases of TURBOQUANT (its Triton write and TRITON_ATTN's read compiled; real sizes)
#   tqcheck  compute-sanitizer memcheck over TURBOQUANT's matrix cases, Triton, CUDA decode
#            and CUDA write tests (TQCHECK_K: another pytest -k)
#   tqsweep  for each of TQ_SWEEP's ATTN_OPS_TUNING strings ("defaults": the CUDA decode; its
#            norm correction on the tensor cores; the query rotated before it; its splits
#            longer; the Triton read; space-separated): the CUDA decode's tests (pytest -k
#            cuda_decode) under those that change its kernel (defaults, norm_mma, min_blocks,
#            fused_rotation), then
#            benchmarks/profile_turboquant_decode.py under each, each row's output checked
#            against REFERENCE; TQ_SWEEP_ARGS its arguments
#   tqncu    Nsight Compute over one TurboQuant decode launch (speed of light, memory, warp
#            stalls, occupancy; TQ_NCU_ARGS: profile_turboquant_decode.py's, default 3bit_nc
#            at B=32; TQ_NCU_KERNEL a regex, default the CUDA decode's tq_decode_kernel;
#            paged_attention for the Triton read under TQ_NCU_ARGS="... --tuning
#            triton.turboquant_cuda_decode=false", cache_write_kernel for the cache write)
#   ssmncu   Nsight Compute over one recurrent prefill launch (the tqncu sections, pipes,
#            schedulers, instruction mix, the SASS lines that stall most): SSM_NCU_KERNEL a
#            regex (default mamba1_unrolled), SSM_NCU_COUNT launches, SSM_NCU_CASES
#            profile_ssm_prefill.py's cases (default mamba1:8x2048)
#   ncu      Nsight Compute (ssmncu's sections) over NCU_COUNT launches (default 1) of the
#            kernels matching NCU_KERNEL while NCU_CMD runs (a script and its arguments), e.g.
#            NCU_KERNEL=index_score NCU_CMD="benchmarks/profile_indexer.py --cases 8x262144"
#   tqbench  benchmarks/bench_turboquant.py (decode over each preset against bf16 / fp8, the
#            write against copy; TQ_ARGS)
#   tqwrite  TurboQuant's write tests compiled, then bench_turboquant.py --only write under each
#            of TQ_WRITE_SWEEP's ATTN_OPS_TUNING strings (default: the defaults and the
#            write's tilings), JSON bench_turboquant_write_N.json
#   tqmodel  benchmarks/bench_model_decode.py --ctx 8192 --no-hf over the selector's bf16 backend
#            (TQ_MODEL_BF16 names one, e.g. COMPOSITE_SM90 where FA4 is installed) and
#            TURBOQUANT:turboquant_4bit_nc (the whole 8-layer step, bf16 against 4-bit)
#   hybrid   benchmarks/bench_hybrid_decode.py (a Qwen3-Next-like hybrid step, compiled and
#            graphed, against HF's Qwen3NextForCausalLM)
#   dsv4     tests/test_deepseek_v4.py (DeepSeek-V4: DSV4_TRITON's kernels compiled, V4-Flash
#            widths against the reference, 200 decode steps replayed in a CUDA graph)
#   dsv4check compute-sanitizer memcheck over DSV4_TRITON's kernel tests and its real sizes
#            (DSV4CHECK_K selects: about 7 minutes on the H200 reach only the kernel tests,
#            e.g. DSV4CHECK_K="gpu_real_sizes or replay" for the rest; ATTN_OPS_MEMCHECK=1:
#            the real-size test runs the backend alone over a shorter first step)
#   hf       tests/test_hf_integration.py on the GPU's transformers (5.17: paged|attn_ops too)
#   hfbench  benchmarks/bench_hf.py (generate against sdpa, generate_batch against paged|sdpa;
#            HF_ARGS, e.g. "--profile --batches 1 64": host profiles and synchronizations
#            first)
#   dsv4bench benchmarks/bench_dsv4.py (a decode step of each V4 layer kind at 128k and 1M
#            against a dense MLA layer, FlashMLA's V4 decode and the C4A key-read floor;
#            DSV4_ARGS)
#   suite    one pytest run of the CUDA-graph, whole-model graph, opcheck and FlashInfer tests
#            and the base-size matrix (SUITE_K selects; default: not the real-size cases)
# PYTEST_FLAGS (default -q) replaces the pytest verbosity flag, e.g. "-v --durations=20".
# PYTEST_WORKERS=N runs those pytest stages over N pytest-xdist workers (compile-bound: ten
# workers run the suite about five times faster); carry .gpu/xdist, pytest-xdist and execnet
# unpacked (`pip download --no-deps pytest-xdist execnet`, then `python -m zipfile -e` each
# wheel into it). A worker whose CUDA context faults exits after its report (tests/conftest.py).
# Everything goes to $OUT/round.log (the device tool returns at most 8 files) and the benchmarks'
# JSON to $OUT; the summary lines (pass/fail counts, benchmark rows) are printed last.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# The GPU machine's copy may carry stale git metadata: pass ATTN_OPS_COMMIT=<the commit you
# sent> in the command.
export ATTN_OPS_COMMIT=${ATTN_OPS_COMMIT:-unknown-pass-ATTN_OPS_COMMIT}
LOG="$OUT/round.log"
if [ -n "${PYTEST_WORKERS:-}" ]; then
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/.gpu/xdist
  PYTEST_FLAGS="${PYTEST_FLAGS:--q} -n $PYTEST_WORKERS"
fi
SUMMARY=$(mktemp)
# Nsight Compute's sections for one launch: speed of light, memory, warp stalls, occupancy.
NCU_SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats
              --section Occupancy --section LaunchStats)

stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG" "$SUMMARY"
}

ncu_stage() {  # ncu_stage NAME SECONDS KERNEL_REGEX LAUNCHES SCRIPT ARGS...: the pipes,
  # schedulers, instruction mix and the SASS lines that stall most, beside NCU_SECTIONS
  local name=$1 limit=$2 kernel=$3 count=$4
  shift 4
  stage "$name" "$limit" ncu --kernel-name "regex:$kernel" --launch-count "$count" \
    "${NCU_SECTIONS[@]}" --section ComputeWorkloadAnalysis --section SchedulerStats \
    --section InstructionStats --section SourceCounters python "$@"
}

for spec in "$@"; do
  name=${spec%%:*}
  limit=${spec#*:}
  [ "$limit" = "$spec" ] && limit=300
  case $name in
    tests) stage tests "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_glue.py tests/test_compile_passes.py tests/test_flashinfer.py \
        tests/test_cudagraph.py ;;
    fi) stage fi "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE tests/test_flashinfer.py \
        tests/test_cudagraph.py -k "flashinfer or FLASHINFER" ;;
    matrix) stage matrix "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_backends_matrix.py -k "${MATRIX_K:-real_size or FLASHINFER or TRITON}" ;;
    fa4) stage fa4 "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_backends_matrix.py tests/test_flash_attn_glue.py tests/test_cudagraph.py \
        -k "FLASH_ATTN or COMPOSITE_SM90 or fa4 or flash_attn or composite" ;;
    model) stage model "$limit" python benchmarks/bench_model_decode.py \
        ${MODEL_BACKENDS:+--backends $MODEL_BACKENDS} ;;
    grid) stage grid "$limit" python benchmarks/bench_gpu_attention.py ${GRID_ARGS:---rounds 2} ;;
    cgraph) stage cgraph "$limit" python benchmarks/bench_cudagraph_decode.py \
        --out "$OUT/bench_cudagraph_decode_h200.json" ;;
    triton) stage triton "$limit" python benchmarks/bench_triton_attention.py --rounds 1 ;;
    kvwrite) stage kvwrite "$limit" python benchmarks/bench_kv_write.py \
        --out "$OUT/bench_kv_write_h200.json" ;;
    tattn) stage tattn "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_triton_attn.py ;;
    ops) stage ops "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE tests/test_ops.py ;;
    builder) stage builder "$limit" python benchmarks/profile_builder.py ;;
    eager) stage eager "$limit" python benchmarks/profile_eager_op.py ;;
    tfused) ATTN_OPS_TUNING=triton.fused_combine=true stage tfused "$limit" python -m pytest -q \
        -p no:cacheprovider -rfE tests/test_triton_attn.py tests/test_tree_attn.py \
        tests/test_cudagraph.py tests/test_backends_matrix.py -k "TRITON or TREE or triton or tree" ;;
    page128) stage page128 "$limit" python benchmarks/bench_triton_attention.py --rounds 1 \
        --page 128 --out "$OUT/bench_triton_attention_page128_h200.json" ;;
    memcheck) stage memcheck "$limit" compute-sanitizer --tool memcheck --report-api-errors no \
        python -m pytest -q \
        -p no:cacheprovider tests/test_triton_attn.py tests/test_tree_attn.py -k \
        "(split_kv and plain) or padding_rows or page_sizes or every_dtype or (ancestors and not fp8)" ;;
    psweep) stage psweep "$limit" python benchmarks/sweep_kernel_configs.py --only prefill \
        ${PSWEEP_ARGS:-} --out "$OUT/sweep_prefill_h200.json" ;;
    dsweep) stage dsweep "$limit" python benchmarks/sweep_kernel_configs.py --only decode \
        ${DSWEEP_ARGS:-} --out "$OUT/sweep_decode_h200.json" ;;
    tsweep) stage tsweep "$limit" python benchmarks/sweep_kernel_configs.py --only triton-prefill \
        --page 16 --rounds 1 --out "$OUT/sweep_triton_prefill_h200.json" ;;
    flex) stage flex "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_flex_attention.py tests/test_backends_matrix.py -k "FLEX or flex" ;;
    suite) stage suite "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_cudagraph.py tests/test_model_graphs.py tests/test_ops.py \
        tests/test_flashinfer.py tests/test_backends_matrix.py \
        -k "${SUITE_K:-not real_size and not gqa_groups}" ;;
    mla) stage mla "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_mla.py
      stage mla_memcheck "$limit" compute-sanitizer --tool memcheck --report-api-errors no \
        python -m pytest -q \
        -p no:cacheprovider tests/test_mla.py -k "real_sizes and 16" ;;
    mlabench) stage mlabench "$limit" python benchmarks/bench_mla_decode.py ${MLA_ARGS:-} \
        --out "$OUT/bench_mla_decode_h200.json" ;;
    mlaprefill) stage mlaprefill "$limit" python benchmarks/bench_mla_prefill.py \
        --out "$OUT/bench_mla_prefill_h200.json" ;;
    mlamodel) stage mlamodel "$limit" python benchmarks/bench_model_decode.py --mla --ctx 4096 \
        --out "$OUT/bench_model_decode_mla_h200.json" ;;
    ssm) stage ssm "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_ssm.py tests/test_hybrid_model.py -k "${SSM_K:-}" ;;
    ssmcheck) k="${SSMCHECK_K:-(real_sizes and bfloat16) or (triton_kernels and mixed) or graph_replays}"
      # (the real sizes in a process of their own: after the others in one memcheck process,
      # lightning's real-size references once found the device memory held)
      for part in "not real_sizes" "real_sizes"; do
        stage "ssmcheck ($part)" "$limit" compute-sanitizer --tool memcheck \
          --report-api-errors no python -m pytest -q -p no:cacheprovider tests/test_ssm.py \
          -k "($k) and $part"
      done ;;
    ssmsweep) i=0
      for cfg in ${SSM_SWEEP:-ssm.decode_block_v=32,ssm.decode_block_p=32 ssm.decode_block_v=16,ssm.decode_block_p=16 ssm.decode_block_v=64,ssm.decode_block_p=64 ssm.decode_num_warps=2 ssm.decode_num_warps=8 ssm.decode_block_v=64,ssm.decode_block_p=64,ssm.decode_num_warps=8 ssm.decode_block_v=128,ssm.decode_num_warps=8}; do
        i=$((i + 1))
        [ "$cfg" = defaults ] && cfg=""
        echo "ssmsweep $i: ${cfg:-defaults}" >> "$LOG"
        ATTN_OPS_TUNING="$cfg" stage "ssmsweep_$i" "$limit" python benchmarks/bench_ssm.py \
          ${SSM_SWEEP_ARGS:---only decode --batches 1 8 64 256 1024 --rounds 1 --no-eager} \
          --out "$OUT/sweep_ssm_$i.json"
      done ;;
    ssmbench) stage ssmbench "$limit" python benchmarks/bench_ssm.py ${SSM_ARGS:-} \
        --out "$OUT/bench_ssm_h200.json" ;;
    ssmprof) stage ssmprof "$limit" python benchmarks/profile_ssm_prefill.py \
        --tunings ${SSM_SWEEP:-defaults} ${SSM_PROF_CASES:+--cases $SSM_PROF_CASES} ${SSM_PROF_ARGS:-} ;;
    sparse) stage sparse "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_mla_sparse.py tests/test_indexer.py -k "${SPARSE_K:-}" ;;
    sparsecheck) stage sparsecheck "$limit" compute-sanitizer --tool memcheck \
        --report-api-errors no python -m pytest -q -p no:cacheprovider tests/test_mla_sparse.py \
        tests/test_indexer.py -k "(real_sizes and bf16) or device or flashinfer_sparse_at" ;;
    sparsebench) stage sparsebench "$limit" python benchmarks/bench_mla_sparse.py \
        ${SPARSE_ARGS:-} --out "$OUT/bench_mla_sparse_h200.json" ;;
    indexprof) i=0
      for cfg in ${INDEX_SWEEP:-defaults}; do
        i=$((i + 1))
        echo "## indexprof $i: $cfg" | tee -a "$LOG" >> "$SUMMARY"
        ATTN_OPS_TUNING="${cfg#defaults}" stage "indexprof_$i" "$limit" \
          python benchmarks/profile_indexer.py ${INDEX_PROF_CASES:+--cases $INDEX_PROF_CASES}
      done ;;
    sparsesweep) i=0
      for cfg in ${SPARSE_SWEEP:-mla.sparse_heads=16 mla.sparse_heads=64,mla.sparse_keys=64,mla.sparse_warps=8 mla.sparse_heads=32,mla.sparse_keys=64,mla.sparse_warps=4 mla.sparse_heads=64,mla.sparse_keys=32,mla.sparse_warps=8,mla.sparse_stages=3}; do
        i=$((i + 1))
        echo "sparsesweep $i: $cfg" >> "$LOG"
        ATTN_OPS_TUNING="$cfg" stage "sparsesweep_$i" "$limit" python benchmarks/bench_mla_sparse.py \
          ${SPARSE_SWEEP_ARGS:---only decode --batches 8 128 --ctxs 32768 --dense TRITON_MLA} \
          --out "$OUT/sweep_mla_sparse_$i.json"
      done ;;
    prefix) for kind in ${PREFIX_KINDS:-gated_deltanet mamba2 mamba1 lightning}; do
        stage "prefix_$kind" "$limit" python benchmarks/bench_prefix_cache.py --kind "$kind" \
          --out "$OUT/bench_prefix_cache_$kind.json"
      done ;;
    tq) stage tq "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_turboquant.py tests/test_backends_matrix.py tests/test_device_indices.py \
        tests/test_ops.py tests/test_cudagraph.py -k "turbo or TURBO" ;;
    tqcheck) stage tqcheck "$limit" compute-sanitizer --tool memcheck --report-api-errors no \
        python -m pytest -q -p no:cacheprovider tests/test_turboquant.py \
        tests/test_backends_matrix.py -k "${TQCHECK_K:-TURBOQUANT and (mixed or long_context) or triton or cuda_decode or cuda_write}" ;;
    tqsweep) sweep=${TQ_SWEEP:-defaults triton.turboquant_cuda_norm_mma=true triton.turboquant_cuda_fused_rotation=false triton.turboquant_cuda_split_keys=512 triton.turboquant_cuda_decode=false}
      for cfg in $sweep; do
        [ "$cfg" = defaults ] && cfg=""
        case "$cfg" in ""|*norm_mma*|*min_blocks*|*fused_rotation*)  # (another kernel or path)
          ATTN_OPS_TUNING="$cfg" stage "tqsweep_tests ${cfg:-defaults}" "$limit" python -m pytest \
            ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE tests/test_turboquant.py -k cuda_decode ;;
        esac
      done
      for cfg in $sweep; do
        [ "$cfg" = defaults ] && cfg=""
        stage "tqsweep ${cfg:-defaults}" "$limit" python benchmarks/profile_turboquant_decode.py \
          --tuning "$cfg" ${TQ_SWEEP_ARGS:---batch 8 32 --presets turboquant_4bit_nc turboquant_k3v4_nc turboquant_3bit_nc turboquant_k8v4}
      done ;;
    tqncu) stage tqncu "$limit" ncu --kernel-name "regex:${TQ_NCU_KERNEL:-tq_decode_kernel}" \
        --launch-count 1 "${NCU_SECTIONS[@]}" python benchmarks/profile_turboquant_decode.py \
        --iters 1 ${TQ_NCU_ARGS:---batch 32 --presets turboquant_3bit_nc} ;;
    ssmncu) ncu_stage ssmncu "$limit" "${SSM_NCU_KERNEL:-mamba1_unrolled}" "${SSM_NCU_COUNT:-1}" \
        benchmarks/profile_ssm_prefill.py --iters 1 --cases ${SSM_NCU_CASES:-mamba1:8x2048} ;;
    ncu) ncu_stage ncu "$limit" "${NCU_KERNEL:?NCU_KERNEL: a kernel regex}" "${NCU_COUNT:-1}" \
        ${NCU_CMD:?NCU_CMD: a script and its arguments} ;;
    tqbench) stage tqbench "$limit" python benchmarks/bench_turboquant.py ${TQ_ARGS:-} \
        --out "$OUT/bench_turboquant_h200.json" ;;
    tqwrite) stage tqwrite_tests "$limit" python -m pytest ${PYTEST_FLAGS:--q} \
        -p no:cacheprovider -rfE tests/test_turboquant.py -k "write"
      i=0
      for cfg in ${TQ_WRITE_SWEEP:-defaults triton.turboquant_write_warps=4 triton.turboquant_write_tokens=32 triton.turboquant_write_tokens=32,triton.turboquant_write_warps=4}; do
        i=$((i + 1))
        [ "$cfg" = defaults ] && cfg=""
        echo "tqwrite $i: ${cfg:-defaults}" >> "$LOG"
        ATTN_OPS_TUNING="$cfg" stage "tqwrite_$i" "$limit" python benchmarks/bench_turboquant.py \
          --only write --rounds 2 --out "$OUT/bench_turboquant_write_$i.json"
      done ;;
    tqmodel) stage tqmodel "$limit" python benchmarks/bench_model_decode.py --ctx 8192 --no-hf \
        --backends ${TQ_MODEL_BF16:-auto} TURBOQUANT:turboquant_4bit_nc \
        --out "$OUT/bench_model_decode_turboquant_h200.json" ;;
    dsv4) stage dsv4 "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_deepseek_v4.py ;;
    dsv4check) ATTN_OPS_MEMCHECK=1 stage dsv4check "$limit" compute-sanitizer --tool memcheck \
        --report-api-errors no python -m pytest -q -p no:cacheprovider \
        tests/test_deepseek_v4.py -k "${DSV4CHECK_K:-triton or gpu_real_sizes}" ;;
    hf) stage hf "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rfE \
        tests/test_hf_integration.py ;;
    hfbench) stage hfbench "$limit" python benchmarks/bench_hf.py ${HF_ARGS:-} \
        --out "$OUT/bench_hf_h200.json" ;;
    dsv4bench) stage dsv4bench "$limit" python benchmarks/bench_dsv4.py ${DSV4_ARGS:-} \
        --out "$OUT/bench_dsv4_h200.json" ;;
    hybrid) stage hybrid "$limit" python benchmarks/bench_hybrid_decode.py \
        --out "$OUT/bench_hybrid_decode_h200.json" ;;
    graphs) stage graphs "$limit" python -m pytest ${PYTEST_FLAGS:--q} -p no:cacheprovider -rA \
        tests/test_model_graphs.py ;;
    *) echo "unknown stage $name" ;;
  esac
done
echo "##### summary"
cat "$SUMMARY"
# pytest's result lines, failures and the benchmarks' printed rows
grep -E "^(FAILED|ERROR|PASSED)|ERROR SUMMARY|passed|failed|^\{|^\||^(decode|prefill|triton prefill|B=|H=|1x8k|4x4k|16x1k|4k_over_28k|generate|generate_batch|write) |^    .* us |^    built: |^== |^## |^   failed: |^ +[0-9.]+ ms  x[0-9]+ +(gdn|ssd)_|^ +[0-9.]+ us  x[0-9]+ |^(gated_deltanet|mamba2|mamba1|lightning) +(cached|uncached|first)|^turboquant_[a-z0-9_]+ +B=" \
  "$LOG" \
  | grep -v -E "DEBUG|Warning" | tail -n 80
