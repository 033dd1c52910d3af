"""TRL beside train.py: the same starting folder, prompts, reward and settings in TRL's \
GRPOTrainer, scored by OUR
evaluation; and a whole-step throughput comparison at fixed shapes on one random checkpoint.

Needs trl and transformers, which the project does not:
`pip install trl==1.16.0 transformers==5.24.0`.
  1. Training (default). The folder (`--init_from`: the demo's cold-start step_N/, or a real
     checkpoint such as SmolLM2-135M-Instruct) loads in transformers' AutoModelForCausalLM and
     AutoTokenizer. The prompts are train.py's RL stream in order (task.problem("rl", k)): with
     template = "chat" each is the conversation (system_prompt, question) that TRL renders with the
     folder's chat template, else our template's text; either way TRL's prompt ids are checked equal
     to ours. The reward is task.score of the decoded completion, what train.py rewards
     (verify.reward on arithmetic; on reasoning_gym the dataset's scorer of the final committed
     answer, binarised; reward = "format_only": tasks.committed_number). GRPOTrainer gets the
     closest settings to train.Config: loss_type "dapo" (token-level, normalised by the batch's
     tokens), ε = eps_low / eps_high, β = beta, num_generations = G and prompts_per_step · G
     completions per step, max_new_tokens, temperature, top_k / top_p, lr with warmup_steps of
     linear warmup then cosine to min_lr_ratio · lr over rl_steps (or constant), AdamW β1 / β2,
     weight decay, grad clip, μ = ppo_epochs, group std-scaled advantages; float32 (cpu_bf16: bf16
     autocast, as ours), no gradient checkpointing; trl_micro_rows splits the backward as
     micro_batch_tokens does ours. What stays different: TRL has no DAPO dynamic sampling
     (zero-spread groups train with zero advantage), samples with transformers' generate, and its
     warmup starts at lr 0.
  2. Training stops after `trl_minutes` of wall-clock (give it the RL stage's time of the run it is
     compared with, measured side by side under the same load). train.evaluate (train.py's held-out
     set and metrics: greedy and sampled pass@1, maj@k, answer rates, length) scores TRL's weights
     at step 0, every eval_every steps and at the end, each a line of out_dir/metrics.jsonl as
     train.py writes them (time/wall_s since training began, and time/train_wall_s without the
     evaluations, which trl_minutes does not count either, as in ours), so `tools/plot.py --x wall`
     (or --x train) draws TRL beside our runs. The model is saved to out_dir/final (our
     loader reads it for the last evaluation), the summary to out_dir/eval.json.
  3. `--bench=2m,20m`: per size, one random Qwen2-shaped checkpoint (tools/bench.py's presets,
     vocabulary 4096: our characters plus fillers; or a model folder, on the config's task and
     template), 4 prompts × 8 completions of exactly 64 new tokens (stop tokens off in both),
     β = 0, μ = 1, float32 (cpu_bf16: the training's products in bf16, both). Each TRL step is
     followed by one of ours (train.rl_step, no dynamic sampling) in the same process, so the two
     take turns through any slow spell of the machine; the first step of each is warm-up. Prints
     the median seconds per whole step (sample, reward, loss, backward, AdamW) and their ratio.

  python -m tools.compare_trl --init_from=runs/demo/step_1000 --trl_minutes=5 --out_dir=runs/trl \\
      --threads=1
  python -m tools.compare_trl --config configs/smollm2-135m-rg.toml --trl_minutes=30 \\
      --out_dir=runs/smollm2-rg-trl_s0
  python -m tools.compare_trl --bench=2m,20m --bench_steps=6 --threads=2
  python -m tools.compare_trl --config configs/smollm2-135m-rg.toml \\
      --bench=checkpoints/SmolLM2-135M-Instruct --threads=2
"""
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

import cli
import rollout
import tasks
import train
from model import ModelConfig, Transformer, build_char_tokenizer
from templates import render_prompt

