"""The CPU examples run as written: the offline LLM.chat one, the `vllm serve` + OpenAI client
script, the `vllm bench serve --dataset-name spec_bench` one and the in-flight target swap.
Short answers keep each under ~90 s on the 2-core box. The two shell examples share one `vllm
serve` (examples/_server.sh uses a server already healthy on PORT; the one start is the same
function they call alone); the two Python examples run vLLM's in-process engine core
(VLLM_ENABLE_V1_MULTIPROCESSING=0: ~20 s less per start on 2 cores; the multiprocess layout users
run is what the shell examples and the wheel's soak serve)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_script(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """A shell example as a user runs it: the venv's bin first on PATH (vllm, vllm-onlinespec)."""
    from conftest import free_port

    bin_dir = str(Path(sys.executable).parent)
    full = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "PORT": str(free_port()), "LOG": os.devnull, **env}
    return subprocess.run(["bash", *argv], capture_output=True, text=True, timeout=420, env=full)


IN_PROCESS = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_offline_chat_online_example_learns_and_answers(smollm2_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "offline_chat_online.py"),
                        "--max-tokens", "32"], capture_output=True, text=True, timeout=300,
                       cwd=EXAMPLES, env=IN_PROCESS)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rounds = re.findall(r"^round (\d): (\d+) tokens .* acceptance length ([0-9.]+) \((\d+) "
                        r"verify steps with drafts, K = (\d+)\), drafter version (\d+)",
                        r.stdout, re.M)
    assert [x[0] for x in rounds] == ["1", "2", "3"], r.stdout
    # Speculation really ran (the budget may give a whole round to plain steps, not all three),
    # and where it did the acceptance length is a real one: 1 + accepted per verify step, at
    # most K + 1.
    assert any(int(steps) > 0 for _, _, _, steps, _, _ in rounds), r.stdout
    for _, n, acc, steps, k, _ in rounds:
        assert int(n) > 0, r.stdout
        if int(steps) > 0:
            assert 1.0 <= float(acc) <= int(k) + 1, r.stdout
    final = re.search(r"^final: drafter version (\d+), learner updates (\d+), .* hook errors (\d+)",
                      r.stdout, re.M)
    assert final, r.stdout
    assert int(final.group(1)) >= 1 and int(final.group(2)) >= 1, final.group(0)
    assert final.group(3) == "0"
    assert r.stdout.count(">>> ") == 9  # every prompt answered


@pytest.fixture(scope="module")
def shell_examples(smollm2_path, spec_bench_questions):
    """serve_openai.sh, then bench_serve_spec_bench.sh, against one server started by the
    examples' own start_server (serve_openai.sh's flags); each part's output apart."""
    from conftest import SPEC_BENCH

    script = (f'cd {EXAMPLES} && source _server.sh && '
              "start_server '{\"onlinespec\": {\"preset\": \"cpu\"}}' "
              "--worker-cls vllm_onlinespec.SpecDecodeWorker && "
              'MAX_TOKENS=16 bash serve_openai.sh && echo "=== bench ===" && '
              f'OUTPUT_LEN=16 bash bench_serve_spec_bench.sh {SPEC_BENCH} 4 2')
    r = run_script(["-c", script])
    serve, _, bench = r.stdout.partition("=== bench ===")
    return r, serve, bench


def test_serve_openai_example_answers_and_reports_the_drafter(shell_examples):
    r, out, _ = shell_examples
    assert "using the vllm server already on port" in out, out  # the shared server, not a second
    assert out.count(">>> ") == 4, r.stdout[-2000:] + r.stderr[-4000:]  # every question answered
    m = re.search(r"^drafter version: ([0-9.]+), learner updates: ([0-9.]+)", out, re.M)
    assert m, out  # the onlinespec metrics are on the server's /metrics
    assert re.search(r"^acceptance length so far: [0-9.]+", out, re.M), out


def test_bench_serve_spec_bench_example(shell_examples):
    r, _, out = shell_examples
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert re.search(r"Successful requests:\s+4\b", out), out[-3000:]
    assert re.search(r"^onlinespec:drafter_version\S* [0-9.]+", out, re.M), out[-3000:]


def test_swap_target_example_serves_both_targets(smollm2_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "swap_target.py"), "--max-tokens", "24"],
                       capture_output=True, text=True, timeout=420, cwd=EXAMPLES, env=IN_PROCESS)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert re.search(r"^swapped in [0-9.]+ s, \d+ stale feedback tokens dropped", r.stdout, re.M), r.stdout
    phases = re.findall(r"^--- (base|swapped): drafter version \d+, learner share ([0-9.]+)",
                        r.stdout, re.M)
    assert [p for p, _ in phases] == ["base", "swapped"], r.stdout
    assert r.stdout.count(">>> ") == 6, r.stdout  # every question answered in both phases
