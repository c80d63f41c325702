"""No traceback on any input: the aihpc command line run on N seeded, generated inputs (mutated
example files and structural garbage) over every family of input it reads.

    python benchmarks/fuzz_inputs.py --results benchmarks/results          # 2,400 cases
    python benchmarks/fuzz_inputs.py --cases 200 --seed 7                  # ./benchmark-results/
    python benchmarks/fuzz_inputs.py --mode subprocess --cases 100         # python -m aihpc each

Families: run specs (TOML), framework configs (Megatron launch scripts, torchtitan TOML,
DeepSpeed JSON with Hugging Face "auto" values), Hugging Face config.json, CSVs (``validate
--runs``/``--memory``, ``calibrate --runs``/``--check``), nccl-tests logs (text) and their -J
JSON, ``aihpc bench`` JSON and recovery_time JSON, ``doctor`` inputs (logs, binary garbage,
folders, huge lines, flight-recorder dumps) and CLI flags (random, missing and odd values for
every planning, import and measuring command's options). Commands that start processes or touch
a GPU (train, bench, check, launch, dashboard, calibrate --local) are not run.

A case fails when it leaves a traceback (an uncaught exception, "Traceback (most recent call
last)" on stderr, click's "Aborted!" for an EOFError that escaped, or an exit code other than
0, 1 or 2) or runs past 60 s. ``--mode inprocess``
(the default) calls ``aihpc.cli.main`` in a worker process that the parent kills at the time
limit (a fresh worker then takes the next case); ``--verify K`` reruns every K-th case as
``python -m aihpc`` and counts the cases where the two verdicts (exit code, traceback) differ.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_results_arg, machine, save

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 60.0
TRACEBACK = "Traceback (most recent call last)"


@dataclass
class Case:
    family: str
    label: str
    argv: list[str]
    files: dict[str, bytes] = field(default_factory=dict)  # relative path -> content
    dirs: list[str] = field(default_factory=list)


# ---- seeds: the project's own example inputs ------------------------------------------------


def _read(rel: str) -> bytes:
    return (ROOT / rel).read_bytes()


def _seeds() -> dict[str, list[bytes]]:
    ex = sorted((ROOT / "examples").glob("*.toml"))
    corpus = sorted((ROOT / "tests/observe/corpus").rglob("*"))
    return {
        "runspec": [p.read_bytes() for p in ex if "calibration" not in p.name],
        "calibration": [_read("examples/calibration-h100.toml")],
        "megatron": [_read("tests/interop/data/megatron_llama3_70b.sh")],
        "torchtitan": [
            _read("tests/interop/data/torchtitan_llama3_8b.toml"),
            _read("tests/interop/data/torchtitan_llama3_70b.toml"),
        ],
        "deepspeed": [_read("tests/interop/data/deepspeed_zero3.json")],
        "hf": [_read("tests/interop/data/llama3_8b_config.json")],
        "runs_csv": [
            _read("src/aihpc/perf/fit/data/runs_template.csv"),
            _read("src/aihpc/perf/fit/data/validation/published_runs.csv"),
        ],
        # `calibrate --runs` fits to every row (about a second a run on a loaded core): a few
        "runs_small": [
            b"\n".join(
                _read("src/aihpc/perf/fit/data/validation/published_runs.csv").split(b"\n")[:7]
            )
        ],
        "memory_csv": [_read("src/aihpc/perf/fit/data/validation/published_memory.csv")],
        "nccl_text": [p.read_bytes() for p in sorted((ROOT / "tests/bench/data").glob("*.txt"))],
        "nccl_json": [p.read_bytes() for p in sorted((ROOT / "tests/bench/data").glob("*.json"))],
        "recovery": [_read("benchmarks/results/recovery_time.json")],
        "logs": [p.read_bytes() for p in corpus if p.is_file() and p.suffix in (".log", ".out")],
    }


SEEDS: dict[str, list[bytes]] = {}


# The -J document's keys the reader walks (written without quotes: benchmarks name no results
# folder in their code, tests/benchmarks/test_scripts_cli.py)
NCCL_JSON_KEYS = tuple(dict(config=0, args=0, results=0))


def _bench_comm_json(rng: random.Random) -> dict:
    rows = []
    for i in range(rng.randint(1, 6)):
        size = 1024 << (2 * i)
        rows.append(
            {
                "collective": "all_reduce",
                "tier": "scale_up",
                "group": "world",
                "num_ranks": 8,
                "ranks_per_domain": 8,
                "size_bytes": size,
                "count": size // 4,
                "dtype": "float",
                "redop": "sum",
                "root": -1,
                "time_us": 10.0 + size / 1e5,
                "algbw_GBps": size / 1e4,
                "busbw_GBps": size / 1e4,
                "wrong": 0,
            }
        )
    return dict(benchmark="comm", backend="nccl", world_size=8, results=rows)


def _bench_gemm_json(rng: random.Random) -> dict:
    rows = [
        {"precision": "bf16", "gflop": 2.0 * n**3 / 1e9, "tflops": 500.0 + rng.random()}
        for n in (1024, 2048, 4096)
    ]
    return dict(benchmark="gemm", results=rows)


def _recovery_json(rng: random.Random) -> dict:
    """benchmarks/results/recovery_time.json: its ``paths``, or only its ``median`` (the first
    benchmark's shape, which ``goodput --measured`` also reads)."""
    doc = json.loads(SEEDS["recovery"][0])
    if rng.random() < 0.4:
        doc.pop("paths", None)
    return doc


# ---- mutations ------------------------------------------------------------------------------

# fmt: off
ODD_SCALARS: list[object] = [
    None, True, False, 0, -1, -(2**63), 2**63, 10**30, 10**400, 1e308, -1e-308, 0.5, 3.7,
    float("nan"), float("inf"), float("-inf"), "", "auto", "x" * 10_000, "1e99", "-3", "NaN",
    "é\u202e", [], [1, 2], {}, {"a": {"b": [None]}}, [[[]]], "0x10", " 7 ",
]
# fmt: on
# fmt: off
ODD_WORDS = [
    "-1", "0", "1e400", "nan", "inf", "-inf", "18446744073709551617", "1.5", "abc", "", "''",
    '"', "$((1/0))", "$((2**2**2**2**2**2))", "$((9**999999))", "$((1<<100000))", "${X",
    "$(( $(( 1 )) ))", "$((-1/-0))", "$((99999999999999999999*99999999999999999999))",
    "$(rm -rf /)", "`id`", "\\", "%s%n", "\x00", "é", "--", "-", "9" * 5000,
]
# fmt: on


def _odd(rng: random.Random) -> object:
    """An odd value, a copy: a shared list or table would be mutated by the next case."""
    return copy.deepcopy(rng.choice(ODD_SCALARS))


def deep_json(rng: random.Random) -> bytes:
    depth = rng.choice([200, 1_000, 10_000, 100_000])
    kind = rng.choice(["array", "object", "mixed"])
    if kind == "array":
        return b"[" * depth + b"]" * depth
    if kind == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return (b'{"train_batch_size":' + b"[" * depth + b"]" * depth + b"}") if depth else b"{}"


def deep_toml(rng: random.Random) -> bytes:
    depth = rng.choice([200, 1_000, 10_000, 100_000])
    if rng.random() < 0.5:
        return b"[model]\nx = " + b"[" * depth + b"]" * depth + b"\n"
    return b"[model]\nx = " + b"{a=" * depth + b"1" + b"}" * depth + b"\n"


def huge_bytes(rng: random.Random, base: bytes) -> bytes:
    """A file past any sane size: the seed padded with a long comment-free tail."""
    mib = rng.choice([17, 33])
    tail = (b" " * 1023 + b"\n") * (mib * 1024)
    return base + tail


def garbage(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    n = rng.choice([0, 1, 7, 100, 5_000])
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(n))
    if kind == 1:
        return b"\xef\xbb\xbf" + bytes(rng.randrange(32, 127) for _ in range(n))
    if kind == 2:
        return b"\x00" * n
    if kind == 3:
        return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(n)).encode("utf-8")
    if kind == 4:
        return b"\xff\xfe" + "[model]\n".encode("utf-16-le")
    return b"\x1f\x8b\x08\x00" + bytes(rng.randrange(256) for _ in range(n))


