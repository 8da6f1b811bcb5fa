"""drafter/prompt_lookup.py and the hybrid rule as serving applies it (session.cut_drafts)."""

import dataclasses
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from test_serving_hooks import bare_session, make_view
from vllm_onlinespec.bench.arm_catalog import make_arm
from vllm_onlinespec.config import ConfigError, OnlineSpecConfig
from vllm_onlinespec.drafter.prompt_lookup import RecentText, choose_drafts, propose
from vllm_onlinespec.serving.lookup import LookupStage


def reference_propose(t, k, min_n=2, max_n=4):
    """vLLM's rule written plainly: longest suffix n-gram first, earliest earlier occurrence."""
    t = list(t)
    for n in range(min(max_n, len(t) - 1), min_n - 1, -1):
        suffix = t[len(t) - n:]
        for j in range(len(t) - n):
            if t[j:j + n] == suffix:
                return t[j + n:j + n + k]
    return []


def test_propose_longest_then_earliest_match():
    # suffix [1, 2, 3] recurs at 0 (and [2, 3] at 4): the 3-gram wins, its next tokens follow
    assert propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], k=2) == [9, 2]
    # only the 2-gram [5, 6] recurs, first at 0 then at 3: the earliest occurrence
    assert propose([5, 6, 1, 5, 6, 2, 8, 5, 6], k=3) == [1, 5, 6]
    assert propose([1, 2, 3, 4], k=4) == []  # nothing recurs
    assert propose([4, 4], k=4) == []  # shorter than a suffix plus an earlier copy
    assert propose([7, 8, 9, 7, 8], k=4) == [9, 7, 8]  # up to the context's end
    assert propose([7, 8, 9, 7, 8], k=0) == []
    assert propose([], k=4) == [] and propose([3], k=4) == []
    # a 1-gram counts only when min_n allows it
    assert propose([3, 5, 3], k=2) == [] and propose([3, 5, 3], k=2, min_n=1) == [5, 3]


def test_propose_equals_the_plain_rule_on_random_text():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(0, 60)
        t = [rng.randint(0, 5) for _ in range(n)]  # a small vocabulary: many matches
        k, lo = rng.randint(0, 6), rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        want = reference_propose(t, k, lo, hi)
        assert propose(t, k, lo, hi) == want
        assert propose(np.array(t, dtype=np.int32), k, lo, hi) == want  # the runner's array


def test_choose_drafts_takes_lookup_only_where_it_fills_the_step():
    drafter = [[1, 1, 1, 1], [2, 2, 2, 2], [3], []]
    lookup = [[9, 9, 9, 9, 9], [8, 8], [7, 7, 7, 7], [6, 6, 6, 6]]
    caps = [4, 4, 4, 0]  # row 2: the drafter's block was cut to 1, the step allowed 4; row 3: k = 0
    c = choose_drafts(drafter, lookup, caps, min_tokens=None)
    assert c.drafts == [[9, 9, 9, 9], [2, 2, 2, 2], [7, 7, 7, 7], []]
    assert c.from_lookup == [True, False, True, False] and c.lookup_rows == 2
    c = choose_drafts(drafter, lookup, caps, min_tokens=2)  # a short proposal may count
    assert c.drafts[1] == [8, 8] and c.from_lookup == [True, True, True, False]


def reference_recent(texts, history, k, min_n, max_n):
    """RecentText's rule written plainly: every (text, position) where the history's last
    min_n tokens end; the longest backward match (<= max_n) wins, then the latest."""
    best, best_key = [], (0, -1)
    order = 0
    for t in texts:
        for e in range(min_n - 1, len(t)):
            m = 0
            while m < min(max_n, len(history)) and e - m >= 0 and t[e - m] == history[-1 - m]:
                m += 1
            if m >= min_n and (m, order) > best_key:
                best_key, best = (m, order), list(t[e + 1:e + 1 + k])
            order += 1
    return best


