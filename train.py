"""GRPO / DAPO / Dr. GRPO training of a reasoning policy with verifiable rewards, after a
supervised cold start.

One RL step, rl_step() below (DeepSeekMath 2024 Alg. 1 with DAPO 2025 Alg. 1's dynamic sampling):
  1. draw P prompts q; sample G completions o_1..o_G ~ π_θ(·|q) each (sample_groups);
  2. reward r_i = accuracy (verify.py) + format weight + DAPO overlong shaping (shaped_rewards);
     DAPO dynamic sampling drops groups with zero reward spread and draws more prompts until P
     informative groups are held (dynamic_sampling);
  3. this rank's rows (rank_batch) and their advantages Â_i over the global batch
     (batch_advantages, credit.group_advantages); π_old = the policy before this step's update;
  4. μ inner epochs over micro-batches sized by a token budget: log π_θ (policy_logprobs), the
     token advantages and weights, loss = grpo.policy_loss(log π_θ, log π_old, Â, mask, ...)
     normalised by the GLOBAL token / sequence count, so any rank or micro-batch split gives the
     same gradient; backward; clip the gradient norm; AdamW (optimizer_step); warmup + cosine.
Each option (KL in the reward, distillation, TIS, top-entropy, Clip-/KL-Cov) is a named helper
to skip. SFT (DeepSeek-R1's cold start): sft_update. The Config: config.py; processes, FSDP2,
checkpoints: infra.py; the sampler: rollout.py; sampler ranks (sampler_ranks): async_rl.py.

  python train.py                                        # the CPU demo: SFT, then DAPO
  python train.py --help                                 # every setting, its default and source
  python train.py --config configs/smoke.toml --rl_steps=8
  torchrun --standalone --nproc_per_node=8 train.py --config configs/qwen2.5-0.5b-gsm8k.toml"""
import bisect
import dataclasses
import itertools
import math
import os
import sys
import time
from collections import Counter
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
from config import Config, parse_args
# the printed formula, and the whole-batch passes some options need before the first update
from objective import cov_picks, objective, whole_batch_pass
import tasks
import templates
import tooluse
import verify
from logger import Logger
from model import ModelConfig, Transformer, build_char_tokenizer, load_tokenizer
from rollout import STOP_NAMES, completion_logprobs, generate, pad_batch


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


@dataclass
class TrainState:
    """What a checkpoint carries besides weights, optimizer and scheduler, restored whole."""
    rl_cursor: int = 0                  # next index of the RL prompt stream
    sft_cursor: int = 0                 # next index of the cold-start stream
    pass_history: dict = field(default_factory=dict)  # problem id -> [saturated?], last visits
    bad_steps: int = 0                  # consecutive non-finite steps


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
    nonfinite: int = 0                  # samples ended at non-finite logits (Rollout.nonfinite)
    policy: list = field(default_factory=list)  # G policy masks (False: a tool's forced tokens)
    tools: list = field(default_factory=list)   # G (tool calls, errors); both empty: no tools


def build_run(cfg: Config, adapter: str = "") -> Run:
    """Join the processes, build or load the policy (sharded, float32; LoRA: `adapter` on resume)
    and its tokenizer, and the task; completions stop at the checkpoint's eos ids."""
    checks.check(cfg)  # every setting and file first, each mistake one line, before anything loads
    proc, link = async_rl.split(infra.setup(cfg.device, cfg.threads), cfg)  # link: async's sides
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
    if link and not link.trains:  # a sampler rank: a plain copy; weights come from the trainers
        return Run(cfg, proc, infra.frozen_copy(model.to(proc.device), proc.device), task,
                   link=link)
    model = infra.shard(model.to(proc.device), proc)  # generate reads a plain copy (sampling_copy)
    return Run(cfg, proc, model, task, sampler=infra.sampling_copy(model, proc),
               teacher=distill.load_teacher(cfg, tok, proc.device), link=link)


