"""A policy that drifts (training/drift.py) on a tiny random Llama: the trajectory's versions,
their reproducibility, each version's adapter merging into exactly the model training held at
that step; the series as known models; the HF generator the recipe runs without vLLM."""

import json

import pytest
import torch
from safetensors.torch import load_file

from vllm_onlinespec import models
from vllm_onlinespec.training import lora
from vllm_onlinespec.training.data import Prompt
from vllm_onlinespec.training.drift import (MANIFEST, checkpoint_steps, read_trajectory,
                                            train_trajectory, version_adapters, version_dir)
from vllm_onlinespec.training.variant import VariantRecipe, build_examples, fresh_model

ANSWER = ("The capital of France is Paris. It is a very beautiful city with a long history.\n\n"
          "Here are some facts:\n1. The Eiffel Tower is an iconic landmark.\n"
          "2. Paris has the Louvre, which is the largest art museum in the world.")
IDS = torch.tensor([[1, 17, 300, 4000, 29, 77, 5, 9]])
RECIPE = VariantRecipe(steps=8, batch_size=2, lr=3e-3, r=2, heldout=2, layers_from=0.5,
                       compute_dtype="float32")


@pytest.fixture(scope="module")
def examples(tiny_target_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_path)
    prompts = [Prompt(id=f"p{i}", source="test", text=f"Tell me about item {i}.") for i in range(6)]
    return build_examples(tok, prompts, [ANSWER] * 6, max_seq=96)


def _run(path, examples, out, recipe=RECIPE, versions=4, on_version=None):
    return train_trajectory(fresh_model(path, recipe), examples, recipe, out, versions=versions,
                            pad_id=0, base_name="tiny", dtype=torch.float32,
                            log=lambda s: None, on_version=on_version)


def test_checkpoint_steps_are_evenly_spaced_and_end_at_the_last_step():
    assert checkpoint_steps(160, 8) == [20, 40, 60, 80, 100, 120, 140, 160]
    assert checkpoint_steps(10, 3) == [3, 6, 10]
    with pytest.raises(ValueError, match="at least one version"):
        checkpoint_steps(10, 0)
    with pytest.raises(ValueError, match="need at least 8 steps"):
        checkpoint_steps(5, 8)


