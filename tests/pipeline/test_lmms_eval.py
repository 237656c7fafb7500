"""The lmms-eval model ``rcr`` (pipeline/lmms/) inside real lmms-eval: its evaluator, its model registry (the
``lmms_eval.models`` entry point) and its Instance/TokenCounts types, on local Parquet caption tasks over the
embedded DetailCaps/TextCaps shards and the embedded model. Skipped where lmms-eval is not installed
(``pip install -e ".[pipeline,lmms]"``) or Java is missing (lmms-eval's caption metrics tokenize with
pycocoevalcap's PTB tokenizer, a Java program).

Decodes are cut to ``MAX_NEW`` tokens (lmms-eval's ``gen_kwargs``), and the compressed runs keep ``SELECTED``
prefix entries of about 315, so that a compressed decode departs from ``full`` within that horizon.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("lmms_eval", reason="lmms-eval is not installed (pip install -e '.[pipeline,lmms]')")
if shutil.which("java") is None:
    pytest.skip("no java: lmms-eval's caption metrics run pycocoevalcap's PTB tokenizer", allow_module_level=True)

import torch  # noqa: E402
from lmms_eval import evaluator  # noqa: E402
from lmms_eval.api.instance import Instance  # noqa: E402
from lmms_eval.models import get_model  # noqa: E402
from lmms_eval.tasks import TaskManager  # noqa: E402
from PIL import (
    Image,  # noqa: E402
    ImageFile,  # noqa: E402
)

# lmms_eval.api.task sets PIL's process-wide ImageFile.LOAD_TRUNCATED_IMAGES on import (lmms-eval's own policy:
# truncated images decode, padded). The rest of this test process checks that the pipeline refuses them.
ImageFile.LOAD_TRUNCATED_IMAGES = False

import rcr  # noqa: E402
import rcr.models  # noqa: E402
from pipeline.analysis.text_metrics import rouge_l_f1  # noqa: E402
from pipeline.data import synthetic  # noqa: E402
from pipeline.data.images import sample_images  # noqa: E402
from pipeline.data.shards import read_input, write_shards  # noqa: E402
from pipeline.lmms.tasks import write_task, write_tasks  # noqa: E402
from pipeline.tasks import TASKS  # noqa: E402
from rcr.config import ConfigError  # noqa: E402

MAX_NEW = 24
SELECTED = "selected=4,candidates=16"
LMMS_TASKS = ["rcr_detailcaps", "rcr_textcaps"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """rcr_detailcaps and rcr_textcaps (2 embedded samples each), and rcr_mixed: the same 4 samples in one
    task, whose two prompts differ in length, so a batch of them is left padded."""
    out = tmp_path_factory.mktemp("lmms-tasks")
    write_tasks(out, n=2)
    records = [synthetic.make_record(task, synthetic.HELDOUT_SEED, i)
               for i in range(2) for task in ("detailcaps", "textcaps")]
    write_shards(records, out / "shards" / "mixed", prefix="mixed")
    write_task(out, "rcr_mixed", out / "shards" / "mixed", max_new_tokens=512)
    return out


@pytest.fixture(scope="module", autouse=True)
def datasets_cache(tmp_path_factory):
    """Hugging Face's datasets cache, a temporary directory here: the tasks' YAML sends lmms-eval's copy of their
    data elsewhere (beside the tasks), and a task without that setting would land here."""
    mp = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("hf-datasets")
    mp.setenv("HF_DATASETS_CACHE", str(cache))
    yield cache
    mp.undo()


def evaluate(task_dir, tasks: list[str], model_args: str, batch_size: int = 1) -> dict:
    """lmms-eval's evaluator with ``--model rcr``, resolved through lmms-eval's registry (the entry point)."""
    tm = TaskManager("WARNING", include_path=str(task_dir), include_defaults=False, model_name="rcr")
    return evaluator.simple_evaluate(model="rcr", model_args=model_args, tasks=tasks, batch_size=batch_size,
                                     gen_kwargs=f"max_new_tokens={MAX_NEW}", log_samples=True, task_manager=tm,
                                     verbosity="WARNING")


def logged(results: dict, task: str) -> dict[str, dict]:
    """sample_id -> (text, telemetry) of a task's logged samples."""
    out = {}
    for s in results["samples"][task]:
        text = s["filtered_resps"][0]
        out[s["doc"]["sample_id"]] = {"text": text, "counts": s["token_counts"][0]}
    return out


