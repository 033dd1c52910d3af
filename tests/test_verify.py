"""verify.py: tables of hand-written cases (extraction, equivalence, rewards, steps) and adversarial timing."""
import time
from fractions import Fraction

import pytest

from verify import eval_arith, extract_answer, format_reward, is_equiv, reward, step_rewards

# ---------------------------------------------------------------------------------------------------- extraction
EXTRACT = [
    # <answer> tags: the last block wins; a \boxed{} inside it wins over the rest of the block
    ("<think>x</think><answer>5</answer>", "5"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("<answer>The result is \\boxed{7}.</answer>", "7"),
    ("<answer> 3 </answer>", "3"),
    ("<answer>x = 4</answer><|endoftext|>", "x = 4"),
    ("<answer>3</answer> \\boxed{4}", "3"),
    ("<answer>The answer is 18.</answer>", "18"),
    ("<answer>Answer: (B)</answer>", "(B)"),
    # \boxed / \fbox: the last balanced one
    ("\\boxed{5}", "5"),
    ("a \\boxed{1} b \\boxed{2}", "2"),
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("\\boxed{{a}{b}}", "{a}{b}"),
    ("\\boxed 5$", "5"),
    ("so $\\boxed 12$.", "12"),
    ("\\fbox{9}", "9"),
    ("\\boxed{12} and then \\boxed{1", "12"),
    ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
    ("thus \\boxed{ x = 3 }.", "x = 3"),
    ("\\boxed{4} #### 5", "4"),
    ("The answer is \\boxed{8} indeed", "8"),
    # GSM8K ####: the rest of the line after the last one
    ("#### 42", "42"),
    ("48/2 = 24\n#### 1,234\n", "1,234"),
    ("#### 1\n#### 2", "2"),
    ("####5", "5"),
    ("#### 5\nso the answer is 6", "5"),
    # "the (final) answer is", "Final answer:"
    ("The answer is 42.", "42"),
    ("So the final answer is $\\frac{1}{2}$. I hope it is correct.", "\\frac{1}{2}"),
    ("the answer is 3.5 kg.", "3.5 kg"),
    ("**Final Answer:** 17", "17"),
    ("Final answer: x = 4", "x = 4"),
    ("The answer is: 9", "9"),
    ("The answer is 1 and more.\nThe answer is 2.", "2"),
    # no explicit final answer
    ("", None),
    ("no answer here, maybe 5", None),
    ("42", None),
    ("<answer>5", None),
    ("</answer>5", None),
    ("<answer>   </answer>", None),
    ("\\boxed{5", None),
    ("\\boxed{", None),
    ("####", None),
    ("#### \nnext line", None),
    ("the answer is", None),
    ("the answer isn't obvious", None),
    ("The answer", None),
]


@pytest.mark.parametrize("text,expected", EXTRACT)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


LENIENT = [
    ("no explicit answer 5 then 7.5", "7.5"),
    ("it is -3 apples", "-3"),
    ("1,000 people came", "1,000"),
    ("nothing numeric", None),
    ("\\boxed{2} and 3", "2"),  # explicit answers still come first
]


@pytest.mark.parametrize("text,expected", LENIENT)
def test_extract_answer_lenient(text, expected):
    assert extract_answer(text, lenient=True) == expected
    if expected is not None and "\\boxed" not in text:
        assert extract_answer(text) is None  # off by default


# ---------------------------------------------------------------------------------------------------- equivalence
EQUIV_TRUE = [
    ("5", "5"), (" 5 ", "5"), ("ABC", "abc"),  # whitespace, case
    ("$5$", "5"), ("\\text{Evelyn}", "evelyn"), ("\\mathrm{cm}", "cm"), ("\\left(1, 2\\right)", "(1,2)"),
    ("1\\!000", "1000"), ("1\\,000", "1000"), ("30^\\circ", "30"), ("30^{\\circ}", "30"), ("30°", "30"),
    ("5.", "5"), ("\\(5\\)", "5"),
    ("1,000", "1000"), ("1{,}000", "1000"), ("1,234,567", "1234567"), ("$1,000", "1000"),  # thousands
    ("-5", "- 5"), ("+5", "5"), ("−5", "-5"), ("-0", "0"),  # signs
    ("2.50", "2.5"), ("2.0", "2"), ("0.5", ".5"), ("007", "7"),  # decimals
    ("1/2", "0.5"), ("\\frac{1}{2}", "0.5"), ("\\dfrac{1}{2}", "1/2"), ("\\tfrac{1}{2}", "\\frac12"),
    ("\\frac12", "0.5"), ("\\frac{3}{4}", "0.75"), ("-\\frac{1}{2}", "-0.5"), ("\\frac{-1}{2}", "-1/2"),
    ("\\frac{6}{4}", "\\frac{3}{2}"), ("2\\frac{1}{2}", "5/2"), ("\\frac{10}{2}", "5"),  # fractions
    ("50\\%", "50"), ("50%", "50"), ("12.5\\%", "12.5"),  # percent
    ("\\$5", "5"), ("$5", "5"), ("5 dollars", "5"), ("\\$18.90", "18.90"), ("\\$18.90", "18.9"),  # currency
    ("5\\text{ cm}", "5"), ("5 cm", "5"), ("6\\sqrt{3}\\text{ square units}", "6\\sqrt3"), ("18 apples", "18"),
    ("10 \\text{ inches}^2", "10"),  # units
    ("x = 5", "5"), ("x=5", "5"), ("y = 2x+3", "2x+3"), ("\\theta = 30^\\circ", "30"), ("a_1 = 7", "7"),
    ("\\sqrt2", "\\sqrt{2}"), ("2\\sqrt3", "2\\sqrt{3}"),  # roots
    ("\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt3}{2}"), ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("(1,2)", "(1, 2)"), ("(1.0, 2)", "(1,2.00)"), ("(\\frac{1}{2}, 3)", "(0.5,3)"),  # tuples in order
    ("(-\\infty, 3]", "(-\\infty,3]"), ("[2, 5)", "[2,5)"),
    ("(-\\infty, 1) \\cup (2, \\infty)", "(-\\infty,1)\\cup(2,\\infty)"),
    ("\\{1,2\\}", "1, 2"), ("\\{1, 2\\}", "\\{2,1\\}"), ("1, 2", "2, 1"), ("-2, 3", "3,-2"), ("1,2,2", "2,1,2"),
    ("1e3", "1000"), ("1.5\\times10^{3}", "1500"), ("2.5 \\cdot 10^3", "2500"), ("10^{3}", "1000"),
    ("10^3", "1000"), ("2^{10}", "1024"), ("1E-3", "0.001"), ("3 \\times 10^{-2}", "0.03"),  # scientific
    ("\\boxed{\\text{(A)}}", "A"), ("\\text{(B)}", "(B)"), ("(C)", "c"), ("\\textbf{(D)}", "D"),  # choices
    ("\\pm 3", "\\pm3"), ("±3", "\\pm 3"), ("\\infty", "\\infty"), ("\\boxed{5}", "5"), ("{5}", "5"), ("(5)", "5"),
    ("\\text{Yes}", "yes"), ("\\frac{1}{2}x", "\\frac12 x"), ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
                                                                  "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("0.333", "333/1000"), ("100", "1e2"), ("1,000,000", "10^6"), ("2.5\\%", "\\frac{5}{2}"),
    ("x \\in [2, 5]", "[2,5]"), ("x=2, x=3", "3, 2"), ("\\frac{x+1}{2}", "(x+1)/2"), ("√2", "\\sqrt{2}"),
    ("\\pm\\frac{1}{2}", "\\pm 1/2"), ("5 \\, \\text{m}", "5"), ("\\left\\{ 1,2 \\right\\}", "\\{2, 1\\}"),
    ("\\frac{3\\pi}{4}", "3\\pi/4"), ("\\frac{2\\sqrt{3}}{3}", "2\\sqrt3/3"), ("\\frac{x}{2}", "x/2"),
    ("\\$32,\\!348", "32348"), ("1,\\!000,\\!000", "1000000"), ("6\\frac{1}{4}", "25/4"), ("5\\text{.}", "5"),
    ("10^{-3}", "0.001"), ("\\sqrt{4}", "2"), ("1\\frac{1}{2}", "1.5"), ("\\frac{-\\sqrt{3}}{2}", "-\\frac{\\sqrt3}{2}"), ("2π", "2\\pi"),
]

EQUIV_FALSE = [
    ("5", "6"), ("abc", "abd"), ("", ""), ("", "0"), (None, "5"), ("5", None),  # basics
    ("1,2", "12"), ("1,2", "1.2"), ("1,000", "1"), ("1,00", "100"), ("12,34", "1234"),  # commas
    ("-5", "5"), ("5", "-5"), ("\\pm 3", "3"),  # signs
    ("2.51", "2.5"), ("0.3333", "1/3"), ("0.33", "\\frac{1}{3}"),  # exact, no float tolerance
    ("1/2", "2"), ("\\frac{1}{2}", "\\frac{2}{1}"), ("2\\frac{1}{2}", "21/2"), ("\\frac{1}{0}", "0"),  # fractions
    ("\\frac{1}{2x}", "\\frac{1}{2}x"), ("1/0", "0"), ("\\frac{1}{0}", "\\infty"),
    ("50\\%", "5"), ("5 cm", "6"), ("2ab", "2"), ("x = 5", "6"), ("x + y = 5", "5"),
    ("\\sqrt{2}", "\\sqrt{3}"), ("\\sqrt{4}", "3"),  # radicals are exact: sqrt 4 = 2 (in EQUIV_TRUE), not 3
    ("(1,2)", "(2,1)"), ("(1,2)", "[1,2]"), ("(1,2]", "(1,2)"), ("(1,2)", "1,2"), ("(1,2,3)", "(1,2)"),
    ("(-\\infty, 3]", "(-\\infty, 3)"), ("\\{1,2\\}", "\\{1,3\\}"), ("1,2", "1,2,3"), ("1,1,2", "1,2,2"),
    ("1e3", "100"), ("10^{3}", "100"), ("1.5\\times10^{3}", "150"),  # scientific
    ("10^10^10", "1"), ("10^{100000}", "1"), ("1e100000", "10^{100000}"), ("1e1001", "10^{1001}"),  # rejected
    ("9" * 400, "9" * 400 + ".0"), ("1" + "0" * 400, "1e400"),  # over-long numbers are rejected, not computed
    ("A", "B"), ("\\text{(A)}", "(B)"), ("yes", "no"), ("2\\mathrm{i}", "2"), ("x\\infty", "\\infty"),
    ("\\frac{x+1}{2}", "x+1/2"), ("x = 2, y = 3", "2"),
    ("5" + " " * 600, "5"), ("x" * 600, "x" * 600),  # over-long answers are never equivalent
]


@pytest.mark.parametrize("pred,gold", EQUIV_TRUE)
def test_is_equiv_true(pred, gold):
    assert is_equiv(pred, gold)
    assert is_equiv(gold, pred)  # symmetric


@pytest.mark.parametrize("pred,gold", EQUIV_FALSE)
def test_is_equiv_false(pred, gold):
    assert not is_equiv(pred, gold)
    assert not is_equiv(gold, pred)


def test_big_exact_numbers():
    # exact rationals: 0.1 + 0.2 style float noise can never make two distinct numbers equal
    assert is_equiv("1" * 100, "1" * 100 + ".0")
    assert not is_equiv("1" * 100, "1" * 99 + "2")


# ---------------------------------------------------------------------------------------------------- rewards
REWARD = [
    ("<think>2+3</think><answer>5</answer>", "5", 1.0),
    ("<think>2+3</think><answer>6</answer>", "5", 0.0),
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("The answer is $18.90.", "18.9", 1.0),
    ("I think it is 5", "5", 0.0),  # no explicit answer: no reward, even when the last number is right
    ("", "5", 0.0),
    ("\\boxed{5", "5", 0.0),
    ("8-18=-10;-10+13=3 #### 3", "3", 1.0),
]


@pytest.mark.parametrize("completion,gold,expected", REWARD)
def test_reward(completion, gold, expected):
    assert reward(completion, gold) == expected


FORMAT = [
    ("<think>a</think><answer>5</answer>", 1.0),
    ("  <think>\nreasoning\n</think>\n<answer> 5 </answer>\n", 1.0),
    ("<think></think><answer>5</answer>", 1.0),
    ("<think>a</think><answer>5</answer><|endoftext|>", 1.0),
    ("<think>a</think><answer>5</answer></s>", 1.0),
    ("<think>a</think><answer>5</answer> <|im_end|>", 1.0),
    ("<think>a</think><think>b</think><answer>5</answer>", 0.0),  # two think blocks
    ("<think>a</think>text<answer>5</answer>", 0.0),  # text between
    ("hello <think>a</think><answer>5</answer>", 0.0),  # text before
    ("<think>a</think><answer>5</answer> bye", 0.0),  # text after
    ("<think>a</think>", 0.0),  # missing answer
    ("<answer>5</answer>", 0.0),  # missing think
    ("<think>a<answer>5</answer></think>", 0.0),  # nested
    ("<answer>5</answer><think>a</think>", 0.0),  # wrong order
    ("<think>a</think><answer>5</answer><answer>6</answer>", 0.0),  # two answers
    ("<think>a</think><answer>  </answer>", 0.0),  # empty answer
    ("<think>a</think><answer>5", 0.0),  # truncated
    ("", 0.0),
    ("<think>a</think><answer>5</answer><|endoftext|><|endoftext|>", 0.0),  # one EOS only
]


@pytest.mark.parametrize("completion,expected", FORMAT)
def test_format_reward(completion, expected):
    assert format_reward(completion) == expected


STEPS = [
    ("8-18=-10;-10+13=3 #### 3", [(8, True), (17, True)]),
    ("8-18=-10;-10+13=4 #### 4", [(8, True), (17, False)]),
    (" 1+1=2 ; 2+2=5 ", [(6, True), (14, False)]),
    ("2*3=6\n6/4=3/2", [(5, True), (13, True)]),
    ("1+2*3=7", [(7, True)]),  # standard precedence inside a step
    ("1+2*3=9", [(7, False)]),
    ("(1+2)*3=9", [(9, True)]),
    ("7/2*2=7", [(7, True)]),  # exact division
    ("1/3+1/3+1/3=1", [(13, True)]),
    ("1/0=1", [(5, False)]),  # division by zero
    ("1+1", [(3, False)]),  # no '='
    ("1=1=1", [(5, False)]),
    ("a+1=2", [(5, False)]),
    ("0.1+0.2=0.3", [(11, False)]),  # integers only
    ("2--3=5", [(6, True)]),
    ("((2))=2", [(7, True)]),
    ("999999999999*999999999999=999999999998000000000001", [(50, True)]),
    ("3+4=7;;", [(5, True)]),
    ("10-3=7 #### 7", [(6, True)]),
    ("", []),
    ("#### 5", []),
]


@pytest.mark.parametrize("solution,expected", STEPS)
def test_step_rewards(solution, expected):
    assert step_rewards(solution) == expected


ARITH = [
    ("1+2*3", 7), ("(1+2)*3", 9), ("7/2*2", 7), ("7/2", Fraction(7, 2)), ("-10+13", 3), ("2*-3", -6),
    ("8-18-3", -13), ("2*(3+4)-5/5", 13), ("--5", 5), ("12 - 2 * 3", 6), ("1/0", None), ("(1", None), ("1)", None),
    ("", None), ("1+", None), ("1 2", None), ("2**3", None), ("x", None), ("1.5", None), ("1+" * 150 + "1", None),
]


@pytest.mark.parametrize("expr,expected", ARITH)
def test_eval_arith(expr, expected):
    assert eval_arith(expr) == expected


# ---------------------------------------------------------------------------------------------------- adversarial
N = 100_000
ADVERSARIAL = {
    "nested_braces": "\\boxed{" + "{" * N,
    "balanced_braces": "\\boxed{" + "{" * (N // 2) + "}" * (N // 2),
    "many_boxed": "\\boxed{" * (N // 7),
    "many_closed_boxed": "\\boxed{1}" * (N // 9),
    "boxed_spaces": "\\boxed" + " " * N + "5",
    "digits": "1" * N,
    "exponent": "1e" + "9" * N,
    "power_tower": "10^" * (N // 3) + "10",
    "answer_tags": "<answer>" * (N // 8),
    "answer_blocks": "<answer>1</answer>" * (N // 18),
    "think_tags": "<think></think>" * (N // 15),
    "hashes": "#### " * (N // 5),
    "hash_digits": "####" + "1" * N,
    "answer_is": "the answer is " * (N // 14),
    "commas": "1," * (N // 2),
    "thousands": "1" + ",000" * (N // 4),
    "parens": "(" * N,
    "fracs": "\\frac{" * (N // 6),
    "texts": "\\text{" * (N // 6) + "}" * (N // 6),
    "steps": "1=1;" * (N // 4),
    "blank_steps": " ;" * (N // 2),
    "long_step": "1+" * (N // 2) + "=1",
    "units": "5" + " cm" * (N // 3),
    "dollars": "$" * N,
    "equals": "x = " * (N // 4),
    "letters": "a" * N,
    "newlines": "\n" * N,
}
FUNCTIONS = {
    "extract_answer": extract_answer,
    "extract_answer_lenient": lambda s: extract_answer(s, lenient=True),
    "is_equiv": lambda s: is_equiv(s, s),
    "is_equiv_short": lambda s: is_equiv(s[:500], s[:500][::-1]),
    "reward": lambda s: reward(s, "5"),
    "format_reward": format_reward,
    "step_rewards": step_rewards,
    "eval_arith": eval_arith,
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_inputs_are_fast(name):
    text = ADVERSARIAL[name]
    for fname, fn in FUNCTIONS.items():
        start = time.perf_counter()
        fn(text)
        elapsed = time.perf_counter() - start
        assert elapsed < 1.0, f"{fname} took {elapsed:.3f} s on {name}"  # target is ~10 ms; 1 s keeps CI calm


def test_adversarial_short_answers_are_fast():
    nasty = ["(" * 240 + "5" + ")" * 240, "\\{" * 60 + "1,2" + "\\}" * 60, "(1," * 120 + "1" + ")" * 120,
             ",".join("(%d.0,%d)" % (i, i) for i in range(32)), "9" * 10 + "^{1000}", "9" * 290 + "e1000",
             "\\text{" * 80 + "a" + "}" * 80, "\\frac{" * 60 + "1}{2}" * 60, "x=" * 200]
    for a in nasty:
        for b in nasty + [a[::-1]]:
            start = time.perf_counter()
            is_equiv(a, b)
            assert time.perf_counter() - start < 1.0
