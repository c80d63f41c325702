"""Disaggregated, optionally asynchronous rollout: a pool of rollout worker processes
(worker.py) apart from the trainer's ranks, fed prompts and weights by the trainer's rank 0.

Transport. Rank 0 hosts a TCPStore; rank 0 and the ``workers`` processes form a gloo process
group of their own (the trainers' world is untouched: DDP / FSDP keep theirs). Weight sync is
the policy's full weights (``full_weights``: an all-gather of FSDP's shards on every trainer
rank, i.e. resharded to the rollout layout, one whole copy) broadcast from rank 0 to every
worker. Prompts go out as commands in the store; each prompt's group of samples comes back as
the store key ``res/{prompt}``, which every trainer rank reads for its own prompts.

Schedule, with staleness s (``[rl] staleness``). Batch j (the prompts of GRPO step j) is
generated with the weights of version max(0, j - s), the policy after j - s updates: at the
start (and after each update to version v) rank 0 broadcasts version v and sends batch v + s.
While the trainer trains step k, the pool generates batch k + s, so s >= 1 overlaps rollout
and training; s = 0 is the synchronous loop. Every sample carries its version and ``take``
refuses one more than s behind (the bound is enforced, not hoped for). The schedule is one
function of (seed, step, s): what a sample is does not depend on which worker made it or when.

Failures. Rank 0 watches its workers while it waits for results and when it broadcasts; when
one dies it kills the rest, starts a fresh pool (a new generation: new group, new command
lists), and re-sends every batch still owed whose results are not in the store, each after the
weights of its version (kept on rank 0 until the batch is taken). Published results are never
re-sent, owed ones always are: no sample is lost or made twice. A checkpoint holds the owed
batches' results (the staleness queue), so a trainer killed and resumed trains on the same
samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aihpc.runspec import SpecError
from aihpc.runtime.rl.rollout import Rollout
from aihpc.runtime.rl.worker import broadcast_weights, gloo_group, unpack

__all__ = ["RolloutPool", "batch_version"]

MAX_RESETS = 8  # pool restarts in a row without a published result: give up
POLL_S = 0.002


def batch_version(batch: int, staleness: int) -> int:
    """The weights version the prompts of GRPO step ``batch`` are generated with."""
    return max(0, batch - staleness)


class RolloutPool:
    """One per trainer rank; rank 0 (``owner``) runs the workers, every rank reads results."""

    def __init__(self, ctx: Any, run_dir: Path, workers: int, staleness: int, g: Any,
                 model_cfg: Any, timeout_s: float = 600.0) -> None:  # fmt: skip
        self.ctx, self.dir, self.g = ctx, run_dir / "rollout", g
        self.workers, self.s = workers, staleness
        self.model_cfg, self.timeout_s = model_cfg, timeout_s
        self.owner = ctx.is_main
        self.store: Any = None
        self.pg: Any = None
        self.procs: list[subprocess.Popen] = []
        self.generation, self.n_cmds = -1, [0] * workers
        self.owed: dict[int, int] = {}  # batch -> version, sent and not yet taken
        self.weights: dict[int, dict[str, torch.Tensor]] = {}  # versions owed batches need
        self.restored: dict[int, bytes] = {}  # a checkpoint's queue: prompt -> result
        self.resets = 0  # restarts since the last published batch
        self.restarts = 0  # in this process's run

    # -- the prompts of a batch ------------------------------------------------------------

    def batch_prompts(self, batch: int) -> list[int]:
        n = self.g.prompts_per_step
        return list(range(batch * n, (batch + 1) * n))

    # -- start, stop -------------------------------------------------------------------------

    def start(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        """Open the store (rank 0 hosts it, every rank connects), start the workers, push the
        weights of version ``step`` and send the batches owed from here (those a checkpoint did
        not bring back). Every trainer rank calls it."""
        port = [0]
        if self.owner:
            self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(days=1))
            port = [self.store.port]
        if self.ctx.world_size > 1:
            dist.broadcast_object_list(port, src=0)
        if not self.owner:  # the workers share rank 0's node; other ranks may not
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            self.store = dist.TCPStore(host, port[0], None, False,
                                       timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg = {"host": "127.0.0.1", "port": port[0], "workers": self.workers, "model":
               asdict(self.model_cfg), "task_base": self.g.task_base, "seed": self.g.seed,
               "samples": self.g.samples_per_prompt, "temperature": self.g.temperature,
               "timeout_s": self.timeout_s}  # fmt: skip
        (self.dir / "worker.json").write_text(json.dumps(cfg, indent=1) + "\n")
        for i, data in self.restored.items():
            self.store.set(f"res/{i}", data)
        self._spawn()
        self.weights[step] = _copy(weights)
        for batch in range(step, min(step + self.s, self.g.steps - 1) + 1):
            version = self.owed.setdefault(batch, batch_version(batch, self.s))
            whole = all(i in self.restored for i in self.batch_prompts(batch))
            # a checkpoint holds every owed batch's results; a memory snapshot, those that had
            # come and the weights to make the rest again
            if version != step and not whole and version not in self.weights:
                raise RuntimeError(f"batch {batch} (version {version}) owed at step {step}")
        self._resend()

    def close(self, kill: bool = False) -> None:
        """Stop the workers after their commands; ``kill``: at once (an in-process restart
        starts a fresh pool from the snapshot)."""
        if not self.owner:
            return
        for slot, p in enumerate(self.procs):
            if kill:
                p.kill()
            elif p.poll() is None and self.pg is not None:
                self._command(slot, {"op": "stop"})
        for p in self.procs:
            try:
                p.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs, self.pg = [], None

    # -- the step's exchange -----------------------------------------------------------------

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> int:
        """After the update to ``version`` (on every rank; rank 0 acts): broadcast the weights
        and send batch version + s, if the run has it. The bytes each worker received."""
        if not self.owner:
            return 0
        done = version - 1  # the batch just trained on: its results are no longer needed
        for i in self.batch_prompts(done):
            self.store.delete_key(f"res/{i}")
            self.restored.pop(i, None)
        nxt = version + self.s
        if nxt < self.g.steps:
            self.owed[nxt] = version
            self.weights[version] = _copy(weights)
        self._forget_versions()
        try:
            moved = self._broadcast(weights, version)
        except RuntimeError as e:  # a worker died mid-broadcast (gloo: connection closed)
            self._reset(str(e))  # the fresh pool is sent every owed batch, nxt's included
            return sum(v.numel() * v.element_size() for v in weights.values())
        if nxt < self.g.steps:
            self._send_batch(nxt, version, self.batch_prompts(nxt))
        return moved

    def take(self, step: int, indices: list[int]) -> tuple[Rollout, torch.Tensor, list[int]]:
        """The rollout of ``indices`` (this rank's prompts of ``step``), its per-row versions
        and sample ids (prompt x samples_per_prompt + j); refuses a sample more than s stale."""
        if self.owner:
            self._wait(self.batch_prompts(step))
            self.owed.pop(step, None)
        else:
            missing = [f"res/{i}" for i in indices if i not in self.restored]
            if missing:
                self.store.wait(missing, timedelta(days=1))
        parts = [unpack(self.restored[i] if i in self.restored else self.store.get(f"res/{i}"))
                 for i in indices]  # fmt: skip
        versions, ids, samples = [], [], self.g.samples_per_prompt
        for i, part in zip(indices, parts, strict=True):
            if part["prompt"] != i or step - part["version"] > self.s:
                raise RuntimeError(
                    f"rollout of prompt {part['prompt']} (version {part['version']}) at step "
                    f"{step}: expected prompt {i}, at most {self.s} versions old"
                )
            versions += [part["version"]] * samples
            ids += [i * samples + j for j in range(samples)]
        fields = ("prompts", "responses", "mask", "rewards", "gen_logprobs")
        ro = Rollout(*(torch.cat([p[k] for p in parts]) for k in fields))
        return ro, torch.tensor(versions), ids

    # -- checkpoints: the staleness queue ----------------------------------------------------

    def state(self, wait: bool = True) -> dict[str, Any]:
        """Rank 0: every owed batch's results (waited for), the queue a resume trains on.
        ``wait`` False (the in-memory snapshot of every step, which must not stall the overlap
        of rollout and training): the results that have come, and the weights of each version
        whose batch is incomplete, with which a fresh pool makes the rest again."""
        queue: dict[int, bytes] = {}
        weights: dict[int, dict[str, torch.Tensor]] = {}
        for batch in sorted(self.owed):
            prompts = self.batch_prompts(batch)
            if wait:
                self._wait(prompts)
            have = [i for i in prompts if i in self.restored or self.store.check([f"res/{i}"])]
            queue |= {i: self.restored.get(i) or self.store.get(f"res/{i}") for i in have}
            if len(have) < len(prompts):
                version = self.owed[batch]
                weights[version] = self.weights[version]
        return {"staleness": self.s, "owed": dict(self.owed), "queue": queue, "weights": weights}

    def load_state(self, state: dict[str, Any], step: int) -> None:
        if state["staleness"] != self.s and state["owed"]:
            raise SpecError("rl.staleness", self.s, f"the checkpoint at step {step} was written "
                            f"with staleness {state['staleness']}; resume with that")  # fmt: skip
        self.restored = dict(state["queue"])
        self.owed = dict(state["owed"])
        self.weights |= state.get("weights", {})

    # -- rank 0: workers, commands, failures ------------------------------------------------

    def _spawn(self) -> None:
        self.generation += 1
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}  # fmt: skip
        env["OMP_NUM_THREADS"] = "1"
        self.procs = []
        for slot in range(self.workers):
            log = open(self.dir / f"worker{slot}.log", "ab")  # noqa: SIM115 (the child's)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "aihpc.runtime.rl.worker", str(self.dir / "worker.json"),
                 str(slot), str(self.generation)], env=env, stdout=log, stderr=log,
            ))  # fmt: skip
            log.close()
        self.n_cmds = [0] * self.workers
        pids = {"generation": self.generation, "pids": [p.pid for p in self.procs]}
        tmp = self.dir / "workers.json.tmp"
        tmp.write_text(json.dumps(pids) + "\n")
        os.replace(tmp, self.dir / "workers.json")
        self.pg = gloo_group(self.store, self.generation, 0, self.workers + 1, self.timeout_s)

    def _command(self, slot: int, cmd: dict[str, Any]) -> None:
        key = f"g{self.generation}/cmd/{slot}/{self.n_cmds[slot]}"
        self.store.set(key, json.dumps(cmd))
        self.n_cmds[slot] += 1

    def _broadcast(self, weights: dict[str, torch.Tensor], version: int) -> int:
        self._check_alive()
        for slot in range(self.workers):
            self._command(slot, {"op": "weights", "version": version})
        return broadcast_weights(self.pg, weights, root=True)

    def _send_batch(self, batch: int, version: int, prompts: list[int]) -> None:
        """Prompts to the workers in contiguous shares (whole groups each)."""
        share = -(-len(prompts) // self.workers)
        for slot in range(self.workers):
            part = prompts[slot * share : (slot + 1) * share]
            if part:
                self._command(slot, {"op": "batch", "version": version, "prompts": part})

    def _wait(self, prompts: list[int]) -> None:
        keys = [f"res/{i}" for i in prompts if i not in self.restored]
        while keys:
            if self.store.check(keys):
                self.resets = 0
                return
            dead = [(p.pid, p.returncode) for p in self.procs if p.poll() is not None]
            if dead:
                self._reset(f"rollout worker (pid, exit code) {dead} ended")
                continue
            keys = [k for k in keys if not self.store.check([k])]
            time.sleep(POLL_S)

    def _check_alive(self) -> None:
        dead = [(p.pid, p.returncode) for p in self.procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"rollout worker (pid, exit code) {dead} ended")

    def _reset(self, why: str) -> None:
        """Kill the pool, start a fresh one, re-send every owed prompt without a result."""
        self.resets += 1
        self.restarts += 1
        if self.resets > MAX_RESETS:
            raise RuntimeError(f"rollout pool: gave up after {MAX_RESETS} restarts ({why})")
        with open(self.dir / "resets.log", "a") as f:
            f.write(f"generation {self.generation}: {why.splitlines()[0][:200]}\n")
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.pg = None
        self._spawn()
        self._resend()

    def _resend(self) -> None:
        """Each owed batch's missing prompts, after the weights of its version (oldest first)."""
        for version in sorted(set(self.owed.values())):
            batches = [b for b, v in sorted(self.owed.items()) if v == version]
            missing = {b: [i for i in self.batch_prompts(b) if i not in self.restored
                           and not self.store.check([f"res/{i}"])] for b in batches}  # fmt: skip
            if not any(missing.values()):
                continue
            try:
                self._broadcast(self.weights[version], version)
                for b, prompts in missing.items():
                    if prompts:
                        self._send_batch(b, version, prompts)
            except RuntimeError as e:
                self._reset(str(e))
                return

    def _forget_versions(self) -> None:
        keep = set(self.owed.values())
        for v in [v for v in self.weights if v not in keep]:
            del self.weights[v]


def _copy(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in weights.items()}
