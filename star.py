"""Expert iteration with a verifier: STaR (Zelikman et al. 2022) and rejection-sampling \
fine-tuning (DeepSeek-R1).

Both sample from the current model, keep what the verifier accepts and fine-tune on it, repeatedly:
  0. Cold start (R1 §2.3.1): grpo.sft_loss on the task's worked solutions for sft_steps, from a
     fresh stream as with train_size = 0 (train_size bounds the pool of step 1 only); with
     hint_sft_frac > 0 that share of the prompts carries the answer as a hint (STaR §3.2 shows
     rationalisation in its few-shot prompt: a model that never saw a hint ignores one). The result
     is the base model M_0.
  1. Sample k = expert_samples completions o ~ M_{n-1}(·|q) for each problem q of a fixed pool: the
     first train_size problems of the "rl" stream (or the whole train_file for gsm8k / math); with
     expert_fresh, iteration n's pool is the stream's n-th block of train_size problems instead, new
     problems each iteration as RL sees them (RAFT, Dong et al. 2023; Xiong et al. 2025). With a
     teacher folder, o ~ π_T(·|q) instead: off-policy distillation, SFT on a stronger model's own
     samples (issue 26's arm (d)); each iteration draws fresh samples, so use it with rft (star
     restarts from M_0 and would see one iteration's).
  2. Keep o iff the verifier accepts it: answer equivalent to the gold (verify.py), finished (an
     EOS, not cut at max_new_tokens) and, with the r1 template, well formatted
     (verify.format_reward); then deduplicate and keep at most m = expert_max_per_problem per
     problem. Fine-tuning on the kept set is the STaR policy gradient with the indicator reward
     1[o correct] (STaR §3.1, eq. 1-2) and R1's rejection sampling (§2.3.3). expert_filter = false
     keeps every sample (duplicates and unfinished ones too, at most m per problem): with a teacher,
     the NLL on its samples estimates the forward KL(π_T‖π_θ) up to π_T's entropy
     (sequence-level KD, Kim & Rush 2016), the counterpart of on-policy distillation's
     reverse KL (distill.py).
  3. star with rationalize, no teacher (STaR §3.2): each problem with nothing kept in 2 is sampled
     again with the gold answer as a hint, hint_prompt(q); rationales that reach the gold are kept,
     paired with the prompt WITHOUT the hint, so the model learns to produce them unaided.
  4. Fine-tune with grpo.sft_loss for expert_sft_steps steps on batches of sft_batch_size drawn
     (seeded, without replacement within an epoch) from this iteration's set: star restarts from M_0
     (STaR §3.1, Alg. 1: M_n = train(M, D_n), against overfitting), rft continues from M_{n-1}
     (R1 §2.3.3). Evaluate; log (solved, rescued, dataset size, steps_ok: the share of kept
     arithmetic rationales whose every step is right, since the verifier checks only the answer);
     save a checkpoint. Repeat from 1 for expert_iters iterations.

Hint format. Synthetic tasks (a char vocabulary "0123456789+-*/()=;#> "): "#<gold>#" before the
prompt, e.g. "#3#8-18+13=". "#" never occurs in a prompt and is the answer marker of solutions
("... #### 3"), so it reads "the answer is 3". Countdown has no useful hint (its gold answer is the
target, already in the prompt), so it runs without rationalisation. gsm8k / math: the question is
followed by "The answer is <gold>. Explain why."

Its own entry point and config (StarConfig: train.Config plus the expert-iteration fields below);
the pieces are train.py's: sample_groups, the verifier's scores, sft_update, evaluate. Not
supported: --resume (start a new run from a checkpoint with --init_from instead).

  python star.py --config configs/star.toml --threads=1
  python star.py --config configs/rft.toml --threads=1
  torchrun --standalone --nproc_per_node=2 star.py --config configs/star.toml
"""
import dataclasses
import random
import sys
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

