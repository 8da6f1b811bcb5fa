"""Offline training: block loss, anchors, data, generation cache, the trainer, the CLI's errors.

No vLLM engine here: generation uses an injected fake generator (the tiny target's own greedy
decoding through HF).
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from vllm_onlinespec.config import LossConfig
from vllm_onlinespec.drafter import DFlashConfig, DFlashDrafter, LengthHead, load_drafter
from vllm_onlinespec.training import data
from vllm_onlinespec.training.blocks import (LossVocab, block_loss, greedy_accepted,
                                             response_mask, sample_anchors, target_argmax,
                                             walk_acceptance, walk_steps)
from vllm_onlinespec.training.generate import SamplingSpec, generate
from vllm_onlinespec.training.settings import TrainerSettings
from vllm_onlinespec.training.trainer import train

VOCAB = 128


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls on a shared 2-core box: a second OpenMP thread waiting on a busy core made
    # these tests 10x slower, not 2x faster.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- a tiny target with learnable structure ----------------------------------------------------------

@pytest.fixture(scope="module")
def walk_target():
    """4-layer random Llama whose greedy continuation walks a fixed permutation: x -> pi(x).

    Its random layers barely move the residual stream, so the final state is ~ the last token's
    embedding; an LM head made of the embedding rows in permuted order makes pi(x) the argmax.
    Drafting k tokens ahead then means learning pi^k: structure a drafter can learn, not a copy.
    """
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    inv = torch.argsort(perm)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.3)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight[inv])  # row pi(x) = E[x]
    return model, perm


def fake_generate_fn(model, calls=None):
    """A GenerateFn: greedy decoding of the tiny target (stands in for vLLM), batched over
    prompts of equal length, no KV cache (sequences are a few dozen tokens)."""
    @torch.no_grad()
    def fn(prompt_ids, spec):
        if calls is not None:
            calls.append(len(prompt_ids))
        out: list = [None] * len(prompt_ids)
        for n in {len(i) for i in prompt_ids}:
            rows = [r for r, i in enumerate(prompt_ids) if len(i) == n]
            seq = torch.tensor([prompt_ids[r] for r in rows])
            for _ in range(spec.max_tokens):
                seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            for r, s in zip(rows, seq):
                out[r] = [s[n:].tolist()] * spec.n
        return out
    return fn


class _Tok:
    """Chat 'tokenizer' for the tiny target: one token per character of the user turn."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return messages[-1]["content"]

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [1] + [3 + (ord(c) % (VOCAB - 3)) for c in text]}


# -- block_loss against a hand computation -----------------------------------------------------------

def _tiny_drafter(block_size=4):
    cfg = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=50,
                       target_layer_ids=[0, 1], mask_token_id=0, block_size=block_size,
                       rope_theta=10000.0, torch_dtype="float32")
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    for p in d.parameters():  # beyond the init so nothing is trivially symmetric
        p.data.add_(0.05 * torch.randn_like(p))
    return cfg, d


def test_block_loss_equals_hand_computation():
    cfg, drafter = _tiny_drafter(block_size=4)
    k, gamma, T, alpha = 3, 3.0, 2.0, 0.7
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (2, 12), generator=g)
    aux = torch.randn(2, 12, 64, generator=g)
    final = torch.randn(2, 12, 32, generator=g)
    emb = torch.randn(50, 32, generator=g)
    head = torch.randn(50, 32, generator=g)
    anchors = torch.tensor([[1, 5, 9, -1], [0, 4, 8, -1]])  # non-overlapping; 9 and 8 are partial
    lengths = torch.tensor([12, 10])
    # Make some rows agree so acceptance is non-trivial: block (0,0) agrees on rows 1-2 along
    # the greedy path, block (1,1) on row 1 only. The drafter only reads ids at anchors.
    with torch.no_grad():
        h0 = drafter.train_hidden(aux, ids, anchors, emb)
        for (b, j), m in {(0, 0): 2, (1, 1): 1}.items():
            a = int(anchors[b, j])
            for r in range(m):
                final[b, a + r] = h0[b, j, r]
                ids[b, a + 1 + r] = int((h0[b, j, r] @ head.T).argmax())
    lhead = LengthHead(32, width=16)
    loss_cfg = LossConfig(alpha=alpha, temperature=T, gamma=gamma, mode="reverse_kl")
    loss, st = block_loss(drafter, ids, aux, final, anchors, emb, head, loss_cfg=loss_cfg,
                          length_head=lhead, lengths=lengths, impl="naive")

    h = drafter.train_hidden(aux, ids, anchors, emb)
    num = den = 0.0
    acc_all, len_err, full_acc = [], [], []
    for b in range(2):
        for j in range(4):
            a = int(anchors[b, j])
            if a < 0:
                continue
            accepted, alive, censored = 0, True, False
            for r in range(k):
                pos = a + 1 + r
                if pos >= int(lengths[b]):
                    censored = alive
                    break
                q = h[b, j, r] @ head.T
                p = final[b, a + r] @ head.T
                t = int(p.argmax())
                ce = -F.log_softmax(q, -1)[t]
                lq, lp = F.log_softmax(q / T, -1), F.log_softmax(p / T, -1)
                kl = (lq.exp() * (lq - lp)).sum()
                w = math.exp(-r / gamma)
                num = num + w * (alpha * ce + (1 - alpha) * T * T * kl)
                den += w
                if alive and int(q.argmax()) == t:
                    accepted += 1
                    if int(ids[b, pos]) != t:  # left the greedy path: the rest is unknowable
                        alive, censored = False, r < k - 1
                else:
                    alive = False
            if a + k < int(lengths[b]):
                full_acc.append(accepted)
            acc_all.append(accepted)
            if not censored:
                pred = lhead(h[b, j].detach())
                len_err.append((pred - min(1.0, (accepted + 1) / 4)) ** 2)
    hand = num / den + torch.stack(len_err).mean()
    torch.testing.assert_close(loss, hand, rtol=1e-5, atol=1e-6)
    assert st.accepted == pytest.approx(sum(full_acc) / len(full_acc))
    assert st.blocks == 6 and st.full_blocks == len(full_acc) == 4
    assert max(acc_all) == 2  # the planted agreement was seen

    # Same gradient for the drafter and the length head.
    g1 = torch.autograd.grad(loss, [drafter.fc.weight, lhead.out.weight], retain_graph=True)
    g2 = torch.autograd.grad(hand, [drafter.fc.weight, lhead.out.weight])
    for x, y in zip(g1, g2):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)


