"""Learning curves from run directories' metrics.jsonl (train.py's log), as one PNG \
(pip install matplotlib).

  1. Each RUN_DIR's metrics.jsonl is read (read_run); runs are grouped by their folder's name
     without a seed suffix (runs/demo_s0, runs/demo_s1 -> "demo"), one group per line of the plot.
  2. --kind eval: held-out greedy and sampled pass@1 (eval/pass@1, eval/pass@1_sampled) against the
     training step (SFT steps, then RL steps), the mean over a group's seeds with their range (min
     to max) shaded, at the steps every seed evaluated (band).
     --kind passk: pass@k against k (1, 2, 4, ... eval_k) at each run's last evaluation, so base,
     RL and RFT runs compare on one figure (Yue et al. 2025's question: more tries, more solved?);
     --kind train: train/reward and the keep rate (train/kept_groups_frac) per RL step, mean and
     range over seeds; --kind tools: the share of completions that call a tool and the accuracy
     (train/tool_call_rate, /accuracy).
  3. --x wall: the x-axis is wall-clock minutes (time/wall_s: since the first training step,
     evaluations included; 0 at the base evaluation), each point at the mean over seeds of the
     minute its step was reached, so runs of different step costs (SFT vs RL, ours vs TRL:
     tools/compare_trl.py writes the same metrics.jsonl) compare at equal compute. --x train: the
     same without the evaluations (time/train_wall_s, the clock rl_minutes counts), so runs that
     evaluate at different rates (RL every 10 steps, RFT every iteration) compare at equal training
     time.
  4. A table of the last shared point of each curve (mean, min, max, seeds) is printed too.

  python -m tools.plot runs/demo_s0 runs/control_sft_s0 runs/control_filtered_s0 \\
      --out plots/demo_eval.png
  python -m tools.plot runs/demo_s* --kind train --out plots/demo_train.png
  python -m tools.plot runs/smollm2-rg_s* runs/smollm2-rg-trl_s* --x wall \\
      --out plots/smollm2_eval.png
"""
import argparse
import json
import os
import re

NAMES = {"demo": "SFT + RL (the demo)", "control_sft": "SFT only (configs/control_sft.toml)",
         "control_filtered": "answer-filtered SFT (configs/control_filtered.toml)",
         **{f"smollm2-mix-{arm}-seed{s}": f"{name}, seed {s}" for s in range(3)
            for arm, name in (("dapo", "DAPO"), ("rft", "RFT"))},
         "base": "the base model", "dapo": "DAPO", "rft": "RFT",
         "r1s3": "RFT of the base on DAPO's samples (R1's stage 3)"}
CLOCKS = {"wall": ("time/wall_s", "wall-clock minutes (evaluations included)"),
          "train": ("time/train_wall_s", "training minutes (wall-clock, evaluations excluded)")}
PANELS = {"eval": [("eval/pass@1", "held-out greedy pass@1"),
                   ("eval/pass@1_sampled", "held-out sampled pass@1 (the run's T)")],
          "train": [("train/reward", "train reward (mean over the step's samples)"),
                    ("train/kept_groups_frac", "dynamic sampling: share of groups kept")],
          "tools": [("train/tool_call_rate", "share of completions that call the tool (train)"),
                    ("train/accuracy", "train accuracy (the verifier)")],
          "passk": [("pass@k", "held-out pass@k, last evaluation (unbiased)")]}


