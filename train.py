"""GRPO / DAPO / Dr. GRPO training of a reasoning policy with verifiable rewards, after a supervised cold start.

One RL step, rl_step() below (DeepSeekMath 2024 Alg. 1 with DAPO 2025 Alg. 1's dynamic sampling):
  1. draw P prompts q; sample G completions o_1..o_G ~ π_θ(·|q) each (sample_groups, per-row seeds);
  2. reward r_i = accuracy (verify.py) + format weight + DAPO overlong shaping (shaped_rewards); DAPO dynamic
     sampling drops groups with zero reward spread and draws more prompts until P informative groups are held;
  3. advantages Â_i from the group (credit.group_advantages); π_old = the policy before this step's update;
  4. μ inner epochs: loss = grpo.policy_loss(log π_θ, log π_old, Â, mask, ε_low, ε_high, log π_ref, β, agg),
     accumulated over micro-batches sized by a token budget (infra.micro_batches) and normalised by the GLOBAL token /
     sequence count, so any rank or micro-batch split gives the same gradient; clip grad norm; AdamW; warmup + cosine.
The supervised stage (DeepSeek-R1 cold start) minimises grpo.sft_loss on worked solutions (sft_update). Processes,
FSDP2, checkpoints: infra.py; the sampler: rollout.py; sampler ranks K versions ahead (sampler_ranks): async_rl.py.

  python train.py                                        # the CPU demo: SFT on a sloppy teacher, then DAPO
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
from typing import ClassVar

import torch

import async_rl
import checks
import cli
import credit
import distill
import grpo
import guard
import infra
from objective import cov_picks, objective, old_pass  # the printed formula, two global-batch passes
import tasks
import templates
import verify
from logger import Logger
from model import ModelConfig, Transformer, build_char_tokenizer, load_tokenizer
from rollout import STOP_NAMES, generate, pad_batch, score


@dataclass
class Config:
    # --- run
    out_dir: str = "runs/demo"          # run directory: metrics.jsonl and step_N/ checkpoints
    seed: int = 0                       # model init, training prompt stream and sampling seeds
    resume: bool = False                # continue from the latest complete step_N/ in out_dir
    init_from: str = ""                 # a Hugging Face folder to start from instead of a fresh model
    device: str = "auto"                # auto: cuda:LOCAL_RANK if available, else cpu
    threads: int = 0                    # CPU threads per rank (0: torch's default); oversubscription is costly
    wandb_mode: str = "auto"            # auto: $WANDB_MODE if set, else online if logged in, else offline
    wandb_project: str = "grpo-from-scratch"
    print_config: str = "changed"       # the config printed at the start: changed (fields off their defaults) | all
    # --- fresh model (Llama-style; ignored with init_from)
    n_layers: int = 4
    hidden_size: int = 128
    n_heads: int = 4
    n_kv_heads: int = 4
    intermediate_size: int = 352
    max_seq_len: int = 96
    # --- task
    task: str = "arithmetic"            # arithmetic | countdown | gsm8k | math | reasoning_gym
    train_file: str = ""                # JSONL for gsm8k / math
    eval_file: str = ""
    template: str = "plain"             # tasks.render_prompt: plain | r1 | boxed; chat: the checkpoint's chat template
    system_prompt: str = ""             # template chat: a system message before each question (e.g. R1's instruction)
    train_size: int = 0                 # synthetic: cycle over this many problems (0: a fresh stream)
    sft_min_ops: int = 2                # synthetic difficulty of the SFT demonstrations
    sft_max_ops: int = 4
    sft_direct_frac: float = 0.0        # synthetic: share of cold-start demos that give only "#### N", no steps
    sft_flaw_frac: float = 0.6          # arithmetic only: share of demos from a sloppy teacher (tasks.flawed_solution)
    sft_flaw: str = "sign"              # its error: sign (negatives lose their "-") | random (one step off by 1-3)
    sft_answer_filter: bool = False     # drop demos whose final answer is wrong (answer-filtered SFT, RFT-like)
    rl_min_ops: int = 2                 # synthetic difficulty of the RL prompts
    rl_max_ops: int = 4
    eval_min_ops: int = 2
    eval_max_ops: int = 4
    max_operand: int = 9                # synthetic: operands in 0..max_operand
    max_value: int = 0                  # synthetic: bound on every intermediate result (0: none)
    ops: str = "+-"                     # synthetic: the operators a problem draws from
    rg_datasets: dict = field(default_factory=dict)  # reasoning_gym: {name: its options}; several
                                        #   names: a composite, drawn by `weight` (tasks.py, step 5)
    rg_size: int = 10000                # reasoning_gym: ONE dataset (seed eval_seed), by index:
    rg_heldout: int = 500               #   held-out [0, rg_heldout) (eval_n of it), training after
    # --- supervised cold start (DeepSeek-R1 §2.3.1)
    sft_steps: int = 800
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    # --- RL sampling
    rl_steps: int = 200
    rl_minutes: float = 0.0             # stop RL after this much wall-clock (0: no limit), for equal-time ablations
    prompts_per_step: int = 16          # P: groups per optimizer step (global, over all ranks)
    group_size: int = 8                 # G: samples per prompt (DeepSeekMath §4.1)
    max_new_tokens: int = 56
    temperature: float = 1.0            # sampling and scoring temperature (the trainer scores logits / T)
    top_k: int = 0
    top_p: float = 1.0
    cpu_compile: str = "auto"           # the compiled decode step on CPU: true | false | auto (infra.compiled_sampling)
    # --- RL objective: each GRPO / DAPO / Dr. GRPO / GSPO / CISPO / RLOO / REINFORCE++ difference is one flag
    reward: str = "outcome"             # outcome (verifier) | process (DeepSeekMath §4.1.3) | none (pure distillation)
                                        # | format_only (1 for any committed number: the control)
    adv_scale: str = "group"            # group (GRPO), batch, none (Dr. GRPO §3), rloo (Ahmadian et al. 2024),
                                        # reinforce_pp (REINFORCE++, Hu 2025: whitened over the batch's tokens)
    ratio_level: str = "token"          # token (PPO, GRPO), sequence (GSPO, Zheng et al. 2025 eq. 5)
    pg_loss: str = "clip"               # clip (PPO surrogate), cispo (MiniMax-M1 2025 §3.1: clipped sg weight),
                                        # dppo_tv | dppo_kl (DPPO, arXiv 2602.04879: ε is the divergence δ), sapo
                                        # (SAPO, arXiv 2511.20347 soft gate), gmpo (GMPO, arXiv 2507.20673: ε in log)
    tau_pos: float = 1.0                # SAPO gate temperature τ for Â > 0
    tau_neg: float = 1.05               #   and for Â ≤ 0
    kl_old: float = 0.0                 # k2 KL to π_old, DPPO's companion term (0: off)
    cov: str = "none"                   # entropy control (Cui et al. 2025): clip (Clip-Cov) | kl (KL-Cov) | none
    cov_frac: float = 2e-4              #   share of tokens picked by cov(log π_old, Â) over the global batch
    cov_low: float = 1.0                #   Clip-Cov's band (cov_low, cov_high) to draw them from
    cov_high: float = 5.0
    cov_kl_coef: float = 1.0            #   KL-Cov's coefficient on |log ρ_t|
    dual_clip: float = 0.0              # c > 1: bound the loss of Â < 0 at c·Â (dual-clip, Ye et al. 2020); 0: off
    kl_estimator: str = "k3"            # k1 | k2 | k3 (Schulman 2020); DeepSeekMath eq. 4 uses k3
    tis: str = "auto"                   # truncated IS of sampler vs trainer log-probs (Yao et al. 2025): none | token
    tis_mode: str = "truncate"          #   | sequence | auto (token if max_staleness > 0, else none); truncate w at C,
                                        #   mask w outside [1/C, C] (IcePop), or mask_high: w > C (Seq-MIS at sequence)
    tis_cap: float = 2.0                #   C
    top_entropy_q: float = 1.0          # gradient only on the top-q entropy tokens (Wang et al. 2025); 1: all
    agg: str = "token_mean"             # seq_mean_token_mean (GRPO), token_mean (DAPO §3.3),
                                        # seq_mean_token_sum_norm (Dr. GRPO §3)
    eps_low: float = 0.2                # PPO clip ε (DeepSeekMath eq. 3)
    eps_high: float = 0.28              # DAPO §3.1 clip-higher
    beta: float = 0.0                   # KL(π_θ‖π_ref) weight, k3 estimator (DeepSeekMath eq. 4); DAPO drops it
    kl_in: str = "loss"                 # loss: β·kl_estimator per token; reward: r_i − β Σ_t k1 before Â (exact ∇)
    ref_update_every: int = 0           # refresh π_ref ← π_θ every K steps (0: never)
    teacher: str = ""                   # on-policy distillation (GKD, Agarwal et al. 2024; Thinking Machines 2025):
    opd_weight: float = 1.0             #   a teacher's folder; Â_t += w·(log π_T − log π_old)(o_t) (distill.py)
    teacher_pass_every: int = 10        #   the teacher's greedy pass rate on a step's P prompts every K steps (0: off)
    dynamic_sampling: bool = True       # DAPO §3.2: drop zero-spread groups and refill
    max_sample_tries: int = 4           # rounds of refill before training on what was found
    skip_saturated_k: int = 0           # skip prompts saturated (all right or all wrong) on their last k visits
    overlong_buffer: int = 0            # DAPO §3.4 soft overlong punishment L_cache (0: off)
    mask_truncated: bool = False        # DAPO §3.4 overlong filtering: no loss on truncated samples
    format_weight: float = 0.0          # reward += weight · format_reward (R1 template)
    ppo_epochs: int = 1                 # μ: optimizer steps per batch (DeepSeekMath Alg. 1)
    micro_batch_tokens: int = 8192      # rows × padded length per forward; bounds activation memory
    # --- optimizer (AdamW, Loshchilov & Hutter 2019)
    lr: float = 1e-4
    warmup_steps: int = 10
    lr_schedule: str = "cosine"         # cosine (to min_lr_ratio · lr) or constant
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    grad_clip: float = 1.0
    max_bad_steps: int = 3              # consecutive non-finite steps before the run stops
    # --- asynchronous RL (async_rl.py, prime-rl's split): the first k ranks sample, the rest train
    sampler_ranks: int = 0              # k sampler ranks (0: every rank samples and trains, the colocated loop)
    max_staleness: int = 0              # K: step s trains on rollouts of π_v, v = s − 1 − K (0: synchronous)
    async_timeout: float = 600.0        # seconds a side waits with no beat from the other before it raises (dead)
    collective_timeout: float = 3600.0  # the async groups' op timeout, and the longest the other side may make no
                                        #   progress (hung); above any eval, checkpoint or sampling step
    # --- evaluation and checkpoints
    eval_every: int = 400               # held-out eval every K steps (0: only at the end of each stage)
    eval_n: int = 500                   # held-out problems (fixed, disjoint from training prompts)
    eval_k: int = 8                     # samples per problem for sampled pass@1 and maj@k
    eval_seed: int = 1234567            # the held-out set's seed, independent of `seed`
    eval_batch: int = 64                # held-out problems per sampling call, all ranks (bounds the KV cache)
    ckpt_every: int = 100               # checkpoint every K steps (0: only at the end)
    keep_ckpts: int = 2                 # newest checkpoints kept (0: all)
    save_dtype: str = ""                # step_N/ weights: "" the source folder's dtype (float32 for a fresh model)

    CHOICES: ClassVar[dict] = {
        "task": ("arithmetic", "countdown", "gsm8k", "math", "reasoning_gym"),
        "template": ("plain", "r1", "boxed", "chat"),
        "adv_scale": credit.SCALES, "agg": grpo.AGGS, "lr_schedule": ("cosine", "constant"), "sft_flaw": tasks.FLAWS,
        "wandb_mode": ("auto", "online", "offline", "disabled"),
        "reward": ("outcome", "process", "none", "format_only"),
        "ratio_level": grpo.RATIO_LEVELS, "pg_loss": grpo.PG_LOSSES, "kl_estimator": grpo.KL_ESTIMATORS,
        "tis": ("auto", "none") + grpo.TIS_LEVELS, "tis_mode": grpo.TIS_MODES, "kl_in": ("loss", "reward"),
        "cov": ("none", "clip", "kl"), "print_config": ("changed", "all"), "cpu_compile": ("auto", "true", "false"),
        "save_dtype": ("", "float32", "bfloat16", "float16")}

    def __post_init__(self):  # tis = "auto": async_rl.py's clipped behaviour correction once rollouts may be stale
        self.tis = ("token" if self.max_staleness > 0 else "none") if self.tis == "auto" else self.tis


def parse_args(argv: list[str], cls=Config):
    """Defaults ← --config FILE.toml ← --key=value (typed by the field; unknown keys and bad values are errors)."""
    return cli.parse_config(cls, argv)


@dataclass
class Run:
    """What every step function reads: the config, this process, the policy and the task."""
    cfg: Config
    proc: infra.Proc
    model: torch.nn.Module              # the policy π_θ, FSDP2-sharded when world > 1
    task: tasks.Task                    # problems, prompts, tokenizer (task.tok), stop ids, verifier
    ref: Transformer | None = None      # π_ref, a frozen unsharded copy (β > 0 only)
    sampler: Transformer | None = None  # the policy's weights outside FSDP (sharded or CUDA runs), for generate
    teacher: Transformer | None = None  # π_T, frozen and unsharded like π_ref (on-policy distillation only)
    link: async_rl.Link | None = None   # sampler_ranks > 0: this side's end of the rollout and weight channels


@dataclass
class TrainState:
    """Everything a checkpoint carries besides weights, optimizer and scheduler; saved and restored whole."""
    rl_cursor: int = 0                  # next index of the RL prompt stream
    sft_cursor: int = 0                 # next index of the cold-start stream
    pass_history: dict = field(default_factory=dict)  # problem id -> [saturated?] of its last visits
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
    nonfinite: int = 0                  # samples the sampler ended at non-finite logits (rollout.Rollout.nonfinite)


def build_run(cfg: Config) -> Run:
    """Join the processes, build or load the policy (sharded; float32, its folder's dtype and files kept for step_N/)
    and its tokenizer, and the task; completions stop at the checkpoint's eos ids (our names only as a fallback)."""
    checks.check(cfg)  # every setting and file first, each mistake one line (cli.UserError), before anything loads
    proc, link = async_rl.split(infra.setup(cfg.device, cfg.threads), cfg)  # link: the async run's two sides
    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        tok, model = load_tokenizer(cfg.init_from), Transformer.from_pretrained(cfg.init_from, dtype=torch.float32)
    else:
        tok = build_char_tokenizer(tasks.CHARS)
        model = Transformer(ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=cfg.hidden_size,
                                        n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                        intermediate_size=cfg.intermediate_size, max_seq_len=cfg.max_seq_len))
    info = templates.read_tokenizer_config(cfg.init_from) if cfg.init_from else {}
    task = tasks.Task(cfg, tok, templates.stop_ids(tok, info, STOP_NAMES), info)
    if link and not link.trains:  # a sampler rank: a plain copy in the compute dtype; weights come from the trainers
        return Run(cfg, proc, infra.frozen_copy(model.to(proc.device), proc.device), task, link=link)
    model = infra.shard(model.to(proc.device), proc)  # generate reads a plain copy when FSDP shards (infra.sampling)
    return Run(cfg, proc, model, task, sampler=infra.sampling_copy(model, proc),
               teacher=distill.load_teacher(cfg, tok, proc.device), link=link)