import cli
import infra
import tasks
import train
import verify
from logger import Logger
from tasks import seed_of

HINT = "The answer is {gold}. Explain why."  # gsm8k / math rationalisation hint (STaR §3.2)


@dataclass
class StarConfig(train.Config):
    algo: str = "star"                  # star (STaR, from the base each iteration, rationalise) |
                                        #   rft (R1 §2.3.3)
    expert_iters: int = 3               # STaR §3.1 Alg. 1: outer loops of
                                        #   sample → filter → fine-tune
    expert_samples: int = 8             # k samples per training problem
                                        #   (R1 §2.3.3 rejection sampling)
    expert_max_per_problem: int = 0     # at most m kept (deduplicated) samples per problem, 0: all
                                        #   (R1 §2.3.3)
    expert_sft_steps: int = 100         # fine-tune steps per iteration
                                        #   (STaR §4: 40 at first, +20% per iteration)
    expert_lr: float = 1e-4             # fine-tune learning rate (STaR §4: constant);
                                        #   1e-3 degraded the demo model
    expert_from_base: bool = True       # STaR §3.1: fine-tune the cold-start model each iteration
                                        #   (star only)
    rationalize: bool = True            # STaR §3.2: retry unsolved problems
                                        #   with the answer as a hint (star only)
    hint_sft_frac: float = 0.0          # STaR §3.2 (hinted few-shot examples): share of hinted
                                        #   cold-start prompts
    expert_filter: bool = True          # step 2: keep only verified samples;
                                        #   false: all (with a teacher: seq-level KD)
    expert_fresh: bool = False          # step 1: iteration n samples the stream's n-th block of
                                        #   train_size problems (RAFT), not the same pool

    CHOICES: ClassVar[dict] = {**train.Config.CHOICES, "algo": ("star", "rft")}


def hint_prompt(p: tasks.Problem, task: str) -> str:
    """The question with its gold answer as a hint (see the module docstring); the trainer never
    sees it."""
    if task in ("gsm8k", "math"):
        return p.prompt.rstrip() + "\n" + HINT.format(gold=p.gold)
    if task == "arithmetic":
        return f"#{p.gold}#{p.prompt}"
    raise ValueError(f"no answer hint for task {task!r} "
                     "(countdown's gold is its target, already in the prompt)")


def keep(g: train.Group, template: str, max_per_problem: int, filtered: bool = True) -> list[int]:
    """Step 2: indices of the samples of one group the verifier accepts, deduplicated, at most m of
    them; not filtered: the first m samples, whatever they are (m = 0: all)."""
    if not filtered:
        return list(range(len(g.texts)))[:max_per_problem or None]
    out, seen = [], set()
    for i, (text, ok, cut) in enumerate(zip(g.texts, g.scores, g.truncated)):
        if (ok >= 1 and not cut and (template != "r1" or verify.format_reward(text) >= 1)
                and text not in seen):
            seen.add(text)
            out.append(i)
    return out[:max_per_problem] if max_per_problem > 0 else out


def steps_ok(text: str) -> bool:
    """Arithmetic: every "a op b=c" step is right, not only the final answer (a hint can be copied
    to the end)."""
    steps = verify.step_rewards(text)
    return bool(steps) and all(ok for _, ok in steps)


def sample(run: train.Run, problems: list, keys: tuple) -> list[train.Group]:
    """k samples per problem (from the teacher when there is one), in batches of prompts_per_step
    problems; groups in the order of `problems`."""
    cfg, out, n = run.cfg, [], max(1, run.cfg.prompts_per_step)
    for a in range(0, len(problems), n):
        out += train.sample_groups(run, problems[a:a + n], cfg.expert_samples, cfg.temperature,
                                   (*keys, a), model=run.teacher)
    return out


