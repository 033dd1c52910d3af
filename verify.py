r"""Answer checking for reasoning RL: the final answer, normalisation, exact equivalence, rewards.

Pure Python on strings, no eval/exec, no CAS (the exact normal form is exact.py); every pass linear
in its input, bounded sizes (MAX_*): milliseconds at 1M characters of any shape. reward(completion,
gold) = 1.0 iff steps 1-3 agree.

1. The final answer (extract_answer) is the last commitment, when every earlier one that differs is
   withdrawn. Commitments: a balanced \boxed{...} / \fbox{...} / `\boxed 5`; the rest of a "####"
   line; the clause after "the (final) answer is" / "Answer:" (its line, or the next when it is
   empty or opens $$ / \[), or the value a sentence there states ("Final Answer: The largest n is
   34." is 34); an <answer> block (read by this rule). Not: text before a closing </think>, "####
   Step 1: ...", a condition or goal ("if / we must show that the answer is", "maybe", "not"), a
   description ("the number of ways ..."). An answer ends where its sentence does or a reason
   begins: `#### 30 (so 30 left)`, `8, not 6.`, `56 since 7 x 8 = 56`.
   A retraction between two commitments withdraws all before it: a cue (wrong, mistake, error, no,
   correction, typo, double-counted, forgot, misread, seems off, ...) outside a hedge, or a soft
   one (wait, hmm, actually, re-check, on second thought) with no hedge there; cues are read at any
   distance (the whole gap, in C-speed passes). These are 14: "First try: \boxed{12}. Checking
   again I double-counted ... \boxed{14}", "\boxed{12} is wrong; the right value is \boxed{14}",
   "The answer is 12. Wait, an error: ... The answer is 14". The same answer stated again
   (thousands of times) is one answer: a run of identical pieces is read as a few copies
   (_collapse), so more than MAX_COMMITS markers are no answer only when they differ. A clause
   that runs into the next commitment with no end of its own commits to nothing (the next counts).
   Only the last commitment is paid and each earlier different one must be withdrawn, so listing
   candidates and retracting them earns what the last one alone earns: no cap on their number.
   No final answer (reward 0) when
   - two commitments differ with no retraction between: "\boxed{12} or maybe \boxed{14}",
     "\boxed{12} (or possibly \boxed{14})", "\boxed{12}. Hmm, it could also be \boxed{14}", "####
     12 ... The answer is 14"; but several boxes are one set answer, "a, b, ...", which only a gold
     list of those values matches (compared as a multiset);
   - anywhere after the last one the text retracts (a cue above: "Correction: step 2 used the wrong
     rate"), hedges ("12, though 14 is also possible", "if I'm wrong", "12?", "I can't tell"),
     doubts without settling it (wait, re-check, "Did I count it twice?": no "correct" / "yes"
     after the doubt) or starts a commitment it does not finish; "no errors", "nothing is wrong",
     "I double-checked it", "the percent error" are no cue;
   - there are more than MAX_COMMITS markers, or none (lenient=True: the last number, never for
     rewards).
2. _normalize: lower-case; unicode (½, x², ×, −, ≤, …); drop $, presentation (\text{},
   \mathbf{} at any depth, \displaystyle and kin), \left/\right, degrees, percent (50% is 50),
   currency, trailing unit words (5 cm); LaTeX spaces (\, ~) inside a number join its digits,
   elsewhere they are a space (\mathrm{12\,cm} is 12 cm, so 12); articles and plurals of a word
   answer; a leading "x =" / "g(3) =" / "(m, n) =" / "|AB| =" / "AE:EC ="; number words (seven, 2.5
   thousand); 3 1/4 and 3\frac14 are mixed; 0.666\ldots is 0.\overline{6}; one spelling for \dfrac,
   \frac12, \sqrt2, x_1, {-}7, \lt, \neq, !=; "a and b", "a or b" and "a; b" are lists, and so is
   "32, 349": a comma then a space separates items, only a comma alone groups thousands (32,349).
3. _equal: numbers compare as exact Fractions (no rounding: 0.33 is not 1/3); tuples, intervals and
   matrices (pmatrix = bmatrix) element-wise, bracket types kept; sets, bare lists, \cup-unions and
   \pm (3, -3) as multisets; assignments by name when both sides name the same variables (a = 1, b
   = 2 is b = 2, a = 1), else in order against a tuple, a list or other names (AB = 4, CD = 5 is 4,
   5); a ratio a:b as a/b (a:b:c as b/a, c/a); one equation or inequality by exact.same_relation,
   every term moved to one side, up to a scale (x - 1 = 0 is 1 - x = 0, 2x + 2 = 4 is x = 1, -x >
   -1 is x < 1); a relation x \le 4 as its interval (-\infty, 4] (5 > y is y < 5, 2x > 2 is x > 1);
   (C) 7 matches (C) and 7; 110 matches 110_2 (the digits, when one side omits the base); else
   exact.same decides.
   A gold "2 or 3" lists the solution set {2, 3}: a prediction matches it by stating that set ("3,
   2", "x = 2 or x = 3"), never by one member, so an answer that hedges with "or" earns only what
   the set it states earns (0 against a gold of one value, as before).
4. format_reward: <think>...</think><answer>...</answer> and nothing else (one trailing EOS
   allowed); step_rewards: each "expr=value" step checked by eval_arith (exact.value on integers
   and + - * / ( )).

Tests: python -m pytest -q tests/test_verify*.py (test_verify, _heldout, _cases)
"""
import operator
import re
import unicodedata
from bisect import bisect_right
from fractions import Fraction
from itertools import accumulate, groupby, islice, repeat

import exact
from exact import MAX_NUMBER, decimal_key, number as _number

MAX_ANSWER = 4000  # characters: longer answers are equal only if identical (or the same decimal)
MAX_LONG = 100_000  # characters: longer ones are never equal
MAX_COMMITS = 500  # markers (boxes, ####, "answer") after _collapse; more is no answer
CLAUSE_BUDGET = 200_000  # characters all "answer is" clauses may read; more: no answer
MAX_DIFFERENT = 16  # different answers after the last retraction (8 boxes, 8 clauses); more: none
MAX_EXPR = 200  # characters of one arithmetic step or countdown expression
MAX_STEPS = 256  # steps scored by step_rewards; later ones are ignored
TOO_LONG = "\x00"  # the answer of a commitment past MAX_ANSWER: equal to nothing
EOS = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "<eos>")

_BOX = re.compile(r"\\(?:boxed|fbox)")
_SIMPLE_BOX = re.compile(r"\\(?:boxed|fbox)\s*+\{\s*+([^{}]{0,%d}+)\}" % (MAX_ANSWER - 1))  # no {}
_BOX_NEXT = re.compile(r"[ \t:*]*(?:\$\$?|\\\[|\\\()?\s*\\(?:boxed|fbox)")  # "is $\boxed{5}$"
_ANSWER_IS = re.compile(r"answer(?: is\b|[ \t*]*:|\s*=)", re.I)  # "the final answer is", "Answer:"
_ANSWER_LOW = re.compile(r"answer(?: is\b|[ \t*]*:|\s*=)")  # on lower-cased text: a literal prefix
_HASHES = re.compile(r"####[ \t#]*([^\n]{0,%d})" % (MAX_ANSWER + 1))  # longer: no answer, no prefix
_GOAL = re.compile(r"\b(?:if|whether|suppose|assum\w*|need|needs|must|want|prove|show|check|verify"
                   r"|claim|guess|expect|unless|until|why|how|what|maybe|perhaps|possibly|probably"
                   r"|might|could|hypothe\w*)\b", re.I)
