"""model.py: cache vs full forward, padding, RoPE and GQA against direct formulas, HF folders, bad input."""
import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import model
from model import (KVCache, ModelConfig, Transformer, apply_rope, build_char_tokenizer, config_from_hf, config_to_hf,
                   load_tokenizer, read_config, rope_inv_freq)


def tiny(**kw):
    base = dict(vocab_size=23, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=48,
                max_seq_len=64)
    base.update(kw)
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**base)).eval()
    with torch.no_grad():  # random norms and biases, so a wrong layout cannot hide behind ones and zeros
        for n, p in m.named_parameters():
            if "norm" in n or "bias" in n:
                p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("kw", [{}, dict(model_type="qwen2", attention_bias=True, tie_embeddings=False)])
def test_cached_decoding_matches_full_forward(kw):
    m = tiny(**kw)
    idx = torch.randint(0, 23, (3, 20))
    with torch.no_grad():
        full = m(idx)
        cache = m.new_cache(3, 20)
        steps = [m(idx[:, :8], cache)] + [m(idx[:, t:t + 1], cache) for t in range(8, 20)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


def test_left_padded_batch_matches_each_prompt_alone():
    m = tiny()
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]
    S = max(map(len, prompts))
    idx = torch.tensor([[0] * (S - len(p)) + p for p in prompts])
    start = torch.tensor([S - len(p) for p in prompts])
    nxt = torch.randint(0, 23, (3, 5))  # then 5 decode steps, the same token per row
    with torch.no_grad():
        cache = m.new_cache(3, S + 5, start=start)
        batched = torch.cat([m(idx, cache)] + [m(nxt[:, t:t + 1], cache) for t in range(5)], 1)
        uncached = m(torch.cat([idx, nxt], 1), start=start)  # the training path: padding without a cache
        for b, p in enumerate(prompts):
            alone = m(torch.cat([torch.tensor([p]), nxt[b:b + 1]], 1))[0]
            got = batched[b, start[b]:]
            assert (got - alone).abs().max() < 1e-5
            assert (uncached[b, start[b]:] - alone).abs().max() < 1e-5
    assert torch.isfinite(batched).all()  # pad queries attend to themselves: no NaN anywhere


def test_cache_index_rows_shares_one_prefill():
    m = tiny()
    idx = torch.randint(0, 23, (2, 6))
    with torch.no_grad():
        c = m.new_cache(2, 10)
        m(idx, c)
        c = c.index_rows(torch.arange(2).repeat_interleave(3))  # G = 3 samples per prompt
        nxt = torch.randint(0, 23, (6, 1))
        out = m(nxt, c)[:, -1]
        ref = m(torch.cat([idx.repeat_interleave(3, 0), nxt], 1))[:, -1]
        assert (out - ref).abs().max() < 1e-5
        sub = c.index_rows(torch.tensor([1, 4]))  # drop finished rows: the rest continue unchanged
        nxt2 = torch.randint(0, 23, (2, 1))
        ref2 = m(torch.cat([idx.repeat_interleave(3, 0)[[1, 4]], nxt[[1, 4]], nxt2], 1))[:, -1]
        assert (m(nxt2, sub)[:, -1] - ref2).abs().max() < 1e-5


def test_an_eager_cache_grows_in_doublings_and_gives_the_uncached_logits():
    """An eager decode attends over its cache's whole buffer (K/V read in place): index_rows keeps the filled
    slots in twice as many, and a step that needs more doubles it, up to max_len."""
    m, idx = tiny(), torch.randint(0, 23, (3, 40))
    with torch.no_grad():
        c = m.new_cache(3, 40)
        m(idx[:, :5], c)
        c = c.index_rows(torch.tensor([0, 2, 2]))
        assert c.k[0].shape[2] == 10 and c.v[1].shape[2] == 10
        got, sizes = [], []
        for t in range(5, 40):
            got.append(m(idx[[0, 2, 2], t:t + 1], c))
            sizes.append(c.k[0].shape[2])
        assert sizes == [10] * 5 + [20] * 10 + [40] * 20 and all(k.shape[2] == sizes[-1] for k in c.k + c.v)
        ref = m(idx[[0, 2, 2]])[:, 5:]
        assert (torch.cat(got, 1) - ref).abs().max() < 1e-5


