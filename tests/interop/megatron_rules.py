"""Megatron-LM's own rules, checked on a launch script `aihpc export --to megatron` writes.

No registry package holds Megatron-LM's argument parser: megatron-core 0.16.1 (wheel and sdist)
has no megatron/training/arguments.py, and GitHub is out of reach of CI. So the tests check
exports against the rules of arguments.py at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553
(main, 2026-08-22), read from that file:

- the options its parser knows, with their arity, type and choices: data/megatron_d98e8a6_
  flags.tsv, read out of the parser itself (``dump-flags`` below, from a checkout);
- the assertions of ``validate_args`` (and of the layout and vocabulary code it calls) that
  bear on the flags aihpc writes, each written here as a rule that cites its line. Our rules
  restate what each assertion requires; none of Megatron's code is copied.

Where a checkout is at hand, ``python3 tests/interop/megatron_rules.py validate SCRIPT CHECKOUT``
runs Megatron's own parse_args + validate_args on a script (triton stubbed: it is imported,
never run, on the way to the parser), and AIHPC_MEGATRON_LM=CHECKOUT makes the tests do it too.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

DATA = Path(__file__).parent / "data" / "megatron_d98e8a6_flags.tsv"
COMMIT = "d98e8a6"


@dataclass
class Option:
    kind: str  # switch | value | list
    type: str = ""
    choices: tuple[str, ...] = ()


def known_options() -> dict[str, Option]:
    out = {}
    for line in DATA.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, kind, *rest = line.split("\t")
        out[name] = Option(
            kind, rest[0] if rest else "", tuple(rest[1].split(",")) if len(rest) > 1 else ()
        )
    return out


@dataclass
class Launch:
    """What a script sets: its environment, torchrun's counts, pretrain_gpt.py's arguments."""

    env: dict[str, str | None]
    nodes: int
    per_node: int
    words: list[str]
    args: dict[str, list[str]] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def has(self, name: str) -> bool:
        return name in self.args

    def value(self, name: str, default: str | None = None) -> str | None:
        return self.args[name][0] if self.args.get(name) else default

    def int(self, name: str, default: int) -> int:
        v = self.value(name)
        return default if v is None else int(v)


def read_launch(script: str) -> Launch:
    """The script's environment lines (export / unset), torchrun's counts and the
    pretrain_gpt.py words, split by bash's own quoting rules (shlex, POSIX mode)."""
    env: dict[str, str | None] = {}
    for m in re.finditer(r"^(export|unset) (\w+)(?:=(\S*))?$", script, re.M):
        env[m.group(2)] = m.group(3) if m.group(1) == "export" else None
    words = shlex.split(script.split("torchrun", 1)[1].replace("\\\n", " "), comments=True)
    i = words.index("pretrain_gpt.py")
    launcher, margs = words[:i], words[i + 1 :]
    nodes = int(launcher[launcher.index("--nnodes") + 1])
    per_node = int(launcher[launcher.index("--nproc-per-node") + 1])
    launch = Launch(env, nodes, per_node, margs)
    name = None
    for w in margs:
        if w.startswith("--"):
            name, eq, value = w.partition("=")
            launch.args[name] = [value] if eq else []
        elif name is not None:
            launch.args[name].append(w)
    return launch


def check_options(launch: Launch) -> list[str]:
    """Each option is one the parser knows (argparse exits 2 on an unknown one:
    parse_args, arguments.py:131), with the values its action takes, of its type and among
    its choices."""
    known, out = known_options(), []
    for name, values in launch.args.items():
        opt = known.get(name)
        if opt is None:
            out.append(f"{name}: no such option at {COMMIT}")
            continue
        if opt.kind == "switch" and values:
            out.append(f"{name} takes no value, got {values}")
        if opt.kind == "value" and len(values) != 1:
            out.append(f"{name} takes one value, got {values}")
        if opt.kind == "list" and not values:
            out.append(f"{name} takes one or more values")
        for v in values:
            if opt.type in ("int", "float"):
                try:
                    (int if opt.type == "int" else float)(v)
                except ValueError:
                    out.append(f"{name} {v!r}: not an {opt.type}")
            if opt.choices and v not in opt.choices:
                out.append(f"{name} {v!r}: not one of {opt.choices}")
    return out


