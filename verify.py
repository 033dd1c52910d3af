r"""Answer checking for reasoning RL: extraction, normalisation, exact equivalence and rewards.

Pure Python on strings: no torch, no eval/exec/sympy. Scans are linear and inputs bounded (MAX_*: longer
answers are never equivalent; huge numbers and exponents are rejected, not computed), so every public
function returns in milliseconds on 100 KB of adversarial text.

1. extract_answer: the content of the last <answer>...</answer> (or the answer found inside it); else the
   last balanced \boxed{...} / \fbox{...} / `\boxed 5`; else the rest of the line after the last "####";
   else what follows "the (final) answer is" / "Final answer:"; else None. lenient=True adds the last
   number in the text: for evaluating base models only, never for rewards.
2. _normalize: lower-case; drop $, \text{}, \left/\right, spacing, degrees, percent, currency, unit words,
   a leading "x ="; one spelling for \dfrac, \frac12, \sqrt2; \frac{a}{b} -> a/b for simple a, b.
3. _equal: numbers (1,000  2.50  1/2  1e3  1.5\times10^{3}  10^3) compare as exact Fractions; tuples and
   intervals element-wise, bracket types kept; sets, bare comma lists and \cup-unions as multisets;
   anything else by normalised string equality. reward(completion, gold) = 1.0 iff 1-3 agree.
4. format_reward: <think>...</think><answer>...</answer> and nothing else (one trailing EOS allowed).
5. step_rewards: each "expr=value" step checked by eval_arith, recursive descent over Fractions:
   expr := term (('+'|'-') term)*   term := unary (('*'|'/') unary)*   unary := ('+'|'-') unary | int | (expr)

Tests: python -m pytest -q tests/test_verify.py
"""
import re
from fractions import Fraction

MAX_ANSWER = 500  # characters: longer answers are never equivalent
MAX_NUMBER = 300  # characters of one number (digits, separators, exponent); longer ones are rejected
MAX_EXP = 1000  # |exponent| of 1e5 / 10^{5}; 10^100000 is rejected, not computed
MAX_EXPR = 200  # characters of one arithmetic step or countdown expression
MAX_STEPS = 256  # steps scored by step_rewards; later ones are ignored
EOS = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "<eos>")

_BRACE = re.compile(r"[{}]")
_SPACES = re.compile(r" *")
_TOKEN = re.compile(r"[^\s$]+")
_ANSWER_IS = re.compile(r"answer(?: is\b|[ \t*]*:)", re.I)  # "the (final) answer is", "Final Answer:"
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_NUMBER_AT_END = re.compile(r"-?\d[\d,]*(?:\.\d+)?$")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} / `\\boxed 5`; a truncated last one falls back a few."""
    end = len(text)
    for _ in range(8):  # bounded, so 10^5 unclosed "\boxed{" cost 8 short scans, not 10^5
        if (i := max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))) < 0:
            return None
        end, j = i, i + (6 if text.startswith("\\boxed", i) else 5)
        k, depth = _SPACES.match(text, j).end(), 0
        if not text.startswith("{", k):
            if k > j and (m := _TOKEN.match(text, k)):
                return m.group()  # \boxed 5
            continue
        for m in _BRACE.finditer(text, k, k + 4 * MAX_ANSWER):  # balanced braces; a longer answer is no answer
            depth += 1 if m.group() == "{" else -1
            if depth == 0:
                return text[k + 1:m.start()].strip()
    return None


def extract_answer(text: str, lenient: bool = False) -> str | None:
    """The completion's final answer (see step 1 of the module docstring), or None."""
    close = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, close) if close >= 0 else -1
    if start >= 0:
        inner = text[start + 8:close]  # holds no "<answer>", so this recursion is one level deep
        return extract_answer(inner) or inner.strip() or None
    if boxed := _last_boxed(text):
        return boxed
    if (i := text.rfind("####")) >= 0 and (line := text[i + 4:].partition("\n")[0].strip(" \t#")):
        return line
    if m := max(_ANSWER_IS.finditer(text), key=lambda x: x.start(), default=None):  # the last one
        rest = text[m.end():m.end() + MAX_ANSWER].split("\n", 1)[0].strip(" \t:*")  # to the end of line/sentence
        if "\\boxed" in rest or "\\fbox" in rest:
            rest = _last_boxed(rest) or rest
        elif rest.startswith("$") and (k := rest.find("$", 1)) > 1:
            rest = rest[1:k]
        elif e := _SENTENCE_END.search(rest):
            rest = rest[:e.start()]
        if rest := rest.strip().rstrip(".").strip():
            return rest
    if lenient:  # the last number: rfind per digit is C-speed, a regex scan over 100 KB is not
        k = max(text.rfind(c) for c in "0123456789") + 1
        m = _NUMBER_AT_END.search(text, max(0, k - MAX_NUMBER), k) if k else None
        return m.group().rstrip(",") if m else None
    return None


