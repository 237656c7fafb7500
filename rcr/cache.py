"""The prefix store (read-only, shared by every method) and the resident cache that decoding attends to.

Shapes: B batch, Hkv KV heads, N padded prompt length, Np = N - window prefix entries, d head dim,
S selected slots, W window slots. Keys are stored post-RoPE (the HF convention), so moving an entry
between the prefix store and a resident slot never re-encodes it.

Resident layout per (layer, KV head):  [ S selected prefix slots | W window slots | generated ... ]
A refresh rewrites only the first S slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass
class PrefixLayer:
    """One layer's full prompt KV, as written by the prefill. Never modified by a method."""

    keys: torch.Tensor  # (B, Hkv, N, d), post-RoPE
    values: torch.Tensor  # (B, Hkv, N, d)
    window_queries: torch.Tensor  # (B, Hq, W, d), post-RoPE queries of the last W prompt tokens
    # the layer's own attention window (Gemma 3's local layers): such a layer is never re-selected and keeps
    # every prefix entry, attending within the window (docs/models.md). None: a global layer
    sliding_window: int | None = None


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
    offloaded: bool = False  # per-layer keys/values live in host memory (deployment mode); the rest stays
    _host: "PrefixStore | None" = field(default=None, repr=False, compare=False)

    def to_host(self, pin: bool | None = None) -> "PrefixStore":
        """This store with every layer's keys/values in CPU memory (deployment mode). ``pin``: page-locked
        memory, so host-to-device copies can be asynchronous; default: when the store is on a CUDA device.
        Validity, positions, first logits and window queries stay where they are (small; read at build).
        Memoised, so the methods decoded from one prefill share one host copy. On a CPU device the tensors are
        shared, not copied."""
        if self.offloaded:
            return self
        if self._host is None:
            dev = self.valid.device
            pin = (dev.type == "cuda") if pin is None else pin

            def host(t: torch.Tensor) -> torch.Tensor:
                t = t.to("cpu").contiguous()
                return t.pin_memory() if pin else t

            layers = [dataclasses.replace(pl, keys=host(pl.keys), values=host(pl.values)) for pl in self.layers]
            self._host = dataclasses.replace(self, layers=layers, offloaded=True, _host=None)
        return self._host

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

    def refresh(self, trigger: torch.Tensor, selection: torch.Tensor, keys: torch.Tensor | None = None,
                values: torch.Tensor | None = None) -> None:
        """Masked merge: where ``trigger`` (B,) or (B, Hkv) is set, slots [0, S) become the prefix entries
        ``selection`` (B, Hkv, S). Window and generated slots are not touched. No host sync: the gather is
        issued unconditionally and the merge is a ``torch.where``. ``keys``/``values`` (B, Hkv, S, d): the
        entries' contents when the caller already brought them to the device (offload reads); otherwise they
        are gathered from the prefix store."""
        S = self.n_selected
        if keys is None or values is None:
            k_p, v_p = self.prefix.prefix_kv(self.layer_idx)
            keys = gather_heads(k_p, selection) if keys is None else keys
            values = gather_heads(v_p, selection) if values is None else values
        B, H = selection.shape[:2]
        t = trigger.view(B, -1, 1)  # (B, 1, 1) per layer, (B, Hkv, 1) per KV head
        new_valid = torch.gather(self.prefix.prefix_valid.unsqueeze(1).expand(B, H, -1), 2, selection)
        self.keys[:, :, :S] = torch.where(t.unsqueeze(-1), keys, self.keys[:, :, :S])
        self.values[:, :, :S] = torch.where(t.unsqueeze(-1), values, self.values[:, :, :S])
        self.slot_valid[:, :, :S] = torch.where(t, new_valid, self.slot_valid[:, :, :S])
        self.selection = torch.where(t, selection, self.selection)

    def evicted_mask(self) -> torch.Tensor:
        """(B, Hkv, Np) bool: valid prefix entries that are not resident."""
        B, H = self.selection.shape[:2]  # shapes only: the store may live in host memory (offload)
        in_sel = torch.zeros(B, H, self.prefix.n_prefix, dtype=torch.bool, device=self.selection.device)
        in_sel.scatter_(2, self.selection, True)
        return self.prefix.prefix_valid.unsqueeze(1) & ~in_sel


class ResidentCache(Cache):
    """A transformers ``Cache`` of :class:`ResidentLayer` s, one per decoder layer."""

    def __init__(self, layers: list[ResidentLayer]):
        super().__init__(layers=layers)
