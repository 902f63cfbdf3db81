#!/usr/bin/env bash
# Build DeepGEMM from a tree made by scripts/env/deepgemm_tree.sh (DIR, default .carry/deepgemm) against
# the current python's torch, without network, into PREFIX (default /tmp/deepgemm-site): PREFIX/deep_gemm
# (the package: deep_gemm._C, the JIT's headers under deep_gemm/include) and PREFIX/env.sh, to source
# before using it:
#   PYTHONPATH          PREFIX first
#   CUDA_HOME           the toolkit the JIT's nvcc comes from (DeepGEMM runs CUDA_HOME/bin/nvcc)
#   DG_JIT_CACHE_DIR    compiled kernels (default /tmp/deepgemm-jit; DeepGEMM's own default is ~/.deep_gemm)
#   LD_PRELOAD          libstdc++: the build compiler's when newer than the one python loads with
#                       torch, else that one. Without it, on the GPU image (python and _C built by
#                       /opt/gcc/bin/g++, the system libstdc++.so.6.0.33 in the process) DeepGEMM's
#                       first call segfaulted in its config printer (2026-11-29) and in its include
#                       parser's std::regex (2026-12-03, cuda-gdb: collate<char>::transform landed in a
#                       codecvt facet): _C's references to the locale facets' ids did not bind to
#                       libstdc++'s own. DG_PRELOAD_LIBSTDCXX=0: no preload
# then checks `import deep_gemm` under env.sh. One C++ file (csrc/python_api.cpp, g++, no nvcc at build
# time); the kernels compile at their first call (nvcc, seconds to a minute each).
#   bash scripts/env/build_deepgemm.sh [DIR] [PREFIX]
# Environment: PYTHON (python3), CUDA_HOME (else /usr/local/cuda, else the directory above nvcc's bin/),
#   DG_JIT_CACHE_DIR, DG_BUILD_DIR (scratch, default /tmp/deepgemm-build), MAX_JOBS (default nproc),
#   DG_CXX / DG_CC (the compiler; default /usr/bin/g++ where present: see below).
# nvrtc.h / cublasLt.h / libnvrtc.so missing from CUDA_HOME are taken from pip's nvidia packages
# (nvidia/cu13/..., nvidia/cuda_nvrtc/..., nvidia/cublas/...) through CPATH, LIBRARY_PATH and an rpath.
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "build_deepgemm.sh: unknown option '$1' (--help says more)" >&2; exit 2 ;; esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DIR=${1:-$ROOT/.carry/deepgemm}
PREFIX=${2:-/tmp/deepgemm-site}
PY=${PYTHON:-python3}
JIT=${DG_JIT_CACHE_DIR:-/tmp/deepgemm-jit}
BUILD=${DG_BUILD_DIR:-/tmp/deepgemm-build}
die() { echo "build_deepgemm.sh: $*" >&2; exit 1; }
[ -f "$DIR/setup.py" ] && [ -d "$DIR/third-party/cutlass/include/cute" ] \
  || die "no DeepGEMM tree at $DIR (make it with scripts/env/deepgemm_tree.sh $DIR)"
DIR=$(cd "$DIR" && pwd)
mkdir -p "$PREFIX" && PREFIX=$(cd "$PREFIX" && pwd)
"$PY" -c "import torch, setuptools, packaging" 2>/dev/null || die "$PY cannot import torch, setuptools and packaging"
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then CUDA_HOME=/usr/local/cuda
  elif nvcc=$(command -v nvcc); then CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  else die "no nvcc: set CUDA_HOME to the CUDA toolkit"; fi
fi
[ -x "$CUDA_HOME/bin/nvcc" ] || die "no $CUDA_HOME/bin/nvcc (set CUDA_HOME to the CUDA toolkit)"
export CUDA_HOME

# The C++ compiler: DG_CXX, else the system's /usr/bin/g++ where there is one, not an inherited
# CC / CXX. The GPU image's CXX (/opt/gcc/bin/g++, a wrapper of the same GCC 13) links part of
# libstdc++ into the module (its nm shows std::locale::id::_M_id defined in _C): a second locale
# registry beside the process's libstdc++, and DeepGEMM's std::regex and iostreams crashed on it
# (2026-12-03, one H200). The system g++ left none.
cxx=${DG_CXX:-}
if [ -z "$cxx" ]; then
  if [ -x /usr/bin/g++ ]; then cxx=/usr/bin/g++; else cxx=${CXX:-c++}; fi