_CLAUSE = re.compile(r"(?s:.*)(?:[,;:.!?]\s|\n)")  # to the last break: where the clause starts
_Q = "['’]"  # an apostrophe
# Cues, read on lower-cased text. Each alternative starts with a literal character: _cue_regex
# groups them by it, so that re skips at C speed to the characters that can begin a cue.
_CUES = {
    "benign": [  # no cue: a check that found nothing
        r"no (?:\w+ )?(?:mistakes?|errors?|typos?)\b", r"nothing (?:is )?wrong\b",
        r"without (?:any )?(?:\w+ )?(?:mistakes?|errors?)\b", r"not (?:wrong|incorrect)\b",
        r"check\w* for (?:\w+ )?(?:mistakes?|errors?|typos?)\b", r"margin of error\b",
        *[rf"{w}(?: not|n{_Q}t) (?:wrong|incorrect|a mistake)\b" for w in ("is", "was")],
        *[rf"{w} errors?\b" for w in ("relative", "percent", "percentage", "absolute", "standard",
                                       "rounding", "round-off", "truncation", "approximation")],
        r"errors? (?:bound|term|function|estimate)s?\b",  # a quantity named error
        rf"do(?:n{_Q}t| not) forget\b"],
    "done": [  # after the answer, a check reported done: no doubt (between two answers, soft)
        r"re[- ]?checked\b", r"double[- ]?checked\b",
        r"checked (?:it |this |that |everything )?again\b"],
    "hedge": [  # two answers, or none for sure
        r"or (?:maybe|possibly|perhaps|alternatively)\b", r"answer would be\b", r"\(\s*or\b",
        *[rf"{w} (?:could|might|may) (?:also |well )?be [-\d$\\(]"
          for w in ("it", "this", "that", "answer")],
        *[rf"{w} (?:well )?be (?:wrong|mistaken|off)\b" for w in ("could", "might", "may")],
        r"also (?:possible|plausible|valid)\b", r"equally (?:possible|plausible|valid)\b",
        r"not (?:\S+ )?(?:sure|certain|confident)\b", r"unsure\b", r"uncertain\b", r"unclear\b",
        *[rf"{w} (?:i{_Q}?m|that{_Q}?s|it{_Q}?s|i am|this is) (?:wrong|mistaken)\b"
          for w in ("if", "unless")],
        rf"can(?:no|{_Q})t (?:tell|say|be sure)\b", r"hard to (?:say|tell)\b", r"no idea\b",
        rf"do(?:n{_Q}t| not) know\b"],
    "adds": [  # another answer besides: a set answer, no retraction
        rf"{w} (?:\w+ )?(?:root|solution|answer|value|zero)s?\b"
        for w in ("another", "other", "also", "both", "second")],
    "strong": [  # a retraction
        r"oops\b", r"mistakes?\b", r"mistaken\b", r"wrong\b", r"incorrect\b", r"erroneous\b",
        r"miscalc\w*", r"recount\w*", r"recalculat\w*", r"recomput\w*", r"redo\b", r"re-?examin\w*",
        r"reconsider\w*", r"impossible\b", r"invalid\b", r"contradict\w*", r"scratch that\b",
        r"start over\b", r"try again\b", r"not (?:right|correct|possible|valid|the answer)\b",
        r"not (?:quite|seem|look) right\b", rf"can(?:no|{_Q})t be\b", r"answer is not\b",
        *[rf"{w}n{_Q}t (?:right|correct|possible|valid)\b" for w in ("is", "are")],
        rf"do(?:es)?n{_Q}t (?:seem|look) right\b",
        rf"do(?:es not|esn{_Q}t| not|n{_Q}t) (?:work|hold|satisfy|fit|make sense|add up)\b",
        r"errors?\b", r"typos?\b", r"correct(?:ion|ed|ing)\b", r"forg[oe]t\w*", r"overlook\w*",
        *[rf"{w}[- ]?count\w*" for w in ("double", "over", "under")],
        r"mis(?:count|read|interpret|typ|judg|appl|underst|took|t[ae]k)\w*",
        *[rf"{w} (?:a (?:bit|little) |slightly |way )?off\b"
          for w in ("seems", "seem", "looks", "look", "feels", "is", "was")],
        rf"something(?:{_Q}s| is) off\b", r"n(?<!-n)o[,.!:]"],
    "soft": [  # a doubt: withdraws where no hedge is; after the answer it needs a confirmation
        r"wait\b", r"hmm+\b", r"actually\b", r"re[- ]?check\w*", r"double[- ]?check\w*",
        r"check\w* again\b", r"let me re-?\w+", r"re-?(?:visit|evaluat|think)\w*",
        r"on second thought\b", r"looking back\b"],
    "question": [  # a question about its own work, opening a sentence: a doubt after the answer
        *[rf"{w[0]}(?<![a-z,] {w[0]}){w[1:]} (?:i|we)\b[^?.!\n]{{0,200}}\?"
          for w in ("did", "do", "have", "am", "was", "were", "should", "could")],
        *[rf"{w[0]}(?<![a-z,] {w[0]}){w[1:]} (?:that|this|it|my|our|these"
          rf"|the (?:answer|result|total|count|sum))\b[^?.!\n]{{0,200}}\?"
          for w in ("is", "was", "are")],
        r"right\s*\?", r"correct\s*\?", r"ok(?:ay)?\s*\?"],
    "confirm": [  # settles a doubt: "Wait, let me check ... yes"
        r"correct\b(?!\s*\?)", r"confirm\w*", r"verified\b", r"checks out\b", r"yes\b(?!\s*\?)",
        "✓"],
}


def _cue_regex(*kinds: str) -> re.Pattern:
    """One alternation of the cues of kinds, an earlier kind first where two start at one place; a
    letter must start a word. m.lastgroup is "<kind>_<n>", an empty group at the end of its
    alternative (an alternative that starts with a literal is rejected at C speed)."""
    by_first = {}
    for kind in kinds:
        for n, alt in enumerate(_CUES[kind]):
            first = alt[:2] if alt[0] == "\\" else alt[0]
            by_first.setdefault(first, []).append(f"{alt[len(first):]}(?P<{kind}_{n}>)")
    return re.compile("|".join(first + (f"(?<!\\w{first})" if first.isalpha() else "")
                               + "(?:%s)" % "|".join(alts) for first, alts in by_first.items()))


