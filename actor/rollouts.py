"""Rollout collection: prompts (with their labels) repeated into groups, generation, critic values, rewards and
log-probs, and DAPO's dynamic sampling. The trainer asks for one step's batch; everything that talks to the
generation engine and the remote servers while it is made lives here.

A group is the `num_generations_per_prompt` samples of one prompt. Groups stay whole and contiguous through
every stage: dynamic sampling keeps or drops whole groups, and the policy update shuffles groups, not rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from algorithms import groups_with_signal, logprobs_from_logits
from serving.labels import label_text
from serving.modeling import (
    ModelPass,
    PassLimits,
    attention_mask_from_lengths,
    by_length,
    causal_lm_logits,
    length_buckets,
    pad_and_stack,
    torch_threads,
)
from serving.prepack import prepacked_linears

from .clients import (
    CriticClient,
    IncompatibleServer,
    OpenRLHFRewardClient,
    Pending,
    RewardClient,
    Scores,
)
from .data import Prompt, PromptSampler
from .generation import GenerationBackend, Rollout, SamplingParams, concat_rollouts, select_rows
from .models import Reference
from .tracking import Timers

# (rollout, the prompt of each of its rows, labels or None) -> the reward request in flight
ScoreFn = Callable[[Rollout, list[Prompt], list[Any] | None], Pending[Scores]]


class PolicyDiverged(RuntimeError):
    """An update left the policy unusable (non-finite weights, or next-token probabilities sampling cannot take)."""


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling could not fill a step within dynamic_sampling_max_gen_batches."""


