"""The observability block: where metrics go, how long they stay, and how requests are traced."""

from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from serving.spec import SpecModel


class MetricsStack(str, Enum):
    # Prometheus Operator, Prometheus, Alertmanager and Grafana in the cluster (default).
    KUBE_PROMETHEUS_STACK = "kube-prometheus-stack"
    # The same in-cluster Prometheus (scrapes, rules, Alertmanager) remote-writing to an Amazon
    # Managed Service for Prometheus workspace; dashboards go to your Amazon Managed Grafana.
    AMAZON_MANAGED_PROMETHEUS = "amazon-managed-prometheus"


# Share of requests traced when `observability.tracing.sampleRate` is not set, by `environment`:
# every request in dev (little traffic, traces are the debugging tool), one in ten in staging,
# one in a hundred in prod (Ray Serve's own default ratio, RAY_SERVE_TRACING_SAMPLING_RATIO
# = 0.01 in ray/serve/_private/constants.py, Ray 2.60).
DEFAULT_TRACE_SAMPLE_RATES = {"dev": 1.0, "staging": 0.1, "prod": 0.01}


class Tracing(SpecModel):
    """Request traces: Ray Serve's spans and vLLM's, through an OpenTelemetry collector into
    Grafana Tempo (traces kept in an encrypted S3 bucket). See docs/observability.md."""

    enabled: bool = True
    # Share of requests whose trace is kept (0 < rate <= 1); a request that arrives with a
    # sampled W3C `traceparent` is always kept. None: DEFAULT_TRACE_SAMPLE_RATES by environment.
    sample_rate: float | None = Field(default=None, gt=0, le=1)
    # How long Tempo keeps a trace (its compactor's block_retention; the bucket expires objects
    # a day later as a backstop).
    retention_days: int = Field(default=14, ge=1, le=90)

    @model_validator(mode="after")
    def _off_means_no_rate(self) -> Tracing:
        if not self.enabled and self.sample_rate is not None:
            raise ValueError("sampleRate is set but tracing is off (enabled: false): remove one of them")
        return self

    def rate_for(self, environment: str) -> float:
        """The sampling ratio this stack traces with (its own, or its environment's default)."""
        return self.sample_rate if self.sample_rate is not None else DEFAULT_TRACE_SAMPLE_RATES[environment]


class Observability(SpecModel):
    """The metrics pipeline (where metrics go, how long they stay, how big the volume is) and
    request tracing."""

    stack: MetricsStack = MetricsStack.KUBE_PROMETHEUS_STACK
    retention_days: int = Field(default=15, ge=1, le=365)
    storage_gib: int = Field(default=100, ge=20, le=16384, alias="storageGiB")
    scrape_interval_seconds: int = Field(default=30, ge=5, le=300)
    pending_alert_minutes: int = Field(default=15, ge=1, le=240)
    tracing: Tracing = Field(default_factory=Tracing)

    @property
    def retention_size_gb(self) -> int:
        # Prometheus deletes the oldest blocks past this size; the rest of the volume holds
        # the WAL and compaction's scratch space (Prometheus storage docs).
        return int(self.storage_gib * 2**30 * 0.8 / 1e9)


class ObservabilityKeys(SpecModel):
    """Metrics, dashboards and alerts."""

    observability: Observability = Field(default_factory=Observability)
