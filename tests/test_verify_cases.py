"""verify.py: a table of cases per class of the verifier issue after issue 36 (A: the final answer,
B: gaps against a peer verifier's regression cases), several variants of our own per class, and the
time each hostile one takes."""
import random
import time

import pytest

import verify

from verify import extract_answer, is_equiv, reward

PAD = "The rows hold six and four more, and each row is counted once. " * 1600  # ~100k characters
M = 1_000_000


# ---------------------------------------------------------------------------------------- A1, A4
def both(equal: list, unequal: list) -> list:
    """(pred, gold, whether they are equivalent) of a class's equal pairs, then its unequal ones."""
    return [(p, g, True) for p, g in equal] + [(p, g, False) for p, g in unequal]


DOUBTED = [  # (the answer, a doubt or correction after it with no new answer): 1 alone, 0 with it
    # a correction that says a factor or a step was wrong, without a new result
    ("\\boxed{24}", "\n\nCorrection: the factor in step 2 should have been 3."),
    ("#### 24", "\nCorrection: step 3 used 12 apples instead of 15."),
    ("So the answer is $24$.", " Correction: the second step dropped a factor of 2."),
    ("The answer is 24.", "\n\n**Correction**: the rate in step 2 was per hour, not per minute."),
    ("\\boxed{24}", " (Corrected: the last step double-counts the corner.)"),
    # a re-check that finds something off
    ("\\boxed{24}.", " Rechecking the second step, the sum seems off."),
    ("The answer is 24.", " Rechecking: 6 \\times 4 looks a bit off to me."),
    ("\\boxed{24}", "\n\nHmm, rechecking the carry in step 2... something's off."),
    ("#### 24", "\nLet me recheck the total."),
    ("The final answer is $24$.", " Double-checking the units now."),
    # a question about its own work, left unsettled ("I can't tell")
    ("\\boxed{24}.", " Did I count the corner squares twice? I can't tell."),
    ("The answer is 24.", " Is that the right total? I cannot tell from here."),
    ("\\boxed{24}", "\n\nDid we include the tax? Hard to say."),
    ("\\boxed{24}.", " Should I have subtracted the 3 returned books?"),
    ("\\boxed{24}.", " Double-checking: I'm not confident about step 2."),
    ("#### 24", "\nWas it 6 rows or 7? No idea."),
    # far from the answer (A4): a cue is read at any distance
    ("\\boxed{24}", PAD + "Correction: step 2 was off by one."),
    ("The answer is 24.", " " * 200_000 + "That's wrong."),
    ("#### 24", "\n" * 300_000 + "Hmm, let me recheck."),
    ("\\boxed{24}", PAD + "Wait, is that right?"),
]


@pytest.mark.parametrize("answer,doubt", DOUBTED)
def test_a_doubt_after_the_answer_takes_it_back(answer, doubt):
    assert reward(answer, "24") == 1.0  # the control: the answer alone
    assert reward(answer + doubt, "24") == 0.0 and extract_answer(answer + doubt) is None


SETTLED = [  # confident completions, some with a doubt they settle: 1
    "\\boxed{24}. Rechecking: 6 \\times 4 = 24, correct.",
    "\\boxed{24}. Did I count the corners twice? Each is in one row only, so yes, 24 stands.",
    "The answer is 24. I checked for errors and found none.",
    "#### 24\nThere are no arithmetic errors.",
    "\\boxed{24}\n\nNothing is wrong with this count.",
    "The final answer is $24$. I hope it is correct.",
    "\\boxed{24}. This matches the direct count of 6 rows of 4.",
    "\\boxed{24}" + PAD,
    "\\boxed{24}" + PAD + "Let me verify: 6 \\times 4 = 24. Correct.",
    "The answer is 24.\n\nWait, let me double check: 20 + 4 = 24. Yes.",
    "So there are \\boxed{24} tiles, without any counting errors.",
    "The answer is 24. Its percent error against the estimate of 25 is 4%.",  # a quantity, no cue
    "The answer is 24, which I double-checked by counting the tiles directly.",  # a check done
    "\\boxed{24} tiles. Don't forget the border when you lay them.",
]


