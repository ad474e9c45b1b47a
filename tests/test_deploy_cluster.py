"""deploy/kubernetes as shipped, with the peer tier turned on by its two values, run as three pods would run it.

The DaemonSet's ConfigMap and its container's environment are rendered as the kubelet hands them to a pod
(tests/k8s_pod.py: downward API, `$(VAR)` expansion, ConfigMap and Secret files), on three "nodes" whose host
IPs are three loopback addresses. The two values a user sets are set: `etcd_endpoints` in the ConfigMap (a
real etcd over TLS with a login) and the Secret `kvstore-secrets`, with exactly the keys of
deploy/kubernetes/secrets.example.yaml filled with real files. Two changes fit the pods on this machine and
are made through the daemon's own KVSTORE_* variables, as an operator would: a 64 MiB arena instead of
64 GiB, and no disk tier. Each pod's mounts live in a directory of its node (paths rewritten, nothing else).
The three daemons must find each other through etcd, each advertising its own host IP, and serve a block
put on one node to the others from the peer tier.
"""

from __future__ import annotations

import datetime
import ipaddress
import random
import re
import socket
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvstore.client import Client
from kvstore.peer.placement import rank
from kvstore.testing import wait_until
from tests.etcd_secure import SecureEtcd, make_etcd_pki
from tests.k8s_pod import Node, PodFiles, daemon_pod
from tests.peer_helpers import blocks, needs_etcd

pytestmark = [needs_etcd]

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
USER, PASSWORD = "kvstore", "etcd-password-for-the-deploy-test"
FIT_THIS_MACHINE = {"KVSTORE_ARENA_BYTES": "64MiB", "KVSTORE_DISK_BYTES": "0"}


def _manifests() -> tuple[dict, dict, dict]:
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "daemonset.yaml").read_text())}
    (secret,) = yaml.safe_load_all((DEPLOY / "secrets.example.yaml").read_text())
    return docs["ConfigMap"], docs["DaemonSet"], secret


def _host_ips() -> list[str]:
    """Three loopback addresses whose ports of the manifest (7071, 9464) are free."""
    rnd = random.Random()
    for _ in range(50):
        base = f"127.{rnd.randint(1, 250)}.{rnd.randint(1, 250)}"
        ips = [f"{base}.{i}" for i in (2, 3, 4)]
        try:
            for ip in ips:
                for port in (7071, 9464):
                    with socket.socket() as s:
                        s.bind((ip, port))
        except OSError:
            continue
        return ips
    raise AssertionError("no free loopback addresses for ports 7071 and 9464")


def _node_pki(directory: Path, ips: list[str]) -> dict[str, str]:
    """One cluster CA and one node certificate whose IP SANs are every node's host IP (secrets.example.yaml)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore-nodes-ca")])

    def build(subject: x509.Name, pub, *, ca: bool) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(pub)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))

    ca = build(ca_name, ca_key.public_key(), ca=True).sign(ca_key, hashes.SHA256())
    node = (build(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvstore nodes")]), key.public_key(), ca=False)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return {"node.pem": node.public_bytes(pem).decode(), "ca.pem": ca.public_bytes(pem).decode(),
            "node-key.pem": key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()).decode()}


def _set_endpoints(toml_text: str, endpoints: str) -> str:
    """Value 1 of 2: the ConfigMap's etcd_endpoints line, set as a user would."""
    new, n = re.subn(r'^etcd_endpoints = ""', f'etcd_endpoints = "{endpoints}"', toml_text, flags=re.M)
    assert n == 1, "the ConfigMap has no `etcd_endpoints = \"\"` line to set"
    return new


def _secret_paths(toml_text: str, mount: str) -> set[str]:
    """The keys of the Secret that active settings of the ConfigMap name."""
    return {p.rsplit("/", 1)[1] for p in re.findall(rf'^\w+ = "({re.escape(mount)}/[^"]+)"', toml_text, flags=re.M)}


