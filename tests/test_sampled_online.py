"""Sampled and mixed traffic with the learner ON and the `adaflash` verify policy cutting drafts
(float32, one engine for the module): greedy rows equal the target while weights change under
way, and the second tokens follow the target's distribution at temperature 1 (the draws are
seeded, so they go through drafter-invariant verification, the default with learning on). Frozen drafter and the `fixed` policy: tests/test_sampled_lossless.py; the
`budget` policy with sampled requests through `vllm serve`: tests/test_serve.py."""

import pytest

from test_sampled_lossless import (N_DRAWS, P_FLOOR, check_mixed_batch, fit, hf_target,  # noqa: F401
                                   make_llm, spec_drafts)
from test_worker_parity import make_drafter

pytestmark = pytest.mark.vllm

ONLINE = {"update": {"lr": 2e-3}, "min_new_tokens_per_update": 8,
          "pacing": {"learner_cpu_share": 0.8},
          "length_head": {"policy": "adaflash", "rho": 0.5}}


@pytest.fixture(scope="module")
def llm(smollm2_path, tmp_path_factory):
    drafter = make_drafter(smollm2_path, str(tmp_path_factory.mktemp("sampled-online") / "drafter"))
    engine = make_llm(smollm2_path, drafter, ONLINE)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def stats(llm):
    from vllm_onlinespec.serving.stats import fetch

    return fetch(llm)


def test_greedy_rows_equal_the_target_while_the_drafter_learns(llm, hf_target):
    check_mixed_batch(llm, hf_target)  # warms the learner up with mixed feedback
    v0 = stats(llm).published_version
    check_mixed_batch(llm, hf_target)
    st = stats(llm)
    assert st.learner.updates >= 1 and st.published_version >= v0, st
    assert st.hook_errors == 0, st


def test_rejection_sampler_follows_the_target_while_learning(llm, hf_target):
    before = spec_drafts(llm)
    res = fit(llm, hf_target, "T1")
    print(f"spec online adaflash T1: {res.summary()}")
    assert spec_drafts(llm) - before >= N_DRAWS
    assert res.p_value > P_FLOOR, res.summary()
    assert abs(res.z_top) < 4, res.summary()
    st = stats(llm)
    assert 0 < st.cutter.verified < st.cutter.drafted, st  # adaflash did cut drafts
