"""The trainer's Prometheus metrics, read back from a real Prometheus that scraped real 2-rank
runs: the values must equal what the run itself recorded (summary.json, metrics.jsonl, the
checkpoint manifests), across an injected kill and a hang."""

from __future__ import annotations

import json

import pytest

from aihpc.observe.metric_names import METRICS
from aihpc.runspec import runspec_from_dict
from conftest import INTERVAL, TRAIN_STEPS, Run, spec_text

pytestmark = pytest.mark.slow
GBS, SEQ = 16, 64  # examples/tiny-train.toml: global_batch_size, tiny-llama's seq_length


def last(prom, run: Run, metric: str, extra: str = "") -> dict[str, float]:
    """Each rank's last scraped value (the targets are gone: instant queries see stale markers,
    last_over_time does not)."""
    sel = f'{{hpc_job="{run.job}"{extra}}}'
    return prom.values(f"last_over_time({metric}{sel}[10m])", at=run.end + 1)


def test_spec_is_the_example_with_fewer_steps():
    import tomllib

    spec = runspec_from_dict(tomllib.loads(spec_text()))
    assert spec.plan().global_batch_size == GBS and spec.model.seq_length == SEQ


def test_every_metric_is_scraped(prometheus, kill_run):
    names = {
        s["__name__"]
        for s in prometheus.api(
            "series", **{"match[]": f'{{hpc_job="{kill_run.job}"}}', "start": kill_run.begin}
        )
    }
    for d in METRICS:
        base = f"{d.name}_count" if d.kind == "histogram" else d.name
        assert base in names, d.name


def test_steps_tokens_loss_and_lr_match_the_run(prometheus, kill_run):
    summary = kill_run.summary
    resumed = summary["resumed_from_step"]
    assert summary["restarts"] == 1 and resumed == INTERVAL  # the step-4 save, synchronous
    done = TRAIN_STEPS - resumed  # steps the restarted processes ran
    assert last(prometheus, kill_run, "aihpc_train_step") == {"0": TRAIN_STEPS, "1": TRAIN_STEPS}
    assert last(prometheus, kill_run, "aihpc_train_steps_total") == {"0": done, "1": done}
    tokens = done * GBS * SEQ / 2  # each rank trains on its half of every batch
    assert last(prometheus, kill_run, "aihpc_train_tokens_total") == {"0": tokens, "1": tokens}
    rows = [json.loads(x) for x in (kill_run.dir / "metrics.jsonl").read_text().splitlines()]
    final = rows[-1]
    assert final["step"] == TRAIN_STEPS
    loss = last(prometheus, kill_run, "aihpc_train_loss")
    assert loss == {"0": summary["final_loss"], "1": summary["final_loss"]}
    assert last(prometheus, kill_run, "aihpc_train_learning_rate")["0"] == final["lr"]


def test_restarts_are_counted_across_the_kill(prometheus, kill_run):
    assert last(prometheus, kill_run, "aihpc_train_restarts_total") == {"0": 1.0, "1": 1.0}
    # the restarted processes loaded the checkpoint, and said how long it took: within the
    # span their own events put around the load (a fixed bound in seconds is no check of that
    # on a loaded machine, where a load of a few MiB can take as long as it likes)
    load = last(prometheus, kill_run, "aihpc_train_checkpoint_load_seconds")
    assert set(load) == {"0", "1"}
    ready = {e["rank"]: e["time_unix"] for e in kill_run.events("pg_ready") if e["attempt"] == 1}
    loaded = {e["rank"]: e["time_unix"] for e in kill_run.events("loaded") if e["attempt"] == 1}
    for rank, seconds in load.items():
        assert 0 < seconds <= loaded[int(rank)] - ready[int(rank)], (rank, seconds)


def test_checkpoint_bytes_and_commits_match_the_manifests(prometheus, kill_run):
    resumed = kill_run.summary["resumed_from_step"]
    root = kill_run.dir / "checkpoints"
    saved = [s for s in range(INTERVAL, TRAIN_STEPS + 1, INTERVAL) if s > resumed]
    sizes = 0
    for s in saved:
        manifest = json.loads((root / f"step_{s:08d}" / "MANIFEST.json").read_text())
        sizes += sum(f["size"] for f in manifest["files"].values())
    written = last(prometheus, kill_run, "aihpc_train_checkpoint_written_bytes_total")
    assert written == {"0": sizes, "1": 0.0}  # rank 0 commits, so rank 0 counts
    committed = last(prometheus, kill_run, "aihpc_train_last_committed_step")
    assert committed == {"0": TRAIN_STEPS, "1": TRAIN_STEPS}
    count = last(prometheus, kill_run, "aihpc_train_checkpoint_save_seconds_count")
    assert count == {"0": len(saved), "1": len(saved)}
    # the test's saves are synchronous: the commit happens inside the blocking call (before its
    # closing barrier), so "start to commit" is positive and no longer than the blocking time
    total = last(prometheus, kill_run, "aihpc_train_checkpoint_save_seconds_sum")
    blocking = last(prometheus, kill_run, "aihpc_train_checkpoint_blocking_seconds_sum")
    assert all(0 < total[r] <= blocking[r] for r in ("0", "1")), (total, blocking)


