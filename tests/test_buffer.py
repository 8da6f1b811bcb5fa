import random
import threading

import pytest
import torch

from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.learner.buffer import FeedbackBuffer, FeedbackRecord

F, H = 6, 4


def rec(req, start, n, num_draft=3, num_accepted=1, version=0):
    """Tokens encode their position so windows can be checked for contiguity."""
    pos = torch.arange(start, start + n)
    return FeedbackRecord(
        req_id=req, token_ids=pos.clone(), start_pos=start,
        aux=pos.float()[:, None].repeat(1, F), target_hidden=-pos.float()[:, None].repeat(1, H),
        num_draft=num_draft, num_accepted=min(num_accepted, num_draft), drafter_version=version)


def check_window(w):
    T = w.token_ids.shape[0]
    assert torch.equal(w.token_ids, w.positions)  # contiguous, in order
    assert torch.equal(w.aux[:, 0], w.positions.float())
    assert torch.equal(w.target_hidden[:, 0], -w.positions.float())
    assert 0 <= w.fresh_from <= w.fresh_to <= T


def test_record_validates_shapes():
    with pytest.raises(ValueError):
        FeedbackRecord("a", torch.arange(3), 0, torch.zeros(2, F))
    with pytest.raises(ValueError):
        FeedbackRecord("a", torch.arange(3), 0, torch.zeros(3, F), num_draft=2, num_accepted=3)


def test_window_and_fresh_tokens():
    b = FeedbackBuffer(window_tokens=16, max_tokens=64, max_requests=4, max_records=100)
    b.push(rec("a", 0, 10))  # prompt
    b.push(rec("a", 10, 3))
    assert b.fresh_tokens == 13
    (w,) = b.sample_training_windows(4)
    check_window(w)
    assert (w.fresh_from, w.fresh_to, w.token_ids.shape[0]) == (0, 13, 13)
    assert b.fresh_tokens == 0 and b.sample_training_windows(4) == []
    b.push(rec("a", 13, 4))
    b.push(rec("a", 17, 2))
    (w,) = b.sample_training_windows(4)
    check_window(w)
    # window = last 16 tokens ending at 19; fresh = positions 13..18
    assert w.start_pos == 3 and w.token_ids.shape[0] == 16
    assert w.token_ids[w.fresh_from].item() == 13 and w.fresh_to == 16
    assert [r.start_pos for r in w.records] == [13, 17]


def test_holdback_keeps_newest_fresh_until_finish():
    b = FeedbackBuffer(window_tokens=32, max_tokens=64)
    b.push(rec("a", 0, 10))
    assert b.fresh_count(holdback=4) == 6
    (w,) = b.sample_training_windows(1, holdback=4)
    assert (w.fresh_from, w.fresh_to, w.token_ids.shape[0]) == (0, 6, 10)
    assert b.fresh_tokens == 4 and b.fresh_count(holdback=4) == 0
    assert b.sample_training_windows(1, holdback=4) == []
    b.finish("a")  # finished: held-back tokens become trainable, then the request is released
    assert "a" in b
    (w,) = b.sample_training_windows(1, holdback=4)
    assert (w.fresh_from, w.fresh_to) == (6, 10) and w.finished
    assert "a" not in b and b.size == 0 and b.num_records == 0


def test_finish_releases_and_counts_drops():
    b = FeedbackBuffer(window_tokens=16, max_tokens=64)
    b.push(rec("a", 0, 5))
    b.sample_training_windows(1)
    b.finish("a")  # nothing fresh: released now
    assert "a" not in b and b.size == 0 and b.drops == 0
    b.push(rec("b", 0, 7))
    b.finish("b", keep_fresh=False)
    assert "b" not in b and b.drops == 7 and b.size == 0 and b.num_requests == 0


def test_window_slide_drops_untrained_tokens():
    b = FeedbackBuffer(window_tokens=8, max_tokens=64)
    for s in range(0, 20, 2):
        b.push(rec("a", s, 2))
    assert b.size == 8 and b.drops == 12
    (w,) = b.sample_training_windows(1)
    check_window(w)
    assert w.start_pos == 12 and w.fresh_from == 0 and w.num_fresh == 8


def test_oversized_record_is_clipped():
    b = FeedbackBuffer(window_tokens=8, max_tokens=64)
    b.push(rec("a", 0, 30))
    assert b.size == 8
    (w,) = b.sample_training_windows(1)
    check_window(w)
    assert w.start_pos == 22


def test_gap_and_rollback():
    b = FeedbackBuffer(window_tokens=32, max_tokens=64)
    b.push(rec("a", 0, 10))
    b.push(rec("a", 5, 3))  # rollback (e.g. preemption recompute): cut to before 5
    assert b.size == 8 and b.gaps == 1
    (w,) = b.sample_training_windows(1)
    check_window(w)
    assert w.token_ids.tolist() == list(range(8))
    b.push(rec("a", 20, 2))  # jump ahead: the context in between is unknown, start over
    (w,) = b.sample_training_windows(1)
    check_window(w)
    assert w.start_pos == 20 and b.gaps == 2


