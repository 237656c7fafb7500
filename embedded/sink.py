"""The attention sink built into the embedded model's weights and held there through training.

A real VLM's decoder is a pretrained LLM, and pretrained LLMs put most of a head's attention on one or two sink
tokens when it has nothing to read, a habit learnt over trillions of tokens that a model trained from scratch on a
few million never forms: its idle heads spread their mass over the image instead, and a sink planted at the start
is trained away within a few hundred steps. A real VLM's fine-tuning does not remove its sinks, so this one is
held: the sink is a fixed part of the architecture and training learns everything else around it.
"""

from __future__ import annotations

import math

HELD_SINK_LOGIT = 6.0  # the logit the sink starts at, and where a recipe's ``sink_ramp`` starts


def sink_logit_at(final: float, ramp: tuple[float, float] | None, frac: float) -> float:
    """The held sink's logit at fraction ``frac`` of the main stage: ``final``, or under ``ramp`` (FROM, TO)
    HELD_SINK_LOGIT until FROM, rising linearly to ``final`` at TO (vision learns to read under the weak sink)."""
    if ramp is None:
        return final
    lo, hi = ramp
    t = 1.0 if frac >= hi else 0.0 if frac <= lo else (frac - lo) / (hi - lo)
    return HELD_SINK_LOGIT + t * (final - HELD_SINK_LOGIT)


class HeldSink:
    """An attention sink on ``token_id``, put back into the weights after every optimizer step.

    It sits on the system prompt's role word, which every prompt carries once, at position 1 (``<|im_start|>``
    recurs at every turn, and three equal sinks would take turns at being the most-attended position).

    One hidden dimension ``s`` (the last) and one rotary pair per head (``pair`` = d/2 - 1, the slowest, and its
    partner ``pair + d/2``) belong to the sink; every entry below is held at the value shown:
    - the sink token's embedding is ``magnitude`` on ``s`` and 0 elsewhere (a "massive activation"); every other
      token's is 0 on ``s``; no layer writes ``s`` (``o_proj`` and ``down_proj`` rows ``s`` are 0) and neither
      does the vision tower (its merger's output row ``s``), so the sink token alone carries it, into every layer;
    - each layer's RMSNorm weights on ``s`` are 1, and ``s`` reaches attention only through the sink's key:
      ``k_proj`` rows ``pair``/``pair + d/2`` are 0 but for ``gain`` on ``s``, with 0 bias; columns ``s`` of
      ``q_proj``/``k_proj``/``v_proj`` are 0 otherwise;
    - ``q_proj`` rows ``pair``/``pair + d/2`` have 0 weights and bias ``(gain, 0)``: every query meets the sink key
      with logit ``logit * cos(w * distance)`` in the first layer, and at the shipped size's w = 1.8e-4 rad per
      token that is ``logit`` to within 1% over a 700-token sample. In later layers the sink token's hidden state
      also holds what attention and MLPs wrote into it, which RMSNorm weighs against ``s``; ``magnitude`` is there
      to keep ``s`` dominant and the logit near ``logit``.
    In the first layer the sink's value is ``v_proj``'s bias alone (a no-op, as a pretrained sink's near-zero value
    is); later layers may learn to give it one. Heads still choose how much mass to leave on it: a head that reads an
    object raises that object's logits above ``logit``. Gradients on the held entries are zeroed (so they leave
    clipping and Adam's moments alone) and ``restore`` undoes AdamW's decoupled weight decay on them after each step.
    """

    def __init__(self, model, token_id: int, logit: float = HELD_SINK_LOGIT, magnitude: float = 10.0):
        import torch

        text = model.model.language_model
        emb = text.embed_tokens.weight  # (V, D); tied to lm_head: only the sink token's logit reads s
        D = emb.shape[1]
        s = D - 1
        head_dim = model.config.text_config.hidden_size // model.config.text_config.num_attention_heads
        pair, half = head_dim // 2 - 1, head_dim // 2
        # RMSNorm maps the sink token's hidden state to ~sqrt(D) on s, so q . k / sqrt(d) = gain^2 sqrt(D/d) = logit
        self.logit, self.scale = logit, math.sqrt(head_dim) / math.sqrt(D)
        gain = math.sqrt(logit * self.scale)
        self.held: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []  # (param, mask, value)
        self.gain_entries: list[tuple[torch.Tensor, tuple]] = []  # (value tensor, index): the entries set to gain

        self._hold(emb, (slice(None), s), 0.0)
        self._hold(emb, token_id, 0.0)
        self._hold(emb, (token_id, s), magnitude)
        merger_out = [m for m in model.model.visual.merger.modules() if isinstance(m, torch.nn.Linear)][-1]
        self._hold(merger_out.weight, s, 0.0)
        self._hold(merger_out.bias, s, 0.0)
        for layer in text.layers:
            att = layer.self_attn
            self._hold(layer.input_layernorm.weight, s, 1.0)
            self._hold(layer.post_attention_layernorm.weight, s, 1.0)
            self._hold(att.o_proj.weight, s, 0.0)
            self._hold(layer.mlp.down_proj.weight, s, 0.0)
            for proj in (att.q_proj, att.k_proj, att.v_proj):
                self._hold(proj.weight, (slice(None), s), 0.0)
            for proj, planted in ((att.q_proj, "bias"), (att.k_proj, "weight")):
                heads = proj.out_features // head_dim
                rows = torch.cat([torch.arange(heads) * head_dim + pair, torch.arange(heads) * head_dim + pair + half])
                first = torch.arange(heads) * head_dim + pair
                self._hold(proj.weight, rows, 0.0)
                self._hold(proj.bias, rows, 0.0)
                index = first if planted == "bias" else (first, s)
                target = proj.bias if planted == "bias" else proj.weight
                self.gain_entries.append((self._hold(target, index, gain), index))
        self.restore()
        for param, mask, _ in self.held:
            param.register_hook(lambda g, m=mask: g.masked_fill(m, 0.0))

    def _hold(self, param, index, value):
        """Hold ``param[index]`` at ``value``: one (mask, value) entry per parameter, a later value winning."""
        import torch

        mask = torch.zeros_like(param, dtype=torch.bool)
        mask[index] = True
        target = torch.zeros_like(param)
        target[index] = value
        for p, m, t in self.held:
            if p is param:
                t.copy_(torch.where(mask, target, t))
                m |= mask
                return t
        self.held.append((param, mask, target))
        return target

    def set_logit(self, logit: float) -> None:
        """Hold the sink at ``logit`` from now on (a recipe's ``sink_ramp``): the query bias and key weight that
        meet on the sink's rotary pair both become sqrt(logit * sqrt(d) / sqrt(D))."""
        if logit == self.logit:
            return
        gain = math.sqrt(logit * self.scale)
        for value, index in self.gain_entries:
            value[index] = gain
        self.logit = logit
        self.restore()

    def restore(self) -> None:
        import torch

        with torch.no_grad():
            for param, mask, value in self.held:
                param.copy_(torch.where(mask, value, param))
