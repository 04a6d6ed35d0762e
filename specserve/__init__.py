"""specserve: an LLM serving engine built around lossless speculative decoding."""
from __future__ import annotations

from specserve.args import ServerArgs
from specserve.request.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams", "ServerArgs"]


def __getattr__(name: str):
    # Engine pulls in torch and transformers; import it only when asked for
    if name == "Engine":
        from specserve.engine.engine import Engine
        return Engine
    raise AttributeError(name)