def test_loss_vocab_projects_onto_its_rows_and_reports_token_ids():
    cfg, drafter = _tiny_drafter(block_size=4)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (2, 12), generator=g)
    aux, final = torch.randn(2, 12, 64, generator=g), torch.randn(2, 12, 32, generator=g)
    emb, head = torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g)
    anchors = torch.tensor([[1, 5], [0, 4]])
    kw = dict(loss_cfg=LossConfig(alpha=0.7, mode="reverse_kl"), impl="naive")

    # The whole vocabulary as a LossVocab is the plain loss, value and statistics.
    full, st_full = block_loss(drafter, ids, aux, final, anchors, emb, head, **kw)
    same, st_same = block_loss(drafter, ids, aux, final, anchors, emb, head,
                               vocab=LossVocab.of(head, torch.arange(50)), **kw)
    torch.testing.assert_close(same, full)
    assert st_same.match == st_full.match and st_same.accepted == st_full.accepted

    # A subset: the loss is the plain loss of a target whose LM head has only those rows, and
    # the argmaxes come back as token ids. Plant drafter/target agreement on tokens 37 and 11
    # in rows 1-2 of block (0, 0), with 37 also the data's label after row 1: only with token
    # ids (not subset positions) is row 1 on the greedy path, so row 2 counts as accepted too.
    sub = torch.tensor([3, 37, 11, 20, 41])  # unsorted on purpose
    assert LossVocab.of(head, sub).ids.tolist() == [3, 11, 20, 37, 41]
    with torch.no_grad():
        h0 = drafter.train_hidden(aux, ids, anchors, emb)
        for r, tok in enumerate((37, 11)):
            final[0, 1 + r] = h0[0, 0, r]
            head[tok] = 10 * h0[0, 0, r]
            ids[0, 2 + r] = tok
    vocab = LossVocab.of(head, sub)
    loss, st = block_loss(drafter, ids, aux, final, anchors, emb, head, vocab=vocab, **kw)
    ref, st_ref = block_loss(drafter, ids, aux, final, anchors, emb, head[vocab.ids], **kw)
    torch.testing.assert_close(loss, ref)  # same rows, so the same loss
    assert st.match[:2] == st_ref.match[:2] and st.match[0] > 0
    assert st.accepted == pytest.approx(st_ref.accepted + 1 / st.full_blocks)
    with pytest.raises(ValueError, match="loss vocabulary ids"):
        LossVocab.of(head, torch.tensor([0, 50]))