_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname|emph)\s*"
                   r"\{([^{}]*)\}")
_DROP = re.compile(r"\\(?:left|right|displaystyle|qquad|quad|degree)(?![a-z])|(?<!\\)\\[!,;: ]|\^\s*\{\s*\\circ\s*\}"
                   r"|\^\s*\\circ|\\circ|°|\\%|%|\\\$|\$|\\[()\[\]]")
_FRAC_ARGS = re.compile(r"\\frac\s*(\{[^{}]*\}|[^\s{}\\])\s*(\{[^{}]*\}|[^\s{}\\])")  # \frac12, \frac1{2}, \frac{1}2
_SQRT = re.compile(r"\\sqrt\s*([^\s{\\\[])")  # \sqrt2
_TEXT_UNIT = re.compile(r"(?<=[\d}])\s*\\(?:text|mbox)\s*\{\s*[a-z][a-z\s.]*\}(?:\^\{?\d\}?)?\s*$")  # 5\text{ m}
_UNITS = re.compile(r"(?<=[\d}])(?:\s+[a-z]{2,}(?![a-z])\.?(?:\^\{?\d\}?)?){1,4}\s*$")  # 5 cm, 18 dollars
_LHS = re.compile(r"(?:[a-z](?:_\{?[a-z0-9]+\}?)?|\\[a-z]+)(?:=|\\in(?![a-z]))")  # "x=", "a_1=", "\theta=", "x\in"
_ARG = r"((?:[^{}]|\{[^{}]*\})+)"  # a \frac argument: nested braces one level deep
_SIMPLE_FRAC = re.compile(r"\\frac\{" + _ARG + r"\}\{" + _ARG + r"\}")
_ATOM = re.compile(r"-?(?:[\d.]+|[a-z]|\\[a-z]+(?:\{[^{}]*\})?)")  # one factor: 2, x, \pi, \sqrt{3}
_PRODUCT = re.compile(r"-?(?:[\d.]|[a-z]|\\[a-z]+(?![a-z])(?:\{[^{}]*\})?)+")  # factors side by side: 3\pi, 2\sqrt{3}


def _slash(m: re.Match) -> str:
    """\\frac{a}{b} -> a/b; parenthesise a if not a product, b if not one factor, the whole after a factor."""
    a = m[1] if _PRODUCT.fullmatch(m[1]) else f"({m[1]})"
    b = m[2] if _ATOM.fullmatch(m[2]) else f"({m[2]})"
    glued = m.start() > 0 and (m.string[m.start() - 1].isdigit() or m.string[m.start() - 1] in ".)}")
    return f"({a}/{b})" if glued else f"{a}/{b}"


