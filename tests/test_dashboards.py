"""The Grafana dashboards (`dashboards/*.json`) and `deploy/monitoring/`: structure, metric names of the
metric contract, every query parsed by a real Prometheus, and every query with data once that
Prometheus has scraped a live server under load."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

import specserve.metrics
from specserve import dashboards as dash
from specserve.api.app import make_app

from api_utils import MODEL_NAME, async_engine
from prometheus_utils import Prometheus, find_or_install_prometheus, uvicorn_thread

REPO = Path(__file__).resolve().parents[1]
DASHBOARD_FILES = sorted((REPO / "dashboards").glob("*.json"))
MONITORING = REPO / "deploy" / "monitoring"
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")

# The metric contract: every metric `specserve.metrics` defines, as exposed, with its type.
CONTRACT = {m.name: m.kind for m in specserve.metrics.ALL_METRICS}

# Panels whose queries cannot filter by replica: the series have no `replica` label.
MODEL_FILTER_ONLY = {"Autoscaling: target vs running replicas"}
# Queries with no data in a single-replica in-process run, and why.
NO_DATA_IN_PROCESS = {
    "panel 'Autoscaling: target vs running replicas' target A": (
        "specserve_autoscaling_target_replicas: set by Ray Serve's autoscaling policy only"
    ),
}


@pytest.fixture(scope="module", params=DASHBOARD_FILES, ids=lambda p: p.stem)
def dashboard(request) -> dict:
    return json.loads(request.param.read_text())


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory):
    binary = find_or_install_prometheus()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not on PATH and apt-get could not install it (CI must run this)")
        pytest.skip("prometheus is not on PATH and cannot be installed here (needs root and apt-get)")
    server = Prometheus(binary, tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()


def _unknown_metrics(names: Collection[str], contract: Mapping[str, str]) -> set[str]:
    """Names that are not a contract metric (histograms only through their _bucket/_sum/_count
    series). A contract type "" (unknown) admits both forms."""

    def known(name: str) -> bool:
        if contract.get(name, "histogram") != "histogram":
            return True
        base, suffix = next(((name[: -len(s)], s) for s in HISTOGRAM_SERIES if name.endswith(s)), (name, ""))
        return bool(suffix) and contract.get(base) in ("histogram", "")

    return {name for name in names if not known(name)}


def _referenced(dashboard: dict) -> set[str]:
    return {name for q in dash.queries(dashboard) for name in dash.metric_names(q.expr)}


def test_metric_names_of_an_expression():
    expr = (
        'sum by (position) (rate(a_total{model=~"$model", x="y}"}[$__rate_interval])) / ignoring (position) '
        "group_left sum(rate(b_count[5m] offset 1m)) or vector(0) * 1e3 + histogram_quantile(0.9, c_bucket)"
    )
    assert dash.metric_names(expr) == {"a_total", "b_count", "c_bucket"}
    assert dash.metric_names('label_values(d{model=~"$model"}, replica)') == {"d"}
    assert dash.metric_names('label_values({__name__=~"specserve_.+"}, model)') == set()
    values = {"model": ".*", "__rate_interval": "5m"}
    assert dash.substitute('x{m=~"$model",n="${model:regex}"}[$__rate_interval] ${1}', values) == (
        'x{m=~".*",n=".*"}[5m] ${1}'
    )


def test_cli_lists_queries_and_their_metrics(capsys):
    assert dash.main([str(p) for p in DASHBOARD_FILES]) == 0
    out = capsys.readouterr().out
    assert "panel 'Acceptance rate' target A: specserve_spec_accepted_tokens_total, " in out


def test_structure(dashboard):
    assert dashboard["uid"].startswith("specserve-") and dashboard["title"]
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for name in ("model", "replica"):
        assert variables[name]["type"] == "query" and variables[name]["query"].startswith("label_values(")
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    panels = list(dash.panels(dashboard))
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    shown = [p for p in panels if p["type"] != "row"]
    assert shown
    for panel in shown:
        title = panel.get("title")
        assert title and panel.get("description"), f"panel {panel['id']} needs a title and a description"
        assert panel["datasource"]["uid"] == "${datasource}", title
        assert panel["targets"], title
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"]["uid"] == "${datasource}", title
            assert '$model"' in expr, f"{title}: {expr}"
            assert title in MODEL_FILTER_ONLY or '$replica"' in expr, f"{title}: {expr}"


def test_unique_uids():
    uids = [json.loads(p.read_text())["uid"] for p in DASHBOARD_FILES]
    assert len(DASHBOARD_FILES) == 3 and len(set(uids)) == len(uids)


def test_metric_names_are_the_contract():
    referenced = {p.name: _referenced(json.loads(p.read_text())) for p in DASHBOARD_FILES}
    for name, names in referenced.items():
        assert not _unknown_metrics(names, CONTRACT), name
    # ...and every contract metric is on some dashboard.
    bases = {n.removesuffix(s) for names in referenced.values() for n in names for s in HISTOGRAM_SERIES}
    seen = set().union(*referenced.values()) | bases
    assert set(CONTRACT) <= seen, set(CONTRACT) - seen


def test_the_contract_is_what_the_issue_names():
    assert set(CONTRACT) == set(specserve.metrics.METRIC_NAMES)
    assert {"specserve_spec_accept_length", "specserve_spec_accepted_tokens_per_position_total"} <= set(
        CONTRACT
    )


def test_monitoring_config(prometheus):
    promtool = shutil.which("promtool")
    if promtool:  # Debian's package ships it beside prometheus
        check = subprocess.run(
            [promtool, "check", "config", str(MONITORING / "prometheus.yml")], capture_output=True
        )
        assert check.returncode == 0, check.stdout + check.stderr
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "5s"
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    provisioning = MONITORING / "grafana" / "provisioning"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    assert datasource["datasources"][0]["type"] == "prometheus"
    provider = yaml.safe_load((provisioning / "dashboards" / "specserve.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"] == "${SPECSERVE_DASHBOARDS}"


def test_every_query_parses(prometheus, dashboard):
    """Through Prometheus's query API, template variables set to match everything."""
    errors = [
        f"{r.query.where}: {r.error}\n  {r.sent}" for r in dash.run(prometheus.url, dashboard) if r.error
    ]
    assert not errors, "\n".join(errors)


