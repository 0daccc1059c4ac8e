"""The synthetic task behind the embedded default: "answer a topic prompt with positive words".

A prompt is 2-5 distinct topic words followed by the separator, e.g. ``"river castle winter =>"``.
A response is 3-10 positive, negative or filler words, e.g. ``"very good and sad"``, ended by ``<eos>``.
The ground-truth reward of a response is the fraction of its words that are positive, in [0, 1].

Everything here is pure Python (no torch) and deterministic given the seed / ``random.Random``.
"""

from __future__ import annotations

import random

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, BOS, EOS)
# The separator is an ordinary word token (the tokenizer does not treat it as special).
SEPARATOR = "=>"

# fmt: off
TOPIC_WORDS: tuple[str, ...] = (
    "river", "mountain", "garden", "city", "ocean", "forest", "market", "library",
    "train", "kitchen", "winter", "island", "castle", "bridge", "desert", "village",
)
POSITIVE_WORDS: tuple[str, ...] = (
    "good", "great", "happy", "love", "excellent", "wonderful",
    "bright", "kind", "joyful", "brilliant", "pleasant", "amazing",
)
NEGATIVE_WORDS: tuple[str, ...] = (
    "bad", "awful", "sad", "hate", "terrible", "horrible",
    "dull", "cruel", "gloomy", "boring", "nasty", "poor",
)
FILLER_WORDS: tuple[str, ...] = ("the", "a", "and", "very", "so", "really")
# fmt: on

# Word-level vocabulary in id order: specials first (<pad> = 0), then the separator and the word sets.
VOCAB: tuple[str, ...] = (
    SPECIAL_TOKENS + (SEPARATOR,) + TOPIC_WORDS + POSITIVE_WORDS + NEGATIVE_WORDS + FILLER_WORDS
)
RESPONSE_WORDS: tuple[str, ...] = POSITIVE_WORDS + NEGATIVE_WORDS + FILLER_WORDS

MIN_TOPICS, MAX_TOPICS = 2, 5
MIN_RESPONSE_WORDS, MAX_RESPONSE_WORDS = 3, 10
# Share of negative words among the non-positive words of a sampled response (the rest is filler).
NEGATIVE_SHARE = 0.6
# p_positive of the SFT data: 25% positive / 45% negative / 30% filler words, so SFT samples score ~0.25.
SFT_P_POSITIVE = 0.25

_POSITIVE = frozenset(POSITIVE_WORDS)
_NEGATIVE = frozenset(NEGATIVE_WORDS)
_SPECIAL = frozenset(SPECIAL_TOKENS)


def make_prompt(rng: random.Random) -> str:
    """One prompt: 2-5 distinct topic words, then the separator."""
    topics = rng.sample(TOPIC_WORDS, rng.randint(MIN_TOPICS, MAX_TOPICS))
    return " ".join([*topics, SEPARATOR])


def make_prompts(n: int, seed: int) -> list[str]:
    """``n`` prompts like ``"river castle winter =>"``, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [make_prompt(rng) for _ in range(n)]


def sample_response(rng: random.Random, p_positive: float, length: int | None = None) -> list[str]:
    """Response words (no ``<eos>``): each word is positive with probability ``p_positive``, else
    negative (60%) or filler (40%), uniformly within its set. ``length`` defaults to uniform 3-10."""
    if length is None:
        length = rng.randint(MIN_RESPONSE_WORDS, MAX_RESPONSE_WORDS)
    words = []
    for _ in range(length):
        if rng.random() < p_positive:
            words.append(rng.choice(POSITIVE_WORDS))
        elif rng.random() < NEGATIVE_SHARE:
            words.append(rng.choice(NEGATIVE_WORDS))
        else:
            words.append(rng.choice(FILLER_WORDS))
    return words


def positive_fraction(response_text: str) -> float:
    """Ground-truth reward of a response: (#positive words) / (#words), in [0, 1].

    ``response_text`` is the response alone (no prompt), words separated by whitespace, as
    ``tokenizer.decode(ids, skip_special_tokens=True)`` gives it. Special tokens (``<pad>``, ``<unk>``,
    ``<bos>``, ``<eos>``) are ignored: they count neither as words nor as positive. Every other word
    counts in the denominator, so topic words, the separator and out-of-vocabulary words dilute the
    reward. A response with no words scores 0.0.
    """
    return _fraction_in(response_text, _POSITIVE)


def negative_fraction(response_text: str) -> float:
    """(#negative words) / (#words), in [0, 1], with the word rules of :func:`positive_fraction`.
    A response with no words scores 0.0."""
    return _fraction_in(response_text, _NEGATIVE)


def _fraction_in(response_text: str, vocabulary: frozenset[str]) -> float:
    words = response_words(response_text)
    if not words:
        return 0.0
    return sum(w in vocabulary for w in words) / len(words)


def response_words(response_text: str) -> list[str]:
    """The words that count in a response: split on whitespace, special tokens left out."""
    return [w for w in response_text.split() if w not in _SPECIAL]