def check_validate_args(launch: Launch, arch_major: int = 9) -> list[str]:
    """validate_args' assertions on the combinations aihpc writes (H100: arch_major 9)."""
    a, out = launch, []
    tp = a.int("--tensor-model-parallel-size", 1)
    pp = a.int("--pipeline-model-parallel-size", 1)
    cp = a.int("--context-parallel-size", 1)
    ep = a.int("--expert-model-parallel-size", 1)
    fsdp2 = a.has("--use-torch-fsdp2")
    connections = a.env.get("CUDA_DEVICE_MAX_CONNECTIONS")  # None: unset or the site's
    if a.world % (tp * pp * cp):  # arguments.py:432
        out.append(f"world size {a.world} not divisible by tp x pp x cp {tp * pp * cp}")
    dp = a.world // (tp * pp * cp)
    # arguments.py:1453-1479: tp or cp > 1 before Blackwell asserts one CUDA connection,
    # unless FSDP or --overlap-moe-expert-parallel-comm (which only warn)
    moe_overlap = a.has("--overlap-moe-expert-parallel-comm")
    one_connection = (tp > 1 or cp > 1) and arch_major < 10 and not fsdp2 and not moe_overlap
    if one_connection and connections != "1":
        out.append("tp or cp > 1 needs CUDA_DEVICE_MAX_CONNECTIONS=1 (arguments.py:1477)")
    if fsdp2:  # arguments.py:1031-1049
        if pp != 1:
            out.append("--use-torch-fsdp2 with pipeline parallelism (arguments.py:1034)")
        if ep != 1:
            out.append("--use-torch-fsdp2 with expert parallelism (arguments.py:1036)")
        if a.has("--use-distributed-optimizer"):
            out.append("--use-torch-fsdp2 with the distributed optimizer (arguments.py:1038)")
        if not a.has("--no-gradient-accumulation-fusion"):
            out.append("--use-torch-fsdp2 with gradient accumulation fusion (arguments.py:1040)")
        if a.value("--ckpt-format", "torch_dist") not in ("torch_dist", "torch_dcp"):
            out.append("--use-torch-fsdp2 needs --ckpt-format torch_dist (arguments.py:1042)")
        if not a.has("--untie-embeddings-and-output-weights"):
            out.append("--use-torch-fsdp2 needs untied embeddings (arguments.py:1044)")
        if a.has("--fp16"):
            out.append("--use-torch-fsdp2 with fp16 (arguments.py:1046)")
        if connections == "1":
            out.append("--use-torch-fsdp2 with CUDA_DEVICE_MAX_CONNECTIONS=1 (arguments.py:1048)")
    if a.has("--tp-comm-overlap") and not a.has("--sequence-parallel"):  # arguments.py:1441
        out.append("--tp-comm-overlap without --sequence-parallel (arguments.py:1442)")
    full_graph = a.value("--cuda-graph-impl") == "full_iteration"  # arguments.py:1236-1237
    if full_graph and not a.has("--no-check-for-nan-in-loss-and-grad"):
        out.append("full_iteration CUDA graphs need --no-check-for-nan-in-loss-and-grad")
    if a.has("--fp8-param-gather") and not a.has("--fp8-format"):
        # TransformerConfig.__post_init__ (transformer_config.py:2141): fp8_param needs fp8
        out.append("--fp8-param-gather without --fp8-format")
    out += _pipeline(a, pp)
    gbs, mbs = a.int("--global-batch-size", 0), a.int("--micro-batch-size", 1)
    if gbs % (mbs * dp):  # the microbatch calculator (num_microbatches_calculator.py)
        out.append(f"global batch {gbs} not a multiple of micro batch {mbs} x dp {dp}")
    return out


