r"""Answer checking for reasoning RL: extraction, normalisation, exact (symbolic) equivalence and rewards.

Pure Python on strings: no torch, no eval/exec, no CAS. Scans are linear, inputs bounded (MAX_*: longer answers
are never equal; huge numbers and expansions are rejected, not computed): milliseconds on 100 KB of adversarial text.

1. extract_answer: the content of the last <answer>...</answer> (or the answer found inside it); else the
   last balanced \boxed{...} / \fbox{...} / `\boxed 5`; else the rest of the line after the last "####";
   else the sentence after "the (final) answer is" / "Final answer:", without **emphasis** or a reason after a
   comma (", since ..."); else None. lenient=True adds the last number: for base models only, never rewards.
2. _normalize: lower-case; drop $, \text{}, \left/\right, spacing, degrees, percent, currency, unit words,
   a leading "x ="; one spelling for \dfrac, \frac12, \sqrt2, x_1; \frac{a}{b} -> a/b for simple a, b.
3. _equal: numbers (1,000  2.50  1e3  2\frac{1}{2}) compare as exact Fractions; tuples and intervals
   element-wise, bracket types kept; sets, bare comma lists and \cup-unions as multisets; any other pair is
   equal iff the strings are or step 4 proves it. reward(completion, gold) = 1.0 iff 1-4 agree.
4. _Form, an exact normal form: numerator / denominator, expanded polynomials in the names that appear (x, a_1,
   \theta, \pi, e; i is the imaginary unit) over Q(i, sqrt 2, sqrt 3, ...), whose square roots of square-free
   integers are independent over Q: the form is canonical, so n1/d1 = n2/d2 iff n1 d2 == n2 d1. Recursive descent:
     expr := term (('+'|'-') term)*     term := factor (('*' | '/' | \cdot | \times | \div | juxtaposed) factor)*
     factor := ('+'|'-')* primary ['!'] ['^' ('+'|'-')* primary]      (2x, x(x+1), 3\sqrt2; x2 is rejected)
     primary := 12.5 | 0.1\overline{6} | name | (expr) | {expr} | \sqrt[n]{q} | \frac a b | \binom n k | \log_b a
   Roots and logs count only where exact (\sqrt{8} = 2\sqrt{2}, \sqrt[3]{27} = 3, \log_2 8 = 3). No form, never
   equal: words ("yes" is no y*e*s), f(x), x+2(1/2) (mixed?), \cdots, \pm, \sqrt{x}, 2^3^4, sizes past MAX_*.
5. format_reward: <think>...</think><answer>...</answer> and nothing else (one trailing EOS allowed).
6. step_rewards: each "expr=value" step checked by eval_arith, the grammar of 4 on integers and + - * / ( ).

Tests: python -m pytest -q tests/test_verify.py
"""
import re
from fractions import Fraction
from math import comb, factorial, gcd, isqrt, log

MAX_ANSWER = 500  # characters: longer answers are never equivalent
MAX_NUMBER = 300  # characters of one number (digits, separators, exponent); longer ones are rejected
MAX_EXP = 1000  # |exponent| of 1e5 / 10^{5}; 10^100000 is rejected, not computed
MAX_EXPR = 200  # characters of one arithmetic step or countdown expression
MAX_STEPS = 256  # steps scored by step_rewards; later ones are ignored
MAX_TERMS = 64  # terms of one polynomial of the normal form; (x+y+z)^6 has 28
MAX_DEG = 32  # degree of a monomial, index of a root
MAX_BITS = 4096  # bits of a coefficient's numerator or denominator (500! has 3,767)
MAX_FACT = 500  # largest n of n! and \binom{n}{k}
MAX_RADICAND = 10 ** 6  # \sqrt{n}: n = s^2 m by trial division up to 1000
MAX_WORK = 1000  # monomial products per answer: bounds the whole normal form's cost
MAX_DEPTH = 32  # nesting of brackets in the normal form
EOS = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "<eos>")

