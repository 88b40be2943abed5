"""The sidecar (the study's envoy): forwards a public port to the server over loopback TCP.

Runs in the same pod (network namespace) as stream-server. Environment: LISTEN (0.0.0.0:8000),
UPSTREAM (127.0.0.1:8090). Each client connection gets one upstream loopback connection; these are
the connections that single-container checkpointing severs.
"""

import contextlib
import os
import signal
import socket
import threading

HOST, _, PORT = os.environ.get("LISTEN", "0.0.0.0:8000").rpartition(":")
UP_HOST, _, UP_PORT = os.environ.get("UPSTREAM", "127.0.0.1:8090").rpartition(":")


def pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def serve(client: socket.socket) -> None:
    try:
        upstream = socket.create_connection((UP_HOST, int(UP_PORT)), timeout=5)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    other = threading.Thread(target=pipe, args=(client, upstream), daemon=True)
    other.start()
    pipe(upstream, client)
    other.join()
    # closed, not only shut down: a finished connection left as an fd is one CRIU must dump as a
    # connected TCP socket, and a restore without --tcp-established then refuses the whole image
    client.close()
    upstream.close()


# As PID 1 of its container the sidecar would ignore SIGTERM (no default action for PID 1): a pod's
# deletion would wait out its whole grace period (30 s: what a cold restart measured) before SIGKILL
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
srv = socket.create_server((HOST, int(PORT)), reuse_port=True)
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
