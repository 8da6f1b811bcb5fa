import random
import threading

import pytest
import torch

from vllm_onlinespec.config import OnlineSpecConfig
from vllm_onlinespec.learner.buffer import FeedbackBuffer, FeedbackRecord

F, H = 6, 4


def rec(req, start, n, num_draft=3, num_accepted=1, version=0, prompt_len=None):
    """Tokens encode their position so windows can be checked for contiguity.

    By default a decode step (it drafted): a request whose first record is one has no prompt
    in the buffer, so its position 0 is the first generated token and positions 0 and 1 are
    context (1 can only be predicted from an anchor at 0, which has no context row)."""
    pos = torch.arange(start, start + n)
    return FeedbackRecord(
        req_id=req, token_ids=pos.clone(), start_pos=start,
        aux=pos.float()[:, None].repeat(1, F), target_hidden=-pos.float()[:, None].repeat(1, H),
        num_draft=num_draft, num_accepted=min(num_accepted, num_draft), drafter_version=version,
        prompt_len=prompt_len)


def prefill(req, start, n):
    """A prefill (chunk): nothing drafted, several tokens committed."""
    return rec(req, start, n, num_draft=0)


def accounted(b):
    """Every token that came in is context, trained, dropped or still fresh: exactly once."""
    return b.context_tokens + b.trained_tokens + b.drops + b.fresh_tokens


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
    b.push(prefill("a", 0, 10))  # prompt
    assert b.fresh_tokens == 0 and b.context_tokens == 10
    b.push(rec("a", 10, 3))  # first decode step: 10 is the first generated token
    # 10 was sampled by prefill, never drafted: only 11 and 12 are ever predicted by the drafter
    assert b.fresh_tokens == 2 and b.context_tokens == 11
    (w,) = b.sample_training_windows(4)
    check_window(w)
    assert (w.fresh_from, w.fresh_to, w.token_ids.shape[0]) == (11, 13, 13)
    assert w.response_from == 10
    assert b.fresh_tokens == 0 and b.sample_training_windows(4) == []
    assert b.trained_tokens == 2 and accounted(b) == b.tokens_in
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
    assert b.fresh_count(holdback=4) == 4  # 2..5: 0 and 1 are context, 6..9 held back
    (w,) = b.sample_training_windows(1, holdback=4)
    assert (w.fresh_from, w.fresh_to, w.token_ids.shape[0]) == (2, 6, 10)
    assert b.fresh_tokens == 4 and b.fresh_count(holdback=4) == 0
    assert b.sample_training_windows(1, holdback=4) == []
    b.finish("a")  # finished: held-back tokens become trainable, then the request is released
    assert "a" in b
    (w,) = b.sample_training_windows(1, holdback=4)
    assert (w.fresh_from, w.fresh_to) == (6, 10) and w.finished
    assert "a" not in b and b.size == 0 and b.num_records == 0
    assert accounted(b) == b.tokens_in


def test_finish_releases_and_counts_drops():
    b = FeedbackBuffer(window_tokens=16, max_tokens=64)
    b.push(rec("a", 0, 5))
    b.sample_training_windows(1)
    b.finish("a")  # nothing fresh: released now
    assert "a" not in b and b.size == 0 and b.drops == 0
    b.push(rec("b", 0, 7))
    b.finish("b", keep_fresh=False)
    assert "b" not in b and b.drops == 5 and b.size == 0 and b.num_requests == 0
    assert accounted(b) == b.tokens_in


