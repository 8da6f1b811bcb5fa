"""What the README tells a user to run exists: every `vllm-onlinespec` verb and flag it names is
one the CLI accepts, every `make` target is in the Makefile, every `python -m` module and
`examples/` file is there, and every relative link resolves."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

from vllm_onlinespec.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    (action,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _commands(prefix: str) -> list[list[str]]:
    """Each README command `prefix VERB ...`, to the line's end or a shell separator (`docker
    build -t vllm-onlinespec .` names the image, not a verb)."""
    out = []
    for line in README.splitlines():
        for m in re.finditer(re.escape(prefix) + r"[a-z][^`#|;)>\n]*", line):
            out.append(shlex.split(m.group(0).replace("$(", " ").replace("\\", " ")))
    return out


def test_every_verb_and_flag_the_readme_names_exists():
    verbs = _subparsers()
    cmds = _commands("vllm-onlinespec ")
    assert len(cmds) >= 5, cmds
    for argv in cmds:
        verb = argv[1]
        assert verb in verbs, f"README runs `vllm-onlinespec {verb}`, which the CLI lacks"
        flags = {s for a in verbs[verb]._actions for s in a.option_strings}
        for tok in argv[2:]:
            if tok.startswith("--"):
                assert tok.split("=")[0] in flags, f"`vllm-onlinespec {verb}` has no {tok}"
        if verb == "train" and "--recipe" in argv:
            from vllm_onlinespec.training.cli import RECIPES

            assert argv[argv.index("--recipe") + 1] in RECIPES


def test_make_targets_modules_examples_and_links_exist():
    makefile = (REPO / "Makefile").read_text()
    for target in set(re.findall(r"\bmake ([a-z][a-z-]*)", README)):
        assert re.search(rf"^{target}:", makefile, re.M), f"README names `make {target}`"
    modules = set(re.findall(r"python -m ([\w.]+)", README))
    assert modules
    for mod in modules:
        assert importlib.util.find_spec(mod) is not None, f"README runs `python -m {mod}`"
    for path in set(re.findall(r"`(examples/[\w./-]+)`", README)):
        assert (REPO / path).is_file(), f"README names {path}"
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if not re.match(r"https?://", link)]
    assert local
    for link in local:
        assert (REPO / link).exists(), f"README links {link}, which is not in the repository"