def make_optimizer(run: Run, lr: float, total: int):
    """AdamW over what trains; linear warmup, then cosine to min_lr_ratio · lr (or constant)."""
    cfg = run.cfg
    trained = [p for p in run.model.parameters() if p.requires_grad]  # LoRA: A and B only
    opt = torch.optim.AdamW(trained, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            weight_decay=cfg.weight_decay)

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
                  seed_keys, max_new_tokens: int, first: int = 0, model=None) -> list[Group]:
    """G scored completions of each problem by `model` (default: the policy), all groups on every
    rank in `problems` order; rank r samples r, r + world, ..., seeds (seed_keys, first + j, g)."""
    cfg, proc = run.cfg, run.proc
    mine = list(range(proc.rank, len(problems), proc.world))
    prompts = [run.task.prompt_ids(problems[j][1]) for j in mine]
    seeds = torch.tensor([tasks.seed_of(*seed_keys, first + j, g) for j in mine for g in range(G)])
    model = infra.sampling(run.sampler, run.model) if model is None else model  # all ranks gather
    groups = []
    if mine:
        ro = generate(model, prompts, G, max_new_tokens, temperature=temperature, top_k=cfg.top_k,
                      top_p=cfg.top_p, stop_ids=run.task.stop_ids, seed=seeds,
                      static=infra.compiled_sampling(cfg), tools=run.task.tools)
        ids, mask, logp = ro.completion_ids.cpu(), ro.completion_mask.cpu(), ro.logprobs.cpu()
        truncated, nonfinite, policy = ro.truncated.cpu(), ro.nonfinite.cpu(), ro.policy_mask.cpu()
        calls = torch.stack((ro.tool_calls, ro.tool_errors), 1).tolist() if run.task.tools else []
    for a, j in enumerate(mine):
        rows = range(a * G, (a + 1) * G)
        comps = [ids[r][mask[r]].tolist() for r in rows]
        texts = [run.task.text(c) for c in comps]
        groups.append(Group(j, *problems[j], prompts[a], comps, texts,
                            [logp[r][mask[r]] for r in rows], truncated[rows].tolist(),
                            [run.task.score(t, problems[j][1]) for t in texts],
                            nonfinite=int(nonfinite[rows].sum()),
                            policy=[policy[r][mask[r]].tolist() for r in rows],
                            tools=calls[a * G:(a + 1) * G]))
    return sorted(infra.all_gather_list(groups), key=lambda g: g.pos)


# ============================================================================ 2. rewards, filtering
def shaped_rewards(cfg: Config, g: Group) -> list[float]:
    """r_i = accuracy + format weight · format reward + DAPO soft overlong punishment (eq. 13);
    reward = "format_only": 1 for any committed number in place of accuracy (g.scores stay it)."""
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


def draw_problems(run: Run, state: TrainState, n: int, may_skip: int) -> tuple[list, int, int]:
    """The next n problems of the RL stream -> (problems, drawn, skipped), skipping at most
    may_skip prompts saturated (all right or all wrong) on their last skip_saturated_k visits."""
    k, problems, drawn, skipped = run.cfg.skip_saturated_k, [], 0, 0
    while len(problems) < n:
        pid, p = run.task.problem("rl", state.rl_cursor)
        state.rl_cursor, drawn = state.rl_cursor + 1, drawn + 1
        history = state.pass_history.get(pid, [])
        if k and len(history) >= k and all(history[-k:]):
            skipped += 1
            if skipped > may_skip:
                raise RuntimeError("every training prompt is saturated: the pass-rate memory "
                                   "skips them all")
            continue
        problems.append((pid, p))
    return problems, drawn, skipped