@pytest.fixture(scope="module")
def full_run(task_dir):
    return evaluate(task_dir, LMMS_TASKS, "pretrained=embedded,method=full")


@pytest.fixture(scope="module")
def rcr_batch1(task_dir):
    return evaluate(task_dir, ["rcr_mixed"], f"pretrained=embedded,method=rcr,fidelity=true,{SELECTED}")


def test_the_copy_lmms_eval_makes_of_a_tasks_data_stays_beside_the_task(task_dir, datasets_cache):
    """datasets' Arrow copy of a task's Parquet goes to the tasks' own ``hf-datasets`` (the YAML's
    ``dataset_kwargs.cache_dir``), which `infra/local_cluster.sh clean` removes with them, not into Hugging Face's
    cache in the home directory (785 MB there for the 800 embedded scenes, which nothing removed)."""
    from lmms_eval.tasks import get_task_dict

    get_task_dict(LMMS_TASKS, TaskManager("WARNING", include_path=str(task_dir), include_defaults=False,
                                          model_name="rcr"))
    assert list((task_dir / "hf-datasets" / "parquet").rglob("*.arrow"))
    assert not [p for p in datasets_cache.rglob("*") if p.is_file()]


def test_registered_through_the_entry_point():
    from pipeline.lmms.model import RCRModel

    assert get_model("rcr") is RCRModel


def test_full_reproduces_rcr_generate(task_dir, full_run):
    """Every sample's text under method=full is plain rcr.generate's (batch 1, same prompt and max_new_tokens),
    and the tasks report lmms-eval's ROUGE-L and CIDEr."""
    model, processor = rcr.models.load("embedded")
    for task in LMMS_TASKS:
        got = logged(full_run, task)
        rows = read_input(task_dir / "shards" / task.removeprefix("rcr_")).to_pylist()
        assert sorted(got) == sorted(r["sample_id"] for r in rows)
        for row in rows:
            inputs = rcr.models.build_inputs(processor, [row["prompt"]], [sample_images(row)])
            with torch.inference_mode():
                res = rcr.generate(model, inputs, method="full", max_new_tokens=MAX_NEW)
            want = processor.tokenizer.decode(res.sample(0)["tokens"], skip_special_tokens=True).strip()
            assert got[row["sample_id"]]["text"] == want, row["sample_id"]
        metrics = full_run["results"][task]
        # CIDEr-D's length penalty puts a 24-token cut of a long description near 0: only its presence is checked
        assert 0.0 < metrics["ROUGE_L,none"] <= 1.0 and metrics["CIDEr,none"] >= 0.0


def test_telemetry_and_fidelity_in_logged_samples(full_run, rcr_batch1):
    """Each logged sample carries the method's telemetry and its ROUGE-L fidelity against full decoded from the
    same prefill; with 4 selected entries rcr departs from full on some sample (it does not on all: the
    fidelity is 1 where the texts agree)."""
    full = {**logged(full_run, "rcr_detailcaps"), **logged(full_run, "rcr_textcaps")}
    got = logged(rcr_batch1, "rcr_mixed")
    assert len(got) == 4
    for sid, s in got.items():
        tel = s["counts"]["rcr"]
        # the label: rcr with its own knob given as a model arg (candidates=16)
        assert tel["method"] == "rcr@candidates=16" and tel["output_tokens"] == s["counts"]["output_tokens"] >= 1
        assert 0.0 < tel["refresh_fraction"] <= 1.0 and tel["keys_read_per_step"] > 0.0
        assert tel["mean_drift"] is not None and tel["prefix_len"] > 0
        assert tel["fidelity"] == pytest.approx(rouge_l_f1(full[sid]["text"], s["text"]))
    assert any(s["text"] != full[sid]["text"] for sid, s in got.items())
    assert {s["counts"]["rcr"]["method"] for s in full.values()} == {"full"}


