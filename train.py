"""GRPO / DAPO / Dr. GRPO training of a reasoning policy with verifiable rewards, after a
supervised cold start.

One RL step, rl_step() below (DeepSeekMath 2024 Alg. 1 with DAPO 2025 Alg. 1's dynamic sampling):
  1. draw P prompts q; sample G completions o_1..o_G ~ π_θ(·|q) each (sample_groups);
  2. reward r_i = the verifier's score (Task.score), plus a format weight and DAPO's overlong
     shaping where set (shaped_rewards); DAPO's dynamic sampling drops groups with zero reward
     spread and draws more prompts until P informative groups are held (dynamic_sampling);
  3. this rank's rows, their loss mask, the loss's GLOBAL normaliser and the micro-batches
     (rank_batch); Â_i of every group, all ranks' (credit.group_advantages), then this rank's rows;
  4. ppo_epochs (GRPO's μ) optimizer steps, each a pass over the micro-batches: log π_θ
     (completion_logprobs), π_old = π_θ of the first pass, loss = grpo.policy_loss divided by the
     global token count, so any rank or micro-batch split gives the same gradient; backward; clip
     the gradient norm; AdamW (optimizer_step); warmup + cosine.
Each option is one guarded line in rl_step (β·KL to π_ref; objective.Options for KL in the
reward, distillation, TIS, top-entropy, Clip-/KL-Cov, process rewards). SFT (DeepSeek-R1's cold
start): sft_update. The Config: config.py; processes, FSDP2, checkpoints: infra.py; the sampler:
rollout.py; sampler ranks (sampler_ranks): async_rl.py.

  python train.py                                        # the CPU demo: SFT, then DAPO
  python train.py --help                                 # every setting, its default and source
  python train.py --config configs/smoke.toml --rl_steps=8
  torchrun --standalone --nproc_per_node=8 train.py --config configs/qwen2.5-0.5b-gsm8k.toml"""
import dataclasses
import math
import os
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

import async_rl
import checks
import cli
import credit
import distill
import grpo
import guard
import infra
import lora
import memory
import rollout
from config import Config, parse_args
# the printed formula; what options beyond the default path add to a step
from objective import Options, objective
import tasks
import templates
import tooluse
import verify
from logger import LAPS, Logger, phase_clock, phase_seconds
from model import ModelConfig, Transformer, build_char_tokenizer, cpu_has_bf16, load_tokenizer
from rollout import FINISH, STOP_NAMES, completion_logprobs, generate, pad_batch


@dataclass
class Run:
    """What every step function reads: the config, this process, the policy and the task."""
    cfg: Config
    proc: infra.Proc
    model: torch.nn.Module              # the policy π_θ, FSDP2-sharded when world > 1
    task: tasks.Task                    # problems, prompts, tokenizer, stop ids, verifier
    ref: Transformer | None = None      # π_ref, a frozen unsharded copy (β > 0 only)
    sampler: Transformer | None = None  # the policy's weights outside FSDP, for generate
    teacher: Transformer | None = None  # π_T, frozen and unsharded (on-policy distillation only)
    link: async_rl.Link | None = None   # sampler_ranks > 0: this side of the rollout channel
    sync_every: bool = False            # FSDP2 reduce-scatters every micro-batch (grad_sync)
    # derived once from the above (__post_init__)
    static: bool | None = field(init=False)  # generate's compiled step (None: the device's default)
    sharded: bool = field(init=False)        # FSDP2 wraps the policy (several ranks, or CUDA)
    loss_kw: dict = field(init=False)        # grpo.policy_loss's settings from the Config
    options: bool = field(init=False)        # an option beyond the default step is on (Options)
    shaped: bool = field(init=False)         # rewards beyond the verifier's score (shaped_rewards)
    sampling: tuple = field(init=False)      # (temperature, top_k, top_p): π as sampled and scored
    clock: object = field(init=False)        # the phase timer: perf_counter, or CUDA events
    laps: deque = field(init=False)          # this step's (phase, clock at its end) marks

    def __post_init__(self):
        cfg = self.cfg  # resolved: Config.__post_init__ turned tis = "auto" into "none" or "token"
        self.static, self.sharded = infra.compiled_sampling(cfg), hasattr(self.model, "reshard")
        self.loss_kw = dict(pg_loss=cfg.pg_loss, ratio_level=cfg.ratio_level, eps_low=cfg.eps_low,
                            eps_high=cfg.eps_high, dual_clip=cfg.dual_clip, tau_pos=cfg.tau_pos,
                            tau_neg=cfg.tau_neg, kl_estimator=cfg.kl_estimator,
                            kl_old=cfg.kl_old, agg=cfg.agg, max_len=cfg.max_new_tokens,
                            beta=cfg.beta if cfg.kl_in == "loss" else 0.0)  # β·KL to π_ref
        self.sampling = (cfg.temperature, cfg.top_k, cfg.top_p)
        self.clock, self.laps = phase_clock(self.proc.device), deque(maxlen=LAPS)
        self.shaped = cfg.reward == "format_only" or bool(cfg.format_weight or cfg.overlong_buffer)
        self.options = (cfg.top_entropy_q < 1 or cfg.cov != "none" or cfg.tis != "none"
                        or bool(cfg.teacher) or cfg.kl_in == "reward" or cfg.reward != "outcome"
                        or cfg.adv_scale == "reinforce_pp")