def dynamic_sampling(run: Run, state: TrainState, step: int) -> tuple[list[Group], dict]:
    """DAPO §3.2: sample groups until P have reward spread > 0 (or max_sample_tries run out);
    without it, the first P groups. Each refill draws enough prompts for the keep rate so far."""
    cfg, P, G, k = run.cfg, run.cfg.prompts_per_step, run.cfg.group_size, run.cfg.skip_saturated_k
    kept, seen, drawn, skipped, keep_rate = [], [], 0, 0, 1.0
    for tries in range(cfg.max_sample_tries if cfg.dynamic_sampling else 1):
        n = P if tries == 0 else min(4 * P, math.ceil((P - len(kept)) / max(keep_rate, 0.25)))
        problems, n_drawn, n_skipped = draw_problems(run, state, n, 100 * P - skipped)
        drawn, skipped = drawn + n_drawn, skipped + n_skipped
        groups = sample_groups(run, problems, G, cfg.temperature, (cfg.seed, step, tries),
                               cfg.max_new_tokens)
        for g in groups:
            g.rewards = shaped_rewards(cfg, g)
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
        spread = credit.keep_groups(rewards, G).tolist()  # [len(groups)]: reward spread > 0
        for g, informative in zip(groups, spread):
            saturated = min(g.scores) == max(g.scores)  # all right or all wrong
            history = state.pass_history.get(g.pid, []) + [saturated]
            state.pass_history[g.pid] = history[-max(1, k):]
            if informative or not cfg.dynamic_sampling:
                kept.append(g)
        seen += groups
        keep_rate = len(kept) / len(seen)
        if len(kept) >= P:
            break
    samples = G * len(seen)
    stats = {"train/reward": sum(sum(g.rewards) for g in seen) / samples,
             "train/accuracy": sum(sum(g.scores) for g in seen) / samples,
             "train/kept_groups_frac": keep_rate,
             "train/discarded_rollouts": G * (len(seen) - min(P, len(kept))),
             "train/skip_rate": skipped / drawn, "train/sample_tries": tries + 1,
             "train/truncated_frac": sum(sum(g.truncated) for g in seen) / samples,
             "train/nonfinite_rows": sum(g.nonfinite for g in seen)}
    return kept[:P], {**stats, **tooluse.metrics(seen, "train/")}


