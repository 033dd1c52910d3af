"""Tool calls inside a rollout: the policy writes a call, the tool's answer joins the row as
forced tokens.

The protocol (rollout.generate(tools=Toolbox), decode.record):
  1. The policy samples a call: the tool's open marker, the call's text, its close marker. The close
     marker is one token (a special token, or a character of a char-level vocabulary): decode.record
     flags a row that samples it (`called`), so the host needs no decoding to find calls.
  2. After each token the host (Session.answer) reads the flags. For each flagged row it takes the
     text between the row's last open marker and the close marker, calls the tool on it (its own
     tokens are decoded for the tool only: the row keeps them as sampled) and queues the result's
     tokens in the row's queue. The next steps feed them through the same decode step: not sampled,
     log-prob 0, policy mask 0 (Outputs.policy). Then sampling resumes. Other rows decode meanwhile.
  3. The result is wrapped as the prompt template shows tool output: plain templates "{result}"
     (result_open/result_close); template = "chat" as the checkpoint's chat template renders a
     tool message after an assistant turn (Qwen2.5: "<|im_end|>\\n<|im_start|>user\\n<tool_response>
     \\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"), so the row's tokens are
     exactly the conversation's. The wrapper's text is found by rendering once (chat_wrapper).
  4. Bounds: max_tool_calls answered calls a row (a call past them ends the row there: finish
     reason "tool_limit"; a close marker without an open one is plain text); a result's body is
     cut to max_tool_tokens tokens (the wrapper apart); max_new_tokens counts every token of the
     row, forced ones too (the row is what the trainer forwards). A demonstration (policy_mask)
     is read the same way up to the limit; its later calls are plain text.
The trainer scores the row in one forward (rollout.completion_logprobs) and counts only policy
tokens in every loss, normaliser, KL, TIS weight, entropy, OPD term and sampler-trainer gap
(train.rank_batch).

  python -m pytest -q tests/test_tooluse.py
"""
import json

import torch

import templates
import verify
from cli import UserError

MAX_CALL_CHARS = 1000  # a longer call is an error, unread (its expression: verify.MAX_EXPR)


class Tool:
    """What a fork subclasses: a name, the call markers the policy writes, call(text) -> str. call
    must be deterministic and bounded in time, and must never execute the text: an error is an
    answer too, a string starting with "error" (counted in tool_error_rate)."""
    name, open, close = "tool", "<tool_call>", "</tool_call>"

    def call(self, text: str) -> str:
        raise NotImplementedError


class Calculator(Tool):
    """Exact arithmetic: integers, + - * / ( ) with standard precedence, ≤ verify.MAX_EXPR
    characters (verify.eval_arith: rationals, no eval, no powers), so every call ends in
    microseconds. "12*34" -> "408", "7/3" -> "7/3"; a JSON call
    {"name": "calculator", "arguments": {"expression": "12*34"}} (a chat model's tool-call format)
    is read too. Anything else -> "error: ..."."""
    name = "calculator"

    def __init__(self, open="[", close="]"):
        self.open, self.close = open, close

    def call(self, text: str) -> str:
        text = text.strip()
        if len(text) > MAX_CALL_CHARS:
            return f"error: a call of more than {MAX_CALL_CHARS} characters"
        if text.startswith("{"):
            try:
                args = json.loads(text).get("arguments", {})
                text = str(args.get("expression", "")) if isinstance(args, dict) else ""
            except (ValueError, AttributeError):
                return "error: not JSON"
        value = verify.eval_arith(text)
        return "error: not arithmetic" if value is None else str(value)


TOOLS = {"calculator": Calculator}  # Config.tools names one; a fork registers its own here
CHARS = "[]{}?"  # added to a char-level vocabulary with tools: the markers, and "?" for an error
CHAT_MARKERS = ("<tool_call>", "</tool_call>")  # template = "chat": Qwen2.5's (its special tokens)


