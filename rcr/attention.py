"""The attention function registered with transformers' ``AttentionInterface`` as ``"rcr"``.

transformers calls it after ``cache.update`` and before attention, with the post-RoPE query of the
current token: exactly where drift is measured and slots are re-selected. The function itself is a thin
dispatcher: the object passed as the ``rcr_hook`` forward kwarg (transformers forwards extra kwargs down
to the attention call) does the work. Without a hook it is plain SDPA, so a model left on ``"rcr"`` still
behaves normally.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "rcr"


def rcr_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    hook = kwargs.pop("rcr_hook", None)
    if hook is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    return hook(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


# Registration is idempotent; the mask function must be registered under the same name, or transformers
# silently builds no mask for the prefill.
AttentionInterface.register(NAME, rcr_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_valid: torch.Tensor | None,
           scaling: float, causal_tail: int = 0, sliding_window: int | None = None) -> torch.Tensor:
    """SDPA over resident slots. query (B, Hq, q, d); keys/values (B, Hkv, n, d); slot_valid (B, Hkv, n).

    ``causal_tail``: the last ``q`` slots are the queries' own keys and are causally masked (teacher-forced
    passes); 0 for one-token decode. ``sliding_window`` (with ``causal_tail``): the slots are the whole sequence
    in position order (a layer that is never re-selected) and query i, at slot n - q + i, sees only slots
    j > n - q + i - window, as transformers' sliding-window mask; a one-token decode passes the window in
    ``slot_valid`` instead (``ResidentLayer.in_window``). Returns (B, q, Hq, d), the layout transformers expects.
    """
    if sliding_window is not None and not causal_tail:
        raise ValueError("attend: sliding_window needs causal_tail (the queries are the last slots)")
    B, Hq, q, d = query.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    if q == 1 and not causal_tail:
        # One-token decode: the G query heads of a KV head are G query rows of one attention head (query head j
        # belongs to KV head j // G, transformers' repeat_kv convention), so SDPA reads each KV head once.
        # With enable_gqa, CPU SDPA reads every KV head once per query head: G times the memory traffic.
        mask = None if slot_valid is None else slot_valid.unsqueeze(2)  # (B, Hkv, 1, n), broadcast over G
        out = F.scaled_dot_product_attention(query.reshape(B, Hkv, G, d), keys, values, attn_mask=mask,
                                             scale=scaling)  # (B, Hkv, G, d)
        return out.reshape(B, 1, Hq, d)
    mask = None
    if slot_valid is not None:
        mask = slot_valid.repeat_interleave(G, dim=1).unsqueeze(2)  # (B, Hq, 1, n)
    if causal_tail:
        n = keys.shape[2]
        causal = torch.ones(q, n, dtype=torch.bool, device=query.device)
        causal[:, n - q:] = torch.ones(q, q, dtype=torch.bool, device=query.device).tril()
        mask = causal if mask is None else mask & causal
    if sliding_window is not None:
        n = keys.shape[2]
        at = torch.arange(n - q, n, device=query.device).unsqueeze(1)  # (q, 1) the queries' own slots
        win = torch.arange(n, device=query.device) > at - sliding_window  # (q, n)
        mask = win if mask is None else mask & win
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


@contextlib.contextmanager
def rcr_attention_enabled(model):
    """Route the text model's attention through ``"rcr"`` for the duration; the vision tower is untouched.
    Restores the previous implementation on exit."""
    text_cfg = model.config.get_text_config()
    previous = text_cfg._attn_implementation
    model.set_attn_implementation({"text_config": NAME})
    try:
        yield model
    finally:
        model.set_attn_implementation({"text_config": previous})
