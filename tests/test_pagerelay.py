"""The sealed page relay between two agents (transport.pagerelay), on loopback with stand-ins for
CRIU's two ends: a dump that sends a request, waits for its answer, sends pages, flushes and waits
again, and a page server that answers each request and hashes what it was sent."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from podmigrate.errors import UsageError
from podmigrate.transport import pagerelay, seal

KEY = seal.new_key()
PAGES = os.urandom(5 * seal.FRAME + 12345)  # more than a few frames, not a whole number of them


def _recv_all(sk: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = sk.recv(n - len(out))
        if not b:
            break
        out += b
    return bytes(out)


class PageServer:
    """Answers "OPEN" with "ok", then counts and hashes everything up to "FLUSH", answers with the digest."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.got = hashlib.sha256()
        self.n = 0
        self.error: str | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sk, _ = self.listener.accept()
        with sk:
            if _recv_all(sk, 4) != b"OPEN":
                self.error = "no OPEN"
                return
            sk.sendall(b"ok")
            (size,) = struct.unpack(">Q", _recv_all(sk, 8))
            data = _recv_all(sk, size)
            self.n = len(data)
            self.got.update(data)
            if _recv_all(sk, 5) != b"FLUSH":
                self.error = "no FLUSH"
                return
            sk.sendall(self.got.digest())
            if sk.recv(1):  # the dump closes first
                self.error = "bytes after FLUSH"


def dump(port: int) -> bytes:
    """What CRIU's dump does on the wire: request, answer, pages, flush, answer; returns the last answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sk:
        sk.sendall(b"OPEN")
        assert _recv_all(sk, 2) == b"ok"
        sk.sendall(struct.pack(">Q", len(PAGES)))
        for i in range(0, len(PAGES), 65536):
            sk.sendall(PAGES[i : i + 65536])
        sk.sendall(b"FLUSH")
        return _recv_all(sk, 32)


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_pages_and_answers_cross_sealed_and_arrive_whole() -> None:
    ps = PageServer()
    target = pagerelay.TargetRelay("cp1", KEY, "127.0.0.1", ps.port, accept_seconds=30)
    source = pagerelay.SourceRelay("cp1", KEY, ("127.0.0.1", target.port), accept_seconds=30)
    assert dump(source.port) == hashlib.sha256(PAGES).digest()
    assert source.wait(30) and target.wait(30)
    ps.thread.join(30)
    assert ps.error is None and ps.n == len(PAGES)
    assert source.error is None and target.error is None
    assert source.bytes[pagerelay.TO_TARGET] == len(PAGES) + 4 + 8 + 5
    assert target.bytes[pagerelay.TO_TARGET] == source.bytes[pagerelay.TO_TARGET]
    assert source.bytes[pagerelay.TO_SOURCE] == target.bytes[pagerelay.TO_SOURCE] == 2 + 32


def test_the_source_connects_from_the_address_the_target_lets_in() -> None:
    """A host whose agent listens on an address its kernel would not choose to connect from (a second
    address on the interface): the target relay lets in only the source's agent address."""
    ps = PageServer()
    target = pagerelay.TargetRelay("cp6", KEY, "127.0.0.1", ps.port, accept_seconds=30, peer="127.0.0.2")
    unbound = pagerelay.SourceRelay("cp6", KEY, ("127.0.0.1", target.port), accept_seconds=30)
    with pytest.raises((AssertionError, OSError)):
        dump(unbound.port)  # it connects from 127.0.0.1: dropped, and the dump fails
    wait_until(lambda: len(target.dropped) == 1, "the wrong address to be dropped")
    assert target.dropped == ["127.0.0.1: not the source (127.0.0.2)"]
    source = pagerelay.SourceRelay("cp6", KEY, ("127.0.0.1", target.port), accept_seconds=30, source="127.0.0.2")
    assert dump(source.port) == hashlib.sha256(PAGES).digest()
    assert source.wait(30) and target.wait(30) and target.error is None and ps.n == len(PAGES)


class Tap:
    """A man in the middle between the relays: forwards everything, flipping byte ``flip`` (counted
    from the start of the sealed stream) if given."""

    def __init__(self, to: int, flip: int | None = None) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.to, self.flip = self.listener.getsockname()[1], to, flip
        self.seen = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        a, _ = self.listener.accept()
        b = socket.create_connection(("127.0.0.1", self.to))

        def back() -> None:
            with contextlib.suppress(OSError):
                while data := b.recv(65536):
                    a.sendall(data)
                a.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=back, daemon=True)
        t.start()
        with contextlib.suppress(OSError):
            while data := bytearray(a.recv(65536)):
                at = len(self.seen)
                if self.flip is not None and at <= self.flip < at + len(data):
                    data[self.flip - at] ^= 0x01
                self.seen += data
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)
        t.join(30)  # as a TCP proxy does: when the target's side is gone, so is the source's
        a.close()
        b.close()


def test_the_wire_holds_no_plaintext() -> None:
    ps = PageServer()
    target = pagerelay.TargetRelay("cp2", KEY, "127.0.0.1", ps.port, accept_seconds=30)
    tap = Tap(target.port)
    source = pagerelay.SourceRelay("cp2", KEY, ("127.0.0.1", tap.port), accept_seconds=30)
    assert dump(source.port) == hashlib.sha256(PAGES).digest()
    assert source.wait(30) and target.wait(30)
    assert len(tap.seen) > len(PAGES)
    assert PAGES[1000:1064] not in tap.seen and b"FLUSH" not in tap.seen


