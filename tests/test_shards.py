"""Feature shards and the data pipeline at scale: round trip, resume after a kill, header and
corruption errors, held-out prompts never in training shards, follow-up turns."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_onlinespec.training import data
from vllm_onlinespec.training.dataset import (GenerationPlan, StreamedFeatures, featurize,
                                              generate_dataset, progress_summary)
from vllm_onlinespec.training.feature_log import FeatureLogWriter
from vllm_onlinespec.training.features import target_features
from vllm_onlinespec.training.generate import Sample, chat_ids
from vllm_onlinespec.training.shards import (MANIFEST, FeatureRow, ShardError, ShardHeader,
                                             ShardWriter, iter_shards, load_rows, read_manifest)

H = 8
HEADER = ShardHeader(target="abc123", layer_ids=(0, 2), hidden_size=H)


def _row(i: int, n: int = 5, start: int = 2) -> FeatureRow:
    g = torch.Generator().manual_seed(i)
    return FeatureRow(key=f"k{i}", ids=torch.randint(0, 100, (n,), generator=g), start=start,
                      aux=torch.randn(n, 2 * H, generator=g).bfloat16(),
                      final=torch.randn(n, H, generator=g).bfloat16())


def test_round_trip(tmp_path):
    w = ShardWriter(tmp_path, HEADER, samples_per_shard=2)
    rows = [_row(i, n=3 + i) for i in range(5)]
    for r in rows:
        w.add(r)
    w.close()
    man = read_manifest(tmp_path)
    assert [s.samples for s in man.shards] == [2, 2, 1]
    assert man.response_tokens == sum(len(r.ids) - r.start for r in rows)
    got = list(iter_shards(tmp_path, HEADER))
    assert [g.key for g in got] == [r.key for r in rows]
    for g, r in zip(got, rows):
        assert torch.equal(g.ids, r.ids) and g.start == r.start
        assert torch.equal(g.aux, r.aux) and torch.equal(g.final, r.final)
    picked = load_rows(tmp_path, HEADER, ["k3", "k0"])
    assert [p.key for p in picked] == ["k3", "k0"]
    with pytest.raises(ShardError, match="no features"):
        load_rows(tmp_path, HEADER, ["k0", "nope"])


def test_fp8_shards_halve_the_bytes_and_read_back_within_fp8_precision(tmp_path):
    """float8_e4m3fn: each token's features per layer scaled by their own max, so a layer of
    large activations (x 300 here) does not crush the others; read back lazily (slices stay
    fp8 until float()), within FP8's 2^-4 relative step of the max; training reads them as
    tensors (feature scale, padded batches, target labels)."""
    from vllm_onlinespec.training.blocks import target_argmax
    from vllm_onlinespec.training.shards import ScaledFeatures
    from vllm_onlinespec.training.trainer import Example, collate, feature_scale

    H = 64
    bf16 = ShardHeader(target="abc123", layer_ids=(0, 2), hidden_size=H)
    fp8 = ShardHeader(target="abc123", layer_ids=(0, 2), hidden_size=H, feature_dtype="float8_e4m3fn")
    rows = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        rows.append(FeatureRow(key=f"k{i}", ids=torch.randint(0, 100, (4 + i,), generator=g),
                               start=2, aux=torch.randn(4 + i, 2 * H, generator=g).bfloat16(),
                               final=torch.randn(4 + i, H, generator=g).bfloat16()))
        rows[-1].aux[:, :H] *= 300  # the first layer's features 300x larger
    for folder, header in ((tmp_path / "bf16", bf16), (tmp_path / "fp8", fp8)):
        w = ShardWriter(folder, header, samples_per_shard=8)
        for r in rows:
            w.add(r)
        w.close()
    size = {f: sum(p.stat().st_size for p in (tmp_path / f).glob("shard-*")) for f in ("bf16", "fp8")}
    assert size["fp8"] < 0.8 * size["bf16"], size  # features half; ids, offsets and headers not
    got = list(iter_shards(tmp_path / "fp8", fp8))
    for g, r in zip(got, rows):
        assert isinstance(g.aux, ScaledFeatures) and g.aux.data.dtype == torch.float8_e4m3fn
        assert torch.equal(g.ids, r.ids) and g.aux.shape == r.aux.shape
        for part in (slice(0, H), slice(H, 2 * H)):  # each layer within 2^-4 of its own max
            ref, back = r.aux[:, part].float(), g.aux.float()[:, part]
            assert ((back - ref).abs().amax(1) <= ref.abs().amax(1) / 16 + 1e-6).all()
        assert ((g.final.float() - r.final.float()).abs().amax(1)
                <= r.final.float().abs().amax(1) / 16 + 1e-6).all()
        assert torch.equal(g.aux[1:3].float(), g.aux.float()[1:3])
    ex = [Example(ids=g.ids, start=g.start, aux=g.aux, final=g.final) for g in got]
    assert feature_scale(ex).shape == (2 * H,)
    batch = collate(ex)
    assert torch.equal(batch["final"][0, :len(ex[0].ids)], ex[0].final.float())
    w_head = torch.randn(50, H)
    assert target_argmax(ex[1].final[1:], w_head).shape == (len(ex[1].ids) - 1,)
    with pytest.raises(ShardError, match="feature dtype must be one of"):
        ShardWriter(tmp_path / "x", ShardHeader(target="a", layer_ids=(0,), hidden_size=H,
                                                feature_dtype="int8"))
    with pytest.raises(ShardError, match="shard of other features|written for other features"):
        list(iter_shards(tmp_path / "fp8", bf16))


def test_convert_moves_a_folder_to_fp8_shard_by_shard_and_resumes(tmp_path):
    from vllm_onlinespec.training.shards import convert

    w = ShardWriter(tmp_path / "src", HEADER, samples_per_shard=2)
    rows = [_row(i, n=3 + i) for i in range(5)]
    for r in rows:
        w.add(r)
    w.close()
    man = convert(tmp_path / "src", tmp_path / "dst", "float8_e4m3fn")
    assert man.header.feature_dtype == "float8_e4m3fn"
    assert [s.keys for s in man.shards] == [s.keys for s in read_manifest(tmp_path / "src").shards]
    fp8 = man.header
    got = list(iter_shards(tmp_path / "dst", fp8))
    assert [g.key for g in got] == [r.key for r in rows]
    for g, r in zip(got, rows):
        assert torch.equal(g.ids, r.ids)
        assert torch.allclose(g.final.float(), r.final.float(), rtol=0.07, atol=1e-2)
    # a conversion killed after its first shard: the rerun writes only the rest
    (tmp_path / "dst" / "shard-00002.safetensors").unlink()
    m = read_manifest(tmp_path / "dst")
    m.shards = m.shards[:1]
    (tmp_path / "dst" / MANIFEST).write_text(json.dumps(m.to_json()))
    again = convert(tmp_path / "src", tmp_path / "dst", "float8_e4m3fn")
    assert [s.keys for s in again.shards] == [s.keys for s in man.shards]
    assert [g.key for g in iter_shards(tmp_path / "dst", fp8)] == [r.key for r in rows]


def test_resume_after_kill_no_duplicates(tmp_path):
    w = ShardWriter(tmp_path, HEADER, samples_per_shard=2)
    for i in range(3):  # 2 flushed into shard 0, the 3rd still pending when the run "dies"
        w.add(_row(i))
    before = (tmp_path / MANIFEST).read_text()
    # A killed run may also leave a half-written next shard behind: it must not count.
    (tmp_path / "shard-00001.safetensors").write_bytes(b"torn")
    w2 = ShardWriter(tmp_path, HEADER, samples_per_shard=2)
    assert w2.done == {"k0", "k1"} and (tmp_path / MANIFEST).read_text() == before
    for i in range(5):  # the rerun offers everything again
        w2.add(_row(i))
    w2.close()
    keys = [r.key for r in iter_shards(tmp_path, HEADER)]
    assert sorted(keys) == [f"k{i}" for i in range(5)] and len(keys) == len(set(keys))


def test_mismatched_or_corrupt_shards_fail_in_one_line(tmp_path):
    w = ShardWriter(tmp_path, HEADER, samples_per_shard=1)
    w.add(_row(0))
    w.add(_row(1))
    w.close()
    for other, what in ((ShardHeader(target="zzz", layer_ids=(0, 2), hidden_size=H), "target"),
                        (ShardHeader(target="abc123", layer_ids=(1, 2), hidden_size=H), "layer_ids")):
        with pytest.raises(ShardError) as e:
            ShardWriter(tmp_path, other)
        assert MANIFEST in str(e.value) and what in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(ShardError, match=what):
            list(iter_shards(tmp_path, other))
    # A shard whose own header disagrees with the manifest (copied in from another run).
    other_dir = tmp_path / "other"
    w3 = ShardWriter(other_dir, ShardHeader(target="abc123", layer_ids=(1, 2), hidden_size=H))
    w3.add(_row(9))
    w3.close()
    (tmp_path / "shard-00001.safetensors").write_bytes(
        (other_dir / "shard-00000.safetensors").read_bytes())
    with pytest.raises(ShardError) as e:
        list(iter_shards(tmp_path, HEADER))
    assert "shard-00001.safetensors" in str(e.value) and "layer_ids" in str(e.value)
    # A truncated file.
    raw = (tmp_path / "shard-00000.safetensors").read_bytes()
    (tmp_path / "shard-00000.safetensors").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ShardError) as e:
        list(iter_shards(tmp_path, HEADER))
    msg = str(e.value)
    assert "shard-00000.safetensors" in msg and "corrupt" in msg and "\n" not in msg
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(ShardError, match="corrupt manifest"):
        read_manifest(tmp_path)


# -- the pipeline on a tiny target --------------------------------------------------------------------

class _Tok:
    """Characters -> ids; the chat template joins the turns (enough for prompt identity)."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "|".join(f"{m['role'][0]}:{m['content']}" for m in messages) + "|a:"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [1] + [3 + ord(c) % 60 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=H * 4, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def _fake_fn(spec_log):
    def fn(prompt_ids, spec):
        spec_log.append((len(prompt_ids), spec.temperature, spec.n))
        out = []
        for ids in prompt_ids:
            out.append([[(sum(ids) + 7 * j + t) % 60 + 3 for t in range(spec.max_tokens)]
                        for j in range(spec.n)])
        return out
    return fn


