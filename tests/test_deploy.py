"""deploy/ against the code it deploys: files that drift from the daemon fail here, not on a production node.

The dashboard's PromQL may only name metrics (and label values) that a real daemon exports: one is started
with a disk tier and some traffic, scraped over HTTP and parsed with prometheus_client. The example config
and the DaemonSet's ConfigMap must load with the daemon's own `load_config`; the systemd unit and the
DaemonSet must agree with the config they ship (socket directory, disk directory, metrics port, mlock).
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvstore.server.config import ServerConfig, load_config
from kvstore.server.main import SHUTDOWN_GRACE_S
from tests.k8s_pod import Node, render_env
from tests.deploy_helpers import connector_metric_names
from tests.required import missing
from kvstore.testing import DaemonProcess, EtcdProcess, etcd_binary, peer_options, wait_until

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvstore.json"
EXAMPLE_TOML = DEPLOY / "kvstore.toml"
UNIT = DEPLOY / "systemd" / "kvstore-server.service"
DAEMONSET = DEPLOY / "kubernetes" / "daemonset.yaml"
MIB = 1 << 20
_SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus, not by the daemon
# the connector's: vLLM's per-engine labels, its families' labels, and what a PodMonitor's scrape adds
_CONNECTOR_LABELS = {"model_name", "engine", "tier", "cause", "outcome", "instance", "job", "namespace", "pod"}

Exposed = dict[str, dict[str, set[str]]]  # sample name -> label name -> values seen


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exposed]:
    """Every sample name and label value a daemon with a disk tier exports after puts, hits on both tiers and misses."""
    disk = tmp_path_factory.mktemp("deploy") / "disk"
    stack = contextlib.ExitStack()
    if etcd_binary() is None:  # the daemon would run alone and the peer families go unchecked
        missing("etcd", "make setup installs Debian's etcd-server")
    etcd = stack.enter_context(EtcdProcess().start()) if etcd_binary() else None  # one-node cluster: peer families
    peers = peer_options(etcd) if etcd is not None else {}
    with stack, DaemonProcess(arena_bytes="4MiB", max_block_bytes="1MiB", high_watermark=1.0, low_watermark=1.0,
                       disk_bytes="16MiB", disk_segment_bytes="4MiB", disk_dir=str(disk), disk_sync="none",
                       **peers) as d:
        with d.client() as c:
            c.register_namespace("deploy/ns", tokens_per_block=16)  # token families get a namespace sample
            keys = [b"k%d" % i for i in range(6)]
            for k in keys:  # 6 blocks into 4 slots: the first two end up on disk only
                c.put("deploy/ns", k, k * (MIB // 2))
                wait_until(lambda: c.stats().disk.write_queue_blocks == 0, timeout_s=30, what="disk writes")
            assert c.get("deploy/ns", keys[-1]) is not None  # RAM hit
            assert c.get("deploy/ns", keys[0]) is not None  # disk hit, promotion
            assert c.get("deploy/ns", b"absent") is None
        with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    out: Exposed = defaultdict(lambda: defaultdict(set))
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:  # histogram samples are named <family>_bucket / _count / _sum
            for name, value in s.labels.items():
                out[s.name][name].add(value)
            out[s.name]  # noqa: B018 - record label-less samples too
    yield {k: dict(v) for k, v in out.items()}


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries(dash: dict[str, Any]) -> list[str]:
    """Every PromQL string of the dashboard: panel targets and template variable queries."""
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return out


def test_dashboard_promql_names_only_exported_metrics_and_labels(exposed: Exposed) -> None:
    queries = _queries(_dashboard())
    assert len(queries) > 20
    used: set[str] = set()
    for expr in queries:
        if "vllm:kvstore_" in expr:  # the connector's, on vLLM's /metrics: its names and labels (kvstore_connector/prom.py)
            assert set(re.findall(r"vllm:kvstore_[a-z0-9_]+", expr)) <= connector_metric_names(), expr
            for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)|(\w+)=~?\"", expr):
                for label in filter(None, (g.strip() for part in group for g in part.split(","))):
                    assert label in _CONNECTOR_LABELS, f"{label!r} is no label of the connector's metrics: {expr}"
            continue
        names = set(re.findall(r"(?<![:\w])kvstore_[a-z0-9_]+", expr))
        assert names, expr
        if not etcd_binary():  # without etcd the fixture's daemon runs alone: no peer families to check
            names = {n for n in names if not n.startswith("kvstore_peer_")}
            if not names:
                continue
        missing = sorted(n for n in names if n not in exposed)
        assert not missing, f"{missing} not exported by the daemon (query: {expr})"
        used |= names
        labels = {label for n in names for label in exposed[n]} | _SCRAPE_LABELS
        for metric, body in re.findall(r"(kvstore_[a-z0-9_]+)\{([^}]*)\}", expr):
            for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', body):
                if label in _SCRAPE_LABELS:
                    continue
                assert label in exposed[metric], f"{metric} has no label {label!r} (query: {expr})"
                if "$" not in value and op in ("=", "=~") and re.fullmatch(r"[\w|+-]+", value):
                    unknown = set(value.split("|") if op == "=~" else [value]) - exposed[metric][label]
                    assert not unknown, f"{metric}{{{label}}} never takes {sorted(unknown)} (query: {expr})"
        for group in re.findall(r"\b(?:by|without|ignoring|on)\s*\(([^)]*)\)", expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                assert label in labels, f"no metric of {expr!r} has the label {label!r}"
    # the panels the deployment promises
    for family in ("kvstore_hit_keys_total", "kvstore_lookup_keys_total", "kvstore_hit_bytes_total",
                   "kvstore_arena_bytes", "kvstore_disk_bytes", "kvstore_evictions_total", "kvstore_promotions_total",
                   "kvstore_rpc_duration_seconds_bucket", "kvstore_leases_active", "kvstore_checksum_failures_total",
                   "kvstore_disk_degraded", "kvstore_namespace_hit_keys_total", "kvstore_lookup_tokens_total",
                   "kvstore_hit_tokens_total", "kvstore_namespace_hit_tokens_total", "kvstore_transfer_bytes_total",
                   "kvstore_transfer_seconds_bucket", "kvstore_transfer_gigabytes_per_second_bucket",
                   *(("kvstore_peer_fetched_blocks_total", "kvstore_peer_errors_total", "kvstore_peer_members")
                     if etcd_binary() else ())):
        assert family in used, family
    connector = {n for q in queries for n in re.findall(r"vllm:kvstore_[a-z0-9_]+", q)}
    assert {"vllm:kvstore_served_tokens_total", "vllm:kvstore_hit_tokens_total", "vllm:kvstore_misses_total",
            "vllm:kvstore_connect_failures_total", "vllm:kvstore_loaded_bytes_total"} <= connector
    assert any("histogram_quantile(0.99" in q and "kvstore_rpc_duration_seconds_bucket" in q for q in queries)
    assert any("histogram_quantile(0.5" in q for q in queries)


def test_dashboard_is_importable_grafana_json() -> None:
    dash = _dashboard()
    assert 36 <= dash["schemaVersion"] <= 41 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])


def _toml_keys(text: str) -> set[str]:
    return set(tomllib.loads(text))


def test_example_config_uses_real_settings_and_loads() -> None:
    names = {f.name for f in fields(ServerConfig)}
    keys = _toml_keys(EXAMPLE_TOML.read_text())
    assert keys <= names, f"not settings: {sorted(keys - names)}"
    cfg = load_config(["--config", str(EXAMPLE_TOML)], {})
    assert cfg.unix_socket == "/run/kvstore/kvstore.sock" and cfg.arena_lock == "on"
    assert cfg.arena_bytes == 64 << 30 and cfg.disk_bytes == 1 << 40


def _unit() -> configparser.ConfigParser:
    p = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                  comment_prefixes=("#", ";"), empty_lines_in_values=False)
    p.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    p.read_string(UNIT.read_text())
    return p


def test_systemd_unit_matches_the_example_config() -> None:
    svc = _unit()["Service"]
    argv = svc["ExecStart"].split()
    assert PurePosixPath(argv[0]).name == "kvstore-server" and PurePosixPath(argv[0]).is_absolute()
    config_path = argv[argv.index("--config") + 1]
    assert config_path == "/etc/kvstore/kvstore.toml"
    assert (svc["Type"], svc["Restart"], svc["KillSignal"], svc["LimitMEMLOCK"]) == (
        "notify", "on-failure", "SIGTERM", "infinity")
    # a reload is a hand-over (SIGUSR2): the successor reports itself as the main process; the fd store holds
    # the journal and one arena file per tenant
    assert svc["ExecReload"] == "/bin/kill -USR2 $MAINPID" and svc["NotifyAccess"] == "all"
    assert int(svc["FileDescriptorStoreMax"]) >= 2
    assert svc["User"] not in ("", "root") and float(svc["TimeoutStopSec"]) > SHUTDOWN_GRACE_S + 10
    cfg = load_config(["--config", str(EXAMPLE_TOML)], {})
    assert os.path.dirname(cfg.unix_socket) == "/run/" + svc["RuntimeDirectory"]
    assert PurePosixPath(cfg.disk_dir).is_relative_to("/var/cache/" + svc["CacheDirectory"])
    for private in ("PrivateDevices", "PrivateIPC"):  # fine: the arena goes over the socket, not /dev/shm
        assert svc.get(private) == "yes"


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    tool, server = shutil.which("systemd-analyze"), Path(sys.executable).parent / "kvstore-server"
    if tool is None:
        missing("systemd-analyze", "apt-get install systemd")
    if not server.exists():
        missing("the kvstore-server entry point", "make setup (pip install -e .)")
    unit = tmp_path / "kvstore-server.service"  # same file, pointing at this checkout's entry point
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={server}", UNIT.read_text(), flags=re.M))
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if unit.name in line]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr


def _k8s() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = {d["kind"]: d for d in yaml.safe_load_all(DAEMONSET.read_text())}
    return docs["ConfigMap"], docs["DaemonSet"]


def _quantity(text: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", str(text))
    assert m, text
    return int(m.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m.group(2)]


def test_daemonset_agrees_with_its_configmap(tmp_path: Path) -> None:
    cm, ds = _k8s()
    toml_text = cm["data"]["kvstore.toml"]
    assert _toml_keys(toml_text) <= {f.name for f in fields(ServerConfig)}
    path = tmp_path / "kvstore.toml"
    path.write_text(toml_text)
    pod = ds["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    env = render_env(c, Node("gpu-node-01", "10.0.0.7"))
    cfg = load_config(["--config", str(path)], {k: v for k, v in env.items() if k.startswith("KVSTORE_")})
    host, _, port_text = cfg.metrics_listen.rpartition(":")
    port = int(port_text)
    assert host == "10.0.0.7"  # the kubelet probes the pod IP (hostNetwork: the host IP), not loopback
    assert (cfg.node_id, cfg.peer_listen, cfg.peer_advertise) == ("gpu-node-01", "10.0.0.7:7071", "")
    assert cfg.peer_endpoints == []  # off as shipped: etcd_endpoints and the Secret turn it on

    assert ds["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    spec = pod["spec"]
    named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    assert not c.get("ports")  # with hostNetwork a declared port is a host port: the surge pod could not start
    assert (env["KVSTORE_TAKE_OVER"], env["KVSTORE_HANDOVER_LINGER"]) == ("true", "true")
    assert cfg.take_over and cfg.handover_linger
    rolling = ds["spec"]["updateStrategy"]["rollingUpdate"]
    assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (1, 0)  # the new pod beside the old: a hand-over
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz" and named.get(get["port"], get["port"]) == port, probe
    notes = pod["metadata"]["annotations"]
    assert (notes["prometheus.io/scrape"], notes["prometheus.io/port"], notes["prometheus.io/path"]) == (
        "true", str(port), "/metrics")

    # the mounted config is the file the command reads, and it is the ConfigMap's
    config_file = PurePosixPath(c["command"][c["command"].index("--config") + 1])
    assert PurePosixPath(c["command"][0]).name == "kvstore-server"
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {PurePosixPath(m["mountPath"]): volumes[m["name"]] for m in c["volumeMounts"]}
    cm_volume = mounts[config_file.parent]["configMap"]
    assert cm_volume["name"] == cm["metadata"]["name"]
    assert {"key": "kvstore.toml", "path": config_file.name} in cm_volume["items"]

    host_paths = {mount: v["hostPath"]["path"] for mount, v in mounts.items() if "hostPath" in v}
    assert PurePosixPath("/dev/shm") not in host_paths  # the arena is handed over the socket: nothing to share
    assert PurePosixPath(cfg.unix_socket).parent in host_paths  # the socket directory, shared too
    assert any(PurePosixPath(cfg.disk_dir).is_relative_to(m) for m in host_paths)  # disk tier survives the pod
    assert spec["hostNetwork"] is True  # same hostname as the clients, or they fall back to streaming

    limits = c["resources"]["limits"]
    assert _quantity(limits["memory"]) > cfg.arena_bytes  # the arena is charged to this container
    sc = c["securityContext"]
    assert "IPC_LOCK" in sc["capabilities"]["add"]
    if cfg.arena_lock == "on":  # added capabilities are effective only for UID 0
        assert sc["runAsUser"] == 0
    assert spec["terminationGracePeriodSeconds"] > SHUTDOWN_GRACE_S + 10


def test_the_example_configs_peer_block_turns_on_with_its_two_values(tmp_path: Path) -> None:
    """deploy/kvstore.toml (systemd): etcd_endpoints set and the files its peer settings name in place give a
    config with the peer tier on, advertising the unit's KVSTORE_PEER_ADVERTISE (%H: this host's name)."""
    text = EXAMPLE_TOML.read_text()
    files = re.findall(r'^\w+ = "(/etc/kvstore/peer/[^"]+)"', text, flags=re.M)
    assert sorted(PurePosixPath(f).name for f in files) == ["ca.pem", "etcd-ca.pem", "etcd-password", "node-key.pem",
                                                            "node.pem"]
    from tests.etcd_secure import make_etcd_pki  # a CA and a certificate with its key, written owner-only
    pki = make_etcd_pki(str(tmp_path / "pki"))
    peer = tmp_path / "peer"
    peer.mkdir(mode=0o700)
    sources = {"etcd-ca.pem": pki.ca, "ca.pem": pki.ca, "node.pem": pki.server.cert, "node-key.pem": pki.server.key}
    for name, src in sources.items():
        (peer / name).write_bytes(Path(src).read_bytes())
        os.chmod(peer / name, 0o600)
    (peer / "etcd-password").write_text("secret\n")
    os.chmod(peer / "etcd-password", 0o600)
    on = re.sub(r'^etcd_endpoints = ""', 'etcd_endpoints = "https://10.0.0.5:2379"', text, count=1, flags=re.M)
    path = tmp_path / "kvstore.toml"
    path.write_text(on.replace("/etc/kvstore/peer/", f"{peer}/"))
    (advertise,) = re.findall(r"^Environment=KVSTORE_PEER_ADVERTISE=(\S+)$", UNIT.read_text(), flags=re.M)
    cfg = load_config(["--config", str(path)], {"KVSTORE_PEER_ADVERTISE": advertise.replace("%H", "gpu-node-01")})
    assert cfg.peer_endpoints == ["https://10.0.0.5:2379"] and cfg.tls.enabled
    assert cfg.peer_config().advertise == "gpu-node-01:7071"
