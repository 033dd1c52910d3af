"""Problems for reasoning RL: synthetic generators, JSONL loaders for GSM8K / MATH, the Task a run
draws from.

1. arithmetic(seed, index): a chain like "8-18*3+13=" in a small synthetic language evaluated
   STRICTLY LEFT TO RIGHT, one binary step at a time (not school precedence: 8-18*3 means (8-18)*3).
   + and - take operands in 0..max_operand, * only takes 0..max_mul_operand. level = number of
   operations, drawn in [min_ops, max_ops].
   prompt "8-18+13="   solution "8-18=-10;-10+13=3 #### 3"   gold "3"
   Every step is "a op b=c", so verify.step_rewards can check it and
   verify.reward(solution, gold) == 1.0.
2. countdown(seed, index): reach a target with the given numbers, each used at most once, and
   + - * /. prompt "3 7 25>46=" (the numbers sorted, ">", the target, "="); solution an expression
   that uses every number once with standard precedence, e.g. "7*3+25"; gold the target "46". The
   target is reachable by construction: it is the value of a random expression over the numbers
   (retried until a positive integer). countdown_check parses an expression with verify.eval_arith
   (exact Fractions, no eval).
3. Determinism: problem (seed, index) comes from its own random.Random seeded with the string
   "task:seed:index" (random hashes str seeds with SHA-512, independent of PYTHONHASHSEED), so
   problem i never depends on the draws of other problems. A held-out set is one seed with indices
   0..n-1; train on another.
4. load_gsm8k / load_math read JSONL files; Task.prompt_text wraps a question in a template
   (templates.py): plain, r1, boxed, or the checkpoint's chat template rendered as transformers'
   apply_chat_template does.
5. reasoning_gym (pip install reasoning-gym): ONE dataset of rg_size items from eval_seed
   (rg_datasets: {name: options}, several names a CompositeDataset by their `weight`), split by
   index: items [0, rg_heldout) are the held-out pool, the rest, less any question the pool holds,
   the training set (its items come from Random(seed + idx): datasets of adjacent seeds overlap, so
   none is built twice). The reward is the dataset's own score_answer of the FINAL committed answer
   (verify.extract_answer), binarised (>= 1: 1, else 0): its partial credit for substrings,
   gsm_symbolic's first number and countdown's 0.01 / 0.05 floors pay nothing. committed_number: the
   format-only control's reward (1 for any final answer that is a number, right or wrong).
6. Task: a run's problems by index (the SFT and RL streams, the held-out set, never drawn for
   training), its prompts as token ids, its cold-start targets and the verifier's score of a
   completion. seed_of(*keys) hashes integers into a seed that is the same on any number of ranks.

Tests: python -m pytest -q tests/test_tasks.py
"""
import functools
import importlib
import json
import multiprocessing
import operator
import random
import re
from dataclasses import dataclass
from fractions import Fraction

import tooluse
import verify
from cli import UserError
from templates import TEMPLATES, chat_template
from verify import MAX_EXPR, eval_arith, extract_answer

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}  # arithmetic's binary steps
# every character a synthetic prompt or solution can hold: a char-level vocabulary
CHARS = "0123456789+-*/()=;#> "


@dataclass
class Problem:
    prompt: str  # the question text, untemplated
    gold: str  # the gold final answer
    solution: str  # a worked completion for a cold start, in a format extract_answer reads
    level: int = 0  # difficulty (number of operations); 0 when unknown
    source: str = ""  # the composite reasoning-gym member it comes from (evaluation rows)
    entry: dict | None = None  # reasoning_gym: the dataset's item, which its score_answer reads


