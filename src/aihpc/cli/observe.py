"""Observing commands: ``aihpc doctor``, ``aihpc check``, ``aihpc dashboard``, and the
``--metrics-*`` options of ``aihpc train`` (torch imported inside ``check`` only)."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from aihpc.cli._common import guarded, print_json
from aihpc.runspec.errors import SpecError

if TYPE_CHECKING:  # prometheus_client is imported only by the commands that serve metrics
    from aihpc.observe.metrics import MetricsConfig

__all__ = ["metrics_args", "metrics_config", "register"]


def metrics_config(
    port: int | None, textfile: Path | None, local_procs: int, host: str = "127.0.0.1"
) -> MetricsConfig | None:
    """Validate ``aihpc train``'s ``--metrics-port`` / ``--metrics-host`` /
    ``--metrics-textfile`` before any process starts. Ranks on a node listen on
    ``host:port .. port + local_procs - 1``; ``host`` is the loopback address unless the user
    opens the endpoint to the network (``0.0.0.0``, ``::`` or one of the node's addresses)."""
    if port is None and textfile is None:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", local_procs))
    if port is not None:
        if not 1 <= port <= 65536 - local:
            raise SpecError(
                "--metrics-port", port, f"a TCP port in 1..{65536 - local} ({local} rank(s) here)"
            )
        family = _listen_family(host)
        if "LOCAL_RANK" not in os.environ:  # the launching process: check the whole range now
            for p in range(port, port + local):
                _check_free(family, host, p)
    if textfile is not None:
        if textfile.exists() and not textfile.is_dir():
            raise SpecError("--metrics-textfile", str(textfile), "exists and is not a folder")
        try:
            textfile.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SpecError(
                "--metrics-textfile", str(textfile), f"cannot be created ({err.strerror})"
            ) from None
        if not os.access(textfile, os.W_OK | os.X_OK):
            raise SpecError("--metrics-textfile", str(textfile), "is not writable")
    from aihpc.observe.metrics import MetricsConfig

    return MetricsConfig(port=port, textfile_dir=textfile, addr=host)


_HOST_ALLOWED = "an address of this host to listen on: 127.0.0.1 (the default), 0.0.0.0, :: or"
_HOST_ALLOWED += " one of the node's addresses"


def _listen_family(host: str) -> socket.AddressFamily:
    """The address family to listen on ``host`` with (IPv4 or IPv6); a name that does not
    resolve, or anything with spaces or control characters, is refused naming the flag."""
    if not host or not host.isprintable() or any(ch.isspace() for ch in host):
        raise SpecError("--metrics-host", host, _HOST_ALLOWED)
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        raise SpecError("--metrics-host", host, _HOST_ALLOWED) from None
    return infos[0][0]


def _check_free(family: socket.AddressFamily, host: str, port: int) -> None:
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:
                raise SpecError("--metrics-host", host, _HOST_ALLOWED) from None
            raise SpecError(
                "--metrics-port",
                port,
                f"cannot listen there on {host} ({err.strerror}); pick a free port",
            ) from None


def metrics_args(config: MetricsConfig | None) -> list[str]:
    """The same options for the workers that the elastic agent starts."""
    if config is None:
        return []
    args: list[str] = []
    if config.port is not None:
        args += ["--metrics-port", str(config.port), "--metrics-host", config.addr]
    if config.textfile_dir is not None:
        args += ["--metrics-textfile", str(config.textfile_dir)]
    return args


def register(app: typer.Typer) -> None:
    """``doctor``, ``check`` and ``dashboard``."""
    _register_doctor(app)
    _register_check(app)
    _register_dashboard(app)


def _render_diagnosis(d: Any) -> None:
    from rich.table import Table

    from aihpc.cli._common import console

    style = "bold red" if d.cause is not None else "bold green"
    console.print(f"[{style}]{d.summary}[/]", highlight=False, soft_wrap=True)
    if d.cause is not None:
        e = d.cause
        console.print(
            f"first failure: {e.where()}, {Path(e.file).name}:{e.line}"
            + (f", {_clock(e.time)}" if e.time else ""),
            highlight=False,
            soft_wrap=True,
        )
        console.print(f"  {e.text}", style="dim", highlight=False, soft_wrap=True, markup=False)
    for s in d.stuck:
        console.print(f"flight recorder: {s.describe()}", highlight=False, soft_wrap=True)
    for ev in d.evidence[1:9]:  # the first is the first failure's line, printed above
        where = f"{Path(ev['file']).name}:{ev['line']}" if ev["line"] else Path(ev["file"]).name
        console.print(f"evidence: {ev['claim']} ({where})", highlight=False, soft_wrap=True)
        console.print(f"  {ev['text']}", style="dim", highlight=False, soft_wrap=True, markup=False)
    if d.follow_on:
        table = Table(title="failures it caused (follow-on)", title_justify="left")
        for col in ("rank", "node", "what", "lines"):
            table.add_column(col)
        for row in d.follow_on[:12]:
            what = ", ".join(f"{k} x{v}" for k, v in row["classes"].items())
            table.add_row(
                "-" if row["rank"] is None else str(row["rank"]),
                row["node"] or "-",
                what,
                str(sum(row["classes"].values())),
            )
        if len(d.follow_on) > 12:
            table.add_row("...", "", f"{len(d.follow_on) - 12} more", "")
        console.print(table)
    console.print(f"[bold]action:[/] {d.action}", highlight=False, soft_wrap=True, markup=True)
    console.print(
        f"read {d.files} file(s), {d.lines:,} lines; ranks seen: {_span(d.ranks_seen)}",
        style="dim",
        highlight=False,
    )


def _clock(t: float) -> str:
    import time

    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):  # beyond the platform's time_t
        return f"{t:.0f} s after 1970"


