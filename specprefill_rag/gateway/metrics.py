"""Prometheus metrics of one gateway: requests by mode and status, TTFT and its parts, keep ratio,
and the draft's passage store (what it found, read anew, holds).

Each gateway has its own registry (two apps in one process never collide); ``/metrics``
serves it in the Prometheus text format. Names and labels are listed in docs/gateway.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..types import GenerationResult
from .text_mode import TextModeResult

__all__ = ["GatewayMetrics", "PassageStoreView"]

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class _StoreCounts(Protocol):
    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def disk_hits(self) -> int: ...


class _Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


class PassageStoreView(Protocol):
    """What the metrics read of the draft's passage store (``DraftModel.passages``)."""

    @property
    def counts(self) -> _StoreCounts: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def disk(self) -> _Sized | None: ...
    def __len__(self) -> int: ...


class _PassageStoreCollector(Collector):
    """The passage store's own counts, read when ``/metrics`` is scraped (the store keeps them)."""

    def __init__(self, store: PassageStoreView) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        store, counts = self.store, self.store.counts
        for name, value, what in (
                ("hits", counts.hits, "Passages the draft found read already (in memory or on disk), by requests "
                 "and warm calls"),
                ("disk_hits", counts.disk_hits, "Of the passages found, those read back from the store's disk tier"),
                ("misses", counts.misses, "Passages the draft did not hold and read anew (then kept)")):
            yield CounterMetricFamily(f"specprefill_gateway_passage_store_{name}", what, value=value)
        held = GaugeMetricFamily("specprefill_gateway_passage_store_bytes", "Bytes of passage readings the store "
                                 "holds, by tier: memory, disk", labels=["tier"])
        held.add_metric(["memory"], store.nbytes)
        held.add_metric(["disk"], store.disk.nbytes if store.disk is not None else 0)
        yield held
        yield GaugeMetricFamily("specprefill_gateway_passage_store_passages", "Passage readings held in memory",
                                value=len(store))


class GatewayMetrics:
    """Counters, gauges and histograms of one gateway."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "specprefill_gateway_requests", "Requests answered, by endpoint, requested mode and HTTP status "
            "(499: the client went away first)", ["endpoint", "mode", "status"], registry=r,
        )
        self.in_flight = Gauge("specprefill_gateway_requests_in_flight",
                               "Requests admitted: running or waiting (bounded by --max-queue)", registry=r)
        self.running = Gauge("specprefill_gateway_requests_running", "Requests generating now", registry=r)
        # Histograms are labelled by what ran: "text" in text mode, else "specprefill" when the prompt
        # was pruned, else "full".
        self.ttft = Histogram("specprefill_gateway_ttft_seconds", "Time to first token (request start in the engine)",
                              ["mode"], buckets=_SECONDS, registry=r)
        self.draft = Histogram("specprefill_gateway_draft_seconds", "Draft scoring time of pruned prompts",
                               buckets=_SECONDS, registry=r)
        self.prefill = Histogram("specprefill_gateway_prefill_seconds", "Main-model prefill time",
                                 ["mode"], buckets=_SECONDS, registry=r)
        self.keep_ratio = Histogram("specprefill_gateway_keep_ratio", "Prefilled share of the prompt's tokens",
                                    ["mode"], buckets=_RATIOS, registry=r)
        self.tokens = Counter("specprefill_gateway_tokens", "Tokens by kind: prompt, prefilled, generated",
                              ["kind"], registry=r)
        self.paths = Counter("specprefill_gateway_paths", "Answered requests by the path they took: pruned, or "
                             "prefilled whole and why (GenerationResult.path: full_mode, short_prompt, "
                             "keeps_everything, draft_cannot_read, draft_slower)", ["path"], registry=r)
        self.fallbacks = Counter("specprefill_gateway_text_fallbacks", "Planned requests answered in text mode "
                                 "because their upstream had no SpecPrefill plugin (--fallback-text-mode)", registry=r)
        self.memo_hits = Counter("specprefill_gateway_draft_memo_hits", "Pruned prompts whose draft scores came "
                                 "from the engine's memo (an identical request before): the draft did not run",
                                 registry=r)

    def watch_passages(self, store: PassageStoreView) -> None:
        """Report the draft's passage store (its counts and bytes, read at each scrape)."""
        self.registry.register(_PassageStoreCollector(store))

    def finished(self, endpoint: str, mode: str, status: int, result: GenerationResult | None = None) -> None:
        """Count one answered request; a complete ``result`` also feeds the histograms."""
        self.requests.labels(endpoint, mode, str(status)).inc()
        if result is None:
            return
        ran = "text" if isinstance(result, TextModeResult) else "specprefill" if result.plan.speculated else "full"
        self.paths.labels(result.path.code).inc()
        timings = result.timings
        self.ttft.labels(ran).observe(timings.ttft_s)
        self.prefill.labels(ran).observe(timings.prefill_s)
        if result.draft_memo_hit:
            self.memo_hits.inc()
        elif timings.draft_s is not None:
            self.draft.observe(timings.draft_s)
        self.keep_ratio.labels(ran).observe(result.keep_ratio)
        self.tokens.labels("prompt").inc(result.prompt_tokens)
        self.tokens.labels("prefilled").inc(result.prefilled_tokens)
        self.tokens.labels("generated").inc(result.generated_tokens)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
