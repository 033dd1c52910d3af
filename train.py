"""GRPO / DAPO / Dr. GRPO training of a reasoning policy with verifiable rewards, after a supervised cold start.

One RL step (DeepSeekMath 2024 Alg. 1 with DAPO 2025 Alg. 1's dynamic sampling):
  1. draw P prompts q; sample G completions o_1..o_G ~ π_θ(·|q) each (rollout.generate, per-row seeds);
  2. reward r_i = accuracy (verify.py) + format weight + DAPO overlong shaping; DAPO dynamic sampling drops
     groups with zero reward spread and draws more prompts until P informative groups are held (capped);
  3. advantages Â_i from the group (grpo.group_advantages); π_old = the policy before this step's update;
  4. μ inner epochs: loss = grpo.policy_loss(log π_θ, log π_old, Â, mask, ε_low, ε_high, log π_ref, β, agg),
     accumulated over micro-batches sized by a token budget and normalised by the GLOBAL token/sequence count,
     so any rank or micro-batch split gives the same gradient; clip grad norm; AdamW; warmup + cosine LR.
The supervised stage (DeepSeek-R1 cold start) minimises grpo.sft_loss on the task's worked solutions.

  python train.py                                        # the CPU demo: SFT then DAPO on synthetic arithmetic
  python train.py --config configs/smoke.toml --rl_steps=8
  torchrun --standalone --nproc_per_node=8 train.py --config configs/qwen2.5-0.5b-gsm8k.toml
"""
import dataclasses
import difflib
import glob
import json
import math
import os
import random
import shutil
import sys
import time
import tomllib
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

import grpo
import tasks
import verify
from model import ModelConfig, Transformer, build_char_tokenizer, load_tokenizer
from rollout import STOP_NAMES, filter_logits, generate


# ================================================================================================== config
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
    # --- fresh model (Llama-style; ignored with init_from)
    n_layers: int = 4
    hidden_size: int = 128
    n_heads: int = 4
    n_kv_heads: int = 4
    intermediate_size: int = 352
    max_seq_len: int = 96
    # --- task
    task: str = "arithmetic"            # arithmetic | countdown | gsm8k | math
    train_file: str = ""                # JSONL for gsm8k / math
    eval_file: str = ""
    template: str = "plain"             # tasks.render_prompt: plain | r1 | boxed
    train_size: int = 0                 # synthetic: cycle over this many problems (0: a fresh stream)
    sft_min_ops: int = 2                # synthetic difficulty of the SFT demonstrations
    sft_max_ops: int = 4
    sft_direct_frac: float = 0.5        # synthetic: share of cold-start demos that give only "#### N", no steps
    rl_min_ops: int = 2                 # synthetic difficulty of the RL prompts
    rl_max_ops: int = 4
    eval_min_ops: int = 2
    eval_max_ops: int = 4
    max_operand: int = 9                # synthetic: operands in 0..max_operand
    max_value: int = 0                  # synthetic: bound on every intermediate result (0: none)
    ops: str = "+-"                     # synthetic: the operators a problem draws from
    # --- supervised cold start (DeepSeek-R1 §2.3.1)
    sft_steps: int = 800
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    # --- RL sampling
    rl_steps: int = 500
    rl_minutes: float = 0.0             # stop RL after this much wall-clock (0: no limit), for equal-time ablations
    prompts_per_step: int = 16          # P: groups per optimizer step (global, over all ranks)
    group_size: int = 8                 # G: samples per prompt (DeepSeekMath §4.1)
    max_new_tokens: int = 56
    temperature: float = 1.0            # sampling and scoring temperature (the trainer scores logits / T)
    top_k: int = 0
    top_p: float = 1.0
    # --- RL objective: each GRPO / DAPO / Dr. GRPO difference is one flag
    algo: str = "grpo"                  # grpo (policy gradient; covers DAPO, Dr. GRPO), star | rft (star.py)
    adv_scale: str = "group"            # group (GRPO), batch, none (Dr. GRPO §3: no std division)
    agg: str = "token_mean"             # seq_mean_token_mean (GRPO), token_mean (DAPO §3.3), seq_mean_token_sum_norm (Dr. GRPO)
    eps_low: float = 0.2                # PPO clip ε (DeepSeekMath eq. 3)
    eps_high: float = 0.28              # DAPO §3.1 clip-higher
    beta: float = 0.0                   # KL(π_θ‖π_ref) weight, k3 estimator (DeepSeekMath eq. 4); DAPO drops it
    ref_update_every: int = 0           # refresh π_ref ← π_θ every K steps (0: never)
    dynamic_sampling: bool = True       # DAPO §3.2: drop zero-spread groups and refill
    max_sample_tries: int = 4           # rounds of refill before training on what was found
    skip_saturated_k: int = 0           # skip prompts saturated (all right or all wrong) on their last k visits
    overlong_buffer: int = 0            # DAPO §3.4 soft overlong punishment L_cache (0: off)
    mask_truncated: bool = False        # DAPO §3.4 overlong filtering: no loss on truncated samples
    format_weight: float = 0.0          # reward += weight · format_reward (R1 template)
    ppo_epochs: int = 1                 # μ: optimizer steps per batch (DeepSeekMath Alg. 1)
    micro_batch_tokens: int = 8192      # rows × padded length per forward; bounds activation memory
    # --- expert iteration, algo = star | rft (star.py): sample, keep what the verifier accepts, fine-tune
    expert_iters: int = 3               # STaR §3.1 Alg. 1: outer loops of sample → filter → fine-tune
    expert_samples: int = 8             # k samples per training problem (R1 §2.3.3 rejection sampling)
    expert_max_per_problem: int = 0     # at most m kept (deduplicated) samples per problem, 0: all (R1 §2.3.3)
    expert_sft_steps: int = 100         # fine-tune steps per iteration (STaR §4: 40 at first, +20% per iteration)
    expert_lr: float = 1e-3             # fine-tune learning rate (STaR §4: constant, the same every iteration)
    expert_from_base: bool = True       # STaR §3.1: fine-tune the cold-start model each iteration (star only)
    rationalize: bool = True            # STaR §3.2: retry unsolved problems with the answer as a hint (star only)
    hint_sft_frac: float = 0.0          # STaR §3.2 (hinted few-shot examples): share of hinted cold-start prompts
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
    # --- evaluation and checkpoints
    eval_every: int = 400
    eval_n: int = 500                   # held-out problems (fixed, disjoint from training prompts)
    eval_k: int = 8                     # samples per problem for sampled pass@1 and maj@k
    eval_seed: int = 1234567            # the held-out set's seed, independent of `seed`
    ckpt_every: int = 100
    keep_ckpts: int = 2                 # newest checkpoints kept (0: all)


