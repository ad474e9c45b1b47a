"""deploy/kubernetes: every manifest validates against Kubernetes' own schemas, and the mistakes an operator
makes with the DaemonSet stop the daemon at start with one line that names the setting and the fix.

The schemas are kubernetes-validate's (PyPI; the OpenAPI schemas of each Kubernetes release, strict mode:
unknown fields are errors too). Custom resources (monitoring.yaml's PodMonitor and PrometheusRule) have no
schema there: tests/test_deploy_monitoring.py checks them against the DaemonSet and the daemon's metrics.

Bad input is rendered as the pod would receive it (tests/k8s_pod.py) and run through the real entry point:
a ConfigMap value of the wrong type, a Secret without a file the ConfigMap names, an advertised address that
is no address (a `$(HOST_IP)` the pod does not define stays as written, as the kubelet leaves it).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.k8s_pod import Node, daemon_pod

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
KUBERNETES = "1.30"  # the oldest release the manifests promise (deploy/README.md); also checked: the newest


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_every_manifest_validates_against_the_kubernetes_schemas() -> None:
    checked = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in _docs(path):
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a custom resource: no schema in Kubernetes' own (test_deploy_monitoring.py)
            for version in (KUBERNETES, kubernetes_validate.latest_version()):
                kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError
            checked.append((path.name, doc["kind"]))
    assert ("daemonset.yaml", "DaemonSet") in checked and ("daemonset.yaml", "ConfigMap") in checked
    assert ("secrets.example.yaml", "Secret") in checked and ("vllm-tenants.yaml", "Deployment") in checked


def test_the_validator_refuses_what_the_manifests_must_not_hold() -> None:
    """The check can fail: a port as a string and an unknown field are refused."""
    ds = next(d for d in _docs(DEPLOY / "daemonset.yaml") if d["kind"] == "DaemonSet")
    c = ds["spec"]["template"]["spec"]["containers"][0]
    c["ports"] = [{"name": "metrics", "containerPort": "9464"}]  # (the DaemonSet itself declares no ports)
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        kubernetes_validate.validate(ds, KUBERNETES, strict=True)
    c["ports"][0]["containerPort"] = 9464
    c["volumeMount"] = []  # a typo of volumeMounts
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        kubernetes_validate.validate(ds, KUBERNETES, strict=True)


def _daemonset() -> tuple[str, dict]:
    docs = {d["kind"]: d for d in _docs(DEPLOY / "daemonset.yaml")}
    return docs["ConfigMap"]["data"]["kvstore.toml"], docs["DaemonSet"]


def _run_pod(tmp: Path, ds: dict, toml_text: str, secret: dict[str, str] | None) -> subprocess.CompletedProcess:
    argv, env, _ = daemon_pod(ds, tmp, Node("gpu-node-01", "127.0.0.1"), toml_text, secret)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_configmap_value_of_the_wrong_type_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    toml_text, ds = _daemonset()
    bad = re.sub(r"^grpc_workers = 16", 'grpc_workers = "sixteen"', toml_text, count=1, flags=re.M)
    line = _one_line(_run_pod(tmp_path / "a", ds, bad, None))
    assert re.fullmatch(r"kvstore-server: grpc_workers \(from /\S+/etc/kvstore/kvstore.toml\): expected a whole "
                        r"number, got 'sixteen'; write e\.g\. grpc_workers = 16", line), line
    listed = re.sub(r'^etcd_endpoints = ""', 'etcd_endpoints = ["https://10.0.0.5:2379", "https://10.0.0.6:2379"]',
                    toml_text, count=1, flags=re.M)
    line = _one_line(_run_pod(tmp_path / "b", ds, listed, None))
    assert line.endswith("etcd_endpoints (from " + str(tmp_path / "b/etc/kvstore/kvstore.toml") + "): expected a "
                         'string, got list; write e.g. etcd_endpoints = "text" (several values: one comma-separated '
                         "string)"), line


def test_a_secret_without_a_file_the_configmap_names_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    toml_text, ds = _daemonset()
    on = re.sub(r'^etcd_endpoints = ""', 'etcd_endpoints = "https://127.0.0.1:2379"', toml_text, flags=re.M)
    (example,) = _docs(DEPLOY / "secrets.example.yaml")
    secret = dict.fromkeys(example["stringData"], "x\n")
    del secret["etcd-ca.pem"]
    line = _one_line(_run_pod(tmp_path, ds, on, secret))
    path = tmp_path / "etc/kvstore-secrets/etcd-ca.pem"
    assert line == (f"kvstore-server: etcd_ca {path}: cannot read it (No such file or directory): correct the path, "
                    f"or create the file (in Kubernetes: the Secret mounted at {path.parent} must hold the key "
                    "'etcd-ca.pem'), or unset etcd_ca"), line
    # no Secret at all and no etcd_endpoints: the shipped default runs alone (checked in test_deploy.py)


def test_an_advertised_address_that_is_no_address_stops_the_daemon_with_one_line(tmp_path: Path) -> None:
    toml_text, ds = _daemonset()
    env = ds["spec"]["template"]["spec"]["containers"][0]["env"]
    env[:] = [v for v in env if v["name"] != "HOST_IP"]  # a pod spec that lost the downward-API variable
    line = _one_line(_run_pod(tmp_path / "a", ds, toml_text, None))
    assert line == ("kvstore-server: invalid config: metrics_listen='$(HOST_IP):9464': '$(HOST_IP)' is not an IP "
                    "address or host name (an unset variable of the pod's env?); use host:port, e.g. "
                    "127.0.0.1:9464"), line
    env.append({"name": "KVSTORE_PEER_ADVERTISE", "value": "gpu node 01:7071"})
    env[:] = [v for v in env if v["name"] != "KVSTORE_METRICS_LISTEN"]
    line = _one_line(_run_pod(tmp_path / "b", ds, toml_text, None))
    assert line == ("kvstore-server: invalid config: peer_listen='$(HOST_IP):7071': '$(HOST_IP)' is not an IP "
                    "address or host name (an unset variable of the pod's env?); use host:port with this node's "
                    "address, e.g. 10.0.0.7:7071 (Kubernetes: $(HOST_IP):7071 from the downward API)"), line
    env[:] = [v for v in env if v["name"] != "KVSTORE_PEER_LISTEN"]
    line = _one_line(_run_pod(tmp_path / "c", ds, toml_text, None))
    assert line.startswith("kvstore-server: invalid config: peer_advertise='gpu node 01:7071': 'gpu node 01' is not "
                           "an IP address or host name;"), line