@dataclass
class TrainState:
    """What a checkpoint carries besides weights, optimizer and scheduler, restored whole."""
    rl_cursor: int = 0                  # next index of the RL prompt stream
    sft_cursor: int = 0                 # next index of the cold-start stream
    pass_history: dict = field(default_factory=dict)  # problem id -> [saturated?], last visits
    bad_steps: int = 0                  # consecutive non-finite steps
    keep_rate: float = 1.0              # the last step's kept fraction of groups (DAPO's refill)


@dataclass
class Group:
    """G samples of one prompt, as every rank holds them after the all-gather."""
    pos: int                            # index of the problem in this draw: the global order
    pid: int                            # problem id (the pass-rate memory's key)
    problem: tasks.Problem
    prompt: list[int]                   # prompt token ids
    comps: list[list[int]]              # G completions' ids, the stop token included
    texts: list[str]                    # G decoded completions
    logprobs: list[torch.Tensor]        # G sampler log-prob vectors, one per completion token
    truncated: list[bool]               # no stop token within max_new_tokens
    scores: list[float]                 # the verifier's score of each completion
    rewards: list[float] = field(default_factory=list)  # shaped rewards (shaped_rewards)
    finish: list[str] = field(default_factory=list)  # how each sample ended: rollout.FINISH
    policy: list = field(default_factory=list)  # G policy masks (False: a tool's forced tokens)
    tools: list = field(default_factory=list)   # G (tool calls, errors); both empty: no tools


def build_run(cfg: Config, adapter: str = "") -> Run:
    """Join the processes, build or load the policy (sharded, float32; LoRA: `adapter` on resume)
    and its tokenizer, and the task; completions stop at the checkpoint's eos ids."""
    checks.check(cfg)  # every setting and file first, each mistake one line, before anything loads
    proc = infra.setup(cfg.device, cfg.threads, cfg.collective_timeout)
    native = cpu_has_bf16()  # AVX512-BF16 or AMX instructions
    cpu_bf16 = cfg.cpu_bf16 == "true" or cfg.cpu_bf16 == "auto" and native
    (rollout.BF16.add if cpu_bf16 else rollout.BF16.discard)("cpu")  # rollout.py's global
    if cfg.cpu_bf16 == "true" and proc.device.type == "cpu" and not native:
        print("note: cpu_bf16 on a CPU without bf16 instructions runs slower than float32")
    proc, link = async_rl.split(proc, cfg)  # link: async's sides
    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        tok = load_tokenizer(cfg.init_from)
        model = Transformer.from_pretrained(cfg.init_from, dtype=torch.float32)
    else:
        tok = build_char_tokenizer(tasks.CHARS + tooluse.CHARS * bool(cfg.tools))
        model = Transformer(ModelConfig(
            vocab_size=tok.get_vocab_size(), hidden_size=cfg.hidden_size, n_layers=cfg.n_layers,
            n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
            intermediate_size=cfg.intermediate_size, max_seq_len=cfg.max_seq_len))
    if cfg.lora_rank:  # the base frozen, A and B trained (lora.py)
        lora.wrap(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, adapter)
    info = templates.read_tokenizer_config(cfg.init_from) if cfg.init_from else {}
    task = tasks.Task(cfg, tok, templates.stop_ids(tok, info, STOP_NAMES), info)
    bf16 = proc.device.type in rollout.BF16  # the decode's weights in bf16: CUDA; CPU, cpu_bf16
    if link and not link.trains:  # a sampler rank: a plain copy; weights come from the trainers
        return Run(cfg, proc, infra.frozen_copy(model.to(proc.device), proc.device,
                                                torch.bfloat16 if bf16 else None), task, link=link)
    # activation checkpointing and the gradient reduce-scatter's schedule: as set, or by the plan
    model.checkpointing, sync_every = memory.resolve(cfg, model.config, proc)
    model = infra.shard(model.to(proc.device), proc)  # generate reads a plain copy (sampling_copy)
    return Run(cfg, proc, model, task, sampler=infra.sampling_copy(model, proc, bf16),
               teacher=distill.load_teacher(cfg, tok, proc.device), link=link,
               sync_every=sync_every)


