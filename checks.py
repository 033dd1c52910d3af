"""Fail fast: every setting train.py, star.py and evaluate.py would otherwise trip over late,
checked before anything loads (train.build_run calls check first), each error one line naming the
keys and their values.

  1. RULES: the cross-field constraints of train.Config and star.StarConfig, one row each: the
     fields it reads, the condition that must hold, and the requirement, whose {key} reads
     "key = value" in the message, e.g. "overlong_buffer = 128 must be <= max_new_tokens = 32"; then
     the counts that must be >= 1 (POSITIVE) or >= 0 (NON_NEGATIVE). A rule applies to a config that
     has all its fields (StarConfig's, to star.py's).
  2. check_files: the paths the config names exist and are complete: init_from and a distillation
     teacher are Hugging Face folders with config.json (a supported model), tokenizer.json and whole
     safetensors files (each file's header gives the bytes its tensors need: a truncated download is
     named, not left to fail inside safetensors), and the JSONL files of gsm8k / math exist.
Every failure raises cli.UserError; the entry points print it as one line and exit 1 (cli.run_main).

  python -c "import checks, train; \\
             checks.check(train.Config(overlong_buffer=128, max_new_tokens=32))"
"""
import json
import os

from cli import UserError
import grpo
import lora
import tooluse

FRESH = "with no init_from (a fresh model)"
LOSS_KEYS = ("pg_loss", "ratio_level", "agg", "dual_clip", "tau_pos", "tau_neg", "kl_estimator")
# (fields, ok(c), requirement); RL-only rules name rl_steps so that SFT-only runs pass; bounds below
RULES = [
    (("overlong_buffer", "max_new_tokens", "rl_steps"), lambda c: c.rl_steps == 0 or
     0 <= c.overlong_buffer <= c.max_new_tokens,
     "{overlong_buffer} must be <= {max_new_tokens} and >= 0 (DAPO eq. 13: L_cache within L_max)"),
    (("max_new_tokens", "max_seq_len", "init_from"),
     lambda c: c.init_from or c.max_new_tokens < c.max_seq_len,
     "{max_new_tokens} must be < {max_seq_len} " + FRESH + ": a prompt needs room too"),
    (("n_heads", "n_kv_heads", "init_from"), lambda c: c.init_from or c.n_kv_heads >= 1 and
     c.n_heads % c.n_kv_heads == 0, "{n_kv_heads} must divide {n_heads} " + FRESH),
    (("hidden_size", "n_heads", "init_from"), lambda c: c.init_from or c.n_heads >= 1 and
     c.hidden_size % c.n_heads == 0 and c.hidden_size // c.n_heads % 2 == 0,
     "{hidden_size} must be {n_heads} times an even head size " + FRESH + " (RoPE rotates pairs)"),
    (("group_size", "rl_steps"), lambda c: c.rl_steps == 0 or c.group_size >= 2,
     "{group_size} must be >= 2 with {rl_steps}: a group's advantages compare its samples"),
    (("temperature",), lambda c: c.temperature > 0,
     "{temperature} must be > 0 (RL and sampled eval sample at it; the trainer scores logits / T)"),
    (("top_p",), lambda c: 0 < c.top_p <= 1, "{top_p} must be in (0, 1] (1: off)"),
    (("eps_low", "eps_high"), lambda c: 0 <= c.eps_low <= 1 and c.eps_high >= 0,
     "{eps_low} must be in [0, 1] and {eps_high} >= 0 "
     "(the clip range [1 − ε_low, 1 + ε_high])"),
    (("dual_clip", "pg_loss"),
     lambda c: c.dual_clip == 0 or c.dual_clip > 1 and c.pg_loss == "clip",
     "{dual_clip} must be 0 (off) or > 1, and only with pg_loss = 'clip' (got {pg_loss})"),
    (("tis", "tis_cap"), lambda c: c.tis == "none" or c.tis_cap >= 1,
     "{tis_cap} must be >= 1 with {tis}"),
    (("top_entropy_q",), lambda c: 0 < c.top_entropy_q <= 1,
     "{top_entropy_q} must be in (0, 1] (1: all tokens)"),
    (("ref_update_every", "beta"), lambda c: c.ref_update_every == 0 or c.beta > 0,
     "{ref_update_every} refreshes π_ref, which only {beta} > 0 uses"),
    (("reward", "task"), lambda c: c.reward != "process" or c.task == "arithmetic",
     "{reward} needs task = 'arithmetic' (its steps are checkable), got {task}"),
    (("sft_batch_size", "sft_steps"), lambda c: c.sft_steps == 0 or c.sft_batch_size >= 1,
     "{sft_batch_size} must be >= 1 with {sft_steps}"),
    (("min_lr_ratio",), lambda c: 0 <= c.min_lr_ratio <= 1, "{min_lr_ratio} must be in [0, 1]"),
    (("sft_min_ops", "sft_max_ops"), lambda c: 1 <= c.sft_min_ops <= c.sft_max_ops,
     "{sft_min_ops} must be >= 1 and <= {sft_max_ops}"),
    (("rl_min_ops", "rl_max_ops"), lambda c: 1 <= c.rl_min_ops <= c.rl_max_ops,
     "{rl_min_ops} must be >= 1 and <= {rl_max_ops}"),
    (("eval_min_ops", "eval_max_ops"), lambda c: 1 <= c.eval_min_ops <= c.eval_max_ops,
     "{eval_min_ops} must be >= 1 and <= {eval_max_ops}"),
    (("ops",), lambda c: c.ops and set(c.ops) <= set("+-*"), "{ops} must draw from '+-*'"),
    (("sft_flaw_frac",), lambda c: 0 <= c.sft_flaw_frac <= 1, "{sft_flaw_frac} must be in [0, 1]"),
    (("sft_direct_frac",), lambda c: 0 <= c.sft_direct_frac <= 1,
     "{sft_direct_frac} must be in [0, 1]"),
    (("template", "init_from"), lambda c: c.template != "chat" or c.init_from,
     "{template} needs a checkpoint's chat template: set init_from (got {init_from})"),
    (("system_prompt", "template"), lambda c: not c.system_prompt or c.template == "chat",
     "{system_prompt} needs template = 'chat' (got {template})"),
    (("task", "train_file", "eval_file"),
     lambda c: c.task not in ("gsm8k", "math") or c.train_file and c.eval_file,
     "{task} reads JSONL files: set train_file and eval_file (got {train_file}, {eval_file})"),
    (("task", "rg_datasets"), lambda c: c.task != "reasoning_gym" or c.rg_datasets,
     "{task} needs {rg_datasets} naming a dataset and its options "
     "(TOML: [rg_datasets.leg_counting]; JSON on the command line)"),
    (("task", "eval_n", "rg_heldout", "rg_size"), lambda c: c.task != "reasoning_gym" or
     c.eval_n <= c.rg_heldout < c.rg_size,
     "{eval_n} must be <= {rg_heldout} (the held-out pool) < {rg_size}"),
    (("task", "sft_steps"), lambda c: c.task != "reasoning_gym" or c.sft_steps == 0,
     "{task} has no worked solutions to imitate: {sft_steps} must be 0"),
    (("adv_scale", "overlong_buffer", "kl_in", "beta"),
     lambda c: c.adv_scale != "maxrl" or c.overlong_buffer == 0 and not c.kl_in_reward,
     "{adv_scale} divides by the group's mean reward, a success rate:"
     " no negative shaping ({overlong_buffer}, {kl_in} with {beta})"),
    (("kl_in", "beta"), lambda c: c.kl_in == "loss" or c.beta > 0,
     "{kl_in} subtracts β·k1 from the reward: set {beta} > 0"),
    (("pg_loss", "tau_pos", "tau_neg"),
     lambda c: c.pg_loss != "sapo" or c.tau_pos > 0 and c.tau_neg > 0,
     "{tau_pos} and {tau_neg} must be > 0 with {pg_loss} (the gate's temperatures)"),
    (("cov", "cov_frac", "cov_low", "cov_high"),
     lambda c: c.cov == "none" or 0 < c.cov_frac <= 1 and c.cov_low < c.cov_high,
     "{cov_frac} must be in (0, 1] and {cov_low} < {cov_high} with {cov}"),
    (("reward", "teacher", "opd_weight"),
     lambda c: c.reward != "none" or c.teacher and c.opd_weight > 0,
     "{reward} turns the verifier's advantage off: "
     "it needs a {teacher} folder and {opd_weight} > 0"),
    (("reward", "dynamic_sampling"), lambda c: c.reward != "none" or not c.dynamic_sampling,
     "{reward} (pure distillation) needs dynamic_sampling = false, got {dynamic_sampling}: "
     "the verifier's reward spread no longer decides which groups teach anything"),
    (("max_staleness", "sampler_ranks"),
     lambda c: c.max_staleness == 0 or c.max_staleness > 0 < c.sampler_ranks,
     "{max_staleness} must be 0, or > 0 with {sampler_ranks} > 0: "
     "the colocated loop samples the weights it trains"),
    (("lora_rank", "lora_alpha"), lambda c: c.lora_rank == 0 or c.lora_alpha > 0,
     "{lora_alpha} must be > 0 with {lora_rank} (the adapter's scale is α / r)"),
    (("lora_rank", "lora_targets"), lambda c: c.lora_rank == 0 or lora.targets_ok(c.lora_targets),
     "{lora_targets} must be 'all' or a comma list of " + ", ".join(lora.TARGETS)
     + " with {lora_rank}"),
    # star.StarConfig
    (("algo", "sampler_ranks"), lambda c: c.sampler_ranks == 0,
     "{sampler_ranks} is train.py's: star.py samples on every rank"),
    (("algo", "resume"), lambda c: not c.resume,
     "{resume} is not supported by star.py: start from a checkpoint with --init_from"),
    (("algo", "task", "train_size"),
     lambda c: c.task not in ("arithmetic", "countdown") or c.train_size > 0,
     "{train_size} must be > 0 with {algo}: it samples a fixed pool of training problems ({task})"),
    (("expert_fresh", "task"),
     lambda c: not c.expert_fresh or c.task not in ("arithmetic", "countdown"),
     "{expert_fresh} needs a dataset task: {task}'s stream is its train_size problems, one pool"),
    (("hint_sft_frac",), lambda c: 0 <= c.hint_sft_frac <= 1, "{hint_sft_frac} must be in [0, 1]"),
    (("tools",), lambda c: c.tools in ("",) + tuple(tooluse.TOOLS),
     "{tools} must be '' (off) or one of " + ", ".join(tooluse.TOOLS) + " (tooluse.TOOLS)"),
    (("sft_tool_frac", "tools", "task", "sft_steps"),
     lambda c: c.sft_tool_frac == 0 or c.sft_steps == 0 or
     0 < c.sft_tool_frac <= 1 and c.tools and c.task == "arithmetic",
     "{sft_tool_frac} must be 0, or in (0, 1] with a tool ({tools}) and task = 'arithmetic' "
     "({task}): the teacher's calls are arithmetic steps"),
    (("task", "hint_sft_frac", "rationalize", "algo"),
     lambda c: c.task != "countdown" or c.hint_sft_frac == 0
     and not (c.rationalize and c.algo == "star"),
     "countdown has no answer hint: set rationalize = false and hint_sft_frac = 0 "
     "(got {rationalize}, {hint_sft_frac}, {algo})"),
    (("scorer_timeout",), lambda c: c.scorer_timeout > 0,
     "{scorer_timeout} must be > 0 (seconds a scorer call may take)"),
]
POSITIVE = ("max_new_tokens", "prompts_per_step", "max_sample_tries", "ppo_epochs",
            "micro_batch_tokens", "eval_n", "eval_k", "eval_batch", "max_operand",
            "max_mul_operand", "max_tool_tokens", "expert_iters", "expert_samples",
            "async_timeout", "collective_timeout")  # counts that must be >= 1