def arithmetic(seed: int, index: int, min_ops: int = 1, max_ops: int = 3, max_operand: int = 30,
               max_mul_operand: int = 9, max_value: int = 0, ops: str = "+-*") -> Problem:
    """A left-to-right arithmetic chain with a step-by-step solution (see step 1 of the module
    docstring). max_value > 0 keeps every intermediate result within ±max_value (an op is re-drawn,
    up to 20 times)."""
    rng = random.Random(f"arithmetic:{seed}:{index}")
    n_ops, value = rng.randint(min_ops, max_ops), rng.randint(0, max_operand)  # in this order
    prompt, steps = str(value), []
    for _ in range(n_ops):
        for _ in range(20):
            op = rng.choice(ops)
            b = rng.randint(0, max_mul_operand if op == "*" else max_operand)
            new = OPS[op](value, b)
            if not max_value or abs(new) <= max_value:
                break
        steps.append(f"{value}{op}{b}={new}")
        prompt, value = prompt + f"{op}{b}", new
    solution = ";".join(steps) + f" #### {value}"
    return Problem(prompt=prompt + "=", gold=str(value), solution=solution, level=n_ops)


FLAWS = ("random", "sign")


def flawed_solution(p: Problem, flaw: str, rng: random.Random) -> str:
    """A sloppy teacher's worked solution of an arithmetic chain, each error carried on to the final
    answer as a careless solver would: random, one step (drawn by rng) off by ±1..3, a slip; sign,
    every negative result written without its minus sign ("3-7=4"), a consistent misconception.
    Chains without a negative result stay right under sign."""
    nums, ops = [int(n) for n in re.findall(r"\d+", p.prompt)], re.findall(r"[-+*]", p.prompt)
    value, steps = nums[0], []
    slip, offset = rng.randrange(len(ops)), rng.choice((-3, -2, -1, 1, 2, 3))
    for i, (op, b) in enumerate(zip(ops, nums[1:])):
        new = OPS[op](value, b)
        new = abs(new) if flaw == "sign" else new + offset * (i == slip)
        steps.append(f"{value}{op}{b}={new}")
        value = new
    return ";".join(steps) + f" #### {value}"


def countdown(seed: int, index: int, n_numbers: int = 3, max_number: int = 25) -> Problem:
    """Reach a target from n_numbers numbers in 1..max_number (see step 2 of the module
    docstring)."""
    rng = random.Random(f"countdown:{seed}:{index}")
    # most random expressions already give a positive integer; try 100 (a sum) surely does
    for tries in range(101):
        numbers = [rng.randint(1, max_number) for _ in range(n_numbers)]
        expr, value, last = str(numbers[0]), Fraction(numbers[0]), ""
        for n in numbers[1:]:
            op = rng.choice("+-*/" if tries < 100 else "+")  # a sum of positive numbers works
            if op in "*/" and last in ("+", "-"):
                expr = f"({expr})"  # the left operand is a sum: keep it together
            expr, last = f"{expr}{op}{n}", op
            value = OPS[op](value, n) if op in OPS else value / n
        if value.denominator == 1 and value > 0:
            break
    prompt = " ".join(map(str, sorted(numbers))) + f">{value}="
    return Problem(prompt=prompt, gold=str(value), solution=expr, level=n_numbers - 1)


def countdown_check(expr: str, numbers: list[int], target: int) -> bool:
    """True iff expr (integers, + - * /, parentheses) uses only the given numbers, each at most
    once, and evaluates exactly to target. Division by zero, unary signs and over-long expressions
    are False."""
    if len(expr) > MAX_EXPR or not re.fullmatch(r"[0-9+\-*/() ]+", expr):
        return False
    if re.search(r"(^|[-+*/(])\s*[-+]", expr):  # a unary sign
        return False
    pool = list(numbers)
    for n in map(int, re.findall(r"[0-9]+", expr)):
        if n not in pool:
            return False  # not given, or given fewer times than used
        pool.remove(n)
    value = eval_arith(expr)
    return value is not None and value == target


def countdown_reward(completion: str, problem: Problem) -> float:
    """1.0 iff the completion's expression solves the countdown problem. The expression is the
    extracted answer (<answer>, \\boxed{}, ...) or else the completion's first line up to any "<"
    (an EOS string like <|endoftext|>); a trailing "=target" is allowed."""
    m = re.fullmatch(r"([0-9 ]+)>([0-9]+)=", problem.prompt)
    if m is None:
        raise ValueError(f"not a countdown prompt: {problem.prompt!r}")
    answer = extract_answer(completion)
    expr = answer if answer is not None else completion.strip().split("\n", 1)[0].split("<", 1)[0]
    expr = expr.split("=")[0]
    return float(countdown_check(expr.strip(), [int(n) for n in m[1].split()], int(m[2])))


