"""Train many plans in one set of processes (torchrun --nproc-per-node N nd_worker.py ...).

Each plan runs the real trainer (``aihpc.runtime.train.train``) in a fresh run directory with
its own device mesh, in the one process group this worker starts: the interpreter, torch and
the process group are paid for once, not once per plan. Rank 0 writes, per plan, the trainer's
summary (or the error) to OUT/NAME.json.

    argv: OUT_DIR  SPEC_JSON  PLANS_JSON  [BASES_JSON]
    (PLANS_JSON: {name: {[parallel] table}}; BASES_JSON, optional: {name: spec} for the plans
    trained from another spec than SPEC_JSON, e.g. another model)
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from aihpc.resilience import Watchdog
from aihpc.runspec import runspec_from_dict
from aihpc.runtime.distributed import init_distributed
from aihpc.runtime.train import TrainOptions, train


def main() -> None:
    out, base, plans = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    bases = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    with init_distributed(timeout_s=120) as ctx:
        for name, table in plans.items():
            run_dir = out / name
            run_dir.mkdir(parents=True, exist_ok=True)
            spec = runspec_from_dict({**bases.get(name, base), "parallel": table})
            opts = TrainOptions(run_dir=run_dir, progress=False, lock_held=True)
            watchdog = Watchdog(run_dir, ctx.rank, 120.0, startup_timeout_s=120.0).start()
            try:
                result = {"ok": True, **train(spec, opts, ctx, watchdog)}
            except Exception as err:  # record it and go on with the next plan
                result = {"ok": False, "error": "".join(traceback.format_exception(err))}
            finally:
                watchdog.stop()
            if ctx.rank == 0:
                (out / f"{name}.json").write_text(json.dumps(result))
            if not result["ok"]:
                print(f"rank {ctx.rank} plan {name}: {result['error']}", file=sys.stderr)
                os._exit(1)  # a failed collective leaves the group unusable


if __name__ == "__main__":
    main()
