"""The frameworks whose own parsers check what `aihpc export` writes: torchtitan 0.2.0's
ConfigManager reads the TOML, DeepSpeed 0.19.8's DeepSpeedConfig the JSON; and verl 0.9.1,
whose shipped trainer configs (`verl/trainer/config/_generated_*.yaml`, read as files: verl's
package imports Ray and vLLM) and advantage estimators (`verl/trainer/ppo/core_algos.py`, read
with `ast`) check what `aihpc import verl` assumes of it. They live in a
git-ignored folder, .frameworks/ at the repository root (or the folders AIHPC_FRAMEWORKS_PATH
names), never in the environment itself.

``python3 tests/interop/frameworks.py install [DIR]`` puts them there with pip, without letting
pip resolve a dependency: ``pip install deepspeed`` alone pulls a CUDA torch of several GB, and
the config parsers need none of it. It does nothing when DIR already holds these pins.
``python3 tests/interop/frameworks.py check`` imports both parsers from the folders the tests use.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".frameworks"
PATH_ENV = "AIHPC_FRAMEWORKS_PATH"

# What the two config-parsing paths import, found by importing them with each package left out
# in turn: tyro (+ docstring-parser, and typeguard on its first parse) for torchtitan's
# ConfigManager; psutil, tqdm, hjson, einops and msgpack for `deepspeed.runtime.config`.
# DeepSpeed's other requirements (ninja, py-cpuinfo) are for building and picking its kernels.
# DeepSpeed 0.19.8 is an sdist only: pip builds it against the torch already installed
# (--no-build-isolation) with no ops compiled (DS_BUILD_OPS=0).
PINS = (
    "torchtitan==0.2.0",
    "tyro==1.0.17",
    "docstring-parser==0.18.0",
    "typeguard==4.6.1",
    "deepspeed==0.19.8",
    "psutil==7.2.2",
    "tqdm==4.70.1",
    "hjson==3.1.0",
    "einops==0.8.2",
    "msgpack==1.2.4",
    "verl==0.9.1",
)
# ... and what they import that aihpc's own install (`pip install -e '.[torch,test]'`) brings:
# setuptools only builds DeepSpeed's sdist.
FROM_ENVIRONMENT = ("torch", "pydantic", "numpy", "packaging", "typing_extensions", "rich")
BUILD_NEEDS = ("setuptools",)
STAMP = "installed.txt"


def folders() -> list[str]:
    """AIHPC_FRAMEWORKS_PATH's folders when it is set, else .frameworks/."""
    env = os.environ.get(PATH_ENV)
    if env:
        return [entry for entry in env.split(os.pathsep) if entry]
    return [str(DEFAULT_DIR)]


def _use_folders() -> None:
    for entry in folders():
        if entry not in sys.path:
            sys.path.append(entry)


def torchtitan_config_manager() -> type:
    """torchtitan's ConfigManager class; ImportError when torchtitan or tyro is missing."""
    _use_folders()
    if "torchtitan" not in sys.modules:
        found = importlib.util.find_spec("torchtitan")
        if found is None:
            raise ModuleNotFoundError(
                f"torchtitan is not installed (in {os.pathsep.join(folders())})"
            )
        # torchtitan's package __init__ imports its models (tokenizers, datasets...): load only
        # its config package, whose manager needs torch and tyro.
        stub = types.ModuleType("torchtitan")
        stub.__path__ = list(found.submodule_search_locations)
        sys.modules["torchtitan"] = stub
    from torchtitan.config.manager import ConfigManager  # type: ignore[import-not-found]

    return ConfigManager


def deepspeed_config() -> types.ModuleType:
    """`deepspeed.runtime.config` on the CPU accelerator; ImportError when it is missing."""
    _use_folders()
    if importlib.util.find_spec("deepspeed") is None:
        raise ModuleNotFoundError(f"deepspeed is not installed (in {os.pathsep.join(folders())})")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.runtime.config as ds_config  # type: ignore[import-not-found]

    return ds_config


def verl_package() -> Path:
    """verl's package folder (its files, not imported: its __init__ needs Ray, vLLM and CUDA);
    ImportError when verl is missing."""
    _use_folders()
    found = importlib.util.find_spec("verl")
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(f"verl is not installed (in {os.pathsep.join(folders())})")
    package = Path(next(iter(found.submodule_search_locations)))
    if not (package / "trainer" / "config" / "_generated_ppo_trainer.yaml").is_file():
        raise ModuleNotFoundError(f"{package} has no trainer/config/_generated_ppo_trainer.yaml")
    return package


def _stamp() -> str:
    return "\n".join((f"python {sys.version_info.major}.{sys.version_info.minor}", *PINS)) + "\n"


def _missing_from_environment() -> list[str]:
    return [m for m in FROM_ENVIRONMENT + BUILD_NEEDS if importlib.util.find_spec(m) is None]


def install(target: Path) -> str:
    """Install PINS into target (through a staging folder, checked by importing both parsers
    from it before it replaces target); a line saying what was done."""
    stamp = target / STAMP
    if stamp.is_file() and stamp.read_text() == _stamp():
        return f"frameworks already installed in {target}"
    missing = _missing_from_environment()
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not importable by {sys.executable}: pyproject.toml's "
            "'torch' and 'test' extras bring them (pip install torch==2.13.0, then pip install "
            "-e '.[torch,test]' with this same python)"
        )
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    begin = time.monotonic()
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--root-user-action=ignore"]
    pip += ["--no-deps", "--no-build-isolation", "--target", str(staging), *PINS]
    subprocess.run(pip, check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    check = subprocess.run(
        [sys.executable, __file__, "check"],
        env={**os.environ, PATH_ENV: str(staging)},
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        raise RuntimeError(f"installed, but the parsers do not import:\n{check.stderr}")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    stamp.write_text(_stamp())
    size_MB = sum(f.stat().st_size for f in target.rglob("*") if f.is_file()) / 1e6
    took_s = time.monotonic() - begin
    return (
        f"{check.stdout.splitlines()[-1]} installed in {target} ({size_MB:.0f} MB, {took_s:.0f} s)"
    )


def check() -> str:
    """Import both parsers from folders() and find verl's configs; their versions."""
    torchtitan_config_manager()
    deepspeed_config()
    verl_package()
    from importlib.metadata import version

    names = ("torchtitan", "deepspeed", "verl")
    return ", ".join(f"{name} {version(name)}" for name in names)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command not in ("install", "check"):
        sys.exit(f"usage: {sys.argv[0]} install [DIR] | check")
    try:
        if command == "install":
            print(install(Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_DIR))
        else:
            print(check())
    except (RuntimeError, ImportError, subprocess.CalledProcessError) as err:
        sys.exit(f"error: {err}")
