"""`vllm serve` as a subprocess on 127.0.0.1 answers an OpenAI chat completion, then exits cleanly."""

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port

pytestmark = pytest.mark.vllm


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError("vllm serve did not become healthy")


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    from vllm_onlinespec.engine import serve_args

    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [str(Path(sys.executable).parent / "vllm"), "serve", smollm2_path, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--served-model-name", "smollm2",
           *serve_args(max_model_len=512)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    except Exception:
        proc.kill()
        print(log.read_text()[-5000:])
        raise
    yield f"http://127.0.0.1:{port}", proc, log
    if proc.poll() is None:
        proc.kill()


def test_openai_chat_completion_then_clean_shutdown(server):
    from openai import OpenAI

    url, proc, log = server
    client = OpenAI(base_url=url + "/v1", api_key="none")
    r = client.chat.completions.create(model="smollm2", temperature=0.0, max_tokens=16,
                                       messages=[{"role": "user", "content": "Say hello."}])
    assert r.choices[0].message.content.strip()
    assert r.usage.completion_tokens > 0
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
