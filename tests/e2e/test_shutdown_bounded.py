"""Shutdown finishes within 30 s in every state (issue 30, item 8): a real `switchyard serve` whose database
never answers (a TCP proxy that accepts and holds every connection: the worst case, each attempt waits for its
timeout) and whose data directory is a read-only tmpfs (nothing can be spooled), after it served requests and
with a stream still open, exits within 30 s of SIGTERM."""
from __future__ import annotations

import threading

import httpx
import openai

from gateway.testing.standin import standin_control
from gateway.testing.tcp_proxy import TcpProxy
from tests.e2e.conftest import free_port, wait_http
from tests.e2e.test_serve_start import MASTER, POLICY, Serve
from tests.gateway.test_ledger_faults import remount_read_only, tmpfs


def test_sigterm_with_the_database_black_holed_and_the_data_dir_read_only_exits_within_30_s(standin, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(standin=standin))
    database = TcpProxy(target_port=5432).open()
    database.hold()  # connections accepted, never answered
    with tmpfs(tmp_path / "data", "1m") as data_dir:
        remount_read_only(data_dir)
        port = free_port()
        serve = Serve(tmp_path, "--policy", str(policy), "--port", str(port), "--database-url",
                      f"postgresql://postgres@127.0.0.1:{database.port}/test")
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=90)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=MASTER, max_retries=0,
                                   timeout=30)
            for _ in range(5):
                reply = client.chat.completions.create(model="local", max_tokens=3,
                                                       messages=[{"role": "user", "content": "hi"}])
                assert reply.choices[0].message.content
            streamed = list(client.chat.completions.create(
                model="local", max_tokens=3, stream=True, messages=[{"role": "user", "content": "hi"}]))
            assert streamed
            # One stream still open at SIGTERM: the upstream sends two tokens, then nothing.
            standin_control(standin, fault="hang", fault_next=1)
            opened = threading.Event()

            def hanging_stream() -> None:
                try:
                    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                                      headers={"authorization": f"Bearer {MASTER}"},
                                      json={"model": "local", "stream": True, "max_tokens": 50,
                                            "messages": [{"role": "user", "content": "hi"}]}) as response:
                        for _ in response.iter_lines():
                            opened.set()
                except httpx.HTTPError:
                    pass

            holder = threading.Thread(target=hanging_stream, daemon=True)
            holder.start()
            assert opened.wait(30), serve.output
            took = serve.stop(timeout=60)
        finally:
            serve.kill()
            database.close()
    print(f"SIGTERM -> exit with the database black-holed, the data dir read-only and a stream open: {took:.1f} s")
    assert took < 30, serve.output
    out = serve.output
    # The one traceback allowed is uvicorn's report of the stream it cut after the drain (DRAIN_S).
    assert out.count("Traceback") == out.count("timeout graceful shutdown exceeded") - 1, out
    assert "closing a part failed" not in out, out
