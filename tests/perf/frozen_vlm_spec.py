"""LLaVA-1.5-7B with its encoder and language model frozen, on 8 H100s: the spec the Megatron
MIMO rows' per-step terms (the parameter norm, the deterministic fill) are checked on."""

from __future__ import annotations

from typing import Any

from aihpc.runspec import RunSpec, runspec_from_dict


def frozen_vlm_spec(**training: Any) -> RunSpec:
    """Frozen encoder and LLM (only the projector trains), dp 8, micro-batches of 4, one image of
    576 tokens and 60 text tokens a sample, with the ``[training]`` fields given."""
    return runspec_from_dict(
        {
            "model": {"preset": "llava-1.5-7b", "seq_length": 2048},
            "cluster": {"gpu": "h100-sxm", "num_gpus": 8},
            "parallel": {"dp": 8, "micro_batch_size": 4, "global_batch_size": 128},
            "training": training,
            "multimodal": {
                "images_per_sample": 1,
                "image_tokens": 576,
                "text_tokens": 60,
                "freeze_encoder": True,
                "freeze_llm": True,
            },
        }
    )
