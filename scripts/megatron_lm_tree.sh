#!/usr/bin/env bash
# The part of a Megatron-LM checkout that pretrain_gpt.py needs (megatron/, pretrain_gpt.py and
# the modules beside it that it imports), exported from a git clone at one revision into DEST:
# what the GPU tests of pretrain_gpt.py carry to a GPU machine without network (about 11 MB,
# against a whole checkout's 63 MB with its tests).
#   bash scripts/megatron_lm_tree.sh GIT_DIR REV DEST
#   e.g. bash scripts/megatron_lm_tree.sh ~/Megatron-LM d98e8a64dd .carry/megatron-lm-main
#        bash scripts/megatron_lm_tree.sh ~/Megatron-LM core_v0.19.0 .carry/megatron-lm-r0.19
set -euo pipefail
[ $# -eq 3 ] || { echo "usage: $0 GIT_DIR REV DEST" >&2; exit 2; }
GIT_DIR=$1 REV=$2 DEST=$3
paths=$(git -C "$GIT_DIR" ls-tree --name-only "$REV" | grep -E '^(megatron|pretrain_gpt\.py|gpt_builders\.py|model_provider\.py)$')
rm -rf "$DEST"; mkdir -p "$DEST"
# shellcheck disable=SC2086
git -C "$GIT_DIR" archive "$REV" $paths | tar -x -C "$DEST"
echo "$(git -C "$GIT_DIR" rev-parse "$REV")" > "$DEST/REVISION"
echo "$DEST: Megatron-LM $REV ($(cut -c1-10 "$DEST/REVISION")), $(du -sh "$DEST" | cut -f1)"
