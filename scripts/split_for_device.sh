#!/usr/bin/env bash
# ../shared/tools/split-for-device with pieces sized to what this checkout leaves of a device call:
# the working tree that travels (tracked and untracked-not-ignored files) and one piece share the
# call's 64 MiB, and the tree (docs/bench's raw rows) passed 8 MiB, which the shared tool's 56-MiB
# pieces no longer fit (the call then fails: "the working tree is larger than 64 MiB").
#
#   scripts/split_for_device.sh FILE...      (run in the repository root; prints the calls)
#
# Writes .stage/NN/ (one piece each, .stage/00 also SHA256SUMS); the rebuilt files land in /root/models/.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: scripts/split_for_device.sh FILE..." >&2; exit 2; }
files=(); for f in "$@"; do files+=("$(realpath "$f")"); done
cd "$(git rev-parse --show-toplevel)"
grep -qxF '/.stage/' .git/info/exclude 2>/dev/null || echo '/.stage/' >> .git/info/exclude
[ ! -d heads ] || { echo "heads/ travels with every call and leaves too little room: scripts/heads_aside.sh out first" >&2; exit 1; }
tree=$( (git ls-files -z; git ls-files -z -o --exclude-standard) | { xargs -0 -r stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
# 4 MiB to spare: each lease adds raw rows to the tree, and pieces cut to the last MiB stop fitting
piece=$((59 * 1024 * 1024 - tree))
[ $piece -ge $((8 * 1024 * 1024)) ] || { echo "the tree takes $((tree >> 20)) MiB of the call's 64: too little room for pieces" >&2; exit 1; }
rm -rf .stage; mkdir -p .stage/pieces
for f in "${files[@]}"; do split -b $piece -d -a 3 "$f" ".stage/pieces/$(basename "$f").part"; done
n=0; for p in .stage/pieces/*; do d=$(printf '.stage/%02d' $n); mkdir -p "$d"; mv "$p" "$d/"; n=$((n + 1)); done
rmdir .stage/pieces
for f in "${files[@]}"; do echo "$(sha256sum "$f" | cut -d' ' -f1)  $(basename "$f")"; done > .stage/00/SHA256SUMS
echo "tree $((tree >> 20)) MiB, pieces of $((piece >> 20)) MiB. Make these device run calls back to back:"
for d in .stage/[0-9][0-9]; do echo "  carry [\"$d\"]   command: mkdir -p /root/stage && cp $d/* /root/stage/"; done
echo "then, with no carry:"
echo "  mkdir -p /root/models && cd /root/stage && for f in \$(ls *.part000 | sed 's/\\.part000\$//'); do cat \$f.part* > /root/models/\$f; done && cd /root/models && sha256sum -c /root/stage/SHA256SUMS"