fi
cc=${DG_CC:-$(dirname "$cxx")/gcc}
[ -x "$cc" ] || cc=$cxx
export CC=$cc CXX=$cxx LDSHARED="$cxx -shared" LDCXXSHARED="$cxx -shared"

rm -rf "$BUILD"; mkdir -p "$BUILD/lib"
log=$BUILD/build.log
# headers and libnvrtc.so the toolkit lacks (a toolkit assembled from pip wheels has no nvrtc/cublas)
extra=$("$PY" - "$CUDA_HOME" <<'EOF'
import glob, os, sys
home = sys.argv[1]
try:
    import nvidia
    roots = list(nvidia.__path__)
except ImportError:
    roots = []
pkgs = [d for r in roots for d in sorted(glob.glob(os.path.join(r, '*'))) if os.path.isdir(d)]
def find(sub, name):
    for d in [home] + pkgs:
        for sd in ([sub, sub + '64'] if sub == 'lib' else [sub]):
            hits = sorted(glob.glob(os.path.join(d, sd, name)))
            if hits:
                return hits[0]
    return ''
for h in ('cuda.h', 'cuda_runtime.h', 'nvrtc.h', 'cublasLt.h'):
    print('inc', h, os.path.dirname(find('include', h)))
print('lib nvrtc', find('lib', 'libnvrtc.so*'))
print('lib cudart', find('lib', 'libcudart.so*'))
EOF
)
cpath= libdirs=
while read -r kind name path; do
  [ -n "$path" ] || die "no $name in $CUDA_HOME or pip's nvidia packages"
  if [ "$kind" = inc ]; then
    [[ ":$cpath:" == *":$path:"* ]] || cpath=$cpath${cpath:+:}$path
  else  # -l$name needs lib$name.so: link the versioned one, and find it again at run time (rpath)
    ln -sf "$path" "$BUILD/lib/lib$name.so"
    d=$(dirname "$path"); [[ ":$libdirs:" == *":$d:"* ]] || libdirs=$libdirs${libdirs:+:}$d
  fi
done <<< "$extra"
export CPATH=$cpath${CPATH:+:$CPATH}
export LIBRARY_PATH=$BUILD/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
export LDFLAGS="${LDFLAGS:-} -Wl,-rpath,${libdirs//:/,-rpath,}"

# build in a copy (setup.py writes stubs/ and build/ beside itself, and runs git there for its version)
cp -a "$DIR" "$BUILD/src"
# DeepGEMM's setup.py compiles with -std=c++17; torch headers that demand C++20 (ATen.h's #error, torch
# 2.14 here) get -std=c++20 in the copy (DeepGEMM asks for a C++20 compiler anyway; its JIT uses C++20)
aten=$("$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include/ATen/ATen.h'))")
if grep -q "__cplusplus < 202002L" "$aten" 2>/dev/null; then
  grep -q "'-std=c++17'" "$BUILD/src/setup.py" || die "torch needs C++20, and $DIR/setup.py has no '-std=c++17' to raise"
  sed -i "s/'-std=c++17'/'-std=c++20'/" "$BUILD/src/setup.py"
  echo "torch's headers need C++20: building with -std=c++20"
fi
# setup.py imports wheel.bdist_wheel at the top (unused by `build`); without the wheel package,
# setuptools' own bdist_wheel (setuptools >= 70.1) in the copy
if ! "$PY" -c "import wheel.bdist_wheel" 2>/dev/null; then
  grep -q "^from wheel.bdist_wheel import" "$BUILD/src/setup.py" || die "no wheel package, and $DIR/setup.py imports bdist_wheel otherwise"
  sed -i "s/^from wheel.bdist_wheel import/from setuptools.command.bdist_wheel import/" "$BUILD/src/setup.py"
  echo "no wheel package: setup.py takes setuptools' bdist_wheel"
