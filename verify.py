r"""Answer checking for reasoning RL: the final answer, its normalisation, exact equivalence, rewards.

Pure Python on strings, no eval/exec, no CAS (the exact normal form is exact.py); every pass linear in its input,
bounded sizes (MAX_*): milliseconds at 1M characters of any shape. reward(completion, gold) = 1.0 iff steps 1-3 agree.

1. The final answer (extract_answer) is the last commitment, when every earlier one that differs is withdrawn.
   Commitments: a balanced \boxed{...} / \fbox{...} / `\boxed 5`; the rest of a "####" line; the clause after "the
   (final) answer is" / "Answer:" (its line, or the next when it is empty or opens $$ / \[); an <answer> block (read by
   this rule). Not: text before a closing </think>, "#### Step 1: ...", a condition or goal ("if / we must show that the
   answer is", "maybe", "not"), a description ("the number of ways ..."). An answer ends where its sentence does or
   a reason begins: `#### 30 (so 30 left)`, `8, not 6.`, `56 since 7 x 8 = 56`.
   A retraction between two commitments withdraws all before it: a cue (wrong, mistake, error, no, correction, typo,
   double-counted, forgot, misread, ...) outside a hedge, or a soft one (wait, hmm, actually, re-check, on second
   thought) with no hedge there. These are 14: "First try: \boxed{12}. Checking again I double-counted ... \boxed{14}",
   "\boxed{12} is wrong; the right value is \boxed{14}", "The answer is 12. Wait, an error: ... The answer is 14".
   No final answer (reward 0) when
   - two commitments differ with no retraction between: "\boxed{12} or maybe \boxed{14}", "\boxed{12} (or possibly
     \boxed{14})", "\boxed{12}. Hmm, it could also be \boxed{14}", "#### 12 ... The answer is 14"; but several boxes
     are one set answer, "a, b, ...", which only a gold list of those values matches (compared as a multiset);
   - after the last one the text retracts, hedges ("12, though 14 is also possible", "if I'm wrong", "12?"), doubts
     without settling it (wait, hmm: no "correct" / "yes" after) or starts a commitment it does not finish;
   - more than MAX_WITHDRAWN (2) different answers are withdrawn: candidates listed and each called "wrong" but one
     are a search written into the answer, not a correction, and the cue words cost a policy nothing to emit;
   - there are more than MAX_COMMITS commitments, or none (lenient=True: the last number, never for rewards).
2. _normalize: lower-case; unicode (½, x², ×, −, ≤, …); drop $, presentation (\text{}, \mathbf{}, \displaystyle and
   kin, braces inside), \left/\right, spacing, degrees, percent (50% is 50), currency, trailing unit words (5 cm),
   articles and plurals of a word answer, a leading "x =" / "g(3) =" / "(m, n) ="; number words (seven, 2.5 thousand);
   3 1/4 and 3\frac14 are mixed; 0.666\ldots is 0.\overline{6}; one spelling for \dfrac, \frac12, \sqrt2, x_1, {-}7.
3. _equal: numbers compare as exact Fractions (no rounding: 0.33 is not 1/3); tuples, intervals and matrices (pmatrix =
   bmatrix) element-wise, bracket types kept; sets, bare lists, \cup-unions and \pm (3, -3) as multisets; distinct
   assignments p = 1, q = 4 as the tuple (1, 4); a relation x \le 4 as its interval (-\infty, 4] (5 > y is y < 5);
   (C) 7 matches (C) and 7; 110 matches 110_2 (the digits, when one side omits the base); else exact.same decides.
4. format_reward: <think>...</think><answer>...</answer> and nothing else (one trailing EOS allowed); step_rewards:
   each "expr=value" step checked by eval_arith (exact.value on integers and + - * / ( )).

Tests: python -m pytest -q tests/test_verify.py tests/test_verify_heldout.py
"""
import re
import unicodedata
from fractions import Fraction
from itertools import accumulate, islice, repeat

import exact
from exact import MAX_NUMBER, decimal_key, number as _number

MAX_ANSWER = 4000  # characters: longer answers are equal only when identical (or the same plain decimal)
MAX_LONG = 100_000  # characters: longer ones are never equal
MAX_COMMITS = 32  # commitments per completion; more is no answer
MAX_WITHDRAWN = 2  # different answers withdrawn before the last commitment; a third is enumeration: no answer
MAX_EXPR = 200  # characters of one arithmetic step or countdown expression
MAX_STEPS = 256  # steps scored by step_rewards; later ones are ignored
TOO_LONG = "\x00"  # the answer of a commitment past MAX_ANSWER: equal to nothing
EOS = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "<eos>")

