#!/usr/bin/env bash
# DeepSeek-V3 pretraining, 8 nodes x 8 GPUs, EP64, MoE dispatch/combine on megatron_ep.
# Run on every node with the same arguments; the environment gives the rendezvous:
#   MEGATRON_LM_DIR=/path/to/Megatron-LM MASTER_ADDR=<node 0> MASTER_PORT=29500 NODE_RANK=<0..7> \
#       bash recipes/deepseek_v3_ep64/launch.sh [--dispatcher hybridep|deepep] [--fp8] [...] [-- pretrain_gpt.py args]
#   bash recipes/deepseek_v3_ep64/launch.sh --dry-run     # all nodes' commands; no GPU or Megatron-LM needed
# NNODES (8) and GPUS_PER_NODE (8) may be overridden; `launch.sh --help` lists the options.
# The command is built by launch.py beside this file (PYTHON picks the interpreter).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "${PYTHON:-python3}" "$HERE/launch.py" "$@"
