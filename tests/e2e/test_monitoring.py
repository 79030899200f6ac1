"""Monitoring that ships (deploy/): the alert rules pass their promtool unit tests, and a real
Prometheus scraping a live kvgate server with an operator token gets data for every query
behind the Grafana dashboard. Needs Debian's ``prometheus`` package (promtool and prometheus);
fails under CI=true without it."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import httpx
import pytest

from tests.support.paths import REPO
from tests.support.server_fixture import running_server
from tests.support.services import free_port, missing

DEPLOY = REPO / "deploy"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"{name} is not installed (apt-get install prometheus)")
    return str(path)


def test_alert_rules_are_valid_and_their_unit_tests_pass():
    promtool = _tool("promtool")
    rules = DEPLOY / "prometheus"
    check = subprocess.run([promtool, "check", "rules", "kvgate-alerts.yml"], cwd=rules, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", "kvgate-alerts.test.yml"], cwd=rules, capture_output=True, text=True)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_rule_unit_tests_can_fail(tmp_path):
    """The promtool tests are not vacuous: a rule with a wrong threshold fails them."""
    promtool = _tool("promtool")
    rules = (DEPLOY / "prometheus" / "kvgate-alerts.yml").read_text()
    (tmp_path / "kvgate-alerts.yml").write_text(rules.replace("increase(kvgate_integrity_failures_total[5m]) > 0", "increase(kvgate_integrity_failures_total[5m]) > 5"))
    shutil.copy(DEPLOY / "prometheus" / "kvgate-alerts.test.yml", tmp_path)
    test = subprocess.run([promtool, "test", "rules", "kvgate-alerts.test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert test.returncode != 0 and "KvgateIntegrityFailures" in test.stdout + test.stderr


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "kvgate-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


@pytest.mark.slow
def test_real_prometheus_scrapes_kvgate_and_every_dashboard_query_has_data(tmp_path):
    prometheus = _tool("prometheus")
    with running_server(tmp_path / "kvgate") as live:
        token_file = tmp_path / "token"
        token_file.write_text(live.operator_token())
        token_file.chmod(0o600)
        # traffic, so the counters behind the panels exist: a denial, lookups, a chunk
        with httpx.Client(base_url=live.base_url, timeout=10) as http:
            assert http.get("/metrics", headers=live.headers("not-a-token")).status_code == 401
        port = free_port()
        host = live.base_url.split("://", 1)[1]
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "rule_files: [" + json.dumps(str(DEPLOY / "prometheus" / "kvgate-alerts.yml")) + "]\n"
            "scrape_configs:\n"
            "  - job_name: kvgate\n"
            "    metrics_path: /metrics\n"
            f"    authorization: {{credentials_file: {json.dumps(str(token_file))}}}\n"
            f"    static_configs: [{{targets: [{json.dumps(host)}]}}]\n"
        )
        log = (tmp_path / "prometheus.log").open("w")
        proc = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            api = f"http://127.0.0.1:{port}/api/v1"
            deadline = time.monotonic() + 60
            empty: list[str] = []
            while time.monotonic() < deadline:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
                try:
                    targets = httpx.get(f"{api}/targets", timeout=2).json()["data"]["activeTargets"]
                except (httpx.HTTPError, KeyError, ValueError):
                    time.sleep(0.5)
                    continue
                if targets and targets[0]["health"] == "up":
                    empty = []
                    for title, expr in _dashboard_queries():
                        r = httpx.get(f"{api}/query", params={"query": expr}, timeout=5).json()
                        assert r["status"] == "success", (title, r)
                        if not r["data"]["result"]:
                            empty.append(title)
                    if not empty:
                        break
                time.sleep(1)
            assert targets and targets[0]["health"] == "up", targets
            assert not empty, f"dashboard panels without data: {empty}"
            rules = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
            assert {r["name"] for g in rules for r in g["rules"]} >= {"KvgateIntegrityFailures", "KvgateDown"}
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
