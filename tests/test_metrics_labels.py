"""Namespace and tenant names on /metrics: names, keyed hashes or nothing (metrics_namespace_labels).

A real daemon with tokens and two tenants (alice, bob), each with a namespace and a few blocks; its metrics
endpoint is scraped over HTTP. For each mode every namespace/tenant label value is checked exactly: the names
with "name"; with "hash" the documented function (HMAC-SHA256 under the key file, kvstore/server/metric_labels.py)
and no name anywhere in the scrape; with "none" no per-namespace or per-tenant family at all, totals intact.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client
from kvstore.errors import ConfigError
from kvstore.server.config import load_config
from kvstore.server.metric_labels import label_hash
from kvstore.testing import DaemonProcess
from tests.tenant_helpers import A_NS, ALICE_TOKEN, B_NS, BOB_TOKEN, secret

KEY = b"0123456789abcdef-label-key-of-this-test"
NS_FAMILIES = ("kvstore_namespace_lookup_keys_total", "kvstore_namespace_hit_keys_total", "kvstore_namespace_blocks",
               "kvstore_namespace_bytes", "kvstore_namespace_lookup_tokens_total",
               "kvstore_namespace_hit_tokens_total", "kvstore_namespace_tokens_per_block")
TENANT_FAMILIES = ("kvstore_tenant_bytes", "kvstore_tenant_quota_bytes")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("labels")
    return {"tokens": secret(str(d / "tokens"), f"alice {ALICE_TOKEN}\nbob {BOB_TOKEN}\n"),
            "alice": secret(str(d / "alice.token"), ALICE_TOKEN), "bob": secret(str(d / "bob.token"), BOB_TOKEN),
            "key": secret(str(d / "label.key"), KEY.decode() + "\n")}


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(d: DaemonProcess) -> tuple[str, Samples]:
    with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, out


@pytest.fixture(scope="module", params=["name", "hash", "hash-random", "none"])
def scraped(request, files: dict[str, str]) -> Iterator[tuple[str, str, Samples]]:
    """(mode, exposition text, samples) of a daemon after the same two-tenant workload."""
    mode = request.param
    opts: dict[str, object] = {"tokens_file": files["tokens"], "tenant_ram_quota": "alice=1MiB"}
    if mode == "hash":
        opts.update(metrics_namespace_labels="hash", metrics_label_key_file=files["key"])
    elif mode != "hash-random":  # hash-random: the default with tokens ("auto"), a random key
        opts["metrics_namespace_labels"] = mode
    with DaemonProcess(**opts) as d:
        with Client(d.address, token_file=files["alice"]) as alice, Client(d.address, token_file=files["bob"]) as bob:
            alice.register_namespace(A_NS, tokens_per_block=16)
            bob.register_namespace(B_NS)
            alice.put_many(A_NS, [b"a0", b"a1", b"a2"], [b"x" * 10_000] * 3)
            bob.put_many(B_NS, [b"b0", b"b1"], [b"y" * 7_000] * 2)
            assert alice.get_many(A_NS, [b"a1", b"nope"]) == [b"x" * 10_000, None]
        text, samples = _scrape(d)
        log = d.log()
    assert ("namespace and tenant labels = " + ("hash" if mode.startswith("hash") else mode)) in log
    yield mode, text, samples


def _labels(samples: Samples, label: str, families: tuple[str, ...]) -> set[str]:
    return {v for (name, labels), _ in samples.items() if name in families for k, v in labels if k == label}


def _expected(mode: str, samples: Samples) -> dict[str, str]:
    """name -> the label value this mode must show for it."""
    names = {"ns:" + A_NS, "ns:" + B_NS, "t:alice", "t:bob"}
    if mode == "name":
        return {n: n.split(":", 1)[1] for n in names}
    if mode == "hash":  # the documented function, written out here rather than imported
        return {n: "h-" + hmac.new(KEY, ("namespace" if n.startswith("ns:") else "tenant").encode() + b"\0"
                                   + n.split(":", 1)[1].encode(), hashlib.sha256).hexdigest()[:16] for n in names}
    # a random key: recover the mapping from the values (blocks: alice 3, bob 2), then check its shape
    by_blocks = {v: dict(labels)["namespace"] for (name, labels), v in samples.items()
                 if name == "kvstore_namespace_blocks"}
    by_quota = {v: dict(labels)["tenant"] for (name, labels), v in samples.items()
                if name == "kvstore_tenant_quota_bytes" and dict(labels)["tier"] == "ram"}
    return {"ns:" + A_NS: by_blocks[3], "ns:" + B_NS: by_blocks[2], "t:alice": by_quota[1 << 20], "t:bob": by_quota[0]}


def test_label_values_per_mode(scraped: tuple[str, str, Samples]) -> None:
    mode, text, m = scraped
    # the totals never depend on the mode
    assert m[("kvstore_lookup_keys_total", ())] == 2
    assert m[("kvstore_hit_keys_total", (("tier", "ram"),))] == 1
    assert m[("kvstore_blocks", ())] == 5
    assert m[("kvstore_lookup_tokens_total", ())] == 32
    if mode == "none":
        assert not {name for name, _ in m if name in NS_FAMILIES + TENANT_FAMILIES}
        assert "namespace=" not in text and "tenant=" not in text
        for name in ("alice", "bob", A_NS, B_NS):
            assert name not in text
        return
    want = _expected(mode, m)
    ns_a, ns_b, t_a, t_b = want["ns:" + A_NS], want["ns:" + B_NS], want["t:alice"], want["t:bob"]
    assert _labels(m, "namespace", NS_FAMILIES) == {ns_a, ns_b}
    assert _labels(m, "tenant", TENANT_FAMILIES) == {t_a, t_b}
    if mode != "name":
        assert len({ns_a, ns_b, t_a, t_b}) == 4
        assert all(re.fullmatch(r"h-[0-9a-f]{16}", v) for v in (ns_a, ns_b, t_a, t_b))
        for name in ("alice", "bob", A_NS, B_NS, "model@abc"):
            assert name not in text  # no name leaves the node, in labels, help texts or anywhere else
    # each series carries its own tenant's / namespace's numbers
    assert m[("kvstore_namespace_blocks", (("namespace", ns_a),))] == 3
    assert m[("kvstore_namespace_blocks", (("namespace", ns_b),))] == 2
    assert m[("kvstore_namespace_lookup_keys_total", (("namespace", ns_a),))] == 2
    assert m[("kvstore_namespace_hit_keys_total", (("namespace", ns_a),))] == 1
    assert m[("kvstore_namespace_hit_keys_total", (("namespace", ns_b),))] == 0
    assert m[("kvstore_namespace_tokens_per_block", (("namespace", ns_a),))] == 16
    assert m[("kvstore_namespace_hit_tokens_total", (("namespace", ns_a), ("tier", "ram")))] == 16
    a_bytes = m[("kvstore_namespace_bytes", (("namespace", ns_a),))]
    b_bytes = m[("kvstore_namespace_bytes", (("namespace", ns_b),))]
    assert (a_bytes, b_bytes) == (30_000, 14_000)
    assert m[("kvstore_tenant_bytes", (("tenant", t_a), ("tier", "ram")))] == a_bytes
    assert m[("kvstore_tenant_bytes", (("tenant", t_b), ("tier", "ram")))] == b_bytes
    assert m[("kvstore_tenant_quota_bytes", (("tenant", t_a), ("tier", "ram")))] == 1 << 20


def test_label_helper_prints_the_same_labels(files: dict[str, str]) -> None:
    r = subprocess.run([sys.executable, "-m", "kvstore.server.metric_labels", "--key-file", files["key"],
                        "--tenant", "alice", "--namespace", A_NS], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"tenant\talice\t{label_hash(KEY, 'tenant', 'alice')}",
                                     f"namespace\t{A_NS}\t{label_hash(KEY, 'namespace', A_NS)}"]
    assert label_hash(KEY, "tenant", "alice") != label_hash(KEY, "namespace", "alice")
    assert label_hash(KEY, "tenant", "alice") != label_hash(KEY + b"x", "tenant", "alice")


def test_config_defaults_and_refusals(files: dict[str, str], tmp_path) -> None:
    base = ["--unix-socket", str(tmp_path / "s.sock"), "--disk-bytes", "0"]
    assert load_config(base, {}).metrics_labels == "name"  # no tokens: today's labels
    with_tokens = [*base, "--tokens-file", files["tokens"]]
    assert load_config(with_tokens, {}).metrics_labels == "hash"
    assert load_config([*with_tokens, "--metrics-namespace-labels", "name"], {}).metrics_labels == "name"
    assert load_config([*with_tokens, "--metrics-label-key-file", files["key"]], {}).metrics_labels == "hash"
    with pytest.raises(ConfigError, match="metrics_namespace_labels='names': use auto, name, hash or none"):
        load_config([*base, "--metrics-namespace-labels", "names"], {})
    with pytest.raises(ConfigError, match="metrics_label_key_file is set but the labels are 'name'"):
        load_config([*base, "--metrics-label-key-file", files["key"]], {})
    short = secret(str(tmp_path / "short"), "tooshort")
    with pytest.raises(ConfigError, match="holds 8 bytes, fewer than 16: write a random key"):
        load_config([*with_tokens, "--metrics-label-key-file", short], {})
    loose = tmp_path / "loose"
    loose.write_text(KEY.decode())
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match="metrics_label_key_file .* is readable or writable by other users"):
        load_config([*with_tokens, "--metrics-label-key-file", str(loose)], {})