def test_step_time_phases_add_up_and_mfu_follows_from_tokens(prometheus, kill_run):
    step_sum = last(prometheus, kill_run, "aihpc_train_step_duration_seconds_sum")
    phases = prometheus.query(
        f'last_over_time(aihpc_train_phase_seconds_total{{hpc_job="{kill_run.job}",'
        f'phase!="checkpoint_blocking"}}[10m])',
        at=kill_run.end + 1,
    )
    for rank in ("0", "1"):
        parts = sum(float(p["value"][1]) for p in phases if p["metric"]["rank"] == rank)
        assert parts == pytest.approx(step_sum[rank], rel=1e-9)
    # MFU = model FLOPs per token x tokens/s / the spec GPU's peak (H100 bf16 989 TFLOP/s)
    from aihpc.observe.metrics import predict

    pred = predict(runspec_from_dict(__import__("tomllib").loads(spec_text())))
    tps = last(prometheus, kill_run, "aihpc_train_tokens_per_second")
    mfu = last(prometheus, kill_run, "aihpc_train_mfu_ratio")
    for rank in ("0", "1"):
        expect = pred.model_flops_per_token * tps[rank] / 989e12
        assert mfu[rank] == pytest.approx(expect, rel=1e-9)
    assert last(prometheus, kill_run, "aihpc_train_predicted_mfu_ratio")["0"] == pred.mfu


def test_ettr_is_progress_over_wall_time_since_the_launch(prometheus, kill_run):
    ettr = last(prometheus, kill_run, "aihpc_train_ettr_ratio")
    start = last(prometheus, kill_run, "aihpc_train_job_start_timestamp_seconds")
    first = min(e["process_start_unix"] for e in kill_run.events("process_start"))
    assert start["0"] == pytest.approx(first, abs=1.0)  # the launch, not the restart
    end = last(prometheus, kill_run, "aihpc_train_last_step_timestamp_seconds")["0"]
    dur_sum = last(prometheus, kill_run, "aihpc_train_step_duration_seconds_sum")["0"]
    dur_n = last(prometheus, kill_run, "aihpc_train_step_duration_seconds_count")["0"]
    expect = TRAIN_STEPS * dur_sum / dur_n / (end - start["0"])
    assert ettr["0"] == pytest.approx(expect, rel=1e-6)
    assert 0 < ettr["0"] < 1  # start-up and a restart were lost


def test_hang_detection_is_counted_by_the_rank_that_saw_it(prometheus, hang_run):
    detected = hang_run.events("hang_detected")
    assert [e["rank"] for e in detected] == [0]
    assert last(prometheus, hang_run, "aihpc_train_hangs_total") == {"0": 1.0, "1": 0.0}
    assert last(prometheus, hang_run, "aihpc_train_restarts_total") == {"0": 1.0, "1": 1.0}
    assert last(prometheus, hang_run, "aihpc_train_step") == {"0": TRAIN_STEPS, "1": TRAIN_STEPS}


def test_textfile_holds_the_failed_ranks_last_values(exception_run):
    """node-exporter's textfile collector format, per rank, left as the job died."""
    from prometheus_client.parser import text_string_to_metric_families

    files = sorted((exception_run.dir.parent / "textfile").glob("*.prom"))
    assert [f.name for f in files] == [
        f"aihpc_{exception_run.job}_rank0.prom",
        f"aihpc_{exception_run.job}_rank1.prom",
    ]
    values = {}
    for fam in text_string_to_metric_families(files[1].read_text()):
        for s in fam.samples:
            values[s.name] = s.value
            assert s.labels["hpc_job"] == exception_run.job and s.labels["rank"] == "1"
    assert values["aihpc_train_steps_total"] == 3  # the exception came after step 3
    assert values["aihpc_train_step"] == 3
    assert values["aihpc_train_restarts_total"] == 0
    assert values["aihpc_train_finished"] == 0  # died: no clean end
