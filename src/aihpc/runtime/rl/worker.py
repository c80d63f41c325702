"""A disaggregated rollout worker: a process of its own that holds a plain copy of the policy,
takes the weights the trainer broadcasts over a gloo process group, generates the groups of
the prompts it is sent with the KV cache (rollout.rollout, the colocated code path), and
publishes each prompt's group to the trainer's store. Started by pool.RolloutPool:

    python -m aihpc.runtime.rl.worker RUN_DIR/rollout/worker.json SLOT GENERATION

Everything it needs comes from the trainer's rank 0: ``worker.json`` (the model's shape, the
task, the sampling) and, through the TCPStore at the address it names, an ordered list of
commands (JSON: nothing read from the network is unpickled; results go back as tensors, read
with ``weights_only``), ``g{generation}/cmd/{slot}/{n}``:

    {"op": "weights", "version": v}   join the broadcast of the policy's weights (version v)
    {"op": "batch", "version": v, "prompts": [i, ...]}   generate, publish ``res/{i}``
    {"op": "stop"}

A worker keeps no state beyond its weights: the trainer may kill and replace the whole pool at
any time (pool.py, ``reset``) and re-send what was not published. Its process dies with its
parent (PR_SET_PDEATHSIG) and when the store goes away (the trainer died).
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import signal
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aihpc.runtime.config import LlamaConfig, MoEConfig
from aihpc.runtime.model import Llama
from aihpc.runtime.rl.rollout import rollout
from aihpc.runtime.rl.task import AdditionTask

__all__ = ["broadcast_weights", "gloo_group", "pack", "unpack"]

WAIT = timedelta(days=1)  # a command may be an hour away (a supervised warm-up, an eval)


def gloo_group(store: Any, generation: int, rank: int, size: int, timeout_s: float) -> Any:
    """The trainer's rank 0 (rank 0) and the pool's workers (1..size-1): a gloo group of their
    own, apart from the trainers' world, keyed by the pool's ``generation``."""
    prefix = dist.PrefixStore(f"g{generation}/pg/", store)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(prefix, rank, size, opts)


def _buckets(weights: dict[str, torch.Tensor]) -> dict[torch.dtype, list[str]]:
    out: dict[torch.dtype, list[str]] = {}
    for name in sorted(weights):
        out.setdefault(weights[name].dtype, []).append(name)
    return out


def broadcast_weights(pg: Any, weights: dict[str, torch.Tensor], root: bool) -> int:
    """Rank 0's ``weights`` into every member's ``weights`` (the same names and shapes): one
    flat buffer per dtype, one gloo broadcast each. The bytes each receiver gets."""
    moved = 0
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for dtype, names in _buckets(weights).items():
        if root:
            flat = torch.cat([weights[n].detach().reshape(-1).to(dtype) for n in names])
        else:
            flat = torch.empty(sum(weights[n].numel() for n in names), dtype=dtype)
        pg.broadcast([flat], opts).wait()
        moved += flat.numel() * flat.element_size()
        if not root:
            offset = 0
            with torch.no_grad():
                for n in names:
                    size = weights[n].numel()
                    weights[n].copy_(flat[offset : offset + size].view_as(weights[n]))
                    offset += size
    return moved


def pack(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _die_with_parent() -> None:
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the store's closing still ends the worker
        return
    if os.getppid() != parent:
        os._exit(1)


def serve(cfg: dict[str, Any], slot: int, generation: int) -> None:
    """The command loop of worker ``slot`` of the pool's ``generation``."""
    torch.set_num_threads(1)
    store = dist.TCPStore(cfg["host"], cfg["port"], None, False, timeout=WAIT)
    pg = gloo_group(store, generation, slot + 1, cfg["workers"] + 1, cfg["timeout_s"])
    shape = dict(cfg["model"])
    moe = shape.pop("moe")
    model = Llama(LlamaConfig(**shape, moe=MoEConfig(**moe) if moe else None))
    model.init_weights(0)  # buffers; every weight comes from the trainer
    model.requires_grad_(False).eval()
    weights = model.state_dict()
    task = AdditionTask(base=cfg["task_base"], seed=cfg["seed"])
    version, n = -1, 0
    while True:
        cmd = json.loads(store.get(f"g{generation}/cmd/{slot}/{n}"))
        n += 1
        if cmd["op"] == "stop":
            return
        if cmd["op"] == "weights":
            broadcast_weights(pg, weights, root=False)
            version = cmd["version"]
            continue
        if cmd["version"] != version:  # the trainer's order of commands guarantees it
            raise RuntimeError(f"batch of version {cmd['version']}, weights at {version}")
        for i in cmd["prompts"]:
            ro = rollout(model, task, [i], cfg["samples"], cfg["seed"], cfg["temperature"])
            fields = {k: getattr(ro, k) for k in ("prompts", "responses", "mask", "rewards",
                                                  "gen_logprobs")}  # fmt: skip
            store.set(f"res/{i}", pack({**fields, "version": version, "prompt": i}))


def main(argv: list[str]) -> None:
    _die_with_parent()
    with open(argv[0]) as f:
        cfg = json.load(f)
    try:
        serve(cfg, int(argv[1]), int(argv[2]))
    except dist.DistNetworkError as e:  # the trainer (its store's host) is gone: so are we
        print(f"rollout worker {argv[1]}: the trainer's store closed ({e})", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
