"""containerd on the lab's nodes (``lab up --runtime containerd``): its configuration, the two fixes
this machine needs, the pause image, and the node-local registry endpoint (standard library only).

Neighbours: ``lab.init`` calls ``prepare_node`` in each node holder and runs ``containerd`` and the
``relay`` as supervised services; ``lab.image`` installs containerd from sid; the host reaches each
node's CRI socket through the lab's state directory (``cri/<node>.sock``), like the agents' sockets.

Why each piece:
- ``restrict_oom_score_adj``: runc may not raise oom_score_adj here (no CAP_SYS_RESOURCE); without
  it no CRI pod starts (runc reports only "can't get final child's PID from pipe").
- ``runc-nocg``: the lab's cgroup2 has no cpu/memory/pids controllers (the host's v1 hierarchies own
  them), but CRI always gives the pause container cpu shares; the wrapper drops the resource limits
  from each bundle before runc sees it. Lab only: a real node has the controllers.
- ``/etc/criu/containerd.conf`` (``org.criu.config`` on every bundle, set by the same wrapper): CRIU's
  options for containerd's containers, ``tcp-close`` among them. Without it a client connection open
  at the instant of the kubelet's checkpoint fails it ("Connected TCP socket, consider using
  --tcp-established"): a Service under traffic could not be migrated. ``tcp-close`` dumps such
  connections as closed and restores them closed (the pod's address changes: they could not move
  anyway); the source keeps its own. A real node sets it in ``/etc/criu/runc.conf``; in the lab that
  file is the Podman engine's, whose migrations keep TCP connections (each CRIU run of theirs reads
  it with its own options added, ``runtime.criu_conf``).
- the registry at ``localhost:5000`` on every node (``relay`` to the lab's registry): containerd
  2.1's CRI restore pulls the checkpoint's base image through its default resolver, which ignores
  the registry configuration and speaks plain HTTP only to localhost. One reference then works on
  every node, with no certificate in the nodes' trust stores.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import socket
import sys
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

from podmigrate import layout

NODE_REGISTRY = "localhost:5000"  # what containerd on a node pulls from: relayed to layout.REGISTRY
PAUSE_IMAGE = f"{NODE_REGISTRY}/pause:3.10"
RUNC_NOCG = "/usr/local/sbin/runc-nocg"
RESTORE_HANDLER = "podmigrate"  # the CRI runtime handler of the RuntimeClass restore path
RESTORE_RUNC = "/usr/local/sbin/podmigrate-runc"  # runtime.runc_restore, installed as a script
RESTORE_DIR = "/var/lib/podmigrate/restore"  # where the node agent unpacks verified checkpoints
CRIU_CONF = "/etc/criu/containerd.conf"  # CRIU's options for containerd's containers (see above)
CRIU_CONF_EXTRA = "tcp-close\n"  # added to the node's default runc.conf
KUBELET_DIR = "/var/lib/kubelet"  # the checkpoints the kubelet asks for go to its checkpoints/ subdirectory
POD_LOGS = "/var/log/pods"
CNI_CONF_DIR = "/etc/cni/net.d"
CNI_STATE_DIR = "/var/lib/cni"
CNI_BIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins

RUNC_NOCG_SCRIPT = """#!/bin/sh
# runc with the bundle's cgroup resource limits removed: the lab's cgroup2 has no controllers (see
# podmigrate/lab/containerd.py). Everything else is plain runc.
b=""; prev=""
for a in "$@"; do
  case $prev in --bundle|-b) b=$a ;; esac
  case $a in --bundle=*) b=${a#--bundle=} ;; esac
  prev=$a
done
if [ -n "$b" ] && [ -f "$b/config.json" ]; then
  f='if .linux.resources then .linux.resources |= del(.cpu,.memory,.pids,.blockIO,.hugepageLimits,.unified) else . end'
  # CRIU's options for this container's checkpoints and restores: containerd's own, not the engine's
  f="$f"' | .annotations["org.criu.config"] = "%s"'
  jq -c "$f" "$b/config.json" > "$b/config.json.nocg" && mv "$b/config.json.nocg" "$b/config.json"
fi
exec /usr/sbin/runc "$@"
"""


def config_toml(socket_path: str) -> str:
    return f"""version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "{socket_path}"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = "/etc/containerd/certs.d"
[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = false
  restrict_oom_score_adj = true
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{CNI_BIN_DIR}"]
    conf_dir = "{CNI_CONF_DIR}"
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{RUNC_NOCG}"
        SystemdCgroup = false
    # the restore path that needs no CRI restore (runtime.runc_restore); CRI copies only allow-listed
    # annotations into the OCI spec, so without these lists the wrapper would never see what to restore
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.{RESTORE_HANDLER}]
      runtime_type = "io.containerd.runc.v2"
      container_annotations = ["io.podmigrate.*"]
      pod_annotations = ["io.podmigrate.*"]
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.{RESTORE_HANDLER}.options]
        BinaryName = "{RESTORE_RUNC}"
        SystemdCgroup = false
"""


def socket_path(node: str) -> str:
    """The node's CRI socket as the lab sees it; the host finds it at ``<lab dir>/cri/<node>.sock``."""
    return f"{layout.IN_LAB_STATE}/cri/{node}.sock"


