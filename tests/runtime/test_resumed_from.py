"""summary.json says where every recovery resumed from, whichever tier served it: the in-memory
tier, a peer's replica (tests/runtime/test_fast_recovery.py), storage when the memory copies
are lost or were never taken (over ``memory_max_GiB``), after an in-process restart and after
an agent restart of the processes. Real gloo ranks under aihpc train's agent; the expected
steps come from the run's own events (the checkpoints and snapshots it took before each fault).
"""

from __future__ import annotations

import pytest
from train_cli import events, ok
from train_cli import train as run_train

pytestmark = pytest.mark.slow

SPEC = """
[model]
preset = "tiny-llama"
seq_length = 32
[cluster]
gpu = "h100-sxm"
num_gpus = 2
gpus_per_node = 2
[parallel]
zero_stage = 3
micro_batch_size = 1
global_batch_size = 4
[training]
train_steps = 8
learning_rate = 3e-3
warmup_steps = 2
[checkpoint]
interval_steps = 3
async_save = false
memory_interval_steps = 2
in_process_restarts = 1
memory_max_GiB = {max_GiB}
"""


def train(tmp_path, max_GiB: float, *faults: str) -> tuple[dict, object]:
    spec, run = tmp_path / "run.toml", tmp_path / "run"
    spec.write_text(SPEC.format(max_GiB=max_GiB))
    args = ["--nproc-per-node", "2", "--max-restarts", "1"]
    for fault in faults:
        args += ["--inject", fault]
    return ok(run_train(spec, run, *args, timeout=240, env={"OMP_NUM_THREADS": "1"})), run


def newest(run, event: str, before: int) -> int:
    """The newest step at or before ``before`` that ``event`` (a storage checkpoint or a kept
    memory snapshot) recorded in the run's first pass."""
    steps = [e["step"] for e in events(run, event) if e.get("kept", True) and e["step"] <= before]
    return max(steps)


def test_memory_lost_falls_back_to_storage_and_says_so(tmp_path):
    """An exception at step 4 is recovered in-process from memory; at step 5 both ranks die
    with their node's memory (kill:mode=node on each, so neither has its own copy): the agent
    restarts them and they load the storage checkpoint."""
    summary, run = train(
        tmp_path,
        8,
        "exception:step=4:rank=1",
        "kill:step=5:rank=0:mode=node",
        "kill:step=5:rank=1:mode=node",
    )
    in_memory, on_storage = newest(run, "memory_snapshot", 4), newest(run, "checkpoint_saved", 5)
    assert in_memory != on_storage  # the two tiers are told apart by their step too
    loaded = {(e["attempt"], e.get("generation", 0), e["source"]) for e in events(run, "loaded")}
    assert (1, 0, "storage") in loaded  # the memory tier had nothing usable: storage served it
    expected = [
        {"step": in_memory, "tier": "memory", "restart": "in-process", "attempt": 0,
         "generation": 1},
        {"step": on_storage, "tier": "storage", "restart": "process", "attempt": 1,
         "generation": 0},
    ]  # fmt: skip
    assert summary["recoveries"] == expected
    assert summary["resumed_from"] == expected[-1]
    assert summary["resumed_from_step"] == on_storage and summary["restored_from"] == "storage"


def test_state_over_memory_max_falls_back_to_storage_and_says_so(tmp_path):
    """The state exceeds memory_max_GiB, so no snapshot is taken: the in-process restart after
    an exception at step 5, and the agent restart after a kill at step 7, both load storage."""
    summary, run = train(tmp_path, 0.0001, "exception:step=5:rank=1", "kill:step=7:rank=0")
    assert not [e for e in events(run, "memory_snapshot") if e["kept"]]
    first, second = newest(run, "checkpoint_saved", 5), newest(run, "checkpoint_saved", 7)
    expected = [
        {"step": first, "tier": "storage", "restart": "in-process", "attempt": 0,
         "generation": 1},
        {"step": second, "tier": "storage", "restart": "process", "attempt": 1,
         "generation": 0},
    ]  # fmt: skip
    assert summary["recoveries"] == expected
    assert summary["resumed_from"] == expected[-1]
    assert summary["memory_checkpoint"]["skipped"]