def _read_jsonl(path, keys: tuple[str, ...]):
    """Yield (where, record) per non-empty line; UserError (a ValueError) naming file:line for bad
    JSON or a missing key."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: bad JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if missing := [key for key in keys if not isinstance(record.get(key), str)]:
                raise UserError(f"{where}: missing string field {missing[0]!r}")
            yield where, record


def load_gsm8k(path) -> list[Problem]:
    """GSM8K JSONL: "question", and "answer" whose last line is "#### N"; gold is N with commas
    stripped."""
    problems = []
    for where, r in _read_jsonl(path, ("question", "answer")):
        i = r["answer"].rfind("####")
        gold = r["answer"][i + 4:].strip().split("\n")[0].strip().replace(",", "") if i >= 0 else ""
        if not gold:
            raise UserError(f"{where}: no final answer ('#### N') in 'answer'")
        problems.append(Problem(prompt=r["question"], gold=gold, solution=r["answer"], level=0))
    return problems


def load_math(path) -> list[Problem]:
    """MATH JSONL: "problem", "solution" with a \\boxed{} answer (the gold), optional "level" like
    "Level 3"."""
    problems = []
    for where, r in _read_jsonl(path, ("problem", "solution")):
        gold = extract_answer(r["solution"])
        if not gold:
            raise UserError(f"{where}: no final answer (\\boxed{{}}) in 'solution'")
        level = re.search(r"\d+", str(r.get("level", "")))
        problems.append(Problem(prompt=r["problem"], gold=gold, solution=r["solution"],
                                level=int(level.group()) if level else 0))
    return problems


def reasoning_gym_dataset(specs: dict, seed: int, size: int):
    """The reasoning-gym dataset of `size` items from `seed`: specs {name: {option: value}} with one
    name, or a CompositeDataset of several, each drawn by its table's `weight` (default 1)."""
    try:
        import reasoning_gym
        from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec
    except ImportError:
        raise UserError("task = 'reasoning_gym' needs reasoning-gym: "
                        "pip install reasoning-gym") from None
    if bad := [n for n, o in specs.items() if not isinstance(o, dict) or {"seed", "size"} & set(o)]:
        raise UserError(f"rg_datasets: {bad[0]!r} needs a table of its options, without seed and "
                        f"size (eval_seed and rg_size set them), got {specs[bad[0]]!r}")
    opts = {n: {k: v for k, v in o.items() if k != "weight"} for n, o in specs.items()}
    try:  # a bad name or option is the user's: reasoning-gym says which
        if len(specs) == 1:
            (name, o), = opts.items()
            return reasoning_gym.create_dataset(name, seed=seed, size=size, **o)
        return CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=[
            DatasetSpec(n, float(specs[n].get("weight", 1.0)), o) for n, o in opts.items()]))
    except (ValueError, TypeError, AssertionError) as e:
        raise UserError(f"rg_datasets = {specs!r}: {e}") from None


def rg_problem(item: dict, composite: bool) -> Problem:
    return Problem(prompt=item["question"], gold=str(item["answer"]), solution="", entry=item,
                   source=item["metadata"]["source_dataset"] if composite else "")


def rg_reward(dataset, completion: str, p: Problem) -> float:
    """1.0 iff the dataset's score_answer gives the final committed answer full marks (step 5 of the
    docstring). It runs in a Scorer: an exception there scores 0 and is counted."""
    answer = extract_answer(completion)
    return float(answer is not None and dataset.score_answer(answer, p.entry) >= 1)


def load_scorer(spec: str):
    """`scorer = "module:function"` -> the function (its module importable from the working
    directory or PYTHONPATH: a Scorer's worker imports it by name)."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name) if module and name else None
    except ImportError as e:
        raise UserError(f"scorer = {spec!r}: cannot import {module!r}: {e}") from None
    except AttributeError:
        fn = None
    if not callable(fn):
        raise UserError(f"scorer = {spec!r}: want \"module:function\", a function "
                        "scorer(completion: str, problem: tasks.Problem) -> float in [0, 1]")
    return fn


def _serve(conn, fn):
    """A Scorer's worker: (completion, problem) -> (True, score) or (False, the exception)."""
    conn.send("ready")
    while True:
        try:
            args = conn.recv()
        except EOFError:  # the trainer has gone
            return
        try:
            conn.send((True, float(fn(*args))))
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}"[:300]))


