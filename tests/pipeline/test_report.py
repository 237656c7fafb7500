"""The job's summary table as a terminal shows it: every line fits 120 columns (the CIs wrap onto a second line when
the methods' labels are long), `full`'s reads say that it attends to the whole prefix, and the notes a reader needs
(too few samples for the CIs, a method's own recalls, why a CIDEr is 0) are printed where they apply."""

from __future__ import annotations

import pandas as pd
import pytest

import rcr
from pipeline.analysis.analyze import analyze
from pipeline.analysis.report import WIDTH, format_summary
from tests.fake_output import make_output_frame


def _summary(df: pd.DataFrame) -> str:
    return format_summary(analyze(df, bootstrap_resamples=200))


def _rows(txt: str) -> dict[str, list[str]]:
    """{method: its table row's cells} of a one-line-per-method table."""
    lines = txt.splitlines()
    return {ln.split()[0]: ln.split() for ln in lines[3:lines.index(next(x for x in lines if x.startswith("against")))]}


def test_every_method_fits_120_columns_on_one_line_each():
    df = make_output_frame(n_samples=12, methods=tuple(rcr.METHODS))
    df.loc[df.method == "arkvale", "recalled_per_step"] = 7.9
    txt = _summary(df)
    assert max(map(len, txt.splitlines())) <= WIDTH, max(txt.splitlines(), key=len)
    header = txt.splitlines()[1]
    assert "fidelity [95% CI]" in header and "recalled" not in header and "err" not in header.split()
    assert set(_rows(txt)) == set(rcr.METHODS)  # one line each, with its CIs
    assert "recalled into a method's own page cache per KV head per layer-step, besides its reads: arkvale 7.9" in txt
    assert _rows(txt)["full"][-3] == "all" and _rows(txt)["bacon"][-3] == "0.0"  # reads/step


def test_long_labels_put_the_cis_on_a_second_line():
    labels = ("full", "bacon", "rcr", "arkvale@rule=recall,groups=layer",
              "rcr@rho=0.3,step=0.1,candidates=64,rank=4,tau0=0.05,controller_signal=layer")
    df = make_output_frame(n_samples=12, methods=labels, errors=2)
    txt = _summary(df)
    lines = txt.splitlines()
    assert max(map(len, lines)) <= WIDTH, max(lines, key=len)
    assert lines[1].split()[:4] == ["method", "fidelity", "vs", "bacon"] and "[95% CI]" in lines[2]
    assert lines[1].split()[-1] == "err"  # the job has error rows
    m = analyze(df, bootstrap_resamples=200).methods.set_index("method")
    body = lines[4:lines.index(next(x for x in lines if x.startswith("against")))]
    seen, i = {}, 0
    while i < len(body):  # a method: its values' line, its CIs' line (and a long label's next pieces)
        values, cis = body[i].split(), body[i + 1].split()
        label, i = values[0] + (cis.pop(0) if not cis[0].startswith("[") else ""), i + 2
        while i < len(body) and len(body[i].split()) == 1:
            label, i = label + body[i].strip(), i + 1
        seen[label] = values[1], cis[:2]
    assert seen == {label: (f"{m.loc[label, 'fidelity']:.3f}", [f"[{m.loc[label, 'fidelity_ci_low']:.3f},",
                                                                f"{m.loc[label, 'fidelity_ci_high']:.3f}]"])
                    for label in labels}


@pytest.mark.parametrize("n, warned", [(6, True), (12, False)])
def test_too_few_samples_say_the_cis_are_not_to_be_trusted(n, warned):
    txt = _summary(make_output_frame(n_samples=n, methods=("full", "bacon", "rcr")))
    assert (f"n = {n} samples (< 10): the bootstrap CIs are not to be trusted" in txt) is warned


def test_a_cider_of_zero_is_explained_by_the_length_penalty():
    """An output that says what its reference says plus 40 words scores CIDEr-D ~0 (its length penalty), and the
    note names it with its distance in words; one of the reference's length does not."""
    df = make_output_frame(n_samples=12, methods=("full", "bacon", "rcr"))
    df["references"] = df.references.map(lambda r: [r[0]])  # one reference: its length is the one to match
    refs = df.references.map(lambda r: r[0])
    df.loc[df.method == "rcr", "output_text"] = refs[df.method == "rcr"]
    df.loc[df.method == "bacon", "output_text"] = refs[df.method == "bacon"] + " and a red cube" * 10
    a = analyze(df, bootstrap_resamples=200)
    m = a.methods.set_index("method")
    assert round(m.loc["bacon", "cider"], 3) == 0 < m.loc["bacon", "rougeL_ref"] and m.loc["rcr", "cider"] > 1
    assert (a.per_sample[a.per_sample.method == "bacon"].ref_length_gap == 40).all()
    note = next(ln for ln in format_summary(a).splitlines() if ln.startswith("CIDEr 0.000"))
    assert note.startswith("CIDEr 0.000 for bacon: CIDEr-D multiplies each match by exp(-d^2/72)")
    assert "rcr" not in note
