"""The MLflow UI in a real browser: a job's runs, logged by the tracking code, rendered by headless Chromium from the
project's MLflow server (infra/mlflow_server.sh) on 127.0.0.1. The URLs a job prints open on the runs, not on
MLflow's GenAI overview, and show the numbers: each method's fidelity, CI, refresh and reads per step as columns,
the summary rounded to 3 digits as the parent's description, the job's charts in the chart view.

The job is a small fake output (tests/fake_output.py) of every method plus a fixed-tau sweep point (11 method runs,
so the parent is the 12th run: the UI's charts show the first 10 by default) logged with `tracking.log_job`, as the
driver does at the end of a job; the server is started by the test and stopped by its process group. `.ci/run`
installs Debian's `chromium` where it is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from matplotlib.colors import to_rgb
from mlflow import MlflowClient

from pipeline.analysis import mlflow_ui, tracking
from pipeline.analysis.colours import label_colours
from tests.fake_output import make_output_frame
from tests.pipeline_helpers import PY, REPO
from tests.ray_head import free_port

pytestmark = pytest.mark.timeout(600)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
METHODS = ("full", "bacon", "prefill_oracle", "exact", "fixed", "rcr", "rcr_layer", "quest", "arkvale", "infinigen",
           "fixed@0.05")


class _Links(HTMLParser):
    """(href, text) of every <a> in a DOM dump."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._open: list[list] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._open.append([dict(attrs).get("href") or "", ""])

    def handle_data(self, data):
        for a in self._open:
            a[1] += data

    def handle_endtag(self, tag):
        if tag == "a" and self._open:
            href, text = self._open.pop()
            self.links.append((href, text.strip()))


def _links(dom: str) -> list[tuple[str, str]]:
    p = _Links()
    p.feed(dom)
    return p.links


@pytest.fixture(scope="module")
def served_job(tmp_path_factory):
    """A small job logged to a sqlite store, served by `mlflow server` on a free 127.0.0.1 port."""
    tmp = tmp_path_factory.mktemp("mlflow-ui")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    df = make_output_frame(n_samples=6, methods=METHODS, job_name="ui-job")
    pid = tracking.log_job(df=df, config={"job_name": "ui-job"}, tracking_uri=uri, experiment="rcr-eval",
                           output_dir=str(tmp / "out"), bootstrap_resamples=200, verbose=False)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("rcr-eval").experiment_id
    runs = {r.info.run_id: r for r in client.search_runs([exp])}
    port = free_port()
    log = open(tmp / "server.log", "w")  # noqa: SIM115 - the server writes to it until the teardown
    env = dict(os.environ, PATH=f"{Path(PY).parent}:{os.environ.get('PATH', '')}")
    server = subprocess.Popen(["bash", str(REPO / "infra" / "mlflow_server.sh"), str(tmp), str(port)], env=env,
                              cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(server, base, tmp / "server.log")
        yield {"base": base, "exp": exp, "pid": pid, "runs": runs, "tmp": tmp}
    finally:
        with_group = server.pid
        try:
            os.killpg(with_group, signal.SIGTERM)
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(with_group, signal.SIGKILL)
            server.wait(timeout=30)
        except ProcessLookupError:
            pass
        log.close()


def _wait_healthy(server: subprocess.Popen, base: str, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"mlflow server exited:\n{log.read_text()[-3000:]}"
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2).close()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise AssertionError(f"mlflow server did not answer in {timeout}s:\n{log.read_text()[-3000:]}")


def _render(url: str, profile: Path, want, attempts: int = 3) -> str:
    """Chromium's DOM of ``url`` once the single-page app has rendered what ``want(dom)`` looks for; a busy
    machine can need a second render (a fresh profile each time: no view state carried over)."""
    dom = ""
    for i in range(attempts):
        d = profile / f"profile-{i}"
        r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={d}",
                            "--window-size=1600,1000",  # wide enough that the grid renders every column it shows
                            "--dump-dom", f"--virtual-time-budget={30_000 * (i + 1)}", url],
                           capture_output=True, text=True, timeout=300, check=False)
        shutil.rmtree(d, ignore_errors=True)
        dom = r.stdout
        if want(dom):
            return dom
    return dom