def _normalize(s: str) -> str:
    s = s.strip().lower()
    s = _last_boxed(s) or s
    for a, b in (("−", "-"), ("×", "\\times"), ("·", "\\cdot"), ("±", "\\pm"), ("∞", "\\infty"), ("π", "\\pi"),
                 ("√", "\\sqrt"), ("{,}", ","), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cfrac", "\\frac")):
        s = s.replace(a, b)
    s = _TEXT_UNIT.sub("", _DROP.sub("", s).strip().rstrip("."))
    for _ in range(8):  # innermost \text{} first; nesting deeper than 8 stays as it is
        s = _TEXT.sub(r" \1", s)
    s = _SQRT.sub(r"\\sqrt{\1}", s)
    s = _FRAC_ARGS.sub(lambda m: "\\frac" + "".join(a if a[0] == "{" else "{" + a + "}" for a in m.groups()), s)
    s = _UNITS.sub("", s.strip().rstrip(".").strip())
    s = re.sub(r"\s+", "", s)
    for _ in range(4):  # outer \frac first, then the ones it held
        s = _SIMPLE_FRAC.sub(_slash, s)
    for _ in range(8):  # "{5}" -> "5"; bounded, each check is a linear scan
        s = s[1:-1] if s.startswith("{") and _wraps(s) else s
    return s


_DECIMAL = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d*)(?:\.(\d*))?(?:e([+-]?\d+))?")
_SCIENTIFIC = re.compile(r"([\d.,]+)(?:\\times|\\cdot|\*)10\^\{?([+-]?\d+)\}?")
_POWER = re.compile(r"([\d.]+)\^\{?([+-]?\d+)\}?")
_MIXED = re.compile(r"(\d+)\((\d+)/(\d+)\)")  # 2\frac{1}{2} normalises to 2(1/2): a mixed number


def _decimal(s: str) -> Fraction | None:
    """'1,000.50', '-.5', '1e-3' -> Fraction; thousands groups must all be 3 digits."""
    m = _DECIMAL.fullmatch(s) if len(s) <= MAX_NUMBER else None
    if not m or not (m[2] or m[3]) or abs(exp := int(m[4] or 0)) > MAX_EXP:
        return None
    scale, digits = exp - len(m[3] or ""), int(m[2].replace(",", "") + (m[3] or "") or "0")  # digits * 10^scale
    v = Fraction(digits * 10 ** scale) if scale >= 0 else Fraction(digits, 10 ** -scale)
    return -v if m[1] == "-" else v


def _number(s: str) -> Fraction | None:
    """Exact value of a normalised numeric answer, or None if it is not one."""
    if not s or len(s) > MAX_NUMBER:
        return None
    sign, s = (-1 if s[0] == "-" else 1), (s[1:] if s[0] in "+-" else s)
    if m := _MIXED.fullmatch(s):
        v = int(m[1]) + Fraction(int(m[2]), int(m[3])) if int(m[3]) else None
    elif s.count("/") == 1:
        a, b = (_decimal(t) for t in s.split("/"))
        v = a / b if a is not None and b else None
    elif m := _SCIENTIFIC.fullmatch(s) or _POWER.fullmatch(s):
        base, exp = _decimal(m[1]), int(m[2])
        if base is None or abs(exp) > MAX_EXP or len(m[1]) * abs(exp) > 10_000 or (base == 0 and exp < 0):
            return None
        v = base * Fraction(10) ** exp if m.re is _SCIENTIFIC else base ** exp
    else:
        v = _decimal(s)
    return None if v is None else sign * v


def _wraps(s: str) -> bool:
    """True when the bracket opening at s[0] closes at s[-1] (any of ([{ with any of )]})."""
    depth = 0
    for i, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if depth <= 0:
            return depth == 0 and i == len(s) - 1
    return False


