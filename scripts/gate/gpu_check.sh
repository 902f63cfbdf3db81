#!/usr/bin/env bash
# The GPU gate (CONTRIBUTING.md): on a machine with one or two Hopper GPUs, build the extension in
# place and run every GPU test of every path, then one compute-sanitizer pass on a small case of
# each path. One summary line per test file; the record docs/gpu-status.md is rewritten for the
# files that ran (the copy under $OUT is the one to bring back and commit).
#
#   bash scripts/gate/gpu_check.sh          the gate (one H200: under 9 minutes, build included)
#   bash scripts/gate/gpu_check.sh long     the long runs: MEP_FUZZ_CASES (default 1000) fuzz seeds per
#                                      R = 2, 4, 8, the MEP_SOAK_ITERS (default 10000) soak, and the
#                                      racecheck and synccheck on the intranode case
#   bash scripts/gate/gpu_check.sh e2e      Megatron-LM's pretrain_gpt.py on our managers, experts and
#                                      chunks against alltoall (tests/megatron/test_megatron_lm.py), then its
#                                      TestFlexDispatcher on megatron_ep.deep_ep and our kernels
#                                      (tests/megatron/test_megatron_lm_dispatcher.py), from the
#                                      trees MEGATRON_LM_DIR (default .carry/megatron-lm-main) and
#                                      MEGATRON_LM_R019_DIR (.carry/megatron-lm-r0.19); the runs' logs
#                                      and numbers land under $OUT/e2e
#   MEP_GATE_COMMIT=<sha>              the commit under test, for the record (else git rev-parse HEAD)
#   MEP_GATE_FILES="a.py b.py"         only these test files (e2e: which of its two files; the record
#                                      then names only them)
#   MEP_GATE_PYTEST="..."              extra pytest arguments for every file
#   MEP_GATE_SANITIZER=split           memcheck over each path's own suite (three pools) instead of
#                                      tests/cuda/test_sanitizer_pass.py (one pool); =none: no memcheck (a
#                                      MEP_GATE_FILES run whose code's memcheck row another run wrote)
#   MEP_GATE_BUDGET_S=590              the whole run's wall-clock budget: each file's timeout is cut to
#                                      what is left of it, so the run ends (and reports) inside it
#   MEP_GATE_RESERVE_S=120             of that budget, what the test files leave for the steps after
#                                      them (the no-MPS tests beside memcheck: about 90 s on one H200)
#   MEP_GATE_SANITIZER_LOADING=LAZY    module loading of the runs without MPS (the no-MPS tests and
#                                      the sanitizer; EAGER loads, and instruments, every kernel of
#                                      every library)
#
# Virtual ranks (R processes on one GPU, CUDA IPC between them) run under MPS, started here; with
# two GPUs rank r takes GPU r % 2, so R = 2 is one process per GPU. Every test has a time limit
# (tests/conftest.py) and every file a timeout here, so nothing can hang the run. Benchmarks are
# scripts/gate/gpu_bench.sh. A DeepGEMM tree at .carry/deepgemm (scripts/env/deepgemm_tree.sh; MEP_GATE_DEEPGEMM=DIR
# for another) is built beside the extension (scripts/env/build_deepgemm.sh, its kernels' JIT cache inside
# the run) and the gate's tests run with it importable; without one DeepGEMM's cases skip, and the
# record's "build deepgemm" row says why. Wheels under .whl/ (megatron-core for the GPU image's Python) are
# installed to /tmp/site first.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
MODE=${1:-gate}
case "$MODE" in
  gate|long|e2e) ;;
  -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: $0 [gate|long|e2e] (--help says more)" >&2; exit 2 ;;