_GAP_CUE = _cue_regex("benign", "hedge", "adds", "strong", "soft")  # between two commitments
_GAP_SHARP = _cue_regex("benign", "hedge", "adds", "strong")  # there, after a doubt or a hedge
_TAIL_CUE = _cue_regex("benign", "done", "hedge", "strong", "soft", "question")  # after the last
_TAIL_SETTLE = _cue_regex("benign", "hedge", "strong", "confirm")  # there, after a doubt
_CONFIRM = _cue_regex("confirm")
_QMARK = re.compile(r"[ \t$*]*\?")  # "\boxed{12}?"
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_BLANK, _SPACE = re.compile(r"[^\S\n]*(?:\n|\Z)"), re.compile(r"\s*")
_LEAD, _CLIP_LEAD = re.compile(r"[ \t:*]*(?:[\r\n]\s*)?"), re.compile(r"[ \t:*]*")
_OPENER = re.compile(r"\s*(?:\\\[|\$\$|\\\(|\$)\s*")  # "$$" alone on its line: the answer follows
_NOT, _BRACKET = re.compile(r"(?:not|n't)\b"), re.compile(r"[()\[\]{}]")  # "the answer is not 5"
# Where the answer ends: a reason, a remark; (?<!\s\s) after a space: one try per run of spaces.
# each branch opens with its character (a lookbehind after it), so the scan skips the rest fast
_RUNON = re.compile(r"\.(?:\s|$)|;(?<!\\;)|!(?<![\d)}\\]!)|\?|,\s+(?!and\b)(?=[a-z]{2})"
                    r"|\s(?<!\s\s)\s*(?:\(|(?:since|because|as|so|which|given|hence|thus|therefore"
                    r"|not|i\.e\.|meaning|where|when|if|for|from|by|using)\b|—|–|--)", re.I)
_DESCRIPTION = re.compile(r"(?:the|an?)\s+\S+\s+\S+\s+\S+", re.I)  # "is the sum of the roots"
_STATED = re.compile(r"(?:(?:the|an?)\s.*|there|it|\$?[a-z](?:_\{?\w+\}?)?\$?)\s(?:is|are|was|were"
                     r"|equals)\s+(?P<value>\S.*)", re.I)  # "The largest n is 34": the last copula
_JOINED = re.compile(r"\s*(?:,|and|or)\s*(?:and\s*)?\$")  # "$5$ and $6$" is one list answer
_DEPTH = dict.fromkeys("([{", 1) | dict.fromkeys(")]}", -1)
_HEADING = re.compile(r"[a-z]{2}[^\d\s]*\s+\S", re.I)  # "#### Step 1: add" is a heading, no answer
_TOKEN, _DOLLAR = re.compile(r"[^\s$]+"), re.compile(r"(?<!\\)\$")  # \boxed 5; a closing $, not \$
_NUMBER_AT_END, _SPACING = re.compile(r"-?\d[\d,]*(?:\.\d+)?$"), str.maketrans("", "", " \t\n\r$")


def _lower(text: str) -> str:
    """text lower-cased, index for index (str.lower lengthens İ: then ASCII letters only)."""
    low = text.lower()
    return low if len(low) == len(text) else text.translate(_ASCII_LOWER)


def _boxes(text: str, lo: int, hi: int, budget: int) -> tuple[list, int] | None:
    """[(start, end, content)] of the boxes in text[lo:hi] and the start of the last unclosed one
    (-1 if none); None once the scans read more than budget characters (boxes opened in boxes,
    never closed)."""
    out, unclosed = [], -1
    for i in [m.start() for m in _BOX.finditer(text, lo, hi)]:
        if m := _SIMPLE_BOX.match(text, i, hi):  # no braces inside: one C-speed match
            out.append((i, m.end(), m[1].strip()))
            budget -= m.end() - i
            continue
        j = i + (6 if text.startswith("\\boxed", i) else 5)
        k = _SPACE.match(text, j, hi).end()
        if not text.startswith("{", k):
            if k > j and (m := _TOKEN.match(text, k, hi)):
                out.append((i, m.end(), m.group()))  # \boxed 5
            continue
        p = _SPACE.match(text, k + 1, hi).end()  # blanks around the answer: no part of its length
        stop, depth = min(hi, p + MAX_ANSWER), 1  # balanced braces: find "}", count "{" between
        while (q := text.find("}", p, stop)) >= 0:
            depth += text.count("{", p, q) - 1
            p = q + 1
            if depth <= 0:
                break
        if depth == 1 and "{" not in text[p:stop]:  # only blanks past the limit, then "}": closed
            e = _SPACE.match(text, stop, hi).end()
            depth, p = (0, e + 1) if text.startswith("}", e) else (depth, p)
        if (budget := budget - ((p if depth == 0 else stop) - i)) < 0:
            return None
        if depth == 0:
            out.append((i, p, text[k + 1:p - 1].strip()))
        else:
            unclosed = i
    return out, unclosed


def _clip(text: str, start: int, stop: int, cut: bool = False) -> tuple[str, int]:
    """The answer that opens text[start:stop] and where it ends: a $...$ span, else its clause
    (cut: the line goes on past stop). Read in place (pos, endpos): a long line is never copied."""
    i = _CLIP_LEAD.match(text, start, stop).end()
    spans = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", None))
    for a, b in spans if text[i:i + 1] in "$\\" else ():
        if text.startswith(a, i, stop):
            j = i + len(a)
            m = _DOLLAR.search(text, j, stop) if b is None else None
            k = m.start() if m else text.find(b, j, stop) if b else -1
            if k > j and not _JOINED.match(text, k + len(b or "$"), stop):
                return text[j:k].strip(), k + len(b or "$")
    end, depth, pos = stop, 0, i
    for m in _RUNON.finditer(text, i, stop):  # the first cut outside brackets
        if depth or _BRACKET.search(text, pos, m.start()):  # counted only where there are any
            depth += sum(text.count(c, pos, m.start()) for c in "([{")
            depth -= sum(text.count(c, pos, m.start()) for c in ")]}")
        pos = m.start()
        if depth <= 0:
            end = m.start()
            break
    answer = text[i:end].rstrip()
    long = i - start + len(answer) >= MAX_ANSWER or cut and end == stop  # trailing blanks: no part
    return (TOO_LONG if long else answer.strip(" \t*").rstrip(".").strip(" \t*")), end


def _clause_answer(a: str) -> str | None:
    """The answer a clause after "the answer is" / "Answer:" commits to: the value a sentence
    states ("The largest n is 34" -> "34"); None for a box (it counts itself), another "answer is"
    (the inner one counts: "Final answer: the answer is 5") or a description ("the number of ways
    to ...")."""
    if _BOX.search(a) or _ANSWER_IS.search(a):
        return None
    m = _STATED.fullmatch(a) if len(a) <= 200 else None  # short: backtracking on it stays cheap
    a = m["value"] if m else a
    return None if _DESCRIPTION.match(a) else a


