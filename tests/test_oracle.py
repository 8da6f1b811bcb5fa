"""Benchmark-only oracle verification (serving/oracle.py): refused without its explicit switch,
its acceptance model hits the configured mean, and it rewrites the sampler's rows correctly."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_onlinespec.config import ORACLE_ENV, ConfigError, OnlineSpecConfig
from vllm_onlinespec.serving import oracle


def test_refused_without_the_benchmark_env(monkeypatch):
    monkeypatch.delenv(ORACLE_ENV, raising=False)
    with pytest.raises(ConfigError, match=ORACLE_ENV):
        OnlineSpecConfig.from_any({"enabled": False, "oracle": {"accept_len": 5}})


def test_refused_with_learning_on(monkeypatch):
    monkeypatch.setenv(ORACLE_ENV, "1")
    with pytest.raises(ConfigError, match="enabled = false"):
        OnlineSpecConfig.from_any({"oracle": {"accept_len": 3}})
    cfg = OnlineSpecConfig.from_any({"enabled": False, "oracle": {"accept_len": 3}})
    assert cfg.oracle.accept_len == 3


def test_off_by_default():
    assert OnlineSpecConfig.from_any(None).oracle.accept_len is None


@pytest.mark.parametrize("tau,k", [(1.0, 4), (2.5, 4), (4.0, 7), (5.0, 4), (8.0, 7)])
def test_rate_gives_the_configured_mean(tau, k):
    r = oracle.conditional_rate(tau, k)
    assert oracle.expected_accept_len(r, k) == pytest.approx(tau, abs=1e-9)
    drawn = oracle.draw_accepted(r, [k] * 20000, np.random.default_rng(0))
    assert 1 + np.mean(drawn) == pytest.approx(tau, abs=0.03)


def test_rate_out_of_range():
    with pytest.raises(ValueError, match="K \\+ 1"):
        oracle.conditional_rate(6.0, 4)


def test_force_rewrites_rows_with_drafts_then_the_target_token():
    V, drafts = 10, [[3, 4, 5], [], [7, 8]]
    num = [len(d) for d in drafts]
    # logits rows per request: its draft positions then its bonus (vLLM's layout)
    rows, target_idx, bonus_idx = 0, [], []
    for n in num:
        target_idx += list(range(rows, rows + n))
        bonus_idx.append(rows + n)
        rows += n + 1
    logits = torch.zeros(rows, V)
    logits[torch.arange(rows), torch.arange(rows) % V] = 5.0  # argmax of row i is i % V
    meta = SimpleNamespace(num_draft_tokens=num, draft_token_ids=torch.tensor([3, 4, 5, 7, 8]),
                           target_logits_indices=torch.tensor(target_idx),
                           bonus_logits_indices=torch.tensor(bonus_idx))
    sampled = torch.full((3, 4), -1, dtype=torch.int32)
    sampled[:, 0] = 1
    full = oracle.OracleVerifier(accept_len=4.0, k=3)  # rate 1: every draft accepted
    full.force(sampled, logits, meta)
    assert sampled[0].tolist() == [3, 4, 5, bonus_idx[0] % V]
    assert sampled[1].tolist() == [1, -1, -1, -1]  # no drafts: left as the sampler made it
    assert sampled[2].tolist() == [7, 8, bonus_idx[2] % V, -1]
    none = oracle.OracleVerifier(accept_len=1.0, k=3)  # rate 0: first draft rejected
    none.force(sampled, logits, meta)
    assert sampled[0].tolist() == [target_idx[0] % V, -1, -1, -1]