def test_recent_text_takes_the_longest_then_latest_match_within_one_text():
    r = RecentText(max_tokens=100, min_n=2, max_n=4)
    assert r.propose([1, 2], k=4) == []  # nothing served yet
    r.add([1, 2, 3, 4, 5, 6])
    r.add([9, 2, 3, 7, 8])  # [2, 3] again, later, but only a 2-token match for [... 1, 2, 3]
    assert r.propose([0, 1, 2, 3], k=3) == [4, 5, 6]  # the 3-token match beats the later 2-token
    assert r.propose([5, 2, 3], k=3) == [7, 8]  # tie at 2 tokens: the latest; stops at its end
    assert r.propose([6, 7], k=3) == []  # no 2-gram [6, 7] was served
    assert r.propose([2, 3], k=0) == [] and r.propose([3], k=2) == []  # k 0; shorter than min_n
    r.add([4])  # shorter than min_n + 1: nothing to learn from
    assert r.tokens == 11


def test_recent_text_keeps_the_newest_texts_within_its_token_budget():
    r = RecentText(max_tokens=8, min_n=2, max_n=4)
    r.add([1, 2, 3, 4, 5])
    r.add([6, 7, 8])
    assert r.propose([1, 2], k=2) == [3, 4] and r.tokens == 8
    r.add([1, 2, 9])  # the oldest text goes
    assert r.tokens == 6 and r.propose([1, 2], k=2) == [9]
    with pytest.raises(ValueError, match="min_n <= max_n"):
        RecentText(max_tokens=8, min_n=3, max_n=2)


def test_recent_text_equals_the_plain_rule_on_random_text():
    rng = random.Random(1)
    for _ in range(200):
        lo = rng.randint(1, 3)
        hi = lo + rng.randint(0, 4)
        texts = [[rng.randint(0, 4) for _ in range(rng.randint(lo + 1, 30))]
                 for _ in range(rng.randint(1, 4))]
        r = RecentText(max_tokens=10**6, min_n=lo, max_n=hi, max_candidates=10**6)
        for t in texts:
            r.add(t)
        h = [rng.randint(0, 4) for _ in range(rng.randint(0, 12))]
        k = rng.randint(0, 5)
        assert r.propose(np.array(h, dtype=np.int32), k) == reference_recent(texts, h, k, lo, hi)


class FakeInputBatch:
    def __init__(self, histories):
        width = max(len(h) for h in histories.values()) + 8
        self.req_id_to_index = {r: i for i, r in enumerate(histories)}
        self.req_ids = list(histories)
        self.token_ids_cpu = np.zeros((len(histories), width), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(len(histories), dtype=np.int32)
        for i, h in enumerate(histories.values()):
            self.token_ids_cpu[i, :len(h)] = h
            self.num_tokens_no_spec[i] = len(h)


class CuttingCutter:
    """The verify-length policy's side of the session: cuts to `keep`, records what it saw."""

    policy_name = "fixed"
    next_option = None  # no budget: no choice among plain / tree / drafter

    def __init__(self, keep):
        self.keep, self.observed = keep, []

    def cut(self, drafts, req_ids=None):
        return [d[:self.keep] for d in drafts]

    def step_price(self, batch_size):
        return None  # not the budget: lookup drafts verified whole

    def observe(self, drafted, accepted, req_ids=None):
        self.observed.append(list(drafted))

    def forget(self, req_ids):
        pass

    def refresh(self, snapshot, version):
        pass


def lookup_session(histories, keep=4, min_tokens=None, plain=False, K=4, drafter_k=4, **over):
    cfg = OnlineSpecConfig.from_any({"prompt_lookup": {"enabled": True, "min_tokens": min_tokens,
                                                       **over},
                                     "features": {"plain": plain}})
    return bare_session(runner=SimpleNamespace(input_batch=FakeInputBatch(histories)), K=K,
                        drafter_k=drafter_k, cfg=cfg,
                        lookup=LookupStage(cfg.prompt_lookup, K, drafter_k),
                        cutter=CuttingCutter(keep))


@dataclasses.dataclass
class SchedOut:
    num_spec_tokens_to_schedule: int = 4


def test_gate_skips_the_drafter_where_lookup_drafts_every_request():
    # Committed "5 6 7 8 9 10 5", sampled this step "6": the text now ends "5 6", seen before
    # followed by 7 8 9 10. vLLM drafts before it books the sampled token, so the gate reads it
    # from the step's sampled ids (-1: rejected).
    hist = {"a": [5, 6, 7, 8, 9, 10, 5], "b": [1, 2, 3, 4, 9, 1, 2]}
    s = lookup_session(hist)
    gated = s.gate_drafting(SchedOut(), [[6, -1, -1, -1, -1], [3, -1, -1, -1, -1]])
    assert gated is not None and gated[1] == 0 and gated[0].num_spec_tokens_to_schedule == 0
    assert s.lookup.skipped_steps == 1
    # After the step's bookkeeping the drafts are the lookup's (prepared at the gate), whatever
    # vLLM's drafter (asked for 0) returned.
    s.runner.input_batch = FakeInputBatch({"a": hist["a"] + [6], "b": hist["b"] + [3]})
    out = s.cut_drafts(SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[], []]))
    assert out.draft_token_ids == [[7, 8, 9, 10], [4, 9, 1, 2]]
    # One request without a full proposal: the drafter runs (vLLM's K, left alone).
    s = lookup_session(hist)
    assert s.gate_drafting(SchedOut(), [[6, -1, -1, -1, -1], [7, -1, -1, -1, -1]]) is None
    assert s.lookup.skipped_steps == 0
    # Without the step's sampled tokens nothing is prepared and nothing is skipped; off by config.
    assert lookup_session(hist).gate_drafting(SchedOut(), None) is None
    s = lookup_session(hist, skip_drafter=False)
    assert s.gate_drafting(SchedOut(), [[6, -1, -1, -1, -1], [3, -1, -1, -1, -1]]) is None


