"""Generation with the vLLM feature log (`vllm-onlinespec train --features vllm`): the engine
decodes plainly (greedy output = the HF target's, token for token, float32) and the features it
logs for every generated sequence, greedy and sampled (n = 2), equal the HF pass the trainer
would otherwise run (training/features.py), within float32 kernel tolerance."""

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.engine_in_process]

PROMPTS = ["What is 2+2?", "Name three colors.", "Write one sentence about the moon."]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def generated(smollm2_path, tmp_path_factory):
    from transformers import AutoConfig, AutoTokenizer

    from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter, save_drafter
    from vllm_onlinespec.training.data import Prompt
    from vllm_onlinespec.training.generate import (FeatureLogSpec, SamplingSpec, chat_ids,
                                                   vllm_generate_fn)

    tmp = tmp_path_factory.mktemp("feature_log")
    dcfg = DFlashConfig.for_target(AutoConfig.from_pretrained(smollm2_path), mask_token_id=16,
                                   num_layers=1, block_size=5, torch_dtype="float32")
    drafter = save_drafter(tmp / "drafter", dcfg, DFlashDrafter(dcfg))
    spec = FeatureLogSpec(dir=str(tmp / "log"), drafter=str(drafter))
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = [chat_ids(tok, Prompt(id=str(i), source="jsonl", text=p)) for i, p in enumerate(PROMPTS)]
    fn = vllm_generate_fn(smollm2_path, "float32", feature_log=spec, max_model_len=512)
    try:
        greedy = fn(ids, SamplingSpec(temperature=0.0, max_tokens=MAX_TOKENS))
        sampled = fn(ids[:1], SamplingSpec(temperature=0.8, n=2, max_tokens=MAX_TOKENS, seed=1))
        passes = fn.stats().drafter_passes
    finally:
        fn.close()
    seqs = [p + r for p, rs in zip(ids, greedy) for r in rs] + [ids[0] + r for r in sampled[0]]
    return {"layers": list(dcfg.target_layer_ids), "log": tmp / "log", "ids": ids,
            "greedy": greedy, "seqs": seqs, "passes": passes}


@pytest.fixture(scope="module")
def hf_target(hf_smollm2):
    return hf_smollm2


def test_plain_engine_output_is_the_targets(generated, hf_target):
    from conftest import hf_greedy

    for prompt, (resp,) in zip(generated["ids"], generated["greedy"]):
        assert resp == hf_greedy(hf_target, prompt, MAX_TOKENS)


def test_a_plain_engine_runs_no_drafter_forward(generated):
    """The K = 0 floor: every step asked vLLM's drafter for nothing, and nothing ran (no
    context pass: no later draft would read it)."""
    passes = generated["passes"]
    assert passes.get("none", 0) >= MAX_TOKENS, passes
    assert passes.get("draft", 0) == 0 and passes.get("context", 0) == 0, passes


def test_logged_features_equal_the_hf_pass(generated, hf_target):
    from vllm_onlinespec.training.feature_log import ids_key, read_feature_log
    from vllm_onlinespec.training.features import target_features

    H = hf_target.config.hidden_size
    logged = read_feature_log(generated["log"], generated["layers"], H)
    assert logged.dropped == 0
    worst = 0.0
    for seq in generated["seqs"]:
        got = logged.sequences[ids_key(seq[:-1])]  # every sequence, sampled ones too
        aux, final = target_features(hf_target, torch.tensor([seq[:-1]]), None,
                                     generated["layers"])
        for g, want in ((got.aux, aux[0]), (got.final, final[0])):
            assert g.shape == want.shape
            worst = max(worst, ((g.float() - want).norm(dim=-1) / want.norm(dim=-1)).max().item())
    # fp32 C++ kernels vs PyTorch: well under this (tests/test_serving_faults.py parity: an off-by-one
    # layer measures 0.61)
    assert worst < 1e-3, f"max relative error {worst:.3g}"


def test_train_cli_with_features_logged_by_vllm(smollm2_path, tmp_path):
    """`vllm-onlinespec train --features vllm` end to end: every answer's features come from
    the generation engine's log (no HF pass), and a vLLM-loadable drafter comes out."""
    import json

    from vllm_onlinespec.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [
        "What is 2+2?", "Name three colors.", "Write one sentence about the moon.",
        "Say hello in French.", "Count to five.", "What is a cat?"]))
    out = tmp_path / "drafter"
    assert main(["train", "--target", smollm2_path, "--prompts", str(prompts), "--out", str(out),
                 "--features", "vllm", "--steps", "2", "--max-new-tokens", "16", "--heldout-fraction", "0.5",
                 "--block-size", "3", "--eval-anchors", "2", "--threads", "1",
                 "--gen-cache", str(tmp_path / "gen")]) == 0
    n_train = json.loads((out / "train_meta.json").read_text())["prompts"]["train"]
    # Streamed per chunk (dataset.StreamedFeatures): every training answer's features from the
    # engine's log, none from an HF pass, the log files consumed, a rate per chunk.
    rows = [json.loads(x) for x in (out / "data" / "progress.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["part"] == "train"]
    assert sum(r["logged"] for r in train) == n_train and sum(r["hf"] for r in rows) == 0, rows
    assert all(r["tok_s"] > 0 for r in rows if r["new"]), rows
    assert not list((out / "data" / "feature_log").glob("log-*.safetensors"))
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
