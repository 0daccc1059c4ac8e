"""Multi-turn episodes: generation alternating with an environment (actor/environments/), NeMo-RL style.

Every sample of a generation batch starts as its prompt. Each turn, the samples still running generate a response
(up to policy.generation.max_new_tokens, stopping at EOS, the stop tokens, policy.generation.stop_strings and the
stop strings the environment asked for); the environment answers all of them at once; its observation is tokenized
with the policy tokenizer and appended. A sample leaves when the environment terminates it, when another turn would
not fit the policy's context (or the critic's, when shorter), or after ppo.max_rollout_turns turns.

The result is an ordinary `Rollout` whose `policy_mask` is 1 only on the actions the policy sampled, so the loss,
the KL, the critic's targets and every estimator see assistant tokens only, and whose `rewards` are each episode's
summed environment rewards; the trainer's step is the same as for single-turn rollouts.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from serving.modeling import right_pad

from .clients import RemoteError, RewardClient, Scores
from .config import ActorConfig
from .data import Prompt
from .environments import (
    BadEnvironment,
    Environment,
    EnvironmentContext,
    EnvironmentStep,
    Message,
    build_environment,
)
from .generation import Rollout, SamplingParams
from .rollouts import RolloutCollector, derived_seed

log = logging.getLogger(__name__)
T = TypeVar("T")


class EnvironmentThread:
    """One thread of the environment's own that runs its constructor and every step, so that the actor can wait for
    a step with a timeout (env.step_timeout_s) instead of hanging with it (a sandbox that never answers, a deadlock
    in the user's code). Always the same thread: an environment holding thread-bound resources (an sqlite
    connection, say) finds them on the thread that made them. A daemon thread: a step that never returns does not
    keep the process from exiting once the run has stopped."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=f"environment {name}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, future = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - SystemExit too: the caller decides what each means
                future.set_exception(e)

    def call(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """fn() on the environment's thread; its exception re-raised here; TimeoutError past `timeout_s`."""
        future: Future = Future()
        self._calls.put((fn, future))
        return future.result(timeout_s)


@dataclass
class Episode:
    """One sample's episode so far: its token ids, which of them the policy sampled (with their generation
    log-probs), its messages and environment metadata, the summed reward, and whether it is over."""

    ids: list[int]
    messages: list[Message]
    metadata: dict[str, Any]
    sampled: list[bool] = field(default_factory=list)  # per token: the policy sampled it
    logprobs: list[float] = field(default_factory=list)  # per token: its generation log-prob (0 if not sampled)
    reward: float = 0.0
    turns: int = 0
    ended: bool = True  # every turn ended with EOS, a stop token or a stop string
    done: bool = False
    stop_strings: tuple[str, ...] = ()  # the environment's stop strings for the next turn

    @classmethod
    def start(cls, prompt_ids: list[int], prompt_text: str, label: Any) -> Episode:
        return cls(list(prompt_ids), [Message("user", prompt_text, tuple(prompt_ids))], {"label": label},
                   [False] * len(prompt_ids), [0.0] * len(prompt_ids))

    @property
    def prompt_length(self) -> int:
        return len(self.messages[0].token_ids)

    def add_turn(self, ids: list[int], logprobs: list[float], ended: bool, text: str) -> None:
        """A policy turn: `ids` sampled with generation log-probs `logprobs`, `ended` by a stop."""
        self.ids += ids
        self.sampled += [True] * len(ids)
        self.logprobs += logprobs
        self.messages.append(Message("assistant", text, tuple(ids)))
        self.turns += 1
        self.ended = self.ended and ended

    def add_observation(self, ids: list[int], text: str) -> None:
        """The environment's answer, appended for the next turn (masked out of the loss and the KL)."""
        self.ids += ids
        self.sampled += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.messages.append(Message("environment", text, tuple(ids)))


def episodes_to_rollout(episodes: list[Episode], pad_id: int) -> Rollout:
    """Episodes -> a right-padded `Rollout` [B, S]: `policy_mask` and `logprobs` float32 [B, S-1] (action t
    produced token t+1: 1 and its generation log-prob where the policy sampled it, 0 on the prompt, observations
    and padding), `rewards` float32 [B] the summed environment rewards, `ended` bool [B] every turn ended with a
    stop, `prompt_lengths` the original prompts'."""
    tokens, lengths = right_pad([e.ids for e in episodes], pad_id)
    width = tokens.shape[1] - 1
    mask = torch.zeros((len(episodes), width), dtype=torch.float32)
    logprobs = torch.zeros((len(episodes), width), dtype=torch.float32)
    for i, e in enumerate(episodes):
        n = len(e.ids) - 1
        mask[i, :n] = torch.tensor(e.sampled[1:], dtype=torch.float32)
        logprobs[i, :n] = torch.tensor(e.logprobs[1:], dtype=torch.float32)
    return Rollout(tokens, lengths, torch.tensor([e.prompt_length for e in episodes]),
                   torch.tensor([e.ended for e in episodes]), logprobs, mask,
                   torch.tensor([e.reward for e in episodes], dtype=torch.float32))


def count_turns(mask: torch.Tensor) -> torch.Tensor:
    """int64 [B]: the number of runs of 1s in each row of `mask` ([B, T], 0/1): the policy turns of an episode."""
    m = mask.bool()
    starts = m & ~torch.nn.functional.pad(m[:, :-1], (1, 0), value=False)
    return starts.sum(1)


def episode_metrics(mask: torch.Tensor) -> dict[str, float]:
    """`train_rollouts/turns` (policy turns per sample) and `train_rollouts/assistant_tokens` (tokens the policy
    sampled per sample; `response_lengths` counts observations too), averaged over the step's samples."""
    return {"train_rollouts/turns": float(count_turns(mask).float().mean()),
            "train_rollouts/assistant_tokens": float(mask.sum(1).mean())}


class _Ready:
    """A reward result that is already there (the environment's), in the shape of a pending reward request."""

    def __init__(self, scores: Scores):
        self.scores = scores

    def done(self) -> bool:
        return True

    def result(self) -> Scores:
        return self.scores


def environment_rewards(r: Rollout, prompts: list[Prompt], labels: list[Any] | None) -> _Ready:
    """The rewards the episodes of `r` earned, as the collector's reward request."""
    assert r.rewards is not None
    return _Ready((r.rewards, {}))


class MultiTurnCollector(RolloutCollector):
    """A `RolloutCollector` whose generation batches are multi-turn episodes with `environment`; critic values,
    log-probs, dynamic sampling and the batch layout are the single-turn collector's."""

    def __init__(self, *, environment: Environment, env_thread: EnvironmentThread, step_timeout_s: float | None,
                 tokenizer: PreTrainedTokenizerBase, max_turns: int, max_length: int, **kwargs: Any):
        super().__init__(**kwargs)
        self.environment, self.env_thread, self.step_timeout_s = environment, env_thread, step_timeout_s
        self.tokenizer, self.max_turns, self.max_length = tokenizer, max_turns, max_length
        self.score = environment_rewards
        self.where = type(environment).__name__

    def generate_rows(self, prompts: list[Prompt], params: SamplingParams, seed: int) -> Rollout:
        """One generation batch of episodes (a sample per prompt), as a Rollout with `policy_mask` and `rewards`."""
        episodes = [Episode.start(p.ids, self.tokenizer.decode(p.ids, skip_special_tokens=True), p.label)
                    for p in prompts]
        cut = 0  # episodes ended because the environment's observation and another turn would not fit the context
        for turn in range(self.max_turns):
            running = [e for e in episodes if not e.done]
            if not running:
                break
            self._policy_turn(running, params, derived_seed(seed, 1_000_003, turn * 7_919))
            with self.timers("environment"):  # part of timers/generate
                try:
                    step = self.env_thread.call(partial(self.environment.step, [e.messages for e in running],
                                                        [e.metadata for e in running]), self.step_timeout_s)
                except TimeoutError:
                    raise BadEnvironment(
                        f"{self.where}.step did not return within env.step_timeout_s={self.step_timeout_s:g} s "
                        f"({len(running)} samples, turn {turn + 1}): the environment hangs or is too slow; raise "
                        f"env.step_timeout_s (null waits as long as it takes)") from None
                except RemoteError:
                    raise  # its scorer's server is away: handled as any server outage
                except (Exception, SystemExit, KeyboardInterrupt) as e:  # the user's code failed (an exit in it
                    # would end the run with exit 0, unsaved): the trainer keeps the last finished step
                    raise BadEnvironment(f"{self.where}.step raised {type(e).__name__}: {e}") from e
            if not isinstance(step, EnvironmentStep):
                raise BadEnvironment(f"{self.where}.step returned a {type(step).__name__}, not an EnvironmentStep")
            step.check(len(running), self.where)
            last_turn = turn + 1 == self.max_turns
            for e, obs, reward, term, stops, meta in zip(running, step.observations, step.rewards.tolist(),
                                                         step.terminated.tolist(), step.next_stop_strings,
                                                         step.metadata, strict=True):
                e.reward += reward
                e.metadata = meta
                if term or last_turn:
                    e.done = True
                    continue
                obs_ids = self.tokenizer(obs, add_special_tokens=False)["input_ids"] if obs else []
                if len(e.ids) + len(obs_ids) + params.max_new_tokens > self.max_length:
                    e.done = True  # another turn would not fit the policy's context
                    cut += 1
                    continue
                e.add_observation(obs_ids, obs)
                e.stop_strings = tuple(stops or ())
        if cut:
            log.warning("%d of %d episodes ended before ppo.max_rollout_turns: %s's observation and another turn of "
                        "policy.generation.max_new_tokens would pass the policy's context of %d tokens", cut,
                        len(episodes), self.where, self.max_length)
        return episodes_to_rollout(episodes, self.pad_id)

    def _policy_turn(self, running: list[Episode], params: SamplingParams, seed: int) -> None:
        """Generate one turn for every running episode; episodes asking for the same stop strings share a call."""
        by_stops: dict[tuple[str, ...], list[Episode]] = {}
        for e in running:
            by_stops.setdefault(e.stop_strings, []).append(e)
        for k, (stops, group) in enumerate(by_stops.items()):
            turn_params = replace(params, stop_strings=params.stop_strings + stops) if stops else params
            r = self.backend.generate([e.ids for e in group], turn_params, seed=derived_seed(seed, 1, k))
            for i, e in enumerate(group):
                start, end = len(e.ids), int(r.lengths[i])
                ids = r.tokens[i, start:end].tolist()
                assert r.logprobs is not None
                e.add_turn(ids, r.logprobs[i, start - 1:end - 1].tolist(), bool(r.ended[i]),
                           self.tokenizer.decode(ids, skip_special_tokens=True))


def multi_turn_collector(cfg: ActorConfig, tokenizer: PreTrainedTokenizerBase, reward: RewardClient | None,
                         max_length: int) -> partial[MultiTurnCollector]:
    """The collector class for a run with `env.name` set: MultiTurnCollector bound to its environment, taking the
    single-turn collector's keyword arguments."""
    assert cfg.env.name is not None
    thread = EnvironmentThread(cfg.env.name)  # built where it will step: on its own thread
    env = thread.call(partial(build_environment, cfg.env.name, cfg.env.options,
                              EnvironmentContext(tokenizer, reward if cfg.env.uses_reward_server else None)))
    log.info("multi-turn episodes with env.name=%s, up to ppo.max_rollout_turns=%d turns; the environment gives "
             "the rewards", cfg.env.name, cfg.ppo.max_rollout_turns)
    return partial(MultiTurnCollector, environment=env, env_thread=thread, step_timeout_s=cfg.env.step_timeout_s,
                   tokenizer=tokenizer, max_turns=cfg.ppo.max_rollout_turns, max_length=max_length)
