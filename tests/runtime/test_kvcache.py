"""Incremental decoding with the KV cache (runtime/kvcache.py, Llama.prefill / decode_step) and
generation (runtime/generate.py): every logit the cache gives equals a full forward over the
growing, unpadded sequence (dense and MoE, GQA / MQA / MHA, a batch of prompts of different
lengths left-padded), greedy generation equals the argmax of full forwards, seeded sampling
repeats, rows stop at EOS; and a model loaded from a trainer's checkpoint generates."""

from __future__ import annotations

import pytest
import torch
from train_cli import ok, train

from aihpc.resilience import CheckpointMismatchError
from aihpc.runspec import load_runspec
from aihpc.runtime import Llama, LlamaConfig
from aihpc.runtime.config import MoEConfig
from aihpc.runtime.generate import generate, load_checkpoint_model, pad_left, sample

VOCAB = 64
# fp32 parity: the cached path and the full forward differ by summation order only (measured
# 6e-8 absolute on logits of about 0.1); a decode step's position off by one moved them by
# 2e-4 (0.2 relative), a padding key left visible by 0.12
TOL = {"rtol": 1e-5, "atol": 1e-6}


def make(kv_heads: int = 2, moe: bool = False, seed: int = 0) -> Llama:
    moe_cfg = None
    if moe:  # layer 0 dense, layer 1 MoE (top-2 of 4, one shared expert)
        moe_cfg = MoEConfig(
            dim=32, num_experts=4, top_k=2, expert_ffn_dim=16, num_shared_experts=1,
            first_dense_layers=1,
        )  # fmt: skip
    cfg = LlamaConfig(
        dim=32, num_layers=2, num_heads=4, num_kv_heads=kv_heads, ffn_dim=64, vocab_size=VOCAB,
        max_seq_len=32, moe=moe_cfg,
    )  # fmt: skip
    model = Llama(cfg)
    model.init_weights(seed)
    return model.eval()


def prompts(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]


@pytest.mark.parametrize(
    ("kv_heads", "moe"),
    [(2, False), (1, False), (4, False), (2, True)],
    ids=["gqa", "mqa", "mha", "moe"],
)
@torch.no_grad()
def test_cached_logits_equal_full_forward(kv_heads, moe):
    model = make(kv_heads, moe)
    rows = prompts([5, 9, 3, 9])
    tokens, lengths = pad_left([r.tolist() for r in rows])
    s = tokens.shape[1]
    new = torch.randint(0, VOCAB, (len(rows), 6), generator=torch.Generator().manual_seed(2))
    logits, cache = model.prefill(tokens, lengths, capacity=s + 6, all_logits=True)
    for i, r in enumerate(rows):  # every prompt position, padding left out
        torch.testing.assert_close(logits[i, s - len(r) :], model(r[None])[0], **TOL)
    for t in range(6):
        step, cache = model.decode_step(new[:, t], cache)
        for i, r in enumerate(rows):
            full = model(torch.cat([r, new[i, : t + 1]])[None])[0, -1]
            torch.testing.assert_close(step[i], full, **TOL)
    assert cache.lengths.tolist() == [n + 6 for n in (5, 9, 3, 9)]
    layer = model.layers["0"].attention
    assert cache.k["0"].shape == (4, layer.wk.out_features // model.cfg.head_dim, s + 6, 8)


@torch.no_grad()
def test_chunked_prefill_equals_one_prefill():
    """A prompt fed in two chunks (the second attends to the first from the cache)."""
    model = make(moe=True)
    tokens, lengths = pad_left([r.tolist() for r in prompts([7, 4])])
    whole, _ = model.prefill(tokens, lengths, all_logits=True)
    first, cache = model.prefill(tokens[:, :4], lengths - 3, capacity=7, all_logits=True)
    second = model.extend(tokens[:, 4:], cache, all_logits=True)
    torch.testing.assert_close(torch.cat([first, second], 1)[0], whole[0], **TOL)
    torch.testing.assert_close(second[1], whole[1, 4:], **TOL)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_generation_is_the_argmax_of_full_forwards(moe):
    model = make(moe=moe)
    rows = [r.tolist() for r in prompts([6, 2, 4])]
    out = generate(model, rows, 7)
    assert out.lengths.tolist() == [7, 7, 7] and not out.finished.any()
    with torch.no_grad():
        for i, row in enumerate(rows):
            seq = list(row)
            for t in range(7):
                logits = model(torch.tensor([seq]))[0, -1]
                assert int(out.tokens[i, t]) == int(logits.argmax())
                torch.testing.assert_close(out.logprobs[i, t], logits.log_softmax(-1).max(), **TOL)
                seq.append(int(logits.argmax()))


def test_rows_stop_at_eos_and_pad_after():
    model = make()
    rows = [r.tolist() for r in prompts([3, 5])]
    free = generate(model, rows, 6)
    first = free.tokens[0].tolist()
    n0 = next(t + 1 for t in range(1, 6) if first[t] not in first[:t])  # a token new at t
    eos = first[n0 - 1]  # row 0 ends there
    out = generate(model, rows, 6, eos_id=eos, pad_id=VOCAB - 1)
    assert bool(out.finished[0]) and int(out.lengths[0]) == n0
    assert out.tokens[0, :n0].tolist() == first[:n0]
    pad = [VOCAB - 1] * (6 - n0)
    assert out.tokens[0, n0:].tolist() == pad and out.logprobs[0, n0:].eq(0).all()
    stop = (free.tokens[1] == eos).nonzero()
    n1 = int(stop[0]) + 1 if len(stop) else 6  # row 1 runs on to its own EOS or the limit
    assert int(out.lengths[1]) == n1
    assert out.tokens[1, :n1].tolist() == free.tokens[1, :n1].tolist()


def test_seeded_sampling_repeats_and_top_p_narrows():
    model = make()
    rows = [r.tolist() for r in prompts([4, 4, 2])]
    a = generate(model, rows, 8, temperature=1.0, top_p=0.9, seed=5)
    b = generate(model, rows, 8, temperature=1.0, top_p=0.9, seed=5)
    c = generate(model, rows, 8, temperature=1.0, top_p=0.9, seed=6)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    # a nucleus too small to hold more than the most likely token is greedy
    greedy = generate(model, rows, 8)
    tiny = generate(model, rows, 8, temperature=1.0, top_p=1e-6, seed=7)
    assert torch.equal(tiny.tokens, greedy.tokens)


def test_sample_draws_from_the_nucleus_at_its_frequencies():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20000, 4)
    gen = torch.Generator().manual_seed(0)
    token, logp = sample(logits, temperature=1.0, top_p=0.7, generator=gen)
    freq = torch.bincount(token, minlength=4).float() / len(token)
    assert freq[2:].sum() == 0  # 0.5 + 0.3 reach 0.7: the nucleus is the first two
    assert abs(float(freq[0]) - 0.5 / 0.8) < 0.02  # renormalised over the nucleus
    torch.testing.assert_close(logp, torch.log(torch.tensor([0.5, 0.3]))[token], **TOL)


