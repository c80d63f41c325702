"""Arithmetic that takes one plan's numbers or numpy arrays of plans.

The step-time terms (batch_step.py, batch_shapes.py) run on a ``PlanBatch`` whose columns are
either numpy arrays (the search: tens of thousands of plans at once) or plain Python numbers (one
plan: ``aihpc estimate``, the validation, the fits). numpy's ufuncs take both, but on Python
numbers they cost a microsecond each and return numpy scalars; these helpers keep one plan on
plain Python arithmetic (the same IEEE operations, so the same floats) and arrays on numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["any_", "is_array", "maximum", "minimum", "where"]


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def where(cond: Any, a: Any, b: Any) -> Any:
    """``np.where``; for one plan, ``a if cond else b`` (both already computed, as numpy does)."""
    if isinstance(cond, np.ndarray):
        return np.where(cond, a, b)
    return a if cond else b


def maximum(a: Any, b: Any) -> Any:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return max(a, b)


def minimum(a: Any, b: Any) -> Any:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.minimum(a, b)
    return min(a, b)


def any_(x: Any) -> bool:
    """Whether any plan has ``x`` true (or non-zero)."""
    return bool(x.any()) if isinstance(x, np.ndarray) else bool(x)