@pytest.mark.parametrize("completion", SETTLED)
def test_a_confident_or_settled_answer_is_paid(completion):
    assert reward(completion, "24") == 1.0 and reward(completion, "25") == 0.0


FAR = [  # (completion, gold, reward): a cue is read at any distance, in linear time
    ("\\boxed{5}" + " " * M + "That's wrong.", "5", 0.0),
    ("The answer is 5." + PAD * 5 + "Wait, I made an error.", "5", 0.0),
    ("#### 5" + "\n" * M + "Correction: the count is off by one.", "5", 0.0),
    ("\\boxed{4}" + " a" * (M // 4) + " That was a mistake." + " a" * (M // 4) + " \\boxed{5}", "5",
     1.0),
    ("\\boxed{4}" + PAD * 5 + "Hmm, I double-counted." + PAD * 5 + "\\boxed{5}", "5", 1.0),
    ("\\boxed{4}" + " " * M + "\\boxed{5}", "5", 0.0),  # no retraction anywhere: two answers
    ("\\boxed{5}" + PAD * 5 + "Let me verify: 2 + 3 = 5. Correct.", "5", 1.0),
    ("\\boxed{5}" + " wait" * (M // 5), "5", 0.0),
    ("\\boxed{5}" + " wait yes" * (M // 9), "5", 1.0),  # each doubt settled
    ("\\boxed{5}" + " wait yes" * (M // 9) + " wait", "5", 0.0),  # but the last one
]


@pytest.mark.parametrize("case", range(len(FAR)))
def test_a_far_retraction_is_read_in_linear_time(case):
    text, gold, expected = FAR[case]
    start = time.perf_counter()
    assert reward(text, gold) == expected
    assert time.perf_counter() - start < 1.0  # 10-50 ms alone (alternating cues: ~0.2 s); CI calm


# ---------------------------------------------------------------------------------------- A2
RESTATED = [  # (one statement, times, padding after each): all earn what one statement earns
    ("The final answer is $\\boxed{34}$.\n", 5000, ""),
    ("\\boxed{34} ", 8000, ""),
    ("#### 34\n", 10_000, ""),
    ("Answer: 34\n", 6000, ""),
    ("So the answer is 34. ", 3000, "The rows hold 30 and 4 more, 30 + 4 = 34. "),
    ("The answer is $\\boxed{34}$. ", 3000, "x" * 300 + "\n"),  # ~1M characters
    ("**Final Answer:** The largest n is 34.\n", 3000, ""),
    ("The answer is 34. ", 60_000, ""),  # 1M characters on one line
    ("\\boxed{34} ", 100_000, ""),  # 1.1M characters: more markers than MAX_COMMITS, all one answer
    ("Answer: 34\n", 100_000, "Checking: 30 + 4 = 34.\n"),
]


@pytest.mark.parametrize("statement,times,padding", RESTATED)
def test_a_restated_answer_earns_what_one_statement_earns(statement, times, padding):
    text = (statement + padding) * times
    start = time.perf_counter()
    assert reward(text, "34") == reward(statement, "34") == 1.0
    assert time.perf_counter() - start < 0.5  # 10-50 ms alone; generous for a shared CI machine
    assert reward(text, "35") == 0.0
    assert reward(text + "Wait, that's wrong.", "34") == 0.0  # a retraction after the last one
    assert reward(text + "\\boxed{35}", "34") == 0.0  # a different last answer is a second answer


def test_collapsing_repeated_pieces_never_changes_the_answer(monkeypatch):
    """verify._collapse keeps a run of identical pieces as a few copies: on texts built from repeated pieces (boxes,
    clauses, cues, hedges, brackets, $, numbers) with fewer markers than MAX_COMMITS, the reward with the collapse
    equals the reward without it (COLLAPSE_ABOVE raised so that nothing collapses), for every gold."""
    import random
    pieces = ["The answer is 5. ", "\\boxed{5} ", "\\boxed{6}. Wait, that's wrong. ", "#### 5\n", "Answer: 7\n",
              "the answer is ", "so 2 + 3 = 5; ", "Hmm, maybe 6? ", "Let me re-check: yes. ", "(x ", "$5$ ", "\\boxed{5",
              "}", "Did I count it twice?\n", "x" * 40 + " ", "\n", "The answer is $\\boxed{5}$.\n", "answer = 5, "]
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        text = "".join(rng.choice(pieces) * rng.choice([1, 1, 2, 30, 120]) for _ in range(rng.randint(1, 6)))
        if sum(text.lower().count(k) for k in ("answer", "\\boxed", "####")) > verify.MAX_COMMITS:
            continue
        with_collapse = [reward(text, g) for g in ("5", "6", "7")]
        with monkeypatch.context() as m:
            m.setattr(verify, "COLLAPSE_ABOVE", 10 ** 9)
            without = [reward(text, g) for g in ("5", "6", "7")]
        assert with_collapse == without, text[:300]
        checked += verify._collapse(text) != text
    assert checked > 50  # the collapse did shorten most of them


# ---------------------------------------------------------------------------------------- A3
def test_no_completion_is_paid_for_two_answers():
    """Why there is no cap on withdrawn answers: whatever candidates a completion lists and
    retracts, it is paid for at most one answer, the one it commits to last, and only when that
    answer stated alone is paid. Enumerating candidates therefore never earns more, in expectation
    over any gold, than committing to the last one directly; a cap only took the reward away from
    long honest self-corrections."""
    rng = random.Random(7)
    answers = ["7", "12", "\\frac{3}{4}", "2\\sqrt{2}", "x+1", "(1, 2)", "-5", "0.5", "14"]
    joins = [" is wrong. ", ". Wait, that's a mistake: ", ", or maybe ", ". Hmm, let me recheck: ",
             " and ", ". No, I misread. ", ". Actually ", ", though ", ". Correction: ", "? "]
    for _ in range(300):
        picks = [rng.choice(answers) for _ in range(rng.randint(1, 12))]
        text = "".join(f"\\boxed{{{a}}}" + rng.choice(joins) for a in picks[:-1])
        text += f"\\boxed{{{picks[-1]}}}"
        paid = [g for g in answers if reward(text, g) == 1.0]
        assert len(paid) <= 1, (text, paid)
        assert all(reward(f"\\boxed{{{picks[-1]}}}", g) == 1.0 for g in paid), text  # the last


# ---------------------------------------------------------------------------------------- A5
WRAPPED_TRUE = [  # a unit inside a text wrapper; presentation nested at any depth
    ("\\mathrm{12\\,cm}", "12"), ("\\text{12 cm}", "12"), ("\\textbf{12~cm}", "12"),
    ("\\mathrm{12\\ cm}", "12"), ("\\text{12}\\,\\mathrm{cm}", "12"),
    ("\\mathbf{12\\;\\mathrm{cm}}", "12"), ("\\text{12 cm}^2", "12"),
    ("\\mathrm{1\\,200\\,m}", "1200"),
    ("\\textit{3.5\\:kg}", "3.5"), ("\\mathbf{" * 300 + "12" + "}" * 300, "12"),
    ("\\mathbf{\\text{\\boldsymbol{" * 100 + "\\frac{3}{8}" + "}}}" * 100, "0.375"),
    ("\\underline{\\mathrm{" * 150 + "x+1" + "}}" * 150, "1+x"),
]
WRAPPED_FALSE = [
    ("\\mathrm{12\\,cm}", "13"), ("\\mathrm{12\\,cm}", "1.2"), ("\\mathrm{1\\,200\\,m}", "200"),
    ("\\mathbf{" * 300 + "12" + "}" * 299, "12"),  # a wrapper that never closes: no answer
    ("\\mathbf{" * 300 + "12" + "}" * 300, "21"),
]


@pytest.mark.parametrize("pred,gold,equal", both(WRAPPED_TRUE, WRAPPED_FALSE))
def test_wrapped_units_and_deep_presentation(pred, gold, equal):
    start = time.perf_counter()
    assert is_equiv(pred, gold) == equal and is_equiv(gold, pred) == equal
    assert time.perf_counter() - start < 0.2


def test_deep_presentation_in_a_box_is_linear():
    for depth in (10, 100, 400):
        text = "So $\\boxed{" + "\\mathbf{" * depth + "5" + "}" * depth + "}$."
        start = time.perf_counter()
        assert reward(text, "5") == 1.0 and reward(text, "6") == 0.0
        assert time.perf_counter() - start < 0.2


# ---------------------------------------------------------------------------------------- B1
LABELLED_TRUE = [  # a label or a left-hand side on the gold (or on both sides)
    ("AB=4, CD=5", "4, 5"), ("AB = 4, CD = 5", "(4, 5)"), ("AE:EC = 1:2", "1:2"),
    ("AE:EC = 1:2", "\\frac12"), ("\\frac{AE}{EC} = \\frac{1}{2}", "1/2"),
    ("BD:DC = 3:4", "\\frac{3}{4}"), ("|AB| = 1", "1"), ("|\\vec{v}| = 5", "5"),
    ("\\|v\\| = 5", "5"), ("\\overline{AB} = 7", "7"), ("a = 1, b = 2", "b = 2, a = 1"),
    ("x=3, y=-1, z=2", "z=2, x=3, y=-1"),
    ("m = 5; n = 7", "n = 7, m = 5"), ("p = \\frac{1}{2}, q = 3", "q = 3, p = 0.5"),
    ("x_{1}=2,\\quadx_{2}=3", "x_{1}=2, x_{2}=3"), ("x_1=2,\\qquadx_2=3", "(2, 3)"),  # "\\quadx": glued
    ("1:2:3", "2:4:6"), ("AB:BC:CA = 3:4:5", "6:8:10"),
]
LABELLED_FALSE = [
    ("AB=4, CD=5", "5, 4"), ("x=1, y=2", "y=1, x=2"), ("a=1, b=2", "a=1, c=2"),
    ("AE:EC = 1:2", "2:1"), ("|AB|=1", "2"), ("x = 1, y = 2", "1"), ("a=1,b=2", "\\{1, 2\\}"),
    ("1:2:3", "(2,3)"), ("1:2", "1, 2"), ("AB=4, CD=5", "4, 5, 6"),
    ("x=3, y=-1, z=2", "z=2, x=3, y=1"),
]


@pytest.mark.parametrize("pred,gold,equal", both(LABELLED_TRUE, LABELLED_FALSE))
def test_labels_and_left_hand_sides(pred, gold, equal):
    assert is_equiv(pred, gold) == equal and is_equiv(gold, pred) == equal


# ---------------------------------------------------------------------------------------- B2
STATED = [  # (completion, gold, reward): "Final Answer:" and a sentence stating the value
    ("Final Answer: The largest n is 34.", "34", 1.0),
    ("Final Answer: The largest n is 34.", "35", 0.0),
    ("Final Answer: The number of ways is $120$.", "120", 1.0),
    ("**Final Answer:** There are 12 ways.", "12", 1.0),
    ("Answer: The total cost is \\$50.", "50", 1.0),
    ("Final answer: the smallest such prime is 7", "7", 1.0),
    ("Final Answer: It is 5.", "5", 1.0),
    ("Answer: n is 34", "34", 1.0),
    ("Final Answer: The sum of the roots equals $-\\frac{3}{2}$.", "-1.5", 1.0),
    ("Final Answer: The triangle is isosceles.", "\\text{isosceles}", 1.0),
    ("Final Answer: The largest n is not 34.", "34", 0.0),  # no value stated
    ("Final Answer: The largest n is probably 34.", "34", 0.0),  # a hedge is no value
    ("Final Answer: The answer is the number of ways to pick 2 of 5.", "10", 0.0),  # a description
    ("Final Answer: The largest n is 34. Wait, n = 35 also works.", "34", 0.0),
]


@pytest.mark.parametrize("completion,gold,expected", STATED)
def test_a_stated_final_answer(completion, gold, expected):
    assert reward(completion, gold) == expected


# ---------------------------------------------------------------------------------------- B3
RELATIONS_TRUE = [  # one equation or inequality: every term on one side, up to a scale
    ("x-1=0", "1-x=0"), ("2x+2=4", "x=1"), ("x=1", "2x=2"), ("y=2x+1", "2x-y+1=0"),
    ("x+y=5", "y+x=5"), ("3x - 6 = 0", "x = 2"), ("\\frac{x}{2} = 3", "x = 6"), ("a+b=c", "c=b+a"),
    ("x^2+2x+1=0", "(x+1)^2=0"), ("-x > -1", "x < 1"), ("2x \\ge 6", "x \\geq 3"),
    ("x \\lt 1", "x < 1"), ("x \\gt 1", "1 < x"), ("3 > x", "x < 3"), ("x != 2", "x \\ne 2"),
    ("x \\neq 2", "2 \\neq x"), ("x ≠ 2", "x != 2"), ("x \\not= 2", "x \\neq 2"),
    ("x^2 - 1 \\le 0", "1 - x^2 \\ge 0"), ("\\frac{1}{x} > 0", "\\frac{2}{x} > 0"),
    ("-3x \\le 6", "x \\ge -2"), ("-x > -1", "(-\\infty, 1)"), ("2x + 2 > 4", "(1, \\infty)"),
    ("-3x \\le 6", "[-2, \\infty)"), ("\\frac{x}{3} < \\frac{1}{2}", "x < 1.5"),
]
RELATIONS_FALSE = [
    ("x-1=0", "x+1=0"), ("x > 1", "x < 1"), ("-x > -1", "x > 1"), ("x \\ge 1", "x > 1"),
    ("x = 1", "x \\ne 1"), ("2x=2", "x=2"), ("x > 1", "-2x > -2"), ("x+y=5", "x-y=5"),
    ("x^2=1", "x=1"), ("-x > -1", "(1, \\infty)"), ("x(x-1)=0", "x-1=0"), ("x \\lt 1", "x \\le 1"),
    ("2x+2=4", "x=2"), ("-3x \\le 6", "(-2, \\infty)"),
]


@pytest.mark.parametrize("pred,gold,equal", both(RELATIONS_TRUE, RELATIONS_FALSE))
def test_equations_and_inequalities(pred, gold, equal):
    assert is_equiv(pred, gold) == equal and is_equiv(gold, pred) == equal


# ---------------------------------------------------------------------------------------- B4
SEPARATED_TRUE = [  # semicolons; a gold listing alternatives with "or" is the set of them
    ("(1; 2)", "(1, 2)"), ("1; 2; 3", "3, 2, 1"), ("\\{1; 2\\}", "\\{2, 1\\}"),
    ("[1; 2)", "[1, 2)"),
    ("(1,000; 2,000)", "(1000, 2000)"), ("a = 1; b = 2", "(1, 2)"), ("2 or 3", "2, 3"),
    ("2 or 3", "3 and 2"), ("2 or 3", "x = 2 or x = 3"), ("2 or 3", "\\{2, 3\\}"),
    ("either 2 or 3", "3, 2"), ("-1 or 4", "x=4, x=-1"),
    ("(11,7)or(7,11)", "(7,11), (11,7)"), ("[1,2]or[3,4]", "[3,4], [1,2]"),  # "or" between brackets
]
SEPARATED_FALSE = [
    ("2 or 3", "2"), ("2 or 3", "3"), ("2 or 3", "2, 3, 4"), ("(1; 2)", "(2; 1)"), ("1; 2", "12"),
    ("2 or 3", "(2, 3)"), ("-1 or 4", "4"),
]
OR_REWARDS = [  # (completion, gold, reward): a prediction hedging with "or" earns 0 for one value
    ("The answer is 2 or 3.", "2", 0.0), ("The answer is 2 or 3.", "3", 0.0),
    ("\\boxed{2 \\text{ or } 3}", "2", 0.0), ("The answer is 2 or 3.", "2 or 3", 1.0),
    ("x = \\boxed{2} or x = \\boxed{3}", "2 or 3", 1.0),
    ("So the answer is $x = 2$ or $x = 3$.", "3 or 2", 1.0),
    ("The answer is $(1; 2)$.", "(1, 2)", 1.0),
]


@pytest.mark.parametrize("pred,gold,equal", both(SEPARATED_TRUE, SEPARATED_FALSE))
def test_separators(pred, gold, equal):
    assert is_equiv(pred, gold) == equal and is_equiv(gold, pred) == equal


@pytest.mark.parametrize("completion,gold,expected", OR_REWARDS)
def test_or_in_a_gold_and_in_a_prediction(completion, gold, expected):
    assert reward(completion, gold) == expected


# ---------------------------------------------------------------------------------------- B5
COMMUTED_TRUE = [  # commutative forms inside radicals, exponents and sums
    ("\\sqrt{x+1}", "\\sqrt{1+x}"), ("e^{x+1}", "e^{1+x}"), ("2^{n+1}", "2^{1+n}"),
    ("\\sqrt{ab+1}", "\\sqrt{1+ba}"), ("\\sqrt{2+\\sqrt{3}}", "\\sqrt{\\sqrt{3}+2}"),
    ("3\\sqrt{x^2+1}", "\\sqrt{1+x^2}\\cdot 3"), ("\\sqrt[3]{x+2y}", "\\sqrt[3]{2y+x}"),
    ("(x+1)^{1/2}", "\\sqrt{x+1}"), ("\\frac{1}{\\sqrt{x+1}}", "(1+x)^{-1/2}"),
    ("x\\sqrt{x+1}+1", "1+\\sqrt{1+x}x"), ("e^{x+1}+e^{y}", "e^y+e^{1+x}"),
    ("\\sqrt{2\\cdot 3 x + 1}", "\\sqrt{1 + 6x}"),
    ("\\frac{\\sqrt{x+1}}{2}", "\\frac12\\sqrt{1+x}"),
    ("\\sqrt{\\sqrt{5}\\cdot 2+3}", "\\sqrt{3+2\\sqrt5}"),
]
COMMUTED_FALSE = [
    ("\\sqrt{x+1}", "\\sqrt{x+2}"), ("\\sqrt{x+1}", "\\sqrt{x}+1"), ("e^{x+1}", "e^{x-1}"),
    ("2^{n+1}", "2^{n}+1"), ("\\sqrt{x^2+2x+1}", "x+1"), ("\\sqrt{x+1}", "x+1"),
    ("e^{x}", "e^{-x}"),
    ("\\sqrt{2+\\sqrt{3}}", "\\sqrt{2-\\sqrt{3}}"), ("\\sqrt[3]{x+1}", "\\sqrt{x+1}"),
    ("2^{n}", "n^{2}"),
]


@pytest.mark.parametrize("pred,gold,equal", both(COMMUTED_TRUE, COMMUTED_FALSE))
def test_commutative_forms_inside_roots_and_powers(pred, gold, equal):
    assert is_equiv(pred, gold) == equal and is_equiv(gold, pred) == equal


# ---------------------------------------------------------------------------------------- B6
THOUSANDS_TRUE = [  # a comma then a space separates items; a comma alone groups thousands
    ("32,349", "32349"), ("32, 349", "32, 349"), ("32, 349", "349, 32"), ("(32, 349)", "(32,349)"),
    ("1,000, 2,000", "2000, 1000"), ("\\$32,\\!349", "32349"), ("1{,}000", "1000"),
    ("1, 2,3", "1,2,3"), ("(a, 2, b)", "(a,2,b)"),  # mixed spacing: still the same list
    ("32,\\! 349", "32349"), ("11,\\! 111,\\! 111,\\! 100", "11111111100"),  # MATH's ",\\! ": a group
]
THOUSANDS_FALSE = [
    ("32, 349", "32349"), ("1, 000", "1000"), ("1, 234, 567", "1234567"), ("32, 349", "32,349"),
    ("1,000, 2,000", "10002000"), ("12, 345.5", "12345.5"), ("1, 2,3", "1, 23"),
]


@pytest.mark.parametrize("pred,gold,equal", both(THOUSANDS_TRUE, THOUSANDS_FALSE))
def test_a_comma_and_a_space_separate_items(pred, gold, equal):
    assert is_equiv(pred, gold) == equal and is_equiv(gold, pred) == equal


def test_a_listed_pair_is_not_one_number_in_a_completion():
    assert reward("The answer is 32, 349.", "32349") == 0.0
    assert reward("#### 32,349", "32349") == 1.0
    assert reward("The answer is $\\boxed{32, 349}$.", "32, 349") == 1.0
