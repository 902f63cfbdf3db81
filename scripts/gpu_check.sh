#!/usr/bin/env bash
# One device call on the GPU machine: build the extension in place, run the GPU test suite
# (virtual ranks R = 2, 4, 8 on one GPU under MPS), the benchmark, and compute-sanitizer on a
# small R = 2 case, and the Megatron phase (integration tests on the cuda backend, then the
# training recipe's step table for each dispatcher). Logs go under $OUT. Select phases with
# MEP_GPU_STEPS=build,tests,megatron,bench,sanitizer (default: all but megatron).
# Wheels under .whl/ (megatron-core for Python 3.12, carried) are installed to /tmp/site first.
# Peer libraries (DeepEP for the benchmark, DeepGEMM for the experts) are looked for on
# PYTHONPATH; if MEP_WAIT_FOR names a file, the phases that use peers wait (up to 10 min) for it.
# MEP_RECIPE_ARGS: the recipe's model flags for the step table.
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
wait_peer() {
  if [ -n "${MEP_WAIT_FOR:-}" ]; then
    for _ in $(seq 300); do [ -e "$MEP_WAIT_FOR" ] && break; sleep 2; done
  fi
}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

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
if has megatron; then
  phase megatron
  wait_peer
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" || status=1
  start_mps
  timeout "${MEP_MEGATRON_TIMEOUT:-420}" python3 -m pytest -q -m gpu -rs tests/test_megatron_gpu.py tests/test_experts.py 2>&1 \
    | tee "$OUT/megatron_tests.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  # The recipe: Megatron's alltoall on one rank (NCCL; flex refuses EP 1), the flex dispatchers
  # on MEP_RECIPE_RANKS virtual ranks sharing the GPU (gloo + megatron_ep's IPC transport, MPS).
  for d in alltoall deepep hybridep; do
    if [ "$d" = alltoall ]; then n=1; v=""; else n=${MEP_RECIPE_RANKS:-4}; v="--virtual-ranks"; fi
    echo "--- recipe: --dispatcher $d, $n rank(s) $v" | tee -a "$OUT/recipe.log"
    timeout 240 python3 -m torch.distributed.run --nproc-per-node "$n" recipes/train_moe.py --dispatcher "$d" --backend cuda $v \
      ${MEP_RECIPE_ARGS:-} > "$OUT/recipe_one.log" 2>&1 || { echo "recipe --dispatcher $d failed"; status=1; }
    grep -v "^\[" "$OUT/recipe_one.log" | grep -v Warning | tail -${MEP_RECIPE_TAIL:-14} | tee -a "$OUT/recipe.log"
  done
  stop_mps
  rm -f "$OUT/recipe_one.log"
fi
if has bench; then
  phase bench
  wait_peer
  start_mps
  # MEP_BENCH_SPECS: ranks:SMs per run, SMs a comma list for a sweep (e.g. "4:8,16,24")
  for spec in ${MEP_BENCH_SPECS:-"4:24" "8:16"}; do
    r=${spec%%:*}; s=${spec##*:}
    timeout 300 python3 scripts/bench_normal.py --ranks "$r" --num-sms "$s" --json "$OUT/bench_r${r}.json" \
      --markdown "$OUT/bench_r${r}.md" > "$OUT/bench_r${r}.log" 2>&1 || { echo "bench --ranks $r failed"; status=1; }
    grep -v "^\[" "$OUT/bench_r${r}.log" | sed '/^### bench_normal/,$d' | tail -40
    [ -f "$OUT/bench_r${r}.md" ] && cat "$OUT/bench_r${r}.md"
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
