r"""The exact normal form behind verify.is_equiv: numbers as Fractions, expressions as canonical
rational functions, an equation or inequality as its terms on one side, up to a scale.

Pure Python on normalised answers (verify._normalize's output): no eval, no CAS, every size bounded
(MAX_*).
1. number: a plain number (1,000  2.50  1e3  2(1/2)) as a Fraction; decimal_key: longer decimals,
   digit by digit; value: a numeric expression (+ - * / ^, brackets, \frac), one iterative pass
   (fractions 400 deep).
2. Form: num / den, expanded polynomials in the names that appear (x, a_1, \theta, \pi, e; i is the
   imaginary unit); a monomial is c * prod p^e * prod x^f, c rational, p prime or -1
   (i = (-1)^(1/2)), 0 < e < 1, f rational. The radicals prod p^e (0 <= e < 1) are linearly
   independent over Q (Besicovitch) and i is not real, so the form is canonical: n1/d1 = n2/d2 iff
   n1 d2 == n2 d1. Parser reads it, a method per rule; Arith computes:
     expr := term (('+'|'-') term)*
     term := factor (('*' | '/' | \cdot | \times | \div | juxtaposed) factor)*
     factor := ('+'|'-')* primary ['!'] ['^' ('+'|'-')* primary]  (2x, x(x+1), 3\sqrt2; not x2)
     primary := 12.5 | 0.1\overline{6} | name | (expr) | {expr} | \sqrt[n]{q} | \frac a b
                | \binom n k | \log_b a
   Radicands factor over primes (3\sqrt[3]{2} = \sqrt[3]{54}); a fractional power of a monomial
   scales its exponents (y^{1/2} = \sqrt{y}), an even root of an even power is refused (\sqrt{x^2}
   is |x|); logs only where exact. A root of a sum and a power with a symbolic exponent are atoms:
   names keyed by the canonical forms inside, so \sqrt{x+1} = \sqrt{1+x} and e^{x+1} = e^{1+x};
   atoms with different keys are independent names, which only loses equalities (\sqrt{x+1}^2 is
   not x+1 here), never makes one. No form, never equal: words ("yes" is no y*e*s), f(x),
   x+2(1/2), \cdots, \pm, 2^3^4, \sqrt[4]{-4}, anything past MAX_*.
3. value(s, big=True), past MAX_BITS: products, powers of rationals as (sign, {prime: exact
   exponent}): 2^{2^{100}} = 4^{2^{99}}, \frac{2^{2^{100}}}{2^{2^{100}}} = 1 by exponent arithmetic,
   never by evaluation.
4. same(a, x, b, y): numbers by value, else forms by n1 d2 == n2 d1, else equal factorisations
   (step 3). same_relation(u, v): L rel R as the form of L - R (R - L for < and \le); equal when
   n1 d2 == c n2 d1 for a rational c, nonzero for = and \neq, positive for an inequality (a
   negative scale flips it: -x > -1 is x < 1); linear_bound: a x + b > 0 is x > -b/a (a > 0).

Tests: python -m pytest -q tests/test_verify.py tests/test_verify_cases.py
"""
import re
import sys
from fractions import Fraction
from math import comb, factorial, log
from typing import NamedTuple

MAX_NUMBER = 300  # characters of a number made a Fraction; longer plain decimals compare digit-wise
MAX_EXP = 1000  # |exponent| of 1e5 / 10^{5}; 10^100000 is rejected, not computed
MAX_TERMS = 64  # terms of one polynomial of the normal form; (x+y+z)^6 has 28
MAX_DEG = 32  # degree of a monomial, index of a root
MAX_BITS = 4096  # bits of a coefficient's numerator, denominator (500! has 3,767), step 3 exponent
MAX_FACT = 500  # largest n of n! and \binom{n}{k}
MAX_RADICAND = 10 ** 6  # numerator, denominator of a radicand past its perfect powers (primes<1000)
MAX_WORK = 1000  # monomial products per answer: bounds the whole normal form's cost
MAX_DEPTH = 400  # nesting of brackets in the normal form (fractions hundreds deep)
MAX_TOKENS = 1000  # tokens of an answer in the normal form; 2.5 x more in value (numbers only)

