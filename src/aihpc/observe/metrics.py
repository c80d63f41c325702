"""Prometheus metrics of a training job: one exporter per rank, scraped over HTTP or written for
node-exporter's textfile collector.

The trainer calls a few methods (``loaded``, ``step``, ``checkpoint``, ``hang``, ``close``);
everything else (the prediction for the same spec, restarts and hangs of earlier attempts, the
launch's start time, checkpoint commit times and sizes) the exporter works out itself. No torch
here: the runtime may import this module (prometheus-client, ``aihpc.runspec`` and ``aihpc.perf``).

Naming follows Prometheus's conventions (prometheus.io/docs/practices/naming): one prefix, base
units in the name (``_seconds``, ``_bytes``, ``_ratio`` for 0-1), ``_total`` on counters, and the
labels ``hpc_job`` (dcgm-exporter's Slurm job label), ``rank``, ``node``, and dcgm-exporter's
``gpu``, ``UUID`` and ``Hostname`` (``gpu_labels``) on every series, so the two join. A plain
``job`` label would clash with the scrape job's own.
Every rank exports its own share (tokens, bytes), so ``sum()`` over ranks is the job's figure and
``avg()`` the per-GPU one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
    write_to_textfile,
)

from aihpc.observe.gpu_labels import GpuLabels, gpu_labels
from aihpc.observe.metric_names import LABELS, METRICS, MetricDef
from aihpc.observe.prediction import RunPrediction, predict
from aihpc.runspec import RunSpec, SpecError

__all__ = [
    "MetricsConfig",
    "NullMetrics",
    "RunPrediction",
    "TrainMetrics",
    "job_name",
    "open_train_metrics",
    "predict",
]

log = logging.getLogger("aihpc.observe")

# Step time from 10 ms (a tiny model) to ~3 min (a 400B model at small scale), doubling.
_STEP_BUCKETS = tuple(0.01 * 2**k for k in range(15))
_SAVE_BUCKETS = tuple(0.01 * 2**k for k in range(17))


@dataclass(frozen=True)
class MetricsConfig:
    """Where to export. ``port``: rank r listens on ``port + local_rank``, on ``addr`` only
    (the loopback interface unless ``--metrics-host`` says otherwise). ``textfile_dir``: each
    rank writes ``<dir>/aihpc_<job>_rank<r>.prom`` (node-exporter's textfile collector reads
    ``*.prom``). ``final_scrape_timeout_s``: at the end, wait up to this long for a scraper that
    has been seen to collect the final values."""

    port: int | None = None
    textfile_dir: Path | None = None
    job: str | None = None
    addr: str = "127.0.0.1"  # safe by default: a remote scraper needs --metrics-host
    final_scrape_timeout_s: float = 30.0
    textfile_interval_s: float = 1.0


def job_name(run_dir: Path, env: Mapping[str, str] | None = None) -> str:
    """``AIHPC_JOB``, else Slurm's job id, else the run directory's name."""
    env = os.environ if env is None else env
    return env.get("AIHPC_JOB") or env.get("SLURM_JOB_ID") or Path(run_dir).resolve().name


def _history(events: Path | None, rank: int) -> tuple[float, int]:
    """(start of this launch, hangs this rank detected before) from the run's event log.

    A launch starts with attempt 0 (the newest attempt-0 ``process_start``: this process's own
    when it is attempt 0); a restart under the elastic agent (attempt >= 1) keeps the launch's
    start, so the restart's downtime counts against the ETTR.
    """
    start, hangs, found = time.time(), 0, False
    if events is None or not events.is_file():
        return start, hangs
    for line in events.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line torn by a crash (the trainer names damaged lines)
        if not isinstance(ev, dict):
            continue
        if ev.get("event") == "hang_detected" and ev.get("rank") == rank:
            hangs += 1
        if ev.get("event") == "process_start" and ev.get("attempt") == 0:
            stamp = ev.get("process_start_unix") or ev.get("time_unix")
            if isinstance(stamp, int | float):
                start, found = float(stamp), True
    if not found:
        log.warning("no attempt-0 start in %s: the ETTR counts from now", events)
    return start, hangs


def _host_rss_bytes() -> float:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return float(pages * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        import resource

        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _as_float(value: Any) -> float:
    """A Python number or a 0-d tensor (a DTensor gathered first); no torch import needed."""
    if value is None:
        return float("nan")
    full = getattr(value, "full_tensor", None)
    if callable(full):  # FSDP2's norm is a DTensor: every rank calls step(), so this is collective
        value = full()
    item = getattr(value, "item", None)
    return float(item() if callable(item) else value)


class NullMetrics:
    """The exporter's interface with every call a no-op: the trainer without ``--metrics-*``."""

    enabled = False

    def loaded(self, step: int, seconds: float) -> None:
        """A checkpoint of ``step`` was loaded in ``seconds``."""

    def step(
        self,
        step: int,
        *,
        step_time_s: float,
        tokens: float,
        loss: float,
        learning_rate: float,
        grad_norm: Any = None,
        phases: Mapping[str, float] | None = None,
    ) -> None:
        """Step ``step`` ended: ``tokens`` is the global count of the step (all ranks)."""

    def checkpoint(self, step: int, blocking_s: float, path: Path) -> None:
        """A save of ``step`` into ``path`` began and blocked training ``blocking_s``."""

    def hang(self) -> None:
        """This rank's watchdog found a hang (the process is about to exit)."""

    def close(self, final: bool = True) -> None:
        """Stop exporting; ``final``: the run ended normally, let a scraper see the end."""