esac
OUT=${OUT:-$ROOT/.gpu_out}
# packed into $OUT/logs.tar.gz at the end (a device call brings few files back); a folder of this
# run's own, junit records included: a record an earlier run left in /tmp must never stand for
# this run's
LOGS=$(mktemp -d /tmp/mep-gate-logs.XXXXXX)
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 NVSHMEM_DISABLE_MNNVL=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mep-mps-log
export MEP_DEEPEP_OUT=${MEP_DEEPEP_OUT:-$OUT/deepep}  # DeepEP's own test files' output (tests/deep_ep/test_deepep_suite.py)
GATE_START=$(date +%s)
# module loading of the runs without MPS (the no-MPS tests, the sanitizer tools): lazy, since each
# process has its own context there (under MPS one context serves every rank, and a kernel loaded
# lazily could wait behind a peer's spinning one: eager)
NO_MPS_LOADING=${MEP_GATE_SANITIZER_LOADING:-LAZY}
BUDGET=${MEP_GATE_BUDGET_S:-590}
left() { local l=$(( BUDGET - ($(date +%s) - GATE_START) - ${2:-0} )); [ "$l" -lt "$1" ] && echo $(( l > 5 ? l : 5 )) || echo "$1"; }
RESULTS=$OUT/results.tsv  # file, passed, failed, skipped, seconds, note
: > "$RESULTS"
status=0
MPS=0
start_mps() { [ "$MPS" = 1 ] && return 0; mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
              nvidia-cuda-mps-control -d && MPS=1; }
stop_mps() { [ "$MPS" = 1 ] && { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; MPS=0; }; return 0; }
finish() { stop_mps; tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; rm -rf "$LOGS"; }  # (a folder per run: packed, then gone)
trap finish EXIT

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
NGPU=$(nvidia-smi -L | wc -l)

# ---- build: _protocol and _C (intranode) in one build, _C_nvshmem (the NVSHMEM paths) in another at the
# same time (each with its own build directory); both done before any test (the intranode suite's
# bad-input cases reach the low-latency path too). MEP_GATE_REUSE_BUILD=1 keeps an extension
# already built in this tree (e.g. the long mode right after the gate).
# torch first: the extensions link its libraries, and `import megatron_ep` alone no longer loads torch
usable() { python3 -c "import torch, megatron_ep as m, megatron_ep.backends.cuda.extension as ext, sys; ext.load_nvshmem(); \
sys.exit(0 if m.cuda_backend_available() else 1)" 2>> "$LOGS/build.log"; }
build_one() {  # build_one NAMES TEMP LOG
  MEGATRON_EP_BUILD_ONLY=$1 MAX_JOBS=$(nproc) MEGATRON_EP_PTXAS_VERBOSE=1 MEGATRON_EP_REQUIRE_EXTENSION=1 \
    python3 setup.py build_ext --inplace --build-temp "build/$2" > "$3" 2>&1
}
t0=$(date +%s)
DG_PID=
DG_TREE=${MEP_GATE_DEEPGEMM:-$ROOT/.carry/deepgemm}
DG_SITE=/tmp/mep-deepgemm-site
if [ "$MODE" = gate ] && [ -f "$DG_TREE/setup.py" ]; then
  # DG_JIT_CACHE_DIR inside the run: the kernels' first-use compile time counts in the tests' time
  # A build an earlier run on this machine made from the same tree (its files' names and sizes) is
  # kept: the gate's second part then skips DeepGEMM's ~75 s build
  ( s0=$(date +%s); rm -rf /tmp/mep-deepgemm-jit
    sum=$(cd "$DG_TREE" && find . -type f -printf '%P %s\n' | sort | md5sum | cut -c1-16)
    if [ -f "$DG_SITE/env.sh" ] && [ "$(cat "$DG_SITE/.tree-sum" 2>/dev/null)" = "$sum" ]; then
      echo "kept the build of the same tree ($sum) in $DG_SITE" > "$LOGS/build_deepgemm.log"; rc=0
    else
      rm -f "$DG_SITE/.tree-sum"
      DG_JIT_CACHE_DIR=/tmp/mep-deepgemm-jit MAX_JOBS=4 bash scripts/env/build_deepgemm.sh \
        "$DG_TREE" "$DG_SITE" > "$LOGS/build_deepgemm.log" 2>&1
      rc=$?; [ "$rc" = 0 ] && echo "$sum" > "$DG_SITE/.tree-sum"
    fi
    echo $(( $(date +%s) - s0 )) > /tmp/mep-dg-seconds; exit $rc ) &
  DG_PID=$!
