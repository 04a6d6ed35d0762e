"""What a second of the EAGLE trainer's data making buys: learned tokens per second of the
target generating answers to chat-turn prompts, against the target's prefill labelling of
the chats' own replies (its states and its distribution over the text, as a training
batch takes them). The numbers behind train_eagle's --generation-share.

  python -m lab.eagle_data_rate --dataset-path .gpu/sharegpt_train.json             # SmolLM2, CPU
  python -m lab.eagle_data_rate --model-path qwen2.5-coder-1.5b-instruct.gguf --num-prompts 1024 \\
      --num-chats 512 --max-new-tokens 384 --batch-tokens 8192 --dataset-path .gpu/sharegpt_train.json
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from specserve.runner.model_runner import resolve_device, resolve_dtype
from specserve.training.eagle_batches import BatchBuilder, plan_batches
from specserve.training.eagle_chats import reply_text_conversations, training_chats, turn_prompts
from specserve.training.eagle_data import Conversation, generate_conversations
from specserve.training.eagle_trainer import target_lm_head
from specserve.training.target_features import TargetFeatureExtractor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lab.eagle_data_rate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--num-prompts", type=int, default=16, help="turn prompts the target answers")
    p.add_argument("--num-chats", type=int, default=16, help="chats whose replies are labelled by prefill")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-text-len", type=int, default=1024)
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per prefill batch")
    p.add_argument("--aux-layers", type=int, nargs="*", default=None, help="default: low, middle, high (EAGLE-3)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    from specserve.engine.engine import Engine
    # the engine train_eagle generates with (on a GPU every batch size decodes in a CUDA graph)
    gpu = dict(mem_fraction_static=0.5, cuda_graph_max_bs=args.max_running_requests) if device.type == "cuda" else {}
    engine = Engine(model_path=args.model_path, device=str(device), log_level="warning",
                    dtype=str(resolve_dtype("auto", device)).removeprefix("torch."),
                    context_length=max(args.max_prompt_len + args.max_new_tokens, args.max_text_len) + 8,
                    max_running_requests=args.max_running_requests, **gpu)
    chats = training_chats(args.dataset_path, None)
    random.Random(0).shuffle(chats)
    prompts = turn_prompts(chats, engine.tokenizer, args.max_prompt_len, args.num_prompts)
    started = time.perf_counter()
    answers = generate_conversations(engine, prompts, args.max_new_tokens, 0.0,
                                     max_in_flight=args.max_running_requests)
    generation_s = time.perf_counter() - started
    texts = reply_text_conversations(chats[:args.num_chats], engine.tokenizer, args.max_text_len)
    model = engine.core.runner.model
    engine.shutdown()
    labelling_s = prefill_labelling_seconds(model, texts, args.batch_tokens, args.aux_layers)
    print(json.dumps({
        "device": device.type, "generation": rate(answers, generation_s), "prefill_labelling": rate(texts, labelling_s),
    }))


def prefill_labelling_seconds(model, texts: list[Conversation], batch_tokens: int,
                              aux_layers: list[int] | None) -> float:
    """Seconds to build the training batches of `texts` (the target's states and its
    distribution at the replies), timed after one warm-up batch."""
    num_layers = model.config.num_layers
    layers = tuple(aux_layers) if aux_layers is not None else (1, num_layers // 2 - 1, num_layers - 4)
    lengths = [len(c.tokens) for c in texts]
    extractor = TargetFeatureExtractor(model, layers, max(batch_tokens, max(lengths)),
                                       max(1, batch_tokens // min(lengths)), max(lengths))
    builder = BatchBuilder(extractor, target_lm_head(model), bool(layers))
    groups = plan_batches(lengths, batch_tokens, seed=0)
    builder([texts[i] for i in groups[0]])
    synchronize(extractor.device)
    started = time.perf_counter()
    for group in groups:
        builder([texts[i] for i in group])
    synchronize(extractor.device)
    return time.perf_counter() - started


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(conversations: list[Conversation], seconds: float) -> dict:
    learned = sum(c.answer_len for c in conversations)
    total = sum(len(c.tokens) for c in conversations)
    return {"sequences": len(conversations), "learned_tokens": learned, "tokens": total, "seconds": round(seconds, 2),
            "learned_tokens_per_s": round(learned / seconds), "tokens_per_s": round(total / seconds)}


if __name__ == "__main__":
    main()
