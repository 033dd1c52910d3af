"""Expert iteration with a verifier: STaR (Zelikman et al. 2022) and rejection-sampling fine-tuning (DeepSeek-R1).

Both sample from the current model, keep what the verifier accepts and fine-tune on it, repeatedly:
  0. Cold start (R1 §2.3.1): grpo.sft_loss on the task's worked solutions for sft_steps, from a fresh stream as
     with train_size = 0 (train_size bounds the pool of step 1 only); with hint_sft_frac > 0 that share of the
     prompts carries the answer as a hint (STaR §3.2 shows rationalisation in its few-shot prompt: a model that
     never saw a hint ignores one). The result is the base model M_0.
  1. Sample k = expert_samples completions o ~ M_{n-1}(·|q) for each problem q of a fixed pool: the first
     train_size problems of the "rl" stream (or the whole train_file for gsm8k / math).
  2. Keep o iff the verifier accepts it: answer equivalent to the gold (verify.py), finished (an EOS, not cut
     at max_new_tokens) and, with the r1 template, well formatted (verify.format_reward); then deduplicate
     and keep at most m = expert_max_per_problem per problem. Fine-tuning on the kept set is the STaR policy
     gradient with the indicator reward 1[o correct] (STaR §3.1, eq. 1-2) and R1's rejection sampling (§2.3.3).
  3. star with rationalize (STaR §3.2): each problem with nothing kept in 2 is sampled again with the gold
     answer as a hint, hint_prompt(q); rationales that reach the gold are kept, paired with the prompt WITHOUT
     the hint, so the model learns to produce them unaided.
  4. Fine-tune with grpo.sft_loss for expert_sft_steps steps on batches of sft_batch_size drawn (seeded, without
     replacement within an epoch) from this iteration's set: star restarts from M_0 (STaR §3.1, Alg. 1:
     M_n = train(M, D_n), against overfitting), rft continues from M_{n-1} (R1 §2.3.3). Evaluate; log (solved,
     rescued, dataset size, steps_ok: the share of kept arithmetic rationales whose every step is right, since
     the verifier checks only the answer); save a checkpoint. Repeat from 1 for expert_iters iterations.

Hint format. Synthetic tasks (a char vocabulary "0123456789+-*/()=;#> "): "#<gold>#" before the prompt, e.g.
"#3#8-18+13=". "#" never occurs in a prompt and is the answer marker of solutions ("... #### 3"), so it reads
"the answer is 3". Countdown has no useful hint (its gold answer is the target, already in the prompt), so it
runs without rationalisation. gsm8k / math: the question is followed by "The answer is <gold>. Explain why."

Not supported: --resume (start a new run from a checkpoint with --init_from instead).

  python train.py --config configs/star.toml --threads=1
  python train.py --config configs/rft.toml --threads=1
  torchrun --standalone --nproc_per_node=2 train.py --config configs/star.toml
"""
import dataclasses
import json
import random
import time

import torch

import grpo
import tasks
import verify
from train import Config, Task, Trainer, all_sum, seed_of

HINT = "The answer is {gold}. Explain why."  # gsm8k / math rationalisation hint (STaR §3.2)


def hint_prompt(p: tasks.Problem, task: str) -> str:
    """The question with its gold answer as a hint (see the module docstring); the trainer never sees it."""
    if task in ("gsm8k", "math"):
        return p.prompt.rstrip() + "\n" + HINT.format(gold=p.gold)
    if task == "arithmetic":
        return f"#{p.gold}#{p.prompt}"
    raise ValueError(f"no answer hint for task {task!r} (countdown's gold is its target, already in the prompt)")


def check(cfg: Config):
    errors = [(cfg.resume, "resume is not supported for star/rft; start from a checkpoint with --init_from"),
              (cfg.task in ("arithmetic", "countdown") and cfg.train_size <= 0,
               "star/rft sample a fixed pool of training problems: set train_size > 0"),
              (cfg.expert_iters < 1 or cfg.expert_samples < 1, "expert_iters and expert_samples must be >= 1"),
              (not 0 <= cfg.hint_sft_frac <= 1, "hint_sft_frac must be in [0, 1]"),
              (cfg.task == "countdown" and (cfg.hint_sft_frac > 0 or (cfg.rationalize and cfg.algo == "star")),
               "countdown has no answer hint: use --rationalize=false --hint_sft_frac=0")]
    for bad, msg in errors:
        if bad:
            raise SystemExit(f"error: {msg}")