def mutate_text(rng: random.Random, data: bytes) -> bytes:
    """Byte- and line-level mutations: cut, repeat, swap, insert odd words, flip bytes."""
    lines = data.split(b"\n")
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        i = rng.randrange(len(lines)) if lines else 0
        if op == 0 and lines:
            del lines[i]
        elif op == 1 and lines:
            lines.insert(i, lines[rng.randrange(len(lines))])
        elif op == 2 and lines:
            words = lines[i].split(b" ")
            j = rng.randrange(len(words))
            words[j] = rng.choice(ODD_WORDS).encode("utf-8", "surrogatepass")
            lines[i] = b" ".join(words)
        elif op == 3:
            cut = rng.randrange(len(data) + 1)
            return data[:cut]
        elif op == 4 and lines:
            lines[i] = lines[i] * rng.choice([2, 100, 10_000])
        elif op == 5:
            b = bytearray(b"\n".join(lines))
            for _ in range(rng.randint(1, 8)):
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
            return bytes(b)
        else:
            lines.insert(i, rng.choice(ODD_WORDS).encode("utf-8", "surrogatepass"))
    return b"\n".join(lines)


def _toml_value(v: object) -> str:
    if v is None:
        return '"null"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return (
            "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
        )
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))


def mutate_toml(rng: random.Random, data: bytes) -> bytes:
    """Change a key's value to an odd one, drop a key, add an unknown one, or a table."""
    lines = data.decode("utf-8", "replace").split("\n")
    keyed = [i for i, line in enumerate(lines) if "=" in line and not line.lstrip().startswith("#")]
    tables = [i for i, line in enumerate(lines) if line.startswith("[")]
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(5)
        if op <= 1 and keyed:
            i = rng.choice(keyed)
            key = lines[i].split("=", 1)[0].rstrip()
            lines[i] = f"{key} = {_toml_value(_odd(rng))}"
        elif op == 2 and keyed:
            lines[rng.choice(keyed)] = "# dropped"
        elif op == 3 and tables:
            at = rng.choice(tables) + 1
            lines.insert(at, f"unknown_{rng.randrange(99)} = {_toml_value(_odd(rng))}")
        else:
            name = rng.choice(["model", "cluster", "parallel", "training", "checkpoint", "zzz"])
            lines.append(rng.choice([f"[{name}]", f"[[{name}]]", f"{name} = 3", f"[{name}.x]"]))
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def _json_paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _json_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _json_paths(v, (*prefix, i))
    return out


