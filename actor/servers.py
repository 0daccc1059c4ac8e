"""The remote servers one run uses: connecting (checked for compatibility at start-up), the reward request the
run makes (token ids or decoded texts, gRPC or OpenRLHF's protocol, or the critic's own rewards), and noticing a
critic that restarted during the run."""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedTokenizerBase

from ppo_services.v1 import critic_pb2, reward_pb2
from serving.modeling import vocab_sha256
from serving.security import load_token

from .clients import (
    CriticClient,
    IncompatibleServer,
    OpenRLHFRewardClient,
    RemoteError,
    RewardClient,
    TrainResult,
    check_compatible,
    check_tls_files,
    warn_clear_text_token,
)
from .config import ActorConfig, RemoteConfig
from .data import DataError, Prompt, require_labels
from .rollouts import RolloutBatch, ScoreFn, chat_scorer, text_scorer, token_scorer

log = logging.getLogger(__name__)


class CriticShared(RemoteError):
    """The critic's train step moved without this run: another client trained it, or Loaded a checkpoint into it.
    A critic serves one run; two runs on one critic would each train on a critic fitted partly to the other's
    rollouts."""


class NotFinite(RemoteError):
    """A server's rewards or values hold NaN or infinity: its model diverged or its scorer failed. Trained on, they
    would make every loss non-finite (each optimizer step skipped) or poison the critic's targets."""


def _serves(info: reward_pb2.RewardInfo) -> str:
    """What a reward server serves, in words: what decides its rewards and the requests it takes (a checkpoint keeps
    it: without a normalisation the words are what they were before servers reported one)."""
    normalized = f", scores normalised {info.reward_normalization}" if info.reward_normalization else ""
    return (f"{info.model!r} (vocabulary {info.vocab_sha256[:12] or 'none'}, components "
            f"{list(info.components)}, labels {'needed' if info.needs_labels else 'not needed'}{normalized})")


def _critic_rewards(info: critic_pb2.CriticInfo) -> str:
    """The rewards a combined critic serves, in words: its reward model and how its scores are normalised."""
    if not info.serves_rewards:
        return "no rewards (no reward_model)"
    return f"rewards of {info.reward_model!r}" + (f", normalised {info.reward_normalization}"
                                                  if info.reward_normalization else "")


