"""train.py's Config: every setting of a run, one field each, with the paper section it comes from.

Defaults are written once, here. A run reads them, then a TOML file (--config FILE.toml, several in
order), then --key=value overrides, each coerced by the field's type (cli.parse_config); an unknown
key or a value outside CHOICES is an error naming the key and where it came from, and `--help`
prints every field with its default and comment, grouped by the sections below. The cross-field
rules (e.g. overlong_buffer <= max_new_tokens) are checked by checks.py before anything loads.

  python train.py --help
  python train.py --config configs/smoke.toml --rl_steps=8
"""
from dataclasses import dataclass, field
from typing import ClassVar

import cli
import credit
import grpo
import tasks


@dataclass
class Config:
    # --- run
    out_dir: str = "runs/demo"          # run directory: metrics.jsonl and step_N/ checkpoints
    seed: int = 0                       # model init, training prompt stream and sampling seeds
    resume: bool = False                # continue from the latest complete step_N/ in out_dir
    init_from: str = ""                 # a Hugging Face folder to start from (not a fresh model)
    device: str = "auto"                # auto: cuda:LOCAL_RANK if available, else cpu
    threads: int = 0                    # CPU threads per rank (0: torch's default);
                                        #   oversubscription is costly
    wandb_mode: str = "auto"            # auto: $WANDB_MODE, else online if logged in, else offline
    wandb_project: str = "grpo-from-scratch"
    print_config: str = "changed"       # the config printed at the start: changed (fields off their
                                        #   defaults) | all
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
    template: str = "plain"             # templates.render_prompt: plain | r1 | boxed; chat: the
                                        #   checkpoint's chat template
    system_prompt: str = ""             # template chat: a system message before each question (e.g.
                                        #   R1's instruction)
    train_size: int = 0                 # synthetic: cycle over this many problems (0: fresh ones)
    sft_min_ops: int = 2                # synthetic difficulty of the SFT demonstrations
    sft_max_ops: int = 4
    sft_direct_frac: float = 0.0        # synthetic: share of cold-start demos that give only
                                        #   "#### N", no steps
    sft_flaw_frac: float = 0.6          # arithmetic only: share of demos from a sloppy teacher
                                        #   (tasks.flawed_solution)
    sft_flaw: str = "sign"              # its error: sign (negatives lose their "-") | random (one
                                        #   step off by 1-3)
    sft_answer_filter: bool = False     # drop demos whose final answer is wrong (answer-filtered
                                        #   SFT, RFT-like)
    sft_tool_frac: float = 0.0          # arithmetic with tools: share of demos that call the tool
                                        #   at every step, always right ([a*b]{c}); the rest mental
    # --- tools (tooluse.py): results join the row as forced tokens, masked from every loss
    tools: str = ""                     # "" (off) | calculator (tooluse.TOOLS)
    max_tool_calls: int = 4             # calls answered per completion; one more ends it
    max_tool_tokens: int = 24           # tokens of one result's text (cut), its wrapper apart
    rl_min_ops: int = 2                 # synthetic difficulty of the RL prompts
    rl_max_ops: int = 4
    eval_min_ops: int = 2
    eval_max_ops: int = 4
    max_operand: int = 9                # synthetic: operands in 0..max_operand
    max_mul_operand: int = 9            # arithmetic: the operand after a "*" in 0..max_mul_operand
    max_value: int = 0                  # synthetic: bound on every intermediate result (0: none)
    ops: str = "+-"                     # synthetic: the operators a problem draws from
    rg_datasets: dict = field(default_factory=dict)
                                        #   reasoning_gym: {name: its options}; several names: a
                                        #   composite, drawn by `weight` (tasks.py, step 5)
    rg_size: int = 10000                # reasoning_gym: the size of ONE dataset (seed eval_seed)
    rg_heldout: int = 500               # reasoning_gym: indices [0, rg_heldout) are held out
                                        #   (eval_n of them evaluated), training draws the rest
    scorer: str = ""                    # "module:function", a scorer(completion, problem) -> float
                                        #   in [0, 1] in place of the task's (tasks.Scorer)
    scorer_timeout: float = 10.0        # seconds a call of a scorer outside verify.py may take
                                        #   (reasoning-gym's, `scorer`); over it: 0, counted
    # --- supervised cold start (DeepSeek-R1 §2.3.1)
    sft_steps: int = 800
    sft_batch_size: int = 64
    sft_lr: float = 2e-3
    # --- RL sampling
    rl_steps: int = 200
    rl_minutes: float = 0.0             # stop RL after this much wall-clock of training, evals
                                        #   not counted (0: no limit), for equal-time ablations
    prompts_per_step: int = 16          # P: groups per optimizer step (global, over all ranks)
    group_size: int = 8                 # G: samples per prompt (DeepSeekMath §4.1)
    max_new_tokens: int = 56
    temperature: float = 1.0            # sampling and scoring temperature (the trainer scores
                                        #   logits / T)
    top_k: int = 0
    top_p: float = 1.0
    cpu_compile: str = "auto"           # the compiled decode step on CPU: true | false | auto
                                        #   (infra.compiled_sampling)
    # --- RL objective: GRPO / DAPO / Dr. GRPO / GSPO / CISPO / RLOO / REINFORCE++, a flag each
    reward: str = "outcome"             # outcome (verifier) | process (DeepSeekMath §4.1.3) | none
                                        #   (pure distillation) | format_only (1 for any committed
                                        #   number: the control)
    adv_scale: str = "group"            # group (GRPO), batch, none (Dr. GRPO §3), rloo
                                        #   (Ahmadian et al. 2024), reinforce_pp (REINFORCE++,
                                        #   Hu 2025: whitened over the batch's tokens)
    ratio_level: str = "token"          # token (PPO, GRPO), sequence (GSPO, Zheng 2025 eq. 5)
    pg_loss: str = "clip"               # clip (PPO surrogate), cispo (MiniMax-M1 2025 §3.1:
                                        #   clipped sg weight), dppo_tv | dppo_kl (DPPO,
                                        #   arXiv 2602.04879: ε is the divergence δ),
                                        #   sapo (SAPO, arXiv 2511.20347 soft gate),
                                        #   gmpo (GMPO, arXiv 2507.20673: ε in log)
    tau_pos: float = 1.0                # SAPO gate temperature τ for Â > 0
    tau_neg: float = 1.05               # SAPO gate temperature τ for Â ≤ 0
    kl_old: float = 0.0                 # k2 KL to π_old, DPPO's companion term (0: off)
    cov: str = "none"                   # entropy control (Cui et al. 2025): clip (Clip-Cov) | kl
                                        #   (KL-Cov) | none
    cov_frac: float = 2e-4              # Clip-/KL-Cov: share of tokens picked by
                                        #   cov(log π_old, Â) over the global batch
    cov_low: float = 1.0                # Clip-Cov: the band (cov_low, cov_high) the tokens come
                                        #   from
    cov_high: float = 5.0               # Clip-Cov: the band's upper end
    cov_kl_coef: float = 1.0            # KL-Cov's coefficient on |log ρ_t|
    dual_clip: float = 0.0              # c > 1: bound the loss of Â < 0 at c·Â (dual-clip, Ye et
                                        #   al. 2020); 0: off
    kl_estimator: str = "k3"            # k1 | k2 | k3 (Schulman 2020); DeepSeekMath eq. 4 uses k3
    tis: str = "auto"                   # truncated IS of sampler vs trainer log-probs (Yao et al.
                                        #   2025): none | token | sequence | auto (token if
                                        #   max_staleness > 0, else none)
    tis_mode: str = "truncate"          # truncate w at C, mask w outside [1/C, C] (IcePop), or
                                        #   mask_high: w > C (Seq-MIS at sequence level)
    tis_cap: float = 2.0                # C, the TIS cap
    top_entropy_q: float = 1.0          # gradient only on the top-q entropy tokens (Wang et al.
                                        #   2025); 1: all
    agg: str = "token_mean"             # seq_mean_token_mean (GRPO), token_mean (DAPO §3.3),
                                        #   seq_mean_token_sum_norm (Dr. GRPO §3)
    eps_low: float = 0.2                # PPO clip ε (DeepSeekMath eq. 3)
    eps_high: float = 0.28              # DAPO §3.1 clip-higher
    beta: float = 0.0                   # KL(π_θ‖π_ref) weight, k3 estimator
                                        #   (DeepSeekMath eq. 4); DAPO drops it
    kl_in: str = "loss"                 # loss: β·kl_estimator per token;
                                        #   reward: r_i − β Σ_t k1 before Â (exact ∇)
    ref_update_every: int = 0           # refresh π_ref ← π_θ every K steps (0: never)
    teacher: str = ""                   # on-policy distillation (GKD, Agarwal et al. 2024; Thinking
                                        #   Machines 2025): a teacher's folder (distill.py)
    opd_weight: float = 1.0             # distillation weight w:
                                        #   Â_t += w·(log π_T − log π_old)(o_t)
    teacher_pass_every: int = 10        # the teacher's greedy pass rate on a step's P prompts every
                                        #   K steps (0: off)
    dynamic_sampling: bool = True       # DAPO §3.2: drop zero-spread groups and refill
    max_sample_tries: int = 4           # rounds of refill before training on what was found
    sample_margin: float = 2.0          # a try's prompts: the kept count's standard deviations to
                                        #   spare beyond missing / keep rate (0: none; RESULTS §15)
    skip_saturated_k: int = 0           # skip prompts saturated (all right or all wrong) on their
                                        #   last k visits
    overlong_buffer: int = 0            # DAPO §3.4 soft overlong punishment L_cache (0: off)
    mask_truncated: bool = False        # DAPO §3.4 overlong filtering: no loss on truncated
                                        #   samples
    format_weight: float = 0.0          # reward += weight · format_reward (R1 template)
    ppo_epochs: int = 1                 # μ: optimizer steps per batch (DeepSeekMath Alg. 1)
    micro_batch_tokens: int = 8192      # rows × padded length per forward; bounds activation
                                        #   memory
    cpu_bf16: str = "false"             # CPU as CUDA: the decode from a bf16 copy of the weights,
                                        #   the trainer's forwards and backward in bf16 autocast
                                        #   (fp32 weights, gradients and AdamW): true | false |
                                        #   auto (true where the CPU has bf16 instructions,
                                        #   AVX512-BF16 or AMX, where it pays): RESULTS.md §15
    activation_checkpointing: str = "auto"  # recompute each block's activations in backward:
                                        #   true | false | auto (on where memory.plan says the
                                        #   saved activations would not fit the GPU)
    grad_sync: str = "auto"             # FSDP2's gradient reduce-scatter: last (once a step; full
                                        #   fp32 gradients held between micro-batches) | every
                                        #   (each micro-batch: sharded gradients only) | auto
                                        #   (every where memory.plan says the full ones would not
                                        #   fit)
    # --- LoRA (Hu et al. 2021; lora.py): a frozen base, adapters on its linear layers
    lora_rank: int = 0                  # r of every adapter (0: off, full fine-tuning); Schulman et
                                        #   al. 2025 ("LoRA Without Regret") use ~10× the full lr
    lora_alpha: float = 32.0            # α: the adapter's output is scaled by α / r
    lora_targets: str = "all"           # all (q, k, v, o, gate, up, down) or a comma list of them
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
    sampler_ranks: int = 0              # k sampler ranks (0: every rank samples and trains, the
                                        #   colocated loop)
    max_staleness: int = 0              # K: step s trains on rollouts of π_v, v = s − 1 − K
                                        #   (0: synchronous)
    async_timeout: float = 600.0        # seconds a side waits with no beat from the other before it
                                        #   raises (dead)
    collective_timeout: float = 3600.0  # the async groups' op timeout, and the longest the other
                                        #   side may make no progress (hung); above any eval,
                                        #   checkpoint or sampling step
    # --- evaluation and checkpoints
    eval_every: int = 400               # held-out eval every K steps (0: only at the end of each
                                        #   stage)
    eval_n: int = 500                   # held-out problems (fixed, disjoint from training prompts)
    eval_k: int = 8                     # samples per problem: sampled pass@1, maj@k, pass@2..k
    eval_seed: int = 1234567            # the held-out set's seed, independent of `seed`
    eval_batch: int = 64                # held-out problems per sampling call, all ranks (bounds the
                                        #   KV cache)
    ckpt_every: int = 100               # checkpoint every K steps (0: only at the end)
    keep_ckpts: int = 2                 # newest checkpoints kept (0: all)
    save_dtype: str = ""                # step_N/ weights: "" the source folder's dtype (float32 for
                                        #   a fresh model)

    CHOICES: ClassVar[dict] = {
        "task": ("arithmetic", "countdown", "gsm8k", "math", "reasoning_gym"),
        "template": ("plain", "r1", "boxed", "chat"),
        "adv_scale": credit.SCALES, "agg": grpo.AGGS, "lr_schedule": ("cosine", "constant"),
        "sft_flaw": tasks.FLAWS, "wandb_mode": ("auto", "online", "offline", "disabled"),
        "reward": ("outcome", "process", "none", "format_only"), "ratio_level": grpo.RATIO_LEVELS,
        "pg_loss": grpo.PG_LOSSES,  # the live table: a loss registered later is a choice too
        "kl_estimator": grpo.KL_ESTIMATORS, "tis": ("auto", "none") + grpo.TIS_LEVELS,
        "tis_mode": grpo.TIS_MODES, "kl_in": ("loss", "reward"), "cov": ("none", "clip", "kl"),
        "print_config": ("changed", "all"), "cpu_compile": ("auto", "true", "false"),
        "cpu_bf16": ("auto", "true", "false"),
        "save_dtype": ("", "float32", "bfloat16", "float16"),
        "activation_checkpointing": ("auto", "true", "false"),
        "grad_sync": ("auto", "last", "every")}

    # r_i − β Σ_t k1 before Â (credit.kl_reward), not in the loss
    @property
    def kl_in_reward(self) -> bool:
        return self.kl_in == "reward" and self.beta > 0

    def __post_init__(self):  # tis = "auto": async_rl.py's correction once rollouts may be stale
        if self.tis == "auto":
            self.tis = "token" if self.max_staleness > 0 else "none"


def parse_args(argv: list[str], cls=Config):
    """Defaults ← --config FILE.toml ← --key=value (typed by the field; unknown keys are
    errors)."""
    return cli.parse_config(cls, argv)

