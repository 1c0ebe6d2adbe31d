"""The server's Prometheus metrics (specrt/server/app.py's /metrics): latencies, finished requests and tokens, KV reuse
and speculation counters under vLLM's names with our prefix."""

from __future__ import annotations

from ..runtime.generate import Stats


class Metrics:
    """Prometheus figures (when prometheus-client is installed): time to first token, end-to-end latency,
    requests by finish reason, tokens. A registry per app, so two apps in one process do not collide."""

    @classmethod
    def create(cls):
        try:
            import prometheus_client as prom
        except ImportError:
            return None
        m = cls()
        m.prom, m.registry = prom, prom.CollectorRegistry()
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        m.ttft = prom.Histogram("specrt_time_to_first_token_seconds", "From the request's arrival to its first token "
                                "(queue, prefill and first round)", buckets=buckets, registry=m.registry)
        m.e2e = prom.Histogram("specrt_request_latency_seconds", "Whole generation", buckets=buckets,
                               registry=m.registry)
        m.queue = prom.Histogram("specrt_request_queue_time_seconds", "Waiting for the engine", buckets=buckets,
                                 registry=m.registry)
        m.itl = prom.Histogram("specrt_inter_token_latency_seconds", "Between streamed text deltas",
                               buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
                               registry=m.registry)
        m.cancel = prom.Histogram("specrt_cancel_latency_seconds", "From a client's disconnect to the engine free",
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
                                  registry=m.registry)
        # KV reuse, under vLLM's names (vllm:prefix_cache_queries / _hits, in prompt tokens) with our prefix
        m.prefix_queries = prom.Counter("specrt:prefix_cache_queries", "Prompt tokens looked up in the KV cache",
                                        registry=m.registry)
        m.prefix_hits = prom.Counter("specrt:prefix_cache_hits", "Prompt tokens found in the KV cache (not prefilled)",
                                     registry=m.registry)
        m.kept = prom.Gauge("specrt_prefix_cache_kept_sequences", "Sequences kept on the host besides the engine's",
                            registry=m.registry)
        m.kept_bytes = prom.Gauge("specrt_prefix_cache_kept_bytes", "Host bytes of the kept sequences (--cache-ram)",
                                  registry=m.registry)
        m.requests = prom.Counter("specrt_requests", "Finished generations", ["finish_reason"], registry=m.registry)
        m.tokens = prom.Counter("specrt_generated_tokens", "New tokens", registry=m.registry)
        # speculation, under vLLM's names (vllm:spec_decode_*) with our prefix
        m.drafts = prom.Counter("specrt:spec_decode_num_drafts", "Rounds that drafted", registry=m.registry)
        m.drafts_by_source = prom.Counter("specrt:spec_decode_num_drafts_per_source", "Rounds that drafted, by "
                                          "drafter (auto's choice each round)", ["source"], registry=m.registry)
        m.draft_tokens = prom.Counter("specrt:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                      registry=m.registry)
        m.accepted = prom.Counter("specrt:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                  registry=m.registry)
        m.accepted_pos = prom.Counter("specrt:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by draft position", ["position"], registry=m.registry)
        return m

    def observe(self, st: Stats, store=None) -> None:
        if st.new_tokens:
            self.ttft.observe(st.queue_s + st.ttft_s)
        self.e2e.observe(st.total_s)
        if st.finish_reason == "cancelled" and st.cancel_s:
            self.cancel.observe(st.cancel_s)
        self.prefix_queries.inc(st.prompt_tokens)
        self.prefix_hits.inc(st.cached_tokens)
        if store is not None:
            self.kept.set(len(store))
            self.kept_bytes.set(store.nbytes)
        self.requests.labels(st.finish_reason).inc()
        self.tokens.inc(st.new_tokens)
        for source, n in st.drafted_by_source.items():
            self.drafts_by_source.labels(source).inc(n)
        drafted = list(st.drafted_by_position)
        if drafted:
            # kept counts from the rates: exact while a position was drafted in < 10^4 rounds (4-decimal rates)
            kept = [round(a * d) for a, d in zip(st.acceptance_by_position, drafted)]
            self.drafts.inc(drafted[0])
            self.draft_tokens.inc(sum(drafted))
            self.accepted.inc(sum(kept))
            for i, k in enumerate(kept):
                self.accepted_pos.labels(str(i)).inc(k)

    def render(self):
        from fastapi.responses import Response

        return Response(self.prom.generate_latest(self.registry), media_type=self.prom.CONTENT_TYPE_LATEST)
