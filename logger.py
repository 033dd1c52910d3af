"""What a run prints and writes: rank 0's console line with an ETA, metrics.jsonl (one flat JSON
object per line, the lines after the last checkpoint dropped on resume, so a resumed file is exact),
W&B, and the held-out table at the end. The other ranks' calls do nothing.

  logger = Logger(proc, out_dir, config_dict, wandb_mode, wandb_project, first_step, total_steps)
  logger.log(step, "rl", {"train/loss": 0.1});  logger.finish(results)

Where a step's time goes: train.rl_step marks the end of each phase, (phase, clock()) in Run.laps;
phase_seconds turns the marks into time/<phase>_s, each the seconds since the mark before it.
"""
import json
import os
import time
from collections import Counter

import torch

CONSOLE = [c.split() for c in (  # metric, console name, format
    "train/loss loss .4f, train/reward reward .3f, train/accuracy acc .3f, "
    "train/completion_len len .1f, train/kl kl .4f, train/clip_low clip_lo .3f, "
    "train/clip_high clip_hi .3f, train/entropy ent .3f, "
    "train/grad_norm gnorm .2f, train/kept_groups_frac kept .2f, train/skip_rate skip .2f, "
    "train/logprob_gap_max lp_gap .1e, train/staleness stale .0f, train/mismatch_kl mis_kl .1e, "
    "time/rollout_s roll_s .1f, time/sample_s sample_s .1f, time/reward_s reward_s .1f, "
    "time/train_s train_s .1f, time/forward_s fwd_s .1f, time/backward_s bwd_s .1f, "
    "time/optimizer_s opt_s .1f, time/sample_tok_per_s tok/s .0f, "
    "time/trainer_wait_s t_wait .1f, time/sampler_wait_s s_wait .1f").split(", ")]

LAPS = 4096  # the phase marks a Run keeps (a deque): 2 a micro-batch, 2 or 3 a sampling try


def phase_clock(device: torch.device):
    """A step's phase timer (Run.clock): time.perf_counter on CPU; on CUDA an event recorded on the
    stream, no host sync, so that a phase is charged the device time it queued."""
    if device.type != "cuda":
        return time.perf_counter

    def event() -> torch.cuda.Event:
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark
    return event


def phase_seconds(laps) -> dict:
    """(phase, its end) marks, the first the start -> {"time/<phase>_s": seconds since the mark
    before}, a phase's laps summed (micro-batches, sampling tries); CUDA: one wait, for the last."""
    marks = list(laps)
    cuda = isinstance(marks[-1][1], torch.cuda.Event)
    if cuda:
        marks[-1][1].synchronize()
    seconds = Counter()
    for (_, start), (phase, end) in zip(marks, marks[1:]):
        seconds[f"time/{phase}_s"] += start.elapsed_time(end) / 1000 if cuda else end - start
    return dict(seconds)


class Logger:
    """Rank 0 writes metrics.jsonl, the console and W&B; the other ranks' calls do nothing. A
    resumed run first drops the lines a killed run logged after its last checkpoint, so the resumed
    metrics.jsonl is exact."""

    def __init__(self, proc, out_dir: str, config: dict, wandb_mode: str, wandb_project: str,
                 first_step: int, total_steps: int):  # proc: infra.Proc
        self.rank, self.first_step, self.total_steps, self.t0, self.wandb = (
            proc.rank, first_step, total_steps, 0, None)
        self.deadline = None  # the RL stage's end on the training clock (rl_minutes), for the ETA
        self.evals_s = 0.0  # seconds of evaluation since t0 (train.evaluate adds them)
        if self.rank != 0:
            return
        os.makedirs(out_dir, exist_ok=True)
        path, self.t0 = os.path.join(out_dir, "metrics.jsonl"), time.time()
        lines = open(path).readlines() if os.path.exists(path) else []
        with open(path + ".tmp", "w") as f:
            f.writelines(ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= first_step)
        os.replace(path + ".tmp", path)
        self.file = open(path, "a")
        # auto: W&B's own WANDB_MODE decides when set (CI sets disabled), else online with stored
        # credentials
        mode = (os.environ.get("WANDB_MODE") or "auto") if wandb_mode == "auto" else wandb_mode
        if mode != "disabled":
            import wandb
            self.wandb = wandb
            mode = mode if mode != "auto" else "online" if wandb.login(prompt=False) else "offline"
            wandb.init(project=wandb_project, dir=out_dir, mode=mode, config=config,
                       name=os.path.basename(os.path.abspath(out_dir)))

    def train_clock(self) -> float:
        """The wall clock, stopped while evaluations run: what rl_minutes and time/train_wall_s
        count."""
        return time.time() - self.evals_s

    def log(self, step: int, stage: str, rec: dict):
        """One metrics.jsonl line; an eval record prints as an EVAL line, a training record as a
        console line."""
        rec = {"step": step, "stage": stage, **{k: float(v) for k, v in rec.items()},
               # since the first training step (for equal-time curves), and without evaluations
               "time/wall_s": time.time() - self.t0,
               "time/train_wall_s": self.train_clock() - self.t0}
        if self.rank != 0:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log(rec, step=step)
        if any(k.startswith("eval/") for k in rec):
            return print(f"step {step:5d} {stage:3s} | EVAL " + " ".join(
                f"{k[5:]} {v:.3f}" for k, v in rec.items()
                if k.startswith("eval/") and "_L" not in k), flush=True)
        eta = (time.time() - self.t0) / max(1, step - self.first_step) * (self.total_steps - step)
        if self.deadline is not None and stage != "sft":  # rl_minutes ends the run sooner
            eta = max(0.0, min(eta, self.deadline - self.train_clock()))
        cols = " ".join(f"{name} {rec[k]:{fmt}}" for k, name, fmt in CONSOLE if k in rec)
        # an outside scorer's failures, loudly: each scored 0 (tasks.Scorer)
        failed = ", ".join(f"{v:.0f} {k.split('_')[-1]}" for k, v in rec.items()
                           if k.startswith("train/scorer_") and v)
        cols += f" | SCORER FAILED: {failed}" if failed else ""
        print(f"step {step:5d} {stage:3s} | {cols} | eta {eta / 60:.1f} min", flush=True)

    def samples(self, step: int, rows: list[tuple]):
        """Eval samples (prompt, completion, gold, correct): three on the console, sixteen in a W&B
        table."""
        for prompt, completion, gold, _ in rows[:3] if self.rank == 0 else []:
            print(f"  [eval sample] {prompt!r} -> {completion!r} (gold {gold})")
        if self.wandb:
            cols = ["step", "prompt", "completion", "gold", "correct"]
            self.wandb.log({"eval/samples": self.wandb.Table(
                cols, [[step, *r] for r in rows[:16]])}, step=step)

    def finish(self, results: dict) -> dict:
        """The held-out table, one column per stage; closes the files."""
        if self.rank != 0:
            return results
        keys = sorted({k for r in results.values() for k in r if k != "eval/maj@k"})
        print("\nheld-out results\n" + f"{'metric':28s}" + "".join(f"{s:>10s}" for s in results)
              if keys else "")
        for k in keys:
            print(f"{k[5:]:28s}"
                  + "".join(f"{r.get(k, float('nan')):10.3f}" for r in results.values()))
        self.file.close()
        if self.wandb:
            self.wandb.finish()
        return results