def _run_links(dom: str, exp: str) -> dict[str, str]:
    """{run id: link text} of the links to runs of experiment ``exp``."""
    prefix = f"#/experiments/{exp}/runs/"
    return {href[len(prefix):].split("?")[0]: text for href, text in _links(dom) if href.startswith(prefix)}


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_job_url_opens_on_the_jobs_runs(served_job, tmp_path):
    """The URL a job prints for its runs shows the runs table with the parent and every method run by name."""
    s = served_job
    key = s["runs"][s["pid"]].data.tags["rcr.job_key"]
    url = mlflow_ui.job_runs_url(s["base"], s["exp"], key)
    want = {rid: r.info.run_name for rid, r in s["runs"].items()}
    dom = _render(url, tmp_path, lambda d: want.items() <= _run_links(d, s["exp"]).items())
    got = _run_links(dom, s["exp"])
    assert want.items() <= got.items(), f"runs in the DOM: {got}; expected {want}\n{dom[-2000:]}"
    assert sorted(want.values()) == sorted(["ui-job", *METHODS])
    assert "Sort: fidelity" in dom  # ranked by fidelity, the job's search applied
    _assert_model_training_view(dom, s["exp"])


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_experiment_url_opens_on_the_runs_table(served_job, tmp_path):
    """The experiment's URL: the runs table (the job's parent run by name), not MLflow's GenAI overview."""
    s = served_job
    dom = _render(mlflow_ui.experiment_url(s["base"], s["exp"]), tmp_path,
                  lambda d: s["pid"] in _run_links(d, s["exp"]))
    assert _run_links(dom, s["exp"]).get(s["pid"]) == "ui-job", dom[-2000:]
    _assert_model_training_view(dom, s["exp"])


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_experiments_list_has_the_switch_a_job_names(served_job, tmp_path):
    """The UI's own Experiments list links to the experiment with no view (so a fresh browser lands on the GenAI
    overview), and shows the "GenAI | Model training" switch that a job's last [mlflow] line tells the user to set."""
    s = served_job
    dom = _render(f"{s['base']}/#/experiments", tmp_path, lambda d: f'href="#/experiments/{s["exp"]}"' in d)
    assert f'href="#/experiments/{s["exp"]}"' in dom, dom[-2000:]
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))
    assert "GenAI Model training" in text and "'GenAI | Model training' switch" in mlflow_ui.LIST_HINT


def _assert_model_training_view(dom: str, exp: str) -> None:
    """The side navigation of the "Model training" view (Runs, Models, ...), not the GenAI one (Overview, ...)."""
    nav = _links(dom)
    runs_tab = [href for href, text in nav if text == "Runs" and href.startswith(f"#/experiments/{exp}/runs?")]
    assert runs_tab and all(mlflow_ui.WORKFLOW in href.split("?")[1].split("&") for href in runs_tab), nav[:12]
    assert not any(f"/experiments/{exp}/overview" in href for href, _ in nav), nav[:12]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_parent_run_page_shows_fidelity_per_method(served_job, tmp_path):
    """The parent run's page: the summary table (description), fidelity and CI per method as metrics, and links
    to its method runs."""
    s = served_job
    url = mlflow_ui.run_url(s["base"], s["exp"], s["pid"])
    metrics = s["runs"][s["pid"]].data.metrics
    n_links = min(10, len(s["runs"]) - 1)  # the method runs it links (below)
    dom = _render(url, tmp_path, lambda d: "fidelity_ci_high/rcr" in d
                  and len(set(_run_links(d, s["exp"])) & set(s["runs"])) >= n_links)
    for m in METHODS:
        label = m.replace("@", "_")
        for name in ("fidelity", "fidelity_ci_low", "fidelity_ci_high"):
            assert f"{name}/{label}" in dom and f"{name}/{label}" in metrics, (name, label)
    # the description: the summary table, each method's fidelity [CI] rounded to 3 digits
    assert "vs bacon [CI]" in dom
    for m in METHODS:
        label = m.replace("@", "_")
        fid, lo, hi = (metrics[f"{name}/{label}"] for name in ("fidelity", "fidelity_ci_low", "fidelity_ci_high"))
        row = rf"\n{re.escape(m)} +{fid:.3f} \[{lo:.3f}, {hi:.3f}\]"
        assert re.search(row, dom), row
    children = {rid: r.info.run_name for rid, r in s["runs"].items() if rid != s["pid"]}
    linked = {rid: name for rid, name in _run_links(dom, s["exp"]).items() if re.fullmatch(r"[0-9a-f]{32}", rid)
              and rid != s["pid"]}  # not the links of its metrics (<run id>/model-metrics)
    # the page lists the 10 latest method runs, and loads more on request
    assert linked.items() <= children.items() and len(linked) == n_links, (linked, children)