def test_generate_dataset_rounds_budget_and_heldout(tmp_path, tiny):
    ps = [data.Prompt(id=f"p:{i}", source="p", text=f"question number {i}",
                      next_turns=("and then?",) if i % 2 else ()) for i in range(30)]
    train, held = data.split_prompts(ps, 0.2, seed=0)
    assert held and train
    plan = GenerationPlan(max_new_tokens=6, samples=2, followups=1, chunk_prompts=8)
    log: list = []
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    kw = dict(tokenizer=_Tok(), cache_dir=tmp_path / "gen", generate_fn=_fake_fn(log),
              dtype="bfloat16", log=lambda m: None)
    tr, he = generate_dataset(str(tmp_path / "m"), train, held, plan, **kw)
    assert len(he) == len(held) and len(tr) == len(train) * 4  # greedy + 2 sampled + 1 follow-up
    assert {t for _, t, _ in log} == {0.0, 0.8}
    # Follow-ups continue the target's own greedy answer; odd prompts use their dataset turn.
    tok = _Tok()
    greedy = {x.prompt_id: x for x in tr if "#" not in x.prompt_id and x.sample == 0}
    fu = [x for x in tr if x.prompt_id.endswith("#turn2")]
    assert len(fu) == len(train) and len(greedy) == len(train)
    by_id = {p.id: p for p in train}
    for x in fu:
        root = by_id[x.prompt_id.split("#")[0]]
        answer = tok.decode(greedy[root.id].ids[greedy[root.id].start:])
        want = data.follow_up(root, answer)
        assert x.ids[:x.start] == chat_ids(tok, want)
        assert want.messages[-1]["content"] == ("and then?" if root.next_turns else
                                                want.messages[-1]["content"])
    # Held-out prompts are never part of a training sample, in any round.
    held_ids = [chat_ids(tok, p)[:-3] for p in held]
    for x in tr:
        assert not any(x.ids[:len(h)] == h for h in held_ids)
    assert {x.prompt_id.split("#")[0] for x in tr}.isdisjoint({p.id for p in held})
    # A budget stops early and takes a prefix; the cache serves it without new generation.
    n_calls = len(log)
    small, _ = generate_dataset(str(tmp_path / "m"), train, held, plan, token_budget=20, **kw)
    assert 20 <= sum(x.response_tokens for x in small) < 20 + 6 and len(log) == n_calls

    # Features into shards: held-out and training folders never share a sample.
    header = ShardHeader(target="t", layer_ids=(0, 2), hidden_size=H * 4)
    wt, wh = ShardWriter(tmp_path / "sh" / "train", header), ShardWriter(tmp_path / "sh" / "held", header)
    featurize(tiny, tr, [0, 2], wt)
    featurize(tiny, he, [0, 2], wh)
    train_keys = read_manifest(tmp_path / "sh" / "train").keys
    assert train_keys == {x.key for x in tr}
    assert train_keys.isdisjoint(read_manifest(tmp_path / "sh" / "held").keys)
    # Stored features equal a plain full-sequence forward (bf16 storage tolerance).
    rows = load_rows(tmp_path / "sh" / "train", header, [x.key for x in tr[:6]])
    for x, r in zip(tr[:6], rows):
        aux, final = target_features(tiny, torch.tensor([x.ids]), None, [0, 2])
        torch.testing.assert_close(r.aux.float(), aux[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(r.final.float(), final[0], rtol=2e-2, atol=2e-2)
        assert r.ids.tolist() == x.ids and r.start == x.start


def test_featurize_resumes_after_a_kill(tmp_path, tiny):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 60, (9,), generator=g).tolist()
    samples = [Sample(prompt_id="a", ids=prompt + torch.randint(3, 60, (5 + j,), generator=g).tolist(),
                      start=9, sample=j) for j in range(5)]
    samples += [Sample(prompt_id=f"s{j}", ids=torch.randint(3, 60, (12,), generator=g).tolist(),
                       start=4) for j in range(3)]
    header = ShardHeader(target="t", layer_ids=(1,), hidden_size=H * 4)

    class Killed(Exception):
        pass

    class DyingWriter(ShardWriter):
        def add(self, row):
            if len(self.done) >= 6:
                raise Killed
            super().add(row)

    w = DyingWriter(tmp_path, header, samples_per_shard=2)
    with pytest.raises(Killed):
        featurize(tiny, samples, [1], w)
    first = read_manifest(tmp_path).keys
    assert 0 < len(first) < len(samples)
    w2 = ShardWriter(tmp_path, header, samples_per_shard=2)
    featurize(tiny, samples, [1], w2)
    keys = [r.key for r in iter_shards(tmp_path, header)]
    assert sorted(keys) == sorted(x.key for x in samples) and len(keys) == len(set(keys))
    man = json.loads((tmp_path / MANIFEST).read_text())
    assert man["header"]["layer_ids"] == [1]


def _stream_run(tmp_path, tiny, folder, *, die_at_call=None, pause=None, log_features=False):
    """generate_dataset with StreamedFeatures over 24 prompts in chunks of 5 (greedy + 1
    sampled); the fake engine raises on call `die_at_call`; with `log_features` it also writes
    a feature log the way the worker does (random features: only their origin is checked)."""
    ps = [data.Prompt(id=f"p:{i}", source="p", text=f"question {i} " * (1 + i % 3)) for i in range(24)]
    train, held = data.split_prompts(ps, 0.2, seed=0)
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text("{}")
    header = ShardHeader(target="t", layer_ids=(0, 2), hidden_size=H * 4)
    logdir = folder / "feature_log"
    calls = []
    inner = _fake_fn([])

    def fn(prompt_ids, spec):
        calls.append(len(prompt_ids))
        if die_at_call is not None and len(calls) == die_at_call:
            raise KeyboardInterrupt  # a kill between chunks
        out = [[[3 + (t + int(spec.temperature > 0)) % 60 for t in r] for r in rs]
               for rs in inner(prompt_ids, spec)]  # a sampled answer differs from the greedy one
        if log_features:
            w = FeatureLogWriter(logdir, [0, 2], H * 4)
            for n, (ids, resps) in enumerate(zip(prompt_ids, out)):
                for j, r in enumerate(resps):
                    seq = torch.tensor(ids + r[:-1])
                    w.add(f"{len(calls)}-{n}-{j}", 0, seq, torch.full((len(seq), 2 * H * 4), 7.0),
                          torch.full((len(seq), H * 4), 7.0))
            w.close()
        return out

    stream = StreamedFeatures(folder, header, load_target=lambda: tiny,
                              feature_log=logdir if log_features else None, pause=pause, poll_s=0.01,
                              log=lambda m: None)
    plan = GenerationPlan(max_new_tokens=4, samples=1, chunk_prompts=5)
    try:
        return generate_dataset(str(tmp_path / "m"), train, held, plan, tokenizer=_Tok(),
                                cache_dir=folder / "gen", generate_fn=fn, dtype="float32",
                                log=lambda m: None, on_chunk=stream), header, calls
    finally:
        stream.close()


def _shards(folder, header):
    man = read_manifest(folder)
    return [[(r.key, r.ids.tolist(), r.start, r.aux.float(), r.final.float())
             for r in iter_shards(folder, header, info.keys)] for info in man.shards]


def test_streamed_generation_resumes_to_the_same_shards(tmp_path, tiny):
    (tr, he), header, calls = _stream_run(tmp_path, tiny, tmp_path / "whole")
    assert len(calls) == 1 + 2 * 4  # held-out once, then 4 chunks of the 19 training prompts x 2 rounds
    with pytest.raises(KeyboardInterrupt):
        _stream_run(tmp_path, tiny, tmp_path / "cut", die_at_call=4)
    part = read_manifest(tmp_path / "cut" / "train")
    assert 0 < len(part.shards) < len(read_manifest(tmp_path / "whole" / "train").shards)
    (tr2, he2), _, calls2 = _stream_run(tmp_path, tiny, tmp_path / "cut")
    assert len(calls2) == 9 - 3  # the chunks done before the kill come from the cache
    assert [x.key for x in tr2] == [x.key for x in tr] and [x.key for x in he2] == [x.key for x in he]
    for part in ("train", "heldout"):
        a, b = _shards(tmp_path / "whole" / part, header), _shards(tmp_path / "cut" / part, header)
        assert len(a) == len(b) and [len(x) for x in a] == [len(x) for x in b]
        for sa, sb in zip(a, b):
            for ra, rb in zip(sa, sb):
                assert ra[:3] == rb[:3]
                torch.testing.assert_close(ra[3], rb[3], rtol=0, atol=0)
                torch.testing.assert_close(ra[4], rb[4], rtol=0, atol=0)
    got = progress_summary(tmp_path / "cut")
    assert got["train_response_tokens"] == sum(x.response_tokens for x in tr)
    assert got["generated_tokens"] > 0 and got["tok_s"] > 0


def test_streamed_features_come_from_the_log_and_pause_closes_the_engine(tmp_path, tiny):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "PAUSE").touch()
    paused = []

    def pause():  # the engine closes once; the run waits until the file is gone
        paused.append(1)
        (folder / "PAUSE").unlink()

    (tr, he), header, calls = _stream_run(tmp_path, tiny, folder, pause=pause, log_features=True)
    assert paused == [1]
    rows = list(iter_shards(folder / "train", header))
    assert {r.key for r in rows} == {x.key for x in tr}
    # Every row came from the log (features 7.0), none from the HF pass; the log was consumed.
    assert all(bool((r.aux.float() == 7.0).all()) for r in rows)
    assert not list((folder / "feature_log").glob("log-*"))
    prog = [json.loads(x) for x in (folder / "progress.jsonl").read_text().splitlines()]
    assert sum(r["logged"] for r in prog) == len(tr) + len(he) and sum(r["hf"] for r in prog) == 0


def test_follow_up_keeps_split_and_uses_dataset_turn():
    p = data.Prompt(id="sb:1", source="spec_bench", text="Write a poem.", next_turns=("Shorter.",))
    f = data.follow_up(p, "Roses are red.")
    assert f.text == p.text and f.id == "sb:1#turn2"
    assert [m["role"] for m in f.messages] == ["user", "assistant", "user"]
    assert f.messages[-1]["content"] == "Shorter."
    q = data.Prompt(id="he:1", source="humaneval", text="def f(): ...")
    assert data.follow_up(q, "ok").messages[-1]["content"] in data.GENERIC_FOLLOWUPS
    train, held = data.split_prompts([p, q], 0.5, seed=0)
    t2, h2 = data.split_prompts([data.follow_up(p, "a"), data.follow_up(q, "b")], 0.5, seed=0)
    assert [x.id + "#turn2" for x in train] == [x.id for x in t2]
