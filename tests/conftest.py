"""Shared fixtures: the real default model (SmolLM2-135M) and a tiny random Llama target."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

# Without a GPU the Triton kernels run under Triton's interpreter, which must be on before the
# first `import triton` anywhere in this process (torch._dynamo and transformers import it early).
# vLLM's CPU path runs no Triton kernels, so its engines are unaffected.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

SHARED = Path(__file__).resolve().parents[2] / "shared"
SPEC_BENCH = SHARED / "data" / "spec_bench" / "question.jsonl"


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from vllm_onlinespec.models import pull

    return str(pull("smollm2-135m"))


@pytest.fixture(scope="session")
def tiny_target_path(tmp_path_factory, smollm2_path) -> str:
    """A 4-layer random Llama with SmolLM2's tokenizer: same vocab, ~3 M non-embedding params."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def spec_bench_questions() -> list[dict]:
    if not SPEC_BENCH.is_file():
        pytest.skip(f"Spec-Bench data not found at {SPEC_BENCH}")
    return [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]


_GREEDY: dict[tuple, list[int]] = {}


def hf_greedy(hf, prompt_ids, max_tokens: int) -> list[int]:
    """The HF model's own greedy continuation of prompt_ids (float32, up to max_tokens, ending at
    EOS where it stops), cached for the session: many engine tests compare the same prompts
    with the same target. Keyed by the model's folder, so a swapped or tiny target is its own."""
    import torch

    key = (str(hf.name_or_path), tuple(int(t) for t in prompt_ids), int(max_tokens))
    if key not in _GREEDY:
        ids = torch.tensor([list(key[1])])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              do_sample=False)
        _GREEDY[key] = out[0, ids.shape[1]:].tolist()
    return list(_GREEDY[key])


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """The default target in HF, float32, once per session."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def greedy_reference(smollm2_path, hf_smollm2) -> dict[str, list[int]]:
    """The HF target's own greedy answers to test_online.PROMPTS (float32): what every learning
    engine's output must equal, token for token. One per session: several modules compare."""
    from transformers import AutoTokenizer

    from test_online import MAX_TOKENS, PROMPTS

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ref = {}
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_dict=True)["input_ids"]
        ref[p] = hf_greedy(hf_smollm2, ids, MAX_TOKENS)
    return ref


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def _engine_core_in_this_process(request):
    """Modules marked `engine_in_process` build their `LLM(...)` engines with vLLM's in-process
    engine core and worker (VLLM_ENABLE_V1_MULTIPROCESSING=0): on CPU vLLM otherwise spawns two
    processes that each import vLLM again, ~20 s of every engine's start. The plugin's code is
    the same either way; the multiprocess layout users run is what every `vllm serve` test (the
    shell examples, the wheel's soak), the engine-loop module and the tensor-parallel test start."""
    if request.node.get_closest_marker("engine_in_process") is None:
        yield
        return
    import torch

    key, before, threads = "VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get(
        "VLLM_ENABLE_V1_MULTIPROCESSING"), torch.get_num_threads()
    os.environ[key] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
        import vllm.envs

        vllm.envs.disable_envs_cache()  # the engine core froze every vLLM variable as it started
        torch.set_num_threads(threads)  # vLLM's CPU worker set this process's count for serving


def pytest_configure(config):
    # vLLM workers are spawned processes; keep their logs quiet and their thread counts sane.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