PRESETS = {  # tools/bench.py's
    "2m": dict(hidden_size=128, n_layers=6, n_heads=4, n_kv_heads=2, intermediate_size=512),
    "20m": dict(hidden_size=384, n_layers=12, n_heads=6, n_kv_heads=2, intermediate_size=1024),
}


@dataclass
class TrlConfig(train.Config):
    trl_minutes: float = 0.0            # stop TRL's training after this much wall-clock
                                        #   (0: run rl_steps)
    bench: str = ""                     # comma-separated PRESETS or model folders:
                                        #   time whole steps, no training
    bench_steps: int = 6                # timed steps per side (after one warm-up step each)
    trl_micro_rows: int = 0             # rows per TRL forward + backward, accumulated
                                        #   (0: all P·G at once)

    CHOICES: ClassVar[dict] = train.Config.CHOICES


def import_trl():
    try:
        import transformers
        import trl
        from datasets import Dataset
    except ImportError as e:
        raise SystemExit(f"error: tools/compare_trl.py needs trl and transformers ({e}); "
                         "pip install trl==1.16.0 transformers==5.24.0") from None
    return transformers, trl, Dataset


def grpo_config(trl, cfg: TrlConfig, out_dir: str, max_steps: int, **over):
    """GRPOConfig closest to train.Config (see step 1 of the module docstring)."""
    P, G = cfg.prompts_per_step, cfg.group_size
    rows = cfg.trl_micro_rows or P * G  # one generation of P·G per optimizer step either way
    if (P * G) % rows:
        raise SystemExit(f"error: trl_micro_rows = {rows} does not divide "
                         f"prompts_per_step × group_size = {P * G}")
    return trl.GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=rows,
        gradient_accumulation_steps=P * G // rows,
        num_generations=G,
        max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
        top_p=cfg.top_p,
        loss_type="dapo", epsilon=cfg.eps_low, epsilon_high=cfg.eps_high, beta=cfg.beta,
        num_iterations=cfg.ppo_epochs, scale_rewards=cfg.adv_scale,
        mask_truncated_completions=cfg.mask_truncated,
        learning_rate=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=max_steps,
        lr_scheduler_type=("cosine_with_min_lr" if cfg.lr_schedule == "cosine"
                           else "constant_with_warmup"),
        lr_scheduler_kwargs=({"min_lr_rate": cfg.min_lr_ratio} if cfg.lr_schedule == "cosine"
                             else None),
        adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.grad_clip, shuffle_dataset=False, seed=cfg.seed,
        use_cpu=cfg.device != "cuda",
        bf16=("cpu" if cfg.device != "cuda" else "cuda") in rollout.BF16,  # as our trainer
        fp16=False, gradient_checkpointing=False, disable_dropout=True,
        report_to="none",
        save_strategy="no", log_completions=False, **{"logging_steps": 10, **over})


def trl_prompts(cfg: TrlConfig, run: train.Run, hf_tok, problems: list) -> list:
    """TRL's prompts: with template = "chat" the conversation (system prompt, question), which TRL
    renders with the folder's chat template; else our template's text. Either way TRL must tokenise
    them to our prompt ids."""
    chat = cfg.template == "chat"
    prompts = [[{"role": "system", "content": cfg.system_prompt}] * bool(cfg.system_prompt) +
               [{"role": "user", "content": p.prompt}] if chat
               else render_prompt(p.prompt, cfg.template)
               for p in problems]
    for p, prompt in zip(problems[:8], prompts):
        ids = (hf_tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
               if chat else hf_tok(prompt)["input_ids"])
        if ids != run.task.prompt_ids(p):
            raise SystemExit(f"error: transformers' tokenizer of {cfg.init_from} gives {prompt!r} "
                             "other ids than ours")
    return prompts


