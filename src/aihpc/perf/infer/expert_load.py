"""Published per-GPU expert loads: a run's busiest MoE GPU over the mean, read from its source.

A serving row whose published configuration names its expert placement (EPLB or the default
layout) and whose source publishes the load that placement leaves takes ``moe_imbalance`` from
here through ``expert_load = "<id>"`` instead of the chance floor alone (routing.py): the learned
router's skew is not in the floor. Each entry of ``data/expert_load.csv`` is a published
balancedness b (mean over max per-GPU or per-expert token count, as its source defines it), its
figure, its kind (a simulation or a measured run) and how it was read (plot markers read against
the plot's gridlines, with the reading's uncertainty). The imbalance a step pays is 1 / b.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from importlib import resources

from aihpc.runspec.errors import SpecError

__all__ = ["ExpertLoad", "expert_load", "expert_loads"]


@dataclass(frozen=True)
class ExpertLoad:
    """One published balancedness: ``gpus`` expert-parallel GPUs, ``eplb`` whether EPLB placed the
    experts, ``balancedness`` mean over max load (0 < b <= 1)."""

    id: str
    figure: str
    gpus: int
    eplb: bool
    balancedness: float
    kind: str
    source: str
    reading: str

    @property
    def imbalance(self) -> float:
        """The busiest GPU's load over the mean: 1 / balancedness."""
        return 1.0 / self.balancedness


@functools.cache
def expert_loads() -> dict[str, ExpertLoad]:
    """Every entry of ``data/expert_load.csv`` by id."""
    path = resources.files("aihpc.perf.infer").joinpath("data/expert_load.csv")
    with path.open(encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    out = {}
    for r in rows:
        b = float(r["balancedness"])
        if not 0 < b <= 1:
            raise SpecError(f"expert_load[{r['id']}].balancedness", b, "a number in (0, 1]")
        out[r["id"]] = ExpertLoad(
            id=r["id"],
            figure=r["figure"],
            gpus=int(r["gpus"]),
            eplb=r["eplb"] == "true",
            balancedness=b,
            kind=r["kind"],
            source=r["source"],
            reading=r["reading"],
        )
    return out


def expert_load(load_id: str, ep: int, field: str = "expert_load") -> ExpertLoad:
    """The published load ``load_id`` for a run over ``ep`` expert-parallel GPUs. A load measured
    at another scale is refused: imbalance grows with the GPUs it spreads over."""
    loads = expert_loads()
    if load_id not in loads:
        raise SpecError(field, load_id, "one of " + ", ".join(sorted(loads)))
    found = loads[load_id]
    if found.gpus != ep:
        allowed = f"a load published at ep = {ep} (this one is at {found.gpus})"
        raise SpecError(field, load_id, allowed)
    return found
