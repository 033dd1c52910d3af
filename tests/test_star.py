"""star.py: hint format, the verifier filter (dedup, cap, format), rationalisation with controlled outcomes, the
hint never reaching a training example, seeded batches, and an end-to-end STaR / RFT run on a micro model."""
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from safetensors.torch import load_file

from conftest import records
from test_distill import hashes_then

import checks
import star
import tasks
import train
from cli import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke.toml")
# the micro model on one-operation sums of 0..3: after 60 steps it solves some and fails some (on seeds 0-4, each
# STaR run both kept solutions and rescued failures), so both halves of an expert iteration are exercised
MICRO = ["--config", SMOKE, "--threads=1", "--sft_steps=60", "--sft_lr=2e-2", "--max_operand=3", "--sft_max_ops=1",
         "--sft_min_ops=1", "--rl_min_ops=1", "--eval_min_ops=1", "--sft_direct_frac=0", "--sft_flaw_frac=0",
         "--ops=+-*", "--rl_max_ops=1", "--eval_max_ops=1", "--train_size=8", "--expert_iters=2", "--expert_samples=8",
         "--expert_sft_steps=2", "--eval_n=8", "--eval_k=2", "--hint_sft_frac=0.5"]


def parse(args):
    return train.parse_args(args, star.StarConfig)


def trainer(tmp_path, *args):
    return train.build_run(parse(["--config", SMOKE, f"--out_dir={tmp_path}", "--train_size=4", "--sft_direct_frac=0",
                                  "--sft_flaw_frac=0", "--expert_samples=4", "--prompts_per_step=4", *args]))


def group(texts, correct, truncated=None):
    n = len(texts)
    return train.Group(0, 0, None, [], [], texts, [], truncated or [False] * n, correct)


def test_hint_prompt_formats():
    p = tasks.arithmetic(0, 0)
    h = star.hint_prompt(p, "arithmetic")
    assert h == f"#{p.gold}#{p.prompt}" and set(h) <= set(tasks.CHARS)
    q = tasks.Problem(prompt="Tom has 3 apples. How many?", gold="42", solution="")
    assert star.hint_prompt(q, "gsm8k") == "Tom has 3 apples. How many?\nThe answer is 42. Explain why."
    with pytest.raises(ValueError, match="countdown"):
        star.hint_prompt(tasks.countdown(0, 0), "countdown")


def test_keep_is_verified_finished_deduplicated_and_capped():
    g = group(["a#### 3", "a#### 3", "b#### 3", "c#### 4", "d#### 3", "e#### 3"], [1, 1, 1, 0, 1, 1],
              [False, False, False, False, True, False])
    assert star.keep(g, "plain", 0) == [0, 2, 5]  # 1 duplicates 0, 3 is wrong, 4 never finished
    assert star.keep(g, "plain", 2) == [0, 2]
    assert star.keep(g, "plain", 0, filtered=False) == [0, 1, 2, 3, 4, 5]  # expert_filter = false: every sample
    assert star.keep(g, "plain", 2, filtered=False) == [0, 1]
    ok, bad = "<think> 1+2=3 </think> <answer> 3 </answer>", "<answer> 3 </answer>"
    g = group([ok, bad, ok + " ", "<think> x </think> <answer> 4 </answer>"], [1, 1, 1, 0])
    assert star.keep(g, "r1", 0) == [0, 2] and star.keep(g, "plain", 0) == [0, 1, 2]


def enc(tr, text):  # a completion as the sampler returns it: its ids and the stop token
    return tr.task.tok.encode(text, add_special_tokens=False).ids + tr.task.stop_ids[:1]


def fake_rollouts(tr, outcomes, calls, monkeypatch):
    """train.sample_groups with outcomes(problem position, hinted, problem) -> [(text, truncated)], scored by the
    task."""
    pool = [tr.task.problem("rl", i)[1].prompt for i in range(tr.cfg.train_size)]

    def sample_groups(run, problems, G, temperature, keys, first=0, model=None):
        assert model is None  # no teacher: the policy samples
        calls.append([p.prompt for _, p in problems])
        out = []
        for j, (pid, p) in enumerate(problems):
            hinted = p.prompt.startswith("#")
            res = outcomes(pool.index(p.prompt.split("#")[-1]), hinted, p)
            assert len(res) == G
            texts = [t for t, _ in res]
            out.append(train.Group(j, pid, p, tr.task.prompt_ids(p), [enc(tr, t) for t in texts], texts, [],
                                   [c for _, c in res], [tr.task.score(t, p) for t in texts]))
        return out
    monkeypatch.setattr(train, "sample_groups", sample_groups)