def collect(run: train.Run, pool: list, it: int) -> tuple[list, dict]:
    """Steps 1-3: (prompt ids, completion ids) pairs for fine-tuning, and the iteration's
    statistics."""
    cfg = run.cfg
    # ok: steps_ok of kept [plain, hinted]
    data, unsolved, n_samples, n_correct, ok = [], [], 0, 0.0, [[], []]
    for (pid, p), g in zip(pool, sample(run, pool, (cfg.seed, it, 0))):
        kept = keep(g, cfg.template, cfg.expert_max_per_problem, cfg.expert_filter)
        data += [(g.prompt, g.comps[i]) for i in kept]
        ok[0] += [steps_ok(g.texts[i]) for i in kept]
        n_samples, n_correct = n_samples + len(g.scores), n_correct + sum(g.scores)
        if not (kept if cfg.expert_filter else keep(g, cfg.template, cfg.expert_max_per_problem)):
            unsolved.append((pid, p))  # nothing the verifier accepts
    rescued, rationalise = 0, (cfg.algo == "star" and cfg.rationalize
                               and not cfg.teacher)  # it never saw a hint
    if rationalise and unsolved:
        hinted = [(pid, dataclasses.replace(p, prompt=hint_prompt(p, cfg.task)))
                  for pid, p in unsolved]
        for (pid, p), g in zip(unsolved, sample(run, hinted, (cfg.seed, it, 1))):
            kept = keep(g, cfg.template, cfg.expert_max_per_problem)
            # the hint is stripped here
            data += [(run.task.prompt_ids(p), g.comps[i]) for i in kept]
            ok[1] += [steps_ok(g.texts[i]) for i in kept]
            rescued += bool(kept)
    stats = {"expert/solved": (len(pool) - len(unsolved)) / len(pool),
             "expert/rescued": rescued / len(pool), "expert/dataset_size": len(data),
             "expert/sample_accuracy": n_correct / max(1, n_samples)}
    # the share of kept rationales whose every step is right, unaided and rescued
    if cfg.task == "arithmetic":
        stats["expert/steps_ok"] = sum(ok[0]) / max(1, len(ok[0]))
        if rationalise:
            stats["expert/rescued_steps_ok"] = sum(ok[1]) / max(1, len(ok[1]))
    return data, stats


def pool_at(run: train.Run, it: int) -> list:
    """Step 1's problems at iteration `it` (1, 2, ...): the stream's first train_size (or the whole
    train_file), or with expert_fresh its it-th block of that many."""
    n = run.cfg.train_size if run.cfg.train_size > 0 else len(run.task.train)
    first = (it - 1) * n if run.cfg.expert_fresh else 0
    return [run.task.problem("rl", i) for i in range(first, first + n)]


def batches(cfg: StarConfig, n: int, it: int):
    """expert_sft_steps batches of indices into the data set: seeded shuffles, without replacement
    per epoch."""
    order, epoch, B = [], 0, cfg.sft_batch_size
    while len(order) < cfg.expert_sft_steps * B and n:
        perm = list(range(n))
        random.Random(seed_of(cfg.seed, it, epoch)).shuffle(perm)
        order, epoch = order + perm, epoch + 1
    return [order[s * B:(s + 1) * B] for s in range(cfg.expert_sft_steps if n else 0)]


def cold_start_batch(run: train.Run, task: tasks.Task,
                     state: train.TrainState) -> tuple[list, list]:
    """Step 0: train.py's cold-start batch (the GLOBAL batch), a seeded hint_sft_frac share of the
    prompts hinted."""
    cfg, ks = run.cfg, range(state.sft_cursor, state.sft_cursor + run.cfg.sft_batch_size)
    probs, prompts, comps = task.cold_start_batch(state.sft_cursor, cfg.sft_batch_size)
    state.sft_cursor += cfg.sft_batch_size
    hinted = [random.Random(seed_of(cfg.seed, k, 8)).random() < cfg.hint_sft_frac for k in ks]
    prompts = [task.prompt_ids(dataclasses.replace(p, prompt=hint_prompt(p, cfg.task)))
               if h else ids
               for p, ids, h in zip(probs, prompts, hinted)]
    return prompts, comps


