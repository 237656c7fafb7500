"""RefreshKV held to a reference written from the paper's text (Xu, Goyal and Choi, ACL 2025, §2.2 and Algorithm 1;
docs/algorithms.md, "refreshkv"), at every layer-step of real decodes on the tiny Qwen2-VL, left padded.

The reference imports nothing of the method: it takes the step's query, the prefix keys and the resident slots as
nested lists. After a full step the small cache is the top S of that step's attention over the whole context (per
KV head: each query head's softmax over every prefix entry, the window and the generated tokens; the max over the
KV head's query heads; max pooling over the 7 surrounding positions; ties by the entry's own score, then the
earlier position); a partial step changes nothing. The similarity trigger is walked step by step from the text.
"""

import math

import numpy as np
import pytest
import torch

import rcr
from tests import tiny_models
from tests.methods import Scale

NEG_INF = float("-inf")
SMALL = Scale(rcr.RCRConfig(selected=8, window=8))
N_NEW = 8
KERNEL = 7  # "the kernel size to 7 for both RefreshKV and SnapKV" (the paper's appendix A.1)


@pytest.fixture(scope="module")
def padded():
    model, proc = tiny_models.qwen2_vl()
    inputs = tiny_models.batch_inputs(proc, [4, 20], image_size=224)
    assert not inputs["attention_mask"].bool().all()
    return model, rcr.prefill(model, inputs, SMALL.config)


# ----------------------------------------------------------------------------- the reference, from the text