_BRACE = re.compile(r"[{}]")
_SPACES = re.compile(r" *")
_TOKEN = re.compile(r"[^\s$]+")
_ANSWER_IS = re.compile(r"answer(?: is\b|[ \t*]*:)", re.I)  # "the (final) answer is", "Final Answer:"
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_BECAUSE = re.compile(r",\s+(?:since|because|as|so|which|where|given|from|by|using|thus|hence)\b", re.I)  # why
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
        else:  # the sentence, without a justification after a comma ("7, since 3 + 4 = 7")
            rest = _BECAUSE.split(_SENTENCE_END.split(rest, 1)[0], 1)[0]
        if rest := rest.strip(" \t*").rstrip(".").strip(" \t*"):  # **42** is markdown emphasis
            return rest
    if lenient:  # the last number: rfind per digit is C-speed, a regex scan over 100 KB is not
        k = max(text.rfind(c) for c in "0123456789") + 1
        m = _NUMBER_AT_END.search(text, max(0, k - MAX_NUMBER), k) if k else None
        return m.group().rstrip(",") if m else None
    return None


_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|operatorname|emph)\s*"
                   r"\{([^{}]*)\}")
_DROP = re.compile(r"\\(?:left|right|displaystyle|qquad|quad|degree)(?![a-z])|(?<!\\)\\[!,;: ]|\^\s*\{\s*\\circ\s*\}"
                   r"|(?<=\\)[dtc](?=frac|binom)|\^\s*\\circ|\\circ|°|\\%|%|\\\$|\$|\\[()\[\]]")
_FRAC_ARGS = re.compile(r"\\(frac|binom)\s*(\{[^{}]*\}|[^\s{}\\])\s*(\{[^{}]*\}|[^\s{}\\])")  # \frac12, \frac1{2}
_SQRT = re.compile(r"(\\sqrt|_)\s*([^\s{\\\[])")  # \sqrt2, x_1, \log_2 8: before spaces go, as LaTeX reads them
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
                 ("√", "\\sqrt"), ("{,}", ","), ("÷", "\\div")):
        s = s.replace(a, b)
    s = _TEXT_UNIT.sub("", _DROP.sub("", s).strip().rstrip("."))
    for _ in range(8):  # innermost \text{} first; nesting deeper than 8 stays as it is
        s = _TEXT.sub(r" \1", s)
    s = _SQRT.sub(r"\1{\2}", s)
    s = _FRAC_ARGS.sub(lambda m: "\\" + m[1] + "".join(a if a[0] == "{" else "{" + a + "}" for a in m.groups()[1:]), s)
    s = _UNITS.sub("", s.strip().rstrip(".").strip())
    s = re.sub(r"\s+", "", s)
    for _ in range(4):  # outer \frac first, then the ones it held
        s = _SIMPLE_FRAC.sub(_slash, s)
    for _ in range(8):  # "{5}" -> "5"; bounded, each check is a linear scan
        s = s[1:-1] if s.startswith("{") and _wraps(s) else s
    return s


_DECIMAL = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d*)(?:\.(\d*))?(?:e([+-]?\d+))?")
_MIXED = re.compile(r"([+-]?)(\d+)\((\d+)/(\d+)\)")  # 2\frac{1}{2} normalises to 2(1/2): a mixed number


def _number(s: str) -> Fraction | None:
    """'1,000.50', '-.5', '1e-3', '2(1/2)' -> Fraction, else None; thousands groups must all be 3 digits.

    1/2, 1.5\times10^{3} and 2^{10} are expressions whose normal forms (step 4) are numbers."""
    if len(s) > MAX_NUMBER or not (m := _MIXED.fullmatch(s) or _DECIMAL.fullmatch(s)):
        return None
    if m.re is _MIXED:
        return (-1 if m[1] == "-" else 1) * (int(m[2]) + Fraction(int(m[3]), int(m[4]))) if int(m[4]) else None
    if not (m[2] or m[3]) or abs(exp := int(m[4] or 0)) > MAX_EXP:
        return None
    scale, digits = exp - len(m[3] or ""), int(m[2].replace(",", "") + (m[3] or "") or "0")  # digits * 10^scale
    v = Fraction(digits * 10 ** scale) if scale >= 0 else Fraction(digits, 10 ** -scale)
    return -v if m[1] == "-" else v


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


