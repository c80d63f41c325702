"""Fast recovery end to end in real gloo processes: an exception or a hang recovered in the
running processes (in-process restart, restored from memory), and a restart that restores a
rank from its peer's replica after its own copy was lost. Each run must end with the
uninterrupted run's state_sha256 and every step's loss bit for bit; the uninterrupted run has
the memory tier off, so this also shows that taking snapshots does not perturb training."""

from __future__ import annotations

import pytest
from train_cli import events, losses, ok
from train_cli import train as run_train

from aihpc.resilience.memory import memory_key, shm_root
from hang_bounds import hang_timeout_s

pytestmark = pytest.mark.slow

SPEC = """
[model]
preset = "tiny-llama"
seq_length = 32
[cluster]
gpu = "h100-sxm"
num_gpus = {world}
gpus_per_node = {world}
[parallel]
tp = {tp}
zero_stage = 3
micro_batch_size = 1
global_batch_size = 4
[training]
train_steps = 8
learning_rate = 3e-3
warmup_steps = 2
[checkpoint]
interval_steps = 6
async_save = false
{memory}
"""
MEMORY = "memory_interval_steps = 2\nin_process_restarts = 1"


def write(path, world, tp=1, memory=True):
    path.write_text(SPEC.format(world=world, tp=tp, memory=MEMORY if memory else ""))
    return path


def train(spec, run, world, *extra):
    args = ["--nproc-per-node", str(world), *extra]
    proc = run_train(spec, run, *args, timeout=240, env={"OMP_NUM_THREADS": "1"})
    return proc


def reference(tmp_path_factory, world, tp):
    d = tmp_path_factory.mktemp(f"ref{world}")
    summary = ok(train(write(d / "run.toml", world, tp, memory=False), d / "run", world))
    return summary, losses(d / "run"), d / "run"


@pytest.fixture(scope="module")
def ref2(tmp_path_factory):
    return reference(tmp_path_factory, 2, 1)


@pytest.fixture(scope="module")
def ref4(tmp_path_factory):
    return reference(tmp_path_factory, 4, 2)  # tp2 x dp2 (FSDP): an N-D plan


def check_in_process(summary, run, ref):
    assert summary["in_process_restarts"] == 1 and summary["restarts"] == 0
    assert summary["restored_from"] == "memory"
    restored = {e["step"] for e in events(run, "loaded") if e.get("generation") == 1}
    assert restored == {4}  # the newest snapshot (every 2 steps) before the fault at step 5
    # the same processes: every process_start of the run is of the first attempt
    assert {e["attempt"] for e in events(run, "process_start")} == {0}
    assert summary["state_sha256"] == ref[0]["state_sha256"]
    assert losses(run) == ref[1]


def test_hang_recovers_in_process_from_memory(tmp_path, ref2):
    run = tmp_path / "run"
    # 3 s, or more where the reference run shows this machine slower now (tests/hang_bounds.py)
    bound = hang_timeout_s(ref2[2], floor_s=3.0)
    proc = train(
        write(tmp_path / "run.toml", 2),
        run,
        2,
        "--hang-timeout",
        str(bound),
        "--inject",
        "hang:step=5:rank=1:mode=stall",
    )
    check_in_process(ok(proc), run, ref2)
    assert events(run, "fault")[0]["step"] == 5
    # Each finding on its own rank's clock, from that rank's last beat (step 5, the one the stall
    # followed): past the bound, then within a poll (0.3 s) and the thread's wake-up. The fault
    # event's time is no start line: on a loaded machine the stalled rank may write it a second
    # after its peer's beat.
    found = events(run, "hang_interrupted")
    assert found and all(e["step"] == 5 and e["phase"] == "step" for e in found), found
    assert all(bound < e["stalled_s"] <= bound + 2.0 for e in found), found


@pytest.mark.parametrize(("world", "ref"), [(2, "ref2"), (4, "ref4")])
def test_exception_in_process_then_node_loss_from_peer(tmp_path, request, world, ref):
    """One launch, two faults. An exception at step 3 is recovered in the same processes from
    the step-2 snapshot; at step 5 the last rank is killed and its node's memory copy lost with
    it (kill:mode=node): the agent restarts the group and every rank restores step 4 from
    memory, the last one from the replica its holder kept. The run ends as the uninterrupted one
    (2 ranks FSDP; 4 ranks tp2 x dp2)."""
    ref = request.getfixturevalue(ref)
    spec, run = write(tmp_path / "run.toml", world, tp=2 if world == 4 else 1), tmp_path / "run"
    last = world - 1
    proc = train(
        spec,
        run,
        world,
        "--max-restarts",
        "1",
        "--inject",
        f"exception:step=3:rank={last // 2}",
        "--inject",
        f"kill:step=5:rank={last}:mode=node",
    )
    summary = ok(proc)
    loaded = [e for e in events(run, "loaded") if e.get("source")]
    in_process = [e for e in loaded if e.get("generation") == 1 and e["attempt"] == 0]
    assert {e["step"] for e in in_process} == {2} and len(in_process) == world
    assert all(e["from_peer"] == [] for e in in_process)
    after_kill = [e for e in loaded if e["attempt"] == 1]
    assert {e["step"] for e in after_kill} == {4} and len(after_kill) == world
    assert {tuple(e["from_peer"]) for e in after_kill} == {(last,)}
    assert summary["restarts"] == 1 and summary["restored_from"] == "memory"
    # every recovery with its step and tier: own memory in-process, then a peer's replica
    tiers = [(r["step"], r["tier"], r["restart"]) for r in summary["recoveries"]]
    assert tiers == [(2, "memory", "in-process"), (4, "peer", "process")]
    assert summary["resumed_from"] == summary["recoveries"][-1]
    assert summary["memory_checkpoint"]["holder_rank"] is not None
    assert summary["state_sha256"] == ref[0]["state_sha256"]
    assert losses(run) == ref[1]
    assert not (shm_root() / f"aihpc-{memory_key(run)}").exists()  # freed at the end


def test_exception_recovers_in_process_by_default(tmp_path, ref2):
    """No fast-recovery field in the spec (the memory tier off, in_process_restarts unset): an
    exception is recovered in the same processes, from storage (here nothing saved before the
    fault: step 0), and the run ends as the uninterrupted one; `in_process_restarts = 0` opts
    out, and the same fault then ends the launch (no agent restarts allowed)."""
    spec, run = write(tmp_path / "run.toml", 2, memory=False), tmp_path / "run"
    summary = ok(train(spec, run, 2, "--inject", "exception:step=5:rank=1"))
    assert summary["in_process_restarts"] == 1 and summary["restarts"] == 0
    assert {e["attempt"] for e in events(run, "process_start")} == {0}
    restart = events(run, "inprocess_restart")
    assert restart and "InjectedFault" in restart[0]["cause"]
    assert summary["state_sha256"] == ref2[0]["state_sha256"]
    off = tmp_path / "off.toml"
    off.write_text(spec.read_text() + "in_process_restarts = 0\n")
    failed = train(off, tmp_path / "run-off", 2, "--inject", "exception:step=5:rank=1")
    assert failed.returncode == 1
    assert "injected exception" in failed.stderr.strip().splitlines()[-1]
    assert not events(tmp_path / "run-off", "inprocess_restart")
