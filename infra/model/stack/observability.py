"""The metrics pipeline: where metrics go, how long they stay, how big the volume is."""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from serving.spec import SpecModel


class MetricsStack(str, Enum):
    # Prometheus Operator, Prometheus, Alertmanager and Grafana in the cluster (default).
    KUBE_PROMETHEUS_STACK = "kube-prometheus-stack"
    # The same in-cluster Prometheus (scrapes, rules, Alertmanager) remote-writing to an Amazon
    # Managed Service for Prometheus workspace; dashboards go to your Amazon Managed Grafana.
    AMAZON_MANAGED_PROMETHEUS = "amazon-managed-prometheus"


class Observability(SpecModel):
    """The metrics pipeline: where metrics go, how long they stay, how big the volume is."""

    stack: MetricsStack = MetricsStack.KUBE_PROMETHEUS_STACK
    retention_days: int = Field(default=15, ge=1, le=365)
    storage_gib: int = Field(default=100, ge=20, le=16384, alias="storageGiB")
    scrape_interval_seconds: int = Field(default=30, ge=5, le=300)
    pending_alert_minutes: int = Field(default=15, ge=1, le=240)

    @property
    def retention_size_gb(self) -> int:
        # Prometheus deletes the oldest blocks past this size; the rest of the volume holds
        # the WAL and compaction's scratch space (Prometheus storage docs).
        return int(self.storage_gib * 2**30 * 0.8 / 1e9)


class ObservabilityKeys(SpecModel):
    """Metrics, dashboards and alerts."""

    observability: Observability = Field(default_factory=Observability)
