"""``GET /metrics``: the service's Prometheus series (``prometheus_client``, the serve extra)."""

from typing import Callable

try:  # the serve extra; without it the service runs and GET /metrics says what to install
    import prometheus_client
except ImportError:
    prometheus_client = None

# a POST /translate's outcomes: its status, or "abandoned" when its client went away
OUTCOMES = ("200", "400", "408", "413", "503", "504", "abandoned", "500")


class Metrics:
    """The service's series, in a registry of its own (one per application). ``queued`` and
    ``in_flight`` are read at each scrape: the batcher's queue length and positions in flight."""

    def __init__(self, max_batch: int, queued: Callable[[], int], in_flight: Callable[[], int]):
        p = prometheus_client
        self.registry = p.CollectorRegistry()
        r = self.registry
        self.requests = p.Counter(
            "hrt_serve_requests", "POST /translate requests answered, by outcome", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.latency = p.Histogram(
            "hrt_serve_request_seconds",
            "POST /translate: from the request's arrival to its answer",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.batch_size = p.Histogram(
            "hrt_serve_batch_sentences",
            "sentences per translated batch",
            buckets=tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < max_batch) + (max_batch,),
            registry=r,
        )
        self.queue = p.Gauge("hrt_serve_queue_requests", "requests waiting for a batch", registry=r)
        self.queue.set_function(queued)
        self.in_flight = p.Gauge(
            "hrt_serve_positions_in_flight", "decoder positions admitted and not yet answered", registry=r
        )
        self.in_flight.set_function(in_flight)
        self.stopped = p.Counter(
            "hrt_serve_stopped_batches", "batches stopped between two decoder steps: nobody waited for them", registry=r
        )
        self.sentences = p.Counter("hrt_serve_sentences", "sentences translated", registry=r)
        self.tokens = p.Counter("hrt_serve_source_tokens", "source tokens translated", registry=r)

    def count(self, outcome: str, seconds: float) -> None:
        """One POST /translate answered: its outcome and latency."""
        self.requests.labels(outcome if outcome in OUTCOMES else "500").inc()
        self.latency.observe(seconds)

    def batch(self, sources) -> None:
        """One batch translated: its sentences and source tokens."""
        self.batch_size.observe(len(sources))
        self.sentences.inc(len(sources))
        self.tokens.inc(sum(int(s.size) for s in sources))

    def text(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
