"""Prompt templates: plain / r1 / boxed wrappers of a question, and a checkpoint's own
chat template.

1. render_prompt(question, template): TEMPLATES["plain"] is the question unchanged; "r1" asks for
   DeepSeek-R1-Zero's <think></think> then <answer></answer>; "boxed" for a final \\boxed{} answer.
2. read_tokenizer_config(folder): tokenizer_config.json, special_tokens_map.json,
   chat_template.jinja and generation_config.json's eos_token_id, merged the way transformers merges
   them; stop_ids(tok, info) the ids that end a completion (train.py's and rollout.py's).
3. chat_template(source): the jinja2 environment transformers' apply_chat_template renders a
   template in (sandboxed, trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now,
   tojson), so tasks.Task.chat gives the exact text transformers gives. jinja2 is imported only when
   a chat template is used.

Tests: python -m pytest -q tests/test_templates.py
"""
import functools
import json
import re
from datetime import datetime
from pathlib import Path


TEMPLATES = {
    "plain": "{question}",
    # DeepSeek-R1-Zero style: reasoning in <think></think>, the final answer in <answer></answer>
    "r1": ("A conversation between User and Assistant. The User asks a question and the Assistant "
           "solves it. The Assistant first thinks through the reasoning process and then gives the "
           "User the answer. The reasoning process is enclosed in <think> </think> tags and the "
           "answer in <answer> </answer> tags, "
           "i.e. <think> reasoning process here </think> <answer> answer here </answer>.\n"
           "User: {question}\nAssistant:"),
    "boxed": ("{question}\n"
              "Please reason step by step, and put your final answer within \\boxed{{}}."),
}


def render_prompt(question: str, template: str = "plain") -> str:
    """The question wrapped in a template: plain (unchanged), r1 (<think>/<answer> tags) or boxed
    (\\boxed{})."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; valid: {', '.join(TEMPLATES)}")
    return TEMPLATES[template].format(question=question)


def read_tokenizer_config(folder) -> dict:
    """tokenizer_config.json as transformers reads it (chat_template.jinja wins over its key) plus
    "special_tokens" ({"bos_token": "<s>", ...}), "eos_ids" (generation_config.json's eos_token_id,
    int or list), "name_or_path"."""
    tc, tmap, gen = (json.loads(p.read_text("utf-8")) if (p := Path(folder, name)).is_file() else {}
                     for name in ("tokenizer_config.json", "special_tokens_map.json",
                                  "generation_config.json"))
    d = {**tc, **({} if "added_tokens_decoder" in tc else tmap), "name_or_path": str(folder)}
    if (jinja := Path(folder, "chat_template.jinja")).is_file():
        d["chat_template"] = jinja.read_text("utf-8")
    # the older list of named templates: transformers takes "default"
    if isinstance(t := d.get("chat_template"), list):
        d["chat_template"] = {x["name"]: x["template"] for x in t}.get("default")
    d["special_tokens"] = {k: v["content"] if isinstance(v, dict) else v
                           # transformers' SPECIAL_TOKENS_ATTRIBUTES
                           for k in [f"{n}_token" for n in "bos eos unk sep pad cls mask".split()]
                           if (v := d.get(k))}
    eos = gen.get("eos_token_id")
    return {**d, "eos_ids": [eos] if isinstance(eos, int) else list(eos or [])}


def stop_ids(tok, info: dict, names=()) -> list[int]:
    """The ids that end a completion: the folder's eos_token and generation_config's eos_token_id
    (info from read_tokenizer_config); where it names neither (our char-level folders), the tokens
    spelled as one of names."""
    eos = ([tok.token_to_id(info["special_tokens"].get("eos_token", "")), *info["eos_ids"]]
           if info else [])
    eos = [i for i in eos if i is not None] or [tok.token_to_id(t) for t in names]
    return [i for i in dict.fromkeys(eos) if i is not None]


@functools.lru_cache(maxsize=8)
def chat_template(source: str):
    """A jinja2 chat template set up as transformers' apply_chat_template sets it up: sandboxed,
    trim_blocks and lstrip_blocks, loop controls, raise_exception, strftime_now, tojson.
    transformers renders it with messages, tools=None, documents=None, add_generation_prompt and the
    tokenizer's special tokens as variables."""
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = (
        lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False:
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                   sort_keys=sort_keys))
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    # transformers' {% generation %} tag only records where assistant text is: a block tag that
    # renders its body
    return env.from_string(re.sub(r"(\{%-?\s*)(end)?generation(\s*-?%\})",
                                  lambda m: m[1] + ("endif" if m[2] else "if true") + m[3], source))
