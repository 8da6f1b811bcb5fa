"""vLLM's suffix decoding backend, as `make setup` installs it (vllm_onlinespec/suffix_install.py):
arctic_inference.suffix_decoding imports, speculates a prompt's repeated text, drives vLLM 0.32's
own SuffixDecodingProposer, and comes without arctic's vLLM plugin. No engine starts. These fail
(not skip) when the extension is missing: run `python -m vllm_onlinespec.suffix_install`."""

from __future__ import annotations

import importlib.metadata as md
from types import SimpleNamespace

import numpy as np

from vllm_onlinespec import suffix_install

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 11, 12, 13]  # "11 12 13" recurs; next comes 14


def test_installed_by_our_installer_with_the_pinned_version():
    assert suffix_install.status() is None, suffix_install.status()
    import arctic_inference
    from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401

    assert md.version("arctic-inference") == suffix_install.VERSION == arctic_inference.__version__


def test_repeated_prompt_text_is_speculated():
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=16)
    cache.start_request("r", np.array(PROMPT, dtype=np.int32))
    cache.add_active_response("r", [14])
    assert "r" in cache.active_requests and "r" in cache.cached_requests
    # As vLLM does: the last <= max_tree_depth tokens of prompt + output as the pattern.
    draft = cache.speculate("r", np.array(PROMPT + [14], dtype=np.int32), max_spec_tokens=4,
                            max_spec_factor=1.0, min_token_prob=0.1)
    assert draft.token_ids == [15, 16, 17, 18]
    assert draft.match_len == 4
    # max_spec_factor caps the draft at factor * match length.
    short = cache.speculate("r", np.array(PROMPT + [14], dtype=np.int32), max_spec_tokens=4,
                            max_spec_factor=0.5, min_token_prob=0.1)
    assert short.token_ids == [15, 16]
    cache.stop_request("r")
    assert "r" not in cache.active_requests and "r" in cache.cached_requests


def test_finished_responses_feed_other_requests_until_evicted():
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=16)
    cache.start_request("r", [1, 2])
    cache.add_active_response("r", [30])
    cache.add_active_response("r", [31, 32, 33, 34, 35])
    cache.stop_request("r")
    ctx = np.array([7, 30, 31, 32], dtype=np.int32)
    cache.start_request("s", ctx)  # s's own prompt has nothing after "30 31 32": r's response has
    draft = cache.speculate("s", ctx, max_spec_tokens=4, max_spec_factor=2.0)
    assert draft.token_ids == [33, 34, 35]
    cache.evict_cached_response("r")
    assert "r" not in cache.cached_requests
    assert cache.speculate("s", ctx, max_spec_tokens=4, max_spec_factor=2.0).token_ids == []


def test_vllm_suffix_proposer_drafts_the_repetition():
    """vLLM 0.32's own proposer (v1/spec_decode/suffix_decoding.py) over a stand-in input batch."""
    from vllm.utils.import_utils import has_arctic_inference
    from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

    assert has_arctic_inference()
    spec = SimpleNamespace(num_speculative_tokens=4, suffix_decoding_max_tree_depth=24,
                           suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1,
                           suffix_decoding_max_cached_requests=16)
    proposer = SuffixDecodingProposer(SimpleNamespace(
        speculative_config=spec, model_config=SimpleNamespace(max_model_len=64)))
    tokens = np.zeros((2, 64), dtype=np.int32)  # vLLM's token_ids_cpu is int32
    tokens[0, :12] = PROMPT + [14]
    batch = SimpleNamespace(req_ids=["a"], req_id_to_index={"a": 0},
                            num_tokens_no_spec=np.array([12]), num_prompt_tokens=np.array([11]),
                            token_ids_cpu=tokens)
    assert proposer.propose(4, batch, [[14]]) == [[15, 16, 17, 18]]
    # A partial prefill (no sampled ids) gets no draft; a request gone from the batch is stopped.
    assert proposer.propose(4, batch, [[]]) == [[]]
    empty = SimpleNamespace(req_ids=[], req_id_to_index={}, num_tokens_no_spec=np.array([]),
                            num_prompt_tokens=np.array([]), token_ids_cpu=tokens)
    assert proposer.propose(4, empty, []) == []
    assert "a" not in proposer.suffix_cache.active_requests


def test_no_arctic_vllm_plugin_is_registered():
    plugins = [f"{ep.name} = {ep.value}" for ep in md.entry_points(group="vllm.general_plugins")]
    assert not [p for p in plugins if "arctic" in p.lower()], plugins
    assert suffix_install.arctic_plugins() == []
    dist = md.distribution("arctic-inference")
    assert not dist.entry_points, list(dist.entry_points)
    names = {str(f) for f in dist.files}
    assert not [n for n in names if n.startswith("arctic_inference/vllm")], sorted(names)