def right(p, k=0):
    return f"{k}+0={k} #### {p.gold}"


def post_hoc(p):  # the right final answer after a wrong step: a rationalisation that copied the hint
    return f"9+0=8 #### {p.gold}"


def wrong(p):
    return f"0+0=0 #### {int(p.gold) + 1}"


def test_star_rationalises_only_unsolved_and_strips_the_hint(tmp_path, monkeypatch):
    tr = trainer(tmp_path, "--algo=star")
    pool = [tr.task.problem("rl", i) for i in range(4)]

    def outcomes(i, hinted, p):
        if hinted:  # 1 and 3 are rescued, 2 is not; 0 must never be asked
            return [(wrong(p), False)] * 3 + [(post_hoc(p) if i == 1 else right(p, 9), False)] if i in (1, 3) \
                else [(wrong(p), False)] * 4
        return {0: [(wrong(p), False), (right(p), False), (right(p), False), (wrong(p), False)],
                3: [(right(p), True)] + [(wrong(p), False)] * 3}.get(i, [(wrong(p), False)] * 4)
    calls = []
    fake_rollouts(tr, outcomes, calls, monkeypatch)
    data, stats = star.collect(tr, pool, 1)
    assert calls == [[p.prompt for _, p in pool], [star.hint_prompt(pool[i][1], "arithmetic") for i in (1, 2, 3)]]
    p = [q for _, q in pool]
    want = [(0, right(p[0])), (1, post_hoc(p[1])), (3, right(p[3], 9))]  # 1 and 3 rescued, paired WITHOUT the hint
    assert data == [(tr.task.prompt_ids(p[i]), enc(tr, t)) for i, t in want]
    for prompt, _ in data:  # the hint never reaches a training example
        assert "#" not in tr.task.text(prompt) and tr.task.text(prompt) in [q.prompt for q in p]
    assert stats == {"expert/solved": 0.25, "expert/rescued": 0.5, "expert/dataset_size": 3,
                     "expert/sample_accuracy": 3 / 16, "expert/steps_ok": 1.0, "expert/rescued_steps_ok": 0.5}


def test_rft_keeps_exactly_the_verified_capped_deduplicated_samples(tmp_path, monkeypatch):
    tr = trainer(tmp_path, "--algo=rft", "--expert_max_per_problem=2")
    pool = [tr.task.problem("rl", i) for i in range(4)]

    def outcomes(i, hinted, p):
        assert not hinted, "rft never rationalises"
        return [[(right(p), False), (right(p), False), (right(p, 1), False), (right(p, 2), False)],
                [(wrong(p), False), (right(p, 3), False), (wrong(p), False), (right(p, 3), True)],
                [(wrong(p), False)] * 4,
                [(right(p, 4), False), (wrong(p), False), (right(p, 5), False), (wrong(p), False)]][i]
    calls = []
    fake_rollouts(tr, outcomes, calls, monkeypatch)
    data, stats = star.collect(tr, pool, 1)
    p = [q for _, q in pool]
    want = [(0, right(p[0])), (0, right(p[0], 1)), (1, right(p[1], 3)), (3, right(p[3], 4)), (3, right(p[3], 5))]
    assert data == [(tr.task.prompt_ids(p[i]), enc(tr, t)) for i, t in want]
    assert len(calls) == 1 and stats["expert/solved"] == 0.75 and stats["expert/rescued"] == 0