_BOX = re.compile(r"\\(?:boxed|fbox)")
_ANSWER_IS = re.compile(r"answer(?: is\b|[ \t*]*:|\s*=)", re.I)  # "the (final) answer is", "Final Answer:"
_HASHES = re.compile(r"####[ \t#]*([^\n]{0,%d})" % (MAX_ANSWER + 1))  # longer: no answer, never a prefix of one
_GOAL = re.compile(r"\b(?:if|whether|suppose|assum\w*|need|needs|must|want|prove|show|check|verify|claim|guess|expect"
                   r"|unless|until|why|how|what|maybe|perhaps|possibly|probably|might|could|hypothe\w*)\b", re.I)
_RETRACT = re.compile(r"\b(?:(?P<weak>wait|hmm+|actually)|oops|mistakes?|mistaken|wrong|incorrect|erroneous|miscalc\w*"
                      r"|recount\w*|recalculat\w*|recomput\w*|redo|re-?examin\w*|reconsider\w*|impossible|invalid"
                      r"|contradict\w*|scratch that|start over|try again|not (?:right|correct|possible|valid|the "
                      r"answer)|(?:is|are)n't (?:right|correct|possible|valid)|can(?:no|')t be|answer is not|(?:does "
                      r"not|doesn't|do not|don't) (?:work|hold|satisfy|fit|make sense))\b|(?<![\w-])no[,.!:]", re.I)
_AMEND = re.compile(_RETRACT.pattern + r"|\b(?:(?P<soft>(?:re|double)[- ]?check\w*|check\w* again|let me re-?\w+"
                    r"|re-?(?:visit|evaluat|think)\w*|on second thought|looking back)|errors?|typo|correct(?:ion|ed"
                    r"|ing)|(?:not|n't) (?:quite|seem|look) right|(?:double|over|under)[- ]?count\w*|mis(?:count|read"
                    r"|interpret|typ|judg|appl|underst|took|t[ae]k)\w*|forg[oe]t\w*|overlook\w*)\b", re.I)  # gaps only
_HEDGE = re.compile(r"\b(?:or (?:maybe|possibly|perhaps|alternatively)|(?:it|this|that|answer) (?:could|might|may) "
                    r"(?:also |well )?be [-\d$\\(]|answer would be|(?:could|might|may) (?:well )?be (?:wrong|mistaken"
                    r"|off\b)|(?:also|equally) (?:possible|plausible|valid)|not (?:\S+ )?(?:sure|certain)|unsure|(?:if"
                    r"|unless) (?:i'?m|that'?s|it'?s|i am|this is) (?:wrong|mistaken))|\(\s*or\b", re.I)
_GAP = re.compile(r"(?P<hedge>" + _HEDGE.pattern + r"|\b(?:another|other|also|both|second) (?:\w+ )?(?:root|solution"
                  r"|answer|value|zero)s?)|" + _AMEND.pattern, re.I)  # one pass, leftmost first; "another root" adds
_BLANK, _SPACE, _LEAD = re.compile(r"[^\S\n]*(?:\n|\Z)"), re.compile(r"\s*"), re.compile(r"[ \t:*]*(?:[\r\n]\s*)?")
_CONFIRM = re.compile(r"\b(?:correct|confirm\w*|verified|checks out|yes)\b|✓", re.I)  # "Wait, let me check ... yes"
_RUNON = re.compile(r"\.(?:\s|$)|(?<!\\);|(?<![\d)}\\])!|\?|,\s+(?!and\b)(?=[a-z]{2})|(?<!\s)\s+(?:\(|(?:since|because"
                    r"|as|so|which|given|hence|thus|therefore|not|i\.e\.|meaning|where|when|if|for|from|by|using)\b"
                    r"|—|–|--)", re.I)  # where the answer ends: a reason, a remark; (?<!\s): one try per run of spaces
_DESCRIPTION = re.compile(r"(?:the|an?)\s+\S+\s+\S+\s+\S+", re.I)  # "the answer is the sum of the roots": no answer
_JOINED, _DEPTH = re.compile(r"\s*(?:,|and|or)\s*(?:and\s*)?\$"), dict.fromkeys("([{", 1) | dict.fromkeys(")]}", -1)
_HEADING = re.compile(r"[a-z]{2}[^\d\s]*\s+\S", re.I)  # "#### Step 1: add" is a markdown heading, not an answer
_TOKEN, _DOLLAR = re.compile(r"[^\s$]+"), re.compile(r"(?<!\\)\$")  # \boxed 5; a closing $, not \$
_NUMBER_AT_END, _SPACING = re.compile(r"-?\d[\d,]*(?:\.\d+)?$"), str.maketrans("", "", " \t\n\r$")


