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

from podmigrate.errors import TransportError, UsageError

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


def check_key(key: object) -> str:
    """A request's seal key, or a UsageError saying what a key is."""
    what = f"a seal key is {2 * KEY_BYTES} hex digits ({KEY_BYTES} bytes)"
    if not isinstance(key, str) or len(key) != 2 * KEY_BYTES:
        raise UsageError(what)
    try:
        bytes.fromhex(key)
    except ValueError:
        raise UsageError(what) from None
    return key


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


class Sealer:
    """Seals one stream frame by frame: ``header()`` first, then ``frame()`` per piece (at most
    FRAME bytes), the last one with ``final=True``. For streams that cannot wait for a full frame
    (``transport.pagerelay``'s request/answer traffic); ``seal`` below cuts a stream into full ones."""

    def __init__(self, key_hex: str, context: str):
        self.context, self.salt = context, os.urandom(SALT)
        self.aead = _aead(key_hex, self.salt, context)
        self.i = 0

    def header(self) -> bytes:
        return MAGIC + self.salt

    def frame(self, data: bytes | memoryview, final: bool = False) -> bytes:
        word, ct = self.frame_parts(data, final)
        return word + ct

    def frame_parts(self, data: bytes | memoryview, final: bool = False) -> tuple[bytes, bytes]:
        """A frame as its length word and its ciphertext, for a vectored send (no 1 MiB join)."""
        if len(data) > FRAME:
            raise ValueError(f"a sealed frame holds at most {FRAME} bytes")
        ct = self.aead.encrypt(_nonce(self.i), data, _aad(self.context, self.i, final))
        self.i += 1
        return struct.pack(">I", len(ct) | (_FINAL if final else 0)), ct


def seal(blocks: Iterator[bytes], key_hex: str, context: str) -> Iterator[bytes]:
    """Seal a stream of blocks (any sizes) into frames; yields bytes ready to send."""
    s = Sealer(key_hex, context)
    yield s.header()
    buf = bytearray()
    for block in blocks:
        buf += block
        while len(buf) > FRAME:  # keep a remainder: the final frame must be the last one
            chunk = bytes(buf[:FRAME])
            del buf[:FRAME]
            yield s.frame(chunk)
    if len(buf) == FRAME:  # sealed_size counts an empty final frame after a full one
        yield s.frame(bytes(buf))
        buf.clear()
    yield s.frame(bytes(buf), final=True)


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

    def start(self, header: bytes) -> None:
        """Take the stream's header (HEADER bytes)."""
        if header[: len(MAGIC)] != MAGIC or len(header) != HEADER:
            raise self._refuse("no seal header")
        self.aead = _aead(self.key_hex, bytes(header[len(MAGIC) :]), self.context)

    def length(self, word: bytes) -> tuple[int, bool]:
        """The sealed length of the frame a 4-byte length word announces, and whether it is final."""
        if self.done:
            raise self._refuse("bytes after the final frame")
        (n,) = struct.unpack(">I", word)
        final, n = bool(n & _FINAL), n & ~_FINAL
        if n < TAG or n > FRAME + TAG:
            raise self._refuse(f"a frame of {n} bytes")
        return n, final

    def open(self, ct: bytes | memoryview, final: bool) -> bytes:
        """The plaintext of the next frame (its ciphertext and tag, without the length word)."""
        assert self.aead is not None, "start() first"
        try:
            out = self.aead.decrypt(_nonce(self.i), ct, _aad(self.context, self.i, final))
        except InvalidTag as e:
            raise self._refuse(f"frame {self.i} does not authenticate") from e
        self.i += 1
        self.done = final
        return out

    def feed(self, data: bytes) -> bytes:
        # frames are opened from a view of the buffer, which is cut once per call (a bytearray cut
        # at its front moves nothing): a sealed upload's frames are copied once, by the decryption
        self.buf += data
        view = memoryview(self.buf)
        pos = 0
        out: list[bytes] = []
        try:
            if self.aead is None:
                if len(view) < HEADER:
                    return b""
                self.start(bytes(view[:HEADER]))
                pos = HEADER
            while len(view) - pos >= 4:
                n, final = self.length(bytes(view[pos : pos + 4]))
                if len(view) - pos < 4 + n:
                    break
                out.append(self.open(view[pos + 4 : pos + 4 + n], final))
                pos += 4 + n
        finally:
            view.release()
        del self.buf[:pos]  # not after a refusal: its traceback still holds a view of the buffer
        return out[0] if len(out) == 1 else b"".join(out)

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
