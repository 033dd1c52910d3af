"""verify.py: tables of hand-written cases (extraction, equivalence, rewards, steps) and adversarial timing."""
import math
import random
import time
from fractions import Fraction

import pytest

import exact
import verify
from verify import eval_arith, extract_answer, format_reward, is_equiv, reward, step_rewards

# ---------------------------------------------------------------------------------------------------- extraction
EXTRACT = [
    # <answer> tags: the last block wins; a \boxed{} inside it wins over the rest of the block
    ("<think>x</think><answer>5</answer>", "5"),
    ("<answer>1</answer> then <answer>2</answer>", None),  # two different committed answers
    ("<answer>The result is \\boxed{7}.</answer>", "7"),
    ("<answer> 3 </answer>", "3"),
    ("<answer>x = 4</answer><|endoftext|>", "x = 4"),
    ("<answer>3</answer> \\boxed{4}", None),
    ("<answer>3</answer> \\boxed{3}", "3"),
    ("<answer>The answer is 18.</answer>", "18"),
    ("<answer>Answer: (B)</answer>", "(B)"),
    # \boxed / \fbox: the last balanced one
    ("\\boxed{5}", "5"),
    ("a \\boxed{1} b \\boxed{2}", "1, 2"),  # several boxes: one set answer
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("\\boxed{{a}{b}}", "{a}{b}"),
    ("\\boxed 5$", "5"),
    ("so $\\boxed 12$.", "12"),
    ("\\fbox{9}", "9"),
    ("\\boxed{12} and then \\boxed{1", None),  # cut off while committing to a new answer
    ("\\boxed{\\text{(A)}}", "\\text{(A)}"),
    ("thus \\boxed{ x = 3 }.", "x = 3"),
    ("\\boxed{4} #### 5", None),
    ("\\boxed{5} #### 5", "5"),
    ("The answer is \\boxed{8} indeed", "8"),
    # GSM8K ####: the rest of the line after the last one
    ("#### 42", "42"),
    ("48/2 = 24\n#### 1,234\n", "1,234"),
    ("#### 1\n#### 2", None),
    ("####5", "5"),
    ("#### 5\nso the answer is 6", None),
    # "the (final) answer is", "Final answer:"
    ("The answer is 42.", "42"),
    ("So the final answer is $\\frac{1}{2}$. I hope it is correct.", "\\frac{1}{2}"),
    ("the answer is 3.5 kg.", "3.5 kg"),
    ("**Final Answer:** 17", "17"),
    ("Final answer: x = 4", "x = 4"),
    ("The answer is: 9", "9"),
    ("The answer is 1 and more.\nThe answer is 2.", None),
    ("The answer is 2 apples.\nThe answer is 2.", "2"),
    ("The answer is **42**.", "42"),  # markdown emphasis
    ("**The answer is 42**", "42"),
    ("The answer is 7, since 3 + 4 = 7.", "7"),  # a justification after a comma
    ("The answer is 3.5, because half of 7 is 3.5.", "3.5"),
    ("The answer is $x^2$, as shown.", "x^2"),
    ("The answer is 1, 2, and 3.", "1, 2, and 3"),  # a list is not a justification
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
    ("10^{-3}", "0.001"), ("\\sqrt{4}", "2"), ("1\\frac{1}{2}", "1.5"),
    ("\\frac{-\\sqrt{3}}{2}", "-\\frac{\\sqrt3}{2}"), ("2π", "2\\pi"),
]

