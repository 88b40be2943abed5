"""The fault waker against a real userfaultfd: a handler that drops a fault (as CRIU's lazy-pages
daemon does when UFFDIO_COPY gets EAGAIN) leaves the faulting thread asleep until something wakes it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
import time

import pytest

from podmigrate.runtime.uffd import FaultWaker, userfaultfds

from .conftest import wait_for

# The child: one thread faults on a page registered with a userfaultfd (through libc's memset, so
# the GIL is released while it sleeps); its handler thread drops the first fault report, like CRIU
# after EAGAIN, and serves any later one. The child only finishes if its thread faults again.
CHILD = textwrap.dedent(
    """
    import ctypes, fcntl, mmap, os, struct, sys, threading
    libc = ctypes.CDLL(None, use_errno=True)
    uffd = libc.syscall(323, os.O_CLOEXEC)  # userfaultfd(2), x86-64
    assert uffd >= 0, ctypes.get_errno()
    fcntl.ioctl(uffd, 0xC018AA3F, bytearray(struct.pack("QQQ", 0xAA, 0, 0)))  # UFFDIO_API
    region = mmap.mmap(-1, 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    fcntl.ioctl(uffd, 0xC020AA00, bytearray(struct.pack("QQQQ", addr, 4096, 1, 0)))  # REGISTER, MISSING
    page = mmap.mmap(-1, 4096)
    page.write(b"x" * 4096)
    src = ctypes.addressof(ctypes.c_char.from_buffer(page))

    def say(line):  # one write(2) per line: two threads' print()s could interleave mid-line
        os.write(1, (line + "\\n").encode())

    def handler():
        faults = 0
        while True:
            msg = os.read(uffd, 32)
            if msg[0] != 0x12:  # UFFD_EVENT_PAGEFAULT
                continue
            faults += 1
            if faults == 1:
                say("dropped")
                continue
            fault = struct.unpack_from("Q", msg, 16)[0] & ~4095
            fcntl.ioctl(uffd, 0xC028AA03, bytearray(struct.pack("QQQQq", fault, src, 4096, 0, 0)))  # COPY
            say(f"served fault {faults}")
            return

    threading.Thread(target=handler, daemon=True).start()
    libc.memset(ctypes.c_void_p(addr + 100), 0x41, 1)
    say(" ".join(("done", region[100:101].decode(), region[0:1].decode())))
    os.close(uffd)  # like CRIU once every page has moved; the process lives on
    say("closed")
    sys.stdin.read()
    """
)

needs_uffd = pytest.mark.skipif(
    os.geteuid() != 0 or platform.machine() != "x86_64", reason="userfaultfd as root on x86-64"
)


def read_until(p: subprocess.Popen[str], want: str, timeout: float) -> list[str]:
    """Lines from the child up to one starting with ``want``; fail after ``timeout`` seconds."""
    assert p.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    os.set_blocking(p.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if line:
            lines.append(line.strip())
            if line.startswith(want):
                return lines
        elif p.poll() is not None:
            break
        else:
            time.sleep(0.01)
    raise AssertionError(f"no {want!r} from the child within {timeout}s: {lines}, exit {p.poll()}")


@needs_uffd
def test_a_dropped_fault_stalls_until_the_waker_makes_the_thread_fault_again() -> None:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        read_until(p, "dropped", 10)
        # nothing else will copy the page: the thread sleeps in the kernel for good
        assert p.poll() is None
        assert userfaultfds(p.pid), "the child holds a userfaultfd"
        waker = FaultWaker(p, interval=0.01).start()
        # the handler serves only a second report of the fault: the woken thread faulted again
        lines = read_until(p, "done", 10)
        assert lines[-1] == "done A x", lines
        # the waker gives its copy back once the handler closed the original: a userfaultfd keeps
        # the memory registered until its last copy is closed
        read_until(p, "closed", 10)
        wait_for(lambda: waker.status()["userfaultfds"] == 0, 10, "the waker to give its copy back")
        assert waker.status()["running"]
        assert p.stdin is not None
        p.stdin.close()
        p.wait(10)
        status = waker.stop()
        assert status["wakes"] >= 1 and status["error"] is None, status
    finally:
        p.kill()
        p.wait()