def _span(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if ranks[-1] - ranks[0] + 1 == len(ranks) > 2:  # sorted and distinct: a whole range
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _register_doctor(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def doctor(
        logs: list[Path] = typer.Argument(
            ..., help="Log files or folders: ranks' output, dmesg, events.jsonl, FR dumps."
        ),
        spec: Path | None = typer.Option(
            None, "--spec", help="The run spec: an OOM is set against its estimated memory."
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Find the first failure in a failed or hung job's logs, what it caused, what to do."""
        from aihpc.observe.doctor import diagnose
        from aihpc.runspec import load_runspec

        for p in logs:
            if not os.path.exists(p):  # False, not OSError, for a name too long
                raise SpecError("LOG", str(p), "no such file or folder")
        run_spec = load_runspec(spec) if spec is not None else None
        diagnosis = diagnose(list(logs), run_spec)
        if as_json:
            print_json(diagnosis.to_json())
        else:
            _render_diagnosis(diagnosis)


def _bench_rows(
    nproc: int | None, precision: str | None, sizes: tuple[int, ...]
) -> tuple[list[dict], list[dict], int, str]:
    """Run the GEMM benchmark here and the all-reduce benchmark on ``nproc`` local workers;
    (gemm rows, comm rows, ranks, device name)."""
    import torch

    from aihpc.bench.comm import CommConfig, run_in_new_group, validate_comm_config
    from aihpc.bench.dist import launch_local
    from aihpc.bench.gemm import GemmConfig, device_name, run_gemm_bench

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    cubes = (4096, 8192) if gpu else (512, 1024)
    prec = precision or ("bf16" if gpu else "fp32")
    cfg = GemmConfig(tuple((c, c, c) for c in cubes), prec, iters=5 if gpu else 3, warmup=2)
    gemm = [dict(vars(r)) for r in run_gemm_bench(cfg, device)]
    ranks = nproc or (torch.cuda.device_count() if gpu else 2)
    comm: list[dict] = []
    if ranks > 1:
        ccfg = validate_comm_config(
            CommConfig(collectives=("all_reduce",), sizes=sizes, iters=10, warmup=2), ranks
        )
        results = launch_local(ranks, run_in_new_group, [ccfg])
        comm = [r.to_json() for r in results[0]]
    return gemm, comm, ranks, device_name(device)


def _register_check(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def check(
        calibration: Path | None = typer.Option(
            None, "--calibration", help="Expected figures: a TOML from `aihpc calibrate`."
        ),
        gpu: str | None = typer.Option(
            None, "--gpu", help="GPU catalog id (default: from nvidia-smi's GPU name)."
        ),
        gpus: int | None = typer.Option(None, "--gpus", help="GPUs this node must have."),
        ib_hca: str | None = typer.Option(
            None, "--ib-hca", help="Comma list of HCAs to check (as NCCL_IB_HCA; default: all)."
        ),
        ib_rate: float | None = typer.Option(None, "--ib-rate", help="Minimum port rate, Gb/s."),
        min_ratio: float = typer.Option(
            0.8, "--min-ratio", help="Fail below this fraction of the expected figure."
        ),
        nproc_per_node: int | None = typer.Option(
            None,
            "--nproc-per-node",
            help="Ranks for the collective test (default: every GPU, 2 on CPU).",
        ),
        precision: str | None = typer.Option(None, "--precision", help="GEMM precision."),
        skip_bench: bool = typer.Option(False, "--skip-bench", help="Presence and health only."),
        mode: str = typer.Option(
            "full",
            "--mode",
            help="full | prolog | epilog: as a Slurm Prolog or Epilog, presence and health only "
            "(seconds), --gpus from SLURM_JOB_GPUS; an epilog also fails on a process left on "
            "a GPU. A non-zero exit makes Slurm drain the node.",
        ),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    ) -> None:
        """Node acceptance test: GPUs and NICs present and healthy, GEMM and all-reduce at the
        expected speed. Exit 1 with one line per failed check; a GPU count or NIC asked for that
        the node's tools cannot show fails too."""
        from aihpc.observe import check as chk
        from aihpc.runspec.calibration import load_calibration
        from aihpc.runspec.cluster import gpu_from_id

        if not 0 < min_ratio <= 1:
            raise SpecError("--min-ratio", min_ratio, "a fraction in (0, 1]")
        if nproc_per_node is not None and nproc_per_node < 1:
            raise SpecError("--nproc-per-node", nproc_per_node, "a positive integer")
        if mode not in ("full", "prolog", "epilog"):
            raise SpecError("--mode", mode, "full, prolog or epilog")
        if gpus is not None and gpus < 1:
            raise SpecError("--gpus", gpus, "a positive integer")
        if mode != "full":
            skip_bench = True  # a prolog holds the job's start: seconds, not a benchmark
            gpus = gpus if gpus is not None else chk.slurm_job_gpu_count(dict(os.environ))
        cal = load_calibration(calibration) if calibration is not None else None
        results, smi = _presence_checks(gpus, mode, ib_hca, ib_rate)
        gpu_id = gpu
        if gpu_id is None and smi and smi[0] == 0 and (rows := chk.parse_nvidia_smi(smi[1])):
            gpu_id = chk.detect_gpu_id(rows[0]["name"], float(rows[0]["memory.total"]))
        spec_gpu = gpu_from_id(gpu_id) if gpu_id else None
        gemm: list[dict] = []
        comm: list[dict] = []
        if not skip_bench:
            from aihpc.cli._common import err_console

            sizes = (8 << 20, 256 << 20) if spec_gpu else (256 << 10, 4 << 20)
            with err_console.status("GEMM and all-reduce benchmarks", spinner="dots"):
                gemm, comm, ranks, _device = _bench_rows(nproc_per_node, precision, sizes)
            exp = chk.Expectations(spec_gpu, cal, ranks)
            results += chk.gemm_checks(gemm, exp, min_ratio)
            results += chk.comm_checks(comm, exp, min_ratio)
        _report_checks(results, gemm, comm, as_json)


def _presence_checks(
    gpus: int | None, mode: str, ib_hca: str | None, ib_rate: float | None
) -> tuple[list, tuple[int, str] | None]:
    """nvidia-smi's and ibstat's checks (in an epilog also the processes left on a GPU), and
    nvidia-smi's answer, which names the GPU."""
    from aihpc.observe import check as chk

    smi = chk.run_tool(
        ["nvidia-smi", f"--query-gpu={chk.NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"]
    )
    results = chk.gpu_checks(smi[1] if smi else None, smi[0] if smi else 0, gpus)
    if mode == "epilog":
        query = f"--query-compute-apps={chk.NVIDIA_SMI_APPS_QUERY}"
        apps = chk.run_tool(["nvidia-smi", query, "--format=csv,noheader,nounits"])
        results += chk.leftover_process_checks(apps[1] if apps else None, apps[0] if apps else 0)
    ib = chk.run_tool(["ibstat"])
    hcas = tuple(h.split(":")[0] for h in (ib_hca or "").split(",") if h)
    results += chk.ib_checks(ib[1] if ib else None, ib[0] if ib else 0, hcas, ib_rate)
    return results, smi


def _report_checks(results: list, gemm: list[dict], comm: list[dict], as_json: bool) -> None:
    from rich.table import Table

    from aihpc.cli._common import console, err_console

    failed = [r for r in results if r.status == "fail"]
    if as_json:
        print_json(
            {
                "checks": [r.to_json() for r in results],
                "failed": len(failed),
                "gemm": gemm,
                "comm": comm,
            }
        )
    else:
        table = Table(title="aihpc check", title_justify="left")
        for col in ("check", "status", "measured", "expected", "note"):
            table.add_column(col)
        colour = {"pass": "green", "fail": "bold red", "skip": "yellow", "info": "cyan"}
        for r in results:
            table.add_row(
                r.name, f"[{colour[r.status]}]{r.status}[/]", r.measured, r.expected, r.detail
            )
        console.print(table)
    for r in failed:
        err_console.print(r.line(), highlight=False, soft_wrap=True, markup=False)
    if failed:
        raise typer.Exit(1)


def _register_dashboard(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def dashboard(
        output: Path | None = typer.Option(
            None, "--output", "-o", help="Write the Grafana dashboard JSON here (for import)."
        ),
        render: Path | None = typer.Option(
            None, "--render", help="Draw its panels from --prometheus into this PNG."
        ),
        prometheus: str | None = typer.Option(
            None, "--prometheus", help="Prometheus URL the panels are evaluated against."
        ),
        job: str = typer.Option(".*", "--job", help="The dashboard's $job (a regex of hpc_job)."),
        since: float = typer.Option(3600.0, "--since", help="Seconds of history to draw."),
        step: float = typer.Option(5.0, "--step", help="Query resolution, s."),
        rate_interval: str = typer.Option("1m", "--rate-interval", help="$__rate_interval."),
        as_json: bool = typer.Option(False, "--json", help="Print the dashboard JSON."),
        alerts: Path | None = typer.Option(
            None, "--alerts", help="Write the Prometheus alert rules (YAML) here."
        ),
    ) -> None:
        """The Grafana dashboard for aihpc train's metrics; --render draws its panels."""
        import json
        import time

        from aihpc._io import check_output_path, write_atomic
        from aihpc.observe.dashboards import evaluate, load_dashboard

        dash = load_dashboard()
        if render is not None:
            check_output_path(render, "--render", ".png")
            if prometheus is None:
                raise SpecError("--prometheus", None, "required with --render: a Prometheus URL")
            if not since > 0 or not step > 0:
                raise SpecError("--since/--step", f"{since}/{step}", "seconds > 0")
        if output is not None:
            write_atomic(output, json.dumps(dash, indent=2) + "\n", "--output")
        if alerts is not None:
            from aihpc.observe.dashboards.alerts import RULES_PATH

            write_atomic(alerts, RULES_PATH.read_text(), "--alerts")
        if render is not None and prometheus is not None:
            from aihpc.observe.dashboards.render import render as draw

            end = time.time()
            try:
                panels = evaluate(prometheus, dash, end - since, end, step, job, rate_interval)
            except ValueError as err:
                raise SpecError("--job", job, f"a query failed: {err}") from None
            draw(panels, render, f"{dash['title']}: job {job}")
        if as_json or (output is None and render is None and alerts is None):
            print_json(dash)
