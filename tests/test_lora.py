"""lora.py and LoRA runs of train.py: B = 0 is the base exactly, gradients reach A and B only, the
adapter's forward is the merged weights' forward, the sampler is on the adapted policy after every
optimizer step (and the probe fails when one merge is skipped), 2 ranks = 1, exact resume, PEFT's
format (and its own loader, when peft is installed)."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import checks
import cli
import infra
import lora
import tasks
import train
from model import ModelConfig, Transformer
from test_train import SMOKE, deterministic, one_and_two_ranks, records, run_cli

CFG = ModelConfig(vocab_size=40, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  intermediate_size=48, max_seq_len=32, attention_bias=True)
# a LoRA run whose gradients are not 0: length shaping gives every group reward spread
RUN = ["--config", SMOKE, "--lora_rank=4", "--lr=3e-2", "--sft_lr=3e-2", "--overlong_buffer=20",
       "--dynamic_sampling=false", "--eval_n=8"]


def tiny(seed=0):
    torch.manual_seed(seed)
    return Transformer(CFG)


def ids(seed=1):
    return torch.randint(0, CFG.vocab_size, (3, 9), generator=torch.Generator().manual_seed(seed))


def test_zero_B_is_the_base_model_exactly_and_only_A_and_B_train():
    model, x = tiny(), ids()
    base = model(x)
    lora.wrap(model, rank=4, alpha=8.0)
    assert len(lora.adapters(model)) == 2 * 7  # every linear layer of both blocks
    assert torch.equal(model(x), base)
    model(x).logsumexp(-1).sum().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained == {n for n, _ in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    assert all(p.requires_grad == n.endswith(("lora_A", "lora_B")) for n, p in model.named_parameters())


def test_the_adapters_forward_is_the_merged_weights_forward():
    model, x = lora.wrap(tiny(), rank=3, alpha=6.0, targets="q_proj,down_proj"), ids()
    with torch.no_grad():
        for m in lora.adapters(model).values():
            m.lora_B.normal_(0, 0.3)
    plain = tiny(seed=5)  # other weights: the merge must overwrite all of them
    plain.load_state_dict(dict(lora.merged_parameters(model)), strict=True)
    want = model(x)
    assert (want - plain(x)).abs().max() < 1e-5
    assert (want - tiny()(x)).abs().max() > 1e-2  # the adapters changed the model
    copy = infra.frozen_copy(model, torch.device("cpu"))  # the sampling copy's path (refresh)
    assert torch.equal(copy(x), plain(x))


def test_targets_are_checked():
    with pytest.raises(ValueError, match="lora_targets 'q,lm_head'"):
        lora.parse_targets("q,lm_head")
    with pytest.raises(cli.UserError, match="lora_targets = 'q_proj,embed' must be 'all' or"):
        train.main(train.parse_args(RUN + ["--lora_targets=q_proj,embed"]))


def test_targets_written_with_spaces_wrap_the_same_layers_and_a_misspelled_one_is_an_error():
    want = [f"model.layers.{i}.self_attn.{t}" for i in range(CFG.n_layers) for t in ("q_proj", "v_proj")]
    for targets in ("q_proj,v_proj", "q_proj, v_proj", " q_proj ,  v_proj "):
        model = lora.wrap(tiny(), rank=2, alpha=4.0, targets=targets)
        assert list(lora.adapters(model)) == want, targets  # 2 layers of 2 blocks, nothing else
        assert model.lora["targets"] == ["q_proj", "v_proj"]
        checks.check_settings(train.parse_args(RUN + [f"--lora_targets={targets}"]))  # accepted
    for targets in ("q_proj, v_prj", "q_proj,,v_proj", "q_proj, "):
        with pytest.raises(ValueError, match="lora_targets"):
            lora.wrap(tiny(), rank=2, alpha=4.0, targets=targets)
        with pytest.raises(cli.UserError, match="must be 'all' or a comma list"):
            checks.check_settings(train.parse_args(RUN + [f"--lora_targets={targets}"]))


def test_non_zero_biases_stay_in_the_adapted_forward_the_merge_and_the_sampling_copy():
    """Qwen2's q/k/v biases (every other test model's biases are 0): the wrapped forward is the forward of
    W + (α/r)·B A with the same biases, built here by hand, and the sampling copy carries the biases."""
    model, x = tiny(), ids()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    biases = {n: p for n, p in before.items() if n.endswith(".bias")}
    assert len(biases) == 3 * CFG.n_layers and all(b.abs().min() > 0 for b in biases.values())
    lora.wrap(model, rank=4, alpha=12.0)
    with torch.no_grad():
        for m in lora.adapters(model).values():
            m.lora_B.normal_(0, 0.3)
    layers, state = lora.adapters(model), {}
    for name, w in before.items():
        module, _, leaf = name.rpartition(".")
        adapted = module in layers and leaf == "weight"
        state[name] = w + 3.0 * layers[module].lora_B.detach() @ layers[module].lora_A.detach() if adapted else w
    plain = tiny(seed=5)
    plain.load_state_dict(state, strict=True)
    no_bias = tiny(seed=5)
    no_bias.load_state_dict({n: torch.zeros_like(w) if n in biases else w for n, w in state.items()})
    want = plain(x)
    assert (want - no_bias(x)).abs().max() > 1e-2  # the biases matter to the logits
    assert (model(x) - want).abs().max() < 1e-5
    merged = dict(lora.merged_parameters(model))
    assert all(torch.equal(merged[n], b) for n, b in biases.items())
    copy = infra.frozen_copy(model, torch.device("cpu"))  # infra.refresh: the sampling copy's path
    got = dict(copy.named_parameters())
    assert all(torch.equal(got[n], b) for n, b in biases.items())
    assert (copy(x) - want).abs().max() < 1e-5


@pytest.mark.parametrize("saved_rank", [8, 1])  # 1: [1, in] and [out, 1] would broadcast into rank 4 silently
def test_an_adapter_of_another_rank_is_an_error_naming_the_tensor(tmp_path, saved_rank):
    src = lora.wrap(tiny(), rank=saved_rank, alpha=8.0)
    with torch.no_grad():
        for m in lora.adapters(src).values():
            m.lora_B.normal_(0, 0.3)
    lora.save_adapter(str(tmp_path / lora.ADAPTER_DIR), src, lora.adapter_state(src), "")
    with pytest.raises(ValueError, match=rf"adapter_config\.json: r = {saved_rank}, but this run's is 4"):
        lora.wrap(tiny(), rank=4, alpha=8.0, adapter=str(tmp_path))
    config = tmp_path / lora.ADAPTER_DIR / "adapter_config.json"  # a config that lies: the shapes still decide
    config.write_text(config.read_text().replace(f'"r": {saved_rank},', '"r": 4,'))
    with pytest.raises(KeyError, match=r"adapter_model\.safetensors: tensor "
                       r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' "
                       r"missing or not of shape \(4, 32\)"):
        lora.wrap(tiny(), rank=4, alpha=8.0, adapter=str(tmp_path))
    config.write_text(config.read_text().replace('"r": 4,', f'"r": {saved_rank},'))
    same = lora.wrap(tiny(), rank=saved_rank, alpha=8.0, adapter=str(tmp_path))  # its own rank: exact
    x = ids()
    assert torch.equal(same(x), src(x))


def test_an_adapter_of_another_alpha_or_other_targets_is_an_error(tmp_path):
    """A resume whose lora_alpha or lora_targets differ from the checkpoint's would load another model (a
    different scale, adapters dropped): an error naming the setting, not a silent load."""
    src = lora.wrap(tiny(), rank=4, alpha=8.0)  # all targets
    lora.save_adapter(str(tmp_path / lora.ADAPTER_DIR), src, lora.adapter_state(src), "")
    with pytest.raises(ValueError, match=r"lora_alpha = 8\.0, but this run's is 32\.0"):
        lora.wrap(tiny(), rank=4, alpha=32.0, adapter=str(tmp_path))
    with pytest.raises(ValueError, match=r"target_modules = \[.*\], but this run's is \['q_proj'\]"):
        lora.wrap(tiny(), rank=4, alpha=8.0, targets="q_proj", adapter=str(tmp_path))
    lora.wrap(tiny(), rank=4, alpha=8.0, adapter=str(tmp_path))  # the same settings load


def test_the_saved_adapter_config_lists_exactly_the_targets_used(tmp_path):
    """A run with lora_targets = ' down_proj, q_proj' (spaces, not the default): step_N/adapter/'s
    target_modules are those two names, and its tensors are on those layers only."""
    train.main(train.parse_args(RUN + ["--lora_targets= down_proj, q_proj", "--sft_steps=1", "--rl_steps=1",
                                       "--eval_n=4", f"--out_dir={tmp_path}"]))
    folder = tmp_path / "step_2" / lora.ADAPTER_DIR
    config = json.loads((folder / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj"]
    saved = load_file(folder / "adapter_model.safetensors")
    assert sorted(saved) == sorted(f"{lora.PEFT_PREFIX}model.layers.0.{block}.{t}.{m}.weight"
                                   for block, t in (("mlp", "down_proj"), ("self_attn", "q_proj"))
                                   for m in ("lora_A", "lora_B"))


def gaps(recs):  # |log π_old − log μ| per RL step: the trainer's vs the sampler's log-probs
    return [r["train/logprob_gap_max"] for r in recs if r["stage"] == "rl" and "train/loss" in r]


def test_the_sampler_is_on_the_adapted_policy_after_every_step(tmp_path, monkeypatch):
    """Each RL step's sampler log-probs (the merged sampling copy) equal the trainer's (the wrapped
    policy) to float tolerance, while the adapters move; skipping one merge is caught."""
    args = RUN + ["--rl_steps=4", "--ckpt_every=0"]
    train.main(train.parse_args(args + [f"--out_dir={tmp_path / 'ok'}"]))
    recs = records(tmp_path / "ok")
    assert all(r["train/grad_norm"] > 1e-3 for r in recs if r["stage"] == "rl" and "train/loss" in r)
    assert max(gaps(recs)) < 1e-4, gaps(recs)
    saved = load_file(tmp_path / "ok" / "step_10" / "adapter" / "adapter_model.safetensors")
    assert max(v.abs().max().item() for k, v in saved.items() if "lora_B" in k) > 1e-3
    refresh, calls = infra.refresh, []

    def skip_once(copy, model, lazy=False):  # the bug the trackers show: one refresh lost
        calls.append(lazy)
        if not lazy and calls.count(False) == 3:  # the second RL step's sampling
            copy.stale = False
            return
        refresh(copy, model, lazy)
    monkeypatch.setattr(infra, "refresh", skip_once)
    train.main(train.parse_args(args + [f"--out_dir={tmp_path / 'bug'}"]))
    assert max(gaps(records(tmp_path / "bug"))) > 1e-3


def test_checkpoint_is_the_merged_model_and_a_peft_adapter(tmp_path):
    train.main(train.parse_args(RUN + ["--rl_steps=2", f"--out_dir={tmp_path}"]))
    folder = tmp_path / "step_8"
    weights = load_file(folder / "model.safetensors")
    adapter = load_file(folder / lora.ADAPTER_DIR / "adapter_model.safetensors")
    assert not any("lora" in k for k in weights)
    config = json.loads((folder / lora.ADAPTER_DIR / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 32.0)
    assert sorted(config["target_modules"]) == sorted(lora.TARGETS)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert adapter[key].shape == (4, 32) and adapter[key].dtype == torch.float32
    # the folder's weights are W + (α/r)·B A over the base: the fresh model of seed 0 (LoRA trains
    # A and B in SFT too)
    torch.manual_seed(0)
    base = Transformer(ModelConfig(vocab_size=len(tasks.CHARS) + 3, hidden_size=32, n_layers=1,
                                   n_heads=2, n_kv_heads=1, intermediate_size=64, max_seq_len=64))
    for name, w in base.named_parameters():
        module, _, leaf = name.rpartition(".")
        if module.endswith(lora.TARGETS) and leaf == "weight":
            a_, b_ = (adapter[f"{lora.PEFT_PREFIX}{module}.{m}.weight"] for m in ("lora_A", "lora_B"))
            assert (weights[name] - (w + 8.0 * b_ @ a_)).abs().max() < 1e-6, name
        else:
            assert torch.equal(weights[name], w.detach()), name
    # transformers reads step_N/ as the plain merged model: the adapter (in adapter/) counts once
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.randint(0, len(tasks.CHARS) + 3, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(x).logits - Transformer.from_pretrained(folder).eval()(x)).abs().max() < 1e-5


def test_peft_loads_the_adapter_onto_the_base(tmp_path):
    """PEFT's own loader over transformers' model of the base folder gives our adapted logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base_dir, x = tmp_path / "base", ids()
    model = tiny()
    model.save_pretrained(base_dir)
    lora.wrap(model, rank=2, alpha=4.0)
    with torch.no_grad():
        for m in lora.adapters(model).values():
            m.lora_B.normal_(0, 0.2)
    os.makedirs(tmp_path / "adapter")
    lora.save_adapter(str(tmp_path / "adapter"), model, lora.adapter_state(model), str(base_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert (peft_model(x).logits - model(x)).abs().max() < 1e-4


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path):
    """2 gloo ranks (A and B sharded with their blocks by FSDP2) train what 1 rank does."""
    args = RUN + ["--sft_steps=4", "--rl_steps=4", "--ckpt_every=100", "--beta=0.05", "--lr=1e-3",
                  "--sft_lr=1e-3", "--ppo_epochs=2"]
    one_and_two_ranks(args, tmp_path)
    wa, wb = (load_file(tmp_path / d / "step_8" / "adapter" / "adapter_model.safetensors") for d in ("one", "two"))
    assert max(v.abs().max().item() for k, v in wa.items() if "lora_B" in k) > 1e-3  # B moved
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


@pytest.mark.slow
def test_a_resumed_lora_run_is_exact(tmp_path):
    """A run resumed from its step_6 checkpoint (the base rebuilt, the adapter and AdamW's state
    loaded) ends bit-identical to the uninterrupted one."""
    args = RUN + ["--sft_steps=4", "--rl_steps=4", "--ckpt_every=3", "--keep_ckpts=0", "--beta=0.05"]
    run_cli(args + [f"--out_dir={tmp_path / 'one'}"])  # both in a fresh process, as a user runs them
    one = records(tmp_path / "one")
    cut = tmp_path / "cut"  # the run as a kill after step 6 leaves it
    os.makedirs(cut)
    shutil.copytree(tmp_path / "one" / "step_6", cut / "step_6")
    shutil.copy(tmp_path / "one" / "metrics.jsonl", cut / "metrics.jsonl")
    run_cli(args + [f"--out_dir={cut}", "--resume"])
    assert deterministic(records(cut)) == deterministic(one)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = (load_file(d / "step_8" / name) for d in (tmp_path / "one", cut))
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_the_async_sampler_is_on_the_adapted_policy(tmp_path):
    """A sampler rank (async_rl, K = 0) receives the merged weights the trainer broadcasts: its
    log-probs equal the trainer's on every step while the adapters move."""
    run_cli(RUN + ["--sampler_ranks=1", "--rl_steps=4", f"--out_dir={tmp_path}"], nproc=2)
    recs = records(tmp_path)
    assert all(r["train/grad_norm"] > 1e-3 for r in recs if r["stage"] == "rl" and "train/loss" in r)
    assert len(gaps(recs)) == 4 and max(gaps(recs)) < 1e-4, gaps(recs)


def test_a_refresh_copies_the_frozen_tensors_once_and_the_merged_weights_every_time():
    """infra.refresh of a LoRA policy's sampling copy: the first copies everything; later ones only W + (α/r)·B A
    (the frozen embeddings, norms and head never change: before, every refresh gathered them again)."""
    model = lora.wrap(tiny(), rank=4, alpha=8.0)
    copy_ = infra.frozen_copy(model, torch.device("cpu"))
    assert copy_.frozen_copied
    with torch.no_grad():
        copy_.model.norm.weight.fill_(7.0)  # a frozen tensor, changed in the copy only
        for m in lora.adapters(model).values():
            m.lora_B.normal_(0, 0.3)
    infra.refresh(copy_, model)
    assert (copy_.model.norm.weight == 7.0).all()  # not copied again
    merged = dict(lora.merged_parameters(model))
    for name, p in copy_.named_parameters():
        if name.endswith("proj.weight"):
            assert torch.equal(p, merged[name]), name  # the merged weights: fresh
    assert [n for n, _ in lora.merged_parameters(model, frozen=False)] == [n for n in merged if n.endswith("proj.weight")]
