"""HiddenCapture: asks DecoderLM.forward to keep some hidden states besides the logits.

EAGLE drafters read the target's hidden states: EAGLE-3 the residual stream after a low,
a middle and a high decoder layer, EAGLE-2 the final-normed state (the lm_head's input).
A forward batch that carries a HiddenCapture gets them filled in, at the token rows it
names; a batch without one (the default) runs exactly as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers whose outputs EAGLE-3 fuses, as SGLang and SpecForge pick them by default."""
    if num_layers < 5:  # num_layers - 4 would not be above the middle layer
        return 0, max(num_layers // 2 - 1, 0), num_layers - 1
    return 1, num_layers // 2 - 1, num_layers - 4


@dataclass
class HiddenCapture:
    layers: tuple[int, ...]              # keep the residual stream after these decoder layers (0-based)
    final: bool = False                  # also keep the final-normed state, the lm_head's input
    rows: torch.Tensor | None = None     # (num_rows,) token rows of the batch to keep; None keeps all
    # filled by DecoderLM.forward:
    layer_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (num_rows, hidden)
    final_state: torch.Tensor | None = None                                # (num_rows, hidden)
    given: torch.Tensor | None = None    # features() computed elsewhere (a prefill graph's output)

    def fresh(self) -> "HiddenCapture":
        """An empty capture of the same states: one per forward, from a template."""
        return HiddenCapture(self.layers, self.final, self.rows)

    def features(self) -> torch.Tensor:
        """What an EAGLE head reads: the kept layers side by side (EAGLE-3), else the final state."""
        if self.given is not None:
            return self.given
        return self.concatenated() if self.layers else self.final_state

    def give_features(self, features: torch.Tensor) -> None:
        """Sets what features() returns: computed by a CUDA graph that ran this capture's forward."""
        self.given = features

    def check(self, num_layers: int) -> None:
        bad = [layer for layer in self.layers if not 0 <= layer < num_layers]
        if bad:
            raise ValueError(f"HiddenCapture.layers must lie in [0, {num_layers}), got {bad}")
        if not self.layers and not self.final:
            raise ValueError("HiddenCapture needs at least one of layers and final")

    def keep(self, layer: int, hidden: torch.Tensor) -> None:
        self.layer_states[layer] = self._rows_of(hidden)

    def keep_final(self, hidden: torch.Tensor) -> None:
        self.final_state = self._rows_of(hidden)

    def _rows_of(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.rows is None else hidden[self.rows]

    def concatenated(self) -> torch.Tensor:
        """The kept layer states side by side in the order of `layers`: (num_rows, len(layers) * hidden),
        the input of an EAGLE-3 head's fc."""
        return torch.cat([self.layer_states[layer] for layer in self.layers], dim=-1)