EQUIV_FALSE = [
    ("5", "6"), ("abc", "abd"), ("", ""), ("", "0"), (None, "5"), ("5", None),  # basics
    ("1,2", "12"), ("1,2", "1.2"), ("1,000", "1"), ("1,00", "100"), ("12,34", "1234"),  # commas
    ("-5", "5"), ("5", "-5"), ("\\pm 3", "3"),  # signs
    ("2.51", "2.5"), ("0.3333", "1/3"), ("0.33", "\\frac{1}{3}"),  # exact, no float tolerance
    ("3.14", "3.1416"), ("0.333", "0.3333"), ("2.5", "2.501"), ("1.0001", "1"), ("0.125", "0.1249"),  # issue 36:
    # no tolerance
    ("99.99", "100"), ("100000", "100001"), ("1.00001", "1"), ("\\frac{1}{3}", "0.3333"), ("-2.5", "-2.499"),
    ("1/2", "2"), ("\\frac{1}{2}", "\\frac{2}{1}"), ("2\\frac{1}{2}", "21/2"), ("\\frac{1}{0}", "0"),  # fractions
    ("\\frac{1}{2x}", "\\frac{1}{2}x"), ("1/0", "0"), ("\\frac{1}{0}", "\\infty"),
    ("50\\%", "5"), ("5 cm", "6"), ("2ab", "2"), ("x = 5", "6"), ("x + y = 5", "5"),
    ("\\sqrt{2}", "\\sqrt{3}"), ("\\sqrt{4}", "3"),  # radicals are exact: sqrt 4 = 2 (in EQUIV_TRUE), not 3
    ("(1,2)", "(2,1)"), ("(1,2)", "[1,2]"), ("(1,2]", "(1,2)"), ("(1,2)", "1,2"), ("(1,2,3)", "(1,2)"),
    ("(-\\infty, 3]", "(-\\infty, 3)"), ("\\{1,2\\}", "\\{1,3\\}"), ("1,2", "1,2,3"), ("1,1,2", "1,2,2"),
    ("1e3", "100"), ("10^{3}", "100"), ("1.5\\times10^{3}", "150"),  # scientific
    ("10^10^10", "1"), ("10^{100000}", "1"), ("1e100000", "10^{100000}"), ("1e1001", "10^{1001}"),  # rejected
    ("1" + "0" * 400, "1e400"),  # over-long numbers are rejected, not computed
    ("A", "B"), ("\\text{(A)}", "(B)"), ("yes", "no"), ("2\\mathrm{i}", "2"), ("x\\infty", "\\infty"),
    ("\\frac{x+1}{2}", "x+1/2"), ("x = 2, y = 3", "2"),
    ("5" + " " * 100_001, "5"), ("x" * 100_001, "x" * 100_001),  # past MAX_LONG answers are never equivalent
    ("9" * 600, "9" * 599 + "8"), ("x" * 600, "x" * 599 + "y"), ("1" * 600, "1" * 600 + "0"),  # long near-misses
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


# ---------------------------------------------------------------------------------------------------- normal form
SYMBOLIC_TRUE = [
    # polynomials: commutativity, distribution, small integer powers, implicit products, \cdot / \times / \div
    ("(x+1)^2", "x^2+2x+1"), ("x\\cdot 2", "2x"), ("2(x+1)", "2x+2"), ("x^{2}", "x^2"), ("(x-1)(x+1)", "x^2-1"),
    ("x^2 y", "y x^2"), ("\\left(x + y\\right)^{3}", "x^3+3x^2y+3xy^2+y^3"), ("a(b+c)", "ab+ac"), ("x \\times 3", "3x"),
    ("6x \\div 2", "3x"), ("-(x-2)", "2-x"), ("x^0", "1"), ("2x - x", "x"), ("a_1 + a_2", "a_{2}+a_{1}"),
    ("y = 2x+1", "1+2x"), ("\\frac{n(n+1)}{2}", "\\frac{n^2+n}{2}"), ("x^3", "x \\cdot x \\cdot x"),
    # rational functions
    ("\\frac{x+2}{7}", "\\frac{x}{7}+\\frac{2}{7}"), ("\\frac{x^2-1}{x-1}", "x+1"), ("\\frac{1}{x^2}", "x^{-2}"),
    ("\\frac{x}{x+1}", "1-\\frac{1}{x+1}"), ("\\dfrac{2}{x}+\\dfrac{1}{y}", "\\frac{2y+x}{xy}"),
    # radicals, reduced and rationalised
    ("\\sqrt{8}", "2\\sqrt{2}"), ("\\sqrt{12}", "2\\sqrt3"), ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("\\sqrt[3]{27}", "3"), ("\\sqrt[3]{-8}", "-2"), ("\\sqrt[4]{4}", "\\sqrt{2}"),
    ("\\sqrt{\\frac{1}{2}}", "\\frac{\\sqrt2}2"),
    ("\\sqrt{2}\\sqrt{3}", "\\sqrt{6}"), ("(1+\\sqrt{2})^2", "3+2\\sqrt{2}"), ("\\frac{1}{\\sqrt{2}+1}", "\\sqrt{2}-1"),
    ("\\frac{1}{\\sqrt2+\\sqrt3}", "\\sqrt3-\\sqrt2"), ("8^{2/3}", "4"), ("2^{1/2}", "\\sqrt2"),
    ("\\sqrt{3^2+4^2}", "5"),
    ("\\frac{3}{\\sqrt{3}}", "\\sqrt{3}"), ("3\\sqrt{2}", "\\sqrt{18}"), ("\\sqrt{50}+\\sqrt{2}", "6\\sqrt2"),
    ("\\frac{-1+\\sqrt{5}}{2}", "-\\frac{1}{2}+\\frac{\\sqrt{5}}{2}"), ("\\sqrt{0}", "0"),
    # i, pi, e, degrees
    ("4i+3", "3+4i"), ("i^2", "-1"), ("i^3", "-i"), ("\\frac{1}{i}", "-i"), ("(3+4i)(3-4i)", "25"),
    ("\\sqrt{-4}", "2i"),
    ("\\frac{1+i}{1-i}", "i"), ("2+2i", "2(1+i)"), ("\\frac{1}{2}\\pi", "\\frac{\\pi}{2}"), ("2\\pi r", "2r\\pi"),
    ("\\pi r^2", "r^2\\pi"), ("e^2", "e \\cdot e"), ("\\frac{9\\pi}{4}", "2.25\\pi"), ("30^\\circ", "30"),
    # integer functions, nested fractions, repeating decimals, mixed numbers
    ("5!", "120"), ("0!", "1"), ("\\frac{10!}{8!}", "90"), ("\\frac{6!}{2!4!}", "15"), ("\\binom{5}{2}", "10"),
    ("\\dbinom{10}{3}", "\\binom{10}{7}"),
    ("\\log_2 8", "3"), ("\\log_{4} 8", "\\frac{3}{2}"), ("\\log_2 \\frac{1}{8}", "-3"), ("\\log_{10} 1", "0"),
    ("\\frac{\\frac{1}{2}}{3}", "\\frac{1}{6}"), ("\\frac{1}{\\frac{1}{\\frac{1}{2}}}", "\\frac12"),
    ("0.\\overline{3}", "\\frac13"), ("0.1\\overline{6}", "\\frac{1}{6}"), ("1.\\overline{09}", "\\frac{12}{11}"),
    ("-2\\frac{1}{2}", "-\\frac{5}{2}"),
    # plain numbers through the form: powers, products, scientific notation
    ("2^{10}", "1024"), ("3 \\cdot 2^{5}", "96"), ("2.5 \\times 10^{-1}", "\\frac14"), ("10^{1000}", "1e1000"),
    # inside tuples, intervals and sets: element-wise
    ("(\\sqrt{8}, x^2)", "(2\\sqrt{2}, x\\cdot x)"), ("[\\frac{1}{\\sqrt3}, 2)", "[\\frac{\\sqrt{3}}{3}, 2)"),
    ("\\{1+i, 1-i\\}", "\\{1-i, i+1\\}"),
]

SYMBOLIC_FALSE = [
    # look-alikes a careless normaliser accepts
    ("\\sqrt{8}", "4"), ("(x+1)^2", "x^2+1"), ("5!", "100"), ("\\log_2 8", "2"), ("2x", "x2"), ("x^2", "2x"),
    ("\\frac{1}{2x}", "\\frac{1}{2}x"), ("(x+y)^3", "x^3+y^3"), ("\\frac{x}{x+1}", "\\frac{1}{x+1}"), ("3+4i", "3-4i"),
    ("\\frac{\\pi}{2}", "\\frac{2}{\\pi}"), ("\\sqrt{2}+\\sqrt{3}", "\\sqrt{5}"), ("2^{10}", "10^2"),
    ("\\sqrt[3]{8}", "\\sqrt{8}"),
    ("8^{1/3}", "\\sqrt{8}"), ("i^2", "1"), ("\\frac{1}{3}", "0.\\overline{33}3"), ("0.\\overline{3}", "0.3"),
    ("\\binom{5}{2}", "\\binom{5}{3}+1"), ("(5!)!", "120"), ("x_1", "x_2"), ("a", "b"), ("\\pi", "3.14159"),
    ("30^\\circ", "\\frac{\\pi}{6}"), ("e", "2.718281828"), ("\\sqrt{2}", "1.414213562"),
    # ambiguous or undecidable: no normal form, so never equal
    ("yes", "sey"), ("abc", "cab"), ("g(f(x))", "f(g(x))"), ("f(x+1)", "f(x)+f(1)"), ("2^3^4", "2^{81}"),
    ("2^3^4", "4096"), ("2^3!", "64"), ("5!!", "15"), ("x+2\\frac{1}{2}", "x+\\frac{5}{2}"), ("\\pi 6", "6\\pi"),
    ("\\sqrt{x^2}", "x"), ("\\sqrt[4]{-4}", "1+i"), ("\\log 100", "2"), ("\\ln e", "1"),
    ("\\frac{1}{\\sqrt{2}-\\sqrt{2}}", "0"), ("\\frac{0}{0}", "0"), ("0^{0}", "1"), ("\\frac{x}{0}", "\\frac{y}{0}"),
    ("1 \\pm \\sqrt{2}", "\\pm\\sqrt{2}"), ("x \\cdots 2", "2xs"), ("1000!", "1000!+0"), ("\\binom{1000}{2}", "499500"),
    ("\\sqrt{2 \\cdot 10^{12}}", "10^6\\sqrt{2}"), ("(x+1)^{32}", "(x+1)^{32}+0"),  # past MAX_FACT, _RADICAND, _WORK
]


@pytest.mark.parametrize("pred,gold", SYMBOLIC_TRUE)
def test_normal_form_true(pred, gold):
    assert is_equiv(pred, gold)
    assert is_equiv(gold, pred)


@pytest.mark.parametrize("pred,gold", SYMBOLIC_FALSE)
def test_normal_form_false(pred, gold):
    assert not is_equiv(pred, gold)
    assert not is_equiv(gold, pred)


def _poly_latex(coef: dict, rng: random.Random, style: int) -> str:
    """{(i, j): c} (c x^i y^j) as LaTeX: style 0 canonical, 1 shuffled with braces and \\cdot, 2 repeated factors."""
    terms = []
    for (i, j), c in sorted(coef.items(), reverse=True):
        names = [("x", i), ("y", j)] if style != 1 else rng.sample([("x", i), ("y", j)], 2)
        mono = "".join("\\cdot ".join([v] * e) if style == 2 else v + (f"^{{{e}}}" if style else f"^{e}") if e > 1
                       else v for v, e in names if e)
        c_text = str(abs(c)) if abs(c) != 1 or not mono else ""
        sep = "\\cdot " if style == 1 and c_text and mono else ""
        terms.append(("-" if c < 0 else "+") + c_text + sep + mono)
    if style:
        rng.shuffle(terms)
    return "".join(terms).lstrip("+") or "0"


def test_random_polynomials_print_equal_and_perturbed_unequal():
    rng = random.Random(0)
    for _ in range(200):
        a, b = {(rng.randint(0, 2), rng.randint(0, 1)): rng.randint(-4, 4) or 1 for _ in range(2)}, \
            {(rng.randint(0, 1), rng.randint(0, 2)): rng.randint(-4, 4) or 1 for _ in range(2)}
        prod = {}  # the expansion of a * b by a naive double loop: the independent expectation
        for (i, j), c in a.items():
            for (k, m), d in b.items():
                prod[(i + k, j + m)] = prod.get((i + k, j + m), 0) + c * d
        prod = {e: c for e, c in prod.items() if c}
        factored = f"({_poly_latex(a, rng, 1)})({_poly_latex(b, rng, 0)})"
        forms = [_poly_latex(prod, rng, s) for s in range(3)] + [factored]
        for f in forms:
            assert is_equiv(f, forms[0]), (f, forms[0])
        e = rng.choice(sorted(prod)) if prod else (0, 0)
        off = prod | {e: prod.get(e, 0) + rng.choice([-1, 1])}
        assert not is_equiv(_poly_latex(off, rng, 1), factored), (off, factored)


def test_random_radicals_and_complex_numbers():
    rng = random.Random(1)
    for _ in range(200):
        k, m, n = rng.randint(1, 12), rng.choice([2, 3, 5, 6, 7, 10, 11]), rng.randint(1, 9)
        assert is_equiv(f"\\sqrt{{{k * k * m}}}", f"{k}\\sqrt{{{m}}}")
        assert not is_equiv(f"\\sqrt{{{k * k * m}}}", f"{k + 1}\\sqrt{{{m}}}")
        assert is_equiv(f"\\frac{{{n}}}{{\\sqrt{{{m}}}}}", f"\\frac{{{n}\\sqrt{{{m}}}}}{{{m}}}")
        assert not is_equiv(f"\\frac{{{n}}}{{\\sqrt{{{m}}}}}", f"\\frac{{{n}\\sqrt{{{m}}}}}{{{m + 1}}}")
        a, b, c, d = (rng.randint(-6, 6) for _ in range(4))
        re_, im = a * c - b * d, a * d + b * c  # (a + bi)(c + di), by hand
        assert is_equiv(f"({a}+{b}i)({c}+{d}i)".replace("+-", "-"), f"{im}i+{re_}".replace("+-", "-"))
        assert not is_equiv(f"({a}+{b}i)({c}+{d}i)".replace("+-", "-"), f"{im}i+{re_ + 1}".replace("+-", "-"))


def test_bounds_reject_before_computing(monkeypatch):
    calls = []
    monkeypatch.setattr(exact, "factorial", lambda n: calls.append(n) or math.factorial(n))
    assert not is_equiv("1000!", "1000!+0") and not is_equiv("10^{100000}", "10^{100000}+0")
    assert calls == []  # 1000! was never computed: past MAX_FACT
    assert is_equiv("500!", "500!+0") and calls == [500, 500]
    products = []
    real_mul = exact.Arith.mul
    monkeypatch.setattr(exact.Arith, "mul", lambda f, p, q: products.append(len(p) * len(q)) or real_mul(f, p, q))
    assert not is_equiv("(1+i)^{5000}", "(1+i)^{5000}+0")  # 2 terms, degree 0, 2500 bits: only MAX_WORK stops it
    assert sum(products) <= 3 * (exact.MAX_WORK + exact.MAX_TERMS ** 2)  # each form stops at its budget (+ 1 try)
    products.clear()
    monkeypatch.setattr(exact, "MAX_WORK", 4)  # a tiny budget: enough to compare x+1 with 1+x, not for (x+1)^2
    assert is_equiv("x+1", "1+x") and not is_equiv("(x+1)^2", "x^2+2x+1")
    monkeypatch.setattr(exact, "MAX_BITS", 64)
    assert is_equiv("2^{31}", "2147483648")
    with pytest.raises(ValueError):  # 2 bits * 64 > 64: the form refuses before computing
        exact.Parser("2^{64}").expr(whole=True)
    assert is_equiv("2^{64}", "18446744073709551616")  # decided by exponent arithmetic instead (exact.Power)
    assert not is_equiv("2^{64}", "18446744073709551617") and not is_equiv("2^{64}", "2^{63}")
    monkeypatch.setattr(exact, "MAX_RADICAND", 100)
    assert is_equiv("\\sqrt{98}", "7\\sqrt{2}") and not is_equiv("\\sqrt{102}", "\\sqrt{102}+0")


def _random_arith(rng: random.Random, depth: int) -> tuple[str, Fraction]:
    """A random numeric LaTeX expression and its value, computed here by hand (the independent expectation)."""
    if depth == 0 or rng.random() < 0.3:
        n = rng.randint(-9, 9)
        return (f"({n})" if n < 0 else str(n)), Fraction(n)
    (a, x), (b, y) = _random_arith(rng, depth - 1), _random_arith(rng, depth - 1)
    op = rng.choice(["+", "-", "\\cdot", "\\frac", "^"] if y else ["+", "-", "\\cdot"])
    if op == "\\frac":
        return f"\\frac{{{a}}}{{{b}}}", x / y
    if op == "^":
        k = rng.randint(0, 3) if x else rng.randint(1, 3)
        return f"({a})^{{{k}}}", x ** k
    return f"({a}){op}({b})", x + y if op == "+" else x - y if op == "-" else x * y


def test_numeric_value_pass_matches_hand_computed_values():
    """exact.value (iterative) and exact.Parser (recursive) agree with values computed by construction."""
    rng = random.Random(5)
    for _ in range(300):
        s, v = _random_arith(rng, rng.randint(1, 5))
        assert exact.value(s) == v, s
        assert exact.Parser(s).expr(whole=True).rational() == v, s
        assert is_equiv(s, str(v)) and not is_equiv(s, str(v + Fraction(1, 7))), s


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
    ("The answer is 7, since 3 + 4 = 7.", "7", 1.0),
    ("The answer is **42**.", "42", 1.0),
    ("so 3 + 4 = 7 and the rest is 7", "7", 0.0),  # still no last-number fallback
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("The answer is $\\frac{1}{\\sqrt{2}}$.", "\\frac{\\sqrt2}{2}", 1.0),
]


