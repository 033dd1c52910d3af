"""evaluate.py: the samples file against the prompts written out by hand (and transformers), its metrics recomputed
from the samples, and train.evaluate chunked vs in one call."""
import json
import os

from conftest import GSM8K
from test_tasks import expected_chat, hf_tokenizer

import evaluate
import train
import verify
from rollout import FINISH
from tools import plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN_PRESET = os.path.join(ROOT, "configs", "qwen2.5-0.5b-gsm8k.toml")


def test_samples_file_holds_the_rendered_prompts(hf_folder, gsm8k_file, tmp_path, capsys):
    folder, out = hf_folder("qwen"), tmp_path / "samples.jsonl"
    rec = evaluate.main(train.parse_args([
        "--ckpt", folder, "--config", QWEN_PRESET, f"--eval_file={gsm8k_file}", "--train_file=/does/not/exist",
        "--eval_k=3", "--max_new_tokens=6", "--eval_batch=2", "--samples_out", str(out),
        f"--metrics_out={tmp_path / 'qwen_s0' / 'metrics.jsonl'}"], evaluate.EvalConfig))
    printed = capsys.readouterr().out
    for line in ("pass@1 greedy", "pass@1 sampled", "maj@3", "answer rate", "mean length", "truncation rate", "level",
                 "eval 2/5", "eval 4/5"):  # the metrics, the per-level rows and the progress lines
        assert line in printed, line
    rows = [json.loads(ln) for ln in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 5 * (1 + 3) and [r["kind"] for r in rows[:4]] == ["greedy"] + ["sampled"] * 3
    assert [r["problem"] for r in rows] == [i for i in range(5) for _ in range(4)]
    system, hf = train.parse_args(["--config", QWEN_PRESET]).system_prompt, hf_tokenizer(folder)
    for r in rows:
        question, answer = GSM8K[r["problem"]]
        assert r["prompt"] == expected_chat("qwen", question, system) and r["gold"] == answer.split("#### ")[1]
        if hf is not None:
            assert r["prompt"] == hf.apply_chat_template([{"role": "system", "content": system},
                                                          {"role": "user", "content": question}],
                                                         tokenize=False, add_generation_prompt=True)
        assert r["answer"] == verify.extract_answer(r["completion"])
        assert r["correct"] == (verify.reward(r["completion"], r["gold"]) == 1.0)
        assert isinstance(r["truncated"], bool) and r["finish"] in FINISH  # how the sample ended
        assert r["truncated"] == (r["finish"] in ("length", "nonfinite"))
    greedy, sampled = [r for r in rows if r["kind"] == "greedy"], [r for r in rows if r["kind"] == "sampled"]
    assert rec["eval/pass@1"] == sum(r["correct"] for r in greedy) / 5
    assert abs(rec["eval/pass@1_sampled"] - sum(r["correct"] for r in sampled) / 15) < 1e-12
    assert abs(rec["eval/truncated_frac"] - sum(r["truncated"] for r in sampled) / 15) < 1e-12
    assert abs(rec["eval/answer_rate"] - sum(r["answer"] is not None for r in sampled) / 15) < 1e-12
    assert rec["eval/completed_pass@1"] == sum(r["correct"] and r["finish"] == "stop" for r in greedy) / 5
    assert abs(rec["eval/completed_pass@1_sampled"]
               - sum(r["correct"] and r["finish"] == "stop" for r in sampled) / 15) < 1e-12
    assert "pass@1 greedy, stopped" in printed and {r["finish"] for r in rows} >= {"length"}
    # --metrics_out: the record as one metrics.jsonl line, which tools/plot.py --kind passk reads
    line, = (tmp_path / "qwen_s0" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    assert json.loads(line) == {"step": 0, "stage": "eval", **rec}
    xs, mean, _, _ = plot.collect([str(tmp_path / "qwen_s0")], "passk")["qwen"]["pass@k"]
    assert xs == [1, 2] and mean == [rec["eval/pass@1_sampled"], rec["eval/pass@2_sampled"]]


def test_a_right_answer_cut_off_by_the_length_limit_is_not_a_completed_solution():
    """eval_row: pass@1 counts a right answer wherever the sample ended; completed_pass@1 only at a stop token."""
    def group(scores, finish):
        return train.Group(pos=0, pid=0, problem=None, prompt=[], comps=[[1, 2]] * len(scores),
                           texts=["#### 4"] * len(scores), logprobs=[], truncated=[f != "stop" for f in finish],
                           scores=scores, finish=finish)
    row = train.eval_row(group([1.0], ["length"]), group([1.0, 1.0, 0.0, 1.0], ["stop", "length", "stop",
                                                                                "tool_limit"]), 4)
    assert row["pass@1"] == 1.0 and row["completed_pass@1"] == 0.0
    assert row["pass@1_sampled"] == 0.75 and row["completed_pass@1_sampled"] == 0.25


def test_evaluate_in_chunks_equals_one_call(tmp_path):
    """Row seeds follow a problem's place in the whole held-out set, so eval_batch changes nothing."""
    cfg = train.parse_args(["--config", os.path.join(ROOT, "configs", "smoke.toml"), "--eval_n=5", "--eval_k=2",
                            "--max_new_tokens=12"])
    run = train.build_run(cfg)
    results = []
    for batch in (5, 2):
        run.cfg.eval_batch, samples = batch, []
        results.append((train.evaluate(run, 0, samples=samples), samples))
    assert results[0] == results[1] and len(results[0][1]) == 5 * 3
    assert len({r["completion"] for r in results[0][1]}) > 1  # not a degenerate equality


def test_pass_at_k_is_the_brute_force_share_of_k_subsets_with_a_right_sample():
    """Chen et al.'s unbiased estimator against counting every k-subset of n samples, and eval_row's pass@k keys."""
    import itertools
    for n in range(1, 9):
        for c in range(n + 1):
            right = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(right, k))
                want = sum(any(s) for s in subsets) / len(subsets)
                assert abs(train.pass_at_k(n, c, k) - want) < 1e-12, (n, c, k)
    g = train.Group(pos=0, pid=0, problem=None, prompt=[], comps=[[1]] * 8, texts=["#### 4"] * 8, logprobs=[],
                    truncated=[False] * 8, scores=[1.0, 0, 0, 0, 0, 0, 0, 1.0], finish=["stop"] * 8)
    row = train.eval_row(g, g, 8)
    assert [k for k in row if k.startswith("pass@") and k.endswith("_sampled")] == [
        "pass@1_sampled", "pass@2_sampled", "pass@4_sampled", "pass@8_sampled"]
    assert row["pass@1_sampled"] == 0.25 and row["pass@8_sampled"] == 1.0
    assert abs(row["pass@2_sampled"] - (1 - 15 / 28)) < 1e-12  # 1 − C(6,2)/C(8,2)