def parse_args(argv) -> Config:
    """Defaults ← --config FILE.toml ← --key=value; unknown keys and ill-typed values are errors."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values, i = {}, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 == len(argv) or not os.path.exists(argv[i + 1]):
                raise SystemExit(f"error: --config needs an existing TOML file, got {argv[i + 1:i + 2]}")
            with open(argv[i + 1], "rb") as f:
                values.update((k, (v, argv[i + 1])) for k, v in tomllib.load(f).items())
            i += 2
            continue
        if not arg.startswith("--"):
            raise SystemExit(f"error: unexpected argument {arg!r}; use --key=value")
        key, eq, val = arg[2:].partition("=")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            val, i = argv[i + 1], i + 1
        elif not eq:
            val = "true"  # a bare --flag
        values[key.replace("-", "_")] = (val, "command line")
        i += 1
    kw = {}
    for key, (val, where) in values.items():
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            raise SystemExit(f"error: unknown config key {key!r} ({where})" + (f"; did you mean {near[0]!r}?" if near else ""))
        kw[key] = coerce(key, val, type(getattr(Config, key)), where)
        if key in CHOICES and kw[key] not in CHOICES[key]:
            raise SystemExit(f"error: config key {key!r} ({where}) is {kw[key]!r}; choose one of {CHOICES[key]}")
    return Config(**kw)


CHOICES = {"task": ("arithmetic", "countdown", "gsm8k", "math"), "template": ("plain", "r1", "boxed"),
           "algo": ("grpo", "star", "rft"), "adv_scale": ("group", "batch", "none"), "agg": grpo.AGGS,
           "lr_schedule": ("cosine", "constant"), "wandb_mode": ("auto", "online", "offline", "disabled")}


def coerce(key, val, typ, where):
    if isinstance(val, str) and typ is not str:
        low = val.lower()
        if typ is bool and low in ("true", "1", "yes", "false", "0", "no"):
            return low in ("true", "1", "yes")
        try:
            val = typ(val) if typ is not bool else val
        except ValueError:
            pass
    if typ is float and isinstance(val, int) and not isinstance(val, bool):
        val = float(val)
    if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
        raise SystemExit(f"error: config key {key!r} ({where}) needs a {typ.__name__}, got {val!r}")
    return val


def objective(cfg: Config) -> str:
    """The loss being optimised, assembled from the config, so a log says exactly which paper it is."""
    adv = {"group": "(r_i − mean_G r) / (std_G r + ε)", "batch": "(r_i − mean_G r) / std_batch r",
           "none": "r_i − mean_G r"}[cfg.adv_scale]
    agg = {"seq_mean_token_mean": "1/G Σ_i 1/|o_i| Σ_t", "token_mean": "1/Σ|o_i| Σ_i Σ_t",
           "seq_mean_token_sum_norm": f"1/(G·{cfg.max_new_tokens}) Σ_i Σ_t"}[cfg.agg]
    kl = f" − {cfg.beta}·D_KL^k3(π_θ‖π_ref)" if cfg.beta > 0 else ""
    name = ("Dr. GRPO" if cfg.adv_scale == "none" and cfg.agg == "seq_mean_token_sum_norm" else
            "DAPO" if cfg.agg == "token_mean" and cfg.eps_high > cfg.eps_low else
            "GRPO (DeepSeekMath)" if cfg.agg == "seq_mean_token_mean" else "custom")
    return (f"{name}: J = E[{agg} min(ρ_t Â_i, clip(ρ_t, 1−{cfg.eps_low}, 1+{cfg.eps_high}) Â_i){kl}],"
            f"  Â_i = {adv}" + (", zero-spread groups resampled (DAPO §3.2)" if cfg.dynamic_sampling else ""))


# ============================================================================================= distributed
def setup_distributed(cfg: Config):
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() and cfg.device in ("auto", "cuda")
    device = torch.device(f"cuda:{local}" if cuda else "cpu") if cfg.device in ("auto", "cuda") else torch.device(cfg.device)
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return rank, world, device


def all_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


def all_gather_list(items: list) -> list:
    if not dist.is_initialized():
        return items
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def seed_of(*keys) -> int:
    """A 63-bit seed from integers, e.g. (seed, step, prompt index, sample index): the same on any rank count."""
    h = 0x9E3779B97F4A7C15
    for k in keys:  # splitmix64 over the keys
        h = (h ^ (k & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h >> 1


# ================================================================================================== data
class Task:
    """Problems by index, prompts as token ids, and the verifier's score of a completion."""

    def __init__(self, cfg: Config, tok):
        self.cfg, self.tok = cfg, tok
        eos = [tok.token_to_id(t) for t in STOP_NAMES]
        self.stop_ids = [i for i in eos if i is not None]
        if not self.stop_ids:
            raise ValueError(f"the tokenizer has no end-of-sequence token (one of {STOP_NAMES})")
        if cfg.task in ("gsm8k", "math"):
            load = tasks.load_gsm8k if cfg.task == "gsm8k" else tasks.load_math
            self.train = load(cfg.train_file)
            self.heldout = load(cfg.eval_file)[:cfg.eval_n]
        elif cfg.task in ("arithmetic", "countdown"):
            self.heldout = [self.synthetic(cfg.eval_seed, i, cfg.eval_min_ops, cfg.eval_max_ops) for i in range(cfg.eval_n)]
        else:
            raise SystemExit(f"error: unknown task {cfg.task!r}; use arithmetic, countdown, gsm8k or math")
        self.heldout_prompts = {p.prompt for p in self.heldout}

    def synthetic(self, seed, i, lo, hi):
        if self.cfg.task == "countdown":
            return tasks.countdown(seed, i)
        return tasks.arithmetic(seed, i, min_ops=lo, max_ops=hi, max_operand=self.cfg.max_operand,
                               max_value=self.cfg.max_value, ops=self.cfg.ops)

    def problem(self, stage: str, k: int) -> tuple[int, tasks.Problem]:
        """The k-th training problem of a stage's stream -> (problem id, problem); held-out prompts never appear."""
        cfg = self.cfg
        if cfg.task in ("gsm8k", "math"):
            epoch, j = divmod(k, len(self.train))
            order = list(range(len(self.train)))
            random.Random(seed_of(cfg.seed, epoch)).shuffle(order)
            return order[j], self.train[order[j]]
        lo, hi = (cfg.sft_min_ops, cfg.sft_max_ops) if stage == "sft" else (cfg.rl_min_ops, cfg.rl_max_ops)
        seed = seed_of(cfg.seed, stage == "sft")
        pid = k % cfg.train_size if cfg.train_size else k
        p = self.synthetic(seed, pid, lo, hi)
        while p.prompt in self.heldout_prompts:  # deterministic re-draw keeps the held-out set unseen
            pid += 1 << 40
            p = self.synthetic(seed, pid, lo, hi)
        return pid, p

    def demo(self, k: int, p: tasks.Problem) -> str:
        """The k-th cold-start target: the worked solution, or (a seeded sft_direct_frac share) the bare answer."""
        direct = random.Random(seed_of(self.cfg.seed, k, 7)).random() < self.cfg.sft_direct_frac
        return f"#### {p.gold}" if direct else p.solution

    def prompt_ids(self, p: tasks.Problem) -> list[int]:
        return self.tok.encode(tasks.render_prompt(p.prompt, self.cfg.template)).ids

    def text(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def score(self, text: str, p: tasks.Problem) -> float:
        return tasks.countdown_reward(text, p) if self.cfg.task == "countdown" else verify.reward(text, p.gold)

    def answer(self, text: str):
        return verify.extract_answer(text)


def pad_batch(seqs: list[list], pad=0, dtype=torch.long) -> torch.Tensor:
    T = max(map(len, seqs), default=1)
    return torch.tensor([list(s) + [pad] * (T - len(s)) for s in seqs], dtype=dtype).view(len(seqs), T)


def completion_logprobs(model, prompts: list[list[int]], comp: torch.Tensor, cfg: Config, device, temperature=None):
    """log π(o_t | q, o_<t) of each completion token [n, L], scored under the distribution the sampler drew from
    (logits / T, and top-k / top-p when set). Rows are prompt + completion right-padded, so the plain causal path
    runs with no mask at all."""
    n, L = comp.shape
    plen = torch.tensor([len(p) for p in prompts], device=device)
    seqs = pad_batch([p + c for p, c in zip(prompts, comp.tolist())]).to(device)   # [n, T]
    logits = model(seqs[:, :-1]).float()                                           # [n, T-1, V]
    T = cfg.temperature if temperature is None else temperature
    pos = (plen[:, None] - 1 + torch.arange(L, device=device)).clamp(max=seqs.shape[1] - 2)  # [n, L]
    logits = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))     # [n, L, V]
    if cfg.top_k or cfg.top_p < 1:  # a truncated, renormalised distribution: score exactly that one
        logits = filter_logits(logits, T, cfg.top_k, cfg.top_p)
    elif T > 0:
        logits = logits / T
    with torch.no_grad():
        ent = grpo.token_entropy(logits)                                           # [n, L], for logging
    return grpo.token_logprobs(logits, comp.to(device)), ent


