"""checks.py and cli.py's user-facing edges: one case per cross-field rule of train.Config / star.StarConfig (each
message names the keys and their values), the files a config names (a missing folder, a truncated safetensors,
a missing data file), one-line errors for a user's mistakes while bugs keep their tracebacks, the printed config,
dict fields (a TOML table, JSON on the command line), --help (every key by group: type, default, comment), a
malformed TOML file (file:line:column), and no torch warning from an RL step that has nothing to learn."""
import dataclasses
import glob
import inspect
import json
import os
import re
import subprocess
import sys
import tomllib
import warnings

import pytest
import torch

import checks
import cli
import star
import train
from cli import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAR = dict(train_size=4)  # a StarConfig needs a pool of synthetic problems
# configs that are read on top of others (their first comment line says so)
OVERLAYS = {"smollm2-135m-mix.toml": ["smollm2-135m-rg.toml"],
            "smollm2-135m-rft.toml": ["smollm2-135m-rg.toml", "smollm2-135m-mix.toml"]}
CASES = [  # (config class, overrides, the exact message)
    (train.Config, dict(overlong_buffer=128, max_new_tokens=32),
     "overlong_buffer = 128 must be <= max_new_tokens = 32 and >= 0 (DAPO eq. 13: L_cache within L_max)"),
    (train.Config, dict(max_new_tokens=96), "max_new_tokens = 96 must be < max_seq_len = 96 with no init_from"),
    (train.Config, dict(n_kv_heads=3), "n_kv_heads = 3 must divide n_heads = 4"),
    (train.Config, dict(hidden_size=130), "hidden_size = 130 must be n_heads = 4 times an even head size"),
    (train.Config, dict(group_size=1), "group_size = 1 must be >= 2 with rl_steps = 200"),
    (train.Config, dict(temperature=0.0), "temperature = 0.0 must be > 0"),
    (train.Config, dict(top_p=0.0), "top_p = 0.0 must be in (0, 1]"),
    (train.Config, dict(eps_low=-0.1), "eps_low = -0.1 must be in [0, 1] and eps_high = 0.28 >= 0"),
    (train.Config, dict(eps_high=-0.1), "eps_low = 0.2 must be in [0, 1] and eps_high = -0.1 >= 0"),
    (train.Config, dict(dual_clip=3.0, pg_loss="cispo"), "dual_clip = 3.0 must be 0 (off) or > 1, and only with "
     "pg_loss = 'clip' (got pg_loss = 'cispo')"),
    (train.Config, dict(tis="token", tis_cap=0.5), "tis_cap = 0.5 must be >= 1 with tis = 'token'"),
    (train.Config, dict(top_entropy_q=0.0), "top_entropy_q = 0.0 must be in (0, 1]"),
    (train.Config, dict(ref_update_every=5), "ref_update_every = 5 refreshes π_ref, which only beta = 0.0 > 0 uses"),
    (train.Config, dict(reward="process", task="countdown"), "reward = 'process' needs task = 'arithmetic'"),
    (train.Config, dict(sft_batch_size=0), "sft_batch_size = 0 must be >= 1 with sft_steps = 800"),
    (train.Config, dict(min_lr_ratio=2.0), "min_lr_ratio = 2.0 must be in [0, 1]"),
    (train.Config, dict(sft_min_ops=5), "sft_min_ops = 5 must be >= 1 and <= sft_max_ops = 4"),
    (train.Config, dict(rl_min_ops=0), "rl_min_ops = 0 must be >= 1 and <= rl_max_ops = 4"),
    (train.Config, dict(eval_max_ops=1), "eval_min_ops = 2 must be >= 1 and <= eval_max_ops = 1"),
    (train.Config, dict(ops="+/"), "ops = '+/' must draw from '+-*'"),
    (train.Config, dict(sft_steps=0, sft_batch_size=0), None),  # no cold start: no batch size needed
    (train.Config, dict(rl_steps=0, group_size=1), None),  # no RL: no groups
    (train.Config, dict(rl_steps=0, overlong_buffer=128, max_new_tokens=32), None),  # an evaluation: no RL
    (train.Config, dict(sft_flaw_frac=1.5), "sft_flaw_frac = 1.5 must be in [0, 1]"),
    (train.Config, dict(sft_direct_frac=-0.5), "sft_direct_frac = -0.5 must be in [0, 1]"),
    (train.Config, dict(template="chat"), "template = 'chat' needs a checkpoint's chat template: set init_from"),
    (train.Config, dict(system_prompt="Be brief."), "system_prompt = 'Be brief.' needs template = 'chat' (got "
     "template = 'plain')"),
    (train.Config, dict(task="gsm8k"), "task = 'gsm8k' reads JSONL files: set train_file and eval_file"),
    (train.Config, dict(adv_scale="maxrl", overlong_buffer=8), "adv_scale = 'maxrl' divides by the group's mean "
     "reward, a success rate: no negative shaping (overlong_buffer = 8, kl_in = 'loss' with beta = 0.0)"),
    (train.Config, dict(adv_scale="maxrl", kl_in="reward", beta=0.1), "adv_scale = 'maxrl' divides by"),
    (train.Config, dict(kl_in="reward"), "kl_in = 'reward' subtracts β·k1 from the reward: set beta = 0.0 > 0"),
    (train.Config, dict(pg_loss="sapo", tau_neg=0.0), "tau_pos = 1.0 and tau_neg = 0.0 must be > 0 with "
     "pg_loss = 'sapo'"),
    (train.Config, dict(cov="clip", cov_low=5.0), "cov_frac = 0.0002 must be in (0, 1] and cov_low = 5.0 < "
     "cov_high = 5.0 with cov = 'clip'"),
    (train.Config, dict(cov="kl", cov_frac=0.0), "cov_frac = 0.0 must be in (0, 1]"),
    (train.Config, dict(tau_neg=0.0, cov_frac=0.0), None),  # SAPO's and Cov's settings unused: no error
    (train.Config, dict(reward="none", dynamic_sampling=False), "reward = 'none' turns the verifier's advantage "
     "off: it needs a teacher = '' folder and opd_weight = 1.0 > 0"),
    (train.Config, dict(reward="none", teacher="t", opd_weight=1.0), "reward = 'none' (pure distillation) needs "
     "dynamic_sampling = false, got dynamic_sampling = True"),
    (train.Config, dict(max_staleness=1), "max_staleness = 1 must be 0, or > 0 with sampler_ranks = 0 > 0: the "
     "colocated loop samples the weights it trains"),
    (train.Config, dict(max_staleness=-1, sampler_ranks=1), "max_staleness = -1 must be 0, or > 0"),
    (train.Config, dict(lora_rank=8, lora_alpha=0.0), "lora_alpha = 0.0 must be > 0 with lora_rank = 8 (the "
     "adapter's scale is α / r)"),
    (train.Config, dict(lora_rank=8, lora_targets="q_proj, lm_head"), "lora_targets = 'q_proj, lm_head' must be "
     "'all' or a comma list of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj with lora_rank = 8"),
    (train.Config, dict(tools="abacus"), "tools = 'abacus' must be '' (off) or one of calculator (tooluse.TOOLS)"),
    (train.Config, dict(sft_tool_frac=0.3), "sft_tool_frac = 0.3 must be 0, or in (0, 1] with a tool (tools = '') "
     "and task = 'arithmetic' (task = 'arithmetic'): the teacher's calls are arithmetic steps"),
    (train.Config, dict(task="reasoning_gym", sft_steps=0), "task = 'reasoning_gym' needs rg_datasets = {} naming a "
     "dataset and its options"),
    (train.Config, dict(task="reasoning_gym", sft_steps=0, rg_datasets={"leg_counting": {}}, eval_n=600),
     "eval_n = 600 must be <= rg_heldout = 500 (the held-out pool) < rg_size = 10000"),
    (train.Config, dict(task="reasoning_gym", rg_datasets={"leg_counting": {}}), "task = 'reasoning_gym' has no "
     "worked solutions to imitate: sft_steps = 800 must be 0"),
    (star.StarConfig, dict(STAR, sampler_ranks=1), "sampler_ranks = 1 is train.py's: star.py samples on every rank"),
    (star.StarConfig, dict(STAR, resume=True), "resume = True is not supported by star.py"),
    (star.StarConfig, dict(train_size=0), "train_size = 0 must be > 0 with algo = 'star'"),
    (star.StarConfig, dict(STAR, expert_fresh=True), "expert_fresh = True needs a dataset task: task = "
     "'arithmetic''s stream is its train_size problems, one pool"),
    (star.StarConfig, dict(STAR, hint_sft_frac=1.5), "hint_sft_frac = 1.5 must be in [0, 1]"),
    (star.StarConfig, dict(STAR, task="countdown"), "countdown has no answer hint: set rationalize = false and "
     "hint_sft_frac = 0 (got rationalize = True, hint_sft_frac = 0.0, algo = 'star')"),
    (train.Config, dict(scorer_timeout=0.0), "scorer_timeout = 0.0 must be > 0 (seconds a scorer call may take)"),
]
CASES += [(star.StarConfig if k.startswith("expert") else train.Config,
           dict(STAR if k.startswith("expert") else {}, **{k: type(getattr(train.Config, k, 0))(lo - 1)}),
           f"{k} = {type(getattr(train.Config, k, 0))(lo - 1)!r} must be >= {lo}")
          for keys, lo in ((checks.POSITIVE, 1), (checks.NON_NEGATIVE, 0)) for k in keys]


