"""Multi-turn episodes: observation masking, turn and token limits, tool errors, seeds, chat-template observations.

The engine here is a scripted policy (what it writes depends only on the text so far), so every token of an episode
is known in advance; the end-to-end run with vLLM is tests/distributed/test_algorithm_runs.py."""

from types import SimpleNamespace

import pytest

from verl_mega.models.tiny import build_char_tokenizer
from verl_mega.config.rl import MultiTurnConfig
from verl_mega.rollout.multi_turn import MultiTurn, _template_parts, check_tool_failures
from verl_mega.rollout.tools import ToolRunner, ToolsFailed
from verl_mega.rollout.base import SamplingSpec

SPEC = dict(tool_call_start="(", tool_call_end=")", observation_start="=", observation_end=".")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(build_char_tokenizer(tmp_path_factory.mktemp("tok"))))


class ScriptedEngine:
    """Answers each context with script(text) (a string; '#' stands for EOS), cut at the first stop token or at
    max_tokens, as vLLM does; records every request."""

    def __init__(self, tok, script):
        self.tok, self.script, self.requests = tok, script, []

    def generate(self, prompts, specs):
        out = []
        for ids, spec in zip(prompts, specs):
            self.requests.append((self.tok.decode(ids), spec))
            reply = [self.tok.eos_token_id if c == "#" else self.tok.convert_tokens_to_ids(c)
                     for c in self.script(self.tok.decode(ids))]
            cut = next((i + 1 for i, t in enumerate(reply) if t in spec.stop_token_ids), len(reply))
            out.append(reply[:min(cut, spec.max_tokens)])
        return SimpleNamespace(token_ids=out, logprobs=[[-0.5] * len(r) for r in out])


def calculator_policy(text):
    if text.endswith("."):
        return text[text.rindex("=", 0, len(text) - 1) + 1:-1] + "#"  # copy the tool's answer
    return f"(calc:{text[:-1]})tail"  # "tail" after the call must never be generated (stop at ")")


def runner(tok, engine_tools=("calc",), max_response_tokens=40, **spec):
    cfg = MultiTurnConfig(**{**SPEC, "enable": True, "tools": engine_tools, "max_turns": 3,
                             "max_observation_tokens": 16, **spec})
    return MultiTurn(tok, ToolRunner(list(engine_tools), 2.0), cfg, max_response_tokens=max_response_tokens)


def test_episode_tokens_masks_and_counts(tok):
    mt = runner(tok)
    engine = ScriptedEngine(tok, calculator_policy)
    prompts = [tok.encode("23*17="), tok.encode("40*5=")]
    try:
        episodes = mt.run(engine, prompts, SamplingSpec(n=2, max_tokens=40, seed=100))
    finally:
        mt.close()
    assert [e.prompt for e in episodes] == [0, 0, 1, 1]
    first = episodes[0]
    assert tok.decode(first.ids) == "(calc:23*17)=391.391<eos>"
    policy, obs = len("(calc:23*17)"), len("=391.")
    assert first.mask == [1] * policy + [0] * obs + [1] * 4
    assert first.logprobs == [-0.5] * policy + [0.0] * obs + [-0.5] * 4
    assert (first.turns, first.tool_calls, first.tool_errors) == (2, 1, 0)
    assert tok.decode(episodes[3].ids) == "(calc:40*5)=200.200<eos>"
    # stop tokens: EOS and the one-token end of a call; every request has its own seed
    assert {spec.stop_token_ids for _, spec in engine.requests} == {(tok.eos_token_id, tok.convert_tokens_to_ids(")"))}
    seeds = [spec.seed for _, spec in engine.requests]
    assert len(set(seeds)) == len(seeds) == 8
    # the second turn sees the prompt, the call and the tool's answer
    assert engine.requests[4][0] == "23*17=(calc:23*17)=391."


