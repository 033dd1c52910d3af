"""The NaN guard of train.py: a non-finite loss or gradient norm on any rank skips the optimizer
step on every rank, loudly (a logged loss that averages NaN steps away, while the optimizer steps on
them, is what it prevents).

1. rl_step keeps each micro-batch's loss (detached, on the device: no host sync in the loop);
2. train.optimizer_step: one all-reduce of the non-finite count over every rank; the step is skipped
   on every rank when it is not 0 or the (global) gradient norm is not finite;
3. name_bad_rows, after a skipped step: the console names the step, the rank and the rows of each
   non-finite micro-batch;
4. infra.check_weights, after every optimizer step: one all-reduce of the non-finite parameter
   count; a non-finite weight stops the run on every rank before any sampler reads it (the
   sampling copy, the asynchronous samplers' broadcast, or the policy itself);
5. count_bad_steps: main counts consecutive bad steps (train/bad_steps, on bad steps) and stops
   after max_bad_steps with an error; checkpoints are written only after good steps, so the newest
   one on disk is good.

Test: python -m pytest -q tests/test_train.py -k "non_finite or nan_loss"
"""
import math

import torch


def name_bad_rows(step: int, rank: int, epoch: int, losses: list[torch.Tensor], batch):
    """Print which of this rank's micro-batches of a train.Batch had a non-finite loss in this epoch
    (losses[b]: micro-batch b's), with the names of their rows, "problem id/sample"."""
    bad = [b for b, ok in enumerate(torch.isfinite(torch.stack(losses)).tolist()) if not ok] \
        if losses else []
    G = len(batch.groups[0].comps)  # row k·G + i: sample i of group k
    for b in bad:
        rows = ", ".join(f"{batch.groups[r // G].pid}/{r % G}"
                         for r in (batch.rows[i] for i in batch.plan[b]))
        print(f"warning: step {step}, rank {rank}: non-finite loss in micro-batch {b} "
              f"(epoch {epoch}), rows {rows}", flush=True)


def count_bad_steps(bad_steps: int, rec: dict, step: int, max_bad_steps: int, out_dir: str) -> int:
    """The consecutive-bad-step count after this step's record (floats): 0 after a step whose loss
    and gradient norm are finite; else the count + 1, also written into rec as train/bad_steps (only
    bad steps carry the key, so a good step logs what it always did); a RuntimeError once it reaches
    max_bad_steps."""
    if math.isfinite(rec["train/loss"]) and math.isfinite(rec["train/grad_norm"]):
        return 0
    bad_steps = rec["train/bad_steps"] = bad_steps + 1
    print(f"warning: step {step}: non-finite loss or grad norm, update skipped "
          f"({bad_steps} in a row)", flush=True)
    if bad_steps >= max_bad_steps:
        raise RuntimeError(f"{bad_steps} non-finite steps in a row (the last at step {step}); "
                           f"the last good checkpoint is intact in {out_dir}")
    return bad_steps
