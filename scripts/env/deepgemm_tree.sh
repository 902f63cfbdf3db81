#!/usr/bin/env bash
# The part of DeepGEMM, CUTLASS and {fmt} that building DeepGEMM (its one C++ file, csrc/python_api.cpp,
# as deep_gemm._C) and its JIT (nvcc at run time on deep_gemm/include/{deep_gemm,cute,cutlass})
# need, exported from git mirrors at DeepGEMM's pinned commit and the submodule commits it pins,
# into DIR: what scripts/env/build_deepgemm.sh builds on a GPU machine without network. Never committed.
#   bash scripts/env/deepgemm_tree.sh [DIR]          (default .carry/deepgemm, git-ignored)
# Environment (defaults: the mirrors that the fetch tool makes):
#   DEEPGEMM_GIT  DeepGEMM git dir (/work/.mirror/deepseek-ai+DeepGEMM/repo)
#   DEEPGEMM_REV  DeepGEMM commit (54e22612409371d6364144b69086735beb54e98b, main of 2026-06-23)
#   CUTLASS_GIT   CUTLASS git dir (/work/.mirror/NVIDIA+cutlass/repo); commit: DeepGEMM's gitlink
#   FMT_GIT       {fmt} git dir (/work/.mirror/fmtlib+fmt/repo); commit: DeepGEMM's gitlink
#   DG_TREE_CUTLASS  closure (default): only the CUTLASS/CuTe headers that an #include line of
#                 deep_gemm/include or csrc reaches, followed through every #include line whatever
#                 the #if around it (about 13 MB of CUTLASS's 26 MB include/); full: all of include/
# Kept from DeepGEMM: setup.py, LICENSE, csrc/, deep_gemm/, scripts/generate_pyi.py (setup.py imports
# it); dropped: tests, third-party/tilelang_ops (tests only), CI, docs. From CUTLASS: include/cute,
# include/cutlass (setup.py copies both into the package for the JIT), LICENSE.txt. From {fmt}:
# include/fmt (the C++ file's formatting), LICENSE. DIR/REVISION lists the three commits.
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "deepgemm_tree.sh: unknown option '$1' (--help says more)" >&2; exit 2 ;; esac
DEST=${1:-.carry/deepgemm}
DG_GIT=${DEEPGEMM_GIT:-/work/.mirror/deepseek-ai+DeepGEMM/repo}
DG_REV=${DEEPGEMM_REV:-54e22612409371d6364144b69086735beb54e98b}
CUTLASS_GIT=${CUTLASS_GIT:-/work/.mirror/NVIDIA+cutlass/repo}
FMT_GIT=${FMT_GIT:-/work/.mirror/fmtlib+fmt/repo}
MODE=${DG_TREE_CUTLASS:-closure}
die() { echo "deepgemm_tree.sh: $*" >&2; exit 1; }
have() { git -C "$1" cat-file -e "$2^{commit}" 2>/dev/null; }
# GIT REV DEST PATH...: git archive into DEST, then check that every file of PATH... arrived (a mirror
# may lack some blobs: CUTLASS's lacks media/ images, which git archive reports even when not asked for)
export_() {
  local g=$1 r=$2 d=$3 want got; shift 3
  git -C "$g" archive "$r" "$@" 2>/dev/null | tar -x -C "$d" || die "git archive of $* at $r from $g failed"
  want=$(git -C "$g" ls-tree -r --name-only "$r" "$@" | wc -l)
  got=$(cd "$d" && find "$@" \( -type f -o -type l \) | wc -l)
  [ "$want" = "$got" ] || die "$g at ${r:0:10}: $got of the $want files of $* exported"
}
case $MODE in closure|full) ;; *) die "DG_TREE_CUTLASS is closure or full, not '$MODE'" ;; esac
have "$DG_GIT" "$DG_REV" || die "no DeepGEMM commit $DG_REV in $DG_GIT (fetch github:deepseek-ai/DeepGEMM, or set DEEPGEMM_GIT/DEEPGEMM_REV)"
gitlink() { git -C "$DG_GIT" ls-tree "$DG_REV" "third-party/$1" | awk '$2 == "commit" {print $3}'; }
CUTLASS_REV=$(gitlink cutlass) FMT_REV=$(gitlink fmt)
[ -n "$CUTLASS_REV" ] && [ -n "$FMT_REV" ] || die "DeepGEMM $DG_REV pins no third-party/cutlass or third-party/fmt submodule"
have "$CUTLASS_GIT" "$CUTLASS_REV" || die "no CUTLASS commit $CUTLASS_REV (DeepGEMM's pin) in $CUTLASS_GIT (fetch github:NVIDIA/cutlass, or set CUTLASS_GIT)"
have "$FMT_GIT" "$FMT_REV" || die "no {fmt} commit $FMT_REV (DeepGEMM's pin) in $FMT_GIT (fetch github:fmtlib/fmt, or set FMT_GIT)"

