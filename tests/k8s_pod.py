"""What a pod of a Kubernetes manifest receives, rendered on this machine: its environment and its mounted files.

The kubelet does three things the deploy test must reproduce exactly to start daemons "as the pods would":

- env: `valueFrom.fieldRef` from the downward API (spec.nodeName, status.hostIP, ...), then `$(VAR)` references
  expanded against the variables defined earlier in the same list; `$$` is a literal `$`, and a reference to
  a variable not (yet) defined stays as written (Kubernetes' rule, which is why the config's address checks
  name an unexpanded `$(HOST_IP)`).
- configMap volumes with `items`: each key becomes the file `path` under the mount.
- secret volumes: each key a file under the mount, with `defaultMode`.

A node here is a directory: every mountPath of the container lives under it (`<root>/etc/kvstore`, ...), and
absolute paths under a mountPath in the config and the env are rewritten to it, the only change made to
what the manifest says.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Node", "render_env", "PodFiles", "mount_pod", "daemon_pod"]

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


@dataclass(frozen=True)
class Node:
    """The downward API's values on one node (hostNetwork: the pod IP is the host IP)."""

    name: str
    host_ip: str

    def field(self, path: str) -> str:
        values = {"spec.nodeName": self.name, "status.hostIP": self.host_ip, "status.podIP": self.host_ip,
                  "metadata.name": f"kvstore-server-{self.name}", "metadata.namespace": "kvstore"}
        if path not in values:
            raise KeyError(f"fieldRef {path!r} is not rendered by this test")
        return values[path]


def _expand(text: str, defined: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return defined.get(m.group(1), m.group(0))
    return _REF.sub(one, text)


def render_env(container: dict[str, Any], node: Node) -> dict[str, str]:
    """The container's environment as the kubelet sets it on `node`, in order."""
    out: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            out[var["name"]] = _expand(str(var["value"]), out)
        else:
            ref = var["valueFrom"]["fieldRef"]["fieldPath"]
            out[var["name"]] = node.field(ref)
    return out


@dataclass(frozen=True)
class PodFiles:
    root: Path
    mounts: dict[str, Path]  # mountPath -> directory on this machine

    def path(self, pod_path: str) -> Path:
        """Where a path of the pod's file system lives here."""
        for mount in sorted(self.mounts, key=len, reverse=True):
            if pod_path == mount or pod_path.startswith(mount + "/"):
                return self.mounts[mount] / os.path.relpath(pod_path, mount)
        raise KeyError(f"{pod_path} is under no volume mount of the pod")

    def rewrite(self, text: str) -> str:
        """`text` with every absolute path under a mountPath (quoted, or a whole env value) moved to its
        directory here."""
        mounts = sorted(self.mounts, key=len, reverse=True)  # one pass: a directory here may lie under /tmp
        pattern = rf'(^|["\s=])({"|".join(re.escape(m) for m in mounts)})(?=/|"|$)'
        text = re.sub(pattern, lambda m: m.group(1) + str(self.mounts[m.group(2)]), text, flags=re.M)
        return text


def mount_pod(spec: dict[str, Any], container: dict[str, Any], root: Path, config_maps: dict[str, dict[str, str]],
              secrets: dict[str, dict[str, str]]) -> PodFiles:
    """Make every volume mount of `container` a directory under `root`, with its ConfigMap or Secret files."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts: dict[str, Path] = {}
    for m in container["volumeMounts"]:
        here = root / m["mountPath"].lstrip("/")
        here.mkdir(parents=True, exist_ok=True, mode=0o700)
        mounts[m["mountPath"]] = here
        vol = volumes[m["name"]]
        if "configMap" in vol:
            data = config_maps[vol["configMap"]["name"]]
            for item in vol["configMap"].get("items") or [{"key": k, "path": k} for k in data]:
                (here / item["path"]).write_text(data[item["key"]])
        elif "secret" in vol:
            data = secrets.get(vol["secret"]["secretName"])
            if data is None:
                assert vol["secret"].get("optional"), f"Secret {vol['secret']['secretName']} is not optional"
                continue
            for key, value in data.items():
                f = here / key
                f.write_text(value)
                os.chmod(f, vol["secret"].get("defaultMode", 0o644))
    return PodFiles(root, mounts)


def daemon_pod(ds: dict[str, Any], root: Path, node: Node, toml_text: str,
               secret: dict[str, str] | None) -> tuple[list[str], dict[str, str], PodFiles]:
    """(argv, environment, files) of the DaemonSet's kvstore-server container on `node`, its ConfigMap holding
    `toml_text` and its Secret `secret` (None: not created). The image's `kvstore-server` is this checkout's
    entry point; the environment is the kubelet's, over this process's own less any KVSTORE_* variable."""
    spec = ds["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    secret_name = next(v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v)
    cm_name = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
    files = mount_pod(spec, container, root, {cm_name: {"kvstore.toml": toml_text}},
                      {secret_name: secret} if secret is not None else {})
    command = container["command"]
    cfg_path = files.path(command[command.index("--config") + 1])
    cfg_path.write_text(files.rewrite(cfg_path.read_text()))
    env = {k: files.rewrite(v) for k, v in render_env(container, node).items()}
    argv = [sys.executable, "-m", "kvstore.server.main"] + [files.rewrite(a) for a in command[1:]]
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return argv, {**base, **env}, files
