"""aihpc: plan, run, measure and recover large-model training on AI-HPC clusters."""

from aihpc import _moved

__version__ = "0.1.0"
__all__ = ["__version__"]

_moved.install()  # the 0.1 import paths (aihpc.spec, the flat aihpc.perf), for one release