fi
NVSHMEM_PID=
if [ "${MEP_GATE_REUSE_BUILD:-0}" = 1 ] && usable; then
  printf 'build\t1\t0\t0\t%s\treused the extension already built here\n' $(( $(date +%s) - t0 )) >> "$RESULTS"
else
  build_one _C_nvshmem gate_nvshmem "$LOGS/build_nvshmem.log" &
  NVSHMEM_PID=$!
  if build_one _protocol,_C gate_c "$LOGS/build.log" && python3 -c "import megatron_ep as m, sys; sys.exit(0 if m.cuda_backend_available() else 1)"; then
    printf 'build _C\t1\t0\t0\t%s\t\n' $(( $(date +%s) - t0 )) >> "$RESULTS"
  else
    tail -40 "$LOGS/build.log"
    printf 'build _C\t0\t1\t0\t%s\textension not built or not usable\n' $(( $(date +%s) - t0 )) >> "$RESULTS"
    python3 scripts/gate/gpu_report.py --mode "$MODE" --results "$RESULTS" --out "$OUT" --elapsed $(( $(date +%s) - GATE_START ))
    exit 1
  fi
fi
wait_nvshmem_build() {  # once: the background _C_nvshmem build's result row
  [ -n "$NVSHMEM_PID" ] || return 0
  local rc=0
  wait "$NVSHMEM_PID" || rc=$?
  NVSHMEM_PID=
  cat "$LOGS/build_nvshmem.log" >> "$LOGS/build.log"
  if [ "$rc" = 0 ] && usable; then
    printf 'build _C_nvshmem\t1\t0\t0\t%s\tbeside the _C build\n' $(( $(date +%s) - t0 )) >> "$RESULTS"
  else
    status=1; tail -30 "$LOGS/build_nvshmem.log"
    printf 'build _C_nvshmem\t0\t1\t0\t%s\tnot built or not usable\n' $(( $(date +%s) - t0 )) >> "$RESULTS"
  fi
  grep -E "Compiling entry|registers|spill" "$LOGS/build.log" | sed 's/ptxas info *: //' > "$LOGS/ptxas.txt"
  tail -1 "$RESULTS"
}
wait_nvshmem_build

