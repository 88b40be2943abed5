"""nftables commands run in this process through libnftables (ctypes; standard library only).

What ``nft -f -`` does, without starting a process: the nft router's switch is one nftables
transaction inside every cutover's blackout, and starting ``nft`` for it took 6-20 ms here (the
breakdown's "LAN: route switch"). One context per process, used under a lock (libnftables
contexts are not thread-safe); where the library cannot be loaded, ``run`` runs ``nft`` itself.
"""

from __future__ import annotations

import ctypes
import threading

from podmigrate.errors import RoutingError
from podmigrate.routing import run as run_command

_JSON = 1 << 4  # NFT_CTX_OUTPUT_JSON (libnftables.h)


class Nft:
    def __init__(self, library: str = "libnftables.so.1"):
        lib = ctypes.CDLL(library)
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        for f in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, f).argtypes = [ctypes.c_void_p]
            getattr(lib, f).restype = ctypes.c_int
        for f in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, f).argtypes = [ctypes.c_void_p]
            getattr(lib, f).restype = ctypes.c_char_p
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise OSError("nft_ctx_new failed")
        lib.nft_ctx_buffer_output(ctx)
        lib.nft_ctx_buffer_error(ctx)
        self.lib, self.ctx, self.lock = lib, ctx, threading.Lock()

    def run(self, commands: str, json: bool = False) -> str:
        with self.lock:
            self.lib.nft_ctx_output_set_flags(self.ctx, _JSON if json else 0)
            rc = self.lib.nft_run_cmd_from_buffer(self.ctx, commands.encode())
            out = (self.lib.nft_ctx_get_output_buffer(self.ctx) or b"").decode()
            err = (self.lib.nft_ctx_get_error_buffer(self.ctx) or b"").decode()
        if rc:
            raise RoutingError(f"nft {commands.strip()!r} failed: {err.strip()}")
        return out


_nft: Nft | None = None
_loaded = False
_guard = threading.Lock()


def run(commands: str, json: bool = False) -> str:
    """Run nftables ``commands`` (one transaction); their output (JSON with ``json``)."""
    global _nft, _loaded
    with _guard:
        if not _loaded:
            _loaded = True
            try:
                _nft = Nft()
            except (OSError, AttributeError):  # no libnftables here: the nft command does the same
                _nft = None
    if _nft is not None:
        return _nft.run(commands, json)
    return run_command(["nft", *(["-j"] if json else []), "-f", "-"], commands)
