"""Two backends as one (SGLang's --prefill-attention-backend / --decode-attention-backend):
prompts and their chunks run eagerly go through the prefill backend, everything else
through the decode backend: decode and verify steps, and every CUDA graph (the decode
graphs, and the prefill graphs that replay small prompts), whose capture is its alone.

With lone_prompts (auto on a GPU: registry.LONE_PROMPT_BACKEND) only a step of one prompt or
chunk goes to the prefill backend; a step of several prompts stays on the decode backend's.

Each forward is planned by one of the two, and every layer's attention goes to the backend
that planned it (ForwardBatch.planned_by)."""
from __future__ import annotations

from specserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode


class HybridBackend(AttentionBackend):

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend, lone_prompts: bool = False):
        super().__init__(decode.num_heads, decode.num_kv_heads, decode.head_dim)
        self.prefill, self.decode = prefill, decode
        self.lone_prompts = lone_prompts
        self.supports_cuda_graph = decode.supports_cuda_graph
        self.supports_prefill_graph = decode.supports_prefill_graph

    def plan(self, batch: ForwardBatch) -> None:
        self._plan_with(self.prefill if self._takes_prompts(batch) else self.decode, batch, "plan")

    def _takes_prompts(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.EXTEND and (not self.lone_prompts or batch.batch_size == 1)

    @property
    def name(self) -> str:
        prompts = "a prompt alone in its step" if self.lone_prompts else "prompts"
        return f"{self.decode.name} ({self.prefill.name} for {prompts})"

    def forward(self, q, k, v, layer, batch: ForwardBatch):
        return batch.planned_by.forward(q, k, v, layer, batch)

    def init_cuda_graph_state(self, max_bs: int, max_tokens_per_req: int, kv_pool) -> None:
        self.decode.init_cuda_graph_state(max_bs, max_tokens_per_req, kv_pool)

    def plan_for_capture(self, batch: ForwardBatch) -> None:
        self._plan_with(self.decode, batch, "plan_for_capture")

    def plan_for_replay(self, batch: ForwardBatch) -> None:
        self._plan_with(self.decode, batch, "plan_for_replay")

    def plan_ragged_extend(self, batch: ForwardBatch) -> None:
        self._plan_with(self.decode, batch, "plan_ragged_extend")

    @staticmethod
    def _plan_with(backend: AttentionBackend, batch: ForwardBatch, how: str) -> None:
        getattr(backend, how)(batch)
        batch.planned_by = backend
