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
from aihpc.runspec import RunSpec, SpecError

if TYPE_CHECKING:
    from aihpc.observe.diagnosis import Diagnosis

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


# One sentence per class; fields are the line's parsed details plus those _fields() derives.
_SUMMARIES = {
    "xid": "Xid {xid} ({xid_meaning}) on {where}, GPU at PCI {pci}",
    "ib_error": "InfiniBand/RoCE completion error {status} (IBV_WC_{wc_status}) on {where} "
    "with peer {peer}",
    "ib_port_event": "InfiniBand/RoCE {event} on {dev}{port_suffix}, {where}",
    "host_oom": "host out of memory (the kernel's OOM killer) on {where}",
    "segfault": "segmentation fault on {where}{obj_suffix}",
    "cuda_error": "CUDA error on {where}: {error}{in_watchdog}",
    "gpu_lost": "GPU fell off the bus on {where}, GPU at PCI {pci_text}",
    "collective_mismatch": "collective mismatch: ranks called different collectives{seq_text}"
    "{pg_text} ({ops_text}): a bug in the program's order of collectives, not a network fault",
    "exception": "Python exception on {where}: {type}: {message}",
    "killed": "{where} was killed by SIGKILL (exit -9)",
    "injected_fault": "aihpc drill: injected {kinds_text} at step {step} on {where}",
    "nccl_timeout": "NCCL collective timeout: {op} #{seq} (timeout {timeout_ms} ms) on {where}",
    "collective_timeout": "collective timed out on {where}: {op} waited {ms} ms",
    "hang": "hang: {where}'s watchdog saw no progress for {stalled_s} s after step {step}",
    "heartbeat_timeout": "hang: PyTorch's heartbeat monitor fired on {where}",
    "aborted": "{where} aborted (SIGABRT, PyTorch's watchdog takes a failed process down)",
    "node_failure": "Slurm node failure: {node_name}",
    "slurm_timeout": "Slurm cancelled the job at its time limit ({entity} on {node_name}, {at})",
    "slurm_preempted": "Slurm preempted the job ({entity} on {node_name}, {at})",
    "slurm_cancelled": "the job was cancelled ({entity}, {at})",
    "nccl_error": "NCCL error on {where}: {code}{cuda}",
    "peer_closed": "a peer of {where} went away without a message of its own",
}


class _Fields(dict):
    def __missing__(self, key: str) -> str:
        return "?"


def _fields(e: Any) -> _Fields:
    x = e.details
    f = _Fields({k: v for k, v in x.items() if v is not None})
    f.update(where=e.where(), node_name=e.node or x.get("node", "?"), dev=x.get("dev", "a port"))
    f["port_suffix"] = f":{x['port']}" if x.get("port") else ""
    f["obj_suffix"] = f" in {x['obj']}" if x.get("obj") else ""
    f["kinds_text"] = ", ".join(x.get("kinds", []))
    f.setdefault("message", "")
    f.setdefault("code", "")
    f.setdefault("cuda", "")
    f["in_watchdog"] = (
        " (raised in NCCL's watchdog thread: some kernel before the collective faulted)"
        if "watchdog thread terminated" in e.text
        else ""
    )
    f["pci_text"] = x.get("pci") or x.get("smi_pci") or "? (the driver's line names none)"
    f["seq_text"] = f" as #{x['seq']}" if x.get("seq") is not None else ""
    f["pg_text"] = f" on process group {x['pg']}" if x.get("pg") is not None else ""
    ops = x.get("ops")
    if isinstance(ops, dict):
        f["ops_text"] = "; ".join(f"rank(s) {r}: {op}" for r, op in ops.items())
    elif "op" in x and "op_b" in x:
        f["ops_text"] = f"rank {x['rank_a']}: {x['op']}; rank {x['rank_b']}: {x['op_b']}"
    else:
        f["ops_text"] = x.get("what") or x.get("fr_error", "?")
    if "xid" in x:
        f["xid_meaning"] = xid_info(int(x["xid"]))["meaning"]
    if "status" in x:
        f["wc_status"] = IBV_WC_STATUS.get(int(x["status"]), "?")
    return f