class Servers:
    """`critic` (None when the estimator needs no values), `reward` (None when the critic serves rewards) and
    `score`, the reward request of every generation batch."""

    def __init__(self, cfg: ActorConfig, tokenizer: PreTrainedTokenizerBase, policy_max_length: int,
                 train_prompts: list[Prompt], val_prompts: list[Prompt], token_ids: int):
        """`token_ids`: how many ids the run can send (the tokenizer's, bounded by the policy's embedding rows: a pad
        token added to a tokenizer without resizing the model is never sent); the servers' models must embed that
        many."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.token_ids = token_ids
        self.train_prompts, self.val_prompts = train_prompts, val_prompts
        self.token = load_token(cfg.auth_token_file, "auth_token_file")
        # every TLS file the run reads, before it waits for any server (a bad reward file was found only once the
        # critic answered); and a word where the token would cross a network in clear text
        for name, remote in self._remotes():
            check_tls_files(name, remote)
            if self.token:
                warn_clear_text_token(name, remote)
        self.critic: CriticClient | None = None
        self.critic_restarts, self.critic_seen = 0, ("", 0)
        self.reward_serves: str | None = None  # what the gRPC reward server served at start
        self.critic_rewards: str | None = None  # with reward.source=critic: the rewards the critic served at start
        if cfg.needs_critic:
            self.critic = CriticClient(cfg.critic, self.token)
        else:
            log.info("ppo.adv_estimator.name=%s needs no critic values: no critic server is used",
                     cfg.ppo.adv_estimator.name)
        self.reward: RewardClient | OpenRLHFRewardClient | None = None
        self.max_length = policy_max_length  # the longest sequence the policy and the critic both take
        self.score = self._connect(policy_max_length)

    def _remotes(self) -> list[tuple[str, RemoteConfig]]:
        """Each server this run calls, by name, with its settings."""
        cfg = self.cfg
        remotes: list[tuple[str, RemoteConfig]] = [("critic", cfg.critic)] if cfg.needs_critic else []
        if (cfg.env.name is None or cfg.env.uses_reward_server) and cfg.reward.source != "critic":
            remotes.append(("reward", cfg.reward))
        return remotes

    def _connect(self, policy_max_length: int) -> ScoreFn | None:
        """Check every server this run uses and build the reward request: token ids to a server that shares the
        policy's tokenizer, decoded texts otherwise (reward.input), or None when the critic serves rewards."""
        cfg = self.cfg
        widest = max(self.train_prompts + self.val_prompts, key=lambda p: len(p.ids))
        longest = len(widest.ids)
        needed = longest + cfg.policy.generation.max_new_tokens
        why = f"the longest prompt ({longest} tokens) + policy.generation.max_new_tokens ({cfg.policy.generation.max_new_tokens})"
        if policy_max_length < needed:
            raise DataError(f"{widest.where}: the prompt has {longest} tokens, and with policy.generation."
                            f"max_new_tokens ({cfg.policy.generation.max_new_tokens}) a sample needs {needed}, more than "
                            f"the policy accepts ({policy_max_length}); shorten the prompt, lower max_new_tokens, or "
                            f"set data.max_input_seq_length to refuse such prompts line by line")
        sha, vocab = vocab_sha256(self.tokenizer), self.token_ids
        critic_info = self.critic.info() if self.critic is not None else None
        if critic_info is not None:
            self._critic_check = (sha, vocab, needed, why)  # checked again on a critic that restarts mid-run
            check_compatible("critic", critic_info, sha, vocab, needed, why)
            self.max_length = min(self.max_length, critic_info.max_length)  # it values whole multi-turn episodes
            self.critic_seen = (critic_info.instance_id, critic_info.train_step)
        labelled = all(p.label is not None for p in self.train_prompts)
        if cfg.env.name is not None and not cfg.env.uses_reward_server:
            log.info("env.name=%s gives the rewards: no reward server is used", cfg.env.name)
            return None
        if cfg.reward.source == "critic":
            if not critic_info.serves_rewards:
                raise IncompatibleServer(f"reward.source=critic needs a combined RM + critic server (critic_server "
                                         f"--reward-model ...), but the critic at {cfg.critic.address} serves no "
                                         f"rewards")
            self.critic_rewards = _critic_rewards(critic_info)  # held to it through restarts
            self._require_components(())
            return None
        if cfg.reward.source == "openrlhf":
            self.reward = OpenRLHFRewardClient(cfg.reward, self.token)
            log.info("rewards from %s (OpenRLHF protocol), texts%s", cfg.reward.url, " and labels" if labelled else "")
            return text_scorer(self.reward, self.tokenizer, cfg.reward.skip_special_tokens)
        self.reward = RewardClient(cfg.reward, self.token)
        info = self.reward.info()
        self.reward_serves = _serves(info)  # held for the run: a restarted server must serve the same
        if info.needs_labels:
            why_labels = f"the reward server's scorer ({info.model}) compares every response with its prompt's label"
            require_labels(self.train_prompts, cfg.data.label_key, why_labels)
            require_labels(self.val_prompts, cfg.data.label_key, why_labels)
        self._require_components(tuple(info.components))
        same_vocab = info.vocab_sha256 == sha
        if cfg.reward.input == "chat" or (cfg.reward.input == "auto" and not same_vocab and info.chat_template):
            if info.kind == "model" and not info.chat_template:
                raise IncompatibleServer(f"reward.input=chat: the reward server {cfg.reward.address} ({info.model}) "
                                         "has no chat template to render conversations with; use reward.input=text")
            log.info("reward server %s (%s) gets conversations, rendered with its own chat template%s",
                     cfg.reward.address, info.model, "" if same_vocab else ": its tokenizer differs from the policy's")
            return chat_scorer(self.reward, self.tokenizer)
        if cfg.reward.input == "text" or (cfg.reward.input == "auto" and not same_vocab):
            log.info("reward server %s (%s) gets decoded texts%s", cfg.reward.address, info.model,
                     "" if same_vocab else ": its tokenizer differs from the policy's")
            return text_scorer(self.reward, self.tokenizer, cfg.reward.skip_special_tokens)
        check_compatible("rule" if info.kind == "rule" else "reward", info, sha, vocab, needed, why)
        return token_scorer(self.reward)

    def _require_components(self, available: tuple[str, ...]) -> None:
        est = self.cfg.ppo.adv_estimator
        if est.name != "gdpo":
            return
        names = est.reward_components or list(available)
        missing = [n for n in names if n not in available]
        if missing or len(names) < 2:
            raise IncompatibleServer(
                f"ppo.adv_estimator.name=gdpo needs at least two reward components; the reward source reports "
                f"{list(available)}, ppo.adv_estimator.reward_components asks for {names}: start the reward server "
                "with components=[...], e.g. components=[positive_fraction,no_negative]")

    def reward_source(self) -> str:
        """Where the run's rewards come from, in words for an error message."""
        cfg = self.cfg
        if cfg.env.name is not None and not cfg.env.uses_reward_server:
            return f"the environment {cfg.env.name}"
        if self.score is None:
            return f"the critic server {cfg.critic.address} (its reward model)"
        if cfg.reward.source == "openrlhf":
            return f"the reward server {cfg.reward.url}"
        return f"the reward server {cfg.reward.address}"

    def require_finite(self, batch: RolloutBatch) -> None:
        """Stop the run (NotFinite) on rewards, reward components or critic values that are NaN or infinite, naming
        the server and the first such sample."""
        checks = [("rewards", batch.rewards, self.reward_source())]
        checks += [(f"reward component {name!r}", v, self.reward_source()) for name, v in batch.components.items()]
        if batch.values is not None:
            checks.append(("values", batch.values * batch.mask, f"the critic server {self.cfg.critic.address}"))
        for what, tensor, source in checks:
            bad = ~torch.isfinite(tensor)
            if bad.any():
                rows = bad.reshape(bad.shape[0], -1).any(dim=1)
                first = int(rows.nonzero()[0])
                sample = self.tokenizer.decode(batch.rollout.tokens[first, : batch.rollout.lengths[first]],
                                               skip_special_tokens=True)
                raise NotFinite(f"{source} returned {what} that are NaN or infinite for {int(rows.sum())} of "
                                f"{rows.numel()} samples (the first: {sample[:200]!r}): its model diverged or its "
                                f"scorer failed; the run stops rather than train on them")

    def critic_at(self, reply: TrainResult) -> None:
        """The critic as its last Train reply gave it. A reply from another instance than the last one seen means
        the critic restarted while this step ran (its Train retried on the new one): the restart is counted here,
        with the train step it resumed at (the reply's, less the steps this call took), before the step's own steps
        hide it; a restarted critic whose checkpoint already held this Train answers with its stored reply
        (`repeated`), and resumed where GetInfo says. From the same instance, the step before this Train must be the
        last one seen (CriticShared)."""
        before = reply.train_step - int(reply.metrics.get("optimizer_steps", 0))
        if reply.instance_id and reply.instance_id != self.critic_seen[0]:
            if reply.repeated:
                info = self.critic.current_info()
                self._restarted(reply.instance_id, info.train_step, info, holds_this_train=True)
            else:
                self._restarted(reply.instance_id, before)
        elif before != self.critic_seen[1]:
            raise self._shared(before)
        self.critic_seen = (reply.instance_id or self.critic_seen[0], reply.train_step)

    def critic_returned_to(self, train_step: int) -> None:
        """The critic Loaded a checkpoint at `train_step` (a resumed run): the same instance, at an earlier step."""
        self.critic_seen = (self.critic_seen[0], train_step)

    def watch_reward(self) -> None:
        """Before every step: the gRPC reward server still serves what the run started with (a server restarted
        mid-run with another model or scorer changes what the rewards mean, and may need other inputs)."""
        if self.reward_serves is None:  # set for a gRPC reward server only
            return
        now = _serves(self.reward.current_info())
        if now != self.reward_serves:
            raise IncompatibleServer(
                f"the reward server {self.cfg.reward.address} now serves {now}, where this run started with "
                f"{self.reward_serves}: it was restarted with other settings, which would change what the rewards "
                f"mean mid-run; restart it as it was, or start a new run")

    def watch_critic(self) -> None:
        """Notice a critic that restarted since the last step (a new instance id): log what it lost (the train steps
        between its checkpoint and the last reply), check it again as at start-up, and go on with it. The same
        instance at another train step than the last reply's was trained or Loaded by someone else: CriticShared."""
        if self.critic is None:
            return
        info = self.critic.current_info()
        instance, train_step = self.critic_seen
        if info.instance_id != instance:
            self._restarted(info.instance_id, info.train_step, info)
        elif info.train_step != train_step:
            raise self._shared(info.train_step)
        self.critic_seen = (info.instance_id, info.train_step)

    def _shared(self, train_step: int) -> CriticShared:
        return CriticShared(
            f"the critic server {self.cfg.critic.address} is at train step {train_step}, where this run left it at "
            f"{self.critic_seen[1]}, with no restart in between (instance {self.critic_seen[0][:8]}): another client "
            f"trained it or returned it to a checkpoint. A critic serves one run: give each run its own critic "
            f"server (two runs on one critic each train against a critic fitted partly to the other's rollouts)")

    def _restarted(self, instance_id: str, resumed_at: int, info: critic_pb2.CriticInfo | None = None,
                   holds_this_train: bool = False) -> None:
        instance, train_step = self.critic_seen
        self.critic_restarts += 1
        if holds_this_train:
            log.warning("the critic server %s restarted (instance %s -> %s) after it applied this step's Train: it "
                        "resumed at train step %d from a checkpoint that holds it, so the retried Train was answered "
                        "from its stored reply and no critic optimizer steps were lost", self.cfg.critic.address,
                        instance[:8], instance_id[:8], resumed_at)
        else:
            log.warning("the critic server %s restarted (instance %s -> %s): it resumed at train step %d, the last "
                        "reply was at %d, so %d critic optimizer steps were lost", self.cfg.critic.address,
                        instance[:8], instance_id[:8], resumed_at, train_step, max(0, train_step - resumed_at))
        # the restarted process may serve another model: held to what the run was started with
        info = info or self.critic.current_info()
        check_compatible("critic", info, *self._critic_check)
        if self.critic_rewards is not None and _critic_rewards(info) != self.critic_rewards:
            raise IncompatibleServer(
                f"the critic server {self.cfg.critic.address} restarted serving {_critic_rewards(info)}, where this "
                f"run (reward.source=critic) started with {self.critic_rewards}: the rewards would change meaning "
                f"mid-run; restart it as it was (its --reward-model and normalize_reward), or start a new run")

    def close(self) -> None:
        if self.critic is not None:
            self.critic.close()
        if self.reward is not None:
            self.reward.close()
