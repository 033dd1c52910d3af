"""DAPO's refill policies replayed on a run's own keep rates: for each RL step of a metrics.jsonl,
its kept fraction of groups p (train/kept_groups_frac) is taken as every group's chance to be kept,
and each policy draws tries of n prompts (kept ~ Binomial(n, p)) until P are kept or the tries run
out, sizing each try from the keep rate r it has seen (the last step's at first):
  old       the first try P, a refill ceil(missing / r)                     (before issue 50)
  p_over_r  every try ceil(missing / r)
  1sigma    every try ceil((missing + sqrt(missing·(1 − r))) / r)
  2sigma    every try ceil((missing + 2·sqrt(missing·(1 − r))) / r)    (train.dynamic_sampling)
r floored at 1/4, a try at most 4·P. It prints tries per step, the share of one-try steps, prompts
drawn per step and the share of steps that end short of P; one policy's replay does not change the
keep rates, so each is compared on the same run.

  python -m tools.refill_sim runs/demo/metrics.jsonl --prompts 16 --tries 4 --replays 200
"""
import argparse
import json
import math
import random

POLICIES = {
    "old": lambda missing, r, first, P: P if first else math.ceil(missing / r),
    "p_over_r": lambda missing, r, first, P: math.ceil(missing / r),
    "1sigma": lambda missing, r, first, P: math.ceil((missing + math.sqrt(missing * (1 - r))) / r),
    "2sigma": lambda missing, r, first, P: math.ceil(
        (missing + 2 * math.sqrt(missing * (1 - r))) / r),
}


def replay(rates: list[float], policy: str, P: int, tries: int, rng: random.Random) -> dict:
    """One pass over the run's steps -> sums of tries, one-try steps, prompts drawn, short steps."""
    out, last = {"tries": 0, "one_try": 0, "drawn": 0, "short": 0}, 1.0
    for p in rates:
        kept = seen = 0
        missing, r = P, last
        for t in range(tries):
            n = min(4 * P, POLICIES[policy](missing, max(r, 0.25), t == 0, P))
            kept += sum(rng.random() < p for _ in range(n))
            seen += n
            r, missing = kept / seen, P - kept
            if missing <= 0:
                break
        last = r
        out = {"tries": out["tries"] + t + 1, "one_try": out["one_try"] + (t == 0),
               "drawn": out["drawn"] + seen, "short": out["short"] + (missing > 0)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("metrics")
    ap.add_argument("--prompts", type=int, default=16, help="P, prompts_per_step")
    ap.add_argument("--tries", type=int, default=4, help="max_sample_tries")
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    with open(args.metrics) as f:
        rows = [json.loads(line) for line in f]
    rates = [r["train/kept_groups_frac"] for r in rows if "train/kept_groups_frac" in r]
    print(f"{len(rates)} RL steps, mean keep rate {sum(rates) / max(len(rates), 1):.3f}, "
          f"P = {args.prompts}, {args.tries} tries, {args.replays} replays")
    rng = random.Random(0)
    for policy in POLICIES:
        total = {"tries": 0, "one_try": 0, "drawn": 0, "short": 0}
        for _ in range(args.replays):
            total = {k: total[k] + v for k, v in replay(rates, policy, args.prompts, args.tries,
                                                        rng).items()}
        steps = len(rates) * args.replays
        print(f"{policy:>9}: tries/step {total['tries'] / steps:.2f}, one-try steps "
              f"{total['one_try'] / steps:.2f}, prompts drawn/step {total['drawn'] / steps:.1f}, "
              f"steps short of P {total['short'] / steps:.3f}")


if __name__ == "__main__":
    main()
