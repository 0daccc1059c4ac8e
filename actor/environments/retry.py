"""`retry_with_feedback`: the policy answers the prompt; the environment scores the answer; an answer below
`threshold` gets a short feedback text (ending with the task's separator "=>") and the policy answers again, until
an answer reaches the threshold or the actor's `ppo.max_rollout_turns` ends the episode.

Each answer is scored as a single-turn response to the original prompt, by a local rule (`positive_fraction`, the
embedded task's ground truth) or by the reward server at reward.address (`scorer: reward_server`: prompt and answer
texts over gRPC, so a learned reward model or any rule scorer judges every turn). A turn's reward is its score minus
the previous turn's, so the rewards of an episode sum to the score of its last answer wherever it stops.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from embedded.task import positive_fraction
from serving.labels import label_text

from . import BadEnvironment, EnvironmentContext, EnvironmentOptions, EnvironmentStep, Message


class RetryOptions(EnvironmentOptions):
    scorer: Literal["positive_fraction", "reward_server"] = Field(
        "positive_fraction", description="positive_fraction: the embedded task's rule, computed in the actor; "
        "reward_server: the reward server at reward.address scores prompt + answer texts.")
    threshold: float = Field(0.5, description="An answer scoring at least this ends the episode; below, the policy gets the feedback and answers again.")
    feedback: str = Field("really bad =>", min_length=1, description="The observation after a low-scoring answer, appended after a space; every word must be in the policy's vocabulary.")

    @property
    def uses_reward_server(self) -> bool:
        return self.scorer == "reward_server"


class RetryWithFeedback:
    Options = RetryOptions

    def __init__(self, options: RetryOptions, context: EnvironmentContext):
        self.options, self.tokenizer = options, context.tokenizer
        # a separate word after the answer: byte-level BPE would otherwise glue it to the answer's last word
        self.observation = options.feedback if options.feedback[0].isspace() else " " + options.feedback
        unk = self.tokenizer.unk_token_id
        ids = self.tokenizer(self.observation, add_special_tokens=False)["input_ids"]
        unknown = [w for w, i in zip(options.feedback.split(), ids, strict=False) if i == unk] if unk is not None else []
        if not ids or unknown:
            raise BadEnvironment(f"env.feedback={options.feedback!r}: the policy's tokenizer does not know "
                                 f"{unknown or 'any of it'}; use words of its vocabulary")
        if options.uses_reward_server and context.reward is None:
            raise BadEnvironment("env.scorer=reward_server needs a connected reward server (reward.address)")
        self.reward = context.reward

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvironmentStep:
        """Score each sample's newest answer; below the threshold, feedback and another turn."""
        scores = self._scores(message_logs, metadata)
        previous = torch.tensor([float(m.get("score", 0.0)) for m in metadata])
        done = scores >= self.options.threshold
        return EnvironmentStep(
            observations=["" if d else self.observation for d in done.tolist()],
            rewards=(scores - previous).float(),  # telescoping: an episode's rewards sum to its last score
            terminated=done,
            next_stop_strings=[None] * len(message_logs),
            metadata=[{**m, "score": s} for m, s in zip(metadata, scores.tolist(), strict=True)],
        )

    def _scores(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> torch.Tensor:
        """float32 [N]: each newest answer scored as the response to the original prompt."""
        if self.options.scorer == "positive_fraction":
            return torch.tensor([positive_fraction(log[-1].text) for log in message_logs], dtype=torch.float32)
        prompts, texts = [], []
        for log in message_logs:
            prompt, answer = log[0].token_ids, log[-1].token_ids
            prompts.append(self.tokenizer.decode(prompt, skip_special_tokens=True))
            texts.append(self.tokenizer.decode(prompt + answer, skip_special_tokens=True))
        labels = [m.get("label") for m in metadata]
        sent = [label_text(x) for x in labels] if any(x is not None for x in labels) else None
        rewards, _ = self.reward.score_texts(texts, prompts, sent).result()
        return rewards.float()