def _boxes(text: str, lo: int, hi: int) -> tuple[list, int]:
    """[(start, end, content)] of the boxes in text[lo:hi] and the start of the last unclosed one (-1 if none)."""
    out, unclosed = [], -1
    for i in [m.start() for m in _BOX.finditer(text, lo, hi)]:
        j = i + (6 if text.startswith("\\boxed", i) else 5)
        k = _SPACE.match(text, j, hi).end()
        if not text.startswith("{", k):
            if k > j and (m := _TOKEN.match(text, k, hi)):
                out.append((i, m.end(), m.group()))  # \boxed 5
            continue
        p = _SPACE.match(text, k + 1, hi).end()  # blanks around the answer are no part of its length
        stop, depth = min(hi, p + MAX_ANSWER), 1  # balanced braces: find "}", count "{" between
        while (q := text.find("}", p, stop)) >= 0:
            depth += text.count("{", p, q) - 1
            p = q + 1
            if depth <= 0:
                break
        if depth == 1 and "{" not in text[p:stop] and text.startswith("}", e := _SPACE.match(text, stop, hi).end()):
            depth, p = 0, e + 1
        out, unclosed = (out + [(i, p, text[k + 1:p - 1].strip())], unclosed) if depth == 0 else (out, i)
    return out, unclosed


