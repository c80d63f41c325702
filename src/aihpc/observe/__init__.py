"""Around the trainer: Prometheus metrics, a Grafana dashboard, failed-job diagnosis
(``aihpc doctor``) and a node health check (``aihpc check``).

Imports ``aihpc.runspec`` and ``aihpc.perf`` only, never torch: the runtime imports
``aihpc.observe.metrics`` to export its metrics, and the benchmarks that ``aihpc check`` runs are
started by the CLI, which hands their JSON to ``aihpc.observe.check``.
"""

from aihpc.observe.metric_names import METRICS, metric_names
from aihpc.observe.metrics import (
    MetricsConfig,
    NullMetrics,
    TrainMetrics,
    open_train_metrics,
    predict,
)

__all__ = [
    "METRICS",
    "MetricsConfig",
    "NullMetrics",
    "TrainMetrics",
    "metric_names",
    "open_train_metrics",
    "predict",
]