def broken(cfg) -> list[int]:
    return [i for i, (keys, ok, _) in enumerate(checks.RULES) if all(hasattr(cfg, k) for k in keys) and not ok(cfg)]


@pytest.mark.parametrize("cls, kw, msg", CASES, ids=[next(iter(c[1].keys() - {"train_size"} or c[1])) for c in CASES])
def test_each_rule_names_its_keys_and_values(cls, kw, msg):
    cfg = cls(**kw)
    if msg is None:  # a setting only another stage needs
        return checks.check_settings(cfg)
    with pytest.raises(UserError) as e:
        checks.check_settings(cfg)
    assert str(e.value).startswith(msg), str(e.value)
    assert len(broken(cfg)) == 1  # the case breaks exactly its own rule


def test_every_rule_has_a_case_and_every_shipped_config_passes():
    assert {i for c in CASES for i in broken(c[0](**c[1]))} == set(range(len(checks.RULES)))
    checks.check_settings(train.Config())
    checks.check_settings(star.StarConfig(**STAR))
    for path in glob.glob(os.path.join(ROOT, "configs", "*.toml")):
        cls = star.StarConfig if "algo" in open(path).read() else train.Config
        stack = [x for name in OVERLAYS.get(os.path.basename(path), [])
                 for x in ("--config", os.path.join(ROOT, "configs", name))]
        checks.check_settings(train.parse_args([*stack, "--config", path], cls))