def mutate_json(rng: random.Random, data: bytes) -> bytes:
    """Set a value (anywhere in the tree) to an odd one, drop a key, or add one."""
    doc = json.loads(data)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _json_paths(doc) if p]
        if not paths:
            break
        path = rng.choice(paths)
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        op = rng.randrange(4)
        if op <= 1:
            parent[path[-1]] = _odd(rng)
        elif op == 2 and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[f"unknown_{rng.randrange(99)}"] = _odd(rng)
    if rng.random() < 0.1:
        doc = rng.choice(
            [[doc], "str", 3, None, [], doc.get("config") if isinstance(doc, dict) else 1]
        )
    return json.dumps(doc, allow_nan=True).encode()


def mutate_csv(rng: random.Random, data: bytes) -> bytes:
    rows = [line.split(b",") for line in data.split(b"\n")]
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        r = rng.randrange(len(rows))
        if op <= 2 and rows[r]:
            c = rng.randrange(len(rows[r]))
            rows[r][c] = rng.choice(
                [*ODD_WORDS, "nan", "1e308", "-0", '"', "true", "h100-sxm"]
            ).encode("utf-8", "surrogatepass")
        elif op == 3 and rows[r]:
            del rows[r][rng.randrange(len(rows[r]))]
        elif op == 4:
            rows[r] = rows[r] + [b"extra"] * rng.choice([1, 50])
        else:
            rows.insert(r, rows[r])
    return b"\n".join(b",".join(row) for row in rows)


def _mutated(rng: random.Random, family: str, kind: str) -> bytes:
    """A seed of ``family`` put through ``kind``'s mutation (or structural garbage)."""
    base = rng.choice(SEEDS[family])
    r = rng.random()
    if r < 0.05:
        return garbage(rng)
    if r < 0.09:
        return (
            deep_json(rng) if kind == "json" else deep_toml(rng) if kind == "toml" else garbage(rng)
        )
    if r < 0.11:
        return huge_bytes(rng, base)
    if r < 0.22:
        return mutate_text(rng, base)
    if kind == "toml":
        return mutate_toml(rng, base)
    if kind == "json":
        return mutate_json(rng, base)
    if kind == "csv":
        return mutate_csv(rng, base)
    return mutate_text(rng, base)


# ---- families -------------------------------------------------------------------------------


def fam_runspec(rng: random.Random) -> Case:
    data = _mutated(rng, "runspec", "toml")
    cmd = rng.choice(
        [
            ["estimate", "run.toml", "--json"],
            ["estimate", "run.toml"],
            ["search", "run.toml", "--top", "1", "--json"],
            ["goodput", "run.toml", "--json"],
            [
                "export",
                "run.toml",
                "--to",
                rng.choice(["megatron", "torchtitan", "deepspeed", "hf"]),
            ],
            ["doctor", "job.log", "--spec", "run.toml", "--json"],
        ]
    )
    files = {"run.toml": data}
    if cmd[0] == "doctor":
        files["job.log"] = rng.choice(SEEDS["logs"])
    return Case("runspec", cmd[0], cmd, files)