def make_optimizer(run: Run, lr: float, total: int):
    """AdamW over what trains; linear warmup, then cosine to min_lr_ratio · lr (or constant)."""
    cfg = run.cfg
    trained = [p for p in run.model.parameters() if p.requires_grad]  # LoRA: A and B only
    opt = torch.optim.AdamW(trained, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            weight_decay=cfg.weight_decay, fused=True)  # one kernel: 5x on CPU

    def factor(s):
        if s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        prog = min(1.0, (s - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        if cfg.lr_schedule == "constant":
            return 1.0
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


# ===================================================================================== 1. sampling
def sample_groups(run: Run, problems: list[tuple[int, tasks.Problem]], G: int, temperature: float,
                  keys: tuple, first: int = 0, model=None) -> list[Group]:
    """G scored completions of each (problem id, problem) by `model` (default: the policy), every
    group on every rank, in `problems` order: rank r samples problems r, r + world, ..., sample g
    of problem j seeded by (*keys, first + j, g), so any rank count draws the same tokens."""
    task, cfg, mine = run.task, run.cfg, range(run.proc.rank, len(problems), run.proc.world)
    if model is None and run.sampler is not None:  # FSDP2, LoRA, bf16: the policy's copy
        model = infra.sampling(run.sampler, run.model)
        run.laps.append(("refresh", run.clock()))  # (and the try's draw of problems)
    model = run.model if model is None else model  # default: the policy
    prompts, groups = [task.prompt_ids(problems[j][1]) for j in mine], []
    if prompts:
        seeds = torch.tensor([tasks.seed_of(*keys, first + j, g) for j in mine for g in range(G)])
        ro = generate(model, prompts, G, cfg.max_new_tokens, temperature, cfg.top_k, cfg.top_p,
                      task.stop_ids, seeds, static=run.static, tools=task.tools)
        mask, ids, logp = ro.completion_mask.cpu(), ro.completion_ids.cpu(), ro.logprobs.cpu()
        comps, lps = [x[m].tolist() for x, m in zip(ids, mask)], [x[m] for x, m in zip(logp, mask)]
        texts = task.tok.decode_batch(comps, skip_special_tokens=True)
    run.laps.append(("sample", run.clock()))  # where a step's time goes: phase_seconds
    for a, j in enumerate(mine):  # prompt j's G rows: a·G, ..., a·G + G − 1
        (pid, p), rows = problems[j], slice(a * G, (a + 1) * G)
        scores = [task.score(t, p) for t in texts[rows]]  # r_i: the verifier's; shaped later
        groups.append(Group(
            pos=j, pid=pid, problem=p, prompt=prompts[a], comps=comps[rows], texts=texts[rows],
            logprobs=lps[rows], truncated=ro.truncated[rows].tolist(), scores=scores,
            finish=[FINISH[c] for c in ro.finish[rows].tolist()], rewards=list(scores)))
    if task.tools and groups:  # each sample's policy mask, calls and errors (tooluse.py)
        tooluse.add_to_groups(groups, ro, G)
    return sorted(infra.all_gather_list(groups), key=lambda g: g.pos)


# ================================================================ 2. rewards and DAPO's filter
def dynamic_sampling(run: Run, state: TrainState, step: int) -> tuple[list[Group], dict]:
    """Steps 1-2: P groups of G samples and their rewards. DAPO §3.2: a group whose rewards are
    all equal has Â = 0 and teaches nothing; dynamic sampling drops it and samples more prompts,
    until P groups are kept or max_sample_tries run out. Each try draws enough for the keep rate
    so far, the first for the last step's (TrainState.keep_rate), so one try usually holds P."""
    cfg, P, G, t0 = run.cfg, run.cfg.prompts_per_step, run.cfg.group_size, time.time()
    kept, seen, skipped, missing = [], [], 0, P
    for tries in range(cfg.max_sample_tries if cfg.dynamic_sampling else 1):
        # n prompts for the keep rate r so far (at first the last step's): the kept count, about
        # Binomial(n, r), then covers what is missing with sample_margin standard deviations to
        # spare. A draw is at most 4·P, and P with one try (the sizes memory.sampling_calls plans)
        r = max(state.keep_rate, 1 / min(4, cfg.max_sample_tries))
        n = min(4 * P, math.ceil((missing + cfg.sample_margin * math.sqrt(missing * (1 - r))) / r))
        if cfg.skip_saturated_k:  # prompts saturated on their last k visits are skipped
            problems, n_skipped = draw_unsaturated(run.task, state, n, cfg.skip_saturated_k,
                                                   100 * P - skipped)
            skipped += n_skipped
        else:
            problems = [run.task.problem("rl", state.rl_cursor + i) for i in range(n)]
            state.rl_cursor += n
        groups = sample_groups(run, problems, G, cfg.temperature, (cfg.seed, step, tries))
        run.laps.append(("reward", run.clock()))  # the verifier's scores, gathered from the ranks
        if run.shaped:  # r_i beyond the verifier's score: format, length, the format-only control
            for g in groups:
                g.rewards = shaped_rewards(cfg, g)
        if cfg.skip_saturated_k:
            remember_saturated(state, groups, cfg.skip_saturated_k)
        # DAPO: the groups whose rewards differ (the others have Â = 0)
        keep = credit.keep_groups(g.rewards for g in groups) if cfg.dynamic_sampling else [True] * n
        kept, seen = kept + [g for g, k in zip(groups, keep) if k], seen + groups
        state.keep_rate, missing = len(kept) / len(seen), P - len(kept)
        if missing <= 0:
            break
    samples, seconds = G * len(seen), time.time() - t0
    stats = {"train/reward": sum(sum(g.rewards) for g in seen) / samples,
             "train/accuracy": sum(sum(g.scores) for g in seen) / samples,
             "train/kept_groups_frac": state.keep_rate, "train/sample_tries": tries + 1,
             "train/discarded_rollouts": G * (len(seen) - min(P, len(kept))),
             "train/skip_rate": skipped / (len(seen) + skipped), "time/rollout_s": seconds,
             "time/sample_tok_per_s": sum(len(c) for g in kept[:P] for c in g.comps) / seconds}
    stats |= {f"train/finish_{r}": sum(g.finish.count(r) for g in seen) / samples for r in FINISH}
    if run.task.outside:  # reasoning-gym's or a user's scorer: its timeouts and errors
        stats |= scorer_failures(run.task.score, "train/")
    return kept[:P], {**stats, **(tooluse.metrics(seen, "train/") if run.task.tools else {})}


def scorer_failures(scorer: tasks.Scorer, prefix: str) -> dict:
    """An outside scorer's timeouts and errors since the last call, summed over ranks."""
    counts = scorer.take_failures()
    return dict(zip((prefix + k for k in counts), infra.all_sum(list(counts.values())).tolist()))


def shaped_rewards(cfg: Config, g: Group) -> list[float]:
    """r_i = accuracy + format weight · format reward + DAPO soft overlong punishment (eq. 13);
    reward = "format_only" (the control): 1 for any committed number in place of accuracy."""
    lengths = torch.tensor([len(c) for c in g.comps])  # all tokens (a tool's too)
    penalty = torch.zeros(len(g.comps))  # + 0.0 and + 0 · f leave a reward bit-exact
    if cfg.overlong_buffer:
        penalty = credit.overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer)
    formats = [verify.format_reward(t) if cfg.format_weight else 0 for t in g.texts]
    outcomes = outcome_rewards(cfg, g.texts, g.scores)
    return [s + cfg.format_weight * f + p for s, f, p in zip(outcomes, formats, penalty.tolist())]


def outcome_rewards(cfg: Config, texts: list[str], scores: list[float]) -> list[float]:
    """The verifier's scores, or with reward = "format_only" 1 for any committed number (the
    control)."""
    if cfg.reward == "format_only":
        return [tasks.committed_number(t) for t in texts]
    return scores


def draw_unsaturated(task: tasks.Task, state: TrainState, n: int, k: int,
                     may_skip: int) -> tuple[list, int]:
    """The next n problems of the RL stream that were not saturated (all right or all wrong) on
    each of their last k visits -> (problems, skipped), skipping at most may_skip."""
    problems, skipped = [], 0
    while len(problems) < n:
        pid, p = task.problem("rl", state.rl_cursor)
        state.rl_cursor += 1
        history = state.pass_history.get(pid, [])
        if len(history) >= k and all(history[-k:]):
            skipped += 1
            if skipped > may_skip:
                raise RuntimeError("every training prompt is saturated: the pass-rate memory "
                                   "skips them all")
            continue
        problems.append((pid, p))
    return problems, skipped


def remember_saturated(state: TrainState, groups: list[Group], k: int):
    """The pass-rate memory: whether each group was saturated (all right or all wrong), its last
    k visits."""
    for g in groups:
        history = state.pass_history.get(g.pid, []) + [min(g.scores) == max(g.scores)]
        state.pass_history[g.pid] = history[-k:]


# ======================================== 3-4. this rank's batch, the log-probs and the update
@dataclass
class Batch:
    """This rank's rows of the step's global batch: rank r trains on groups r, r + world, ..."""
    groups: list[Group]                # the step's P groups, the same list on every rank
    rows: list[int]                    # this rank's n rows k·G + i (sample i of group k)
    prompts: list[list[int]]           # [n] prompts' token ids
    completions: list[list[int]]       # [n] completions' token ids
    mask: torch.Tensor                 # [n, L] bool: the loss tokens
    sampler_logp: torch.Tensor         # [n, L] the sampler's log-probs of its tokens
    plan: list[list[int]]              # the micro-batches: row indices, longest rows first
    pad_passes: int                    # passes with no rows, so ranks run as many as the busiest
    norm: torch.Tensor                 # the loss's normaliser over all ranks (grpo.loss_normaliser)


def rank_batch(cfg: Config, proc: infra.Proc, groups: list[Group], tools) -> Batch:
    """This rank's whole groups, their loss mask (DAPO §3.4 overlong filtering: mask_truncated
    takes truncated samples out of the loss; a tool's forced tokens are context, not actions), the
    global normaliser and the micro-batch plan."""
    G, mine = cfg.group_size, range(proc.rank, len(groups), proc.world)
    samples = [(groups[k], i) for k in mine for i in range(G)]  # sample i of group k: row k·G + i
    prompts, completions = [g.prompt for g, _ in samples], [g.comps[i] for g, i in samples]
    # DAPO §3.4 overlong filtering (mask_truncated): a truncated sample is out of the loss
    mask = pad_batch([[not (cfg.mask_truncated and g.truncated[i])] * len(g.comps[i])
                      for g, i in samples], False, torch.bool)                           # [n, L]
    if tools:
        mask &= pad_batch([g.policy[i] for g, i in samples], False, torch.bool)
    plan, pad_passes = infra.micro_batches(prompts, completions, cfg.micro_batch_tokens)
    logp = pad_batch([g.logprobs[i].tolist() for g, i in samples], 0.0, torch.float32)  # [n, L]
    return Batch(groups=groups, rows=[k * G + i for k in mine for i in range(G)], prompts=prompts,
                 completions=completions, mask=mask.to(proc.device), plan=plan,
                 pad_passes=pad_passes, sampler_logp=logp.to(proc.device),
                 norm=infra.all_sum(grpo.loss_normaliser(mask, cfg.agg, cfg.max_new_tokens)))


def optimizer_step(run: Run, opt, losses: list[torch.Tensor] = ()) -> torch.Tensor:
    """Clip the gradient norm, step, zero the gradients. The NaN guard: a non-finite loss on any
    rank (one all-reduce) or a non-finite norm skips the step on every rank."""
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = torch.where(infra.all_sum(sum(~x.isfinite() for x in losses)) == 0, norm, math.nan)
    # skipped: opt.step() still runs, without gradients (it changes nothing), so that torch never
    # sees the LR scheduler step before the optimizer has (it warns)
    if not torch.isfinite(norm):
        opt.zero_grad(set_to_none=True)
    opt.step()
    # no non-finite weight reaches a sampler (one all-reduce); its copy is gathered before sampling
    infra.check_weights(run.model, run.sampler, run.cfg.out_dir)
    opt.zero_grad(set_to_none=True)
    return norm


# ============================================================================================ SFT
def sft_update(run: Run, opt, sched, prompts: list, comps: list) -> dict:
    """One optimizer step of token-mean NLL (grpo.sft_loss) on a GLOBAL batch: rank r takes rows
    r, r + world, ..., divided by the global token count (any rank count, one gradient)."""
    proc = run.proc
    prompts, comps = prompts[proc.rank::proc.world], comps[proc.rank::proc.world]
    keep = pad_batch([tooluse.policy_mask(run.task.tools, c) for c in comps], False,
                     torch.bool).to(proc.device)  # [n, L] loss tokens: no tool result, no pad
    norm = infra.all_sum(float(keep.sum()))  # global loss tokens
    plan, pad_passes = infra.micro_batches(prompts, comps, run.cfg.micro_batch_tokens)
    metrics = []
    for b, rows in enumerate(plan):
        logp, entropy = completion_logprobs(run.model, [prompts[i] for i in rows],
                                            [comps[i] for i in rows], 0.0)             # [n, L]
        mask = keep[rows, :logp.shape[1]]                                               # [n, L]
        loss = grpo.sft_loss(logp, mask, loss_scale=norm)
        if run.sharded:  # FSDP2 reduce-scatters the gradients in the last backward
            run.model.set_requires_gradient_sync(run.sync_every or b == len(plan) - 1 + pad_passes)
        (loss * proc.world).backward()  # FSDP averages over ranks: undo it
        metrics.append({"train/loss": loss, "train/entropy": (entropy * mask).sum() / norm})
    if pad_passes:
        infra.padding_passes(run.model, pad_passes, every=run.sync_every)
    gnorm = optimizer_step(run, opt)
    sched.step()
    return {**infra.reduce_metrics(metrics), "train/grad_norm": gnorm,
            "train/lr": sched.get_last_lr()[0]}


def skip_update(opt, sched, stats: dict) -> dict:
    """No group to learn from: no gradients, no update; the schedule still steps after opt."""
    opt.step()
    sched.step()
    return {**stats, "train/loss": 0.0, "train/grad_norm": 0.0, "train/lr": sched.get_last_lr()[0]}


def rl_step(run: Run, opt, sched, state: TrainState, step: int) -> dict:
    """One RL step, the module docstring's steps 1-4; returns its metrics."""
    # 1-2. sample, reward, keep P groups with reward spread (the same list on every rank; with
    # sampler ranks, async_rl.py's, sampled ahead)
    groups, stats = run.link.take(state, step) if run.link else dynamic_sampling(run, state, step)
    if not groups:
        return skip_update(opt, sched, stats)
    # 3. this rank's rows; Â_i of every group: DeepSeekMath §4.1.2's (r_i − mean) / std
    # over the group, adv_scale's other, or the options' (objective.Options)
    t1, batch = time.time(), rank_batch(run.cfg, run.proc, groups, run.task.tools)
    rewards = torch.tensor([r for g in groups for r in g.rewards])                      # [N]
    options = Options(run, batch, step) if run.options else None
    adv = (options.advantages(rewards) if options else credit.group_advantages(
        rewards, run.cfg.group_size, run.cfg.adv_scale))[batch.rows].to(run.proc.device)
    # 4. ppo_epochs optimizer steps on this batch, each over every micro-batch; grpo.py's loss
    fixed, metrics = {}, []  # what epoch 0 fixes per micro-batch; metrics per micro-batch
    for epoch in range(run.cfg.ppo_epochs):
        for b, rows in enumerate(batch.plan):
            inputs = [batch.prompts[i] for i in rows], [batch.completions[i] for i in rows]
            logp, entropy = completion_logprobs(run.model, *inputs, *run.sampling)      # [n, L]
            mask = batch.mask[rows, :logp.shape[1]]                                     # [n, L]
            if epoch == 0:  # π_old = π_θ before the update: ρ = 1; the clip binds from the 2nd
                fixed[b] = dict(old_logp=logp.detach(), advantages=adv[rows], loss_scale=batch.norm)
                if run.cfg.beta and run.cfg.kl_in == "loss":  # β·KL(π_θ‖π_ref), GRPO's
                    fixed[b]["ref_logp"] = completion_logprobs(run.ref, *inputs, *run.sampling)[0]
                if options:  # TIS, top-entropy, Clip-/KL-Cov, OPD: their terms in fixed[b]
                    options.terms(b, fixed[b], entropy, mask, batch.sampler_logp[rows])
            run.laps.append(("forward", run.clock()))  # log π_θ (and π_ref, options, the batch)
            loss, terms = grpo.policy_loss(logp, mask=mask, **run.loss_kw, **fixed[b])
            metrics.append(grpo.loss_sums(loss, terms, mask, entropy, batch.sampler_logp[rows]))
            if run.sharded:  # FSDP2 reduce-scatters the gradients in the step's last backward
                last = b == len(batch.plan) - 1 + batch.pad_passes  # (grad_sync every: in each)
                run.model.set_requires_gradient_sync(run.sync_every or last)
            (loss * run.proc.world).backward()  # FSDP averages gradients over ranks: undo it
            run.laps.append(("backward", run.clock()))
        if batch.pad_passes:  # fewer rows than the busiest rank: passes that add nothing
            infra.padding_passes(run.model, batch.pad_passes, every=run.sync_every)
        losses = [m["loss"] for m in metrics[len(metrics) - len(batch.plan):]]  # this epoch's
        gnorm = optimizer_step(run, opt, losses)  # a NaN on any rank: every rank skips
        run.laps.append(("optimizer", run.clock()))  # (and the padding passes)
        if not torch.isfinite(gnorm):
            guard.name_bad_rows(step, run.proc.rank, epoch, losses, batch)
    sched.step()  # once per RL step, whatever ppo_epochs: the schedule ends at the last step
    # epoch 0's metrics (and the options'): sums over micro-batches and ranks, then token means
    m = infra.reduce_metrics(metrics[:len(batch.plan)] + (options.metrics if options else []))
    n, n_comp = m.pop("tokens").clamp(min=1), sum(len(c) for g in groups for c in g.comps)
    return {**stats, **{f"train/{k}": v if k == "loss" or k.endswith("_max") else v / n
                        for k, v in m.items()}, "train/grad_norm": gnorm,
            "train/lr": sched.get_last_lr()[0], "time/train_s": time.time() - t1,
            "train/completion_len": n_comp / (run.cfg.group_size * len(groups)),
            **(distill.teacher_pass(run, groups, step) if run.teacher is not None else {})}


# ===================================================================================== evaluation
def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's unbiased pass@k from n samples of which c are right:
    1 − C(n−c, k) / C(n, k): the chance that k of the n, drawn without replacement, hold a right
    one."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_row(g: Group, s: Group, k: int) -> dict:
    """One held-out problem's numbers from its greedy group g and its k sampled completions s
    (pass@j for j = 2, 4, ... <= k, from the k samples)."""
    answers = [verify.extract_answer(t) for t in s.texts]
    right = sum(score >= 1 for score in s.scores)
    votes = Counter(a for a in answers if a is not None).most_common(1)
    return {"pass@1": g.scores[0], "pass@1_sampled": sum(s.scores) / k,
            f"maj@{k}": s.scores[answers.index(votes[0][0])] if votes else 0.0,
            "completion_len": sum(map(len, s.comps)) / k,
            "answer_rate": sum(a is not None for a in answers) / k,
            "answer_rate_greedy": float(verify.extract_answer(g.texts[0]) is not None),
            "truncated_frac": sum(s.truncated) / k,
            # a right answer that did not end at a stop token is not a finished solution
            "completed_pass@1": g.scores[0] * (g.finish[0] == "stop"),
            "completed_pass@1_sampled": sum(c for c, f in zip(s.scores, s.finish) if f == "stop")
            / k, **{f"pass@{2 ** i}_sampled": pass_at_k(k, right, 2 ** i)
                    for i in range(1, k.bit_length())}}


def evaluate(run: Run, step: int, logger: Logger | None = None,
             samples: list | None = None) -> dict:
    """Greedy and sampled pass@1, maj@k, length, answer and truncation rates (per level too); a
    `samples` list gets a record per completion (prompt, completion, answer, gold, correct, cut)."""
    cfg, probs, t0 = run.cfg, list(enumerate(run.task.heldout)), time.time()
    if run.link:  # async: no weight broadcast pending while this rank samples (async_rl.py)
        run.link.settle()
    rec, by_level, shown, tried = {}, {}, [], []
    for c0 in range(0, len(probs), cfg.eval_batch):
        chunk = probs[c0:c0 + cfg.eval_batch]
        greedy = sample_groups(run, chunk, 1, 0.0, (cfg.eval_seed, 0), c0)
        sampled = sample_groups(run, chunk, cfg.eval_k, cfg.temperature, (cfg.eval_seed, 1), c0)
        for g, s in zip(greedy, sampled):
            row = eval_row(g, s, cfg.eval_k)
            for key in [None, f"L{g.problem.level}"] + [g.problem.source] * bool(g.problem.source):
                by_level.setdefault(key, Counter()).update({**row, "n": 1})  # composite: per member
            if samples is None:
                continue
            for kind, x in (("greedy", g), ("sampled", s)):  # one record per completion
                samples += [{"problem": c0 + x.pos, "kind": kind,
                             "prompt": run.task.prompt_text(x.problem), "completion": t,
                             "answer": verify.extract_answer(t), "gold": x.problem.gold,
                             "correct": sc >= 1, "truncated": cut, "finish": f}
                            for t, sc, cut, f in zip(x.texts, x.scores, x.truncated, x.finish)]
        shown, tried = shown + greedy, tried + sampled
        if run.proc.rank == 0 and len(probs) > cfg.eval_batch:  # a long eval shows its progress
            n, dt = min(len(probs), c0 + cfg.eval_batch), time.time() - t0
            eta = dt / n * (len(probs) - n) / 60
            print(f"  eval {n}/{len(probs)} | {dt:.0f} s | eta {eta:.1f} min", flush=True)
    for level, acc in by_level.items():  # all over all problems, pass@1 per level (and member)
        keys = [k for k in acc if k != "n"] if level is None else ["pass@1", "pass@1_sampled"]
        suffix = "" if level is None else f"_{level}"
        rec.update({f"eval/{k}{suffix}": acc[k] / acc["n"] for k in keys})
    if logger:
        logger.samples(step, [(g.problem.prompt, g.texts[0], g.problem.gold, g.scores[0])
                              for g in shown])
    answered = rec["eval/answer_rate_greedy"]  # accuracy among the answered: format apart
    rec["eval/answered_accuracy"] = rec["eval/pass@1"] / answered if answered else 0.0
    tools = tooluse.metrics(tried, "eval/") if run.task.tools else {}
    if run.task.outside:  # the outside scorer's timeouts and errors in this evaluation
        rec |= scorer_failures(run.task.score, "eval/")
    if logger:  # the training clock (time/train_wall_s, rl_minutes) stops while this runs
        logger.evals_s += time.time() - t0
    return {"eval/maj@k": rec[f"eval/maj@{cfg.eval_k}"], **rec, **tools}


# =========================================================================================== loop
def start_stage(run: Run, cfg: Config, stage: str, step: int, latest: int, total: int, saved,
                state: TrainState, ckpt: str):
    """A fresh AdamW and LR schedule (mid-stage: `ckpt`'s); RL freezes π_ref, starts samplers."""
    opt, sched = make_optimizer(run, *((cfg.sft_lr, cfg.sft_steps) if stage == "sft" else
                                       (cfg.lr, cfg.rl_steps)))
    resumed = saved and step == latest + 1  # mid-stage: the optimizer and π_ref continue
    if resumed and saved["stage"] == stage:  # the fp32 weights and the optimizer, exactly
        infra.load_shards(run.model, opt, ckpt)
        sched.load_state_dict(saved["scheduler"])
    if stage == "rl" and cfg.beta > 0:
        run.ref = infra.frozen_copy(run.model, run.proc.device)
        ref_file = os.path.join(ckpt, "ref_model.pt")
        if resumed and os.path.exists(ref_file):
            run.ref.load_state_dict(torch.load(ref_file, map_location=run.proc.device))
    if stage == "rl" and run.link:  # the samplers start: π_(step−1), the stream, saved rollouts
        rollouts = saved.get("rollouts") if resumed else None
        run.link.publish(run, step - 1, total, state, rollouts, Group)
    return opt, sched


def main(cfg: Config) -> dict:
    checks.check(cfg)  # every mistake in one line, then the process group: ranks agree on a resume
    infra.setup(cfg.device, cfg.threads, cfg.collective_timeout)
    latest, ckpt, saved = infra.latest_checkpoint(cfg.out_dir) if cfg.resume else (0, "", None)
    if latest and not cfg.lora_rank:  # resume: weights from the checkpoint (LoRA: its adapter
        cfg = dataclasses.replace(cfg, init_from=ckpt)  # on the same base), the rest from its state
    run, total = build_run(cfg, ckpt if cfg.lora_rank else ""), cfg.sft_steps + cfg.rl_steps
    state = TrainState(**saved["state"]) if saved else TrainState()
    if run.link and not run.link.trains:  # a sampler rank samples until the trainers stop it
        return async_rl.sampler_loop(run, state, dynamic_sampling)
    if saved:
        torch.set_rng_state(saved["rng"])
    logger = Logger(run.proc, cfg.out_dir, dataclasses.asdict(cfg), cfg.wandb_mode,
                    cfg.wandb_project, latest, total)
    if run.proc.rank == 0:
        print(cli.banner(cfg, objective(cfg), run.model, run.proc), flush=True)
    opt, stage, results, rl_t0 = None, None, {}, time.time()
    if not latest:  # the baseline: every curve starts from the checkpoint it trains
        logger.log(0, "base", results.setdefault("base", evaluate(run, 0, logger)))
        logger.t0, logger.evals_s = time.time(), 0.0  # the ETA counts training steps only
    for step in range(latest + 1, total + 1):
        if stage != ("sft" if step <= cfg.sft_steps else "rl"):  # a new stage
            # rl_t0 on the training clock: evaluations do not count against rl_minutes
            stage, rl_t0 = "sft" if step <= cfg.sft_steps else "rl", logger.train_clock()
            logger.deadline = rl_t0 + 60 * cfg.rl_minutes if cfg.rl_minutes else None
            opt, sched = start_stage(run, cfg, stage, step, latest, total, saved, state, ckpt)
        if stage == "sft":
            _, prompts, comps = run.task.cold_start_batch(state.sft_cursor, cfg.sft_batch_size)
            state.sft_cursor += cfg.sft_batch_size
            rec = sft_update(run, opt, sched, prompts, comps)
        else:
            run.laps.clear()  # the step's phases from here (time/<phase>_s: phase_seconds)
            run.laps.append(("", run.clock()))
            rec = rl_step(run, opt, sched, state, step)
            rec |= phase_seconds(run.laps)
            if run.link:  # π_step to the samplers, which may now sample step + 1 + K
                run.link.publish(run, step, total)
        rec = {k: float(v) for k, v in rec.items()}  # the step's host sync, for logging
        state.bad_steps = guard.count_bad_steps(state.bad_steps, rec, step, cfg.max_bad_steps,
                                                cfg.out_dir)
        logger.log(step, stage, rec)
        rl_steps_done = step - cfg.sft_steps
        if stage == "rl" and cfg.ref_update_every and rl_steps_done % cfg.ref_update_every == 0:
            run.ref = infra.frozen_copy(run.model, run.proc.device)  # (checks.py: needs beta > 0)
        trained_min = (logger.train_clock() - rl_t0) / 60
        stop = stage == "rl" and infra.any_rank(0 < cfg.rl_minutes < trained_min)
        total = step if stop else total
        if cfg.eval_every and step % cfg.eval_every == 0 or step in (cfg.sft_steps, total):
            t_eval, ev = time.time(), evaluate(run, step, logger)
            logger.log(step, stage, {**ev, "time/eval_s": time.time() - t_eval})
            if step in (cfg.sft_steps, total):  # the end of a stage: its column of the final table
                results[stage] = ev
        at_ckpt = cfg.ckpt_every and step % cfg.ckpt_every == 0 or step == total
        if at_ckpt and state.bad_steps == 0:
            infra.save_run(run, state, step, stage, opt, sched)
        if stop:
            break
    if run.link:
        run.link.stop(state)
    return logger.finish(results)


if __name__ == "__main__":
    cli.run_main(main, parse_args(sys.argv[1:]))
    infra.teardown()