def toolbox(cfg, tok, tok_config: dict) -> "Toolbox | None":
    """The run's Toolbox (None with tools = ""): plain templates call in the tool's own markers and
    get "{result}"; template = "chat" calls in CHAT_MARKERS and gets the template's tool message."""
    if not cfg.tools:  # a name not in TOOLS: checks.py stops the run first
        return None
    if cfg.template != "chat":
        return Toolbox([TOOLS[cfg.tools]()], tok, cfg.max_tool_calls, cfg.max_tool_tokens)
    template = templates.chat_template(tok_config["chat_template"])

    def render(messages, generation_prompt):
        return template.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=generation_prompt,
                               **tok_config["special_tokens"])
    return Toolbox([TOOLS[cfg.tools](*CHAT_MARKERS)], tok, cfg.max_tool_calls, cfg.max_tool_tokens,
                   wrapper=chat_wrapper(render))


def chat_wrapper(render) -> tuple[str, str]:
    """(before, after): the text a chat template adds around a tool message's content when it
    follows an assistant turn, with the generation prompt for the next one.
    render(messages, add_generation_prompt) -> str. The template must be append-only there, else
    UserError."""
    call, result = "\x00CALL\x00", "\x00RESULT\x00"
    turns = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": call}]
    head = render(turns, False)
    full = render(turns + [{"role": "tool", "content": result}], True)
    head = head[:head.index(call) + len(call)]
    if not full.startswith(head) or result not in full[len(head):]:
        raise UserError("tools with template = 'chat': the chat template does not render a tool "
                        "message after an assistant turn append-only (no 'tool' role?); "
                        "use a template that does")
    before, _, after = full[len(head):].partition(result)
    return before, after


class Toolbox:
    """A run's tools and how their results become tokens. tok: a tokenizers.Tokenizer; wrapper:
    (before, after) around a result (chat_wrapper for chat checkpoints); None: each tool's plain
    result markers."""

    def __init__(self, tools: list[Tool], tok, max_calls: int, max_tokens: int, wrapper=None,
                 result_open="{", result_close="}"):
        self.tools, self.tok, self.max_calls, self.max_tokens = tools, tok, max_calls, max_tokens
        before, after = wrapper or (result_open, result_close)
        self.wrap = self.ids(before), self.ids(after)
        self.marks = {}  # close-marker id -> (tool, open-marker ids)
        for t in tools:
            close = self.ids(t.close)
            if len(close) != 1:
                raise UserError(f"tool {t.name!r}: its close marker {t.close!r} is {len(close)} "
                                "tokens in this tokenizer; it must be one "
                                "(a special token or a character)")
            self.marks[close[0]] = (t, self.ids(t.open))

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def result_ids(self, result: str) -> tuple[list[int], bool]:
        """A result's forced tokens (the wrapper around its body cut to max_tokens), whether cut. A
        result the tokenizer cannot spell (an error's letters in a char vocabulary) becomes "?"."""
        before, after = self.wrap
        try:
            body = self.ids(result)
        except Exception:
            # tokenizers raises a bare Exception for a character outside a WordLevel vocab
            body = self.ids("?")
        return before + body[:self.max_tokens] + after, len(body) > self.max_tokens

    def call_start(self, ids: list[int]) -> int | None:
        """A row's tokens ending in a close marker -> where the call's text starts (after the last
        open marker since the previous close); None: no open marker there (plain text)."""
        open_ids = self.marks[ids[-1]][1]
        k = len(open_ids)
        for start in range(len(ids) - 1, k - 1, -1):
            if ids[start - k:start] == open_ids:
                return start
            if ids[start - 1] == ids[-1]:
                return None  # the previous call's end: no open marker since
        return None

    def answer(self, ids: list[int]) -> tuple[list[int], bool, bool] | None:
        """A row's tokens ending in a close marker -> (forced tokens, error, cut), or None
        (no call)."""
        start = self.call_start(ids)
        if start is None:
            return None
        text = self.tok.decode(ids[start:-1], skip_special_tokens=False)  # for the tool only
        result = self.marks[ids[-1]][0].call(text)
        forced, cut = self.result_ids(result)
        return forced, result.startswith("error"), cut

    def session(self, rows: int) -> "Session":
        return Session(self, rows)