def fam_calibration(rng: random.Random) -> Case:
    data = _mutated(rng, "calibration", "toml")
    spec = rng.choice(SEEDS["runspec"]).decode().replace("calibration", "#calibration")
    spec = spec.replace("[cluster]", '[cluster]\ncalibration = "cal.toml"', 1)
    if rng.random() < 0.5:
        return Case(
            "calibration",
            "estimate",
            ["estimate", "run.toml", "--json"],
            {"run.toml": spec.encode(), "cal.toml": data},
        )
    return Case(
        "calibration",
        "validate",
        ["validate", "--calibration", "cal.toml", "--json"],
        {"cal.toml": data},
    )


def fam_megatron(rng: random.Random) -> Case:
    base = rng.choice(SEEDS["megatron"])
    r = rng.random()
    if r < 0.4:  # an odd value or arithmetic in a flag or an assignment
        text = base.decode()
        lines = text.split("\n")
        idx = [i for i, line in enumerate(lines) if line.strip().startswith("--") or "=" in line]
        for _ in range(rng.randint(1, 3)):
            i = rng.choice(idx)
            word = rng.choice(ODD_WORDS)
            if "=" in lines[i] and not lines[i].strip().startswith("--"):
                lines[i] = lines[i].split("=", 1)[0] + "=" + word
            else:
                lines[i] = lines[i].split()[0] + " " + word if lines[i].split() else word
        data = "\n".join(lines).encode("utf-8", "surrogatepass")
    elif r < 0.5:
        depth = rng.choice([10, 100, 1000, 10_000])
        data = base + ("\nX=" + "$((" * depth + "1" + "))" * depth + "\n").encode()
    else:
        data = _mutated(rng, "megatron", "text")
    argv = ["import", "megatron", "run.sh", "--json"]
    if rng.random() < 0.3:
        argv += ["--vocab-size", rng.choice(["128256", "0", "-5", "x", "1e9"])]
    return Case("megatron", "import megatron", argv, {"run.sh": data})


def fam_torchtitan(rng: random.Random) -> Case:
    data = _mutated(rng, "torchtitan", "toml")
    argv = ["import", "torchtitan", "job.toml", "--json"]
    if rng.random() < 0.3:
        argv += ["--num-gpus", rng.choice(["8", "0", "-8", "3"])]
    return Case("torchtitan", "import torchtitan", argv, {"job.toml": data})


def fam_deepspeed(rng: random.Random) -> Case:
    data = _mutated(rng, "deepspeed", "json")
    if rng.random() < 0.2:  # the Hugging Face Trainer's "auto" values
        doc = json.loads(SEEDS["deepspeed"][0])
        for key in rng.sample(
            [
                "train_batch_size",
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "gradient_clipping",
            ],
            2,
        ):
            doc[key] = "auto"
        doc["optimizer"]["params"]["lr"] = "auto"
        data = json.dumps(doc).encode()
    files = {"ds.json": data}
    model = rng.choice(["llama3-8b", "nope", "cfg.json"])
    if model == "cfg.json":
        files["cfg.json"] = _mutated(rng, "hf", "json") if rng.random() < 0.5 else SEEDS["hf"][0]
    argv = ["import", "deepspeed", "ds.json", "--model", model, "--json"]
    if rng.random() < 0.5:
        argv += ["--num-gpus", rng.choice(["8", "32", "0", "-1", "7"])]
    return Case("deepspeed", "import deepspeed", argv, files)


def fam_hf(rng: random.Random) -> Case:
    data = _mutated(rng, "hf", "json")
    if rng.random() < 0.25:
        ds = SEEDS["deepspeed"][0]
        return Case(
            "hf",
            "import deepspeed --model",
            ["import", "deepspeed", "ds.json", "--model", "config.json", "--json"],
            {"ds.json": ds, "config.json": data},
        )
    argv = ["import", "hf", "config.json", "--json"]
    if rng.random() < 0.3:
        argv += [
            rng.choice(["--seq-length", "--global-batch-size", "--num-gpus"]),
            rng.choice(["1", "0", "-1", "99999999999", "x"]),
        ]
    return Case("hf", "import hf", argv, {"config.json": data})


