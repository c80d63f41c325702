"""Start torchrun's elastic agent in this process, with the training command as its workers."""

from __future__ import annotations

import os
import sys
import uuid

from aihpc.runtime.distributed import free_port

__all__ = ["launch_elastic"]


def launch_elastic(
    nproc_per_node: int, max_restarts: int, worker_args: list[str], monitor_interval_s: float = 0.1
) -> int:
    """Run ``python -m aihpc <worker_args>`` on ``nproc_per_node`` local workers under the
    torchelastic agent; restart the whole group up to ``max_restarts`` times. Exit code 0 or 1.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # With the shared rendezvous store, restarted gloo workers read the dead generation's
    # addresses and fail (pytorch#135712); a store per attempt makes restarts reliable.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ["AIHPC_ELASTIC_AGENT"] = "1"  # workers leave the summary to the agent
    if nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=f"aihpc-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        monitor_interval=monitor_interval_s,
        start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "aihpc", *worker_args)
    except ChildFailedError as err:
        print(
            f"error: training failed after {max_restarts} restart(s): "
            f"{err.get_first_failure()[1].message if err.failures else err}",
            file=sys.stderr,
        )
        return 1
    return 0