def _split(s: str, sep: str = ",") -> list[str]:
    """Split at top-level separators (outside any bracket)."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if depth == 0 and s.startswith(sep, i):
            items.append(s[start:i])
            start = i + len(sep)
    return items + [s[start:]]


def _parts(s: str) -> tuple[str, list[str]] | None:
    """(kind, items) of a compound answer; kind is the bracket pair for tuples/intervals, 'set' if unordered."""
    if s.startswith("\\{") and s.endswith("\\}") and _wraps(s[1:]):
        return "set", _split(s[2:-2])
    if s[:1] in "([" and s[-1:] in ")]" and _wraps(s):
        return s[0] + s[-1], _split(s[1:-1])
    items = _split(s, "\\cup") if "\\cup" in s else _split(s)  # bare lists and unions are unordered
    return ("set", items) if len(items) > 1 else None


def _unwrap(s: str) -> str:
    for _ in range(8):  # "(5)" -> "5", "(a)" -> "a", "x=5" -> "5", "x\in[1,2]" -> "[1,2]"; bounded
        if (m := _LHS.match(s)) and "=" not in s[m.end():]:
            s = s[m.end():]
        elif s[:1] == "(" and s[-1:] == ")" and _wraps(s) and len(_split(s[1:-1])) == 1:
            s = s[1:-1]
    return s


def _equal(a: str, b: str, depth: int = 0) -> bool:
    a, b = _unwrap(a), _unwrap(b)
    if a == b:
        return True
    x, y = _number(a), _number(b)
    if x is not None or y is not None:
        return x == y
    pa, pb = _parts(a), _parts(b)
    if depth > 4 or pa is None or pb is None or pa[0] != pb[0] or len(pa[1]) != len(pb[1]) or len(pa[1]) > 32:
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
    """True when the two answers are the same after normalisation (exact rationals for numbers)."""
    if pred is None or gold is None or len(pred) > MAX_ANSWER or len(gold) > MAX_ANSWER:
        return False
    a, b = _normalize(pred), _normalize(gold)
    return bool(a) and bool(b) and _equal(a, b)


def reward(completion: str, gold: str) -> float:
    """1.0 if the completion's extracted final answer is equivalent to gold, else 0.0 (no answer -> 0.0)."""
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


_ARITH_TOKEN = re.compile(r"[0-9]+|\S")
_STEP = re.compile(r"[^;\s](?:[^;\n]*[^;\s])?")  # a step without its surrounding whitespace


def eval_arith(expr: str) -> Fraction | None:
    """Exact value of an integer expression with + - * / ( ) and standard precedence; None if malformed or /0."""
    if len(expr) > MAX_EXPR:  # also bounds the recursion depth
        return None
    toks, pos = _ARITH_TOKEN.findall(expr.replace("×", "*").replace("÷", "/")) + [""], 0  # "" marks the end

    def parse(level: int) -> Fraction:  # level 0: sums, 1: products, 2: sign, number or (expr)
        nonlocal pos
        if level == 2:
            t, pos = toks[pos], pos + 1
            if t in ("+", "-"):
                return parse(2) if t == "+" else -parse(2)
            if t == "(" and (v := parse(0)) is not None and toks[pos] == ")":
                pos += 1
                return v
            if t.isascii() and t.isdigit():
                return Fraction(int(t))
            raise ValueError(f"unexpected {t!r}")
        v = parse(level + 1)
        while toks[pos] in ("+-", "*/")[level] and toks[pos]:
            op, pos = toks[pos], pos + 1
            w = parse(level + 1)
            v = v + w if op == "+" else v - w if op == "-" else v * w if op == "*" else v / w  # /0 raises
        return v

    try:
        v = parse(0)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    return v if pos == len(toks) - 1 else None


def step_rewards(solution: str) -> list[tuple[int, bool]]:
    """Per step of "8-18=-10;-10+13=3 #### 3" (split by ';' or newlines, up to '####'): (end, correct).

    end: exclusive character offset of the step's end (whitespace around a step is not part of it), so its
    last character is solution[end - 1]. correct: "lhs=rhs" with eval_arith(lhs) == eval_arith(rhs).
    """
    stop, out = solution.find("####"), []
    for m in _STEP.finditer(solution, 0, stop if stop >= 0 else len(solution)):
        lhs, eq, rhs = m.group().partition("=")
        left = eval_arith(lhs) if eq and "=" not in rhs else None
        out.append((m.end(), left is not None and left == eval_arith(rhs)))
        if len(out) >= MAX_STEPS:
            break
    return out