_ONE, _UNIT = (1, ()), {(1, ()): Fraction(1)}  # the monomial 1 and the polynomial 1
_NAMES = ("alpha", "beta", "gamma", "delta", "theta", "lambda", "mu", "rho", "sigma", "tau", "phi", "omega", "pi")  # x
_FORM_TOKEN = re.compile(r"\d*\.\d*\\overline\{\d+\}|\d+\.?\d*|\.\d+|\\(?:%s)|\\[a-z]+|[a-z](?:_\{[a-z0-9]+\})?|\S"
                         % "|".join(_NAMES + ("sqrt", "frac", "binom", "log", "cdot", "times", "div")))  # \pir: \pi r
_TIMES, _OPENS = ("*", "\\cdot", "\\times", "/", "\\div"), ("(", "{", "\\sqrt", "\\frac", "\\binom", "\\log")
_NO_FORM = re.compile(r"(?<![\\a-z])(?:[a-z]{3}|[fgh]\()|(?<![\d.])\d+\(\d+/\d+\)|\\[lc]?dots")  # see step 4


def _root(c: Fraction, n: int) -> Fraction | None:
    """The exact real n-th root of a rational c, or None (integer Newton from above on numerator and denominator)."""
    out = []
    for x in (abs(c.numerator), c.denominator):
        r = 1 << -(-x.bit_length() // n)
        while r and (y := ((n - 1) * r + x // r ** (n - 1)) // n) < r:
            r = y
        out.append(r)
    return r if (r := Fraction(*out) * (-1 if c < 0 else 1)) ** n == c else None


class _Form:
    """Step 4: a value is (numerator, denominator), polynomials as dicts {monomial: Fraction}; a monomial is
    (m, ((name, exponent), ...)) with m a signed square-free integer for sqrt(m) (1: none, -1: i), names sorted."""

    def __init__(self, s: str):
        if _NO_FORM.search(s):
            raise ValueError(s)
        self.toks, self.pos, self.work, self.depth = _FORM_TOKEN.findall(s) + [""], 0, 0, 0

    def check(self, p: dict) -> dict:
        p = {m: c for m, c in p.items() if c}
        if len(p) > MAX_TERMS or any(max(c.numerator.bit_length(), c.denominator.bit_length()) > MAX_BITS
                                     or sum(e for _, e in m[1]) > MAX_DEG for m, c in p.items()):
            raise ValueError("too large")
        return p

    def const(self, c: Fraction | int) -> tuple:
        return self.check({_ONE: Fraction(c)}), _UNIT

    def rational(self, v: tuple, integer: bool = False) -> Fraction | int:
        c = v[0].get(_ONE, Fraction(0)) if set(v[0]) <= {_ONE} and v[1] == _UNIT else None
        if c is None or integer and not (c.denominator == 1 and 0 <= c <= MAX_FACT):
            raise ValueError("not an integer in [0, MAX_FACT]" if integer else "not a rational number")
        return int(c) if integer else c

    def mul(self, p: dict, q: dict) -> dict:
        if (work := self.work + len(p) * len(q)) > MAX_WORK:
            raise ValueError("too much work")
        out, self.work = {}, work
        for (m1, v1), x in p.items():
            for (m2, v2), y in q.items():
                g = gcd(m1, m2) * (-1 if m1 < 0 and m2 < 0 else 1)  # i i = -1
                names = (n1 := dict(v1)) | {k: n1.get(k, 0) + e for k, e in v2}
                key = ((m1 // g) * (m2 // g), tuple(sorted(names.items())))  # sqrt(a) sqrt(b) = g sqrt(ab / g^2)
                out[key] = out.get(key, 0) + (x * y if g == 1 else g * x * y)
        return self.check(out)

    def value(self, n: dict, d: dict) -> tuple:
        if not d:
            raise ZeroDivisionError
        c = d.get(_ONE) if len(d) == 1 else None  # a rational denominator goes into the coefficients
        return (n, d) if c is None else ({m: x / c for m, x in n.items()}, _UNIT)

    def add(self, u: tuple, v: tuple, sign: int) -> tuple:
        (a, b), (c, d) = u, v
        a, c, b = (a, c, b) if b == d else (self.mul(a, d), self.mul(c, b), self.mul(b, d))
        return self.value(self.check({m: a.get(m, 0) + sign * c.get(m, 0) for m in a | c}), b)

    def times(self, u: tuple, v: tuple, divide: bool = False) -> tuple:
        v = (v[1], v[0]) if divide else v
        return self.value(self.mul(u[0], v[0]), self.mul(u[1], v[1]))

    def power(self, v: tuple, k: Fraction) -> tuple:
        if k.denominator > 1 or set(v[0]) <= {_ONE} and v[1] == _UNIT:  # a rational base: bound the result first
            c = self.rational(v)
            if c == 0 and k <= 0 or max(abs(c.numerator), c.denominator).bit_length() * abs(k.numerator) > MAX_BITS:
                raise ValueError("power")
            return self.root(c ** k.numerator, k.denominator)
        out = (_UNIT, _UNIT)
        for _ in range(abs(int(k))):  # MAX_WORK ends i^(10^9) and x^(10^9) early
            out = self.times(out, v, divide=k < 0)
        return out

    def root(self, c: Fraction, n: int) -> tuple:
        """c^(1/n) when it is rational, or sqrt(t) for a rational t: s sqrt(m) / q with m square-free and signed."""
        if (r := _root(c, n)) is not None:
            return self.const(r)
        if n % 2 or (t := _root(abs(c), n // 2)) is None or c < 0 < n - 2:  # \sqrt[4]{4} = \sqrt{2}; no \sqrt[4]{-4}
            raise ValueError("root")
        m, s = t.numerator * t.denominator, 1  # sqrt(p / q) = sqrt(p q) / q = s sqrt(m) / q, m square-free
        for d in range(2, isqrt(m) + 1 if m <= MAX_RADICAND else 0):  # trial division, at most 1000 steps
            while m % (d * d) == 0:
                m, s = m // (d * d), s * d
        if m > MAX_RADICAND:
            raise ValueError("radicand")
        return {(m if c > 0 else -m, ()): Fraction(s, t.denominator)}, _UNIT  # \sqrt{-4} = 2i

    def take(self, *ops: str) -> str | None:
        t = self.toks[self.pos] if self.toks[self.pos] in ops else None
        self.pos += t is not None
        return t

    def expr(self, whole: bool = False) -> tuple:
        v = self.term()
        while t := self.take("+", "-"):
            v = self.add(v, self.term(), 1 if t == "+" else -1)
        if whole and self.toks[self.pos]:
            raise ValueError(self.toks[self.pos])
        return v

    def term(self) -> tuple:
        v = self.factor()
        while (t := self.toks[self.pos]) in _TIMES or t[:1].isalpha() or t[1:] in _NAMES or t in _OPENS or (
                t[:1].isdigit() and self.toks[self.pos - 1] == "!"):  # or juxtaposed: 2x, x(x+1), 3\sqrt{2}, 2!4!
            self.pos += t in _TIMES  # a number never follows anything else: x2, (x)2 are rejected
            v = self.times(v, self.factor(), divide=t in ("/", "\\div"))
        return v

    def factor(self, exponent: bool = False) -> tuple:
        sign = 1
        while t := self.take("+", "-"):
            sign = -sign if t == "-" else sign
        v = self.primary()
        if not exponent and self.take("!"):  # 2^3! and 5!! are left over, so rejected: ambiguous, as 2^3^4
            v = self.const(factorial(self.rational(v, integer=True)))
        if not exponent and self.take("^"):
            v = self.power(v, self.rational(self.factor(exponent=True)))
        return v if sign > 0 else ({m: -c for m, c in v[0].items()}, v[1])

    def primary(self) -> tuple:
        t, self.pos = self.toks[self.pos], self.pos + 1
        if t and t[0] in "0123456789." and len(t) <= MAX_NUMBER:  # 0.1\overline{6} = 0.1 + 6 / (10 * 9)
            num, _, rep = t.partition("\\overline")
            rep = Fraction(int(rep[1:-1]), 10 ** len(num.partition(".")[2]) * (10 ** (len(rep) - 2) - 1)) if rep else 0
            return self.const(Fraction(num) + rep)
        if t[:1].isalpha() or t[1:] in _NAMES:
            return {(-1, ()) if t == "i" else (1, ((t, 1),)): Fraction(1)}, _UNIT
        if t in ("(", "{") and self.depth < MAX_DEPTH:
            self.depth += 1
            v, self.depth = self.expr(), self.depth - 1
            if self.take(")" if t == "(" else "}"):
                return v
        if t == "\\sqrt":  # \sqrt[n]{c}
            n, close = (self.rational(self.expr(), integer=True), self.take("]")) if self.take("[") else (2, "]")
            if close and 2 <= n <= MAX_DEG:
                return self.root(self.rational(self.primary()), n)
        if t == "\\frac":
            return self.times(self.primary(), self.primary(), divide=True)
        if t == "\\binom":
            return self.const(comb(self.rational(self.primary(), True), self.rational(self.primary(), True)))
        if t == "\\log" and self.take("_"):  # log_b(a) = p/q iff b = c^q and a = c^p for a rational c
            b, a = self.rational(self.primary()), self.rational(self.primary())
            for q in range(1, 7) if b > 0 and b != 1 and a > 0 else ():
                if (c := _root(b, q)) is not None and c != 1:
                    p = round((log(a.numerator) - log(a.denominator)) / (log(c.numerator) - log(c.denominator)))
                    if abs(p) <= MAX_DEG and c ** p == a:
                        return self.const(Fraction(p, q))
        raise ValueError(t)


def _same(a: str, x: Fraction | None, b: str, y: Fraction | None) -> bool:
    """True iff both answers have normal forms n1/d1, n2/d2 (x, y: values of plain numbers) with n1 d2 == n2 d1."""
    try:
        p = _Form(a if x is None else "")
        u = p.expr(whole=True) if x is None else p.const(x)
        (n1, d1), (n2, d2) = u, _Form(b).expr(whole=True) if y is None else p.const(y)
        return p.mul(n1, d2) == p.mul(n2, d1)
    except (ValueError, ZeroDivisionError):
        return False


def _equal(a: str, b: str, depth: int = 0) -> bool:
    a, b = _unwrap(a), _unwrap(b)
    if a == b:
        return True
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y
    pa, pb = _parts(a), _parts(b)
    if x is not None or y is not None or pa is None or pb is None:  # an expression on one side: the normal form decides
        return _same(a, x, b, y)
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


_STEP = re.compile(r"[^;\s](?:[^;\n]*[^;\s])?")  # a step without its surrounding whitespace
_ARITH = re.compile(r"[0-9+\-*/()\s]*")
_GLUED = re.compile(r"[0-9)]\s*\(|[0-9]\s+[0-9]")  # 2(3), (1)(2) and "1 2": no implicit products in arithmetic


def eval_arith(expr: str) -> Fraction | None:
    """Exact value of an integer expression with + - * / ( ) and standard precedence; None if malformed or /0."""
    expr = expr.replace("×", "*").replace("÷", "/")
    if len(expr) > MAX_EXPR or not _ARITH.fullmatch(expr) or _GLUED.search(expr):
        return None
    try:
        return (p := _Form(expr)).rational(p.expr(whole=True))  # the grammar of step 4 on integers and + - * / ( )
    except (ValueError, ZeroDivisionError):
        return None


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
