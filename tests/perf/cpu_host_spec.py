"""tiny-llama-small on a two-rank CPU host whose only figure that matters is its memory
bandwidth: the spec the host-copy tests (FSDP2's, DDP's) price their copies on."""

from __future__ import annotations

from typing import Any

from aihpc.runspec import RunSpec, runspec_from_dict


def cpu_host_spec(bw: float, dispatch: str = "eager", **parallel: Any) -> RunSpec:
    """Two CPU ranks at ``bw`` GB/s, ``training.dtensor_dispatch = dispatch``, global batch 8
    in micro-batches of 2, and the ``[parallel]`` fields given."""
    gpu = {"bf16_tflops": 0.1, "fp32_tflops": 0.1, "hbm_gib": 16, "hbm_bw_GBps": bw,
           "scale_up_bw_GBps": 1.0, "scale_up_domain": 2, "scale_out_bw_GBps": 1.0,
           "gpus_per_node": 2, "host_is_device": True}  # fmt: skip
    return runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small"},
            "cluster": {"num_gpus": 2, "gpus_per_node": 2, "gpu_spec": gpu},
            "training": {"fused_kernels": False, "dtensor_dispatch": dispatch},
            "parallel": {"global_batch_size": 8, "micro_batch_size": 2, **parallel},
        }
    )