def test_eviction_prefers_finished_then_lru():
    b = FeedbackBuffer(window_tokens=8, max_tokens=1000, max_requests=3)
    b.push(rec("a", 0, 4))
    b.push(rec("b", 0, 4))
    b.push(rec("c", 0, 4))
    b.push(rec("b", 4, 1))
    b.finish("b")  # still fresh: kept, but first in line for eviction though not the LRU
    b.push(rec("a", 4, 1))  # LRU order now: c, b, a
    b.push(rec("d", 0, 4))
    assert [r for r in "abcd" if r in b] == ["a", "c", "d"]
    b.push(rec("e", 0, 4))  # no finished request left: least recently updated (c) goes
    assert [r for r in "acde" if r in b] == ["a", "d", "e"]
    assert b.evictions == 2 and b.drops == 5 + 4


def test_fifo_fairness():
    b = FeedbackBuffer(window_tokens=8, max_tokens=1000)
    for r in "abc":
        b.push(rec(r, 0, 2))
    assert [w.req_id for w in b.sample_training_windows(2)] == ["a", "b"]
    b.push(rec("a", 2, 2))
    assert [w.req_id for w in b.sample_training_windows(2)] == ["c", "a"]


def test_acceptance_stats():
    b = FeedbackBuffer()
    b.push(rec("a", 0, 3, num_draft=4, num_accepted=2, version=0))
    b.push(rec("a", 3, 2, num_draft=4, num_accepted=1, version=1))
    b.push(rec("b", 0, 1, num_draft=4, num_accepted=0, version=1))
    assert b.acceptance("a") == (8, 3) and b.acceptance("b") == (4, 0)
    assert b.acceptance_by_version() == {0: (4, 2), 1: (8, 1)}
    assert b.stats()["acceptance"] == pytest.approx(3 / 12)


def test_bound_holds_under_long_random_stream():
    cfg = OnlineSpecConfig.from_any({"buffer": {"window_tokens": 24, "max_tokens": 100,
                                                "max_requests": 6, "max_records": 40}})
    b = FeedbackBuffer.from_config(cfg)
    rng = random.Random(0)
    nxt: dict[str, int] = {}
    gen = [0] * 12  # vLLM never reuses a request id: a finished slot gets a new one
    trained = 0
    for step in range(4000):
        slot = rng.randrange(12)
        rid = f"r{slot}.{gen[slot]}"
        n = rng.choice([1, 1, 2, 3, 5]) if rid in nxt else rng.randrange(1, 40)
        b.push(rec(rid, nxt.get(rid, 0), n))
        nxt[rid] = nxt.get(rid, 0) + n
        if rng.random() < 0.03:
            b.finish(rid)
            nxt.pop(rid)
            gen[slot] += 1
        if rng.random() < 0.2:
            for w in b.sample_training_windows(rng.randrange(1, 4), holdback=rng.randrange(3)):
                check_window(w)
                assert w.token_ids.shape[0] <= 24 and w.num_fresh >= 1
                trained += w.num_fresh
        assert b.size <= 100 and b.num_records <= 40 and b.num_requests <= 6
        s = b.stats()
        assert s["size"] == b.size
    # every token that came in was trained, dropped, or is still fresh: none lost, none twice
    assert b.drops > 0 and b.evictions > 0 and trained > 0
    assert b.tokens_in == trained + b.drops + b.fresh_tokens
    # internal token/record counters agree with what the requests actually hold
    with b._lock:
        assert b.size == sum(r.tokens for r in b._reqs.values())
        assert b.size == sum(x.num_tokens for r in b._reqs.values() for x in r.records)
        assert b.num_records == sum(len(r.records) for r in b._reqs.values())


def test_thread_safety_smoke():
    b = FeedbackBuffer(window_tokens=32, max_tokens=256, max_requests=8, max_records=128)
    stop = threading.Event()
    errors: list[BaseException] = []
    consumed = [0]

    def producer(k):
        try:
            rng = random.Random(k)
            pos = {}
            gen = [0] * 6
            for i in range(1500):
                slot = rng.randrange(6)
                rid = f"p{k}-{slot}.{gen[slot]}"
                n = rng.randrange(1, 5)
                b.push(rec(rid, pos.get(rid, 0), n))
                pos[rid] = pos.get(rid, 0) + n
                if rng.random() < 0.01:
                    b.finish(rid)
                    pos.pop(rid)
                    gen[slot] += 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def consumer():
        try:
            while not stop.is_set():
                for w in b.sample_training_windows(4):
                    check_window(w)
                    consumed[0] += w.num_fresh
                b.stats()
        except BaseException as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(2)]
    c = threading.Thread(target=consumer)
    c.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    c.join()
    assert not errors, errors
    assert b.records_in == 3000 and consumed[0] > 0
    assert b.tokens_in == consumed[0] + b.drops + b.fresh_tokens
    assert b.size <= 256 and b.num_records <= 128 and b.num_requests <= 8
    with b._lock:
        assert b.size == sum(x.num_tokens for r in b._reqs.values() for x in r.records)


def test_views_into_step_tensors_are_compacted():
    step = torch.randn(100, F)  # one step-wide tensor, records are row slices of it
    ids = torch.arange(100)
    b = FeedbackBuffer(window_tokens=16, max_tokens=64)
    b.push(FeedbackRecord("a", ids[:3], 0, step[:3], step[:3, :H]))
    with b._lock:
        (r,) = b._reqs["a"].records
    for t in (r.token_ids, r.aux, r.target_hidden):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert torch.equal(r.aux, step[:3])