def test_window_slide_drops_untrained_tokens():
    b = FeedbackBuffer(window_tokens=8, max_tokens=64)
    for s in range(0, 20, 2):
        b.push(rec("a", s, 2))
    # 0, 1 context; the window holds 12..19, whose first two rows cannot be predicted any
    # more (no row before them in the window): 2..13 were dropped untrained
    assert b.size == 8 and b.drops == 12 and b.context_tokens == 2
    (w,) = b.sample_training_windows(1)
    check_window(w)
    assert w.start_pos == 12 and w.fresh_from == 2 and w.num_fresh == 6
    assert accounted(b) == b.tokens_in


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
    b.push(rec("a", 20, 4))  # jump ahead: the context in between is unknown, start over
    (w,) = b.sample_training_windows(1)
    check_window(w)
    assert w.start_pos == 20 and b.gaps == 2
    # the rollback dropped 5..9 untrained; re-sent tokens are counted again on arrival
    assert b.drops == 5 and accounted(b) == b.tokens_in


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
    assert b.evictions == 2 and b.drops == 3 + 2  # b's 2..4, c's 2..3 (0, 1 are context)
    assert accounted(b) == b.tokens_in


def test_fifo_fairness():
    b = FeedbackBuffer(window_tokens=8, max_tokens=1000)
    for r in "abc":
        b.push(rec(r, 0, 4))
    assert [w.req_id for w in b.sample_training_windows(2)] == ["a", "b"]
    b.push(rec("a", 4, 2))
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
        if rid in nxt:
            n = rng.choice([1, 1, 2, 3, 5])
            b.push(rec(rid, nxt[rid], n))
        else:  # a prompt, told or inferred
            n = rng.randrange(1, 40)
            b.push(rec(rid, 0, n, num_draft=0, prompt_len=rng.choice([None, n])))
        nxt[rid] = nxt.get(rid, 0) + n
        if rng.random() < 0.03:
            b.finish(rid)
            nxt.pop(rid)
            gen[slot] += 1
        if rng.random() < 0.2:
            cap = rng.choice([None, 1, 4])
            for w in b.sample_training_windows(rng.randrange(1, 4), holdback=rng.randrange(3),
                                               max_fresh=cap):
                check_window(w)
                assert w.token_ids.shape[0] <= 24 and 1 <= w.num_fresh <= (cap or 24)
                # only generated tokens after the first one, each with a row before its anchor
                assert w.start_pos + w.fresh_from > w.response_from and w.fresh_from >= 2
                trained += w.num_fresh
        assert b.size <= 100 and b.num_records <= 40 and b.num_requests <= 6
        s = b.stats()
        assert s["size"] == b.size
    # every token that came in is context, trained, dropped, or still fresh: none lost or twice
    assert b.drops > 0 and b.evictions > 0 and trained > 0 and b.context_tokens > 0
    assert trained == b.trained_tokens and accounted(b) == b.tokens_in
    # internal token/record counters agree with what the requests actually hold
    with b._lock:
        assert b.size == sum(r.tokens for r in b._reqs.values())
        assert b.size == sum(x.num_tokens for r in b._reqs.values() for x in r.records)
        assert b.num_records == sum(len(r.records) for r in b._reqs.values())


PUSHES = 600  # per producer: enough evictions and finishes to race the consumer


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
            for i in range(PUSHES):
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
    assert b.records_in == 2 * PUSHES and consumed[0] > 0
    assert consumed[0] == b.trained_tokens and accounted(b) == b.tokens_in
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


# -- which tokens are trainable, and what "trained" means ------------------------------------------

@pytest.mark.parametrize("told", [True, False])
def test_prompt_tokens_are_context_never_fresh(told):
    """Chunked prefill (two chunks), then decoding. With prompt_len told or inferred, nothing
    up to the first generated token (12) is ever fresh: vLLM never drafts those."""
    b = FeedbackBuffer(window_tokens=64, max_tokens=256)
    p = 12 if told else None
    b.push(rec("a", 0, 8, num_draft=0, prompt_len=p))
    b.push(rec("a", 8, 4, num_draft=0, prompt_len=p))
    assert b.fresh_tokens == 0 and b.sample_training_windows(4) == []
    b.push(rec("a", 12, 3, prompt_len=p))  # 12 = first generated token, 13 and 14 drafted
    assert b.fresh_tokens == 2 and b.context_tokens == 13
    (w,) = b.sample_training_windows(4)
    assert w.response_from == 12 and w.start_pos + w.fresh_from == 13 and w.num_fresh == 2
    assert accounted(b) == b.tokens_in


