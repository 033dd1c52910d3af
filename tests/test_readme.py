"""Every command in README.md runs as written: each `python X.py ...` / `torchrun ... X.py ...` line's flags are
accepted by that script's parser and its settings pass checks.py; the test command is the one CI runs; and the
first real-checkpoint command runs end to end on a small Qwen-shaped folder at the paths the README names."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import checks
import cli
import memory
from tools import compare_trl
import evaluate
from tools import plot
import star
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"train.py": train.Config, "star.py": star.StarConfig, "evaluate.py": evaluate.EvalConfig,
           "python -m tools.compare_trl": compare_trl.TrlConfig}


def readme_commands() -> list[list[str]]:
    """The argv of every python / torchrun line of README.md's code blocks (continuations joined, comments cut) and
    of every inline `python ...` span."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    lines = [ln for block in re.findall(r"^```\n(.*?)^```", text, re.S | re.M)
             for ln in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`(python [^`]+)`", re.sub(r"^```\n.*?^```", "", text, flags=re.S | re.M).replace("\n", " "))
    return [w for w in (shlex.split(ln, comments=True) for ln in lines) if w and w[0] in ("python", "torchrun")]


def script_args(words: list[str]) -> tuple[str, list[str]]:
    """(script, its arguments) of a command line: torchrun's own options and `python -m` modules dropped."""
    i = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
    return (words[i], words[i + 1:]) if i is not None else (" ".join(words[:3]), words[3:])


def test_every_readme_command_parses_and_passes_the_checks():
    cmds = readme_commands()
    scripts = {script_args(c)[0] for c in cmds}
    assert {"train.py", "star.py", "evaluate.py", "python -m tools.plot", "python -m tools.oracle", "python -m pytest"} <= scripts, scripts
    for words in cmds:
        script, args = script_args(words)
        if script in CONFIGS:
            cfg = cli.parse_config(CONFIGS[script], [os.path.join(ROOT, a) if a.startswith("configs/") else a
                                                     for a in args])
            checks.check_settings(cfg)
        elif script == "python -m tools.plot":
            plot.parser().parse_args(args)
        elif script == "rollout.py":  # its parser lives in main(): each flag is one of its add_argument calls
            source = open(os.path.join(ROOT, script)).read()
            assert all(f'add_argument("{a}"' in source for a in args if a.startswith("--")), words
        elif script == "memory.py":  # the plan runs as written: its table, and the preset fits
            table = memory.main([os.path.join(ROOT, a) if a.startswith("configs/") else a for a in args])
            assert "margin" in table, table
        elif script == "python -m tools.oracle":
            assert args == [], words  # tools/oracle.py takes no arguments
        elif script == "python -m tools.gguf_to_hf":  # the converter: each flag is one of its add_argument calls
            source = open(os.path.join(ROOT, "tools", "gguf_to_hf.py")).read()
            assert args and all(f'add_argument("{a}"' in source for a in args if a.startswith("--")), words
        else:
            assert words == ["python", "-m", "pytest", "-q"], words  # the test command, as .ci/run runs it
    assert "python3 -m pytest -q" in open(os.path.join(ROOT, ".ci", "run")).read()
    for path in re.findall(r"`((?:configs|tests)/[\w./-]+\.\w+)`", open(os.path.join(ROOT, "README.md")).read()):
        assert os.path.exists(os.path.join(ROOT, path)) or "NAME" in path or path == "tests/gpu_check.sh", path


@pytest.mark.slow
def test_the_first_real_checkpoint_command_runs_as_written(tmp_path, hf_folder, gsm8k_file):
    first = next(c for c in readme_commands() if "configs/qwen2.5-0.5b-gsm8k.toml" in c and c[:2] == ["python",
                                                                                             "train.py"])
    shutil.copytree(hf_folder("qwen"), tmp_path / "checkpoints" / "Qwen2.5-0.5B-Instruct")
    os.makedirs(tmp_path / "data" / "gsm8k")
    for name in ("train.jsonl", "test.jsonl"):
        shutil.copy(gsm8k_file, tmp_path / "data" / "gsm8k" / name)
    shutil.copytree(os.path.join(ROOT, "configs"), tmp_path / "configs")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py")] + first[2:] + ["--threads=1"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = next(a.split("=", 1)[1] for a in first if a.startswith("--out_dir="))
    recs = [json.loads(ln) for ln in open(tmp_path / out / "metrics.jsonl")]
    assert [r["step"] for r in recs if "train/loss" in r] == [1, 2] and "config (the fields" in p.stdout


def test_the_step_walk_points_at_the_lines_it_quotes():
    """README's "One DAPO step" walk cites `file.py:N`: `code`; line N of that file holds that code."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    walk = text[text.index("## One DAPO step"):text.index("## Files")]
    refs = re.findall(r"`(\w+\.py):(\d+)`: `([^`]+)`", walk.replace("\n   ", " "))
    assert len(refs) >= 12, refs
    for name, line, code in refs:
        lines = open(os.path.join(ROOT, name), encoding="utf-8").read().splitlines()
        assert code in lines[int(line) - 1], (name, line, code, [i + 1 for i, ln in enumerate(lines)
                                                                 if code in ln])
