#!/usr/bin/env bash
# One device call on the GPU machine: build the extension in place, run the GPU test suite
# (virtual ranks R = 2, 4, 8 on one GPU under MPS), the benchmark, and compute-sanitizer on a
# small R = 2 case. Logs go under $OUT. Select phases with MEP_GPU_STEPS=build,tests,bench,sanitizer.
# A peer library for the benchmark is looked for on PYTHONPATH (see scripts/bench_normal.py);
# if MEP_WAIT_FOR names a file, the benchmark waits (up to 10 min) for it to appear first.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/.gpu_out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 NVSHMEM_DISABLE_MNNVL=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1
STEPS=${MEP_GPU_STEPS:-build,tests,bench,sanitizer}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
phase() { echo "=== $1 ($(date +%T))"; }
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mep-mps-log
start_mps() { mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"; nvidia-cuda-mps-control -d && echo "MPS started"; }
stop_mps() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
trap stop_mps EXIT
status=0

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
if has build; then
  phase build
  if ! MAX_JOBS=16 MEP_PTXAS_VERBOSE=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; exit 1
  fi
  grep -E "Compiling entry|registers|spill" "$OUT/build.log" | sed 's/ptxas info *: //' > "$OUT/ptxas.txt"
  python3 -c "import megatron_ep as m; print('extension usable:', m.cuda_backend_available())"
fi
if has tests; then
  phase tests
  start_mps
  timeout "${MEP_TEST_TIMEOUT:-420}" python3 -m pytest -q -x -m gpu tests/test_cuda_intranode.py ${MEP_TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  stop_mps
fi
if has bench; then
  phase bench
  if [ -n "${MEP_WAIT_FOR:-}" ]; then
    for _ in $(seq 300); do [ -e "$MEP_WAIT_FOR" ] && break; sleep 2; done
  fi
  start_mps
  for spec in ${MEP_BENCH_SPECS:-"4:24" "8:16"}; do
    r=${spec%%:*}; s=${spec##*:}
    timeout 300 python3 scripts/bench_normal.py --ranks "$r" --num-sms "$s" --json "$OUT/bench_r${r}.json" 2>&1 | tee "$OUT/bench_r${r}.log" | grep -v "^\[" | tail -25
  done
  stop_mps
fi
if has sanitizer; then
  phase sanitizer
  for tool in memcheck racecheck; do
    MEP_CASES=${MEP_SAN_CASES:-0,1} MEP_TIMEOUT_S=120 timeout 240 compute-sanitizer --tool "$tool" --target-processes all \
      --error-exitcode 9 python3 -m pytest -q -x -m gpu tests/test_cuda_intranode.py -k "test_normal_cases and 2" \
      > "$OUT/sanitizer_$tool.log" 2>&1
    echo "$tool exit $?: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
  done
fi
exit $status