NON_NEGATIVE = ("sft_steps", "rl_steps", "rl_minutes", "top_k", "beta", "kl_old", "cov_kl_coef",
                "opd_weight", "teacher_pass_every", "warmup_steps", "eval_every", "ckpt_every",
                "keep_ckpts", "skip_saturated_k", "train_size", "threads", "max_value",
                "expert_sft_steps", "expert_max_per_problem", "sampler_ranks", "lora_rank",
                "max_tool_calls", "sample_margin")
RULES += [((k,), lambda c, k=k, lo=lo: getattr(c, k) >= lo, f"{{{k}}} must be >= {lo}")
          for keys, lo in ((POSITIVE, 1), (NON_NEGATIVE, 0)) for k in keys]


def check(cfg):
    """Raise UserError on the first rule cfg breaks (check_settings), then on a missing or
    incomplete file."""
    check_settings(cfg)
    check_files(cfg)


def check_settings(cfg):
    for keys, ok, text in RULES:
        if all(hasattr(cfg, k) for k in keys) and not ok(cfg):
            raise UserError(text.format(**{k: f"{k} = {getattr(cfg, k)!r}" for k in keys}))
    try:  # the policy loss's settings, once: grpo.policy_loss does not check them per call
        grpo.check_settings(**{k: getattr(cfg, k) for k in LOSS_KEYS})
    except ValueError as e:
        raise UserError(f"loss settings: {e}") from None