@dataclass
class RolloutBatch:
    """One step's experience. Per-action tensors are float32 [B, S-1] (action t produced token t+1)."""

    rollout: Rollout
    group_ids: torch.Tensor  # int64 [B]: samples with one id are the generations of one prompt
    labels: list[Any] | None  # the prompt's label for every sample, or None when the data has none
    mask: torch.Tensor  # 1 on response actions
    logprobs: torch.Tensor  # policy at rollout time
    ref_logprobs: torch.Tensor | None  # frozen reference policy; None when skipped
    values: torch.Tensor | None  # critic value of the prefix before each action; None without a critic
    rewards: torch.Tensor  # [B] sequence reward as the reward source gave it (unscaled, unshaped)
    components: dict[str, torch.Tensor]  # named reward components, [B] each, as given

    @property
    def size(self) -> int:
        return int(self.group_ids.shape[0])

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """Rows `index` (int64 [K]), every field alike."""
        width = int(self.rollout.lengths[index].max()) - 1 if len(index) else 0

        def rows(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[index, :width]

        return RolloutBatch(
            rollout=select_rows(self.rollout, index), group_ids=self.group_ids[index],
            labels=None if self.labels is None else [self.labels[i] for i in index.tolist()],
            mask=rows(self.mask), logprobs=rows(self.logprobs), ref_logprobs=rows(self.ref_logprobs),
            values=rows(self.values), rewards=self.rewards[index],
            components={k: v[index] for k, v in self.components.items()},
        )


def concat_batches(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    def cat(xs: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if any(x is None for x in xs) else pad_and_stack(xs)

    first = parts[0]
    return RolloutBatch(
        rollout=concat_rollouts([p.rollout for p in parts], pad_id),
        group_ids=torch.cat([p.group_ids for p in parts]),
        labels=None if first.labels is None else [label for p in parts for label in p.labels],
        mask=cat([p.mask for p in parts]), logprobs=cat([p.logprobs for p in parts]),
        ref_logprobs=cat([p.ref_logprobs for p in parts]), values=cat([p.values for p in parts]),
        rewards=torch.cat([p.rewards for p in parts]),
        components={k: torch.cat([p.components[k] for p in parts]) for k in first.components},
    )


def first_groups(batch: RolloutBatch, n_groups: int) -> RolloutBatch:
    """The first `n_groups` whole groups, in order."""
    ids = list(dict.fromkeys(batch.group_ids.tolist()))[:n_groups]
    keep = torch.isin(batch.group_ids, torch.tensor(ids, dtype=batch.group_ids.dtype))
    return batch.select(keep.nonzero().squeeze(1))


def decoded_texts(tokenizer: PreTrainedTokenizerBase, r: Rollout,
                  skip_special_tokens: bool = True) -> tuple[list[str], list[str]]:
    """(prompt + response texts, prompt texts) of each row, special tokens skipped unless `skip_special_tokens` is
    false (padding is never decoded: each row stops at its length). Each text starts with its prompt text: it is the
    decoded whole row when that begins with the decoded prompt, else the two joined."""
    texts, prompts = [], []
    for i in range(r.tokens.shape[0]):
        p, n = int(r.prompt_lengths[i]), int(r.lengths[i])
        prompt = tokenizer.decode(r.tokens[i, :p], skip_special_tokens=skip_special_tokens)
        whole = tokenizer.decode(r.tokens[i, :n], skip_special_tokens=skip_special_tokens)
        if not whole.startswith(prompt):
            whole = prompt + tokenizer.decode(r.tokens[i, p:n], skip_special_tokens=skip_special_tokens)
        texts.append(whole)
        prompts.append(prompt)
    return texts, prompts


def token_scorer(client: RewardClient) -> ScoreFn:
    def score(r: Rollout, prompts: list[Prompt], labels: list[Any] | None) -> Pending[Scores]:
        return client.score_tokens(r.tokens, r.lengths, r.prompt_lengths,
                                   None if labels is None else [label_text(x) for x in labels])
    return score


def text_scorer(client: RewardClient | OpenRLHFRewardClient, tokenizer: PreTrainedTokenizerBase,
                skip_special_tokens: bool = True) -> ScoreFn:
    """Decoded texts to a reward server with its own tokenizer; labels as strings for gRPC, as they are for
    OpenRLHF's JSON protocol."""
    as_text = isinstance(client, RewardClient)

    def score(r: Rollout, prompts: list[Prompt], labels: list[Any] | None) -> Pending[Scores]:
        texts, prompt_texts = decoded_texts(tokenizer, r, skip_special_tokens)
        if labels is not None and as_text:
            labels = [label_text(x) for x in labels]
        return client.score_texts(texts, prompt_texts, labels)
    return score


def chat_scorer(client: RewardClient, tokenizer: PreTrainedTokenizerBase) -> ScoreFn:
    """Conversations to a chat reward model, which renders them with its own chat template: each prompt's messages,
    then the response, decoded without the policy tokenizer's special tokens (its chat markup and EOS), as an
    assistant message."""
    def score(r: Rollout, prompts: list[Prompt], labels: list[Any] | None) -> Pending[Scores]:
        conversations = []
        for i, prompt in enumerate(prompts):
            p, n = int(r.prompt_lengths[i]), int(r.lengths[i])
            messages = prompt.messages or [
                {"role": "user", "content": tokenizer.decode(r.tokens[i, :p], skip_special_tokens=True)}]
            response = tokenizer.decode(r.tokens[i, p:n], skip_special_tokens=True)
            conversations.append([*messages, {"role": "assistant", "content": response}])
        return client.score_conversations(conversations, None if labels is None else [label_text(x) for x in labels])
    return score


SEED_SPACE = 2**63  # torch takes seeds below 2**64: a derived seed is kept below this, the same below it as before


def derived_seed(seed: int, scale: int, offset: int) -> int:
    """The seed of a part (a generation batch, a turn) of what `seed` seeds: `seed * scale + offset`, taken modulo
    SEED_SPACE, where a large `ppo.seed` times the scales of nested parts would pass what torch's generators take."""
    return (seed * scale + offset) % SEED_SPACE


def generate_in_batches(generate: Callable[[list[Prompt], SamplingParams, int], Rollout], rows: list[Prompt],
                        params: SamplingParams, seed: int, batch_size: int,
                        timers: Timers) -> Iterator[tuple[int, Rollout]]:
    """(offset of the first row, Rollout) per generation batch of `batch_size` rows, made by
    `generate(rows, params, seed)`, each seeded from `seed` and its offset, generated when the iterator reaches it."""
    for i in range(0, len(rows), batch_size):
        with timers("generate"):
            r = generate(rows[i:i + batch_size], params, derived_seed(seed, 100_003, i))
        yield i, r


def split_rows(rollout: Rollout, batch_size: int) -> Iterator[tuple[int, Rollout]]:
    """The batches generate_in_batches would have made of `rollout`'s rows, each trimmed to its longest row."""
    n = rollout.tokens.shape[0]
    for i in range(0, n, batch_size):
        yield i, select_rows(rollout, torch.arange(i, min(i + batch_size, n)))


def critic_rewards(reply: tuple[torch.Tensor, torch.Tensor | None]) -> Scores:
    """The rewards of a combined critic's Infer reply (reward.source=critic); IncompatibleServer when it carries
    none: the critic restarted without its reward model (a TypeError traceback ended the run before)."""
    if reply[1] is None:
        raise IncompatibleServer("the critic server returned values without rewards: it was restarted without its "
                                 "reward model, and reward.source=critic needs them (critic_server --reward-model ...); "
                                 "restart it as it was")
    return reply[1], {}


class RolloutCollector:
    """Makes a step's RolloutBatch: per generation batch, the critic and reward requests go out as soon as the
    batch is generated and the actor computes the policy's and the reference's log-probs while they run."""

    def __init__(self, *, policy: PreTrainedModel, reference: Reference | None, backend: GenerationBackend,
                 critic: CriticClient | None, score: ScoreFn | None, pad_id: int, device: torch.device,
                 generation_batch_size: int, logprob_passes: PassLimits, timers: Timers, reuse_logprobs: bool = False,
                 shared_threads: int = 0, logits: ModelPass = causal_lm_logits, prepack: bool = False):
        self.policy, self.reference, self.backend = policy, reference, backend
        self.critic, self.score = critic, score  # score None: rewards come with the critic's values (combined)
        self.pad_id, self.device = pad_id, device
        self.generation_batch_size, self.logprob_passes = generation_batch_size, logprob_passes
        self.timers = timers
        self.shared_threads = shared_threads  # torch threads while the servers answer this batch's requests
        self.reuse_logprobs = reuse_logprobs  # the policy's log-probs are generation's (the backend samples the policy)
        self.logits = logits  # causal_lm_logits, or its compiled form (policy.compile)
        self.prepack = prepack  # the log-prob passes through weights prepacked for oneDNN (serving.prepack)
        self.next_group = 0  # group ids stay unique across steps (and across a resume)

    def logprobs(self, model: PreTrainedModel, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Log-prob of each next token, float32 [B, S-1] (0 past each row's end), without gradients, in passes of
        of rows of similar length trimmed to their longest row, as `logprob_passes` cuts them (policy.logprob_batch_size
        rows, or policy.dynamic_batching's tokens)."""
        def pass_(tok: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            logits = self.logits(model, tok, n)
            lp = logprobs_from_logits(logits[:, :-1], tok[:, 1:], dtype=torch.float32)  # float32 a row at a time
            return lp * attention_mask_from_lengths(n - 1, lp.shape[1])

        first = length_buckets(lengths, self.logprob_passes)[0]  # the widest pass: the rows the weights are packed for
        rows = len(first) * self.logprob_passes.width(int(lengths[first].max()), tokens.shape[1])
        with torch.no_grad(), prepacked_linears(model, rows, enabled=self.prepack):
            return by_length(pass_, tokens, lengths, self.logprob_passes, self.device)

    def generate_rows(self, prompts: list[Prompt], params: SamplingParams, seed: int) -> Rollout:
        """One generation batch: a response per prompt (actor/multiturn.py makes episodes instead)."""
        try:
            return self.backend.generate([p.ids for p in prompts], params, seed=seed)
        except RuntimeError as e:
            if "probability tensor contains" not in str(e):  # torch.multinomial's words for inf or NaN
                raise
            raise PolicyDiverged("sampling met next-token probabilities that are not finite: an earlier update made the "
                                 "policy diverge (a learning rate too large for the model?); checkpoints written "
                                 "since may hold it: resume from one before, with a smaller learning rate") from None

    def generate(self, prompts: list[Prompt], params: SamplingParams | None, seed: int, generations: int = 1,
                 batch_size: int | None = None, train: bool = True, rollout: Rollout | None = None) -> RolloutBatch:
        """`generations` samples of every prompt (consecutive rows, one group id per prompt), scored. With
        `train`, also critic values and the policy's and reference's log-probs. `rollout`: those rows generated
        already (by the async worker); then only the post-generation part runs, on the same batches."""
        t = self.timers
        rows = [p for p in prompts for _ in range(generations)]
        group_ids = torch.arange(self.next_group, self.next_group + len(prompts)).repeat_interleave(generations)
        self.next_group += len(prompts)
        # one label per sample whenever the data has any (a missing one is null), none otherwise
        labels = [p.label for p in rows] if any(p.label is not None for p in prompts) else None
        step = batch_size or self.generation_batch_size
        parts = []
        chunks = (generate_in_batches(self.generate_rows, rows, params, seed, step, t) if rollout is None
                  else split_rows(rollout, step))
        for i, r in chunks:  # lazily: each batch's requests go out before the next batch is generated
            chunk_labels = None if labels is None else labels[i:i + step]
            with t("transfer"):  # requests encoded and sent; the replies are awaited below
                values = (self.critic.infer(r.tokens, r.lengths)
                          if self.critic is not None and (train or self.score is None) else None)
                scores = (self.score(r, rows[i:i + step], chunk_labels) if self.score is not None
                          else values.then(critic_rewards))
            lp = ref = None
            if train:
                with torch_threads(self.shared_threads):
                    if self.reuse_logprobs:
                        lp = r.logprobs
                    else:
                        with t("logprobs"):
                            lp = self.logprobs(self.policy, r.tokens, r.lengths)
                    if self.reference is not None:
                        with t("init_logprobs"), self.reference.resident() as reference:
                            ref = self.logprobs(reference, r.tokens, r.lengths)
            parts.append((r, values, scores, lp, ref))
        with t("critic_wait"):
            remote = [(v.result()[0] if v is not None and train else None, s.result()) for _, v, s, _, _ in parts]
        rollout = concat_rollouts([p[0] for p in parts], self.pad_id)
        mask = rollout.action_mask()
        names = remote[0][1][1].keys()
        return RolloutBatch(
            rollout=rollout, group_ids=group_ids, labels=labels, mask=mask,
            logprobs=pad_and_stack([p[3] for p in parts]) if train else torch.zeros_like(mask),
            ref_logprobs=pad_and_stack([p[4] for p in parts]) if train and self.reference is not None else None,
            values=pad_and_stack([v for v, _ in remote])[:, :-1] if train and self.critic is not None else None,
            rewards=torch.cat([s[0] for _, s in remote]).float(),
            components={k: torch.cat([s[1][k] for _, s in remote]).float() for k in names},
        )

    def collect(self, sampler: PromptSampler, params: SamplingParams, seed: int, num_prompts: int, generations: int,
                dynamic_sampling: bool, max_gen_batches: int, batch_multiplier: float) -> tuple[RolloutBatch, int]:
        """One step's batch of `num_prompts` whole groups. With dynamic sampling, groups whose rewards are all
        equal are dropped and generation repeats (ceil(num_prompts * batch_multiplier) prompts a time, kept
        groups cached) until the step is full; after max_gen_batches it fails with DynamicSamplingError.
        Returns the batch and the number of generation batches it took."""
        if not dynamic_sampling:
            return self.generate(sampler.take(num_prompts), params, seed, generations), 1
        kept: list[RolloutBatch] = []
        n_kept = 0
        per_batch = math.ceil(num_prompts * batch_multiplier)
        for gen_batch in range(max_gen_batches):
            batch = self.generate(sampler.take(per_batch), params, derived_seed(seed, 1_009, gen_batch), generations)
            signal = groups_with_signal(batch.rewards, batch.group_ids)
            batch = batch.select(signal.nonzero().squeeze(1))
            if batch.size:
                kept.append(batch)
                n_kept += batch.size // generations
            if n_kept >= num_prompts:
                return first_groups(concat_batches(kept, self.pad_id), num_prompts), gen_batch + 1
        raise DynamicSamplingError(
            f"dynamic sampling kept {n_kept} of the {num_prompts} prompt groups a step needs after {max_gen_batches} "
            f"generation batches (ppo.dynamic_sampling_max_gen_batches): the rewards of too many prompts are all "
            "equal. Raise ppo.dynamic_sampling_max_gen_batches or ppo.batch_multiplier, or turn "
            "ppo.use_dynamic_sampling off"
        )

