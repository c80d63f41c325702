"""Import paths of aihpc 0.1 that moved in the package layout of 0.2, kept working for one release.

``aihpc.spec`` became ``aihpc.runspec``; the flat ``aihpc.perf`` became ``perf.step`` (the step
model), ``perf.search``, ``perf.fit`` (validation and calibration against runs) and a top-level
``aihpc.goodput``. Importing an old path gives a module that reads every name from the new one
(or, where a module was split, from the new ones in turn) and warns once with a
``DeprecationWarning`` naming the new path. docs/architecture.md lists the layout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

__all__ = ["MOVED", "install"]

_RUNSPEC = (
    "errors _table tomlw model cluster parallel training reliability calibration runspec reference"
)
_STEP = (
    "flops params numeric memory compute attention_kernels moe_kernels moe_host dtensor_host "
    "tp_overlap comm dp_comm pipeline plan_batch batch batch_shapes batch_memory batch_step "
    "estimate"
)

# old dotted path -> the new module(s) its names come from, first match wins
MOVED: dict[str, tuple[str, ...]] = {
    "aihpc.spec": ("aihpc.runspec",),
    **{f"aihpc.spec.{m}": (f"aihpc.runspec.{m}",) for m in _RUNSPEC.split()},
    **{f"aihpc.perf.{m}": (f"aihpc.perf.step.{m}",) for m in _STEP.split()},
    # split modules: what left them is found in the module it went to
    "aihpc.perf.compute": (
        "aihpc.perf.step.compute",
        "aihpc.perf.step.gemm",
        "aihpc.perf.step.moe_kernels",
    ),
    "aihpc.perf.memory": ("aihpc.perf.step.memory", "aihpc.perf.step.batch_memory"),
    "aihpc.perf.candidates": ("aihpc.perf.search.candidates",),
    "aihpc.perf.validate": ("aihpc.perf.fit.validate",),
    "aihpc.perf.runs_csv": ("aihpc.perf.fit.runs_csv",),
    "aihpc.perf.runs_fit": ("aihpc.perf.fit.runs_fit",),
    "aihpc.perf.calibration_use": ("aihpc.perf.fit.calibration_use",),
    "aihpc.perf.goodput": ("aihpc.goodput.ettr",),
    "aihpc.perf.goodput_sim": ("aihpc.goodput.simulator",),
    "aihpc.perf.goodput_plot": ("aihpc.goodput.plot",),
    "aihpc.perf.reliability": ("aihpc.goodput.failures",),
    "aihpc.perf.strategies": ("aihpc.goodput.strategies",),
}


class _Alias(types.ModuleType):
    """A module whose names are read, on use, from the module(s) its path moved to."""

    _targets: tuple[str, ...]

    def __getattr__(self, name: str) -> Any:
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # ``aihpc.perf.estimate`` was both a module and the function ``aihpc.perf`` exports;
        # importing the old module path rebinds the package's attribute to this module, which
        # then still calls the function.
        function = self.__dict__.get("_shadowed")
        if function is None:
            raise TypeError(f"module {self.__name__!r} is not callable")
        return function(*args, **kwargs)

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in self._targets:
            names.update(dir(importlib.import_module(target)))
        return sorted(names)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Alias(spec.name)
        module._targets = MOVED[spec.name]
        if spec.name == "aihpc.spec":  # a package: its old submodules resolve through MOVED
            module.__path__ = []
        parent, _, child = spec.name.rpartition(".")
        same_name = getattr(sys.modules.get(parent), child, None)
        if callable(same_name) and not isinstance(same_name, types.ModuleType):
            module._shadowed = same_name
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        new = " / ".join(MOVED[module.__name__])
        warnings.warn(
            f"{module.__name__} moved to {new}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        importlib.import_module(MOVED[module.__name__][0])  # a broken target fails here, loudly


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(
            fullname, _Loader(), is_package=fullname == "aihpc.spec"
        )


def install() -> None:
    """Put the old paths' finder first on sys.meta_path (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
