"""The labels that join a rank's series with dcgm-exporter's: ``gpu``, ``UUID`` and ``Hostname``.

dcgm-exporter (github.com/NVIDIA/dcgm-exporter) labels every GPU series
``{gpu="0", UUID="GPU-...", pci_bus_id="00000000:07:00.0", device="nvidia0", modelName="...",
Hostname="node1"}``: ``gpu`` is the GPU's NVML index (the one ``nvidia-smi`` shows), ``UUID`` its
``GPU-`` UUID, ``Hostname`` the node's host name (Go's ``os.Hostname()``, or ``NODE_NAME`` where
that is set, as in Kubernetes). A rank's GPU is CUDA device ``local_rank % visible devices`` (the
runtime's choice); this module finds that device in ``nvidia-smi``'s table through
``CUDA_VISIBLE_DEVICES``. Where it cannot be told for sure the GPU labels are empty, which
Prometheus stores as absent: nothing joins rather than the wrong GPU. No torch here.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["NVIDIA_SMI_ARGS", "GpuLabels", "gpu_labels", "hostname", "parse_gpus", "resolve"]

log = logging.getLogger("aihpc.observe")

NVIDIA_SMI_ARGS = ("nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader")


@dataclass(frozen=True)
class GpuLabels:
    """dcgm-exporter's names for one rank's GPU; empty strings where unknown (a CPU run)."""

    gpu: str = ""
    uuid: str = ""
    hostname: str = ""

    def labels(self) -> dict[str, str]:
        return {"gpu": self.gpu, "UUID": self.uuid, "Hostname": self.hostname}


def hostname(env: Mapping[str, str] | None = None) -> str:
    """The host name as dcgm-exporter labels it: ``NODE_NAME`` if set, else the kernel's."""
    env = os.environ if env is None else env
    return env.get("NODE_NAME") or socket.gethostname()


def parse_gpus(text: str) -> list[tuple[str, str, str]]:
    """(index, uuid, name) rows of ``nvidia-smi`` run with ``NVIDIA_SMI_ARGS``."""
    rows = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) >= 3 and cells[0].isdigit() and cells[1].startswith("GPU-"):
            rows.append((cells[0], cells[1], ",".join(cells[2:])))
    return rows


def _visible(env: Mapping[str, str]) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it (up to the first entry it cannot read), or None
    when unset."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    out = []
    for entry in (e.strip() for e in raw.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        out.append(entry)
    return out


def resolve(
    local_rank: int, rows: list[tuple[str, str, str]], env: Mapping[str, str]
) -> tuple[str, str, str]:
    """(gpu index, UUID, why-not) of CUDA device ``local_rank % visible`` in ``rows``; an empty
    index and UUID with the reason when the device cannot be told for sure."""
    if not rows:
        return "", "", "nvidia-smi lists no GPU"
    visible = _visible(env)
    if visible is not None and not visible:
        return "", "", "CUDA_VISIBLE_DEVICES names no GPU"
    entry = str(local_rank % len(rows)) if visible is None else visible[local_rank % len(visible)]
    if entry.startswith("MIG-"):
        return "", "", f"{entry} is a MIG instance (dcgm-exporter labels those by GPU_I_ID)"
    if entry.startswith("GPU-"):  # CUDA takes a unique UUID prefix
        found = [r for r in rows if r[1].startswith(entry)]
        if len(found) != 1:
            return "", "", f"CUDA_VISIBLE_DEVICES entry {entry} matches {len(found)} GPUs"
        return found[0][0], found[0][1], ""
    # A number is CUDA's ordinal: NVML's (PCI bus) order under CUDA_DEVICE_ORDER=PCI_BUS_ID, and
    # on a node of one GPU model also under CUDA's default FASTEST_FIRST (equals sort by bus id).
    if env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len({r[2] for r in rows}) > 1:
        return "", "", "mixed GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID"
    found = [r for r in rows if r[0] == entry]
    if not found:
        return "", "", f"nvidia-smi lists no GPU {entry}"
    return found[0][0], found[0][1], ""


def gpu_labels(
    local_rank: int, on_gpu: bool, env: Mapping[str, str] | None = None, timeout_s: float = 10.0
) -> GpuLabels:
    """This rank's labels: the host name always; the GPU's index and UUID on a GPU run whose
    device ``nvidia-smi`` identifies."""
    env = os.environ if env is None else env
    host = hostname(env)
    if not on_gpu:
        return GpuLabels(hostname=host)
    binary = shutil.which(NVIDIA_SMI_ARGS[0])
    if binary is None:
        log.warning("no nvidia-smi: the metrics carry no gpu/UUID label to join dcgm-exporter's")
        return GpuLabels(hostname=host)
    try:
        proc = subprocess.run(
            [binary, *NVIDIA_SMI_ARGS[1:]], capture_output=True, text=True, timeout=timeout_s
        )
        text = proc.stdout if proc.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    gpu, uuid, why = resolve(local_rank, parse_gpus(text), env)
    if why:
        log.warning("metrics without gpu/UUID labels (no join with dcgm-exporter): %s", why)
    return GpuLabels(gpu, uuid, host)