def test_rope_matches_direct_formula():
    cfg = ModelConfig(hidden_size=16, n_heads=2, n_kv_heads=2, rope_theta=100.0)
    D = cfg.head_dim
    x = torch.randn(1, 1, 5, D)
    out = torch.empty_like(x)
    for p in range(5):  # rotate each pair (x_i, x_{i+D/2}) by angle p * base^(-2i/D), written out by hand
        for i in range(D // 2):
            a = p * cfg.rope_theta ** (-2 * i / D)
            x1, x2 = x[0, 0, p, i].item(), x[0, 0, p, i + D // 2].item()
            out[0, 0, p, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[0, 0, p, i + D // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    ang = torch.arange(5).float()[:, None] * rope_inv_freq(cfg, None)
    ang = torch.cat((ang, ang), -1)[None, None]
    assert (apply_rope(x, ang.cos(), ang.sin()) - out).abs().max() < 1e-5


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_gqa_attention_matches_naive_per_head_loop(kv):
    m = tiny(n_kv_heads=kv)
    attn, cfg = m.model.layers[0].self_attn, m.config
    x = torch.randn(2, 7, 32)
    H, D, T = cfg.n_heads, cfg.head_dim, 7
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, D, 2).float() / D)
    ang = torch.arange(T).float()[:, None] * inv
    ang = torch.cat((ang, ang), -1)[None, None]
    with torch.no_grad():
        got = attn(x, ang.cos(), ang.sin(), None, None, 0)
        q = attn.q_proj(x).view(2, T, H, D).transpose(1, 2)
        k = attn.k_proj(x).view(2, T, kv, D).transpose(1, 2)
        v = attn.v_proj(x).view(2, T, kv, D).transpose(1, 2)
        q, k = apply_rope(q, ang.cos(), ang.sin()), apply_rope(k, ang.cos(), ang.sin())
        heads = []
        for h in range(H):  # query head h reads K/V head h // (H / H_kv)
            g = h // (H // kv)
            s = q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(D)
            s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
            heads.append(s.softmax(-1) @ v[:, g])
        ref = attn.o_proj(torch.stack(heads, 2).reshape(2, T, H * D))
    assert (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize("kw", [{}, dict(model_type="qwen2", attention_bias=True, tie_embeddings=False, n_kv_heads=1)])
def test_save_load_round_trip_is_bit_exact(tmp_path, kw):
    m = tiny(**kw)
    tok = build_char_tokenizer("0123456789+-=")
    m.save_pretrained(tmp_path / "a", tokenizer=tok)
    m2 = Transformer.from_pretrained(tmp_path / "a")
    assert m2.config == m.config
    for (k, a), (k2, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    names = set(load_file(tmp_path / "a" / "model.safetensors"))
    assert "model.layers.1.self_attn.q_proj.weight" in names and "model.norm.weight" in names
    assert ("lm_head.weight" in names) == (not m.config.tie_embeddings)
    m2.save_pretrained(tmp_path / "b")  # a reloaded model carries its tokenizer along
    assert load_tokenizer(tmp_path / "b").encode("12+3=").ids == tok.encode("12+3=").ids
    assert Transformer.from_pretrained(tmp_path / "b").config == m.config


def test_sharded_checkpoint_and_bf16(tmp_path):
    m = tiny()
    m.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    os.remove(tmp_path / "model.safetensors")
    keys = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, ks in parts.items():
        save_file({k: sd[k] for k in ks}, tmp_path / fname)
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {k: fn for fn, ks in parts.items() for k in ks}}, f)
    m2 = Transformer.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert m2.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(m2.model.embed_tokens.weight, m.model.embed_tokens.weight.bfloat16())


def test_char_tokenizer_round_trip():
    tok = build_char_tokenizer("0123456789+-*=;# ")
    s = "8-18=-10;-10+13=3 #### 3"
    ids = tok.encode(s).ids
    assert ids[0] == 1 and len(ids) == len(s) + 1 and tok.decode(ids) == s  # <bos> first, skipped on decode
    assert tok.token_to_id("<pad>") == 0 and tok.token_to_id("<eos>") == 2
    assert tok.encode("1").ids == [1, 4] and tok.encode("1", add_special_tokens=False).ids == [4]
    assert tok.decode([4, 2], skip_special_tokens=False) == "1<eos>"


def _broken(tmp_path, edit_config=None, edit_tensors=None):
    m = tiny()
    m.save_pretrained(tmp_path)
    if edit_config:
        d = json.load(open(tmp_path / "config.json"))
        edit_config(d)
        json.dump(d, open(tmp_path / "config.json", "w"))
    if edit_tensors:
        sd = load_file(tmp_path / "model.safetensors")
        edit_tensors(sd)
        save_file(sd, tmp_path / "model.safetensors")
    return tmp_path


def test_bad_inputs_name_the_culprit(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Transformer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(KeyError, match="num_hidden_layers"):
        read_config(_broken(tmp_path / "a", edit_config=lambda d: d.pop("num_hidden_layers")))
    with pytest.raises(ValueError, match="gpt2"):
        read_config(_broken(tmp_path / "b", edit_config=lambda d: d.update(model_type="gpt2")))
    with pytest.raises(ValueError, match="yarn"):
        read_config(_broken(tmp_path / "b2", edit_config=lambda d: d.update(rope_scaling={"rope_type": "yarn"})))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        Transformer.from_pretrained(_broken(tmp_path / "c", edit_tensors=lambda sd: sd.pop(
            "model.layers.1.mlp.up_proj.weight")))
    with pytest.raises(KeyError, match="model.layers.0.extra.weight"):
        Transformer.from_pretrained(_broken(tmp_path / "d", edit_tensors=lambda sd: sd.update(
            {"model.layers.0.extra.weight": torch.zeros(2)})))
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(31,\)"):
        Transformer.from_pretrained(_broken(tmp_path / "e", edit_tensors=lambda sd: sd.update(
            {"model.norm.weight": torch.zeros(31)})))
    os.remove(tmp_path / "e" / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Transformer.from_pretrained(tmp_path / "e")
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny()(torch.zeros(1, 65, dtype=torch.long))


def test_matches_transformers_when_installed(tmp_path):
    tr = pytest.importorskip("transformers")
    for i, cfg in enumerate([
        tr.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True),
        tr.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)]):
        torch.manual_seed(i)
        hf = tr.AutoModelForCausalLM.from_config(cfg).eval()
        hf.save_pretrained(tmp_path / f"hf{i}")
        ours = Transformer.from_pretrained(tmp_path / f"hf{i}")
        idx = torch.randint(0, 50, (2, 30))
        with torch.no_grad():
            ref = hf(idx).logits
            assert (ours(idx) - ref).abs().max() < 1e-4
            ours.save_pretrained(tmp_path / f"ours{i}")
            back = tr.AutoModelForCausalLM.from_pretrained(tmp_path / f"ours{i}").eval()
            assert (back(idx).logits - ref).abs().max() < 1e-4


def test_kv_cache_is_not_a_module_buffer():
    m = tiny()
    assert not list(m.buffers())
    assert isinstance(m.new_cache(2, 8), KVCache)


def holders(m):  # a block's products: q, k and v stacked (its Attention), o, gate and up stacked (its MLP), down
    head = m.model.embed_tokens if m.lm_head is None else m.lm_head
    return [x for b in m.model.layers for x in (b.self_attn, b.self_attn.o_proj, b.mlp, b.mlp.down_proj)] + [head]


def packs(m):  # each product's packed weight or None (holders); none of the stacked parts holds one of its own
    parts = [p for b in m.model.layers for p in b.self_attn.parts() + b.mlp.parts()]
    assert all("packed" not in vars(p) for p in parts)
    return [vars(x).get("packed") for x in holders(m)]


def cached_logits(m, idx):  # a prefill of 6 tokens, then one token a step
    cache = m.new_cache(len(idx), idx.shape[1])
    return torch.cat([m(idx[:, :6], cache)] + [m(idx[:, t:t + 1], cache) for t in range(6, idx.shape[1])], 1)


@pytest.mark.skipif(not model.PACKED_GEMM, reason="oneDNN's packed GEMM: x86 CPUs")
@pytest.mark.parametrize("kw", [{}, dict(model_type="qwen2", attention_bias=True, tie_embeddings=False)])
def test_packed_weights_give_the_plain_logits_and_leave_nothing_behind(kw, monkeypatch, linear_calls):
    m, idx = tiny(**kw), torch.randint(0, 23, (5, 16))
    with torch.no_grad():
        want = cached_logits(m, idx)
        with m.packed():
            assert all(p is not None for p in packs(m))  # every product, the head too, is packed ...
            n = len(linear_calls)
            got = cached_logits(m, idx)
            seen = linear_calls[n:]
            assert len(seen) == 11 * 9 and all(seen)  # ... and multiplies so: 11 forwards x 9 products
            one = m(idx[:2])  # the packed products are the same in any batch: row by row, bit for bit
            assert torch.equal(one[:1], m(idx[:1])) and torch.equal(one[1:], m(idx[1:2]))
        assert (got - want).abs().max() < 1e-5
        assert packs(m) == [None] * len(packs(m))
        m.model.layers[0].mlp.down_proj.weight.mul_(-2)  # the next call packs the weights it finds
        with m.packed():
            got = cached_logits(m, idx)
        assert (got - cached_logits(m, idx)).abs().max() < 1e-5 and (got - want).abs().max() > 1e-3
    with pytest.raises(KeyError), m.packed():  # an error inside: nothing left packed
        raise KeyError
    assert packs(m) == [None] * len(packs(m))
    with m.packed():  # with autograd the plain products run: the same gradients
        m(idx).logsumexp(-1).sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(idx).logsumexp(-1).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, m.parameters()))
    m64 = tiny(**kw).double()
    with m64.packed():  # float64 (the tests' exact checks): nothing packed
        assert packs(m64) == [None] * len(packs(m64))
    monkeypatch.setattr(model, "PACK_FROM", 1537)  # q, k, v stacked (64 x 32) and gate, up (96 x 32); not o, down
    with m.packed():
        sizes = [sum(p.weight.numel() for p in x.parts()) if hasattr(x, "parts") else x.weight.numel()
                 for x in holders(m)]
        assert [p is not None for p in packs(m)] == [n >= 1537 for n in sizes] and sorted(sizes)[:2] == [736, 1024]


