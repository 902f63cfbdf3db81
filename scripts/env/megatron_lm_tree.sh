#!/usr/bin/env bash
# The part of a Megatron-LM checkout that pretrain_gpt.py needs (megatron/, pretrain_gpt.py and
# the modules beside it that it imports) and its token-dispatcher unit tests, exported from a git
# clone at one revision into DEST:
# what the GPU tests of pretrain_gpt.py carry to a GPU machine without network (about 11 MB,
# against a whole checkout's 63 MB with its tests).
#   bash scripts/env/megatron_lm_tree.sh GIT_DIR REV DEST
#   e.g. bash scripts/env/megatron_lm_tree.sh ~/Megatron-LM d98e8a64dd .carry/megatron-lm-main
#        bash scripts/env/megatron_lm_tree.sh ~/Megatron-LM core_v0.19.0 .carry/megatron-lm-r0.19
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
[ $# -eq 3 ] || { echo "usage: $0 GIT_DIR REV DEST" >&2; exit 2; }
GIT_DIR=$1 REV=$2 DEST=$3
paths=$(git -C "$GIT_DIR" ls-tree --name-only "$REV" | grep -E '^(megatron|pretrain_gpt\.py|gpt_builders\.py|model_provider\.py)$')
# and Megatron's token-dispatcher unit tests with what their conftests import (about 120 KB):
# tests/support/run_megatron_tests.py runs them (TestFlexDispatcher)
for f in tests/__init__.py tests/unit_tests/__init__.py tests/unit_tests/conftest.py tests/unit_tests/test_utilities.py \
    tests/unit_tests/dist_checkpointing/__init__.py tests/unit_tests/dist_checkpointing/utils.py \
    tests/unit_tests/transformer/__init__.py tests/unit_tests/transformer/moe/__init__.py \
    tests/unit_tests/transformer/moe/conftest.py tests/unit_tests/transformer/moe/test_token_dispatcher.py \
    tests/test_utils/python_scripts/download_unit_tests_dataset.py; do
  git -C "$GIT_DIR" cat-file -e "$REV:$f" 2>/dev/null && paths="$paths $f"
done
# DEST is replaced only when it is empty or an earlier tree of this script (REVISION and megatron/)
if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST" 2>/dev/null)" ] && ! { [ -f "$DEST/REVISION" ] && [ -d "$DEST/megatron" ]; }; then
  echo "$0: $DEST exists and is not a tree of this script: give a new or empty directory" >&2; exit 2
fi
rm -rf -- "$DEST"; mkdir -p "$DEST"
# shellcheck disable=SC2086
git -C "$GIT_DIR" archive "$REV" $paths | tar -x -C "$DEST"
echo "$(git -C "$GIT_DIR" rev-parse "$REV")" > "$DEST/REVISION"
echo "$DEST: Megatron-LM $REV ($(cut -c1-10 "$DEST/REVISION")), $(du -sh "$DEST" | cut -f1)"