def test_refusals_name_the_limit():
    model = make()
    with pytest.raises(ValueError, match="max_seq_len 32"):
        generate(model, [[1] * 20], 14)  # 20 + 14 - 1 slots > 32
    tokens = torch.ones(2, 4, dtype=torch.long)
    _, cache = model.prefill(tokens, capacity=5)
    model.decode_step(tokens[:, 0], cache)
    with pytest.raises(ValueError, match="KV cache full"):
        model.decode_step(tokens[:, 0], cache)
    with pytest.raises(ValueError, match="lengths"):
        model.prefill(tokens, torch.tensor([0, 4]))


TRAIN_SPEC = """
[model]
preset = "tiny-llama"
seq_length = 32
{extra}
[cluster]
gpu = "h100-sxm"
num_gpus = 1
gpus_per_node = 1
[parallel]
micro_batch_size = 2
global_batch_size = 2
[training]
train_steps = 4
learning_rate = 3e-3
warmup_steps = 1
[checkpoint]
interval_steps = 2
"""


@pytest.mark.slow
def test_model_from_a_trainers_checkpoint_generates(tmp_path):
    spec_path = tmp_path / "run.toml"
    spec_path.write_text(TRAIN_SPEC.format(extra=""))
    ok(train(spec_path, tmp_path / "run", env={"OMP_NUM_THREADS": "1"}))
    spec, root = load_runspec(spec_path), tmp_path / "run" / "checkpoints"
    model = load_checkpoint_model(spec, root)  # the newest: step 4
    step2 = load_checkpoint_model(spec, root, step=2)
    fresh = Llama(LlamaConfig.from_spec(spec.model))
    fresh.init_weights(spec.training.seed)
    w = "layers.0.attention.wq.weight"
    weights = [m.state_dict()[w] for m in (model, step2, fresh)]
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])
    prompt = [ord(c) for c in "First Citizen:"]
    out = generate(model, [prompt, prompt[:5]], 6)
    with torch.no_grad():  # the loaded model's cached decoding against its own full forward
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert out.tokens[0].tolist() == seq[len(prompt) :]
    other = tmp_path / "other.toml"
    other.write_text(TRAIN_SPEC.format(extra="num_layers = 3"))
    with pytest.raises(CheckpointMismatchError, match=r"model\.num_layers 2"):
        load_checkpoint_model(load_runspec(other), root)
