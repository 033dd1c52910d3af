"""tasks.py: generators checked by independent evaluators, countdown checker table, loaders, templates, chat
templates against hand-written renderings and transformers' apply_chat_template."""
import importlib.util
import json
import os
import random
import re
import sys
import time
from datetime import datetime
from fractions import Fraction

import pytest
from conftest import QWEN_SYSTEM

from tasks import (CHARS, Problem, Task, arithmetic, committed_number, countdown, countdown_check, countdown_reward,
                   flawed_solution, load_gsm8k, load_math)
from templates import read_tokenizer_config
from verify import reward, step_rewards


def left_to_right(prompt: str) -> int:
    """Independent evaluator of an arithmetic prompt: fold the operations strictly left to right."""
    tokens = re.findall(r"\d+|[-+*]", prompt.rstrip("="))
    value = int(tokens[0])
    for op, b in zip(tokens[1::2], map(int, tokens[2::2])):
        value = value + b if op == "+" else value - b if op == "-" else value * b
    return value


def exact_value(expr: str) -> Fraction:
    """Independent exact evaluator for trusted, generated expressions (test-only; verify.py never evals)."""
    return eval(re.sub(r"(\d+)", r"Fraction(\1)", expr), {"Fraction": Fraction})  # noqa: S307


# ---------------------------------------------------------------------------------------------------- arithmetic
def test_arithmetic_pinned_examples():
    # hand-checked: 3*7=21, 21-25=-4 (strictly left to right)
    assert arithmetic(0, 0) == Problem("3*7-25=", "-4", "3*7=21;21-25=-4 #### -4", 2)
    assert arithmetic(0, 2) == Problem("13*4=", "52", "13*4=52 #### 52", 1)
    assert arithmetic(0, 3) == Problem("7*6+4+2=", "48", "7*6=42;42+4=46;46+2=48 #### 48", 3)


def test_arithmetic_thousand_problems_are_consistent():
    for i in range(1000):
        p = arithmetic(1, i)
        assert p.prompt.endswith("=") and set(p.prompt + p.solution) <= set(CHARS)
        assert int(p.gold) == left_to_right(p.prompt)  # the gold is the left-to-right value
        steps = step_rewards(p.solution)
        assert len(steps) == p.level and 1 <= p.level <= 3
        assert all(ok for _, ok in steps)
        assert reward(p.solution, p.gold) == 1.0


def test_arithmetic_operand_bounds_and_levels():
    levels = set()
    for i in range(300):
        p = arithmetic(2, i, min_ops=2, max_ops=4, max_operand=12, max_mul_operand=3)
        tokens = re.findall(r"\d+|[-+*]", p.prompt.rstrip("="))
        assert int(tokens[0]) <= 12
        for op, b in zip(tokens[1::2], map(int, tokens[2::2])):
            assert 0 <= b <= (3 if op == "*" else 12)
        assert p.level == len(tokens) // 2
        levels.add(p.level)
    assert levels == {2, 3, 4}  # uniform over [min_ops, max_ops]: all three show up in 300 draws


def test_arithmetic_is_independent_of_call_order():
    forward = [arithmetic(7, i) for i in range(20)]
    backward = [arithmetic(7, i) for i in reversed(range(20))][::-1]
    interleaved = []
    for i in range(20):
        countdown(7, i), arithmetic(8, i)  # unrelated draws in between change nothing
        interleaved.append(arithmetic(7, i))
    assert forward == backward == interleaved
    assert [arithmetic(7, i) for i in range(20)] != [arithmetic(8, i) for i in range(20)]  # seeds differ



def chain(solution: str) -> list[tuple[int, str, int, int]]:
    """The steps "a op b=c" of a worked solution as (a, op, b, c)."""
    return [(int(a), op, int(b), int(c)) for a, op, b, c in re.findall(r"(-?\d+)([-+*])(\d+)=(-?\d+)", solution)]


