"""The array search prices eager FSDP2 (perf/step/fsdp_host.py) as estimate_plan prices one plan:
every candidate of a CPU-hosted and a GPU spec with ``dtensor_dispatch = "eager"``."""

from __future__ import annotations

import numpy as np
import pytest

from aihpc.perf.search.ranking import _valid_batch
from aihpc.perf.step.batch import price_batch
from aihpc.perf.step.estimate import estimate_plan
from aihpc.perf.step.params import DEFAULT_PARAMS
from aihpc.runspec import runspec_from_dict

CPU = {"bf16_tflops": 0.1, "fp32_tflops": 0.1, "hbm_gib": 16, "hbm_bw_GBps": 20.0,
       "scale_up_bw_GBps": 1.0, "scale_up_domain": 8, "scale_out_bw_GBps": 1.0,
       "gpus_per_node": 8, "host_is_device": True}  # fmt: skip


@pytest.mark.parametrize("host", ["cpu", "h100-sxm"])
def test_every_eager_fsdp_plan_priced_as_estimate_plan_prices_it(host: str) -> None:
    gpu = {"gpu_spec": CPU} if host == "cpu" else {"gpu": host}
    spec = runspec_from_dict(
        {
            "model": {"preset": "tiny-llama-small"},
            "cluster": {"num_gpus": 8, "gpus_per_node": 8, **gpu},
            "training": {"fused_kernels": False, "dtensor_dispatch": "eager"},
            "parallel": {"global_batch_size": 32},
        }
    )
    batch, _ = _valid_batch(spec.model, spec.cluster, spec.parallel, spec.training, None, None)
    assert np.any(batch.zero == 3) and np.any((batch.zero == 1) | (batch.zero == 2))
    times = price_batch(spec.model, spec.cluster, batch, spec.training, DEFAULT_PARAMS)
    sample = np.random.default_rng(0).choice(len(batch), size=min(len(batch), 150), replace=False)
    for i in sample:
        est = estimate_plan(spec.model, spec.cluster, batch.plan(i), spec.training, check=False)
        assert times.step_time_s[i] == pytest.approx(est.step_time_s, rel=1e-12, abs=0)