def read_run(path: str) -> list[dict]:
    """The records of path/metrics.jsonl (or of path itself, a .jsonl file), in order."""
    fname = path if path.endswith(".jsonl") else os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(fname):
        raise SystemExit(f"error: {fname}: no such file (a run directory holds metrics.jsonl)")
    with open(fname, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def group_name(path: str) -> str:
    """runs/demo_s2 -> "demo"; runs/demo_s2/metrics.jsonl -> "demo"."""
    base = os.path.basename(os.path.dirname(path) if path.endswith(".jsonl")
                            else os.path.normpath(path))
    return re.sub(r"_s(eed)?\d+$", "", base)


def curve(records: list[dict], key: str, kind: str) -> dict[int, float]:
    """{x: value} of one run: eval keys by training step, train keys by RL step (1, 2, ... from the
    first RL step); passk: {k: eval/pass@k_sampled} of the run's last evaluation."""
    if kind == "passk":
        last = [r for r in records if "eval/pass@1_sampled" in r][-1:]
        return {int(k[len("eval/pass@"):-len("_sampled")]): float(v) for r in last
                for k, v in r.items() if re.fullmatch(r"eval/pass@\d+_sampled", k)}
    rows = [r for r in records if key in r and (kind == "eval" or r.get("stage") == "rl")]
    first = min((r["step"] for r in rows), default=1)
    return {r["step"] - (first - 1 if kind == "train" else 0): float(r[key]) for r in rows}


def band(curves: list[dict[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(x, mean, min, max) over the curves at the x every curve has."""
    xs = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    vals = [[c[x] for c in curves] for x in xs]
    return xs, [sum(v) / len(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def on_the_clock(runs: list[list[dict]], kind: str, b: tuple, clock: str = "wall") -> tuple:
    """A band with its x (steps) replaced by the mean over runs of the minute each step was reached
    on `clock` (CLOCKS)."""
    key = CLOCKS[clock][0]
    clocks = [{**curve([x for x in r if any(k.startswith("eval/") for k in x) == (kind == "eval")],
                       key, kind),
               **({0: 0.0} if kind == "eval" else {})}  # an eval's own record; base 0
              for r in runs]
    if any(x not in c for c in clocks for x in b[0]):
        raise SystemExit(f"error: --x {clock} needs {key} in every record "
                         "(train.py logs both clocks; older runs may lack time/train_wall_s)")
    return ([sum(c[x] for c in clocks) / len(clocks) / 60 for x in b[0]], *b[1:])


def collect(paths: list[str], kind: str, x: str = "step") -> dict[str, dict[str, tuple]]:
    """{group: {key: band}} for the panels of `kind` (x: steps, or minutes on a clock of CLOCKS),
    groups in the order of their first run on the command line."""
    groups: dict[str, list[list[dict]]] = {}
    for p in paths:
        groups.setdefault(group_name(p), []).append(read_run(p))
    out = {}
    for name, runs in groups.items():
        bands = {key: band([curve(r, key, kind) for r in runs]) for key, _ in PANELS[kind]}
        bands = {k: on_the_clock(runs, kind, b, x) for k, b in bands.items()} if x != "step" \
            else bands
        if any(b[0] for b in bands.values()):  # an SFT-only run has no train curve
            out[name] = {**bands, "seeds": len(runs)}
    return out


def table(data: dict, kind: str) -> str:
    lines = []
    for name, bands in data.items():
        for key, _ in PANELS[kind]:
            xs, mean, lo, hi = bands[key]
            if xs:
                at = (f"k {xs[-1]:8d}" if kind == "passk" else f"step {xs[-1]:5d}"
                      if isinstance(xs[-1], int) else f"{xs[-1]:6.1f} min")
                lines.append(f"{name:18s} {key:24s} {at}: mean {mean[-1]:.3f} "
                             f"(min {lo[-1]:.3f}, max {hi[-1]:.3f}; "
                             f"{bands['seeds']} seed{'s' * (bands['seeds'] > 1)})")
    return "\n".join(lines)


def draw(data: dict, kind: str, out: str, title: str, x: str = "step"):
    try:
        import matplotlib
    except ImportError:
        msg = ("error: tools/plot.py draws with matplotlib, which is not installed: "
               "pip install matplotlib")
        raise SystemExit(msg) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(PANELS[kind]), figsize=(6.2 * len(PANELS[kind]), 4.2),
                             squeeze=False)
    axes = axes[0]
    for ax, (key, label) in zip(axes, PANELS[kind]):
        for i, (name, bands) in enumerate(data.items()):
            xs, mean, lo, hi = bands[key]
            n = bands["seeds"]
            tag = (f"{NAMES.get(name, name)}, {n} seed{'s' * (n > 1)}"
                   + (": mean, range" if n > 1 else ""))
            marker = "o" if kind in ("eval", "passk") else None
            line, = ax.plot(xs, mean, marker=marker, ms=3, lw=1.6,
                            color=f"C{i}", label=tag)
            if n > 1:
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
        if kind == "eval" and "demo" in data and data["demo"][key][0] and x == "step":
            ax.axvline(800, color="grey", ls=":", lw=1)
            ax.annotate("demo: SFT | RL", (800, 0.03), xytext=(0, 0), textcoords="offset points",
                        fontsize=8, color="grey", ha="center")
        ax.set_xlabel(CLOCKS[x][1] if x != "step" else
                      "training step (SFT, then RL)" if kind == "eval" else
                      "k (samples per problem)" if kind == "passk" else "RL step")
        if kind == "passk":
            ax.set_xscale("log", base=2)
        ax.set_ylabel(label)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+",
                    help="run directories (each with a metrics.jsonl) or metrics.jsonl files")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--kind", choices=sorted(PANELS), default="eval")
    ap.add_argument("--title", default="", help="a line above the panels")
    ap.add_argument("--x", choices=["step", *CLOCKS], default="step",
                    help="the x-axis: training step, wall-clock minutes or training minutes")
    return ap


if __name__ == "__main__":
    args = parser().parse_args()
    if args.kind == "passk" and args.x != "step":
        raise SystemExit(f"error: --kind passk is against k, not the clock: drop --x {args.x}")
    data = collect(args.runs, args.kind, args.x)
    if not data:
        raise SystemExit("error: none of the runs logged "
                         f"{' or '.join(k for k, _ in PANELS[args.kind])}")
    print(table(data, args.kind))
    draw(data, args.kind, args.out, args.title, args.x)