# ---- end to end: a live server, scraped ----------------------------------------------------------

JOB = "specserve"
PROMPT = "Speculative decoding drafts tokens and the target checks them, one verify step at a time. " * 2


def _request(http: httpx.Client, job: tuple[str, str, dict, int]) -> int:
    """Send one request: `post` (read the body), `stream` (read every SSE line), `abort` (hang up
    after the first line). The status code."""
    how, route, body, _ = job
    if how == "post":
        return http.post(route, json=body).status_code
    with http.stream("POST", route, json={**body, "stream": True}) as response:
        lines = (line for line in response.iter_lines() if line)
        if how == "stream":
            assert list(lines)[-1] == "data: [DONE]"
        else:
            next(lines)
        return response.status_code


def _load(url: str) -> None:
    """One burst of mixed requests, four at a time: plain and streamed completions and chats,
    greedy and sampled, a native /generate, a bad input (400), and a client that hangs up."""
    completion = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
    jobs = [
        *[("post", "/v1/completions", completion, 200)] * 2,
        ("post", "/v1/completions", {**completion, "temperature": 1.0, "seed": 1}, 200),
        *[("stream", "/v1/completions", completion, 200)] * 2,
        ("post", "/v1/chat/completions", chat, 200),
        ("stream", "/v1/chat/completions", chat, 200),
        ("post", "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 16}}, 200),
        ("post", "/v1/completions", {**completion, "temperature": -1}, 400),
        ("abort", "/v1/completions", {**completion, "max_tokens": 200, "ignore_eos": True}, 200),
    ]
    with httpx.Client(base_url=url, timeout=120) as http, ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda job: _request(http, job), jobs))
    assert statuses == [job[3] for job in jobs]


def test_every_query_has_data_from_a_scraped_server(prometheus, tiny_llama):
    """A live server (the in-process app under uvicorn, n-gram speculation) scraped every second
    through two bursts of load: then every dashboard query returns a finite value, but those of
    NO_DATA_IN_PROCESS."""
    dashboards = {p.name: json.loads(p.read_text()) for p in DASHBOARD_FILES}
    known = {q.where for d in dashboards.values() for q in dash.queries(d)}
    assert set(NO_DATA_IN_PROCESS) <= known
    speculative = {"method": "ngram", "num_steps": 4}
    with async_engine(tiny_llama, speculative=speculative) as engine, uvicorn_thread(make_app(engine)) as url:
        prometheus.scrape(JOB, url.removeprefix("http://"))
        prometheus.wait_for_scrape_after(JOB, time.time())
        for _ in range(2):  # every series is scraped before and after the second burst: rates move
            _load(url)
            assert engine.wait_idle(60)
            prometheus.wait_for_scrape_after(JOB, time.time())
        last = prometheus.wait_for_scrape_after(JOB, time.time())
        prometheus.wait_for_scrape_after(JOB, last)  # series born in the last burst: a second sample
        results = {name: dash.run(prometheus.url, d) for name, d in dashboards.items()}
    missing = [
        f"{name}: {r.query.where}: {r.error or r.values}\n  {r.sent}"
        for name, rs in results.items()
        for r in rs
        if not r.has_finite_data and r.query.where not in NO_DATA_IN_PROCESS
    ]
    assert not missing, "queries without data:\n" + "\n".join(missing)