def test_sloppy_teacher_pinned_examples():
    rng = random.Random(0)
    p = Problem("2-5+2=", "-1", "2-5=-3;-3+2=-1 #### -1", 2)
    assert flawed_solution(p, "sign", rng) == "2-5=3;3+2=5 #### 5"  # |2-5| = 3, carried on: 3+2 = 5
    q = Problem("3+4+9=", "16", "3+4=7;7+9=16 #### 16", 2)
    assert flawed_solution(q, "sign", rng) == q.solution  # no negative result: nothing to get wrong


@pytest.mark.parametrize("flaw", ["sign", "random"])
def test_sloppy_teacher_chains(flaw):
    rng, n_wrong = random.Random(1), 0
    for i in range(500):
        p = arithmetic(2, i, min_ops=2, max_ops=4, max_operand=9, ops="+-")
        s = flawed_solution(p, flaw, rng)
        steps, value, wrong = chain(s), int(re.match(r"\d+", p.prompt).group()), 0
        assert [f"{op}{b}" for _, op, b, _ in steps] == re.findall(r"[-+]\d+", p.prompt)  # the prompt's operations
        for a, op, b, c in steps:
            assert a == value  # each step starts from the result written before it: errors are carried on
            right = a + b if op == "+" else a - b
            wrong += c != right
            assert c == abs(right) if flaw == "sign" else c == right or 1 <= abs(c - right) <= 3
            value = c
        assert s.endswith(f"#### {value}")
        if flaw == "random":  # exactly one slip, and on + - chains it always changes the final answer
            assert wrong == 1 and reward(s, p.gold) == 0.0
        else:  # wrong exactly when the correct chain goes below zero somewhere
            assert (wrong > 0) == (reward(s, p.gold) == 0.0) == (min(running_values(p.prompt)) < 0)
        n_wrong += wrong > 0
    assert n_wrong == 500 if flaw == "random" else 100 < n_wrong < 400


def running_values(prompt: str) -> list[int]:
    """Independent evaluator: every intermediate result of the left-to-right fold."""
    tokens, out = re.findall(r"\d+|[-+*]", prompt.rstrip("=")), []
    value = int(tokens[0])
    for op, b in zip(tokens[1::2], map(int, tokens[2::2])):
        value = value + b if op == "+" else value - b if op == "-" else value * b
        out.append(value)
    return out


# ---------------------------------------------------------------------------------------------------- countdown
def test_countdown_pinned_example():
    # hand-checked: 2*1*9 = 18 uses 1, 2, 9 once each
    assert countdown(0, 0) == Problem("1 2 9>18=", "18", "2*1*9", 2)


def test_countdown_thousand_problems_are_solvable():
    for i in range(1000):
        p = countdown(1, i)
        m = re.fullmatch(r"([0-9 ]+)>([0-9]+)=", p.prompt)
        numbers, target = [int(n) for n in m[1].split()], int(m[2])
        assert set(p.prompt + p.solution) <= set(CHARS)
        assert numbers == sorted(numbers) and all(1 <= n <= 25 for n in numbers) and len(numbers) == 3
        assert sorted(map(int, re.findall(r"\d+", p.solution))) == numbers  # every number exactly once
        assert exact_value(p.solution) == target > 0 and p.gold == str(target)
        assert countdown_check(p.solution, numbers, target)
        assert countdown_reward(p.solution, p) == 1.0


def test_countdown_options_and_order():
    p = countdown(3, 5, n_numbers=5, max_number=9)
    numbers = [int(n) for n in p.prompt.split(">")[0].split()]
    assert len(numbers) == 5 and max(numbers) <= 9 and p.level == 4
    assert [countdown(3, i) for i in (4, 2)] == [countdown(3, 4), countdown(3, 2)]


