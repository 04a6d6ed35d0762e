#!/usr/bin/env bash
# heads/ (the kept EAGLE heads, ~48 MiB) is tracked, so it travels with every device call and leaves
# too little of a call's 64 MiB for the pieces that stage a model (scripts/split_for_device.sh).
# Move it aside while staging, and back before a call that serves a kept head (gpu_run.sh eagle-head
# converts it on the machine; later calls need it no more):
#
#   scripts/heads_aside.sh out     (heads/ into .git/heads-aside: git shows it deleted; commit only named paths,
#                                   and a pre-commit hook refuses a commit that deletes heads/ until `back`:
#                                   a `git commit -a` while it was aside once deleted the kept head)
#   scripts/heads_aside.sh back
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
aside="$(git rev-parse --git-dir)/heads-aside"
hook="$(git rev-parse --git-dir)/hooks/pre-commit"
case ${1:-} in
  out)  [ -d heads ] || { echo "no heads/ here" >&2; exit 1; }
        [ ! -e "$aside" ] || { echo "$aside exists: run '$0 back' first" >&2; exit 1; }
        [ ! -e "$hook" ] || { echo "$hook exists: this script's guard would replace it" >&2; exit 1; }
        mv heads "$aside" && mkdir -p "$(dirname "$hook")" \
          && printf '%s\n' '#!/bin/sh' \
               'if git diff --cached --name-only --diff-filter=D | grep -q "^heads/"; then' \
               '  echo "this commit deletes heads/, which scripts/heads_aside.sh moved aside: commit named paths" >&2' \
               '  exit 1' 'fi' > "$hook" && chmod +x "$hook" \
          && echo "heads/ is aside in $aside until '$0 back'" ;;
  back) [ -d "$aside" ] || { echo "nothing aside in $aside" >&2; exit 1; }
        [ ! -e heads ] || { echo "heads/ exists already" >&2; exit 1; }
        mv "$aside" heads && rm -f "$hook" && git status --short heads | head -5 ;;
  *)    echo "usage: $0 out|back" >&2; exit 2 ;;
esac
