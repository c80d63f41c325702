"""training.moe_stack from the flags a framework reads (issue 37): Megatron-LM's dispatcher
flags, torchtitan's expert_parallel_comm_backend; an exported stack comes back as it was."""

from __future__ import annotations

import pytest

from aihpc.interop import export_megatron, import_megatron, import_torchtitan
from aihpc.runspec import SpecError, runspec_from_dict


def _moe_script(extra: str = "") -> str:
    spec = runspec_from_dict(
        {
            "model": {"preset": "deepseek-v3"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 32, "gpus_per_node": 8},
            "parallel": {"tp": 1, "pp": 1, "ep": 8, "global_batch_size": 256},
            "training": {},
        }
    )
    script, _ = export_megatron(spec)
    # the exported dispatcher flags first, the case's own after them: Megatron's parser keeps
    # the last value of a flag given twice
    return f"{script.rstrip()} {extra}"


@pytest.mark.parametrize(
    ("flags", "stack"),
    [
        ("", "megatron-alltoall"),  # the export's own --moe-token-dispatcher-type alltoall
        ("--moe-token-dispatcher-type allgather", "megatron-allgather"),
        ("--moe-token-dispatcher-type flex", "megatron-deepep"),  # DeepEP is flex's default
        ("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep",
         "megatron-hybridep"),
        ("--moe-token-dispatcher-type flex --moe-enable-deepep", "megatron-deepep"),
    ],
)  # fmt: skip
def test_megatron_dispatcher_flags_set_the_stack(flags: str, stack: str) -> None:
    imported = import_megatron(_moe_script(flags))
    t = imported.spec().training
    assert t.moe_stack == stack
    assert t.moe_dispatcher == ("hierarchical" if "flex" in flags else "alltoall")
    assert not [f for f in imported.unpriced if "deepep" in f or "dispatcher" in f]


@pytest.mark.parametrize("stack", ["megatron-alltoall", "megatron-deepep", "megatron-hybridep"])
def test_an_exported_stack_comes_back(stack: str) -> None:
    spec = runspec_from_dict(
        {
            "model": {"preset": "deepseek-v3"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 32, "gpus_per_node": 8},
            "parallel": {"tp": 1, "pp": 1, "ep": 8, "global_batch_size": 256},
            "training": {"moe_stack": stack, "moe_expert_gemm": "per_expert"},
        }
    )
    script, dropped = export_megatron(spec)
    assert dropped == []
    assert import_megatron(script).spec().training.moe_stack == stack


def test_a_stack_megatron_does_not_run_is_reported_on_export() -> None:
    spec = runspec_from_dict(
        {
            "model": {"preset": "deepseek-v3"},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 32, "gpus_per_node": 8},
            "parallel": {"tp": 1, "pp": 1, "ep": 8, "global_batch_size": 256},
            "training": {"moe_stack": "torch-deepep"},
        }
    )
    script, dropped = export_megatron(spec)
    assert any(
        "moe_stack = 'torch-deepep' (Megatron-LM runs 'megatron-deepep')" in d for d in dropped
    )
    assert import_megatron(script).spec().training.moe_stack == "megatron-deepep"


TITAN = """[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 1
seq_len = 8192

[parallelism]
data_parallel_shard_degree = -1
expert_parallel_degree = 8
{backend}
"""


@pytest.mark.parametrize(
    ("line", "stack"),
    [
        ("", "torch-native"),
        ('expert_parallel_comm_backend = "standard"', "torch-native"),
        ('expert_parallel_comm_backend = "deepep"', "torch-deepep"),
        ('expert_parallel_comm_backend = "hybridep"', "torch-hybridep"),
    ],
)
def test_torchtitan_backend_sets_the_stack(line: str, stack: str) -> None:
    imported = import_torchtitan(TITAN.format(backend=line), num_gpus=8)
    assert imported.spec().training.moe_stack == stack


def test_torchtitan_unknown_backend_is_refused_naming_it() -> None:
    with pytest.raises(SpecError) as err:
        import_torchtitan(
            TITAN.format(backend='expert_parallel_comm_backend = "nvshmem"'), num_gpus=8
        )
    assert err.value.field == "parallelism.expert_parallel_comm_backend"
    assert "deepep" in str(err.value)