def test_cached_labels_give_the_ce_loss_of_the_target_head():
    """CE mode with the target's argmax cached (target_ids) is the CE mode that runs the
    target's head every step: the same loss, gradient and statistics, whole vocabulary and a
    subset; a label outside the subset adds no loss."""
    cfg, drafter = _tiny_drafter(block_size=4)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 50, (2, 12), generator=g)
    aux, final = torch.randn(2, 12, 64, generator=g), torch.randn(2, 12, 32, generator=g)
    emb, head = torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g)
    anchors = torch.tensor([[1, 5, 9], [0, 4, -1]])
    lengths = torch.tensor([12, 10])
    tgt = torch.stack([target_argmax(f, head) for f in final])
    assert torch.equal(tgt, (final @ head.T).argmax(-1))
    kw = dict(loss_cfg=LossConfig(mode="ce", gamma=2.0), lengths=lengths, impl="naive")
    for vocab in (None, LossVocab.of(head, torch.cat([ids.flatten(), tgt.flatten()]))):
        ref, st_ref = block_loss(drafter, ids, aux, final, anchors, emb, head, vocab=vocab, **kw)
        got, st = block_loss(drafter, ids, aux, torch.full_like(final, float("nan")), anchors,
                             emb, head, vocab=vocab, target_ids=tgt, **kw)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        assert st.match == st_ref.match and st.accepted == st_ref.accepted
        g1 = torch.autograd.grad(got, drafter.fc.weight)[0]
        g2 = torch.autograd.grad(ref, drafter.fc.weight)[0]
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-7)
    # Labels outside the vocabulary: only the rows whose label is inside count.
    inside = LossVocab.of(head, torch.arange(25))
    got, _ = block_loss(drafter, ids, aux, final, anchors, emb, head, vocab=inside,
                        target_ids=tgt, **kw)
    h = drafter.train_hidden(aux, ids, anchors, emb)
    num = den = 0.0
    for b in range(2):
        for j in range(3):
            a = int(anchors[b, j])
            for r in range(3):
                if a < 0 or a + 1 + r >= int(lengths[b]):
                    continue
                w = math.exp(-r / 2.0)
                den += w
                t = int(tgt[b, a + r])
                if t < 25:
                    num = num - w * F.log_softmax(h[b, j, r] @ head[:25].T, -1)[t]
    torch.testing.assert_close(got, num / den, rtol=1e-5, atol=1e-6)


def test_target_labels_equal_the_model_heads_argmax(walk_target):
    from vllm_onlinespec.training.trainer import Example, add_target_labels

    model, _ = walk_target
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    e = Example(ids=ids[0], start=6, aux=torch.zeros(20, 4), final=out.hidden_states[-1][0])
    add_target_labels([e], model.lm_head.weight)
    assert torch.equal(e.tgt[5:], out.logits[0, 5:].argmax(-1))


def test_feature_scale_folded_into_fc_equals_scaling_the_inputs():
    from vllm_onlinespec.training.trainer import Example, feature_scale, fold_feature_scale

    cfg, drafter = _tiny_drafter(block_size=4)
    g = torch.Generator().manual_seed(7)
    aux = torch.randn(2, 12, 64, generator=g) * torch.logspace(-1, 2.5, 64)  # a few massive dims
    ids = torch.randint(1, 50, (2, 12), generator=g)
    emb = torch.randn(50, 32, generator=g)
    scale = feature_scale([Example(ids=ids[0], start=0, aux=aux[0], final=aux[0]),
                           Example(ids=ids[1], start=0, aux=aux[1], final=aux[1])])
    rms = (aux.reshape(-1, 64).pow(2).mean(0).sqrt())
    torch.testing.assert_close(scale, 1 / rms)
    anchors = torch.tensor([[2, 6], [1, 7]])
    want = drafter.train_hidden(aux * scale, ids, anchors, emb)
    folded = fold_feature_scale(drafter, scale)
    torch.testing.assert_close(folded.train_hidden(aux, ids, anchors, emb), want,
                               rtol=1e-4, atol=1e-5)
    assert not torch.equal(drafter.fc.weight, folded.fc.weight)  # a copy; the original stays


def test_feature_scale_is_applied_when_read_and_samples_whole_sequences(tmp_path):
    """Normalised features are scaled as batches read them: memory-mapped shards are never
    rewritten or copied whole; the scale's estimate reads about max_rows rows."""
    from vllm_onlinespec.training.shards import FeatureRow, ShardHeader, ShardWriter, load_rows
    from vllm_onlinespec.training.trainer import Example, collate, feature_scale, scale_features

    g = torch.Generator().manual_seed(3)
    header = ShardHeader(target="t", layer_ids=(0,), hidden_size=8, feature_dtype="float32")
    w = ShardWriter(tmp_path, header)
    for i in range(6):
        w.add(FeatureRow(key=f"k{i}", ids=torch.arange(10), start=2,
                         aux=torch.randn(10, 8, generator=g) * 5, final=torch.randn(10, 8, generator=g)))
    w.close()
    rows = load_rows(tmp_path, header, [f"k{i}" for i in range(6)])
    ex = [Example(ids=r.ids, start=r.start, aux=r.aux, final=r.final) for r in rows]
    raw = [e.aux.clone() for e in ex]
    scale = feature_scale(ex, max_rows=25)  # 3 whole sequences of 10 rows
    scale_features(ex, scale)
    assert all(torch.equal(e.aux, r) for e, r in zip(ex, raw))  # stored features untouched
    batch = collate(ex[:2])
    torch.testing.assert_close(batch["aux"][1], raw[1] * scale)
    full = torch.cat(raw).pow(2).mean(0).sqrt()
    assert not torch.allclose(scale, 1 / full)  # estimated from the 3 sequences, not all 6