CHECK = [
    ("25+3*7", [3, 7, 25], 46, True),
    ("(7*3)+25", [3, 7, 25], 46, True),
    ("7*3+25", [25, 7, 3], 46, True),
    ("3*7", [3, 7, 25], 21, True),  # not every number has to be used
    ("10-3", [3, 10], 7, True),
    ("(10-3)", [3, 10], 7, True),
    ("7/2*2", [2, 2, 7], 7, True),  # exact division through a fraction
    ("8/(3-8/3)", [3, 3, 8, 8], 24, True),
    (" 25 + 3 * 7 ", [3, 7, 25], 46, True),
    ("7*3+25+3", [3, 7, 25], 49, False),  # 3 used twice
    ("7*3+26", [3, 7, 25], 47, False),  # 26 is not given
    ("37", [3, 7], 37, False),  # no concatenation
    ("25/(7-7)", [7, 7, 25], 0, False),  # division by zero
    ("7/2", [2, 7], 3, False),  # 3.5, not 3
    ("25+3*7", [3, 7, 25], 47, False),  # wrong value
    ("-3+10", [3, 10], 7, False),  # unary minus
    ("10*(-3)", [3, 10], -30, False),
    ("2**3", [2, 3], 8, False),
    ("x+1", [1], 2, False),
    ("3 7", [3, 7], 10, False),
    ("", [1], 1, False),
    ("(3+7", [3, 7], 10, False),
    ("1+" * 150 + "1", [1] * 151, 151, False),  # over-long
]


@pytest.mark.parametrize("expr,numbers,target,expected", CHECK)
def test_countdown_check(expr, numbers, target, expected):
    assert countdown_check(expr, numbers, target) is expected


COUNTDOWN_PROBLEM = Problem(prompt="3 7 25>46=", gold="46", solution="25+3*7", level=2)
COUNTDOWN_REWARD = [
    ("25+3*7", 1.0),
    ("25+3*7\nand some words", 1.0),
    ("25+3*7=46", 1.0),
    ("25+3*7<|endoftext|>", 1.0),
    ("<think>7*3=21</think><answer>(7*3)+25</answer>", 1.0),
    ("so \\boxed{7*3+25}", 1.0),
    ("25+3+7", 0.0),
    ("25+3*7+3", 0.0),
    ("", 0.0),
    ("<answer>46</answer>", 0.0),  # the target itself is not an expression over the numbers
]


@pytest.mark.parametrize("completion,expected", COUNTDOWN_REWARD)
def test_countdown_reward(completion, expected):
    assert countdown_reward(completion, COUNTDOWN_PROBLEM) == expected


def test_countdown_adversarial_is_fast():
    for text in ("(" * 100_000, "1+" * 50_000, "<answer>" * 12_000, "\\boxed{" * 14_000, "9" * 100_000):
        start = time.perf_counter()
        countdown_check(text, [1, 2, 3], 6)
        countdown_reward(text, COUNTDOWN_PROBLEM)
        assert time.perf_counter() - start < 1.0


def test_chars():
    assert CHARS == "0123456789+-*/()=;#> " and len(set(CHARS)) == len(CHARS)


# ---------------------------------------------------------------------------------------------------- loaders
def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_gsm8k(tmp_path):
    path = write_lines(tmp_path / "gsm8k.jsonl", [
        json.dumps({"question": "Q1?", "answer": "48/2 = <<48/2=24>>24\n#### 72"}),
        "",
        "   ",
        json.dumps({"question": "Q2?", "answer": "Big.\n#### 1,000"}),
    ])
    assert load_gsm8k(path) == [
        Problem("Q1?", "72", "48/2 = <<48/2=24>>24\n#### 72", 0),
        Problem("Q2?", "1000", "Big.\n#### 1,000", 0),
    ]
    assert load_gsm8k(str(path))[1].gold == "1000"


