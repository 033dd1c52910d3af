"""tasks.Scorer: a scorer outside verify.py (reasoning-gym's score_answer, a user's `scorer`) runs in a worker
process with a per-call time limit; a scorer that sleeps forever, raises, kills its worker or returns a score outside
[0, 1] scores 0 and is counted, the next call is scored by a fresh worker, and a training step with such a scorer
finishes within its limits and reports the failures in metrics.jsonl and on the console."""
import os
import sys
import textwrap
import time

import pytest

import tasks
from cli import UserError
from test_train import ROOT, SMOKE, records, run_cli

SCORERS = textwrap.dedent('''
    import os, time

    def right_if_42(completion, problem):
        return float("42" in completion)

    def sleeps_on_slow(completion, problem):
        if "slow" in completion:
            time.sleep(10 ** 6)
        return 1.0

    def raises_on_bad(completion, problem):
        if "bad" in completion:
            raise ZeroDivisionError("the scorer's own bug")
        return 1.0

    def exits_on_die(completion, problem):
        if "die" in completion:
            os._exit(3)
        return 0.5

    def out_of_range(completion, problem):
        return 2.0

    def sleeps_forever(completion, problem):
        time.sleep(10 ** 6)
''')


@pytest.fixture
def scorers(tmp_path, monkeypatch):
    (tmp_path / "my_scorers.py").write_text(SCORERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_scorers
    yield my_scorers
    sys.modules.pop("my_scorers", None)


def test_a_scorer_that_hangs_raises_or_dies_scores_0_and_is_counted(scorers):
    p = tasks.Problem(prompt="q", gold="42", solution="")
    s = tasks.Scorer(scorers.sleeps_on_slow, timeout=1.0)
    assert s("fast", p) == 1.0  # the worker starts on the first call
    t0 = time.time()
    assert s("slow", p) == 0.0
    assert time.time() - t0 < 5  # the limit (1 s) plus a worker's kill, not the sleep
    assert s("fast again", p) == 1.0  # a fresh worker scores the next call
    assert s.take_failures() == {"scorer_timeouts": 1, "scorer_errors": 0}
    assert s.take_failures() == {"scorer_timeouts": 0, "scorer_errors": 0}  # taken: reset
    s.stop()
    for fn, bad, good in ((scorers.raises_on_bad, "bad", 1.0), (scorers.exits_on_die, "die", 0.5)):
        s = tasks.Scorer(fn, timeout=5.0)
        assert [s(t, p) for t in ("ok", bad, "ok", bad, "ok")] == [good, 0.0, good, 0.0, good]
        assert s.take_failures() == {"scorer_timeouts": 0, "scorer_errors": 2}
        s.stop()
    s = tasks.Scorer(scorers.out_of_range, timeout=5.0)
    assert s("x", p) == 0.0 and s.take_failures()["scorer_errors"] == 1
    s.stop()


def test_a_user_scorer_replaces_the_task_s_and_a_bad_spec_is_one_line(scorers):
    import train
    from model import build_char_tokenizer
    task = tasks.Task(train.Config(scorer="my_scorers:right_if_42"), build_char_tokenizer(tasks.CHARS), [2])
    p = tasks.Problem(prompt="1+1=", gold="2", solution="")
    assert task.outside and task.score("#### 42", p) == 1.0 and task.score("#### 2", p) == 0.0
    task.score.stop()
    for spec in ("my_scorers", "my_scorers:nothing", "no_such_module:f"):
        with pytest.raises(UserError, match="scorer = "):
            tasks.load_scorer(spec)
    assert not tasks.Task(train.Config(), build_char_tokenizer(tasks.CHARS), [2]).outside  # verify.py: in-process


def test_a_training_step_with_a_hanging_scorer_finishes_and_reports_it(tmp_path):
    (tmp_path / "my_scorers.py").write_text(SCORERS)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT])}
    out = tmp_path / "run"
    args = ["--config", SMOKE, "--sft_steps=1", "--rl_steps=1", "--prompts_per_step=2", "--group_size=2",
            "--dynamic_sampling=false", "--eval_every=0", "--eval_n=2", "--eval_k=1", "--ckpt_every=0",
            "--scorer=my_scorers:sleeps_forever", "--scorer_timeout=0.5", f"--out_dir={out}", "--threads=1"]
    t0 = time.time()
    p = run_cli(args, env=env, timeout=240)
    rl = [r for r in records(out) if r["stage"] == "rl" and "train/scorer_timeouts" in r]
    assert rl and rl[0]["train/scorer_timeouts"] == 4 and rl[0]["train/scorer_errors"] == 0
    assert rl[0]["train/accuracy"] == 0.0
    assert "SCORER FAILED: 4 timeouts" in p.stdout
    ev = [r for r in records(out) if "eval/scorer_timeouts" in r]
    assert ev and all(r["eval/scorer_timeouts"] == 4 for r in ev)  # 2 problems x (1 greedy + 1 sampled)
    print(f"{time.time() - t0:.0f} s")
