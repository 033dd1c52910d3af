"""tools/plot.py's data reading (the numbers a plot shows, against hand-computed ones); the drawing needs matplotlib."""
import json
import os
import sys

import pytest

from tools import plot


def write_run(path, records):
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def demo(tmp_path, seed, greedy, rewards):
    recs = [{"step": 0, "stage": "base", "eval/pass@1": 0.0, "eval/pass@1_sampled": 0.0}]
    recs += [{"step": s, "stage": "sft", "train/loss": 1.0} for s in (1, 2)]
    recs.append({"step": 2, "stage": "sft", "eval/pass@1": greedy[0], "eval/pass@1_sampled": greedy[0] / 2})
    recs += [{"step": 2 + i, "stage": "rl", "train/reward": r, "train/kept_groups_frac": 1 - r}
             for i, r in enumerate(rewards, 1)]
    recs.append({"step": 2 + len(rewards), "stage": "rl", "eval/pass@1": greedy[1], "eval/pass@1_sampled": 0.5})
    return write_run(tmp_path / f"demo_s{seed}", recs)


def test_curves_group_seeds_and_give_mean_and_range(tmp_path):
    runs = [demo(tmp_path, 0, (0.4, 0.8), [0.2, 0.4, 0.6]), demo(tmp_path, 1, (0.6, 1.0), [0.4, 0.6])]
    sft = write_run(tmp_path / "control_sft_s0", [{"step": 0, "stage": "base", "eval/pass@1": 0.0},
                                                  {"step": 3, "stage": "sft", "train/loss": 1.0},
                                                  {"step": 3, "stage": "sft", "eval/pass@1": 0.7}])
    assert [plot.group_name(p) for p in runs + [sft, sft + "/metrics.jsonl"]] == ["demo", "demo", "control_sft",
                                                                            "control_sft"]
    assert plot.curve(plot.read_run(runs[0]), "eval/pass@1", "eval") == {0: 0.0, 2: 0.4, 5: 0.8}
    assert plot.curve(plot.read_run(runs[0]), "train/reward", "train") == {1: 0.2, 2: 0.4, 3: 0.6}  # RL steps
    ev = plot.collect(runs + [sft], "eval")
    assert list(ev) == ["demo", "control_sft"] and ev["demo"]["seeds"] == 2
    # seed 1 ran 2 RL steps, seed 0 three: only the steps both evaluated are averaged
    assert ev["demo"]["eval/pass@1"] == ([0, 2], [0.0, 0.5], [0.0, 0.4], [0.0, 0.6])
    assert ev["control_sft"]["eval/pass@1"] == ([0, 3], [0.0, 0.7], [0.0, 0.7], [0.0, 0.7])
    assert ev["control_sft"]["eval/pass@1_sampled"] == ([], [], [], [])  # a key it never logged: no curve
    tr = plot.collect(runs + [sft], "train")
    assert list(tr) == ["demo"]  # an SFT-only run has no RL curve
    xs, mean, lo, hi = tr["demo"]["train/reward"]
    assert xs == [1, 2] and mean == pytest.approx([0.3, 0.5]) and lo == [0.2, 0.4] and hi == [0.4, 0.6]
    assert tr["demo"]["train/kept_groups_frac"][1] == pytest.approx([0.7, 0.5])
    assert "demo               train/reward             step     2: mean 0.500 (min 0.400, max 0.600; 2 seeds)" \
        in plot.table(tr, "train")
    with pytest.raises(SystemExit, match="no such file"):
        plot.read_run(str(tmp_path / "nope"))


def test_pass_at_k_curves_are_the_last_evaluations_by_k(tmp_path):
    """--kind passk: {k: eval/pass@k_sampled} of each run's last evaluation, mean and range over seeds."""
    def run(seed, last):
        recs = [{"step": 0, "stage": "base", "eval/pass@1": 0.0, "eval/pass@1_sampled": 0.1, "eval/pass@2_sampled": 0.2,
                 "eval/pass@4_sampled": 0.3},
                {"step": 5, "stage": "rl", "eval/pass@1": 0.5, "eval/pass@1_sampled": last[0],
                 "eval/pass@2_sampled": last[1], "eval/pass@4_sampled": last[2]}]
        return write_run(tmp_path / f"rl_s{seed}", recs)
    runs = [run(0, (0.4, 0.6, 0.7)), run(1, (0.6, 0.8, 0.9))]
    assert plot.curve(plot.read_run(runs[0]), "pass@k", "passk") == {1: 0.4, 2: 0.6, 4: 0.7}
    xs, mean, lo, hi = plot.collect(runs, "passk")["rl"]["pass@k"]
    assert xs == [1, 2, 4] and mean == pytest.approx([0.5, 0.7, 0.8]) and lo == [0.4, 0.6, 0.7]
    assert "rl                 pass@k                   k        4: mean 0.800" in plot.table(
        plot.collect(runs, "passk"), "passk")
    pytest.importorskip("matplotlib")
    out = tmp_path / "passk.png"
    plot.draw(plot.collect(runs, "passk"), "passk", str(out), "pass@k")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_matplotlib_is_one_clear_line(tmp_path, monkeypatch):
    data = plot.collect([demo(tmp_path, 0, (0.4, 0.8), [0.2])], "eval")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit, match="matplotlib, which is not installed: pip install matplotlib"):
        plot.draw(data, "eval", str(tmp_path / "x.png"), "")