def test_load_math(tmp_path):
    path = write_lines(tmp_path / "math.jsonl", [
        json.dumps({"problem": "P1", "solution": "So $\\boxed{\\frac{1}{2}}$.", "level": "Level 3"}),
        json.dumps({"problem": "P2", "solution": "$\\boxed{(1,2)}$"}),
        json.dumps({"problem": "P3", "solution": "\\boxed{5}", "level": "Level ?"}),
        json.dumps({"problem": "P4", "solution": "\\boxed{5}", "level": 2}),
    ])
    problems = load_math(path)
    assert [(p.prompt, p.gold, p.level) for p in problems] == [
        ("P1", "\\frac{1}{2}", 3), ("P2", "(1,2)", 0), ("P3", "5", 0), ("P4", "5", 2)]
    assert problems[0].solution == "So $\\boxed{\\frac{1}{2}}$."


GOOD_GSM8K = json.dumps({"question": "Q", "answer": "#### 1"})
GOOD_MATH = json.dumps({"problem": "P", "solution": "\\boxed{1}"})
MALFORMED = [
    (load_gsm8k, [GOOD_GSM8K, "{not json"], 2, "bad JSON"),
    (load_gsm8k, [GOOD_GSM8K, "", json.dumps({"question": "Q"})], 3, "missing"),
    (load_gsm8k, [json.dumps({"question": "Q", "answer": "no marker"})], 1, "no final answer"),
    (load_gsm8k, [json.dumps({"question": "Q", "answer": "####   "})], 1, "no final answer"),
    (load_gsm8k, [json.dumps([1, 2])], 1, "JSON object"),
    (load_gsm8k, [json.dumps({"question": 3, "answer": "#### 1"})], 1, "missing"),
    (load_math, [GOOD_MATH, GOOD_MATH, "[1,"], 3, "bad JSON"),
    (load_math, [json.dumps({"solution": "\\boxed{1}"})], 1, "missing"),
    (load_math, [GOOD_MATH, json.dumps({"problem": "P", "solution": "no box here"})], 2, "no final answer"),
]


@pytest.mark.parametrize("loader,lines,lineno,reason", MALFORMED)
def test_loaders_reject_malformed_lines(tmp_path, loader, lines, lineno, reason):
    path = write_lines(tmp_path / "data.jsonl", lines)
    with pytest.raises(ValueError, match=re.escape(f"{path}:{lineno}:") + ".*" + reason):
        loader(path)


# ---------------------------------------------------------------------------------------------------- chat templates
def chat_task(folder, data, **kw):
    """A gsm8k Task with template = "chat" on a checkpoint folder's tokenizer; stop ids as the Hub files name them."""
    import train
    from tokenizers import Tokenizer
    cfg = train.Config(task="gsm8k", train_file=data, eval_file=data, template="chat", **kw)
    tok, info = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")), read_tokenizer_config(folder)
    return Task(cfg, tok, [tok.token_to_id(info["special_tokens"]["eos_token"])], info)


