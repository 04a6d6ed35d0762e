"""Helpers shared by the speculative-decoding tests: SmolLM2 engines that reuse one loaded
checkpoint, tiny random-weight Hugging Face directories (with tokenizers the Engine can
load), spies on the drafter / allocator, and the accounting checks."""
from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from unittest import mock

import torch
import transformers

CODE = '''def merge_sorted(a, b):
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    return result + a[i:] + b[j:]
'''


# A code-editing request (a raw prompt: the chat template's system prompt would add 30 tokens
# to every prefill): the answer copies the code, so n-gram drafts get accepted.
CODE_PROMPT = f"Python code:\n```python\n{CODE}```\nRepeat the code above:\n```python\n"


# ---- SmolLM2 engines that share one parsed checkpoint and its built weights ----
_built_models: dict = {}   # (config, device, dtype, context length, the checkpoint's tensors) -> a built model
_build_lock = threading.Lock()


def _model_tensors(model) -> dict:
    """id -> tensor of every tensor a built model's modules hold (parameters, buffers and plain
    attributes such as CpuLinear.packed, also inside lists, tuples and dicts)."""
    found = {}

    def add(value):
        if isinstance(value, torch.Tensor):
            found[id(value)] = value
        elif isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        elif isinstance(value, dict):
            for item in value.values():
                add(item)
    for module in model.modules():
        add(vars(module))
    return found


def shared_model_build(original_build):
    """runner.model_runner.build_model for test engines over one loaded checkpoint: the first
    engine of a process builds the model as any engine does (copying the weights in, then the
    CPU layouts: oneDNN's packed copy and the column-major one, ~6 s of one core for SmolLM2);
    each later engine gets its own module tree (so a patch on one engine's model, or its
    per-engine attributes, stay its own) over those same weight tensors, bit for bit what it
    would have built. The weights are read-only once built: no forward writes them."""
    def build(config, state_dict, device, dtype, context_length, tp=None):
        if tp is not None:
            return original_build(config, state_dict, device, dtype, context_length, tp)
        key = (repr(config), str(device), dtype, context_length,
               tuple((name, t.data_ptr(), tuple(t.shape), t.dtype) for name, t in state_dict.items()))
        with _build_lock:
            if key not in _built_models:
                _built_models[key] = original_build(config, state_dict, device, dtype, context_length, tp)
            model = _built_models[key]
            # the same tensors (memo), new modules and attributes
            return copy.deepcopy(model, memo=_model_tensors(model))
    return build


class SmolEngines:
    """Makes fp32 CPU engines over SmolLM2 from an already-loaded checkpoint (parsing the GGUF
    again costs seconds); `close()` shuts down and drops every engine it made."""

    def __init__(self, path: str, checkpoint):
        self.path, self.checkpoint = path, checkpoint
        self.engines: list = []

    def make(self, **server_args):
        from specserve.engine import builder
        from specserve.engine.engine import Engine
        from specserve.runner import model_runner

        def reuse_checkpoint(model_path, dtype, device="cpu"):
            assert model_path == self.path and dtype == torch.float32, (model_path, dtype)
            # the builder drops state_dict from what it gets: hand it a copy; one tokenizer per engine thread
            return dataclasses.replace(self.checkpoint, state_dict=dict(self.checkpoint.state_dict),
                                       tokenizer=copy.deepcopy(self.checkpoint.tokenizer))

        kwargs = {"dtype": "float32", "device": "cpu", "log_level": "warning", "max_total_tokens": 4096, **server_args}
        with mock.patch.object(builder, "load_checkpoint", reuse_checkpoint), \
                mock.patch.object(model_runner, "build_model", shared_model_build(model_runner.build_model)):
            engine = Engine(model_path=self.path, **kwargs)
        self.engines.append(engine)
        return engine

    def close(self, engine=None) -> None:
        for e in ([engine] if engine is not None else list(self.engines)):
            e.shutdown()
            if e in self.engines:
                self.engines.remove(e)


def ngram_args(num_draft_tokens: int, one_branch: bool = False, adaptive: bool = False, **extra) -> dict:
    """NGRAM at a pinned draft size (every step verifies what the trie proposes, which is
    what tests of verification need), or with the adaptive policy, the engine's default."""
    return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": num_draft_tokens,
            "speculative_one_branch": one_branch, "speculative_disable_adaptive": not adaptive, **extra}


def price_steps(engine, plain_seconds: float, seconds_per_node: float):
    """The adaptive policy prices steps from a fixed cost model (a plain step plain_seconds,
    seconds_per_node more per verified node a request: of the largest tree, or of the nodes
    a ragged step verified) instead of this CPU's timings: whether drafting pays then
    depends on acceptance alone, not on what else the machine runs (a busy 2-core CPU made
    the policy stop drafting in about one run of two)."""
    adaptive = engine.core.adaptive
    record = adaptive.record_step

    def priced(batch_size, tree_size, seconds, tokens=None, steady=True, nodes=None, prefill=False):
        per_request = nodes / batch_size if nodes is not None and tree_size > 1 else tree_size
        record(batch_size, tree_size, plain_seconds + seconds_per_node * (per_request - 1), tokens, steady, nodes,
               prefill)
    adaptive.record_step = priced
    return engine


# ---- tiny random-weight Hugging Face directories ----
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


def save_bpe_tokenizer(directory: str) -> None:
    """A byte-level BPE tokenizer trained on one sentence (as tests/test_loader.py makes): small,
    offline, and of a kind transformers rebuilds for any architecture."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["hello world, a tiny tokenizer for speculative decoding tests"], trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>")
    tokenizer.save_pretrained(directory)


LETTERS = [chr(ord("a") + i) for i in range(13)]            # with 3 special tokens: a vocabulary of 16


def save_letter_tokenizer(directory: str) -> int:
    """A word-level tokenizer over <unk> <s> </s> a..m (ids 0..15); returns the vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *LETTERS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>")
    tokenizer.save_pretrained(directory)
    return len(vocab)


