"""Greedy outputs of the 1.5B on code-types prompts (bf16, one GPU), with the few-row kernels as the
environment sets them (SPECSERVE_ROW_KERNELS): plain at batch 1, plain at batch 32, pinned NGRAM at 32.
Run once with the kernels and once without: where the kernels compute wrong rows, batch 32's plain and
NGRAM outputs leave batch 1's far more often than bf16 rounding does without them.

  SPECSERVE_ROW_KERNELS={0,1} python -m lab.row_kernel_identity MODEL.gguf OUT_DIR
"""
import json
import os
import sys

from specserve.bench.gpu_suite import code_edit_workloads, set_drafter
from specserve.engine.engine import Engine


def main() -> None:
    model, out_dir = sys.argv[1], sys.argv[2]
    kernels = os.environ.get("SPECSERVE_ROW_KERNELS", "0")
    engine = Engine(model_path=model, speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                    cuda_graph_max_bs=64, log_level="warning", mem_fraction_static=0.5)
    prompts = code_edit_workloads(engine, 32)["code-types"][0][:32]
    params = {"temperature": 0, "max_new_tokens": 96}
    outputs = {}
    set_drafter(engine, None)
    outputs["plain_b1"] = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts[:12]]
    for name, spec in (("plain_b32", (None,)), ("ngram_b32", (16, True, False))):
        set_drafter(engine, *spec)
        outputs[name] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    same = lambda a, b: sum(x == y for x, y in zip(outputs[a], outputs[b]))
    print(f"kernels={kernels}: plain b32 == b1 {same('plain_b32', 'plain_b1')}/12, "
          f"ngram b32 == b1 {same('ngram_b32', 'plain_b1')}/12, ngram b32 == plain b32 {same('ngram_b32', 'plain_b32')}/32")
    with open(os.path.join(out_dir, f"row_kernels_{kernels}.json"), "w") as f:
        json.dump(outputs, f)
    engine.shutdown()


if __name__ == "__main__":
    main()