@pytest.mark.skipif(torch.bfloat16 not in model.PACKED_DTYPES, reason="oneDNN multiplies bf16 natively: AVX512-BF16")
def test_packed_bf16_weights_give_the_plain_bf16_logits_bit_for_bit(monkeypatch, linear_calls):
    """cpu_bf16's sampling copy (bf16 weights) packs where oneDNN multiplies bf16 natively: every product runs on the
    packed weight and the cached logits are F.linear's bit for bit; where it does not (PACKED_DTYPES float32 only),
    nothing is packed."""
    m, idx = tiny().to(torch.bfloat16), torch.randint(0, 23, (5, 16))
    with torch.no_grad():
        want = cached_logits(m, idx)
        with m.packed():
            assert all(p is not None and p.dtype == torch.bfloat16 for p in packs(m))
            n = len(linear_calls)
            got = cached_logits(m, idx)
            assert len(linear_calls) - n == 11 * 9 and all(linear_calls[n:])
        assert torch.equal(got, want) and packs(m) == [None] * len(packs(m))
        monkeypatch.setattr(model, "PACKED_DTYPES", {torch.float32})
        with m.packed():
            assert packs(m) == [None] * len(packs(m))


# the config.json of Qwen2.5-0.5B-Instruct and of Llama-3.2-1B-Instruct as the Hub ships them
QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
          "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
          "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
          "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
          "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
          "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