def _clip(rest: str, cut: bool = False) -> tuple[str, int]:
    """The answer at the start of rest and its end: a $...$ span, else its clause (cut: the line goes on past rest)."""
    rest, lead = rest.lstrip(" \t:*"), len(rest) - len(rest.lstrip(" \t:*"))
    for a, b in (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", None)):
        if rest.startswith(a):
            m = _DOLLAR.search(rest, len(a)) if b is None else None
            k = m.start() if m else rest.find(b, len(a)) if b else -1
            if k > len(a) and not _JOINED.match(rest, k + len(b or "$")):  # "$5$ and $6$" is one list answer
                return rest[len(a):k].strip(), lead + k + len(b or "$")
    end, depth, pos = len(rest), 0, 0
    for m in _RUNON.finditer(rest):  # the first cut outside brackets
        seg, pos = rest[pos:m.start()], m.start()
        if (depth := depth + sum(seg.count(c) for c in "([{") - sum(seg.count(c) for c in ")]}")) <= 0:
            end = m.start()
            break
    answer = rest[:end].rstrip()
    long = lead + len(answer) >= MAX_ANSWER or cut and end == len(rest)  # trailing blanks are no part of it
    return (TOO_LONG if long else answer.strip(" \t*").rstrip(".").strip(" \t*")), lead + end


def _commitments(text: str) -> tuple[list, int] | None:
    """[(start, end, answer, is_box)] in text order and the start of an unfinished commitment after them (-1 if
    none), or None when there are more than MAX_COMMITS."""
    hashes, said = text.count("####"), _ANSWER_IS.findall(text)
    if text.count("\\boxed") + text.count("\\fbox") + hashes + len(said) > MAX_COMMITS:
        return None
    boxes, unfinished = _boxes(text, 0, len(text))
    out = [(i, j, a, True) for i, j, a in boxes]
    for m in _HASHES.finditer(text) if hashes else ():
        a, k = _clip(m[1], len(m[1]) > MAX_ANSWER and not _BLANK.match(text, m.end()))
        if a and not _BOX.search(a) and not _ANSWER_IS.search(a) and not _HEADING.match(a):  # else the inner counts
            out.append((m.start(), m.start(1) + k, a, False))
    for m in _ANSWER_IS.finditer(text) if said else ():
        clause = re.split(r"[,;:.!?]\s|\n", text[max(0, m.start() - 200):m.start()])[-1]
        base = _LEAD.match(text, m.end()).end()  # "The answer is:" then the answer on the next line
        line = (body := text[base:base + MAX_ANSWER]).split("\n", 1)[0]
        line = body if line.strip() in ("\\[", "$$", "\\(", "$") else line
        if _GOAL.search(clause) or re.match(r"(?:not|n't)\b", line) or any(i <= m.end() < j for i, j, _ in boxes):
            continue
        a, k = _clip(line, len(line) == len(body) and not _BLANK.match(text, base + len(body)))
        if a and not (_BOX.search(a) or _ANSWER_IS.search(a) or _DESCRIPTION.match(a)):  # else its box counts, or
            out.append((m.start(), base + k, a, False))  # the "answer is" in "Final answer: the answer is 5"
        elif not a and not body.strip(" \t:*$\n") and base + MAX_ANSWER >= len(text):
            unfinished = max(unfinished, m.start())  # cut off after "the answer is"
    return sorted(out), unfinished


def _withdraws(text: str, i: int, j: int) -> bool:
    """Whether text[i:j], between two commitments, takes the first back: a cue outside a hedge, a soft one with none."""
    found = [(m["hedge"], m["weak"] or m["soft"]) for a, b in ((i, min(j, i + 2000)), (max(i, j - 2000), j + 1))
             for m in _GAP.finditer(text, a, b)]  # near either commitment; "could also be \\boxed{14}" reads on
    return any(not h and not s for h, s in found) or any(not h for h, _ in found) and not any(h for h, _ in found)


def _final(text: str, top: bool = True) -> tuple[str | None, bool]:
    """(the final answer or None, whether the text commits to anything): step 1. top: a whole completion."""
    text = text[text.rfind("</think>") + 8:] if top and "</think>" in text else text  # thinking: no commitment
    commits, pos, close = [], 0, text.find("</answer>")
    if top and text.find("<answer>", 0, max(close, 0)) >= 0:  # r1 format: a block is a commitment, read by this rule
        if text.count("</answer>") > MAX_COMMITS:
            return None, True
        while (close := text.find("</answer>", pos)) >= 0 and (open_ := text.rfind("<answer>", pos, close)) >= 0:
            a, committed = _final(inner := text[open_ + 8:close], False)
            commits, pos = commits + [(open_, close + 9, a if committed else inner.strip() or None, False)], close + 9
    if (found := _commitments(text[pos:])) is None:
        return None, True
    commits += [(i + pos, j + pos, a, box) for i, j, a, box in found[0]]
    unfinished, ends = (found[1] + pos if found[1] >= 0 else -1), list(accumulate((c[1] for c in commits), max))
    tail = text[ends[-1]:ends[-1] + 1000] if commits else ""  # after the last one: a retraction, an unsettled doubt,
    after = [m["weak"] for m in _RETRACT.finditer(tail)]  # a hedge, a question mark
    if not commits or unfinished > commits[-1][0] or None in after or after and not _CONFIRM.search(tail) or (
            _HEDGE.search(tail) or tail.lstrip(" \t$*").startswith("?")):
        return None, bool(commits) or unfinished >= 0
    cut = next((k for k in range(len(commits) - 1, 0, -1) if _withdraws(text, ends[k - 1], commits[k][0])), 0)
    withdrawn, commits = dict.fromkeys(c[2] for c in commits[:cut]), commits[cut:]  # a retraction: all before it
    boxes, others, texts = [], [a for *_, a, box in commits if not box], dict.fromkeys(c[2] for c in commits if c[3])
    for a in texts if len(texts) <= 8 else ():  # more different boxes is no answer (below): no pairs compared
        boxes += [] if any(is_equiv(a, b) for b in boxes) else [a]
    answers = others + ([", ".join(boxes)] if len(boxes) > 1 else boxes)
    final = ", ".join(boxes) if commits[-1][3] and len(boxes) > 1 else commits[-1][2]
    other = islice((a for a in withdrawn if a != final and not is_equiv(a, final)), MAX_WITHDRAWN + 1)  # not again
    ok = None not in answers and len(set(answers)) <= 8 and len(texts) <= 8 and all(
        a == final or is_equiv(a, final) for a in answers) and len(list(other)) <= MAX_WITHDRAWN
    return (final if ok else None), True


def extract_answer(text: str, lenient: bool = False) -> str | None:
    """The completion's final answer (step 1 of the module docstring), or None."""
    answer, committed = _final(text)
    if answer is None and not committed and lenient:  # the last number: rfind per digit is C-speed
        k = max(text.rfind(c) for c in "0123456789") + 1
        m = _NUMBER_AT_END.search(text, max(0, k - MAX_NUMBER), k) if k else None
        return m.group().rstrip(",") if m else None
    return answer if answer != TOO_LONG else None


_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|textsf|texttt|textup|textmd|mathrm|mathbf|mathit|mathsf"
                   r"|mathtt|mathnormal|mathup|mbox|hbox|operatorname|emph|boldsymbol|bm|pmb|underline)\s*"
                   r"\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}")  # presentation only; one path per character: linear
_DROP = re.compile(r"(?=[\\^°%$+dtc])(?:\\(?:left|right|middle|(?:display|text|script|scriptscript)style|qquad|quad"
                   r"|degree|bigg?[lrm]?|bf|rm|it|sf|tt|boldmath|(?:text)?color\s*\{[a-z]*\})(?![a-z])"
                   r"|(?<!\\)\\[!,;: ]|\^\s*\{\s*\\circ\s*\}|(?<=\\)[dtc](?=frac|binom)|\^\s*\\circ|\\circ|°|\\%|%"
                   r"|\\\$|\$|\\[()\[\]]|(?<![\w}])\+(?=\s*\\infty))")  # the lookahead: fail fast