def test_walk_acceptance_steps_like_serving():
    # a block at 0 accepts 2 -> next anchor 3 accepts 1 -> next 5 has no full window: stop
    assert walk_acceptance([2, 0, 0, 1, 0, -1, 3], 4) == (2, 5)
    assert walk_acceptance([0, 0, 0], 4) == (3, 3)  # nothing accepted: 1 token per step
    assert walk_acceptance([9, 0, 0], 4) == (1, 5)  # never more than K drafts per step
    assert walk_acceptance([], 4) == (0, 0)
    # An easy stretch then a hard one: uniform anchors average 1 + 20/10 = 3.0 tokens per step,
    # the walk crosses the easy half in one step and the hard half in five: 10 / 6.
    assert walk_acceptance([4] * 5 + [0] * 5, 4) == (6, 10)
    assert walk_steps([2, 0, 0, 1, 0, -1, 3], 4) == [2, 1]  # accepted drafts per visited step
    assert walk_steps([9, 0, 0, 0, 0, 4], 4) == [4, 4]


def test_walk_eval_counts_blocks_at_every_position_in_any_chunking():
    from vllm_onlinespec.training.trainer import Example, walk_eval

    cfg, drafter = _tiny_drafter(block_size=3)
    g = torch.Generator().manual_seed(5)
    emb, head = torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g)
    exs = []
    for n, start in ((14, 3), (9, 2)):
        ids = torch.randint(1, 50, (n,), generator=g)
        aux, final = torch.randn(n, 64, generator=g), torch.randn(n, 32, generator=g)
        exs.append(Example(ids=ids, start=start, aux=aux, final=final))
    # Make the drafter right at one position of the first answer so the walk jumps there.
    with torch.no_grad():
        e = exs[0]
        h = drafter.train_hidden(e.aux.unsqueeze(0), e.ids.view(1, -1), torch.tensor([[5]]), emb)
        e.final[5] = h[0, 0, 0]
        e.ids[6] = int((h[0, 0, 0] @ head.T).argmax())
    a = walk_eval(drafter, exs, emb, head, chunk=64)
    b = walk_eval(drafter, exs, emb, head, chunk=2)
    assert a == b
    # positions with a full window: 14-2-3 = 9 and 9-2-2 = 5; one accepted draft skips one
    assert a["walk_steps"] <= 14 and a["walk_acceptance"] > 1.0
    assert 0.0 <= a["walk_full_block_share"] <= (a["walk_acceptance"] - 1) / 2  # K = 2 here


def test_greedy_accepted_censoring():
    d = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 9, 7], [5, 6, 7]])
    t = torch.tensor([[5, 6, 7], [5, 6, 8], [5, 6, 7], [5, 6, 7]])
    lab = torch.tensor([[5, 6, 7], [5, 6, 8], [5, 6, 7], [5, 1, 7]])  # row 3 leaves the path
    valid = torch.ones(4, 3, dtype=torch.bool)
    acc, cen = greedy_accepted(d, t, lab, valid)
    assert acc.tolist() == [3, 2, 1, 2] and cen.tolist() == [False, False, False, True]
    valid[0, 2] = False  # window ran out after two matches
    acc, cen = greedy_accepted(d, t, lab, valid)
    assert acc[0] == 2 and cen[0]


# -- anchors ------------------------------------------------------------------------------------------

def test_anchors_only_in_responses_full_windows_first():
    g = torch.Generator().manual_seed(0)
    starts = torch.tensor([10, 3, 20, 30])
    lengths = torch.tensor([40, 12, 26, 31])
    allowed = response_mask(starts, lengths, 40)
    for _ in range(20):
        a = sample_anchors(allowed, lengths, 8, 3, g)
        for b in range(4):
            used = a[b][a[b] >= 0]
            assert (used >= starts[b]).all() and (used < lengths[b] - 1).all()  # never the prompt
            assert used.unique().numel() == used.numel()
            assert (a[b][used.numel():] == -1).all() and (used.diff() > 0).all()
            n_allowed = int(allowed[b].sum())
            assert used.numel() == min(8, n_allowed)
            n_full = int((allowed[b] & (torch.arange(40) + 3 < lengths[b])).sum())
            assert int((used + 3 < lengths[b]).sum()) == min(8, n_full)
    assert (sample_anchors(allowed, lengths, 8, 3, g)[3] == -1).all()  # response of 1 token