# DEST is replaced only when it is empty or an earlier tree of this script (its REVISION file)
if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST" 2>/dev/null)" ] && ! grep -q '^deepgemm ' "$DEST/REVISION" 2>/dev/null; then
  die "$DEST exists and is not a tree of this script (no REVISION file): give a new or empty directory"
fi
rm -rf -- "$DEST"; mkdir -p "$DEST/third-party/cutlass" "$DEST/third-party/fmt"
export_ "$DG_GIT" "$DG_REV" "$DEST" setup.py LICENSE csrc deep_gemm scripts/generate_pyi.py
export_ "$FMT_GIT" "$FMT_REV" "$DEST/third-party/fmt" include/fmt LICENSE
if [ "$MODE" = full ]; then
  export_ "$CUTLASS_GIT" "$CUTLASS_REV" "$DEST/third-party/cutlass" include/cute include/cutlass LICENSE.txt
else
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  export_ "$CUTLASS_GIT" "$CUTLASS_REV" "$tmp" include/cute include/cutlass
  export_ "$CUTLASS_GIT" "$CUTLASS_REV" "$DEST/third-party/cutlass" LICENSE.txt
  # every header of CUTLASS's include/ that an #include line reaches from DeepGEMM's sources
  python3 - "$tmp/include" "$DEST/deep_gemm/include" "$DEST/csrc" > "$tmp/closure" <<'EOF'
import os, re, sys
root, seeds = os.path.realpath(sys.argv[1]), sys.argv[2:]
include = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
seen, todo = set(), [os.path.join(r, f) for d in seeds for r, _, fs in os.walk(d) for f in fs]
while todo:
    path = todo.pop()
    with open(path, errors='replace') as f:
        names = include.findall(f.read())
    for name in names:
        for cand in (os.path.join(os.path.dirname(path), name), os.path.join(root, name)):
            cand = os.path.realpath(cand)
            if cand.startswith(root + os.sep) and os.path.isfile(cand):
                if cand not in seen:
                    seen.add(cand)
                    todo.append(cand)
                break
print('\n'.join(sorted(os.path.relpath(p, os.path.dirname(root)) for p in seen)))
EOF
  (cd "$tmp" && tar -c -T closure) | tar -x -C "$DEST/third-party/cutlass"
fi
printf 'deepgemm %s\ncutlass %s\nfmt %s\n' "$(git -C "$DG_GIT" rev-parse "$DG_REV")" "$CUTLASS_REV" "$FMT_REV" > "$DEST/REVISION"
echo "$DEST: DeepGEMM ${DG_REV:0:10}, CUTLASS ${CUTLASS_REV:0:10} ($MODE include), fmt ${FMT_REV:0:10}: $(find "$DEST" -type f | wc -l) files, $(du -sh "$DEST" | cut -f1) ($(du -sb "$DEST" | cut -f1) bytes)"