def _commitments(text: str, low: str) -> tuple[list, int] | None:
    """[(start, end, answer, is_box)] in text order and the start of an unfinished commitment
    after them (-1 if none); None past MAX_COMMITS markers, or when reading them would read past a
    linear budget."""
    hashes, said = low.count("####"), low.count("answer")
    if low.count("\\boxed") + low.count("\\fbox") + hashes + said > MAX_COMMITS:
        return None
    budget = 2 * len(text) + 16 * MAX_ANSWER  # characters all scans may read: unclosed boxes...
    if (found := _boxes(text, 0, len(text), budget)) is None:
        return None
    (boxes, unfinished), out = found, [(i, j, a, True) for i, j, a in found[0]]
    for m in _HASHES.finditer(text) if hashes else ():  # disjoint lines: linear
        long = m.end(1) - m.start(1) > MAX_ANSWER and not _BLANK.match(text, m.end())
        a, k = _clip(text, m.start(1), m.end(1), long)
        if a and not _BOX.search(a) and not _ANSWER_IS.search(a) and not _HEADING.match(a):
            out.append((m.start(), k, a, False))  # else the box or the "answer is" in it counts
    starts, reach = [i for i, *_ in boxes], list(accumulate((j for _, j, _ in boxes), max))
    read = {}  # clause -> the answer it commits to: a restated one is read once
    marks = list(_ANSWER_LOW.finditer(low)) if said else []
    budget = min(budget, CLAUSE_BUDGET)  # what the clauses may read in all (a regex a character)
    for n, m in enumerate(marks):
        k = bisect_right(starts, m.end()) - 1  # boxes opened before it; reach: their furthest end
        base = _LEAD.match(text, m.end()).end()  # "The answer is:" then the answer on the next line
        if k >= 0 and reach[k] > m.end() or _BOX_NEXT.match(text, base):
            continue  # inside a box, or a box next: the box counts
        lo = _CLAUSE.match(low, max(0, m.start() - 200), m.start())
        clause = (lo.end() if lo else max(0, m.start() - 200), m.start())
        stop = min(len(text), base + MAX_ANSWER)
        line = stop if (nl := text.find("\n", base, stop)) < 0 else nl  # where its line ends
        line = stop if _OPENER.fullmatch(text, base, line) else line  # "$$" alone: lines after it
        if _GOAL.search(low, *clause) or _NOT.match(text, base):
            continue  # a goal or condition, "the answer is not 5"
        # the next commitment: a clause that runs into it commits to nothing (the inner counts)
        box = bisect_right(starts, base)
        nxt = min(marks[n + 1].start() if n + 1 < len(marks) else len(text),
                  starts[box] if box < len(starts) else len(text))
        inner = nxt < line
        a, end = _clip(text, base, nxt) if inner else _clip(
            text, base, line, line == stop and not _BLANK.match(text, stop))
        if (budget := budget - (end - base)) < 0:
            return None
        if inner and end >= nxt:
            continue
        if not a:
            if stop == len(text) and not text[base:stop].strip(" \t:*$\n"):
                unfinished = max(unfinished, m.start())  # cut off after "the answer is"
        elif a := read[a] if a in read else read.setdefault(a, _clause_answer(a)):
            out.append((m.start(), end, a, False))
    return sorted(out), unfinished


def _withdraws(gap: str) -> bool:
    """Whether gap (lower-cased text between two commitments) takes the first back: a retraction
    outside a hedge, or a soft cue (wait, hmm, re-check) in a gap with no hedge. C-speed passes,
    any length."""
    pattern, soft, hedged, i = _GAP_CUE, False, False, 0
    while m := pattern.search(gap, i):
        i, kind = m.end(), m.lastgroup.rsplit("_", 1)[0]
        if kind == "strong":
            return True
        soft, hedged = soft or kind == "soft", hedged or kind in ("hedge", "adds")
        pattern = _GAP_SHARP if soft or hedged else pattern  # then only retractions, hedges matter
    return soft and not hedged


def _doubted(low: str, i: int) -> bool:
    """Whether the text after the last commitment (low[i:], at any distance) retracts or hedges,
    or doubts it (wait, re-check, "did I ...?") with no confirmation ("correct", "yes") after the
    doubt."""
    if _QMARK.match(low, i):
        return True
    pattern = _TAIL_CUE
    while m := pattern.search(low, i):  # a doubt, then its confirmation, ...: C skips the rest
        i, kind = m.end(), m.lastgroup.rsplit("_", 1)[0]
        if kind in ("strong", "hedge"):
            return True
        if kind in ("soft", "question"):
            pattern = _TAIL_SETTLE
        elif kind == "confirm":
            pattern = _TAIL_CUE
        if pattern is _TAIL_SETTLE and not _CONFIRM.search(low, i):  # nothing can settle it
            return True
    return pattern is _TAIL_SETTLE


def _last_retraction(low: str, commits: list, ends: list) -> int | None:
    """Index of the first commitment after the last gap that withdraws (0: none), or None when
    more than MAX_DIFFERENT different answers follow that gap (no answer, whatever came before). A
    gap read once decides its copies: a restated answer costs a dict look-up."""
    verdicts, different = {}, {commits[-1][2]}
    for k in range(len(commits) - 1, 0, -1):
        gap = low[ends[k - 1]:commits[k][0] + 1]  # and one character on: "could be \\boxed{14}"
        if (withdrawn := verdicts.get(gap)) is None:
            withdrawn = verdicts[gap] = _withdraws(gap)
        if withdrawn:
            return k
        different.add(commits[k - 1][2])
        if len(different) > MAX_DIFFERENT:
            return None
    return 0


COLLAPSE_ABOVE = 64  # commitment markers: a text with fewer is read as it is


def _collapse(text: str) -> str:
    """Runs of identical pieces (lines, then the pieces from one marker to the next, for each kind
    of marker: a restated answer, thousands of times) kept as the few copies that decide the
    answer: every copy commits to the same answer with the same gap before it, so the final answer
    is the same and is read in the time of a few. Only pieces that close what they open (brackets,
    $), hold no tag and end their clause (a box, a line break, a sentence's end: no answer runs
    into the next copy); enough copies are kept that the last reads 200 characters of copies
    before it. String splits: C speed at any length."""
    low = text.lower() if "<" not in text else ""
    if sum(map(low.count, ("\\boxed", "\\fbox", "####", "answer"))) <= COLLAPSE_ABOVE:
        return text  # few markers (or tags): read as it is
    for sep in ("\n", "answer", "Answer", "ANSWER", "\\boxed", "\\fbox", "####"):
        if sep not in text:
            continue
        if sep == "\n":
            pieces = text.splitlines(keepends=True)
        else:
            parts = text.split(sep)
            pieces = parts[:1] + [sep + p for p in parts[1:]]
        if not any(map(operator.eq, pieces, islice(pieces, 1, None))):
            continue  # no piece repeats the one before it (C-speed check)
        out = []
        for piece, run in groupby(pieces):
            n, keep = sum(1 for _ in run), 2 + 200 // max(1, len(piece))  # 200 chars: context
            out.append(piece * (keep if n > keep and _closed(piece) else n))
        text = "".join(out)
    return text


def _closed(piece: str) -> bool:
    """A piece that closes what it opens (brackets, $) and ends its clause."""
    whole = all(piece.count(o) == piece.count(c) for o, c in ("{}", "()", "[]"))
    ends = piece.startswith(("\\boxed", "\\fbox")) or "\n" in piece or _RUNON.search(piece)
    return whole and piece.count("$") % 2 == 0 and bool(ends)