def make_optimizer(run: Run, lr: float, total: int):
    """AdamW and its schedule: linear warmup, then cosine to min_lr_ratio · lr (or constant) at step `total`."""
    cfg = run.cfg
    opt = torch.optim.AdamW(run.model.parameters(), lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                            weight_decay=cfg.weight_decay)

    def factor(s):
        if s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        prog = min(1.0, (s - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        return 1.0 if cfg.lr_schedule == "constant" else \
            cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


# ============================================================================================ 1. sampling
def sample_groups(run: Run, problems: list[tuple[int, tasks.Problem]], G: int, temperature: float, seed_keys,
                  max_new_tokens: int, first: int = 0, model=None) -> list[Group]:
    """G scored completions of each problem by `model` (default: the policy; star.py's teacher), all groups on every
    rank in `problems` order. Rank r samples r, r + world, ...; row seeds (seed_keys, first + position, sample)."""
    cfg, proc = run.cfg, run.proc
    mine = list(range(proc.rank, len(problems), proc.world))
    prompts = [run.task.prompt_ids(problems[j][1]) for j in mine]
    seeds = torch.tensor([tasks.seed_of(*seed_keys, first + j, g) for j in mine for g in range(G)])
    model = infra.sampling(run.sampler, run.model) if model is None else model  # all ranks gather, prompts or none
    ro = mine and generate(model, prompts, G, max_new_tokens, temperature=temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                           stop_ids=run.task.stop_ids, seed=seeds, static=infra.compiled_sampling(cfg))
    groups, (ids, mask, lp, cut, bad) = [], [x.cpu() for x in (ro.completion_ids, ro.completion_mask, ro.logprobs,
                                                                ro.truncated, ro.nonfinite)] if mine else [None] * 5
    for a, j in enumerate(mine):
        rows = range(a * G, (a + 1) * G)
        comps = [ids[r][mask[r]].tolist() for r in rows]
        texts = [run.task.text(c) for c in comps]
        groups.append(Group(j, *problems[j], prompts[a], comps, texts, [lp[r][mask[r]] for r in rows],
                            cut[rows].tolist(), [run.task.score(t, problems[j][1]) for t in texts],
                            nonfinite=int(bad[rows].sum())))
    return sorted(infra.all_gather_list(groups), key=lambda g: g.pos)


# ====================================================================================== 2. rewards, filtering
def shaped_rewards(cfg: Config, g: Group) -> list[float]:
    """r_i = accuracy + format weight · format reward + DAPO soft overlong punishment (eq. 13);
    reward = "format_only": 1 for any committed number in place of accuracy (g.scores stay it)."""
    pen = credit.overlong_penalty(torch.tensor([len(c) for c in g.comps]), cfg.max_new_tokens, cfg.overlong_buffer) \
        if cfg.overlong_buffer else torch.zeros(len(g.comps))  # (+ 0.0 and + 0 · f leave a reward bit-exact)
    return [s + cfg.format_weight * (verify.format_reward(t) if cfg.format_weight else 0) + p
            for s, t, p in zip(outcome_rewards(cfg, g.texts, g.scores), g.texts, pen.tolist())]


def outcome_rewards(cfg: Config, texts: list[str], scores: list[float]) -> list[float]:
    """The verifier's scores, or with reward = "format_only" 1 for any committed number (the control)."""
    return [tasks.committed_number(t) for t in texts] if cfg.reward == "format_only" else scores


def dynamic_sampling(run: Run, state: TrainState, step: int) -> tuple[list[Group], dict]:
    """DAPO §3.2: sample groups until P have reward spread > 0 (or max_sample_tries run out); without it, the
    first P groups. Prompts saturated on each of their last k visits are skipped before any sampling."""
    cfg, P, G, k = run.cfg, run.cfg.prompts_per_step, run.cfg.group_size, run.cfg.skip_saturated_k
    kept, seen, drawn, skipped, keep_rate = [], [], 0, 0, 1.0
    for tries in range(cfg.max_sample_tries if cfg.dynamic_sampling else 1):
        n, problems = P if tries == 0 else min(4 * P, math.ceil((P - len(kept)) / max(keep_rate, 0.25))), []
        while len(problems) < n:
            pid, p = run.task.problem("rl", state.rl_cursor)
            state.rl_cursor, drawn = state.rl_cursor + 1, drawn + 1
            if k and len(state.pass_history.get(pid, [])) >= k and all(state.pass_history[pid][-k:]):
                skipped += 1
                if skipped > 100 * P:
                    raise RuntimeError("every training prompt is saturated: the pass-rate memory skips them all")
                continue
            problems.append((pid, p))
        groups = sample_groups(run, problems, G, cfg.temperature, (cfg.seed, step, tries), cfg.max_new_tokens)
        for g in groups:
            g.rewards = shaped_rewards(cfg, g)
            saturated = min(g.scores) == max(g.scores)  # all right or all wrong
            state.pass_history[g.pid] = (state.pass_history.get(g.pid, []) + [saturated])[-max(1, k):]
            if not cfg.dynamic_sampling or max(g.rewards) > min(g.rewards):
                kept.append(g)
        seen += groups
        keep_rate = len(kept) / len(seen)
        if len(kept) >= P:
            break
    stats = {"train/reward": sum(sum(g.rewards) for g in seen) / (G * len(seen)),
             "train/accuracy": sum(sum(g.scores) for g in seen) / (G * len(seen)),
             "train/kept_groups_frac": keep_rate, "train/discarded_rollouts": G * (len(seen) - min(P, len(kept))),
             "train/skip_rate": skipped / drawn, "train/sample_tries": tries + 1,
             "train/truncated_frac": sum(sum(g.truncated) for g in seen) / (G * len(seen)),
             "train/nonfinite_rows": sum(g.nonfinite for g in seen)}
    return kept[:P], stats


# ============================================================================== 3. micro-batches and updates
def scores(run: Run, model, prompts: list, comps: list, rows: list[int], temperature: float):
    """log π and entropy [n, L] of a micro-batch's rows under `model` (policy, π_ref), bf16 autocast on CUDA."""
    cs, dev = [comps[i] for i in rows], run.proc.device
    with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
        return score(model, [prompts[i] for i in rows], pad_batch(cs).to(dev), temperature, run.cfg.top_k,
                     run.cfg.top_p, lengths=[len(c) for c in cs])


def optimizer_step(run: Run, opt, finite: torch.Tensor | None = None) -> torch.Tensor:
    """Clip the gradient norm, step (skipped when the norm, or `finite`, every rank's losses, is not), zero grads."""
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.grad_clip)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norm = norm if finite is None else torch.where(finite, norm, math.nan)  # guard.py: NaN anywhere skips everywhere
    if not (ok := bool(torch.isfinite(norm))):  # skipped: without gradients the step below changes nothing, and
        opt.zero_grad(set_to_none=True)         # torch's LR scheduler sees the optimizer step it expects first
    opt.step()
    if ok:
        infra.refresh(run.sampler, run.model, lazy=True)  # gathered before the next sampling
    opt.zero_grad(set_to_none=True)
    return norm


# =================================================================================================== SFT
def cold_start_batch(task: tasks.Task, state: TrainState, B: int):
    """The next B problems of the cold-start stream -> (problems, prompt ids, target ids): the GLOBAL batch."""
    ks = range(state.sft_cursor, state.sft_cursor + B)
    probs = [task.problem("sft", k)[1] for k in ks]
    state.sft_cursor += B
    return probs, [task.prompt_ids(p) for p in probs], [task.target_ids(task.cold_start_target(k, p))
                                                          for k, p in zip(ks, probs)]


def sft_update(run: Run, opt, sched, prompts: list, comps: list) -> dict:
    """One optimizer step of token-mean NLL (grpo.sft_loss) on a GLOBAL batch (the same lists on every rank; rank r
    takes rows r, r + world, ...; divided by the global token count: any rank count, one gradient). star.py's too."""
    proc = run.proc
    prompts, comps = prompts[proc.rank::proc.world], comps[proc.rank::proc.world]
    norm = infra.all_sum(float(sum(map(len, comps))))                                     # global loss tokens
    plan, sums = infra.rank_micro_batches(prompts, comps, run.cfg.micro_batch_tokens), {}
    lens = torch.tensor([len(c) for c in comps] + [0], device=proc.device)                # the pad row: no loss
    for b, rows in enumerate(plan):
        logp, ent = scores(run, run.model, prompts + [[0]], comps + [[0]], rows, 0.0)       # [n, L]
        mask = torch.arange(logp.shape[1], device=logp.device) < lens[rows, None]         # [n, L]
        loss = grpo.sft_loss(logp, mask, loss_scale=norm)
        infra.grad_sync(run.model, b == len(plan) - 1)  # FSDP2 reduce-scatters after the last micro-batch only
        (loss * proc.world).backward()  # FSDP averages over ranks: undo it
        infra.add_sums(sums, {"train/loss": loss, "train/entropy": (ent * mask).sum() / norm})
    gnorm = optimizer_step(run, opt)
    sched.step()
    return {**infra.all_sum_dict(sums), "train/grad_norm": gnorm, "train/lr": sched.get_last_lr()[0]}


# ==================================================================================================== RL
def advantages(run: Run, groups: list[Group], shift: torch.Tensor | None = None) -> torch.Tensor:
    """Â [N] of the global batch (credit.group_advantages; REINFORCE++ whitens over its loss tokens), or with
    reward = "process" Â [N, L] (DeepSeekMath §4.1.3, credit.process_advantages): each arithmetic step's reward
    (1 right, 0 wrong: verify.step_rewards) at the step's last token, the shaped outcome reward at the last.
    shift [N] is added to the (outcome) rewards first: −β Σ_t k1 for KL in the reward."""
    cfg = run.cfg
    rewards = torch.tensor([r for g in groups for r in g.rewards]) + (0 if shift is None else shift)
    if cfg.reward != "process":  # "none": zero rewards, so Â = 0 (pure distillation)
        rewards = rewards * (cfg.reward != "none")
        lengths = torch.tensor([0 if cfg.mask_truncated and cut else len(c) for g in groups
                                for c, cut in zip(g.comps, g.truncated)])
        return credit.group_advantages(rewards, cfg.group_size, scale=cfg.adv_scale, lengths=lengths)
    steps, shaped = [], iter(rewards.tolist())
    for g in groups:
        for comp, text, r in zip(g.comps, g.texts, shaped):
            ends = list(itertools.accumulate(len(run.task.text([t])) for t in comp))  # each token's end character
            steps.append([(float(ok), bisect.bisect_right(ends, e - 1)) for e, ok in verify.step_rewards(text)]
                         + [(r, len(comp) - 1)])
    rew, end = (pad_batch([[s[j] for s in row] for row in steps], 0, dtype) for j, dtype in ((0, torch.float32),
                                                                                               (1, torch.long)))
    valid = pad_batch([[True] * len(row) for row in steps], False, torch.bool)
    return credit.process_advantages(rew, end, valid, cfg.group_size, max(len(c) for g in groups for c in g.comps))


def rl_step(run: Run, opt, sched, state: TrainState, step: int) -> dict:
    cfg, proc, G, dev = run.cfg, run.proc, run.cfg.group_size, run.proc.device
    t0 = time.time()
    # 1-2. sample, reward and keep P informative groups (the same global list on every rank)
    groups, stats = run.link.take(state, step) if run.link else dynamic_sampling(run, state, step)  # async_rl.py
    t1 = time.time()
    if not groups:  # every group had zero spread even after refills: nothing to learn from this step
        opt.step()  # no gradients, so no update: the schedule still advances, after a step as torch expects
        sched.step()
        return {**stats, "train/loss": 0.0, "train/grad_norm": 0.0, "train/lr": sched.get_last_lr()[0]}
    # 3. this rank trains on whole groups rank, rank + world, ...; advantages over the global batch
    mine = [(k, i) for k in range(proc.rank, len(groups), proc.world) for i in range(G)]
    ids = [k * G + i for k, i in mine]  # their global row indices
    prompts, comps = [groups[k].prompt for k, _ in mine], [groups[k].comps[i] for k, i in mine]
    mask = pad_batch([[not (cfg.mask_truncated and groups[k].truncated[i])] * len(groups[k].comps[i])
                      for k, i in mine] + [[False]], False, torch.bool).to(dev)                # [n + 1, L]
    sampler = pad_batch([groups[k].logprobs[i].tolist() for k, i in mine] + [[0.0]], 0.0, torch.float32).to(dev)
    norm = infra.all_sum(grpo.loss_normaliser(mask[:-1], cfg.agg, cfg.max_new_tokens))   # the global normaliser
    plan = infra.rank_micro_batches(prompts, comps, cfg.micro_batch_tokens)  # this rank's rows, longest first
    old, keep, sums, maxes, teach = {}, {}, {}, {}, {}
    prompts, comps = prompts + [[0]], comps + [[0]]  # the pad row of padding passes: mask, advantage 0
    kl_in_reward = cfg.kl_in == "reward" and cfg.beta > 0
    pre = old_pass(run, scores, prompts, comps, plan) if cfg.top_entropy_q < 1 or cfg.cov != "none" or kl_in_reward \
        else []
    shift = torch.zeros(len(mine) + 1, device=dev)  # KL in the reward: −β Σ_t k1 of each row, in the global order
    for (lp, _, ref), rows in zip(pre, plan) if kl_in_reward else ():
        shift[rows] = credit.kl_reward(shift[rows], lp, ref, mask[rows, :lp.shape[1]], cfg.beta)
    got = infra.all_gather_list(list(zip(ids, shift[:-1].tolist()))) if kl_in_reward else []
    adv = advantages(run, groups, torch.tensor([v for _, v in sorted(got)]) if kl_in_reward else None)   # [N] or [N, L]
    adv = torch.cat((adv[ids], adv.new_zeros(1, *adv.shape[1:]))).to(dev)  # [n + 1, ...]
    if cfg.top_entropy_q < 1:  # Wang et al. 2025: τ = the top-q entropy of π_old over the global batch's tokens
        ents = [ent[mask[rows, :ent.shape[1]]].cpu() for (_, ent, _), rows in zip(pre, plan)]
        tau = grpo.entropy_threshold(torch.cat(infra.all_gather_list(ents)), cfg.top_entropy_q).to(dev)
    picks = cov_picks(cfg, proc.rank, pre, plan, mask, adv, step, ids) if cfg.cov != "none" else []  # Cui et al. 2025
    # 4. μ optimizer steps on this batch, each over all micro-batches
    for epoch in range(cfg.ppo_epochs):
        losses = []  # this epoch's micro-batch losses, for the NaN guard
        for b, rows in enumerate(plan):
            logp, ent = scores(run, run.model, prompts, comps, rows, cfg.temperature)                # [n, L]
            r, Lm = torch.tensor(rows, device=dev), logp.shape[1]
            m, ref, weight, tis = mask[r, :Lm], None, None, {}
            if cfg.beta > 0 and cfg.kl_in == "loss":
                with torch.no_grad():
                    ref = scores(run, run.ref, prompts, comps, rows, cfg.temperature)[0]
            old[b] = logp.detach() if epoch == 0 else old[b]  # π_old: π_θ before this step's first update
            a = adv[r, :Lm] if adv.dim() == 2 else adv[r]
            if run.teacher is not None:  # on-policy distillation: Â_t += w·(log π_T − log π_old)(o_t) (distill.py)
                teach[b] = teach[b] if epoch else distill.teacher_logprobs(run, prompts, comps, rows)
                a = distill.opd_advantage(a, teach[b].logp, old[b], m, cfg.opd_weight)
            if cfg.tis != "none":  # the sampler drew from its own log-probs: reweight to the trainer's π_old
                weight, tis = grpo.tis_weights(old[b], sampler[r, :Lm], m, cfg.tis, cfg.tis_mode, cfg.tis_cap)
            if cfg.top_entropy_q < 1:
                keep[b] = grpo.top_entropy_mask(ent, m, tau) if epoch == 0 else keep[b]
                weight = keep[b].float() if weight is None else weight * keep[b]
            if cfg.cov == "clip":  # Clip-Cov: the picked tokens leave the loss (KL-Cov: |log ρ| on them, below)
                weight = (~picks[b]).float() * (1 if weight is None else weight)
            loss, met = grpo.policy_loss(logp, old[b], a, m, cfg.eps_low, cfg.eps_high, ref,
                                         cfg.beta * (ref is not None), cfg.agg, cfg.max_new_tokens, norm,
                                         cfg.ratio_level, cfg.pg_loss, cfg.dual_clip, cfg.kl_estimator, weight,
                                         cfg.tau_pos, cfg.tau_neg, cfg.kl_old, cfg.cov_kl_coef * picks[b].float()
                                         if cfg.cov == "kl" else None)
            infra.grad_sync(run.model, b == len(plan) - 1)  # reduce-scatter once per optimizer step
            (loss * proc.world).backward()  # FSDP averages gradients over ranks: undo it
            losses.append(loss.detach())
            if epoch == 0:  # log the on-policy epoch; sampler vs trainer on the same tokens: a scoring mismatch
                d = (logp.detach() - sampler[r, :Lm]) * m  # log π_old − log μ on the sampled tokens
                gap = d.abs().amax()
                for k, v in [("train/logprob_gap_max", gap)] + ([("train/tis_max", tis.pop("tis_max"))] if tis else []):
                    maxes[k] = torch.maximum(maxes.get(k, v), v)
                tok = met.pop("tokens")
                infra.add_sums(sums, {"train/loss": loss, "n": tok, "train/entropy": (ent * m).sum(),
                                      "train/mismatch_kl": (torch.expm1(d) - d).sum(),  # k3 of KL(μ‖π_old)
                                      **{f"train/{k}": v * tok for k, v in {**met, **tis}.items()},
                                      **distill.metrics(run, teach.get(b), old[b], m)})
        gnorm = optimizer_step(run, opt, guard.finite_everywhere(losses))  # a NaN loss on any rank: all skip
        guard.name_bad_rows(step, proc.rank, losses, plan, [f"{groups[k].pid}/{i}" for k, i in mine] + ["pad"])
    sched.step()  # once per RL step, whatever μ: the schedule ends at the last step
    out, top = infra.all_sum_dict(sums), dict(zip(maxes, infra.all_max(torch.stack(list(maxes.values())))))
    n = out.pop("n").clamp(min=1)
    tokens = infra.all_sum(float(sum(map(len, comps[:-1]))))
    return {"time/rollout_s": t1 - t0, "time/sample_tok_per_s": tokens / (t1 - t0), **stats,  # async: the sampler's
            **{k: v / (1 if k == "train/loss" else n) for k, v in out.items()}, **top,
            "train/grad_norm": gnorm, "train/lr": sched.get_last_lr()[0], "time/train_s": time.time() - t1,
            "train/completion_len": sum(len(c) for g in groups for c in g.comps) / (G * len(groups)),
            **distill.teacher_pass(run, groups, step)}  # after time/train_s: its own time/teacher_pass_s


# ============================================================================================== evaluation
def evaluate(run: Run, step: int, logger: Logger | None = None, samples: list | None = None) -> dict:
    """Greedy pass@1, sampled pass@1 at the training temperature, maj@k, length, answer and truncation rates, per level
    too, in chunks of eval_batch problems (a progress line after each of a long eval). A `samples` list receives one
    record per completion: the prompt text as tokenized, completion, extracted answer, gold, correct, truncated."""
    cfg, probs, t0 = run.cfg, list(enumerate(run.task.heldout)), time.time()
    if run.link:  # async: no weight broadcast pending while this rank samples (async_rl.py, the docstring)
        run.link.settle()
    rec, by_level, shown = {}, {}, []
    for c0 in range(0, len(probs), cfg.eval_batch):
        chunk = probs[c0:c0 + cfg.eval_batch]
        greedy = sample_groups(run, chunk, 1, 0.0, (cfg.eval_seed, 0), cfg.max_new_tokens, c0)
        sampled = sample_groups(run, chunk, cfg.eval_k, cfg.temperature, (cfg.eval_seed, 1), cfg.max_new_tokens, c0)
        for g, s in zip(greedy, sampled):
            answers = [verify.extract_answer(t) for t in s.texts]
            votes = Counter(a for a in answers if a is not None).most_common(1)
            row = {"pass@1": g.scores[0], "pass@1_sampled": sum(s.scores) / cfg.eval_k,
                   f"maj@{cfg.eval_k}": s.scores[answers.index(votes[0][0])] if votes else 0.0,
                   "completion_len": sum(map(len, s.comps)) / cfg.eval_k,
                   "answer_rate": sum(a is not None for a in answers) / cfg.eval_k,
                   "answer_rate_greedy": float(verify.extract_answer(g.texts[0]) is not None),
                   "truncated_frac": sum(s.truncated) / cfg.eval_k}
            for key in [None, f"L{g.problem.level}"] + [g.problem.source] * bool(g.problem.source):
                by_level.setdefault(key, Counter()).update({**row, "n": 1})  # composite: per member
            if samples is not None:  # one record per completion, the greedy one first
                samples += [{"problem": c0 + x.pos, "kind": kind, "prompt": run.task.prompt_text(x.problem),
                             "completion": t, "answer": verify.extract_answer(t), "gold": x.problem.gold,
                             "correct": sc >= 1, "truncated": cut} for kind, x in (("greedy", g), ("sampled", s))
                            for t, sc, cut in zip(x.texts, x.scores, x.truncated)]
        shown += greedy
        if run.proc.rank == 0 and len(probs) > cfg.eval_batch:  # a long eval shows its progress
            n, dt = min(len(probs), c0 + cfg.eval_batch), time.time() - t0
            print(f"  eval {n}/{len(probs)} | {dt:.0f} s | eta {dt / n * (len(probs) - n) / 60:.1f} min", flush=True)
    for level, acc in by_level.items():  # all over all problems, pass@1 per level (and member)
        keys = [k for k in acc if k != "n"] if level is None else ["pass@1", "pass@1_sampled"]
        suffix = "" if level is None else f"_{level}"
        rec.update({f"eval/{k}{suffix}": acc[k] / acc["n"] for k in keys})
    if logger:
        logger.samples(step, [(g.problem.prompt, g.texts[0], g.problem.gold, g.scores[0]) for g in shown])
    answered = rec["eval/answer_rate_greedy"]  # accuracy among the answered: format apart
    rec["eval/answered_accuracy"] = rec["eval/pass@1"] / answered if answered else 0.0
    return {"eval/maj@k": rec[f"eval/maj@{cfg.eval_k}"], **rec}


# ==================================================================================================== loop
def save(run: Run, state: TrainState, step: int, stage: str, opt, sched):
    infra.save_checkpoint(run.proc, run.cfg.out_dir, step, run.model, run.task.tok, opt, {  # async: rollouts first
        "rollouts": run.link.checkpoint(state, step) if run.link and stage == "rl" else [],
        "scheduler": sched.state_dict(), "step": step, "stage": stage, "state": dataclasses.asdict(state),
        "rng": torch.get_rng_state(), "config": dataclasses.asdict(run.cfg)}, ref=run.ref, keep=run.cfg.keep_ckpts,
        dtype=getattr(torch, run.cfg.save_dtype) if run.cfg.save_dtype else None)


def main(cfg: Config) -> dict:
    latest, ckpt, saved = infra.latest_checkpoint(cfg.out_dir) if cfg.resume else (0, "", None)
    if latest:  # resume: weights from the checkpoint folder, the rest from its trainer_state.pt
        cfg = dataclasses.replace(cfg, init_from=ckpt)
    run, total = build_run(cfg), cfg.sft_steps + cfg.rl_steps
    state = TrainState(**saved["state"]) if saved else TrainState()
    if run.link and not run.link.trains:  # a sampler rank samples until the trainers stop it (async_rl.py)
        return async_rl.sampler_loop(run, state, dynamic_sampling)
    if saved:
        torch.set_rng_state(saved["rng"])
    logger = Logger(run.proc, cfg.out_dir, dataclasses.asdict(cfg), cfg.wandb_mode, cfg.wandb_project, latest, total)
    if run.proc.rank == 0:
        print(cli.banner(cfg, objective(cfg), run.model, run.proc), flush=True)
    opt, stage, results, rl_t0 = None, None, {}, time.time()
    if not latest:  # the baseline: every curve starts from the checkpoint it trains
        logger.log(0, "base", results.setdefault("base", evaluate(run, 0, logger)))
        logger.t0 = time.time()  # the console's ETA counts training steps only
    for step in range(latest + 1, total + 1):
        if stage != ("sft" if step <= cfg.sft_steps else "rl"):  # each stage starts a fresh AdamW and LR schedule
            stage, rl_t0 = "sft" if step <= cfg.sft_steps else "rl", time.time()
            opt, sched = make_optimizer(run, *((cfg.sft_lr, cfg.sft_steps) if stage == "sft" else
                                               (cfg.lr, cfg.rl_steps)))
            resumed = saved and step == latest + 1  # mid-stage: the optimizer and π_ref continue where they were
            if resumed and saved["stage"] == stage:
                infra.load_optimizer(run.model, opt, saved["optimizer"])
                sched.load_state_dict(saved["scheduler"])
            if stage == "rl" and cfg.beta > 0:
                run.ref = infra.frozen_copy(run.model, run.proc.device)
                if resumed and os.path.exists(ref_file := os.path.join(cfg.init_from, "ref_model.pt")):
                    run.ref.load_state_dict(torch.load(ref_file, map_location=run.proc.device))
            if stage == "rl" and run.link:  # the samplers start: π_(step−1), the prompt stream, checkpointed rollouts
                run.link.publish(run, step - 1, total, state, saved.get("rollouts") if resumed else None, Group)
        if stage == "sft":
            _, prompts, comps = cold_start_batch(run.task, state, cfg.sft_batch_size)
            rec = sft_update(run, opt, sched, prompts, comps)
        else:
            rec = rl_step(run, opt, sched, state, step)
            if run.link:  # π_step to the samplers, which may now sample step + 1 + K
                run.link.publish(run, step, total)
        rec = {k: float(v) for k, v in rec.items()}  # the step's host sync, for logging
        state.bad_steps = guard.count_bad_steps(state.bad_steps, rec, step, cfg.max_bad_steps, cfg.out_dir)
        logger.log(step, stage, rec)
        if stage == "rl" and cfg.ref_update_every and (step - cfg.sft_steps) % cfg.ref_update_every == 0:
            run.ref = infra.frozen_copy(run.model, run.proc.device)  # (checks.py: ref_update_every needs beta > 0)
        stop = stage == "rl" and infra.any_rank(0 < cfg.rl_minutes < (time.time() - rl_t0) / 60)
        total = step if stop else total
        if cfg.eval_every and step % cfg.eval_every == 0 or step in (cfg.sft_steps, total):
            t_eval, ev = time.time(), evaluate(run, step, logger)
            logger.log(step, stage, {**ev, "time/eval_s": time.time() - t_eval})
            if step in (cfg.sft_steps, total):  # the end of a stage: its column of the final table
                results[stage] = ev
        if (cfg.ckpt_every and step % cfg.ckpt_every == 0 or step == total) and state.bad_steps == 0:
            save(run, state, step, stage, opt, sched)
        if stop:
            break
    if run.link:
        run.link.stop(state)
    return logger.finish(results)


if __name__ == "__main__":
    cli.run_main(main, parse_args(sys.argv[1:]))
    infra.teardown()