def test_trajectory_versions_are_reproducible_and_merge_into_the_trained_model(
        tiny_target_path, examples, tmp_path):
    seen = {}

    def capture(k, step):  # the wrapped model as training holds it right after version k
        with torch.no_grad():
            seen[k] = (step, model_ref[0](IDS).logits.clone())

    model_ref = [fresh_model(tiny_target_path, RECIPE)]
    manifest = train_trajectory(model_ref[0], examples, RECIPE, tmp_path / "a", versions=4,
                                pad_id=0, base_name="tiny", dtype=torch.float32,
                                log=lambda s: None, on_version=capture)
    # as many versions as asked, plus the base as version 0, at evenly spaced steps
    assert [r["version"] for r in manifest["rows"]] == [0, 1, 2, 3, 4]
    assert [r["train_step"] for r in manifest["rows"]] == [0, 2, 4, 6, 8]
    assert read_trajectory(tmp_path / "a") == json.loads((tmp_path / "a" / MANIFEST).read_text())
    folders = version_adapters(tmp_path / "a")
    assert folders[0] == (0, None) and [f.name for _, f in folders[1:]] == [
        "a-v1", "a-v2", "a-v3", "a-v4"]
    assert sorted(seen) == [1, 2, 3, 4]

    # each version's adapter, merged into a fresh base, is the model training held at its step
    for k, folder in folders[1:]:
        cfg, factors = lora.load(folder)
        meta = json.loads((folder / lora.ADAPTER_CONFIG).read_text())["vllm_onlinespec"]
        assert meta["drift"]["version"] == k and meta["drift"]["train_step"] == seen[k][0]
        merged = fresh_model(tiny_target_path, RECIPE).eval()
        assert lora.merge(merged, cfg, factors) == 2 * 7  # upper half: 2 of 4 layers
        with torch.no_grad():
            torch.testing.assert_close(merged(IDS).logits, seen[k][1], atol=1e-4, rtol=1e-4)
    # the versions differ: the policy moves
    first, last = (load_file(str(version_dir(tmp_path / "a", k) / lora.ADAPTER_WEIGHTS))
                   for k in (1, 4))
    assert any(not torch.equal(first[n], last[n]) for n in first)

    # same seed -> identical adapters at every checkpoint
    _run(tiny_target_path, examples, tmp_path / "b")
    for k in range(1, 5):
        a, b = (load_file(str(version_dir(tmp_path / x, k) / lora.ADAPTER_WEIGHTS))
                for x in ("a", "b"))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), k
    # another seed -> another trajectory
    other = VariantRecipe(**{**RECIPE.__dict__, "seed": 1})
    _run(tiny_target_path, examples, tmp_path / "c", recipe=other)
    a, c = (load_file(str(version_dir(tmp_path / x, 4) / lora.ADAPTER_WEIGHTS)) for x in "ac")
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_a_killed_trajectory_resumes_to_the_same_versions(tiny_target_path, examples, tmp_path):
    class Killed(Exception):
        pass

    def kill_after_2(k, step):
        if k == 2:
            raise Killed

    with pytest.raises(Killed):
        _run(tiny_target_path, examples, tmp_path / "r", on_version=kill_after_2)
    assert (tmp_path / "r" / "resume.pt").is_file() and not version_dir(tmp_path / "r", 3).exists()
    logs = []
    manifest = train_trajectory(fresh_model(tiny_target_path, RECIPE), examples, RECIPE,
                                tmp_path / "r", versions=4, pad_id=0, base_name="tiny",
                                dtype=torch.float32, log=logs.append)
    assert any("resumed at step 2" in line for line in logs)  # v2 saved, state not yet
    assert not (tmp_path / "r" / "resume.pt").exists()
    assert [r["train_step"] for r in manifest["rows"]] == [0, 2, 4, 6, 8]
    _run(tiny_target_path, examples, tmp_path / "u")  # uninterrupted
    for k in range(1, 5):
        a, b = (load_file(str(version_dir(tmp_path / x, k) / lora.ADAPTER_WEIGHTS))
                for x in ("r", "u"))
        assert all(torch.equal(a[n], b[n]) for n in a), k