LLAMA32 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
           "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
           "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
           "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {
               "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "rope_type": "llama3",
               "original_max_position_embeddings": 8192}, "rope_theta": 500000.0, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}


def test_real_config_keys_accepted_unless_they_change_the_maths():
    q = config_from_hf(QWEN25, "qwen")
    assert (q.n_layers, q.n_heads, q.n_kv_heads, q.head_dim, q.vocab_size, q.attention_bias) == (
        24, 14, 2, 64, 151936, True)
    assert config_to_hf(q, torch.bfloat16)["eos_token_id"] == 151645  # the harmless keys are written back
    ll = config_from_hf(LLAMA32, "llama")
    assert (ll.head_dim, ll.rope_theta, ll.rope_scaling["rope_type"], ll.tie_embeddings) == (64, 5e5, "llama3", True)
    ok = [{**QWEN25, "use_sliding_window": True, "max_window_layers": 24},  # no layer at or past max_window_layers
          {**QWEN25, "use_sliding_window": True, "sliding_window": 32768},  # the window covers every position
          {**QWEN25, "layer_types": ["full_attention"] * 24, "use_sliding_window": True, "sliding_window": 4096}]
    for d in ok:
        config_from_hf(d, "ok")
    bad = [({**QWEN25, "use_sliding_window": True, "sliding_window": 4096}, "sliding-window attention"),
           ({**QWEN25, "attention_dropout": 0.1}, "attention_dropout"),
           ({**LLAMA32, "quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
           ({**LLAMA32, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling"),
           ({**QWEN25, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope scaling")]
    for d, msg in bad:
        with pytest.raises(ValueError, match=f"^where: .*{msg}"):
            config_from_hf(d, "where")


def test_save_keeps_the_source_folders_files_and_dtype(hf_folder, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_folder("qwen", torch.bfloat16), src)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (src / "original").mkdir()  # Llama folders keep Meta's weights here: not a tokenizer file
    (src / "original" / "consolidated.00.pth").write_bytes(b"x" * 100)
    for name in ("README.md", "LICENSE", "vocab.json", "merges.txt", "pytorch_model.bin"):
        (src / name).write_text(name)
    m = Transformer.from_pretrained(src, dtype=torch.float32)
    assert m.model.norm.weight.dtype == torch.float32 and m.source_dtype == torch.bfloat16
    m.save_pretrained(tmp_path / "out")
    kept = ["LICENSE", "additional_chat_templates/tool_use.jinja", "chat_template.jinja", "generation_config.json",
            "merges.txt", "tokenizer.json", "tokenizer_config.json", "vocab.json"]
    written = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert written == sorted(kept + ["config.json", "model.safetensors"])
    assert all((tmp_path / "out" / n).read_bytes() == (src / n).read_bytes() for n in kept)  # byte for byte
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)  # bf16 -> f32 -> bf16 exact
    assert json.load(open(tmp_path / "out" / "config.json"))["torch_dtype"] == "bfloat16"
    m.save_pretrained(tmp_path / "f32", dtype=torch.float32)  # save_dtype overrides
    assert {t.dtype for t in load_file(tmp_path / "f32" / "model.safetensors").values()} == {torch.float32}
    assert json.load(open(tmp_path / "f32" / "config.json"))["dtype"] == "float32"


def test_char_folder_loads_in_transformers(tmp_path):
    tr = pytest.importorskip("transformers")
    tok = build_char_tokenizer("0123456789+-=")
    tiny().save_pretrained(tmp_path, tokenizer=tok)
    hf = tr.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token, hf.eos_token, hf.pad_token, hf.eos_token_id) == ("<bos>", "<eos>", "<pad>", 2)
    assert hf("12+3=")["input_ids"] == tok.encode("12+3=").ids == [1] + [tok.token_to_id(c) for c in "12+3="]
    assert tr.GenerationConfig.from_pretrained(tmp_path).eos_token_id == 2


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_attention_by_products_is_sdpa_and_sdpa_past_its_bound(heads, monkeypatch):
    """model.attention on CPU (two batched products, the trainer's Prefix attention) against SDPA in float64, values
    and gradients, with GQA and a random mask (every query sees at least itself); past PRODUCTS_UPTO scores it is
    SDPA's own call."""
    H, K = heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, 5, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (H, K, K))
    keep = (torch.rand(3, 1, 5, 5, generator=g) < 0.6) | torch.eye(5, dtype=torch.bool)
    bias = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    out = []
    for fn in (model.attention, lambda *a: F.scaled_dot_product_attention(*a, enable_gqa=K < H)):
        y = fn(q, k, v, bias)
        out.append((y, torch.autograd.grad((y * torch.arange(y.numel()).view(y.shape)).sum(), (q, k, v))))
    (y, grads), (want, want_grads) = out
    assert torch.allclose(y, want, atol=1e-12) and all(torch.allclose(a, b, atol=1e-11)
                                                        for a, b in zip(grads, want_grads))
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    model.attention(q, k, v, bias)
    assert not calls
    monkeypatch.setattr(model, "PRODUCTS_UPTO", 3 * H * 5 * 5 - 1)
    assert torch.equal(model.attention(q, k, v, bias), want) and calls == [1]
