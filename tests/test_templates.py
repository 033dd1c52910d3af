"""templates.py: the prompt templates, and chat templates rendered in transformers' jinja2 environment (checked
against transformers' own renderer when it is installed); tokenizer_config.json read as transformers reads it."""
import json
from datetime import datetime

import pytest

from model import build_char_tokenizer
from tasks import CHARS, Task
from templates import chat_template, read_tokenizer_config, render_prompt


def test_render_prompt():
    question = "What is {x} + 1?"
    assert render_prompt(question) == question
    assert render_prompt(question, "plain") == question
    r1 = render_prompt(question, "r1")
    assert question in r1 and "<think>" in r1 and "</answer>" in r1 and r1.endswith("Assistant:")
    assert r1.index("<think>") < r1.index("<answer>") < r1.index(question)
    boxed = render_prompt(question, "boxed")
    assert boxed.startswith(question) and "\\boxed{}" in boxed
    with pytest.raises(ValueError, match="plain.*r1.*boxed"):
        render_prompt(question, "chatml")


# trim_blocks, lstrip_blocks, loop controls, tojson without escaping, {% generation %}, strftime_now, tools None
ENV_TEMPLATE = ("{% for m in messages %}\n    {% if loop.index > 2 %}{% break %}{% endif %}\n"
                "{{ m.role }}: {{ m.content | tojson }}\n{% endfor %}\n"
                "{% generation %}{{ bos_token }}{% endgeneration %}{% if add_generation_prompt %}GEN{% endif %}"
                "{% if tools is none and documents is none %}|none{% endif %}|{{ strftime_now('%Y') }}")


def test_chat_template_environment_is_transformers(tmp_path):
    import train
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": ENV_TEMPLATE, "bos_token": "<bos>"}))
    task = Task(train.Config(template="chat", system_prompt="Sé <b>&"), build_char_tokenizer(CHARS), [2],
                read_tokenizer_config(tmp_path))
    year = datetime.now().year
    assert task.chat("q?") == f'system: "Sé <b>&"\nuser: "q?"\n<bos>GEN|none|{year}'
    assert task.chat("q?", "a") == f'system: "Sé <b>&"\nuser: "q?"\n<bos>|none|{year}'  # the 3rd message: break
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        return
    messages = [{"role": "system", "content": "Sé <b>&"}, {"role": "user", "content": "q?"}]
    assert render_jinja_template([messages], chat_template=ENV_TEMPLATE, add_generation_prompt=True,
                                 bos_token="<bos>")[0][0] == task.chat("q?")
    import jinja2
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        chat_template("{{ raise_exception('no ' + messages[0]['role'] + ' role') }}").render(
            messages=[{"role": "system"}])


def test_read_tokenizer_config_as_transformers_reads_it(tmp_path):
    def folder(name, **files):
        (tmp_path / name).mkdir()
        for fname, d in files.items():
            (tmp_path / name / fname.replace("_json", ".json").replace("_jinja", ".jinja")).write_text(
                d if isinstance(d, str) else json.dumps(d))
        return read_tokenizer_config(tmp_path / name)
    added = {"bos_token": {"__type": "AddedToken", "content": "<s>", "special": True}, "unk_token": None,
             "eos_token": "</s>", "added_tokens_decoder": {}}
    a = folder("a", tokenizer_config_json={**added, "chat_template": "key"}, chat_template_jinja="file",
               special_tokens_map_json={"eos_token": "<ignored>"}, generation_config_json={"eos_token_id": 7})
    assert a["chat_template"] == "file" and a["eos_ids"] == [7]  # the .jinja file wins over the key
    assert a["special_tokens"] == {"bos_token": "<s>", "eos_token": "</s>"}  # no added_tokens_decoder: map ignored
    b = folder("b", tokenizer_config_json={"eos_token": "</s>", "chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]},
        special_tokens_map_json={"eos_token": "<|eot|>", "pad_token": "<pad>"}, generation_config_json={
        "eos_token_id": [3, 1]})
    assert b["chat_template"] == "D" and b["eos_ids"] == [3, 1]  # the older list of named templates: its default
    assert b["special_tokens"] == {"eos_token": "<|eot|>", "pad_token": "<pad>"}  # legacy map overrides
    c = folder("c")
    assert c["eos_ids"] == [] and c["special_tokens"] == {} and c.get("chat_template") is None