def test_a_bad_setting_stops_before_anything_loads(monkeypatch):
    monkeypatch.setattr(train.infra, "setup", lambda *a: pytest.fail("build_run went on to set up processes"))
    with pytest.raises(UserError, match="overlong_buffer = 128 must be <= max_new_tokens = 32"):
        train.main(train.Config(overlong_buffer=128, max_new_tokens=32))


def test_files_a_config_names(tmp_path, hf_folder):
    with pytest.raises(UserError, match=f"init_from = '{tmp_path}/nope': no such folder"):
        checks.check_files(train.Config(init_from=str(tmp_path / "nope")))
    with pytest.raises(UserError, match=f"train_file = '{tmp_path}/train.jsonl': no such file"):
        checks.check_files(train.Config(task="gsm8k", train_file=str(tmp_path / "train.jsonl"), eval_file="x"))
    folder = hf_folder("qwen")
    checks.check_files(train.Config(init_from=folder))  # a complete folder passes
    with pytest.raises(UserError, match="max_new_tokens = 600 must be < the checkpoint's max_position_embeddings"
                                        " = 512"):
        checks.check_files(train.Config(init_from=folder, max_new_tokens=600))
    for name, edit, msg in [("tokenizer.json", "delete", "tokenizer.json is missing"),
                            ("model.safetensors", "truncate", "model.safetensors: truncated: "),
                            ("model.safetensors", "header", "model.safetensors: not a safetensors file"),
                            ("config.json", "model_type", "config.json: model_type 'gpt2' is not supported")]:
        copy = tmp_path / f"{edit}_{name}"
        subprocess.run(["cp", "-r", folder, str(copy)], check=True)
        target = copy / name
        if edit == "delete":
            target.unlink()
        elif edit == "model_type":
            target.write_text(target.read_text().replace('"qwen2"', '"gpt2"'))
        else:
            data = target.read_bytes()
            target.write_bytes(data[:len(data) - 100] if edit == "truncate" else data[:20])
        with pytest.raises(UserError, match=msg):
            checks.check_files(train.Config(init_from=str(copy)))