def test_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [demo(tmp_path, s, (0.4, 0.8), [0.2, 0.4]) for s in (0, 1)]
    for kind in ("eval", "train"):
        out = tmp_path / kind / "plot.png"
        plot.draw(plot.collect(runs, kind), kind, str(out), "a title")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_wall_clock_axis_puts_each_step_at_its_mean_minute(tmp_path):
    def run(seed, secs):
        recs = [{"step": 0, "stage": "base", "eval/pass@1": 0.1, "eval/pass@1_sampled": 0.1, "time/wall_s": 9.0}]
        recs += [{"step": s, "stage": "rl", "train/reward": 0.5 + seed / 10, "train/kept_groups_frac": 1.0,
                  "time/wall_s": t} for s, t in zip((1, 2), secs)]
        recs.append({"step": 2, "stage": "rl", "eval/pass@1": 0.3 + seed / 10, "eval/pass@1_sampled": 0.2,
                     "time/wall_s": secs[1] + 30})  # the evaluation after step 2 ends 30 s later
        return write_run(tmp_path / f"w_s{seed}", recs)
    runs = [run(0, (60, 120)), run(1, (120, 240))]
    xs, mean, lo, hi = plot.collect(runs, "eval", "wall")["w"]["eval/pass@1"]
    assert xs == pytest.approx([0.0, (150 + 270) / 2 / 60]) and mean == pytest.approx([0.1, 0.35])
    xs, mean, _, _ = plot.collect(runs, "train", "wall")["w"]["train/reward"]
    assert xs == pytest.approx([1.5, 3.0]) and mean == pytest.approx([0.55, 0.55])
    assert "w                  eval/pass@1                 3.5 min: mean 0.350" in \
        plot.table(plot.collect(runs, "eval", "wall"), "eval")
    assert plot.collect(runs, "eval")["w"]["eval/pass@1"][0] == [0, 2]  # the step axis is unchanged
    old = write_run(tmp_path / "old_s0", [{"step": 0, "stage": "base", "eval/pass@1": 0.1},
                                          {"step": 5, "stage": "rl", "eval/pass@1": 0.2}])  # no time/wall_s
    with pytest.raises(SystemExit, match="--x wall needs time/wall_s"):
        plot.collect([old], "eval", "wall")


def test_the_training_clock_leaves_the_evaluations_out(tmp_path):
    """--x train reads time/train_wall_s: an RL run that evaluates for 100 s after step 1 and an RFT-like run that
    evaluates less often put the same training minute at the same x, whatever their evaluations cost."""
    rl = write_run(tmp_path / "rl_s0", [
        {"step": 0, "stage": "base", "eval/pass@1": 0.1, "eval/pass@1_sampled": 0.1, "time/wall_s": 0.0,
         "time/train_wall_s": 0.0},
        {"step": 1, "stage": "rl", "eval/pass@1": 0.2, "eval/pass@1_sampled": 0.2, "time/wall_s": 160.0,
         "time/train_wall_s": 60.0},
        {"step": 2, "stage": "rl", "eval/pass@1": 0.3, "eval/pass@1_sampled": 0.3, "time/wall_s": 320.0,
         "time/train_wall_s": 120.0}])
    xs, mean, _, _ = plot.collect([rl], "eval", "train")["rl"]["eval/pass@1"]
    assert xs == pytest.approx([0.0, 1.0, 2.0]) and mean == pytest.approx([0.1, 0.2, 0.3])
    assert plot.collect([rl], "eval", "wall")["rl"]["eval/pass@1"][0] == pytest.approx([0.0, 160 / 60, 320 / 60])
    old = write_run(tmp_path / "old_s0", [{"step": 0, "stage": "base", "eval/pass@1": 0.1, "time/wall_s": 0.0},
                                          {"step": 5, "stage": "rl", "eval/pass@1": 0.2, "time/wall_s": 9.0}])
    with pytest.raises(SystemExit, match="--x train needs time/train_wall_s"):
        plot.collect([old], "eval", "train")
