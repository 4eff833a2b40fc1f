"""Training curves in the catalog browser over real HTTP: the run page's curve with its
checkpoints and loss alerts, and runs overlaid on /compare."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ckptstore.ops.upkeep.history import ALERT_EVENT
from ckptstore.ui.app import BackgroundUI
from ckptstore.ui.report import write_report
from ckptstore.ui.views import CURVE_POINTS


def fetch(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=20) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def curve_svgs(body: str) -> list[str]:
    return re.findall(r'<svg class="curve".*?</svg>', body, re.S)


def test_run_page_draws_the_curve_with_checkpoints_and_alerts(
    curve_server: BackgroundUI, curve_store: Any
) -> None:
    store = curve_store.store
    events = store.events(run="alpha", kind=ALERT_EVENT)
    assert sorted(e.detail["step"] for e in events) == list(curve_store.alert_steps)
    status, body = fetch(curve_server.url + "runs/alpha")
    assert status == 200 and "Training curve" in body
    (svg,) = curve_svgs(body)
    assert 'data-metric="loss"' in svg and svg.count('class="curve-line"') == 1
    # 20,000 logged steps, stored in at most 1,000 buckets, drawn as at most 600 points.
    drawn = int(re.search(r'data-points="(\d+)"', svg).group(1))  # type: ignore[union-attr]
    assert 100 <= drawn <= CURVE_POINTS
    assert "19999 values logged" in body  # the NaN step is not a value; the spike is
    # One marker per committed checkpoint, linked to its page, at its step.
    cks = store.list(run="alpha", order_by="step")
    assert [c.step for c in cks] == [4000, 8000, 12000, 16000, 20000]
    steps = re.findall(r'<circle class="ckpt-marker" data-run="alpha" data-step="(\d+)"', svg)
    assert [int(s) for s in steps] == [c.step for c in cks]
    for ck in cks:
        assert f'<a href="/checkpoints/{ck.id}"><circle class="ckpt-marker"' in svg
    # The loss alerts: the spike and the NaN, with the monitor's reason as the tooltip.
    alerts = re.findall(r'<path class="alert-marker" data-run="alpha" data-step="(\d+)"', svg)
    assert sorted(int(s) for s in alerts) == list(curve_store.alert_steps)
    assert "jumped" in svg and "nonfinite at step 15000" in svg
    # The downsampled curve still reaches the spike: the band's top is the spike's height.
    assert ">40</text>" in svg  # a y tick at the spike's height
    assert '<td class="num">40</td>' in body and 'class="alerts"' in body
    # Links to overlay the other runs that have a curve (not delta, which has none).
    assert 'href="/compare?run=alpha&amp;run=beta"' in body
    assert 'href="/compare?run=alpha&amp;run=gamma"' in body
    assert "run=delta" not in body


def test_a_run_without_a_curve_has_no_curve_section(curve_server: BackgroundUI) -> None:
    status, body = fetch(curve_server.url + "runs/delta")
    assert status == 200 and "Training curve" not in body and not curve_svgs(body)


def test_compare_overlays_runs(curve_server: BackgroundUI, curve_store: Any) -> None:
    status, body = fetch(curve_server.url + "compare?run=alpha&run=beta")
    assert status == 200
    (svg,) = curve_svgs(body)
    assert re.findall(r'<g class="curve-series" data-run="(\w+)"', svg) == ["alpha", "beta"]
    assert re.findall(r'<g class="legend-item" data-run="(\w+)"', svg) == ["alpha", "beta"]
    beta_cks = len(curve_store.store.list(run="beta"))
    assert svg.count('class="ckpt-marker" data-run="beta"') == beta_cks == 3
    assert svg.count('class="ckpt-marker" data-run="alpha"') == 5
    assert svg.count('class="alert-marker"') == 2
    # Remove one run, add another: plain links (the page runs no script).
    assert 'class="remove-link" href="/compare?run=beta"' in body
    assert 'class="remove-link" href="/compare?run=alpha"' in body
    assert 'class="add-link" href="/compare?run=alpha&amp;run=beta&amp;run=gamma"' in body
    # The same run twice is drawn once.
    status, body = fetch(curve_server.url + "compare?run=gamma&run=gamma")
    assert status == 200 and curve_svgs(body)[0].count('class="curve-series"') == 1


def test_compare_without_runs_lists_the_choices(curve_server: BackgroundUI) -> None:
    status, body = fetch(curve_server.url + "compare")
    assert status == 200 and not curve_svgs(body)
    for run in ("alpha", "beta", "gamma"):
        assert f'class="add-link" href="/compare?run={run}"' in body
    assert "run=delta" not in body
    assert 'href="/compare">Curves</a>' in body  # reachable from every page's header


def test_compare_errors(curve_server: BackgroundUI) -> None:
    status, body = fetch(curve_server.url + "compare?run=nope")
    assert status == 404 and "nope" in body
    status, _ = fetch(curve_server.url + "compare?run=bad%20name")
    assert status == 400
    status, _ = fetch(curve_server.url + "compare?run=alpha&metric=bad%20metric")
    assert status == 400
    # A metric no run recorded: an empty plot, not an error.
    status, body = fetch(curve_server.url + "compare?run=alpha&metric=accuracy")
    assert status == 200 and "no values recorded" in body


def test_static_report_carries_the_curves(curve_store: Any, tmp_path: Path) -> None:
    html = write_report(curve_store.store, tmp_path / "report.html").read_text()
    assert len(curve_svgs(html)) == 3  # alpha, beta, gamma
    assert "/compare" not in html  # the comparison needs the live app