@pytest.mark.slow
def test_user_errors_are_one_line_and_bugs_keep_tracebacks(tmp_path, hf_folder, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "2\\n#### 2"}\n{"question": oops}\n')
    cfg = train.Config(init_from=hf_folder("qwen"), task="gsm8k", train_file=str(bad), eval_file=str(bad),
                       out_dir=str(tmp_path / "run"), wandb_mode="disabled", max_new_tokens=8)
    with pytest.raises(SystemExit) as e:
        cli.run_main(train.main, cfg)
    assert e.value.code == 1 and capsys.readouterr().err == f"error: {bad}:2: bad JSON (Expecting value)\n"
    with pytest.raises(ZeroDivisionError):  # not the user's: the traceback stays
        cli.run_main(lambda: 1 / 0)
    # the whole command line: a truncated checkpoint in --init_from is one line naming the file, exit status 1
    copy = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", hf_folder("qwen"), str(copy)], check=True)
    (copy / "model.safetensors").write_bytes((copy / "model.safetensors").read_bytes()[:5000])
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--init_from={copy}", "--threads=1"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "WANDB_MODE": "disabled"})
    assert p.returncode == 1 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"error: {copy}/model.safetensors: truncated: 5,000 bytes") and \
        p.stderr.count("\n") == 1


def test_the_printed_config_groups_the_changed_fields():
    cfg = train.Config(out_dir="runs/x", lr=3e-4, group_size=4, print_config="changed")
    assert cli.config_lines(cfg) == ['  # --- run', '  out_dir    = "runs/x"', '  # --- RL sampling',
                                     '  group_size = 4', '  # --- optimizer (AdamW, Loshchilov & Hutter 2019)',
                                     '  lr         = 0.0003']
    every = cli.config_lines(star.StarConfig(), every=True)
    assert len([ln for ln in every if "# ---" not in ln]) == len(train.dataclasses.fields(star.StarConfig))
    assert "  # --- StarConfig" in every and every[0] == "  # --- run"
    proc = train.infra.Proc(0, 1, torch.device("cpu"))
    text = cli.banner(cfg, "J = ...", torch.nn.Linear(3, 2), proc).splitlines()
    assert text[0].startswith("config (the fields off their defaults") and text[-2] == "objective: J = ..."
    assert text[-1] == "model: 8 parameters, float32 weights | world size 1 | device cpu"


def test_a_dict_field_is_a_toml_table_or_json_on_the_command_line(tmp_path):
    toml = tmp_path / "rg.toml"
    toml.write_text('task = "reasoning_gym"\n[rg_datasets.basic_arithmetic]\nmin_terms = 2\noperators = ["+"]\n'
                    '[rg_datasets."leg counting"]\nweight = 0.5\n')
    want = {"basic_arithmetic": {"min_terms": 2, "operators": ["+"]}, "leg counting": {"weight": 0.5}}
    cfg = train.parse_args(["--config", str(toml)])
    assert cfg.rg_datasets == want and train.Config().rg_datasets == {}
    assert train.parse_args(["--config", str(toml), '--rg_datasets={"chain_sum": {}}']).rg_datasets == \
        {"chain_sum": {}}  # the command line replaces the table whole
    printed = "\n".join(cli.config_lines(cfg))  # TOML: the printed block pastes back into a config file
    assert tomllib.loads(printed.replace("  # ---", "# ---"))["rg_datasets"] == want
    for bad, msg in [("--rg_datasets={oops}", "needs a table: a JSON object on the command line"),
                     ("--rg_datasets=[1]", "needs a dict, got [1]")]:
        with pytest.raises(SystemExit, match=re.escape(msg)):
            train.parse_args([bad])


