"""Micro-benchmarks that measure the cluster and calibrate the performance model.

* ``aihpc.bench.comm`` / ``aihpc.bench.gemm`` / ``aihpc.bench.dist``: collective and GEMM
  benchmarks over torch.distributed (import torch; import them by module).
* the names below (nccl-tests semantics, the nccl-tests log parser, the fitter) need only numpy, so
  ``aihpc calibrate`` on an nccl-tests log works without torch installed.
"""

from aihpc.bench.calibrate import (
    CommPoint,
    FitReport,
    fit_comm,
    fit_regime,
    fit_to_calibration,
    load_measurements,
)
from aihpc.bench.collectives import (
    algbw_GBps,
    busbw_factor,
    busbw_GBps,
    element_counts,
    format_row,
    parse_size,
    size_sweep,
)
from aihpc.bench.nccl_log import NcclRow, NcclTest, parse_nccl_tests, read_nccl_tests_log

__all__ = [
    "CommPoint",
    "FitReport",
    "NcclRow",
    "NcclTest",
    "algbw_GBps",
    "busbw_GBps",
    "busbw_factor",
    "element_counts",
    "fit_comm",
    "fit_regime",
    "fit_to_calibration",
    "format_row",
    "load_measurements",
    "parse_nccl_tests",
    "parse_size",
    "read_nccl_tests_log",
    "size_sweep",
]
