"""How prefix entries reach the device: a resident gather (GPU-only mode) or trigger-conditioned reads from
host memory (deployment mode; docs/algorithms.md, "Offload mode").

A re-selecting method reads the prefix store only through a reader (``StepContext.reader``):

- ``fired(trigger, idx)``: which (sample, KV head) rows need reads this layer-step. The resident reader
  returns ``None`` (every row, unconditionally, and no host sync: the merge is masked on the device). The host
  reader copies the trigger and the indices the method will read to the host in one synchronisation and
  returns a host bool tensor (B, Hkv); the method returns early, reading nothing, when no row fired.
- ``gather(layer, step, kind, idx, rows)``: prefix keys or values at ``idx`` (B, Hkv, k) as a device tensor
  (B, Hkv, k, d). The host reader gathers only the fired rows from host memory into a staging buffer
  (page-locked on CUDA), copies it to the device on a side stream with ``non_blocking=True`` (the host does
  not wait for the copy; the compute stream waits for it on the device, right before the entries are used),
  and leaves zeros in the rows that did not fire (the trigger mask discards them). It counts the bytes it
  moved per sample into the telemetry.

The trade-off, stated plainly: reading only on a trigger needs the trigger on the host, so offload mode
synchronises once per layer-step that computes a trigger (twice when it fired: the exact top-S indices of
the candidate keys are known only after those keys arrived, and the values are read after that). GPU-only
mode never synchronises but issues every read at every layer-step. Outputs are the same.
"""

from __future__ import annotations

import numpy as np
import torch

from .cache import PrefixStore, gather_heads


class ResidentReader:
    """GPU-only mode: the store is on the device and every gather is issued unconditionally."""

    offload = False

    def __init__(self, prefix: PrefixStore):
        self.prefix = prefix

    def fired(self, trigger: torch.Tensor, idx: torch.Tensor | None = None) -> None:
        return None

    def gather(self, layer: int, step: int, kind: str, idx: torch.Tensor, rows=None) -> torch.Tensor:
        k_p, v_p = self.prefix.prefix_kv(layer)
        return gather_heads(k_p if kind == "keys" else v_p, idx)


class HostReader:
    """Deployment mode: the store is in host memory; reads are issued only for rows whose trigger fired.

    ``bytes_moved`` (B, L, T), a host array, receives the bytes of prefix keys and values copied to the device
    per sample and layer-step (index traffic device-to-host, 8 bytes per index, is not counted)."""

    offload = True
    RING = 4  # staging buffers in flight per kind before one is reused

    def __init__(self, prefix: PrefixStore, device: torch.device, bytes_moved: np.ndarray):
        assert prefix.offloaded, "HostReader needs a store from PrefixStore.to_host()"
        self.prefix = prefix
        self.device = torch.device(device)
        self.bytes_moved = bytes_moved
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None  # (device idx, its host copy)
        self._ring: list[tuple[torch.Tensor, object]] = []  # (pinned buffer, event of its last copy)
        self._next = 0

    # -- host view of the decision --
    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        return buf

    def fired(self, trigger: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """(B, Hkv) host bool: rows to read. One device->host synchronisation for the trigger and ``idx``."""
        B, H = self.prefix.batch_size, self.prefix.n_kv_heads
        trig = self._to_host(trigger)
        idx_h = self._to_host(idx) if idx is not None else None
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self._staged = (idx, idx_h) if idx is not None else None
        return trig.view(B, -1).expand(B, H)

    def _host_indices(self, idx: torch.Tensor) -> torch.Tensor:
        if self._staged is not None and self._staged[0] is idx:
            return self._staged[1]
        h = self._to_host(idx)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return h

    def _staging(self, n: int, d: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """A host buffer for n rows of d: (ring slot or -1, view). Page-locked and recycled on CUDA."""
        if not self.cuda:
            return -1, torch.empty(n, d, dtype=dtype)
        slot = self._next % self.RING
        self._next += 1
        buf, ev = self._ring[slot] if slot < len(self._ring) else (None, None)
        if ev is not None:
            ev.synchronize()  # its previous copy must have left before it is overwritten (rarely waits)
        if buf is None or buf.numel() < n * d or buf.dtype != dtype:
            buf = torch.empty(max(n * d, 1), dtype=dtype, pin_memory=True)
        if slot < len(self._ring):
            self._ring[slot] = (buf, None)
        else:
            self._ring.append((buf, None))
        return slot, buf[: n * d].view(n, d)

    def gather(self, layer: int, step: int, kind: str, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        p = self.prefix
        pl = p.layers[layer]
        src = pl.keys if kind == "keys" else pl.values  # (B, Hkv, N, d), contiguous, host
        B, H, N, d = src.shape
        k = idx.shape[-1]
        idx_h = self._host_indices(idx).reshape(B * H, k)
        r = rows.reshape(-1).nonzero().squeeze(1)  # fired rows (b * H + h), host
        flat = (r.unsqueeze(1) * N + idx_h[r]).reshape(-1)
        slot, staging = self._staging(flat.numel(), d, src.dtype)
        torch.index_select(src.view(B * H * N, d), 0, flat, out=staging)  # the only read of the store
        self.bytes_moved[:, layer, step] += rows.reshape(B, H).sum(1).numpy() * (k * d * src.element_size())
        out = torch.zeros(B * H, k, d, dtype=src.dtype, device=self.device)
        if not self.cuda:
            out[r] = staging.view(-1, k, d)
            return out.view(B, H, k, d)
        main = torch.cuda.current_stream(self.device)
        r_dev = r.to(self.device)  # a few row ids
        self.stream.wait_stream(main)  # `out` and `r_dev` were made on the main stream
        with torch.cuda.stream(self.stream):
            moved = staging.to(self.device, non_blocking=True)  # from page-locked memory: asynchronous
            ev = torch.cuda.Event()
            ev.record(self.stream)
            out[r_dev] = moved.view(-1, k, d)
        self._ring[slot] = (self._ring[slot][0], ev)
        out.record_stream(self.stream)
        r_dev.record_stream(self.stream)
        main.wait_stream(self.stream)  # a device-side wait: the host goes on issuing work
        return out.view(B, H, k, d)
