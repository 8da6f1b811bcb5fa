"""lab/data_report.py: the data run's page from its prompt manifest, progress and shards."""

import json
import sys
from pathlib import Path

import torch

LAB = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(LAB))

import data_report as D  # noqa: E402


def test_report_projects_hours_and_disk_from_the_chunks(tmp_path):
    from vllm_onlinespec.training.shards import FeatureRow, ShardHeader, ShardWriter

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "manifest.json").write_text(json.dumps({
        "total": 3, "kinds": {"math": 2, "code": 1},
        "sources": {"gsm8k": {"licence": "MIT", "origin": "/somewhere/local", "read": 3,
                              "kept": 3, "deduped": 0, "excluded": 0, "empty": 0,
                              "too_long": 0, "bad_format": 0}}}))
    data = tmp_path / "data"
    header = ShardHeader(target="t", layer_ids=(0,), hidden_size=4)
    for part, n in (("train", 2), ("heldout", 1)):
        w = ShardWriter(data / part, header)
        for i in range(n):  # 10 tokens stored, 5 of them the response
            w.add(FeatureRow(key=f"{part}{i}", ids=torch.arange(10), start=5,
                             aux=torch.zeros(10, 4), final=torch.zeros(10, 4)))
        w.close()
    rows = [{"part": "train", "round": "greedy", "samples": 2, "new": 2, "response_tokens": 10,
             "gen_s": 4.0, "features_s": 1.0, "tok_s": 2.0},
            {"part": "train", "round": "greedy", "samples": 2, "new": 0, "response_tokens": 10,
             "gen_s": 0.1, "features_s": 0.0, "tok_s": None}]  # served from the cache
    (data / "progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert D.main(["--prompts", str(prompts), "--data", str(data), "--budget", "1010",
                   "--box", "test box", "--date", "2026-12-06", "--out", str(out)]) == 0
    s = json.loads((out / "drafter_data.json").read_text())
    assert s["summary"]["tok_s"] == 2.0  # only chunks that generated count
    assert s["summary"]["stored_per_response_token"] == 2.0
    assert s["summary"]["hours_left"] == round(1000 / 2.0 / 3600, 1)
    assert "origin" not in s["sources"]["gsm8k"]  # no local paths in a published page
    md = (out / "drafter_data.md").read_text()
    assert "| gsm8k | MIT | 3 | 3 |" in md and "/somewhere" not in md