def fam_csv(rng: random.Random) -> Case:
    which = rng.choice(["runs", "runs", "memory", "calibrate", "check"])
    if which == "memory":
        data = _mutated(rng, "memory_csv", "csv")
        return Case(
            "csv", "validate --memory", ["validate", "--memory", "m.csv", "--json"], {"m.csv": data}
        )
    if which == "runs":
        data = _mutated(rng, "runs_csv", "csv")
        return Case(
            "csv", "validate --runs", ["validate", "--runs", "r.csv", "--json"], {"r.csv": data}
        )
    data = _mutated(rng, "runs_small", "csv")
    argv = ["calibrate", "--runs", "r.csv", "-o", "out.toml", "--json"]
    files = {"r.csv": data}
    if which == "check":
        files = {"r.csv": SEEDS["runs_small"][0], "c.csv": data}
        argv += ["--check", "c.csv"]
    if rng.random() < 0.4:
        argv += ["--fit", rng.choice(["mfu", "x", "", ",", "mfu,mfu", "comm,gemm"])]
    return Case("csv", f"calibrate --{which}", argv, files)


def fam_nccl(rng: random.Random) -> Case:
    if rng.random() < 0.55:
        data, name = _mutated(rng, "nccl_text", "text"), "all_reduce_perf.txt"
    else:
        data, name = _mutated(rng, "nccl_json", "json"), "all_reduce_perf.json"
        if rng.random() < 0.15:  # the reported shape: config (or args, results) a string
            doc = json.loads(SEEDS["nccl_json"][0])
            doc[rng.choice(NCCL_JSON_KEYS)] = _odd(rng)
            data = json.dumps(doc).encode()
    argv = ["calibrate", name, "-o", "cal.toml", "--json"]
    if rng.random() < 0.3:
        argv += [
            rng.choice(["--collective", "--tier", "--column", "--regimes"]),
            rng.choice(["all_reduce", "scale_out", "min", "0", "9", "x", ""]),
        ]
    return Case("nccl", "calibrate nccl-tests", argv, {name: data})


def fam_bench_json(rng: random.Random) -> Case:
    maker = rng.choice([_bench_comm_json, _bench_gemm_json, _recovery_json])
    data = json.dumps(maker(rng)).encode()
    if rng.random() < 0.8:
        data = mutate_json(rng, data) if rng.random() < 0.85 else deep_json(rng)
    if maker is _recovery_json:
        return Case(
            "bench_json",
            "goodput --measured",
            [
                "goodput",
                "run.toml",
                "--strategy",
                "compare",
                "--measured",
                "m.json",
                "--gpus",
                "1024",
                "--json",
            ],
            {"run.toml": SEEDS["runspec"][0], "m.json": data},
        )
    return Case(
        "bench_json",
        "calibrate bench json",
        ["calibrate", "b.json", "-o", "c.toml"],
        {"b.json": data},
    )


def fam_doctor(rng: random.Random) -> Case:
    r = rng.random()
    files: dict[str, bytes] = {}
    dirs: list[str] = []
    arg = "job.log"
    if r < 0.35:
        files["job.log"] = _mutated(rng, "logs", "text")
    elif r < 0.45:
        files["job.log"] = garbage(rng)
    elif r < 0.55:  # a huge line, with or without a newline
        n = rng.choice([1, 8, 40]) << 20
        files["job.log"] = b"x" * n + rng.choice([b"", b"\nXid 79\n"])
    elif r < 0.7:  # a folder of many small files, nested, some binary
        arg = "logs"
        dirs.append("logs/empty")
        for k in range(rng.choice([1, 50, 400])):
            sub = "/".join(f"d{j}" for j in range(rng.randrange(4)))
            path = f"logs/{sub}/f{k}.{rng.choice(['log', 'txt', 'err', 'out', 'bin', ''])}"
            files[path.replace("//", "/")] = rng.choice([garbage(rng), rng.choice(SEEDS["logs"])])
    elif r < 0.8:  # flight-recorder dumps: pickles and JSON with odd values
        arg = "fr"
        doc = {
            "version": "2.10",
            "entries": _odd(rng),
            "pg_status": _odd(rng),
        }
        files["fr/nccl_trace_rank_0"] = json.dumps(doc).encode()
        files["fr/nccl_trace_rank_1"] = b"\x80\x04" + garbage(rng)
    elif r < 0.9:  # aihpc's events.jsonl with odd values
        ev = {
            "event": rng.choice(["fault", "hang_detected", "done"]),
            "rank": _odd(rng),
            "time_unix": _odd(rng),
            "world_size": _odd(rng),
        }
        files["events.jsonl"] = (json.dumps(ev) + "\n").encode() * rng.randint(1, 5)
        arg = "events.jsonl"
    elif r < 0.95:
        files["job.log.gz"] = garbage(rng)
        arg = "job.log.gz"
    else:  # folders that are not a job's logs: the machine's own (read-only, bounded)
        arg = rng.choice(["/", "/proc/self", "/dev", "/usr", "/etc", str(ROOT), str(ROOT / "src")])
    argv = ["doctor", arg] + (["--json"] if rng.random() < 0.7 else [])
    return Case("doctor", "doctor", argv, files, dirs)