class TrainMetrics(NullMetrics):
    """One rank's exporter. Build it with ``open_train_metrics``."""

    enabled = True

    def __init__(
        self,
        config: MetricsConfig,
        *,
        job: str,
        rank: int,
        local_rank: int = 0,
        world_size: int = 1,
        node: str | None = None,
        spec: RunSpec | None = None,
        prediction: RunPrediction | None = None,
        restarts: int = 0,
        hangs_before: int = 0,
        job_start_unix: float | None = None,
        device_memory: Callable[[], Mapping[str, float]] | None = None,
        gpu: GpuLabels | None = None,
    ) -> None:
        disable_created_metrics()  # no *_created series: they double the series for nothing
        self.config, self.rank, self.world_size = config, rank, world_size
        self.prediction, self.device_memory = prediction, device_memory
        self.registry = CollectorRegistry(auto_describe=True)
        host = node or socket.gethostname()
        base = {"hpc_job": job, "rank": str(rank), "node": host}
        base |= (gpu or GpuLabels(hostname=host)).labels()  # empty gpu/UUID: Prometheus drops them
        self._m = {d.name: self._make(d, base) for d in METRICS}
        self._pending: list[tuple[int, Path, float]] = []
        self._step_sum = self._step_count = 0.0
        self._job_start = job_start_unix if job_start_unix is not None else time.time()
        self._lock = threading.Lock()
        self._writing = threading.local()  # set while this process collects for the textfile
        self._scrapes, self._last_scrape = 0, 0.0
        self._server: Any = None
        self._last_textfile = 0.0
        self.textfile = None
        if config.textfile_dir is not None:
            safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)
            self.textfile = Path(config.textfile_dir) / f"aihpc_{safe}_rank{rank}.prom"
        self._describe(spec, restarts, hangs_before)
        if config.port is not None:
            self.registry.register(_ScrapeClock(self))
            port = config.port + local_rank
            try:
                self._server, _ = start_http_server(port, addr=config.addr, registry=self.registry)
            except OSError as err:
                raise SpecError(
                    "--metrics-port",
                    port,
                    f"cannot listen there on {config.addr} ({err.strerror}); pick a free port",
                ) from None
        self._write_textfile(force=True)

    def _make(self, d: MetricDef, base: dict[str, str]) -> Any:
        cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[d.kind]
        kwargs: dict[str, Any] = {"registry": self.registry}
        if d.kind == "histogram":
            kwargs["buckets"] = _SAVE_BUCKETS if "checkpoint" in d.name else _STEP_BUCKETS
        metric = cls(d.name, d.help, (*LABELS, *d.labels), **kwargs)
        if d.labels:  # children are made where the extra label's value is known
            return _Partial(metric, base)
        if d.kind == "gauge":  # a gauge nobody set yet is absent, not 0
            return _Lazy(metric, base)
        return metric.labels(**base)  # counters and histograms: 0 is true before anything

    def _describe(self, spec: RunSpec | None, restarts: int, hangs_before: int) -> None:
        m, p = self._m, self.prediction
        if spec is not None:
            plan = spec.plan()
            text = (
                f"tp{plan.tp} pp{plan.pp} cp{plan.cp} dp{plan.dp} zero{plan.zero_stage} "
                f"mbs{plan.micro_batch_size} gbs{plan.global_batch_size}"
            )
            m["aihpc_train_info"].child(
                model=spec.model.name,
                spec_gpu=spec.cluster.gpu.id,
                world_size=str(self.world_size),
                plan=text,
            ).set(1)
        m["aihpc_train_restarts_total"].inc(restarts)
        m["aihpc_train_hangs_total"].inc(hangs_before)
        m["aihpc_train_job_start_timestamp_seconds"].set(self._job_start)
        m["aihpc_train_finished"].set(0)
        if p is not None:
            m["aihpc_train_predicted_step_seconds"].set(p.step_time_s)
            m["aihpc_train_predicted_tokens_per_second"].set(p.tokens_per_s_per_gpu)
            m["aihpc_train_predicted_mfu_ratio"].set(p.mfu)
            m["aihpc_train_predicted_memory_bytes"].set(p.memory_bytes)
            if p.ettr is not None:
                m["aihpc_train_predicted_ettr_ratio"].set(p.ettr)
        self._memory()

    # ---- what the trainer calls -----------------------------------------------------------
    def loaded(self, step: int, seconds: float) -> None:
        self._m["aihpc_train_checkpoint_load_seconds"].set(seconds)
        self._m["aihpc_train_step"].set(step)
        self._m["aihpc_train_last_committed_step"].set(step)
        self._write_textfile(force=True)

    def step(
        self,
        step: int,
        *,
        step_time_s: float,
        tokens: float,
        loss: float,
        learning_rate: float,
        grad_norm: Any = None,
        phases: Mapping[str, float] | None = None,
    ) -> None:
        m, now = self._m, time.time()
        share = tokens / self.world_size
        m["aihpc_train_steps_total"].inc()
        m["aihpc_train_step"].set(step)
        m["aihpc_train_step_duration_seconds"].observe(step_time_s)
        for phase, seconds in (phases or {}).items():
            m["aihpc_train_phase_seconds_total"].child(phase=phase).inc(max(0.0, seconds))
        m["aihpc_train_tokens_total"].inc(share)
        m["aihpc_train_tokens_per_second"].set(share / step_time_s)
        if self.prediction is not None:
            flops = self.prediction.model_flops_per_token * share / step_time_s
            m["aihpc_train_mfu_ratio"].set(flops / self.prediction.peak_flops)
        m["aihpc_train_loss"].set(loss)
        if grad_norm is not None:
            m["aihpc_train_grad_norm"].set(_as_float(grad_norm))
        m["aihpc_train_learning_rate"].set(learning_rate)
        m["aihpc_train_last_step_timestamp_seconds"].set(now)
        self._step_sum += step_time_s
        self._step_count += 1
        # ETTR so far: progress (steps on the surviving trajectory) at this process's mean step
        # time, over the wall time since the launch began (Meta's definition, arXiv 2410.21680:
        # productive time over elapsed time; startup, restarts, replays and saves are the loss).
        elapsed = now - self._job_start
        if elapsed > 0:
            productive = step * self._step_sum / self._step_count
            m["aihpc_train_ettr_ratio"].set(min(1.0, productive / elapsed))
        self._memory()
        self._poll_commits()
        self._write_textfile()

    def checkpoint(self, step: int, blocking_s: float, path: Path) -> None:
        self._m["aihpc_train_checkpoint_blocking_seconds"].observe(blocking_s)
        self._m["aihpc_train_phase_seconds_total"].child(phase="checkpoint_blocking").inc(
            blocking_s
        )
        self._pending.append((step, Path(path), time.time() - blocking_s))
        self._poll_commits()
        self._write_textfile(force=True)

    def hang(self) -> None:
        self._m["aihpc_train_hangs_total"].inc()
        self._write_textfile(force=True)

    def close(self, final: bool = True) -> None:
        if final:  # the end marker: a series that vanishes at 0 is a job that died
            self._m["aihpc_train_finished"].set(1)
        self._poll_commits()
        self._memory()
        self._write_textfile(force=True)
        if self._server is None:
            return
        if final:
            self._await_final_scrape()
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    # ---- internals -----------------------------------------------------------------------
    def _poll_commits(self) -> None:
        """Saves whose manifest appeared: total seconds (start to commit), bytes, the step."""
        still = []
        for step, path, began in self._pending:
            manifest = path / "MANIFEST.json"
            try:
                doc = json.loads(manifest.read_text())
            except (OSError, ValueError):
                still.append((step, path, began))
                continue
            committed = float(doc.get("created_unix", time.time()))
            self._m["aihpc_train_checkpoint_save_seconds"].observe(max(0.0, committed - began))
            if self.rank == 0:
                size = sum(f.get("size", 0) for f in doc.get("files", {}).values())
                self._m["aihpc_train_checkpoint_written_bytes_total"].inc(size)
            self._m["aihpc_train_last_committed_step"].set(step)
        self._pending = still

    def _memory(self) -> None:
        mem = {"host_rss": _host_rss_bytes()}
        if self.device_memory is not None:
            mem.update(self.device_memory())
        for kind, value in mem.items():
            self._m["aihpc_train_memory_bytes"].child(kind=kind).set(value)

    def _write_textfile(self, force: bool = False) -> None:
        if self.textfile is None:
            return
        now = time.monotonic()
        if not force and now - self._last_textfile < self.config.textfile_interval_s:
            return
        self._last_textfile = now
        self._writing.active = True
        try:
            write_to_textfile(str(self.textfile), self.registry)
        except OSError as err:  # a full disk must not stop training
            log.warning("cannot write %s: %s", self.textfile, err)
        finally:
            self._writing.active = False

    def _scraped(self) -> None:
        with self._lock:
            self._scrapes += 1
            self._last_scrape = time.time()

    def _await_final_scrape(self) -> None:
        """If a scraper has come before, wait (bounded) for one more visit after the end, so
        the final step, the last commit and the end time are recorded."""
        if not self._scrapes:
            return
        end = time.time()
        deadline = time.monotonic() + self.config.final_scrape_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._last_scrape > end:
                    return
            time.sleep(0.05)
        log.warning("no scrape in the %.0f s after the end", self.config.final_scrape_timeout_s)