def test_max_fresh_hands_out_oldest_and_keeps_the_rest():
    b = FeedbackBuffer(window_tokens=64, max_tokens=256)
    b.push(prefill("a", 0, 5))
    b.push(rec("a", 5, 11))  # fresh: 6..15
    (w,) = b.sample_training_windows(1, max_fresh=4)
    assert (w.start_pos + w.fresh_from, w.start_pos + w.fresh_to) == (6, 10)
    assert b.fresh_tokens == 6 and b.trained_tokens == 4
    b.finish("a")
    (w,) = b.sample_training_windows(1, max_fresh=4)
    assert (w.start_pos + w.fresh_from, w.start_pos + w.fresh_to) == (10, 14) and "a" in b
    (w,) = b.sample_training_windows(1, max_fresh=4)
    assert (w.start_pos + w.fresh_from, w.start_pos + w.fresh_to) == (14, 16) and "a" not in b
    assert accounted(b) == b.tokens_in and b.drops == 0


def block_labels_of(batch, K):
    """Absolute positions each batch row's blocks predict, with the window start per row."""
    out = []
    for row in range(batch.anchors.shape[0]):
        labels = set()
        for a in batch.anchors[row].tolist():
            if a >= 0:
                labels.update(range(a + 1, min(a + 1 + K, int(batch.lengths[row]))))
        out.append(labels)
    return out


@pytest.mark.parametrize("P", [20, 0])
def test_batch_anchors_only_on_generated_tokens_and_covers_what_it_marks(P):
    """Each update marks trained exactly the fresh tokens its blocks predict (at most
    anchors_per_request * K per request); the rest stay fresh for the next update."""
    from vllm_onlinespec.learner.batches import make_batch_fn

    K = 4
    b = FeedbackBuffer(window_tokens=256, max_tokens=1024)
    if P:
        b.push(prefill("a", 0, P))  # inferred prompt: nothing drafted, 20 tokens
    pos = P
    for n in (5, 3, 1, 5, 4, 5, 2, 5, 5, 3):  # decode steps (1 + accepted tokens each)
        b.push(rec("a", pos, n))
        pos += n
    make = make_batch_fn(batch_blocks=3, anchors_per_request=3, holdback=K)
    trained = set()
    rounds = 0
    while True:
        fresh_before = b.fresh_count(K)
        batch = make(b)
        if batch is None:
            break
        rounds += 1
        (labels,) = block_labels_of(batch, K)
        anchors = [a for a in batch.anchors[0].tolist() if a >= 0]
        assert all(a >= P for a in anchors), anchors  # window starts at 0 here
        newly = fresh_before - b.fresh_count(K)
        assert newly == batch.num_fresh <= 3 * K
        # the tokens marked trained are exactly the first `newly` fresh ones, all of them labels
        marked = set(range(min(labels), min(labels) + newly))
        assert marked <= labels and not marked & trained
        trained |= marked
    # P + 1 .. pos - K - 1 trainable now (the last K held back; without a prompt 0 and 1 are
    # context): 33 or 32 tokens, <= 12 per update
    assert rounds == 3
    assert trained == set(range(max(P + 1, 2), pos - K)) and b.trained_tokens == len(trained)
    assert b.fresh_count(K) == 0 and b.fresh_tokens == K


@pytest.mark.parametrize("stride", [1, 2])
def test_dense_anchors_label_every_fresh_token_at_every_position(stride):
    """anchor_stride < K: blocks overlap; every token marked trained is a label of this batch,
    and with stride 1 each one (but the first K - 1) sits at every draft position 1..K."""
    from vllm_onlinespec.learner.batches import make_batch_fn

    K, P = 4, 10
    b = FeedbackBuffer(window_tokens=256, max_tokens=1024)
    b.push(prefill("a", 0, P))
    pos = P
    for n in (5, 5, 5, 5, 5):
        b.push(rec("a", pos, n))
        pos += n
    make = make_batch_fn(batch_blocks=8, anchors_per_request=8, holdback=K, stride=stride)
    fresh_before = b.fresh_count(K)
    batch = make(b)
    anchors = [a for a in batch.anchors[0].tolist() if a >= 0]
    assert anchors == list(range(P, P + 8 * stride, stride))
    newly = fresh_before - b.fresh_count(K)
    assert newly == batch.num_fresh == 8 * stride  # the buffer hands out stride * anchors tokens
    (labels,) = block_labels_of(batch, K)
    assert set(range(P + 1, P + 1 + newly)) <= labels
    if stride == 1:  # token t is label k of the block anchored at t - k, for every k <= K
        for t in range(P + K, P + newly):
            assert all(t - k in anchors for k in range(1, K + 1))
    with pytest.raises(ValueError, match="stride"):
        make_batch_fn(batch_blocks=8, anchors_per_request=8, holdback=K, stride=K + 1)