# ---- DeepGEMM: built beside the extension builds above (one C++ file), waited for here, then one small
# grouped GEMM in a process of its own (a crash there must not take the gate down), its kernel compiled
# with nvcc (DeepGEMM's default; about 8 s a kernel on the GPU machine), else with NVRTC (its image was
# refused on the GPU image: CUDA_ERROR_INVALID_IMAGE at the kernel's load): the cases use the compiler
# that worked. The JIT cache starts empty, so every kernel's compile counts in its test's time.
dg_smoke() {  # dg_smoke NVRTC(0|1)
  ( . "$DG_SITE/env.sh"; export DG_JIT_USE_NVRTC=$1; cd /tmp && timeout 180 python3 - <<'PY'
import os, torch, deep_gemm as dg
a = torch.randn(256, 512, device="cuda").bfloat16()
w = torch.randn(2, 256, 512, device="cuda").bfloat16()
m = torch.tensor([0] * 128 + [1] * 128, device="cuda", dtype=torch.int32)
d = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
dg.m_grouped_bf16_gemm_nt_contiguous(a, w, d, m)
ref = torch.cat([a[:128].float() @ w[0].float().t(), a[128:].float() @ w[1].float().t()])
err = ((d.float() - ref).norm() / ref.norm()).item()
assert err < 1e-2, f"relative error {err:.3g}"
jit = "NVRTC" if os.environ["DG_JIT_USE_NVRTC"] == "1" else "nvcc"
print(f"its first GEMM (bf16 grouped, {jit}) right: relative error {err:.1e}")
PY
  ) >> "$LOGS/deepgemm_smoke.log" 2>&1 || { echo "exit $? $(grep -v '^\s*$' "$LOGS/deepgemm_smoke.log" | tail -1 | cut -c1-200)" >> "$LOGS/deepgemm_smoke.log"; return 1; }
}
if [ "$MODE" = gate ]; then
  if [ -f "$DG_TREE/setup.py" ]; then
    wait "$DG_PID"; dg_rc=$?
    dg_s=$(cat /tmp/mep-dg-seconds 2>/dev/null || echo 0)
    nvrtc=0
    if [ "$dg_rc" = 0 ] && [ -f "$DG_SITE/env.sh" ] && { dg_smoke 0 || { nvrtc=1; dg_smoke 1; }; }; then
      # shellcheck disable=SC1091
      . "$DG_SITE/env.sh"
      export DG_JIT_USE_NVRTC=$nvrtc
      printf 'build deepgemm\t1\t0\t0\t%s\tDeepGEMM from %s, beside the extension builds%s; %s\n' "$dg_s" "$DG_TREE" \
        "$(grep -q '^kept the build' "$LOGS/build_deepgemm.log" && echo ' (kept: built earlier on this machine from the same tree)')" \
        "$(tail -1 "$LOGS/deepgemm_smoke.log")" >> "$RESULTS"
    else
      # DeepGEMM is optional: a build or first GEMM that fails is recorded, and its cases skip saying so
      tail -20 "$LOGS/build_deepgemm.log" "$LOGS/deepgemm_smoke.log" 2>/dev/null
      why="scripts/env/build_deepgemm.sh failed"
      [ "$dg_rc" = 0 ] && why="its first GEMM failed ($(tail -1 "$LOGS/deepgemm_smoke.log" | cut -c1-160))"
      printf 'build deepgemm\t0\t0\t1\t%s\t%s: DeepGEMM cases skip\n' "$dg_s" "$why" >> "$RESULTS"
    fi
  elif [ -z "${MEP_GATE_FILES:-}" ]; then
    # (a run over some files without the tree leaves the row of the run that built it)
    printf 'build deepgemm\t0\t0\t1\t0\tno DeepGEMM tree at %s (scripts/env/deepgemm_tree.sh): DeepGEMM cases skip\n' "$DG_TREE" >> "$RESULTS"
  fi
  tail -1 "$RESULTS"
fi