def keep(g: dict, template: str, max_per_problem: int) -> list[int]:
    """Step 2: indices of the samples of one group the verifier accepts, deduplicated, at most m of them."""
    out, seen = [], set()
    for i, (text, ok, cut) in enumerate(zip(g["texts"], g["correct"], g["truncated"])):
        if ok >= 1 and not cut and (template != "r1" or verify.format_reward(text) >= 1) and text not in seen:
            seen.add(text)
            out.append(i)
    return out[:max_per_problem] if max_per_problem > 0 else out


def steps_ok(text: str) -> bool:
    """Arithmetic: every "a op b=c" step is right, not only the final answer (a hint can be copied to the end)."""
    steps = verify.step_rewards(text)
    return bool(steps) and all(ok for _, ok in steps)


def sample(tr: Trainer, problems: list, keys: tuple) -> list[dict]:
    """k samples per problem, in batches of prompts_per_step problems; groups in the order of `problems`."""
    cfg, out, n = tr.cfg, [], max(1, tr.cfg.prompts_per_step)
    for a in range(0, len(problems), n):
        out += tr.rollouts(problems[a:a + n], cfg.expert_samples, cfg.temperature, (*keys, a), cfg.max_new_tokens)
    return out


def collect(tr: Trainer, pool: list, it: int) -> tuple[list, dict]:
    """Steps 1-3: (prompt ids, completion ids) pairs for fine-tuning, and the iteration's statistics."""
    cfg = tr.cfg
    data, unsolved, n_samples, n_correct, ok = [], [], 0, 0.0, [[], []]  # ok: steps_ok of kept [plain, hinted]
    for (pid, p), g in zip(pool, sample(tr, pool, (cfg.seed, it, 0))):
        kept = keep(g, cfg.template, cfg.expert_max_per_problem)
        data += [(g["prompt"], g["comps"][i]) for i in kept]
        ok[0] += [steps_ok(g["texts"][i]) for i in kept]
        n_samples, n_correct = n_samples + len(g["correct"]), n_correct + sum(g["correct"])
        if not kept:
            unsolved.append((pid, p))
    rescued, rationalise = 0, cfg.algo == "star" and cfg.rationalize
    if rationalise and unsolved:
        hinted = [(pid, dataclasses.replace(p, prompt=hint_prompt(p, cfg.task))) for pid, p in unsolved]
        for (pid, p), g in zip(unsolved, sample(tr, hinted, (cfg.seed, it, 1))):
            kept = keep(g, cfg.template, cfg.expert_max_per_problem)
            data += [(tr.task.prompt_ids(p), g["comps"][i]) for i in kept]  # the hint is stripped here
            ok[1] += [steps_ok(g["texts"][i]) for i in kept]
            rescued += bool(kept)
    stats = {"expert/solved": (len(pool) - len(unsolved)) / len(pool), "expert/rescued": rescued / len(pool),
             "expert/dataset_size": len(data), "expert/sample_accuracy": n_correct / max(1, n_samples)}
    if cfg.task == "arithmetic":  # the share of kept rationales whose every step is right, unaided and rescued
        stats["expert/steps_ok"] = sum(ok[0]) / max(1, len(ok[0]))
        if rationalise:
            stats["expert/rescued_steps_ok"] = sum(ok[1]) / max(1, len(ok[1]))
    return data, stats


def batches(cfg: Config, n: int, it: int):
    """expert_sft_steps batches of indices into the data set: seeded shuffles, without replacement per epoch."""
    order, epoch, B = [], 0, cfg.sft_batch_size
    while len(order) < cfg.expert_sft_steps * B and n:
        perm = list(range(n))
        random.Random(seed_of(cfg.seed, it, epoch)).shuffle(perm)
        order, epoch = order + perm, epoch + 1
    return [order[s * B:(s + 1) * B] for s in range(cfg.expert_sft_steps if n else 0)]


def finetune_step(tr: Trainer, prompts: list, comps: list, opt, sched) -> dict:
    """One optimizer step of token-mean NLL on a GLOBAL batch (identical on every rank): each rank takes its
    rows [rank::world]; the loss is normalised by the global token count, so any rank count gives one gradient."""
    mine = list(range(tr.rank, len(prompts), tr.world))
    prompts, comps = [prompts[i] for i in mine], [comps[i] for i in mine]
    norm = all_sum(torch.tensor(float(sum(map(len, comps))), device=tr.device))  # global loss-token count

    def loss_fn(rows, logp, ent):
        lens = torch.tensor([len(comps[i]) for i in rows] or [0], device=logp.device)  # [n]; a dummy pass: 0
        mask = torch.arange(logp.shape[1], device=logp.device) < lens[:, None]            # [n, L]
        loss = grpo.sft_loss(logp, mask, loss_scale=norm)
        return loss, {"train/loss": loss, "train/entropy": (ent * mask).sum() / norm}
    m = {k: all_sum(v) for k, v in tr.accumulate(prompts, comps, loss_fn, 0.0).items()}
    return {**m, "train/grad_norm": tr.optimizer_step(opt, sched), "train/lr": sched.get_last_lr()[0]}


