"""benchmarks/real_size_models.py writes model directories laid out as the Hub lays them out. Here each family's
published configuration, shrunk to a tiny width and depth (the tokenizer's ids, the processor and the chat template
stay the published ones), goes through the same writer, then through the job's loader: every stored tensor must be
loaded into the model (a misnamed one would be left at transformers' random init, silently), and the job's prompt
over a DetailCaps-copy image must carry the family's special tokens at their published ids."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from benchmarks import real_size_models as rs


def tiny(family: str) -> dict:
    cfg = rs.published_config(family)
    small = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "num_hidden_layers": 1}
    if family == "qwen2_vl":
        cfg.update(small, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})  # sums to head_dim / 2
        cfg["vision_config"].update(depth=1, embed_dim=32, num_heads=2, hidden_size=64)
    elif family == "qwen3_vl":
        cfg["text_config"].update(small, head_dim=16)
        cfg["text_config"]["rope_scaling"]["mrope_section"] = [2, 3, 3]
        cfg["vision_config"].update(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                    deepstack_visual_indexes=[0])
    else:
        cfg["text_config"].update(small)
        cfg["vision_config"].update(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2)
    return cfg


@pytest.mark.parametrize("family", rs.FAMILIES)
def test_a_written_directory_loads_every_tensor_and_prompts_with_the_familys_tokens(tmp_path, family):
    from pipeline.data.convert import parse_dataset
    from pipeline.data.images import load_sample_images
    from pipeline.tasks import TASKS
    from rcr.models import build_inputs, geometry, load

    out = rs.write_model_dir(tmp_path, family, config=tiny(family))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored = {}
    for f in sorted(set(index["weight_map"].values())):
        stored.update(load_file(str(out / f)))
    assert set(stored) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    assert all(t.dtype == torch.bfloat16 for t in stored.values())

    model, proc = load(str(out), dtype=torch.bfloat16)
    params = dict(model.named_parameters(remove_duplicate=True))
    assert {rs.published_name(family, n) for n in params} == set(stored)  # every tensor has a home, and back
    for n, p in params.items():  # and the loaded value is the stored one, not an init
        assert torch.equal(p.detach(), stored[rs.published_name(family, n)]), n

    data = rs.write_detailcaps(tmp_path / "data", sizes=[(320, 240)])
    rec = next(iter(parse_dataset(str(data), "detailcaps").records()))
    image = load_sample_images(rec["images"], "detailcaps", 64, 64 * 2**20, 50_000_000)[0]
    assert image.size == (320, 240)
    ids = build_inputs(proc, [TASKS["detailcaps"].prompt], [[image]])["input_ids"][0].tolist()
    tok = proc.tokenizer
    image_id = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    assert ids.count(image_id) > 1  # the processor expanded the image placeholder into its visual tokens
    if family == "llava_next":  # [INST] <image>\n... [/INST] after <s>, ids 1 and 32000 as published
        # Mistral-7B-Instruct-v0.2 publishes "sliding_window": null: no window, every layer global (re-selected)
        assert geometry(model).sliding_windows == (None,) * model.config.text_config.num_hidden_layers
        assert ids[0] == 1 and image_id == 32000 and tok.convert_ids_to_tokens(ids[1]) == "["
    else:  # <|im_start|> 151644, <|vision_start|> 151652 ... <|vision_end|> 151653
        assert 151644 in ids and ids[ids.index(image_id) - 1] == 151652 and 151653 in ids
        assert tok.decode([151645]) == "<|im_end|>" and tok.eos_token_id == 151645
    assert "Describe this image in detail." in tok.decode(ids, skip_special_tokens=True)
    assert all(i < len(rs.WORDS) + 3 for i in ids if i < 32000)  # the prompt's words: in the vocabulary, no <unk>
    assert model(**build_inputs(proc, ["Describe"], [[image]])).logits.shape[-1] == model.config.get_text_config(
    ).vocab_size
