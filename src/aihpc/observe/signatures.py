"""The log lines ``aihpc doctor`` recognises: one regular expression per format, in the exact
form the tool prints it (the source is named beside each; docs/doctor.md has the table).

Each signature gives a failure class and a tier:

* ``cause``: can start a failure by itself (an Xid, an OOM, an exception, a node failure, ...);
* ``symptom``: what ranks report while waiting on a cause (a collective timeout, a hang);
* ``follow_on``: what the rest of the job prints once something died (peer closed, teardown);
* ``context``: facts, not failures (the watchdog's sequence numbers, a benign IB event).

Lines are matched after a launcher's rank prefix is removed; the first signature that matches
wins, so the specific forms come before the generic ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["EXCEPTION_LINE", "SIGNATURES", "Signature", "classify_exitcode", "signal_name"]

_SIZE = r"[\d.]+ (?:[KMGTP]i)?B|0 bytes"


@dataclass(frozen=True)
class Signature:
    cls: str
    tier: str
    pattern: re.Pattern[str]
    source: str


def _s(cls: str, tier: str, pattern: str, source: str) -> Signature:
    return Signature(cls, tier, re.compile(pattern), source)


_PT = "PyTorch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"
_NCCL_IB = "NCCL src/transport/net_ib.cc"
_SLURMSTEPD = "Slurm src/slurmd/slurmstepd/req.c"
_FR = "PyTorch torchfrtrace (torch/distributed/flight_recorder/components/utils.py)"

SIGNATURES: tuple[Signature, ...] = (
    # ---- a CUDA error the NCCL watchdog found (WorkNCCL::finishedGPUExecutionInternal) is the
    # first and often only print of it: a cause, although teardown lines carry it -------------
    _s(
        "cuda_error",
        "cause",
        r"(?:Process group|NCCL) watchdog thread terminated with exception: (?:\[[^\]]*\] )?"
        r"CUDA error: (?P<error>[a-z][^.\n]*?)(?:\n|$|\. |\.$| CUDA kernel errors)",
        _PT + " (watchdog: WorkNCCL::finishedGPUExecutionInternal's C10_CUDA_CHECK)",
    ),
    # ---- teardown next: these lines repeat a cause's text inside them ------------------------
    _s(
        "teardown",
        "follow_on",
        r"(?:Process group|NCCL) watchdog thread terminated with exception|"
        r"terminate called after throwing an instance of|^\s*what\(\):|"
        r"Some NCCL operations have failed or timed out|"
        r"To avoid data inconsistency, we are taking the entire process down|"
        r"Stack trace of the failed collective not found",
        _PT,
    ),
    _s(
        "agent_sigterm",
        "follow_on",
        r"Sending process (?P<pid>\d+) closing signal (?P<signal>SIG\w+)|"
        r"Received (?P<signum>\d+) death signal, shutting down workers",
        "PyTorch torch/distributed/elastic/multiprocessing/api.py",
    ),
    _s(
        "nccl_comm",
        "context",
        r"NCCL INFO comm 0x[0-9a-f]+ rank (?P<comm_rank>\d+) nranks (?P<nranks>\d+)",
        "NCCL src/init.cc (the 'Init COMPLETE' line: which host and PID hold which rank)",
    ),
    # ---- hardware ------------------------------------------------------------------------------
    _s(
        "xid",
        "cause",
        r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): (?P<xid>\d+)"
        r"(?:, pid=(?P<pid>'?[^,]*'?))?(?:, name=(?P<pname>[^,]*))?,?\s*(?P<msg>.*)",
        "NVIDIA Xid Errors (docs.nvidia.com/deploy/xid-errors); kernel log",
    ),
    _s(
        "gpu_lost",
        "cause",
        r"NVRM: GPU (?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F:.]+): GPU has fallen off the bus|"
        r"NVRM: fallen off the bus and is not responding to commands|"
        r"Unable to determine the device handle for GPU ?(?:\d+: )?(?P<smi_pci>[0-9a-fA-F:.]+): "
        r"GPU is lost",
        "NVIDIA driver (kernel log: 'GPU has fallen off the bus' with or without its Xid 79 "
        "line; 'The NVIDIA GPU ... has fallen off the bus and is not responding'); nvidia-smi "
        "(NVML_ERROR_GPU_IS_LOST)",
    ),
    _s(
        "ib_error",
        "cause",
        r"NET/IB : Got completion from peer (?P<peer>\S+) with (?:error |status=)(?P<status>\d+)"
        r",? ?opcode[ =](?P<opcode>\d+),? ?len[ =](?P<len>\d+),? ?vendor err (?P<vendor>\d+)"
        r"(?: \((?P<dir>\w+)\))?",
        _NCCL_IB + " (ncclIbTest; 'status=' form since NCCL 2.19)",
    ),
    _s(
        "ib_port_event",
        "cause",
        r"NET/IB : (?:(?P<dev>\S+):(?P<port>\d+) )?Got async event : "
        r"(?P<event>port error|local catastrophic error|device fatal|.*fatal.*)",
        _NCCL_IB + " (ncclIbAsyncThreadMain); event names: libibverbs ibv_event_type_str",
    ),
    _s(
        "ib_event",
        "context",
        r"NET/IB : (?:(?P<dev>\S+):(?P<port>\d+) )?Got async event : (?P<event>.+)",
        _NCCL_IB,
    ),
    _s(
        "cuda_oom",
        "cause",
        r"CUDA out of memory\. Tried to allocate (?P<tried>" + _SIZE + r")[.;]? ?"
        r"(?:GPU (?P<gpu>\d+) has a total capac\w* of (?P<total>" + _SIZE + r") of which "
        r"(?P<free>" + _SIZE + r") is free\.)?"
        r"(?:.*?this process has (?P<in_use>" + _SIZE + r") memory in use\.)?"
        r"(?:.*?Of the allocated memory (?P<allocated>" + _SIZE + r") is allocated by PyTorch, "
        r"and (?P<reserved>" + _SIZE + r") is reserved by PyTorch but unallocated)?"
        r"(?:\(GPU (?P<gpu_old>\d+); (?P<total_old>" + _SIZE + r") total capacity; "
        r"(?P<allocated_old>" + _SIZE + r") already allocated; (?P<free_old>" + _SIZE + r") free)?",
        "PyTorch c10/cuda/CUDACachingAllocator.cpp (malloc's OutOfMemoryError message)",
    ),
    _s(
        "host_oom",
        "cause",
        r"Detected (?P<events>\d+) oom[_-]kill event|"
        r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,-]+): Out Of Memory|"
        r"[Oo]ut of memory: Killed process (?P<pid>\d+) \((?P<comm>[^)]+)\)",
        "Slurm task/cgroup (oom_kill events), srun; Linux mm/oom_kill.c",
    ),
    _s(
        "segfault",
        "cause",
        r"(?P<comm>\S+)\[(?P<pid>\d+)\]: segfault at (?P<addr>[0-9a-f]+) ip (?P<ip>[0-9a-f]+) "
        r"sp [0-9a-f]+ error (?P<err>\d+)(?: in (?P<obj>[^\[\s]+))?|"
        r"Fatal Python error: Segmentation fault|"
        r"Signal 11 \(SIGSEGV\) received by PID (?P<sig_pid>\d+)",
        "Linux arch/x86/mm/fault.c (show_signal_msg); CPython faulthandler; torchelastic",
    ),
    _s(
        "cuda_error",
        "cause",
        r"CUDA error: (?P<error>[a-z][^.\n]*?)(?:\n|$|\. |\.$| CUDA kernel errors)",
        "PyTorch c10/cuda/CUDAException (C10_CUDA_CHECK)",
    ),
    # ---- the scheduler -------------------------------------------------------------------------
    _s(
        "slurm_cancelled",
        "cause",
        r"\*\*\* (?P<entity>JOB \d+|STEP [\w.]+) (?:ON (?P<node>\S+) )?CANCELLED AT (?P<at>\S+)"
        r"(?: DUE TO (?P<reason>TIME LIMIT|PREEMPTION|NODE FAILURE|JOB REQUEUE))?",
        _SLURMSTEPD + " (_handle_signal_container)",
    ),
    _s(
        "node_failure",
        "cause",
        r"srun: error: Node failure on (?P<node>\S+)",
        "Slurm src/srun (launch node-failure handler)",
    ),
    # ---- collectives and hangs ---------------------------------------------------------------
    _s(
        "collective_mismatch",
        "cause",
        r"Detected mismatch between collectives on ranks\. Rank (?P<rank_a>\d+) is running "
        r"collective: CollectiveFingerPrint\(SequenceNumber=(?P<seq>\d+), OpType=(?P<op>\w+)"
        r".*?but Rank (?P<rank_b>\d+) is running collective: CollectiveFingerPrint\("
        r"SequenceNumber=(?P<seq_b>\d+), OpType=(?P<op_b>\w+)",
        "PyTorch torch/csrc/distributed/c10d/ProcessGroupWrapper.cpp "
        "(TORCH_DISTRIBUTED_DEBUG=DETAIL)",
    ),
    _s(
        "collective_mismatch",
        "cause",
        r"^error msg: Culprit rank (?P<culprit>\d+); Error type: (?P<fr_error>"
        r"COLLECTIVE_TYPE_MISMATCH|SIZE_OR_SYNTAX_MISMATCH|COLLECTIVE_DTYPE_MISMATCH)"
        r"(?:, (?P<what>.*))?",
        _FR + " (error_analysis: 'Collective sequence number: N has errors')",
    ),
    _s(
        "collective_stuck",
        "symptom",
        r"^Not all ranks joining collective, sequence number: (?P<seq>\d+)",
        _FR + " (error_analysis)",
    ),
    _s(
        "fr_missing",
        "context",
        r"^missing ranks: \{(?P<ranks>\d+(?:, \d+)*)\}",
        _FR + " (EntryState.log: the ranks that never joined the collective above)",
    ),
    _s(
        "desync_missing",
        "context",
        r"To our best knowledge, ranks \[(?P<ranks>\d+(?:, \d+)*)\] are the lagging ranks that "
        r"caused this timeout",
        "PyTorch torch/csrc/distributed/c10d/TraceUtils.h (retrieveDesyncReport, "
        "TORCH_NCCL_DESYNC_DEBUG=1)",
    ),
    _s(
        "nccl_timeout",
        "symptom",
        r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), "
        r"OpType=(?P<op>\w+)(?:, NumelIn=(?P<numel_in>\d+), NumelOut=(?P<numel_out>\d+))?"
        r"(?:, Timeout\(ms\)=(?P<timeout_ms>\d+))?\) ran for (?P<ran_ms>\d+) milliseconds",
        _PT + " (WorkNCCL::checkTimeout)",
    ),
    _s(
        "nccl_progress",
        "context",
        r"(?:Timeout at NCCL work|detected by watchdog at work|"
        r"failure detected by watchdog at work sequence id): (?P<seq>-?\d+),? "
        r"(?:PG status: )?last enqueued (?:NCCL )?work: (?P<enqueued>-?\d+), "
        r"last completed (?:NCCL )?work: (?P<completed>-?\d+)",
        _PT + " (watchdogHandler, 2.2-2.6 and later forms)",
    ),
    _s(
        "nccl_progress",
        "context",
        r"Received a dump signal due to a collective timeout from (?:rank (?P<from_rank>\d+)|"
        r"this local rank).*?Last enqueued NCCL work: (?P<enqueued>-?\d+), "
        r"last completed NCCL work: (?P<completed>-?\d+)",
        _PT + " (HeartbeatMonitor: the ranks told to dump, with their own progress)",
    ),
    _s(
        "heartbeat_timeout",
        "symptom",
        r"Heartbeat monitor timed out|monitoring thread.*(?:stuck|timed out)",
        _PT + " (HeartbeatMonitor)",
    ),
    _s(
        "collective_timeout",
        "symptom",
        r"Timed out waiting (?P<ms>\d+)ms for (?P<op>\w+) operation to complete|"
        r"Wait timeout for (?P<what>.+)",
        "gloo/transport/tcp/unbound_buffer.cc",
    ),
    _s(
        "hang",
        "symptom",
        r"watchdog: rank (?P<rank>\d+) made no progress for (?P<stalled_s>[\d.]+) s "
        r"(?:in phase (?P<phase>[\w -]+?) )?after step (?P<step>-?\d+) "
        r"\(bound (?P<bound_s>[\d.]+) s\)",
        "aihpc src/aihpc/resilience/watchdog.py",
    ),
    _s(
        "peer_closed",
        "follow_on",
        r"Connection closed by peer|Connection reset by peer|ncclRemoteError|"
        r"remote process exited or there was a network error|Broken pipe|"
        r"Connection refused|DistNetworkError|recvBytes|sendBytes failed",
        "gloo tcp/pair.cc; NCCL ncclRemoteError; c10d TCPStore",
    ),
    _s(
        "nccl_error",
        "cause",
        r"(?P<code>ncclUnhandledCudaError|ncclSystemError|ncclInternalError|ncclInvalidUsage)"
        r"|NCCL WARN Cuda failure '(?P<cuda>[^']+)'",
        "NCCL src/include/checks.h; PyTorch NCCLUtils.hpp",
    ),
    # ---- the launcher's summaries --------------------------------------------------------------
    _s(
        "done",
        "context",
        r"^trained \d+ steps on (?P<world>\d+) rank|\"final_step\": \d+",
        "aihpc train (its closing line and JSON summary)",
    ),
    _s(
        "world",
        "context",
        r"^\s*\"world_size\": (?P<world>\d+)",
        "aihpc train (its JSON summary)",
    ),
    _s(
        "worker_failed",
        "context",
        r"failed \(exitcode: (?P<exitcode>-?\d+)\) local_rank: (?P<local_rank>\d+) "
        r"\(pid: (?P<pid>\d+)\)",
        "PyTorch torch/distributed/elastic/multiprocessing/api.py",
    ),
    _s(
        "srun_task",
        "context",
        r"srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,-]+): "
        r"(?P<what>Killed|Exited with exit code (?P<exitcode>\d+)|Segmentation fault|Aborted|"
        r"Terminated)",
        "Slurm src/srun (task exit messages)",
    ),
)

# The last line of a Python traceback: "pkg.mod.SomeError: message".
EXCEPTION_LINE = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Fault|Exit|Interrupt))(?:: (?P<message>.*))?$"
)

_SIGNAL_NAMES = {6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM", 7: "SIGBUS"}


def classify_exitcode(code: int) -> tuple[str, str]:
    """A worker's exit code as torchelastic reports it → (class, tier). Negative = signal."""
    if code == -9:
        return "killed", "cause"  # SIGKILL: the OOM killer, scancel, or a peer's watchdog
    if code == -11 or code == -7:
        return "segfault", "cause"
    if code == -6:
        return "aborted", "symptom"  # SIGABRT: PyTorch's watchdog takes the process down
    if code == -15:
        return "terminated", "follow_on"  # SIGTERM: the agent stopping the survivors
    if code == 75:
        return "hang", "symptom"  # aihpc's watchdog (HANG_EXIT_CODE)
    return "exited", "context"  # 1: an exception, explained by its traceback


def signal_name(code: int) -> str:
    return _SIGNAL_NAMES.get(-code, f"signal {-code}") if code < 0 else f"exit code {code}"
