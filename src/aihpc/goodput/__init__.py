"""Goodput at scale: failure rates and checkpoint / recovery costs (``failures``), the
effective-training-time ratio, checkpoint intervals and time-to-train (``ettr``), recovery
strategies compared (``strategies``), an event simulator that checks the analytic model
(``simulator``) and the ETTR-by-scale plot (``plot``).

Imports ``aihpc.runspec`` and the step model's checkpoint size (``aihpc.perf``); never torch.
"""

from aihpc.goodput.ettr import GoodputReport, goodput_model, goodput_report
from aihpc.goodput.failures import failure_model

__all__ = ["GoodputReport", "failure_model", "goodput_model", "goodput_report"]