def test_drafter_drafts_its_own_block_and_lookup_fills_vllms_k():
    # vLLM's K = 8, the drafter's block 4: the drafter is asked for 4, a lookup match verifies 8.
    s = lookup_session({"a": list(range(10, 20)) + [10, 11], "b": [1, 2, 3]}, K=8, drafter_k=4)
    gated = s.gate_drafting(SchedOut(8), [[12, -1], [4, -1]])
    assert gated[1] == 4 and gated[0].num_spec_tokens_to_schedule == 4
    s.runner.input_batch = FakeInputBatch({"a": list(range(10, 20)) + [10, 11, 12],
                                           "b": [1, 2, 3, 4]})
    out = s.cut_drafts(SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[0] * 4, [7] * 4]))
    assert out.draft_token_ids == [list(range(13, 20)) + [10], [7] * 4]
    # An ngram proposal is taken once it fills the drafter's 4, not vLLM's 8.
    s = lookup_session({"a": [5, 6, 7, 8, 9, 10, 5, 6]}, K=8, drafter_k=4)
    out = s.cut_drafts(SimpleNamespace(req_ids=["a"], draft_token_ids=[[0] * 4]))
    assert out.draft_token_ids == [[7, 8, 9, 10, 5, 6]]


def test_drafter_tokens_follow_the_block_and_the_config(tmp_path):
    from vllm_onlinespec.config import ConfigError
    from vllm_onlinespec.serving.validate import drafter_tokens

    from vllm_onlinespec.models import shipped_drafter

    conf = json.loads((shipped_drafter("smollm2-135m") / "config.json").read_text())
    conf["block_size"] = 5
    conf.get("dflash_config", {}).pop("block_size", None)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    cfg = OnlineSpecConfig()
    assert drafter_tokens(cfg, str(tmp_path), 16) == 4  # its block, 5 - 1
    assert drafter_tokens(cfg, str(tmp_path), 3) == 3  # at most vLLM's K
    assert drafter_tokens(cfg, str(tmp_path / "missing"), 7) == 7  # no config of ours: K
    assert drafter_tokens(OnlineSpecConfig.from_any({"drafter_tokens": 2}), str(tmp_path), 16) == 2
    with pytest.raises(ConfigError, match="drafter_tokens"):
        OnlineSpecConfig.from_any({"drafter_tokens": 0})


def test_session_verifies_lookup_where_the_text_repeats_and_keeps_it_from_the_policy():
    # "a" ends with [5, 6], seen before followed by 7 8 9 10; "b" has no repeat.
    s = lookup_session({"a": [5, 6, 7, 8, 9, 10, 5, 6], "b": [1, 2, 3, 4]}, keep=1)
    drafts = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[0, 0, 0, 0], [4, 4, 4, 4]])
    out = s.cut_drafts(drafts).draft_token_ids
    assert out == [[7, 8, 9, 10], [4]]  # a: lookup's full block; b: the drafter's cut block
    # The next step verifies them: a accepts 3 of its 4, b 1 of 1.
    view = make_view(num_draft=(4, 1), sched=(5, 2))
    s.after_step(None, view, [[7, 8, 9, 11, -1], [4, 2, -1, -1, -1]])
    assert s.cutter.observed == [[0, 1]]  # the policy scores the drafter's block only
    assert (s.lookup.rows, s.lookup.drafted, s.lookup.accepted) == (1, 4, 3)
    s.after_step(None, view, [[7, -1, -1, -1, -1], [4, -1, -1, -1, -1]])
    assert s.cutter.observed[-1] == [4, 1] and s.lookup.rows == 1  # nothing pending any more


