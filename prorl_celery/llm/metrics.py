"""Prometheus metric families of the LLM backends, for ``prorl_celery.metrics`` (``/metrics``)."""
from __future__ import annotations

from collections.abc import Iterator

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from prorl_celery.llm.models import BackendStatus
from prorl_celery.llm.registry import BackendRegistry


def backend_metrics(client: redis.Redis) -> Iterator[Metric]:
    labels = ["backend", "address"]
    in_flight = GaugeMetricFamily("prorl_llm_in_flight", "Requests in flight per LLM backend", labels=labels)
    capacity = GaugeMetricFamily("prorl_llm_capacity", "Declared capacity per LLM backend", labels=labels)
    status = GaugeMetricFamily("prorl_llm_backend_status", "1 for the backend's current status",
                               labels=[*labels, "status"])
    served = CounterMetricFamily("prorl_llm_served", "Requests an LLM backend served", labels=labels)
    failures = CounterMetricFamily("prorl_llm_failures", "Failed requests per LLM backend", labels=labels)
    for backend in BackendRegistry(client).list():
        key = [backend.id, backend.address]
        in_flight.add_metric(key, backend.in_flight)
        capacity.add_metric(key, backend.capacity)
        served.add_metric(key, backend.served)
        failures.add_metric(key, backend.failures)
        for name in BackendStatus:
            status.add_metric([*key, name.value], 1.0 if backend.status is name else 0.0)
    yield from (in_flight, capacity, status, served, failures)