def micro_batches(lengths: list[int], budget: int, n_micro: int | None = None) -> list[list[int]]:
    """Consecutive row groups with rows × longest ≤ budget (at least one row each); padded with empty groups
    to n_micro so every rank runs the same number of forward/backward passes (FSDP collectives must match)."""
    out, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    out += [cur] if cur else []
    return out + [[] for _ in range((n_micro or len(out)) - len(out))]


# ============================================================================================== training
class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world, self.device = setup_distributed(cfg)
        self.log_file, self.wandb, self.t0 = None, None, time.time()
        # ------------------------------------------------------------------------------ model / tokenizer
        torch.manual_seed(cfg.seed)
        if cfg.init_from:
            self.tok = load_tokenizer(cfg.init_from)
            model = Transformer.from_pretrained(cfg.init_from, dtype=torch.float32)
        else:
            self.tok = build_char_tokenizer(tasks.CHARS)
            model = Transformer(ModelConfig(vocab_size=self.tok.get_vocab_size(), hidden_size=cfg.hidden_size,
                                            n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                            intermediate_size=cfg.intermediate_size, max_seq_len=cfg.max_seq_len))
        self.model_config, self.n_params = model.config, sum(p.numel() for p in model.parameters())
        self.model = self.shard(model.to(self.device))
        # data cursors, pass-rate memory and failure count: the state a checkpoint carries besides the weights
        self.cursor, self.sft_cursor, self.memory, self.bad_steps, self.start_step = 0, 0, {}, 0, 0
        self.ref = None
        self.task = Task(cfg, self.tok)

    def shard(self, model):
        """FSDP2: each block, then the root; bf16 compute with fp32 gradient reduction on CUDA, fp32 on CPU."""
        if self.world == 1:
            return model
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if self.device.type == "cuda" else MixedPrecisionPolicy()
        for block in model.model.layers:
            fully_shard(block, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)

    def fsdp_modules(self, model):
        from torch.distributed.fsdp import FSDPModule
        return [m for m in model.modules() if isinstance(m, FSDPModule)]

    def gathered(self, model, fn):
        """Run fn with every parameter all-gathered once (not once per decoded token), then reshard."""
        mods = self.fsdp_modules(model) if self.world > 1 else []
        if mods and not getattr(model, "_lazy_ok", False):
            with torch.no_grad():  # FSDP2 must run one ordinary forward before an explicit unshard()
                model(torch.zeros(1, 1, dtype=torch.long, device=self.device))
            model._lazy_ok = True
        for m in mods:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
                return fn()
        finally:
            for m in mods:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)

    def make_optimizer(self, lr: float, total: int):
        cfg = self.cfg
        opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                weight_decay=cfg.weight_decay)

        def factor(s):  # linear warmup, then cosine to min_lr_ratio or constant
            if s < cfg.warmup_steps:
                return (s + 1) / cfg.warmup_steps
            if cfg.lr_schedule == "constant":
                return 1.0
            prog = min(1.0, (s - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)

    # ---------------------------------------------------------------------------------------- sampling
    def rollouts(self, problems: list[tuple[int, tasks.Problem]], G: int, temperature: float, seed_keys,
                 max_new_tokens: int):
        """Sample G completions for this rank's share of `problems` (whole groups); gather every rank's groups,
        in the global order, as dicts. Per-row seeds come from (seed_keys, problem position, sample index)."""
        mine = list(range(self.rank, len(problems), self.world))
        prompts = [self.task.prompt_ids(problems[j][1]) for j in mine]
        seeds = torch.tensor([seed_of(*seed_keys, j, g) for j in mine for g in range(G)])
        ro = self.gathered(self.model, lambda: mine and generate(  # every rank gathers, even one with no prompts
            self.model, prompts, G, max_new_tokens, temperature=temperature, top_k=self.cfg.top_k,
            top_p=self.cfg.top_p, stop_ids=self.task.stop_ids, seed=seeds))
        out = []
        if mine:
            ids, mask, lp = ro.completion_ids.cpu(), ro.completion_mask.cpu(), ro.logprobs.float().cpu()
        for a, j in enumerate(mine):
            rows = range(a * G, (a + 1) * G)
            comps = [ids[r][mask[r]].tolist() for r in rows]
            texts = [self.task.text(c) for c in comps]
            out.append(dict(pos=j, pid=problems[j][0], problem=problems[j][1], prompt=prompts[a], comps=comps,
                            texts=texts, logprobs=[lp[r][mask[r]] for r in rows],
                            truncated=[bool(ro.truncated[r]) for r in rows],
                            correct=[self.task.score(t, problems[j][1]) for t in texts]))
        return sorted(all_gather_list(out), key=lambda g: g["pos"])

    def rewards(self, g) -> list[float]:
        """r_i = accuracy + format weight · format reward + DAPO soft overlong punishment (eq. 13)."""
        cfg, r = self.cfg, list(g["correct"])
        if cfg.format_weight:
            r = [x + cfg.format_weight * verify.format_reward(t) for x, t in zip(r, g["texts"])]
        if cfg.overlong_buffer:
            pen = grpo.overlong_penalty(torch.tensor([len(c) for c in g["comps"]]), cfg.max_new_tokens,
                                        cfg.overlong_buffer)
            r = [x + p for x, p in zip(r, pen.tolist())]
        return r

    def collect(self, step: int):
        """DAPO dynamic sampling: sample groups until P have reward spread > 0 (or the tries run out). Prompts
        saturated on each of their last k visits are skipped before any sampling is spent on them."""
        cfg, P, G = self.cfg, self.cfg.prompts_per_step, self.cfg.group_size
        kept, seen, drawn, skipped, keep_rate = [], [], 0, 0, 1.0
        for tries in range(cfg.max_sample_tries if cfg.dynamic_sampling else 1):
            n = P if tries == 0 else min(4 * P, math.ceil((P - len(kept)) / max(keep_rate, 0.25)))
            problems = []
            while len(problems) < n:
                pid, p = self.task.problem("rl", self.cursor)
                self.cursor, drawn = self.cursor + 1, drawn + 1
                hist = self.memory.get(pid, [])
                if cfg.skip_saturated_k and len(hist) >= cfg.skip_saturated_k and all(hist[-cfg.skip_saturated_k:]):
                    skipped += 1
                    if skipped > 100 * P:
                        raise RuntimeError("every training prompt is saturated: the pass-rate memory skips them all")
                    continue
                problems.append((pid, p))
            groups = self.rollouts(problems, G, cfg.temperature, (cfg.seed, step, tries), cfg.max_new_tokens)
            for g in groups:
                g["rewards"] = self.rewards(g)
                sat = min(g["correct"]) == max(g["correct"])
                self.memory[g["pid"]] = (self.memory.get(g["pid"], []) + [sat])[-max(1, cfg.skip_saturated_k):]
                if not cfg.dynamic_sampling or max(g["rewards"]) > min(g["rewards"]):
                    kept.append(g)
            seen += groups
            keep_rate = len(kept) / len(seen)
            if len(kept) >= P:
                break
        stats = {"train/reward": sum(sum(g["rewards"]) for g in seen) / (G * len(seen)),
                 "train/accuracy": sum(sum(g["correct"]) for g in seen) / (G * len(seen)),
                 "train/kept_groups_frac": keep_rate, "train/discarded_rollouts": G * (len(seen) - min(P, len(kept))),
                 "train/skip_rate": skipped / drawn, "train/sample_tries": tries + 1,
                 "train/truncated_frac": sum(sum(g["truncated"]) for g in seen) / (G * len(seen))}
        return kept[:P], stats

    # ------------------------------------------------------------------------------------- optimisation
    def accumulate(self, prompts, comps, loss_fn, temperature):
        """Forward/backward over this rank's rows in token-budget micro-batches; loss_fn(rows, logp, entropy)
        returns (loss already divided by the GLOBAL normaliser, metrics). Returns summed metrics."""
        lengths = [len(p) + len(c) for p, c in zip(prompts, comps)]
        n_micro = len(micro_batches(lengths, self.cfg.micro_batch_tokens))
        if self.world > 1:  # equal pass counts on every rank, else FSDP's collectives would hang
            t = torch.tensor(n_micro, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            n_micro = int(t)
        sums = {}
        for rows in micro_batches(lengths, self.cfg.micro_batch_tokens, n_micro):
            dummy = not rows  # an empty pass keeps collectives in step: one pad token, zero weight
            ps, cs = ([[0]], [[0]]) if dummy else ([prompts[i] for i in rows], [comps[i] for i in rows])
            comp = pad_batch(cs).to(self.device)
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
                logp, ent = completion_logprobs(self.model, ps, comp, self.cfg, self.device, temperature)
            loss, met = loss_fn(rows, logp, ent)
            (loss * self.world * (0.0 if dummy else 1.0)).backward()  # FSDP averages over ranks: undo it
            for k, v in met.items():
                sums[k] = sums.get(k, 0.0) + v.detach().float()
        return sums

    def optimizer_step(self, opt, sched) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if torch.isfinite(norm):
            opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return norm

    def sft_step(self, step, opt, sched):
        """Cold start: token-mean NLL of the worked solution (+ eos) given the prompt."""
        B = self.cfg.sft_batch_size
        ks = list(range(self.sft_cursor, self.sft_cursor + B))[self.rank::self.world]
        probs = [self.task.problem("sft", k)[1] for k in ks]
        self.sft_cursor += B
        prompts = [self.task.prompt_ids(p) for p in probs]
        comps = [self.tok.encode(self.task.demo(k, p), add_special_tokens=False).ids + self.task.stop_ids[:1]
                 for k, p in zip(ks, probs)]
        norm = all_sum(torch.tensor(float(sum(map(len, comps))), device=self.device))

        def loss_fn(rows, logp, ent):
            mask = pad_batch([[1] * len(comps[i]) for i in rows]).to(self.device).bool() if rows else logp < 0 * logp
            loss = grpo.sft_loss(logp, mask, loss_scale=norm)
            return loss, {"train/loss": loss, "train/entropy": (ent * mask).sum() / norm}
        m = {k: all_sum(v) for k, v in self.accumulate(prompts, comps, loss_fn, 0.0).items()}
        return {**m, "train/grad_norm": self.optimizer_step(opt, sched), "train/lr": sched.get_last_lr()[0]}

    def rl_step(self, step, opt, sched):
        cfg, G, dev = self.cfg, self.cfg.group_size, self.device
        t0 = time.time()
        groups, stats = self.collect(step)
        t1 = time.time()
        if not groups:  # every group had zero spread even after refills: nothing to learn from this step
            sched.step()
            return {**stats, "train/loss": 0.0, "train/grad_norm": 0.0, "train/lr": sched.get_last_lr()[0]}
        adv = grpo.group_advantages(torch.tensor([r for g in groups for r in g["rewards"]]), G, scale=cfg.adv_scale)
        mine = [(k, i) for k in range(self.rank, len(groups), self.world) for i in range(G)]  # whole groups per rank
        prompts = [groups[k]["prompt"] for k, _ in mine]
        comps = [groups[k]["comps"][i] for k, i in mine]
        adv = adv[[k * G + i for k, i in mine]].to(dev)                                       # [n]
        mask = pad_batch([[not (cfg.mask_truncated and groups[k]["truncated"][i])] * len(groups[k]["comps"][i])
                          for k, i in mine], False, torch.bool).to(dev)                       # [n, L]
        sampler = pad_batch([groups[k]["logprobs"][i].tolist() for k, i in mine], 0.0, torch.float32).to(dev)
        norm = all_sum(grpo.loss_normaliser(mask, cfg.agg, cfg.max_new_tokens).to(dev))      # global normaliser
        old = self.gathered(self.model, lambda: self.old_logprobs(prompts, comps)) if cfg.ppo_epochs > 1 else None
        gaps = [torch.zeros((), device=dev)]
        for epoch in range(cfg.ppo_epochs):
            def loss_fn(rows, logp, ent):
                if not rows:
                    return logp.sum() * 0, {}
                r, Lm = torch.tensor(rows, device=dev), logp.shape[1]
                m = mask[r, :Lm]
                ref = None
                if cfg.beta > 0:
                    with torch.no_grad():
                        ref = completion_logprobs(self.ref, [prompts[i] for i in rows], pad_batch(
                            [comps[i] for i in rows]), cfg, dev)[0]
                loss, met = grpo.policy_loss(logp, logp.detach() if old is None else old[r, :Lm], adv[r], m, cfg.eps_low,
                                             cfg.eps_high, ref, cfg.beta, cfg.agg, cfg.max_new_tokens, loss_scale=norm)
                if epoch == 0:  # sampler vs trainer on the same tokens: catches a mismatched scoring rule
                    gaps.append(((logp.detach() - sampler[r, :Lm]).abs() * m).amax())
                tok = met.pop("tokens")
                return loss, {"train/loss": loss, "n": tok, "train/entropy": (ent * m).sum(),
                              **{f"train/{k}": v * tok for k, v in met.items()}}
            m = self.accumulate(prompts, comps, loss_fn, cfg.temperature)
            if epoch == 0:  # log the metrics of the first epoch: the on-policy one
                sums = m
            gnorm = self.optimizer_step(opt, sched)
        n = all_sum(sums.pop("n", torch.zeros((), device=dev))).clamp(min=1)
        gap = torch.stack(gaps).amax()
        if dist.is_initialized():
            dist.all_reduce(gap, op=dist.ReduceOp.MAX)
        out = {k: all_sum(v) / (1 if k == "train/loss" else n) for k, v in sums.items()}
        tokens = all_sum(torch.tensor(float(sum(map(len, comps)))))
        return {**stats, **out, "train/logprob_gap_max": gap, "train/grad_norm": gnorm, "train/lr": sched.get_last_lr()[0],
                "train/completion_len": sum(len(c) for g in groups for c in g["comps"]) / (G * len(groups)),
                "time/rollout_s": t1 - t0, "time/train_s": time.time() - t1, "time/sample_tok_per_s": tokens / (t1 - t0)}

    @torch.no_grad()
    def old_logprobs(self, prompts, comps):
        """π_old(o_t) for μ > 1 inner epochs: one no-grad pass before the first update, [n, L]."""
        out = torch.zeros(len(comps), max(map(len, comps), default=1), device=self.device)
        for rows in micro_batches([len(p) + len(c) for p, c in zip(prompts, comps)], self.cfg.micro_batch_tokens):
            lp = completion_logprobs(self.model, [prompts[i] for i in rows], pad_batch([comps[i] for i in rows]),
                                     self.cfg, self.device)[0]
            out[rows[0]:rows[-1] + 1, :lp.shape[1]] = lp
        return out

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate(self, step: int, stage: str) -> dict:
        """Greedy pass@1, sampled pass@1 at the training temperature, maj@k, length and answer rate, per level too."""
        cfg, probs = self.cfg, list(enumerate(self.task.heldout))
        greedy = self.rollouts(probs, 1, 0.0, (cfg.eval_seed, 0), cfg.max_new_tokens)
        sampled = self.rollouts(probs, cfg.eval_k, cfg.temperature, (cfg.eval_seed, 1), cfg.max_new_tokens)
        rec, by_level = {}, {}
        for g, s in zip(greedy, sampled):
            answers = [self.task.answer(t) for t in s["texts"]]
            votes = Counter(a for a in answers if a is not None).most_common(1)
            maj = s["correct"][answers.index(votes[0][0])] if votes else 0.0
            row = {"pass@1": g["correct"][0], "pass@1_sampled": sum(s["correct"]) / cfg.eval_k, f"maj@{cfg.eval_k}": maj,
                   "completion_len": sum(map(len, s["comps"])) / cfg.eval_k,
                   "answer_rate": sum(a is not None for a in answers) / cfg.eval_k}
            for key in (None, g["problem"].level):
                acc = by_level.setdefault(key, Counter())
                acc.update(row)
                acc["n"] += 1
        for level, acc in by_level.items():
            suffix = "" if level is None else f"_L{level}"
            keys = list(acc) if level is None else ["pass@1", "pass@1_sampled"]
            rec.update({f"eval/{k}{suffix}": acc[k] / acc["n"] for k in keys if k != "n"})
        if self.rank == 0:
            for g in greedy[:3]:
                print(f"  [eval sample] {g['problem'].prompt!r} -> {g['texts'][0]!r} (gold {g['problem'].gold})")
            if self.wandb:
                table = self.wandb.Table(columns=["step", "prompt", "completion", "gold", "correct"])
                for g in greedy[:16]:
                    table.add_data(step, g["problem"].prompt, g["texts"][0], g["problem"].gold, g["correct"][0])
                self.wandb.log({"eval/samples": table}, step=step)
        return {"eval/maj@k": rec[f"eval/maj@{cfg.eval_k}"], **rec}

    # ---------------------------------------------------------------------------------------------- logging
    def log(self, step: int, stage: str, rec: dict):
        rec = {"step": step, "stage": stage, **{k: float(v) for k, v in rec.items()}}
        if self.rank != 0:
            return
        self.log_file.write(json.dumps(rec) + "\n")
        self.log_file.flush()
        if self.wandb:
            self.wandb.log(rec, step=step)
        if any(k.startswith("eval/") for k in rec):
            print(f"step {step:5d} {stage:3s} | EVAL " + " ".join(
                f"{k[5:]} {v:.3f}" for k, v in rec.items() if k.startswith("eval/") and "_L" not in k), flush=True)
            return
        total = self.cfg.sft_steps + self.cfg.rl_steps
        eta = (time.time() - self.t0) / max(1, step - self.start_step) * (total - step)
        cols = " ".join(f"{name} {rec[k]:{fmt}}" for k, name, fmt in CONSOLE if k in rec)
        print(f"step {step:5d} {stage:3s} | {cols} | eta {eta / 60:.1f} min", flush=True)

    def start_logging(self, resumed_step: int):
        if self.rank != 0:
            return
        os.makedirs(self.cfg.out_dir, exist_ok=True)
        path = os.path.join(self.cfg.out_dir, "metrics.jsonl")
        lines = open(path).readlines() if os.path.exists(path) else []
        # a killed run may have logged steps past its last checkpoint: drop them so the resumed log is exact
        kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= resumed_step]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        self.log_file = open(path, "a")
        mode = self.cfg.wandb_mode
        if mode == "auto":  # W&B's own WANDB_MODE decides when set (CI sets disabled)
            mode = os.environ.get("WANDB_MODE") or "auto"
        if mode != "disabled":
            import wandb
            if mode == "auto":
                mode = "online" if wandb.login(prompt=False) else "offline"  # True only with stored credentials
            self.wandb = wandb
            wandb.init(project=self.cfg.wandb_project, dir=self.cfg.out_dir, mode=mode,
                       config=dataclasses.asdict(self.cfg), name=os.path.basename(os.path.abspath(self.cfg.out_dir)))

    # ------------------------------------------------------------------------------------------ checkpoints
    def full_state(self, opt=None, rank0_only=True):
        """Unsharded model (and optimizer) state dicts; with FSDP every rank must call this (it all-gathers), and
        with rank0_only the other ranks get empty dicts (cpu_offload keeps them on rank 0 only)."""
        if self.world == 1:
            return self.model.state_dict(), opt and opt.state_dict()
        from torch.distributed.checkpoint import state_dict as dcp
        opts = dcp.StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
        if opt is None:
            return dcp.get_model_state_dict(self.model, options=opts), None
        return dcp.get_state_dict(self.model, opt, options=opts)

    def save(self, step: int, stage: str, opt, sched):
        """run_dir/step_N/: a Hugging Face folder plus trainer_state.pt, written under a temporary name and
        renamed, so a crash mid-save never leaves a corrupt latest checkpoint."""
        model_sd, opt_sd = self.full_state(opt)
        if self.rank == 0:
            final = os.path.join(self.cfg.out_dir, f"step_{step}")
            tmp = final + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            with torch.device("meta"):
                m = Transformer(self.model_config)
            m.load_state_dict({k: v.detach().cpu() for k, v in model_sd.items()}, assign=True)
            m.save_pretrained(tmp, tokenizer=self.tok)
            if self.ref is not None:
                torch.save(self.ref.state_dict(), os.path.join(tmp, "ref_model.pt"))
            torch.save({"optimizer": opt_sd, "scheduler": sched.state_dict(), "step": step, "stage": stage,
                        "cursor": self.cursor, "sft_cursor": self.sft_cursor, "memory": self.memory,
                        "bad_steps": self.bad_steps, "rng": torch.get_rng_state(), "config": dataclasses.asdict(self.cfg)},
                       os.path.join(tmp, "trainer_state.pt"))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            done = sorted(complete_checkpoints(self.cfg.out_dir))
            for old in done[:-self.cfg.keep_ckpts] if self.cfg.keep_ckpts else []:
                shutil.rmtree(os.path.join(self.cfg.out_dir, f"step_{old}"), ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()

    def out_of_time(self, t0: float) -> bool:
        """rl_minutes spent since t0 on any rank: every rank stops at the same step."""
        late = float(self.cfg.rl_minutes > 0 and time.time() - t0 > 60 * self.cfg.rl_minutes)
        return bool(all_sum(torch.tensor(late, device=self.device)) > 0)

    def finish(self, results: dict) -> dict:
        if self.rank == 0:
            summary(results)
            self.log_file.close()
            if self.wandb:
                self.wandb.finish()
        return results

    def make_ref(self):
        """π_ref: a frozen, unsharded copy of the current policy (β > 0 only; costs one model copy per rank)."""
        sd, _ = self.full_state(rank0_only=False)
        ref = Transformer(self.model_config).to(self.device)
        ref.load_state_dict({k: v.to(self.device) for k, v in sd.items()})
        return ref.requires_grad_(False).eval()


CONSOLE = [("train/loss", "loss", ".4f"), ("train/reward", "reward", ".3f"), ("train/accuracy", "acc", ".3f"),
           ("train/completion_len", "len", ".1f"), ("train/kl", "kl", ".4f"), ("train/clip_low", "clip_lo", ".3f"),
           ("train/clip_high", "clip_hi", ".3f"), ("train/entropy", "ent", ".3f"), ("train/grad_norm", "gnorm", ".2f"),
           ("train/kept_groups_frac", "kept", ".2f"), ("train/skip_rate", "skip", ".2f"),
           ("train/logprob_gap_max", "lp_gap", ".1e"), ("time/rollout_s", "roll_s", ".1f"),
           ("time/train_s", "train_s", ".1f"), ("time/sample_tok_per_s", "tok/s", ".0f")]


def complete_checkpoints(out_dir: str) -> list[int]:
    return [int(p.split("_")[-1]) for p in glob.glob(os.path.join(out_dir, "step_*"))
            if p.split("_")[-1].isdigit() and os.path.exists(os.path.join(p, "trainer_state.pt"))]


# ================================================================================================== loop
def main(cfg: Config) -> dict:
    if cfg.algo in ("star", "rft"):  # expert iteration: STaR / rejection-sampling fine-tuning
        import star
        return star.main(cfg)
    latest = max(complete_checkpoints(cfg.out_dir), default=0) if cfg.resume else 0
    if latest:  # resume: weights from the checkpoint folder, the rest from its trainer_state.pt
        ckpt = os.path.join(cfg.out_dir, f"step_{latest}")
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
        cfg = dataclasses.replace(cfg, init_from=ckpt)
    tr = Trainer(cfg)
    tr.start_step = latest
    if latest:
        tr.cursor, tr.sft_cursor, tr.memory, tr.bad_steps = (state[k] for k in ("cursor", "sft_cursor", "memory", "bad_steps"))
        torch.set_rng_state(state["rng"])
    tr.start_logging(latest)
    if tr.rank == 0:
        print(json.dumps(dataclasses.asdict(cfg)), f"\nmodel: {tr.n_params:,} "
              f"parameters, world size {tr.world}, device {tr.device}\nobjective: {objective(cfg)}", flush=True)
    total, opt, stage, results, rl_t0 = cfg.sft_steps + cfg.rl_steps, None, None, {}, time.time()
    for step in range(latest + 1, total + 1):
        new_stage = "sft" if step <= cfg.sft_steps else "rl"
        if new_stage != stage:  # each stage starts a fresh AdamW and LR schedule
            stage, rl_t0 = new_stage, time.time()
            n = cfg.sft_steps if stage == "sft" else cfg.rl_steps
            opt, sched = tr.make_optimizer(cfg.sft_lr if stage == "sft" else cfg.lr, n)
            if latest and step == latest + 1 and state["stage"] == stage:  # resumed mid-stage
                load_optimizer(tr, opt, state["optimizer"])
                sched.load_state_dict(state["scheduler"])
            if stage == "rl" and cfg.beta > 0:
                tr.ref = tr.make_ref()
                ref_file = os.path.join(cfg.init_from, "ref_model.pt")
                if latest and step == latest + 1 and os.path.exists(ref_file):
                    tr.ref.load_state_dict(torch.load(ref_file, map_location=tr.device))
        rec = tr.sft_step(step, opt, sched) if stage == "sft" else tr.rl_step(step, opt, sched)
        rec = {k: float(v) for k, v in rec.items()}  # the one host sync of the step
        if not (math.isfinite(rec["train/loss"]) and math.isfinite(rec["train/grad_norm"])):
            tr.bad_steps += 1
            print(f"warning: step {step}: non-finite loss or grad norm, update skipped ({tr.bad_steps} in a row)")
            if tr.bad_steps >= cfg.max_bad_steps:
                raise RuntimeError(f"{tr.bad_steps} non-finite steps in a row; the last good checkpoint is intact "
                                   f"in {cfg.out_dir}")
        else:
            tr.bad_steps = 0
        tr.log(step, stage, rec)
        if stage == "rl" and cfg.beta > 0 and cfg.ref_update_every and (step - cfg.sft_steps) % cfg.ref_update_every == 0:
            tr.ref = tr.make_ref()
        out_of_time = stage == "rl" and tr.out_of_time(rl_t0)
        total = step if out_of_time else total
        end_of_stage = step in (cfg.sft_steps, total)
        if step % cfg.eval_every == 0 or end_of_stage:
            ev = tr.evaluate(step, stage)
            tr.log(step, stage, ev)
            if end_of_stage:
                results[stage] = ev
        if (step % cfg.ckpt_every == 0 or step == total) and tr.bad_steps == 0:
            tr.save(step, stage, opt, sched)
        if out_of_time:
            break
    return tr.finish(results)


def load_optimizer(tr, opt, sd):
    if tr.world == 1:
        return opt.load_state_dict(sd)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(tr.model, opt, sd, options=StateDictOptions(full_state_dict=True))


def summary(results: dict):
    if not results:
        return
    keys = sorted({k for r in results.values() for k in r if k != "eval/maj@k"})
    print("\nheld-out results\n" + f"{'metric':28s}" + "".join(f"{s:>10s}" for s in results))
    for k in keys:
        print(f"{k[5:]:28s}" + "".join(f"{r.get(k, float('nan')):10.3f}" for r in results.values()))


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
    if dist.is_initialized():  # leave together: a rank tearing gloo down while its peer still works can abort
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown, where gloo's threads have aborted (SIGABRT) about 1 run in 12
