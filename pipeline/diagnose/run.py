"""The premise check as a job: ``python jobs/diagnose.py --model M --shards S`` (or ``--dataset``).

1. The pipeline's own job (``pipeline.run.driver``: Ray actors, Parquet, resume) decodes ``full``, ``bacon``,
   ``prefill_oracle``, ``exact`` and ``fixed`` (and any ``--methods`` added) on the first ``--limit`` samples,
   with exact drift and the most-attended prefix position recorded.
2. On the driver, the model answers the first ``--probe-samples`` of each drift tercile once more with eager
   attention, for the per-layer probes (``attention.sample_profiles``, ``detector.probe``): over all of them, and
   the image share per tercile.
3. ``premises.figures`` -> one printed table; ``<output dir>/_diagnose/`` gets the figures, per-layer and per-head
   tables (Parquet) and a plot; one MLflow run gets the figures as metrics and those files as artifacts.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from pipeline import quiet
from pipeline.analysis import mlflow_client, mlflow_store
from pipeline.analysis.analyze import analyze
from pipeline.analysis.labels import BACON, EXACT, FIXED, FULL, PREFILL_ORACLE
from pipeline.diagnose import premises
from pipeline.progress import Stage
from pipeline.quiet import say
from pipeline.run import driver
from pipeline.run.cli import build_arg_parser
from pipeline.run.cli import job_config as parse_job
from pipeline.run.config import ConfigError, JobConfig, model_slug
from pipeline.run.inputs import scan_inputs
from pipeline.run.store import OutputStore

METHODS = (FULL, BACON, PREFILL_ORACLE, EXACT, FIXED)  # what the figures need
DEFAULT_LIMIT = 40
DEFAULT_PROBE_SAMPLES = 3
EXAMPLES = """examples:
  python jobs/diagnose.py                                            # the embedded default: 40 samples, then 9 probed
  python jobs/diagnose.py --model Qwen/Qwen2-VL-7B-Instruct --shards /data/shards/detailcaps --limit 100 --device cuda
"""


def parser() -> argparse.ArgumentParser:
    p = build_arg_parser(None)
    p.prog = "diagnose.py"
    p.description = ("Measure what RCR assumes of a model (attention dwell, staleness of a static selection, drift "
                     "between samples, detector recall, image share) on the first --limit samples (default "
                     f"{DEFAULT_LIMIT}); --methods adds methods to the ones the figures need ({', '.join(METHODS)}).")
    p.epilog = EXAMPLES
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--probe-samples", type=int, default=DEFAULT_PROBE_SAMPLES,
                   help="samples of each drift tercile the per-layer probes answer again on the driver, with eager "
                        f"attention (0: skip them) (default: {DEFAULT_PROBE_SAMPLES})")
    # the job flags whose default is the premise check's own (job_config), not the evaluation job's
    own = {"limit": f"first N input rows, in shard order (default: {DEFAULT_LIMIT})",
           "methods": f"comma-separated method labels added to the ones the figures need ({', '.join(METHODS)}); "
                      "'fixed@TAU' runs fixed with that tau (default: none added)",
           "job_name": "names the output dir and the MLflow run (default: diagnose-<task>-<model name>, e.g. "
                       "diagnose-detailcaps-embedded)",
           "rcr": "an rcr.RCRConfig field, repeatable (default: the paper's values, with record_attention=true and "
                  "exact_drift=true)",
           "summary": argparse.SUPPRESS}  # the per-method summary is always off: the premise table replaces it
    for action in p._actions:
        if action.dest in own:
            action.help = own[action.dest]
    return p


def job_config(argv: list[str] | None) -> tuple[JobConfig, int]:
    """The diagnose job's config: the user's flags over the diagnose defaults (methods, limit, job name, exact
    drift, no per-method summary); and the number of probe samples."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser().parse_args(argv)
    if ns.probe_samples < 0:
        raise ConfigError("probe_samples", f"must be >= 0, got {ns.probe_samples}")
    rest = _without(argv, "--probe-samples")
    user = parse_job(rest)  # the user's flags alone: task, model, methods
    methods = list(dict.fromkeys([*METHODS, *(user.methods if ns.methods else [])]))
    defaults = ["--limit", str(DEFAULT_LIMIT), "--no-summary", "--job-name",
                f"diagnose-{user.task}-{model_slug(user.model)}", "--rcr", "exact_drift=true"]
    return parse_job(defaults + _without(rest, "--methods") + ["--methods", ",".join(methods)]), \
        ns.probe_samples