# run_file NAME TIMEOUT_S PYTEST_ARGS...: one pytest run, its summary row (from the junit record;
# a file killed at its timeout names the test that was running)
run_file() {
  local name=$1 limit; limit=$(left "$2" 40); shift 2
  local safe=${name//[^A-Za-z0-9_.-]/_}; local log=$LOGS/$safe.log xml=$LOGS/junit-$safe.xml t0 rc
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" python3 -m pytest -v -rs -p no:cacheprovider --durations=12 --junitxml="$xml" "$@" \
    ${MEP_GATE_PYTEST:-} > "$log" 2>&1
  rc=$?
  # EMPTY_OK=1: a selection that matches no test (pytest exit 5: the no-MPS tests of a run over files
  # that have none) ran nothing, so it writes no row and the record keeps the row of the last run that did
  if [ "$rc" = 5 ] && [ "${EMPTY_OK:-0}" = 1 ]; then echo "$name: no test of this kind in these files"; return 0; fi
  python3 scripts/gate/gpu_report.py --row "$name" --junit "$xml" --log "$log" --rc "$rc" --seconds $(( $(date +%s) - t0 )) \
    --limit "$limit" >> "$RESULTS"
  [ "$rc" = 0 ] || status=1
  awk -F'\t' -v n="$name" '$1 == n' "$RESULTS" | tail -1
}

# run_files TIMEOUT_S "FILES": one pytest process over the files under MPS (one start-up and collection
# instead of one per file), a summary row per file
run_files() {
  local limit; limit=$(left "$1" "${MEP_GATE_RESERVE_S:-120}")
  local log=$LOGS/gpu_tests.log xml=$LOGS/junit-gpu_tests.xml t0 rc
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" python3 -m pytest -v -rs -p no:cacheprovider --durations=25 --junitxml="$xml" \
    -m "gpu and not no_mps" $2 ${MEP_GATE_PYTEST:-} > "$log" 2>&1
  rc=$?
  python3 scripts/gate/gpu_report.py --files "$2" --junit "$xml" --log "$log" --rc "$rc" --limit "$limit" >> "$RESULTS"
  [ "$rc" = 0 ] || status=1
  echo "(the files took $(( $(date +%s) - t0 )) s together)"
  tail -"$(echo $2 | wc -w)" "$RESULTS"
}

# sanitize NAME TOOL TIMEOUT_S PYTEST_ARGS...: compute-sanitizer over every process of a small case
# (without MPS: the tools do not follow MPS clients; R = 2 time-slices one GPU, or takes two)
sanitize() {
  local name=$1 tool=$2 limit; limit=$(left "$3" 15); shift 3
  local log=$LOGS/sanitizer_${tool}_${name//[^A-Za-z0-9_.-]/_}.log t0 rc
  t0=$(date +%s)
  # lazy module loading (NO_MPS_LOADING): the tool instruments only the kernels that run
  MEGATRON_EP_TIMEOUT_S=120 MEP_TEST_MODULE_LOADING=$NO_MPS_LOADING CUDA_MODULE_LOADING=$NO_MPS_LOADING \
    timeout -k 10 "$limit" compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 9 \
    python3 -m pytest -q -x -p no:cacheprovider "$@" > "$log" 2>&1
  rc=$?
  local errs passed
  errs=$(grep -cE "^========= (Invalid|Error|Race|Barrier|Uninitialized|Program hit)" "$log")
  passed=$(grep -oE "[0-9]+ passed" "$log" | tail -1 | grep -oE "[0-9]+"); passed=${passed:-0}
  local note="$tool: $errs reports"
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && note="$tool: timeout after ${limit}s"
  if [ "$rc" = 0 ]; then
    printf '%s %s\t%s\t0\t0\t%s\t%s\n' "$tool" "$name" "$passed" $(( $(date +%s) - t0 )) "$note" >> "$RESULTS"
  else
    status=1
    printf '%s %s\t%s\t1\t0\t%s\t%s (exit %s)\n' "$tool" "$name" "$passed" $(( $(date +%s) - t0 )) "$note" "$rc" >> "$RESULTS"
    grep -B2 -A14 -m3 -E "^========= (Invalid|Error|Race|Barrier|Uninitialized)" "$log" | head -60
  fi
  awk -F"\t" -v n="$tool $name" '$1 == n' "$RESULTS" | tail -1
}

# the whole gate's test files (MEP_GATE_FILES picks some; the record then wants the others at this code)
GATE_FILES="tests/cuda/test_cuda_intranode.py tests/cuda/test_cuda_internode.py tests/cuda/test_cuda_low_latency.py tests/megatron/test_megatron_gpu.py tests/unit/test_experts.py tests/unit/test_deepgemm.py tests/deep_ep/test_deep_ep_gpu.py tests/deep_ep/test_deepep_suite.py"
start_mps
if [ "$MODE" = gate ]; then
  FILES=${MEP_GATE_FILES:-$GATE_FILES}
  run_files 560 "$FILES"
  stop_mps
  # the tests without MPS beside the sanitizer run (both outside MPS, each process its own context,
  # time-sliced): the EP1 test's few short kernels barely slow the tool's, and the gate saves its minute
  # shellcheck disable=SC2086
  ( MEP_TEST_MODULE_LOADING=$NO_MPS_LOADING CUDA_MODULE_LOADING=$NO_MPS_LOADING EMPTY_OK=1 \
      run_file "tests without MPS" 120 -m "gpu and no_mps" $FILES; exit "$status" ) &
  NO_MPS_PID=$!
  # one small case of each path (R = 2) under memcheck: in one pool (tests/cuda/test_sanitizer_pass.py), or
  # with MEP_GATE_SANITIZER=split in each path's own suite (three pools under the tool)
  if [ "${MEP_GATE_SANITIZER:-pool}" = none ]; then
    :
  elif [ "${MEP_GATE_SANITIZER:-pool}" = split ]; then
    MEP_CASES=0 NVSHMEM_DISABLE_NCCL=1 sanitize "intranode, internode, low-latency" memcheck 240 -m gpu \
      "tests/cuda/test_cuda_intranode.py::test_normal_cases[2]" "tests/cuda/test_cuda_internode.py::test_internode_cases[2-1]" \
      "tests/cuda/test_cuda_low_latency.py::test_low_latency_cases[2]"
  else
    sanitize "intranode, internode, low-latency" memcheck 240 -m gpu tests/cuda/test_sanitizer_pass.py
  fi
  wait "$NO_MPS_PID" || status=1
elif [ "$MODE" = e2e ]; then
  wait_nvshmem_build
  mkdir -p "$OUT/e2e"
  # MEP_GATE_FILES picks among the mode's two files (by default both)
  E2E_FILES=" ${MEP_GATE_FILES:-tests/megatron/test_megatron_lm.py tests/megatron/test_megatron_lm_dispatcher.py} "
  if [[ "$E2E_FILES" == *" tests/megatron/test_megatron_lm.py "* ]]; then
    MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-$ROOT/.carry/megatron-lm-main} \
    MEGATRON_LM_R019_DIR=${MEGATRON_LM_R019_DIR:-$ROOT/.carry/megatron-lm-r0.19} MEP_E2E_OUT=$OUT/e2e \
    MEP_E2E_TIMEOUT_S=$(left 420 60) \
      run_file "tests/megatron/test_megatron_lm.py" 540 -m gpu tests/megatron/test_megatron_lm.py
  fi
  # Megatron's own dispatcher tests on megatron_ep.deep_ep and our kernels (the tree's test files)
  if [[ "$E2E_FILES" == *" tests/megatron/test_megatron_lm_dispatcher.py "* ]]; then
    MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-$ROOT/.carry/megatron-lm-main} \
      run_file "tests/megatron/test_megatron_lm_dispatcher.py" 600 -m gpu tests/megatron/test_megatron_lm_dispatcher.py
  fi
  tar -czf "$OUT/e2e_logs.tar.gz" -C "$OUT/e2e" . && find "$OUT/e2e" -name '*.log' -delete
