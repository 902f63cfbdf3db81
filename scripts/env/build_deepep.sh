#!/usr/bin/env bash
# Build DeepEP (a peer we measure against, never part of this repository) on the GPU machine, in the
# background, from a source tree the user gives (DIR, default .carry/deepep-src: e.g.
# `git --git-dir=<a DeepEP mirror> archive 567632d csrc deep_ep setup.py | tar -x -C .carry/deepep-src`,
# and the commit in DIR/DEEPEP_COMMIT for the benchmarks' labels):
#   bash scripts/env/build_deepep.sh full|intranode [DIR]
# full: every kernel, against NVSHMEM from pip (nvidia-nvshmem-cu13); intranode: no NVSHMEM (its
# setup.py finds none). Into /tmp/deepep/MODE (put it on PYTHONPATH); /tmp/deepep_MODE.ok on
# success, /tmp/deepep_MODE.done (one line) at the end, the log in /tmp/deepep_MODE.log.
# Environment: DEEPEP_JOBS (parallel compiles, default 8), TORCH_CUDA_ARCH_LIST (default 9.0).
set -uo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;; esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MODE=${1:-full}
SRC=${2:-$ROOT/.carry/deepep-src}
case $MODE in full|intranode) ;; *) echo "build_deepep.sh: full or intranode, not '$MODE'" >&2; exit 2 ;; esac
[ -f "$SRC/setup.py" ] || { echo "build_deepep.sh: no DeepEP tree at $SRC (--help)" >&2; exit 2; }
DST=/tmp/deepep/$MODE
rm -rf "$DST" /tmp/deepep_"$MODE".ok /tmp/deepep_"$MODE".done && mkdir -p "$DST" && cp -r "$SRC/." "$DST/"
(
  cd "$DST" || exit 1
  # g++ compiles its .cpp against CUDA 13's headers, whose cuda/std lives under cccl
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${DEEPEP_JOBS:-8}
  export CPLUS_INCLUDE_PATH=/usr/local/cuda/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
  # intranode: hide the pip NVSHMEM from its setup.py
  [ "$MODE" = intranode ] && sed -i 's/find_spec("nvidia.nvshmem")/find_spec("nvidia.no_nvshmem_here")/' setup.py
  start=$(date +%s)
  if python3 setup.py build_ext --inplace > /tmp/deepep_"$MODE".log 2>&1 \
      && python3 -c "import sys; sys.path.insert(0, '$DST'); import deep_ep" >> /tmp/deepep_"$MODE".log 2>&1; then
    touch /tmp/deepep_"$MODE".ok
    echo "DeepEP $MODE built in $(( $(date +%s) - start )) s" > /tmp/deepep_"$MODE".done
  else
    echo "DeepEP $MODE build FAILED: $(tail -1 /tmp/deepep_"$MODE".log)" > /tmp/deepep_"$MODE".done
  fi
) &