def _without(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def probes(cfg: JobConfig, rows: list, picks: dict[str, str]):
    """(attention profile per layer, detector figures per layer and KV head, re-selected layers, attention profile
    per layer of each group) on the samples of the input's ``rows`` (``scan_inputs``) that ``picks`` names (sample
    id -> group: its drift tercile), answered on this process's device; (None, None, None, None) where no sample
    can be probed."""
    say(f"probes: loading the model and reading the {len(picks)} sample(s)")
    import torch

    from pipeline.data.images import load_sample_images
    from pipeline.diagnose import attention, detector
    from rcr import RCRConfig
    from rcr.methods import RCR, parse_method
    from rcr.methods.rcr import DriftRefresh
    from rcr.models import geometry, limit_image_tokens, load

    samples, groups = [], []
    for r in (r for r in rows if r.key in picks):  # in shard order
        row = pq.read_table(r.file, columns=["prompt", "images"]).slice(r.row, 1).to_pylist()[0]
        images = load_sample_images(row["images"], cfg.task, cfg.max_frames, cfg.max_image_bytes,
                                    cfg.max_image_pixels)
        samples.append((row["prompt"], images, cfg.task == "video"))
        groups.append(picks[r.key])
    device = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
    with quiet.quiet_model_loading():
        model, processor = load(cfg.model_path(), device=device, dtype=cfg.dtype_on(device),
                                trust_remote_code=cfg.trust_remote_code)  # the job's dtype: the same answers
    limit_image_tokens(processor, cfg.max_image_tokens)  # the job's cap (--max-image-tokens), so the same prompts
    model.set_attn_implementation("eager")  # the attention weights are materialised only by the eager path
    rcfg = RCRConfig(**cfg.rcr)
    every = cfg.progress_every_s
    with Stage(f"probes: greedy answers (up to {cfg.max_new_tokens} tokens each)", len(samples), every) as stage:
        answered = attention.greedy_answers(model, processor, samples, cfg.max_new_tokens, done=stage)
    # dwell needs two answer steps, the detector a prefix region (a prompt longer than the window)
    kept = [(a, g) for a, g in zip(answered, groups)
            if a.answer.shape[1] >= 2 and a.inputs["input_ids"].shape[1] > rcfg.window]
    if not kept:
        say(f"probes: no sample has an answer of 2 tokens or more and a prompt longer than the window "
            f"({rcfg.window}); the per-layer figures are left out")
        return None, None, None, None
    answers = [a for a, _ in kept]
    with Stage("probes: attention profiles", len(answers), every) as stage:
        per_sample = attention.sample_profiles(model, answers, rcfg.selected, done=stage)
    by_group = attention.mean_profiles_by(per_sample, [g for _, g in kept])
    context = max(a.inputs["input_ids"].shape[1] for a in answers) + cfg.max_new_tokens - 1  # the decode's longest
    # the detector of the job's first drift-triggered method (its rank and candidates), else rcr's defaults
    drift = [m for m in (parse_method(label, rcfg) for label in cfg.methods) if isinstance(m, DriftRefresh)]
    probed = drift[0] if drift else RCR(rcfg)
    with Stage("probes: detector recall", len(answers), every) as stage:
        recall = detector.probe(model, answers, probed, done=stage)
    return attention.mean_profile(per_sample), recall, geometry(model).reselected(context), by_group


def layer_frames(layers: list[dict], heads: list[list[dict]], treated) -> tuple[pd.DataFrame, pd.DataFrame]:
    lf = pd.DataFrame([{"layer": i, "reselected": treated[i], **r} for i, r in enumerate(layers)])
    hf = pd.DataFrame([{"layer": i, "kv_head": h, **r} for i, hs in enumerate(heads) for h, r in enumerate(hs)])
    return lf, hf


def plot(a, layers: list[dict] | None, treated, path: Path) -> Path:
    """Left: each sample's mean drift, sorted, coloured by tercile. Right: per re-selected layer, the image share of
    a step's attention and the top-S share an exact selection keeps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    per = a.per_sample.drop_duplicates("sample_id").dropna(subset=["sample_drift"]).sort_values("sample_drift")
    colours = {"low": "tab:green", "mid": "tab:orange", "high": "tab:red"}
    ax1.scatter(range(len(per)), per["sample_drift"], c=[colours.get(t, "grey") for t in per["drift_tercile"]], s=12)
    ax1.set(xlabel="sample (sorted)", ylabel="mean drift", title="drift per sample, by tercile")
    shown = [t for t in colours if t in set(per["drift_tercile"])]
    if shown:  # which colour is which tercile
        ax1.legend(handles=[ax1.scatter([], [], color=colours[t], s=12, label=f"{t} drift") for t in shown],
                   title="tercile", fontsize=8, title_fontsize=8)
    if layers:
        idx = [i for i in range(len(layers)) if treated[i]]
        x = range(len(idx))
        ax2.bar([i - 0.2 for i in x], [layers[i]["on_image"] for i in idx], 0.4, label="image share")
        ax2.bar([i + 0.2 for i in x], [layers[i]["top"] for i in idx], 0.4, label="top-S share of prefix")
        ax2.set_xticks(list(x), [str(i) for i in idx])
        ax2.set(xlabel="re-selected layer", ylim=(0, 1), title="attention per layer")
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_run(cfg: JobConfig, figs: list[premises.Figure], files: list[Path], n_samples: int) -> str:
    """One MLflow run: the config as params, the figures as metrics, the tables and plot as artifacts. A failure
    part way marks the run FAILED and raises."""
    uri = mlflow_client.resolve_tracking_uri(cfg.mlflow_uri)
    client = mlflow_client.client(uri)
    exp_id = mlflow_client.experiment_id(client, cfg.experiment, uri)
    run = client.create_run(exp_id, run_name=cfg.job_name, tags={mlflow_client.TAG_ROLE: "diagnose"})
    rid = run.info.run_id
    try:
        params = {"model": cfg.model, "task": cfg.task, "n_samples": n_samples, "config_hash": cfg.config_hash,
                  "output_dir": cfg.output_dir, "methods": ",".join(cfg.methods)}
        for k, v in params.items():
            client.log_param(rid, k, str(v)[:6000])
        for k, v in premises.finite_metrics(figs).items():
            client.log_metric(rid, k, v)
        for f in files:
            mlflow_store.upload(client, uri, run, f, "diagnose")
        client.set_terminated(rid)
    except BaseException:
        mlflow_store.fail_runs(client, [rid])
        raise
    return rid


def run(cfg: JobConfig, probe_samples: int, argv: list[str] | tuple[str, ...] = ()) -> int:
    """The premise check; ``argv``: the command's flags, for the line that says how to log it again."""
    result = driver.run(cfg)
    if result["status"] == "interrupted":  # Ctrl-C: the driver said what it left, in one line
        return 128 + result["signal"]
    if result["status"] != "ok":
        return 1
    store = OutputStore(cfg.output_dir)
    df = store.read().to_pandas()
    df = df[(df["config_hash"] == cfg.config_hash) & df["method"].isin(cfg.methods)]
    say(f"premise figures: the statistics of {len(df)} row(s), with bootstrap CIs")
    a = analyze(df, baselines=(BACON, PREFILL_ORACLE))
    layers = heads = treated = by_tercile = None
    if probe_samples:
        _, rows, _ = scan_inputs(cfg)
        picks = premises.probe_picks(a, [r.key for r in rows], probe_samples)
        say(f"probes: answering {len(picks)} sample(s) again with eager attention ({probe_samples} per drift "
            "tercile)")
        layers, heads, treated, by_tercile = probes(cfg, rows, picks)
    figs = premises.figures(a, layers, heads, treated, by_tercile)
    n = int(df["sample_id"].nunique())
    print(f"\npremise check: {cfg.model}, {cfg.task}, {n} samples ({probe_samples} per drift tercile for the "
          "per-layer probes)")
    print(premises.table(figs), flush=True)
    out = Path(cfg.output_dir) / "_diagnose"  # '_': pd.read_parquet(output_dir) skips it
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "figures.parquet"]
    premises.frame(figs).to_parquet(files[0])
    if layers is not None:
        lf, hf = layer_frames(layers, heads, treated)
        files += [out / "layers.parquet", out / "heads.parquet"]
        lf.to_parquet(files[1])
        hf.to_parquet(files[2])
    files.append(plot(a, layers, treated, out / "premises.png"))
    say(f"premise tables and plot: {out}")
    say(f"MLflow: logging the figures, tables and plot to {cfg.mlflow_uri}")
    try:
        rid = log_run(cfg, figs, files, n)
        say(f"MLflow run {rid}: {cfg.mlflow_uri}")
    except Exception as e:  # noqa: BLE001 - the figures are printed and written; MLflow is a convenience
        again = shlex.join(["python", "jobs/diagnose.py", *argv])
        say(f"MLflow logging failed ({mlflow_store.error_cause(e)}); the run is marked FAILED, the tables "
                   f"are in {out} and the rows in {cfg.output_dir}. Log it by running the same command again (it "
                   f"computes no rows, only the probes): {again}")
        return driver.MLFLOW_FAILED_EXIT
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        cfg, probe_samples = job_config(argv)
        with quiet.stderr_without(quiet.RAY_ACTOR_RESTART_NOTICE):  # as the jobs' driver.main
            return run(cfg, probe_samples, argv)
    except ConfigError as e:
        print(f"[rcr-job] {e}", file=sys.stderr, flush=True)
        return 2