def test_padded_batch_matches_batch_one(task_dir, rcr_batch1):
    """A left-padded batch of 4 (two prompt lengths) decodes each sample as batch 1 does: the same text and
    the same per-sample refresh telemetry (each sample's own threshold and selection)."""
    single = logged(rcr_batch1, "rcr_mixed")
    assert len({s["counts"]["input_tokens"] for s in single.values()}) == 2  # two lengths: the batch is padded
    batched = logged(evaluate(task_dir, ["rcr_mixed"], f"pretrained=embedded,method=rcr,{SELECTED}", 4),
                     "rcr_mixed")
    for sid, s in single.items():
        assert batched[sid]["text"] == s["text"], sid
        a, b = batched[sid]["counts"]["rcr"], s["counts"]["rcr"]
        for key in ("output_tokens", "refresh_fraction", "keys_read_per_step", "mean_drift"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (sid, key)


@pytest.mark.parametrize("args, named", [
    ("method=bogus", "unknown method 'bogus'"),
    ("method=fixed@x", "'fixed@x'"),
    ("method=rcr,selectd=3", "selectd"),
    ("method=rcr,rank=0", "field 'rcr.rank'"),  # a knob of the method, given as its own model arg
    ("method=rcr@rho=2", "field 'rcr.rho'"),  # ... or in its label
    ("method=rcr,tau0=high", "tau0"),
    ("method=rcr,bacon_kernel=4", "field 'RCRConfig.bacon_kernel'"),  # a shared field, checked by RCRConfig
    ("method=rcr,batch_size=auto", "batch_size"),
    ("method=rcr,dtype=float8", "dtype"),
    ("method=rcr,device=gpu0", "device"),
    ("method=rcr,max_image_tokens=0", "max_image_tokens"),
    ("method=infinigen,pretrained=Qwen/Qwen2-VL-2B-Instruct", "infinigen.calibration"),
])
def test_bad_model_args_fail_in_one_line(args, named):
    """Through lmms-eval's own construction path (the evaluator's), before the model loads."""
    with pytest.raises(ConfigError) as e:
        get_model("rcr").create_from_arg_string(args, {"batch_size": None, "device": None})
    msg = str(e.value)
    assert named in msg and "\n" not in msg


def _request(gen_kwargs: dict, kind: str = "generate_until") -> Instance:
    args = ("Describe this image in detail.", gen_kwargs, None, 0, "t", "test")
    return Instance(request_type=kind, arguments=args, idx=0, metadata={"task": "t", "doc_id": 0, "repeats": 1})


@pytest.fixture(scope="module")
def model():
    return get_model("rcr").create_from_arg_string("pretrained=embedded,method=rcr")


@pytest.mark.parametrize("gen, named", [
    ({"do_sample": True, "temperature": 0.7}, "do_sample"),
    ({"temperature": 0.2}, "sampling"),
    ({"num_beams": 3}, "num_beams"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
])
def test_unsupported_generation_arguments_fail_in_one_line(model, gen, named):
    with pytest.raises(ConfigError) as e:
        model.generate_until([_request({"max_new_tokens": 8, "until": ["\n\n"], **gen})])
    assert named in str(e.value) and "\n" not in str(e.value)


def test_loglikelihood_and_multi_round_are_refused_in_one_line(model):
    for call in (model.loglikelihood, model.generate_until_multi_round):
        with pytest.raises(NotImplementedError) as e:
            call([_request({})])
        assert "rcr model" in str(e.value) and "\n" not in str(e.value)


def test_until_cuts_the_text_and_its_telemetry(model):
    """A stop string cuts the text where lmms-eval's HF models cut it, and the logged token count (over which the
    telemetry is summarised) stops at the token that completes the string. A text-only request: no image."""
    model.task_dict = {"t": {"test": [{}]}}
    whole, cut = model.generate_until([_request({"max_new_tokens": 16, "until": []}),
                                       _request({"max_new_tokens": 16, "until": [" at "]})])
    assert " at " in whole.text
    assert cut.text == whole.text[: whole.text.index(" at ")].strip()
    n = cut.token_counts.output_tokens
    assert cut.token_counts.rcr["output_tokens"] == n < whole.token_counts.output_tokens
    ids = model.tokenizer(whole.text, add_special_tokens=False)["input_ids"]
    assert " at " in model.tokenizer.decode(ids[:n]) and " at " not in model.tokenizer.decode(ids[: n - 1])


def test_a_video_file_is_decoded_as_rcr_generate_decodes_its_frames(tmp_path):
    """A task's video file (an H.264 .mp4 of an embedded video scene, written with PyAV, lmms-eval's video
    dependency) is a video request: the model's text is rcr.generate's on the same file's frames."""
    import av
    from transformers.video_utils import load_video

    frames, _ = synthetic.render("video", synthetic.HELDOUT_SEED, 0)
    path = tmp_path / "scene.mp4"
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = frames[0].shape[1], frames[0].shape[0], "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    m = get_model("rcr").create_from_arg_string("pretrained=embedded,method=full")
    m.task_dict = {"t": {"test": [{}]}}
    prompt = TASKS["video"].prompt
    req = Instance(request_type="generate_until", idx=0, metadata={"task": "t", "doc_id": 0, "repeats": 1},
                   arguments=(prompt, {"max_new_tokens": 16, "until": []}, lambda doc: [str(path)], 0, "t", "test"))
    (got,) = m.generate_until([req])
    decoded, _ = load_video(str(path))  # every frame: the video is shorter than max_frames (32)
    assert len(decoded) == len(frames)
    inputs = rcr.models.build_inputs(m.processor, [prompt], [[Image.fromarray(f) for f in decoded]], video=True)
    with torch.inference_mode():
        res = rcr.generate(m.model, inputs, method="full", max_new_tokens=16)
    assert got.text == m.tokenizer.decode(res.sample(0)["tokens"], skip_special_tokens=True).strip()
    assert got.token_counts.input_tokens == int(inputs["attention_mask"].sum())


def test_the_drift_test_bed_loads_by_name_with_its_own_calibration():
    """``pretrained=embedded-drift`` loads the drift test bed (docs/embedded.md), and InfiniGen finds the
    calibration shipped beside its weights (made for them: a calibration of other weights is refused)."""
    from rcr.embedded import model_dir

    m = get_model("rcr").create_from_arg_string("pretrained=embedded-drift,method=infinigen")
    assert m.model.config._name_or_path == str(model_dir("embedded-drift"))
    assert m.method_.calibration_samples(str(model_dir("embedded-drift"))) == 0


def test_a_qwen_images_visual_tokens_are_capped_as_the_pipeline_caps_them(monkeypatch):
    """Qwen2-VL's published processor lets one image take thousands of visual tokens; the lmms-eval model caps them
    at ``max_image_tokens``, by default the pipeline's ``--max-image-tokens``, so both give the model the same
    prompt for the same image."""
    import copy

    from pipeline.run import actor
    from pipeline.run.config import JobConfig
    from tests import tiny_models

    model, proc = tiny_models.qwen2_vl()
    published = copy.deepcopy(proc)
    published.image_processor.size = {"shortest_edge": 3136, "longest_edge": 12845056}  # Qwen2-VL-*-Instruct's
    monkeypatch.setattr(rcr.models, "load", lambda *a, **k: (model, copy.deepcopy(published)))
    image = Image.new("RGB", (2000, 1500))

    def tokens(processor) -> int:
        ids = rcr.models.build_inputs(processor, ["describe"], [[image]])["input_ids"]
        return int((ids == model.config.image_token_id).sum())

    assert tokens(published) > 3000
    engine = actor.RcrEngine(JobConfig(model="qwen2-vl"), "cpu", "float32")
    lm = get_model("rcr").create_from_arg_string("pretrained=qwen2-vl,method=full", {"device": "cpu"})
    assert tokens(lm.processor) == tokens(engine.processor) <= JobConfig().max_image_tokens
    small = get_model("rcr").create_from_arg_string("pretrained=qwen2-vl,method=full,max_image_tokens=64",
                                                    {"device": "cpu"})
    assert tokens(small.processor) <= 64
