"""Configuration of the reward server (YAML + dotted overrides; see README "Configuration")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from serving.config import MAX_TIMEOUT_S, SEED_LIMIT, ModelName, StrictModel
from serving.server_config import ServerConfig

from .scorers import SCORERS, describe_scorers


def _check_scorer(name: str) -> str:
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; allowed: {', '.join(sorted(SCORERS))}")
    return name


class MathVerifyConfig(StrictModel):
    """The worker processes of the math_verify scorer (as `scorer` or among `components`)."""

    workers: int = Field(0, ge=0, le=64, description="Worker processes scoring samples side by side; 0: num_threads, or "
                         "one per core when that is 0 too. Each takes some 150 MB and one core while it scores.")
    timeout_s: float = Field(5.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="The longest one sample may take: past it "
                             "its worker is killed and replaced and the sample scores 0.0, logged and counted in "
                             "ppo_reward_math_verify_timeouts_total (math-verify's own limits, 1 s to parse each side and "
                             "1 s to compare, stop most inputs first; not those a signal cannot interrupt).")
    batch_timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="The longest one batch (the "
                                   "requests merged into one pass) may take: past it no further sample of it is sent "
                                   "and the rest score 0.0, logged and counted in "
                                   "ppo_reward_math_verify_timeouts_total, so a request of many slow samples whose "
                                   "caller waits cannot hold the server, and every caller behind it, for longer.")


class RewardConfig(ServerConfig):
    """`python -m reward_server`: every key, with its default."""

    port: int = Field(5556, ge=0, le=65535, description="gRPC port.")
    http_port: int = Field(8002, ge=0, le=65535,
                           description="REST port for /health, /ready, /metrics, /get_reward.")
    model: ModelName = Field(
        "embedded:reward",
        description="Learned reward model: a Hugging Face sequence-classification checkpoint with one label "
        "(path or hub id), or embedded:reward for the built-in tiny model. Ignored when `scorer` is set.",
    )
    scorer: str | None = Field(
        None,
        description=f"Rule-based scorer instead of a learned model (no model is loaded): {describe_scorers()}.",
    )
    components: list[str] = Field(
        default_factory=list,
        description="Rule scorers computed alongside the reward and returned as components `reward/<name>`, "
        "e.g. [positive_fraction] to watch a learned model track the ground truth, or [positive_fraction, "
        "no_negative] as GDPO's two reward components. Any scorer of `scorer` may be named. Rule scorers read the "
        "response only: tokens after prompt_lengths, or texts after their prompts (the whole text when no "
        "prompts are sent or a text does not start with its prompt). A component is left out of a response "
        "whose request lacks what it needs (prompt_lengths with tokens; labels for exact_match).",
    )
    tokenizer: ModelName | None = Field(
        None,
        description="Tokenizer (path, hub id or embedded:<name>) that decodes token ids for rule scorers and "
        "tokenizes texts for the learned model. Default: the model's own; embedded:policy's with `scorer`.",
    )
    long_texts: Literal["refuse", "truncate"] = Field(
        "refuse",
        description="A text or rendered conversation longer than the model's max length: refuse it "
        "(INVALID_ARGUMENT, or 400 on /get_reward, naming it), or truncate it to its first max-length tokens and score "
        "that, as OpenRLHF's reward server does (its trainer fails a whole batch on a 400), counting each in "
        "ppo_reward_truncated_texts_total. Token ids are never truncated.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights' dtype.")
    normalize_reward: bool | None = Field(
        None,
        description="Learned model: report (score - mean) / std with the `mean` and `std` in its config.json, as "
        "OpenRLHF does for reward models trained with --normalize_reward (their config.json also says "
        "normalize_reward: true). Unset follows the checkpoint's own normalize_reward; true requires mean and std "
        "there; false reports raw scores. Not for a rule `scorer`.",
    )
    math_verify: MathVerifyConfig = Field(default_factory=MathVerifyConfig)
    seed: int = Field(1234, ge=0, lt=SEED_LIMIT, description="torch seed set before loading (a checkpoint without a score head "
                                        "gets a random one).")

    @field_validator("scorer")
    @classmethod
    def _scorer_known(cls, v: str | None) -> str | None:
        return None if v is None else _check_scorer(v)

    @model_validator(mode="after")
    def _normalize_needs_a_model(self) -> RewardConfig:
        if self.scorer is not None and self.normalize_reward:
            raise ValueError(f"normalize_reward=true applies to a learned model's scores, not to the rule scorer "
                             f"{self.scorer!r}; unset it or unset scorer")
        return self

    @field_validator("components")
    @classmethod
    def _components_known(cls, v: list[str]) -> list[str]:
        return [_check_scorer(name) for name in v]
