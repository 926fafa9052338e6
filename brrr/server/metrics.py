"""Prometheus metrics, named like vLLM's with a `brrr:` prefix, each labelled with the served model name; the ones
vLLM has are also exported under vLLM's own `vllm:` names (VLLM_NAMES), because aiperf, guidellm and the vLLM
Grafana dashboards scrape those exact names. Both: renaming brrr's would break its own dashboards and `brrr bench`;
the copies are made at scrape time only, so serving pays nothing for them.

Engine state (running/waiting requests, KV cache usage, prefix-cache and token counters, preemptions) is read from
`AsyncLLM.stats()` at scrape time: the engine's stats as of its latest step, which every step message carries.
Per-request latencies are histograms the server observes as outputs stream back. Each app gets its own registry,
so several servers can live in one process (tests).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from brrr.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _geometric(low: float, high: float, per_decade: int = 4) -> list[float]:
    """Bucket bounds from low to high, `per_decade` steps per factor of ten (1, 1.8, 3.2, 5.6, 10, ...)."""
    bounds, k = [], 0
    while (b := low * 10 ** (k / per_decade)) <= high * 1.0001:
        bounds.append(float(f"{b:.3g}"))
        k += 1
    return bounds


LATENCY_BUCKETS = _geometric(0.001, 1000)  # 1 ms .. 1000 s
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]


# vLLM's metric names (its v1 engine), which brrr's `brrr:` families mirror one for one
VLLM_NAMES = frozenset((
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens", "request_success"))


class _VllmNames:
    """The `brrr:` families vLLM also has, copied under `vllm:` when scraped."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self):
        for family in self.source.collect():
            name = family.name.removeprefix("brrr:")
            if name not in VLLM_NAMES:
                continue
            copy = Metric("vllm:" + name, family.documentation, family.type, family.unit)
            copy.samples = [sample._replace(name="vllm:" + sample.name.removeprefix("brrr:"))
                            for sample in family.samples]
            yield copy


class _EngineCollector:
    """Gauges and cumulative counters straight from the engine's own bookkeeping (anything with `stats()`)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s, label = self.engine.stats(), [self.model_name]
        gauges = (("num_requests_running", "Sequences in the running batch.", s["num_requests_running"]),
                  ("num_requests_waiting", "Sequences queued for their first (or, after preemption, next) step.",
                   s["num_requests_waiting"]),
                  ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s["kv_cache_usage"]))
        counters = (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["prefix_cache_queries"]),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["prefix_cache_hits"]),
                    ("num_preemptions", "Sequences preempted (KV freed and recomputed later, or swapped to host).",
                     s["num_preemptions"]),
                    ("prompt_tokens", "Prompt tokens prefilled (prefix-cache hits excluded).", s["prompt_tokens"]),
                    ("generation_tokens", "Tokens generated.", s["generation_tokens"]))
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"brrr:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        if "spec_decode_num_drafts" in s:  # speculative decoding (vLLM's spec_decode_* names)
            counters += (
                ("spec_decode_num_drafts", "Verified runs with at least one draft token.", s["spec_decode_num_drafts"]),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
                 s["spec_decode_num_draft_tokens"]),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s["spec_decode_num_accepted_tokens"]))
        if "kv_transfers" in s:  # disaggregated prefill/decode: the prompts' KV moved to the decode instance
            counters += (
                ("kv_transfers", "Prompts whose KV blocks came from a prefill instance.", s["kv_transfers"]),
                ("kv_transfer_bytes", "Bytes of KV blocks received from prefill instances.", s["kv_transfer_bytes"]),
                ("kv_transfer_seconds", "Seconds from each pull to its KV in place, summed.",
                 s["kv_transfer_seconds"]))
            gauges = (("prefill_instances_alive", "Prefill instances in service.", s["prefill_instances_alive"]),
                      ("num_requests_prefilling", "Requests at a prefill instance or waiting for their KV pull.",
                       s["num_requests_prefilling"]))
            for name, doc, value in gauges:
                family = GaugeMetricFamily(f"brrr:{name}", doc, labels=["model_name"])
                family.add_metric(label, value)
                yield family
        for name, doc, value in counters:
            family = CounterMetricFamily(f"brrr:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        if "spec_decode_num_accepted_tokens_per_pos" in s:
            family = CounterMetricFamily("brrr:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the run.",
                                         labels=["model_name", "position"])
            for position, value in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                family.add_metric(label + [str(position)], value)
            yield family


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        registry = CollectorRegistry()  # brrr's own families
        registry.register(_EngineCollector(engine, model_name))
        self.registry = CollectorRegistry(auto_describe=False)  # what /metrics shows: brrr's, then vLLM's names
        self.registry.register(registry)
        self.registry.register(_VllmNames(registry))

        def histogram(name, doc, buckets):
            return Histogram(f"brrr:{name}", doc, ["model_name"], buckets=buckets, registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive outputs of a request.",
                             LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish, finished requests.", LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled step.", LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.output_len = histogram("request_generation_tokens", "Tokens generated per finished request (all n).",
                                    TOKEN_BUCKETS)
        self._success = Counter("brrr:request_success", "Finished requests, by why the first sample stopped.",
                                ["model_name", "finished_reason"], registry=registry)
        self._aborted = Counter("brrr:request_aborted", "Requests ended early: client gone, error or shutdown.",
                                ["model_name"], registry=registry).labels(model_name)
        self.model_name = model_name

    def request_tracker(self) -> "RequestTracker":
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one engine request's outputs as they arrive."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics, self.last_output_time, self.done = metrics, None, False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        steps = max((len(c.delta_token_ids) for c in out.outputs), default=0)  # a sample gains 1 token per step
        if steps:
            # Outputs of steps the server fell behind on arrive merged: one gap per step, the time split evenly.
            # Gaps run from the previous output, or for a merged first output from the engine's first token.
            if self.last_output_time is None:
                start, gaps = out.metrics.first_token_time, steps - 1
            else:
                start, gaps = self.last_output_time, steps
            if gaps and start is not None:
                gap = max(0.0, now - start) / gaps
                for _ in range(gaps):
                    self.metrics.itl.observe(gap)
            self.last_output_time = now
        m = out.metrics
        if out.finished and out.error is None:
            self.done = True
            if m.first_token_time is not None:
                self.metrics.ttft.observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.metrics.queue.observe(m.first_scheduled_time - m.arrival_time)
            self.metrics.e2e.observe((m.finish_time or now) - m.arrival_time)
            self.metrics.prompt_len.observe(len(out.prompt_token_ids))
            self.metrics.output_len.observe(sum(len(c.token_ids) for c in out.outputs))
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.metrics._success.labels(self.metrics.model_name, reason or "unknown").inc()

    def close(self) -> None:
        if not self.done:
            self.metrics._aborted.inc()