def test_session_lookup_fills_k_whatever_the_drafter_was_asked_for():
    s = lookup_session({"a": [5, 6, 7, 8, 9, 10, 5, 6]})
    # The budget's gate asked vLLM's drafter for k = 2, or none: a lookup match still verifies K.
    for drafted in ([0, 0], []):
        out = s.cut_drafts(SimpleNamespace(req_ids=["a"], draft_token_ids=[drafted]))
        assert out.draft_token_ids == [[7, 8, 9, 10]]
    # Shorter than K (the match runs into the end of the text): the drafter's block stays.
    s = lookup_session({"a": [5, 6, 7, 5, 6]})  # lookup: [7, 5, 6]
    out = s.cut_drafts(SimpleNamespace(req_ids=["a"], draft_token_ids=[[1, 1, 1, 1]]))
    assert out.draft_token_ids == [[1, 1, 1, 1]] and not s.lookup.pending
    # A data-generation engine never speculates.
    s = lookup_session({"a": [5, 6, 7, 8, 9, 10, 5, 6]}, plain=True)
    assert s.cut_drafts(SimpleNamespace(req_ids=["a"], draft_token_ids=[[]])).draft_token_ids == [[]]


def test_session_lookup_falls_back_to_finished_requests_text():
    # "b" has no repeat of its own, but its last 3 tokens ended "a"'s [.., 7, 8, 9] before 3 1 4 1.
    s = lookup_session({"a": [7, 8, 9, 3, 1, 4, 1, 5], "b": [2, 7, 8, 9]})
    s.lookup.recent = RecentText(64, min_n=3, max_n=8)
    drafts = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[0] * 4, [6] * 4])
    assert s.cut_drafts(drafts).draft_token_ids == [[0] * 4, [6] * 4]  # nothing finished yet
    view = make_view(num_draft=(4, 4), sched=(5, 5))
    view.finished_req_ids = {"a"}
    s.after_step(None, view, [[0, -1, -1, -1, -1], [6, -1, -1, -1, -1]])
    assert s.lookup.recent.tokens == 8 and "a" not in s.lookup.texts  # a's text joined the pool
    drafts = SimpleNamespace(req_ids=["b"], draft_token_ids=[[6] * 4])
    assert s.cut_drafts(drafts).draft_token_ids == [[3, 1, 4, 1]]
    assert s.lookup.pending == {"b"} and s.lookup.recent_rows == 1
    # A seeded request drafts from its own text only (its sample must reproduce).
    s.runner.input_batch.generators = {s.runner.input_batch.req_id_to_index["b"]: object()}
    drafts = SimpleNamespace(req_ids=["b"], draft_token_ids=[[6] * 4])
    assert s.cut_drafts(drafts).draft_token_ids == [[6] * 4] and s.lookup.recent_rows == 1


def test_lookup_arms_and_config(tmp_path):
    kw = dict(target="t", prompts="p", out_dir=tmp_path, drafter="d", num_speculative_tokens=4)
    frozen = make_arm("frozen+lookup", **kw).onlinespec
    assert frozen["enabled"] is False
    assert frozen["prompt_lookup"] == {"enabled": True, "source": "ngram"}
    ogd = make_arm("online-ogd+lookup", **kw).onlinespec
    assert ogd["update"]["algorithm"] == "ogd"
    assert ogd["prompt_lookup"] == {"enabled": True, "source": "ngram"}
    assert "prompt_lookup" not in make_arm("online-ogd", **kw).onlinespec
    for cfg in (frozen, ogd):  # what the worker will validate
        assert OnlineSpecConfig.from_any(cfg).prompt_lookup.enabled
    with pytest.raises(ValueError, match=r"\+lookup goes with this project's DFlash arms"):
        make_arm("nospec+lookup", **kw)
    with pytest.raises(ValueError, match=r"\+lookup goes with this project's DFlash arms"):
        make_arm("ngram+lookup", **kw)
    with pytest.raises(ConfigError, match=r"onlinespec.prompt_lookup: max_n \(2\) must be >= min_n \(3\)"):
        OnlineSpecConfig.from_any({"prompt_lookup": {"min_n": 3, "max_n": 2}})
    assert OnlineSpecConfig.from_any(None).prompt_lookup.enabled is False