@pytest.mark.parametrize("completion,gold,expected", REWARD)
def test_reward(completion, gold, expected):
    assert reward(completion, gold) == expected


# ---------------------------------------------------------------------------------------------------- the final answer
FINAL = [  # (completion, gold, reward): the answer is what the completion commits to last, and nothing else
    # several different committed answers: boxes, ####, "the answer is" alike
    ("It is either \\boxed{12} or perhaps \\boxed{15}.", "12", 0.0),
    ("It is either \\boxed{12} or perhaps \\boxed{15}.", "15", 0.0),
    ("So \\boxed{12}.\n#### 15", "15", 0.0),
    ("#### 12\nOn second thought the answer is 15.", "12", 0.0),  # issue 36: a correction; 15 earns 1 (CORRECTIONS)
    ("The answer is 12.\nThe answer is 15.", "15", 0.0),
    ("<answer>12</answer><answer>15</answer>", "15", 0.0),
    ("<think>so</think><answer>12</answer> and \\boxed{15}", "12", 0.0),
    # a retraction after the last answer, with no new one
    ("So \\boxed{12}. Wait, I dropped a term: it should be 13.", "12", 0.0),
    ("#### 40\nHmm, that is wrong, let me recount the pens.", "40", 0.0),
    ("The answer is 6. Actually no, I misread the question.", "6", 0.0),
    ("<answer>6</answer> Oops, that was a mistake.", "6", 0.0),
    # a box the text itself rejects
    ("x = \\boxed{-2} is impossible since lengths are positive, so x = 3.", "-2", 0.0),
    ("x = \\boxed{-2} is impossible since lengths are positive, so x = 3.", "3", 0.0),
    # cut off while committing: an unclosed box, or "the answer is" at the end
    ("First try: \\boxed{8}. Redoing it: 2 \\cdot 5 = \\boxed{1", "8", 0.0),
    ("#### 8\nNo wait. The final answer is", "8", 0.0),
    # a goal or a condition is not a commitment
    ("We must show that the answer is 20. Consider the first", "20", 0.0),
    ("If the answer is 20 then 4x = 80, so", "20", 0.0),
    ("Maybe the answer is 20. Let us compute", "20", 0.0),
    ("If the answer were 4 we would need 2x = 8. Solving gives x = 5.\n#### 5", "5", 1.0),
    ("Is it 4? Check: 2 + 2 = 4. The answer is 4.", "4", 1.0),
    # the same answer committed twice is one answer
    ("The answer is \\boxed{7}.\n#### 7", "7", 1.0),
    ("The final answer is $\\boxed{30}$. I hope it is correct.", "30", 1.0),
    ("Final Answer: The final answer is $30$. I hope it is correct.", "30", 1.0),
    ("The answer is 30 apples.\n#### 30", "30", 1.0),
    ("\\boxed{\\frac12} so the answer is 0.5", "1/2", 1.0),
    ("<think>maybe 4, no, 5</think><answer>5</answer>", "5", 1.0),  # thinking before the answer block is not hedging
    ("Let me double-check: 6 \\times 7 = 42. So \\boxed{42}. Verified: 42 / 7 = 6.", "42", 1.0),
    # several boxes are one set answer: only a gold list of those values matches
    ("The roots are \\boxed{2} and \\boxed{-3}.", "-3, 2", 1.0),
    ("The roots are \\boxed{2} and \\boxed{-3}.", "\\{2, -3\\}", 1.0),
    ("The roots are \\boxed{2} and \\boxed{-3}.", "2", 0.0),
    ("The roots are \\boxed{2} and \\boxed{-3}.", "2, 3", 0.0),
    ("The roots are \\boxed{2} and \\boxed{-3}. The answer is 2 and -3.", "2, -3", 1.0),
    ("The roots are \\boxed{2} and \\boxed{-3}. The answer is 2.", "2", 0.0),
    # the answer ends where its sentence or clause does
    ("#### 30 (so 30 apples are left)", "30", 1.0),
    ("The answer is 8, not 6.", "8", 1.0),
    ("The answer is 8, not 6.", "6", 0.0),
    ("The answer is 56 since 7 times 8 is 56", "56", 1.0),
    ("The answer is $\\$25$.", "25", 1.0),
    ("The answer is 4 or 9.", "4", 0.0),  # a hedge inside one answer is no answer
    ("The answer is: \n\n$42$", "42", 1.0),
    ("**Answer:** 17 apples", "17", 1.0),
    ("The answer is 5! ways.", "120", 1.0),  # a factorial, not an exclamation
    ("So the answer is (1, 2), as claimed.", "(1,2)", 1.0),
    ("The answer is the number of pairs, which is 10.\nSo the answer is \\boxed{10}.", "10", 1.0),  # a description
    ("<think>is the answer 4? no wait, 4 + 1</think>The answer is \\boxed{5}.", "5", 1.0),  # thinking is no commitment
    ("<think>so the answer is 4</think>", "4", 0.0),
    ("#### Step 1: add\n3 + 4 = 7\n#### Step 2: double\n#### 14", "14", 1.0),  # markdown headings are not answers
    ("The answer is $5$ and $6$.", "5, 6", 1.0), ("The answer is $5$ and $6$.", "5", 0.0),
    ("The answer is $5$ or $6$.", "5", 0.0),
    ("\\boxed{5}\n\nWait, let me double check: 2 + 3 = 5. Correct.", "5", 1.0),  # a doubt it settles
    ("\\boxed{5}. Wait, she ate one of them.", "5", 0.0),  # one it does not
    ("The answer is:\n\\[\n\\boxed{5}\n\\]", "5", 1.0), ("The final answer is:\n$$\n12\n$$", "12", 1.0),  # display math
]