_DECIMAL = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d*)(?:\.(\d*))?(?:e([+-]?\d+))?")
_MIXED = re.compile(r"([+-]?)(\d+)\((\d+)/(\d+)\)")  # 2\frac{1}{2} normalises to 2(1/2): mixed
_PRIMES = [p for p in range(2, 1000) if all(p % q for q in range(2, int(p ** 0.5) + 1))]


def number(s: str) -> Fraction | None:
    """The exact value of a plain number: 3, -2.5, 1,000 (groups of 3 digits), 1e3, .5, 2(1/2);
    else None (1/2, 1.5\\times10^{3} and 2^{10} are expressions whose normal forms are numbers)."""
    if len(s) > MAX_NUMBER or not (m := _MIXED.fullmatch(s) or _DECIMAL.fullmatch(s)):
        return None
    if m.re is _MIXED:
        whole = int(m[2]) + Fraction(int(m[3]), int(m[4])) if int(m[4]) else None
        return None if whole is None else -whole if m[1] == "-" else whole
    if not (m[2] or m[3]) or abs(exp := int(m[4] or 0)) > MAX_EXP:
        return None
    digits = int(m[2].replace(",", "") + (m[3] or "") or "0")
    scale = exp - len(m[3] or "")  # the value is digits * 10^scale
    v = Fraction(digits * 10 ** scale) if scale >= 0 else Fraction(digits, 10 ** -scale)
    return -v if m[1] == "-" else v


def decimal_key(s: str) -> tuple | None:
    """(sign, integer digits, fraction digits) of a plain decimal without separators, linear time
    at any length."""
    whole, _, frac = (s[1:] if s[:1] in ("+", "-") else s).partition(".")
    if whole and not whole.isdecimal() or frac and not frac.isdecimal():
        return None
    if not (whole or frac or "0" in s):
        return None
    whole, frac = whole.lstrip("0"), frac.rstrip("0")
    return ("-" if s[:1] == "-" and (whole or frac) else ""), whole, frac


