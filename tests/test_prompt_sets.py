"""The prompt-set builder (training/prompt_sets.py): served-as-unseen prompts stay out, dedup,
bad inputs skipped and counted. Fast, no model, no engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHARED, SPEC_BENCH

from vllm_onlinespec.training import prompt_sets as P

GSM8K = SHARED / "data" / "gsm8k" / "train.jsonl"


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def quiet(*_):
    pass


def built(out: Path) -> list[dict]:
    return P.read_prompts(out / "prompts.jsonl")


# ---- the exclusion list -----------------------------------------------------------------------

def test_synthetic_build_keeps_excluded_prompts_out(tmp_path):
    served = ["What is the capital of France?", "Summarize: " + "a long article. " * 40]
    ex = P.Exclusions([P._entry(t, f"served:{i}", "test served") for i, t in enumerate(served)])
    src = write_jsonl(tmp_path / "s.jsonl", [
        {"prompt": "what is the   CAPITAL of france?"},  # case / whitespace variant of a served one
        {"prompt": "Summarize: " + "a long article. " * 40 + "Be brief."},  # same head (near-dup)
        {"prompt": "An unrelated question about trees?"},
    ])
    m = P.build([P.jsonl_source(src, name="s", kind="qa", licence="MIT")], tmp_path / "out", ex,
                log=quiet)
    assert [r["messages"][0]["content"] for r in built(tmp_path / "out")] == [
        "An unrelated question about trees?"]
    assert m["sources"]["s"]["excluded"] == 2 and m["sources"]["s"]["kept"] == 1
    assert P.check_against(tmp_path / "out" / "prompts.jsonl", ex) == []


def test_shipped_exclusions_hold_what_the_repo_serves_as_unseen():
    """The shipped file lists every prompt the project serves as unseen: rebuilt here from the
    sources themselves (Spec-Bench and GSM8K when shared/data is present)."""
    shipped = P.load_exclusions()
    sb = SPEC_BENCH if SPEC_BENCH.is_file() else None
    gsm = GSM8K if GSM8K.is_file() else None
    rebuilt = P.exclusion_entries(spec_bench=sb, gsm8k=gsm)
    have = {e["sha256"] for e in shipped.entries}
    missing = [e["where"] for e in rebuilt if e["sha256"] not in have]
    assert not missing, f"exclusions.jsonl is stale (rebuild: vllm-onlinespec prompts " \
                        f"exclusions --spec-bench ... --gsm8k ... --write): {missing[:5]}"
    whys = {e["why"].split(":")[0] for e in shipped.entries}
    assert {"the shipped drafter's held-out prompts", "Spec-Bench", "HumanEval",
            "built-in chat prompts", f"GSM8K served slice (last {P.GSM8K_SERVED} lines)"} <= whys


def test_what_the_repo_serves_is_excluded_by_the_shipped_file():
    """Each served stream, as the benchmarks build it, hits the shipped list."""
    from vllm_onlinespec.bench import prompts as BP
    from vllm_onlinespec.training.data import load_humaneval

    ex = P.load_exclusions()
    served = [p.text for p in BP.builtin_chat()] + [p.text for p in load_humaneval()]
    for held in sorted((Path(P.__file__).parents[1] / "drafters").glob("*/heldout_prompts.jsonl")):
        served += [json.loads(ln)["messages"][0]["content"] for ln in held.read_text().splitlines()
                   if ln.strip()]
    if SPEC_BENCH.is_file():
        from vllm_onlinespec.bench.demo import SERVE_CATEGORIES

        served += [p.text for p in BP.spec_bench(str(SPEC_BENCH), SERVE_CATEGORIES)]
        served += [p.text for p in BP.spec_bench(str(SPEC_BENCH), None)]
    if GSM8K.is_file():
        slice_ = P.gsm8k_served_slice(GSM8K)
        assert len(slice_) == P.GSM8K_SERVED
        assert slice_[-1]["id"] == "gsm8k-train:7472"  # the file's last problem, by index
        served += [r["prompt"] for r in slice_]
    assert served and all(ex.hit(t) is not None for t in served)
    assert all(ex.hit(t.upper() + "  ") is not None for t in served[:50])  # normalised


def test_a_build_of_served_prompts_keeps_none(tmp_path):
    from vllm_onlinespec.bench.prompts import BUILTIN_CHAT

    rows = [{"prompt": t} for t in BUILTIN_CHAT] + [{"prompt": "A prompt nobody serves."}]
    src = write_jsonl(tmp_path / "s.jsonl", rows)
    P.build([P.jsonl_source(src, name="s", kind="chat", licence="MIT")], tmp_path / "o", log=quiet)
    assert [r["messages"][0]["content"] for r in built(tmp_path / "o")] == ["A prompt nobody serves."]
    assert P.check_against(tmp_path / "o" / "prompts.jsonl", P.load_exclusions()) == []


def test_gsm8k_source_never_reads_the_served_slice(tmp_path):
    f = write_jsonl(tmp_path / "g.jsonl", [{"id": f"gsm8k-train:{i}", "prompt": f"Problem {i}: how many?"}
                                           for i in range(10)])
    rows = list(P.gsm8k_source(f, served=3).rows())
    assert [r.text for r in rows] == [f"Problem {i}: how many?" for i in range(7)]
    assert {r.kind for r in rows} == {"math"}
    assert [r["prompt"] for r in P.gsm8k_served_slice(f, served=3)] == [
        f"Problem {i}: how many?" for i in (7, 8, 9)]
    ex = P.Exclusions(P.exclusion_entries(spec_bench=None, gsm8k=f, humaneval=False,
                                          gsm8k_served=3))
    assert ex.hit("Problem 9: how many?") and not ex.hit("Problem 6: how many?")


# ---- dedup ------------------------------------------------------------------------------------

def test_dedup_exact_normalised_and_near(tmp_path):
    long_doc = "word " * 100
    a = write_jsonl(tmp_path / "a.jsonl", [
        {"prompt": "Tell me a joke."},
        {"prompt": "  tell ME a   joke. "},  # normalised duplicate
        {"prompt": long_doc + "Question one?"},
        {"prompt": long_doc + "Question two?"},  # same first 200 chars: near-duplicate
        {"prompt": "Instruction A.\n" + long_doc},
        {"prompt": "Instruction B.\n" + long_doc},  # same last 200 chars: near-duplicate
    ])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "tell me a joke."}, {"prompt": "New one."}])
    m = P.build([P.jsonl_source(a, name="a", kind="chat", licence="x"),
                 P.jsonl_source(b, name="b", kind="chat", licence="y")], tmp_path / "o",
                P.Exclusions(), log=quiet)
    texts = [r["messages"][0]["content"] for r in built(tmp_path / "o")]
    assert texts == ["Tell me a joke.", long_doc + "Question one?", "Instruction A.\n" + long_doc,
                     "New one."]  # first occurrence wins, across sources too
    assert (m["sources"]["a"]["deduped"], m["sources"]["b"]["deduped"]) == (3, 1)
    assert m["total"] == 4 and m["kinds"] == {"chat": 4}
    assert m["sources"]["b"]["licence"] == "y"


def test_a_template_head_shared_by_many_texts_is_not_a_duplicate(tmp_path):
    head = "Pick one category for the following text. The options are: " + "x, " * 60
    rows = [{"prompt": head + f"\nItem number {i} about topic {i * 7}."} for i in range(P.TEMPLATE_MIN)]
    f = write_jsonl(tmp_path / "t.jsonl", rows + rows[:2])
    m = P.build([P.jsonl_source(f, name="t", kind="instructions", licence="x")], tmp_path / "o",
                P.Exclusions(), log=quiet)
    assert m["sources"]["t"]["kept"] == P.TEMPLATE_MIN and m["sources"]["t"]["deduped"] == 2


# ---- bad inputs -------------------------------------------------------------------------------

def test_bad_inputs_are_counted_and_skipped(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt": "   "},  # empty
        {"prompt": "x" * 50},  # too long for max_chars=40
        {"messages": [{"role": "wizard", "content": "hi"}]},  # unknown role
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"text": "no known field"},
        "not json at all {",
        "[1, 2]",
        {"prompt": "A fine prompt."},
        {"turns": ["First turn.", "Second turn."]},
    ])
    m = P.build([P.jsonl_source(f, name="bad", kind="chat", licence="x")], tmp_path / "o",
                P.Exclusions(), max_chars=40, log=quiet)
    c = m["sources"]["bad"]
    assert (c["read"], c["empty"], c["too_long"], c["bad_format"], c["kept"]) == (9, 1, 1, 5, 2)
    rows = built(tmp_path / "o")
    assert rows[1]["kind"] == "multi-turn" and rows[1]["turns"] == ["First turn.", "Second turn."]
    from vllm_onlinespec.training.data import load_jsonl  # the trainer reads the file as is

    got = load_jsonl(tmp_path / "o" / "prompts.jsonl")
    assert [(p.text, p.category, p.next_turns) for p in got] == [
        ("A fine prompt.", "chat", ()), ("First turn.", "multi-turn", ("Second turn.",))]
    assert m["kinds"] == {"chat": 1, "multi-turn": 1}


def test_unknown_kind_and_missing_files_are_clear_errors(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hi there"}])
    with pytest.raises(ValueError, match="unknown kind"):
        P.jsonl_source(f, name="a", kind="poetry", licence="x")
    with pytest.raises(FileNotFoundError):
        P.jsonl_source(tmp_path / "nope.jsonl", name="a", kind="chat", licence="x")
    with pytest.raises(ValueError, match="unknown kinds"):
        P.build([], tmp_path / "o", P.Exclusions(), drop_kinds=["poetry"], log=quiet)


def test_drop_kinds(tmp_path):
    f = write_jsonl(tmp_path / "g.jsonl", [{"prompt": f"Problem {i}"} for i in range(5)])
    m = P.build([P.gsm8k_source(f, served=1)], tmp_path / "o", P.Exclusions(),
                drop_kinds=["math"], log=quiet)
    assert m["total"] == 0 and m["sources"]["gsm8k"]["dropped_kind"] == 4


# ---- the other loaders and the CLI --------------------------------------------------------------

def test_t0_reads_only_licence_cleared_datasets(tmp_path):
    d = tmp_path / "t0"
    d.mkdir()
    write_jsonl(d / "cnn_dailymail_3_0_0_tldr_summary.jsonl", [{"prompt": "TLDR: an article."}])
    write_jsonl(d / "samsum_Summarize_.jsonl", [{"prompt": "Summarize this dialogue."}])  # NC
    srcs = P.t0_sources(d)
    assert [s.name for s in srcs] == ["t0/cnn_dailymail"]
    assert [(r.kind, r.text) for r in srcs[0].rows()] == [("summarisation", "TLDR: an article.")]


def test_stdlib_code_source(tmp_path):
    (tmp_path / "os.py").write_text("")
    (tmp_path / "m.py").write_text('def add(a, b):\n    """Add two numbers and return the sum '
                                   'of them, as an int or a float."""\n    c = a + b\n    return c\n'
                                   'def _private(x):\n    """Hidden helper that nobody should '
                                   'ever call directly."""\n    y = x\n    return y\n')
    rows = list(P.stdlib_code_source(tmp_path).rows())
    assert len(rows) == 1 and rows[0].kind == "code" and rows[0].id == "stdlib_code:m.py:1"
    assert "add" in rows[0].text


def test_cli_build(tmp_path, capsys):
    from vllm_onlinespec.cli import main

    f = write_jsonl(tmp_path / "self.jsonl", [{"prompt": "Write a haiku about rain."},
                                              {"prompt": "Give me three tips for a good night's sleep."}])
    out = tmp_path / "set"
    assert main(["prompts", "build", "--out", str(out), "--jsonl",
                 f"self:chat:the target's own output={f}"]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["total"] == 1 and man["sources"]["self"]["excluded"] == 1  # a built-in chat prompt
    assert main(["prompts", "build", "--out", str(out)]) == 2  # no source
    assert main(["prompts", "build", "--out", str(out), "--jsonl", "self=x"]) == 2