def test_a_changed_byte_is_refused_and_the_dump_fails() -> None:
    ps = PageServer()
    target = pagerelay.TargetRelay("cp3", KEY, "127.0.0.1", ps.port, accept_seconds=30)
    tap = Tap(target.port, flip=seal.HEADER + 4 + seal.FRAME // 2 + 3 * seal.FRAME)  # inside a later frame
    source = pagerelay.SourceRelay("cp3", KEY, ("127.0.0.1", tap.port), accept_seconds=30)
    with pytest.raises((AssertionError, OSError)):
        assert dump(source.port) == hashlib.sha256(PAGES).digest()
    wait_until(lambda: not target.running(), "the target relay to stop")
    assert target.error is not None and "does not authenticate" in target.error
    ps.thread.join(30)
    assert ps.n < len(PAGES) or ps.error is not None  # the page server never got the whole dump


def test_a_stranger_is_dropped_and_the_real_source_still_gets_in() -> None:
    ps = PageServer()
    target = pagerelay.TargetRelay("cp4", KEY, "127.0.0.1", ps.port, accept_seconds=30)
    with socket.create_connection(("127.0.0.1", target.port)) as stranger:
        stranger.sendall(seal.MAGIC + os.urandom(16) + struct.pack(">I", 32) + os.urandom(32))
        wait_until(lambda: len(target.dropped) == 1, "the stranger to be dropped")
    # another migration's key: its first frame does not open here either
    other = pagerelay.SourceRelay("cp4", seal.new_key(), ("127.0.0.1", target.port), accept_seconds=30)
    with pytest.raises((AssertionError, OSError)):
        dump(other.port)
    wait_until(lambda: len(target.dropped) == 2, "the wrong key to be dropped")
    assert "does not authenticate" in target.dropped[1]
    assert other.wait(30) and other.error is not None
    source = pagerelay.SourceRelay("cp4", KEY, ("127.0.0.1", target.port), accept_seconds=30)
    assert dump(source.port) == hashlib.sha256(PAGES).digest()
    assert target.wait(30) and target.error is None and ps.n == len(PAGES)


def test_a_source_relay_whose_target_is_gone_fails_the_dump_with_the_reason() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        gone = s.getsockname()[1]
    source = pagerelay.SourceRelay("cp5", KEY, ("127.0.0.1", gone), accept_seconds=30)
    with pytest.raises((AssertionError, OSError)):
        dump(source.port)
    assert source.wait(30)
    assert source.error is not None and f"127.0.0.1:{gone}" in source.error


def test_a_bad_key_is_refused_before_anything_listens() -> None:
    with pytest.raises(UsageError, match="64 hex digits"):
        seal.check_key("abc")
    with pytest.raises(UsageError, match="64 hex digits"):
        seal.check_key("z" * 64)
    with pytest.raises(UsageError):
        seal.check_key(None)


def test_only_the_source_node_gets_in_and_a_trickling_stranger_does_not_hold_the_door(monkeypatch: Any) -> None:
    monkeypatch.setattr(pagerelay, "HANDSHAKE_SECONDS", 0.5)
    ps = PageServer()
    elsewhere = pagerelay.TargetRelay("cp6", KEY, "127.0.0.1", ps.port, accept_seconds=30, peer="127.0.0.2")
    with socket.create_connection(("127.0.0.1", elsewhere.port)) as s:
        s.sendall(seal.MAGIC)
        wait_until(lambda: len(elsewhere.dropped) == 1, "the stranger to be dropped")
    assert elsewhere.dropped[0] == "127.0.0.1: not the source (127.0.0.2)"
    elsewhere.close()
    target = pagerelay.TargetRelay("cp7", KEY, "127.0.0.1", PageServer().port, accept_seconds=30, peer="127.0.0.1")
    with socket.create_connection(("127.0.0.1", target.port)) as slow:
        slow.sendall(seal.MAGIC[:2])  # then nothing more: the handshake's time runs out, not per byte
        wait_until(lambda: len(target.dropped) == 1, "the trickling stranger to be dropped", timeout=10)
    source = pagerelay.SourceRelay("cp7", KEY, ("127.0.0.1", target.port), accept_seconds=30)
    assert dump(source.port) == hashlib.sha256(PAGES).digest()
    assert target.wait(30) and target.error is None


def test_a_relay_that_breaks_on_a_bug_cuts_both_ends_at_once_and_says_why(monkeypatch: Any) -> None:
    """What happened when a node's cryptography lacked a method the relay called: the sealing thread
    died, and CRIU's dump waited on an open connection until the target gave up."""

    def broken(self: Any, data: Any, final: bool = False) -> Any:
        raise AttributeError("no such method")

    monkeypatch.setattr(seal.Sealer, "frame_parts", broken)
    ps = PageServer()
    target = pagerelay.TargetRelay("cp7", KEY, "127.0.0.1", ps.port, accept_seconds=30)
    source = pagerelay.SourceRelay("cp7", KEY, ("127.0.0.1", target.port), accept_seconds=30)
    with pytest.raises((AssertionError, OSError)):
        dump(source.port)  # the dump sees its connection cut, rather than hanging
    assert source.wait(30)
    assert source.error is not None and "AttributeError: no such method" in source.error