@pytest.mark.parametrize("completion,gold,expected", FINAL)
def test_final_answer(completion, gold, expected):
    assert reward(completion, gold) == expected


HEDGES = [  # templates of completions that commit to two answers, or to one and take it back
    "maybe \\boxed{{{a}}}, or else \\boxed{{{b}}}",
    "\\boxed{{{a}}}. Hmm, no: recounting gives {b}.",
    "#### {a}\nThat is wrong, let me recount.",
    "\\boxed{{{a}}}, though {b} is also possible.",  # issue 36: "{a} is impossible ...; the answer is {b}" corrects
    "\\boxed{{{a}}} (or possibly \\boxed{{{b}}})",
    "\\boxed{{{a}}}. Hmm, it could also be \\boxed{{{b}}}.",
    "The answer is {a}.\n#### {b}",
    "\\boxed{{{a}}}\nThe final answer is {b}.",
    "<answer>{a}</answer>\n<answer>{b}</answer>",
    "So \\boxed{{{a}}}. Wait, that is not right.",
    "The answer is {a}. Actually, I made a mistake in step 2.",
    "First \\boxed{{{a}}}, then recomputing \\boxed{{",
    "#### {a}\n#### {b}",
]


def test_reward_hacking_hedges_earn_nothing():
    """A batch of hedging completions earns 0 whatever the gold: either of its answers, or another one."""
    rng = random.Random(3)
    for _ in range(40):
        a, b = rng.sample(["7", "12", "\\frac{3}{4}", "2\\sqrt{2}", "x+1", "(1, 2)", "-5", "0.5", "\\pi"], 2)
        for t in HEDGES:
            text = t.format(a=a, b=b)
            for gold in (a, b, "13"):
                assert reward(text, gold) == 0.0, (text, gold)
    for t in HEDGES:  # the control: each template with one answer stated once, no retraction, is rewarded
        assert reward(t.format(a="12", b="12").split("\n")[0].split(" Wait")[0].split(" Actually")[0]
                      .split("Hmm")[0].split(", though")[0].split(" (or")[0].split(", then")[0], "12") == 1.0, t