def test_tree_miss_anchors_leave_out_what_the_tree_drafts():
    """`--anchors tree-miss`: an answer that repeats an earlier answer is drafted by the suffix
    tree (its global tree holds the earlier output), so its positions are not anchors; the
    first answer's fresh text is. Training batches anchor only at marked positions."""
    from types import SimpleNamespace

    from vllm_onlinespec.training.trainer import Example, collate
    from vllm_onlinespec.training.tree_anchors import mark_tree_misses

    prompt = [1, 2, 3]
    answer = list(range(100, 140))
    ex = [SimpleNamespace(ids=torch.tensor(prompt + answer), start=3),
          SimpleNamespace(ids=torch.tensor([4, 5, 6] + answer), start=3)]
    share = mark_tree_misses(ex, min_score=1.0, k=4)
    first, second = ex[0].anchor_ok, ex[1].anchor_ok
    assert first[2:20].all()  # nothing to match yet: the drafter drafts there
    assert not second[10:-3].any()  # the copy of the first answer: the tree drafts (to its end)
    assert not first[:2].any() and not first[-1]  # prompt and the last token: never anchors
    assert 0.3 < share < 0.8
    # Batches carry the mask; anchors are drawn only where it (and the response) allows.
    e = [Example(ids=x.ids, start=x.start, aux=torch.zeros(len(x.ids), 2),
                 final=torch.zeros(len(x.ids), 2), anchor_ok=x.anchor_ok) for x in ex]
    batch = collate(e)
    allowed = response_mask(batch["starts"], batch["lengths"], batch["ids"].shape[1]) & batch["anchor_ok"]
    a = sample_anchors(allowed, batch["lengths"], 8, 4, torch.Generator().manual_seed(0))
    for b in range(2):
        used = a[b][a[b] >= 0]
        assert used.numel() and ex[b].anchor_ok[used].all()


# -- data ---------------------------------------------------------------------------------------------

def test_prompt_sources_and_stable_split(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"prompt": f"question {i}"} for i in range(200)]
    rows += [{"turns": ["first turn", "second"], "category": "qa", "question_id": 7},
             {"messages": [{"role": "user", "content": "hi there"}]}, {"prompt": "question 3"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = data.dedupe(data.load_jsonl(f))
    assert len(prompts) == 202
    assert prompts[200].text == "first turn" and prompts[200].id == "jsonl:7"
    train_p, held = data.split_prompts(prompts, 0.2, seed=0)
    assert 20 < len(held) < 60 and not {p.text for p in train_p} & {p.text for p in held}
    # A prompt's side does not depend on the other prompts or their order.
    _, held2 = data.split_prompts(list(reversed(prompts[:50])), 0.2, seed=0)
    assert {p.text for p in held2} == {p.text for p in held if p in prompts[:50]}
    # ... nor on the process: pinned, since Python's own str hash changes per run.
    pinned = [data.Prompt(id=str(i), source="t", text=f"question {i}") for i in range(20)]
    assert [p.text for p in data.split_prompts(pinned, 0.2, seed=0)[1]] == [
        "question 4", "question 6", "question 9", "question 12", "question 19"]
    assert data.load_jsonl(f, categories=["qa"])[0].text == "first turn"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        data.load_jsonl(bad)  # nothing usable: an error naming the first bad line
    # In a file with usable rows, bad ones are skipped and counted, never fatal.
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "ok one"}\n{"question": "x"}\nnot json\n{"prompt": "  "}\n'
                     '[1, 2]\n{"messages": [{"role": "user", "content": "ok two"}]}\n')
    said: list[str] = []
    got = data.load_jsonl(mixed, log=said.append)
    assert [p.text for p in got] == ["ok one", "ok two"]
    assert len(said) == 1 and "4 rows skipped" in said[0] and "1 unknown chat format" in said[0]
    assert "1 empty prompt" in said[0] and "1 not JSON" in said[0] and "mixed.jsonl:2" in said[0]
    he = data.load_humaneval()
    assert len(he) == 164 and "def " in he[0].text


def test_spec_bench_categories(spec_bench_questions):
    from conftest import SPEC_BENCH

    ps = data.load_spec_bench(SPEC_BENCH, ["qa", "coding"])
    assert {p.category for p in ps} == {"qa", "coding"} and len(ps) == 90
    with pytest.raises(ValueError, match="unknown Spec-Bench categories"):
        data.load_spec_bench(SPEC_BENCH, ["nope"])


# -- generation cache ---------------------------------------------------------------------------------

