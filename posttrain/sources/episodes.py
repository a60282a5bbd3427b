"""Multi-turn episodes on any rollout engine that takes stop sequences: the model and an environment take turns, and
the trajectory is one token sequence (docs/environments.md).

Each turn, every episode still running is continued by the engine from its whole trajectory so far, until a stop
token, one of the environment's `stop` strings (a tool call's closing tag), the turn's budget or the episode's.
The environment reads the turn (`Environment.step`, in a bounded worker process) and replies; its reply is
rendered, by the chat template as a message or plainly by `Environment.render`, tokenised, and appended as ids. The
model's tokens are kept exactly as sampled, never decoded and encoded again, so what the model trains on is what it
sampled from.

Every call into an environment is bounded by `env.timeout_s` (posttrain.environments.base), and a failed one is an
observation: a step that raises, hangs, or returns something other than a `Reply` with a finite reward is answered
with `error: the environment failed (...)`; an episode whose environment could not be created or reset is still
sampled, and each of its turns is answered with why, its environment never asked to step. `errors` counts the failed
calls: a failed start once, each failed step once. The class is checked once as the episodes are built
(`environments.check`), so that one which cannot be created or pickled is one line before a run starts.

The batch that comes back is a rollout record like a single-turn one, with one difference: the response holds the
environment's tokens between the model's turns, and `mask` (with `model_tokens`) is 1 on the model's tokens only.
Every method's gradient coefficient multiplies the mask, so the environment's tokens get a GC of exactly 0, and
token means count the model's tokens. Their log-probs under the sampler are 0, and no method reads them. Each
episode's environment rewards, summed, are `extra["env_reward"]`; with `turns` (rewards.process=turns, for GRPO+PS)
each turn's is also on its last token (`extra["turn_reward"]`, `["turn_end"]`), where the online source adds the
outcome rewards to the last turn's.

`env.check_template=true` checks every turn that the conversation so far, rendered and tokenised, equals the
trajectory's ids, and stops at the first position where it does not: a template that renders an earlier turn
differently from how it was sampled (drift), or a tokenisation that merges across a turn's edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain import environments
from posttrain.core.batch import Batch, left_pad
from posttrain.core.bounded import BoundedPool
from posttrain.core.errors import ConfigError
from posttrain.data import prompt_messages, uses_chat
from posttrain.rollout.base import counts
from posttrain.schema import DataConfig, EnvConfig
from posttrain.stages.step_rewards import TURN_END, TURN_REWARD


@dataclass
class Episode:
    """One trajectory as it grows: its prompt ids, the response's ids, which of them are the model's, the sampler's
    log-probs, and the conversation as messages (for the chat template)."""

    env: object  # None where it failed to start
    prompt: list[int]
    messages: list[dict]
    ids: list[int] = field(default_factory=list)
    model: list[float] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    truncated: bool = False
    errors: int = 0
    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    turn_ends: list[int] = field(default_factory=list)  # the index in `ids` of each model turn's last token
    turn_rewards: list[float] = field(default_factory=list)  # the environment's reward for each of those turns
    version: int | None = None  # the oldest policy version that sampled a turn (rollout workers say; else None)
    failed: str | None = None  # why its environment could not start: every turn's reply says so

    def add(self, ids: list[int], logp: list[float] | None) -> None:
        self.ids += ids
        self.model += [1.0 if logp is not None else 0.0] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)
        if logp is not None and ids:
            self.turn_ends.append(len(self.ids) - 1)
            self.turn_rewards.append(0.0)


class Episodes:
    """Runs the episodes of a batch of prompts turn by turn on `engine` in the environment class `env_cls`."""

    def __init__(self, engine, env_cls, settings: EnvConfig, tokenizer, data: DataConfig, *, pad_id: int,
                 stop_ids: list[int], pool: BoundedPool | None = None, turns: bool = False):
        if not engine.stops:
            raise ConfigError(f"env.name: the {engine.name} engine cannot stop a turn at the environment's strings "
                              "(multi-turn rollouts run on rollout.engine=hf or vllm)")
        self.engine, self.env_cls, self.settings = engine, env_cls, settings
        self.tokenizer, self.data, self.pad_id, self.stop_ids = tokenizer, data, pad_id, list(stop_ids)
        self.chat = uses_chat(tokenizer, data)
        self.stop = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in env_cls.stop]
        self.pool = pool or environments.pool_for(env_cls)  # this process's, for a class given from Python
        self.turns = turns  # put each turn's reward on its last token (rewards.process=turns)
        environments.check(env_cls, settings, self.pool)  # one that cannot be created or pickled: one line, now

    def generate(self, rows: list[dict], prompts: list[list[int]], n: int | list[int], *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False) -> tuple[Batch, dict]:
        """`n` episodes of each prompt (or n[i] of prompt i), rows ordered as `generate`'s; and their metrics."""
        sizes = counts(n, len(prompts))
        group = [i for i, k in enumerate(sizes) for _ in range(k)]
        episodes = [Episode(None, list(prompts[i]), prompt_messages(rows[i], self.data)) for i in group]
        starts = self.pool.map(environments.start_function(self.env_cls), [(self.settings, rows[i]) for i in group],
                               self.settings.timeout_s)
        for e, outcome in zip(episodes, starts):
            if outcome.ok:
                e.env = outcome.value
            else:  # the episode is sampled all the same: the model reads why at each turn (docs/environments.md)
                e.failed, e.errors = f"reset: {outcome.error}", 1
        turn_budget = self.settings.max_turn_tokens or max_new_tokens
        for turn in range(self.settings.max_turns):
            running = [e for e in episodes if not e.done]
            if not running:
                break
            limit = max(min(turn_budget, max_new_tokens - len(e.ids)) for e in running)
            out = self.engine.generate([e.prompt + e.ids for e in running], 1, max_new_tokens=limit,
                                       temperature=temperature, top_p=top_p, greedy=greedy, stop=self.stop)
            response, keep, logp = out.response_ids.tolist(), out.mask.bool().tolist(), out.rollout_logp.tolist()
            versions = out.version.tolist() if out.version is not None else [None] * len(running)
            asked = []  # (episode, text, ids, ended) whose turn the environment answers
            for e, ids, kept, lp, version in zip(running, response, keep, logp, versions):
                if version is not None:  # rollout workers may sample a later turn with newer weights
                    e.version = version if e.version is None else min(e.version, version)
                length = min(sum(kept), max_new_tokens - len(e.ids), turn_budget)
                ids, lp = ids[:length], lp[:length]
                e.add(ids, lp)
                e.turns += 1
                ended = bool(ids) and ids[-1] in self.stop_ids
                called = any(len(s) and ids[-len(s):] == s for s in self.stop) and not ended
                if not (ended or called):  # the turn's or the episode's budget ran out mid-turn
                    e.done = e.truncated = True
                else:
                    asked.append((e, self.tokenizer.decode(ids, skip_special_tokens=True), ids, ended))
            self._answer(asked, last=turn == self.settings.max_turns - 1, max_new_tokens=max_new_tokens)
        return self._batch(episodes, group), self._metrics(episodes)

    def _answer(self, asked: list, *, last: bool, max_new_tokens: int) -> None:
        """The environment's replies to the turns in `asked`, appended to their episodes (those that go on)."""
        if not asked:
            return
        live = [(e.env, text, ids, ended) for e, text, ids, ended in asked if e.failed is None]
        outcomes = iter(self.pool.map(environments.step_function(self.env_cls, render=not self.chat), live,
                                      self.settings.timeout_s))
        for e, _text, ids, ended in asked:
            reply, rendered, why = None, None, e.failed  # an environment that never started is not asked
            if why is None:
                outcome = next(outcomes)
                if outcome.ok:
                    env, reply, rendered, why = outcome.value  # why: a reply that breaks step's contract
                    if why is None:
                        e.env = env
                else:
                    why = outcome.error
                e.errors += 0 if why is None else 1
            if why is not None:  # it raised, hung or broke the contract: the model reads why, the episode goes on;
                # the reply is plain text (under a chat template, a user message), not rendered by what failed
                reply = environments.Reply(text=f"error: the environment failed ({why})")
                rendered = reply.text
            e.reward += float(reply.reward)
            e.turn_rewards[-1] += float(reply.reward)  # the turn just sampled: one the environment reads is not empty
            for k, v in reply.info.items():
                e.info[k] = e.info.get(k, 0.0) + float(v)
            if ended or reply.done:
                e.done = True
                continue
            if last:  # a tool call left unanswered: the episode ran out of turns without an answer
                e.done = e.truncated = True
                continue
            reply_ids = self._render(e, ids, reply, rendered)
            if len(e.ids) + len(reply_ids) >= max_new_tokens:  # no room left for the model to answer
                e.done = e.truncated = True
                continue
            e.add(reply_ids, None)
            if self.settings.check_template:
                self._check(e)

    def _render(self, e: Episode, ids: list[int], reply, rendered: str | None) -> list[int]:
        """The environment's reply as token ids to append after the model's turn: under a chat template, what the
        template writes after the model's text (the end of the assistant's turn, the reply's message, the start of
        the next assistant turn); without one, `rendered`, the environment's `render` of it (run in the worker with
        its step), as is."""
        if not self.chat:
            return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        turn = self.tokenizer.decode(ids, skip_special_tokens=False)
        before = self._chat(e.messages) + turn
        e.messages = [*e.messages, {"role": "assistant", "content": turn}, {"role": reply.role, "content": reply.text}]
        after = self._chat(e.messages)
        if not after.startswith(before):
            at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(after))
            raise ConfigError(f"env.name: the chat template renders the conversation differently once the "
                              f"environment has replied (character {at}: {before[at:at + 30]!r} became "
                              f"{after[at:at + 30]!r}); it cannot be extended turn by turn")
        return self.tokenizer(after[len(before):], add_special_tokens=False)["input_ids"]

    def _chat(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _check(self, e: Episode) -> None:
        """env.check_template: the conversation so far, rendered and tokenised, is the trajectory's ids."""
        if self.chat:
            rendered = self.tokenizer(self._chat(e.messages), add_special_tokens=False)["input_ids"]
        else:
            text = self.tokenizer.decode(e.prompt, skip_special_tokens=True) + self.tokenizer.decode(
                e.ids, skip_special_tokens=True)
            rendered = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            specials = set(self.tokenizer.all_special_ids)
            lead = 0
            while lead < len(e.prompt) and e.prompt[lead] in specials:  # BOS: kept by the prompt, not by decode
                lead += 1
            rendered = e.prompt[:lead] + rendered
        sampled = e.prompt + e.ids
        if rendered != sampled:
            at = next((i for i, (a, b) in enumerate(zip(rendered, sampled)) if a != b), min(len(rendered),
                                                                                               len(sampled)))
            where = "the prompt" if at < len(e.prompt) else f"response token {at - len(e.prompt)}"
            show = self.tokenizer.convert_ids_to_tokens
            raise ConfigError(f"env.check_template: turn {e.turns}: the rendered conversation tokenises differently "
                              f"from the trajectory at {where} (rendered {show(rendered[at:at + 3])}, sampled "
                              f"{show(sampled[at:at + 3])})")

    def _batch(self, episodes: list[Episode], group: list[int]) -> Batch:
        prompt_ids, prompt_mask = left_pad([e.prompt for e in episodes], self.pad_id)  # [B, P] x2
        R = max(1, max(len(e.ids) for e in episodes))

        def right(values: list[list], fill, dtype) -> torch.Tensor:
            return torch.tensor([v + [fill] * (R - len(v)) for v in values], dtype=dtype)  # [B, R]

        response = right([e.ids for e in episodes], self.pad_id, torch.long)
        real = right([[1] * len(e.ids) for e in episodes], 0, torch.long)
        model = right([e.model for e in episodes], 0.0, torch.float32)
        extra = {"env_reward": torch.tensor([e.reward for e in episodes], dtype=torch.float32)}  # [B]
        if self.turns:
            reward, end = torch.zeros(len(episodes), R), torch.zeros(len(episodes), R)  # [B, R] x2
            for i, e in enumerate(episodes):
                reward[i, e.turn_ends], end[i, e.turn_ends] = torch.tensor(e.turn_rewards), 1.0
            extra.update({TURN_REWARD: reward, TURN_END: end})
        versions = [e.version for e in episodes]
        return Batch(
            input_ids=torch.cat([prompt_ids, response], 1), attention_mask=torch.cat([prompt_mask, real], 1),
            mask=model, prompt_len=prompt_ids.shape[1], group=torch.tensor(group, dtype=torch.long),
            truncated=torch.tensor([e.truncated for e in episodes]),
            rollout_logp=right([e.logp for e in episodes], 0.0, torch.float32), model_tokens=model.clone(),
            extra=extra, version=None if None in versions else torch.tensor(versions, dtype=torch.long))

    @staticmethod
    def _metrics(episodes: list[Episode]) -> dict:
        n = len(episodes)
        out = {"env/turns": sum(e.turns for e in episodes) / n,
               "env/env_tokens": sum(len(e.model) - sum(e.model) for e in episodes) / n,
               "env/errors": float(sum(e.errors for e in episodes)),
               "env/reward": sum(e.reward for e in episodes) / n}
        for name in sorted({k for e in episodes for k in e.info}):
            out[f"env/{name}"] = sum(e.info.get(name, 0.0) for e in episodes) / n
        return out


def episodes_for(env: EnvConfig, engine, tokenizer, data: DataConfig, stop_ids: list[int],
                 turns: bool = False) -> Episodes | None:
    """The episodes a run or an evaluation samples with `env.name`, each turn's reward on its tokens with `turns`;
    None without one (single completions)."""
    if env.name is None:
        return None
    return Episodes(engine, environments.get(env.name), env, tokenizer, data, pad_id=tokenizer.pad_token_id,
                    stop_ids=list(stop_ids), turns=turns)

