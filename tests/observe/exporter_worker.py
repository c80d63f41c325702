"""One rank's real exporter (``TrainMetrics``) in a process of its own, for
tests/observe/test_metrics_dcgm.py: the GPU labels a GPU node's nvidia-smi gives (argv) and
examples/tiny-train.toml's spec. It steps, prints ``ready``, then ends cleanly on a ``close``
line on stdin, or waits to be killed."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from aihpc.observe.gpu_labels import GpuLabels
from aihpc.observe.metrics import MetricsConfig, TrainMetrics, predict
from aihpc.runspec import runspec_from_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-train.toml"


def main() -> None:
    port, job, gpu, uuid, host = sys.argv[1:6]
    config = MetricsConfig(port=int(port), final_scrape_timeout_s=120.0)
    spec = runspec_from_dict(tomllib.loads(EXAMPLE.read_text()))
    gpu_labels = GpuLabels(gpu, uuid, host)
    metrics = TrainMetrics(
        config, job=job, rank=0, spec=spec, prediction=predict(spec), gpu=gpu_labels
    )
    for step in (1, 2, 3):
        metrics.step(step, step_time_s=0.5, tokens=1000.0, loss=2.0, learning_rate=1e-3)
    print("ready", flush=True)
    if sys.stdin.readline().strip() == "close":
        metrics.close(final=True)  # waits for one scrape after the end
        print("closed", flush=True)


if __name__ == "__main__":
    main()