class Pod:
    def __init__(self, node: Node, files: PodFiles, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.node, self.files, self.log = node, files, log
        self.proc = subprocess.Popen(argv, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    def address(self, toml_text: str) -> str:
        (sock,) = re.findall(r'^unix_socket = "([^"]+)"', toml_text, flags=re.M)
        return "unix:" + str(self.files.path(sock))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start_pods(stack: ExitStack, tmp: Path, toml_text: str, ds: dict, secret: dict[str, str],
                ips: list[str]) -> list[Pod]:
    pods = []
    for name, ip in zip(("node-a", "node-b", "node-c"), ips):
        node = Node(name, ip)
        argv, env, files = daemon_pod(ds, tmp / name, node, toml_text, secret)
        assert env["KVSTORE_PEER_LISTEN"] == f"{ip}:7071" and env["KVSTORE_NODE_ID"] == name
        pod = Pod(node, files, argv, {**env, **FIT_THIS_MACHINE}, tmp / f"{name}.log")
        stack.callback(pod.stop)
        pods.append(pod)
    return pods


def test_daemonset_with_its_two_peer_values_runs_a_cluster_that_serves_a_peer_hit(tmp_path: Path) -> None:
    cm, ds, example = _manifests()
    toml_text = cm["data"]["kvstore.toml"]
    mount = next(m["mountPath"] for m in ds["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                 if m["name"] == "secrets")
    # the example Secret holds exactly the files the ConfigMap's settings name
    assert set(example["stringData"]) == _secret_paths(toml_text, mount)

    ips = _host_ips()
    pki = make_etcd_pki(str(tmp_path / "etcd-pki"))
    node_files = _node_pki(tmp_path / "node-pki", ips)
    with ExitStack() as stack:
        etcd = stack.enter_context(SecureEtcd(pki).start())
        etcd.enable_auth(USER, PASSWORD)
        secret = {"etcd-ca.pem": Path(pki.ca).read_text(), "etcd-password": PASSWORD + "\n", **node_files}
        assert set(secret) == set(example["stringData"])
        pods = _start_pods(stack, tmp_path, _set_endpoints(toml_text, etcd.endpoint), ds, secret, ips)
        clients = {}
        for pod in pods:
            address = pod.address(toml_text)
            deadline = time.monotonic() + 60
            while True:
                assert pod.proc.poll() is None, f"{pod.node.name} exited:\n{pod.log.read_text()[-4000:]}"
                try:
                    clients[pod.node.name] = stack.enter_context(Client(address, timeout_s=5.0))
                    break
                except Exception:  # noqa: BLE001 - not serving yet
                    assert time.monotonic() < deadline, pod.log.read_text()[-4000:]
                    time.sleep(0.1)
        names = sorted(clients)

        # they found each other, each at its own host IP
        def members(name: str) -> dict[str, str]:
            peers = clients[name].health().peers
            return {m.node_id: m.data_address for m in peers.members} if peers is not None else {}
        want = {p.node.name: f"{p.node.host_ip}:7071" for p in pods}
        for name in names:
            wait_until(lambda: members(name) == want, timeout_s=30, what=f"{name} to see all three members")
            assert clients[name].health().peers.etcd_connected

        # a block put on node-a is served to the others by the peer tier
        ns = "deploy-cluster/ns"
        for c in clients.values():
            c.register_namespace(ns, model="m", layout_digest="d")
        keys = [b"deploy-%02d" % i for i in range(12)]
        values = blocks(12, 256 << 10, seed=7)
        clients["node-a"].put_many(ns, keys, values)
        wait_until(lambda: clients["node-a"].stats().peers.pending_pushes == 0, 20, what="node-a's pushes")
        owners = [rank(ns, k, names)[0] for k in keys]
        for name in ("node-b", "node-c"):
            before = clients[name].stats().peers.counters["fetched_blocks"]
            assert clients[name].get_many(ns, keys) == values
            fetched = clients[name].stats().peers.counters["fetched_blocks"] - before
            assert fetched == sum(o != name for o in owners)  # all but its own pushed copies came over the wire
        assert sum(o != "node-a" for o in owners) > 0
