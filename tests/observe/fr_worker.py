"""Two gloo ranks where rank 1 never calls the 4th all_reduce: rank 0 times out in it, and both
dump PyTorch's flight recorder (``TORCH_FR_BUFFER_SIZE`` set by the caller) into ``OUT``.

Run as: ``torchrun --nproc-per-node 2 fr_worker.py OUT`` (tests/observe/conftest.py does).
"""

import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo", timeout=timedelta(seconds=3))
rank = dist.get_rank()
x = torch.ones(8)
for _ in range(3):
    dist.all_reduce(x)
if rank == 0:
    try:
        dist.all_reduce(x)  # rank 1 never joins: gloo times out after 3 s
    except RuntimeError:
        traceback.print_exc()
else:
    time.sleep(4.5)  # busy elsewhere until rank 0 has given up
with open(os.path.join(out, f"fr_trace_rank_{rank}"), "wb") as f:
    f.write(c10d._dump_fr_trace())  # the file name ends with the rank, as PyTorch names dumps
sys.stderr.flush()
os._exit(0)  # the group is broken; destroying it would wait on rank 1's side
