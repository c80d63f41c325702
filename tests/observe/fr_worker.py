"""Two gloo ranks where rank 1 never calls the 4th all_reduce: rank 0 times out in it, and both
dump PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE`` set by the caller) into ``OUT``.
With MODE ``mismatch``, rank 0 calls a broadcast as its 4th collective while rank 1 calls the
all_reduce: both time out (or, under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, PyTorch's
ProcessGroupWrapper raises its mismatch error at once), and both dump.

Run as: ``torchrun --nproc-per-node 2 fr_worker.py OUT [MODE]`` (tests/observe/conftest.py does).
"""

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

out = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "missing"
# Start-up gets a long timeout: on a loaded machine one rank may finish importing torch many
# seconds after the other, and only the 4th all_reduce is meant to run out.
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = dist.distributed_c10d._get_default_store()
x = torch.ones(8)
for _ in range(3):
    dist.all_reduce(x)
if mode == "mismatch":
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3))
    try:
        if rank == 0:
            dist.broadcast(x, 0)  # rank 1 calls all_reduce as the same collective
        else:
            dist.all_reduce(x)
    except RuntimeError:
        traceback.print_exc()
elif rank == 0:
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3))  # this rank's wait only
    try:
        dist.all_reduce(x)  # rank 1 never joins: gloo times out after 3 s
    except RuntimeError:
        traceback.print_exc()
else:
    # busy elsewhere until rank 0 has given up and dumped (an event, not a sleep that a loaded
    # machine can outlast: rank 1 leaving first would end rank 0's wait with a closed
    # connection instead of the timeout)
    store.wait(["rank0_gave_up"], timedelta(seconds=120))
with open(os.path.join(out, f"fr_trace_rank_{rank}"), "wb") as f:
    f.write(c10d._dump_fr_trace())  # the file name ends with the rank, as PyTorch names dumps
if rank == 0:
    store.set("rank0_gave_up", "1")
elif mode == "mismatch":  # leave only once rank 0 has dumped too
    store.wait(["rank0_gave_up"], timedelta(seconds=120))
sys.stderr.flush()
os._exit(0)  # the group is broken; destroying it would wait on rank 1's side