def _final(text: str, top: bool = True) -> tuple[str | None, bool]:
    """(the final answer or None, whether the text commits to anything): step 1. top: a
    completion."""
    if top and "</think>" in text:  # thinking commits to nothing
        text = text[text.rfind("</think>") + 8:]
    text = _collapse(text) if top else text
    low, commits, pos, close = _lower(text), [], 0, text.find("</answer>")
    if top and text.find("<answer>", 0, max(close, 0)) >= 0:  # r1 format: a block is a commitment,
        if text.count("</answer>") > MAX_COMMITS:  # read by this rule
            return None, True
        while (close := text.find("</answer>", pos)) >= 0 and (
                open_ := text.rfind("<answer>", pos, close)) >= 0:
            a, committed = _final(inner := text[open_ + 8:close], False)
            commits.append((open_, close + 9, a if committed else inner.strip() or None, False))
            pos = close + 9
    if (found := _commitments(text[pos:], low[pos:])) is None:
        return None, True
    commits += [(i + pos, j + pos, a, box) for i, j, a, box in found[0]]
    unfinished = found[1] + pos if found[1] >= 0 else -1
    ends = list(accumulate((c[1] for c in commits), max))
    if not commits or unfinished > commits[-1][0] or _doubted(low, ends[-1]):
        return None, bool(commits) or unfinished >= 0
    if (cut := _last_retraction(low, commits, ends)) is None:
        return None, True
    commits = commits[cut:]  # a retraction withdraws all before it
    others = list(dict.fromkeys(a for *_, a, box in commits if not box))
    texts, boxes = dict.fromkeys(c[2] for c in commits if c[3]), []
    for a in texts if len(texts) <= 8 else ():  # more different boxes is no answer: no pairs
        boxes += [] if any(is_equiv(a, b) for b in boxes) else [a]
    answers = others + ([", ".join(boxes)] if len(boxes) > 1 else boxes)
    final = ", ".join(boxes) if commits[-1][3] and len(boxes) > 1 else commits[-1][2]
    ok = None not in answers and len(set(answers)) <= 8 and len(texts) <= 8 and all(
        a == final or is_equiv(a, final) for a in answers)
    return (final if ok else None), True


def extract_answer(text: str, lenient: bool = False) -> str | None:
    """The completion's final answer (step 1 of the module docstring), or None."""
    answer, committed = _final(text)
    if answer is None and not committed and lenient:  # the last number: rfind per digit is C-speed
        k = max(text.rfind(c) for c in "0123456789") + 1
        m = _NUMBER_AT_END.search(text, max(0, k - MAX_NUMBER), k) if k else None
        return m.group().rstrip(",") if m else None
    return answer if answer != TOO_LONG else None


_WRAPPER = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|textsf|texttt|textup|textmd"
                      r"|mathrm|mathbf|mathit|mathsf|mathtt|mathnormal|mathup|mbox|hbox"
                      r"|operatorname|emph|boldsymbol|bm|pmb|underline)\s*\{|[{}]")  # or a brace
_THIN_DIGITS = re.compile(r"(?<=\d)(?:\\[,;: ]|~)(?=\d)")  # 1\,000: a digit group
_THIN = re.compile(r"(?<!\\)(?:\\[,;: ]|~)")  # elsewhere a space: 12\,cm is 12 cm
_THIN_COMMA = re.compile(r"(?<=\d),\\!\s*(?=\d)")  # MATH's "11,\! 111": a digit group, not a list
_QUAD_GLUED = re.compile(r"\\q?quad(?=[a-z])")  # "\quadx_{2}" (NuminaMath golds): a space
_LIST_COMMA = re.compile(r",\s+")  # "32, 349", "1,000, 2,000": a comma and a space separate items
_DROP = re.compile(r"(?=[\\^°%$+dtc])(?:\\(?:left|right|middle"  # the lookahead: fail fast
                   r"|(?:display|text|script|scriptscript)style|qquad|quad|degree|bigg?[lrm]?|bf|rm"
                   r"|it|sf|tt|boldmath|(?:text)?color\s*\{[a-z]*\})(?![a-z])|(?<!\\)\\!"
                   r"|\^\s*\{\s*\\circ\s*\}|(?<=\\)[dtc](?=frac|binom)|\^\s*\\circ|\\circ|°|\\%|%"
                   r"|\\\$|\$|\\[()\[\]]|(?<![\w}])\+(?=\s*\\infty))")
_UNICODE = dict(zip("−×·±∞π√÷≤≥≠∪…⁄", (
    "-", "\\times", "\\cdot", "\\pm", "\\infty", "\\pi", "\\sqrt", "\\div", "\\le", "\\ge", "\\neq",
    "\\cup", "\\ldots", "/")))
_UNICODE |= {  # vulgar fractions
    c: "\\frac{%d}{%d}" % Fraction(unicodedata.numeric(c)).limit_denominator(10).as_integer_ratio()
    for c in "½⅓⅔¼¾⅕⅖⅗⅘⅙⅚⅛⅜⅝⅞"}
_SUPER = re.compile("[⁰¹²³⁴⁵⁶⁷⁸⁹⁻]+")
_SUPER_DIGITS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
_SPELL = [(t, re.compile(a), b) for t, a, b in (  # (a substring that must be there, pattern, new)
    ("{,}", r"\{,\}", ","), ("}", r"\{([+-])\}", r"\1"), ("\\", r"\\lbrace|\\\{", r"\\{"),
    ("\\", r"\\rbrace|\\\}", r"\\}"), ("\\lbrack", r"\\lbrack", "["),
    ("\\rbrack", r"\\rbrack", "]"),
    ("matrix", r"\\begin\{[pb]?matrix\}", r"\\begin{matrix}"),
    ("matrix", r"\\end\{[pb]?matrix\}", r"\\end{matrix}"),
    ("\\", r"\\leq?(?![a-z])|\\leqslant", r"\\le "), ("<=", "<=", r"\\le "), (">=", ">=", r"\\ge "),
    ("\\", r"\\geq?(?![a-z])|\\geqslant", r"\\ge "),
    ("\\", r"\\neq?(?![a-z])|\\not\s*=", r"\\neq "),
    ("!=", "!=", r"\\neq "), ("\\", r"\\lt(?![a-z])", "<"), ("\\", r"\\gt(?![a-z])", ">"),
    ("/", r"^(-?\d+)\s+(\d+)\s*/\s*(\d+)$", r"\1\\frac{\2}{\3}"))]
# \frac12, \frac1{2}: the arguments of \frac and \binom as LaTeX reads them
_FRAC_ARGS = re.compile(r"\\(frac|binom)\s*(\{[^{}]*\}|[^\s{}\\])\s*(\{[^{}]*\}|[^\s{}\\])")
_SQRT = re.compile(r"(\\sqrt|_)\s*([^\s{\\\[])")  # \sqrt2, x_1, \log_2 8: as LaTeX reads them
_TEXT_UNIT = re.compile(r"(?<=[\d}a-z!)])\s*\\(?:text|mbox)\s*\{\s*[a-z][a-z\s.]*\}"
                        r"(?:\^\{?\d\}?)?\s*$")  # 5\text{ m}
_UNITS = re.compile(r"(?<=[\d}!])(?:\s+(?:[a-z]{2,}|[msgl])(?![a-z])\.?(?:\^\{?\d\}?)?){1,4}"
                    r"\s*$")  # 5 cm, 18 dollars
