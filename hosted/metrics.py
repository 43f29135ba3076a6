"""Prometheus metrics of the engine server, in a registry of its own (one per app, so tests can run many).

Latency histograms are observed per request by the server; engine gauges (running/waiting requests,
KV blocks, prefix-cache hit rate, busy fraction, speculative-decoding totals) are read from the AsyncLLMEngine
when /metrics is scraped.
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from hosted.async_llm_engine import AsyncLLMEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# Request outcomes counted in switchyard_engine_requests_total{status=...}.
STATUSES = ("success", "invalid", "not_found", "overloaded", "aborted", "error")


class EngineMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "switchyard_engine_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the first)",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "request_latency_seconds", "Time from request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter(p + "requests", "Requests by outcome", ["status"], registry=r)
        for status in STATUSES:
            self.requests.labels(status=status)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge(p + "requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_used = Gauge(p + "kv_blocks_used", "KV cache blocks held by live sequences", registry=r)
        self.kv_free = Gauge(p + "kv_blocks_free", "KV cache blocks free (including unreferenced prefix-cache blocks)", registry=r)
        self.kv_total = Gauge(p + "kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens looked up",
                                     registry=r)
        self.prefix_hit_tokens = Gauge(p + "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache "
                                       "since start", registry=r)
        self.prefix_query_tokens = Gauge(p + "prefix_cache_query_tokens", "Prompt tokens looked up in the prefix "
                                         "cache since start", registry=r)
        self.busy_fraction = Gauge(p + "busy_fraction",
                                   "Seconds spent in forward passes / wall seconds, over the busy window",
                                   registry=r)
        # Cumulative busy time, so that a scraper can measure utilisation over any interval it likes
        # (the gateway records it per minute as the engine's paid-versus-busy time).
        self.busy_seconds = Counter(p + "busy_seconds", "Seconds spent in forward passes and sampling since start",
                                    registry=r)
        self._busy_seen = 0.0
        self.preemptions = Gauge(p + "preemptions", "Sequences preempted (recomputed) since start", registry=r)
        self.ready = Gauge(p + "ready", "1 once the model is loaded", registry=r)
        # What the engine runs on, so the gateway's ledger says cpu or gpu from the engine, not from how the
        # policy happens to price it.
        self.device_info = Gauge(p + "device_info", "1 for the kind of device the model runs on (cpu | gpu)",
                                 ["kind", "device"], registry=r)
        self._device_seen = False
        # The precision the model was loaded at (hosted/precision.py): weights bfloat16 | float32 | int8 | int4-g32 …
        self.precision_info = Gauge(p + "precision_info", "1 for the precision the model runs at, and who chose it",
                                    ["weights", "dtype", "chosen_by"], registry=r)
        # Speculative decoding: counters advanced by the engine's totals at each scrape.
        self.spec_proposed = Counter(p + "spec_proposed_tokens", "Draft tokens verified by the target model",
                                     registry=r)
        self.spec_accepted = Counter(p + "spec_accepted_tokens", "Draft tokens accepted (kept as output)",
                                     registry=r)
        self.spec_acceptance = Gauge(p + "spec_acceptance_rate", "Draft tokens accepted / verified, since start",
                                     registry=r)
        self._spec_seen = (0, 0)
        # KV tiers (hosted/kv_tiers.py), per tier: host | disk.
        self.kv_tier_blocks = Gauge(p + "kv_tier_blocks", "KV blocks held in a lower tier", ["tier"], registry=r)
        self.kv_tier_hits = Counter(p + "kv_tier_restored_blocks", "KV blocks restored from a lower tier",
                                    ["tier"], registry=r)
        self.kv_tier_bytes = Counter(p + "kv_tier_bytes", "Bytes moved into (demoted) and out of (restored) a "
                                     "lower tier", ["tier", "direction"], registry=r)
        self.kv_tier_restore_seconds = Counter(p + "kv_tier_restore_seconds", "Seconds spent restoring KV blocks",
                                               ["tier"], registry=r)
        self.kv_disk_enabled = Gauge(p + "kv_disk_tier_enabled", "1 while the KV disk tier is on (0: off after an "
                                     "error, or none configured)", registry=r)
        self.kv_disk_errors = Gauge(p + "kv_disk_tier_errors", "Disk errors that turned the KV disk tier off",
                                    registry=r)
        self.kv_disk_rejected = Gauge(p + "kv_disk_tier_rejected_files", "KV block files removed as foreign, "
                                      "truncated or corrupted", registry=r)
        self._tiers_seen: dict[tuple[str, str], float] = {}

    def observe_request(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def set_precision(self, weights: str, dtype: str, chosen_by: str) -> None:
        self.precision_info.clear()
        self.precision_info.labels(weights=weights, dtype=dtype, chosen_by=chosen_by).set(1)

    def _observe_device(self, engine: AsyncLLMEngine) -> None:
        device = getattr(getattr(engine, "engine", None), "device", None)
        if self._device_seen or device is None:
            return
        self.device_info.labels(kind=device_kind(str(getattr(device, "type", device))), device=str(device)).set(1)
        self._device_seen = True

    def render(self, engine: AsyncLLMEngine | None) -> bytes:
        """Refresh the engine gauges and return the exposition text."""
        self.ready.set(1 if engine is not None and engine.alive else 0)
        if engine is not None:
            self._observe_device(engine)
            s = engine.stats()
            self.running.set(s.num_running)
            self.waiting.set(engine.num_waiting)
            self.kv_total.set(s.kv_blocks_total)
            self.kv_free.set(s.kv_blocks_free)
            self.kv_used.set(s.kv_blocks_total - s.kv_blocks_free)
            self.prefix_hit_rate.set(s.prefix_hit_tokens / s.prefix_queries_tokens if s.prefix_queries_tokens else 0.0)
            self.prefix_hit_tokens.set(s.prefix_hit_tokens)
            self.prefix_query_tokens.set(s.prefix_queries_tokens)
            self.busy_fraction.set(engine.utilisation())
            self.busy_seconds.inc(max(0.0, s.busy_seconds - self._busy_seen))
            self._busy_seen = max(self._busy_seen, s.busy_seconds)
            self.preemptions.set(s.num_preemptions)
            seen_proposed, seen_accepted = self._spec_seen
            self.spec_proposed.inc(max(0, s.spec_proposed_tokens - seen_proposed))
            self.spec_accepted.inc(max(0, s.spec_accepted_tokens - seen_accepted))
            self._spec_seen = (max(seen_proposed, s.spec_proposed_tokens), max(seen_accepted, s.spec_accepted_tokens))
            self.spec_acceptance.set(s.spec_accepted_tokens / s.spec_proposed_tokens if s.spec_proposed_tokens else 0.0)
            if s.kv_tiers is not None:
                self._observe_tiers(s.kv_tiers)
        return generate_latest(self.registry)


    def _observe_tiers(self, tiers: dict) -> None:
        """Advance the tier counters by what the engine's totals grew since the last scrape."""
        def advance(counter, key: tuple[str, str], total: float) -> None:
            counter.inc(max(0.0, total - self._tiers_seen.get(key, 0.0)))
            self._tiers_seen[key] = max(self._tiers_seen.get(key, 0.0), total)

        for tier in ("host", "disk"):
            t = tiers[tier]
            self.kv_tier_blocks.labels(tier=tier).set(t["blocks"])
            advance(self.kv_tier_hits.labels(tier=tier), (tier, "hits"), t["hits"])
            advance(self.kv_tier_bytes.labels(tier=tier, direction="in"), (tier, "in"), t["bytes_in"])
            advance(self.kv_tier_bytes.labels(tier=tier, direction="out"), (tier, "out"), t["bytes_out"])
            advance(self.kv_tier_restore_seconds.labels(tier=tier), (tier, "s"), t["restore_seconds"])
        self.kv_disk_enabled.set(1 if tiers["disk"]["enabled"] else 0)
        self.kv_disk_errors.set(tiers["disk"]["errors"])
        self.kv_disk_rejected.set(tiers["disk"]["rejected"])


def device_kind(device_type: str) -> str:
    """'cpu' for a torch device type of cpu, 'gpu' for an accelerator (cuda, hip, xpu, mps)."""
    return "cpu" if device_type == "cpu" else "gpu"