def _pipeline(a: Launch, pp: int) -> list[str]:
    """arguments.py:927-1008 and pipeline_parallel_layer_layout.py's validate_layer_layout."""
    out = []
    layers, mtp = a.int("--num-layers", 0), a.int("--mtp-num-layers", 0)
    layout = a.value("--pipeline-model-parallel-layout")
    vpp_flags = (
        "--num-layers-per-virtual-pipeline-stage",
        "--num-virtual-stages-per-pipeline-rank",
    )
    if sum(a.has(f) for f in (*vpp_flags, "--pipeline-model-parallel-layout")) > 1:
        out.append("more than one of the vpp / layout flags (arguments.py:927-939)")
    vpp = a.int("--num-virtual-stages-per-pipeline-rank", 1)
    if layout is not None:
        stages = layout_stages(layout)
        if len(stages) % pp:  # arguments.py:941-947
            out.append(f"layout of {len(stages)} stages not divisible by pp {pp}")
        vpp = max(1, len(stages) // pp)
        flat = "".join(stages)
        if not flat.startswith("E") or not flat.endswith("L"):
            out.append("layout must start with E and end with L (validate_layer_layout)")
        if flat.count("E") != 1 or flat.count("L") != 1:
            out.append("layout must hold E and L once each (validate_layer_layout)")
        if flat.count("t") != layers:
            out.append(f"layout holds {flat.count('t')} layers, --num-layers {layers}")
        if flat.count("m") != mtp:
            out.append(f"layout holds {flat.count('m')} MTP layers, --mtp-num-layers {mtp}")
        if "m" in flat and "t" in flat[flat.index("m") :]:
            out.append("decoder layers after an MTP layer (validate_layer_layout)")
        if mtp and stages[-1].count("m") != mtp:
            out.append("MTP layers outside the last stage (validate_layer_layout)")
    elif not a.has("--decoder-first-pipeline-num-layers") and pp > 1:
        units = layers + a.has("--account-for-embedding-in-pipeline-split")
        units += a.has("--account-for-loss-in-pipeline-split")
        if units % pp:  # arguments.py:996-997
            out.append(f"--num-layers {layers} not divisible by pp {pp} (arguments.py:997)")
        elif (units // pp) % vpp:  # TransformerConfig: layers per stage split over vpp
            out.append(f"{units // pp} layers per stage not divisible by vpp {vpp}")
    if vpp > 1 and pp < 2:  # arguments.py:1000-1004 (p2p overlap on by default)
        out.append("an interleaved schedule needs pp > 1 (arguments.py:1002)")
    return out


def layout_stages(layout: str) -> list[str]:
    """The stages of a --pipeline-model-parallel-layout string, its (..)*n and x*n unrolled
    (the grammar parse_str_to_list documents: pipeline_parallel_layer_layout.py:283-301)."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def padded_vocab(launch: Launch) -> int:
    """The vocabulary Megatron builds for --vocab-size with NullTokenizer: rounded up to a
    multiple of make_vocab_size_divisible_by x tp (build_tokenizer.py:133-146)."""
    multiple = launch.int("--make-vocab-size-divisible-by", 128)
    multiple *= launch.int("--tensor-model-parallel-size", 1)
    return -(-launch.int("--vocab-size", 0) // multiple) * multiple


def problems(script: str, arch_major: int = 9) -> list[str]:
    """Every rule the script breaks; [] when Megatron-LM at d98e8a6 would accept it."""
    launch = read_launch(script)
    return check_options(launch) + check_validate_args(launch, arch_major)


# ---- with a Megatron-LM checkout: its own parser -------------------------------------------


def _import_parser(checkout: str):  # pragma: no cover - needs a checkout
    """megatron.training.arguments from CHECKOUT, with triton (imported on the way, never
    called by the parser) stubbed and Python 3.11's typing given 3.12's override."""
    import importlib.abc
    import importlib.machinery
    import types
    import typing

    class _Any:
        def __init__(self, *a, **k): ...
        def __call__(self, *a, **k):
            return a[0] if len(a) == 1 and callable(a[0]) and not k else _Any()

        def __getattr__(self, n):
            if n.startswith("__"):
                raise AttributeError(n)
            return _Any()

        def __getitem__(self, k):
            return _Any()

    class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "triton":
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            m = types.ModuleType(spec.name)
            m.__path__, m.__file__ = [], f"/stub/{spec.name}.py"

            def attr(name):
                if name == "__version__":
                    return "3.4.0"
                if name.startswith("__"):
                    raise AttributeError(name)
                return type(name, (_Any,), {}) if name.lstrip("_")[:1].isupper() else _Any()

            m.__getattr__ = attr
            return m

        def exec_module(self, m): ...

    sys.meta_path.insert(0, _Stub())
    typing.override = getattr(typing, "override", lambda f: f)  # type: ignore[attr-defined]
    sys.path.insert(0, checkout)
    import megatron.training.arguments as arguments  # type: ignore[import-not-found]

    return arguments


def validate_with_checkout(
    script: str, checkout: str, arch_major: int = 9
) -> str:  # pragma: no cover
    """Megatron-LM's own parse_args + validate_args on the script, in a fresh process of this
    python; "" when it accepts, else its last error line."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
        f.write(script)
    run = subprocess.run(
        [sys.executable, __file__, "validate", f.name, checkout, str(arch_major)],
        capture_output=True,
        text=True,
    )
    os.unlink(f.name)
    if run.returncode == 0:
        return ""
    return (run.stderr.strip().splitlines() or ["(no output)"])[-1]


def _validate_main(path: str, checkout: str, arch_major: int) -> None:  # pragma: no cover
    launch = read_launch(Path(path).read_text())
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"  # a site's own value, unless the script sets it
    for k, v in launch.env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    os.environ.update(WORLD_SIZE=str(launch.world), RANK="0")
    arguments = _import_parser(checkout)
    import torch

    arguments.get_device_arch_version = lambda: arch_major
    torch.cuda.get_device_capability = lambda *a: (arch_major, 0)
    sys.argv = ["pretrain_gpt.py", *launch.words]
    args = arguments.parse_args()
    arguments.validate_args(args)
    print("accepted")


def _dump_flags(checkout: str) -> None:  # pragma: no cover
    import argparse
    import enum

    arguments = _import_parser(checkout)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    for opt, act in sorted(parser._option_string_actions.items()):
        if not opt.startswith("--"):
            continue
        kind = "switch" if act.nargs == 0 else "list" if act.nargs in ("+", "*") else "value"
        kind_type = act.type.__name__ if act.type in (int, float, str) else ""
        choices = ",".join(
            c.name if isinstance(c, enum.Enum) else str(c) for c in act.choices or ()
        )
        print("\t".join((opt, kind, kind_type, choices)).rstrip("\t"))


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) >= 3 and sys.argv[1] == "dump-flags":
        _dump_flags(sys.argv[2])
    elif len(sys.argv) >= 4 and sys.argv[1] == "validate":
        _validate_main(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 9)
    else:
        sys.exit(f"usage: {sys.argv[0]} dump-flags CHECKOUT | validate SCRIPT CHECKOUT [ARCH]")
