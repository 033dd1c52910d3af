"""The held-out evaluation train.py runs (pass@1, maj@k, pass@k; train.evaluate: the same \
function, not a copy), as a command line.

  1. Load the checkpoint folder --ckpt as train.py loads init_from: weights, tokenizer, chat
     template, stop ids.
  2. For every held-out problem (eval_file, the synthetic held-out set of eval_seed, or the first
     eval_n of reasoning-gym's held-out pool, split as in training: tasks.py step 5), sample one
     greedy completion and eval_k at `temperature` (with top_k / top_p), eval_batch problems at a
     time, with a progress line and ETA.
  3. Print greedy pass@1, sampled pass@1, both again counting only completions that ended at a
     stop token ("stopped": a right answer cut off by max_new_tokens is not a finished solution),
     maj@k (the most frequent extracted answer of the k samples), answer rate (sampled, greedy),
     mean completion length, truncation rate (no stop token within max_new_tokens), pass@k for
     k = 2, 4, ... up to eval_k (Chen et al. 2021's unbiased estimator from the eval_k samples:
     does the model solve more with more tries?), pass@1 per level and, for a composite
     reasoning-gym dataset, per member.
  4. --samples_out FILE.jsonl: one JSON object per completion, greedy first: problem,
     kind (greedy | sampled), prompt (the rendered prompt text, exactly what was tokenized),
     completion, answer (extracted, or null), gold, correct, truncated, finish (how the sample
     ended: stop, length, tool_limit, nonfinite; rollout.FINISH). With tools the completion
     holds each call and its forced result ("[37*48]{1776}"). --metrics_out FILE: the record as one
     metrics.jsonl line (step 0), so tools/plot.py --kind passk draws base, RL and RFT checkpoints
     on one figure.
  5. Tools: a run's `tools` applies (--tools=calculator); --tools= evaluates with the tool off (a
     call is then plain text: no result). The table adds, over the sampled completions: tool calls
     per completion, their error rate, the share of correct answers that called, the accuracy with
     and without a call, the share of tokens forced.
Every train.py key applies (task, eval_file, template, system_prompt, eval_n, eval_k,
max_new_tokens, temperature, top_k, top_p, seed, threads, ...); under torchrun each rank samples its
share of the problems, as in training.

  python evaluate.py --ckpt runs/qwen2.5-0.5b-gsm8k/step_500 \\
      --config configs/qwen2.5-0.5b-gsm8k.toml --eval_n=1319 --eval_k=8 --samples_out samples.jsonl
  torchrun --standalone --nproc_per_node=8 evaluate.py --ckpt DIR \\
      --config configs/qwen2.5-0.5b-gsm8k.toml
  python evaluate.py --ckpt runs/smollm2-rg_s0/step_100 --config configs/smollm2-135m-rg.toml \\
      --eval_n=500
"""
import dataclasses
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass

import cli
import infra
import train

ROWS = [("pass@1", "pass@1 greedy"), ("pass@1_sampled", "pass@1 sampled"),
        ("completed_pass@1", "pass@1 greedy, stopped"),
        ("completed_pass@1_sampled", "pass@1 sampled, stopped"), ("maj@k", "maj@k"),
        ("answer_rate", "answer rate"), ("answer_rate_greedy", "answer rate greedy"),
        ("answered_accuracy", "greedy pass@1 / answered"),
        ("completion_len", "mean length (tokens)"),
        ("truncated_frac", "truncation rate")]


@dataclass
class EvalConfig(train.Config):
    ckpt: str = ""                      # the Hugging Face folder to evaluate: a step_N/
                                        #   or a Qwen2 / Llama download
    samples_out: str = ""               # write one JSON line per completion here (rank 0)
    metrics_out: str = ""               # write the record here as a metrics.jsonl (one line, step
                                        #   0): tools/plot.py --kind passk draws its pass@k


def table(cfg: EvalConfig, levels: Counter, rec: dict, seconds: float,
          sources: Counter = Counter()) -> str:
    """The printed result: a header, one line per metric, then greedy and sampled pass@1 per level
    and, for a composite reasoning-gym dataset, per member dataset."""
    out = [f"{cfg.init_from}: {sum(levels.values())} {cfg.task} problems, "
           f"template {cfg.template}, greedy + {cfg.eval_k} samples at T = {cfg.temperature} "
           f"(top_k {cfg.top_k}, top_p {cfg.top_p}), {seconds:.0f} s"]
    out += [f"  {name.replace('@k', f'@{cfg.eval_k}'):24s}{rec['eval/' + key]:10.3f}"
            for key, name in ROWS]
    out += [f"  {key[5:].replace('_', ' '):24s}{v:10.3f}"
            for key, v in rec.items() if "tool" in key or "scorer" in key
            or re.fullmatch(r"eval/pass@\d+_sampled", key) and key != "eval/pass@1_sampled"]
    out.append(f"  {'level':>8s}{'problems':>10s}{'greedy':>10s}{'sampled':>10s}")
    out += [f"  {lv:8d}{n:10d}{rec[f'eval/pass@1_L{lv}']:10.3f}"
            f"{rec[f'eval/pass@1_sampled_L{lv}']:10.3f}"
            for lv, n in sorted(levels.items())]
    if sources:
        out.append(f"  {'dataset':>24s}{'problems':>10s}{'greedy':>10s}{'sampled':>10s}")
        out += [f"  {name:>24s}{n:10d}{rec[f'eval/pass@1_{name}']:10.3f}"
                f"{rec[f'eval/pass@1_sampled_{name}']:10.3f}"
                for name, n in sources.items()]
    return "\n".join(out)


def main(cfg: EvalConfig) -> dict:
    """Evaluate cfg.ckpt; returns train.evaluate's record (eval/pass@1, eval/maj@k, ...)."""
    if not (cfg.ckpt or cfg.init_from):
        raise SystemExit("error: evaluate.py needs --ckpt DIR (a Hugging Face folder)")
    # the held-out set is all an evaluation reads: the training file of a preset need not exist
    # here, and its training-only settings (e.g. overlong_buffer against a short max_new_tokens)
    # are not checked
    cfg = dataclasses.replace(cfg, init_from=cfg.ckpt or cfg.init_from, train_file=cfg.eval_file,
                              sft_steps=0, rl_steps=0)
    t0 = time.time()
    run = train.build_run(cfg)
    samples = [] if cfg.samples_out else None
    rec = train.evaluate(run, 0, samples=samples)
    if run.proc.rank == 0:
        heldout = run.task.heldout
        print(table(cfg, Counter(p.level for p in heldout), rec, time.time() - t0,
                    Counter(p.source for p in heldout if p.source)), flush=True)
        if cfg.samples_out:
            with open(cfg.samples_out, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in samples)
            print(f"{len(samples)} completions written to {cfg.samples_out}")
        if cfg.metrics_out:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_out)), exist_ok=True)
            with open(cfg.metrics_out, "w", encoding="utf-8") as f:
                f.write(json.dumps({"step": 0, "stage": "eval", **rec}) + "\n")
    return rec


if __name__ == "__main__":
    cli.run_main(main, train.parse_args(sys.argv[1:], EvalConfig))
    infra.teardown()