def test_model_cli_lists_a_series_and_refuses_a_version_elsewhere(capsys):
    from vllm_onlinespec.cli import main

    assert main(["model", "path", models.DRIFT]) == 0
    lines = capsys.readouterr().out.split()
    assert len(lines) == models.DRIFT_VERSIONS + 1 and lines[-1].endswith(f"{models.DRIFT}-v8")
    assert main(["model", "path", models.DRIFT, "--version", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{models.DRIFT}-v2")
    with pytest.raises(SystemExit, match="--version picks a member of a series"):
        main(["model", "path", "smollm2-135m", "--version", "2"])


def test_variant_cli_takes_the_trajectory_flags():
    from vllm_onlinespec.cli import build_parser

    a = build_parser().parse_args(["variant", "--out", "x", "--trajectory", "8", "--generator",
                                   "hf", "--prompts", "800", "--compute-dtype", "float32"])
    assert (a.trajectory, a.generator, a.prompts, a.compute_dtype) == (8, "hf", 800, "float32")


def test_hf_generator_is_greedy_trimmed_and_seeded(tiny_target_path):
    from transformers import AutoTokenizer

    from vllm_onlinespec.training.generate import SamplingSpec
    from vllm_onlinespec.training.hf_generate import hf_generate_fn, trim_response

    assert trim_response([5, 6, 2, 2, 2], {2}) == [5, 6, 2]
    assert trim_response([5, 6], {2}) == [5, 6]
    tok = AutoTokenizer.from_pretrained(tiny_target_path)
    prompts = [tok("Hello there")["input_ids"], tok("A longer prompt than the first")["input_ids"]]
    fn = hf_generate_fn(tiny_target_path, batch_size=2)
    greedy = fn(prompts, SamplingSpec(max_tokens=6))
    assert [len(r) for r in greedy] == [1, 1] and all(0 < len(r[0]) <= 6 for r in greedy)
    # batched and alone: the same greedy answer (left padding is masked)
    assert fn(prompts[1:], SamplingSpec(max_tokens=6))[0] == greedy[1]
    spec = SamplingSpec(temperature=1.0, n=3, max_tokens=6, seed=4)
    assert fn(prompts, spec) == fn(prompts, spec)
    assert fn(prompts, spec) != fn(prompts, SamplingSpec(temperature=1.0, n=3, max_tokens=6, seed=5))


def test_reference_recipe_trains_on_a_files_answers_and_never_its_tail(tiny_target_path, tmp_path):
    """--answers reference: each row's reference_answer after its chat-formatted question,
    unchanged (GSM8K's <<a*b=c>> notes kept), the file's last hold_tail rows never used, a row
    without an answer or a user turn skipped, the order fixed by the seed; the trajectory's
    manifest names the prompts it trained on (an evaluation checks it holds them out)."""
    from transformers import AutoTokenizer

    from vllm_onlinespec.training.drift import make_trajectory, prompt_hash
    from vllm_onlinespec.training.variant import reference_examples

    rows = [{"id": f"g:{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "reference_answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"}
            for i in range(10)]
    rows[3].pop("reference_answer")
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, "not json")
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    tok = AutoTokenizer.from_pretrained(tiny_target_path)
    recipe = VariantRecipe(steps=4, batch_size=2, lr=3e-3, r=2, heldout=2, answers="reference",
                           data="train.jsonl", hold_tail=2, compute_dtype="float32")
    _, ex, used = reference_examples(tiny_target_path, recipe, data, log=lambda s: None)
    # rows 8 and 9 are the tail, row 3 has no answer: 7 left, in the seed's order
    assert sorted(p.text for p in used) == sorted(f"What is {i} + {i}?" for i in (0, 1, 2, 4, 5, 6, 7))
    _, ex2, used2 = reference_examples(tiny_target_path, recipe, data, log=lambda s: None)
    assert [p.id for p in used2] == [p.id for p in used] and [e.ids for e in ex2] == [e.ids for e in ex]
    for p, e in zip(used, ex):
        i = int(p.text.split()[2])
        answer = tok.decode(e.ids[e.start:], skip_special_tokens=True)
        assert answer == f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}"
    out = make_trajectory(tiny_target_path, tmp_path / "drift", recipe, versions=2,
                          cache_dir=tmp_path / "cache", base_name="tiny", data=data,
                          log=lambda s: None)
    manifest = read_trajectory(out)
    assert manifest["recipe"]["style"] == "reference-answers/1"
    assert manifest["recipe"]["recipe"]["hold_tail"] == 2
    assert set(manifest["prompt_hashes"]) == {prompt_hash(p.text) for p in used}
    assert [r["version"] for r in manifest["rows"]] == [0, 1, 2]


def test_reference_recipe_refuses_a_file_without_answers_and_the_cli_pairs_its_flags(tmp_path):
    from vllm_onlinespec.cli import main
    from vllm_onlinespec.training.variant import recipe_examples

    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    recipe = VariantRecipe(answers="reference", hold_tail=0)
    with pytest.raises(ValueError, match="no row with a user turn and a reference_answer"):
        recipe_examples(str(models.pull("smollm2-135m")), recipe, cache_dir=tmp_path, data=data)
    with pytest.raises(ValueError, match="needs a data file"):
        recipe_examples("x", recipe, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="answers must be one of terse, reference"):
        VariantRecipe(answers="gsm8k")
    with pytest.raises(SystemExit, match="--answers reference takes its answers from --data"):
        main(["variant", "--out", str(tmp_path / "o"), "--data", str(data)])
