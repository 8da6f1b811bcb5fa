"""Chat with a `vllm serve` that speculates with a drafter learning online (see serve_openai.sh).

    python examples/openai_client.py [--base-url http://127.0.0.1:8000] [--max-tokens 128]

Plain OpenAI client calls; afterwards it reads the server's /metrics, where vllm-onlinespec
publishes the drafter version and its learner counters next to vLLM's own metrics.
"""

from __future__ import annotations

import argparse
import re
import urllib.request

from openai import OpenAI

QUESTIONS = ["Say hello in three languages.", "Why do leaves change color in autumn?",
             "Write a two-line poem about coffee.", "Give me three tips for learning to cook."]


def metric(base_url: str, name: str) -> float | None:
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    vals = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)
    return sum(float(v) for v in vals) if vals else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url + "/v1", api_key="unused")
    for q in QUESTIONS:
        r = client.chat.completions.create(model=args.model, temperature=0.0,
                                           max_tokens=args.max_tokens,
                                           messages=[{"role": "user", "content": q}])
        print(f">>> {q}\n{r.choices[0].message.content.strip()}\n")
    acc = metric(args.base_url, "vllm:spec_decode_num_accepted_tokens_total")
    drafts = metric(args.base_url, "vllm:spec_decode_num_drafts_total")
    if drafts:
        print(f"acceptance length so far: {(acc + drafts) / drafts:.2f} tokens per verify step")
    print(f"drafter version: {metric(args.base_url, 'onlinespec:drafter_version')}, "
          f"learner updates: {metric(args.base_url, 'onlinespec:learner_updates_total')}")


if __name__ == "__main__":
    main()
