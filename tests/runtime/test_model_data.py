"""Model, data and fault-spec units (single process, fast)."""

from __future__ import annotations

import threading

import pytest
import torch

from aihpc.resilience import Watchdog, parse_fault
from aihpc.runspec import SpecError, model_presets
from aihpc.runtime import ByteTokenizer, Llama, LlamaConfig, TokenLoader, load_tokens
from watchdog_clock import WAIT_S, WatchdogClock

CFG = LlamaConfig(
    dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64, vocab_size=256, max_seq_len=16
)


def make_model(seed=0):
    m = Llama(CFG)
    m.init_weights(seed)
    return m


def test_causal_and_shapes():
    m = make_model()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    y = m(x)
    assert y.shape == (2, 16, 256)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256
    y2 = m(x2)
    assert torch.equal(y[:, :10], y2[:, :10])  # a later token never changes earlier logits
    assert not torch.allclose(y[:, 10:], y2[:, 10:])


def test_gqa_shares_kv_heads():
    m = make_model()
    att = m.layers["0"].attention
    assert att.wk.weight.shape == (CFG.num_kv_heads * CFG.head_dim, CFG.dim)
    assert att.wq.weight.shape == (CFG.num_heads * CFG.head_dim, CFG.dim)


def test_init_is_seeded_and_independent_of_global_rng():
    torch.manual_seed(1)
    a = make_model(0).state_dict()
    torch.manual_seed(2)
    b = make_model(0).state_dict()
    c = make_model(1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["output.weight"], c["output.weight"])


def test_byte_tokenizer_roundtrip_and_sample():
    tok = ByteTokenizer()
    text = "Speak, speak. — Ünïcode"
    assert tok.decode(tok.encode(text)) == text
    tokens = load_tokens()
    assert 100_000 < len(tokens) < 400_000
    assert "First Citizen" in tok.decode(tokens[:200])


def test_tiny_presets_match_the_tokenizer():
    presets = model_presets()
    for name in ("tiny-llama", "tiny-llama-small"):
        assert presets[name]["vocab_size"] == ByteTokenizer.vocab_size
        assert presets[name]["source"].startswith("aihpc test preset")


def _rows(batches):
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches])


def test_loader_is_resumable_and_world_size_invariant():
    tokens = torch.arange(0, 2000).remainder(256).to(torch.uint8)
    a = TokenLoader(tokens, 8, 4, seed=3)
    first = [_rows(a.next_batch(0, 1, 2)) for _ in range(3)]
    state = a.state_dict()
    nxt = _rows(a.next_batch(0, 1, 2))
    b = TokenLoader(tokens, 8, 4, seed=3)
    b.load_state_dict(state)
    assert torch.equal(_rows(b.next_batch(0, 1, 2)), nxt)
    # two ranks together read exactly the one-rank global batch
    c, d = TokenLoader(tokens, 8, 4, seed=3), TokenLoader(tokens, 8, 4, seed=3)
    for ref in first:
        both = torch.cat([_rows(c.next_batch(0, 2, 1)), _rows(d.next_batch(1, 2, 1))])
        assert torch.equal(both, ref)
    other = TokenLoader(tokens, 8, 4, seed=4)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_loader_crosses_epochs_with_new_order():
    tokens = torch.arange(0, 81).to(torch.uint8)  # 10 samples of 8 (+1)
    lo = TokenLoader(tokens, 8, 5, seed=0)
    e0 = torch.cat([_rows(lo.next_batch(0, 1, 5)) for _ in range(2)])
    e1 = torch.cat([_rows(lo.next_batch(0, 1, 5)) for _ in range(2)])
    starts0, starts1 = sorted(e0[:, 0].tolist()), sorted(e1[:, 0].tolist())
    assert starts0 == starts1 == list(range(0, 80, 8))  # each epoch visits every sample once
    assert not torch.equal(e0, e1)


@pytest.mark.parametrize(
    "text",
    [
        "kill",
        "kill:step=0",
        "boom:step=3",
        "kill:step=3:rank=x",
        "hang:step=3:at=later",
        "kill:step=3:step=4",
        "corrupt-checkpoint:step=3:at=save",
    ],
)
def test_bad_fault_specs_name_the_flag(text):
    with pytest.raises(SpecError, match="--inject"):
        parse_fault(text)


def test_fault_spec_parses():
    f = parse_fault("kill:step=17:rank=1")
    assert (f.kind, f.step, f.rank, f.at) == ("kill", 17, 1, "step")
    assert parse_fault("corrupt-checkpoint:step=4:mode=truncate").mode == "truncate"


def test_watchdog_fires_within_bound(tmp_path, monkeypatch):
    """Quiet while the beats come within the bound, and it fires at the first check after the
    bound is exceeded. The clock is the test's (tests/watchdog_clock.py): on a loaded machine a
    real sleep between beats may itself outlast the bound."""
    clock = WatchdogClock(monkeypatch)
    fired, done = [], threading.Event()
    wd = Watchdog(
        tmp_path,
        0,
        timeout_s=0.5,
        poll_s=0.01,
        exit_on_hang=False,
        on_hang=lambda ev: (fired.append(ev), done.set()),
    ).start()
    try:
        for step in range(5):  # beating keeps it quiet
            wd.beat(step)
            clock.advance(0.375)  # binary fractions: the ages below are exact
            clock.checks()
        clock.advance(0.125)  # 0.5 s since the last beat: the bound, not beyond it
        clock.checks()
        assert not fired
        clock.advance(0.015625)
        assert done.wait(WAIT_S)
    finally:
        wd.stop()
    # found at the first check past the bound: the clock has not moved since
    assert fired[0]["step"] == 4 and fired[0]["phase"] == "step"
    assert fired[0]["stalled_s"] == 0.516 and fired[0]["bound_s"] == 0.5


def test_launcher_env_from_torchrun_slurm_or_none():
    from aihpc.runtime import launcher_env

    assert launcher_env({}) is None
    tr = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    assert launcher_env(tr) == tr
    slurm = launcher_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_ID": "123",
            "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7",
        }
    )
    assert slurm == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": str(20000 + 123),
    }


def test_pre_tokenized_npy_is_memory_mapped_and_read_alike(tmp_path):
    import numpy as np

    from aihpc.runtime.data import token_vocab_needed

    ids = np.arange(0, 3000, dtype=np.uint16) % 1000
    path = tmp_path / "tokens.npy"
    np.save(path, ids)
    mapped = load_tokens(path)
    assert isinstance(mapped, np.memmap) and token_vocab_needed(path) == (0, 1000)
    a = TokenLoader(mapped, 8, 4, seed=0)
    b = TokenLoader(torch.from_numpy(ids.astype(np.int64)), 8, 4, seed=0)
    for _ in range(3):
        for (xa, ya), (xb, yb) in zip(a.next_batch(0, 1, 2), b.next_batch(0, 1, 2), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb) and xa.dtype == torch.int64