class Scorer:
    """A scorer outside verify.py (a reasoning-gym dataset's score_answer, a user's `scorer`) in a
    worker process, so that none can stall or silently zero a run (a thread cannot be stopped):
    each call has `timeout` seconds; past it the worker is killed and a fresh one takes the next
    call. A timeout, an exception, a dead worker or a score outside [0, 1] scores 0 and is counted
    (take_failures); the first of each kind is printed. The worker is forked from a fork server
    (spawned where there is none), never from this process and its threads."""

    STARTUP_S = 120.0  # a worker that has not started by then is an error, not a wait

    def __init__(self, fn, timeout: float):
        self.fn, self.timeout, self.worker, self.conn = fn, timeout, None, None
        self.failed, self.seen = {"timeouts": 0, "errors": 0}, set()

    def __call__(self, completion: str, p: Problem) -> float:
        if self.worker is None:
            self.start()
        self.conn.send((completion, p))
        if not self.conn.poll(self.timeout):
            self.stop()
            return self.fail("timeouts", f"no score within scorer_timeout = {self.timeout} s")
        try:
            ok, value = self.conn.recv()
        except EOFError:  # the worker died (a crash, an exit inside the scorer)
            self.stop()
            return self.fail("errors", "the scorer's worker died")
        if not ok or not 0 <= value <= 1:  # NaN fails both
            return self.fail("errors", value if not ok else f"score {value} outside [0, 1]")
        return value

    def fail(self, kind: str, why: str) -> float:
        self.failed[kind] += 1
        if kind not in self.seen:
            self.seen.add(kind)
            print(f"warning: scorer {getattr(self.fn, '__name__', self.fn)!r}: {why}; scored 0 "
                  f"(counted in scorer_{kind}; first of its kind)", flush=True)
        return 0.0

    def take_failures(self) -> dict:
        """{"scorer_timeouts": n, "scorer_errors": n} since the last take."""
        out = {f"scorer_{k}": v for k, v in self.failed.items()}
        self.failed = dict.fromkeys(self.failed, 0)
        return out

    def start(self):
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        self.conn, child = ctx.Pipe()
        self.worker = ctx.Process(target=_serve, args=(child, self.fn), daemon=True)
        self.worker.start()
        child.close()
        if not self.conn.poll(self.STARTUP_S):
            self.stop()
            raise RuntimeError(f"the scorer's worker did not start within {self.STARTUP_S} s")
        self.conn.recv()

    def stop(self):
        self.worker.kill()
        self.worker.join()
        self.conn.close()
        self.worker = self.conn = None


def verified(completion: str, p: Problem) -> float:
    """verify.reward of the completion against the problem's gold answer."""
    return verify.reward(completion, p.gold)


def committed_number(completion: str) -> float:
    """1.0 iff the completion's final committed answer is a number, right or wrong: the format-only
    control."""
    answer = extract_answer(completion)
    return float(answer is not None and re.fullmatch(r"-?\d[\d,]*(\.\d+)?", answer) is not None)