def test_rft_on_a_teachers_samples(tmp_path):
    """Issue 26's arm (d): with a teacher, star.py fine-tunes on the teacher's samples, not the policy's. The
    teacher (test_distill.hashes_then) answers `digit` to every problem as "####...#digit": every sample has that
    form; the verified set, one per problem, holds one example per pool problem whose gold is the digit, and
    expert_filter = false keeps all k samples of every problem."""
    pool_args = ["--config", SMOKE, "--train_size=8", "--rl_min_ops=1", "--rl_max_ops=1", "--max_operand=3",
                 "--expert_samples=3", "--prompts_per_step=4", "--sft_steps=0", "--algo=rft", "--expert_iters=1",
                 "--expert_sft_steps=2", "--eval_n=4", "--eval_k=2"]
    tr = train.build_run(parse(pool_args))
    pool = [tr.task.problem("rl", i) for i in range(8)]
    digit = Counter(p.gold for _, p in pool if p.gold in "0123456789").most_common(1)[0][0]
    n_digit = sum(p.gold == digit for _, p in pool)
    assert 0 < n_digit < 8
    args = pool_args + [f"--teacher={hashes_then(tmp_path / 't', digit, sharp=10.0)}"]
    groups = star.sample(train.build_run(parse(args)), pool, (0, 1, 0))
    assert all(re.fullmatch("#{4,}" + digit, t) for g in groups for t in g.texts), [g.texts for g in groups]
    for filtered, m, size in (("true", 1, n_digit), ("false", 0, 8 * 3)):
        out = tmp_path / filtered
        star.main(parse(args + [f"--expert_filter={filtered}", f"--expert_max_per_problem={m}", f"--out_dir={out}"]))
        rec = [r for r in records(out) if "expert/dataset_size" in r][-1]
        assert rec["expert/dataset_size"] == size and rec["expert/sample_accuracy"] == n_digit / 8
        assert rec["expert/solved"] == n_digit / 8 and rec["expert/steps_ok"] == 0  # "####7" has no steps


def test_cold_start_mixes_hints_and_batches_are_seeded(tmp_path):
    tr, state = trainer(tmp_path, "--hint_sft_frac=0.5", "--sft_batch_size=64"), train.TrainState()
    prompts, comps = star.cold_start_batch(tr, tr.task, state)
    hinted = sum(tr.task.text(p).startswith("#") for p in prompts)
    assert 16 < hinted < 48 and state.sft_cursor == 64
    probs = [tr.task.problem("sft", i)[1] for i in range(64)]
    for p, c, q in zip(prompts, comps, probs):  # a hinted prompt keeps its problem's worked solution
        assert tr.task.text(p) in (q.prompt, star.hint_prompt(q, "arithmetic"))
        assert c == enc(tr, q.solution)  # sft_direct_frac = 0: the worked solution
    cfg = star.StarConfig(sft_batch_size=4, expert_sft_steps=5)
    b = star.batches(cfg, 6, 1)
    assert b == star.batches(cfg, 6, 1) and len(b) == 5 and all(len(x) == 4 for x in b)
    flat = [i for x in b for i in x]
    assert sorted(flat[:6]) == list(range(6)) and sorted(flat[6:12]) == list(range(6))  # epochs without replacement
    assert star.batches(cfg, 0, 1) == []


def test_config_errors():  # checks.RULES's star rows, which train.build_run checks before anything loads
    for args, msg in [(["--train_size=0"], "train_size = 0 must be > 0 with algo = 'star'"),
                      (["--resume"], "resume = True is not supported"),
                      (["--task=countdown"], "countdown has no answer hint")]:
        with pytest.raises(UserError, match=msg):
            checks.check(parse(["--algo=star", "--train_size=4", *args]))


