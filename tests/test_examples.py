"""The CPU examples run as written. The offline one is run here (one engine start); the
`vllm serve` + OpenAI client path is the one tests/test_serve.py covers."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_offline_chat_online_example_learns_and_answers(smollm2_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "offline_chat_online.py"),
                        "--max-tokens", "32"], capture_output=True, text=True, timeout=300,
                       cwd=EXAMPLES)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rounds = re.findall(r"^round (\d): (\d+) tokens .* acceptance length ([0-9.]+), drafter "
                        r"version (\d+)", r.stdout, re.M)
    assert [x[0] for x in rounds] == ["1", "2", "3"], r.stdout
    assert all(int(n) > 0 for _, n, _, _ in rounds)
    assert all(float(a) >= 1.0 for _, _, a, _ in rounds)
    final = re.search(r"^final: drafter version (\d+), learner updates (\d+), .* hook errors (\d+)",
                      r.stdout, re.M)
    assert final, r.stdout
    assert int(final.group(1)) >= 1 and int(final.group(2)) >= 1, final.group(0)
    assert final.group(3) == "0"
    assert r.stdout.count(">>> ") == 9  # every prompt answered
