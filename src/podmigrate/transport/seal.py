"""Checkpoints sealed for one migration: AES-256-GCM in 1 MiB frames, authenticated end to end.

The controller makes a 32-byte key per migration and gives it only to the two agents (over their
owner-only sockets); it is never written to a record or a log. Each sealed stream derives its own key
(HKDF-SHA256 over the migration key, a random salt in the stream's header and the stream's *context*,
e.g. ``migration-id/checkpoint-id``), so no nonce is ever used twice and a stream cannot be replayed as
another. Frame ``i`` uses nonce ``i`` and authenticates ``(i, final)``: a changed byte, a dropped,
duplicated or reordered frame, a cut-off end, or a stream from another migration or for another
checkpoint all fail to open. Layout::

    header   b"PMSEAL1\\n" | salt (16)
    frame    length (4, big-endian; top bit = final frame) | ciphertext + tag (16)

Used by ``transport.stream`` (agent to agent) and ``transport.oci`` (the registry layer, so an image at
rest is ciphertext). Needs ``cryptography`` (the node image has python3-cryptography).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from podmigrate.errors import TransportError

MAGIC = b"PMSEAL1\n"
SALT = 16
TAG = 16
HEADER = len(MAGIC) + SALT
FRAME = 1 << 20
_FINAL = 0x80000000
KEY_BYTES = 32


def new_key() -> str:
    """A migration's key, as the hex string that travels in agent requests."""
    return os.urandom(KEY_BYTES).hex()


def _aead(key_hex: str, salt: bytes, context: str) -> AESGCM:
    key = bytes.fromhex(key_hex)
    if len(key) != KEY_BYTES:
        raise TransportError("a migration key must be 32 bytes (64 hex digits)")
    derived = HKDF(hashes.SHA256(), 32, salt, b"podmigrate seal v1 " + context.encode()).derive(key)
    return AESGCM(derived)


def _nonce(i: int) -> bytes:
    return struct.pack(">4xQ", i)


def _aad(context: str, i: int, final: bool) -> bytes:
    return context.encode() + struct.pack(">QB", i, final)


def sealed_size(plain: int) -> int:
    """The sealed length of ``plain`` bytes cut into FRAME-sized frames (a Content-Length)."""
    frames = plain // FRAME + 1  # the last frame is shorter (or empty) and marked final
    return HEADER + plain + frames * (4 + TAG)


def seal(blocks: Iterator[bytes], key_hex: str, context: str) -> Iterator[bytes]:
    """Seal a stream of blocks (any sizes) into frames; yields bytes ready to send."""
    salt = os.urandom(SALT)
    aead = _aead(key_hex, salt, context)
    yield MAGIC + salt
    buf = bytearray()
    i = 0
    for block in blocks:
        buf += block
        while len(buf) > FRAME:  # keep a remainder: the final frame must be the last one
            chunk = bytes(buf[:FRAME])
            del buf[:FRAME]
            yield struct.pack(">I", len(chunk) + TAG) + aead.encrypt(_nonce(i), chunk, _aad(context, i, False))
            i += 1
    if len(buf) == FRAME:  # sealed_size counts an empty final frame after a full one
        chunk = bytes(buf)
        yield struct.pack(">I", FRAME + TAG) + aead.encrypt(_nonce(i), chunk, _aad(context, i, False))
        i += 1
        buf.clear()
    ct = aead.encrypt(_nonce(i), bytes(buf), _aad(context, i, True))
    yield struct.pack(">I", (len(ct)) | _FINAL) + ct


class Opener:
    """Opens a sealed stream fed in pieces of any size; ``feed`` returns the plaintext so far,
    ``close`` fails unless the final frame arrived and nothing followed it."""

    def __init__(self, key_hex: str, context: str, what: str):
        self.key_hex, self.context, self.what = key_hex, context, what
        self.buf = bytearray()
        self.aead: AESGCM | None = None
        self.i = 0
        self.done = False

    def _refuse(self, why: str) -> TransportError:
        return TransportError(
            f"{self.what} is not sealed for this migration ({why}); refusing to restore from it",
            hint="it was tampered with, cut short, or comes from another migration",
        )

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = bytearray()
        if self.aead is None:
            if len(self.buf) < HEADER:
                return b""
            if bytes(self.buf[: len(MAGIC)]) != MAGIC:
                raise self._refuse("no seal header")
            self.aead = _aead(self.key_hex, bytes(self.buf[len(MAGIC) : HEADER]), self.context)
            del self.buf[:HEADER]
        while len(self.buf) >= 4:
            if self.done:
                raise self._refuse("bytes after the final frame")
            (word,) = struct.unpack(">I", self.buf[:4])
            final, n = bool(word & _FINAL), word & ~_FINAL
            if n < TAG or n > FRAME + TAG:
                raise self._refuse(f"a frame of {n} bytes")
            if len(self.buf) < 4 + n:
                break
            ct = bytes(self.buf[4 : 4 + n])
            del self.buf[: 4 + n]
            try:
                out += self.aead.decrypt(_nonce(self.i), ct, _aad(self.context, self.i, final))
            except InvalidTag as e:
                raise self._refuse(f"frame {self.i} does not authenticate") from e
            self.i += 1
            self.done = final
        return bytes(out)

    def close(self) -> None:
        if not self.done:
            raise self._refuse("cut off before its final frame")
        if self.buf:
            raise self._refuse("bytes after the final frame")


def open_all(blocks: Iterator[bytes], key_hex: str, context: str, what: str) -> Iterator[bytes]:
    opener = Opener(key_hex, context, what)
    for block in blocks:
        if out := opener.feed(block):
            yield out
    opener.close()