_UNICODE = dict(zip("−×·±∞π√÷≤≥≠∪…⁄", ("-", "\\times", "\\cdot", "\\pm", "\\infty", "\\pi", "\\sqrt", "\\div",
                                        "\\le", "\\ge", "\\ne", "\\cup", "\\ldots", "/")))
_UNICODE |= {c: "\\frac{%d}{%d}" % Fraction(unicodedata.numeric(c)).limit_denominator(10).as_integer_ratio()
             for c in "½⅓⅔¼¾⅕⅖⅗⅘⅙⅚⅛⅜⅝⅞"}  # vulgar fractions
_SUPER, _SUPER_DIGITS = re.compile("[⁰¹²³⁴⁵⁶⁷⁸⁹⁻]+"), str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
_SPELL = [(t, re.compile(a), b) for t, a, b in (  # (a substring that must be there, pattern, replacement)
    ("{,}", r"\{,\}", ","), ("}", r"\{([+-])\}", r"\1"), ("\\", r"\\lbrace|\\\{", r"\\{"),
    ("\\", r"\\rbrace|\\\}", r"\\}"), ("\\lbrack", r"\\lbrack", "["), ("\\rbrack", r"\\rbrack", "]"),
    ("matrix", r"\\begin\{[pb]?matrix\}", r"\\begin{matrix}"), ("matrix", r"\\end\{[pb]?matrix\}", r"\\end{matrix}"),
    ("\\", r"\\leq?(?![a-z])|\\leqslant", r"\\le "), ("<=", "<=", r"\\le "), (">=", ">=", r"\\ge "),
    ("\\", r"\\geq?(?![a-z])|\\geqslant", r"\\ge "), ("\\", r"\\neq?(?![a-z])", r"\\ne "),
    ("/", r"^(-?\d+)\s+(\d+)\s*/\s*(\d+)$", r"\1\\frac{\2}{\3}"))]
_FRAC_ARGS = re.compile(r"\\(frac|binom)\s*(\{[^{}]*\}|[^\s{}\\])\s*(\{[^{}]*\}|[^\s{}\\])")  # \frac12, \frac1{2}
_SQRT = re.compile(r"(\\sqrt|_)\s*([^\s{\\\[])")  # \sqrt2, x_1, \log_2 8: before spaces go, as LaTeX reads them
_TEXT_UNIT = re.compile(r"(?<=[\d}a-z!)])\s*\\(?:text|mbox)\s*\{\s*[a-z][a-z\s.]*\}(?:\^\{?\d\}?)?\s*$")  # 5\text{ m}
_UNITS = re.compile(r"(?<=[\d}!])(?:\s+(?:[a-z]{2,}|[msgl])(?![a-z])\.?(?:\^\{?\d\}?)?){1,4}\s*$")  # 5 cm, 18 dollars
_LHS = re.compile(r"(?:(?:m?\\angle)?[a-z]{1,3}(?:_\{?[a-z0-9]+\}?)?(?:\([^()=]*\))?|\\[a-z]+(?:\{[a-z]+\})?"
                  r"|\([a-z](?:,[a-z])+\))(?:=|\\in(?![a-z]))")  # x=, a_1=, g(3)=, cd=, \theta=, (m,n)=, x\in
_ARG = r"((?:[^{}]|\{[^{}]*\})+)"  # a \frac argument: nested braces one level deep
_SIMPLE_FRAC = re.compile(r"\\frac\{" + _ARG + r"\}\{" + _ARG + r"\}")
_ATOM = re.compile(r"-?(?:[\d.]+|[a-z]|\\[a-z]+(?:\{[^{}]*\})?)")  # one factor: 2, x, \pi, \sqrt{3}
_PRODUCT = re.compile(r"-?(?:[\d.]|[a-z]|\\[a-z]+(?![a-z])(?:\{[^{}]*\})?)+")  # factors side by side: 3\pi, 2\sqrt{3}
_DOTS = re.compile(r"(?<!\d)(-?\d*)\.(\d+)(?:\\[lc]?dots|\.\.\.)")  # 0.666\ldots; one try per run
_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                     "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_WORDS |= {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), 2)}
_SCALES = {"hundred": 100, "thousand": 10 ** 3, "million": 10 ** 6, "billion": 10 ** 9}
_WORD = "(?:%s)" % "|".join(list(_WORDS) + list(_SCALES))
_NUMWORD = re.compile(r"(?<![\w.])(?:(\d+(?:\.\d+)?)\s+)?(%s(?:(?:\s+and\s+|[\s-]+)%s)*)\b" % (_WORD, _WORD))
_PLURAL = re.compile(r"\b([a-z]{2,}?)(ies|(?:(?<=[sxz])|(?<=ch|sh))es|(?<![sui])s)\b")
_LETTERS, _RELATION = re.compile(r"(?:^|[^\\a-z])[a-z]{2}"), re.compile(r"(<|>|\\le|\\ge)")
_BASE, _CHOICE = re.compile(r"([0-9a-z]+)_\{(\d+)\}"), re.compile(r"\(([a-e])\)((?:\(?-?\d|\\frac|\\sqrt).*)")