def test_an_rl_step_with_nothing_to_learn_steps_the_schedule_without_a_warning(monkeypatch):
    from test_train import FakeRun
    tr = FakeRun(monkeypatch, lambda pid: [1, 1, 1, 1], prompts_per_step=4, max_sample_tries=1, warmup_steps=2)
    tr.run.model = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in tr.run.model.parameters()]
    opt, sched = train.make_optimizer(tr.run, 1e-3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recs = [train.rl_step(tr.run, opt, sched, tr.state, step) for step in (1, 2)]
    assert [r["train/lr"] for r in recs] == pytest.approx([1e-3, 1e-3])  # warmup 1/2, 2/2, then the cosine
    assert sched.last_epoch == 2 and all(torch.equal(a, b) for a, b in zip(before, tr.run.model.parameters()))
    assert opt.state == {}  # AdamW took no step: no moments, no step count


@pytest.mark.parametrize("cls", [train.Config, star.StarConfig])
def test_help_lists_every_key_with_its_type_default_and_comment_by_group(cls, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--lr=1", "--help"], cls)
    text = capsys.readouterr().out
    assert e.value.code == 0 and text.splitlines()[0] == sys.modules[cls.__module__].__doc__.splitlines()[0]
    assert max(map(len, text.splitlines())) <= 120
    source = "".join(inspect.getsource(k) for k in reversed(cls.__mro__[:-1]))  # train.Config's, then StarConfig's
    groups = re.findall(r"^    # --- (.*)$", source, re.M) + (["StarConfig"] if cls is star.StarConfig else [])
    assert re.findall(r"^# --- (.*)$", text, re.M) == groups  # every group once, in the class's order
    rows = {m[1]: m for m in re.finditer(r"^  --(\w+) +(\w+) +(\S+)(.*(?:\n {30,}\S.*)*)", text, re.M)}
    assert list(rows) == [f.name for f in dataclasses.fields(cls)]
    assert len({m.start(2) - m.start() for m in rows.values()}) == 1  # the type column is aligned
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        m = rows[f.name]
        assert (m[2], m[3]) == (type(value).__name__, json.dumps(value)), f.name
        line = re.search(rf"^    {f.name}: .*$", source, re.M)[0]
        note = line.partition("  # ")[2]  # the field's own comment line (continuation lines: below)
        assert " ".join(note.split()) in " ".join(m[4].split()), f.name
    one = {k: " ".join(rows[k][4].split()) for k in ("reward", "eps_high", "wandb_project", "collective_timeout")}
    assert one == {"reward": "outcome (verifier) | process (DeepSeekMath §4.1.3) | none (pure distillation) | "
                             "format_only (1 for any committed number: the control)",
                   "eps_high": "DAPO §3.1 clip-higher", "wandb_project": "",
                   "collective_timeout": "the async groups' op timeout, and the longest the other side may make no "
                                         "progress (hung); above any eval, checkpoint or sampling step"}


def test_help_from_the_command_line_is_the_entry_points():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "star.py"), "-h"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.startswith(star.__doc__.splitlines()[0] + "\n\nusage: python star.py [--config FILE.toml]")
    assert "\n# --- StarConfig\n  --algo " in p.stdout and "\n  python star.py --config configs/star.toml" in p.stdout


def test_a_malformed_toml_file_is_one_line_naming_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    for text, where in [("lr = 1e-3\nx = \n", "2:5"), ("x = ", "1:5"), ("[rg_datasets\n", "1:13")]:
        bad.write_text(text)
        with pytest.raises(UserError) as e:
            cli.load_toml(str(bad))
        assert str(e.value).startswith(f"{bad}:{where}: "), str(e.value)
        with pytest.raises(SystemExit) as e:
            train.parse_args(["--config", str(bad)])
        assert e.value.code == 1 and capsys.readouterr().err.count("\n") == 1
    bad.write_text("lr = 1e-3\nx = \n")
    with pytest.raises(SystemExit):
        train.parse_args(["--config", str(bad)])
    assert capsys.readouterr().err == f"error: {bad}:2:5: Invalid value\n"