def test_generate_caches_and_reuses(walk_target, tmp_path):
    model, _ = walk_target
    calls: list[int] = []
    fn = fake_generate_fn(model, calls)
    ps = [data.Prompt(id=f"t:{i}", source="t", text=f"prompt {i}") for i in range(3)]
    spec = SamplingSpec(max_tokens=5)
    cfg_dir = tmp_path / "model"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text("{}")
    s1 = generate(cfg_dir, ps, spec, tokenizer=_Tok(), cache_dir=tmp_path, generate_fn=fn,
                  log=lambda m: None)
    assert calls == [3] and len(s1) == 3
    assert all(s.response_tokens == 5 and s.ids[:s.start] == [1] + [3 + ord(c) % 125 for c in
               f"prompt {i}"] for i, s in enumerate(s1))
    s2 = generate(cfg_dir, ps + [data.Prompt(id="t:9", source="t", text="new")], spec,
                  tokenizer=_Tok(), cache_dir=tmp_path, generate_fn=fn, log=lambda m: None)
    assert calls == [3, 1] and [s.ids for s in s2[:3]] == [s.ids for s in s1]
    generate(cfg_dir, ps, SamplingSpec(max_tokens=6), tokenizer=_Tok(), cache_dir=tmp_path,
             generate_fn=fn, log=lambda m: None)
    assert calls == [3, 1, 3]  # other sampling params: another cache
    with pytest.raises(ValueError, match="identical"):
        SamplingSpec(n=2)


# -- the trainer --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def walk_samples(walk_target, tmp_path_factory):
    model, _ = walk_target
    g = torch.Generator().manual_seed(3)
    ps = [data.Prompt(id=f"w:{i}", source="w", text="".join(
        chr(97 + int(c)) for c in torch.randint(0, 26, (6,), generator=g))) for i in range(72)]
    train_p, held_p = ps[:64], ps[64:]
    spec = SamplingSpec(max_tokens=24)
    cache = tmp_path_factory.mktemp("gen")
    kw = dict(tokenizer=_Tok(), cache_dir=cache, generate_fn=fake_generate_fn(model),
              log=lambda m: None)
    return generate(cache, train_p, spec, **kw), generate(cache, held_p, spec, **kw)


def _cfg(**kw):
    base = dict(layers=1, block_size=4, num_target_features=2, mask_token_id=0, epochs=10,
                batch_size=8, anchors_per_seq=16, lr=1e-2, warmup_steps=4, eval_anchors=8,
                log_every=4, alpha=0.8, gamma=4.0)
    return TrainerSettings(**{**base, **kw})


def test_training_lowers_loss_and_raises_acceptance(walk_target, walk_samples, tmp_path):
    model, perm = walk_target
    train_s, held_s = walk_samples
    walk = train_s[0].ids[train_s[0].start:]
    assert all(perm[a] == b for a, b in zip(walk, walk[1:]))  # the data is the permutation walk
    res = train("unused", train_s, held_s, tmp_path / "run", _cfg(), target=model,
                log=lambda m: None)
    first, last = res.evals[0], res.evals[-1]
    assert [e["epoch"] for e in res.evals] == list(range(11))
    assert last["loss"] < 0.5 * first["loss"]
    assert first["accepted"] < 0.2 and last["accepted"] > 0.5  # of K = 3
    assert min(last["match"]) > 0.2  # rows 2-3 need pi^2, pi^3: learned, not copied
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    train_rows = [r for r in log if r["event"] == "train"]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    # The exported folder is a loadable drafter with the mask token and the length head.
    dcfg, drafter, head = load_drafter(tmp_path / "run", dtype=torch.float32)
    assert dcfg.mask_token_id == 0 and dcfg.block_size == 4 and head is not None
    meta = json.loads((tmp_path / "run" / "train_meta.json").read_text())
    assert meta["num_speculative_tokens"] == 3 and meta["train_sequences"] == 64


def test_init_from_continues_a_trained_drafter(walk_target, walk_samples, tmp_path):
    """--init-from: the run starts where the folder's drafter ended (same held-out acceptance
    before its first step); a drafter of another shape is refused in one line."""
    model, _ = walk_target
    train_s, held_s = walk_samples
    quiet = dict(target=model, log=lambda m: None)
    first = train("unused", train_s, held_s, tmp_path / "a", _cfg(epochs=3), **quiet)
    cont = train("unused", train_s, held_s, tmp_path / "b",
                 _cfg(epochs=1, init_from=str(tmp_path / "a")), **quiet)
    for key in ("accepted", "loss"):
        assert cont.evals[0][key] == pytest.approx(first.evals[-1][key], rel=1e-3)
    fresh = train("unused", train_s, held_s, tmp_path / "c", _cfg(epochs=1), **quiet)
    assert cont.evals[0]["loss"] < 0.9 * fresh.evals[0]["loss"]
    with pytest.raises(ValueError, match="its (layer_types|num_hidden_layers) is"):
        train("unused", train_s, held_s, tmp_path / "d",
              _cfg(epochs=1, layers=2, init_from=str(tmp_path / "a")), **quiet)
    with pytest.raises(ValueError, match="feature scale"):
        _cfg(init_from="x", normalize_features=True)