def test_turn_limit_token_limit_and_tool_errors(tok):
    engine = ScriptedEngine(tok, calculator_policy)
    mt = runner(tok, max_turns=1)
    (one,) = mt.run(engine, [tok.encode("2*3=")], SamplingSpec(n=1, max_tokens=40))
    # no tool answer after the last turn
    assert tok.decode(one.ids) == "(calc:2*3)" and one.tool_calls == 0 and one.turns == 1
    mt.close()

    mt = runner(tok, max_response_tokens=14)
    (cut,) = mt.run(engine, [tok.encode("99*99=")], SamplingSpec(n=1, max_tokens=14))
    assert tok.decode(cut.ids) == "(calc:99*99)=9" and cut.mask == [1] * 12 + [0] * 2  # the episode's token limit
    mt.close()

    mt = runner(tok, max_tokens_per_turn=5)
    (turn_cut,) = mt.run(engine, [tok.encode("99*99=")], SamplingSpec(n=1, max_tokens=40))
    assert tok.decode(turn_cut.ids) == "(calc" and turn_cut.turns == 1  # a turn's limit; no call, the episode ends
    mt.close()

    mt = runner(tok, max_observation_tokens=3)
    (short,) = mt.run(engine, [tok.encode("99*99=")], SamplingSpec(n=1, max_tokens=40))
    assert tok.decode(short.ids).startswith("(calc:99*99)=9.")  # the answer cut, its wrapping kept: 3 tokens
    mt.close()

    mt = runner(tok)
    (bad,) = mt.run(ScriptedEngine(tok, lambda t: "0#" if "=" in t else "(calc:9**99)"),
                    [tok.encode("x")], SamplingSpec(n=1, max_tokens=40))
    text = tok.decode(bad.ids).replace("<unk>", "?")
    assert (bad.tool_calls, bad.tool_errors) == (1, 1) and text == "(calc:9**99)=error: ?alue?r.0<eos>", text
    mt.close()


def _hanging(tok, tmp_path, **spec):
    (tmp_path / "slow_tools.py").write_text("import time\n\ndef hang(arguments):\n    time.sleep(600)\n")
    cfg = MultiTurnConfig(**{**SPEC, "enable": True, "tools": (f"{tmp_path / 'slow_tools.py'}:hang",), "max_turns": 2,
                             "max_observation_tokens": 150, **spec})
    return MultiTurn(tok, ToolRunner(list(cfg.tools), 0.3), cfg, max_response_tokens=200)


def test_the_tool_calls_of_a_step_are_bounded_as_a_whole(tok, tmp_path):
    """A tool that hangs: the first call is cut off, and the step's budget (step_tool_time_s) answers the others
    without running them; every one counts as a failure."""
    mt = _hanging(tok, tmp_path, step_tool_time_s=1.0, max_tool_failure_frac=1.0)
    engine = ScriptedEngine(tok, lambda t: "0#" if "=" in t else "(hang:1)")
    try:
        episodes = mt.run(engine, [tok.encode("x")] * 6, SamplingSpec(n=1, max_tokens=200))
    finally:
        mt.close()
    assert [(e.tool_calls, e.tool_errors, e.tool_failures) for e in episodes] == [(1, 1, 1)] * 6
    texts = [tok.decode(e.ids).replace("<unk>", "?") for e in episodes]
    assert texts[0].startswith("(hang:1)=error: hang timed out after 0.3 s")
    assert all(t.startswith("(hang:1)=error: not run: the tool calls of this step took") for t in texts[1:])
    assert mt.first_failure == "hang: error: hang timed out after 0.3 s"


def test_a_turn_stops_calling_a_failing_tool(tok, tmp_path):
    """Past max_tool_failure_frac of a turn's calls failed, the turn's other calls are not run; past it over the
    step, the run stops with one error."""
    mt = _hanging(tok, tmp_path, max_tool_failure_frac=0.3)
    engine = ScriptedEngine(tok, lambda t: "0#" if "=" in t else "(hang:1)")
    try:
        episodes = mt.run(engine, [tok.encode("x")] * 6, SamplingSpec(n=1, max_tokens=200))
    finally:
        mt.close()
    texts = [tok.decode(e.ids).replace("<unk>", "?") for e in episodes]
    assert sum("timed out" in t for t in texts) == 2  # 2 of 6 is more than 0.3: the other 4 are not run
    assert sum("not run: 2 of the 6 tool calls of this turn failed" in t for t in texts) == 4
    failures = sum(e.tool_failures for e in episodes)
    with pytest.raises(ToolsFailed, match="6 of the step's 6 tool calls failed .* more than rollout.multi_turn."
                                          "max_tool_failure_frac=0.3"):
        check_tool_failures(6.0, float(failures), 0.3)
    check_tool_failures(10.0, 3.0, 0.3)  # 0.3 of the calls is not more than 0.3
    check_tool_failures(0.0, 0.0, 0.0)