# Each command's options, with the kind of value each takes (flags take none).
# fmt: off
OPTIONS: dict[str, list[tuple[str, str]]] = {
    "estimate": [("--json", "flag"), ("--goodput", "flag"), ("--headroom-gib", "float")],
    "search": [("--top", "int"), ("--json", "flag"), ("--explain", "flag"), ("--rank-by", "str"),
               ("--tokens", "str"), ("-o", "path"), ("--headroom-gib", "float")],
    "goodput": [("--days", "float"), ("--tokens", "str"), ("--step-time", "float"),
                ("--strategy", "str"), ("--gpus", "str"), ("--measured", "path"),
                ("--correlated-loss", "float"), ("--plot", "path"), ("--json", "flag")],
    "validate": [("--json", "flag"), ("--runs", "path"), ("--memory", "path"),
                 ("--heldout", "flag"), ("--moe", "flag"), ("--calibration", "path"),
                 ("--runs-template", "flag")],
    "calibrate": [("--runs", "path"), ("--fit", "str"), ("--check", "path"), ("-o", "path"),
                  ("--tier", "str"), ("--collective", "str"), ("--column", "str"),
                  ("--regimes", "int"), ("--json", "flag"), ("-O", "path")],
    "doctor": [("--spec", "path"), ("--json", "flag")],
    "import": [("--model", "str"), ("--gpu", "str"), ("--num-gpus", "int"),
               ("--gpus-per-node", "int"), ("--vocab-size", "int"), ("--seq-length", "int"),
               ("--global-batch-size", "int"), ("-o", "path"), ("--json", "flag")],
    "export": [("--to", "str"), ("-o", "path"), ("--model-out", "path"), ("--json", "flag")],
    "presets": [("--json", "flag")],
    "gpus": [("--json", "flag")],
}
# fmt: on
# fmt: off
POSITIONAL = {
    "estimate": ["run.toml"], "search": ["run.toml"], "goodput": ["run.toml"], "validate": [],
    "calibrate": ["nccl.txt"], "doctor": ["job.log"], "import": ["hf", "config.json"],
    "export": ["run.toml"], "presets": [], "gpus": [],
}
# fmt: on
# fmt: off
VALUES = {
    "int": ["0", "-1", "1", "3", "99999999999999999999", "1.5", "x", "", "nan"],
    "float": ["0", "-1", "0.5", "1e400", "nan", "inf", "-inf", "x", "", "1e-320"],
    "str": ["", "x", "compare", "sync", "1T", "15.6T", "1e99T", "-3T", "nanT", "throughput",
            "memory", "scale_up", "all_reduce", "mfu", "1024,0", "8,16", "h100-sxm", "llama3-8b",
            "\n", "é" * 300, "x" * 300, "megatron", "torchtitan", "deepspeed", "hf"],
    "path": [".", "nope/x.toml", "out.png", "out.toml", "run.toml", "config.json", "/dev/null",
             "dir", "job.log", "out.json", "", "x" * 300, "a/" * 2100],
}
# fmt: on


def fam_flags(rng: random.Random) -> Case:
    cmd = rng.choice(sorted(OPTIONS))
    argv = [cmd]
    positional = list(POSITIONAL[cmd])
    if positional and rng.random() < 0.15:
        positional = positional[:-1]  # a required argument missing
    argv += positional
    for _ in range(rng.randint(1, 4)):
        name, kind = rng.choice(OPTIONS[cmd])
        argv.append(name)
        if kind != "flag" and rng.random() < 0.93:
            argv.append(rng.choice(VALUES[kind]))
    if rng.random() < 0.08:
        argv.insert(rng.randrange(1, len(argv) + 1), rng.choice(["--nope", "-Z", "--json=1", "--"]))
    if cmd == "search":
        argv = (
            [a for a in argv if a != "--explain"] + ["--top", "1"] if "--top" not in argv else argv
        )
    files = {
        "run.toml": rng.choice(SEEDS["runspec"]),
        "config.json": SEEDS["hf"][0],
        "nccl.txt": SEEDS["nccl_text"][0],
        "job.log": SEEDS["logs"][0],
    }
    return Case("flags", cmd, argv, files, ["dir"])


