"""The feature log (training/feature_log.py): rows vLLM's worker logs per step come back as
whole sequences keyed by their token ids; recomputed requests overwrite, requests with a gap
are dropped, a file for other layers or a damaged file fails with one line naming it; and
dataset.from_feature_log turns logged sequences into feature shards."""

import pytest
import torch

from vllm_onlinespec.training.dataset import from_feature_log
from vllm_onlinespec.training.feature_log import (FeatureLogError, FeatureLogWriter, ids_key,
                                                  read_feature_log)
from vllm_onlinespec.training.generate import Sample
from vllm_onlinespec.training.shards import ShardHeader, ShardWriter, load_rows

F, H = 6, 2  # aux width (3 layers x 2), hidden size
LAYERS = [0, 1, 2]


def feats(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features that encode (token, position): a wrong row or a shifted position shows."""
    t = torch.tensor(ids, dtype=torch.int64)
    pos = torch.arange(len(ids), dtype=torch.float32)
    aux = torch.stack([t.float() + 0.01 * pos] * F, dim=-1)
    return t, aux, aux[:, :H] * 2


def log_steps(w: FeatureLogWriter, req: str, ids: list[int], steps: list[tuple[int, int]]):
    t, aux, fin = feats(ids)
    for s, e in steps:
        w.add(req, s, t[s:e], aux[s:e], fin[s:e])


def test_round_trip_across_files_and_requests(tmp_path):
    w = FeatureLogWriter(tmp_path, LAYERS, H, flush_tokens=5)  # several files
    a, b = [5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23]
    # Interleaved like a batch: a prefill chunk each, then one token per step.
    log_steps(w, "a", a, [(0, 4)])
    log_steps(w, "b", b, [(0, 2)])
    for i in range(3):
        log_steps(w, "a", a, [(4 + i, 5 + i)])
        if i < 2:
            log_steps(w, "b", b, [(2 + i, 3 + i)])
    w.close()
    assert w.files >= 2 and w.rows_written == len(a) + len(b)
    got = read_feature_log(tmp_path, LAYERS, H)
    assert (got.requests, got.dropped, got.files) == (2, 0, w.files)
    for ids in (a, b):
        seq = got.sequences[ids_key(ids)]
        t, aux, fin = feats(ids)
        assert seq.ids.tolist() == ids
        assert torch.equal(seq.aux, aux) and torch.equal(seq.final, fin)


def test_recompute_overwrites_and_gaps_are_dropped(tmp_path):
    w = FeatureLogWriter(tmp_path, LAYERS, H)
    a = [1, 2, 3, 4, 5]
    t, aux, fin = feats(a)
    w.add("a", 0, t[:3], aux[:3] + 100, fin[:3] + 100)  # stale rows before a preemption
    w.add("a", 0, t[:4], aux[:4], fin[:4])  # recomputed from position 0
    w.add("a", 4, t[4:], aux[4:], fin[4:])
    tg, ag, fg = feats([7, 8, 9])
    w.add("gap", 2, tg[2:], ag[2:], fg[2:])  # positions 0-1 came from the prefix cache
    w.close()
    got = read_feature_log(tmp_path, LAYERS, H)
    assert (got.requests, got.dropped, len(got.sequences)) == (2, 1, 1)
    seq = got.sequences[ids_key(a)]
    assert torch.equal(seq.aux, aux) and torch.equal(seq.final, fin)


def test_two_engines_share_a_folder(tmp_path):
    for _ in range(2):  # the same request id in two runs is two requests
        w = FeatureLogWriter(tmp_path, LAYERS, H)
        log_steps(w, "0", [1, 2, 3], [(0, 3)])
        w.close()
    got = read_feature_log(tmp_path, LAYERS, H)
    assert got.requests == 2 and got.dropped == 0


def test_wrong_layers_and_damaged_files_name_the_file(tmp_path):
    w = FeatureLogWriter(tmp_path, LAYERS, H)
    log_steps(w, "a", [1, 2], [(0, 2)])
    path = w.flush()
    with pytest.raises(FeatureLogError, match=f"{path.name}.*target layers \\[0, 1, 2\\].*"
                                              "expected \\[0, 1, 3\\]"):
        read_feature_log(tmp_path, [0, 1, 3], H)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(FeatureLogError, match=f"{path.name}: unreadable"):
        read_feature_log(tmp_path, LAYERS, H)
    with pytest.raises(ValueError, match="3 ids but 2 aux"):
        w.add("a", 0, torch.tensor([1, 2, 3]), torch.zeros(2, F), torch.zeros(3, H))


def test_from_feature_log_writes_shards_without_the_last_token(tmp_path):
    prompt, resp = [1, 2, 3], [4, 5, 6]
    ids = prompt + resp
    w = FeatureLogWriter(tmp_path / "log", LAYERS, H)
    log_steps(w, "a", ids[:-1], [(0, 3), (3, 4), (4, 5)])  # the last token is never fed
    w.close()
    logged = read_feature_log(tmp_path / "log", LAYERS, H)
    hit = Sample(prompt_id="p", ids=ids, start=3, sample=0)
    miss = Sample(prompt_id="q", ids=[9, 9, 9, 9], start=2, sample=0)
    header = ShardHeader(target="t", layer_ids=tuple(LAYERS), hidden_size=H,
                         feature_dtype="float32")
    writer = ShardWriter(tmp_path / "shards", header)
    assert from_feature_log([hit, miss], logged, writer) == 1
    assert hit.key in writer.done and miss.key not in writer.done
    writer.close()
    (row,) = load_rows(tmp_path / "shards", header, [hit.key])
    t, aux, fin = feats(ids[:-1])
    assert row.ids.tolist() == ids[:-1] and row.start == 3
    assert torch.equal(row.aux, aux) and torch.equal(row.final, fin)
    assert from_feature_log([hit], logged, writer) == 0  # already in the shards: not again