def test_lookup_refuses_probabilistic_drafts():
    from vllm_onlinespec.serving.validate import config_from_vllm

    def vllm_config(method):
        spec = SimpleNamespace(method="dflash", num_speculative_tokens=4,
                               draft_sample_method=method)
        return SimpleNamespace(speculative_config=spec,
                               additional_config={"onlinespec": {"prompt_lookup": {"enabled": True}}})

    assert config_from_vllm(vllm_config("greedy")).prompt_lookup.enabled
    with pytest.raises(ConfigError, match="prompt_lookup: needs draft_sample_method 'greedy'"):
        config_from_vllm(vllm_config("probabilistic"))


def test_demo_serves_frozen_and_online_with_the_same_recipe(tmp_path):
    from vllm_onlinespec.bench.demo import PLANS, demo_arms
    from vllm_onlinespec.models import shipped_drafter

    drafter = str(shipped_drafter("smollm2-135m"))
    _, specs = demo_arms(PLANS["quick"], "t", tmp_path / "s.jsonl", tmp_path, drafter)
    by = {s.name: s.onlinespec for s in specs}
    assert by["nospec"] is None
    k = {s.name: s.num_speculative_tokens for s in specs}
    for name in ("frozen", "online-ogd"):
        cfg = OnlineSpecConfig.from_any(by[name])
        assert cfg.prompt_lookup.enabled and cfg.length_head.policy == "budget"
        assert cfg.length_head.k_min == 0
        # the recommended hybrid: the suffix tree drafts up to 16, the drafter its own 4
        assert cfg.prompt_lookup.source == "suffix_tree" and k[name] == 16
    assert OnlineSpecConfig.from_any(by["frozen"]).enabled is False
    with pytest.raises(ConfigError, match=r"recent_max_n \(2\) must be >= recent_min_n \(3\)"):
        OnlineSpecConfig.from_any({"prompt_lookup": {"recent_min_n": 3, "recent_max_n": 2}})
    assert OnlineSpecConfig.from_any({}).prompt_lookup.recent_tokens == 4096  # on with lookup


# -- the suffix-tree source ---------------------------------------------------------------------

def tree_session(histories, **over):
    cfg = OnlineSpecConfig.from_any({"prompt_lookup": {"enabled": True, "source": "suffix_tree",
                                                       **over}})
    return bare_session(runner=SimpleNamespace(input_batch=FakeInputBatch(histories)), K=4,
                        cfg=cfg, lookup=LookupStage(cfg.prompt_lookup, 4),
                        cutter=CuttingCutter(4))


def test_suffix_tree_drafts_a_repeated_prompt_and_learns_across_requests():
    from vllm_onlinespec.drafter.suffix_tree import SuffixTreeLookup

    # A request that repeats its prompt: the tree proposes the repeated text (as many tokens
    # as the match is long, max_spec_factor 1).
    t = SuffixTreeLookup()
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    d = t.propose("r", prompt + [11, 12, 13], 4)
    assert d.tokens == [14, 15, 16] and d.score > 1
    # Fed incrementally: the next call appends what the request gained.
    assert t.propose("r", prompt + [11, 12, 13, 14, 15], 4).tokens == [16, 17, 18, 11]
    t.finish(["r"])
    assert t.active == 0
    # A finished request's output (what it wrote after its prompt) helps a later request.
    t.propose("a", [7, 8], 4)
    t.propose("a", [7, 8, 9, 3, 1, 4, 1, 5], 4)
    t.finish(["a"])
    assert t.propose("b", [2, 9, 3, 1], 4).tokens == [4, 1, 5]
    assert t.propose("c", [2, 9, 3, 1], 0).tokens == []