def _slash(m: re.Match) -> str:
    """\\frac{a}{b} -> a/b; parenthesise a if not a product, b if not one factor, the whole after a factor."""
    a = m[1] if _PRODUCT.fullmatch(m[1]) else f"({m[1]})"
    b = m[2] if _ATOM.fullmatch(m[2]) else f"({m[2]})"
    glued = m.start() > 0 and (m.string[m.start() - 1].isdigit() or m.string[m.start() - 1] in ".)}")
    return f"({a}/{b})" if glued else f"{a}/{b}"


def _number_words(m: re.Match) -> str:
    """seven -> 7, twenty-one -> 21, one hundred and five -> 105, 2.5 thousand -> 2500; else unchanged."""
    words = re.split(r"[\s-]+", m[2])
    if m[1] and words[0] not in _SCALES:  # 3 seven is no number
        return m.group()
    total, part = Fraction(0), Fraction(m[1] or 0)
    for w in words:  # "and" is neither
        part = part + _WORDS[w] if w in _WORDS else (part or 1) * _SCALES[w] if w in _SCALES else part
        total, part = (total + part, Fraction(0)) if w in _SCALES and w != "hundred" else (total, part)
    v = total + part
    return str(v.numerator) if v.denominator == 1 else str(float(v))


def _dots(m: re.Match) -> str:
    """0.1666\\ldots -> 0.1\\overline{6}: the shortest repeating tail shown at least twice, else unchanged."""
    d, k, fail = m[2], 0, [0]  # KMP on the reversed digits: every tail's shortest period in one linear pass
    for c in (r := d[::-1])[1:]:
        while k and c != r[k]:
            k = fail[k - 1]
        fail.append(k := k + (c == r[k]))
    s, p = next(((len(d) - t, t - fail[t - 1]) for t in range(len(d), 0, -1) if 2 * (t - fail[t - 1]) <= t), (0, 0))
    return f"{m[1]}.{d[:s]}\\overline{{{d[s:s + p]}}}" if p else m.group()


def _normalize(s: str) -> str:
    s = " ".join(s.lower().split()).replace("...", "\\ldots")  # one space: no \\s+ scans a run twice
    if s.startswith(("\\boxed", "\\fbox")) and (b := _boxes(s, 0, len(s))[0]) and b[0][1] == len(s):
        s = b[0][2]  # a whole-answer box
    s = "".join(_UNICODE.get(c, c) for c in s) if not s.isascii() else s
    s = _SUPER.sub(lambda m: "^{" + m.group().translate(_SUPER_DIGITS) + "}", s)  # x² -> x^{2}
    s = _TEXT_UNIT.sub("", _DROP.sub("", s).strip().rstrip("."))
    for _ in range(8 if "\\" in s and _TEXT.search(s) else 0):  # \mathbf{\frac{3}{8}}; nested ones in turn
        s = _TEXT.sub(r" \1", s)
    for t, a, b in _SPELL:
        s = a.sub(b, s.strip()) if t in s else s
    s = _SQRT.sub(r"\1{\2}", s)
    s = _FRAC_ARGS.sub(lambda m: "\\" + m[1] + "".join(a if a[0] == "{" else "{" + a + "}" for a in m.groups()[1:]), s)
    s = s.strip().rstrip(".").strip()
    if _LETTERS.search(s):  # number words, and "a and b" as a list
        s = re.sub(r"(?<!\s),?\s+and\s+", ", ", _NUMWORD.sub(_number_words, s))
    s = _UNITS.sub("", s.strip())
    if re.fullmatch(r"[a-z][a-z' -]*", s):  # a word answer: no article, singular
        s = _PLURAL.sub(lambda m: m[1] + ("y" if m[2] == "ies" else "") if len(m[0]) > 3 else m[0],
                        re.sub(r"^(?:the|an?) ", "", s))
    s = re.sub(r"\s+", "", s)
    s = _DOTS.sub(_dots, s) if "." in s else s
    for _ in range(4 if s.count("\\frac") <= 16 else 0):  # outer \frac first, then the ones it held
        s = _SIMPLE_FRAC.sub(_slash, s)
    for _ in range(8):  # "{5}" -> "5"; bounded, each check is a linear scan
        s = s[1:-1] if s.startswith("{") and _wraps(s) else s
    return s


