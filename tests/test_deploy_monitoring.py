"""deploy/kubernetes/monitoring.yaml: the PodMonitors scrape what the pods expose, and the alert rules name only
metrics that exist, parse as Prometheus reads them, and fire exactly when they should.

The rules are checked with promtool (Debian's prometheus package, unpacked by `make setup`): `check rules`,
then `test rules` with synthetic series per alert, a broken instance beside a healthy one, so each alert must
fire for the one and stay silent for the other. Metric names come from a real daemon's /metrics (test_deploy's
`exposed` fixture) and, for vllm:kvstore_*, from the connector's own counter list.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.deploy_helpers import connector_metric_names
from tests.required import missing
from tests.test_deploy import Exposed, exposed  # noqa: F401 - the fixture, shared with the dashboard's test

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all((K8S / "monitoring.yaml").read_text())}


def _rules() -> list[dict[str, Any]]:
    return [r for g in _docs()[("PrometheusRule", "kvstore")]["spec"]["groups"] for r in g["rules"]]


def test_pod_monitors_select_the_pods_and_their_ports() -> None:
    docs = _docs()
    daemonset = {d["kind"]: d for d in yaml.safe_load_all((K8S / "daemonset.yaml").read_text())}["DaemonSet"]
    vllm = next(d for d in yaml.safe_load_all((K8S / "vllm-tenants.yaml").read_text()) if d["kind"] == "Deployment")
    for name, workload in (("kvstore-server", daemonset), ("vllm", vllm)):
        pm = docs[("PodMonitor", name)]
        assert pm["metadata"]["namespace"] == workload["metadata"]["namespace"]
        pod = workload["spec"]["template"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        if name == "vllm":  # by the container port's name
            assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == [next(iter(ports & {"http"}))]
        else:  # no ports declared (host network, surge updates): by the number the daemon's metrics listen on
            env = {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}
            assert ports == set() and env["KVSTORE_METRICS_LISTEN"].endswith(":9464")
            assert [e["portNumber"] for e in pm["spec"]["podMetricsEndpoints"]] == [9464]
        assert all(e["path"] == "/metrics" for e in pm["spec"]["podMetricsEndpoints"])


def test_alert_rules_cover_the_failures_and_name_only_real_metrics(exposed: Exposed) -> None:  # noqa: F811
    rules = _rules()
    assert {r["alert"] for r in rules} == {"KVStoreDown", "KVStoreConnectorCannotReachDaemon", "KVStoreHitRateCollapse",
                                           "KVStoreDiskErrors", "KVStoreQuotaRefusals", "KVStorePeerUnreachable",
                                           "KVStoreClusterSplit"}
    for r in rules:
        expr = r["expr"]
        for name in re.findall(r"(?<![:\w])kvstore_[a-z0-9_]+", expr):
            assert name in exposed, f"{r['alert']}: {name} is not exported by the daemon"
        for name in re.findall(r"vllm:kvstore_[a-z0-9_]+", expr):
            assert name in connector_metric_names(), f"{r['alert']}: {name} is not a connector metric"
        assert r["labels"]["severity"] in ("critical", "warning") and r["annotations"]["summary"]


def _promtool() -> str:
    tool = shutil.which("promtool") or str(ROOT / "build" / "tools" / "promtool")
    if not Path(tool).exists():
        missing("promtool", "make setup unpacks it from Debian's prometheus package into build/tools")
    return tool


def _annotations(rule: dict[str, Any], labels: dict[str, str], value: str = "") -> dict[str, str]:
    """The rule's annotations as Prometheus renders them for an alert with these labels and value."""
    out = {}
    for k, v in rule["annotations"].items():
        v = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], v)
        out[k] = v.replace("{{ $value }}", value)
    return out


def _alert(name: str, eval_time: str, labels: dict[str, str], value: str = "") -> dict[str, Any]:
    rule = next(r for r in _rules() if r["alert"] == name)
    exp = {"exp_labels": {**labels, "severity": rule["labels"]["severity"]},
           "exp_annotations": _annotations(rule, labels, value)}
    return {"eval_time": eval_time, "alertname": name, "exp_alerts": [exp]}