_NAME = r"(?:[a-z]{1,3}(?:_\{?[a-z0-9]+\}?)?|\\[a-z]+(?:\{[a-z]+\})?)"  # x, a_1, cd, \vec{v}
_LHS = re.compile((r"(?:(?:m?\\angle)?[a-z]{1,3}(?:_\{?[a-z0-9]+\}?)?(?:\([^()=]*\))?"
                   r"|\\[a-z]+(?:\{[a-z]+\})?|\([a-z](?:[,;][a-z])+\)|\|N\||\\\|N\\\||N(?::N)+"
                   r"|N/\(?N\)?)(?:=|\\in(?![a-z]))").replace("N", _NAME))
# _LHS: x=, a_1=, g(3)=, cd=, \theta=, (m,n)=, |ab|=, ae:ec=, ab/cd=, x\in
_ARG = r"((?:[^{}]|\{[^{}]*\})+)"  # a \frac argument: nested braces one level deep
_SIMPLE_FRAC = re.compile(r"\\frac\{" + _ARG + r"\}\{" + _ARG + r"\}")
_ATOM = re.compile(r"-?(?:[\d.]+|[a-z]|\\[a-z]+(?:\{[^{}]*\})?)")  # one factor: 2, x, \pi, \sqrt{3}
_PRODUCT = re.compile(r"-?(?:[\d.]|[a-z]|\\[a-z]+(?![a-z])(?:\{[^{}]*\})?)+")  # side by side: 3\pi
_DOTS = re.compile(r"(?<!\d)(-?\d*)\.(\d+)(?:\\[lc]?dots|\.\.\.)")  # 0.666\ldots; one try per run
_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven "
                                     "twelve thirteen fourteen fifteen sixteen seventeen eighteen "
                                     "nineteen".split())}
_WORDS |= {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty "
                                           "ninety".split(), 2)}
_SCALES = {"hundred": 100, "thousand": 10 ** 3, "million": 10 ** 6, "billion": 10 ** 9}
_WORD = "(?:%s)" % "|".join(list(_WORDS) + list(_SCALES))
_NUMWORD = re.compile(r"(?<![\w.])(?:(\d+(?:\.\d+)?)\s+)?(%s(?:(?:\s+and\s+|[\s-]+)%s)*)\b"
                      % (_WORD, _WORD))
_PLURAL = re.compile(r"\b([a-z]{2,}?)(ies|(?:(?<=[sxz])|(?<=ch|sh))es|(?<![sui])s)\b")
_LETTERS, _RELATION = re.compile(r"(?:^|[^\\a-z])[a-z]{2}"), re.compile(r"(<|>|\\le|\\ge)")
_REL_SEP = re.compile(r"\\neq|\\le|\\ge|<|>|=")  # one relation: an equation or an inequality
_BASE = re.compile(r"([0-9a-z]+)_\{(\d+)\}")
_CHOICE = re.compile(r"\(([a-e])\)((?:\(?-?\d|\\frac|\\sqrt).*)")


def _slash(m: re.Match) -> str:
    """\\frac{a}{b} -> a/b; parenthesise a if not a product, b if not one factor, the whole after a
    factor."""
    a = m[1] if _PRODUCT.fullmatch(m[1]) else f"({m[1]})"
    b = m[2] if _ATOM.fullmatch(m[2]) else f"({m[2]})"
    before = m.string[m.start() - 1] if m.start() else ""
    glued = before.isdigit() or before in (".", ")", "}")
    return f"({a}/{b})" if glued else f"{a}/{b}"


def _number_words(m: re.Match) -> str:
    """seven -> 7, twenty-one -> 21, one hundred and five -> 105, 2.5 thousand -> 2500; else
    unchanged."""
    words = re.split(r"[\s-]+", m[2])
    if m[1] and words[0] not in _SCALES:  # 3 seven is no number
        return m.group()
    total, part = Fraction(0), Fraction(m[1] or 0)
    for w in words:  # "and" is neither
        if w in _WORDS:
            part += _WORDS[w]
        elif w in _SCALES:
            part = (part or 1) * _SCALES[w]
        if w in _SCALES and w != "hundred":
            total, part = total + part, Fraction(0)
    v = total + part
    return str(v.numerator) if v.denominator == 1 else str(float(v))


def _dots(m: re.Match) -> str:
    """0.1666\\ldots -> 0.1\\overline{6}: the shortest repeating tail shown at least twice, else
    unchanged."""
    d, k, fail = m[2], 0, [0]  # KMP on the reversed digits: each tail's shortest period, one pass
    for c in (r := d[::-1])[1:]:
        while k and c != r[k]:
            k = fail[k - 1]
        fail.append(k := k + (c == r[k]))
    periods = ((len(d) - t, t - fail[t - 1]) for t in range(len(d), 0, -1)
               if 2 * (t - fail[t - 1]) <= t)
    s, p = next(periods, (0, 0))
    return f"{m[1]}.{d[:s]}\\overline{{{d[s:s + p]}}}" if p else m.group()


def _strip_wrappers(s: str) -> str:
    """Presentation macros (\\mathbf{...}, \\text{...}) dropped, their content kept after a space
    (5\\text{cm} -> 5 cm): one pass over the braces with a stack, at any depth; s unchanged if a
    wrapper never closes."""
    out, wrapper, last = [], [], 0  # wrapper: per open brace, whether a presentation macro did
    for m in _WRAPPER.finditer(s):
        if m.group() == "{":
            wrapper.append(False)
        elif m.group() != "}":
            wrapper.append(True)
            out.append(s[last:m.start()] + " ")
            last = m.end()
        elif wrapper and wrapper.pop():
            out.append(s[last:m.start()])
            last = m.end()
    return s if any(wrapper) else "".join(out) + s[last:]


