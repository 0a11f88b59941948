"""Agentic GRPO (`grpo.environment`): each completion is an episode of several turns in an environment the user writes.

An environment is a class in the user's file, built from each prompt row (one instance per episode):

    class Calculator:
        def __init__(self, row): ...                     # the prompt row as read
        tools = [calculate]                              # optional: plain functions (or methods) with type hints
        def reset(self) -> list[dict]: ...               # optional: the first messages (default: the row's prompt)
        def step(self, message) -> list[dict]: ...       # optional: the answer to a turn without tool calls (the
                                                         #   user's next message), [] or None: the episode is over
        def reward(self, messages) -> float: ...         # the episode's score, from the whole conversation

An episode: the policy writes a turn (up to max_completion_length tokens, sampled as GRPO samples: each turn's noise
from a seed of (train.seed, data step, the prompt's sample, the episode, the turn), so a resumed run and 2 processes
repeat it). Its tool calls are parsed in the model's format and run (finetune/objectives/tools.py), their answers
rendered by the chat template and appended; a turn without calls goes to `step`. The episode ends when `step`
has nothing to say, at max_turns, when the next turn would pass max_episode_tokens, or past episode_timeout. A turn
cut at max_completion_length is closed with its end-of-turn token (context, not trained) and answered as any other.
Only the policy's own tokens are trained: the prompt, the tools' and the environment's answers are context (label
-100). A group's episodes are packed into one row, positions restarting at each, so they never attend to each other.

The tokens of an answer are the chat template's: what it writes after the policy's end-of-turn token when it renders
the conversation with the answer (chatml's newline, the tool's turn, the next generation prompt). The policy's own
tokens are kept as sampled, never re-tokenized.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from finetune.config.errors import UserError
from finetune.data.chat import render
from finetune.data.encoding import prompt_ids
from finetune.data.packing import Prompt, Row
from finetune.model.loading import end_tokens
from finetune.objectives import tools as toolkit
from finetune.objectives.grpo import GRPO, group_row
from finetune.objectives.rewards import Reward, finite, import_named, score
from finetune.objectives.sampling import generate

ENDED = ("answer", "max_turns", "length", "timeout")  # why an episode ended, counted in the step's metrics


def load_environment(spec: str) -> type:
    """The environment class grpo.environment names, imported now (one line if it does not resolve or lacks `reward`)."""
    environment = import_named(spec, {}, key="grpo.environment", kind="class")
    if not callable(getattr(environment, "reward", None)):
        raise UserError(f"grpo.environment: {spec}: the class has no reward(self, messages) method, which scores an episode")
    return environment


def answer_text(tokenizer, messages: list[dict], answers: list[dict], tools: list[dict] | None = None) -> str:
    """The text the chat template writes for `answers` after the policy's last turn, up to the next generation prompt:
    what follows that turn's end-of-turn token when the conversation is rendered with them (the turn's end is found by
    count, not by position: templates rewrite earlier turns, as Qwen3 drops the empty <think> block of a past answer)."""
    end = tokenizer.eos_token
    turns = render(tokenizer, messages, tools=tools).count(end) if end else 0
    after = render(tokenizer, messages + answers, add_generation_prompt=True, tools=tools)
    at = -1
    for _ in range(turns):
        at = after.find(end, at + 1)
    if not turns or at < 0:
        raise UserError(f"grpo.environment: the chat template does not end the policy's turns with the tokenizer's EOS ({end!r}); "
                        "finetune cannot tell where the answers to a turn begin (data.chat_template names another template)")
    return after[at + len(end):]


def check_template(tokenizer) -> None:
    """Before any episode (preflight): the chat template ends an assistant turn with the tokenizer's EOS, where the answers begin."""
    answer_text(tokenizer, [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}],
                [{"role": "user", "content": "And 2 + 2?"}])


@dataclass
class Episode:
    env: object
    prompt: Prompt
    index: int  # the episode's place in its group
    tools: dict[str, Callable]
    schemas: list[dict] | None
    messages: list[dict]  # the conversation so far
    start: int  # how many of the messages the environment gave first
    ids: list[int]
    trained: list[bool]
    turns: int = 0
    cut: int = 0  # turns cut at max_completion_length
    calls: int = 0
    failures: int = 0
    spent: float = 0.0  # seconds inside the environment and its tools
    ended: str = ""

    @property
    def done(self) -> bool:
        return bool(self.ended)