else
  export MEP_FUZZ_CASES=${MEP_FUZZ_CASES:-1000} MEP_SOAK_ITERS=${MEP_SOAK_ITERS:-10000}
  MEP_GPU_TEST_LIMIT_S=420 run_file "tests/cuda/test_cuda_intranode.py (long)" 540 -m gpu tests/cuda/test_cuda_intranode.py -k "fuzz or soak"
  stop_mps
  # not initcheck: it tracks initialisation per process, so every read of a peer's counters
  # (zeroed by the peer's cudaMemset, mapped here by CUDA IPC) is reported as uninitialised
  # (35 such reports on one H200, 2026-12-01, and no others)
  for tool in racecheck synccheck; do
    MEP_CASES=0 sanitize intranode "$tool" 100 -m gpu "tests/cuda/test_cuda_intranode.py::test_normal_cases[2]"
  done
fi
stop_mps
WHOLE=--whole; [ -n "${MEP_GATE_FILES:-}" ] && WHOLE=  # a run over some files keeps the other files' rows
python3 scripts/gate/gpu_report.py --mode "$MODE" --results "$RESULTS" --out "$OUT" --elapsed $(( $(date +%s) - GATE_START )) \
  --gpus "$NGPU" --expect "$([ "$MODE" = gate ] && echo "$GATE_FILES")" $WHOLE || status=1
exit $status