def test_an_answer_without_a_call_ends_the_episode(tok):
    mt = runner(tok)
    (plain,) = mt.run(ScriptedEngine(tok, lambda t: "42#"), [tok.encode("6*7=")], SamplingSpec(n=1, max_tokens=40))
    assert tok.decode(plain.ids) == "42<eos>" and plain.mask == [1, 1, 1] and plain.turns == 1
    mt.close()


QWEN_LIKE = ("{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
             "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_observation_follows_the_chat_template(tok):
    templated = SimpleNamespace(chat_template=QWEN_LIKE,
                                apply_chat_template=lambda msgs, **kw: _render(msgs, **kw))
    assert _template_parts(templated) == ("<|im_end|>\n", "<|im_start|>user\n<tool_response>\n",
                                          "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert _template_parts(SimpleNamespace(chat_template=None)) is None
    broken = SimpleNamespace(chat_template="x", apply_chat_template=lambda *a, **k: (_ for _ in ()).throw(
        ValueError("no tool role")))
    assert _template_parts(broken) is None


def test_a_long_answer_is_cut_inside_the_templates_wrapping(tok):
    mt = runner(tok)
    mt.template = ("<eos> ", "(tool:", ") assistant:")  # end of turn, tool message, next assistant header
    obs = mt._observation("1234567890" * 3, turn_ended_with_eos=False, limit=24)
    assert len(obs) == 24 and tok.decode(obs) == "<eos> (tool:1234) assistant:"
    after_eos = mt._observation("42", turn_ended_with_eos=True, limit=24)  # the policy wrote the end of its turn
    assert tok.decode(after_eos) == " (tool:42) assistant:"
    mt.close()


def _render(messages, tokenize=False, add_generation_prompt=False):
    from jinja2 import Template

    return Template(QWEN_LIKE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def test_calculator_task_reward_and_demonstrations(tok):
    from verl_mega.data.calculator import calculator_score, generate_calculator
    from verl_mega.data.tasks import generated_task
    from verl_mega.data.warm_start import encode_demonstration
    from verl_mega.rewards import load_reward_fn

    records = generate_calculator(50, seed=3)
    assert records == generate_calculator(50, seed=3) and records != generate_calculator(50, seed=4)
    a, b = map(int, records[0]["prompt"][:-1].split("*"))
    assert records[0]["answer"] == str(a * b) and 10 <= a <= 99 and 10 <= b <= 99
    assert generated_task("generated:calculator").reward_spec == "calculator"
    score = load_reward_fn("calculator").score_one
    assert score("(calc:23*17)=391.391", "391") == 1.0
    assert score("(calc:23*17)=391.390", "391") == 0.0  # the tool's answer is not the policy's
    assert score("391", "391") == 1.0 and score("", "391") == 0.0
    assert calculator_score("(calc:2*2)=4.(calc:4*4)=16.16", "16") == 1.0  # after the last answer

    prompt, response, trained = encode_demonstration(tok, {"prompt": "23*17=", "answer": "391", "demonstration": [
        ["(calc:23*17)", True], ["=391.", False], ["391", True]]})
    assert tok.decode(prompt) == "23*17=" and tok.decode(response) == "(calc:23*17)=391.391<eos>"
    assert trained == [True] * 12 + [False] * 5 + [True] * 4  # the tool's answer is not trained on
    assert encode_demonstration(tok, {"prompt": "1+1=", "answer": "2"})[2] == [True, True]
