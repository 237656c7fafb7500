"""``prefill_oracle``: a static selection scored by the uncompressed answer's own attention (docs/algorithms.md,
"prefill_oracle").

The scores come from one teacher-forced pass over [prompt ; uncompressed answer] with the full cache
(``rcr.generate.answer_attention_scores``): per (layer, KV head), the attention probability of each prefix
entry, averaged over the answer's query positions and the G query heads. An upper bound for *static*
selection.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..bacon_score import pool
from ..scoring import NEG_INF
from .base import BuildContext, Method
from .knobs import knob


@dataclass
class PrefillOracle(Method):
    name = "prefill_oracle"
    needs_reference = True

    pool: bool = knob(False, "average-pool the answer-attention scores like BACON (RCRConfig.bacon_kernel) before "
                             "the top-k")

    def validate(self) -> None:
        self.need(isinstance(self.pool, bool), "pool", "must be a bool")

    def initial_scores(self, ctx: BuildContext, layer: int):
        if ctx.reference_scores is None:
            raise RuntimeError("prefill_oracle needs the uncompressed answer's attention; run it through "
                               "rcr.generate, which decodes `full` first")
        s = ctx.reference_scores[layer]  # (B, Hkv, Np)
        if self.pool:
            s = pool(s, self.config.bacon_kernel)
        return s.masked_fill(~ctx.prefix.prefix_valid.unsqueeze(1), NEG_INF)
