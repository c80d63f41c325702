"""What ``aihpc doctor`` says about a diagnosis: one sentence on what happened, and what to do.

The Xid meanings come from ``data/xid.toml`` (NVIDIA's Xid catalog); the verbs work-completion
codes from libibverbs' ``enum ibv_wc_status`` (include/infiniband/verbs.h); a CUDA OOM is set
against the plan's memory as ``aihpc estimate`` prices it when the run spec is given.
"""

from __future__ import annotations

import functools
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aihpc.observe.signatures import signal_name
from aihpc.spec import RunSpec, SpecError

if TYPE_CHECKING:
    from aihpc.observe.doctor import Diagnosis

__all__ = ["IBV_WC_STATUS", "action_for", "summary_for", "xid_info"]

# libibverbs include/infiniband/verbs.h, enum ibv_wc_status
IBV_WC_STATUS = {
    1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 3: "LOC_EEC_OP_ERR", 4: "LOC_PROT_ERR",
    5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR", 7: "BAD_RESP_ERR", 8: "LOC_ACCESS_ERR",
    9: "REM_INV_REQ_ERR", 10: "REM_ACCESS_ERR", 11: "REM_OP_ERR", 12: "RETRY_EXC_ERR",
    13: "RNR_RETRY_EXC_ERR", 14: "LOC_RDD_VIOL_ERR", 15: "REM_INV_RD_REQ_ERR",
    16: "REM_ABORT_ERR", 17: "INV_EECN_ERR", 18: "INV_EEC_STATE_ERR", 19: "FATAL_ERR",
    20: "RESP_TIMEOUT_ERR", 21: "GENERAL_ERR",
}  # fmt: skip
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "bytes": 1}


@functools.cache
def _xids() -> dict[int, dict[str, str]]:
    data = tomllib.loads((Path(__file__).parent / "data" / "xid.toml").read_text())
    return {int(k): v for k, v in data.items()}


def xid_info(xid: int) -> dict[str, str]:
    return _xids().get(
        xid,
        {
            "meaning": "not in aihpc's table",
            "kind": "hardware",
            "action": "see NVIDIA's Xid catalog",
        },
    )


def _bytes(text: str | None) -> float | None:
    if not text:
        return None
    m = re.match(r"([\d.]+) (\w+)", text)
    return float(m.group(1)) * _UNITS.get(m.group(2), 1) if m else None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "none"


def _drain(node: str | None, reason: str) -> str:
    if not node:
        return "find the node in the scheduler's records, drain it and requeue the job"
    return (
        f'drain {node} (scontrol update nodename={node} state=drain reason="{reason}"), '
        f"requeue the job without it (sbatch --exclude={node}); it resumes from its last checkpoint"
    )


