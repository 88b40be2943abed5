"""Post-copy and streamed dumps in the Podman backend: a lazy-pages dump, its restore, and a CRIU page server.

The lazy dump packs what podman's export would (``_rootfs_diff``, network.status) itself, since
podman exports only at the end; CRIU options go through ``criu_conf``, dropped faults are woken by
``uffd``. Built on ``podman_cli``; ``podman.Podman`` joins it with ``podman_pod``. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from podmigrate.errors import RuntimeBackendError
from podmigrate.runtime import criu_conf, freezer, speculative
from podmigrate.runtime.criu_conf import criu_log_tail, criu_spans, file_tail
from podmigrate.runtime.podman_cli import CHECKPOINTING, PodmanCLI, container_info, restore_network
from podmigrate.runtime.prefetch import read_pagemap
from podmigrate.runtime.speculative import Gate
from podmigrate.runtime.uffd import FaultWaker


class LazyPagesUnavailable(RuntimeBackendError):
    """The lazy-pages daemon did not start: nothing was restored, an eager restore can still run."""


class PodmanLazy(PodmanCLI):
    def lazy_checkpoint(
        self,
        name: str,
        archive: Path,
        address: str,
        port: int,
        *,
        tcp_established: bool = True,
        tls: tuple[str, ...] = (),
        criu: tuple[str, ...] = (),
    ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
        """Start a lazy-pages dump: CRIU dumps everything but the memory, then serves the pages from
        ``address:port`` until the target has them all (the returned process ends then).

        Podman only exports its archive at the very end, so the few MB the target needs now
        (config.dump, spec.dump, the CRIU images without pages, the root file system's changes) are
        packed into ``archive`` here from the container's own directory, the way podman would. The
        times name the dump's images and the container's process, which a prefetch reads
        (``agent.node_prefetch``) while CRIU keeps the tasks frozen."""
        # all read now: the checkpoint holds the container's lock till the end
        d = json.loads(self._run("container", "inspect", "--", name).stdout)[0]
        static, upper, cid = Path(d["StaticDir"]), Path(d["GraphDriver"]["Data"]["UpperDir"]), str(d["Id"])
        pid = str(d["State"]["Pid"])
        cgroup = freezer.cgroup_dir(int(pid)) if pid.isdigit() else None
        netstatus = network_status((d.get("NetworkSettings") or {}).get("Networks") or {})
        args = [
            "podman",
            "container",
            "checkpoint",
            "--export",
            str(archive) + ".full",
            "--compress",
            "none",
            "--keep",
            "--",
            name,
        ]
        if tcp_established:
            args.insert(3, "--tcp-established")
        else:  # connections that cannot follow (their address changes) are closed, not a failed dump
            criu += ("tcp-close",)
        times: dict[str, Any] = {"dump_started": time.time()}
        with (
            self.criu_options(
                "lazy-pages", f"address={address}", f"port={port}", *tls, *criu, container_id=cid
            ) as conf,
            freezer.freeze_when_opened(conf, cgroup) as early,
        ):
            # its own process group: a dump that never serves is killed whole (podman, runc, CRIU), or it
            # would hold the container's lock, and every podman command on the node behind it, forever
            proc = subprocess.Popen(
                args,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env=criu_conf.block_env(),
            )
            self.dumping[cid] = (proc, container_info(d, CHECKPOINTING))
            deadline = time.monotonic() + 600
            while not listening(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    if proc.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        out, errs = "", "timed out"
                    else:
                        out, errs = proc.communicate(timeout=10)
                    raise RuntimeBackendError(
                        f"lazy checkpoint of {name} on {self.node} did not start serving pages: "
                        f"{(errs or out).strip().splitlines()[-1:] or proc.returncode}",
                        details={"stderr": (errs or "")[-3000:], "criu_log": criu_log_tail(errs or "")},
                    )
                time.sleep(0.005)
        times["serving_at"] = time.time()
        if early:
            times.update(early.times)
        _rootfs_diff(upper, static)
        # what podman's export adds from its database and tmpfs: the addresses (so the copy keeps
        # them) and the contents of /dev/shm
        (static / "network.status").write_text(json.dumps(netstatus))
        if (static / "shm").is_dir():
            subprocess.run(
                ["tar", "-C", str(static / "shm"), "-cf", str(static / "devshm-checkpoint.tar"), "."],
                capture_output=True,
            )
        members = [
            m
            for m in (
                "config.dump",
                "spec.dump",
                "network.status",
                "checkpoint",
                "rootfs-diff.tar",
                "deleted.files",
                "devshm-checkpoint.tar",
            )
            if (static / m).exists()
        ]
        p = subprocess.run(["tar", "-C", str(static), "-cf", str(archive), *members], capture_output=True, text=True)
        if p.returncode:
            proc.kill()
            raise RuntimeBackendError(f"packing the lazy checkpoint of {name} failed: {p.stderr.strip()}")
        os.chmod(archive, 0o600)
        times["packed_at"] = time.time()
        times["images"], times["pid"] = str(static / "checkpoint"), int(pid) if pid.isdigit() else None
        opened = times.get("opened_at")
        if opened:  # the blackout breakdown's spans (engine.breakdown) on this node's clock
            times["timeline"] = [
                ["podman, runc: until CRIU dump", times["dump_started"], opened],
                ["CRIU dump (all but the memory)", opened, times["serving_at"]],
                ["packing the lazy archive", times["serving_at"], times["packed_at"]],
            ]
        return proc, times

    def skeleton(self, name: str) -> dict[str, Any]:
        """What a speculative restore of ``name`` needs from this node before the freeze
        (``runtime.speculative``): podman's configuration as an export writes it, runc's standard
        descriptors, the OCI spec, the addresses."""
        d = json.loads(self._run("container", "inspect", "--", name).stdout)[0]  # one podman command: ~40 ms
        cid = str(d["Id"])
        return {
            "config": speculative.read_config(cid),
            "descriptors": speculative.read_descriptors(cid),
            "spec": json.loads((Path(d["StaticDir"]) / "config.json").read_text()),
            "network": network_status((d.get("NetworkSettings") or {}).get("Networks") or {}),
        }

    def speculate(self, token: str, skeleton: dict[str, Any], where: Path, *, tcp_established: bool = True) -> Gate:
        """Start a speculative restore of ``skeleton`` that waits at gate ``token``."""
        return speculative.start(token, skeleton, where, tcp_established=tcp_established)

    def page_server(
        self, images: Path, address: str, port: int, *, tls: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]:
        """A CRIU page server writing the pages a dump sends into ``images``; returns once it listens."""
        images.mkdir(mode=0o700, exist_ok=True)
        server = subprocess.Popen(
            [
                "criu",
                "page-server",
                "-D",
                str(images),
                "--address",
                address,
                "--port",
                str(port),
                "-o",
                "page-server.log",
                "-v2",
                *(f"--{line}" for line in tls),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of the agent's process group: a group kill never reaches the agent
        )
        deadline = time.monotonic() + 10
        while not listening(port):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeBackendError(
                    f"criu page-server did not start on {self.node}",
                    details={"log": file_tail(images / "page-server.log")},
                )
            time.sleep(0.01)
        return server

    def lazy_restore(
        self,
        archive: Path,
        images: Path,
        work: Path,
        address: str | None,
        port: int | None,
        *,
        tcp_established: bool = True,
        wake_faults: bool = True,
        tls: tuple[str, ...] = (),
        action_script: str | None = None,
        gate: Gate | None = None,
        network: str = "keep",
    ) -> tuple[dict[str, Any], subprocess.Popen[bytes], FaultWaker | None]:
        """Restore with the memory left behind: a ``criu lazy-pages`` daemon fetches pages from the
        source at ``address:port`` as the process touches them (userfaultfd), and the rest in the
        background. Without an address the pages are here already, in ``images`` (a streamed dump's
        page server wrote them, each marked lazy-able by CRIU): the daemon copies them in from there,
        so the restore does not read the whole memory before the process runs. ``wake_faults``
        re-raises the faults the daemon drops (see ``runtime.uffd``). ``action_script``: a script
        CRIU runs at each step of the restore (``agent.node_prefetch``). ``gate``: a speculative
        restore waiting for these images (``runtime.speculative``), released instead of running
        podman's restore now; the caller cancels it when this fails."""
        started = time.time()
        images.mkdir(mode=0o700, exist_ok=True)
        work.mkdir(mode=0o700, exist_ok=True)
        # from the source, the daemon reads the pagemaps and never the pages (the pages a prefetch
        # made present are CRIU's restore's, read from podman's own copy): they stay packed
        skip = ["--exclude=checkpoint/pages-*.img"] if address else []
        p = subprocess.run(
            ["tar", "-C", str(images), "-xf", str(archive), *skip, "--strip-components=1", "checkpoint"],
            capture_output=True,
            text=True,
        )
        if p.returncode:
            raise RuntimeBackendError(f"unpacking the lazy checkpoint failed: {p.stderr.strip()}")
        try:
            for pagemap in images.glob("pagemap-*.img") if skip else ():  # CRIU opens their pages files all the same
                (images / f"pages-{read_pagemap(pagemap)[1]}.img").touch(0o600)
        except (OSError, ValueError, IndexError, KeyError):  # an image this reader does not know: unpack them
            subprocess.run(["tar", "-C", str(images), "-xf", str(archive), "--strip-components=1", "checkpoint"])
        daemon = subprocess.Popen(
            [
                "criu",
                "lazy-pages",
                *(["--page-server", "--address", address, "--port", str(port)] if address else []),
                "-D",
                str(images),
                "-W",
                str(work),
                "-o",
                "lazy-pages.log",
                "-v2",
                *(f"--{line}" for line in tls if address),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # out of the agent's process group: a group kill never reaches the agent
        )
        if gate is not None:  # while the daemon starts
            try:
                gate.place(archive)
            except Exception:  # the caller cancels the gate (agent.node_lazy)
                daemon.kill()
                daemon.wait()
                raise
        deadline = time.monotonic() + 30
        while not (work / "lazy-pages.socket").exists():
            if daemon.poll() is not None or time.monotonic() > deadline:
                daemon.kill()
                daemon.wait()
                raise LazyPagesUnavailable(
                    f"criu lazy-pages did not start on {self.node}",
                    details={"log": file_tail(work / "lazy-pages.log")},
                )
            time.sleep(0.005)
        waker = FaultWaker(daemon).start() if wake_faults else None
        hook: tuple[str, ...] = ()
        if action_script:
            (work / "action.sh").write_text(action_script)
            (work / "action.sh").chmod(0o700)
            hook = (f"action-script={work / 'action.sh'}",)
        # no --print-stats: with a work-dir override podman fails after CRIU restored the process
        args = ["container", "restore", "--import", str(archive), *restore_network(network)]
        if tcp_established:
            args.append("--tcp-established")
        else:  # connections that cannot follow (their address changes) come back closed
            hook += ("tcp-close",)
        t0 = time.time()
        try:
            with (
                # local pages: the archive holds none, CRIU reads the images where they are
                self.criu_options(
                    "lazy-pages",
                    f"work-dir={work}",
                    *(() if address else (f"images-dir={images}",)),
                    *hook,
                    run=gate.criu if gate else None,
                ) as conf,
                freezer.freeze_when_opened(conf, None) as noted,
            ):
                if gate is None:
                    self._run(*args, what="lazy restore")
                else:
                    gate.release()
                    rc, err = gate.finish()
                    if rc:
                        raise RuntimeBackendError(
                            f"podman's speculative restore failed on {self.node} (exit {rc}): {err.strip()[-500:]}",
                            details={"criu_log": criu_log_tail(err) or file_tail(work / "restore.log")},
                        )
        except Exception:
            daemon.kill()
            daemon.wait()
            if waker:
                waker.stop()
            raise
        ended = time.time()
        step = (
            "unpacking, placing at the gate, lazy-pages daemon start" if gate else "unpacking, lazy-pages daemon start"
        )
        timeline = [[step, started, t0]]
        timeline += criu_spans(
            "restore", t0, noted.times.get("opened_at") if noted else None, work / "restore.log", ended
        )
        return {"started": t0, "ended": ended, "stats": {}, "timeline": timeline}, daemon, waker


_PODMAN_FILES = {"etc/mtab", "run/.containerenv", "etc/hosts", "etc/hostname", "etc/resolv.conf"}


def network_status(nets: dict[str, Any]) -> dict[str, Any]:
    """The network.status podman writes into an export (netavark's status block), from inspect's
    ``NetworkSettings.Networks``."""
    return {
        net: {
            "interfaces": {
                "eth0": {
                    "subnets": [{"ipnet": f"{n['IPAddress']}/{n['IPPrefixLen']}", "gateway": n["Gateway"]}],
                    "mac_address": n["MacAddress"],
                }
            }
        }
        for net, n in nets.items()
        if n.get("IPAddress")
    }


def _rootfs_diff(upper: Path, bundle: Path) -> None:
    """Write rootfs-diff.tar and deleted.files into ``bundle`` from the overlay upper directory, as
    podman's export does: changed files as a tar, whiteouts (0:0 character devices) as a list."""
    import stat as st
    import tarfile

    added, deleted = [], []
    for root, dirs, files in os.walk(upper):
        for f in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, f)
            rel = os.path.relpath(path, upper)
            if rel in _PODMAN_FILES:
                continue
            info = os.lstat(path)
            if st.S_ISCHR(info.st_mode) and info.st_rdev == 0:
                deleted.append("/" + rel)
            else:
                added.append(rel)
    for f in ("rootfs-diff.tar", "deleted.files"):
        (bundle / f).unlink(missing_ok=True)
    if added:
        with tarfile.open(bundle / "rootfs-diff.tar", "w") as t:
            for rel in added:
                t.add(os.path.join(upper, rel), arcname=rel, recursive=False)
    if deleted:
        (bundle / "deleted.files").write_text(json.dumps(deleted))


def listening(port: int) -> bool:
    """Whether something listens on TCP ``port`` in this network namespace."""
    suffix = f":{port:04X}"
    with open("/proc/net/tcp") as f:
        return any(x.split()[1].endswith(suffix) and x.split()[3] == "0A" for x in f.readlines()[1:])