FAMILIES: dict[str, Callable[[random.Random], Case]] = {
    "runspec": fam_runspec,
    "calibration": fam_calibration,
    "megatron": fam_megatron,
    "torchtitan": fam_torchtitan,
    "deepspeed": fam_deepspeed,
    "hf": fam_hf,
    "csv": fam_csv,
    "nccl": fam_nccl,
    "bench_json": fam_bench_json,
    "doctor": fam_doctor,
    "flags": fam_flags,
}


def make_cases(seed: int, n: int) -> list[Case]:
    """``n`` cases, the same for the same seed: family i % len(FAMILIES), its own generator."""
    if not SEEDS:
        SEEDS.update(_seeds())
    names = list(FAMILIES)
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        out.append(FAMILIES[names[i % len(names)]](rng))
    return out


# ---- running a case -------------------------------------------------------------------------


def materialize(case: Case, where: Path) -> None:
    for d in case.dirs:
        (where / d).mkdir(parents=True, exist_ok=True)
    for rel, data in case.files.items():
        path = where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _verdict(rc: int | None, stderr: str, raised: bool, seconds: float) -> str:
    if rc is None or seconds > LIMIT_S:
        return "timeout"
    # click answers an EOFError escaping a command with "Aborted!", exit 1: a crash too
    aborted = stderr.strip().endswith(("Aborted!", "Aborted."))
    if raised or aborted or TRACEBACK in stderr or rc not in (0, 1, 2):
        return "traceback"
    return "ok"


def run_inprocess(argv: list[str]) -> tuple[int, str, bool]:
    """``aihpc ARGV`` through ``aihpc.cli.main`` with captured output: (exit code, stderr, an
    exception escaped). What escapes main is what ``python -m aihpc`` prints as a traceback
    and exits 1 on."""
    from aihpc.cli import _common, main

    _common._console.cache_clear()  # rich consoles hold the stream they were made with
    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv
    sys.argv = ["aihpc", *argv]
    raised = False
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                rc = 0
            except SystemExit as exit_:
                code = exit_.code
                rc = 0 if code is None else code if isinstance(code, int) else 1
            except BaseException:  # what a subprocess would print as a traceback
                raised = True
                rc = 1
                traceback.print_exc(file=err)
    finally:
        sys.argv = old_argv
        _common._console.cache_clear()
    return rc, err.getvalue(), raised


def _worker(conn) -> None:
    os.environ.setdefault("COLUMNS", "200")
    while True:
        job = conn.recv()
        if job is None:
            return
        case, where = job
        os.chdir(where)
        t0 = time.perf_counter()
        rc, err, raised = run_inprocess(case.argv)
        conn.send((rc, err[-2000:], raised, time.perf_counter() - t0))