fi
echo "building DeepGEMM $(sed -n 's/^deepgemm \(.\{10\}\).*/\1/p' "$DIR/REVISION" 2>/dev/null) with $("$PY" -c 'import torch; print("torch", torch.__version__)'), CUDA_HOME=$CUDA_HOME (log: $log)"
t0=$(date +%s)
if ! (cd "$BUILD/src" && DG_USE_LOCAL_VERSION=0 DG_FORCE_BUILD=1 DG_JIT_CACHE_DIR=$JIT MAX_JOBS=${MAX_JOBS:-$(nproc)} \
      TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
      "$PY" setup.py build --build-base "$BUILD/build" --build-lib "$BUILD/out") > "$log" 2>&1; then
  grep -E "error|Error" "$log" | head -20 >&2
  die "setup.py build failed after $(($(date +%s) - t0)) s (log: $log)"
fi
compgen -G "$BUILD/out/deep_gemm/_C*.so" > /dev/null || die "setup.py build made no deep_gemm/_C*.so (log: $log)"
if command -v nm > /dev/null && nm -C --defined-only "$BUILD"/out/deep_gemm/_C*.so 2>/dev/null | grep -q "std::locale::id::_M_id"; then
  echo "warning: $cxx linked libstdc++'s locale code into _C (a second locale registry): set DG_CXX to a plain g++" >&2
fi
rm -rf "$PREFIX/deep_gemm"; cp -a "$BUILD/out/deep_gemm" "$PREFIX/"
echo "built in $(($(date +%s) - t0)) s: $PREFIX/deep_gemm ($(du -sh "$PREFIX/deep_gemm" | cut -f1))"

# libstdc++: the build compiler's, when it is newer than the one python loads with torch
preload= mode=${DG_PRELOAD_LIBSTDCXX:-auto}
if [ "$mode" != 0 ]; then
  cxxlib=
  # the compiler that built _C (setuptools takes python's configured one, e.g. the GPU image's
  # /opt/gcc/bin/g++, which need not be the c++ on PATH), then CXX, c++, g++
  built_with=$(sed -n 's/^\([^ ]*\) .* -c csrc\/python_api.cpp .*/\1/p' "$log" | head -1)
  for c in "$built_with" "${CXX:-}" c++ g++; do
    [ -n "$c" ] && command -v "$c" > /dev/null || continue
    p=$("$c" -print-file-name=libstdc++.so.6 2>/dev/null) || continue
    [[ $p == /* ]] && [ -e "$p" ] && { cxxlib=$(readlink -f "$p"); break; }
  done
  loaded=$("$PY" -c "import torch; print(next((l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++.so' in l), ''))")
  loaded=$(readlink -f "$loaded" 2>/dev/null || true)
  minor() { local v=${1##*/libstdc++.so.6.0.}; [[ $v =~ ^[0-9]+$ ]] && echo "$v" || echo 0; }
  # the newer of the two; the one python loads anyway is preloaded too: in the global scope,
  # _C's references to libstdc++'s locale facets bind to libstdc++'s own definitions
  if [ -n "$cxxlib" ] && [ "$cxxlib" != "$loaded" ] && [ "$(minor "$cxxlib")" -gt "$(minor "$loaded")" ]; then
    preload=$cxxlib
  else
    preload=${loaded:-$cxxlib}
  fi
  echo "libstdc++: the compiler's (${built_with:-${CXX:-c++}}) ${cxxlib:-unknown}, python's with torch ${loaded:-unknown}: $([ -n "$preload" ] && echo preloaded || echo "not preloaded")"
fi
{
  echo "# DeepGEMM built by scripts/env/build_deepgemm.sh from $DIR ($(head -1 "$DIR/REVISION" 2>/dev/null))"
  echo "export PYTHONPATH=\"$PREFIX\${PYTHONPATH:+:\$PYTHONPATH}\""
  echo "export CUDA_HOME=\"$CUDA_HOME\""
  echo "export DG_JIT_CACHE_DIR=\"$JIT\""
  [ -z "$preload" ] || echo "export LD_PRELOAD=\"$preload\${LD_PRELOAD:+:\$LD_PRELOAD}\""
} > "$PREFIX/env.sh"
mkdir -p "$JIT"
cat "$PREFIX/env.sh"
# shellcheck disable=SC1091
if ! out=$(cd / && . "$PREFIX/env.sh" && "$PY" -c "import deep_gemm; print(deep_gemm.__file__)" 2>&1); then
  echo "$out" | tail -5 >&2
  die "built into $PREFIX, but import deep_gemm fails: $(echo "$out" | tail -1)"
fi
echo "$out"