def prepare_node(base: Path, node: str, bind: Callable[[str, str], object]) -> None:
    """In the node holder: containerd's directories and configuration, private to ``node``.

    ``bind(source, target)`` bind-mounts a directory of the node's state over a system path."""
    etc = base / "containerd-etc"
    hosts = etc / "certs.d" / NODE_REGISTRY
    hosts.mkdir(parents=True, exist_ok=True)
    (etc / "config.toml").write_text(config_toml(socket_path(node)))
    (hosts / "hosts.toml").write_text(f'server = "http://{NODE_REGISTRY}"\n[host."http://{NODE_REGISTRY}"]\n')
    Path(socket_path(node)).parent.mkdir(parents=True, exist_ok=True)
    for sub, target in (
        ("containerd-etc", "/etc/containerd"),
        ("containerd", "/var/lib/containerd"),
        ("kubelet", KUBELET_DIR),
        ("cni-net.d", CNI_CONF_DIR),  # the node's pod network (podmigrate.kube writes it)
        ("pod-logs", POD_LOGS),
        ("container-logs", "/var/log/containers"),  # the kubelet's links into pod-logs
        # host-local's leases: in the shared node image every node of every lab wrote one
        # last_reserved_ip, so a freed pod address went at once to the next pod of any node
        ("cni-state", CNI_STATE_DIR),
        ("podmigrate-restore", RESTORE_DIR),
    ):
        (base / sub).mkdir(parents=True, exist_ok=True)
        os.makedirs(target, exist_ok=True)
        bind(str(base / sub), target)
    os.makedirs(f"{KUBELET_DIR}/checkpoints", mode=0o700, exist_ok=True)  # checkpoints hold process memory
    os.chmod(RESTORE_DIR, 0o700)


def install_wrapper(root: Path) -> None:
    """Write runc-nocg and podmigrate-runc into the node image (on every ``lab up``: cheap, never
    forces a rebuild). In the lab the restore handler's runc is runc-nocg, for the same reason."""
    restore = (Path(__file__).parents[1] / "runtime" / "runc_restore.py").read_text()
    for target, text in ((RUNC_NOCG, RUNC_NOCG_SCRIPT.replace("%s", CRIU_CONF)), (RESTORE_RUNC, restore)):
        path = root / target.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    conf = root / "etc/podmigrate/runc-restore.json"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(json.dumps({"runc": RUNC_NOCG, "restore_dir": RESTORE_DIR}) + "\n")


def pause_layout(out: Path, binary: Path = Path("/usr/bin/catatonit")) -> str:
    """An OCI image layout whose one file is ``/pause`` = the static catatonit (``pause -P``); its
    manifest digest. The lab has no registry to pull a pause image from, so it makes its own."""
    blobs = out / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def blob(data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return f"sha256:{digest}", len(data)

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t, open(binary, "rb") as f:
        info = t.gettarinfo(str(binary), arcname="pause")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        t.addfile(info, f)
    layer, layer_size = blob(buf.getvalue())
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause", "-P"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer]},
    }
    cfg, cfg_size = blob(json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg, "size": cfg_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer, "size": layer_size}],
    }
    man, man_size = blob(json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": man,
                "size": man_size,
                "annotations": {"org.opencontainers.image.ref.name": PAUSE_IMAGE.rsplit(":", 1)[1]},
            }
        ],
    }
    (out / "index.json").write_text(json.dumps(index))
    (out / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    return man


# ------------------------------------------------------------------------------------------ relay
def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _serve(server: socket.socket, upstream: tuple[str, int]) -> None:
    while True:
        try:
            client, _ = server.accept()
        except OSError:  # closed (``stop``)
            return
        try:
            up = socket.create_connection(upstream, timeout=10)
        except OSError:
            client.close()
            continue
        up.settimeout(None)
        for a, b in ((client, up), (up, client)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def listen(port: int) -> list[socket.socket]:
    """Listening sockets on localhost:``port``, IPv4 and IPv6 where there is ::1 (Go may resolve
    localhost to ::1 first); made in the calling thread's network namespace."""
    servers = [socket.create_server(("127.0.0.1", port))]
    with contextlib.suppress(OSError):  # no IPv6 loopback in this namespace
        servers.append(socket.create_server(("::1", port), family=socket.AF_INET6))
    return servers


def forward(servers: list[socket.socket], upstream: str) -> None:
    """Forward the connections to ``servers`` to ``upstream`` (host:port), from daemon threads."""
    up_host, up_port = upstream.rsplit(":", 1)
    for s in servers:
        threading.Thread(target=_serve, args=(s, (up_host, int(up_port))), daemon=True).start()


def stop(servers: list[socket.socket]) -> None:
    """Stop listening: shut down first, which wakes a thread blocked in accept() (a close alone would
    leave the socket listening as long as that thread holds it)."""
    for s in servers:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()


def relay(port: int, upstream: str) -> None:
    """Forward TCP connections to localhost:``port`` to ``upstream`` until killed."""
    forward(listen(port), upstream)
    threading.Event().wait()


if __name__ == "__main__":  # python3 -m podmigrate.lab.containerd relay PORT UPSTREAM
    if sys.argv[1:2] == ["relay"] and len(sys.argv) == 4:
        relay(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit("usage: python3 -m podmigrate.lab.containerd relay PORT UPSTREAM")