def safetensors_complete(path: str):
    """A safetensors file is 8 bytes of header length n, n bytes of JSON header, then the tensors'
    bytes, the last ending at the largest data_offsets end: a file shorter than that is truncated
    (an interrupted download)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        try:
            header = json.loads(f.read(n)) if 0 <= n <= size - 8 else None
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file, or truncated in its header "
                        f"({size:,} bytes)")
    need = 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                       default=0)
    if size < need:
        raise UserError(f"{path}: truncated: {size:,} bytes, its header describes {need:,} "
                        "(download it again)")


def check_files(cfg):
    """The files the config names exist; init_from is a complete Hugging Face folder this code
    supports."""
    for key in ("train_file", "eval_file") if getattr(cfg, "task", "") in ("gsm8k", "math") else ():
        if not os.path.isfile(getattr(cfg, key)):
            raise UserError(f"{key} = {getattr(cfg, key)!r}: no such file")
    for key in ("init_from", "teacher"):
        if getattr(cfg, key, ""):
            check_folder(cfg, key, getattr(cfg, key))
    if getattr(cfg, "scorer", ""):  # importable, a function
        import tasks
        tasks.load_scorer(cfg.scorer)


def check_folder(cfg, key: str, path: str):
    """A Hugging Face folder (init_from, or a distillation teacher) this code can load, whole."""
    if not os.path.isdir(path):
        raise UserError(f"{key} = {path!r}: no such folder "
                        "(a Hugging Face checkpoint folder, or a step_N/)")
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(path, name)):
            raise UserError(f"{key} = {path!r}: {name} is missing")
    import model  # torch, only once a checkpoint is named
    try:
        max_len = model.read_config(path).max_seq_len
    except (ValueError, KeyError) as e:
        # an unsupported architecture or a missing key, naming config.json
        raise UserError(str(e).strip("'\"")) from None
    if getattr(cfg, "max_new_tokens", 0) >= max_len:
        raise UserError(f"max_new_tokens = {cfg.max_new_tokens} must be < the checkpoint's "
                        f"max_position_embeddings = {max_len} ({path}/config.json): "
                        "a prompt needs room too")
    index = os.path.join(path, "model.safetensors.index.json")
    files = ["model.safetensors"]
    if os.path.isfile(index):
        with open(index) as f:
            try:
                files = sorted(set(json.load(f)["weight_map"].values()))
            except (ValueError, KeyError):
                raise UserError(f"{index}: not a safetensors index (no 'weight_map')") from None
    for name in files:
        if not os.path.isfile(os.path.join(path, name)):
            raise UserError(f"{key} = {path!r}: {name} is missing")
        safetensors_complete(os.path.join(path, name))
