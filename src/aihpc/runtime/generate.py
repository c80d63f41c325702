"""Generation with the trainer's Llama and its KV cache (``Llama.prefill`` / ``decode_step``,
runtime/kvcache.py): greedy or temperature / top-p sampling from a seeded generator, a batch of
prompts of different lengths (left-padded), each row stopping at EOS or ``max_new_tokens``;
and the model of a trainer's checkpoint, to generate with (RL rollout).

    model = load_checkpoint_model(spec, run_dir / "checkpoints")
    out = generate(model, [[1, 2, 3], [4, 5]], 16, temperature=0.7, top_p=0.9, seed=0, eos_id=10)
    out.tokens, out.lengths, out.logprobs
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from aihpc.runtime.model import Llama

__all__ = ["Generation", "generate", "load_checkpoint_model", "pad_left", "sample"]


@dataclass(frozen=True)
class Generation:
    """``tokens`` (batch, steps) the new tokens, ``pad_id`` after a row's end; ``lengths``
    (batch,) the new tokens of each row (its EOS included); ``logprobs`` (batch, steps) each
    token's log-probability under the distribution it was drawn from (the logits over the
    temperature, before top-p; greedy: the logits), 0 after a row's end; ``finished`` (batch,)
    whether the row ended at EOS."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor


def pad_left(
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    pad_id: int = 0,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths → (batch, longest) left-padded with ``pad_id``, lengths."""
    if isinstance(prompts, torch.Tensor):
        b, s = prompts.shape
        return prompts.to(device), torch.full((b,), s, dtype=torch.int64, device=device)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: need at least one prompt, each of at least one token")
    s = max(len(p) for p in prompts)
    out = torch.full((len(prompts), s), pad_id, dtype=torch.int64)
    for i, p in enumerate(prompts):
        out[i, s - len(p) :] = torch.as_tensor(list(p), dtype=torch.int64)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    return out.to(device), lengths.to(device)


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (batch, vocab) → the tokens drawn (batch,) and their log-probabilities.

    temperature 0: the argmax. Otherwise from softmax(logits / temperature) restricted to the
    nucleus (Holtzman et al. 2019): the most likely tokens whose probabilities reach ``top_p``
    (the token that crosses it included), renormalised."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature {temperature} must be >= 0 and top_p {top_p} in (0, 1]")
    logits = logits.float()
    if temperature == 0:
        token = logits.argmax(dim=-1)
        return token, logits.log_softmax(-1).gather(1, token[:, None])[:, 0]
    logp = (logits / temperature).log_softmax(-1)
    probs = logp.exp()
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    # multinomial draws on the generator's device; a CPU generator draws on the CPU
    device = generator.device if generator is not None else probs.device
    token = torch.multinomial(probs.to(device), 1, generator=generator)[:, 0].to(logits.device)
    return token, logp.gather(1, token[:, None])[:, 0]


@torch.inference_mode()
def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    pad_id: int = 0,
) -> Generation:
    """Up to ``max_new_tokens`` new tokens for each prompt (token-id lists of any lengths, or a
    (batch, s) tensor of equal ones), with the KV cache: one prefill, then one decode step per
    token until every row has reached ``eos_id`` or the limit. Draws from ``generator``, else one
    seeded by ``seed`` (the same seed, the same tokens), else torch's global one. The model runs
    in eval mode (the MoE routers count no tokens) and is left in the mode it had."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens {max_new_tokens} must be >= 1")
    device = model.rope_cos.device
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    tokens, lengths = pad_left(prompts, pad_id, device)
    b = tokens.shape[0]
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.int64, device=device)
    logprobs = torch.zeros((b, max_new_tokens), device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    done = torch.zeros(b, dtype=torch.int64, device=device)
    was_training = model.training
    model.eval()
    try:
        logits, cache = model.prefill(tokens, lengths, tokens.shape[1] + max_new_tokens - 1)
        for t in range(max_new_tokens):
            token, lp = sample(logits, temperature, top_p, generator)
            live = ~finished
            out[:, t] = torch.where(live, token, out[:, t])
            logprobs[:, t] = torch.where(live, lp, logprobs[:, t])
            done += live.long()
            if eos_id is not None:
                finished |= live & (token == eos_id)
            if bool(finished.all()) or t == max_new_tokens - 1:
                break
            logits, cache = model.decode_step(token, cache)
    finally:
        model.train(was_training)
    return Generation(out, done, logprobs, finished)


def load_checkpoint_model(
    spec: object, checkpoint_root: str | Path, step: int | None = None
) -> Llama:
    """The trainer's model of run spec ``spec`` (a RunSpec) with the weights of its checkpoint
    under ``checkpoint_root`` (RUN_DIR/checkpoints): the newest intact one, or ``step``; on the
    CPU, in float32, in eval mode. Refuses (CheckpointMismatchError) a checkpoint of another
    model shape; any plan's checkpoint loads (DCP reshards)."""
    import torch.distributed.checkpoint as dcp

    from aihpc.resilience.manifest import (
        CheckpointCorruptError,
        check_identity,
        scan_checkpoints,
        verify_checkpoint,
    )
    from aihpc.runtime.config import LlamaConfig
    from aihpc.runtime.rundir import run_identity

    root = Path(checkpoint_root)
    if step is None:
        scan = scan_checkpoints(root)
        if scan.intact is None:
            raise CheckpointCorruptError(
                f"no intact checkpoint under {root}: " + ("; ".join(scan.lines()) or "none saved")
            )
        path = scan.intact.path
    else:
        path = root / f"step_{step:08d}"
        verify_checkpoint(path)
    ident = {k: v for k, v in run_identity(spec, None).items() if k.startswith("model.")}
    check_identity(path, _with_saved_rest(path, ident))
    model = Llama(LlamaConfig.from_spec(spec.model))  # type: ignore[attr-defined]
    model.init_weights(0)  # the rotary tables and buffers; every weight is then loaded
    state = {"train": {"model": model.state_dict()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state["train"]["model"])
    return model.eval()


def _with_saved_rest(path: Path, model_fields: dict) -> dict | None:
    """The identity to check the checkpoint against: its own, with the model fields the spec's
    (the seed and the data are the training run's business, not the model's); None when the
    checkpoint records no identity (then only its format is checked)."""
    from aihpc.resilience.manifest import read_manifest

    saved = read_manifest(path).get("run")
    if not saved:
        return None
    return {**{k: v for k, v in saved.items() if not k.startswith("model.")}, **model_fields}
