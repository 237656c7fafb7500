"""The prefix store (read-only, shared by every method) and the resident cache that decoding attends to.

Shapes: B batch, Hkv KV heads, N padded prompt length, Np = N - window prefix entries, d head dim,
S selected slots, W window slots. Keys are stored post-RoPE (the HF convention), so moving an entry
between the prefix store and a resident slot never re-encodes it.

Resident layout per (layer, KV head):  [ S selected prefix slots | W window slots | generated ... ]
A refresh rewrites only the first S slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass
class PrefixLayer:
    """One layer's full prompt KV, as written by the prefill. Never modified by a method."""

    keys: torch.Tensor  # (B, Hkv, N, d), post-RoPE
    values: torch.Tensor  # (B, Hkv, N, d)
    window_queries: torch.Tensor  # (B, Hq, W, d), post-RoPE queries of the last W prompt tokens


@dataclass
class PrefixStore:
    """Everything one prefill produced, for every method's decode of the same batch."""

    layers: list[PrefixLayer]
    valid: torch.Tensor  # (B, N) bool: False at left padding
    next_position: torch.Tensor  # (B,) long: true position of the first generated token
    first_logits: torch.Tensor  # (B, V) logits of the last prompt position
    window: int  # W actually used (min(config.window, N))
    scaling: float
    n_kv_heads: int
    n_q_heads: int
    head_dim: int

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def prompt_len(self) -> int:  # N (padded)
        return self.valid.shape[1]

    @property
    def n_prefix(self) -> int:  # Np: the re-selectable region [0, N - W)
        return self.prompt_len - self.window

    @property
    def prefix_valid(self) -> torch.Tensor:  # (B, Np)
        return self.valid[:, : self.n_prefix]

    @property
    def pad(self) -> torch.Tensor:  # (B,) number of left-padding positions per sample
        return (~self.valid).sum(-1)

    def prefix_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pl = self.layers[layer]
        return pl.keys[:, :, : self.n_prefix], pl.values[:, :, : self.n_prefix]


def gather_heads(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, d), idx (B, H, k) -> (B, H, k, d)."""
    return torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


class ResidentLayer(CacheLayerMixin):
    """One layer's resident slots. Implements transformers' cache-layer interface.

    ``get_seq_length`` is the *true* number of tokens processed (prompt + generated), never the number
    stored, so every transformers path that derives positions or mask offsets from it stays correct
    (the precedent is ``DynamicSlidingWindowLayer``'s cumulative length).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, prefix: PrefixStore, layer: int, selection: torch.Tensor, max_new_tokens: int):
        super().__init__()
        pl = prefix.layers[layer]
        B, H, N, d = pl.keys.shape
        S, W, Np = selection.shape[-1], prefix.window, prefix.n_prefix
        self.layer_idx = layer
        self.prefix = prefix
        self.n_selected = S
        cap = S + W + max_new_tokens
        self.keys = pl.keys.new_empty(B, H, cap, d)  # (B, Hkv, cap, d)
        self.values = pl.values.new_empty(B, H, cap, d)
        self.slot_valid = torch.ones(B, H, cap, dtype=torch.bool, device=pl.keys.device)  # (B, Hkv, cap)
        self.selection = selection.clone()  # (B, Hkv, S) indices into the prefix region [0, Np)
        k_p, v_p = prefix.prefix_kv(layer)
        self.keys[:, :, :S] = gather_heads(k_p, self.selection)
        self.values[:, :, :S] = gather_heads(v_p, self.selection)
        self.slot_valid[:, :, :S] = torch.gather(prefix.prefix_valid.unsqueeze(1).expand(B, H, Np), 2, self.selection)
        self.keys[:, :, S : S + W] = pl.keys[:, :, Np:]
        self.values[:, :, S : S + W] = pl.values[:, :, Np:]
        self.slot_valid[:, :, S : S + W] = prefix.valid[:, None, Np:]
        self.n_stored = S + W
        self.true_len = N
        self.is_initialized = True
        self.device = pl.keys.device

    # --- transformers CacheLayerMixin interface ---
    def lazy_initialization(self, key_states, value_states) -> None:  # initialised eagerly from the prefix
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        if self.n_stored + q > self.keys.shape[-2]:
            raise RuntimeError(f"layer {self.layer_idx}: resident cache is full ({self.keys.shape[-2]} slots); "
                               "decode more tokens than max_new_tokens was sized for")
        self.keys[:, :, self.n_stored : self.n_stored + q] = key_states
        self.values[:, :, self.n_stored : self.n_stored + q] = value_states
        self.n_stored += q
        self.true_len += q
        return self.resident_keys, self.resident_values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Asked before `update` for this step: the mask spans what is stored plus the new queries, and its
        # columns start at absolute position true_len - stored.
        return self.n_stored + query_length, self.true_len - self.n_stored

    def get_seq_length(self) -> int:
        return self.true_len

    def get_max_length(self) -> int:
        return -1

    # --- resident views ---
    @property
    def resident_keys(self) -> torch.Tensor:  # (B, Hkv, n_stored, d)
        return self.keys[:, :, : self.n_stored]

    @property
    def resident_values(self) -> torch.Tensor:
        return self.values[:, :, : self.n_stored]

    @property
    def resident_valid(self) -> torch.Tensor:  # (B, Hkv, n_stored)
        return self.slot_valid[:, :, : self.n_stored]

    def refresh(self, trigger: torch.Tensor, selection: torch.Tensor) -> None:
        """Masked merge: where ``trigger`` (B,) is set, slots [0, S) become the prefix entries ``selection``
        (B, Hkv, S). Window and generated slots are not touched. No host sync: the gather is issued
        unconditionally and the merge is a ``torch.where``."""
        S = self.n_selected
        k_p, v_p = self.prefix.prefix_kv(self.layer_idx)
        t = trigger.view(-1, 1, 1)
        new_valid = torch.gather(self.prefix.prefix_valid.unsqueeze(1).expand_as(k_p[..., 0]), 2, selection)
        self.keys[:, :, :S] = torch.where(t.unsqueeze(-1), gather_heads(k_p, selection), self.keys[:, :, :S])
        self.values[:, :, :S] = torch.where(t.unsqueeze(-1), gather_heads(v_p, selection), self.values[:, :, :S])
        self.slot_valid[:, :, :S] = torch.where(t, new_valid, self.slot_valid[:, :, :S])
        self.selection = torch.where(t, selection, self.selection)

    def evicted_mask(self) -> torch.Tensor:
        """(B, Hkv, Np) bool: valid prefix entries that are not resident."""
        k_p, _ = self.prefix.prefix_kv(self.layer_idx)
        in_sel = torch.zeros(k_p.shape[:3], dtype=torch.bool, device=k_p.device)
        in_sel.scatter_(2, self.selection, True)
        return self.prefix.prefix_valid.unsqueeze(1) & ~in_sel


class ResidentCache(Cache):
    """A transformers ``Cache`` of :class:`ResidentLayer` s, one per decoder layer."""

    def __init__(self, layers: list[ResidentLayer]):
        super().__init__(layers=layers)