@pytest.mark.parametrize("algo", ["star", "rft"])
def test_micro_run_logs_iterations(tmp_path, algo, monkeypatch):
    seen = []
    real = star.collect
    monkeypatch.setattr(star, "collect", lambda tr, pool, it: seen.append(real(tr, pool, it)) or seen[-1])
    out = tmp_path / algo
    results = star.main(parse(MICRO + [f"--algo={algo}", f"--out_dir={out}"]))
    recs = records(out)
    assert [r["step"] for r in recs if r["stage"] == "sft" and "train/loss" in r] == list(range(1, 61))
    it = [r for r in recs if "expert/iteration" in r]
    assert [(r["step"], r["stage"], r["expert/iteration"]) for r in it] == [(62, algo, 1), (64, algo, 2)]
    for r in it:
        assert 0 <= r["expert/solved"] and 0 <= r["expert/rescued"] and r["expert/solved"] + r["expert/rescued"] <= 1
        assert 0 <= r["eval/pass@1"] <= 1 and r["expert/dataset_size"] >= 0
    assert [r["expert/dataset_size"] for r in it] == [len(d) for d, _ in seen] and len(seen[0][0]) > 0
    assert [r["step"] for r in recs if r["stage"] == algo and "train/loss" in r] == [61, 62, 63, 64]
    assert (sum(r["expert/rescued"] for r in it) > 0) == (algo == "star")  # rationalisation ran (star only)
    hash_id = train.build_char_tokenizer(tasks.CHARS).token_to_id("#")
    assert all(hash_id not in p for data, _ in seen for p, _ in data)  # no hinted prompt was trained on
    assert set(results) == {"sft", algo} and sorted(os.listdir(out))[-1] == "step_64"


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path):
    """STaR from base on 2 gloo ranks (FSDP2) and on 1: same metrics and weights."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    args = MICRO + ["--algo=star", "--wandb_mode=disabled", "--sft_steps=30"]  # fp drift between 1 and 2 ranks
                                                                                # grows with steps at lr 2e-2
    for name, launcher in [("one", [sys.executable]), ("two", [sys.executable, "-m", "torch.distributed.run",
                                                               "--standalone", "--nproc_per_node=2"])]:
        p = subprocess.run(launcher + [os.path.join(ROOT, "star.py")] + args + [f"--out_dir={tmp_path / name}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    one, two = records(tmp_path / "one"), records(tmp_path / "two")
    assert len(one) == len(two)
    for a, b in zip(one, two):
        for k in a:
            if not k.startswith("time/") and k != "train/grad_norm":
                assert a[k] == pytest.approx(b[k], abs=1e-4), k
    wa, wb = (load_file(tmp_path / d / "step_34" / "model.safetensors") for d in ("one", "two"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-4  # 30 cold-start steps at lr 2e-2: fp drift
    assert any(r.get("expert/dataset_size", 0) > 0 for r in one)  # the fine-tuning ran


def test_cold_start_is_the_grpo_cold_start(tmp_path):
    """With no hints, star.py's cold start (its own loop, train_size not applied) logs what train.py's SFT logs."""
    args = ["--config", SMOKE, "--threads=1", "--sft_steps=4", "--eval_n=8", "--eval_k=2"]
    train.main(train.parse_args(args + ["--rl_steps=0", f"--out_dir={tmp_path / 'grpo'}"]))
    star.main(parse(args + ["--algo=rft", "--train_size=4", "--expert_iters=1", "--expert_samples=1",
                            "--expert_sft_steps=0", f"--out_dir={tmp_path / 'rft'}"]))
    a, b = ([{k: v for k, v in r.items() if not k.startswith("time/")} for r in records(tmp_path / d)
             if r["stage"] == "sft"] for d in ("grpo", "rft"))
    assert len(a) == 5 and [r.keys() for r in a] == [r.keys() for r in b]
    for ra, rb in zip(a, b):
        assert all(ra[k] == pytest.approx(rb[k], abs=1e-6) for k in ra if k != "stage"), (ra, rb)


def test_a_fresh_pool_is_the_next_block_of_the_stream_each_iteration(gsm8k_file):
    """expert_fresh: iteration n samples problems [(n-1)·m, n·m) of the training stream (m = train_size), the
    problems train.py's RL would see next; without it every iteration samples the same first m. A synthetic task
    has no stream beyond its train_size problems: a clear error."""
    class Run:  # what pool_at reads
        def __init__(self, **kw):
            self.cfg = parse(["--config", SMOKE, "--task=gsm8k", f"--train_file={gsm8k_file}",
                              *[f"--{k}={v}" for k, v in kw.items()]])
            self.task = Stream()

    class Stream:  # a train_file of 10 problems; problem k of the stream is (k, "problem k")
        train = list(range(10))

        def problem(self, stage, k):
            assert stage == "rl"
            return k, f"problem {k}"
    fresh, fixed = Run(train_size=3, expert_fresh=True), Run(train_size=3)
    assert [pid for pid, _ in star.pool_at(fresh, 1)] == [0, 1, 2]
    assert [pid for pid, _ in star.pool_at(fresh, 3)] == [6, 7, 8]
    assert star.pool_at(fixed, 3) == star.pool_at(fixed, 1) == [(0, "problem 0"), (1, "problem 1"), (2, "problem 2")]
    assert len(star.pool_at(Run(train_size=0, expert_fresh=True), 2)) == 10  # the whole train_file a block
    with pytest.raises(UserError, match="expert_fresh"):
        checks.check_settings(parse(["--config", SMOKE, "--train_size=8", "--expert_fresh"]))
