"""Test doubles for the gateway's tests and benchmarks, not gateway code (as httpx keeps MockTransport).

`gateway.testing.standin` is a stand-in OpenAI-compatible upstream with fault injection and counters;
nothing on the request path imports this package.
"""
