"""The prefix store (read-only, shared by every method) and the resident cache that decoding attends to.

Shapes: B batch, Hkv KV heads, N padded prompt length, Np = N - window prefix entries, d head dim,
S selected slots, W window slots. Keys are stored post-RoPE (the HF convention), so moving an entry
between the prefix store and a resident slot never re-encodes it.

Resident layout per (layer, KV head):  [ S selected prefix slots | W window slots | generated ... ]
A refresh rewrites only the first S slots.

The resident buffer is allocated once, S + W + max_new_tokens slots. Eagerly, decoding attends to the slots
written so far. With ``static=True`` (compiled decode) every step attends to the whole buffer: slots not yet
written are invalid in ``slot_valid`` (the length mask), and the write position is a device tensor, so a
decode step has the same shapes and reads no Python counter that changes from step to step.
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
    # the layer's own attention window (Gemma 3's local layers): where it can exclude an entry of a decode
    # (rcr.generate.layer_windows), such a layer is not re-selected and keeps every prefix entry, attending within
    # the window (docs/models.md). None: a global layer
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
    _host: PrefixStore | None = field(default=None, repr=False, compare=False)
    _kv: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # prefix_kv's views, per layer

    def to_host(self, pin: bool | None = None) -> PrefixStore:
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
        """(B, Hkv, Np, d) views of the layer's prefix keys and values (made once: a decode asks every layer-step)."""
        if layer not in self._kv:
            pl = self.layers[layer]
            self._kv[layer] = (pl.keys[:, :, : self.n_prefix], pl.values[:, :, : self.n_prefix])
        return self._kv[layer]


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through dataclass fields, lists, tuples and dict values (a prefix store, a
    method's state), for marking as static addresses (``rcr.generate.Decoder.static_tensors``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    else:
        return []
    return [t for item in items for t in tensors_in(item)]


def gather_heads(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, H, N, d), idx (B, H, k) -> (B, H, k, d): the rows ``x[b, h, idx[b, h]]``.

    Rows of d are read with one ``index_select`` on a flat (rows, d) view of x's storage (about 10x faster on
    CPU than ``torch.gather`` with an index expanded over d). x may be a slice along N of a contiguous tensor
    (``PrefixStore.prefix_kv``); other layouts fall back to ``torch.gather``."""
    B, H, N, d = x.shape
    s0, s1, s2, s3 = x.stride()
    if s3 != 1 or s2 != d or s1 % d or s0 % d:
        return torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, d))
    n_rows = (B - 1) * (s0 // d) + (H - 1) * (s1 // d) + N
    rows = x.as_strided((n_rows, d), (d, 1))  # (rows, d) from x's first element
    base = (torch.arange(B, device=idx.device) * (s0 // d)).view(B, 1, 1) \
        + (torch.arange(H, device=idx.device) * (s1 // d)).view(1, H, 1)  # (B, H, 1) first row of (b, h)
    return rows.index_select(0, (idx + base).view(-1)).view(*idx.shape, d)


def _merge_into(dst: torch.Tensor, cond: torch.Tensor, src: torch.Tensor) -> None:
    """dst = where(cond, src, dst), in place. Eagerly one pass with ``out=dst`` (no temporary); dynamo does not
    trace ``out=`` into a strided view, so a compiled step writes back with ``copy_`` (which the compiler fuses)."""
    if torch.compiler.is_compiling():
        dst.copy_(torch.where(cond, src, dst))
    else:
        torch.where(cond, src, dst, out=dst)


class ResidentLayer(CacheLayerMixin):
    """One layer's resident slots. Implements transformers' cache-layer interface.

    ``get_seq_length`` is the *true* number of tokens processed (prompt + generated), never the number
    stored, so every transformers path that derives positions or mask offsets from it stays correct
    (the precedent is ``DynamicSlidingWindowLayer``'s cumulative length).
    """

    is_sliding = False
    is_compileable = False

    def __init__(self, prefix: PrefixStore, layer: int, selection: torch.Tensor, max_new_tokens: int,
                 static: bool = False, fused: bool = False):
        super().__init__()
        pl = prefix.layers[layer]
        B, H, N, d = pl.keys.shape
        S, W, Np = selection.shape[-1], prefix.window, prefix.n_prefix
        self.layer_idx = layer
        self.prefix = prefix
        self.n_selected = S
        # any left padding in the batch, read once here: without it no slot or prefix entry is ever invalid and
        # the decode-time masks are skipped
        self.padded = not bool(prefix.valid.all())
        cap = S + W + max_new_tokens
        self.static = static
        # refresh as row copies by the fused CPU op (rcr.fused, built and checked by the caller): eager only; a
        # static (compiled) step keeps the torch.where merge, which the compiler fuses
        self.fused_merge = fused and not static
        # zeros, not garbage: a static step still computes q.k on unwritten (masked) slots, and a NaN there
        # would survive the mask
        self.keys = pl.keys.new_zeros(B, H, cap, d)  # (B, Hkv, cap, d)
        self.values = pl.values.new_zeros(B, H, cap, d)
        self.slot_valid = torch.full((B, H, cap), not static, dtype=torch.bool, device=pl.keys.device)  # (B, Hkv, cap)
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
        self.write_pos = torch.full((1,), S + W, dtype=torch.long, device=pl.keys.device)  # static: next slot
        self.is_initialized = True
        self.device = pl.keys.device

    # --- transformers CacheLayerMixin interface ---
    def lazy_initialization(self, key_states, value_states) -> None:  # initialised eagerly from the prefix
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        if self.static:  # one token, written at the device-side position; the host counters move in `advance`
            self.keys.index_copy_(2, self.write_pos, key_states)
            self.values.index_copy_(2, self.write_pos, value_states)
            self.slot_valid.index_fill_(2, self.write_pos, True)
            self.write_pos.add_(1)
            return self.keys, self.values
        if self.n_stored + q > self.keys.shape[-2]:
            raise RuntimeError(f"layer {self.layer_idx}: resident cache is full ({self.keys.shape[-2]} slots); "
                               "decode more tokens than max_new_tokens was sized for")
        self.keys[:, :, self.n_stored : self.n_stored + q] = key_states
        self.values[:, :, self.n_stored : self.n_stored + q] = value_states
        self.n_stored += q
        self.true_len += q
        return self.resident_keys, self.resident_values

    def advance(self, q: int) -> None:
        """Static mode: the host-side counters of the ``q`` tokens ``update`` wrote on the device."""
        if self.n_stored + q > self.keys.shape[-2]:
            raise RuntimeError(f"layer {self.layer_idx}: resident cache is full ({self.keys.shape[-2]} slots); "
                               "decode more tokens than max_new_tokens was sized for")
        self.n_stored += q
        self.true_len += q

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Asked before `update` for this step: the mask spans what is stored plus the new queries, and its
        # columns start at absolute position true_len - stored.
        return self.n_stored + query_length, self.true_len - self.n_stored

    def get_seq_length(self) -> int:
        return self.true_len

    def get_max_length(self) -> int:
        return -1

    # --- resident views: the slots written so far; static mode: the whole buffer and its length mask ---
    @property
    def slots_masked(self) -> bool:
        """Whether any resident slot can be invalid (left padding, or unwritten slots in static mode)."""
        return self.padded or self.static

    @property
    def resident_keys(self) -> torch.Tensor:  # (B, Hkv, n_stored, d)
        return self.keys if self.static else self.keys[:, :, : self.n_stored]

    @property
    def resident_values(self) -> torch.Tensor:
        return self.values if self.static else self.values[:, :, : self.n_stored]

    @property
    def resident_valid(self) -> torch.Tensor:  # (B, Hkv, n_stored)
        return self.slot_valid if self.static else self.slot_valid[:, :, : self.n_stored]

    def in_window(self, window: int) -> torch.Tensor:
        """(B, Hkv, n) ``resident_valid`` limited to the last ``window`` slots written, the current token's
        included: a sliding-window layer's slots are its whole sequence in position order (it keeps every prefix
        entry), so this is transformers' sliding-window mask for the one-token decode (docs/models.md)."""
        n = self.resident_valid.shape[-1]
        last = self.write_pos - 1 if self.static else self.n_stored - 1  # the current token's slot
        return self.resident_valid & (torch.arange(n, device=self.device) > last - window)

    def refresh(self, trigger: torch.Tensor, selection: torch.Tensor, keys: torch.Tensor | None = None,
                values: torch.Tensor | None = None) -> None:
        """Masked merge: where ``trigger`` (B,) or (B, Hkv) is set, slots [0, S) become the prefix entries
        ``selection`` (B, Hkv, S). Window and generated slots are not touched. No host sync: the gather is
        issued unconditionally and the merge is a ``torch.where``. ``keys``/``values`` (B, Hkv, S, d): the
        entries' contents when the caller already brought them to the device (offload reads); otherwise they
        are gathered from the prefix store."""
        S = self.n_selected
        if keys is None and values is None and self.fused_merge:  # copies only the rows that fired, in place
            k_p, v_p = self.prefix.prefix_kv(self.layer_idx)
            torch.ops.rcr.merge_rows(self.keys, self.values, self.slot_valid, self.selection, trigger, selection,
                                     k_p, v_p, self.prefix.prefix_valid if self.padded else None)
            return
        if keys is None or values is None:
            k_p, v_p = self.prefix.prefix_kv(self.layer_idx)
            keys = gather_heads(k_p, selection) if keys is None else keys
            values = gather_heads(v_p, selection) if values is None else values
        B, H = selection.shape[:2]
        t = trigger.view(B, -1, 1)  # (B, 1, 1) per layer, (B, Hkv, 1) per KV head
        _merge_into(self.keys[:, :, :S], t.unsqueeze(-1), keys)
        _merge_into(self.values[:, :, :S], t.unsqueeze(-1), values)
        if self.padded:  # without padding every prefix entry, hence every slot, is valid
            new_valid = torch.gather(self.prefix.prefix_valid.unsqueeze(1).expand(B, H, -1), 2, selection)
            _merge_into(self.slot_valid[:, :, :S], t, new_valid)
        _merge_into(self.selection, t, selection)

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