def make_tiny_directory(path, architecture: str = "llama", vocab_size: int = 256, seed: int = 0,
                        tokenizer: str = "bpe", weight_std: float | None = 1.0,
                        logit_scale: float = 1.0) -> transformers.PreTrainedModel:
    """Saves a random-weight model (and a tokenizer) that `Engine(model_path=path)` loads.

    weight_std: every parameter ~ N(0, std) (random norms and biases too, so a swapped tensor
    shows; large weights also keep greedy away from near-ties); None keeps HF's init.
    logit_scale multiplies lm_head, to make the distribution peakier."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[architecture]
    config = config_class(**TINY, vocab_size=vocab_size, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        if weight_std is not None:
            for parameter in model.parameters():
                parameter.normal_(std=weight_std)
        else:
            for name, parameter in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    parameter.add_(torch.randn_like(parameter) * 0.1)
        model.lm_head.weight.mul_(logit_scale)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer == "bpe":
        save_bpe_tokenizer(str(path))
    else:
        assert save_letter_tokenizer(str(path)) == vocab_size
    return model


def tiny_engine(path, **server_args):
    from specserve.engine.engine import Engine
    return Engine(model_path=str(path), **{"dtype": "float32", "device": "cpu", "log_level": "warning", **server_args})


# ---- spies (wrap a bound method on one instance; they run in the engine's thread) ----
class ProposeSpy:
    """Records the trees a drafter proposes: per call, per request, (tokens, parents) of the real nodes.
    A fused chain's chained steps (on a GPU, most of its steps) are proposed by no call: their
    chains are the pending drafts of the requests they are adopted for (`adopt_chained`), and
    are recorded there."""

    def __init__(self, drafter):
        self.trees: list[tuple[list[int], list[int]]] = []
        original = drafter.propose

        def propose(reqs, max_nodes):
            trees, num_nodes = original(reqs, max_nodes)
            self._record(trees, num_nodes)
            return trees, num_nodes

        drafter.propose = propose
        if hasattr(drafter, "adopt_chained"):
            adopt_chained = drafter.adopt_chained

            def adopt(reqs, *args):
                self._record(*drafter.chained_proposal(reqs))
                return adopt_chained(reqs, *args)

            drafter.adopt_chained = adopt

    def _record(self, trees, num_nodes) -> None:
        for row, count in enumerate(num_nodes):
            self.trees.append((trees.tokens[row, :count].tolist(), trees.parents[row, :count].tolist()))

    @property
    def drafted_nodes(self) -> int:
        """Draft nodes proposed in all (root not counted)."""
        return sum(len(tokens) - 1 for tokens, _ in self.trees)

    @property
    def branching_trees(self) -> int:
        """Trees in which some node has two or more children."""
        return sum(len([p for p in parents if p >= 0]) != len(set(p for p in parents if p >= 0))
                   for _, parents in self.trees)


class AllocSpy:
    """Counts slot allocations the scheduler refused (returned None)."""

    def __init__(self, scheduler):
        self.refused = 0
        original = scheduler.alloc_slots

        def alloc_slots(count):
            slots = original(count)
            self.refused += slots is None
            return slots

        scheduler.alloc_slots = alloc_slots


# ---- accounting ----
def plain_greedy_outputs(path, prompts: list[list[int]], params: dict) -> list[list[int]]:
    """What plain decoding answers: the output ids a speculative engine must reproduce."""
    with tiny_engine(path) as plain:
        return [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]


def committed_by_verify_steps(output: dict) -> int:
    """Tokens the verify steps committed, counted from the accept-length histogram (it counts
    tokens a stop later cut off, the output does not)."""
    return sum(length * count for length, count in output["meta_info"]["spec_accept_histogram"].items())


def truncated_mid_path(output: dict) -> bool:
    """The last verify step accepted tokens past the stop: the first output token comes from the
    prefill, the rest from verify steps, so without a cut the two counts agree."""
    return committed_by_verify_steps(output) > len(output["output_ids"]) - 1


def cached_draft_rows(engine) -> list[int]:
    """The draft head's rows the prefix cache holds beside the target's KV (kv/draft_rows.py):
    none without the cache, or for a drafter whose rows it does not keep."""
    tree = engine.core.scheduler.kv.tree
    return list(tree.held_slots(draft=True)) if tree is not None and tree.draft_allocator is not None else []


def assert_draft_pool_is_free(pool, cached: list[int]) -> None:
    """Every slot of a drafter's pool is free or one of the prefix cache's rows, exactly once."""
    free = pool.slots.free_list()
    assert len(free) + len(cached) == pool.size, f"{pool.size - len(free) - len(cached)} draft slots leaked"
    assert sorted(free + cached) == list(range(1, pool.size + 1))     # none lost or freed twice


def wait_until_all_kv_is_free(engine, timeout: float = 30.0) -> None:
    """The core runs in its own thread: poll, then check every slot is free or in the prefix
    cache (unheld) exactly once, and every req_to_token row is free."""
    core, pool = engine.core, engine.core.runner.pool
    all_rows = pool.max_requests
    deadline = time.monotonic() + timeout
    while core.has_work() or core.scheduler.available_slots() != pool.size or pool.free_rows() != all_rows:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not core.has_work() and not core.requests
    leaked = pool.size - core.scheduler.available_slots()
    assert leaked == 0, f"{leaked} slots leaked"
    core.scheduler.check_kv()     # no slot lost or freed twice
    assert pool.free_rows() == all_rows
    assert sorted(pool._free_rows) == list(range(all_rows))
