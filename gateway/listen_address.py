"""Where `switchyard serve` listens: --host and --port checked as the command line is read, and the listening
socket bound before anything announces the gateway ready (a port in use is a one-line error, not a banner
followed by an exit). Standard library only: the CLI's parser imports it."""
from __future__ import annotations

import argparse
import errno
import ipaddress
import re
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the one helper tests, benchmarks and embedded engines
    use)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def port_arg(text: str) -> int:
    """argparse type for --port: a whole number from 1 to 65535."""
    try:
        port = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 65535, not {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be from 1 to 65535, not {port}")
    return port


def host_arg(text: str) -> str:
    """argparse type for --host: an IPv4/IPv6 address or a hostname (resolved when the socket is bound)."""
    host = text.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if len(host) <= 253 and _HOSTNAME.fullmatch(host) and not host.replace(".", "").isdigit():
        return host
    raise argparse.ArgumentTypeError(f"must be an IP address (e.g. 127.0.0.1, 0.0.0.0, ::) or a hostname, "
                                     f"not {text!r}")


class BindError(Exception):
    """The address cannot be listened on; the message is one line naming host and port."""


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it). BindError says why not, in one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
        sock.bind((host, port))
        sock.set_inheritable(True)
    except OSError as exc:
        sock.close()
        shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        reason = exc.strerror or str(exc)
        hint = f" (another process is listening on port {port})" if exc.errno == errno.EADDRINUSE else ""
        raise BindError(f"cannot listen on {shown}: {reason}{hint}") from None
    return sock