def test_session_takes_the_tree_where_its_score_clears_the_threshold():
    # "a" repeats its prompt (the tree is confident), "b" has nothing to match.
    s = tree_session({"a": [5, 6, 7, 8, 9, 10, 5, 6, 7], "b": [1, 2, 3, 4]})
    drafts = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[0, 0, 0, 0], [4, 4, 4, 4]])
    assert s.cut_drafts(drafts).draft_token_ids == [[8, 9, 10], [4, 4, 4, 4]]
    assert s.lookup.pending == {"a"}
    view = make_view(num_draft=(3, 4), sched=(4, 5))
    s.after_step(None, view, [[8, 9, 10, 5, -1], [4, -1, -1, -1, -1]])
    assert (s.lookup.rows, s.lookup.drafted, s.lookup.accepted) == (1, 3, 3)
    # Above any score it can reach, the drafter's blocks stay.
    s = tree_session({"a": [5, 6, 7, 8, 9, 10, 5, 6, 7]}, suffix_min_score=9.0)
    drafts = SimpleNamespace(req_ids=["a"], draft_token_ids=[[0, 0, 0, 0]])
    assert s.cut_drafts(drafts).draft_token_ids == [[0, 0, 0, 0]] and not s.lookup.pending


def test_a_tree_draft_below_the_threshold_fills_a_request_the_drafter_left_empty():
    """suffix_min_score chooses between the tree and the drafter: where the drafter drafted
    nothing for a request (a K = 0 step the budget gave to the tree, or a block cut to
    nothing) any tree draft is verified, as vLLM's suffix decoding verifies it; where the
    drafter has a block, the threshold still decides."""
    hist = {"a": [5, 6, 7, 8, 9, 10, 5, 6, 7], "b": [5, 6, 7, 8, 9, 10, 5, 6, 7]}
    s = tree_session(hist, suffix_min_score=9.0)
    drafts = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[], [0, 0, 0, 0]])
    assert s.cut_drafts(drafts).draft_token_ids == [[8, 9, 10], [0, 0, 0, 0]]
    assert s.lookup.pending == {"a"} and s.lookup.weak_rows == 1
    # It is a lookup row like a confident one: counted and calibrated as the tree's.
    view = make_view(num_draft=(3, 4), sched=(4, 5))
    s.after_step(None, view, [[8, 9, -1, -1], [0, -1, -1, -1, -1]])
    assert (s.lookup.rows, s.lookup.drafted, s.lookup.accepted) == (1, 3, 1)
    assert s.lookup.calibration.expected > 1.0


def test_suffix_tree_keeps_seeded_requests_on_their_own_text():
    s = tree_session({"a": [7, 8], "b": [2, 9, 3, 1]})
    s.cut_drafts(SimpleNamespace(req_ids=["a"], draft_token_ids=[[0] * 4]))
    # "a" writes its answer, then finishes.
    s.runner.input_batch = FakeInputBatch({"a": [7, 8, 9, 3, 1, 4, 1, 5], "b": [2, 9, 3, 1]})
    s.cut_drafts(SimpleNamespace(req_ids=["a"], draft_token_ids=[[0] * 4]))
    view = make_view(num_draft=(4, 4), sched=(5, 5))
    view.finished_req_ids = {"a"}
    s.after_step(None, view, [[0, -1, -1, -1, -1], [6, -1, -1, -1, -1]])
    unseeded = s.cut_drafts(SimpleNamespace(req_ids=["b"], draft_token_ids=[[6] * 4]))
    assert unseeded.draft_token_ids == [[4, 1, 5]]  # from a's finished answer
    s.runner.input_batch.generators = {s.runner.input_batch.req_id_to_index["b"]: object()}
    seeded = s.cut_drafts(SimpleNamespace(req_ids=["b"], draft_token_ids=[[6] * 4]))
    assert seeded.draft_token_ids == [[6] * 4]  # own text only: no match, the drafter's


def test_suffix_tree_without_the_extension_is_one_line(monkeypatch):
    import builtins

    from vllm_onlinespec.serving.validate import config_from_vllm

    real = builtins.__import__

    def no_arctic(name, *a, **k):
        if name.startswith("arctic_inference"):
            raise ImportError("no module")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_arctic)
    spec = SimpleNamespace(method="dflash", num_speculative_tokens=4, draft_sample_method="greedy")
    vc = SimpleNamespace(speculative_config=spec, additional_config={"onlinespec": {
        "prompt_lookup": {"enabled": True, "source": "suffix_tree"}}})
    with pytest.raises(ConfigError, match="suffix_install") as e:
        config_from_vllm(vc)
    assert "\n" not in str(e.value)