# ================================================================== 3. log-probs and the update
def policy_logprobs(run: Run, model, prompts: list, comps: list, rows: list[int],
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log π and entropy [n, L] of a micro-batch's rows under `model` (bf16 autocast on CUDA)."""
    completions, dev = [comps[i] for i in rows], run.proc.device
    ids = pad_batch(completions).to(dev)  # [n, L]
    with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
        return completion_logprobs(model, [prompts[i] for i in rows], ids, temperature,
                                   run.cfg.top_k, run.cfg.top_p,
                                   lengths=[len(c) for c in completions])


def optimizer_step(run: Run, opt, finite: torch.Tensor | None = None) -> torch.Tensor:
    """Clip the gradient norm, step (skipped when the norm, or `finite`, every rank's losses, is
    not), zero grads."""
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if finite is not None:  # guard.py: NaN anywhere skips everywhere
        norm = torch.where(finite, norm, math.nan)
    ok = bool(torch.isfinite(norm))
    if not ok:  # skipped: without gradients the step below changes nothing, and torch's LR
        opt.zero_grad(set_to_none=True)  # scheduler sees the optimizer step it expects first
    opt.step()
    if ok:
        infra.refresh(run.sampler, run.model, lazy=True)  # gathered before the next sampling
    opt.zero_grad(set_to_none=True)
    return norm


# ============================================================================================ SFT
def sft_update(run: Run, opt, sched, prompts: list, comps: list) -> dict:
    """One optimizer step of token-mean NLL (grpo.sft_loss) on a GLOBAL batch: rank r takes rows
    r, r + world, ..., divided by the global token count (any rank count, one gradient)."""
    proc = run.proc
    prompts, comps = prompts[proc.rank::proc.world], comps[proc.rank::proc.world]
    keep = pad_batch([tooluse.policy_mask(run.task.tools, c) for c in comps] + [[False]], False,
                     torch.bool).to(proc.device)  # [n + 1, L] loss tokens: no tool result, no pad
    norm = infra.all_sum(float(keep.sum()))  # global loss tokens
    plan, sums = infra.rank_micro_batches(prompts, comps, run.cfg.micro_batch_tokens), {}
    for b, rows in enumerate(plan):
        logp, entropy = policy_logprobs(run, run.model, prompts + [[0]], comps + [[0]], rows, 0.0)
        mask = keep[rows, :logp.shape[1]]  # [n, L]
        loss = grpo.sft_loss(logp, mask, loss_scale=norm)
        infra.grad_sync(run.model, b == len(plan) - 1)  # FSDP2 reduce-scatters after the last
        (loss * proc.world).backward()  # FSDP averages over ranks: undo it
        infra.add_sums(sums, {"train/loss": loss, "train/entropy": (entropy * mask).sum() / norm})
    gnorm = optimizer_step(run, opt)
    sched.step()
    return {**infra.all_sum_dict(sums), "train/grad_norm": gnorm,
            "train/lr": sched.get_last_lr()[0]}


# ============================================================================================= RL
@dataclass
class Batch:
    """This rank's rows of the step's global batch: rank r trains on whole groups r, r + world, ...

    The pad row: every rank runs as many micro-batches as the busiest (FSDP's collectives line
    up): a rank with fewer rows runs padding passes on an extra row n, last in every list and
    tensor here (token 0, loss mask 0, advantage 0): nothing in the loss, gradient or metrics."""
    groups: list[Group]                # the step's P groups, the same list on every rank
    samples: list[tuple[int, int]]     # this rank's n rows as (group k, sample i)
    ids: list[int]                     # their global row indices k·G + i
    prompts: list[list[int]]           # n + 1 prompts' token ids (the pad row last)
    completions: list[list[int]]       # n + 1 completions' token ids
    mask: torch.Tensor                 # [n + 1, L] bool: the loss tokens
    sampler_logp: torch.Tensor         # [n + 1, L] the sampler's log-probs of its tokens
    plan: list[list[int]]              # the micro-batches: row indices, longest rows first
    normaliser: torch.Tensor           # the loss's denominator over all ranks

    def row_names(self) -> list[str]:  # "problem id/sample", the NaN guard's names for its rows
        return [f"{self.groups[k].pid}/{i}" for k, i in self.samples] + ["pad"]


def rank_batch(run: Run, groups: list[Group]) -> Batch:
    """This rank's whole groups, their loss mask (DAPO §3.4 overlong filtering: no loss on
    truncated samples with mask_truncated), the global normaliser and the micro-batch plan."""
    cfg, proc, G = run.cfg, run.proc, run.cfg.group_size
    samples = [(k, i) for k in range(proc.rank, len(groups), proc.world) for i in range(G)]
    ids = [k * G + i for k, i in samples]
    prompts = [groups[k].prompt for k, _ in samples]
    completions = [groups[k].comps[i] for k, i in samples]
    in_loss = [not (cfg.mask_truncated and groups[k].truncated[i]) for k, i in samples]
    policy = [groups[k].policy[i] for k, i in samples]  # tools: their forced tokens are context
    mask = pad_batch([[keep and p for p in pol] for keep, pol in zip(in_loss, policy)] + [[False]],
                     False, torch.bool).to(proc.device)  # [n + 1, L]
    sampler_logp = pad_batch([groups[k].logprobs[i].tolist() for k, i in samples] + [[0.0]], 0.0,
                             torch.float32).to(proc.device)  # [n + 1, L]
    normaliser = infra.all_sum(grpo.loss_normaliser(mask[:-1], cfg.agg, cfg.max_new_tokens))
    plan = infra.rank_micro_batches(prompts, completions, cfg.micro_batch_tokens)
    return Batch(groups, samples, ids, prompts + [[0]], completions + [[0]], mask, sampler_logp,
                 plan, normaliser)


def pass_before_update(run: Run, batch: Batch) -> list[tuple]:
    """(log π_old, entropy, log π_ref or None) [n, L] of every micro-batch, no gradients, for the
    options needing the whole batch first: top-entropy, KL in the reward, Clip-/KL-Cov; else []."""
    cfg = run.cfg
    if cfg.top_entropy_q < 1 or cfg.cov != "none" or cfg.kl_in_reward:
        return whole_batch_pass(run, policy_logprobs, batch.prompts, batch.completions, batch.plan)
    return []


def advantages(run: Run, groups: list[Group], shift: torch.Tensor | None = None) -> torch.Tensor:
    """Â [N] of the global batch (credit.group_advantages), or with reward = "process" Â [N, L]
    (credit.process_advantages): each step's 0/1 reward (verify.step_rewards) at its last token,
    the shaped outcome reward at the end; shift [N] (KL in the reward, −β Σ_t k1) goes first."""
    cfg = run.cfg
    rewards = torch.tensor([r for g in groups for r in g.rewards]) + (0 if shift is None else shift)
    if cfg.reward != "process":  # "none": zero rewards, so Â = 0 (pure distillation)
        rewards = rewards * (cfg.reward != "none")
        lengths = torch.tensor([0 if cfg.mask_truncated and cut else len(c) for g in groups
                                for c, cut in zip(g.comps, g.truncated)])
        return credit.group_advantages(rewards, cfg.group_size, scale=cfg.adv_scale,
                                       lengths=lengths)
    steps, shaped = [], iter(rewards.tolist())  # steps: per row, [(reward, end token)]
    for g in groups:
        for comp, text, r in zip(g.comps, g.texts, shaped):
            # each token's end character, to find the token a step's text ends in
            ends = list(itertools.accumulate(len(run.task.text([t])) for t in comp))
            row = [(float(ok), bisect.bisect_right(ends, e - 1))
                   for e, ok in verify.step_rewards(text)]
            steps.append(row + [(r, len(comp) - 1)])
    step_rewards = pad_batch([[s[0] for s in row] for row in steps], 0, torch.float32)
    step_ends = pad_batch([[s[1] for s in row] for row in steps], 0, torch.long)
    valid = pad_batch([[True] * len(row) for row in steps], False, torch.bool)
    length = max(len(c) for g in groups for c in g.comps)
    return credit.process_advantages(step_rewards, step_ends, valid, cfg.group_size, length)


def batch_advantages(run: Run, batch: Batch, before: list[tuple]) -> torch.Tensor:
    """Â of this rank's rows, [n + 1] or [n + 1, L] (0 on the pad row), over the global batch;
    KL in the reward shifts each reward by −β Σ_t k1 (credit.kl_reward), gathered by row."""
    cfg, dev = run.cfg, run.proc.device
    shift = None
    if cfg.kl_in_reward:
        mine = torch.zeros(len(batch.ids) + 1, device=dev)
        for (old_logp, _, ref_logp), rows in zip(before, batch.plan):
            mask = batch.mask[rows, :old_logp.shape[1]]
            mine[rows] = credit.kl_reward(mine[rows], old_logp, ref_logp, mask, cfg.beta)
        gathered = infra.all_gather_list(list(zip(batch.ids, mine[:-1].tolist())))
        shift = torch.tensor([v for _, v in sorted(gathered)])
    adv = advantages(run, batch.groups, shift)  # [N] or [N, L]
    return torch.cat((adv[batch.ids], adv.new_zeros(1, *adv.shape[1:]))).to(dev)


@dataclass
class TokenPicks:
    """Tokens chosen over the whole batch before the first update (None / [] when off)."""
    entropy_threshold: torch.Tensor | None  # top_entropy_q < 1: τ, the top-q entropy of π_old
    cov: list[torch.Tensor]                 # cov != "none": bool [n, L] per micro-batch


def token_picks(run: Run, batch: Batch, before: list[tuple], adv: torch.Tensor,
                step: int) -> TokenPicks:
    """The top-entropy threshold τ over the global batch's tokens (Wang et al. 2025), and the
    Clip-Cov / KL-Cov tokens by cov(log π_old, Â) (Cui et al. 2025, objective.cov_picks)."""
    cfg, dev = run.cfg, run.proc.device
    tau = None
    if cfg.top_entropy_q < 1:
        entropies = [entropy[batch.mask[rows, :entropy.shape[1]]].cpu()
                     for (_, entropy, _), rows in zip(before, batch.plan)]
        every = torch.cat(infra.all_gather_list(entropies))
        tau = grpo.entropy_threshold(every, cfg.top_entropy_q).to(dev)
    cov = []
    if cfg.cov != "none":
        cov = cov_picks(cfg, run.proc.rank, before, batch.plan, batch.mask, adv, step, batch.ids)
    return TokenPicks(tau, cov)


@dataclass
class OldPolicy:
    """What the first epoch fixes for a micro-batch: π_old and what hangs on it."""
    logp: torch.Tensor                      # log π_old [n, L]: π_θ before this step's update
    teacher: distill.TeacherLogProbs | None  # log π_T of the sampled tokens (a teacher only)
    high_entropy: torch.Tensor | None       # top_entropy_q < 1: bool [n, L], entropy ≥ τ
    cov_picked: torch.Tensor | None         # cov != "none": bool [n, L], Clip-/KL-Cov's tokens


def old_policy(run: Run, batch: Batch, picks: TokenPicks, b: int, logp: torch.Tensor,
               entropy: torch.Tensor, mask: torch.Tensor) -> OldPolicy:
    """Micro-batch b's π_old (logp, entropy [n, L] of epoch 0), its teacher log-probs and picks."""
    teacher = (None if run.teacher is None
               else distill.teacher_logprobs(run, batch.prompts, batch.completions, batch.plan[b]))
    tau = picks.entropy_threshold
    high_entropy = None if tau is None else grpo.top_entropy_mask(entropy, mask, tau)
    return OldPolicy(logp.detach(), teacher, high_entropy, picks.cov[b] if picks.cov else None)


def token_advantages(run: Run, adv: torch.Tensor, rows: torch.Tensor, length: int,
                     old: OldPolicy, mask: torch.Tensor) -> torch.Tensor:
    """Â of a micro-batch, [n] or [n, L]; on-policy distillation adds its per-token term
    w·(log π_T − log π_old)(o_t) (distill.opd_advantage)."""
    token_adv = adv[rows, :length] if adv.dim() == 2 else adv[rows]
    if old.teacher is None:
        return token_adv
    return distill.opd_advantage(token_adv, old.teacher.logp, old.logp, mask, run.cfg.opd_weight)


def token_weights(run: Run, old: OldPolicy, sampler_logp: torch.Tensor,
                  mask: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
    """grpo.policy_loss's pg_weight w_t [n, L] (None: all 1) and TIS's metrics: the truncated IS
    weight of the sampler/trainer mismatch × the top-entropy mask × Clip-Cov's 0 on its tokens."""
    cfg = run.cfg
    weight, tis = None, {}
    if cfg.tis != "none":  # the sampler drew from its own log-probs: reweight to π_old
        weight, tis = grpo.tis_weights(old.logp, sampler_logp, mask, cfg.tis, cfg.tis_mode,
                                       cfg.tis_cap)
    if old.high_entropy is not None:
        weight = old.high_entropy.float() if weight is None else weight * old.high_entropy
    if cfg.cov == "clip":  # the picked tokens leave the loss (KL-Cov: |log ρ| on them instead)
        weight = (~old.cov_picked).float() * (1 if weight is None else weight)
    return weight, tis


def ref_logprobs(run: Run, batch: Batch, rows: list[int]) -> torch.Tensor | None:
    """log π_ref [n, L] of a micro-batch for β·KL in the loss (kl_in "loss", β > 0), or None."""
    if not (run.cfg.beta > 0 and run.cfg.kl_in == "loss"):
        return None
    with torch.no_grad():
        return policy_logprobs(run, run.ref, batch.prompts, batch.completions, rows,
                               run.cfg.temperature)[0]


def loss_settings(cfg: Config) -> dict:
    """grpo.policy_loss's keywords that the Config fixes for the whole run."""
    return dict(pg_loss=cfg.pg_loss, ratio_level=cfg.ratio_level, eps_low=cfg.eps_low,
                eps_high=cfg.eps_high, dual_clip=cfg.dual_clip, tau_pos=cfg.tau_pos,
                tau_neg=cfg.tau_neg, kl_estimator=cfg.kl_estimator, kl_old=cfg.kl_old,
                agg=cfg.agg, max_len=cfg.max_new_tokens)


@dataclass
class Tally:
    """The step's metrics over its epoch-0 micro-batches: token-weighted sums and maxima."""
    sums: dict = field(default_factory=dict)
    maxes: dict = field(default_factory=dict)

    def add(self, run: Run, loss, metrics: dict, tis: dict, old: OldPolicy, sampler_logp, mask,
            entropy):
        # log π_old − log μ on the sampled tokens: the sampler/trainer scoring mismatch
        diff = (old.logp - sampler_logp) * mask
        maxes = [("train/logprob_gap_max", diff.abs().amax())]
        if tis:
            maxes.append(("train/tis_max", tis.pop("tis_max")))
        for k, v in maxes:
            self.maxes[k] = torch.maximum(self.maxes.get(k, v), v)
        n_tokens = metrics.pop("tokens")
        infra.add_sums(self.sums, {
            "train/loss": loss, "n": n_tokens, "train/entropy": (entropy * mask).sum(),
            "train/mismatch_kl": (torch.expm1(diff) - diff).sum(),  # k3 of KL(μ‖π_old)
            **{f"train/{k}": v * n_tokens for k, v in {**metrics, **tis}.items()},
            **(distill.metrics(run, old.teacher, old.logp, mask) if old.teacher is not None
               else {})})

    def result(self) -> dict:
        out = infra.all_sum_dict(self.sums)
        top = dict(zip(self.maxes, infra.all_max(torch.stack(list(self.maxes.values())))))
        n_tokens = out.pop("n").clamp(min=1)
        return {**{k: v / (1 if k == "train/loss" else n_tokens) for k, v in out.items()}, **top}


def skip_update(opt, sched, stats: dict) -> dict:
    """No group to learn from: no gradients, no update; the schedule still steps after opt."""
    opt.step()
    sched.step()
    return {**stats, "train/loss": 0.0, "train/grad_norm": 0.0, "train/lr": sched.get_last_lr()[0]}


def rl_step(run: Run, opt, sched, state: TrainState, step: int) -> dict:
    """One RL step, the module docstring's steps 1-4; returns its metrics."""
    cfg, world, dev = run.cfg, run.proc.world, run.proc.device
    t0 = time.time()
    # 1-2. sample, reward and keep P informative groups (the same global list on every rank)
    if run.link:  # async_rl.py: from the sampler ranks
        groups, stats = run.link.take(state, step)
    else:
        groups, stats = dynamic_sampling(run, state, step)
    t1 = time.time()
    if not groups:
        return skip_update(opt, sched, stats)
    # 3. this rank's rows; advantages (and the options' picks) over the global batch
    batch = rank_batch(run, groups)
    before = pass_before_update(run, batch)  # [] unless an option needs the whole batch
    adv = batch_advantages(run, batch, before)  # [n + 1] or [n + 1, L]
    picks = token_picks(run, batch, before, adv, step)
    # 4. μ optimizer steps on this batch, each over all micro-batches
    old, tally, settings = {}, Tally(), loss_settings(cfg)
    for epoch in range(cfg.ppo_epochs):
        losses = []  # this epoch's micro-batch losses, for the NaN guard
        for b, rows in enumerate(batch.plan):
            logp, entropy = policy_logprobs(run, run.model, batch.prompts, batch.completions,
                                            rows, cfg.temperature)  # [n, L]
            r, length = torch.tensor(rows, device=dev), logp.shape[1]
            mask, sampler_logp = batch.mask[r, :length], batch.sampler_logp[r, :length]
            ref = ref_logprobs(run, batch, rows)
            if epoch == 0:  # π_old = π_θ before the update: ρ = 1, the clip binds from epoch 2
                old[b] = old_policy(run, batch, picks, b, logp, entropy, mask)
            token_adv = token_advantages(run, adv, r, length, old[b], mask)
            weight, tis = token_weights(run, old[b], sampler_logp, mask)
            kl_cov = cfg.cov_kl_coef * old[b].cov_picked.float() if cfg.cov == "kl" else None
            loss, metrics = grpo.policy_loss(
                logp, old[b].logp, token_adv, mask, pg_weight=weight, ref_logp=ref,
                beta=cfg.beta * (ref is not None), abs_kl=kl_cov, loss_scale=batch.normaliser,
                **settings)
            infra.grad_sync(run.model, b == len(batch.plan) - 1)  # reduce once per optimizer step
            (loss * world).backward()  # FSDP averages gradients over ranks: undo it
            losses.append(loss.detach())
            if epoch == 0:  # log the on-policy epoch
                tally.add(run, loss, metrics, tis, old[b], sampler_logp, mask, entropy)
        gnorm = optimizer_step(run, opt, guard.finite_everywhere(losses))  # NaN anywhere: all skip
        guard.name_bad_rows(step, run.proc.rank, losses, batch.plan, batch.row_names())
    sched.step()  # once per RL step, whatever μ: the schedule ends at the last step
    trained = tally.result()
    tokens = infra.all_sum(float(sum(map(len, batch.completions[:-1]))))
    completion_len = sum(len(c) for g in groups for c in g.comps) / (cfg.group_size * len(groups))
    return {"time/rollout_s": t1 - t0, "time/sample_tok_per_s": tokens / (t1 - t0), **stats,
            **trained, "train/grad_norm": gnorm, "train/lr": sched.get_last_lr()[0],
            "time/train_s": time.time() - t1, "train/completion_len": completion_len,
            **(distill.teacher_pass(run, groups, step) if run.teacher is not None else {})}


# ===================================================================================== evaluation
def eval_row(g: Group, s: Group, k: int) -> dict:
    """One held-out problem's numbers from its greedy group g and its k sampled completions s."""
    answers = [verify.extract_answer(t) for t in s.texts]
    votes = Counter(a for a in answers if a is not None).most_common(1)
    return {"pass@1": g.scores[0], "pass@1_sampled": sum(s.scores) / k,
            f"maj@{k}": s.scores[answers.index(votes[0][0])] if votes else 0.0,
            "completion_len": sum(map(len, s.comps)) / k,
            "answer_rate": sum(a is not None for a in answers) / k,
            "answer_rate_greedy": float(verify.extract_answer(g.texts[0]) is not None),
            "truncated_frac": sum(s.truncated) / k}


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
        greedy = sample_groups(run, chunk, 1, 0.0, (cfg.eval_seed, 0), cfg.max_new_tokens, c0)
        sampled = sample_groups(run, chunk, cfg.eval_k, cfg.temperature, (cfg.eval_seed, 1),
                                cfg.max_new_tokens, c0)
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
                             "correct": sc >= 1, "truncated": cut}
                            for t, sc, cut in zip(x.texts, x.scores, x.truncated)]
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
    return {"eval/maj@k": rec[f"eval/maj@{cfg.eval_k}"], **rec, **tooluse.metrics(tried, "eval/")}