def main(cfg: StarConfig) -> dict:
    run, state, stage = train.build_run(cfg), train.TrainState(), cfg.algo
    total = cfg.sft_steps + cfg.expert_iters * cfg.expert_sft_steps  # for the console's ETA
    logger = Logger(run.proc, cfg.out_dir, dataclasses.asdict(cfg), cfg.wandb_mode,
                    cfg.wandb_project, 0, total)
    if run.proc.rank == 0:
        source, kept = (" from the teacher" if cfg.teacher else "",
                        "the verified" if cfg.expert_filter else "all")
        print(cli.banner(cfg, f"{stage}: sample {cfg.expert_samples}/problem{source}, keep {kept}, "
                              "fine-tune", run.model, run.proc), flush=True)
    # --------------------------------------------------------------------------- step 0: cold start
    # train_size bounds the pool of step 1, not the cold start
    sft_task = tasks.Task(dataclasses.replace(cfg, train_size=0), run.task.tok, run.task.stop_ids,
                          run.task.tok_config)
    opt, sched = train.make_optimizer(run, cfg.sft_lr, cfg.sft_steps)
    for step in range(1, cfg.sft_steps + 1):
        logger.log(step, "sft",
                   train.sft_update(run, opt, sched, *cold_start_batch(run, sft_task, state)))
    step = cfg.sft_steps
    results = {"sft": train.evaluate(run, step, logger)}
    logger.log(step, "sft", results["sft"])
    # M_0 (this rank's shards under FSDP)
    base = [p.detach().clone() for p in run.model.parameters()]
    # ------------------------------------------------------------------------ steps 1-4: iterations
    # seconds spent sampling and fine-tuning: the budget rl_minutes counts no evaluation
    trained = 0.0
    if cfg.rl_minutes:  # the console's ETA: the budget's end on the training clock
        logger.deadline = logger.train_clock() + 60 * cfg.rl_minutes
    for it in range(1, cfg.expert_iters + 1):
        t0 = time.time()
        data, stats = collect(run, pool_at(run, it), it)
        t1 = time.time()
        if cfg.algo == "star" and cfg.expert_from_base:
            with torch.no_grad():
                for p, b in zip(run.model.parameters(), base):
                    p.copy_(b)
            infra.refresh(run.sampler, run.model, lazy=True)  # M_0 again: sampling re-gathers it
        opt, sched = train.make_optimizer(run, cfg.expert_lr, cfg.expert_sft_steps)
        losses = []
        for s, idx in enumerate(batches(cfg, len(data), it)):
            rec = train.sft_update(run, opt, sched, [data[i][0] for i in idx],
                                   [data[i][1] for i in idx])
            rec = {k: float(v) for k, v in rec.items()}  # the step's host sync, for logging
            losses.append(rec["train/loss"])
            logger.log(step + s + 1, stage, rec)
        step += cfg.expert_sft_steps
        if run.proc.rank == 0:
            print(f"iteration {it}: " + " ".join(f"{k[7:]} {v:.3f}" for k, v in stats.items()) +
                  f" | sample {t1 - t0:.1f}s, fine-tune {time.time() - t1:.1f}s", flush=True)
        trained += time.time() - t0
        results[stage] = train.evaluate(run, step, logger)
        logger.log(step, stage, {**stats, "expert/iteration": it, "time/sample_s": t1 - t0,
                                 "train/loss_mean": sum(losses) / max(1, len(losses)),
                                 "time/trained_s": trained, **results[stage]})
        infra.save_run(run, state, step, stage, opt, sched)
        if infra.any_rank(0 < cfg.rl_minutes < trained / 60):  # RL's time budget
            break
    return logger.finish(results)


if __name__ == "__main__":
    cli.run_main(main, train.parse_args(sys.argv[1:], StarConfig))
    infra.teardown()