class Session:
    """One generate call's tool state on the host: per output row, calls answered and errors."""

    def __init__(self, box: Toolbox, rows: int):
        self.box = box
        self.calls, self.errors, self.limited = [0] * rows, [0] * rows, [False] * rows

    def answer(self, d):
        """After a token: every row that has just sampled a close marker gets its result queued."""
        if not bool(d.called.any()):
            return
        t = int(d.t)  # the token just written is at t - 1
        for b in d.called.nonzero()[:, 0].tolist():
            r = int(d.rows[b])
            ids = d.out.ids[r, :t].tolist()
            if self.calls[r] >= self.box.max_calls:  # a call past the limit ends the row there
                if self.box.call_start(ids) is not None:
                    d.live[b], self.limited[r] = False, True
                continue
            got = self.box.answer(ids)
            if got is None:  # no open marker since the last call: plain text
                continue
            forced, error, _ = got
            self.calls[r], self.errors[r] = self.calls[r] + 1, self.errors[r] + error
            n = min(len(forced), d.queue.shape[1])
            d.queue[b, :n] = torch.tensor(forced[:n], device=d.queue.device)
            d.qpos[b], d.qlen[b] = 0, n

    def counts(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N] calls answered, of them errors, and whether a call past the limit ended the row."""
        return tuple(torch.tensor(x, dtype=dtype, device=device) for x, dtype in (
            (self.calls, torch.long), (self.errors, torch.long), (self.limited, torch.bool)))


def add_to_groups(groups: list, ro, G: int):
    """Each sample's policy mask (False on a result's forced tokens) and (calls, errors) from
    generate's Rollout into this rank's train.Group list
    (group a: rows a·G, ..., a·G + G − 1)."""
    mask, policy = ro.completion_mask.cpu(), ro.policy_mask.cpu()
    calls = torch.stack((ro.tool_calls, ro.tool_errors), 1).tolist()
    for a, g in enumerate(groups):
        g.policy = [policy[r][mask[r]].tolist() for r in range(a * G, (a + 1) * G)]
        g.tools = calls[a * G:(a + 1) * G]


def policy_mask(box: Toolbox | None, ids: list[int]) -> list[bool]:
    """A written completion's (a demonstration's) policy tokens: False on the result after each call
    generate would answer (a close marker after an open one, calls left), from the result's wrapper
    to the end of the wrapper's closing part (or the row's end)."""
    mask = [True] * len(ids)
    if box is None:
        return mask
    (before, after), i, calls = box.wrap, 0, 0
    while i < len(ids):
        if (ids[i] in box.marks and calls < box.max_calls
                and box.call_start(ids[:i + 1]) is not None):
            ends = (j + len(after) for j in range(i + 1, len(ids))
                    if ids[j:j + len(after)] == after)
            end = min(next(ends, len(ids)), i + 1 + len(before) + box.max_tokens + len(after))
            mask[i + 1:end] = [False] * (end - i - 1)
            i, calls = end, calls + 1
        else:
            i += 1
    return mask


def metrics(groups, prefix: str) -> dict:
    """Tool use over groups' samples (train.Group: tools = (calls, errors) per sample): calls per
    completion, errors per call, the share of correct answers that called, the accuracy with and
    without a call, the share of row tokens forced. {} when no group ran with tools."""
    rows = [(c, e, s, p) for g in groups if g.tools
            for (c, e), s, p in zip(g.tools, g.scores, g.policy)]
    if not rows:
        return {}
    called, correct = [r for r in rows if r[0]], [r for r in rows if r[2] >= 1]
    plain, n_calls = [r for r in rows if not r[0]], sum(r[0] for r in rows)
    return {f"{prefix}tool_calls": n_calls / len(rows),
            f"{prefix}tool_call_rate": len(called) / len(rows),
            f"{prefix}tool_error_rate": sum(r[1] for r in rows) / max(1, n_calls),
            f"{prefix}tool_share_of_correct": sum(1 for r in correct if r[0])
            / max(1, len(correct)),
            f"{prefix}tool_accuracy_with": sum(r[2] for r in called) / max(1, len(called)),
            f"{prefix}tool_accuracy_without": sum(r[2] for r in plain) / max(1, len(plain)),
            f"{prefix}tool_forced_frac": sum(len(r[3]) - sum(r[3]) for r in rows)
            / max(1, sum(len(r[3]) for r in rows))}