def test_ce_training_on_cached_labels_with_normalised_features(walk_target, walk_samples,
                                                                tmp_path):
    """The fast recipe (CE on cached target labels, normalised features, bf16 autocast) learns,
    and the exported drafter reads raw features: loaded from disk, it scores the held-out
    answers as the trained one did on normalised ones."""
    from vllm_onlinespec.training.trainer import evaluate

    model, _ = walk_target
    train_s, held_s = walk_samples
    cfg = _cfg(loss_mode="ce", gamma=2.0, normalize_features=True,
               compute_dtype="bfloat16")
    res = train("unused", train_s, held_s, tmp_path / "run", cfg, target=model,
                log=lambda m: None)
    first, last = res.evals[0], res.evals[-1]
    assert last["loss"] < 0.5 * first["loss"]
    assert first["accepted"] < 0.2 and last["accepted"] > 0.5
    state = torch.load(tmp_path / "run" / "train_state" / "state.pt", weights_only=False)
    assert state["feature_scale"] is not None and state["loss_vocab_ids"] is not None
    _, loaded, _ = load_drafter(tmp_path / "run", dtype=torch.float32)
    from vllm_onlinespec.training.trainer import extract_features

    raw = extract_features(model, held_s, loaded.config.target_layer_ids, dtype=torch.float32)
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    ev = evaluate(loaded.float(), None, raw, emb, head, cfg)
    # bf16 export of the folded weights: the same acceptance within rounding.
    assert ev["accepted"] == pytest.approx(last["accepted"], abs=0.05)


def test_training_exports_the_reduced_draft_vocabulary_it_trained(walk_target, walk_samples,
                                                                   tmp_path):
    from vllm_onlinespec.drafter import load_draft_vocab

    model, _ = walk_target
    train_s, held_s = walk_samples
    cfg = _cfg(epochs=1, loss_mode="ce", gamma=7.0, draft_vocab_size=40)
    res = train("unused", train_s, held_s, tmp_path / "run", cfg, target=model,
                log=lambda m: None)
    vocab = load_draft_vocab(tmp_path / "run", dtype=torch.float32)
    state = torch.load(tmp_path / "run" / "train_state" / "state.pt", weights_only=False)
    assert len(vocab) == 40 and torch.equal(vocab.ids, state["loss_vocab_ids"])
    assert 2 in vocab.ids.tolist()  # the target's end-of-sequence token is always in
    torch.testing.assert_close(vocab.weight, model.lm_head.weight[vocab.ids].to(torch.bfloat16).float())
    assert "walk_acceptance" in res.evals[-1]
    with pytest.raises(ValueError, match="--draft-vocab-size needs --loss-mode ce"):
        _cfg(draft_vocab_size=40)


def test_resume_continues_with_identical_state(walk_target, walk_samples, tmp_path):
    model, _ = walk_target
    train_s, held_s = walk_samples
    cfg = _cfg(epochs=2, batch_size=16)  # 4 steps per epoch, 8 in all
    full = train("unused", train_s, held_s, tmp_path / "a", cfg, target=model, log=lambda m: None)
    part = train("unused", train_s, held_s, tmp_path / "b", cfg, target=model, stop_after=5,
                 log=lambda m: None)
    assert part.steps == 5
    msgs: list[str] = []
    rest = train("unused", train_s, held_s, tmp_path / "b", cfg, target=model, log=msgs.append)
    assert any("resumed at step 5" in m for m in msgs) and rest.steps == full.steps == 8
    for (n, x), (_, y) in zip(full.drafter.state_dict().items(), rest.drafter.state_dict().items()):
        assert torch.equal(x, y), n
    for x, y in zip(full.length_head.parameters(), rest.length_head.parameters()):
        assert torch.equal(x, y)
    assert [e["acceptance"] for e in full.evals] == [e["acceptance"] for e in rest.evals]

    def log_rows(d):  # minus wall-clock fields
        rows = [json.loads(x) for x in (tmp_path / d / "train_log.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]
    assert log_rows("a") == log_rows("b")
    with pytest.raises(ValueError, match="other settings"):
        train("unused", train_s, held_s, tmp_path / "b", _cfg(epochs=3, batch_size=16),
              target=model, log=lambda m: None)


# -- command line -------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, msg", [
    (["--out", "X"], "no prompts"),
    (["--out", "X", "--humaneval", "--block-size", "1"], "--block-size must be >= 2"),
    (["--humaneval"], "--out is required"),
    (["--out", "X", "--categories", "qa", "--humaneval"], "--categories needs --spec-bench"),
    (["--out", "X", "--prompts", "/nonexistent.jsonl"], "no such prompt file"),
    (["--out", "X", "--humaneval", "--token-budget", "0"], "--token-budget must be >= 1"),
    (["--out", "X", "--humaneval", "--sampled-answers", "2", "--temperature", "0"],
     "--sampled-answers needs --temperature > 0"),
    (["--out", "X", "--humaneval", "--followups", "-1"], "--followups must be >= 0"),
    (["--out", "X", "--humaneval", "--anchors", "tree-miss", "--tree-min-score", "-1"],
     "--tree-min-score must be >= 0"),
])
def test_cli_one_line_errors(argv, msg, tmp_path, capsys):
    from vllm_onlinespec.cli import main

    argv = [str(tmp_path / a) if a == "X" else a for a in argv]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err


