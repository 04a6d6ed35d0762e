#!/usr/bin/env bash
# Benchmark jobs side by side on a machine of several GPUs, one queue a GPU, run from the repo root:
#   scripts/gpu_parallel.sh JOBS_FILE
# Each line of JOBS_FILE is "GPU COMMAND..." (blank lines and #-comments skipped), e.g.
#   0 AB_TREE=.ab/old scripts/gpu_run.sh suite-tree qwen2.5-coder-0.5b-instruct
#   1 AB_TREE=. scripts/gpu_run.sh suite-tree qwen2.5-coder-0.5b-instruct
# A GPU's lines run in order and the GPUs at once, each job with CUDA_VISIBLE_DEVICES=GPU, its own
# OUT ($OUT/gGPU/jN) and its own compile caches (two processes building one Triton or vLLM cache at
# once is a race); shared builds (HF directories, the peers' installs, /tmp/site) take file locks.
# Every job ends by PARALLEL_DEADLINE_S (540) after the start, so a call under the device's
# 10-minute limit always returns: each GPU's outputs come back packed as $OUT/gpuN.tar (a call
# returns 8 files at most), with each job's log and exit status.
# The jobs share the host's cores: an A/B runs its two trees at once on two GPUs, so both see the
# same host load, rather than one after the other.
set -uo pipefail
jobs_file=${1:?usage: scripts/gpu_parallel.sh JOBS_FILE}
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
end=$(( $(date +%s) + ${PARALLEL_DEADLINE_S:-540} ))
export PARALLEL_END=$end   # a job that ends on time by itself (gpu_run.sh peers-eagle) reads it
run_queue() {   # GPU: that GPU's jobs, one after another, until the deadline
  local gpu=$1 n=0 line
  grep -E "^[[:space:]]*$gpu[[:space:]]" "$jobs_file" | while read -r _ line; do
    n=$((n + 1)); local out="$OUT/g$gpu/j$n" left=$((end - $(date +%s)))
    mkdir -p "$out"; echo "$line" > "$out/command.txt"
    if [ $left -le 5 ]; then echo "not started: the deadline passed" > "$out/status.txt"; continue; fi
    CUDA_VISIBLE_DEVICES=$gpu OUT=$out XDG_CACHE_HOME=/root/cache/g$gpu SPECSERVE_CACHE_DIR=/root/cache/g$gpu/specserve \
      TRITON_CACHE_DIR=/root/cache/g$gpu/triton timeout -k 5 $left bash -c "$line" > "$out/log.txt" 2>&1
    echo "exit $? after $(( $(date +%s) - end + ${PARALLEL_DEADLINE_S:-540} )) s of the call" > "$out/status.txt"
  done
  tar -cf "$OUT/gpu$gpu.tar" -C "$OUT" "g$gpu" && rm -rf "${OUT:?}/g$gpu"
}
gpus=$(grep -E '^[[:space:]]*[0-9]+[[:space:]]' "$jobs_file" | awk '{print $1}' | sort -un)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
for gpu in $gpus; do run_queue "$gpu" & done
wait
for gpu in $gpus; do echo "== GPU $gpu"; tar -xOf "$OUT/gpu$gpu.tar" --wildcards '*/status.txt' 2>/dev/null; done