# =========================================================================================== loop
def start_stage(run: Run, cfg: Config, stage: str, step: int, latest: int, total: int, saved,
                state: TrainState, ckpt: str):
    """A fresh AdamW and LR schedule (mid-stage: `ckpt`'s); RL freezes π_ref, starts samplers."""
    opt, sched = make_optimizer(run, *((cfg.sft_lr, cfg.sft_steps) if stage == "sft" else
                                       (cfg.lr, cfg.rl_steps)))
    resumed = saved and step == latest + 1  # mid-stage: the optimizer and π_ref continue
    if resumed and saved["stage"] == stage:
        infra.load_optimizer(run.model, opt, saved["optimizer"])
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
        logger.t0 = time.time()  # the console's ETA counts training steps only
    for step in range(latest + 1, total + 1):
        if stage != ("sft" if step <= cfg.sft_steps else "rl"):  # a new stage
            stage, rl_t0 = "sft" if step <= cfg.sft_steps else "rl", time.time()
            opt, sched = start_stage(run, cfg, stage, step, latest, total, saved, state, ckpt)
        if stage == "sft":
            _, prompts, comps = run.task.cold_start_batch(state.sft_cursor, cfg.sft_batch_size)
            state.sft_cursor += cfg.sft_batch_size
            rec = sft_update(run, opt, sched, prompts, comps)
        else:
            rec = rl_step(run, opt, sched, state, step)
            if run.link:  # π_step to the samplers, which may now sample step + 1 + K
                run.link.publish(run, step, total)
        rec = {k: float(v) for k, v in rec.items()}  # the step's host sync, for logging
        state.bad_steps = guard.count_bad_steps(state.bad_steps, rec, step, cfg.max_bad_steps,
                                                cfg.out_dir)
        logger.log(step, stage, rec)
        rl_steps_done = step - cfg.sft_steps
        if stage == "rl" and cfg.ref_update_every and rl_steps_done % cfg.ref_update_every == 0:
            run.ref = infra.frozen_copy(run.model, run.proc.device)  # (checks.py: needs beta > 0)
        stop = stage == "rl" and infra.any_rank(0 < cfg.rl_minutes < (time.time() - rl_t0) / 60)
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
