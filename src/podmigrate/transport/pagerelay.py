"""The memory pages of a streamed dump, sealed by the agents instead of by CRIU's own TLS.

CRIU's page server protocol is a request/answer stream; with ``--tls`` CRIU reads the pages into a
user buffer and sends them as 16 KB GnuTLS records, and the page server takes them record by record:
on a 2-core node that was 3.1 s of a 1 GB dump, against 1.2 s in the clear (issue 13's note). Here
CRIU talks in the clear to this node's loopback only (workloads are in their own network namespaces
and never see it), and the two agents carry the stream between the nodes sealed with the migration's
key (``transport.seal``: AES-256-GCM, up to 1 MiB per frame, each direction its own derived key, a
cut or changed stream refused):

    source CRIU dump -> 127.0.0.1:p  [Relay, source]  ==sealed==>  [Relay, target] node:q
                                                                   -> 127.0.0.1:r CRIU page-server

The target's listener opens the first frame of each connection before it connects the page server,
so a stranger that connects first is dropped and the source's stream still gets in. Runs in node
agents (standard library plus ``cryptography``).
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable

from podmigrate.errors import TransportError
from podmigrate.transport import seal

TO_TARGET, TO_SOURCE = "pages", "pages-answers"  # the two directions' contexts, after the checkpoint id
ACCEPT_SECONDS = 300.0  # how long a target relay waits for its source (the page server's own lifetime)
HANDSHAKE_SECONDS = 10.0  # for a connection's header and first frame, all told


def _recv_exact(sk: socket.socket, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = sk.recv_into(view[got:])
        if not n:
            break
        got += n
    return got


def _send_parts(sk: socket.socket, parts: tuple[bytes, bytes]) -> None:
    """Send both parts, in one system call when the socket takes them at once."""
    word, body = parts
    sent = sk.sendmsg([word, body])
    if sent < len(word):
        sk.sendall(word[sent:])
        sent = len(word)
    if sent - len(word) < len(body):
        sk.sendall(memoryview(body)[sent - len(word) :])


def _pump_sealing(plain: socket.socket, sealed: socket.socket, sealer: seal.Sealer, clean: Callable[[], bool]) -> int:
    """Plaintext from ``plain`` to ``sealed`` as frames: as much as has arrived, up to a frame, so
    a short request goes at once and a run of pages in full frames; the final frame at EOF, and
    only if ``clean()`` (an end the relay caused by failing must not look like a complete stream)."""
    buf = bytearray(seal.FRAME)
    view = memoryview(buf)
    total = 0
    sealed.sendall(sealer.header())
    while True:
        n = plain.recv_into(view)
        if not n:
            if not clean():
                raise OSError("the relay failed: no final frame")
            sealed.sendall(sealer.frame(b"", final=True))
            with contextlib.suppress(OSError):
                sealed.shutdown(socket.SHUT_WR)
            return total
        while n < seal.FRAME:  # what else has arrived already, without waiting for more
            try:
                k = plain.recv_into(view[n:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if not k:
                break
            n += k
        _send_parts(sealed, sealer.frame_parts(view[:n]))
        total += n


def _pump_opening(sealed: socket.socket, plain: socket.socket, opener: seal.Opener, first: bytes = b"") -> int:
    """Frames from ``sealed``, opened, to ``plain``, until the final frame; ``first``: the
    plaintext of a frame already opened."""
    buf = bytearray(seal.FRAME + seal.TAG)
    word = bytearray(4)
    total = len(first)
    if first:
        plain.sendall(first)
    while not opener.done:
        if _recv_exact(sealed, memoryview(word)) < 4:
            raise opener._refuse("cut off before its final frame")
        n, final = opener.length(bytes(word))
        view = memoryview(buf)[:n]
        if _recv_exact(sealed, view) < n:
            raise opener._refuse("cut off before its final frame")
        data = opener.open(view, final)
        if data:
            plain.sendall(data)
            total += len(data)
    with contextlib.suppress(OSError):
        plain.shutdown(socket.SHUT_WR)
    return total


class Relay:
    """One direction pair between a plaintext connection and a sealed one, in two threads; ``error``
    says what went wrong (a refused stream, a connection lost), ``bytes`` what went each way."""

    def __init__(self, cid: str, key: str, what: str):
        self.cid, self.key, self.what = cid, key, what
        self.error: str | None = None
        self.bytes = {TO_TARGET: 0, TO_SOURCE: 0}
        self.started: float | None = None
        self.ended: float | None = None
        self._socks: list[socket.socket] = []
        self._closed = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def context(self, direction: str) -> str:
        return f"{self.cid}/{direction}"

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
            print(f"page relay {self.cid} ({self.what}): {why}", file=sys.stderr, flush=True)
        self.close()

    def close(self) -> None:
        """Cut every connection: CRIU on either end sees its peer gone and fails."""
        self._closed = True
        for sk in self._socks:
            with contextlib.suppress(OSError):
                sk.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sk.close()

    def _run(
        self,
        plain: socket.socket,
        sealed: socket.socket,
        out: str,
        back: str,
        first: bytes = b"",
        opener: seal.Opener | None = None,
    ) -> None:
        """Pump ``out`` (plain -> sealed) here and ``back`` (sealed -> plain) in a second thread."""
        self.started = self.started or time.time()
        opener = opener or seal.Opener(self.key, self.context(back), f"the {back} of checkpoint {self.cid}")

        def backward() -> None:
            try:
                if opener.aead is None:
                    header = bytearray(seal.HEADER)
                    if _recv_exact(sealed, memoryview(header)) < seal.HEADER:
                        raise opener._refuse("no seal header")
                    opener.start(bytes(header))
                self.bytes[back] = _pump_opening(sealed, plain, opener, first)
            except (OSError, TransportError) as e:
                self._fail(str(e))
            except Exception as e:  # a bug must still cut both connections, or CRIU waits for its peer
                self._fail(f"relaying the {back}: {type(e).__name__}: {e}")

        t = threading.Thread(target=backward, name=f"relay-{self.cid}-{back}", daemon=True)
        t.start()
        try:
            sealer = seal.Sealer(self.key, self.context(out))
            self.bytes[out] = _pump_sealing(plain, sealed, sealer, lambda: self.error is None)
        except OSError as e:
            self._fail(f"sending the {out}: {e}")
        except Exception as e:
            self._fail(f"sending the {out}: {type(e).__name__}: {e}")
        t.join()
        self.ended = time.time()
        self.close()
        self._done.set()

    def wait(self, timeout: float) -> bool:
        """Whether the relay ended within ``timeout`` seconds."""
        return self._done.wait(timeout)

    def running(self) -> bool:
        return self._thread is not None and not self._done.is_set()


class SourceRelay(Relay):
    """Listens on this node's loopback for CRIU's dump and relays it to the target relay at
    ``target`` (address, port) from ``source``, this node's address the target lets in (a host's
    agent may listen on an address that is not the one its kernel would choose). ``port`` goes into
    CRIU's ``page-server`` options."""

    def __init__(
        self, cid: str, key: str, target: tuple[str, int], accept_seconds: float = 60.0, source: str | None = None
    ):
        super().__init__(cid, key, "source")
        self.target, self.source = target, source
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(accept_seconds)
        self.port = int(self.listener.getsockname()[1])
        self._socks.append(self.listener)
        self._thread = threading.Thread(target=self._serve, name=f"relay-{cid}-source", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            plain, _ = self.listener.accept()
            self.listener.close()
            self._socks.append(plain)
            sealed = socket.create_connection(self.target, 10, (self.source, 0) if self.source else None)
            sealed.settimeout(None)
            plain.settimeout(None)
            sealed.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks.append(sealed)
        except OSError as e:
            self._fail(f"connecting CRIU's dump to the target's relay at {self.target[0]}:{self.target[1]}: {e}")
            self._done.set()
            return
        self._run(plain, sealed, TO_TARGET, TO_SOURCE)


class TargetRelay(Relay):
    """Listens on ``address`` (the node's LAN address) for the source relay at ``peer`` (other
    addresses are hung up on unread) and relays its stream, once its first frame opened, to the CRIU
    page server at 127.0.0.1:``page_server``."""

    def __init__(
        self,
        cid: str,
        key: str,
        address: str,
        page_server: int,
        accept_seconds: float = ACCEPT_SECONDS,
        peer: str | None = None,
    ):
        super().__init__(cid, key, "target")
        self.page_server, self.peer = page_server, peer
        self.listener = socket.create_server((address, 0))
        self.deadline = time.monotonic() + accept_seconds
        self.address, self.port = address, int(self.listener.getsockname()[1])
        self.dropped: list[str] = []
        self._socks.append(self.listener)
        self._thread = threading.Thread(target=self._serve, name=f"relay-{cid}-target", daemon=True)
        self._thread.start()

    def _first_frame(self, sk: socket.socket) -> tuple[seal.Opener, bytes]:
        """Open the stream's header and first frame within HANDSHAKE_SECONDS, or refuse the connection."""
        opener = seal.Opener(self.key, self.context(TO_TARGET), f"the pages of checkpoint {self.cid}")
        until = time.monotonic() + HANDSHAKE_SECONDS  # all of it: a trickling stranger does not hold the door

        def read(n: int, why: str) -> bytearray:
            buf, got = bytearray(n), 0
            while got < n:
                sk.settimeout(max(0.01, until - time.monotonic()))
                k = sk.recv_into(memoryview(buf)[got:])
                if not k:
                    raise opener._refuse(why)
                got += k
            return buf

        opener.start(bytes(read(seal.HEADER, "no seal header")))
        n, final = opener.length(bytes(read(4, "cut off before its first frame")))
        first = opener.open(memoryview(read(n, "cut off in its first frame")), final)
        sk.settimeout(None)
        return opener, first

    def _serve(self) -> None:
        try:
            while True:
                if self._closed:
                    raise TransportError("the relay was stopped")
                self.listener.settimeout(max(0.01, self.deadline - time.monotonic()))
                sealed, (host, _port) = self.listener.accept()
                if self.peer is not None and host != self.peer:
                    self.dropped.append(f"{host}: not the source ({self.peer})")
                    sealed.close()
                    continue
                self._socks.append(sealed)
                try:
                    opener, first = self._first_frame(sealed)
                    break
                except (OSError, TransportError) as e:
                    self.dropped.append(f"{host}: {e}")
                    print(f"page relay {self.cid}: dropped {host}: {e}", file=sys.stderr, flush=True)
                    self._socks.remove(sealed)
                    sealed.close()
            self.listener.close()
            sealed.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            plain = socket.create_connection(("127.0.0.1", self.page_server), timeout=10)
            plain.settimeout(None)
            self._socks.append(plain)
        except (OSError, TransportError) as e:
            self._fail(f"waiting for the source's pages: {e}")
            self._done.set()
            return
        self._run(plain, sealed, TO_SOURCE, TO_TARGET, first, opener)