def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def reference_small_cache(q_h, keys, valid, rest, rest_valid, scaling, k) -> list:
    """One KV head after a full step: the top k prefix entries of the step's attention over the whole context,
    ascending. q_h (G, d) the head's queries; keys (Np, d) prefix keys, valid (Np); rest (n, d) the window and
    generated slots, rest_valid (n)."""
    attn = {}  # a_n: the max over the query heads of each one's attention probability on prefix entry n
    for q in q_h:
        lg = {n: dot(q, kn) * scaling for n, kn in enumerate(keys) if valid[n]}
        lg_rest = [dot(q, kr) * scaling for kr, ok in zip(rest, rest_valid) if ok]
        m = max([*lg.values(), *lg_rest])
        z = sum(math.exp(x - m) for x in [*lg.values(), *lg_rest])
        for n, x in lg.items():
            attn[n] = max(attn.get(n, 0.0), math.exp(x - m) / z)
    # "max pooling over attention scores of surrounding tokens"
    pooled = {n: max(attn[j] for j in range(n - KERNEL // 2, n + KERNEL // 2 + 1) if j in attn) for n in attn}
    return sorted(sorted(attn, key=lambda n: (-pooled[n], -attn[n], n))[:k])


def reference_trigger(queries: list, first: list, every: int, threshold: float) -> list:
    """One (sample, layer): whether each decode step is a full step under the query-similarity rule. ``queries``:
    each step's query averaged over the layer's query heads; ``first``: the prefill's last prompt token's."""
    ref, out = first, []
    for t, q in enumerate(queries):
        full = False
        if (t + 1) % every == 0:  # "at every S-th decode step"
            cos = dot(q, ref) / math.sqrt(dot(q, q) * dot(ref, ref))
            full = not cos > threshold  # "If the similarity is higher than a threshold s, we decode with Cp"
            ref = q if full else ref  # "the most recent full attention step for that layer"
        out.append(full)
    return out


class Recorder:
    """Wraps a method's ``decide`` and ``merge``: each layer-step's query, resident slots and selection before it,
    its trigger, and the selection and slots after the merge."""

    def __init__(self, method):
        self.steps = []
        decide, merge = method.decide, method.merge

        def recorded_decide(ctx):
            res, S = ctx.resident, ctx.resident.n_selected
            self.steps.append(dict(layer=ctx.layer, step=ctx.step, query=ctx.query.clone(),
                                   before=res.selection.clone(), slots_before=res.resident_keys[:, :, :S].clone(),
                                   rest=res.resident_keys[:, :, S:].clone(),
                                   rest_valid=res.resident_valid[:, :, S:].clone()))
            d = decide(ctx)
            self.steps[-1]["trigger"] = d.trigger.clone()
            return d

        def recorded_merge(res, d):
            merge(res, d)
            after = res.resident_keys[:, :, :res.n_selected].clone()
            self.steps[-1].update(after=res.selection.clone(), slots_after=after)

        method.decide, method.merge = recorded_decide, recorded_merge


@pytest.mark.parametrize("label", ["refreshkv@stride=3", "refreshkv@rule=similarity,qc_stride=2,threshold=0.5"])
def test_refreshkv_small_cache_is_the_top_of_the_full_steps_attention(padded, label):
    model, prefix = padded
    method = SMALL.method(label)
    rec = Recorder(method)
    res = rcr.decode(model, prefix, method, N_NEW, eos_token_id=[])
    trigger = res.telemetry.trigger  # (B, L, T)
    assert 0 < np.nanmean(trigger) < 1
    k_p = [prefix.prefix_kv(layer)[0].tolist() for layer in range(len(prefix.layers))]
    valid = prefix.prefix_valid.tolist()
    n_full = 0
    for s in rec.steps:
        layer, t = s["layer"], s["step"]
        for b in range(prefix.batch_size):
            assert bool(s["trigger"][b]) == bool(trigger[b, layer, t])
            if not s["trigger"][b]:  # a partial step changes nothing
                assert torch.equal(s["after"][b], s["before"][b])
                assert torch.equal(s["slots_after"][b], s["slots_before"][b])
                continue
            n_full += 1
            q = s["query"][b].view(prefix.n_kv_heads, -1, prefix.head_dim).tolist()  # (Hkv, G, d)
            for h in range(prefix.n_kv_heads):
                want = reference_small_cache(q[h], k_p[layer][b][h], valid[b], s["rest"][b, h].tolist(),
                                             s["rest_valid"][b, h].tolist(), prefix.scaling, SMALL.selected)
                assert s["after"][b, h].tolist() == want, f"layer {layer}, step {t}, sample {b}, KV head {h}"
    assert n_full > 0
    if method.rule == "stride":
        steps = np.arange(trigger.shape[-1])
        np.testing.assert_array_equal(trigger, np.broadcast_to((steps + 1) % 3 == 0, trigger.shape))
        return
    for layer in range(len(prefix.layers)):
        first = prefix.layers[layer].window_queries[:, :, -1].double().mean(1).tolist()  # (B, d)
        mean_q = [s["query"][:, :, 0].double().mean(1).tolist() for s in rec.steps if s["layer"] == layer]
        for b in range(prefix.batch_size):
            want = reference_trigger([q[b] for q in mean_q], first[b], method.qc_stride, method.threshold)
            assert trigger[b, layer].astype(bool).tolist() == want, f"layer {layer}, sample {b}"


def test_refreshkv_full_step_output_attends_to_the_whole_context(padded):
    """With a full step at every step, every output is the uncompressed one, though the budget compresses."""
    model, prefix = padded
    full, bacon, every = (rcr.decode(model, prefix, SMALL.method(m), N_NEW, eos_token_id=[])
                          for m in ("full", "bacon", "refreshkv@stride=1"))
    assert not torch.equal(bacon.sequences, full.sequences)
    assert torch.equal(every.sequences, full.sequences)
    np.testing.assert_array_equal(every.telemetry.trigger, 1.0)
    # reads: every valid prefix key and value of the layer, at every layer-step
    n_prefix = prefix.prefix_valid.sum(-1).float().view(-1, 1, 1).numpy()  # (B, 1, 1)
    np.testing.assert_array_equal(every.telemetry.keys_read, np.broadcast_to(n_prefix, every.telemetry.keys_read.shape))


@pytest.mark.parametrize("knob,value", [("rule", "sometimes"), ("stride", 0), ("qc_stride", 1.5),
                                        ("threshold", 1.5), ("full_attention", "yes")])
def test_refreshkv_knobs_are_validated(knob, value):
    with pytest.raises(rcr.ConfigError) as e:
        rcr.METHODS["refreshkv"](**{knob: value})
    assert e.value.field == f"refreshkv.{knob}"
