"""Tiny random-weight models of every architecture, and a driver that runs our decoder
through the runner's real forward paths (prefill chunks, decode steps, draft trees)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import transformers

from specserve.args import ServerArgs
from specserve.model.config import ModelConfig
from specserve.runner.model_runner import ModelRunner
from specserve.verify.tree import TreeProposal

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

ARCHITECTURES = {
    "llama": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama3-rope-tied": lambda: transformers.LlamaConfig(
        **TINY, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
}


def tiny_hf_model(name: str, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = ARCHITECTURES[name]()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases and norms too, so a dropped weight shows up
        for param_name, param in model.named_parameters():
            if "norm" in param_name or param_name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


class RunnerDriver:
    """Feeds one sequence through ModelRunner the way the engine does, without the scheduler."""

    def __init__(self, config: ModelConfig, state_dict: dict, attention_backend: str = "torch_native",
                 kv_tokens: int = 512, **server_args):
        args = ServerArgs(max_total_tokens=kv_tokens, attention_backend=attention_backend, max_running_requests=4,
                          **server_args)
        # the runner empties the dict it gets: a copy, so that a session's checkpoint (conftest's
        # smollm2_checkpoint) keeps its weights for the next file sharing the process
        self.runner = ModelRunner(args, config, dict(state_dict), torch.device("cpu"), torch.float32, 256)
        self.req = SimpleNamespace(all_ids=[], kv_slots=[], row=self.runner.pool.alloc_row())

    @classmethod
    def from_hf(cls, hf_model, **kwargs) -> "RunnerDriver":
        return cls(ModelConfig.from_hf(hf_model.config), hf_model.state_dict(), **kwargs)

    @property
    def kv_len(self) -> int:
        return len(self.req.kv_slots)

    def _take_slots(self, count: int) -> list[int]:
        return self.runner.pool.slots.alloc(count)

    def _commit_slots(self, slots: list[int]) -> None:
        start = self.kv_len
        self.req.kv_slots.extend(slots)
        self.runner.pool.req_to_token[self.req.row, start:start + len(slots)] = torch.tensor(slots, dtype=torch.int32)

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Appends tokens through one EXTEND step; returns the logits of the last one."""
        self.req.all_ids = self.req.all_ids + tokens
        self.req.kv_len = self.kv_len
        slots = self._take_slots(len(tokens))
        logits = self.runner.extend([self.req], [len(tokens)], slots, [True])
        self._commit_slots(slots)
        return logits[0, 0]

    def decode(self, token: int) -> torch.Tensor:
        """One DECODE step feeding `token` (not yet cached); returns its logits."""
        self.req.all_ids = self.req.all_ids + [token]
        return self.verify_tree([token], [-1], commit_path=[0])[0]

    def verify_tree(self, tokens: list[int], parents: list[int], commit_path: list[int]) -> torch.Tensor:
        """Runs a draft tree rooted at tokens[0]; keeps the KV of the nodes on commit_path."""
        self.req.kv_len = self.kv_len
        proposal = TreeProposal.from_lists([(tokens, parents)])
        slots = self._take_slots(len(tokens))
        logits = self.runner.run_trees([self.req], proposal, slots).logits[0]
        self._commit_slots([slots[i] for i in commit_path])
        self.runner.pool.slots.free([s for i, s in enumerate(slots) if i not in commit_path])
        return logits