def _normalize(s: str) -> str:
    """One spelling of an answer (step 2 of the module docstring), in passes linear in its size."""
    s = " ".join(s.lower().split()).replace("...", "\\ldots")  # one space: no \\s+ scans twice
    box = _boxes(s, 0, len(s), 4 * len(s)) if s.startswith(("\\boxed", "\\fbox")) else None
    if box and box[0] and box[0][0][1] == len(s):
        s = box[0][0][2]  # a whole-answer box
    s = "".join(_UNICODE.get(c, c) for c in s) if not s.isascii() else s
    s = _SUPER.sub(lambda m: "^{" + m.group().translate(_SUPER_DIGITS) + "}", s)  # x² -> x^{2}
    s = _THIN_COMMA.sub(",", s) if ",\\!" in s else s
    s = _QUAD_GLUED.sub(" ", s) if "quad" in s else s
    s = _THIN.sub(" ", _THIN_DIGITS.sub("", s)) if "\\" in s or "~" in s else s
    s = _TEXT_UNIT.sub("", _DROP.sub("", s).strip().rstrip("."))
    s = _strip_wrappers(s) if "\\" in s and _WRAPPER.search(s) else s  # \mathbf{\frac{3}{8}}
    for t, a, b in _SPELL:
        s = a.sub(b, s.strip()) if t in s else s
    s = _SQRT.sub(r"\1{\2}", s)
    s = _FRAC_ARGS.sub(lambda m: "\\" + m[1] + "".join(a if a[0] == "{" else "{" + a + "}"
                                                       for a in m.groups()[1:]), s)
    s = s.strip().rstrip(".").strip()
    if _LETTERS.search(s):  # number words; "a and b", "a or b", "either a or b" as a list
        s = re.sub(r"(?<=[)\]])or(?=[(\[])", ", ", s)  # "(11,7)or(7,11)": alternatives too
        s = re.sub(r"(?<!\s),?\s+(?:and|or)\s+", ", ", _NUMWORD.sub(_number_words, s))
        s = s[7:] if s.startswith("either ") else s
    s = _UNITS.sub("", s.strip())
    if re.fullmatch(r"[a-z][a-z' -]*", s):  # a word answer: no article, singular
        s = _PLURAL.sub(lambda m: m[1] + ("y" if m[2] == "ies" else "") if len(m[0]) > 3 else m[0],
                        re.sub(r"^(?:the|an?) ", "", s))
    s = re.sub(r"\s+", "", _LIST_COMMA.sub(";", s))  # "32, 349" -> 32;349: a list, not 32,349
    s = _DOTS.sub(_dots, s) if "." in s else s
    for _ in range(4 if s.count("\\frac") <= 16 else 0):  # outer \frac first, then the ones it held
        s = _SIMPLE_FRAC.sub(_slash, s)
    for _ in range(8):  # "{5}" -> "5"; bounded, each check is a linear scan
        s = s[1:-1] if s.startswith("{") and _wraps(s) else s
    return s


def _wraps(s: str) -> bool:
    """True when the bracket opening at s[0] closes at s[-1] (any of ([{ with any of )]}); C-speed
    running depths."""
    depths = list(accumulate(map(_DEPTH.get, s, repeat(0)))) if s[:1] in ("(", "[", "{") else [0]
    return len(depths) > 1 and depths[-1] == 0 and min(depths[:-1]) > 0


def _top(s: str, sep: str) -> list[re.Match]:
    """The matches of the separator pattern sep in s outside any bracket."""
    out, depth = [], 0
    for m in re.finditer(r"[(\[{]|[)\]}]|" + sep, s):  # only brackets and separators
        depth += _DEPTH.get(m.group(), 0)
        if depth == 0 and m.group() not in _DEPTH:
            out.append(m)
    return out


def _split(s: str, sep: str = ",") -> list[str]:
    """Split at top-level separators (outside any bracket)."""
    if sep not in s:
        return [s]
    cuts = [0] + [k for m in _top(s, re.escape(sep)) for k in (m.start(), m.end())] + [len(s)]
    return [s[i:j] for i, j in zip(cuts[::2], cuts[1::2])]


def _items(s: str) -> list[str]:
    """The items of a list: split at top-level semicolons when there are any (1,000; 2, written
    "1,000, 2" too), else at commas; an item that is no number (1, 2,3) at its commas as well."""
    items = _split(s, ";")
    if len(items) == 1:
        return _split(s)
    return [u for t in items for u in ([t] if _number(t) is not None else _split(t))]


def _parts(s: str) -> tuple[str, list[str]] | None:
    """(kind, items) of a compound answer: the bracket pair of a tuple/interval, 'set' if
    unordered, a matrix shape, 'ratio' (a:b:c as b/a, c/a)."""
    if s.startswith("\\begin{matrix}") and s.endswith("\\end{matrix}"):
        rows = [r.split("&") for r in s[14:-12].split("\\\\") if r]
        return f"matrix{len(rows)}x{len(rows[0]) if rows else 0}", [c for r in rows for c in r]
    if s.startswith("\\{") and s.endswith("\\}") and _wraps(s[1:]):
        return "set", _items(s[2:-2])
    if s[:1] in "([" and s[-1:] in ")]" and _wraps(s):
        return s[0] + s[-1], _items(s[1:-1])
    items = _split(s, "\\cup") if "\\cup" in s else _items(s)  # bare lists and unions are unordered
    ratio = _split(s, ":") if len(items) == 1 and not _RELATION.search(s) else []
    if len(ratio) > 2 and all(ratio):
        return "ratio", [f"({t})/({ratio[0]})" for t in ratio[1:]]
    if len(items) == 1 and s.count("\\pm") == 1 and "\\le" not in s and "\\ge" not in s:  # a \pm b:
        items = [s.replace("\\pm", "+"), s.replace("\\pm", "-")]  # {a + b, a - b}
    return ("set", items) if len(items) > 1 else None


def _relation(s: str) -> str:
    """x<4 -> (-\\infty,4), 5>y -> (-\\infty,5), 2<x\\le5 -> (2,5], 2x+2>4 -> (1,\\infty)
    (exact.linear_bound); anything else unchanged."""
    p = _RELATION.split(s)
    if len(p) == 3 and _LHS.fullmatch(p[2] + "=") and not _LHS.fullmatch(p[0] + "="):  # 5 > y
        p = [p[2], {"<": ">", ">": "<", "\\le": "\\ge", "\\ge": "\\le"}[p[1]], p[0]]
    if len(p) == 3 and p[0] and p[2] and not _LHS.fullmatch(p[0] + "=") and (
            x := exact.linear_bound((p[0], p[1], p[2]))):
        p = [x[0], x[1], str(x[2])]  # -x > -1 -> x < 1
    if len(p) == 3 and _LHS.fullmatch(p[0] + "=") and p[2]:
        return {"<": "(-\\infty,%s)", "\\le": "(-\\infty,%s]", ">": "(%s,\\infty)",
                "\\ge": "[%s,\\infty)"}[p[1]] % p[2]
    chain = len(p) == 5 and {p[1], p[3]} <= {"<", "\\le"} and p[0] and p[4]  # 2 < x \le 5
    if chain and _LHS.fullmatch(p[2] + "="):
        return ("(" if p[1] == "<" else "[") + p[0] + "," + p[4] + (")" if p[3] == "<" else "]")
    return s


def _unwrap(s: str) -> str:
    """"(5)" -> "5", "(a)" -> "a", "x=5" -> "5", "x\\in[1,2]" -> "[1,2]", "ae:ec=1:2" ->
    "(1)/(2)", a relation as its interval; bounded."""
    for _ in range(8):
        if (m := _LHS.match(s)) and "=" not in s[m.end():]:
            s = s[m.end():]
        elif s[:1] == "(" and s[-1:] == ")" and _wraps(s) and len(_items(s[1:-1])) == 1:
            s = s[1:-1]
        else:
            break
    if ":" in s and len(ratio := _split(s, ":")) == 2 and all(ratio) and not _RELATION.search(s):
        return f"({ratio[0]})/({ratio[1]})"  # a ratio a:b is a/b
    return _relation(s) if ("<" in s or ">" in s or "\\le" in s or "\\ge" in s) else s


def _named(s: str) -> list[tuple[str, str]] | None:
    """[(name, value)] of a list of two or more assignments to different names (p=1,q=4), else
    None."""
    if "=" not in s or len(items := _items(s)) < 2:
        return None
    found = [_LHS.match(t) for t in items]
    pairs = [(t[:m.end()], t[m.end():]) for t, m in zip(items, found) if m]
    return pairs if len(pairs) == len(items) and len(dict(pairs)) == len(pairs) else None


