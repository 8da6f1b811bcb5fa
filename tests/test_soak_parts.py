"""The soak's parts without a server: the traffic mix, its per-minute and summary figures, the
RSS reading, and the strict-request middleware on a fake ASGI app."""

import asyncio
import json
import os
import random

import pytest

from vllm_onlinespec.bench import soak as S
from vllm_onlinespec.serving.compat.strict_requests import StrictRequests, unknown_fields


def make_soak(**kw) -> S.Soak:
    return S.Soak(url="http://x", duration_s=kw.pop("duration_s", 180.0), long_prompt="long " * 10,
                  **kw)


def test_the_mix_holds_every_kind_and_one_malformed_request_in_n():
    soak, rng = make_soak(malformed_every=10), random.Random(0)
    kinds = [soak.kind_of(i, rng) for i in range(400)]
    assert sum(bad for _, bad in kinds) == 40
    assert {k for k, bad in kinds if bad} == set(S.MALFORMED)
    assert {k for k, bad in kinds if not bad} == set(S.KINDS)
    for k, _ in kinds:  # every kind has a body
        body, stream, drop = soak.body(0, k)
        assert body["model"] == S.SERVED_NAME
        assert stream == (k in ("stream", "abort")) and (drop > 0) == (k == "abort")


def test_malformed_bodies_are_malformed_and_wellformed_ones_are_not():
    soak = make_soak(max_model_len=2048)
    assert soak.body(0, "negative_temperature")[0]["temperature"] < 0
    assert soak.body(0, "max_tokens_over")[0]["max_tokens"] > 2048
    assert soak.body(0, "empty_messages")[0]["messages"] == []
    assert unknown_fields("/v1/chat/completions",
                          json.dumps(soak.body(0, "unknown_field")[0]).encode()) == ["temprature"]
    for k in S.KINDS:
        assert unknown_fields("/v1/chat/completions", json.dumps(soak.body(3, k)[0]).encode()) == []
    assert soak.body(0, "long")[0]["messages"][0]["content"] == soak.long_prompt


def rec(i, kind, t1, ok=True, malformed=False, tokens=10, status=200, tpot=None):
    return S.Record(i=i, kind=kind, malformed=malformed, t0=t1 - 1, t1=t1, ok=ok, tokens=tokens,
                    status=status, tpot_ms=tpot)


def test_per_minute_and_summary_count_what_happened():
    soak = make_soak(duration_s=120.0)
    soak.records = [rec(0, "greedy", 10), rec(1, "stream", 20, tpot=30.0),
                    rec(2, "sampled", 70, ok=False, status=500, tokens=0),
                    rec(3, "unknown_field", 80, malformed=True, status=400, tokens=0),
                    rec(4, "empty_messages", 90, ok=False, malformed=True, status=500, tokens=0)]
    soak.samples = [S.Sample(t=t, rss_mb={"VLLM::EngineCore-1": m},
                             metrics={"updates": u, "errors": 0.0, "publishes": u / 4,
                                      "version": u / 4, "hook_errors": 0.0})
                    for t, m, u in ((0, 100, 0), (40, 110, 4), (80, 120, 8), (120, 121, 12))]
    rows = S.per_minute(soak)
    assert [r["minute"] for r in rows] == [1, 2]
    assert rows[0]["served"] == {"greedy": 1, "stream": 1} and rows[0]["tpot_p50_ms"] == 30.0
    assert rows[1]["failed"] == {"sampled": 1} and rows[1]["malformed_4xx"] == 1
    assert rows[1]["statuses"] == {"500": 2, "400": 1}
    s = S.summary(soak, {"compared": 0, "mismatches": 0, "straddling": 0}, [])
    assert s["failed_wellformed"] == 1 and s["malformed_total"] == 2 and s["malformed_4xx"] == 1
    assert s["malformed_statuses"]["empty_messages"] == {500: 1}
    # From the first sample at or after a third of the run (40 s): 110 -> 121 MB.
    assert s["rss_growth"] == pytest.approx(0.1) and s["rss_growth_process"] == "VLLM::EngineCore-1"
    assert s["learner_updates"] == 12 and s["learner_errors"] == 0
    md = S.markdown({"summary": s, "minutes": rows, "command": "c", "box": "b",
                     "dtype": "float32", "concurrency": 4, "max_tokens": 64,
                     "malformed_every": 10, "swap_to": "t", "swap_at": 0.5})
    assert "| well-formed failed | **1** |" in md and "**1 / 2**" in md


def test_phase_of_a_greedy_answer_against_the_swap():
    soak = make_soak()
    soak.swap = {"ok": True, "t0": 50.0, "t1": 55.0}
    assert soak.phase(rec(0, "greedy", 40)) == "base"
    assert soak.phase(rec(0, "greedy", 60)) == "swapped"  # t0 = 59 > 55
    assert soak.phase(rec(0, "greedy", 55.5)) == "straddle"  # began before the swap ended


def test_rss_of_this_process_tree():
    rss = S.process_rss(os.getpid())
    assert any(k.endswith(f"-{os.getpid()}") for k in rss) and all(v > 0 for v in rss.values())
    assert S.process_rss(None) == {}


def asgi(body: bytes, path="/v1/chat/completions", chunks=1):
    """Runs StrictRequests over a fake app; (sent messages, what the app received)."""
    cut = len(body) // chunks
    parts = [body[:cut], body[cut:]] if chunks == 2 else [body]
    incoming = [{"type": "http.request", "body": p, "more_body": j < len(parts) - 1}
                for j, p in enumerate(parts)] + [{"type": "http.disconnect"}]
    sent, got = [], []

    async def receive():
        return incoming.pop(0)

    async def send(msg):
        sent.append(msg)

    async def app(scope, receive, send):
        got.append(await receive())
        got.append(await receive())  # the client's disconnect reaches vLLM
        await send({"type": "http.response.start", "status": 200, "headers": []})

    scope = {"type": "http", "method": "POST", "path": path}
    asyncio.run(StrictRequests(app)(scope, receive, send))
    return sent, got


def test_strict_requests_refuse_unknown_fields_in_one_line():
    sent, got = asgi(json.dumps({"model": "m", "messages": [], "temprature": 1}).encode())
    assert got == [] and sent[0]["status"] == 400
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == 400 and "'temprature'" in err["message"] and err["param"] == "temprature"


def test_strict_requests_refuse_an_empty_chat():
    sent, got = asgi(json.dumps({"model": "m", "messages": []}).encode())
    assert got == [] and sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["param"] == "messages"


def test_strict_requests_pass_known_fields_through_with_the_body_replayed():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "temperature": 1, "top_k": 5,
                       "return_token_ids": True}).encode()
    sent, got = asgi(body, chunks=2)
    assert got[0] == {"type": "http.request", "body": body, "more_body": False}
    assert got[1] == {"type": "http.disconnect"} and sent[0]["status"] == 200
    # Not JSON, or another route: vLLM's own handling.
    assert asgi(b"not json")[0][0]["status"] == 200
    assert asgi(json.dumps({"x": 1}).encode(), path="/v1/models")[0][0]["status"] == 200
    assert unknown_fields("/v1/completions", json.dumps({"prompt": "a", "nope": 1}).encode()) \
        == ["nope"]


def test_the_long_prompt_fills_the_context_but_leaves_room_for_the_answer(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    text = S.long_prompt(tok, 1024, 24)
    n = len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"])
    assert 1024 - 24 - 32 - 40 <= n <= 1024 - 24 - 32
