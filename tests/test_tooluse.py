"""tooluse.py through rollout.generate: a row that closes a call gets exactly the tool's answer as forced tokens
(policy mask 0, log-prob 0), the other rows decode on; the trainer's one fresh forward over the whole row gives
the sampler's log-probs at every policy token; a row alone samples what it samples in the batch; the static step
samples what the eager one does; bounds (calls, result tokens, hostile calls); a chat template's tool turn."""
import itertools
import json
import os
import re
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

import decode
import grpo
import infra
import model
import rollout
import tasks
import templates
import tooluse
import train
import verify
from cli import UserError
from conftest import CHATML
from model import ModelConfig, Transformer, build_char_tokenizer, load_tokenizer
from rollout import completion_logprobs, generate
from test_rollout import one_thread  # noqa: F401  (autouse: one thread for tiny tensors)
from test_train import SMOKE, deterministic, one_and_two_ranks, records, run_cli

CHARS = "0123456789+-*/()[]{}?"
TOK = build_char_tokenizer(CHARS)
PROMPTS = [TOK.encode(s).ids for s in ("12*3", "[4+5]", "7", "(1+2)*", "9-8[")]
STOP = [2]


def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=TOK.get_vocab_size(), hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=48, max_seq_len=128)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # peaked, prompt-dependent distributions (as tests/test_rollout.py)
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() == 2 else p.normal_(1, 0.3)
    return m


def box(max_calls=3, max_tokens=8, tools=None):
    return tooluse.Toolbox(tools or [tooluse.Calculator()], TOK, max_calls=max_calls, max_tokens=max_tokens)


def rows(r):
    return [(r.completion_ids[i, :r.lengths[i]].tolist(), r.policy_mask[i, :r.lengths[i]].tolist())
            for i in range(len(r.lengths))]


def replay(b: tooluse.Toolbox, ids: list[int]) -> tuple[list[bool], int, bool]:
    """The protocol by hand, over a finished row: after each sampled close marker with an open marker before it
    (and calls left), the next tokens must be the toolbox's answer to the row so far; they are not policy. A call
    with no calls left must be the row's last token -> (policy mask, calls answered, ended at the limit)."""
    policy, i, calls = [], 0, 0
    while i < len(ids):
        policy.append(True)
        if ids[i] in b.marks and calls >= b.max_calls and b.call_start(ids[:i + 1]) is not None:
            assert i == len(ids) - 1, "a call past the limit ends the row"
            return policy, calls, True
        if ids[i] in b.marks and calls < b.max_calls and (got := b.answer(ids[:i + 1])) is not None:
            forced = got[0][:len(ids) - i - 1]
            assert ids[i + 1:i + 1 + len(forced)] == forced
            policy += [False] * len(forced)
            i, calls = i + len(forced), calls + 1
        i += 1
    return policy, calls, False


def test_results_are_forced_exactly_and_the_trainer_forward_gives_the_sampler_logprobs(linear_calls):
    m, b = tiny(), box()
    r = generate(m, PROMPTS, 8, 60, 1.0, stop_ids=STOP, seed=1, tools=b)
    assert linear_calls and all(linear_calls) == model.PACKED_GEMM  # on x86 the loop with tools packs too
    n_calls = r.tool_calls.tolist()
    for (ids, policy), calls in zip(rows(r), n_calls):
        want, k, _ = replay(b, ids)
        assert policy == want and calls == k
    assert sum(c > 0 for c in n_calls) >= 3 and sum(c == 0 for c in n_calls) >= 3  # a mixed batch
    assert r.tool_errors.sum() > 0 and (r.tool_errors <= r.tool_calls).all()
    comps = [ids[:n] for ids, n in zip(r.completion_ids.tolist(), r.lengths.tolist())]
    lp, _ = completion_logprobs(m, [p for p in PROMPTS for _ in range(8)], comps, 1.0)
    pol = r.policy_mask
    assert (r.logprobs[~pol] == 0).all() and pol.sum() < r.completion_mask.sum()
    assert torch.allclose(lp[pol], r.logprobs[pol], atol=2e-5)  # one fresh forward over the whole sequence