def _wraps(s: str) -> bool:
    """True when the bracket opening at s[0] closes at s[-1] (any of ([{ with any of )]}); C-speed running depths."""
    depths = list(accumulate(map(_DEPTH.get, s, repeat(0)))) if s[:1] in ("(", "[", "{") else [0]
    return len(depths) > 1 and depths[-1] == 0 and min(depths[:-1]) > 0


def _split(s: str, sep: str = ",") -> list[str]:
    """Split at top-level separators (outside any bracket)."""
    if sep not in s:
        return [s]
    items, depth, start = [], 0, 0
    for m in re.finditer(r"[(\[{]|[)\]}]|" + re.escape(sep), s):  # only brackets and separators
        depth += _DEPTH.get(m.group(), 0)
        if depth == 0 and m.group() == sep:
            items.append(s[start:m.start()])
            start = m.end()
    return items + [s[start:]]


def _parts(s: str) -> tuple[str, list[str]] | None:
    """(kind, items) of a compound answer: the bracket pair of a tuple/interval, 'set' if unordered, a matrix shape."""
    if s.startswith("\\begin{matrix}") and s.endswith("\\end{matrix}"):
        rows = [r.split("&") for r in s[14:-12].split("\\\\") if r]
        return f"matrix{len(rows)}x{len(rows[0]) if rows else 0}", [c for r in rows for c in r]
    if s.startswith("\\{") and s.endswith("\\}") and _wraps(s[1:]):
        return "set", _split(s[2:-2])
    if s[:1] in "([" and s[-1:] in ")]" and _wraps(s):
        return s[0] + s[-1], _split(s[1:-1])
    items = _split(s, "\\cup") if "\\cup" in s else _split(s)  # bare lists and unions are unordered
    if len(items) == 1 and s.count("\\pm") == 1 and "\\le" not in s and "\\ge" not in s:  # a \pm b: {a + b, a - b}
        items = [s.replace("\\pm", "+"), s.replace("\\pm", "-")]
    return ("set", items) if len(items) > 1 else None


def _relation(s: str) -> str:
    """x<4 -> (-\\infty,4), 5>y -> (-\\infty,5), 2<x\\le5 -> (2,5]; anything else unchanged."""
    p = _RELATION.split(s)
    if len(p) == 3 and _LHS.fullmatch(p[2] + "=") and not _LHS.fullmatch(p[0] + "="):  # 5 > y: name first
        p = [p[2], {"<": ">", ">": "<", "\\le": "\\ge", "\\ge": "\\le"}[p[1]], p[0]]
    if len(p) == 3 and _LHS.fullmatch(p[0] + "=") and p[2]:
        return {"<": "(-\\infty,%s)", "\\le": "(-\\infty,%s]", ">": "(%s,\\infty)", "\\ge": "[%s,\\infty)"}[p[1]] % p[2]
    if len(p) == 5 and {p[1], p[3]} <= {"<", "\\le"} and _LHS.fullmatch(p[2] + "=") and p[0] and p[4]:
        return ("(" if p[1] == "<" else "[") + p[0] + "," + p[4] + (")" if p[3] == "<" else "]")
    return s


def _unwrap(s: str) -> str:
    for _ in range(8):  # "(5)" -> "5", "(a)" -> "a", "x=5" -> "5", "x\in[1,2]" -> "[1,2]"; bounded
        if (m := _LHS.match(s)) and "=" not in s[m.end():]:
            s = s[m.end():]
        elif s[:1] == "(" and s[-1:] == ")" and _wraps(s) and len(_split(s[1:-1])) == 1:
            s = s[1:-1]
        else:
            break
    if "=" in s and len(items := _split(s)) > 1 and all(m := [_LHS.match(t) for t in items]):
        names = [t[:k.end()] for t, k in zip(items, m)]  # p=1,q=4 -> (1,4); x=2,x=3 stays a set of values
        if len(set(names)) == len(names):
            return "(" + ",".join(t[k.end():] for t, k in zip(items, m)) + ")"
    return _relation(s) if ("<" in s or ">" in s or "\\le" in s or "\\ge" in s) else s


