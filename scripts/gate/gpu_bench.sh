#!/usr/bin/env bash
# Benchmarks on the GPU machine (one or two H200s): build the extension in place, then the phases
# named in MEP_GPU_STEPS: the normal-path benchmark (one process per GPU when the GPUs suffice,
# with DeepEP and NCCL baselines), the low-latency benchmark, the Megatron A/B runs, the NVLink
# roofline, DeepGEMM's expert tests. Logs go under $OUT. The tests are scripts/gate/gpu_check.sh (the
# gate); run it first: a figure counts only for code that passed it.
#   MEP_GPU_STEPS   phases, comma-separated: build,bench,megatron,lowlat,host,overlap,deepep,gemm,deepgemm,link
#                   (default build,bench)
#   link            the NVLink roofline between GPUs 0 and 1 (scripts/bench link MEP_LINK_ARGS: copy
#                   engine, SM stores, bulk copies; one way and both ways) -> $OUT/link.md
#   lowlat          scripts/bench low-latency --ranks ${MEP_LL_RANKS:-2} (MEP_LL_BENCH_ARGS) -> $OUT/ll_bench.md
#   megatron        the Megatron A/B runs of MEP_AB_ARGS (scripts/ab_throughput.py)
#   overlap         scripts/bench overlap --ranks ${MEP_OVERLAP_RANKS:-2} (MEP_OVERLAP_ARGS): chunked
#                   experts against one round, the forward timeline, the model -> $OUT/overlap.log
#   deepgemm        DeepGEMM under our expert glue (the gate runs the same tests): waits for scripts/env/build_deepgemm.sh's build of .carry/deepgemm (started
#                   at the top; MEP_DG_WAIT seconds, default 300), takes /tmp/deepgemm.env (PYTHONPATH,
#                   DG_JIT_CACHE_DIR, LD_PRELOAD) for this phase only, then under MPS: every GPU test of
#                   tests/unit/test_experts.py (masked bf16/FP8 GEMMs, the decode experts in a CUDA graph,
#                   contiguous GEMMs), tests/unit/test_deepgemm.py (FP8 dispatch into DeepGEMM, chunked experts
#                   on DeepGEMM) and the decode layer in one CUDA graph from
#                   tests/cuda/test_cuda_low_latency.py (needs the build phase's extension)
#                   -> $OUT/deepgemm_tests.log (MEP_DG_TEST_ARGS; MEP_DG_TEST_TIMEOUT, default 300 s, for
#                   each of the two pytest runs). Without a usable deep_gemm the DeepGEMM cases skip,
#                   the fallback's run, and the phase fails
#   deepep          DeepEP's own test files (.carry/deepep, CONTRIBUTING.md) on megatron_ep.deep_ep at each of
#                   MEP_DEEPEP_RANKS (default 2,4,8) virtual ranks: tests/test_intranode.py (--num-tokens 1024
#                   --num-experts 64) and tests/test_low_latency.py (its defaults), each run's whole output
#                   under a header in $OUT/deepep_runs.log and their result and figure lines in
#                   $OUT/deepep_prints.txt (MEP_DEEPEP_TIMEOUT, default 300 s, per run). One GPU's virtual
#                   ranks share it: correctness and the prints' shape, not speed figures
#   gemm            the routed-expert GEMMs on one GPU (scripts/bench gemm MEP_GEMM_ARGS, default
#                   --jit-jobs 6: DeepGEMM's kernels compiled in 6 processes first), waits for the DeepGEMM
#                   build like the deepgemm phase -> $OUT/gemm.md, $OUT/gemm.json
#   host            host cost per call (scripts/bench host --ranks ${MEP_HOST_RANKS:-2} MEP_HOST_ARGS: ours,
#                   megatron_ep.deep_ep and DeepEP V1 when its full build imports) -> $OUT/host.md, and
#                   $OUT/host.log (the profiles with --profile N); with MEP_HOST_BASE=DIR (another
#                   commit's tree, `git archive COMMIT setup.py csrc megatron_ep`, carried) that tree is
#                   built beside this one and measured as the implementation `base` (--base DIR)
#   MEP_BENCH_ARGS  scripts/bench normal arguments (default: --ranks 2 --num-sms 8,16,24)
#   MEP_RECIPE_ARGS the recipe's model flags for the Megatron step table
# Wheels under .whl/ (megatron-core for Python 3.12, carried) are installed to /tmp/site first.
# If a DeepEP tree is at .carry/deepep-src (scripts/env/build_deepep.sh --help: a peer built on the GPU
# machine from a snapshot the user gives, never part of this repository), DeepEP's build starts in
# the background and the bench, lowlat and host phases wait for it; likewise the DeepGEMM build
# for the deepgemm phase.
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/.gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 NVSHMEM_DISABLE_MNNVL=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1
STEPS=${MEP_GPU_STEPS:-build,bench}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
phase() { echo "=== $1 ($(date +%T))"; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mep-mps-log
MPS=0
start_mps() { mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"; nvidia-cuda-mps-control -d && MPS=1 && echo "MPS started"; }
stop_mps() { [ "$MPS" = 1 ] && { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; MPS=0; }; return 0; }
trap stop_mps EXIT
status=0
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
NGPU=$(nvidia-smi -L | wc -l)
DEEPEP=0; [ -f .carry/deepep-src/setup.py ] && DEEPEP=1
if [ "$DEEPEP" = 1 ] && { has bench || has megatron; }; then
  bash scripts/env/build_deepep.sh intranode > /tmp/deepep_start.log 2>&1
fi
# (a full build already done on this machine, e.g. started beside the gate, is kept)
if [ "$DEEPEP" = 1 ] && { has lowlat || has host; } && [ ! -e /tmp/deepep_full.ok ]; then  # its LL kernels: pip NVSHMEM
  bash scripts/env/build_deepep.sh full > /tmp/deepep_full_start.log 2>&1
fi
# PYTHONPATH with DeepEP's MODE build first once it is done (up to $2 s), as it is without one
deepep_path() {
  for _ in $(seq "$2"); do [ "$DEEPEP" = 0 ] || [ -e "/tmp/deepep_$1.done" ] && break; sleep 1; done
  cat "/tmp/deepep_$1.done" >&2 2>/dev/null
  if [ -e "/tmp/deepep_$1.ok" ]; then echo "/tmp/deepep/$1${PYTHONPATH:+:$PYTHONPATH}"; else echo "${PYTHONPATH:-}"; fi
}
if [ -d .carry/deepgemm ] && { has deepgemm || has gemm; }; then  # one C++ file, beside the build phase
  ( bash scripts/env/build_deepgemm.sh .carry/deepgemm /tmp/deepgemm-site > /tmp/deepgemm_build.log 2>&1 \
      && cp /tmp/deepgemm-site/env.sh /tmp/deepgemm.env && touch /tmp/deepgemm.ok
    tail -1 /tmp/deepgemm_build.log > /tmp/deepgemm.done ) &
fi

if [ -n "${MEP_HOST_BASE:-}" ] && has host; then  # the other commit's tree, built beside this one's
  rm -f /tmp/base_build.ok /tmp/base_build.done
  ( cd "$MEP_HOST_BASE" && MAX_JOBS=8 python3 setup.py build_ext --inplace > /tmp/base_build.log 2>&1 \
      && touch /tmp/base_build.ok; tail -1 /tmp/base_build.log > /tmp/base_build.done ) &
fi
if has build; then
  phase build
  if ! MAX_JOBS=16 MEGATRON_EP_PTXAS_VERBOSE=1 python3 setup.py build_ext --inplace > /tmp/build.log 2>&1; then
    tail -40 /tmp/build.log; exit 1
  fi
  grep -E "Compiling entry|registers|spill" /tmp/build.log | sed 's/ptxas info *: //' > "${MEP_PTXAS_OUT:-$OUT}/ptxas.txt"
  python3 -c "import megatron_ep as m; print('extension usable:', m.cuda_backend_available())"
fi
if has link; then
  phase link
  timeout "${MEP_LINK_TIMEOUT:-180}" python3 scripts/bench link ${MEP_LINK_ARGS:-} > "$OUT/link.md" 2>&1 \
    || { status=1; echo "link failed"; }
  cat "$OUT/link.md"
fi
if has bench; then
  phase bench
  PYTHONPATH=$(deepep_path intranode 240); export PYTHONPATH
  args=${MEP_BENCH_ARGS:---ranks 2 --num-sms 8,16,24}
  r=$(echo "$args" | sed -n 's/.*--ranks \([0-9]*\).*/\1/p'); r=${r:-2}
  [ "$r" -gt "$NGPU" ] && start_mps
  timeout "${MEP_BENCH_TIMEOUT:-300}" python3 scripts/bench normal $args --json "$OUT/bench.json" --markdown "$OUT/bench.md" \
    > /tmp/bench.log 2>&1 || { status=1; echo "bench failed"; }
  grep -v "^\[" /tmp/bench.log | tail -70
  stop_mps
fi
if has lowlat; then
  phase lowlat
  llr=${MEP_LL_RANKS:-2}
  llpath=$(deepep_path full 240)  # the full DeepEP build first: an intranode-only one has no LL kernels
  [ "$llr" -gt "$NGPU" ] && start_mps
  PYTHONPATH=$llpath timeout "${MEP_LL_BENCH_TIMEOUT:-400}" python3 scripts/bench low-latency --ranks "$llr" ${MEP_LL_BENCH_ARGS:-} \
    --markdown "$OUT/ll_bench.md" --json "$OUT/ll_bench.json" > "$OUT/ll_bench.log" 2>&1 || { status=1; echo "LL bench failed"; }
  grep -v "^\[" "$OUT/ll_bench.log" | tail -30
  stop_mps
fi
if has host; then
  phase host
  hr=${MEP_HOST_RANKS:-2}
  hpath=$(deepep_path full 300)
  base=()
  if [ -n "${MEP_HOST_BASE:-}" ]; then
    for _ in $(seq 600); do [ -e /tmp/base_build.done ] && break; sleep 1; done
    if [ -e /tmp/base_build.ok ]; then base=(--base "$MEP_HOST_BASE"); else
      status=1; echo "the base tree $MEP_HOST_BASE did not build:"; tail -20 /tmp/base_build.log; fi
  fi
  [ "$hr" -gt "$NGPU" ] && start_mps
  # shellcheck disable=SC2086
  PYTHONPATH=$hpath timeout "${MEP_HOST_TIMEOUT:-400}" python3 scripts/bench host --ranks "$hr" ${MEP_HOST_ARGS:-} \
    ${base[@]+"${base[@]}"} > "$OUT/host.log" 2>&1 || { status=1; echo "host bench failed"; }
  grep "^|" "$OUT/host.log" > "$OUT/host.md"
  grep -v "^\[" "$OUT/host.log" | grep -v "^ " | tail -40
  stop_mps
fi
if has overlap; then
  phase overlap
  ovr=${MEP_OVERLAP_RANKS:-2}
  [ "$ovr" -gt "$NGPU" ] && start_mps
  # shellcheck disable=SC2086
  timeout "${MEP_OVERLAP_TIMEOUT:-300}" python3 scripts/bench overlap --ranks "$ovr" ${MEP_OVERLAP_ARGS:-} \
    > "$OUT/overlap.log" 2>&1 || { status=1; echo "overlap bench failed"; }
  tail -30 "$OUT/overlap.log"
  stop_mps
fi
if has deepep; then
  phase deepep
  if [ ! -f .carry/deepep/tests/test_intranode.py ]; then
    echo "no DeepEP test files at .carry/deepep (CONTRIBUTING.md, \"DeepEP's own tests\")"; status=1
  else
    start_mps
    : > "$OUT/deepep_runs.log"; : > "$OUT/deepep_prints.txt"
    ranks=${MEP_DEEPEP_RANKS:-2,4,8}
    for r in ${ranks//,/ }; do
      for t in intranode low_latency; do
        args=(); [ "$t" = intranode ] && args=(--num-tokens 1024 --num-experts 64)
        echo "=== tests/test_$t.py, $r virtual ranks" | tee -a "$OUT/deepep_prints.txt" >> "$OUT/deepep_runs.log"
        timeout -k 10 "${MEP_DEEPEP_TIMEOUT:-300}" python3 scripts/deepep_tests.py --checkout .carry/deepep --test "$t" \
          --num-processes "$r" -- "${args[@]}" > /tmp/mep-deepep-run.log 2>&1
        rc=$?
        cat /tmp/mep-deepep-run.log >> "$OUT/deepep_runs.log"
        grep -E "Best|bandwidth|send/recv time|Kernel performance" /tmp/mep-deepep-run.log >> "$OUT/deepep_prints.txt"
        echo "exit $rc, $(grep -c 'passed' /tmp/mep-deepep-run.log) passed lines" | tee -a "$OUT/deepep_prints.txt"
        [ "$rc" = 0 ] || status=1
      done
    done
    stop_mps
  fi
fi
wait_deepgemm() {  # wait_deepgemm LOG: the background DeepGEMM build's end, said in LOG
  if [ -d .carry/deepgemm ]; then
    for _ in $(seq "${MEP_DG_WAIT:-300}"); do [ -e /tmp/deepgemm.done ] && break; sleep 1; done
    echo "DeepGEMM build: $(cat /tmp/deepgemm.done 2>/dev/null || echo 'not finished')" | tee -a "$1"
    [ -e /tmp/deepgemm.ok ] || { status=1; tail -30 /tmp/deepgemm_build.log 2>/dev/null | tee -a "$1"; }
  fi
}
if has gemm; then
  phase gemm
  wait_deepgemm "$OUT/gemm.log"
  (
    if [ -e /tmp/deepgemm.ok ]; then . /tmp/deepgemm.env; fi
    # shellcheck disable=SC2086
    MEP_DEEPGEMM_REVISION=$(cat .carry/deepgemm/REVISION 2>/dev/null | head -1) exec timeout "${MEP_GEMM_TIMEOUT:-360}" \
      python3 scripts/bench gemm ${MEP_GEMM_ARGS:---jit-jobs 6} --markdown "$OUT/gemm.md" --json "$OUT/gemm.json"
  ) >> "$OUT/gemm.log" 2>&1 || { status=1; echo "expert GEMM bench failed"; }
  grep -v '^{' "$OUT/gemm.log" | tail -50
fi
if has deepgemm; then
  phase deepgemm
  dglog=$OUT/deepgemm_tests.log
  wait_deepgemm "$dglog"
  start_mps
  eval "dgargs=(${MEP_DG_TEST_ARGS:-})"
  # two runs, so a crash in the single-process GEMM tests still leaves the decode-layer run
  for dgtests in "tests/unit/test_experts.py tests/unit/test_deepgemm.py" \
      "tests/cuda/test_cuda_low_latency.py::test_decode_layer tests/cuda/test_cuda_low_latency.py::test_decode_layer_one_graph"; do
    (
      if [ -e /tmp/deepgemm.ok ]; then . /tmp/deepgemm.env; fi
      python3 -c "import deep_gemm" 2>&1 | tail -3
      exec timeout "${MEP_DG_TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -rs $dgtests "${dgargs[@]}"
    ) 2>&1 | tee -a "$dglog" | grep -vE "^\s*$" | tail -30
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
  stop_mps
fi
if has megatron; then
  phase megatron
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" || status=1
  [ -e /tmp/deepep_intranode.ok ] && export PYTHONPATH=/tmp/deepep/intranode${PYTHONPATH:+:$PYTHONPATH}
  # A/B runs, one process per GPU: MEP_AB_ARGS holds one argument list per run, separated by '|'
  i=0
  IFS='|' read -ra ab_runs <<< "${MEP_AB_ARGS:-}"
  for ab in "${ab_runs[@]}"; do
    i=$((i + 1))
    echo "--- A/B $i: $ab"
    timeout "${MEP_AB_TIMEOUT:-240}" python3 scripts/ab_throughput.py --nproc-per-node "$NGPU" $ab > "$OUT/ab$i.log" 2>&1 \
      || { status=1; echo "A/B $i failed"; }
    grep -v "^\[" "$OUT/ab$i.log" | tail -${MEP_AB_TAIL:-16}
  done
fi
exit $status
