"""The embedded model's objective and its held attention sink (embedded/losses.py, sink.py): the grounding
loss moves the supervised layer's attention onto the described cell, its spread variant over the whole cell, the
share loss holds each sample's image share of attention to its own target, and the sink stays where it is held
through training and takes a head's idle mass."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embedded.assets import SYSTEM_PROMPT_ROLE, build_model, build_processor, build_tokenizer, processor_inputs
from embedded.batches import BatchBuilder
from embedded.curriculum import cooled_lr
from embedded.loops import Polisher, RunOptions, Trainer
from embedded.losses import Share, answer_rows, grounding_loss, image_share_loss, optimizer_step
from embedded.recipe import Recipe
from embedded.sink import HELD_SINK_LOGIT, HeldSink, sink_logit_at
from embedded.train import build_run_model, main_optimizer
from pipeline.data import synthetic as S

TINY = dict(size="tiny", threads=1, warmup=1, batch_scale=0.25, vision_steps=0, steps=3, polish_steps=0,
            polish_ground_spread=[])


def tiny(**changes) -> Recipe:
    return Recipe.load().replace(**{**TINY, **changes})


def v5_batch(tok):
    builder = BatchBuilder(build_processor(tok))
    return builder.build("detailcaps", [S.render("detailcaps", 3, i, layout="v5") for i in range(2)],
                         ground=S.get_layout("v5"))


def trained_attention(tok, batch, weight: float, spread: bool = False):
    """Layer attentions (B, H, T, T) each of a tiny model after 20 steps on ``batch`` from one initialisation."""
    torch.manual_seed(0)
    model = build_model(tok, "tiny", 0)
    model.set_attn_implementation({"text_config": "eager", "vision_config": "eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(20):
        out = optimizer_step(model, opt, dict(batch), 1e-2, weight, ground_layer=1, ground_spread=spread)
        assert (out[3] is None) == (weight == 0)
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "ground")}
        return model(**inputs, output_attentions=True).attentions


def test_ground_loss_pulls_the_supervised_layers_attention_to_the_cell():
    """grounding_loss through optimizer_step: from one initialisation and on one v5 batch, steps with weight 1 raise
    layer 1's mean attention mass on the targeted tokens five-fold, and steps without it (the batch's targets
    ignored) do not. The loss is -log of that mass, and nothing where no row has a target."""
    attn = torch.full((1, 2, 3, 3), 1 / 3)  # (B, H, T, T): even attention
    target = torch.zeros(1, 3, 3, dtype=torch.bool)
    assert grounding_loss(attn, target) == (None, None)
    target[0, 2, 0] = True
    loss, mass = grounding_loss(attn, target)
    assert mass == pytest.approx(1 / 3) and loss == pytest.approx(-np.log(1 / 3 + 1e-4))

    tok = build_tokenizer()
    batch = v5_batch(tok)
    off = float(grounding_loss(trained_attention(tok, batch, 0.0)[1], batch["ground"])[1])
    on = float(grounding_loss(trained_attention(tok, batch, 1.0)[1], batch["ground"])[1])
    chance = 16 / 320  # a cell's tokens among v5's image tokens, were all the mass on the image
    assert off < 2 * chance < 5 * chance < on, (off, on)


def test_ground_spread_asks_for_the_whole_cell_not_one_entry():
    """grounding_loss(spread=True) is the cross-entropy of a target row's attention against the uniform distribution
    over its targets, less log n: 0 for all the mass spread evenly on them, and more for the same mass on the
    targets unevenly, where the plain loss sees only the mass. From one initialisation and on one v5 batch, 20 steps
    with it leave layer 1's attention within the described cell spread over 12 or more of its 16 tokens (exp of the
    entropy), where the plain loss's steps leave it on fewer than 10, with the mass on the cell over five times
    chance."""
    attn = torch.tensor([0.1, 0.2, 0.3, 0.4]).expand(1, 1, 1, 4)  # (B, H, T, T): one row
    target = torch.zeros(1, 1, 4, dtype=torch.bool)
    target[0, 0, 2:] = True  # the targets hold 0.3 and 0.4
    loss, mass = grounding_loss(attn, target, spread=True)
    assert mass == pytest.approx(0.7) and loss == pytest.approx(-(np.log(0.6 + 1e-4) + np.log(0.8 + 1e-4)) / 2)
    even = torch.tensor([0.0, 0.0, 0.5, 0.5]).expand(1, 1, 1, 4)
    uneven = torch.tensor([0.0, 0.0, 0.1, 0.9]).expand(1, 1, 1, 4)
    assert grounding_loss(even, target, spread=True)[0] == pytest.approx(0.0, abs=1e-3)
    assert grounding_loss(uneven, target, spread=True)[0] > 0.5
    assert grounding_loss(even, target)[0] == pytest.approx(grounding_loss(uneven, target)[0])

    tok = build_tokenizer()
    batch = v5_batch(tok)
    rows = batch["ground"].any(-1)  # (B, T)
    got = {}
    for spread in (False, True):
        att = trained_attention(tok, batch, 1.0, spread)[1]  # (B, H, T, T)
        on = att * batch["ground"][:, None]
        p = on / on.sum(-1, keepdim=True).clamp_min(1e-9)  # the row's distribution within its cell
        tokens = torch.exp(-(p * torch.log(p.clamp_min(1e-12))).sum(-1))  # (B, H, T)
        got[spread] = float(tokens.transpose(1, 2)[rows].mean()), float(grounding_loss(att, batch["ground"])[1])
    assert got[False][0] < 10 < 12 < got[True][0] <= 16, got
    assert got[True][1] > 5 * 16 / 320, got


def test_share_loss_is_zero_only_where_the_held_means_meet_each_samples_target():
    """image_share_loss: the squared log-odds gap between the image's share of an answer step's attention and the
    sample's own target, over the layer's head mean (groups 1) or each KV head's mean over its query heads (groups
    H_kv): heads that split the image unevenly around the target meet it as a layer and miss it as KV heads."""
    # (B=2, H=4, T=3, T=3): token 0 is the image, row 2 the one answer step; sample b's heads give the image share[b]
    share = torch.tensor([[0.05, 0.15, 0.2, 0.2], [0.3, 0.3, 0.3, 0.3]])  # (B, H); head means 0.15 and 0.3
    attn = torch.zeros(2, 4, 3, 3)
    attn[:, :, :, 0] = share[:, :, None]
    attn[:, :, :, 1] = 1 - share[:, :, None]
    image = torch.tensor([[True, False, False]] * 2)
    rows = torch.tensor([[False, False, True]] * 2)
    target = torch.tensor([0.15, 0.3])
    loss, seen = image_share_loss([attn], rows, image, target, groups=1)
    assert float(loss) == pytest.approx(0.0, abs=1e-6) and seen.tolist() == pytest.approx([0.15, 0.3])
    by_kv = float(image_share_loss([attn], rows, image, target, groups=2)[0])  # KV heads at 0.1 / 0.2 and 0.3 / 0.3
    gaps = [np.log(0.1 / 0.9) - np.log(0.15 / 0.85), np.log(0.2 / 0.8) - np.log(0.15 / 0.85), 0.0, 0.0]
    assert by_kv == pytest.approx(np.mean(np.square(gaps)), rel=1e-4)
    off = float(image_share_loss([attn], rows, image, torch.tensor([0.01, 0.3]), groups=1)[0])
    assert off == pytest.approx((np.log(0.15 / 0.85) - np.log(0.01 / 0.99)) ** 2 / 2, rel=1e-4)
    # grounding relative to the image mass (the share stage's default): the cell's share of the row's image mass
    row = torch.tensor([0.25, 0.25, 0.5]).expand(1, 1, 3, 3)  # (B, H, T, T): tokens 0-1 the image, 0 the cell
    cell = torch.zeros(1, 3, 3, dtype=torch.bool)
    cell[0, 2, 0] = True
    on_image = torch.tensor([[True, True, False]])
    assert float(grounding_loss(row, cell)[1]) == pytest.approx(0.25)
    assert float(grounding_loss(row, cell, image=on_image)[1]) == pytest.approx(0.5)
    labels = torch.tensor([[-100, -100, 7, 8]])
    assert answer_rows(labels).tolist() == [[False, True, True, False]]  # the steps that write tokens 7 and 8


def test_share_loss_sets_each_samples_image_share_from_its_target():
    """optimizer_step with a share loss: from one initialisation and on one v6 batch whose two scenes are trained
    to shares 0.02 and 0.3, 30 steps leave the low-target scene's answer steps giving the image under half the share
    of the high-target one, and the mean of each within a factor 3 of its target, where steps without the loss (the
    targets ignored) leave the two alike."""
    tok = build_tokenizer()
    builder = BatchBuilder(build_processor(tok))
    batch = builder.build("detailcaps", [S.render("detailcaps", 3, i, layout="v6") for i in range(2)])
    batch["share_target"] = torch.tensor([0.02, 0.3])
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    got = {}
    for weight in (0.0, 1.0):
        torch.manual_seed(0)
        model = build_model(tok, "tiny", 0)
        model.set_attn_implementation({"text_config": "eager", "vision_config": "eager"})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        share = Share(weight, (0, 1), 1, image_id)
        for _ in range(30):
            out = optimizer_step(model, opt, dict(batch), 1e-2, share=share)
            assert (out[4] is None) == (weight == 0)
        with torch.no_grad():
            inputs = {k: v for k, v in batch.items() if k not in ("labels", "share_target")}
            att = model(**inputs, output_attentions=True).attentions
        rows = answer_rows(batch["labels"])  # (B, T)
        image = batch["input_ids"] == image_id  # (B, T)
        share = torch.stack([(a * image[:, None, None]).sum(-1).mean(1) for a in att]).mean(0)  # (B, T)
        got[weight] = [float(share[i][rows[i]].mean()) for i in range(2)]
    low, high = got[1.0]
    assert low < 0.5 * high and 0.02 / 3 < low < 0.06 and 0.1 < high < 0.9, got
    assert abs(got[0.0][0] - got[0.0][1]) < 0.25 * max(got[0.0]), got


def sink_share(model, inputs, layer: int | None = None, start: int = 30) -> list[float]:
    """Each layer's (or one layer's) mean attention on position 1, the sink, from queries after ``start``."""
    with torch.no_grad():
        att = model(**inputs, output_attentions=True).attentions  # L x (1, H, T, T)
    return [float(a[0, :, start:, 1].mean()) for a in (att if layer is None else [att[layer]])]


def test_held_sink_survives_training_and_takes_the_idle_mass(tmp_path):
    """HeldSink: after training steps with weight decay every held entry is where it was put (and every parameter
    holding one has trained), and each layer's last query leaves most of its mass on the sink token at position 1,
    where the same steps without it leave little."""
    tok = build_tokenizer()
    processor = build_processor(tok)
    frames, _ = S.render("textcaps", S.HELDOUT_SEED, 0)
    inputs = processor_inputs(processor, "textcaps", frames)
    assert processor.tokenizer.convert_ids_to_tokens(int(inputs["input_ids"][0, 1])) == SYSTEM_PROMPT_ROLE
    recipe = tiny(ground_loss=0.0, ground_tasks=[], polish_ground_tasks=[])
    opts = RunOptions(run_dir=tmp_path, out=tmp_path / "model", fresh=True)
    shares = {}
    for held in (True, False):
        torch.manual_seed(0)
        model, sink = build_run_model(recipe, tok, "cpu")
        fresh = {k: v.clone() for k, v in model.state_dict().items()}
        if not held:  # the same model and steps, the sink neither held nor put back
            model = build_model(tok, "tiny", recipe.seed)
            sink = None
        trainer = Trainer(recipe, opts, model, main_optimizer(model, recipe), BatchBuilder(processor),
                          tmp_path / f"ckpt{held}.pt", 0, 0.0, sink)
        assert trainer.run()
        model.eval().set_attn_implementation("eager")
        shares[held] = sink_share(model, inputs, start=-1)
        if held:
            names = {id(p): n for n, p in model.named_parameters()}
            for param, mask, value in sink.held:
                got = param.detach()
                assert torch.equal(got[mask], value[mask]), names[id(param)]
                assert not torch.equal(got, fresh[names[id(param)]]), f"{names[id(param)]} did not train at all"
    assert min(shares[True]) > 0.5 and max(shares[False]) < 0.2, shares


def test_sink_logit_sets_the_held_sinks_pull_and_the_ramp_raises_it_in_place():
    """A larger held logit leaves more of a fresh model's first-layer attention on the sink; under a ramp the logit
    stays at HELD_SINK_LOGIT until FROM and rises linearly to sink_logit by TO; set_logit moves a live model's pull
    through the two held entries alone, to those of a model built at that logit."""
    at = [sink_logit_at(10.0, (0.3, 0.5), frac) for frac in (0.0, 0.3, 0.4, 0.5, 0.99)]
    assert at == pytest.approx([HELD_SINK_LOGIT, HELD_SINK_LOGIT, (HELD_SINK_LOGIT + 10) / 2, 10, 10])
    assert sink_logit_at(10.0, None, 0.0) == 10.0
    tok = build_tokenizer()
    frames, _ = S.render("textcaps", S.HELDOUT_SEED, 0)
    inputs = processor_inputs(build_processor(tok), "textcaps", frames)
    share = {}
    for logit in (2.0, 6.0, 10.0):
        model, _ = build_run_model(tiny(sink_logit=logit, sink_ramp=None), tok, "cpu")
        model.set_attn_implementation("eager")
        share[logit] = sink_share(model, inputs, layer=0)[0]  # every query after the system prompt
    assert share[2.0] < share[6.0] < share[10.0] and share[10.0] > 0.9, share

    model, sink = build_run_model(tiny(sink_logit=10.0, sink_ramp=[0.3, 0.5]), tok, "cpu")  # starts at 6
    model.set_attn_implementation("eager")
    before, weights = sink_share(model, inputs, layer=0)[0], {k: v.clone() for k, v in model.state_dict().items()}
    sink.set_logit(10.0)
    after = sink_share(model, inputs, layer=0)[0]
    fresh, _ = build_run_model(tiny(sink_logit=10.0, sink_ramp=None), tok, "cpu")
    assert before < after and after > 0.9, (before, after)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, weights[k])]
    assert changed and all(k.endswith(("q_proj.bias", "k_proj.weight")) for k in changed), changed
    for k in changed:  # the same entries a model built at logit 10 holds
        assert torch.allclose(model.state_dict()[k], fresh.state_dict()[k]), k


def test_polish_cooldown_lowers_the_rate_linearly_over_the_last_steps():
    """polish_cooldown FRAC: polish_lr until the last FRAC of the polish stage, then a linear fall that would reach
    0 one step after the last; 0 keeps the rate constant; the Polisher trains at it."""
    assert [cooled_lr(1e-3, 0.0, 8, s) for s in range(8)] == [1e-3] * 8
    assert [cooled_lr(1e-3, 0.5, 8, s) for s in range(8)] == pytest.approx([1e-3] * 5 + [7.5e-4, 5e-4, 2.5e-4])
    recipe = tiny(steps=100, polish_steps=8, polish_lr=1e-3, polish_cooldown=0.5)
    tok = build_tokenizer()
    model, sink = build_run_model(recipe, tok, "cpu")
    polisher = Polisher(recipe, RunOptions(run_dir=Path("unused"), out=Path("unused")), model,
                        main_optimizer(model, recipe), BatchBuilder(build_processor(tok)), Path("unused.pt"), 0.0,
                        sink)
    polisher.step = 6
    assert polisher.lr() == pytest.approx(5e-4)
    assert isinstance(sink, HeldSink)