def _cases() -> list[dict[str, Any]]:
    job = 'job="kvstore/kvstore-server"'
    return [
        {"interval": "1m", "input_series": [
            {"series": f'up{{{job},instance="n1:9464"}}', "values": "1 1 1 0x10"},
            {"series": f'up{{{job},instance="n2:9464"}}', "values": "1x13"}],
         "alert_rule_test": [_alert("KVStoreDown", "8m", {"job": "kvstore/kvstore-server", "instance": "n1:9464"}),
                             {"eval_time": "4m", "alertname": "KVStoreDown", "exp_alerts": []}]},  # pending
        {"interval": "1m", "input_series": [
            {"series": 'vllm:kvstore_connect_failures_total{namespace="llm",pod="vllm-alice-0",engine="0"}',
             "values": "0+2x20"},
            {"series": 'vllm:kvstore_connect_failures_total{namespace="llm",pod="vllm-bob-0",engine="0"}',
             "values": "3x20"}],
         "alert_rule_test": [_alert("KVStoreConnectorCannotReachDaemon", "15m",
                                    {"namespace": "llm", "pod": "vllm-alice-0"})]},
        # a day at 90 % hits, then 10 % on n1; n2 keeps 90 %
        {"interval": "5m", "input_series": [
            {"series": 'kvstore_lookup_keys_total{instance="n1"}', "values": "0+600x330"},
            {"series": 'kvstore_hit_keys_total{instance="n1",tier="ram"}', "values": "0+540x300 162000+60x30"},
            {"series": 'kvstore_lookup_keys_total{instance="n2"}', "values": "0+600x330"},
            {"series": 'kvstore_hit_keys_total{instance="n2",tier="ram"}', "values": "0+540x330"}],
         "alert_rule_test": [_alert("KVStoreHitRateCollapse", "1650m", {"instance": "n1"}),
                             {"eval_time": "1490m", "alertname": "KVStoreHitRateCollapse", "exp_alerts": []}]},
        {"interval": "1m", "input_series": [
            {"series": 'kvstore_disk_io_errors_total{instance="n1"}', "values": "0 0 0 1 1"},
            {"series": 'kvstore_disk_io_errors_total{instance="n2"}', "values": "0x4"},
            {"series": 'kvstore_disk_degraded{instance="n1"}', "values": "0x4"},
            {"series": 'kvstore_disk_degraded{instance="n2"}', "values": "0x4"},
            {"series": 'kvstore_checksum_failures_total{instance="n1"}', "values": "0x4"},
            {"series": 'kvstore_checksum_failures_total{instance="n2"}', "values": "0x4"}],
         "alert_rule_test": [_alert("KVStoreDiskErrors", "4m", {"instance": "n1"}),
                             {"eval_time": "2m", "alertname": "KVStoreDiskErrors", "exp_alerts": []}]},
        {"interval": "1m", "input_series": [
            {"series": 'kvstore_store_full_total{instance="n1"}', "values": "0+1x15"},
            {"series": 'kvstore_store_full_total{instance="n2"}', "values": "7x15"}],
         "alert_rule_test": [_alert("KVStoreQuotaRefusals", "10m", {"instance": "n1"})]},
        {"interval": "1m", "input_series": [
            {"series": 'kvstore_peer_etcd_connected{instance="n1"}', "values": "1 1 0x10"},
            {"series": 'kvstore_peer_etcd_connected{instance="n2"}', "values": "1x12"},
            {"series": 'kvstore_peer_errors_total{instance="n1"}', "values": "0x12"},
            {"series": 'kvstore_peer_errors_total{instance="n2"}', "values": "0+1x12"},  # 10 in 10 min: not yet
            {"series": 'kvstore_peer_timeouts_total{instance="n1"}', "values": "0x12"},
            {"series": 'kvstore_peer_timeouts_total{instance="n2"}', "values": "0x12"}],
         "alert_rule_test": [_alert("KVStorePeerUnreachable", "10m", {"instance": "n1"})]},
        {"interval": "1m", "input_series": [
            *({"series": f'up{{{job},instance="{n}"}}', "values": "1x15"} for n in ("n1", "n2", "n3")),
            {"series": 'kvstore_peer_members{instance="n1"}', "values": "2x15"},
            {"series": 'kvstore_peer_members{instance="n2"}', "values": "3x15"},
            {"series": 'kvstore_peer_members{instance="n3"}', "values": "3x15"}],
         "alert_rule_test": [_alert("KVStoreClusterSplit", "12m", {"instance": "n1"}, "2")]},
    ]


def test_promtool_accepts_the_rules_and_each_alert_fires_only_where_it_should(tmp_path: Path) -> None:
    tool = _promtool()
    rules = tmp_path / "kvstore-rules.yml"
    rules.write_text(yaml.safe_dump(_docs()[("PrometheusRule", "kvstore")]["spec"]))
    r = subprocess.run([tool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 7 rules found" in r.stdout, r.stdout + r.stderr
    tests = tmp_path / "kvstore-rules-test.yml"
    tests.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": _cases()}))
    r = subprocess.run([tool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # the same cases fail against a rule that cannot fire: the test can fail
    broken = yaml.safe_load(rules.read_text())
    for rule in broken["groups"][0]["rules"]:
        rule["expr"] = "vector(0) > 1"
    rules.write_text(yaml.safe_dump(broken))
    r = subprocess.run([tool, "test", "rules", str(tests)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode != 0 and r.stdout.count("FAILED") + r.stderr.count("FAILED") >= 1, r.stdout + r.stderr