def summary_for(d: Diagnosis) -> str:
    """One sentence: what failed first, where."""
    e = d.cause
    if e is None:
        if d.stuck:
            return "collective stuck: " + "; ".join(s.describe() for s in d.stuck)
        return "no failure found in these logs"
    if d.cls == "cuda_oom":
        text = _oom_summary(e)
    else:
        text = _SUMMARIES.get(d.cls, d.cls + " on {where}").format_map(_fields(e))
    if d.not_joined:
        text += f"; not joined: rank(s) {_ranks(d.not_joined)}"
    elif d.not_joined_state == "unknown" and not d.frozen:
        text += "; not joined: unknown (no line shows which rank)"
    elif d.not_joined_state == "none":
        text += "; every rank joined"
    if d.frozen:
        text += "; no rank had enqueued a collective: frozen, not stuck on the network"
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
    from aihpc.perf.step import estimate

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


def _hardware_action(d: Diagnosis) -> str | None:
    x, node = d.cause.details, d.cause.node
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
    if d.cls == "cuda_error" and "ECC" in str(x.get("error")):
        return _drain(node, "uncorrectable ECC")
    if d.cls == "gpu_lost":
        return (
            f"{_drain(node, 'GPU fell off the bus')}. The GPU is unreachable until the node is "
            "cold-rebooted (PCIe, power or thermal: as NVIDIA's Xid 79)"
        )
    if d.cls == "node_failure":
        return _drain(node or x.get("node"), "node failure")
    return None


_FIXED_ACTIONS = {
    "host_oom": "the node's RAM ran out: fewer dataloader workers, smaller pinned buffers, async "
    "checkpoint staging counted in the budget, or a larger --mem",
    "segfault": "a native crash: rerun with PYTHONFAULTHANDLER=1 and core dumps on (ulimit -c "
    "unlimited) to see the frame; check the library it names and the driver/CUDA versions; if it "
    "happened once on one node, requeue without it",
    "cuda_error": "rerun the failing step with CUDA_LAUNCH_BLOCKING=1 (or under "
    "compute-sanitizer) to find the kernel",
    "slurm_timeout": "requeue: the job resumes from its last checkpoint (sbatch --requeue, or "
    "scontrol requeue JOBID); ask for a longer --time, and checkpoint at the interval `aihpc "
    "goodput` gives so less is lost at the limit",
    "slurm_preempted": "nothing is wrong with the job: requeue it (automatic with sbatch "
    "--requeue)",
}


def _process_action(d: Diagnosis) -> str | None:
    e = d.cause
    if d.cls == "injected_fault":
        outcome = "the job recovered" if d.recovered else "it did not recover: see the follow-on"
        return f"a fault injected on purpose (aihpc train --inject): nothing to fix; {outcome}"
    if d.cls == "collective_mismatch":
        return (
            "a program bug: the ranks took different paths (a collective inside a rank-dependent "
            "branch, a different number of steps or microbatches, an unevenly sharded dataset), "
            "so one sequence number meant different collectives. Nothing to drain or requeue. "
            "Rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL (names both calls) or the flight recorder "
            "(TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1; its frames name "
            "the lines)"
        )
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
    return None


def action_for(d: Diagnosis, spec: RunSpec | None = None) -> str:
    """What to do next, for the root cause's class."""
    e = d.cause
    if e is None:
        if d.stuck:
            return _waiting_action(d)
        return "nothing failed in these logs: pass the ranks' stderr, dmesg and events.jsonl"
    if d.cls == "cuda_oom":
        return _oom_action(d, spec)
    action = _hardware_action(d) or _process_action(d) or _FIXED_ACTIONS.get(d.cls)
    if action is not None:
        return action
    if d.cls in _WAITING_CLASSES:
        return _waiting_action(d)
    code = e.details.get("exitcode")
    where = f"{Path(e.file).name}:{e.line}"
    return f"look at {where} ({signal_name(int(code))})" if code is not None else f"look at {where}"


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
    if d.not_joined_state == "none":
        return (
            "every rank entered the collective and none finished: a network or GPU fault inside "
            "it. Look for Xid and IB errors on the job's nodes (dmesg), run `aihpc check` on "
            "each, and requeue without the bad node"
        )
    silent = (
        f"; rank(s) {_ranks(d.silent)} printed no wait of their own or were found stalled: "
        "read their logs (py-spy dump, if they still run) first"
        if d.silent
        else "; the ranks in these logs may not be the whole job (NCCL_DEBUG=INFO prints its "
        "size: 'nranks')"
    )
    return (
        "these logs do not show which rank had not joined (no flight-recorder dump, and no line "
        "with the other ranks' sequence numbers in this process group)" + silent + ". Next "
        "time set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 (or "
        "TORCH_NCCL_DESYNC_DEBUG=1) and give the doctor every rank's log; look for Xid and IB "
        "errors on the job's nodes (dmesg)"
    )