# self-correction (issue 36): the last commitment counts when every earlier different one is withdrawn by a retraction
CORRECTIONS = [  # (completion, its corrected answer: 1, the withdrawn one: 0)
    ("First attempt: \\boxed{12}. Checking again I double-counted two cases, so 12 + 2 = 14. \\boxed{14}", "14", "12"),
    ("\\boxed{10} is wrong because of overflow; the right value is \\boxed{-6}", "-6", "10"),
    ("The answer is 42. Wait, I made an arithmetic error: 6 \\times 6.5 = 39. The answer is 39.", "39", "42"),
    ("Tentatively, the final answer is 12. After re-checking the last case there is one more: the final answer is 13.",
     "13", "12"),
    ("So the total is \\boxed{56}. Hmm, that's not right. Let me redo the product: 7 \\cdot 9 = 63. \\boxed{63}", "63",
     "56"),
    ("The answer is 15.\n\nActually, I made an error: the discount applies twice.\nThe answer is 12.", "12", "15"),
    ("#### 24\nCorrection: she sold 30 on Monday.\n#### 30", "30", "24"),
    ("The sum is \\boxed{101}. Let me re-check... I see, I forgot the carry. The sum is \\boxed{111}.", "111", "101"),
    ("\\boxed{7}\n\nWait, no. I misread the question: it asks for the remainder. \\boxed{3}", "3", "7"),
    ("The answer is 8. No, that's incorrect; the answer is 9.", "9", "8"),
    ("So $\\boxed{\\frac{1}{3}}$. Oops, I inverted the fraction: $\\boxed{3}$.", "3", "1/3"),
    ("Final answer: 20. Hmm, wait: 4 \\times 6 = 24. Final answer: 24.", "24", "20"),
    ("<answer>12</answer> Wait, that is wrong. <answer>14</answer>", "14", "12"),
    ("Thus x = \\boxed{2}. On second thought, x = 2 is extraneous; the only solution is \\boxed{-3}.", "-3", "2"),
    ("The answer is 100. My mistake: the rate is per minute, so the answer is 6000.", "6000", "100"),
    ("We get \\boxed{18}. But that can't be, the total is only 15. Recounting: \\boxed{12}.", "12", "18"),
    ("\\boxed{(1, 2)}. Wait, the order is reversed: \\boxed{(2, 1)}", "(2,1)", "(1,2)"),
    ("#### 12\nOn second thought the answer is 15.", "15", "12"),
    ("\\boxed{4}. Actually, let me reconsider: it asks for the perimeter. \\boxed{16}", "16", "4"),
    ("\\boxed{2\\sqrt{2}} is impossible because it is too big; hence the answer is \\frac{3}{4}.", "3/4", "2\\sqrt2"),
    ("The roots are \\boxed{2} and \\boxed{3}. Wait, a sign error: the roots are \\boxed{2} and \\boxed{-3}.", "2, -3",
     "2, 3"),  # a set answer corrected: the boxes since the retraction are the answer
    # hedge withdrawn
    ("\\boxed{12} or maybe \\boxed{14}. Hmm, let me recheck: only 14 works. \\boxed{14}", "14", "12"),
    ("\\boxed{5}. Wait, wrong. \\boxed{6}. No, that's a mistake too: \\boxed{7}", "7", "6"),  # two withdrawn
]
HEDGED = [  # (completion, gold): nothing withdraws the earlier answer, or the last one is doubted: 0 for any gold
    ("\\boxed{12} or maybe \\boxed{14}", "14"), ("\\boxed{12} (or possibly \\boxed{14})", "14"),
    ("The answer is either 12 or 14.", "12"), ("The answer is 12, though 14 is also possible.", "12"),
    ("\\boxed{12}. Hmm, it could also be \\boxed{14}.", "14"),
    ("\\boxed{12}, but I might be wrong; maybe \\boxed{14}", "14"),
    ("The answer is 12. But if I'm wrong, the answer is 14.", "14"), ("\\boxed{12}? Or \\boxed{14}?", "14"),
    ("The answer is 12, but I'm not sure.", "12"), ("\\boxed{14}. Wait, I made a mistake somewhere.", "14"),
    ("The answer is 14. Hmm, let me recheck that.", "14"),
    ("\\boxed{12}. Wait, actually it might be \\boxed{14}.", "14"),
    ("\\boxed{12}\n\\boxed{14}", "14"), ("The answer is 12.\nThe answer is 14.", "14"), ("The answer is 14?", "14"),
    ("I think \\boxed{12}, although \\boxed{14} is equally plausible.", "14"),
    ("#### 12\nOr it could be 14, depending on rounding.", "12"),
]


