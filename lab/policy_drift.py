"""How the shipped drafter goes stale as the target policy drifts: its held-out acceptance on
every version of the drift trajectory (training/drift.py; version 0 = the base), offline.

    python lab/policy_drift.py --out docs/results [--versions 0 4 8] [--work DIR]

Per version k: the base (float32) with version k's shipped adapter merged in memory answers the
shipped drafter's held-out prompts greedily (HF transformers, --max-tokens), the target's
features of each answer are taken from the same model, and the drafter alone walks each answer
as serving does (lab/hybrid_ceiling.py: a block at every answer position, greedy verification,
a step commits its accepted drafts + 1). Reported: tokens per verify step of the drafter alone
(walk_accept, bootstrap standard error over prompts), of the suffix tree first and the drafter
where the tree's score is below --suffix-tree (walk_accept_tree, the product's lookup default),
the version's held-out style loss (its training record: the answer loss on restyled answers
the fine-tune held out), and how far its answers moved from the base's (numbered-answer share,
mean tokens before the first token that differs from the base's answer).

The prompts are checked against the trajectory's training prompts (the manifest's hashes):
none may be among them. --work DIR keeps each finished version (a rerun resumes).
Writes OUT/policy_drift.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

from hybrid_ceiling import accepted_run, ratio_se, tree_accepts, walk_policies



def load_prompts(path: Path, tail: int = 0, limit: int = 0) -> list[dict]:
    """Rows with `id` and `messages`: the file's last `tail` rows (0: all), the first `limit`
    of them (0: all)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = rows[len(rows) - tail:] if tail else rows
    return rows[:limit] if limit else rows


def check_disjoint(prompts: list[dict], manifest: dict) -> int:
    """Refuse prompts the trajectory trained on; returns how many training prompts it names."""
    from vllm_onlinespec.training.drift import prompt_hash

    trained = set(manifest.get("prompt_hashes", []))
    if not trained:
        raise SystemExit("the trajectory's manifest names no training prompts: cannot check "
                         "that the evaluation prompts are held out")
    seen = [p["id"] for p in prompts for m in p["messages"]
            if m["role"] == "user" and prompt_hash(m["content"]) in trained]
    if seen:
        raise SystemExit(f"evaluation prompts the trajectory trained on: {', '.join(seen)}")
    return len(trained)


