"""What a reader follows for one RL step: train.py runs 20 SFT steps and one RL step with a line
tracer switched on only inside the first call of train.rl_step; per project file, the distinct lines
that ran and the functions entered (with their whole length: a reader opens each one it meets).
model.py, verify.py and exact.py are counted apart (the model and the verifier are read on their
own).

  python -m tools.step_lines                                # the default run (the CPU demo's DAPO)
  python -m tools.step_lines --config configs/grpo.toml     # any train.py setting passes through
"""
import inspect
import os
import sys
import tempfile
from collections import defaultdict

import torch

import train
from config import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APART = {"model.py", "verify.py", "exact.py"}


def main(argv: list[str]) -> tuple[int, int, int, int]:
    """-> (files, lines run, functions entered, their length) outside APART; prints a table."""
    files = {os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
    lines, funcs = defaultdict(set), {}  # file -> line numbers; (file, first line, name) -> length

    def tracer(frame, event, arg):
        code = frame.f_code
        if code.co_filename not in files:
            return None
        if event == "call" and not code.co_name.startswith("<"):  # a comprehension: its function's
            key = (code.co_filename, code.co_firstlineno, code.co_qualname)
            funcs.setdefault(key, len(inspect.getsourcelines(code)[0]))
        elif event == "line":
            lines[code.co_filename].add(frame.f_lineno)
        return tracer

    step, traced = train.rl_step, []

    def rl_step(*a, **kw):  # the first call only
        if traced:
            return step(*a, **kw)
        traced.append(True)
        sys.settrace(tracer)
        try:
            return step(*a, **kw)
        finally:
            sys.settrace(None)
    torch.set_num_threads(1)
    cfg = parse_args(["--sft_steps=20", "--rl_steps=1", "--eval_every=0", "--eval_n=8",
                      "--threads=1", f"--out_dir={tempfile.mkdtemp()}", "--wandb_mode=disabled",
                      "--ckpt_every=0"] + argv)
    train.rl_step = rl_step
    try:
        train.main(cfg)
    finally:
        train.rl_step = step
    rows = defaultdict(lambda: [0, 0, 0])
    for (f, _, _), n in funcs.items():
        rows[f][1], rows[f][2] = rows[f][1] + 1, rows[f][2] + n
    for f, s in lines.items():
        rows[f][0] = len(s)
    print(f"{'file':14}{'lines run':>10}{'functions':>10}{'their lines':>12}")
    total = [0, 0, 0, 0]
    for f, (n_lines, n_funcs, span) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        name = os.path.basename(f)
        apart = "  (apart)" if name in APART else ""
        print(f"{name:14}{n_lines:10d}{n_funcs:10d}{span:12d}{apart}")
        if name not in APART:
            total = [total[0] + 1, total[1] + n_lines, total[2] + n_funcs, total[3] + span]
    print(f"one RL step ({' '.join(argv) or 'defaults'}), outside {', '.join(sorted(APART))}: "
          f"{total[0]} files, {total[1]} lines run, {total[2]} functions entered spanning "
          f"{total[3]} lines")
    return tuple(total)


if __name__ == "__main__":
    main(sys.argv[1:])
