"""Vision-language models: the encoder and projector's terms (``encoder``), the imbalance the
image distribution brings (``imbalance``, ``workload``), where the encoder runs (``placement``),
one plan priced (``estimate``) and the search over plans and placements (``search``). A
sibling of ``perf/step``, which it imports (never the reverse)."""

from aihpc.perf.multimodal.estimate import VlmEstimate, estimate_vlm

__all__ = ["VlmEstimate", "estimate_vlm"]
