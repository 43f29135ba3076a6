"""What every benchmark records about where it ran, and a free loopback port (one copy for bench/)."""
from __future__ import annotations

import os
import platform
import socket
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (the figures depend on it), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
