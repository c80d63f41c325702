"""aihpc: plan, run, measure and recover large-model training on AI-HPC clusters."""

__version__ = "0.1.0"
__all__ = ["__version__"]