def test_a_row_alone_samples_what_it_samples_in_the_batch():
    m, b = tiny(), box()
    r = generate(m, PROMPTS, 4, 60, 1.0, stop_ids=STOP, seed=5, tools=b)
    called = [i for i, c in enumerate(r.tool_calls.tolist()) if c][:3]
    assert called
    for i in called:
        alone = generate(m, [PROMPTS[i // 4]], 1, 60, 1.0, stop_ids=STOP, seed=r.seeds[i:i + 1], tools=b)
        assert rows(alone)[0] == rows(r)[i]


def test_without_tools_nothing_is_forced_and_the_close_marker_is_text():
    m = tiny()
    r = generate(m, PROMPTS, 4, 40, 1.0, stop_ids=STOP, seed=1)
    assert torch.equal(r.policy_mask, r.completion_mask) and r.tool_calls.sum() == 0


def test_a_call_past_max_tool_calls_ends_the_row_with_its_finish_reason():
    m = tiny()
    many = generate(m, PROMPTS, 8, 60, 1.0, stop_ids=STOP, seed=1, tools=box(max_calls=3))
    one = generate(m, PROMPTS, 8, 60, 1.0, stop_ids=STOP, seed=1, tools=box(max_calls=1))
    assert one.tool_calls.max() == 1 and many.tool_calls.max() > 1
    ended = [rollout.FINISH[c] for c in one.finish.tolist()]
    assert {"tool_limit", "stop"} <= set(ended), ended
    for (ids, policy), why, n in zip(rows(one), ended, one.lengths.tolist()):
        want, _, limited = replay(box(max_calls=1), ids)
        assert policy == want and limited == (why == "tool_limit"), (ids, why)
        assert (ids[-1] in STOP) == (why == "stop") and (n == 60) >= (why == "length")
    assert torch.equal(one.truncated, one.finish == rollout.FINISH.index("length"))  # all finite


class Echo(tooluse.Tool):
    name, open, close = "echo", "(", ")"

    def call(self, text):
        return "0123456789" * 5  # a long result


def test_a_long_result_is_cut_to_max_tool_tokens_inside_its_wrapper():
    m, b = tiny(), box(max_tokens=6, tools=[Echo()])
    r = generate(m, PROMPTS, 8, 60, 1.0, stop_ids=STOP, seed=2, tools=b)
    assert r.tool_calls.sum() > 0
    forced = b.answer(TOK.encode("(1)", add_special_tokens=False).ids)[0]
    assert TOK.decode(forced) == "{012345}" and len(forced) == 8
    for ids, policy in rows(r):
        assert policy == replay(b, ids)[0]


class Nested(tooluse.Tool):
    name, open, close = "nested", "(", ")"

    def call(self, text):
        return "(1)"  # an answer holding the tool's own open and close markers


def test_a_close_marker_inside_a_forced_answer_is_not_a_call():
    """A forced ")" (the answer's) is context, not the policy closing a call: no extra call is answered, no row
    ends at the limit, and every forced run is exactly one answer "{(1)}" (or its start, cut by the row's end)."""
    b = box(max_calls=2, tools=[Nested()])
    answer = TOK.encode("{(1)}", add_special_tokens=False).ids
    assert b.answer(TOK.encode("(7)", add_special_tokens=False).ids)[0] == answer
    r = generate(tiny(), PROMPTS, 8, 60, 1.0, stop_ids=STOP, seed=2, tools=b)
    close, forced_closes = TOK.token_to_id(")"), 0
    for (ids, policy), calls, why in zip(rows(r), r.tool_calls.tolist(), r.finish.tolist()):
        assert (policy, calls) == replay(b, ids)[:2]
        runs = [list(g) for k, g in itertools.groupby(zip(ids, policy), key=lambda x: x[1]) if not k]
        assert len(runs) == calls, ids  # one forced run per answered call
        for k, run in enumerate(runs):
            got = [t for t, _ in run]
            assert got == answer or (k == len(runs) - 1 and got == answer[:len(got)] and ids[-len(got):] == got)
        forced_closes += sum(t == close and not p for t, p in zip(ids, policy))
        # a forced marker past the limit ends nothing: only a sampled call does
        assert rollout.FINISH[why] != "tool_limit" or (policy[-1] and ids[-1] == close), ids
    assert forced_closes >= 3 and r.tool_calls.sum() >= 3


def test_the_static_step_with_tools_samples_what_the_eager_one_does(monkeypatch):
    monkeypatch.setattr(rollout, "compiled_step", lambda device_type: decode.step)
    monkeypatch.setattr(rollout, "MIN_BUCKET", 2)
    monkeypatch.setattr(rollout, "CHECK_EVERY", 3)
    m, b = tiny(), box()
    eager = generate(m, PROMPTS, 4, 50, 1.0, stop_ids=STOP, seed=4, tools=b)
    static = generate(m, PROMPTS, 4, 50, 1.0, stop_ids=STOP, seed=4, tools=b, static=True)
    assert rows(static) == rows(eager) and torch.equal(static.tool_calls, eager.tool_calls)
    assert (static.logprobs - eager.logprobs).abs().max() < 2e-5 and eager.tool_calls.sum() > 0


@pytest.mark.slow
def test_the_compiled_step_keeps_one_frame_per_setting_with_forced_tokens(monkeypatch):
    """Inductor on CPU, tools on and off, calls of varying rows: a frame per sampling setting (greedy, sampled),
    and the eager path's tokens."""
    monkeypatch.setattr(rollout, "CHECK_EVERY", 2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    m = tiny()
    for i, (G, T, tools) in enumerate([(4, 1.0, box()), (2, 1.0, None), (8, 1.0, box(max_calls=1)),
                                       (3, 0.0, box()), (1, 0.0, None)]):
        got = generate(m, PROMPTS, G, 40, T, stop_ids=STOP, seed=i, tools=tools, static=True)
        want = generate(m, PROMPTS, G, 40, T, stop_ids=STOP, seed=i, tools=tools, static=False)
        assert rows(got) == rows(want) and (got.logprobs - want.logprobs).abs().max() < 2e-5
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert frames <= 2, frames


HOSTILE = ["9" * 5000, "(" * 1000 + "1" + ")" * 1000, "__import__('os').system('true')", "9**9**9**9",
           "2^99999999", "1/0", '{"name": "calculator", "arguments": {"expression": "' + "9*" * 99 + '9"}}',
           '{"arguments": [1, 2]}', '{"a": ' * 500 + "1" + "}" * 500, "exec('1')", "\x00" * 100]


def test_hostile_calls_are_answered_with_errors_in_bounded_time():
    calc = tooluse.Calculator()
    t0 = time.perf_counter()
    out = [calc.call(text) for text in HOSTILE]
    assert time.perf_counter() - t0 < 1.0  # a bound on behaviour (each is size-bounded), not a speed test
    assert all(o.startswith("error") for o in out[:6] + out[7:]), out
    assert out[6] == str(9 ** 100)  # the JSON form's 199-character product is still arithmetic
    assert calc.call("12*34") == "408" and calc.call(" 7/3 ") == "7/3" and calc.call("-2*(3-5)") == "4"


def test_a_demonstration_s_policy_mask_is_what_generate_would_force():
    b = box()
    text = "12*3[12*3]{36}+1[36+1]{37}]{9}"  # two calls, then a stray close marker (no open since: text)
    ids = TOK.encode(text, add_special_tokens=False).ids
    mask = tooluse.policy_mask(b, ids)
    forced = "".join(TOK.id_to_token(t) for t, keep in zip(ids, mask) if not keep)
    assert forced == "{36}{37}"
    assert mask == replay(b, ids)[0]


@pytest.mark.parametrize("limit, forced", [(0, ""), (1, "{2}"), (2, "{2}{4}"), (3, "{2}{4}{6}"), (4, "{2}{4}{6}")])
def test_a_demonstration_s_calls_past_max_tool_calls_are_plain_text(limit, forced):
    text = "[1+1]{2}[2+2]{4}[3+3]{6}"  # three calls: those up to the limit are answered, the rest text
    ids = TOK.encode(text, add_special_tokens=False).ids
    mask = tooluse.policy_mask(box(max_calls=limit), ids)
    want = [True] * len(text)
    for start in (5, 13, 21)[:limit]:  # each answered call's "{n}" (3 characters) is not policy
        want[start:start + 3] = [False] * 3
    assert mask == want
    assert "".join(c for c, keep in zip(text, mask) if not keep) == forced


def test_generate_s_rows_past_max_tool_calls_are_read_as_demonstrations_the_same_way():
    b = box(max_calls=1)
    r = generate(tiny(), PROMPTS, 8, 60, 1.0, stop_ids=STOP, seed=1, tools=b)
    for ids, policy in rows(r):  # the row's own call past the limit (its last token) is plain text
        assert tooluse.policy_mask(b, ids) == policy, ids
    assert "tool_limit" in [rollout.FINISH[c] for c in r.finish.tolist()] and r.tool_calls.max() == 1


def group(samples):
    """A train.Group of hand-made samples (calls, errors, score, policy as '.' sampled / 'F' forced)."""
    policy = [[c == "." for c in p] for _, _, _, p in samples]
    comps = [[3] * len(p) for p in policy]
    return train.Group(0, 0, None, [1], comps, [""] * len(comps), [torch.zeros(len(c)) for c in comps],
                       [False] * len(comps), [s for _, _, s, _ in samples], policy=policy,
                       tools=[[c, e] for c, e, _, _ in samples])


def test_tool_metrics_are_the_hand_counted_values_and_errors_are_per_call():
    groups = [group([(2, 1, 1.0, "..FF.F."), (0, 0, 0.0, "...."), (1, 0, 1.0, ".FF.."), (0, 0, 0.0, "...")]),
              group([(4, 2, 0.0, ".F.F.F"), (0, 0, 1.0, ".."), (1, 0, 0.0, "..F")])]
    no_tools = train.Group(0, 1, None, [1], [[3], [3]], ["", ""], [torch.zeros(1)] * 2, [False] * 2, [1.0, 1.0])
    got = tooluse.metrics(groups + [no_tools], "train/")
    # 7 samples, 8 calls, 3 errors; 4 samples called (2 correct), 3 did not (1 correct); correct: 3, 2 of them
    # called; 9 forced tokens of 30
    assert got == pytest.approx({"train/tool_calls": 8 / 7, "train/tool_call_rate": 4 / 7,
                                 "train/tool_error_rate": 3 / 8,  # not 3 / 7 (per completion)
                                 "train/tool_share_of_correct": 2 / 3, "train/tool_accuracy_with": 2 / 4,
                                 "train/tool_accuracy_without": 1 / 3, "train/tool_forced_frac": 9 / 30})
    assert set(got) == {"train/tool_calls", "train/tool_call_rate", "train/tool_error_rate",
                        "train/tool_share_of_correct", "train/tool_accuracy_with", "train/tool_accuracy_without",
                        "train/tool_forced_frac"}
    assert tooluse.metrics([no_tools], "train/") == {}
    none_called = tooluse.metrics([group([(0, 0, 1.0, ".."), (0, 0, 0.0, "...")])], "eval/")
    assert none_called["eval/tool_error_rate"] == 0 and none_called["eval/tool_accuracy_with"] == 0
    assert none_called["eval/tool_accuracy_without"] == 0.5 and none_called["eval/tool_share_of_correct"] == 0


# ------------------------------------------------------------------------------------------ in training
TOOL_RUN = ["--config", SMOKE, "--tools=calculator", "--sft_tool_frac=0.5", "--max_seq_len=128",
            "--max_new_tokens=40", "--overlong_buffer=20", "--dynamic_sampling=false", "--eval_n=8",
            "--sft_steps=30", "--sft_lr=3e-2"]  # enough SFT that the policy calls the tool


def gaps(recs):
    return [r["train/logprob_gap_max"] for r in recs if r["stage"] == "rl" and "train/loss" in r]


def test_forced_tokens_leave_the_loss_mask_the_normaliser_and_the_gradient():
    cfg = train.parse_args(["--config", SMOKE, "--tools=calculator", "--agg=token_mean"])
    tok = train.build_char_tokenizer(tasks.CHARS + tooluse.CHARS)
    run = train.Run(cfg, infra.Proc(0, 1, torch.device("cpu")), None, tasks.Task(cfg, tok, [2]))
    comps = [tok.encode(t, add_special_tokens=False).ids for t in ("[2*3]{6}", "7")]
    policy = [tooluse.policy_mask(run.task.tools, c) for c in comps]
    assert policy[0] == [True] * 5 + [False] * 3 and policy[1] == [True]
    g = train.Group(0, 0, None, [1], comps, ["", ""], [torch.zeros(len(c)) for c in comps], [False, False],
                    [1.0, 0.0], policy=policy, tools=[[1, 0], [0, 0]])
    cfg.group_size = 2
    batch = train.rank_batch(cfg, run.proc, [g], run.task.tools)
    assert batch.mask.tolist() == [policy[0], [True] + [False] * 7]
    assert float(batch.norm) == 6  # policy tokens only (token_mean: their count)
    logp = torch.zeros(2, 8, requires_grad=True)
    loss, _ = grpo.policy_loss(logp, logp.detach(), torch.tensor([[1.0] * 8, [-1.0] * 8]),
                               batch.mask, agg="token_mean", loss_scale=batch.norm)
    loss.backward()
    assert (logp.grad[0, 5:] == 0).all() and (logp.grad[0, :5] != 0).all()


def test_a_cold_start_demo_with_calls_is_the_tool_s_answers_and_masks_them():
    cfg = train.parse_args(["--config", SMOKE, "--tools=calculator", "--sft_tool_frac=1.0",
                            "--sft_flaw_frac=0"])
    tok = train.build_char_tokenizer(tasks.CHARS + tooluse.CHARS)
    task = tasks.Task(cfg, tok, [2])
    probs, _, targets = task.cold_start_batch(0, 8)
    for p, ids in zip(probs, targets):
        text = task.text(ids)
        assert text.count("[") == p.level and verify.reward(text, p.gold) == 1.0
        mask = tooluse.policy_mask(task.tools, ids)
        forced = "".join(tok.id_to_token(t) for t, m in zip(ids, mask) if not m)
        want = "".join("{" + task.tools.tools[0].call(c) + "}" for c in re.findall(r"\[([^\]]*)\]", text))
        assert forced == want


@pytest.mark.slow
def test_tool_runs_on_one_and_two_ranks_agree(tmp_path):
    """The same RL on 1 and 2 ranks from one cold start. (Each side's own 30 SFT steps at lr 3e-2 amplify the ranks'
    float rounding to weights 1e-4 apart, where a greedy near-tie flips a sample, before and after model.Prefix
    alike, seeds 0-2; from one checkpoint the RL metrics agree to ~1e-7.)"""
    train.main(train.parse_args(TOOL_RUN + ["--rl_steps=0", f"--out_dir={tmp_path / 'sft'}"]))
    sft = next((tmp_path / "sft").glob("step_*"))
    one_and_two_ranks(TOOL_RUN + ["--rl_steps=3", f"--init_from={sft}", "--sft_steps=0"], tmp_path)
    recs = records(tmp_path / "one")
    assert any(r.get("train/tool_calls", 0) > 0 for r in recs)  # the policy called in training
    assert max(gaps(recs)) < 1e-4  # the sampler-trainer gap over policy tokens (a forced token's 0: huge)


@pytest.mark.slow
def test_a_resumed_tool_run_is_exact(tmp_path):
    args = TOOL_RUN + ["--rl_steps=4", "--ckpt_every=32", "--keep_ckpts=0"]
    run_cli(args + [f"--out_dir={tmp_path / 'one'}"])
    one = records(tmp_path / "one")
    cut = tmp_path / "cut"
    os.makedirs(cut)
    shutil.copytree(tmp_path / "one" / "step_32", cut / "step_32")
    shutil.copy(tmp_path / "one" / "metrics.jsonl", cut / "metrics.jsonl")
    run_cli(args + [f"--out_dir={cut}", "--resume"])
    assert deterministic(records(cut)) == deterministic(one)
    a, b = (load_file(d / "step_34" / "model.safetensors") for d in (tmp_path / "one", cut))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_an_async_tool_run_at_staleness_1_runs(tmp_path):
    run_cli(TOOL_RUN + ["--rl_steps=3", "--sampler_ranks=1", "--max_staleness=1", f"--out_dir={tmp_path}"],
            nproc=2)
    recs = [r for r in records(tmp_path) if r["stage"] == "rl" and "train/loss" in r]
    assert len(recs) == 3 and all("train/tool_calls" in r for r in recs)


QWEN_TOOL_TURNS = (  # Qwen2.5-Instruct's template: its assistant tool-call and tool-message branches
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n")


def qwen_tool_folder(hf_folder, tmp_path):
    """The Qwen-shaped test folder with Qwen2.5's tool turns in its template and <tool_call> / </tool_call>
    as added special tokens (as the Hub's Qwen2.5 tokenizer has them)."""
    folder = tmp_path / "qwen_tools"
    shutil.copytree(hf_folder("qwen"), folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(list(tooluse.CHAT_MARKERS))
    tok.save(str(folder / "tokenizer.json"))
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    head, loop = CHATML.split("{%- for message in messages %}")
    tc["chat_template"] = head + QWEN_TOOL_TURNS + loop[loop.index("{%- if add_generation_prompt"):]
    for t in tooluse.CHAT_MARKERS:
        tc["added_tokens_decoder"][str(tok.token_to_id(t))] = dict(content=t, lstrip=False, normalized=False,
                                                                  rstrip=False, single_word=False, special=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    return str(folder)


def test_a_chat_checkpoint_s_forced_tokens_are_what_its_template_adds_for_a_tool_message(hf_folder, tmp_path):
    """Qwen2.5's template: prompt + the policy's call + the forced tokens tokenise to exactly the rendered
    conversation [user, assistant(call), tool(result)] with the next generation prompt."""
    folder = qwen_tool_folder(hf_folder, tmp_path)
    cfg = train.parse_args(["--config", SMOKE, f"--init_from={folder}", "--template=chat", "--tools=calculator"])
    tok, info = load_tokenizer(folder), templates.read_tokenizer_config(folder)
    task = tasks.Task(cfg, tok, templates.stop_ids(tok, info, rollout.STOP_NAMES), info)
    p = task.heldout[0]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    call_ids = tok.encode(call, add_special_tokens=False).ids
    forced, error, cut = task.tools.answer(call_ids)
    assert not error and not cut and tok.decode(forced, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    full = templates.chat_template(info["chat_template"]).render(
        messages=[{"role": "user", "content": p.prompt}, {"role": "assistant", "content": call},
                  {"role": "tool", "content": "408"}], tools=None, documents=None, add_generation_prompt=True,
        **info["special_tokens"])
    assert tok.encode(full, add_special_tokens=False).ids == task.prompt_ids(p) + call_ids + forced
    assert tooluse.policy_mask(task.tools, call_ids + forced) == [True] * len(call_ids) + [False] * len(forced)


def test_a_chat_template_without_tool_messages_is_one_line_naming_it(hf_folder):
    folder = hf_folder("qwen")  # its template renders no 'tool' role
    cfg = train.parse_args(["--config", SMOKE, f"--init_from={folder}", "--template=chat", "--tools=calculator"])
    tok, info = load_tokenizer(folder), templates.read_tokenizer_config(folder)
    with pytest.raises(UserError, match="does not render a tool message"):
        tasks.Task(cfg, tok, templates.stop_ids(tok, info, rollout.STOP_NAMES), info)


class Stopper(tooluse.Tool):
    name, open, close = "stopper", "(", ")"

    def call(self, text):
        return "1<eos>2"  # a result holding a stop id (a chat wrapper's <|im_end|>)


def test_a_stop_id_inside_a_forced_result_does_not_end_the_row():
    m, b = tiny(), box(tools=[Stopper()])
    r = generate(m, PROMPTS, 8, 60, 1.0, stop_ids=STOP, seed=2, tools=b)
    eos_forced = 0
    for ids, policy in rows(r):
        assert policy == replay(b, ids)[0]
        at = [i for i, (t, p) in enumerate(zip(ids, policy)) if t == STOP[0] and not p]
        eos_forced += len(at)
        assert all(i + 1 < len(ids) for i in at if i + 2 < 60)  # the row went on after the forced <eos>
    assert eos_forced > 0