def seed_of(*keys) -> int:
    """A 63-bit seed from integers, e.g. (seed, step, prompt index, sample index): the same on any
    rank count."""
    h = 0x9E3779B97F4A7C15
    for k in keys:  # splitmix64 over the keys
        h = (h ^ (k & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return h >> 1


class Task:
    """Problems by index, prompts as token ids, cold-start targets, and the verifier's score of a
    completion. cfg has train.Config's task fields; tok is a tokenizers.Tokenizer; stop_ids end a
    completion; tok_config (from read_tokenizer_config) holds the chat template that template =
    "chat" renders."""

    def __init__(self, cfg, tok, stop_ids: list[int], tok_config: dict | None = None):
        self.cfg, self.tok, self.stop_ids = cfg, tok, list(stop_ids)
        self.tok_config = tok_config or {}
        if not self.stop_ids:
            raise ValueError("the tokenizer has no end-of-sequence token")
        if cfg.template == "chat" and not self.tok_config.get("chat_template"):
            name = self.tok_config.get('name_or_path', 'a fresh model')
            raise SystemExit(f"error: template = 'chat', but {name} has no chat template "
                             "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        if cfg.system_prompt and cfg.template != "chat":
            raise SystemExit("error: system_prompt needs template = 'chat' "
                             f"(template is {cfg.template!r})")
        # a plain template's text (None: the chat template's); chat text holds its special tokens
        self.template, self.add_bos = TEMPLATES.get(cfg.template), cfg.template != "chat"
        # the token that ends every SFT target
        self.end_id = self.end_of_turn() if cfg.template == "chat" else self.stop_ids[0]
        self.stop_ids += [] if self.end_id in self.stop_ids else [self.end_id]
        if cfg.task in ("gsm8k", "math"):
            load = load_gsm8k if cfg.task == "gsm8k" else load_math
            self.train, self.heldout = load(cfg.train_file), load(cfg.eval_file)[:cfg.eval_n]
        elif cfg.task == "reasoning_gym":  # one dataset split by index (module docstring, 5)
            self.rg = reasoning_gym_dataset(cfg.rg_datasets, cfg.eval_seed, cfg.rg_size)
            items = [rg_problem(self.rg[i], len(cfg.rg_datasets) > 1) for i in range(cfg.rg_size)]
            pool = {p.prompt for p in items[:cfg.rg_heldout]}
            self.heldout = items[:cfg.eval_n]
            self.train = [p for p in items[cfg.rg_heldout:] if p.prompt not in pool]
            if not self.train:
                raise UserError("rg_datasets: every item after the held-out pool repeats one of "
                                f"its questions: raise rg_size = {cfg.rg_size} or use a task "
                                "with more questions")
        elif cfg.task in ("arithmetic", "countdown"):  # make(seed, index, min_ops, max_ops)
            self.make = functools.partial(arithmetic, max_operand=cfg.max_operand, ops=cfg.ops,
                                          max_mul_operand=cfg.max_mul_operand,
                                          max_value=cfg.max_value)
            if cfg.task == "countdown":
                self.make = lambda seed, i, lo, hi: countdown(seed, i)
            lo, hi = cfg.eval_min_ops, cfg.eval_max_ops
            self.heldout = [self.make(cfg.eval_seed, i, lo, hi) for i in range(cfg.eval_n)]
            # each stream's (seed, ops range)
            self.streams = {"sft": (seed_of(cfg.seed, 1), cfg.sft_min_ops, cfg.sft_max_ops),
                            "rl": (seed_of(cfg.seed, 0), cfg.rl_min_ops, cfg.rl_max_ops)}
        else:
            raise SystemExit(f"error: unknown task {cfg.task!r}; use arithmetic, countdown, gsm8k, "
                             "math, reasoning_gym")
        self.heldout_prompts = {p.prompt for p in self.heldout}
        self.tools = tooluse.toolbox(cfg, tok, self.tok_config)  # None without tools
        # score(completion, problem) -> the verifier's 0/1: the task's own scorer, else verify.py's;
        # one from outside the project (a user's, reasoning-gym's) runs in a Scorer's worker
        self.score = countdown_reward if cfg.task == "countdown" else verified
        if cfg.task == "reasoning_gym" or cfg.scorer:
            fn = load_scorer(cfg.scorer) if cfg.scorer else functools.partial(rg_reward, self.rg)
            self.score = Scorer(fn, cfg.scorer_timeout)
        self.outside = isinstance(self.score, Scorer)

    def problem(self, stage: str, k: int) -> tuple[int, Problem]:
        """The k-th training problem of a stage's stream -> (problem id, problem); held-out prompts
        never appear."""
        if self.cfg.task in ("gsm8k", "math", "reasoning_gym"):
            epoch, j = divmod(k, len(self.train))
            order = list(range(len(self.train)))
            random.Random(seed_of(self.cfg.seed, epoch)).shuffle(order)
            return order[j], self.train[order[j]]
        seed, lo, hi = self.streams[stage]
        pid = k % self.cfg.train_size if self.cfg.train_size else k
        p = self.make(seed, pid, lo, hi)
        # deterministic re-draws keep the held-out set unseen and, with sft_answer_filter, drop
        # every demonstration whose final answer is wrong (answer-filtered SFT: the next problem
        # takes its place)
        while p.prompt in self.heldout_prompts or (stage == "sft" and self.filtered(k, p)):
            pid += 1 << 40
            p = self.make(seed, pid, lo, hi)
        return pid, p

    def filtered(self, k: int, p: Problem) -> bool:
        """With sft_answer_filter, True iff the k-th cold-start target's final answer is wrong."""
        if not self.cfg.sft_answer_filter:
            return False
        return verify.reward(self.cold_start_target(k, p), p.gold) < 1

    def cold_start_target(self, k: int, p: Problem) -> str:
        """The k-th cold-start target: the worked solution, from the sloppy teacher
        (flawed_solution) in a seeded sft_flaw_frac share, then (a seeded sft_direct_frac share)
        only its final answer."""
        # keyed by the prompt too: a re-draw re-rolls; the sloppy teacher is the demo's only
        flaw = random.Random(f"flaw:{self.cfg.seed}:{k}:{p.prompt}")
        flawed = self.cfg.task == "arithmetic" and flaw.random() < self.cfg.sft_flaw_frac
        solution = flawed_solution(p, self.cfg.sft_flaw, flaw) if flawed else p.solution
        direct = random.Random(seed_of(self.cfg.seed, k, 7)).random() < self.cfg.sft_direct_frac
        tool = random.Random(seed_of(self.cfg.seed, k, 11)).random() < self.cfg.sft_tool_frac
        if self.tools and tool:
            return re.sub(r"(-?\d+[-+*]\d+)=(-?\d+)", r"[\1]{\2}", p.solution)  # each step a call
        if direct:
            return f"#### {solution.rsplit('#### ', 1)[1] if flawed else p.gold}"
        return solution

    def cold_start_batch(self, first: int, B: int) -> tuple[list, list, list]:
        """Cold-start problems first..first + B - 1 (a GLOBAL batch) -> (problems, prompt ids,
        target ids)."""
        ks = range(first, first + B)
        probs = [self.problem("sft", k)[1] for k in ks]
        targets = [self.target_ids(self.cold_start_target(k, p)) for k, p in zip(ks, probs)]
        return probs, [self.prompt_ids(p) for p in probs], targets

    def chat(self, question: str, answer: str = "") -> str:
        """The chat template's text of system_prompt (if set), the question, then the generation
        prompt or `answer`."""
        turns = [("system", self.cfg.system_prompt), ("user", question), ("assistant", answer)]
        return chat_template(self.tok_config["chat_template"]).render(
            messages=[{"role": r, "content": c} for r, c in turns if c or r == "user"],
            tools=None, documents=None, add_generation_prompt=not answer,
            **self.tok_config["special_tokens"])

    def end_of_turn(self) -> int:
        """The token ending an assistant turn in the chat template: the first stop id (else special
        token) after it."""
        # a template may not show the answer
        _, mark, after = self.chat("1+1?", "THE_ANSWER").rpartition("THE_ANSWER")
        ids = self.tok.encode(after, add_special_tokens=False).ids if mark else []
        special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        fallback = next((i for i in ids if i in special), self.stop_ids[0])
        return next((i for i in ids if i in self.stop_ids), fallback)

    def prompt_text(self, p: Problem) -> str:  # exactly what prompt_ids tokenizes
        return self.template.format(question=p.prompt) if self.template else self.chat(p.prompt)

    def prompt_ids(self, p: Problem) -> list[int]:
        return self.tok.encode(self.prompt_text(p), add_special_tokens=self.add_bos).ids

    def target_ids(self, text: str) -> list[int]:
        """A supervised completion: its ids and the token that ends it (the chat template's end of
        turn)."""
        return self.tok.encode(text, add_special_tokens=False).ids + [self.end_id]

    def text(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