def cold_start_batch(tr: Trainer, task: Task) -> tuple[list, list]:
    """Step 0: the cold-start batch of Trainer.sft_step (the GLOBAL batch), a seeded hint_sft_frac share hinted."""
    cfg, B = tr.cfg, tr.cfg.sft_batch_size
    ks = range(tr.sft_cursor, tr.sft_cursor + B)
    probs = [task.problem("sft", k)[1] for k in ks]
    tr.sft_cursor += B
    hinted = [random.Random(seed_of(cfg.seed, k, 8)).random() < cfg.hint_sft_frac for k in ks]
    probs_in = [dataclasses.replace(p, prompt=hint_prompt(p, cfg.task)) if h else p for p, h in zip(probs, hinted)]
    prompts = [tr.task.prompt_ids(p) for p in probs_in]
    comps = [tr.tok.encode(task.demo(k, p), add_special_tokens=False).ids + tr.task.stop_ids[:1]
             for k, p in zip(ks, probs)]
    return prompts, comps


def main(cfg: Config) -> dict:
    check(cfg)
    # the console ETA counts the fine-tune steps as the "rl" stage
    cfg = dataclasses.replace(cfg, rl_steps=cfg.expert_iters * cfg.expert_sft_steps)
    tr, stage = Trainer(cfg), cfg.algo
    tr.start_logging(0)
    if tr.rank == 0:
        print(json.dumps(dataclasses.asdict(cfg)), f"\nworld size {tr.world}, device {tr.device}, "
              f"algo {stage}: sample {cfg.expert_samples}/problem, keep the verified, fine-tune", flush=True)
    # ---------------------------------------------------------------------------- step 0: cold start
    sft_task = Task(dataclasses.replace(cfg, train_size=0), tr.tok)  # train_size bounds the pool, not the cold start
    opt, sched = tr.make_optimizer(cfg.sft_lr, cfg.sft_steps)
    for step in range(1, cfg.sft_steps + 1):
        tr.log(step, "sft", finetune_step(tr, *cold_start_batch(tr, sft_task), opt, sched))
    step = cfg.sft_steps
    results = {"sft": tr.evaluate(step, "sft")}
    tr.log(step, "sft", results["sft"])
    base = [p.detach().clone() for p in tr.model.parameters()]  # M_0 (this rank's shards under FSDP)
    n_pool = cfg.train_size if cfg.train_size > 0 else len(tr.task.train)
    pool = [tr.task.problem("rl", i) for i in range(n_pool)]
    # ---------------------------------------------------------------------------- steps 1-4: iterations
    t_start = time.time()
    for it in range(1, cfg.expert_iters + 1):
        t0 = time.time()
        data, stats = collect(tr, pool, it)
        t1 = time.time()
        if cfg.algo == "star" and cfg.expert_from_base:
            with torch.no_grad():
                for p, b in zip(tr.model.parameters(), base):
                    p.copy_(b)
        opt, sched = tr.make_optimizer(cfg.expert_lr, cfg.expert_sft_steps)
        losses = []
        for s, idx in enumerate(batches(cfg, len(data), it)):
            rec = finetune_step(tr, [data[i][0] for i in idx], [data[i][1] for i in idx], opt, sched)
            rec = {k: float(v) for k, v in rec.items()}  # the one host sync of the step
            losses.append(rec["train/loss"])
            tr.log(step + s + 1, stage, rec)
        step += cfg.expert_sft_steps
        if tr.rank == 0:
            print(f"iteration {it}: " + " ".join(f"{k[7:]} {v:.3f}" for k, v in stats.items()) +
                  f" | sample {t1 - t0:.1f}s, fine-tune {time.time() - t1:.1f}s", flush=True)
        results[stage] = tr.evaluate(step, stage)
        tr.log(step, stage, {**stats, "expert/iteration": it, "time/sample_s": t1 - t0,
                             "train/loss_mean": sum(losses) / max(1, len(losses)), **results[stage]})
        tr.save(step, stage, opt, sched)
        if tr.out_of_time(t_start):  # same wall-clock budget as an RL run
            break
    return tr.finish(results)
