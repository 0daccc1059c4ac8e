"""Environments for multi-turn episodes, in NeMo-RL's shape: the actor alternates a policy turn with an
environment step for every sample still running, and the environment's rewards are the sample rewards.

An environment is a class with an `Options` model (its keys in the `env` section of the config, beside `name`) and
`step(message_logs, metadata) -> EnvironmentStep`, batched over the samples still running. Built-in environments
are chosen by name (`ENVIRONMENTS`); `env.name: package.module:Class` imports any other class with the same shape.
docs/environments.md says how to write one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from serving.config import StrictModel

Role = Literal["user", "assistant", "environment"]


@dataclass(frozen=True)
class Message:
    """One message of an episode: the prompt (`user`), a policy turn (`assistant`, its text decoded without special
    tokens) or an observation (`environment`), with the policy tokenizer's ids it occupies in the sequence."""

    role: Role
    text: str
    token_ids: tuple[int, ...]


@dataclass
class EnvironmentStep:
    """An environment's answer for N samples, in the order they were given.

    observations: the text appended to each sample's sequence before its next turn ("" appends nothing); ignored
        for terminated samples. Tokenized on its own with the policy tokenizer, no special tokens added, and appended
        as is: start it with a space where the tokenizer marks word starts with one (byte-level BPE).
    rewards: float32 [N], this turn's reward; a sample's reward is the sum over its turns (NeMo-RL's rule).
    terminated: bool [N], the sample's episode is over.
    next_stop_strings: per sample, stop strings for its next turn besides policy.generation's own (None: none).
    metadata: per sample, handed back to the next `step` of the same sample.
    """

    observations: list[str]
    rewards: torch.Tensor
    terminated: torch.Tensor
    next_stop_strings: list[list[str] | None]
    metadata: list[dict[str, Any]]

    def check(self, n: int, where: str) -> None:
        """Raise BadEnvironment naming the field when the step does not answer exactly `n` samples, or answers
        with the wrong types (the class docstring's)."""
        for name in ("rewards", "terminated"):
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor) or x.dim() != 1:
                got = f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise BadEnvironment(f"{where}.step: {name} must be a 1-D tensor [N], got {got}")
        if self.terminated.dtype != torch.bool:  # a float 0.3 (or NaN) read as True ended every episode
            raise BadEnvironment(f"{where}.step: terminated must be a bool tensor, got {self.terminated.dtype}")
        for name in ("observations", "next_stop_strings", "metadata"):
            if not isinstance(getattr(self, name), list | tuple):
                raise BadEnvironment(f"{where}.step: {name} must be a list, got {type(getattr(self, name)).__name__}")
        sizes = {"observations": len(self.observations), "rewards": self.rewards.numel(),
                 "terminated": self.terminated.numel(), "next_stop_strings": len(self.next_stop_strings),
                 "metadata": len(self.metadata)}
        wrong = {k: v for k, v in sizes.items() if v != n}
        if wrong:
            raise BadEnvironment(f"{where}.step was given {n} samples but answered {wrong}")
        if not bool(torch.isfinite(self.rewards.float()).all()):
            raise BadEnvironment(f"{where}.step returned non-finite rewards {self.rewards.tolist()}")
        if any(not isinstance(o, str) for o in self.observations):
            raise BadEnvironment(f"{where}.step: every observation must be a str ('' appends nothing), got "
                                 f"{self.observations!r}")
        # a bare string would be taken apart into one-character stop strings
        if any(s is not None and (not isinstance(s, list | tuple) or not all(isinstance(x, str) and x for x in s))
               for s in self.next_stop_strings):
            raise BadEnvironment(f"{where}.step: next_stop_strings holds, per sample, None or a list of non-empty "
                                 f"strings, got {self.next_stop_strings!r}")
        if any(not isinstance(m, dict) for m in self.metadata):
            raise BadEnvironment(f"{where}.step: metadata holds a dict per sample, got {self.metadata!r}")


class BadEnvironment(RuntimeError):
    """An environment cannot be used: options that do not fit the policy (its tokenizer), or a step that answered
    with the wrong number of samples or non-finite rewards. The message names the key or the field."""


class EnvironmentOptions(StrictModel):
    """Base of every environment's `Options`: unknown keys are errors naming `env.<key>`."""

    @property
    def uses_reward_server(self) -> bool:
        """True when the environment scores through the reward server at reward.address (the actor connects)."""
        return False


class Environment(Protocol):
    Options: type[EnvironmentOptions]

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentStep:
        """One step for the N samples still running: each one's messages so far (the prompt first, its newest
        policy turn last) and its metadata (at the first step: `{"label": <the prompt's label or None>}`)."""
        ...


@dataclass(frozen=True)
class EnvironmentContext:
    """What an environment may use besides its options: the policy tokenizer and, when its options say
    `uses_reward_server`, the connected reward server client (else None)."""

    tokenizer: PreTrainedTokenizerBase
    reward: Any = None  # actor.clients.RewardClient


# built-in environments by name, imported when chosen
ENVIRONMENTS = {"retry_with_feedback": "actor.environments.retry:RetryWithFeedback"}


def environment_class(name: str) -> type:
    """The class of a built-in name or of an importable 'package.module:Class'; ValueError naming env.name."""
    module, sep, attr = ENVIRONMENTS.get(name, name).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"env.name: unknown environment {name!r}; built-in: {', '.join(ENVIRONMENTS)}, or an "
                         "importable 'package.module:Class'")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"env.name={name}: cannot import it: {e} (the actor imports it from its working directory "
                         "and PYTHONPATH)") from None
    except AttributeError as e:
        raise ValueError(f"env.name={name}: cannot import it: {e}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the module's own code failed as it was imported
        raise ValueError(f"env.name={name}: importing {module} raised {type(e).__name__}: {e}") from None
    if not (isinstance(getattr(cls, "Options", None), type) and issubclass(cls.Options, EnvironmentOptions)
            and callable(getattr(cls, "step", None))):
        # a ValueError, so pydantic reports it as the key's error like every other config mistake
        raise ValueError(  # noqa: TRY004
            f"env.name={name}: not an environment: it needs an `Options` class derived from "
            "actor.environments.EnvironmentOptions and a `step(message_logs, metadata)` method")
    return cls


def environment_options(name: str, options: dict[str, Any]) -> EnvironmentOptions:
    """`options` validated by the environment's `Options`; ValueError naming each wrong `env.<key>`."""
    cls = environment_class(name)
    try:
        return cls.Options.model_validate(options)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = "env." + ".".join(str(p) for p in err["loc"]) if err["loc"] else "env"
            allowed = f"; allowed keys: name, {', '.join(cls.Options.model_fields)}" if err["type"] == "extra_forbidden" else ""
            problems.append(f"{key}: {err['msg'].removeprefix('Value error, ')}{allowed}")
        raise ValueError(f"env.name={name}: " + "; ".join(problems)) from None


def build_environment(name: str, options: dict[str, Any], context: EnvironmentContext) -> Environment:
    """The environment `name` with its validated options: `cls(options, context)`; BadEnvironment naming env.name
    when the user's constructor fails (SystemExit too: it would end the run with exit 0, having done nothing)."""
    cls, validated = environment_class(name), environment_options(name, options)
    try:
        return cls(validated, context)
    except BadEnvironment:
        raise
    except (Exception, SystemExit) as e:
        raise BadEnvironment(f"env.name={name}: its constructor raised {type(e).__name__}: {e}") from e
