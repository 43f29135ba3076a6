"""A TCP forwarder on 127.0.0.1 that a test opens and closes, to make a real database unreachable and back.

`TcpProxy(target_port).open()` listens on its port and forwards every connection to the target; `close()` stops
listening and resets every forwarded connection (what a database crash or a firewall reset looks like to the
gateway: connection refused until `open()` again, on the same port); `hold()` is a database that stopped answering
(a firewall dropping packets): open connections are reset, new ones are accepted and never answered, until
`release()`. Threads, no event loop: it works beside a gateway that runs its own loop in another thread or
process.
"""
from __future__ import annotations

import contextlib
import socket
import struct
import threading

from gateway.listen_address import free_port


class TcpProxy:
    def __init__(self, target_port: int, port: int = 0, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._holding = False
        self._held: list[socket.socket] = []

    def open(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True, name="tcp-proxy-accept").start()
        return self

    def close(self) -> None:
        """Refuse new connections and reset the open ones (RST, not FIN: the peer sees a broken connection)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
            conns += self._held
            self._held = []
        for conn in conns:
            _reset(conn)

    def hold(self) -> None:
        """Stop answering: reset forwarded connections; accept new ones but never forward or answer them."""
        self._holding = True
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            _reset(conn)

    def release(self) -> None:
        """Answer again (connections held meanwhile are reset: their clients gave up on them anyway)."""
        self._holding = False
        with self._lock:
            held, self._held = self._held, []
        for conn in held:
            _reset(conn)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            if self._holding:
                with self._lock:
                    self._held.append(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._listener is not listener:  # closed meanwhile
                    _reset(client)
                    _reset(upstream)
                    return
                self._conns.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True, name="tcp-proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            _reset(src)
            _reset(dst)


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a pump thread blocked in recv() on it
    with contextlib.suppress(OSError):
        sock.close()