def summary_for(d: Diagnosis) -> str:
    """One sentence: what failed first, where."""
    e = d.cause
    if e is None:
        if d.stuck:
            return "collective stuck: " + "; ".join(s.describe() for s in d.stuck)
        return "no failure found in these logs"
    x, where = e.details, e.where()
    text = {
        "xid": lambda: (
            f"Xid {x.get('xid')} ({xid_info(int(x['xid']))['meaning']}) on "
            f"{where}, GPU at PCI {x.get('pci')}"
        ),
        "ib_error": lambda: (
            f"InfiniBand/RoCE completion error {x.get('status')} "
            f"(IBV_WC_{IBV_WC_STATUS.get(int(x['status']), '?')}) on {where} "
            f"with peer {x.get('peer')}"
        ),
        "ib_port_event": lambda: (
            f"InfiniBand/RoCE {x.get('event')} on {x.get('dev', 'a port')}"
            f"{':' + x['port'] if x.get('port') else ''}, {where}"
        ),
        "cuda_oom": lambda: _oom_summary(e),
        "host_oom": lambda: f"host out of memory (the kernel's OOM killer) on {where}",
        "segfault": lambda: (
            f"segmentation fault on {where}" + (f" in {x['obj']}" if x.get("obj") else "")
        ),
        "cuda_error": lambda: f"CUDA error on {where}: {x.get('error')}",
        "exception": lambda: (
            f"Python exception on {where}: {x.get('type')}: {x.get('message', '')}"
        ),
        "killed": lambda: f"{where} was killed by SIGKILL (exit -9)",
        "injected_fault": lambda: (
            f"aihpc drill: injected {', '.join(x.get('kinds', []))} at "
            f"step {x.get('step')} on {where}"
        ),
        "nccl_timeout": lambda: (
            f"NCCL collective timeout: {x.get('op')} #{x.get('seq')} "
            f"(timeout {x.get('timeout_ms', '?')} ms) on {where}"
        ),
        "collective_timeout": lambda: (
            f"collective timed out on {where}: {x.get('op', '')} waited {x.get('ms', '?')} ms"
        ),
        "hang": lambda: (
            f"hang: {where}'s watchdog saw no progress for "
            f"{x.get('stalled_s', '?')} s after step {x.get('step', '?')}"
        ),
        "heartbeat_timeout": lambda: f"hang: PyTorch's heartbeat monitor fired on {where}",
        "aborted": lambda: (
            f"{where} aborted (SIGABRT, PyTorch's watchdog takes a failed process down)"
        ),
        "node_failure": lambda: f"Slurm node failure: {e.node or x.get('node', '?')}",
        "slurm_timeout": lambda: (
            f"Slurm cancelled the job at its time limit ({x.get('entity')} "
            f"on {e.node}, {x.get('at')})"
        ),
        "slurm_preempted": lambda: (
            f"Slurm preempted the job ({x.get('entity')} on {e.node}, {x.get('at')})"
        ),
        "slurm_cancelled": lambda: f"the job was cancelled ({x.get('entity')}, {x.get('at')})",
        "nccl_error": lambda: f"NCCL error on {where}: {x.get('code') or x.get('cuda')}",
        "peer_closed": lambda: f"a peer of {where} went away without a message of its own",
    }.get(d.cls, lambda: f"{d.cls} on {where}")()
    if d.not_joined:
        text += f"; not joined: rank(s) {_ranks(d.not_joined)}"
    if d.recovered:
        text += " (the job restarted and finished)"
    return text


def _oom_summary(e: Any) -> str:
    x = e.details
    gpu = x.get("gpu", x.get("gpu_old", "?"))
    total, free = x.get("total", x.get("total_old")), x.get("free", x.get("free_old"))
    text = f"CUDA out of memory on {e.where()} (GPU {gpu}): tried to allocate {x.get('tried')}"
    if total:
        text += f" with {free} free of {total}"
    if x.get("allocated"):
        text += f"; PyTorch held {x['allocated']} allocated + {x.get('reserved')} cached"
    return text