class _Lazy:
    """A gauge's labelled child, made on first use."""

    def __init__(self, metric: Any, base: dict[str, str]):
        self.metric, self.base = metric, base

    def __getattr__(self, name: str) -> Any:
        return getattr(self.metric.labels(**self.base), name)


class _Partial:
    """A metric with one label beyond LABELS, its base labels bound."""

    def __init__(self, metric: Any, base: dict[str, str]):
        self.metric, self.base = metric, base

    def child(self, **labels: str) -> Any:
        return self.metric.labels(**self.base, **labels)


class _ScrapeClock:
    """A collector that yields nothing and notes each scrape (not the textfile writer's own
    collections, which run with the owner's ``_writing`` flag set)."""

    def __init__(self, owner: TrainMetrics):
        self.owner = owner

    def collect(self) -> Iterable[Any]:
        if not getattr(self.owner._writing, "active", False):
            self.owner._scraped()
        return []

    def describe(self) -> Iterable[Any]:
        return []


def open_train_metrics(
    config: MetricsConfig | None,
    *,
    spec: RunSpec,
    run_dir: Path,
    rank: int,
    local_rank: int,
    world_size: int,
    attempt: int,
    device_memory: Callable[[], Mapping[str, float]] | None = None,
) -> NullMetrics:
    """The trainer's exporter: a no-op without ``config``; else restarts (the elastic attempt
    plus Slurm's requeues), earlier hangs and the launch's start come from ``run_dir``."""
    if config is None or (config.port is None and config.textfile_dir is None):
        return NullMetrics()
    start, hangs = _history(Path(run_dir) / "events.jsonl", rank)
    restarts = attempt + int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return TrainMetrics(
        config,
        job=config.job or job_name(run_dir),
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        spec=spec,
        prediction=predict(spec),
        restarts=restarts,
        hangs_before=hangs,
        job_start_unix=start,
        device_memory=device_memory,
        gpu=gpu_labels(local_rank, on_gpu=device_memory is not None),
    )