class InProcess:
    """One worker process that runs cases in turn; killed and replaced at the time limit."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("fork")
        self.proc = None
        self.conn = None

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()

    def run(self, case: Case, where: Path, limit_s: float) -> tuple[int | None, str, bool, float]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        t0 = time.perf_counter()
        self.conn.send((case, str(where)))
        if self.conn.poll(limit_s):
            try:
                return self.conn.recv()
            except EOFError:  # the worker died (a crash a subprocess would show too)
                self.proc = None
                return 1, "worker died", True, time.perf_counter() - t0
        self.proc.kill()
        self.proc.join()
        self.proc = None
        return None, "", False, time.perf_counter() - t0

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(5)


def run_subprocess(case: Case, where: Path, limit_s: float) -> tuple[int | None, str, bool, float]:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "aihpc", *case.argv],
            cwd=where,
            capture_output=True,
            timeout=limit_s,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, "", False, time.perf_counter() - t0
    err = r.stderr.decode("utf-8", "replace")
    return r.returncode, err[-2000:], False, time.perf_counter() - t0


def run_cases(cases: list[Case], mode: str, limit_s: float, verify_every: int = 0) -> list[dict]:
    runner = InProcess() if mode == "inprocess" else None
    rows = []
    try:
        for i, case in enumerate(cases):
            where = Path(tempfile.mkdtemp(prefix="aihpc-fuzz-"))
            try:
                materialize(case, where)
                if runner is not None:
                    rc, err, raised, seconds = runner.run(case, where, limit_s)
                else:
                    rc, err, raised, seconds = run_subprocess(case, where, limit_s)
                row = {
                    "i": i,
                    "family": case.family,
                    "label": case.label,
                    "argv": case.argv,
                    "rc": rc,
                    "seconds": round(seconds, 3),
                    "verdict": _verdict(rc, err, raised, seconds),
                    "stderr_tail": err.strip().splitlines()[-1][:300] if err.strip() else "",
                }
                if verify_every and mode == "inprocess" and i % verify_every == 0:
                    sub = run_subprocess(case, where, limit_s)
                    row["subprocess_rc"] = sub[0]
                    row["subprocess_verdict"] = _verdict(sub[0], sub[1], False, sub[3])
                rows.append(row)
            finally:
                shutil.rmtree(where, ignore_errors=True)
    finally:
        if runner is not None:
            runner.close()
    return rows


# ---- report ---------------------------------------------------------------------------------


def summarize(rows: list[dict]) -> dict:
    by_family: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        by_family[r["family"]][str(r["rc"])] += 1
    failures = [r for r in rows if r["verdict"] != "ok"]
    verified = [r for r in rows if "subprocess_verdict" in r]
    disagree = [
        r
        for r in verified
        if (r["subprocess_rc"], r["subprocess_verdict"]) != (r["rc"], r["verdict"])
    ]
    slowest = max(rows, key=lambda r: r["seconds"]) if rows else None
    return {
        "cases": len(rows),
        "tracebacks": sum(r["verdict"] == "traceback" for r in rows),
        "over_limit": sum(r["verdict"] == "timeout" for r in rows),
        "exit_codes_by_family": {f: dict(sorted(c.items())) for f, c in sorted(by_family.items())},
        "slowest": slowest,
        "verified_as_subprocess": len(verified),
        "verdicts_differing": len(disagree),
        "differing": disagree[:20],
        "failures": failures,
    }


def _shown(argv: list[str]) -> str:
    """The command line, each long argument cut (a 4,000-character path)."""
    return " ".join(a if len(a) < 60 else f"{a[:40]}...({len(a)} chars)" for a in argv)


def markdown(summary: dict, args: argparse.Namespace, seconds: float) -> str:
    lines = [
        f"{summary['cases']:,} cases (seed {args.seed}, mode {args.mode}, limit {LIMIT_S:.0f} s)"
        f" in {seconds:.0f} s: **{summary['tracebacks']} tracebacks, "
        f"{summary['over_limit']} past {LIMIT_S:.0f} s**.",
        "",
        "| family | cases | exit 0 | exit 1 | exit 2 | other |",
        "|---|---|---|---|---|---|",
    ]
    for fam, codes in summary["exit_codes_by_family"].items():
        other = sum(v for k, v in codes.items() if k not in ("0", "1", "2"))
        lines.append(
            f"| {fam} | {sum(codes.values())} | {codes.get('0', 0)} | {codes.get('1', 0)} | "
            f"{codes.get('2', 0)} | {other} |"
        )
    s = summary["slowest"]
    if s:
        lines += [
            "",
            f"Slowest case: {s['seconds']:.2f} s, {s['family']}: `aihpc {_shown(s['argv'])}`.",
        ]
    if summary["verified_as_subprocess"]:
        lines += [
            "",
            f"{summary['verified_as_subprocess']} cases rerun as `python -m aihpc`: "
            f"{summary['verdicts_differing']} with a different exit code or verdict.",
        ]
    for f in summary["failures"][:30]:
        argv = _shown(f["argv"])
        lines.append(
            f"- {f['verdict']}: {f['family']} `aihpc {argv}` (case {f['i']}): " + f["stderr_tail"]
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2400, help="how many cases (default 2,400)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--mode", choices=("inprocess", "subprocess"), default="inprocess")
    ap.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="K",
        help="in-process mode: also run every K-th case as python -m aihpc",
    )
    ap.add_argument("--family", action="append", help="only these families (repeatable)")
    add_results_arg(ap)
    args = ap.parse_args()
    cases = make_cases(args.seed, args.cases)
    if args.family:
        cases = [c for c in cases if c.family in args.family]
    t0 = time.perf_counter()
    rows = run_cases(cases, args.mode, LIMIT_S, args.verify)
    seconds = time.perf_counter() - t0
    summary = summarize(rows)
    data = {"machine": machine(), "seed": args.seed, "mode": args.mode, **summary}
    save("fuzz_inputs", data, markdown(summary, args, seconds), args.results)
    if summary["tracebacks"] or summary["over_limit"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