def _oom_action(d: Diagnosis, spec: RunSpec | None) -> str:
    x = d.cause.details if d.cause else {}
    parts = []
    tried, reserved = _bytes(x.get("tried")), _bytes(x.get("reserved"))
    if tried and reserved and reserved >= tried:
        # the cache held more than the request, just not in one piece: fragmentation
        parts.append(
            f"PyTorch's cache held {x['reserved']} unused, more than the {x['tried']} asked "
            "for, but not in one piece: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        )
    if spec is not None:
        parts.append(_plan_memory(spec, _bytes(x.get("total") or x.get("total_old"))))
    parts.append(
        "lower the per-GPU memory: a smaller micro-batch, recompute (selective or full), a higher "
        "ZeRO stage, or more TP/PP; `aihpc search RUN.toml` lists plans that fit"
    )
    return "; ".join(parts)


def _plan_memory(spec: RunSpec, device_bytes: float | None) -> str:
    from aihpc.perf import estimate

    try:
        est = estimate(spec)
    except SpecError as err:
        return f"aihpc estimate cannot price the spec ({err})"
    gib = est.memory.gib()
    parts = ", ".join(f"{k} {v:.1f}" for k, v in gib.items() if k != "total" and v >= 0.05)
    have = device_bytes / 2**30 if device_bytes else est.hbm_gib
    verdict = "does not fit" if gib["total"] > have else "fits on paper"
    return (
        f"aihpc estimate prices this plan at {gib['total']:.1f} GiB per GPU ({parts}) against "
        f"{have:.1f} GiB: it {verdict}"
    )


def action_for(d: Diagnosis, spec: RunSpec | None = None) -> str:
    """What to do next, for the root cause's class."""
    e = d.cause
    if e is None:
        if d.stuck:
            return _waiting_action(d)
        return "nothing failed in these logs: pass the ranks' stderr, dmesg and events.jsonl"
    x, node = e.details, e.node
    if d.cls == "xid":
        info = xid_info(int(x["xid"]))
        if info["kind"] == "hardware":
            return f"{_drain(node, 'Xid ' + str(x['xid']))}. NVIDIA: {info['action']}"
        return f"restart from the last checkpoint. NVIDIA: {info['action']}"
    if d.cls == "ib_error":
        status = int(x["status"])
        why = {
            12: "the link dropped packets until the transport retry count ran out",
            13: "the receiver was not ready (RNR) past the retry count",
        }.get(status, f"IBV_WC_{IBV_WC_STATUS.get(status, '?')}")
        return (
            f"{why}: check both ends (ibstat; the port counters symbol_error, link_downed, "
            f"port_rcv_errors) of {node or 'this node'} and {x.get('peer')}; "
            + _drain(node, f"IB completion error {status}")
        )
    if d.cls == "ib_port_event":
        return "a link flap or a dead HCA port: " + _drain(node, f"IB {x.get('event')}")
    if d.cls == "cuda_oom":
        return _oom_action(d, spec)
    if d.cls == "host_oom":
        return (
            "the node's RAM ran out: fewer dataloader workers, smaller pinned buffers, async "
            "checkpoint staging counted in the budget, or a larger --mem"
        )
    if d.cls == "segfault":
        return (
            "a native crash: rerun with PYTHONFAULTHANDLER=1 and core dumps on (ulimit -c "
            "unlimited) to see the frame; check the library it names and the driver/CUDA versions; "
            "if it happened once on one node, requeue without it"
        )
    if d.cls == "cuda_error":
        if "ECC" in str(x.get("error")):
            return _drain(node, "uncorrectable ECC")
        return (
            "rerun the failing step with CUDA_LAUNCH_BLOCKING=1 (or under compute-sanitizer) "
            "to find the kernel"
        )
    if d.cls == "injected_fault":
        outcome = (
            "the job recovered"
            if d.recovered
            else "it did not recover: read the follow-on failures"
        )
        return f"a fault injected on purpose (aihpc train --inject): nothing to fix; {outcome}"
    if d.cls == "exception":
        return (
            f"fix the error on {e.where()} ({Path(e.file).name}:{e.line}); the other ranks failed "
            "because it exited. Restart from the last checkpoint"
        )
    if d.cls == "killed":
        return (
            f"find who sent SIGKILL to {e.where()}: the kernel's OOM killer (dmesg: 'Out of "
            "memory: Killed process'), scancel or the time limit (sacct -j JOBID), or a watchdog"
        )
    if d.cls in ("node_failure",):
        return _drain(node or x.get("node"), "node failure")
    if d.cls == "slurm_timeout":
        return (
            "requeue: the job resumes from its last checkpoint (sbatch --requeue, or scontrol "
            "requeue JOBID); ask for a longer --time, and checkpoint at the interval `aihpc "
            "goodput` gives so less is lost at the limit"
        )
    if d.cls == "slurm_preempted":
        return "nothing is wrong with the job: requeue it (automatic with sbatch --requeue)"
    if d.cls in _WAITING_CLASSES:
        return _waiting_action(d)
    return (
        f"look at {Path(e.file).name}:{e.line} ({signal_name(int(x['exitcode']))})"
        if ("exitcode" in x)
        else f"look at {Path(e.file).name}:{e.line}"
    )


_WAITING_CLASSES = (
    "nccl_timeout",
    "collective_timeout",
    "hang",
    "heartbeat_timeout",
    "aborted",
    "peer_closed",
    "collective_stuck",
)


def _waiting_action(d: Diagnosis) -> str:
    if d.frozen:
        return (
            "no rank had ever enqueued a collective (last enqueued -1 everywhere): the processes "
            "were frozen before the first one (a storage stall, a Python deadlock, a slow "
            "compile), not a network fault. py-spy dump the ranks next time; if storage stalls "
            "are normal there, raise TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
        )
    if d.not_joined:
        return (
            f"rank(s) {_ranks(d.not_joined)} never reached the collective the others waited in: "
            "see what they were doing (py-spy dump --pid on their node; set "
            "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 for the flight "
            "recorder). Slow I/O (data, checkpoint) there: raise the process-group timeout or "
            "aihpc train's --hang-timeout; a dead node: exclude it and requeue"
        )
    return (
        "every rank entered the collective and none finished: a network or GPU fault inside it. "
        "Look for Xid and IB errors on the job's nodes (dmesg), run `aihpc check` on each, and "
        "requeue without the bad node"
    )
