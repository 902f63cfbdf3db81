#!/usr/bin/env bash
# The test suite: every CPU test (multi-process gloo); GPU tests skip without a GPU.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/env/setup_env.sh"
echo "test suite: about 10-12 minutes on 2 cores (each file's name is printed as it starts; some take minutes)" >&2
# default verbosity: one line per test file, its name first, so a long file shows which one it is
cd "$ROOT" && python -m pytest tests "$@"