ADDED = [  # (completion, the set answer): a soft cue that adds an answer withdraws nothing; the boxes are one set
    ("x = \\boxed{2}. Wait, there is another root: x = \\boxed{-3}.", "2, -3"),
    ("x = \\boxed{2}. Hmm, the other solution is \\boxed{-3}.", "\\{-3, 2\\}"),
    ("x = \\boxed{2}. Actually, both roots work: \\boxed{-3} as well.", "-3, 2"),
]


@pytest.mark.parametrize("completion,answer", ADDED)
def test_a_soft_cue_that_adds_an_answer_keeps_the_set(completion, answer):
    assert reward(completion, answer) == 1.0 and reward(completion, "-3") == 0.0 and reward(completion, "2") == 0.0


@pytest.mark.parametrize("completion,right,withdrawn", CORRECTIONS)
def test_a_correction_earns_its_last_answer(completion, right, withdrawn):
    assert reward(completion, right) == 1.0 and reward(completion, withdrawn) == 0.0


@pytest.mark.parametrize("completion,gold", HEDGED)
def test_a_hedge_earns_nothing(completion, gold):
    for g in (gold, "12", "14"):
        assert reward(completion, g) == 0.0


def test_enumerating_retracted_answers_earns_only_the_last():
    """Listing candidates and 'retracting' all but the last: only the last commitment is ever paid, so such a
    completion earns what its last answer alone earns and never a withdrawn one (the cap of two withdrawn
    answers is gone: it bought nothing, see test_verify_cases.test_no_completion_is_paid_for_two_answers)."""
    for k in range(1, 9):
        wrong = "".join(f"\\boxed{{{i}}} is wrong. " for i in range(k))
        assert reward(wrong + "\\boxed{42}", "42") == 1.0, k
        assert all(reward(wrong + "\\boxed{42}", str(i)) == 0.0 for i in range(k)), k  # a withdrawn one: never
    assert reward("\\boxed{7} is wrong. \\boxed{7} is wrong again. \\boxed{7}, wrong. \\boxed{42}", "42") == 1.0
    listed = "".join(f"\\boxed{{{i}}}" + (" is wrong. " if i != 42 else ". ") for i in range(38, 46))
    assert reward(listed, "42") == 0.0  # the last one retracted: the right one in the middle earns nothing
    assert reward(listed + "\\boxed{42}", "42") == 1.0 and reward(listed + "\\boxed{42}", "45") == 0.0
    assert reward("\\boxed{41} wrong \\boxed{43} wrong \\boxed{42} wrong", "42") == 0.0  # and all retracted


WRAPPED = [  # presentation macros around an answer with braces of its own (issue 36): dropped, the rest compared
    "\\mathbf{\\frac{3}{8}}", "\\textbf{\\frac{3}{8}}", "\\mathrm{\\frac{3}{8}}", "\\text{\\frac{3}{8}}",
    "\\displaystyle{\\frac{3}{8}}", "\\boldsymbol{\\frac{3}{8}}", "\\mathit{\\frac{3}{8}}", "\\textstyle{\\frac{3}{8}}",
    "\\operatorname{\\frac{3}{8}}", "\\bm{\\frac{3}{8}}", "\\mathsf{\\frac{3}{8}}", "\\textit{\\frac{3}{8}}",
    "\\underline{\\frac{3}{8}}", "\\pmb{\\frac{3}{8}}", "{\\bf \\frac{3}{8}}", "\\color{red}{\\frac{3}{8}}",
    "\\textcolor{blue}{\\frac{3}{8}}", "\\scriptstyle{\\frac{3}{8}}", "\\mathbf{\\boldsymbol{\\frac{3}{8}}}",
    "\\frac{\\mathbf{3}}{\\mathbf{8}}", "\\mbox{\\frac{3}{8}}", "\\textrm{\\dfrac{3}{8}}", "\\mathtt{\\frac{3}{8}}",
]


@pytest.mark.parametrize("pred", WRAPPED)
def test_presentation_wrappers_are_dropped(pred):
    assert is_equiv(pred, "0.375") and is_equiv("0.375", pred) and is_equiv(pred, "\\frac{3}{8}")
    assert not is_equiv(pred, "0.38") and not is_equiv(pred, "\\frac{8}{3}")
    assert reward(f"So the answer is $\\boxed{{{pred}}}$.", "0.375") == 1.0