def _in_order(s: str) -> list[str] | None:
    """The items of a tuple (a, b) or of a bare list a, b, in order; None for anything else."""
    if s[:1] in "([{\\" and _wraps(s[s[:1] == "\\":]):
        return _items(s[1:-1]) if s[0] == "(" else None
    return _items(s)


def _assignments(a: str, b: str, depth: int) -> bool | None:
    """Lists of assignments: by name when both sides name the same variables (a=1,b=2 is b=2,a=1),
    else in order against a tuple, a bare list or other names (AB=4,CD=5 is 4,5); None when neither
    side is one."""
    na, nb = _named(a), _named(b)
    if not na and not nb:
        return None
    if na and nb and dict(na).keys() & dict(nb).keys():  # names in common: by name, all of them
        named = dict(nb)
        return dict(na).keys() == named.keys() and all(_equal(v, named[k], depth + 1)
                                                        for k, v in na)
    u = [v for _, v in na] if na else _in_order(_unwrap(a))
    w = [v for _, v in nb] if nb else _in_order(_unwrap(b))
    return u is not None and w is not None and len(u) == len(w) and all(
        _equal(x, y, depth + 1) for x, y in zip(u, w))


def _sides(s: str) -> tuple[str, str, str] | None:
    """(lhs, relation, rhs) of one equation or inequality (= \\neq < > \\le \\ge) outside
    brackets: no list, no chain; else None."""
    if not _REL_SEP.search(s) or _top(s, "[,;]"):
        return None
    found = _top(s, _REL_SEP.pattern)
    if len(found) != 1 or not found[0].start() or found[0].end() == len(s):
        return None
    return s[:found[0].start()], found[0].group(), s[found[0].end():]


def _equal(a: str, b: str, depth: int = 0) -> bool:
    """Step 3 on two normalised answers: assignments, one relation, then after _unwrap choices and
    bases, numbers, compound answers item by item (depth: how far inside them), else exact.same."""
    if a == b:
        return True
    if depth > 4:
        return False
    if (named := _assignments(a, b, depth)) is not None:
        return named
    if (u := _sides(a)) and (v := _sides(b)) and exact.same_relation(u, v):  # x-1=0 is 1-x=0
        return True
    a, b = _unwrap(a), _unwrap(b)
    if a == b:
        return True
    for u, v in ((a, b), (b, a)):  # (c)7 is (c) and 7; 110_2 is 110 (a side omits the base), not 6
        if (m := _CHOICE.fullmatch(u)) and (v in (m[1], f"({m[1]})") or _equal(m[2], v, depth + 1)):
            return True
        base = int(m[2]) if (m := _BASE.fullmatch(u)) else 0
        if 2 <= base <= 36 and all(int(c, 36) < base for c in m[1]):
            return m[1].lstrip("0") == v.lstrip("0")
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y
    if x is None and y is None and max(len(a), len(b)) > MAX_NUMBER and (
            k := decimal_key(a)) is not None:
        return k == decimal_key(b)  # plain decimals too long to convert, digit by digit
    pa, pb = _parts(a), _parts(b)
    if x is not None or y is not None or pa is None or pb is None:  # an expression on one side:
        return exact.same(a, x, b, y)  # the normal form decides
    if pa[0] != pb[0] or len(pa[1]) != len(pb[1]) or len(pa[1]) > 32:
        return False
    if pa[0] != "set":
        return all(_equal(u, v, depth + 1) for u, v in zip(pa[1], pb[1]))
    rest = list(pb[1])
    for u in pa[1]:  # multiset match, greedy (equivalence is transitive); identical strings first
        k = rest.index(u) if u in rest else next(
            (k for k, v in enumerate(rest) if _equal(u, v, depth + 1)), None)
        if k is None:
            return False
        rest.pop(k)
    return True


def is_equiv(pred: str | None, gold: str | None) -> bool:
    """True when the two answers are the same after normalisation (exact rationals for numbers):
    steps 2-3."""
    if pred is None or gold is None or TOO_LONG in (pred, gold):
        return False
    if len(pred) > MAX_LONG or len(gold) > MAX_LONG:  # never equal
        return False
    if max(len(pred), len(gold)) > MAX_ANSWER:  # identical up to spacing, or the same plain decimal
        a, b = (t.translate(_SPACING).replace("\\,", "").replace("\\!", "").replace("{,}", "")
                for t in (pred, gold))
        return bool(pred.strip()) and (a == b or (k := decimal_key(a.replace(",", ""))) is not None
                                       and k == decimal_key(b.replace(",", "")))
    a, b = _normalize(pred), _normalize(gold)
    return bool(a) and bool(b) and _equal(a, b)


def reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer (step 1) is equivalent to gold, else 0.0 (no final
    answer -> 0.0)."""
    return float(is_equiv(extract_answer(completion), gold))


def format_reward(completion: str) -> float:
    """1.0 iff the completion is one <think>...</think> then one non-empty <answer>...</answer>,
    nothing else."""
    s = completion.strip()
    s = next((s[:-len(e)].rstrip() for e in EOS if s.endswith(e)), s)
    if any(s.count(t) != 1 for t in ("<think>", "</think>", "<answer>", "</answer>")):
        return 0.0  # each tag exactly once: no second block, no nesting
    mid, ans = s.find("</think>") + 8, s.find("<answer>")
    between, answer = s[mid:ans].strip(), s[ans + 8:-9].strip()
    ok = s.startswith("<think>") and s.endswith("</answer>") and mid <= ans and not between
    return float(ok and bool(answer))


_STEP = re.compile(r"[^;\s](?:[^;\n]*[^;\s])?")  # a step without its surrounding whitespace
_ARITH = re.compile(r"[0-9+\-*/()\s]*")
_GLUED = re.compile(r"[0-9)]\s*\(|[0-9]\s+[0-9]")  # 2(3), (1)(2), "1 2": no implicit products


def eval_arith(expr: str) -> Fraction | None:
    """Exact value of an integer expression with + - * / ( ) and standard precedence; None if
    malformed or /0."""
    expr = expr.replace("×", "*").replace("÷", "/")
    if len(expr) > MAX_EXPR or not _ARITH.fullmatch(expr) or _GLUED.search(expr):
        return None
    return exact.value(expr)  # exact.value on integers and + - * / ( ): one iterative pass


def step_rewards(solution: str) -> list[tuple[int, bool]]:
    """Per step of "8-18=-10;-10+13=3 #### 3" (split by ';' or newlines, up to '####'): (end,
    correct). end: exclusive offset of the step's end (its last character is solution[end - 1]);
    correct: eval_arith(lhs) == eval_arith(rhs)."""
    stop, out = solution.find("####"), []
    for m in _STEP.finditer(solution, 0, stop if stop >= 0 else len(solution)):
        lhs, eq, rhs = m.group().partition("=")
        left = eval_arith(lhs) if eq and "=" not in rhs else None
        out.append((m.end(), left is not None and left == eval_arith(rhs)))
        if len(out) >= MAX_STEPS:
            break
    return out