def _rational_root(c: Fraction, n: int) -> Fraction | None:
    """The exact real n-th root of a rational c, or None (integer Newton from above on numerator
    and denominator)."""
    out = []
    for x in (abs(c.numerator), c.denominator):
        r = 1 << -(-x.bit_length() // n)
        while r and (y := ((n - 1) * r + x // r ** (n - 1)) // n) < r:
            r = y
        out.append(r)
    return r if (r := Fraction(*out) * (-1 if c < 0 else 1)) ** n == c else None


def _prime_factors(n: int, bound: int) -> dict | None:
    """{prime: exponent} of 0 < n by trial division over the primes below 1000; None if a cofactor
    > bound remains."""
    out = {}
    for p in _PRIMES:
        if n < p * p:
            break
        while n % p == 0:
            n, out[p] = n // p, out.get(p, 0) + 1
    return None if n > bound else out | ({n: 1} if n > 1 else {})  # < 10^6, no factor < 1000: prime


_ONE = ((), ())  # the monomial 1: (radical ((p, e), ...), names ((x, f), ...)), both sorted
_UNIT = {_ONE: Fraction(1)}  # the polynomial 1
_NAMES = ("alpha", "beta", "gamma", "delta", "theta", "lambda", "mu", "rho", "sigma", "tau", "phi",
          "omega", "pi")  # names, as x is
_FORM_TOKEN = re.compile(r"\d*\.\d*\\overline\{\d+\}|\d+\.?\d*|\.\d+|\\(?:%s)|\\[a-z]+"
                         r"|[a-z](?:_\{[a-z0-9]+\})?|\S"  # \pir: \pi r
                         % "|".join(_NAMES + ("sqrt", "frac", "binom", "log", "cdot", "times",
                                              "div")))
_TIMES = ("*", "\\cdot", "\\times", "/", "\\div")
_OPENS = ("(", "{", "\\sqrt", "\\frac", "\\binom", "\\log")
_NO_FORM = re.compile(r"(?<![\\a-z])(?:[a-z]{3}|[fgh]\()|(?<![\d.])\d+\(\d+/\d+\)|\\[lc]?dots")


class Form(NamedTuple):
    """A normal form of step 2, num / den: polynomials as dicts {monomial: Fraction}, a monomial
    laid out as _ONE."""
    num: dict
    den: dict

    def rational(self, integer: bool = False) -> Fraction | int:
        """The rational number this form is (integer: an int in [0, MAX_FACT]); else ValueError."""
        plain = set(self.num) <= {_ONE} and self.den == _UNIT
        c = self.num.get(_ONE, Fraction(0)) if plain else None
        if c is None or integer and not (c.denominator == 1 and 0 <= c <= MAX_FACT):
            raise ValueError("no integer in [0, MAX_FACT]" if integer else "no rational number")
        return int(c) if integer else c


def _int(e: Fraction | int) -> Fraction | int:
    return int(e) if type(e) is int or e.denominator == 1 else e  # ints hash fast: keys hold them


def _merge(a: tuple, b: tuple) -> tuple:
    """{key: exponent} of a and b, as a sorted tuple without zeros."""
    out = dict(a)
    for k, e in b:
        out[k] = out[k] + e if k in out else e
    return tuple(sorted((k, _int(e)) for k, e in out.items() if e))


def _key(v: "Form") -> str:
    """A canonical text for the form v: sorted monomials of its numerator and denominator."""
    return repr((sorted(v.num.items()), sorted(v.den.items())))


def _radical(factors: dict) -> tuple[Fraction, tuple]:
    """prod p^x (rational x) = c * prod p^e with 0 < e < 1: (c, ((p, e), ...))."""
    c, rad = Fraction(1), []
    for p, x in sorted(factors.items()):
        k = x.numerator // x.denominator  # floor
        c *= Fraction(p) ** k
        if x != k:
            rad.append((p, x - k))
    return c, tuple(rad)


class Arith:
    """Step 2's arithmetic on Forms and their polynomials, for one answer."""
    work = 0  # monomial products so far, against MAX_WORK

    def check(self, p: dict) -> dict:
        p = {m: c for m, c in p.items() if c}
        if len(p) > MAX_TERMS or any(max(c.numerator.bit_length(), c.denominator.bit_length())
                                     > MAX_BITS or sum(e for _, e in m[1]) > MAX_DEG
                                     for m, c in p.items()):
            raise ValueError("too large")
        return p

    def const(self, c: Fraction | int) -> Form:
        return Form(self.check({_ONE: Fraction(c)}), _UNIT)

    def mul(self, p: dict, q: dict) -> dict:
        if (work := self.work + len(p) * len(q)) > MAX_WORK:
            raise ValueError("too much work")
        out, self.work = {}, work
        for (r1, v1), x in p.items():
            for (r2, v2), y in q.items():
                # sqrt2 sqrt2 = 2, i i = -1
                c, rad = _radical(dict(_merge(r1, r2))) if r1 and r2 else (1, r1 or r2)
                key = (rad, _merge(v1, v2) if v1 and v2 else v1 or v2)
                z = x * y if c == 1 else c * x * y
                out[key] = out[key] + z if key in out else z
        return self.check(out)

    def quotient(self, n: dict, d: dict) -> Form:
        if not d:
            raise ZeroDivisionError
        c = d.get(_ONE) if len(d) == 1 else None  # a rational denominator: into the coefficients
        return Form(n, d) if c is None else Form({m: x / c for m, x in n.items()}, _UNIT)

    def add(self, u: Form, v: Form, sign: int) -> Form:
        (a, b), (c, d) = u, v
        a, c, b = (a, c, b) if b == d else (self.mul(a, d), self.mul(c, b), self.mul(b, d))
        return self.quotient(self.check({m: a.get(m, 0) + sign * c.get(m, 0) for m in a | c}), b)

    def times(self, u: Form, v: Form, divide: bool = False) -> Form:
        if u.den == _UNIT == v.den and len(u.num) == 1 == len(v.num) and _ONE in u.num and (
                _ONE in v.num):  # two rationals
            self.work += 1
            return self.const(u.num[_ONE] / v.num[_ONE] if divide else u.num[_ONE] * v.num[_ONE])
        n, d = (v.den, v.num) if divide else v
        return self.quotient(self.mul(u.num, n), self.mul(u.den, d))

    def mono_power(self, p: dict, k: Fraction) -> dict:
        """(c * radical * names)^k of a one-term polynomial, k > 0; an even root of an even power
        or of i is refused."""
        ((rad, names), c), = p.items()
        if k.denominator > 1 and (any(q == -1 for q, _ in rad) or k.denominator % 2 == 0
                                  and any(f.denominator == 1 and f % 2 == 0 for _, f in names)):
            raise ValueError("root")  # \sqrt{x^2} is |x|
        if max(abs(c.numerator), c.denominator).bit_length() * k.numerator > MAX_BITS:
            raise ValueError("power")
        if c < 0 < k.numerator - 1 and k.denominator > 1:  # (-4)^{3/2}: not sqrt((-4)^3)
            raise ValueError("power")
        if k.denominator == 1:
            out = {_ONE: c ** k.numerator}
        else:
            out = self.root(c ** k.numerator, k.denominator).num
        if rad:
            r, extra = _radical({q: e * k for q, e in rad})
            out = self.mul(out, {(extra, ()): r})
        if names:  # out holds no names yet
            out = {(m[0], tuple((x, _int(f * k)) for x, f in names)): v for m, v in out.items()}
        return self.check(out)

    def power(self, v: Form, k: Fraction) -> Form:
        if abs(k.numerator) > 10 ** 6:
            raise ValueError("power")
        if not v.num:  # 0^k
            return self.quotient({}, _UNIT) if k > 0 else self.quotient(_UNIT, {})
        if len(v.num) == 1 and len(v.den) == 1:  # a monomial over a monomial: exponent arithmetic
            n, d = self.mono_power(v.num, abs(k)), self.mono_power(v.den, abs(k))
            return self.quotient(*((d, n) if k < 0 else (n, d)))
        if k.denominator > 1:  # a root of a sum: an opaque atom, sqrt(x+1) = sqrt(1+x), no more
            return self.atom("@(%s)" % _key(v), k)
        out = Form(_UNIT, _UNIT)
        for _ in range(abs(int(k))):  # MAX_WORK ends (1+i)^(10^6) early
            out = self.times(out, v, divide=k < 0)
        return out

    def atom(self, name: str, k: Fraction) -> Form:
        """name^k for an opaque name (a root of a sum, a symbolic power): equal atoms have equal
        keys, the canonical forms of what they hold; distinct ones are independent names, so only
        equalities are lost."""
        mono = {((), ((name, abs(k)),)): Fraction(1)}
        return Form(self.check(mono), _UNIT) if k > 0 else self.quotient(_UNIT, self.check(mono))

    def root(self, c: Fraction, n: int) -> Form:
        """c^(1/n) for a rational c: s * prod p^e with p prime (-1 for i)."""
        if (r := _rational_root(c, n)) is not None:
            return self.const(r)
        if c < 0 and n % 2 == 0 and n != 2:  # \sqrt[4]{-4} has no real value
            raise ValueError("root")
        sign = -1 if c < 0 and n % 2 else 1
        num = _prime_factors(abs(c.numerator), MAX_RADICAND)
        den = _prime_factors(c.denominator, MAX_RADICAND)
        if num is None or den is None or max(abs(c.numerator), c.denominator) > MAX_RADICAND:
            raise ValueError("radicand")
        factors = {p: Fraction(e, n) for p, e in num.items()}
        for p, e in den.items():
            factors[p] = factors.get(p, 0) - Fraction(e, n)
        if c < 0 and n == 2:
            factors[-1] = Fraction(1, 2)  # \sqrt{-4} = 2i
        s, rad = _radical(factors)
        if any(p > MAX_RADICAND for p, _ in rad):
            raise ValueError("radicand")
        return Form({(rad, ()): sign * s}, _UNIT)


class Parser:
    """Step 2's grammar, one method per rule: tokens of s to a Form by recursive descent, computed
    by arith."""

    def __init__(self, s: str, arith: Arith | None = None):
        if _NO_FORM.search(s):
            raise ValueError(s)
        self.toks, self.pos, self.depth = _FORM_TOKEN.findall(s) + [""], 0, 0
        self.arith = arith or Arith()  # one Arith for the parts of an answer: one MAX_WORK budget
        if len(self.toks) > MAX_TOKENS:
            raise ValueError("too long")

    def take(self, *ops: str) -> str | None:
        t = self.toks[self.pos] if self.toks[self.pos] in ops else None
        self.pos += t is not None
        return t

    def expr(self, whole: bool = False) -> Form:
        v = self.term()
        while t := self.take("+", "-"):
            v = self.arith.add(v, self.term(), 1 if t == "+" else -1)
        if whole and self.toks[self.pos]:
            raise ValueError(self.toks[self.pos])
        return v

    def term(self) -> Form:
        v = self.factor()
        # an operator, or factors juxtaposed: 2x, x(x+1), 3\sqrt{2}, 2!4!
        while (t := self.toks[self.pos]) in _TIMES or t[:1].isalpha() or t[1:] in _NAMES or (
                t in _OPENS) or t[:1].isdigit() and self.toks[self.pos - 1] == "!":
            self.pos += t in _TIMES  # a number never follows anything else: x2, (x)2 are rejected
            v = self.arith.times(v, self.factor(), divide=t in ("/", "\\div"))
        return v

    def factor(self, exponent: bool = False) -> Form:
        sign = 1
        while t := self.take("+", "-"):
            sign = -sign if t == "-" else sign
        v = self.primary()
        if not exponent and self.take("!"):  # 2^3!, 5!! are left over, so rejected: ambiguous
            v = self.arith.const(factorial(v.rational(integer=True)))
        if not exponent and self.take("^"):
            e = self.factor(exponent=True)
            if set(e.num) - {_ONE} or e.den != _UNIT:  # e^{x+1}: a symbolic power is an opaque atom
                atom = self.arith.atom("@(%s)^(%s)" % (_key(v), _key(e)), Fraction(1))
                return self.signed(atom, sign)
            if (k := e.rational()) == 0 and not v.num:
                raise ValueError("0^0")
            v = self.arith.power(v, k) if k else Form(_UNIT, _UNIT)
        return self.signed(v, sign)

    @staticmethod
    def signed(v: Form, sign: int) -> Form:
        return v if sign > 0 else Form({m: -c for m, c in v.num.items()}, v.den)

    def primary(self) -> Form:
        t, self.pos = self.toks[self.pos], self.pos + 1
        if t and t[0] in "0123456789." and len(t) <= MAX_NUMBER:  # 0.1\overline{6} = 0.1 + 6/90
            num, _, rep = t.partition("\\overline")
            shift = 10 ** len(num.partition(".")[2])  # the repeating digits start after these
            rep = Fraction(int(rep[1:-1]), shift * (10 ** (len(rep) - 2) - 1)) if rep else 0
            return self.arith.const(Fraction(num) + rep)
        if t[:1].isalpha() or t[1:] in _NAMES:
            mono = (((-1, Fraction(1, 2)),), ()) if t == "i" else ((), ((t, 1),))  # i = (-1)^(1/2)
            return Form({mono: Fraction(1)}, _UNIT)
        if t in ("(", "{") and self.depth < MAX_DEPTH:
            self.depth += 1
            v, self.depth = self.expr(), self.depth - 1
            if self.take(")" if t == "(" else "}"):
                return v
        if t == "\\sqrt":  # \sqrt[n]{c}
            n, close = (self.expr().rational(True), self.take("]")) if self.take("[") else (
                2, "]")
            if close and 2 <= n <= MAX_DEG:
                return self.arith.power(self.primary(), Fraction(1, n))
        if t == "\\frac":
            return self.arith.times(self.primary(), self.primary(), divide=True)
        if t == "\\binom":
            n = self.primary().rational(True)
            return self.arith.const(comb(n, self.primary().rational(True)))
        if t == "\\log" and self.take("_"):  # log_b(a) = p/q iff b = c^q and a = c^p, c rational
            b, a = self.primary().rational(), self.primary().rational()
            for q in range(1, 7) if b > 0 and b != 1 and a > 0 else ():
                if (c := _rational_root(b, q)) is not None and c != 1:
                    p = round((log(a.numerator) - log(a.denominator))
                              / (log(c.numerator) - log(c.denominator)))
                    if abs(p) <= MAX_DEG and c ** p == a:
                        return self.arith.const(Fraction(p, q))
        raise ValueError(t)


def same(a: str, x: Fraction | None, b: str, y: Fraction | None) -> bool:
    """True iff both answers have normal forms n1/d1, n2/d2 (x, y: values of plain numbers) with
    n1 d2 == n2 d1, or (past the bounds of the form) equal factorisations."""
    x, y = (value(a) if x is None else x), (value(b) if y is None else y)  # numbers first
    if x is not None and y is not None:
        return x == y
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 6 * MAX_DEPTH + 1000))  # 5 frames a bracket level
    try:
        arith = (p := Parser(a if x is None else "")).arith
        u = p.expr(whole=True) if x is None else arith.const(x)
        (n1, d1), (n2, d2) = u, Parser(b).expr(whole=True) if y is None else arith.const(y)
        return arith.mul(n1, d2) == arith.mul(n2, d1)
    except (ValueError, ZeroDivisionError, RecursionError):
        if "^" not in a + b or x == 0 or y == 0:
            return False
        try:  # past the form's bounds: exponent arithmetic
            u = _big(x) if x is not None else value(a, True)
            v = _big(y) if y is not None else value(b, True)
        except ValueError:
            return False
        return u is not None and u == v
    finally:
        sys.setrecursionlimit(limit)


_ORIENT = {"=": ("=", 1), "\\neq": ("\\neq", 1), ">": (">", 1), "\\ge": ("\\ge", 1), "<": (">", -1),
           "\\le": ("\\ge", -1)}  # a relation as one of = \\neq > \\ge; the side subtracted from
_FLIP = {">": "<", "\\ge": "\\le"}


def _relation_form(u: tuple, arith: Arith) -> tuple[str, Form]:
    """(relation, form) of u = (lhs, relation, rhs): every term moved to one side, so that the
    relation is =, \\neq, > or \\ge against 0: L - R, or R - L for < and \\le. Raises as Parser
    does."""
    lhs, rel, rhs = u
    rel, sign = _ORIENT[rel]
    sys.setrecursionlimit(max(limit := sys.getrecursionlimit(), 6 * MAX_DEPTH + 1000))  # as in same
    try:
        left, right = Parser(lhs, arith).expr(whole=True), Parser(rhs, arith).expr(whole=True)
    finally:
        sys.setrecursionlimit(limit)
    return rel, arith.add(left, right, -1) if sign > 0 else arith.add(right, left, -1)


def _scale(p: dict, q: dict) -> Fraction | None:
    """The rational c with p == c q (c != 0; 1 when both are 0), or None when there is none."""
    if p.keys() != q.keys():
        return None
    m = next(iter(p), None)
    c = p[m] / q[m] if p else Fraction(1)
    return c if all(p[k] == c * q[k] for k in p) else None


def same_relation(u: tuple, v: tuple) -> bool:
    """True iff u and v, each (lhs, relation, rhs) with relation = \\neq < > \\le or \\ge, state
    one relation of the same normal form: their forms n1/d1, n2/d2 (terms on one side) have n1 d2 =
    c n2 d1 for a rational c, c != 0 for = and \\neq (x = 1 is 2x = 2, x - 1 = 0 is 1 - x = 0), c >
    0 for an inequality (-x > -1 is x < 1, x > 1 is not x < 1). One Arith: one MAX_WORK budget for
    both."""
    arith = Arith()
    try:
        (r, (n1, d1)), (s, (n2, d2)) = _relation_form(u, arith), _relation_form(v, arith)
        c = _scale(arith.mul(n1, d2), arith.mul(n2, d1))
    except (ValueError, ZeroDivisionError, RecursionError):
        return False
    return r == s and c is not None and (c > 0 or r in ("=", "\\neq"))


def linear_bound(u: tuple) -> tuple[str, str, Fraction] | None:
    """(x, relation, c) when the inequality u = (lhs, relation, rhs) is a x + b > 0 (or \\ge) for
    one name x and rationals a != 0, b: then u is x > c (a > 0) or x < c (a < 0), c = -b/a; None
    for anything else."""
    if u[1] not in ("<", ">", "\\le", "\\ge"):
        return None
    try:
        rel, (num, den) = _relation_form(u, Arith())
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    terms = [m for m in num if m != _ONE]  # a monomial: (radical, ((name, exponent), ...))
    names = terms[0][1] if len(terms) == 1 and not terms[0][0] else ()  # no radical on it
    if den != _UNIT or len(names) != 1 or names[0][1] != 1:  # a x + b: one name, to the first power
        return None
    name, a, b = terms[0][1][0][0], num[terms[0]], num.get(_ONE, Fraction(0))
    return None if name.startswith("@") else (name, rel if a > 0 else _FLIP[rel], -b / a)


_PREC = {"+": 1, "-": 1, "*": 2, "/": 2, "u": 3, "^": 4}  # u: unary minus (-2^2 = -4)
_OPS = {"\\cdot": "*", "\\times": "*", "\\div": "/", "*": "*", "/": "/", "+": "+", "-": "-",
        "^": "^"}


def _big(c: Fraction) -> tuple:
    """c as (sign, ((prime, exponent), ...)); ValueError past the factoring bound."""
    num = _prime_factors(abs(c.numerator), MAX_RADICAND)
    den = _prime_factors(c.denominator, MAX_RADICAND)
    if num is None or den is None or not c:
        raise ValueError("factor")
    return (-1 if c < 0 else 1), _merge(tuple(num.items()), tuple((p, -e) for p, e in den.items()))


def _apply_big(vals: list, op: str) -> None:
    """Step 3 on (sign, factors): products, quotients and integer powers by exponent arithmetic;
    no sums."""
    (t, b), (s, a) = vals.pop(), vals.pop() if op != "u" else (1, ())
    if op in "+-" or op == "^" and (s < 0 or any(e < 0 for _, e in b)
                                    or sum(e * p.bit_length() for p, e in b) > MAX_BITS + 64):
        raise ValueError(op)
    if op != "^":
        b = b if op in "*u" else tuple((p, -e) for p, e in b)  # a quotient: the exponents negated
        return vals.append((s * t if op != "u" else -t, _merge(a, b)))
    k = t
    for p, e in b:
        k *= p ** e  # the exponent, an exact integer of at most MAX_BITS bits
    if max((abs(e * k).bit_length() for _, e in a), default=0) > 2 * MAX_BITS:
        raise ValueError("power")
    vals.append((s, tuple((p, e * k) for p, e in a if k)))


def _apply(vals: list, op: str) -> None:
    """One operation on unreduced (numerator, denominator > 0) pairs of ints: no gcd per step,
    bounded bits."""
    (p, q), (n, d) = vals.pop(), vals.pop() if op != "u" else (0, 1)
    if op == "^" and (q != 1 or abs(p) > MAX_BITS or n == 0 and p <= 0
                      or max(n.bit_length(), d.bit_length()) * abs(p) > MAX_BITS):
        raise ValueError("power")
    if op == "^":
        r = (n ** p, d ** p) if p >= 0 else (d ** -p, n ** -p)
    elif op in "+-u":  # u: 0 - p / q
        r = (n * q + p * d if op == "+" else n * q - p * d, d * q)
    else:
        r = (n * p, d * q) if op == "*" else (n * q, d * p)
    if r[1] == 0 or max(r[0].bit_length(), r[1].bit_length()) > 2 * MAX_BITS:
        raise ZeroDivisionError if r[1] == 0 else ValueError("size")
    vals.append(r if r[1] > 0 else (-r[0], -r[1]))


def _arith_tokens(toks: list) -> list | None:
    """\\frac{a}{b} -> ((a)/(b)), {a} -> (a), implicit products made explicit; None on anything
    else."""
    out, kinds, expect = [], [], None
    for t in toks:
        if expect == "den" and t != "{" or t == "\\frac" and expect:
            return None
        if t == "\\frac":
            expect = "num"
            continue
        if t == "{":
            kind, expect = expect or "plain", None
            kinds.append(kind)
            new = ["/", "("] if kind == "den" else ["(", "("] if kind == "num" else ["("]
        elif t == "}" and kinds:
            kind = kinds.pop()
            new, expect = [")", ")"] if kind == "den" else [")"], "den" if kind == "num" else None
        elif t in _OPS or t in ("(", ")") or t[0] in "0123456789." and "\\" not in t and (
                len(t) <= MAX_NUMBER):
            new = [_OPS.get(t, t)]
        else:
            return None
        if expect == "num" or new == ["^"] and _after_power(out):  # 2^3^4 and 2^{3}^4 are ambiguous
            return None
        if out and (out[-1] == ")" or out[-1][0] in "0123456789.") and new[0] == "(":
            out.append("*")  # 2(3), (1)(2), 2\\frac{1}{2} is not here: normalised to 2(1/2) before
        elif out and (out[-1] == ")" or out[-1][0] in "0123456789.") and new[0][0] in "0123456789.":
            return None  # 2 3, (1)2: no implicit products of numbers
        out += new
    return out if not kinds and expect is None else None


def _after_power(out: list) -> bool:
    """True when the operand that ends out (a number or a bracket group) is itself an exponent."""
    k, depth = len(out) - 1, 0
    while k > 0 and (depth or out[k] == ")"):
        depth += (out[k] == ")") - (out[k] == "(")
        k -= 1 if depth else 0
        if not depth:
            break
    return k > 0 and out[k - 1] == "^"


def value(s: str, big: bool = False) -> Fraction | tuple | None:
    """The value of a purely numeric expression (numbers, + - * / ^, brackets, \\frac, \\cdot),
    iteratively: a shunting-yard pass, so a fraction nested 400 deep costs no recursion; None if it
    is anything else. big: as (sign, prime factors) by exponent arithmetic (step 3)."""
    apply = _apply_big if big else _apply
    toks = _FORM_TOKEN.findall(s) if s.count("^") <= MAX_DEG and not _NO_FORM.search(s) else None
    toks = _arith_tokens(toks) if toks and len(toks) <= 2.5 * MAX_TOKENS else None
    if not toks or toks[-1] in _PREC:  # 1+1+...+ ends in an operator: no arithmetic wasted on it
        return None
    vals, ops, prev = [], [], "("
    try:
        for t in toks:
            if t == "(":
                ops.append(t)
            elif t == ")":
                while ops[-1] != "(":
                    apply(vals, ops.pop())
                ops.pop()
            elif t[0] in "0123456789.":
                c = (int(t), 1) if t.isdigit() else Fraction(t).as_integer_ratio()
                vals.append(_big(Fraction(*c)) if big else c)
            elif prev in ("(", "+", "-", "*", "/", "^", "u") and t in "+-":
                if t == "-":
                    ops.append("u")  # a prefix operator pops nothing
                t = "u" if t == "-" else prev  # a leading + is nothing
            else:
                _push(vals, ops, t, apply)
            prev = t
        while ops:
            apply(vals, ops.pop())
        return (vals[0] if big else Fraction(*vals[0])) if len(vals) == 1 else None
    except (IndexError, ValueError, ZeroDivisionError, KeyError):
        return None


def _push(vals: list, ops: list, op: str, apply) -> None:
    while ops and ops[-1] != "(" and (_PREC[ops[-1]] > _PREC[op]
                                      or _PREC[ops[-1]] == _PREC[op] and op not in "^u"):
        apply(vals, ops.pop())
    ops.append(op)
