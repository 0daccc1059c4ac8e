"""The reward server's model work, free of gRPC and HTTP: validation and scoring.

`validate` runs on the event loop (cheap checks, so a bad request fails alone); `score_batch` runs on the
server's single model thread (serving.batching), on several merged requests at once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from embedded import naming_the_model, resolve_model
from serving.errors import InvalidArgument
from serving.metrics import PassObserver, no_observer
from serving.modeling import (
    NO_LENGTH_LIMIT,
    TORCH_DTYPES,
    ModelPass,
    NoScoreHead,
    RewardNormalization,
    at_last_token,
    by_length,
    compiled,
    embeddable_pad_id,
    load_scalar_head_model,
    load_sequence_classifier,
    load_tokenizer,
    max_length_before_loading,
    max_length_of,
    normalization_text,
    pad_and_stack,
    per_token_scores,
    resolve_device,
    reward_normalization,
    right_pad,
    sequence_scores,
    text_ids,
    usable_cores,
    vocab_sha256,
    warm_up,
)
from serving.prepack import KeptPacking, prepacks_passes
from serving.validation import check_int_vector, check_lengths, check_tokens, token_ids

from .config import RewardConfig
from .scorers import SCORERS, component_name
from .special_text import COMMON_END_MARKS, special_marks, without_end_marks
from .verifier import MathVerifyPool

log = logging.getLogger(__name__)

_RULE_TOKENIZER = "embedded:policy"


@dataclass
class ScoreInput:
    """One validated Score request of `rows` samples. The learned model reads `tokens`/`lengths`; rule scorers
    read the response of each sample: `responses` (from texts) or `response_ids` (from tokens), None when the
    request does not say where responses start. `labels` is None when the request carries none."""

    rows: int
    tokens: torch.Tensor | None = None  # int64 [B, S], right-padded
    lengths: torch.Tensor | None = None  # int64 [B]
    responses: list[str] | None = None
    response_ids: list[list[int]] | None = None
    labels: list[str] | None = None


# rewards float32 [B], components name -> float32 [B]
ScoreOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


class RewardCore:
    def __init__(self, cfg: RewardConfig, observe_pass: PassObserver = no_observer,
                 on_truncated: Callable[[int], None] = lambda n: None, on_verify_timeout: Callable[[int], None] = lambda n: None,
                 abandoned: Callable[[], bool] = lambda: False):
        self.cfg = cfg
        self.abandoned = abandoned  # every caller of the running batch gone: math_verify stops sending its samples
        self.on_verify_timeout = on_verify_timeout  # math_verify samples past math_verify.timeout_s or batch_timeout_s
        self.observe_pass = observe_pass  # each forward pass's padded tokens, for /metrics
        self.on_truncated = on_truncated  # how many texts a request had cut to the max length (long_texts=truncate)
        self.device = resolve_device(cfg.device)
        self.model = None
        self.packing: KeptPacking | None = None  # Score's passes through prepacked weights (load() decides)
        self.encoder = False  # an encoder scoring (prompt, response) pairs with its own head, not a decoder's last token
        # Rule scorers whose results are returned as components: the scorer itself, then the extra ones.
        self.component_scorers = list(dict.fromkeys([*([cfg.scorer] if cfg.scorer else []), *cfg.components]))
        self.verifier: MathVerifyPool | None = None  # the math_verify scorer's worker processes (load() starts them)

    # --- loading --------------------------------------------------------------------------------
    def max_length_hint(self) -> int | None:
        """The learned model's max_length from its config, without loading it; None for a rule scorer, whose texts
        have no token limit."""
        return max_length_before_loading(self.cfg.model) if self.cfg.scorer is None else None

    def load(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        if cfg.scorer is None:
            path = resolve_model(cfg.model, key="model")
            with naming_the_model("model", cfg.model):
                try:  # a decoder's `score` at the last valid position
                    self.model = load_scalar_head_model(path, TORCH_DTYPES[cfg.dtype], trained_head=True,
                                                        trust_remote_code=cfg.trust_remote_code)
                except NoScoreHead:  # an encoder's own pooling and head over the whole sequence
                    self.model = load_sequence_classifier(path, TORCH_DTYPES[cfg.dtype],
                                                          trust_remote_code=cfg.trust_remote_code)
                    self.encoder = True
            self.model = self.model.to(self.device).eval()
            self.model.requires_grad_(False)
            self.normalize_reward = reward_normalization(self.model.config, cfg.normalize_reward, "normalize_reward",
                                                         cfg.model)
            with naming_the_model("tokenizer", cfg.tokenizer) if cfg.tokenizer else naming_the_model("model", cfg.model):
                self.tokenizer = load_tokenizer(resolve_model(cfg.tokenizer, key="tokenizer") if cfg.tokenizer else path,
                                                cfg.trust_remote_code)
            self.scores = (compiled(self._encoder_scores(), cfg.compile, "compile", self.device) if self.encoder
                           else at_last_token(compiled(per_token_scores, cfg.compile, "compile", self.device)))
            self.vocab_size = int(self.model.config.vocab_size)
            self.max_length = max_length_of(self.model)
            # packed at the first Score and kept: a reward model's weights never change (serving.prepack)
            self.packing = KeptPacking(self.model, cfg.batching.max_tokens_per_pass, prepacks_passes(
                "prepack_weights", cfg.prepack_weights, self.device, TORCH_DTYPES[cfg.dtype], "Score"))
            if cfg.compile:  # compiled now, before ready, not at the first Score
                log.info("compile=true: Score pass compiled in %.1f s",
                         warm_up(self.scores, [self.model], self.device, packed=self.packing.packed))
        else:
            self.tokenizer = load_tokenizer(resolve_model(cfg.tokenizer or _RULE_TOKENIZER, key="tokenizer"),
                                            cfg.trust_remote_code)
            self.vocab_size = len(self.tokenizer)
            limit = self.tokenizer.model_max_length
            self.max_length = int(min(limit, NO_LENGTH_LIMIT))
        if "math_verify" in self.component_scorers:
            workers = min(cfg.math_verify.workers or cfg.num_threads or usable_cores(), 64)
            self.verifier = MathVerifyPool(workers, cfg.math_verify.timeout_s, on_timeout=self.on_verify_timeout,
                                           batch_timeout_s=cfg.math_verify.batch_timeout_s)
            log.info("math_verify: %d worker process(es), %.1f s a sample and %.0f s a batch at most", workers,
                     cfg.math_verify.timeout_s, cfg.math_verify.batch_timeout_s)
        self.vocab_sha256 = vocab_sha256(self.tokenizer)
        self.end_marks = special_marks((*self.tokenizer.all_special_tokens, *COMMON_END_MARKS))
        # no token spells more characters than the longest in the vocabulary (normalizers aside, hence the factor 4):
        # a longer text is over the max length before it is tokenized, which costs some 300 B a token
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_text_chars = min(4 * self.max_length * max(longest, 1), MAX_TEXT_CHARS)
        # with neither a pad nor an EOS token the model can embed, id 0: padding positions are masked
        pad = embeddable_pad_id(self.tokenizer, self.vocab_size, self.source)
        self.pad_id = 0 if pad is None else pad
        log.info("reward %s loaded on %s (vocab %d, max length %d, components %s)", self.source, self.device,
                 self.vocab_size, self.max_length, self.component_scorers)

    def _encoder_scores(self) -> ModelPass:
        """An encoder's scores of the pairs (prompt, response) it was trained on, typed by token type ids as its
        tokenizer types them where both the model (`type_vocab_size` > 1: BERT's, ELECTRA's) and the tokenizer (its
        `model_input_names`) use them."""
        typed = (getattr(self.model.config, "type_vocab_size", 0) > 1 and self.tokenizer.sep_token_id is not None
                 and "token_type_ids" in self.tokenizer.model_input_names)
        log.info("%s scores whole sequences through its own %s head; a text that starts with its prompt is encoded as "
                 "the pair (prompt, response)%s", self.cfg.model, type(self.model).__name__,
                 ", the response typed 1 after the first separator" if typed else "")
        return functools.partial(sequence_scores, separator=self.tokenizer.sep_token_id if typed else None)

    @property
    def source(self) -> str:
        return self.cfg.model if self.cfg.scorer is None else f"rule:{self.cfg.scorer}"

    def info(self) -> dict:
        return {
            "model": self.source,
            "kind": "model" if self.cfg.scorer is None else "rule",
            "vocab_size": self.vocab_size,
            "max_length": self.max_length,
            "vocab_sha256": self.vocab_sha256,
            "components": [component_name(s) for s in self.component_scorers],
            "needs_labels": self.cfg.scorer is not None and SCORERS[self.cfg.scorer].needs_labels,
            "chat_template": self.model is not None and self.tokenizer.chat_template is not None,
            "reward_normalization": normalization_text(getattr(self, "normalize_reward", RewardNormalization())),
        }

    # --- validation -----------------------------------------------------------------------------
    def check_rows(self, **counts: int) -> None:
        """InvalidArgument naming the first field whose count of samples passes max_request_rows: called on the
        counts alone, before any per-sample work (a 14 MB body of 3.5 M one-letter queries held the event loop 26 s
        being checked and stripped, before this refused it). Token ids are held to it by the receive limit."""
        for field, n in counts.items():
            if n > self.cfg.max_request_rows:
                raise InvalidArgument(f"{field}: {n} samples, more than one request may carry "
                                      f"(max_request_rows {self.cfg.max_request_rows})")

    def validate(
        self,
        *,
        tokens: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        prompt_lengths: torch.Tensor | None = None,
        texts: list[str] | None = None,
        prompts: list[str] | None = None,
        labels: list[str] | None = None,
        conversations: list[list[dict[str, str]]] | None = None,
        texts_field: str = "texts",
    ) -> ScoreInput:
        """Check one request and bring it into the form `score_batch` takes. Raises InvalidArgument naming the
        field. `texts_field` is how the caller's protocol calls the texts (`query` in OpenRLHF's); `conversations`
        are lists of {"role", "content"} messages, the response last."""
        texts, prompts, labels, conversations = texts or [], prompts or [], labels or [], conversations or []
        self.check_rows(**{texts_field: len(texts), "conversations": len(conversations)})
        sent = [name for name, given in (("tokens", tokens is not None), (texts_field, bool(texts)),
                                         ("conversations", bool(conversations))) if given]
        if len(sent) != 1:
            named = f"tokens, {texts_field}" + (", conversations" if texts_field == "texts" else "")
            raise InvalidArgument(f"{named}: send exactly one of them, got {' and '.join(sent) or 'none'}")
        if tokens is not None:
            inp = self._validate_tokens(tokens, lengths, prompt_lengths, prompts)
        elif texts:
            inp = self._validate_texts(texts, lengths, prompt_lengths, prompts, texts_field)
        else:
            inp = self._validate_conversations(conversations, lengths, prompt_lengths, prompts)
        if labels:
            _check_count(labels, "labels", inp.rows)
            inp.labels = list(labels)
        if self.cfg.scorer is not None and SCORERS[self.cfg.scorer].needs_labels and inp.labels is None:
            raise InvalidArgument(f"labels: the scorer {self.cfg.scorer} needs one label per sample "
                                  f"({inp.rows})")
        return inp

    def _validate_tokens(self, tokens, lengths, prompt_lengths, prompts) -> ScoreInput:
        if prompts:
            raise InvalidArgument("prompts: only used with texts; with tokens, send prompt_lengths")
        check_tokens(tokens, "tokens", self.vocab_size, self.max_length, self.cfg.max_request_rows)
        if lengths is None:
            raise InvalidArgument("lengths: required with tokens")
        b, s = tokens.shape
        check_lengths(lengths, "lengths", b, s)
        lengths = lengths.long()
        tokens = token_ids(tokens, lengths, "tokens", self.vocab_size)
        inp = ScoreInput(rows=b, tokens=tokens, lengths=lengths)
        if prompt_lengths is not None:
            check_int_vector(prompt_lengths, "prompt_lengths", b)
            bad = ((prompt_lengths < 0) | (prompt_lengths > lengths)).nonzero()
            if len(bad):
                i = int(bad[0, 0])
                raise InvalidArgument(f"prompt_lengths: every entry must lie in [0, lengths[b]], got "
                                      f"prompt_lengths[{i}] = {int(prompt_lengths[i])} with "
                                      f"lengths[{i}] = {int(lengths[i])}")
            starts = prompt_lengths.tolist()
            inp.response_ids = [tokens[i, starts[i]:int(lengths[i])].tolist() for i in range(b)]
        elif self.cfg.scorer is not None:
            raise InvalidArgument(f"prompt_lengths: required by the rule scorer {self.cfg.scorer} "
                                  "when tokens are sent")
        if self.model is None:
            inp.tokens = inp.lengths = None  # rule mode reads responses only
        return inp

    def _validate_texts(self, texts, lengths, prompt_lengths, prompts, texts_field) -> ScoreInput:
        for name, value in (("lengths", lengths), ("prompt_lengths", prompt_lengths)):
            if value is not None:
                raise InvalidArgument(f"{name}: only used with tokens")
        b = len(texts)
        responses, whole = list(texts), []
        if prompts:
            _check_count(prompts, "prompts", b)
            # OpenRLHF truncates long prompts, so a text need not start with its prompt; it is then scored whole.
            whole = [i for i, (text, prompt) in enumerate(zip(texts, prompts)) if not text.startswith(prompt)]
            if whole:
                log.debug("%s%s do not start with their prompts; scored whole", texts_field, whole)
            responses = [text.removeprefix(prompt) for text, prompt in zip(texts, prompts)]
        # the rule scorers read each response as token ids decoded without their special tokens would read: a text
        # decoded with them kept (OpenRLHF's queries) ends with the policy's EOS text, which no label has
        inp = ScoreInput(rows=b, responses=[without_end_marks(r, self.end_marks) for r in responses])
        if prompts and self.encoder:  # encoders' reward models are trained on (prompt, response) pairs, as sent
            pairs = [(p, r) if i not in whole else (t, None)
                     for i, (t, p, r) in enumerate(zip(texts, prompts, responses))]
            inp.tokens, inp.lengths = self._tokenize_pairs(pairs, texts_field)
        elif self.model is not None:
            inp.tokens, inp.lengths = self._tokenize(texts, texts_field)
        return inp

    def _validate_conversations(self, conversations, lengths, prompt_lengths, prompts) -> ScoreInput:
        for name, value in (("lengths", lengths), ("prompt_lengths", prompt_lengths), ("prompts", prompts or None)):
            if value is not None:
                raise InvalidArgument(f"{name}: not used with conversations (each carries its prompt's messages)")
        for i, messages in enumerate(conversations):
            if not messages:
                raise InvalidArgument(f"conversations[{i}].messages: empty; expected the prompt's messages, then the "
                                      f"response as an assistant message")
            for k, message in enumerate(messages):
                if not message["role"]:
                    raise InvalidArgument(f"conversations[{i}].messages[{k}].role: empty")
            if messages[-1]["role"] != "assistant":
                raise InvalidArgument(f"conversations[{i}].messages[{len(messages) - 1}].role: the last message is "
                                      f"the response, so its role must be 'assistant', got {messages[-1]['role']!r}")
        # the rule scorers read the response without the end-of-text mark it may end with, as they read texts
        inp = ScoreInput(rows=len(conversations),
                         responses=[without_end_marks(messages[-1]["content"], self.end_marks) for messages in conversations])
        if self.model is not None:
            if self.tokenizer.chat_template is None:
                raise InvalidArgument("conversations: the reward model's tokenizer has no chat template (GetInfo's "
                                      "chat_template is false); send texts")
            rendered = []
            for i, messages in enumerate(conversations):
                try:
                    rendered.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
                except Exception as e:  # noqa: BLE001 - the template's own complaint, e.g. roles must alternate
                    raise InvalidArgument(f"conversations[{i}]: the reward model's chat template refused it: "
                                          f"{type(e).__name__}: {e}") from None
            inp.tokens, inp.lengths = self._tokenize(rendered, "conversations", rendered=True)
        return inp

    def _tokenize(self, texts: list[str], field: str, *, rendered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """texts -> (tokens int64 [B, S] right-padded, lengths int64 [B]). A plain text is encoded as the tokenizer
        encodes a text on its own (its BOS, or an encoder's [CLS] and [SEP]; not twice when the text carries them),
        which is how reward models are trained on plain text; a `rendered` chat template gets no special tokens on
        top, since the template writes its own."""
        texts = [self._bounded(text, f"{field}[{i}]") for i, text in enumerate(texts)]
        ids = (self.tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"] if rendered
               else text_ids(self.tokenizer, texts, ending=True))
        return self._pad_checked(ids, field)

    def _bounded(self, text: str, field: str) -> str:
        """A text short enough to tokenize: one longer than max_text_chars cannot fit the max length in any case, so
        it is refused (long_texts=refuse) or cut there (truncate: its first max-length tokens lie well inside)
        before the tokenizer sees it; a 200 MB query took gigabytes to tokenize, and the server with them."""
        if len(text) <= self.max_text_chars:
            return text
        if self.cfg.long_texts == "truncate":
            return text[:self.max_text_chars]
        raise InvalidArgument(f"{field}: {len(text)} characters, more than the model's max length of {self.max_length} "
                              f"tokens can hold (at most {self.max_text_chars} characters are tokenized)")

    def _tokenize_pairs(self, pairs: list[tuple[str, str | None]], field: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt, response) pairs as the tokenizer encodes a pair (`[CLS] prompt [SEP] response [SEP]`); a pair
        without a response is its text alone."""
        pairs = [(self._bounded(a, f"{field}[{i}]"), None if b is None else self._bounded(b, f"{field}[{i}]"))
                 for i, (a, b) in enumerate(pairs)]
        ids = [self.tokenizer(a, b, verbose=False)["input_ids"] if b is not None else
               text_ids(self.tokenizer, [a], ending=True)[0] for a, b in pairs]
        return self._pad_checked(ids, field)

    def _pad_checked(self, ids: list[list[int]], field: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.long_texts == "truncate" and (cut := [i for i, row in enumerate(ids) if len(row) > self.max_length]):
            ids = [row[:self.max_length] for row in ids]
            self.on_truncated(len(cut))
            log.debug("%s%s truncated to the model's max length %d (long_texts=truncate)", field, cut, self.max_length)
        for i, row in enumerate(ids):
            if not row:
                raise InvalidArgument(f"{field}[{i}]: has no tokens")
            if max(row) >= self.vocab_size:
                raise InvalidArgument(f"{field}[{i}]: encodes to token {self.tokenizer.convert_ids_to_tokens(max(row))!r} "
                                      f"(id {max(row)}), past the reward model's {self.vocab_size} embeddings: its "
                                      f"tokenizer has tokens the model was not resized for")
            if len(row) > self.max_length:
                raise InvalidArgument(f"{field}[{i}]: {len(row)} tokens exceed the model's max length "
                                      f"{self.max_length}")
        tokens, lengths = right_pad(ids, self.pad_id)
        check_tokens(tokens, field, self.vocab_size, self.max_length, self.cfg.max_request_rows)
        return tokens, lengths  # every id checked above, row by row; the padding is the tokenizer's pad id

    # --- scoring --------------------------------------------------------------------------------
    def score_batch(self, requests: list[ScoreInput]) -> list[ScoreOutput]:
        """Rewards float32 [B_i] and components for each request. The learned model runs on all requests'
        rows together, in forward passes of at most max_batch_size rows and max_tokens_per_pass padded tokens, of
        similar length, each trimmed to its longest row."""
        model_rewards = self._model_rewards(requests) if self.model is not None else None
        out = []
        for i, (req, components) in enumerate(zip(requests, self._rule_components(requests), strict=True)):
            if model_rewards is not None:
                reward = model_rewards[i]
            else:  # validation made sure the request has what the scorer needs
                reward = components[component_name(self.cfg.scorer)]
            out.append((reward, components))
        return out

    @torch.inference_mode()
    def _model_rewards(self, requests: list[ScoreInput]) -> list[torch.Tensor]:
        tokens = pad_and_stack([r.tokens for r in requests], pad=self.pad_id)
        lengths = torch.cat([r.lengths for r in requests])
        self.packing.pack()
        rewards = by_length(lambda tok, n: self.scores(self.model, tok, n), tokens, lengths,
                            self.cfg.batching.max_batch_size, self.device, self.cfg.batching.max_tokens_per_pass,
                            observe=functools.partial(self.observe_pass, "Score"))
        rewards = self.normalize_reward(rewards)
        return list(rewards.split([r.rows for r in requests]))

    def _rule_components(self, requests: list[ScoreInput]) -> list[dict[str, torch.Tensor]]:
        """Each request's rule scores, by component name. Each scorer runs once over the samples of every request
        that has what it needs (labels, responses), so math_verify's workers take a merged batch's samples side by
        side."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in requests]
        for name in self.component_scorers:
            scorer = SCORERS[name]
            able = [i for i, req in enumerate(requests) if not (scorer.needs_labels and req.labels is None)
                    and self._responses(req) is not None]
            responses = [r for i in able for r in requests[i].responses]
            labels = [label for i in able for label in (requests[i].labels or [None] * requests[i].rows)]
            if scorer.score is not None:
                scores = [scorer.score(response, label) for response, label in zip(responses, labels, strict=True)]
            else:  # math_verify, in worker processes
                assert self.verifier is not None
                scores = self.verifier.score(responses, labels, self.abandoned) if responses else []
            start = 0
            for i in able:
                out[i][component_name(name)] = torch.tensor(scores[start:start + requests[i].rows],
                                                            dtype=torch.float32)
                start += requests[i].rows
        return out

    def _responses(self, req: ScoreInput) -> list[str] | None:
        """The request's responses as text, decoded here (on the model thread) and kept for the next scorer; None
        when it carries neither texts nor token ids of them."""
        if req.responses is None and req.response_ids is not None:
            req.responses = self.tokenizer.batch_decode(req.response_ids, skip_special_tokens=True)
        return req.responses


MAX_TEXT_CHARS = 2**22  # the most characters of one text tokenized, whatever the max length (4 Mi)


def _check_count(values: list[str], field: str, rows: int) -> None:
    if len(values) != rows:
        raise InvalidArgument(f"{field}: expected one entry per sample ({rows}) or none, got {len(values)}")
