"""An OpenAI-compatible upstream on 127.0.0.1 that refuses every model request with one fixed error body (what
an engine or a provider answers a client's bad request with: 400 context_length_exceeded and the like).
The shared stand-in (gateway/testing/standin.py) injects failures without a `code`; this one sends the code."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def refusing_upstream(status: int = 400, code: str | None = "context_length_exceeded",
                      message: str = "the prompt is longer than this model's context length of 512 tokens",
                      param: str | None = "messages") -> Iterator[str]:
    """Its /v1 base URL; every POST gets `status` with OpenAI's error body (`code`, `param`)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": code}}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