def _cells(dom: str) -> dict[tuple[str, str], str]:
    """{(run id, metric): its cell's text} of the runs table in a DOM dump (each grid row carries its run id)."""
    out = {}
    for row in re.split(r'(?=<div[^>]*role="row")', dom):
        rid = re.match(r'<div[^>]*role="row"[^>]*row-id="([0-9a-f]{32})"', row)
        if rid is None:
            continue
        for col, text in re.findall(r'col-id="metrics\.`([^`]+)`"(?:(?!col-id=).)*?class="ag-cell-value">([^<]*)<',
                                    row, re.S):
            out[(rid.group(1), col)] = text
    return out


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_job_runs_page_shows_each_methods_fidelity_ci_refresh_and_reads(served_job, tmp_path):
    """The job's runs link opens on a table whose cells show each method run's fidelity, its CI, refresh fraction and
    reads per step: the values of its metrics, in the rendered DOM."""
    s = served_job
    key = s["runs"][s["pid"]].data.tags["rcr.job_key"]
    children = {rid: r for rid, r in s["runs"].items() if rid != s["pid"]}
    want = {(rid, m): r.data.metrics[m] for rid, r in children.items() for m in mlflow_ui.JOB_COLUMNS}
    assert len(want) == len(METHODS) * 5
    dom = _render(mlflow_ui.job_runs_url(s["base"], s["exp"], key), tmp_path, lambda d: want.keys() <= _cells(d).keys())
    got = _cells(dom)
    assert want.keys() <= got.keys(), f"cells missing: {sorted(want.keys() - got.keys())[:5]}\n{dom[-2000:]}"
    for k, v in want.items():
        assert float(got[k]) == pytest.approx(v, rel=1e-9, abs=1e-12), (k, got[k], v)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_chart_view_opens_on_the_jobs_charts(served_job, tmp_path):
    """The runs link's chart view: first a section of bar charts of fidelity, refresh and reads per step across the
    method runs (the fidelity chart's labels are their values), and no section without charts."""
    s = served_job
    key = s["runs"][s["pid"]].data.tags["rcr.job_key"]
    url = mlflow_ui.job_runs_url(s["base"], s["exp"], key) + "&compareRunsMode=CHART"
    dom = _render(url, tmp_path, lambda d: "main-svg" in d)
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))
    assert f"this job, per method ({len(mlflow_ui.JOB_CHARTS)})" in text, text[:3000]
    assert "No charts in this section" not in text
    titles = re.findall(r'<h4[^>]*title="([^"]+)"', dom)
    assert titles[:len(mlflow_ui.JOB_CHARTS)] == list(mlflow_ui.JOB_CHARTS), titles[:10]
    first = dom[dom.index("main-svg"):]
    first = first[:first.index("</svg>")]
    labels = re.findall(r'<text[^>]*class="bartext[^"]*"[^>]*>([0-9.]+)</text>', first)  # not the axis ticks
    fidelity = sorted(f"{r.data.metrics['fidelity']:.2f}" for rid, r in s["runs"].items() if rid != s["pid"])
    assert sorted(labels) == fidelity, (labels, fidelity)
    # each bar in its method's colour (the plots' table; the run's mlflow.runColor tag): one colour per method
    fills = re.findall(r'<path[^>]*class="point[^"]*"[^>]*>|<g class="point[^"]*">\s*<path[^>]*>', first)
    bars = {tuple(int(c) for c in m) for m in re.findall(r"fill:\s*rgb\((\d+),\s*(\d+),\s*(\d+)\)", "".join(fills))}
    want = {tuple(round(255 * c) for c in to_rgb(colour)) for colour in label_colours(METHODS).values()}
    assert bars == want and len(want) == len(METHODS), (bars, want)
