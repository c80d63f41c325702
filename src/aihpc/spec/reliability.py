"""ReliabilitySpec: ``[reliability]`` — failure rates and recovery costs for the goodput model.

Owned by the goodput work (aihpc.perf.goodput); every default carries its source there.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReliabilitySpec"]


@dataclass(frozen=True)
class ReliabilitySpec:
    """Overrides of the published default failure and recovery figures (none set = defaults)."""
