"""`--prompts FILE`: the JSONL prompt-file reader (prompt / messages / ShareGPT), its CLI wiring."""

from __future__ import annotations

import gzip
import json

import pytest

from vllm_onlinespec.bench import prompts as P
from vllm_onlinespec.bench.cli import check_stream_source, serving_prompts


def write(tmp_path, rows, name="traffic.jsonl"):
    f = tmp_path / name
    f.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return f


def test_reads_all_three_formats_in_file_order(tmp_path):
    f = write(tmp_path, [
        {"prompt": "Plain prompt.", "id": "a", "category": "misc"},
        "",  # blank lines are skipped, but still counted for line numbers
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hi?"},
                      {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": "And now?"},
                      {"role": "assistant", "content": "dataset answer, not served"}]},
        {"conversations": [{"from": "gpt", "value": "Greeting first."},
                           {"from": "system", "value": "Sys."},
                           {"from": "human", "value": "Q1"},
                           {"from": "gpt", "value": "A1"},
                           {"from": "human", "value": "Q2"},
                           {"from": "gpt", "value": "A2"}]},
    ])
    ps = P.from_file(f)
    assert [p.id for p in ps] == ["file:a", "file:3", "file:4"]
    assert ps[0].messages == [{"role": "user", "content": "Plain prompt."}]
    assert ps[0].category == "misc" and ps[1].category == "traffic"  # default: the file's name
    assert ps[1].messages == [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Hi?"},
                              {"role": "assistant", "content": "Hello."},
                              {"role": "user", "content": "And now?"}]
    # ShareGPT: human -> user, gpt -> assistant, cut after the last human turn; the opening gpt
    # greeting (before any user turn) is dropped, the system prompt kept.
    assert ps[2].messages == [{"role": "system", "content": "Sys."},
                              {"role": "user", "content": "Q1"},
                              {"role": "assistant", "content": "A1"},
                              {"role": "user", "content": "Q2"}]
    assert ps[2].text == "Q1" and ps[2].source == "file"


def test_gzip_file(tmp_path):
    f = tmp_path / "t.jsonl.gz"
    with gzip.open(f, "wt", encoding="utf-8") as g:
        g.write(json.dumps({"prompt": "zipped"}) + "\n")
    [p] = P.from_file(f)
    assert p.text == "zipped" and p.category == "t"


BAD_ROWS = [
    ('{"prompt": "x"', "invalid JSON"),
    ('["prompt", "x"]', "expected a JSON object, got list"),
    ('"just a string"', "expected a JSON object, got str"),
    ({"text": "x", "id": 1}, "none of 'prompt', 'messages', 'conversations' (keys: id, text)"),
    ({"prompt": 3}, "'prompt' must be a string, got int"),
    ({"prompt": "   "}, "'prompt' is empty"),
    ({"messages": "hi"}, "'messages' must be a non-empty list"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": ["hi"]}, "messages[1] is not an object"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[1].role is 'bot'"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[1].content must be a string"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
     "messages[2].content is empty"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
     "'messages' has no user turn"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "system", "content": "t"},
                   {"role": "user", "content": "q"}]}, "2 system turns before the first user"),
    ({"conversations": [{"from": "gpt", "value": "a"}]}, "'conversations' has no human turn"),
    ({"conversations": [{"from": "user", "value": "a"}]}, "conversations[1].from is 'user'"),
    ({"conversations": [{"from": "human", "value": None}]},
     "conversations[1].value must be a string, got NoneType"),
]


@pytest.mark.parametrize("bad,why", BAD_ROWS)
def test_bad_row_is_named_by_file_and_line(tmp_path, bad, why):
    f = write(tmp_path, [{"prompt": "ok"}, "", bad, {"prompt": "never read"}])
    with pytest.raises(P.PromptFileError) as e:
        P.from_file(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}:3: ") and why in msg and "\n" not in msg, msg


def test_missing_empty_and_undecodable_files(tmp_path):
    with pytest.raises(P.PromptFileError, match="no such prompt file"):
        P.from_file(tmp_path / "nope.jsonl")
    with pytest.raises(P.PromptFileError, match="no prompts"):
        P.from_file(write(tmp_path, ["", "  "]))
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(P.PromptFileError, match="unreadable"):
        P.from_file(f)


def test_file_prompts_survive_the_stream_round_trip(tmp_path):
    """What the arm subprocess reads back: the chat messages, unchanged."""
    ps = P.from_file(write(tmp_path, [{"conversations": [{"from": "human", "value": "Q"},
                                                         {"from": "gpt", "value": "A"},
                                                         {"from": "human", "value": "R"}]}]))
    [row] = P.read_stream(P.write_stream(ps, tmp_path / "stream.jsonl"))
    assert [m["content"] for m in row["messages"]] == ["Q", "A", "R"]


def bench_args(**kw):
    from vllm_onlinespec.cli import build_parser

    return build_parser().parse_args(["bench", "--out", "o", *kw.pop("argv", [])])


def test_cli_prompts_replace_the_serving_categories(tmp_path):
    f = write(tmp_path, [{"prompt": "one"}, {"prompt": "two"}])
    args = bench_args(argv=["--prompts", str(f), "--train-categories", "qa"])
    check_stream_source(args)
    assert [p.text for p in serving_prompts(args, None)] == ["one", "two"]
    both = bench_args(argv=["--prompts", str(f), "--serve-categories", "qa"])
    with pytest.raises(ValueError, match="--prompts and --serve-categories"):
        check_stream_source(both)
    # Without --prompts the categories still choose the stream.
    assert [p.category for p in serving_prompts(bench_args(), ["chat"])][:1] == ["chat"]


def test_cli_help_names_the_formats():
    from vllm_onlinespec.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["bench"]
    text = " ".join(sub.format_help().split())
    for word in ("--prompts FILE", "'prompt'", "'messages'", "'conversations'", "ShareGPT"):
        assert word in text, word


def test_cli_bad_file_is_one_line_error(tmp_path, capsys):
    from vllm_onlinespec.cli import main

    f = write(tmp_path, [{"prompt": "ok"}, {"prompt": ""}])
    both = main(["bench", "--out", str(tmp_path / "o"), "--prompts", str(f),
                 "--serve-categories", "qa"])
    assert both == 2 and "--prompts and --serve-categories" in capsys.readouterr().err
    # The file is read before any model is resolved or drafter trained: a bad row fails at once.
    rc = main(["bench", "--out", str(tmp_path / "o"), "--prompts", str(f), "--drafter", "none"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"vllm-onlinespec: error: {f}:2: 'prompt' is empty", err
