"""The model against measurements: published and user runs (``runs_csv``), the validation report
(``validate``), the efficiency fit to a user's runs (``runs_fit``), and what a calibration file
changed in an estimate (``calibration_use``)."""

from aihpc.perf.fit.validate import ValidationReport, validate

__all__ = ["ValidationReport", "validate"]
