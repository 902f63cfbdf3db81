#!/usr/bin/env bash
# The test suite: every CPU test (multi-process gloo); GPU tests skip without a GPU.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT" && python -m pytest -q tests "$@"
