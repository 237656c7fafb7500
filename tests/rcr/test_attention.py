"""The one-token decode attention (``rcr.attention.attend``) against transformers' own attention functions:
SDPA (``sdpa_attention_forward``) and eager (Qwen2-VL's ``eager_attention_forward``), with and without
left-padding masks, and against a float64 reference for per-KV-head slot masks (which transformers' masks
cannot express)."""

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen2_vl.modeling_qwen2_vl import eager_attention_forward

from rcr.attention import attend

B, HKV, G, D, N = 3, 4, 7, 32, 57


def inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # transformers hands the attention a transposed projection: (B, 1, Hq, d) -> (B, Hq, 1, d), not contiguous
    query = torch.randn(B, 1, HKV * G, D, generator=g).transpose(1, 2).to(dtype)
    keys = torch.randn(B, HKV, N, D, generator=g).to(dtype)
    values = torch.randn(B, HKV, N, D, generator=g).to(dtype)
    return query, keys, values


def module():
    return SimpleNamespace(num_key_value_groups=G, is_causal=True, training=False)


def left_padding():
    pad = torch.tensor([0, 5, 20])
    return torch.arange(N).unsqueeze(0) >= pad.unsqueeze(1)  # (B, N)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "left_padding"])
def test_one_token_attention_equals_transformers(dtype, atol, padded):
    query, keys, values = inputs(dtype)
    scaling = D ** -0.5
    valid = left_padding() if padded else torch.ones(B, N, dtype=torch.bool)
    slot_valid = valid.unsqueeze(1).expand(B, HKV, N) if padded else None
    got = attend(query, keys, values, slot_valid, scaling)
    assert got.shape == (B, 1, HKV * G, D) and got.dtype == dtype

    sdpa_mask = valid[:, None, None, :] if padded else None  # (B, 1, 1, N) bool, as transformers' sdpa_mask
    want, _ = sdpa_attention_forward(module(), query, keys, values, sdpa_mask, scaling=scaling)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)

    eager_mask = None
    if padded:  # eager takes an additive float mask
        eager_mask = torch.zeros(B, 1, 1, N, dtype=dtype).masked_fill(~valid[:, None, None, :], torch.finfo(dtype).min)
    want_eager, _ = eager_attention_forward(module(), query, keys, values, eager_mask, scaling=scaling)
    torch.testing.assert_close(got, want_eager, atol=atol, rtol=0)
    if padded:  # the mask is really applied: the padded keys change nothing
        k2, v2 = keys.clone(), values.clone()
        k2[~slot_valid] = 100.0
        v2[~slot_valid] = -100.0
        torch.testing.assert_close(attend(query, k2, v2, slot_valid, scaling), got, atol=atol, rtol=0)


def test_per_kv_head_mask_equals_float64_reference():
    query, keys, values = inputs(torch.float32, seed=1)
    g = torch.Generator().manual_seed(2)
    slot_valid = torch.rand(B, HKV, N, generator=g) > 0.3  # differs per KV head (refreshed selected slots)
    slot_valid[..., -1] = True
    scaling = D ** -0.5
    got = attend(query, keys, values, slot_valid, scaling)
    q = query.double().view(B, HKV, G, D)
    lg = torch.einsum("bhgd,bhnd->bhgn", q, keys.double()) * scaling
    lg = lg.masked_fill(~slot_valid.unsqueeze(2), float("-inf"))
    want = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(lg, -1), values.double()).reshape(B, 1, HKV * G, D)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