def trainer_for(cfg: TrlConfig, run: train.Run, folder: str, out_dir: str, max_steps: int,
                n_prompts: int, callback, **over):
    """A GRPOTrainer on the HF copy of `folder`, fed run's RL stream and rewarded by run.task.score
    (or, with reward = "format_only", train.outcome_rewards, the rule train.py trains on)."""
    transformers, trl, Dataset = import_trl()
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    problems = [run.task.problem("rl", k)[1] for k in range(n_prompts)]
    prompts = trl_prompts(dataclasses.replace(cfg, init_from=folder), run, hf_tok, problems)

    def task_score(prompts, completions, completion_ids, pid, **_):
        texts = [run.task.text(ids) for ids in completion_ids]
        return train.outcome_rewards(cfg, texts,
                                     [run.task.score(t, problems[k]) for t, k in zip(texts, pid)])

    return trl.GRPOTrainer(model=model, processing_class=hf_tok, reward_funcs=[task_score],
                           args=grpo_config(trl, cfg, out_dir, max_steps, **over),
                           train_dataset=Dataset.from_list([{"prompt": t, "pid": k}
                                                            for k, t in enumerate(prompts)]),
                           callbacks=[callback] if callback else [])


def step_clock(transformers):
    class StepClock(transformers.TrainerCallback):
        """Seconds per optimizer step; stops training after `minutes` (not counting `after_step`,
        which runs between steps: the evaluations)."""

        def __init__(self, minutes=0.0, after_step=None):
            self.minutes, self.after_step, self.steps, self.paused = minutes, after_step, [], 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.t_start = time.time()

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.steps.append(time.perf_counter() - self.t0)
            if self.after_step:
                t = time.time()
                self.after_step()
                self.paused += time.time() - t
            if 0 < self.minutes < (time.time() - self.t_start - self.paused) / 60:
                control.should_training_stop = True
    return StepClock


