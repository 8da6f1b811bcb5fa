"""Does drafter-invariant verification accept a greedy (deterministic) draft more often than
vLLM's rejection sampling? Offline, no engine: the two verification rules on the real target's
logits (SmolLM2-135M-Instruct, float32), many independent seeds.

For a deterministic draft d both rules accept with probability p(d): rejection sampling
without draft probabilities accepts iff u <= p(d) (vLLM's NO_DRAFT_PROBS path), the invariant
rule iff argmax(log p + G) = d, which has probability p(d) for Gumbel noise G. This script
measures both on the same logits:

  positions  the target's logits at every position of a few sampled continuations (one
             teacher-forced forward per text), drafts = the target's top-1 and top-2 token
             there; per seed, each position is verified once by each rule: vLLM's own
             `rejection_sample` (the CPU kernel fallbacks, one draft per request) and
             `invariant_tokens` (vllm_onlinespec/sampling/invariant.py). Reported: the
             acceptance rate per rule (mean over seeds, SD across seeds), and E[p(d)].
  chain      speculative decoding end to end at K drafts per step with a greedy drafter (the
             target's own argmax continuation, the best greedy drafter there is): each rule
             samples its own text, seed by seed; accept_len (tokens per verify step) per seed,
             mean, SD and min-max across seeds: the spread a one-text-per-request served
             comparison does not see.

    .venv/bin/python lab/greedy_draft_acceptance.py \
        --spec-bench $SPEC_BENCH --out runs/greedy_accept --publish

With --publish the result goes into docs/results/seeded_sampling.md (its own section) and
seeded_sampling.json (key "greedy_draft_acceptance").
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SECTION = "greedy_draft_acceptance"
BEGIN, END = f"<!-- {SECTION}: begin -->", f"<!-- {SECTION}: end -->"


# -- the two rules ---------------------------------------------------------------------------

def _cpu_kernels() -> None:
    """vLLM's CPU fallbacks for its Triton kernels (what a CPU worker registers)."""
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.register_triton_kernel_overrides()


