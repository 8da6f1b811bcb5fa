"""Online learning with a reduced draft vocabulary (draft_vocab_size + d2t) inside vLLM (CPU,
float32): the learner trains the rows vLLM serves, publishes in place, stays lossless, and its
checkpoints keep the vocabulary (they stay loadable by vLLM as the same reduced drafter)."""

from __future__ import annotations

import pytest
import torch

from test_online import (PROMPTS, assert_lossless, make_llm,
                         run_pass, wait_learned)
from test_worker_parity import make_drafter

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def served(smollm2_path, tmp_path_factory, greedy_reference):
    from vllm_onlinespec.drafter import (DraftVocab, load_draft_vocab, load_drafter,
                                         save_drafter)
    from vllm_onlinespec.training.trainer import load_target

    tmp = tmp_path_factory.mktemp("dv_online")
    plain = make_drafter(smollm2_path, str(tmp / "plain"))
    W = load_target(smollm2_path).get_output_embeddings().weight.detach()
    answers = sorted({t for ids in greedy_reference.values() for t in ids})
    vocab = DraftVocab.of(W, torch.tensor(list(range(2048)) + answers))
    cfg, drafter, head = load_drafter(plain, dtype=torch.float32)
    path = str(save_drafter(tmp / "drafter", cfg, drafter, head, dtype=torch.float32,
                            draft_vocab=vocab))
    assert load_draft_vocab(path).ids.tolist() == vocab.ids.tolist()
    llm = make_llm(smollm2_path, path, str(tmp / "ckpt"))
    passes = []
    for _ in range(3):
        passes.append(run_pass(llm))
        st = wait_learned(llm)
    llm.llm_engine.engine_core.shutdown()
    return {"passes": passes, "stats": st, "vocab": vocab, "ckpt": tmp / "ckpt"}


def test_reduced_vocabulary_learns_losslessly(served, greedy_reference):
    for outs, _ in served["passes"]:
        assert_lossless(outs, greedy_reference)
    st = served["stats"]
    assert st.learner.updates > 0 and st.learner.errors == 0 and st.published_version > 0, st
    assert st.hook_errors == 0


def test_learner_checkpoints_keep_the_vocabulary(served):
    import glob

    from vllm_onlinespec.drafter import load_draft_vocab

    folders = [p for p in glob.glob(str(served["ckpt"] / "**" / "config.json"), recursive=True)]
    assert folders, "the learner wrote no checkpoint"
    from pathlib import Path

    got = load_draft_vocab(Path(folders[-1]).parent)
    assert got is not None and torch.equal(got.ids, served["vocab"].ids)
