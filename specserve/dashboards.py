"""Grafana dashboards as data: every PromQL query of a dashboard, the metric names a query reads, and
a check of all of them against a running Prometheus.

    python -m specserve.dashboards dashboards/*.json                   # queries and metric names
    python -m specserve.dashboards --prometheus http://127.0.0.1:9090 dashboards/*.json

The second form runs every query (template variables set to match everything, `$__rate_interval`
to 5m) and lists the ones that fail or return no data: what a panel showing "No data" would need.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Grafana's built-in interval variables, as the checks set them.
INTERVALS = {"__rate_interval": "5m", "__interval": "5m", "__range": "5m"}

# PromQL words that look like identifiers but are no metric names. Functions and aggregations are
# found by the parenthesis that follows them (after by/without lists are removed), so are not here.
_KEYWORDS = {"and", "or", "unless", "atan2", "bool", "offset", "group_left", "group_right", "inf", "nan"}
_VARIABLE = re.compile(r"\$\{(\w+)(?:[.:][^}]*)?\}|\$(\w+)|\[\[(\w+)(?::\w+)?\]\]")
_STRING = re.compile(r""""(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`""")
_TOKEN = re.compile(
    r"(?P<number>0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?)"
    r"|(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"|(?P<other>\S)"
)
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_VARIABLE_QUERY = re.compile(r"^\s*(label_values|query_result)\s*\((.*)\)\s*$", re.S)


@dataclass(frozen=True)
class Query:
    """One query of a dashboard: `where` names it (panel title and refId, or the variable)."""

    where: str
    expr: str
    variable: bool = False  # a template variable's query (label_values / query_result), not PromQL


def load(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included (a collapsed row holds its panels)."""
    stack = list(reversed(dashboard.get("panels", [])))
    while stack:
        panel = stack.pop()
        yield panel
        stack.extend(reversed(panel.get("panels", [])))


def queries(dashboard: dict[str, Any]) -> list[Query]:
    """Every query: template variables' first, then each panel target's `expr`."""
    found = []
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            query = query.get("query") if isinstance(query, dict) else query
            found.append(Query(f"variable {var['name']}", query, variable=True))
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                where = f"panel {panel.get('title')!r} target {target.get('refId')}"
                found.append(Query(where, target["expr"]))
    return found


def match_all_values(dashboard: dict[str, Any]) -> dict[str, str]:
    """Values that make every query match everything: each query variable's all-value, 5m intervals."""
    values = dict(INTERVALS)
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") in ("query", "custom"):
            values[var["name"]] = var.get("allValue") or ".*"
    return values


def substitute(text: str, values: Mapping[str, str]) -> str:
    """Grafana's variable syntaxes (`$x`, `${x}`, `${x:fmt}`, `[[x]]`) replaced by `values[x]`; an
    unknown variable stays as it is, as Grafana leaves it."""

    def replace(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        return values.get(name, m.group(0))

    return _VARIABLE.sub(replace, text)


def variable_query(query: str) -> tuple[str, str | None, str | None]:
    """A variable query's parts: ("label_values", selector or None, label) or ("query_result", expr,
    None). Raises ValueError for what Prometheus variables do not support here."""
    m = _VARIABLE_QUERY.match(query)
    if not m:
        raise ValueError(f"not a label_values(...) or query_result(...) query: {query!r}")
    kind, inner = m.groups()
    if kind == "query_result":
        return kind, inner, None
    selector, _, label = inner.rpartition(",")
    return kind, selector.strip() or None, label.strip()


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a variable query) reads. Grafana variables are
    removed first; then strings, label matchers `{...}`, ranges `[...]` and the label lists of
    by/without/on/ignoring/group_*; what is left that is an identifier, not followed by `(` and no
    keyword, is a metric name. Names chosen by `__name__` matchers are not seen."""
    if _VARIABLE_QUERY.match(expr):
        kind, inner, _ = variable_query(expr)
        return metric_names(inner) if inner else set()
    text = _VARIABLE.sub("0", expr)
    text = _without_strings(text)
    text = _strip_brackets(_strip_brackets(text, "{", "}"), "[", "]")
    text = _LABEL_LIST.sub(" ", text)
    names: set[str] = set()
    tokens = [(m.lastgroup, m.group(0), m.end()) for m in _TOKEN.finditer(text)]
    for kind, value, end in tokens:
        if kind != "ident" or value.lower() in _KEYWORDS:
            continue
        if text[end:].lstrip().startswith("("):
            continue  # a function
        names.add(value)
    return names


def _without_strings(text: str) -> str:
    return _STRING.sub('""', text)


def _strip_brackets(text: str, opening: str, closing: str) -> str:
    out, depth = [], 0
    for ch in text:
        if ch == opening:
            depth += 1
        elif ch == closing and depth:
            depth -= 1
            out.append(" ")
        elif not depth:
            out.append(ch)
    return "".join(out)


# ---- against a running Prometheus ---------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    query: Query
    sent: str  # the query after substitution
    error: str | None  # Prometheus's error, None on "status": "success"
    values: list[float]  # instant-query sample values, or one 1.0 per label value for variables

    @property
    def has_data(self) -> bool:
        return self.error is None and bool(self.values)

    @property
    def has_finite_data(self) -> bool:
        return self.error is None and any(math.isfinite(v) for v in self.values)


def run(
    prometheus_url: str,
    dashboard: dict[str, Any],
    values: Mapping[str, str] | None = None,
    at: float | None = None,
) -> list[Result]:
    """Every query of `dashboard` through Prometheus's HTTP API (`/api/v1/query` for PromQL,
    `/api/v1/label/<name>/values` for label_values), evaluated at `at` (default: now)."""
    import httpx

    values = match_all_values(dashboard) if values is None else values
    results = []
    with httpx.Client(base_url=prometheus_url.rstrip("/"), timeout=30) as http:
        for query in queries(dashboard):
            sent = substitute(query.expr, values)
            results.append(_run_one(http, query, sent, at))
    return results


def _run_one(http, query: Query, sent: str, at: float | None) -> Result:
    time_param = {} if at is None else {"time": at}
    if query.variable:
        kind, inner, label = variable_query(sent)
        if kind == "label_values":
            params = {"match[]": inner} if inner else {}
            reply = http.get(f"/api/v1/label/{label}/values", params=params).json()
            data = reply.get("data") or []
            return Result(query, sent, reply.get("error"), [1.0] * len(data))
        sent = inner
    reply = http.post("/api/v1/query", data={"query": sent, **time_param}).json()
    if reply.get("status") != "success":
        return Result(query, sent, reply.get("error", str(reply)), [])
    data = reply["data"]
    samples = data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]
    return Result(query, sent, None, [float(s["value"][1]) for s in samples if "value" in s])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specserve.dashboards", description=__doc__.split("\n")[0]
    )
    parser.add_argument("files", nargs="+", type=Path, help="Grafana dashboard JSON files")
    parser.add_argument("--prometheus", help="run every query against this Prometheus (base URL)")
    args = parser.parse_args(argv)
    bad = 0
    for path in args.files:
        dashboard = load(path)
        print(f"{path}: {dashboard.get('title')}")
        if not args.prometheus:
            for q in queries(dashboard):
                print(f"  {q.where}: {', '.join(sorted(metric_names(q.expr))) or '-'}")
            continue
        for r in run(args.prometheus, dashboard):
            state = f"error: {r.error}" if r.error else "ok" if r.has_finite_data else "no data"
            bad += state != "ok"
            print(f"  {state:8} {r.query.where}" + ("" if state == "ok" else f"\n           {r.sent}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