def test_recipes_resolve_and_bench_flags_parse(tmp_path, monkeypatch):
    """Every recipe is a valid set of flags (the benchmarks pass recipe values as flags)."""
    from vllm_onlinespec.bench.cli import recipe_flags, train_flags
    from vllm_onlinespec.cli import build_parser
    from vllm_onlinespec.training.cli import RECIPES, resolve_settings

    question = tmp_path / "question.jsonl"
    question.write_text("")
    monkeypatch.setenv("VLLM_ONLINESPEC_SPEC_BENCH", str(question))
    for name in RECIPES:
        args = build_parser().parse_args(["train", "--recipe", name, "--out", str(tmp_path)])
        s = resolve_settings(args)
        assert s.out == str(tmp_path)
        assert s.spec_bench in (None, str(question))  # a recipe's 'auto': the variable's path
    s = resolve_settings(build_parser().parse_args(
        ["train", "--recipe", "smollm2-default", "--out", "x", "--epochs", "2"]))
    assert s.steps is None and s.epochs == 2  # an explicit --epochs beats a recipe's steps
    assert "math_reasoning" in RECIPES["smollm2-default"]["exclude_categories"]
    flags = train_flags(["humaneval"], None, base={**recipe_flags(), "epochs": 2})
    resolve_settings(build_parser().parse_args(["train", "--out", "x", *flags]))


def _settings(*argv):
    from vllm_onlinespec.cli import build_parser
    from vllm_onlinespec.training.cli import resolve_settings

    return resolve_settings(build_parser().parse_args(["train", "--out", "x", *argv]))


def test_flags_are_generated_from_the_settings(monkeypatch):
    """A flag per field (dashes for underscores) with the field's default; booleans as
    --x/--no-x; 'none' unsets an optional setting; a recipe's value stands unless a flag is
    given; the trainer's part of the settings is what train_config records."""
    from vllm_onlinespec.cli import build_parser
    from vllm_onlinespec.training.settings import TrainerSettings, TrainSettings

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    flags = {s for a in sub.choices["train"]._actions for s in a.option_strings}
    for name in TrainSettings.model_fields:
        assert "--" + name.replace("_", "-") in flags, name
    assert {"--no-humaneval", "--normalize-features", "--recipe"} <= flags
    monkeypatch.delenv("VLLM_ONLINESPEC_SPEC_BENCH", raising=False)
    s = _settings("--threads", "1")
    assert s.model_dump(exclude={"out", "threads"}) == TrainSettings().model_dump(
        exclude={"out", "threads"}) and s.threads == 1
    s = _settings("--recipe", "smollm2-scaled", "--spec-bench", "none", "--no-humaneval",
                  "--prompts", "a.jsonl", "--token-budget", "none", "--mask-token-id", "16")
    assert (s.spec_bench, s.humaneval, s.prompts, s.token_budget) == (None, False, ["a.jsonl"],
                                                                      None)
    assert s.mask_token_id == 16 and s.draft_vocab_size == 8192 and s.steps == 3400
    assert _settings("--recipe", "smollm2-scaled", "--spec-bench", "q", "--epochs", "3").steps is None
    assert _settings("--recipe", "smollm2-small", "--steps", "7").epochs == 2
    assert set(s.trainer_json()) == set(TrainerSettings.model_fields)
    assert s.trainer_json()["layers"] == 1 and "spec_bench" not in s.trainer_json()


@pytest.mark.parametrize("argv, msg", [
    (["--recipe", "smollm2-l3"], "--spec-bench PATH"),
    (["--threads", "0"], "--threads must be >= 1 (got 0)"),
    (["--target-layers", "1,x"], "--target-layers must be 'auto' or comma-separated ints"),
    (["--draft-vocab-size", "8"], "--draft-vocab-size needs --loss-mode ce"),
    (["--top-p", "0"], "--top-p must be > 0"),
])
def test_settings_one_line_errors(argv, msg, monkeypatch):
    monkeypatch.delenv("VLLM_ONLINESPEC_SPEC_BENCH", raising=False)
    with pytest.raises(ValueError) as e:
        _settings(*argv)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_a_bad_recipe_key_fails_in_one_line():
    from vllm_onlinespec.training.settings import Recipe, _checked

    with pytest.raises(ValueError, match="^recipe r: unknown setting 'num_layers'$"):
        _checked({"r": Recipe("why", num_layers=2)})
    with pytest.raises(ValueError, match="^recipe r: --block-size must be >= 2 \\(got 1\\)$"):
        _checked({"r": Recipe("why", block_size=1)})