def log_eval(run: train.Run, weights: dict, step: int, wall_s: float, out_dir: str,
             paused_s: float = 0.0) -> dict:
    """train.evaluate of TRL's weights (copied into our model: the same names; a tied lm_head is
    embed_tokens), as one line of out_dir/metrics.jsonl in train.py's format, so tools/plot.py draws
    TRL beside our runs."""
    own = run.model.state_dict()
    run.model.load_state_dict({k: v for k, v in weights.items() if k in own}, strict=True)
    rec = {"step": step, "stage": "base" if step == 0 else "rl", **train.evaluate(run, step),
           "time/wall_s": wall_s, "time/train_wall_s": wall_s - paused_s}
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def train_and_evaluate(cfg: TrlConfig) -> dict:
    """Steps 1-2: TRL from init_from for trl_minutes, our held-out evaluation at step 0, every
    eval_every steps and at the end (out_dir/metrics.jsonl), then of the saved final folder
    (eval.json)."""
    if not cfg.init_from:
        raise SystemExit("error: --init_from=DIR "
                         "(a Hugging Face folder, e.g. train.py's step_N/) is required")
    transformers, _, _ = import_trl()
    run = train.build_run(cfg)
    os.makedirs(cfg.out_dir, exist_ok=True)
    open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w").close()
    last = [{}]  # the latest evaluation's record

    def evaluate_now():
        step = len(clock.steps)
        if cfg.eval_every and step % cfg.eval_every == 0:
            last[0] = log_eval(run, trainer.model.state_dict(), step, time.time() - clock.t_start,
                               cfg.out_dir, clock.paused)
    clock = step_clock(transformers)(cfg.trl_minutes, evaluate_now)
    trainer = trainer_for(cfg, run, cfg.init_from, cfg.out_dir, cfg.rl_steps,
                          cfg.rl_steps * cfg.prompts_per_step, clock)
    if cfg.eval_every:  # the base model, as train.py's step 0
        log_eval(run, trainer.model.state_dict(), 0, 0.0, cfg.out_dir)
    t0 = time.time()
    trainer.train()
    seconds = time.time() - t0
    final = os.path.join(cfg.out_dir, "final")
    trainer.save_model(final)
    # the saved folder, loaded by model.py
    ev = last[0] if last[0].get("step") == len(clock.steps) else log_eval(
        run, Transformer.from_pretrained(final, dtype=torch.float32).state_dict(), len(clock.steps),
        seconds, cfg.out_dir, clock.paused)
    out = {"trl_steps": len(clock.steps), "train_seconds": seconds,
           "median_step_s": statistics.median(clock.steps),
           **{k: v for k, v in ev.items() if k.startswith("eval/")}}
    with open(os.path.join(cfg.out_dir, "eval.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nTRL GRPOTrainer: {len(clock.steps)} steps in {seconds / 60:.2f} min "
          f"from {cfg.init_from}; held-out, our evaluation:")
    for k, v in out.items():
        print(f"{k:28s}{v:10.3f}")
    return out


def random_checkpoint(path: str, preset: dict) -> Transformer:
    """A random Qwen2-shaped folder: our character tokenizer padded with filler tokens to a 4,096
    vocabulary; returns the model it saved."""
    tok = build_char_tokenizer(tasks.CHARS)
    tok.add_special_tokens([f"<u{i}>" for i in range(4096 - tok.get_vocab_size())])
    torch.manual_seed(0)
    model = Transformer(ModelConfig(model_type="qwen2", attention_bias=True, vocab_size=4096,
                                    max_seq_len=256, **preset))
    model.save_pretrained(path, tok)
    return model


def bench(cfg: TrlConfig) -> dict:
    """Step 3: TRL's and our whole GRPO step on the same random weights, taking turns."""
    transformers, _, _ = import_trl()
    out = {}
    for size in cfg.bench.split(","):
        if size not in PRESETS and not os.path.isfile(os.path.join(size, "config.json")):
            raise SystemExit(f"error: --bench {size!r} is neither a size ({', '.join(PRESETS)}) "
                             "nor a model folder")
        with tempfile.TemporaryDirectory() as tmp:
            # a real folder: the config's task and template on it
            folder = tmp if size in PRESETS else size
            if size in PRESETS:
                random_checkpoint(tmp, PRESETS[size])
            c = dataclasses.replace(cfg, init_from=folder, prompts_per_step=4, group_size=8,
                                    max_new_tokens=64, beta=0.0, ppo_epochs=1,
                                    dynamic_sampling=False, out_dir=tmp)
            run = train.build_run(c)
            # every row decodes all 64 tokens, as TRL does with min_new_tokens
            run.task.stop_ids = []
            opt, sched = train.make_optimizer(run, c.lr, 1000)
            state, ours = train.TrainState(), []

            def our_step():
                t0 = time.perf_counter()
                train.rl_step(run, opt, sched, state, len(ours))
                ours.append(time.perf_counter() - t0)

            clock = step_clock(transformers)(0.0, our_step)
            n = cfg.bench_steps + 1
            trainer = trainer_for(c, run, folder, os.path.join(tmp, "trl"), n, n * 4, clock,
                                  generation_kwargs={"min_new_tokens": 64}, logging_steps=1000)
            trainer.train()
        params = sum(p.numel() for p in run.model.parameters())
        t_trl, t_ours = statistics.median(clock.steps[1:]), statistics.median(ours[1:])
        out[size] = {"params": params, "ours_s": t_ours, "trl_s": t_trl,
                     "trl_over_ours": t_trl / t_ours}
        print(f"{size}: {params / 1e6:.2f}M params, 4 prompts x 8, 64 new tokens, "
              f"{torch.get_num_threads()} threads, "
              f"median of {cfg.bench_steps} alternating steps: ours {t_ours:.3f} s, "
              f"TRL {t_trl:.3f} s, TRL / ours {t_trl / t_ours:.2f}x", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    args = cli.parse_config(TrlConfig, sys.argv[1:])
    bench(args) if args.bench else train_and_evaluate(args)