def test_replay_fills_the_batch_from_trained_response_tokens_only():
    """replay: an update with few fresh blocks is filled up to batch_blocks with anchors on
    tokens trained before (never the prompt, never fresh ones: those stay the fresh blocks'),
    and the buffer marks only the fresh range trained. No fresh data, no batch."""
    from vllm_onlinespec.learner.batches import make_batch_fn

    K, P = 4, 10
    b = FeedbackBuffer(window_tokens=256, max_tokens=1024)
    b.push(prefill("a", 0, P))
    pos = P
    for n in (5,) * 8:
        b.push(rec("a", pos, n))
        pos += n
    plain = make_batch_fn(batch_blocks=16, anchors_per_request=16, holdback=K)
    first = plain(b)  # trains everything trainable so far (36 tokens, 9 blocks)
    assert first is not None and b.fresh_count(K) == 0
    trained_to = P + 1 + first.num_fresh
    b.push(rec("a", pos, 5))  # 5 fresh tokens: 2 blocks at stride K
    pos += 5
    replay = make_batch_fn(batch_blocks=16, anchors_per_request=16, holdback=K, replay=True)
    batch = replay(b)
    anchors = [a for a in batch.anchors[0].tolist() if a >= 0]
    fresh = [a for a in anchors if a >= trained_to - 1]
    old = [a for a in anchors if a < trained_to - 1]
    assert fresh == [trained_to - 1, trained_to - 1 + K] and batch.num_fresh == 5
    assert len(anchors) == 16 and len(set(old)) == 14
    assert all(P <= a for a in old)  # generated tokens only
    assert b.fresh_count(K) == 0 and b.trained_tokens == first.num_fresh + 5
    assert replay(b) is None  # nothing fresh: no replay-only update


def test_sequence_records_replay_a_whole_answer_as_serving_feedback():
    from vllm_onlinespec.learner.buffer import sequence_records

    n, start, k = 23, 7, 4
    pos = torch.arange(n)
    recs = sequence_records("a", pos, start, pos.float()[:, None].repeat(1, F),
                            -pos.float()[:, None].repeat(1, H), k)
    # The prompt as one prefill record, then steps of K + 1 (the last one shorter).
    assert [(r.start_pos, r.num_tokens, r.num_draft) for r in recs] == [
        (0, 7, 0), (7, 5, 4), (12, 5, 4), (17, 5, 4), (22, 1, 4)]
    assert torch.equal(torch.cat([r.token_ids for r in recs]), pos)
    b = FeedbackBuffer(window_tokens=64)
    for r in recs:
        b.push(r)
    b.finish("a")
    # Prompt and first generated token are context; the other answer tokens are trainable.
    assert b.context_tokens == start + 1 and b.fresh_tokens + b.context_tokens == n
    assert accounted(b) == n


def test_clear_drops_everything_and_a_running_request_starts_over():
    b = FeedbackBuffer(window_tokens=64, max_tokens=1024)
    b.push(rec("a", 0, 10))
    b.push(rec("b", 0, 6))
    assert b.clear() == b.drops > 0
    assert len(b) == 0 and b.size == 0 and b.fresh_tokens == 0
    b.push(rec("a", 10, 5))  # the next record of a request that was running
    assert "a" in b and b.size == 5
