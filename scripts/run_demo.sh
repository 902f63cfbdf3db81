#!/usr/bin/env bash
# The main job on its embedded default: 4 CPU processes (gloo) route tokens through a small MoE
# layer with the reference backend, forward and backward, and print a table.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/env/setup_env.sh"
cd "$ROOT" && python -m megatron_ep.tools.demo "$@"