def chat_heads(tok, prompts: list[dict]) -> list[list[int]]:
    return [list(tok.apply_chat_template(p["messages"], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"])
            for p in prompts]


def lookup_walk(heads: list[list[int]], answers: list[list[int]], k: int) -> tuple[float, float]:
    """(tokens per verify step, its standard error) of prompt lookup alone (vLLM's ngram rule)
    on the same windows as the drafter's walk: how much of the answers repeats their context."""
    steps, tokens = [], []
    for h, a in zip(heads, answers):
        ids = h + a
        w = walk_policies(ids, len(h), [0] * max(0, len(a) - k), k)["ngram"]
        steps.append(w.steps)
        tokens.append(w.tokens)
    return round(sum(tokens) / sum(steps), 4), round(ratio_se(steps, tokens), 4)


def version_model(base: str, adapter: Path | None):
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_onlinespec.training import lora

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        cfg, factors = lora.load(adapter)
        lora.merge(model, cfg, factors)
    return model.eval().requires_grad_(False)


def evaluate_version(k: int, adapter: Path | None, base: str, tok, prompts: list[dict],
                     drafter_path: str, max_tokens: int, min_score: float) -> dict:
    import torch

    from vllm_onlinespec.config import LossConfig
    from vllm_onlinespec.drafter import load_draft_vocab, load_drafter_config
    from vllm_onlinespec.drafter.suffix_tree import SuffixTreeLookup
    from vllm_onlinespec.training.generate import Sample, SamplingSpec
    from vllm_onlinespec.training.hf_generate import hf_generate, prepare
    from vllm_onlinespec.training.trainer import (HeldoutInputs, add_target_labels,
                                                  block_accepts, extract_features)

    t0 = time.time()
    model = version_model(base, adapter)
    eos, pad = prepare(model, tok)
    heads = chat_heads(tok, prompts)
    answers = [r[0] for r in hf_generate(model, eos, pad, heads, SamplingSpec(max_tokens=max_tokens),
                                         batch_size=16)]
    t_gen = time.time() - t0
    samples = [Sample(prompt_id=p["id"], ids=h + a, start=len(h))
               for p, h, a in zip(prompts, heads, answers)]
    layers = list(load_drafter_config(drafter_path).target_layer_ids)
    inp = HeldoutInputs(tuple(layers), extract_features(model, samples, layers, desc=f"v{k}"),
                        model.get_input_embeddings().weight.detach().float(),
                        model.get_output_embeddings().weight.detach().float())
    _, drafter = inp.drafter(drafter_path)
    kd = drafter.config.num_draft_tokens
    vocab = load_draft_vocab(drafter_path, dtype=torch.float32)
    if vocab is not None:
        add_target_labels(inp.examples, inp.lm_head_w)
    tree = SuffixTreeLookup()
    per = {"dflash": ([], []), "tree-first": ([], [])}
    for n, e in enumerate(inp.examples):
        acc = block_accepts(drafter, e, inp.embed_w, inp.lm_head_w, LossConfig(mode="ce"),
                            draft_vocab=vocab)
        ids = e.ids.tolist()
        walks = walk_policies(ids, e.start, acc, kd, tree=tree_accepts(
            tree, f"h{n}", ids, e.start, len(acc), kd, min_score))
        for p in per:
            per[p][0].append(walks[p].steps)
            per[p][1].append(walks[p].tokens)
    row = {"version": k, "adapter": adapter.name if adapter else None, "K": kd}
    for name, p in (("walk_accept", "dflash"), ("walk_accept_tree", "tree-first")):
        steps, tokens = per[p]
        row[name] = round(sum(tokens) / sum(steps), 4) if sum(steps) else None
        row[name + "_se"] = round(ratio_se(steps, tokens), 4)
    texts = [tok.decode(a, skip_special_tokens=True) for a in answers]
    row.update(
        walk_steps=sum(per["dflash"][0]), answer_tokens=sum(len(a) for a in answers),
        numbered_share=round(sum(t.lstrip().startswith("1.") for t in texts) / len(texts), 3),
        calc_share=round(sum("<<" in t or "####" in t for t in texts) / len(texts), 3),
        gen_s=round(t_gen, 1), eval_s=round(time.time() - t0, 1), answers=answers,
        example=texts[0][:160])
    return row


def box() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    f = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{f.get('CPU(s)', '?').strip()}-vCPU {f.get('Model name', '?').strip()} " \
           f"(family {f.get('CPU family', '?').strip()}, model {f.get('Model', '?').strip()})"


def page(rows: list[dict], manifest: dict, args, wall_s: float, box_name: str) -> str:
    base = rows[0]
    rec = manifest["recipe"]["recipe"]
    if rec.get("answers", "terse") == "reference":
        target = (f"toward the worked solutions of `{rec['data']}` (its reference answers "
                  "unchanged: GSM8K's <<a*b=c>> calculator notes and `#### answer` line)")
        data = f" (the file less its last {rec['hold_tail']} rows, which are served only)"
        style_col, style_doc = "calc_share", "share of answers with a calculator note or `####`"
    else:
        target = "toward the terse numbered-step style"
        data = (f" ({rec['prompts']} self-written prompts asked for, the base's greedy answers "
                f"(max {rec['max_answer_tokens']} tokens, generator "
                f"`{manifest.get('generator', '?')}`) restyled)")
        style_col, style_doc = "numbered_share", "share of answers that start with a numbered step"
    lines = [
        "# A policy that drifts: the shipped drafter's acceptance along a real fine-tune", "",
        f"{args.date}, {box_name}. Made by `lab/policy_drift.py` (offline, HF transformers float32, "
        "no vLLM engine).", "",
        f"The target: SmolLM2-135M-Instruct along one LoRA fine-tune {target} "
        f"(training/variant.py, run as a trajectory by training/drift.py): "
        f"rank {rec['r']} on the upper {1 - rec['layers_from']:.0%} of the layers, "
        f"{rec['steps']} steps of {rec['batch_size']}, peak lr {rec['lr']:g} (cosine to 10 %), "
        f"{manifest['recipe']['report']['train_examples']} training answers{data}. "
        f"Version k = the base after k/{manifest['versions']} of the run (its adapter "
        f"`vllm_onlinespec/adapters/smollm2-135m-drift-v<k>`); version 0 = the base.", "",
        f"The drafter: the shipped one ({args.drafter_label}), alone, on "
        f"{args.n_prompts} prompts ({args.prompts_label}: trained "
        f"on by neither the drafter nor the fine-tune; checked against the trajectory's "
        f"{args.trained_prompts} training prompts). Per version: its greedy answers "
        f"(max {args.max_tokens} new tokens), the drafter's greedy walk through them "
        f"(lab/hybrid_ceiling.py's walk, K = {base['K']}).", "",
        "```bash", args.command, "```", "",
        "Columns: `walk_accept` tokens per verify step of the drafter alone (± bootstrap standard "
        "error over prompts); `walk_accept_tree` the suffix tree first where its score reaches "
        f"{args.suffix_tree:g}, the drafter elsewhere; `heldout_style_loss` the version's answer "
        f"loss on the {manifest['recipe']['report']['heldout_examples']} answers the "
        f"fine-tune held out (its training record); `style` {style_doc}; "
        "`same_as_base` mean tokens "
        "before the version's answer first differs from the base's; `lookup` prompt lookup alone "
        "(vLLM's ngram rule, no model) on the same answers: how much of them repeats their own "
        "context, which a drafter also exploits.", "",
        "| version | train_step | walk_accept | vs base | walk_accept_tree | heldout_style_loss "
        "| style | same_as_base | lookup | answer tokens |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['version']} | {r['train_step']} | {r['walk_accept']:.3f} ± "
            f"{r['walk_accept_se']:.3f} | {r['walk_accept'] / base['walk_accept']:.3f}x | "
            f"{r['walk_accept_tree']:.3f} ± {r['walk_accept_tree_se']:.3f} | "
            f"{r['heldout_style_loss']:.3f} | {r.get(style_col, float('nan')):.2f} | "
            f"{r['same_as_base']:.1f} | {r['walk_accept_lookup']:.3f} | {r['answer_tokens']} |")
    last = rows[-1]
    drop = base["walk_accept"] - last["walk_accept"]
    se = (base["walk_accept_se"] ** 2 + last["walk_accept_se"] ** 2) ** 0.5
    ups = sum(b["walk_accept"] > a["walk_accept"] for a, b in zip(rows, rows[1:]))
    drafted = (last["walk_accept"] - 1) / (base["walk_accept"] - 1) - 1
    lines += ["", "## Reading", "",
              f"- From version 0 to version {last['version']} the drafter's acceptance goes "
              f"{base['walk_accept']:.3f} -> {last['walk_accept']:.3f} tokens per verify step "
              f"({-drop:+.3f}, {drop / se:.1f} standard errors of the difference; the accepted "
              f"drafts per step {base['walk_accept'] - 1:.3f} -> {last['walk_accept'] - 1:.3f}, "
              f"{drafted:+.0%}); {ups} of {len(rows) - 1} consecutive versions rise instead of "
              "falling."]
    peak = max(rows, key=lambda r: r["walk_accept_tree"])
    tail = [r for r in rows if r["version"] > peak["version"]]
    if tail:
        falls = sum(b["walk_accept_tree"] < a["walk_accept_tree"]
                    for a, b in zip([peak] + tail, tail))
        lines.append(
            f"- With the suffix tree first (what the preset drafts): {base['walk_accept_tree']:.3f} "
            f"at version 0, the peak {peak['walk_accept_tree']:.3f} at version {peak['version']}, "
            f"{last['walk_accept_tree']:.3f} at version {last['version']} "
            f"({last['walk_accept_tree'] / peak['walk_accept_tree'] - 1:+.0%} from the peak; "
            f"{falls} of {len(tail)} later versions below the one before).")
    lines += [f"- Wall time: this evaluation {wall_s / 60:.0f} min (the versions' own times "
              f"summed, {args.threads} torch threads); the trajectory: "
              f"{args.recipe_note or 'see the recipe command'}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trajectory", default=None,
                    help="a trajectory folder (its trajectory.json; versions beside it); "
                    "default: the shipped vllm_onlinespec/adapters/smollm2-135m-drift")
    ap.add_argument("--drafter", default=None, help="default: the shipped drafter")
    ap.add_argument("--prompts", default=None,
                    help="held-out prompts (jsonl); default: the drafter's heldout_prompts.jsonl")
    ap.add_argument("--tail", type=int, default=0, help="--prompts: its last N rows only "
                    "(1000 for GSM8K train: the served slice no trajectory trains on)")
    ap.add_argument("--limit", type=int, default=0, help="the first N of those (0: all)")
    ap.add_argument("--versions", type=int, nargs="*", default=None)
    ap.add_argument("--prompts-as", default=None, help="how the page names --prompts "
                    "(e.g. $GSM8K_TRAIN: no machine paths in a published page)")
    ap.add_argument("--out-label", default=None, help="how the page names --out")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--suffix-tree", type=float, default=1.0, metavar="MIN_SCORE")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default=None, help="folder keeping finished versions (resume)")
    ap.add_argument("--recipe-note", default="", help="the trajectory's command and wall time, "
                    "for the page")
    ap.add_argument("--out", default=None, help="folder for policy_drift.{json,md}")
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d", time.gmtime()),
                    help="date for the page (default: today, UTC)")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from vllm_onlinespec import models
    from vllm_onlinespec.training.drift import read_trajectory, version_adapters

    torch.set_num_threads(args.threads)
    traj = Path(args.trajectory) if args.trajectory else (
        Path(models.shipped_adapter(models.KNOWN_MODELS[f"{models.DRIFT}-v1"])).parent / models.DRIFT)
    manifest = read_trajectory(traj)
    drafter = args.drafter or str(models.shipped_drafter("smollm2-135m"))
    args.drafter_label = args.drafter or "`vllm-onlinespec model drafter`"
    prompts = load_prompts(Path(args.prompts) if args.prompts else
                           Path(drafter) / "heldout_prompts.jsonl", args.tail, args.limit)
    args.trained_prompts = check_disjoint(prompts, manifest)
    args.n_prompts = len(prompts)
    args.prompts_label = ("the drafter's own `heldout_prompts.jsonl`" if not args.prompts else
                          f"`{Path(args.prompts).name}`" + (f", its last {args.tail} rows" if args.tail else "")
                          + (f", the first {args.limit} of them" if args.limit else ""))
    base = str(models.pull(manifest["base"]))
    tok = AutoTokenizer.from_pretrained(base)
    losses = {r["version"]: (r["train_step"], r["heldout_loss"]) for r in manifest["rows"]}
    work = Path(args.work) if args.work else None
    if work:
        work.mkdir(parents=True, exist_ok=True)
    rows = []
    for k, adapter in version_adapters(traj, args.versions):
        done = work / f"v{k}.json" if work else None
        if done is not None and done.is_file():
            row = json.loads(done.read_text())
        else:
            row = evaluate_version(k, adapter, base, tok, prompts, drafter, args.max_tokens,
                                   args.suffix_tree)
            if done is not None:
                done.write_text(json.dumps(row))
        row["train_step"], row["heldout_style_loss"] = losses[k]
        rows.append(row)
        print(json.dumps({c: row[c] for c in ("version", "train_step", "walk_accept",
                                              "walk_accept_se", "walk_accept_tree",
                                              "heldout_style_loss", "numbered_share", "calc_share",
                                              "eval_s")}),
              flush=True)
    ref = next((r["answers"] for r in rows if r["version"] == 0), None)
    heads = chat_heads(tok, prompts)
    for r in rows:
        r["walk_accept_lookup"], r["walk_accept_lookup_se"] = lookup_walk(heads, r["answers"], r["K"])
        r["same_as_base"] = (round(sum(accepted_run(a, b) for a, b in zip(r["answers"], ref))
                                   / len(ref), 1) if ref else float("nan"))
    wall = sum(r["eval_s"] for r in rows)  # resumed versions keep their own times
    args.command = ("python lab/policy_drift.py --out " + (args.out_label or args.out or "OUT")
                    + "".join(f" --{k} {v}" for k, v in (("trajectory", args.trajectory),
                                                        ("drafter", args.drafter),
                                                        ("prompts", args.prompts_as or args.prompts),
                                                        ("tail", args.tail),
                                                        ("limit", args.limit)) if v)
                    + (f" --versions {' '.join(map(str, args.versions))}" if args.versions else "")
                    + f" --max-tokens {args.max_tokens} --threads {args.threads}"
                    + (" --work WORK" if args.work else ""))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        keep = [{c: v for c, v in r.items() if c != "answers"} for r in rows]
        box_name = box()
        (out / "policy_drift.json").write_text(json.dumps(
            {"date": args.date, "box": box_name, "command": args.command, "wall_s": round(wall),
             "recipe_note": args.recipe_note, "drafter": args.drafter_label,
             "prompts": len(prompts), "max_tokens": args.max_tokens,
             "suffix_min_score": args.suffix_tree, "trajectory": manifest["recipe"],
             "rows": keep}, indent=1) + "\n")
        (out / "policy_drift.md").write_text(page(rows, manifest, args, wall, box_name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
