"""torchtitan job TOML ⇄ run spec: ``reader`` imports, ``writer`` exports, ``flavors`` holds the
model flavors and what torchtitan fixes either way."""

from aihpc.interop.torchtitan.flavors import FIXED, FLAVORS, FRAMEWORK, VERSION
from aihpc.interop.torchtitan.reader import import_torchtitan
from aihpc.interop.torchtitan.writer import export_torchtitan

__all__ = ["FIXED", "FLAVORS", "FRAMEWORK", "VERSION", "export_torchtitan", "import_torchtitan"]
