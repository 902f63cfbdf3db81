#!/usr/bin/env bash
# Megatron-LM's pretrain_gpt.py with DeepSeek-V3's routing at EP 4 on virtual ranks (4 processes on one
# GPU under MPS, tests/support/megatron_lm_ledger.py over tests/support/megatron_lm_virtual.py), each run with a
# ledger of every rank's Buffer calls and the ranks' stacks where they stop; one line of results
# per run (also in $OUT/megatron_lm_diag.txt), the logs packed into $OUT/megatron_lm_diag.tar.gz.
#
#   bash scripts/env/megatron_lm_diag.sh [NAME:LOADING:DISPATCHER:ITERS[:LAUNCHER OPTIONS,...]] ...
#   e.g. bash scripts/env/megatron_lm_diag.sh deepep-lazy:LAZY:deepep:12 deepep-eager:EAGER:deepep:12 \
#          hybridep-eager:EAGER:hybridep:12:--ep-experts,grouped,--ep-chunks,2
#
# LOADING: CUDA_MODULE_LOADING of the ranks (the ledger logs what the driver then uses);
# DISPATCHER: alltoall, deepep or hybridep (flex, the Buffer's default SMs unless DIAG_NUM_SMS);
# launcher options comma-separated. MEGATRON_LM_DIR (default .carry/megatron-lm-main), MEGATRON_EP_TIMEOUT_S
# (default 40), DIAG_LIMIT_S (each run's wall-clock limit, default 150), DIAG_NUM_SMS. Run from the
# repository root on a Hopper GPU; wheels under .whl/ are installed first, as by scripts/gate/gpu_check.sh.
set -uo pipefail
ROOT=$(pwd)
OUT=${OUT:-$ROOT/.gpu_out}
W=/tmp/mep-diag
LM=${MEGATRON_LM_DIR:-$ROOT/.carry/megatron-lm-main}
LEDGER=${DIAG_LEDGER:-$ROOT/tests/megatron_lm_ledger.py}
rm -rf "$W"; mkdir -p "$W" "$OUT"
exec > >(tee "$OUT/megatron_lm_diag.txt") 2>&1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=1 MEGATRON_EP_BACKEND=cuda MEGATRON_EP_DEVICE_SHARERS=4
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mep-mps-log
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$(date +%s)
MEGATRON_EP_BUILD_ONLY=_protocol,_C MAX_JOBS=$(nproc) MEGATRON_EP_REQUIRE_EXTENSION=1 \
  python3 setup.py build_ext --inplace --build-temp build/diag > "$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
make -C "$LM/megatron/core/datasets" > "$W/make.log" 2>&1
echo "built in $(( $(date +%s) - t0 )) s; Megatron-LM $(cut -c1-10 "$LM/REVISION" 2>/dev/null)"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d
finish() { echo quit | nvidia-cuda-mps-control 2>/dev/null; tar -czf "$OUT/megatron_lm_diag.tar.gz" -C "$W" .; }
trap finish EXIT

MODEL=(--num-layers 2 --hidden-size 512 --ffn-hidden-size 1024 --num-attention-heads 8 --seq-length 256
  --max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 8 --lr 1e-4 --lr-warmup-iters 2 --mock-data
  --tokenizer-type NullTokenizer --vocab-size 1024 --transformer-impl local --bf16 --num-experts 16 --moe-router-topk 4
  --expert-model-parallel-size 4 --distributed-backend gloo --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --no-bias-gelu-fusion --no-bias-dropout-fusion --seed 1234 --moe-router-load-balancing-type seq_aux_loss
  --moe-aux-loss-coeff 1e-3 --no-persist-layer-norm --moe-router-score-function sigmoid --moe-router-enable-expert-bias
  --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32
  --moe-shared-expert-intermediate-size 512 --position-embedding-type rope --no-rope-fusion --disable-bias-linear
  --log-interval 1 --eval-iters 0 --eval-interval 100000 --num-workers 1 --timing-log-level 0)

runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=(deepep-lazy:LAZY:deepep:12 deepep-eager:EAGER:deepep:12
                               hybridep-eager:EAGER:hybridep:12:--ep-experts,grouped,--ep-chunks,2)
for spec in "${runs[@]}"; do
  IFS=: read -r name loading disp iters opts <<< "$spec"
  IFS=, read -r -a launcher <<< "${opts:-}"
  d=$W/$name; mkdir -p "$d"
  if [ "$disp" = alltoall ]; then flags=(--moe-token-dispatcher-type alltoall)
  else flags=(--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend "$disp")
       [ -n "${DIAG_NUM_SMS:-}" ] && flags+=(--moe-flex-dispatcher-num-sms "$DIAG_NUM_SMS"); fi
  s0=$(date +%s)
  CUDA_MODULE_LOADING=$loading MEP_CALL_LEDGER=$d MEGATRON_EP_TIMEOUT_S=${MEGATRON_EP_TIMEOUT_S:-40} \
    timeout -k 10 "${DIAG_LIMIT_S:-150}" python3 -m torch.distributed.run --standalone --nproc-per-node 4 "$LEDGER" \
    "${launcher[@]}" "$LM/pretrain_gpt.py" "${MODEL[@]}" --train-iters "$iters" "${flags[@]}" > "$d/run.log" 2>&1
  rc=$?
  losses=$(grep -oE "iteration +[0-9]+/ *[0-9]+ .*lm loss: [0-9.E+-]+" "$d/run.log" | sed -E 's/.*iteration +([0-9]+)\/.*lm loss: ([0-9.E+-]+)/\1:\2/' | tr '\n' ' ')
  echo "== $name (CUDA_MODULE_LOADING=$loading, $disp ${opts:-}): exit $rc after $(( $(date +%s) - s0 )) s; loss $losses"
  grep -hoE "(CommTimeoutError|CallMismatchError|PeerFailedError|BufferBrokenError)[^\[]{0,400}" "$d/run.log" | sort -u | head -6
  for f in "$d"/rank*.log; do
    echo "-- $(basename "$f"): $(grep -m1 -o 'module loading [A-Z]*' "$f"); $(grep -m1 -o 'num_sms [0-9]*, push_sms [0-9]*' "$f")"
    grep -E " (begin|end|raised)( |$)" "$f" | tail -3 | cut -c1-200
    # at the first stall: each thread's three innermost frames (the ledger's own left out)
    awk '/nothing began or ended/{n++; if (n==1) print "   " $0} n==1 && /^(Thread|Current)/{k=0}
         n==1 && /File/ && k<3 && !/megatron_lm_ledger|threading.py/ {print "     " $0; k++}' "$f" | head -10 | cut -c1-200
  done
done