def _equal(a: str, b: str, depth: int = 0) -> bool:
    a, b = _unwrap(a), _unwrap(b)
    if a == b:
        return True
    for u, v in ((a, b), (b, a)):  # (c)7 is (c) and 7; 110_2 is 110 (one side omits the base), not 6
        if (m := _CHOICE.fullmatch(u)) and (v in (m[1], f"({m[1]})") or _equal(m[2], v, depth + 1)):
            return True
        if (m := _BASE.fullmatch(u)) and 2 <= int(m[2]) <= 36 and all(int(c, 36) < int(m[2]) for c in m[1]):
            return m[1].lstrip("0") == v.lstrip("0")
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y
    if x is None and y is None and max(len(a), len(b)) > MAX_NUMBER and (k := decimal_key(a)) is not None:
        return k == decimal_key(b)  # plain decimals too long to convert, digit by digit
    pa, pb = _parts(a), _parts(b)
    if x is not None or y is not None or pa is None or pb is None:  # an expression on one side: the normal form decides
        return exact.same(a, x, b, y)
    if depth > 4 or pa[0] != pb[0] or len(pa[1]) != len(pb[1]) or len(pa[1]) > 32:
        return False
    if pa[0] != "set":
        return all(_equal(u, v, depth + 1) for u, v in zip(pa[1], pb[1]))
    rest = list(pb[1])
    for u in pa[1]:  # multiset match, greedy (equivalence is transitive); identical strings first, they are cheap
        k = rest.index(u) if u in rest else next((k for k, v in enumerate(rest) if _equal(u, v, depth + 1)), None)
        if k is None:
            return False
        rest.pop(k)
    return True


def is_equiv(pred: str | None, gold: str | None) -> bool:
    """True when the two answers are the same after normalisation (exact rationals for numbers): steps 2-3."""
    if pred is None or gold is None or len(pred) > MAX_LONG or len(gold) > MAX_LONG or TOO_LONG in (pred, gold):
        return False
    if len(pred) > MAX_ANSWER or len(gold) > MAX_ANSWER:  # identical up to spacing, or the same plain decimal
        a, b = (t.translate(_SPACING).replace("\\,", "").replace("\\!", "").replace("{,}", "") for t in (pred, gold))
        return bool(pred.strip()) and (a == b or (k := decimal_key(a.replace(",", ""))) is not None
                                       and k == decimal_key(b.replace(",", "")))
    a, b = _normalize(pred), _normalize(gold)
    return bool(a) and bool(b) and _equal(a, b)


def reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer (step 1) is equivalent to gold, else 0.0 (no final answer -> 0.0)."""
    return float(is_equiv(extract_answer(completion), gold))


def format_reward(completion: str) -> float:
    """1.0 iff the completion is one <think>...</think> then one non-empty <answer>...</answer>, nothing else."""
    s = completion.strip()
    s = next((s[:-len(e)].rstrip() for e in EOS if s.endswith(e)), s)
    if any(s.count(t) != 1 for t in ("<think>", "</think>", "<answer>", "</answer>")):
        return 0.0  # each tag exactly once: no second block, no nesting
    mid, ans = s.find("</think>") + 8, s.find("<answer>")
    ok = s.startswith("<think>") and s.endswith("</answer>") and mid <= ans and not s[mid:ans].strip()
    return float(ok and bool(s[ans + 8:-9].strip()))


_STEP = re.compile(r"[^;\s](?:[^;\n]*[^;\s])?")  # a step without its surrounding whitespace
_ARITH = re.compile(r"[0-9+\-*/()\s]*")
_GLUED = re.compile(r"[0-9)]\s*\(|[0-9]\s+[0-9]")  # 2(3), (1)(2) and "1 2": no implicit products in arithmetic


def eval_arith(expr: str) -> Fraction | None:
    """Exact value of an integer expression with + - * / ( ) and standard precedence; None if malformed or /0."""
    expr = expr.replace("×", "*").replace("÷", "/")
    if len(expr) > MAX_EXPR or not _ARITH.fullmatch(expr) or _GLUED.search(expr):
        return None
    return exact.value(expr)  # exact.value on integers and + - * / ( ): one iterative pass


def step_rewards(solution: str) -> list[tuple[int, bool]]:
    """Per step of "8-18=-10;-10+13=3 #### 3" (split by ';' or newlines, up to '####'): (end, correct). end: exclusive
    offset of the step's end (its last character is solution[end - 1]); correct: eval_arith(lhs) == eval_arith(rhs)."""
    stop, out = solution.find("####"), []
    for m in _STEP.finditer(solution, 0, stop if stop >= 0 else len(solution)):
        lhs, eq, rhs = m.group().partition("=")
        left = eval_arith(lhs) if eq and "=" not in rhs else None
        out.append((m.end(), left is not None and left == eval_arith(rhs)))
        if len(out) >= MAX_STEPS:
            break
    return out