@dataclass
class AgentGRPO(GRPO):
    # The grpo section's settings, passed by `build` (their defaults are the schema's alone).
    environment: type = field(kw_only=True)
    tool_format: str = field(kw_only=True)
    max_episode_tokens: int = field(kw_only=True)
    ends: list[int] = field(default_factory=list)  # where a turn ends (loading.end_tokens), set as episodes are played
    extra_metrics: tuple[str, ...] = field(default=("turns", "cut_turns", "tool_calls", "tool_failures", *(f"ended_{e}" for e in ENDED)),
                                           init=False)
    keeps_sampler_logps = False  # an episode's turns come from several generate calls, between tool answers

    # -- episodes ----------------------------------------------------------------------------------

    def groups(self, model, tokenizer, prompts: list[Prompt], position: int, device) -> list[tuple[Row, dict[str, torch.Tensor]]]:
        g = self.cfg.num_generations
        episodes = self.play(model, tokenizer, [p for p in prompts for _ in range(g)], list(range(g)) * len(prompts), position, device)
        out = []
        for i in range(0, len(episodes), g):
            group = episodes[i : i + g]
            per_function, reward = self.scores(group)
            extra = torch.tensor([[e.turns, e.cut, e.calls, e.failures, *(float(e.ended == why) for why in ENDED)] for e in group], dtype=torch.float32)
            out.append(group_row([(e.ids, e.trained) for e in group], per_function, reward, self.cfg, extra))
        return out

    def play(self, model, tokenizer, prompts: list[Prompt], indices: list[int], position: int | None, device) -> list[Episode]:
        """One episode of each prompt (episode `indices[i]` of its group), all advanced a turn at a time through one
        `generate` call; position None: greedy (evaluation). Sharded weights (synced): every rank runs max_turns calls."""
        if self.tool_format == "auto":
            self.tool_format = toolkit.format_of(tokenizer.chat_template)
        self.ends = end_tokens(model, tokenizer)
        episodes = [self._begin(tokenizer, p, i) for p, i in zip(prompts, indices)]
        for turn in range(self.cfg.max_turns):
            active = [e for e in episodes if not e.done]
            if not active and not self.synced:
                break
            playing = active or episodes[:1]  # sharded weights: a rank with nothing left still takes part in each forward
            sampler = None
            if position is not None:
                seeds = [np.random.SeedSequence([self.seed, position, e.prompt.sample, e.index, turn]).generate_state(1, np.uint64)[0]
                         for e in playing]
                sampler = self.sampler(torch.as_tensor(np.array(seeds).view(np.int64), device=device))
            completions = generate(model, tokenizer, [np.asarray(e.ids) for e in playing], self.cfg.max_completion_length, device, sampler,
                                   synced=self.synced, cache=self.cfg.kv_cache)
            for episode, completion in zip(active, completions):
                self._advance(tokenizer, episode, completion, turn)
        return episodes

    def _begin(self, tokenizer, prompt: Prompt, index: int) -> Episode:
        where = self._where(prompt)
        env = self._call(where, "__init__", lambda: self.environment(prompt.row))
        functions = list(getattr(env, "tools", None) or [])
        tools = {getattr(f, "__name__", str(f)): f for f in functions}
        schemas = self._call(where, "tools", lambda: toolkit.schemas(tools)) if tools else None
        if hasattr(env, "reset"):
            messages = self._call(where, "reset", env.reset)
            self._check_messages(messages, where, "reset", may_end=False)
        else:
            messages = prompt.row["prompt"]
            if isinstance(messages, str):  # a text prompt: the user's message
                messages = [{"role": "user", "content": messages}]
        ids = prompt_ids({"prompt": messages, "tools": schemas}, tokenizer)
        return Episode(env, prompt, index, tools, schemas, list(messages), len(messages), list(ids), [False] * len(ids))

    def _advance(self, tokenizer, episode: Episode, completion: list[int], turn: int) -> None:
        """Append the policy's turn, then the answer to it (tool results or the environment's), or end the episode."""
        episode.ids += completion
        episode.trained += [True] * len(completion)
        episode.turns += 1
        finished = bool(completion) and completion[-1] in (self.ends or [tokenizer.eos_token_id])
        text = tokenizer.decode(completion[:-1] if finished else completion, skip_special_tokens=False)
        parsed = toolkit.parse(text, self.tool_format)
        message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [c.as_message_part() for c in parsed.calls]
        episode.messages.append(message)
        if not finished:  # cut at max_completion_length: closed with its end-of-turn token (context, not trained), then answered
            episode.cut += 1
            episode.ids.append(tokenizer.eos_token_id)
            episode.trained.append(False)
        started = time.perf_counter()
        if parsed.calls or parsed.errors:
            answers = self._tool_answers(episode, parsed)
        else:
            where = self._where(episode.prompt)
            answers = self._call(where, "step", lambda: episode.env.step(message)) if hasattr(episode.env, "step") else None
            self._check_messages(answers, where, "step", may_end=True)
        episode.spent += time.perf_counter() - started
        if episode.ended:
            return
        if not answers:
            episode.ended = "answer"
        elif turn + 1 >= self.cfg.max_turns:
            episode.ended = "max_turns"
        elif episode.spent > self.cfg.episode_timeout:
            episode.ended = "timeout"
        else:
            observed = self._answer_ids(tokenizer, episode, list(answers))
            if len(episode.ids) + len(observed) + self.cfg.max_completion_length > self.max_episode_tokens:
                episode.ended = "length"
                return
            episode.messages += answers
            episode.ids += observed
            episode.trained += [False] * len(observed)

    def _tool_answers(self, episode: Episode, parsed: toolkit.Parsed) -> list[dict]:
        """The tool messages answering a turn's calls. A call past grpo.tool_timeout ends the episode ("timeout") and the
        turn's later calls are not run: its thread may still change the environment, which is used again (its reward) only
        once that thread has ended (waited for up to grpo.episode_timeout in all)."""
        answers = [{"role": "tool", "content": f"invalid tool call: {why}"} for why in parsed.errors]
        episode.calls += len(parsed.errors)
        episode.failures += len(parsed.errors)
        for call in parsed.calls:
            answer = toolkit.run(episode.tools, call, self.cfg.tool_timeout)
            answers.append({"role": "tool", "name": call.name, "content": answer.text})
            episode.calls += 1
            episode.failures += answer.failed
            if answer.running is not None:
                episode.ended = "timeout"
                left = max(0.0, self.cfg.episode_timeout - episode.spent - self.cfg.tool_timeout)
                answer.running.join(left)
                if answer.running.is_alive():
                    raise UserError(f"grpo.environment: {self.cfg.environment}: the tool {call.name} still ran past grpo.episode_timeout "
                                    f"({self.cfg.episode_timeout:g} s; the episode of {self._where(episode.prompt)}), so its environment "
                                    "cannot be scored while it may change; make the tool return or raise within grpo.episode_timeout")
                break
        return answers

    def _check_messages(self, messages, where: str, method: str, may_end: bool) -> None:
        """What reset (a non-empty list) or step (a list, or [] / None: the episode is over) returned: messages."""
        if may_end and (messages is None or messages == []):
            return
        good = isinstance(messages, list) and bool(messages)
        bad = next((m for m in messages if not (isinstance(m, dict) and isinstance(m.get("role"), str))), None) if good else None
        if good and bad is None:
            return
        got = f"a list holding {type(bad).__name__} {str(bad)[:60]!r}" if good else repr(messages) if isinstance(messages, list) \
            else type(messages).__name__
        raise UserError(f"grpo.environment: {self.cfg.environment}.{method}() returned {got} for the episode of {where}; expected a "
                        + ("list of messages ({'role': ..., 'content': ...}), or [] / None to end the episode" if may_end
                           else "non-empty list of messages ({'role': ..., 'content': ...})"))

    def _answer_ids(self, tokenizer, episode: Episode, answers: list[dict]) -> list[int]:
        return tokenizer(answer_text(tokenizer, episode.messages, answers, episode.schemas), add_special_tokens=False)["input_ids"]

    # -- rewards -----------------------------------------------------------------------------------

    def scores(self, episodes: list[Episode]) -> tuple[torch.Tensor, torch.Tensor]:
        """(each reward's value for each episode: the environment's first, the episodes' weighted sums)."""
        env = []
        for e in episodes:
            value = self._call(self._where(e.prompt), "reward", lambda e=e: e.env.reward(e.messages))
            env.append([finite(value, f"grpo.environment: {self.cfg.environment}: reward()", f"an episode of {self._where(e.prompt)}")])
        functions = self.rewards[1:]
        table = env
        if functions:
            rows = [{**e.prompt.row, "tool_calls": e.calls, "tool_failures": e.failures} for e in episodes]
            scored = score(functions, [e.messages[: e.start] for e in episodes], [e.messages[e.start :] for e in episodes],
                           [[t for t, keep in zip(e.ids, e.trained) if keep] for e in episodes], rows, lambda i: self._where(episodes[i].prompt))
            table = [a + b for a, b in zip(env, scored)]
        per_function = torch.tensor(table, dtype=torch.float32)
        return per_function, (per_function * torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)).sum(1)

    def greedy_scores(self, model, tokenizer, prompts: list[Prompt], device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        episodes = self.play(model, tokenizer, prompts, [0] * len(prompts), None, device)
        per_function, reward = self.scores(episodes)
        return [(per_function[i : i + 1], reward[i : i + 1]) for i in range(len(episodes))]

    def _where(self, prompt: Prompt) -> str:
        return (self.locate or (lambda sample: f"sample {sample}"))(prompt.sample)

    def _call(self, where: str, what: str, function: Callable):
        """The environment's code, run for up to grpo.episode_timeout: its failure, or its running past that, is bad input,
        named with its row (a tool's failure is the model's observation)."""
        outcome = toolkit.bounded(function, self.cfg.episode_timeout, f"environment {what}")
        if outcome.running is not None:
            raise UserError(f"grpo.environment: {self.cfg.environment}.{what} did not return within grpo.episode_timeout "
                            f"({self.cfg.episode_timeout:g} s; the episode of {where})")
        if isinstance(outcome.error, UserError):
            raise outcome.error
        if outcome.error is not None:
            err = outcome.error
            raise UserError(f"grpo.environment: {self.cfg.environment}.{what} raised {type(err).__name__}: {err} (the episode of {where})")
        return outcome.value


def agent_objective(g, rewards: list[Reward], seed: int, locate=None, synced: bool = False) -> AgentGRPO:
    """GRPO over episodes of the environment grpo.environment names (its reward first, then the reward functions')."""
    own = Reward("environment", "reward_environment", 1.0, None)
    return AgentGRPO(g, [own, *rewards], seed, locate=locate, synced=synced, environment=load_environment(g.environment),
                     tool_format=g.tool_format, max_episode_tokens=g.max_episode_tokens)