def expected_chat(family: str, question: str, system: str = "") -> str:
    """The rendered prompt, written out by hand from the two templates in conftest.py."""
    if family == "qwen":
        return (f"<|im_start|>system\n{system or QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                "<|im_start|>assistant\n")
    return (f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
            f"Today Date: {datetime.now():%d %b %Y}\n\n{system}<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
            f"{question}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def hf_tokenizer(folder):
    """transformers' AutoTokenizer of a folder, or None when transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("family", ["qwen", "llama"])
@pytest.mark.parametrize("system", ["", "Think step by step, then give the answer after ####."])
def test_chat_prompts_render_the_checkpoints_template(hf_folder, gsm8k_file, family, system):
    folder = hf_folder(family)
    task, hf = chat_task(folder, gsm8k_file, system_prompt=system), hf_tokenizer(folder)
    assert len(task.heldout) == 5
    for p in task.heldout:
        text, ids = task.prompt_text(p), task.prompt_ids(p)
        assert text == expected_chat(family, p.prompt, system)
        assert ids == task.tok.encode(text, add_special_tokens=False).ids
        if family == "llama":  # the template writes bos_token; the tokenizer would add a second one
            bos = task.tok.token_to_id("<|begin_of_text|>")
            assert ids[0] == bos and ids.count(bos) == 1 and task.tok.encode(text).ids[:2] == [bos, bos]
        if hf is not None:
            messages = [{"role": "system", "content": system}] if system else []
            messages += [{"role": "user", "content": p.prompt}]
            assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert ids == hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("family,base,end", [("qwen", False, "<|im_end|>"), ("llama", False, "<|eot_id|>"),
                                             ("qwen", True, "<|im_end|>")])
def test_sft_targets_end_with_the_templates_end_of_turn(hf_folder, gsm8k_file, family, base, end):
    task = chat_task(hf_folder(family, base=base), gsm8k_file)
    end_id, body = task.tok.token_to_id(end), task.tok.encode("48 + 24 = 72\n#### 72", add_special_tokens=False).ids
    assert task.end_id == end_id and task.target_ids("48 + 24 = 72\n#### 72") == body + [end_id]
    assert end_id in task.stop_ids  # a base model's eos is <|endoftext|>: the template's end of turn stops it too
    assert task.stop_ids[0] == task.tok.token_to_id("<|endoftext|>" if base else end)


def test_chat_template_without_one_names_the_folder(hf_folder, gsm8k_file):
    folder = hf_folder("qwen", chat_template=False)
    with pytest.raises(SystemExit, match=re.escape(folder) + ".*no chat template"):
        chat_task(folder, gsm8k_file)
    import train
    from model import build_char_tokenizer
    with pytest.raises(SystemExit, match="a fresh model.*no chat template"):
        Task(train.Config(template="chat"), build_char_tokenizer(CHARS), [2])
    with pytest.raises(SystemExit, match="system_prompt needs template = 'chat'"):
        Task(train.Config(template="r1", system_prompt="Be brief."), build_char_tokenizer(CHARS), [2])


# ------------------------------------------------------------------------------------------------------ reasoning-gym
needs_rg = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="pip install reasoning-gym")
ADDITIONS = {"basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+"],
                                      allow_parentheses=False, allow_negation=False)}  # 121 distinct questions


def rg_task(datasets=ADDITIONS, **kw) -> Task:
    import train
    from model import build_char_tokenizer
    cfg = train.Config(task="reasoning_gym", rg_datasets=datasets, sft_steps=0, **kw)
    return Task(cfg, build_char_tokenizer(CHARS), [2])  # rewards and splits only: no prompt is tokenized


@needs_rg
def test_reasoning_gym_train_and_heldout_share_no_question():
    """One dataset split by index; 1-digit additions repeat questions, so the training part must drop the pool's."""
    import reasoning_gym
    task = rg_task(rg_size=600, rg_heldout=200, eval_n=150)
    items = [reasoning_gym.create_dataset("basic_arithmetic", seed=task.cfg.eval_seed, size=600,
                                          **ADDITIONS["basic_arithmetic"])[i] for i in range(600)]
    pool = {x["question"] for x in items[:200]}
    assert [p.prompt for p in task.heldout] == [x["question"] for x in items[:150]]
    assert [p.gold for p in task.heldout] == [x["answer"] for x in items[:150]]
    assert sum(x["question"] in pool for x in items[200:]) > 100  # the raw split overlaps ...
    assert [p.prompt for p in task.train] == [x["question"] for x in items[200:] if x["question"] not in pool]
    stream = {task.problem("rl", k)[1].prompt for k in range(3 * len(task.train))}  # ... the training stream never
    assert stream == {p.prompt for p in task.train} and not stream & pool
    smaller = rg_task(rg_size=600, rg_heldout=200, eval_n=20)  # eval_n picks from the pool: training stays put
    assert [p.prompt for p in smaller.train] == [p.prompt for p in task.train]
    other = rg_task(rg_size=600, rg_heldout=200, eval_n=150, seed=1)  # a run's seed orders training, no more
    assert [other.problem("rl", k)[1].prompt for k in range(20)] != [task.problem("rl", k)[1].prompt
                                                                      for k in range(20)]


@needs_rg
def test_reasoning_gym_reward_is_the_scorer_of_the_final_answer_binarised():
    gsm = rg_task({"gsm_symbolic": {}}, rg_size=20, rg_heldout=10, eval_n=10)
    p = gsm.heldout[0]
    gold, wrong = p.gold, str(int(p.gold) + 1)
    first_right = f"My first guess is {gold}, but recomputing it, the answer is {wrong}."
    assert gsm.rg.score_answer(first_right, p.entry) == 1.0  # the pitfall: gsm_symbolic scores the FIRST number
    assert gsm.score(first_right, p) == 0.0 and gsm.score(f"First {wrong}. Recomputing: the answer is {gold}.", p) == 1
    add = rg_task(rg_size=20, rg_heldout=10, eval_n=10)
    q = next(x for x in add.heldout if len(x.gold) == 1)
    assert add.rg.score_answer(q.gold * 2, q.entry) == 0.5  # substring partial credit ("4" inside "44") ...
    assert add.score(f"The answer is {q.gold * 2}.", q) == 0.0  # ... pays nothing here
    assert add.score(f"The answer is {q.gold}.", q) == 1.0 and add.score(q.gold, q) == 0.0  # nothing committed
    cd = rg_task({"countdown": {}}, rg_size=20, rg_heldout=10, eval_n=10)
    c = cd.heldout[0]
    assert cd.rg.score_answer("1 + 2", c.entry) in (0.01, 0.05)
    assert cd.score("The answer is 1 + 2.", c) == 0.0  # the floors are 0


@pytest.mark.parametrize("completion,expected", [("The answer is 12.", 1.0), ("The answer is -4.", 1.0),
                                                 ("The answer is 1,000.", 1.0), ("The answer is 2.5", 1.0),
                                                 ("The answer is 24 legs.", 0.0), ("12", 0.0), ("no idea", 0.0),
                                                 ("\\boxed{7}", 1.0), ("The answer is x.", 0.0)])
def test_committed_number_is_the_format_only_reward(completion, expected):
    assert committed_number(completion) == expected


@needs_rg
def test_reasoning_gym_composite_routes_each_problem_to_its_scorer():
    task = rg_task({"basic_arithmetic": {**ADDITIONS["basic_arithmetic"], "weight": 3}, "leg_counting": {}},
                   rg_size=200, rg_heldout=100, eval_n=100)
    sources = [p.source for p in task.heldout]
    assert set(sources) == {"basic_arithmetic", "leg_counting"} and sources.count("basic_arithmetic") > 50
    for p in task.heldout[:20]:
        assert task.score(f"The answer is {p.gold}.", p) == 1.0 and task.score(f"The answer is {p.gold}0.", p) == 0
    assert all(p.source == "" for p in rg_task(rg_size=20, rg_heldout=10, eval_n=10).heldout)  # one dataset: none


@needs_rg
@pytest.mark.parametrize("datasets,message", [({"no_such_task": {}}, "no_such_task"),
                                              ({"leg_counting": {"min_animals": 0}}, "min_animals"),
                                              ({"leg_counting": {"seed": 3}}, "without seed and size"),
                                              ({"leg_counting": 3}, "needs a table of its options")])
def test_reasoning_gym_bad_datasets_are_one_line_errors(datasets, message):
    from cli import UserError
    with pytest.raises(UserError, match=message):
        rg_task(datasets, rg_size=20, rg_heldout=10, eval_n=10)


def test_reasoning_gym_missing_names_the_pip_command(monkeypatch):
    from cli import UserError
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(UserError, match="pip install reasoning-gym"):
        rg_task(rg_size=20, rg_heldout=10, eval_n=10)