def _metadata(temps: list[float], gens: dict[int, torch.Generator]):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    b = len(temps)
    return SamplingMetadata(
        temperature=torch.tensor(temps), all_greedy=False, all_random=True, top_p=None,
        top_k=None, generators=gens, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(b),
        presence_penalties=torch.zeros(b), repetition_penalties=torch.ones(b),
        output_token_ids=[[] for _ in range(b)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def rejection_rows(processed: torch.Tensor, drafts: list[list[int]], bonus: list[int],
                   seeds: list[int]) -> list[list[int]]:
    """vLLM's rejection_sample, no draft probabilities (a greedy drafter), one request per
    entry of `drafts`; `processed`: the requests' draft-position rows (temperature applied),
    request-major. Returns each request's emitted tokens."""
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample

    counts = [len(d) for d in drafts]
    gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
    out = rejection_sample(
        torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
        counts, max(counts), torch.tensor(counts).cumsum(0).to(torch.int32), None,
        processed.contiguous(), torch.tensor(bonus, dtype=torch.int32)[:, None],
        _metadata([1.0] * len(drafts), gens))
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()]


def invariant_rows(processed: torch.Tensor, drafts: list[list[int]], seeds: list[int],
                   positions: list[int]) -> list[list[int]]:
    """The invariant rule (sampling/invariant.py): `processed` holds len(d) + 1 rows per
    request (its draft positions, then the bonus one)."""
    from vllm_onlinespec.sampling.invariant import PLACEHOLDER, invariant_tokens, verify_rows

    s = [seed for seed, d in zip(seeds, drafts) for _ in range(len(d) + 1)]
    p = [pos + j for pos, d in zip(positions, drafts) for j in range(len(d) + 1)]
    toks = invariant_tokens(processed, torch.tensor(s), torch.tensor(p)).tolist()
    rows = verify_rows(drafts, toks, max(len(d) for d in drafts) + 1)
    return [[t for t in r if t != PLACEHOLDER] for r in rows]


# -- the target -------------------------------------------------------------------------------

def load_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_onlinespec.models import pull

    path = pull("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, model


def prompt_ids(tok, text: str) -> list[int]:
    chat = tok.apply_chat_template([{"role": "user", "content": text}],
                                   add_generation_prompt=True, tokenize=False)
    return tok.encode(chat, add_special_tokens=False)


@torch.no_grad()
def sampled_text(model, ids: list[int], n: int, seed: int) -> list[int]:
    """ids + n tokens sampled from the target (temperature 1), one forward per token."""
    g = torch.Generator().manual_seed(seed)
    res = model(torch.tensor([ids]), use_cache=True)
    out, cache = list(ids), res.past_key_values
    for _ in range(n):
        t = int(torch.multinomial(torch.softmax(res.logits[0, -1].float(), -1), 1, generator=g))
        out.append(t)
        res = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        cache = res.past_key_values
    return out


# -- positions --------------------------------------------------------------------------------

@torch.no_grad()
def positions_run(model, texts: list[tuple[list[int], int]], temps: list[float], seeds: int
                  ) -> list[dict]:
    """texts: (ids, prompt length). Every continuation position, each rule, each seed."""
    from vllm_onlinespec.sampling.invariant import invariant_tokens

    logits, pos = [], []
    for ids, n_prompt in texts:
        x = model(torch.tensor([ids])).logits[0].float()  # row t predicts position t + 1
        logits.append(x[n_prompt - 1:len(ids) - 1])
        pos += list(range(n_prompt, len(ids)))
    logits = torch.cat(logits)
    n = logits.shape[0]
    rows = []
    for temp in temps:
        x = logits / temp
        p = torch.softmax(x, -1)
        top2 = x.topk(2, dim=-1).indices
        for rank, label in ((0, "top-1"), (1, "top-2")):
            d = top2[:, rank]
            expected = float(p.gather(1, d[:, None]).mean())
            rates = {"rejection": [], "invariant": []}
            for s in range(seeds):
                req_seeds = [1_000_003 * s + i for i in range(n)]
                drafts = [[int(t)] for t in d]
                # the invariant rule accepts iff its token at the position is the draft
                inv = invariant_tokens(x, torch.tensor(req_seeds), torch.tensor(pos))
                rej = rejection_rows(x.clone(), drafts, [0] * n, req_seeds)
                rates["invariant"].append(float((inv == d).double().mean()))
                rates["rejection"].append(sum(r[0] == dd[0] for r, dd in zip(rej, drafts)) / n)
            row = {"temperature": temp, "draft": label, "positions": n, "seeds": seeds,
                   "expected_p_draft": expected}
            for rule, r in rates.items():
                row[rule] = {"mean": statistics.mean(r), "sd_across_seeds": statistics.stdev(r),
                             "se": statistics.stdev(r) / math.sqrt(seeds)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


# -- chain ------------------------------------------------------------------------------------

@torch.no_grad()
def chain_run(model, ids: list[int], rule: str, temp: float, seed: int, k: int, n: int
              ) -> tuple[int, int]:
    """Speculative decoding of n tokens after `ids` with the target's greedy continuation as
    the K-token draft, verified by `rule`. Returns (verify steps, drafts accepted)."""
    ids = list(ids)
    res = model(torch.tensor([ids]), use_cache=True)
    cache, cur = res.past_key_values, res.logits[0, -1].float()
    gen = torch.Generator().manual_seed(seed)
    # the first token: a plain step (no drafts), each rule's own sample
    if rule == "invariant":
        first = invariant_rows(cur[None] / temp, [[]], [seed], [len(ids)])[0][0]
    else:
        first = int(torch.multinomial(torch.softmax(cur / temp, -1), 1, generator=gen))
    ids.append(first)
    res = model(torch.tensor([[first]]), past_key_values=cache, use_cache=True)
    cache, cur = res.past_key_values, res.logits[0, -1].float()
    steps = accepted = 0
    start = len(ids) - 1
    while len(ids) - start < n:
        rows, drafts, x = [cur], [], cur
        for _ in range(k):  # the greedy drafter: the target's own argmax continuation
            d = int(x.argmax())
            drafts.append(d)
            res = model(torch.tensor([[d]]), past_key_values=cache, use_cache=True)
            cache, x = res.past_key_values, res.logits[0, -1].float()
            rows.append(x)
        processed = torch.stack(rows) / temp  # positions len(ids) .. len(ids) + k
        if rule == "invariant":
            emitted = invariant_rows(processed, [drafts], [seed], [len(ids)])[0]
        else:
            bonus = int(torch.multinomial(torch.softmax(processed[k], -1), 1, generator=gen))
            emitted = rejection_rows(processed[:k].clone(), [drafts], [bonus],
                                     [int(torch.randint(0, 2**62, (1,), generator=gen))])[0]
        a = len(emitted) - 1
        steps, accepted = steps + 1, accepted + a
        if a < k:
            cache.crop(a - k)  # keep the prefix and the accepted drafts
        ids += emitted
        res = model(torch.tensor([[emitted[-1]]]), past_key_values=cache, use_cache=True)
        cache, cur = res.past_key_values, res.logits[0, -1].float()
    return steps, accepted


def chain(model, prompts: list[list[int]], temps: list[float], seeds: int, k: int, n: int
          ) -> list[dict]:
    rows = []
    for temp in temps:
        for rule in ("rejection", "invariant"):
            per_seed = []
            for s in range(seeds):
                st = acc = 0
                for i, ids in enumerate(prompts):
                    a, b = chain_run(model, ids, rule, temp, 1_000_003 * s + i, k, n)
                    st, acc = st + a, acc + b
                per_seed.append({"seed": s, "steps": st, "accepted": acc,
                                 "accept_len": (st + acc) / st})
                print(json.dumps({"temperature": temp, "rule": rule, **per_seed[-1]}), flush=True)
            al = [r["accept_len"] for r in per_seed]
            rows.append({"temperature": temp, "rule": rule, "seeds": seeds, "k": k,
                         "prompts": len(prompts), "tokens": n, "accept_len": statistics.mean(al),
                         "sd_across_seeds": statistics.stdev(al), "range": [min(al), max(al)],
                         "per_seed": per_seed})
    return rows


# -- report -----------------------------------------------------------------------------------

def report_md(rep: dict) -> list[str]:
    a = rep["args"]
    md = [BEGIN, "", f"## Greedy drafts: rejection sampling vs the invariant rule, offline "
          f"({rep['date']}, {rep['box']})", "",
          f"Command: `{rep['command']}` ({rep['wall_s']:.0f} s, 1 thread). No engine: "
          f"SmolLM2-135M-Instruct float32 logits, temperature only (no top-k/top-p), vLLM's own "
          f"`rejection_sample` (CPU kernel fallbacks, no draft probabilities: a greedy draft) "
          f"against `invariant_tokens` + `verify_rows`; seeds independent per request and run. "
          f"For a deterministic draft d both rules accept with probability p(d) "
          f"(lab/greedy_draft_acceptance.py says why).", "",
          f"Per position: {a['prompts']} Spec-Bench prompts ({a['categories']}), a "
          f"{a['text_tokens']}-token continuation each sampled once from the target; every "
          f"continuation position verified once per seed by each rule, draft = the target's "
          f"top-1 or top-2 token; {a['seeds']} seeds. Acceptance rate: mean over seeds "
          f"(SD across seeds); E[p(d)] is the exact expectation on these logits.", "",
          "| temperature | draft | positions | E[p(d)] | rejection | invariant | "
          "invariant - rejection (SE) |", "|---|---|---|---|---|---|---|"]
    for r in rep["positions"]:
        rej, inv = r["rejection"], r["invariant"]
        se = math.hypot(rej["se"], inv["se"])
        md.append(f"| {r['temperature']} | {r['draft']} | {r['positions']} | "
                  f"{r['expected_p_draft']:.4f} | {rej['mean']:.4f} ({rej['sd_across_seeds']:.4f})"
                  f" | {inv['mean']:.4f} ({inv['sd_across_seeds']:.4f}) | "
                  f"{inv['mean'] - rej['mean']:+.4f} ({se:.4f}) |")
    if rep["chain"]:
        c0 = rep["chain"][0]
        md += ["", f"Chain: speculative decoding of {c0['tokens']} tokens after each of "
               f"{c0['prompts']} prompts, K = {c0['k']}, the drafter the target's own greedy "
               f"continuation; each rule samples its own text; accept_len = tokens per verify "
               f"step over the prompts, one value per seed ({c0['seeds']} seeds): mean, SD "
               f"across seeds, min-max.", "",
               "| temperature | rule | accept_len | SD | min-max |", "|---|---|---|---|---|"]
        for r in rep["chain"]:
            md.append(f"| {r['temperature']} | {r['rule']} | {r['accept_len']:.3f} | "
                      f"{r['sd_across_seeds']:.3f} | {r['range'][0]:.3f}-{r['range'][1]:.3f} |")
    md += ["", rep["conclusion"], "", END]
    return md


def _z(a: float, b: float, se: float) -> float:
    return abs(a - b) / se if se > 0 else (0.0 if a == b else math.inf)


def conclusion(rep: dict) -> str:
    """The verdict the numbers give: differences judged against 3 standard errors."""
    pos = rep["positions"]
    worst = max(_z(r["invariant"]["mean"], r["rejection"]["mean"],
                   math.hypot(r["invariant"]["se"], r["rejection"]["se"])) for r in pos)
    off_p = max(max(_z(r[rule]["mean"], r["expected_p_draft"], r[rule]["se"])
                    for rule in ("rejection", "invariant")) for r in pos)
    text = (f"Per position, the largest difference between the rules is {worst:.1f} standard "
            f"errors and the largest gap to E[p(d)] {off_p:.1f}: "
            + ("no difference between the rules at this precision."
               if max(worst, off_p) <= 3 else "a difference beyond 3 standard errors."))
    if rep["chain"]:
        by = {(r["temperature"], r["rule"]): r for r in rep["chain"]}
        parts = []
        for temp in sorted({r["temperature"] for r in rep["chain"]}):
            rej, inv = by[(temp, "rejection")], by[(temp, "invariant")]
            se = (math.hypot(rej["sd_across_seeds"], inv["sd_across_seeds"])
                  / math.sqrt(rej["seeds"]))
            diff = inv["accept_len"] - rej["accept_len"]
            parts.append(f"{inv['accept_len']:.3f} vs {rej['accept_len']:.3f} at temperature "
                         f"{temp} (difference {diff:+.3f}, SE {se:.3f}, "
                         f"{_z(diff, 0.0, se):.1f} SE)")
        text += (" End to end, accept_len invariant vs rejection: " + "; ".join(parts) + ".")
    return text


def publish(rep: dict, md: list[str]) -> None:
    page = ROOT / "docs/results/seeded_sampling.md"
    data = page.with_suffix(".json")
    text = page.read_text()
    block = "\n".join(md)
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text,
                      flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    page.write_text(text)
    d = json.loads(data.read_text())
    d[SECTION] = rep
    data.write_text(json.dumps(d, indent=1) + "\n")


def box() -> str:
    """The CPU as lscpu names it (family / model tell the generation), its CPUs, our threads."""
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout

    def field(name: str) -> str:
        m = re.search(rf"^{name}:\s*(.+)$", cpu, flags=re.M)
        return m.group(1).strip() if m else "?"

    return (f"{field('Model name')} (CPU family {field('CPU family')}, model {field('Model')}), "
            f"{field('CPU[(]s[)]')} vCPU, {torch.get_num_threads()} thread")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec-bench", required=True, help="Spec-Bench question.jsonl")
    ap.add_argument("--categories", default="writing,roleplay,translation,qa")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--text-tokens", type=int, default=48, help="continuation per prompt")
    ap.add_argument("--seeds", type=int, default=32, help="seeds per position")
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--chain-prompts", type=int, default=4)
    ap.add_argument("--chain-tokens", type=int, default=32)
    ap.add_argument("--chain-seeds", type=int, default=6, help="0: no chain run")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default="runs/greedy_accept")
    ap.add_argument("--publish", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    _cpu_kernels()
    from vllm_onlinespec.training.data import load_spec_bench

    temps = [float(t) for t in args.temperatures.split(",")]
    tok, model = load_target()
    texts = [p.text for p in load_spec_bench(args.spec_bench, args.categories.split(","))]
    prompts = [prompt_ids(tok, t) for t in texts[:max(args.prompts, args.chain_prompts)]]
    cont = [(sampled_text(model, ids, args.text_tokens, seed=i), len(ids))
            for i, ids in enumerate(prompts[:args.prompts])]
    rep = {"positions": positions_run(model, cont, temps, args.seeds)}
    rep["chain"] = (chain(model, prompts[:args.chain_prompts], temps, args.chain_seeds, args.k,
                          args.chain_tokens) if args.chain_seeds else [])
    rep.update(
        date=time.strftime("%Y-%m-%d"), wall_s=time.perf_counter() - t0, box=box(),
        command="python lab/greedy_draft_acceptance.py --spec-bench $SPEC_BENCH "
                + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                           if k not in ("spec_bench", "out", "publish")) + " --publish",
        args={k: v for k, v in vars(args).items() if k not in ("spec_bench", "out")})
    rep["conclusion"] = conclusion(rep)
    md = report_md(rep)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{SECTION}.md").write_text("\n".join(md) + "\n")
    (out / f"{SECTION}.json").write_text(json.dumps(rep, indent=1) + "\n")
    if args.publish:
        publish(rep, md)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