FORMS_TRUE = [  # the forms a MATH grader accepts (item 3 of issue 23)
    ("seven", "7"), ("Twenty-one", "21"), ("2.5 thousand", "2500"), ("one hundred and five", "105"),
    ("seven apples", "7"), ("3 1/4", "13/4"), ("-2 1/2", "-5/2"), ("\\mathbf{7}", "7"), ("\\boldsymbol{x+1}", "1+x"),
    ("\\Bigl( 1, 2 \\Bigr)", "(1,2)"), ("\\bigl[ 0, 1 \\bigr)", "[0,1)"),
    ("\\left\\lbrace 1, 2 \\right\\rbrace", "\\{2,1\\}"),
    ("{-}7", "-7"), ("(-\\infty, +\\infty)", "(-\\infty, \\infty)"), ("[3, +\\infty)", "[3,\\infty)"),
    ("8\\sqrt{2} \\text{ m}", "8\\sqrt2"), ("8\\sqrt{2} m", "8\\sqrt2"), ("4\\pi \\text{ cm}^2", "4\\pi"),
    ("5 > y", "y < 5"), ("x \\geq 3", "3 \\le x"), ("x \\le 4", "(-\\infty, 4]"), ("x > -1", "(-1, \\infty)"),
    ("2 < x \\leq 5", "(2, 5]"), ("g(3) = 10", "10"), ("CD = 9", "9"), ("m\\angle ABC = 40^\\circ", "40"),
    ("p = 1, q = 4", "(1, 4)"), ("(m, n) = (1, 4)", "(1, 4)"), ("\\pm 3", "3, -3"), ("x = \\pm 3", "-3,3"),
    ("1 \\pm \\sqrt{2}", "1+\\sqrt2, 1-\\sqrt2"),
    ("\\begin{bmatrix} 0.25 & 1 \\\\ 2 & 3 \\end{bmatrix}",
     "\\begin{pmatrix} \\frac{1}{4} & 1 \\\\ 2 & 3 \\end{pmatrix}"),
    ("\\begin{pmatrix} 1 \\\\ -2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ {-}2 \\end{pmatrix}"),
    ("y^{1/2}", "\\sqrt{y}"), ("3^{1/3}", "\\sqrt[3]{3}"), ("3\\sqrt[3]{2}", "\\sqrt[3]{54}"),
    ("x^{3/2}", "x\\sqrt{x}"),
    ("\\frac{1}{\\sqrt[3]{2}}", "\\frac{\\sqrt[3]{4}}{2}"), ("\\sqrt[3]{x^3}", "x"), ("2^{-1/2}", "\\frac{\\sqrt2}{2}"),
    ("0.666\\ldots", "\\frac{2}{3}"), ("0.1666...", "\\frac16"), ("0.142857142857\\dots", "\\frac17"),
    ("-0.333\\ldots", "-1/3"),
    ("\\textbf{(C) } 7", "(C)"), ("\\textbf{(C) } 7", "7"), ("(B) \\frac{1}{2}", "B"),
    ("the dogs", "dog"), ("an equilateral triangle", "Equilateral Triangle"), ("Parties", "party"), ("boxes", "box"),
    ("110", "110_2"), ("1011_{2}", "1011"), ("A3", "A3_{16}"),
    ("½", "0.5"), ("3½", "7/2"), ("x²", "x^2"), ("2 × 3", "6"), ("−4", "-4"), ("x ≤ 4", "x \\le 4"),
    ("1, 2, and 3", "3, 2, 1"), ("Tom and Jerry", "Jerry and Tom"),
]
FORMS_FALSE = [  # their near misses
    ("seven", "8"), ("2.5 thousand", "250"), ("3 1/4", "3/4"), ("3 1/4", "31/4"), ("{-}7", "7"),
    ("(-\\infty, 4]", "(-\\infty, 4)"), ("8\\sqrt{2} \\text{ m}", "8\\sqrt3"), ("5 > y", "y > 5"),
    ("x \\le 4", "x < 4"),
    ("x \\le 4", "(-\\infty, 4)"), ("2 < x \\le 5", "[2, 5]"), ("g(3) = 10", "3"), ("x + y = 5", "5"),
    ("p = 1, q = 4", "(4, 1)"), ("p = 1, q = 4", "1"), ("\\pm 3", "3"), ("\\pm 3", "3, 3"),
    ("1 \\pm \\sqrt{2}", "\\pm \\sqrt2"),
    ("\\begin{bmatrix} 0.25 & 1 \\\\ 2 & 3 \\end{bmatrix}",
     "\\begin{pmatrix} \\frac{1}{4} & 1 \\\\ 3 & 2 \\end{pmatrix}"),
    ("\\begin{pmatrix} 1 & 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),  # the shape counts
    ("\\begin{vmatrix} 1 & 2 \\\\ 3 & 4 \\end{vmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"),
    ("y^{1/2}", "y"), ("3^{1/3}", "\\sqrt{3}"), ("3\\sqrt[3]{2}", "\\sqrt[3]{18}"),
    ("\\sqrt[3]{2}+\\sqrt[3]{3}", "\\sqrt[3]{5}"),
    ("\\sqrt{x^2}", "x"), ("\\sqrt[4]{x^4}", "x"), ("i^{1/2}", "i"),
    ("0.666\\ldots", "0.666"), ("0.666\\ldots", "\\frac{333}{500}"), ("3.14\\ldots", "\\pi"),
    ("0.12\\ldots", "\\frac{4}{33}"),
    ("\\textbf{(C) } 7", "(D)"), ("\\textbf{(C) } 7", "8"),
    ("cats", "dog"), ("yes", "ye"), ("the dog", "a cat"), ("111", "110_2"), ("110_3", "110_2"), ("6", "110_2"),
    ("½", "2"), ("x²", "2x"), ("1, 2, and 3", "1, 2"), ("2 and -3", "5"), ("3 seven", "37"),
    ("(a)+b", "a"), ("(b)^2", "b"), ("x_{1}", "x"), ("(-4)^{3/2}", "8i"), ("10_{2}", "2"),  # look-alikes of the rules
]


@pytest.mark.parametrize("pred,gold", FORMS_TRUE)
def test_grader_forms_true(pred, gold):
    assert is_equiv(pred, gold) and is_equiv(gold, pred)


@pytest.mark.parametrize("pred,gold", FORMS_FALSE)
def test_grader_forms_false(pred, gold):
    assert not is_equiv(pred, gold) and not is_equiv(gold, pred)


HUGE_TRUE = [  # past the size bounds, but decidable cheaply: identical forms, digits, exponent arithmetic
    ("9" * 3000, "9" * 3000), ("9" * 400, "9" * 400 + ".0"), ("1" * 350 + ".50", "0" + "1" * 350 + ".5"),
    ("2^{2^{100}}", "2^{1267650600228229401496703205376}"), ("2^{2^{100}}", "4^{2^{99}}"),
    ("\\frac{2^{2^{100}}}{2^{2^{100}}}", "1"), ("(3^{10^{30}})^{2}", "9^{10^{30}}"),
    ("6^{2^{64}}", "2^{2^{64}} \\cdot 3^{2^{64}}"),
    ("\\frac{1}{" * 300 + "2" + "}" * 300, "2"), ("\\frac{1}{" * 301 + "2" + "}" * 301, "0.5"),
]
HUGE_FALSE = [
    ("9" * 3000, "9" * 2999 + "8"), ("9" * 400, "9" * 400 + ".1"),
    ("2^{2^{100}}", "2^{1267650600228229401496703205377}"),
    ("\\frac{2^{2^{100}}}{2^{2^{100}}}", "2"), ("2^{2^{100}}+1", "2^{2^{100}}"), ("-2^{2^{100}}", "2^{2^{100}}"),
    ("\\frac{1}{" * 300 + "2" + "}" * 300, "\\frac12"), ("2^{2^{5000}}", "2^{2^{5000}}\\cdot 1"),  # past MAX_BITS twice
]


FIB = [0, 1]
for _ in range(90):
    FIB.append(FIB[-1] + FIB[-2])
HUGE_TRUE.append(("1+\\frac{1}{" * 80 + "1" + "}" * 80, f"{FIB[82]}/{FIB[81]}"))  # a continued fraction, by a loop


@pytest.mark.parametrize("pred,gold", HUGE_TRUE)
def test_huge_exact_answers_decided(pred, gold):
    start = time.perf_counter()
    assert is_equiv(pred, gold) and is_equiv(gold, pred)
    assert time.perf_counter() - start < 0.2  # a few ms alone; generous for a shared CI machine


@pytest.mark.parametrize("pred,gold", HUGE_FALSE)
def test_huge_exact_near_misses(pred, gold):
    start = time.perf_counter()
    assert not is_equiv(pred, gold) and not is_equiv(gold, pred)
    assert time.perf_counter() - start < 0.2


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
    ("(1)(2)", None), ("2(3)", None), ("2 (3)", None), ("2^3", None), ("3!", None),  # no implicit products, no powers
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


M, K = 1_000_000, 90_000
HOSTILE = [  # (completion, gold, reward): long runs of the characters the parser scans for, around a real answer
    ("#### 5" + " " * 50_000, 1.0), ("#### 5" + " " * M, 1.0), ("#### 5" + "\n" * M, 1.0),
    ("#### 5" + "\r\n\t " * N, 1.0),
    ("The answer is 5" + " " * M, 1.0), ("The answer is 5." + "\n" * M, 1.0), ("\\boxed{5}" + " " * M, 1.0),
    (" " * M + "\\boxed{5}", 1.0), ("\n" * M + "#### 5", 1.0), ("The answer is" + " " * M + "5", 1.0),
    ("The answer is:" + "\n" * M + "5", 1.0), ("\\boxed{" + " " * M + "5" + " " * M + "}", 1.0),
    ("\\boxed" + " " * M + "5", 1.0), ("<answer>" + " " * M + "5</answer>", 1.0),
    ("</think>" + " " * M + "#### 5", 1.0),
    ("{" * M + "\\boxed{5}", 1.0), ("}" * M + "\\boxed{5}", 1.0), ("\\" * M + "\\boxed{5}", 1.0),
    ("#" * M + "\n#### 5", 0.0), ("1" * M + "\n#### 5", 1.0), ("$" * M + "\\boxed{5}", 1.0),
    ("the answer is " * (M // 14) + "5", 0.0), ("\\boxed{" * (M // 7) + "5}", 0.0), ("#### " * (M // 5) + "5", 0.0),
    ("\\boxed{5" + " " * M, 0.0), ("#### 5" + "{" * M, 0.0), ("#### 5 " + "1 " * M, 0.0),  # unclosed, or no end
    ("\\boxed{" + "\\mathbf{\\frac{1}{8}}+" * 99 + "\\textbf{\\frac{1}{8}}}", "12.5", 1.0),
    ("\\boxed{" + "\\mathbf{" * 400 + "5}", 0.0), ("\\boxed{5}" + " wait" * M, 0.0),
    ("\\boxed{4}. Wait, that's wrong." + " " * M + "\\boxed{5}", 1.0), ("\\boxed{4}" + " " * M + "\\boxed{5}", 0.0),
    ("\\boxed{4} is wrong." + " a" * (M // 2) + " \\boxed{5}", 1.0),
    ("\\boxed{4}" + " a" * (M // 2) + " \\boxed{5}", 0.0),
    ("\\boxed{4} or maybe" + " wait" * (M // 5) + " \\boxed{5}", 0.0),  # a gap of cues and hedges: one pass
    ("\\boxed{0." + "3" * 3000 + "\\ldots}", "\\frac13", 1.0),
    ("\\boxed{0." + "3" * 3000 + "4\\ldots}", "\\frac13", 0.0),
    ("\\boxed{" + "1" * 3900 + ".5}", "1" * 3900 + ".50", 1.0), ("#### " + "1" * 3900 + ".5", "1" * 3900 + ".6", 0.0),
    ("\\boxed{ab" + " \\," * 1300 + " and c}", "c, ab", 1.0), ("\\boxed{" + "\\frac{" * 600 + "}", "1", 0.0),
]


@pytest.mark.parametrize("case", range(len(HOSTILE)))
def test_hostile_inputs_get_the_right_answer(case):
    text, *gold, expected = HOSTILE[case]
    assert reward(text, gold[0] if gold else "5") == expected


LONG_DECIMALS = [("1." + "0" * K + "1", "1." + "0" * K + "10", True), ("0" * K + "7", "7", True),  # K: below MAX_LONG
                 ("1." + "0" * K + "1", "1." + "0" * K + "2", False), ("0" * K + "x", "0" * K + "y", False)]


@pytest.mark.parametrize("case", range(len(LONG_DECIMALS)))
def test_long_decimals_compare_digit_by_digit(case):
    a, b, expected = LONG_DECIMALS[case]
    assert is_equiv(a, b) == expected and is_equiv(b, a) == expected


def test_adversarial_short_answers_are_fast():
    nasty = ["(" * 240 + "5" + ")" * 240, "\\{" * 60 + "1,2" + "\\}" * 60, "(1," * 120 + "1" + ")" * 120,
             ",".join("(%d.0,%d)" % (i, i) for i in range(32)), "9" * 10 + "^{1000}", "9" * 290 + "e1000",
             "\\text{" * 80 + "a" + "}" * 80, "\\frac{" * 60 + "1}{2}" * 60, "x=" * 200]
    for a in nasty:
        for b in nasty + [a[::-1]]:
            start = time.perf_counter()
            is_equiv(a, b)
            assert time.perf_counter() - start < 1.0
