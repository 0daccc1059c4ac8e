"""The reward server as its users meet it: `python -m reward_server`, its gRPC API and POST /get_reward."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from embedded import resolve_model, task
from ppo_services.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from reward_server.config import RewardConfig
from reward_server.core import RewardCore
from reward_server.scorers import SCORERS, as_number, math_answer, no_negative
from serving.codec import decode, encode
from serving.errors import InvalidArgument
from serving.modeling import (
    RewardNormalization,
    last_token_scores,
    load_scalar_head_model,
    load_tokenizer,
    per_token_scores,
    reward_normalization,
    text_ids,
    vocab_sha256,
)
from serving.wire import grpc_options
from tests.conftest import OPENRLHF_MEAN, OPENRLHF_STD
from tests.grpc_helpers import channel, expect_invalid
from tests.network_path import NetworkPath
from tests.service_procs import ROOT, ServiceProcess, histogram_stats

SCORE = "/ppo_services.v1.RewardService/Score"
GET_INFO = "/ppo_services.v1.RewardService/GetInfo"


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(embedded_cache, log_dir):
    """The default learned reward model; a long batching delay, the longest a batch waits for callers it expects."""
    extra = ("components=[positive_fraction]", "batching.max_queue_delay_ms=100")
    env = {"PPO_SERVICES_CACHE": str(embedded_cache)}
    with ServiceProcess("reward", *extra, log_dir=log_dir, env=env) as proc:
        yield proc


@pytest.fixture(scope="module")
def rule_server(embedded_cache, log_dir):
    """A rule scorer (3 s of grace at its SIGTERM, the last test's)."""
    with ServiceProcess("reward", "--scorer", "positive_fraction", "grace_period_s=3", log_dir=log_dir,
                        env={"PPO_SERVICES_CACHE": str(embedded_cache)}) as proc:
        yield proc


@pytest.fixture(scope="module")
def exact_server(embedded_cache, log_dir):
    """exact_match as the reward, both task scorers as components."""
    with ServiceProcess("reward", "--scorer", "exact_match", "components=[positive_fraction,no_negative]",
                        log_dir=log_dir, env={"PPO_SERVICES_CACHE": str(embedded_cache)}) as proc:
        yield proc


def open_stub(proc: ServiceProcess):
    channel = grpc.insecure_channel(proc.address, options=grpc_options(64))
    return channel, reward_pb2_grpc.RewardServiceStub(channel)


@pytest.fixture(scope="module")
def stub(server):
    channel, stub = open_stub(server)
    yield stub
    channel.close()


@pytest.fixture(scope="module")
def rule_stub(rule_server):
    channel, stub = open_stub(rule_server)
    yield stub
    channel.close()


@pytest.fixture(scope="module")
def tokenizer(embedded_cache):
    return load_tokenizer(resolve_model("embedded:reward"))


@pytest.fixture(scope="module")
def reference_model(embedded_cache):
    """The same weights, in this process."""
    return load_scalar_head_model(resolve_model("embedded:reward")).eval()


# --- helpers ------------------------------------------------------------------------------------


def make_samples(seed: int, n: int) -> list[tuple[str, str]]:
    """(prompt, response) pairs of the embedded task, responses ended with <eos> half the time."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = task.sample_response(rng, rng.random()) + ([task.EOS] if rng.random() < 0.5 else [])
        out.append((task.make_prompt(rng), " ".join(words)))
    return out


def encode_samples(tokenizer, samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens int64 [B, S] right-padded, lengths [B], prompt_lengths [B]) of prompt + response."""
    rows = [tokenizer(f"{p} {r}", add_special_tokens=False)["input_ids"] for p, r in samples]
    prompt_lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p, _ in samples]
    lengths = torch.tensor([len(r) for r in rows])
    # Three extra padding columns on purpose: padding must not change a reward.
    tokens = torch.full((len(rows), int(lengths.max()) + 3), tokenizer.pad_token_id)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row)
    return tokens, lengths, torch.tensor(prompt_lengths)


def token_request(tokenizer, samples, with_prompt_lengths: bool = True) -> reward_pb2.ScoreRequest:
    tokens, lengths, prompt_lengths = encode_samples(tokenizer, samples)
    req = reward_pb2.ScoreRequest(tokens=encode(tokens), lengths=encode(lengths))
    if with_prompt_lengths:
        req.prompt_lengths.CopyFrom(encode(prompt_lengths))
    return req


@torch.inference_mode()
def expected_rewards(model, tokenizer, samples) -> torch.Tensor:
    tokens, lengths, _ = encode_samples(tokenizer, samples)
    return last_token_scores(per_token_scores(model, tokens, lengths), lengths)


def truth(samples) -> torch.Tensor:
    return torch.tensor([task.positive_fraction(r) for _, r in samples])


def batch_size_stats(proc: ServiceProcess, method: str = "Score") -> tuple[float, float]:
    """(number of executed batches, total rows) from the batch-size histogram on /metrics."""
    return histogram_stats(proc, "ppo_reward_batch_size", method)


def request_count(proc: ServiceProcess, method: str, code: str) -> float:
    text = httpx.get(f"{proc.http}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "ppo_reward_requests_total" and s.labels == {"method": method, "code": code})


# --- learned reward model -----------------------------------------------------------------------


def test_get_info(stub, tokenizer):
    info = stub.GetInfo(common_pb2.GetInfoRequest())
    assert info.model == "embedded:reward"
    assert info.kind == "model"
    assert info.vocab_size == len(task.VOCAB)
    assert info.max_length == 64
    assert info.vocab_sha256 == vocab_sha256(tokenizer)
    assert list(info.components) == ["reward/positive_fraction"]
    assert not info.chat_template  # the embedded tokenizer has none


def test_score_tokens_matches_in_process_model(server, stub, tokenizer, reference_model):
    samples = make_samples(seed=1, n=6)
    passes_before, tokens_before = histogram_stats(server, "ppo_reward_pass_tokens", "Score")
    reply = stub.Score(token_request(tokenizer, samples))
    # one forward pass over the 6 rows trimmed to the longest (the request's 3 extra padding columns dropped)
    passes, tokens = histogram_stats(server, "ppo_reward_pass_tokens", "Score")
    assert (passes - passes_before, tokens - tokens_before) == (1, 6 * int(encode_samples(tokenizer, samples)[1].max()))
    rewards = decode(reply.rewards, "rewards")
    assert rewards.dtype == torch.float32 and rewards.shape == (6,)
    expected = expected_rewards(reference_model, tokenizer, samples)
    torch.testing.assert_close(rewards, expected, atol=1e-5, rtol=0)
    # on a CPU in float32, eager: the pass computed through prepacked weights (prepack_weights, the default)
    assert "Score passes compute through linear weights prepacked for oneDNN" in server.log()
    # The ground truth rides along as a component, computed on the response part only.
    assert set(reply.components) == {"reward/positive_fraction"}
    torch.testing.assert_close(decode(reply.components["reward/positive_fraction"], "c"), truth(samples))


def test_score_without_prompt_lengths_has_no_components(stub, tokenizer):
    reply = stub.Score(token_request(tokenizer, make_samples(seed=2, n=2), with_prompt_lengths=False))
    assert decode(reply.rewards, "rewards").shape == (2,)
    assert dict(reply.components) == {}


def test_score_texts_equals_score_tokens(stub, tokenizer):
    samples = make_samples(seed=3, n=5)
    by_tokens = stub.Score(token_request(tokenizer, samples))
    by_texts = stub.Score(reward_pb2.ScoreRequest(texts=[f"{p} {r}" for p, r in samples],
                                                  prompts=[f"{p} " for p, _ in samples]))
    torch.testing.assert_close(decode(by_texts.rewards, "r"), decode(by_tokens.rewards, "r"),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(decode(by_texts.components["reward/positive_fraction"], "c"), truth(samples))


def test_concurrent_scores_are_merged_and_correct(server, stub, tokenizer, reference_model):
    batches = [make_samples(seed=100 + i, n=2) for i in range(8)]
    expected = [expected_rewards(reference_model, tokenizer, b) for b in batches]
    results: list[torch.Tensor | None] = [None] * len(batches)
    barrier = threading.Barrier(len(batches))

    def call(i: int) -> None:
        request = token_request(tokenizer, batches[i])
        barrier.wait()
        results[i] = decode(stub.Score(request, timeout=30).rewards, "rewards")

    count_before, rows_before = batch_size_stats(server)
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, expected, strict=True):
        assert got is not None
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    count_after, rows_after = batch_size_stats(server)
    assert rows_after - rows_before == 16
    assert count_after - count_before < len(batches), "no two Score calls were merged into one batch"


def test_get_reward_speaks_openrlhf_protocol(server, stub):
    samples = make_samples(seed=4, n=3)
    body = {"query": [f"{p} {r}" for p, r in samples], "prompts": [f"{p} " for p, _ in samples],
            "labels": ["", "", ""]}
    before = request_count(server, "get_reward", "OK")
    response = httpx.post(f"{server.http}/get_reward", json=body, timeout=30)
    assert response.status_code == 200, response.text
    out = response.json()
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert out["rewards"] == out["scores"] and len(out["rewards"]) == 3
    assert all(isinstance(v, float) for v in out["rewards"])
    assert out["extra_logs"] == {"reward/positive_fraction": pytest.approx(truth(samples).tolist())}
    grpc_reply = stub.Score(reward_pb2.ScoreRequest(texts=body["query"]))
    assert out["rewards"] == pytest.approx(decode(grpc_reply.rewards, "r").tolist(), abs=1e-6)
    assert request_count(server, "get_reward", "OK") == before + 1


def test_get_reward_scores_openrlhf_s_padded_queries_as_the_unpadded_ones(server, tokenizer):
    """OpenRLHF decodes its padded batch with special tokens kept: pads before the prompt, pads after the EOS. Its
    own reward server strips them, and so does this one; an empty slice of a batch (OpenRLHF spreads a batch over
    several servers) gets empty lists, as OpenRLHF's server answers it."""
    pad, eos = tokenizer.pad_token, tokenizer.eos_token
    samples = make_samples(seed=12, n=3)
    plain = [f"{p} {r}" for p, r in samples]
    prompts = [f"{p} " for p, _ in samples]
    expected = openrlhf_rewards(f"{server.http}/get_reward", plain, prompts, [])["rewards"]
    with_eos = openrlhf_rewards(f"{server.http}/get_reward", [q + eos for q in plain], prompts, [])["rewards"]
    assert with_eos != pytest.approx(expected, abs=1e-6)  # the EOS is scored: it is no padding
    padded = [pad * 3 + plain[0], pad * 2 + plain[1], pad + plain[2]]
    assert openrlhf_rewards(f"{server.http}/get_reward", padded, [pad * 3 + p for p in prompts],
                            [])["rewards"] == pytest.approx(expected, abs=1e-6)
    after_eos = [pad * 2 + plain[0] + eos + pad * 10, plain[1] + eos * 3, plain[2] + eos + pad]
    assert openrlhf_rewards(f"{server.http}/get_reward", after_eos, prompts,
                            [])["rewards"] == pytest.approx(with_eos, abs=1e-6)
    # a tokenizer that decodes word by word puts spaces between the special tokens (this one does)
    spaced = [f"{pad} {pad} {plain[0]} {eos} {pad} {pad}", f"{plain[1]} {eos} {eos}", f"{plain[2]} {eos}\n{pad}"]
    assert openrlhf_rewards(f"{server.http}/get_reward", spaced, [f"{pad} {pad} {prompts[0]}", *prompts[1:]],
                            [])["rewards"] == pytest.approx(with_eos, abs=1e-6)
    assert openrlhf_rewards(f"{server.http}/get_reward", [], [], []) == {"rewards": [], "scores": [],
                                                                          "extra_logs": {}}


def test_special_token_runs_of_any_length_are_stripped_in_one_pass():
    """A regular expression of repeated alternatives backtracked on a run of pads that something else followed: one
    200 KB query held the event loop for 10 s, and the time grew with the square of the run. Now each end is read
    once: 400,000 marks (2 MB, hours before) take milliseconds; the bound leaves a hundredfold margin."""
    from types import SimpleNamespace

    from reward_server.rest import unpadded
    from reward_server.special_text import COMMON_END_MARKS, special_marks, without_end_marks

    strip = unpadded(SimpleNamespace(pad_token="<pad>", eos_token="<eos>"))
    runs = 400_000
    for text, want in (("x" + "<pad>" * runs + "y", None), ("<pad>" * runs + "x" + "<eos> " * runs, "x<eos>"),
                       ("x" + "<pad> " * runs + "<eos>", None), ("x<" * runs + "<eos>", None)):
        start = time.perf_counter()
        assert strip(text) == (text if want is None else want)
        assert time.perf_counter() - start < 2.0
    marks = special_marks(("<pad>", "<eos>", *COMMON_END_MARKS))
    assert without_end_marks("#### 42<|im_end|>", marks) == "#### 42"
    assert without_end_marks("42 <eos> <pad>\n", marks) == "42" and without_end_marks("4<eos>2", marks) == "4<eos>2"


def test_long_texts_truncate_scores_the_first_max_length_tokens_as_openrlhf_s_server(embedded_cache, log_dir,
                                                                                      tokenizer):
    """By default a text past the model's max length is refused naming it (a 400 on /get_reward); with
    long_texts=truncate it is cut to its first max-length tokens and scored, as OpenRLHF's server does, and
    counted."""
    long = " ".join(["good"] * 100)
    cut = tokenizer.decode(text_ids(tokenizer, [long], ending=True)[0][:64])
    with ServiceProcess("reward", "long_texts=truncate", log_dir=log_dir) as server, channel(server.address) as ch:
        stub = reward_pb2_grpc.RewardServiceStub(ch)
        out = openrlhf_rewards(f"{server.http}/get_reward", [long, "good day"], [], [])
        expected = decode(stub.Score(reward_pb2.ScoreRequest(texts=[cut, "good day"])).rewards, "r").tolist()
        assert out["rewards"] == pytest.approx(expected, abs=1e-6)
        # one far past what the max length can hold is cut before it is tokenized, to the same first tokens
        assert openrlhf_rewards(f"{server.http}/get_reward", [" ".join(["good"] * 200_000)], [],
                                [])["rewards"] == pytest.approx(expected[:1], abs=1e-6)
        metrics = httpx.get(f"{server.http}/metrics", timeout=10).text
    assert "ppo_reward_truncated_texts_total 2.0" in metrics


def test_huge_get_reward_bodies_and_texts_are_refused_before_they_are_read_or_tokenized(server):
    """/get_reward had no body limit and tokenized each query whole before checking its length (some 300 B a
    token): one 200 MB query took the server's memory with it. A body past the receive limit gets 413 (declared
    or chunked), a text that cannot fit the max length is refused before it is tokenized, and a request carries at
    most max_request_rows samples."""
    url = f"{server.http}/get_reward"
    too_large = request_count(server, "get_reward", "RESOURCE_EXHAUSTED")
    huge = httpx.post(url, json={"query": ["good " * 200_000]}, timeout=60)
    assert huge.status_code == 400 and "query[0]: 1000000 characters, more than the model's max length of 64 tokens" \
        in huge.json()["detail"], huge.text
    body = json.dumps({"query": ["x" * (18 * 2**20)]}).encode()  # the embedded models' limit is 17 MiB
    declared = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    chunked = httpx.post(url, content=iter([body[i:i + 2**20] for i in range(0, len(body), 2**20)]),
                         headers={"Content-Type": "application/json"}, timeout=60)
    for reply in (declared, chunked):
        assert reply.status_code == 413 and "larger than this server takes" in reply.json()["detail"], reply.text
    assert request_count(server, "get_reward", "RESOURCE_EXHAUSTED") == too_large + 2  # counted (they were not)
    text = httpx.get(f"{server.http}/metrics").text  # and every counted request is in the latency histogram
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    counted = sum(s.value for s in samples if s.name == "ppo_reward_requests_total" and s.labels["method"] == "get_reward")
    timed = sum(s.value for s in samples if s.name == "ppo_reward_request_duration_seconds_count"
                and s.labels["method"] == "get_reward")
    assert counted == timed, (counted, timed)
    many = httpx.post(url, json={"query": ["good"] * 4097}, timeout=60)
    assert many.status_code == 400 and "query: 4097 samples" in many.json()["detail"] and "max_request_rows" in \
        many.json()["detail"], many.text
    # counted before any per-query work (a 14 MB body of 3.5 M one-letter queries held the event loop 26 s being
    # checked and stripped one by one before the count refused it): the count is named, not query[4097]'s problem
    bad_last = httpx.post(url, content=json.dumps({"query": ["good"] * 4097 + ["\ud800"]}),
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert bad_last.status_code == 400 and "query: 4098 samples" in bad_last.json()["detail"], bad_last.text
    assert openrlhf_rewards(url, ["good day"], [], [])["rewards"]  # and it goes on serving
    assert httpx.get(f"{server.http}/health", timeout=10).status_code == 200


def _requests_with_errors(tokenizer) -> list[tuple[str, reward_pb2.ScoreRequest, str]]:
    samples = make_samples(seed=5, n=2)
    tokens, lengths, prompt_lengths = encode_samples(tokenizer, samples)

    def tok(**fields) -> reward_pb2.ScoreRequest:
        base = {"tokens": encode(tokens), "lengths": encode(lengths)}
        return reward_pb2.ScoreRequest(**{**base, **fields})

    unknown = tokens.clone()
    unknown[0, 0] = len(task.VOCAB) + 7
    return [
        ("neither", reward_pb2.ScoreRequest(), "tokens, texts"),
        ("both", tok(texts=["good", "bad"]), "tokens, texts"),
        ("lengths missing", reward_pb2.ScoreRequest(tokens=encode(tokens)), "lengths"),
        ("lengths too long", tok(lengths=encode(lengths + 100)), "lengths"),
        ("lengths zero", tok(lengths=encode(torch.zeros_like(lengths))), "lengths"),
        ("lengths count", tok(lengths=encode(lengths[:1])), "lengths"),
        ("prompt_lengths > lengths", tok(prompt_lengths=encode(lengths + 1)), "prompt_lengths"),
        ("prompt_lengths < 0", tok(prompt_lengths=encode(-prompt_lengths)), "prompt_lengths"),
        ("float tokens", tok(tokens=encode(tokens.float())), "tokens"),
        ("unknown token id", tok(tokens=encode(unknown)), "tokens"),
        ("negative token id", tok(tokens=encode(-tokens)), "tokens"),
        ("1-d tokens", tok(tokens=encode(tokens[0])), "tokens"),
        ("labels count", tok(labels=["a"]), "labels"),
        ("prompts with tokens", tok(prompts=["a", "b"]), "prompts"),
        ("prompts count", reward_pb2.ScoreRequest(texts=["good", "bad"], prompts=["x"]), "prompts"),
        ("labels count (texts)", reward_pb2.ScoreRequest(texts=["good"], labels=["a", "b"]), "labels"),
        ("text too long", reward_pb2.ScoreRequest(texts=["good", "good " * 65]), "texts[1]"),
        ("empty text", reward_pb2.ScoreRequest(texts=["", "good"]), "texts[0]"),
        ("lengths with texts", reward_pb2.ScoreRequest(texts=["good"], lengths=encode(torch.tensor([1]))),
         "lengths"),
        ("texts and conversations", reward_pb2.ScoreRequest(texts=["good"], conversations=[chat("x =>", "good")]),
         "tokens, texts, conversations"),
        ("response not last", reward_pb2.ScoreRequest(conversations=[chat("x =>", "good", last="user")]),
         "conversations[0].messages[1].role"),
        ("empty conversation", reward_pb2.ScoreRequest(conversations=[reward_pb2.Conversation()]),
         "conversations[0].messages"),
        ("empty role", reward_pb2.ScoreRequest(conversations=[chat("x =>", "good", first="")]),
         "conversations[0].messages[0].role"),
        ("prompts with conversations", reward_pb2.ScoreRequest(conversations=[chat("x =>", "good")], prompts=["x"]),
         "prompts"),
        # the embedded reward model's tokenizer has no chat template
        ("no chat template", reward_pb2.ScoreRequest(conversations=[chat("x =>", "good")]), "conversations"),
    ]


def chat(prompt: str, response: str, first: str = "user", last: str = "assistant") -> reward_pb2.Conversation:
    return reward_pb2.Conversation(messages=[reward_pb2.ChatMessage(role=first, content=prompt),
                                             reward_pb2.ChatMessage(role=last, content=response)])


def test_bad_requests_are_invalid_argument_naming_the_field(stub, tokenizer):
    for name, request, field in _requests_with_errors(tokenizer):
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert err.value.details().startswith(field), (name, err.value.details())


def test_wrong_wire_tensor_is_invalid_argument(stub):
    bad = encode(torch.ones(2, 3, dtype=torch.int64))
    bad.data = bad.data[:-1]
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(reward_pb2.ScoreRequest(tokens=bad, lengths=encode(torch.tensor([3, 3]))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("tokens:")


@pytest.mark.parametrize("body, status, field", [
    ({"query": "good"}, 422, None),
    ({"prompts": ["x"]}, 422, None),
    ({"query": [1, 2]}, 422, None),
    ({"query": [], "prompts": ["x"]}, 400, "tokens, query"),
    ({"query": ["good", "bad"], "labels": ["a"]}, 400, "labels"),
    ({"query": ["good"], "labels": "42"}, 422, None),
    ({"query": ["good " * 65]}, 400, "query[0]"),
])
def test_get_reward_rejects_bad_bodies(server, body, status, field):
    before = request_count(server, "get_reward", "INVALID_ARGUMENT")
    response = httpx.post(f"{server.http}/get_reward", json=body, timeout=30)
    assert response.status_code == status, response.text
    assert request_count(server, "get_reward", "INVALID_ARGUMENT") == before + 1  # 422s are counted too
    if field is not None:
        assert response.json()["detail"].startswith(field)


@pytest.mark.parametrize("raw, reason", [
    (b'{"query": ["good \xff"]}', "UnicodeDecodeError"),  # not UTF-8
    (b'{"query": ["good"], "labels": [' + b"9" * 5000 + b']}', "ValueError"),  # past Python's 4,300 digits
    (b'{"query": ["good"], "labels": [' + b"[" * 5000 + b"]" * 5000 + b']}', "nested too deeply"),
], ids=["invalid-utf8", "5000-digit-label", "nested-5000-deep"])
def test_get_reward_refuses_a_body_it_cannot_parse_naming_why_and_counts_it(server, raw, reason):
    """FastAPI answers these "There was an error parsing the body" without the reason, and they went uncounted."""
    before = request_count(server, "get_reward", "INVALID_ARGUMENT")
    response = httpx.post(f"{server.http}/get_reward", content=raw, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["detail"].startswith("body: cannot be parsed as JSON") and reason in response.text
    assert request_count(server, "get_reward", "INVALID_ARGUMENT") == before + 1
    assert httpx.post(f"{server.http}/no_such_route", content=raw, timeout=30).status_code == 404


def test_get_reward_rejects_non_json(server):
    before = request_count(server, "get_reward", "INVALID_ARGUMENT")
    response = httpx.post(f"{server.http}/get_reward", content=b"\x00not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["detail"].startswith("body: cannot be parsed as JSON")
    response = httpx.post(f"{server.http}/get_reward", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"][0]["type"] == "json_invalid"
    assert request_count(server, "get_reward", "INVALID_ARGUMENT") == before + 2


def test_random_bytes_get_an_error_and_leave_the_server_serving(server, stub, tokenizer):
    samples = make_samples(seed=6, n=3)
    before = decode(stub.Score(token_request(tokenizer, samples)).rewards, "r")
    channel = grpc.insecure_channel(server.address)
    rng = random.Random(0)
    blobs = [rng.randbytes(n) for n in (1, 7, 64, 500, 4096)]
    for path, message in ((SCORE, reward_pb2.ScoreRequest), (GET_INFO, common_pb2.GetInfoRequest)):
        raw = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        for blob in blobs:
            try:
                message.FromString(blob)
                parses = True
            except DecodeError:
                parses = False
            if parses and path == GET_INFO:  # an empty message with unknown fields: a valid GetInfo
                raw(blob, timeout=30)
                continue
            with pytest.raises(grpc.RpcError) as err:
                raw(blob, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    after = decode(stub.Score(token_request(tokenizer, samples)).rewards, "r")
    assert torch.equal(before, after)


def test_ops_endpoints(server, stub, tokenizer):
    stub.Score(token_request(tokenizer, make_samples(seed=4, n=1)))  # one good and one bad call of its own
    assert httpx.post(f"{server.http}/get_reward", json={"query": "one"}, timeout=30).status_code == 422
    assert httpx.get(f"{server.http}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.http}/ready").status_code == 200
    metrics = httpx.get(f"{server.http}/metrics").text
    assert 'ppo_reward_requests_total{code="OK",method="Score"}' in metrics
    assert 'ppo_reward_requests_total{code="INVALID_ARGUMENT",method="get_reward"}' in metrics
    assert "ppo_reward_ready 1.0" in metrics


# --- rule-based scorer --------------------------------------------------------------------------


def test_rule_scorer_info(rule_stub, tokenizer):
    info = rule_stub.GetInfo(common_pb2.GetInfoRequest())
    assert (info.model, info.kind) == ("rule:positive_fraction", "rule")
    assert info.vocab_size == len(task.VOCAB)
    assert info.vocab_sha256 == vocab_sha256(tokenizer)
    assert list(info.components) == ["reward/positive_fraction"]
    assert not info.needs_labels


def test_a_scorer_that_compares_with_labels_says_so_in_get_info(exact_server):
    channel, stub = open_stub(exact_server)
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30)
    channel.close()
    assert info.model == "rule:exact_match" and info.needs_labels


def test_a_response_ending_with_its_end_of_text_mark_scores_alike_as_a_text_and_as_a_conversation(exact_server):
    """The rule scorers read a response without the end-of-text mark it ends with (a text decoded with its special
    tokens kept); an assistant message ending with one was scored with it, so the same answer scored 0."""
    channel, stub = open_stub(exact_server)
    responses = ["42</s>", "42<|im_end|>", "42 <|eot_id|>", "42"]
    by_texts = stub.Score(reward_pb2.ScoreRequest(texts=responses, labels=["42"] * 4), timeout=60)
    by_chats = stub.Score(reward_pb2.ScoreRequest(conversations=[chat("x =>", r) for r in responses],
                                                  labels=["42"] * 4), timeout=60)
    channel.close()
    assert decode(by_texts.rewards, "r").tolist() == decode(by_chats.rewards, "r").tolist() == [1.0] * 4


def test_token_padding_may_hold_any_id_for_the_model_and_the_rule_scorers(stub, tokenizer):
    """Positions at or past lengths[b] are padding and ignored (-1 and -100 were refused): the rewards and the
    components are those of the same rows padded with in-vocabulary ids."""
    samples = make_samples(seed=12, n=4)
    tokens, lengths, prompt_lengths = encode_samples(tokenizer, samples)
    padding = torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]
    assert padding.any()
    replies = []
    for pad in (0, -1, -100, len(tokenizer) + 7):
        request = reward_pb2.ScoreRequest(tokens=encode(torch.where(padding, pad, tokens)), lengths=encode(lengths),
                                          prompt_lengths=encode(prompt_lengths))
        reply = stub.Score(request, timeout=60)
        replies.append((decode(reply.rewards, "r"), decode(reply.components["reward/positive_fraction"], "c")))
    for rewards, component in replies[1:]:
        torch.testing.assert_close(rewards, replies[0][0], atol=0, rtol=0)
        torch.testing.assert_close(component, replies[0][1], atol=0, rtol=0)


def test_rule_scorer_scores_hand_written_responses(rule_server, rule_stub, tokenizer):
    samples = [
        ("river castle =>", "good bad the great"),  # 2 of 4 positive
        ("ocean =>", "amazing <eos>"),  # special tokens do not count
        ("city desert =>", "sad awful"),
        ("forest =>", "good kind so great"),  # 3 of 4
    ]
    want = [0.5, 1.0, 0.0, 0.75]  # exact in float32
    by_tokens = rule_stub.Score(token_request(tokenizer, samples))
    assert decode(by_tokens.rewards, "r").tolist() == pytest.approx(want, abs=0)
    by_texts = rule_stub.Score(reward_pb2.ScoreRequest(texts=[f"{p} {r}" for p, r in samples],
                                                       prompts=[p for p, _ in samples]))
    assert decode(by_texts.rewards, "r").tolist() == pytest.approx(want, abs=0)
    assert decode(by_texts.components["reward/positive_fraction"], "c").tolist() == pytest.approx(want, abs=0)
    body = {"query": [r for _, r in samples]}
    out = httpx.post(f"{rule_server.http}/get_reward", json=body, timeout=30).json()
    assert out["rewards"] == pytest.approx(want, abs=0)


def test_rule_scorer_needs_prompt_lengths_with_tokens(rule_stub, tokenizer):
    with pytest.raises(grpc.RpcError) as err:
        rule_stub.Score(token_request(tokenizer, make_samples(seed=7, n=2), with_prompt_lengths=False))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt_lengths")


def test_exact_match_compares_the_response_with_the_label(embedded_cache):
    core = RewardCore(RewardConfig(scorer="exact_match", device="cpu"))
    core.load()
    inp = core.validate(texts=["what is 6 x 7? 42 ", "what is 6 x 7? 41"], prompts=["what is 6 x 7?"] * 2,
                        labels=["42", "42"])
    [(rewards, components)] = core.score_batch([inp])
    assert rewards.tolist() == [1.0, 0.0]
    assert components["reward/exact_match"].tolist() == [1.0, 0.0]
    with pytest.raises(InvalidArgument, match="^labels"):
        core.validate(texts=["42"])


def test_unknown_scorer_exits_2_listing_the_scorers(embedded_cache):
    proc = subprocess.run([sys.executable, "-m", "reward_server", "--scorer", "nonsense"], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "scorer" in proc.stderr and "nonsense" in proc.stderr
    for name in SCORERS:
        assert name in proc.stderr, name


@pytest.mark.parametrize("service, flag", [("reward_server", "--model"), ("critic_server", "--reward-model")])
def test_a_model_without_a_trained_reward_head_is_refused_at_start(embedded_assets, tmp_path, service, flag):
    """A causal LM (here the embedded policy) given as the reward model would score with a randomly initialised head:
    both servers that score stop at start, naming the checkpoint, instead of serving random rewards."""
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt")] if service == "critic_server" else []
    proc = subprocess.run([sys.executable, "-m", service, "--port", "0", "--http-port", "0", flag,
                           str(embedded_assets.policy), *checkpoints],
                          cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"{embedded_assets.policy} has no weights for the reward head (score.weight): it is not a reward model" \
        in proc.stderr


# --- chat reward models ------------------------------------------------------------------------------

# Renders a conversation as the embedded reward model reads text: "prompt response"; refuses two user turns in a row.
CHAT_TEMPLATE = ("{% for m in messages %}{% if loop.index0 and m['role'] == 'user' and messages[loop.index0 - 1]['role'] "
                 "== 'user' %}{{ raise_exception('user turns must alternate with assistant ones') }}{% endif %}"
                 "{% if m['role'] == 'assistant' %}{{ m['content'] }}{% else %}{{ m['content'] }} {% endif %}"
                 "{% endfor %}")


@pytest.fixture(scope="module")
def chat_server(embedded_assets, log_dir, tmp_path_factory):
    """The embedded reward model with a chat template in its tokenizer."""
    import shutil

    path = tmp_path_factory.mktemp("chat-rm") / "rm"
    shutil.copytree(embedded_assets.reward_model, path)
    tok = load_tokenizer(str(path))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    with ServiceProcess("reward", "--model", str(path), "components=[positive_fraction]", log_dir=log_dir) as proc:
        yield proc


def test_conversations_are_rendered_by_the_reward_models_chat_template(chat_server, tokenizer, reference_model):
    """A chat reward model scores each conversation as its template renders it; rule components read the response,
    the last message."""
    samples = make_samples(83, 5)
    channel, stub = open_stub(chat_server)
    assert stub.GetInfo(common_pb2.GetInfoRequest()).chat_template
    reply = stub.Score(reward_pb2.ScoreRequest(conversations=[chat(p, r) for p, r in samples]), timeout=60)
    refused = None
    try:
        stub.Score(reward_pb2.ScoreRequest(conversations=[chat("x =>", "good"), reward_pb2.Conversation(messages=[
            reward_pb2.ChatMessage(role="user", content="a"), reward_pb2.ChatMessage(role="user", content="b"),
            reward_pb2.ChatMessage(role="assistant", content="good")])]), timeout=60)
    except grpc.RpcError as e:
        refused = e
    channel.close()
    torch.testing.assert_close(decode(reply.rewards, "rewards"), expected_rewards(reference_model, tokenizer, samples),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode(reply.components["reward/positive_fraction"], "c"), truth(samples))
    assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("conversations[1]: the reward model's chat template refused it")
    assert "user turns must alternate" in refused.details()


def test_a_rule_scorer_scores_the_last_message_of_each_conversation(rule_stub):
    reply = rule_stub.Score(reward_pb2.ScoreRequest(conversations=[chat("x =>", "good good bad great"),
                                                                   chat("y =>", "bad")]), timeout=60)
    torch.testing.assert_close(decode(reply.rewards, "rewards"), torch.tensor([0.75, 0.0]))


def test_texts_are_scored_as_the_reward_model_s_tokenizer_encodes_a_text(embedded_assets, reference_model, log_dir,
                                                                          tmp_path):
    """A reward model trained on plain text saw each text as its tokenizer encodes one (Llama's: BOS first): texts
    are scored so, and a text that carries its BOS already (decoded with special tokens kept, as OpenRLHF sends them)
    gets no second one. The tokenizer also has a pad token added without resizing the model's embeddings: texts of
    unequal lengths are padded with an id the model has (all of them were refused before), and a text that encodes
    to that token is refused naming it."""
    import shutil

    from transformers import AutoTokenizer

    from tests.conftest import with_special_tokens

    model_dir = tmp_path / "bos-rm"
    shutil.copytree(embedded_assets.reward_model, model_dir)
    tok = with_special_tokens(AutoTokenizer.from_pretrained(model_dir))
    tok.pad_token = None
    tok.add_special_tokens({"pad_token": "[PAD]"})
    tok.save_pretrained(model_dir)
    assert tok.pad_token_id == reference_model.config.vocab_size
    with ServiceProcess("reward", "--model", str(model_dir), log_dir=log_dir) as proc:
        channel, stub = open_stub(proc)
        reply = stub.Score(reward_pb2.ScoreRequest(texts=["river castle good", "<bos> river castle good", "city"]),
                           timeout=60)
        expect_invalid(stub.Score, reward_pb2.ScoreRequest(texts=["good", "river [PAD] castle"]), "texts[1]", "'[PAD]'",
                       "not resized")
        channel.close()
    assert (f"(id {tok.pad_token_id}) is past the model's embedding table ({tok.pad_token_id} rows), which was not "
            f"resized for it; rows are padded with EOS (id {tok.eos_token_id}) instead") in proc.log()
    rows = [[tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]] for text in ("river castle good", "city")]
    with torch.no_grad():
        expected = torch.cat([last_token_scores(per_token_scores(reference_model, torch.tensor([r]),
                                                                 torch.tensor([len(r)])), torch.tensor([len(r)]))
                              for r in (rows[0], rows[0], rows[1])])
    torch.testing.assert_close(decode(reply.rewards, "rewards"), expected, atol=1e-5, rtol=1e-5)


def encoder_reward_model(words: list[str], path: Path, family: str = "deberta") -> Path:
    """A random one-label DeBERTa-v2 reward model (or BERT, whose pairs' segments differ by token type ids) and a
    word-level BERT-style tokenizer (`[CLS] a [SEP] b [SEP]`, the second segment typed 1), as OpenAssistant's
    DeBERTa reward models are laid out: a `classifier` over the pooled first token, no `score`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DebertaV2Config,
        DebertaV2ForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *sorted(words)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    typed = ["token_type_ids"] if family == "bert" else []  # BERT's tokenizers return them
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                        sep_token="[SEP]", model_input_names=["input_ids", *typed, "attention_mask"])
    torch.manual_seed(0)
    shape = {"vocab_size": len(vocab), "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64, "max_position_embeddings": 128, "num_labels": 1, "pad_token_id": 0}
    model = (DebertaV2ForSequenceClassification(DebertaV2Config(**shape)) if family == "deberta" else
             BertForSequenceClassification(BertConfig(type_vocab_size=2, **shape)))
    with torch.no_grad():  # scores of order 1, so that a pair and the same words as one text score apart
        model.classifier.weight.mul_(1000)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("family, settings", [("deberta", ()), ("bert", ()), ("bert", ("compile=true",))],
                         ids=["deberta", "bert", "bert-compiled"])
def test_an_encoder_reward_model_scores_prompt_response_pairs_with_its_own_head(family, settings, tokenizer, log_dir,
                                                                                tmp_path):
    """An encoder reward model (DeBERTa, as OpenAssistant's; BERT, whose pairs' segments differ by token type ids) has
    no per-position `score`: the server scores each sample through the model's own pooling and head, a text with its
    prompt as the pair (prompt, response) it was trained on, typed as its tokenizer types a pair, a text alone as
    `[CLS] text [SEP]`, eager or compiled (`compile=true`: compiled at load, one graph for both calls' shapes); the
    critic refuses such a model, which gives no per-token values."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = encoder_reward_model([w for w in tokenizer.get_vocab() if not w.startswith("<")], tmp_path / family, family)
    prompts, responses = ["river castle", "city garden forest"], [" good good", " bad"]
    with ServiceProcess("reward", "--model", str(path), *settings, log_dir=log_dir,
                        env={"TORCH_LOGS": "recompiles"}) as proc:
        channel, stub = open_stub(proc)
        paired = stub.Score(reward_pb2.ScoreRequest(texts=[p + r for p, r in zip(prompts, responses)],
                                                    prompts=prompts), timeout=60)
        alone = stub.Score(reward_pb2.ScoreRequest(texts=["river castle good good"]), timeout=60)
        channel.close()
        log = proc.log()
    assert ("compile=true: Score pass compiled in" in log) == bool(settings) and "Recompiling" not in log, log[-3000:]
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    enc = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        expected = [float(model(**enc(p, r, return_tensors="pt")).logits[0, 0]) for p, r in zip(prompts, responses)]
        whole = float(model(**enc("river castle good good", return_tensors="pt")).logits[0, 0])
    torch.testing.assert_close(decode(paired.rewards, "rewards"), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode(alone.rewards, "rewards"), torch.tensor([whole]), atol=1e-5, rtol=1e-5)
    assert abs(whole - expected[0]) > 1e-3  # the pair is not the text alone
    if family != "deberta":
        return
    done = subprocess.run([sys.executable, "-m", "critic_server", "--port", "0", "--http-port", "0", "--model",
                           str(path), "--checkpoint-dir", str(tmp_path / "ckpt")], cwd=ROOT, check=False,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "has no `score` head" in done.stderr, done.stderr[-2000:]


# --- OpenRLHF's reward model checkpoints ---------------------------------------------------------


@pytest.mark.parametrize("setting", [None, "false"])
def test_an_openrlhf_reward_model_scores_as_openrlhf_reports_it(openrlhf_reward_model, reference_model, tokenizer,
                                                                 log_dir, setting):
    """OpenRLHF saves its reward head as `value_head` and, for a model trained with --normalize_reward, the scores'
    mean and std in config.json: the server reads that head and reports (score - mean) / std by default, raw scores
    with normalize_reward=false."""
    samples = make_samples(81, 6)
    extra = () if setting is None else (f"normalize_reward={setting}",)
    with ServiceProcess("reward", "--model", str(openrlhf_reward_model), *extra, log_dir=log_dir) as proc:
        channel, stub = open_stub(proc)
        reply = stub.Score(token_request(tokenizer, samples), timeout=60)
        # GetInfo says so too: the actor holds a restarted server to it (a flipped setting changed the rewards'
        # scale mid-run unnoticed)
        info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30)
        assert info.reward_normalization == ("(score - 0.25) / 2" if setting is None else "")
        channel.close()
        said = "reported as (score - 0.25) / 2 (its config.json's mean and std)" in proc.log()
    assert said == (setting is None)  # the start-up log says when rewards are normalised
    raw = expected_rewards(reference_model, tokenizer, samples)
    expected = raw if setting == "false" else (raw - OPENRLHF_MEAN) / OPENRLHF_STD
    torch.testing.assert_close(decode(reply.rewards, "rewards"), expected, atol=1e-5, rtol=1e-5)


def test_normalize_reward_without_the_statistics_is_refused_at_start_naming_the_key(embedded_cache):
    done = subprocess.run([sys.executable, "-m", "reward_server", "--port", "0", "--http-port", "0",
                           "normalize_reward=true"], cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "normalize_reward=true: the reward model's config.json has no `mean`" in done.stderr


@pytest.mark.parametrize("service, extra, words", [
    ("reward_server", ["--scorer", "positive_fraction"], "normalize_reward=true applies to a learned model's scores"),
    ("critic_server", [], "normalize_reward=true applies to the combined reward model's scores, and no reward_model"),
])
def test_normalize_reward_without_a_reward_model_to_normalise_is_a_config_error(service, extra, words):
    done = subprocess.run([sys.executable, "-m", service, "--port", "0", "--http-port", "0", *extra,
                           "normalize_reward=true"], cwd=ROOT, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("stats, complaint", [({}, "has no `mean`"), ({"mean": 0.0, "std": 0.0}, "std=0.0; expected a number > 0"),
                                              ({"mean": "x", "std": 1.0}, "mean='x'; expected a finite number"),
                                              ({"mean": 0.0, "std": float("inf")}, "std=inf; expected a finite number")])
def test_reward_statistics_that_cannot_normalise_are_refused_naming_the_key(stats, complaint):
    from transformers import LlamaConfig

    config = LlamaConfig(normalize_reward=True, **stats)
    with pytest.raises(ValueError, match=re.escape(complaint)) as caught:
        reward_normalization(config, True, "normalize_reward", "rm")
    assert str(caught.value).startswith("normalize_reward")
    with pytest.raises(ValueError, match=re.escape(complaint)) as caught:  # the critic's own statistics, its key
        reward_normalization(config, True, "normalize_values", "critic", role="critic model", outputs="values")
    assert str(caught.value).startswith("normalize_values") and "the critic model's config.json" in str(caught.value)
    if not stats:  # following the checkpoint: normalize_reward without stats is OpenRLHF's identity
        assert reward_normalization(config, None, "normalize_reward", "rm") == RewardNormalization()


# --- OpenRLHF's remote reward client ------------------------------------------------------------


def openrlhf_rewards(url: str, queries: list[str], prompts: list[str], labels: list) -> dict:
    """What OpenRLHF's remote reward client does: POST {"query", "prompts", "labels"} as JSON, raise for an HTTP
    error, read `rewards` (newer versions also `scores`, falling back to `rewards`, and `extra_logs`)."""
    response = httpx.post(url, json={"query": queries, "prompts": prompts, "labels": labels},
                          headers={"Content-Type": "application/json"}, timeout=180)
    response.raise_for_status()
    out = response.json()
    assert "rewards" in out, out
    return {"rewards": out["rewards"], "scores": out.get("scores", out["rewards"]),
            "extra_logs": out.get("extra_logs") or {}}


JSON_LABELS = {"int": 42, "float": 1.5, "list": [1, "two", None], "dict": {"answer": 42, "unit": "m"}, "null": None,
               "bool": True, "string": "42"}


@pytest.mark.parametrize("label", list(JSON_LABELS.values()), ids=list(JSON_LABELS))
def test_get_reward_takes_any_json_label(server, label):
    """The newest OpenRLHF sends one sample per request, with the label its dataset holds."""
    prompt, response = "river castle =>", "good bad the great"
    out = openrlhf_rewards(f"{server.http}/get_reward", [f"{prompt} {response}"], [prompt], [label])
    assert len(out["rewards"]) == 1 and out["scores"] == out["rewards"]
    assert out["extra_logs"] == {"reward/positive_fraction": [0.5]}


def test_get_reward_takes_a_batch_of_mixed_labels(server, stub):
    samples = make_samples(seed=8, n=len(JSON_LABELS))
    queries = [f"{p} {r}" for p, r in samples]
    out = openrlhf_rewards(f"{server.http}/get_reward", queries, [f"{p} " for p, _ in samples],
                           list(JSON_LABELS.values()))
    expected = decode(stub.Score(reward_pb2.ScoreRequest(texts=queries)).rewards, "r")
    assert out["rewards"] == pytest.approx(expected.tolist(), abs=1e-6)
    assert out["extra_logs"]["reward/positive_fraction"] == pytest.approx(truth(samples).tolist())


def test_a_label_is_sent_as_its_text_a_number_in_plain_decimal():
    """The actor's labels and /get_reward's are made text by one function: JSON's float text (1e-05, 1e+20) was
    read by math-verify as other numbers, so a right answer to a dataset's 0.00001 scored 0."""
    from serving.labels import label_text

    cases = {"42": "42", 42: "42", 72.0: "72.0", 0.1: "0.1", 1e-05: "0.00001", 1e20: "100000000000000000000",
             -2.5e-7: "-0.00000025", True: "true", None: "null", "[1, 2]": "[1, 2]"}
    assert {label: label_text(label) for label in cases} == cases
    assert label_text([1, "two", None]) == '[1, "two", null]' and label_text({"x": "é"}) == '{"x": "é"}'
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError):
            label_text(bad)


def test_exact_match_compares_a_label_that_is_no_string_as_its_json_text(exact_server):
    prompt = "what is 6 x 7?"
    cases = [  # (response, label, reward)
        (" 42", 42, 1.0), (" 41", 42, 0.0), ("42.0", 42, 0.0), (" 1.5 ", 1.5, 1.0), (" true", True, 1.0),
        (" null", None, 1.0), (" ", None, 0.0), (" [1, 2]", [1, 2], 1.0), (' {"x": "é"}', {"x": "é"}, 1.0),
        (" 42", "42", 1.0),
        # OpenRLHF decodes with the special tokens kept: the policy's EOS (and end-of-turn) text ends the query
        (" 42<eos>", 42, 1.0), (" 42</s>", 42, 1.0), (" 42<|im_end|><|endoftext|>", 42, 1.0), (" 42 <eos> <pad>", 42, 1.0),
        (" 42<eos>7", 427, 0.0),
        # a number as a dataset writes it, in plain decimal, not JSON's float text with an exponent (1e-05, 1e+20),
        # which math-verify reads as other numbers
        (" 0.00001", 1e-05, 1.0), (" 100000000000000000000", 1e20, 1.0), (" 1e-05", 1e-05, 0.0),
    ]
    out = openrlhf_rewards(f"{exact_server.http}/get_reward", [prompt + r for r, _, _ in cases],
                           [prompt] * len(cases), [label for _, label, _ in cases])
    assert out["rewards"] == [reward for _, _, reward in cases]


MATH_CASES = [  # (response, label, reward): the response's final answer against the label's
    ("so the answer is \\boxed{42}.", "42", 1.0), ("\\boxed{\\frac{1}{2}}", "0.5", 1.0), ("3/4", "\\frac{3}{4}", 1.0),
    ("It is 1,000 apples", "1000", 1.0), ("first 3, then 7", "7", 1.0), ("first 7, then 3", "7", 0.0),
    ("She sold 48 + 24 = 72 clips.\n#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    ("\\boxed{x + 1}", "x+1", 1.0), ("\\boxed{x+1}", "x+2", 0.0), ("no number here", "5", 0.0),
    ("answer: $18.", "18", 1.0), ("50%", "50", 1.0), ("\\boxed{\\text{B}}", "B", 1.0), ("\\boxed{2}", "\\boxed{2.0}", 1.0),
    ("-3", "-3", 1.0), ("the value is .5", "1/2", 1.0), ("1/0", "1", 0.0), ("\\boxed{5", "5", 1.0), ("", "5", 0.0),
    # a final number followed by a comma, as in running text
    ("she sold 48 + 24 = 72, which is the answer.", "#### 72", 1.0), ("So we get 5, in all.", "5", 1.0),
    ("Total: 1,234,", "1234", 1.0), ("Total: 1,235,", "1234", 0.0),
    # notation that leaves the answer the same
    ("1{,}234", "1234", 1.0), ("she pays 1{,}234 dollars", "#### 1{,}234", 1.0), ("1{,}235", "1234", 0.0),
    ("\\boxed{\\$18}", "18", 1.0), ("\\boxed{1{,}234}", "1234", 1.0), ("\\boxed{42\\text{ apples}}", "42", 1.0),
    ("\\boxed{18\\text{ dollars}}", "#### 18", 1.0), ("\\boxed{x=7}", "7", 1.0), ("\\boxed{x = 7}", "x=8", 0.0),
    ("\\boxed{90^\\circ}", "90", 1.0), ("\\boxed{90^{\\circ}}", "90°", 1.0), ("\\boxed{\\textbf{5}}", "5", 1.0),
    ("#### 18 dollars", "18", 1.0), ("#### **42**", "42", 1.0), ("the answer is \u22125", "-5", 1.0),
    ("it is 1e6", "1000000", 1.0), ("\\boxed{0.5}", "\\boxed{\\frac12}", 1.0), ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    # an algebraic answer is not a number with a unit
    ("\\boxed{2 x}", "2", 0.0), ("\\boxed{2 x}", "2x", 1.0),
    # a unit after TeX spacing or in \text without a blank, squared units
    ("\\boxed{10\\,\\text{cm}}", "10", 1.0), ("\\boxed{10\\ \\text{inches}}", "10", 1.0), ("\\boxed{10~\\text{cm}}", "10", 1.0),
    ("\\boxed{10\\text{cm}}", "10", 1.0), ("\\boxed{10\\,\\mathrm{cm}^2}", "10", 1.0), ("\\boxed{10\\;\\text{cm}}", "11", 0.0),
    # a base is not Fraction's digit separator: 1_2 is not 12
    ("\\boxed{1011_{2}}", "1011_2", 1.0), ("\\boxed{1_2}", "12", 0.0), ("\\boxed{10_2}", "102", 0.0),
    # invisible characters are nothing
    ("\\boxed{4\u200b2}", "42", 1.0), ("\\boxed{\ufeff42}", "42", 1.0), ("\\boxed{12\u200f}", "12", 1.0),
    # fractions TeX accepts without braces, a negative denominator, a minus before an escaped dollar
    ("\\boxed{\\frac 12}", "0.5", 1.0), ("\\boxed{\\frac{1}2}", "0.5", 1.0), ("\\boxed{\\frac1{2}}", "0.5", 1.0),
    ("\\boxed{\\frac{1}{-2}}", "-0.5", 1.0), ("\\boxed{-\\$5}", "-5", 1.0), ("\\boxed{\\frac{1}{-2}}", "0.5", 0.0),
]


@pytest.mark.parametrize("response, label, reward", MATH_CASES)
def test_math_answer_compares_final_answers(response, label, reward):
    assert math_answer(response, label) == reward


def test_a_caret_before_a_long_run_of_blanks_is_scored_in_linear_time():
    """The degree sign's pattern tried a `^` before blanks at every split of the run: a 100 KB response or label took
    7 s (200 KB 30 s), holding the whole server, /health included (a regular expression keeps the GIL)."""
    for response, label in (("\\boxed{^" + " " * 100_000 + "x}", "1"), ("\\boxed{1}", "^" + " " * 100_000 + "1")):
        started = time.perf_counter()
        assert math_answer(response, label) == 0.0
        assert time.perf_counter() - started < 2.0


def test_numbers_in_e_notation_compare_by_value_and_a_huge_exponent_is_text():
    """Fraction expands an exponent digit by digit: `1e20000000` (20 bytes a policy can sample) took it 18 s. An
    exponent of up to 3 digits is a number; a longer one is not, so such an answer compares as text, at once."""
    assert as_number("1.5e3") == 1500 and as_number("1E-3") == Fraction(1, 1000) and as_number("1e999") == 10**999
    for text in ("1e20000000", "1e999999999", "-2.5E+1000", "1e1_0000"):
        assert as_number(text) is None, text
    assert math_answer("#### 1e20000000", "1") == 0.0 and math_answer("#### 1e2000", "1e2000") == 1.0


def test_a_math_answer_server_scores_gsm8k_style_answers_over_openrlhf_s_protocol(embedded_cache, log_dir):
    """Labels as a dataset gives them (a number, or GSM8K's worked answer ending in '#### N')."""
    prompt = "Q: Natalia sold clips to 48 friends in April, and half as many in May. How many in all? A:"
    cases = [(" 48 + 24 = 72. #### 72", "Natalia sold 48/2 = 24 clips in May. #### 72", 1.0),
             (" The total is \\boxed{72}.", 72, 1.0), (" It is 70, no, 71", 72, 0.0), (" 72.0", "72", 1.0),
             (" 48 + 24 = 72. #### 72<|im_end|>", 72, 1.0), (" 48 + 24 = 72. #### 72</s>", "#### 72", 1.0),
             # labels a regular expression once took seconds over, holding the server: answered at once
             (" #### 1", "1 " + "a" * 40_000 + "!", 0.0), (" #### 1", "\\text{" * 16_000 + "1" + "}" * 16_000, 0.0)]
    with ServiceProcess("reward", "--scorer", "math_answer", log_dir=log_dir,
                        env={"PPO_SERVICES_CACHE": str(embedded_cache)}) as server:
        # every method's series is there from the start, at 0, so an alert can tell idle from unscraped
        fresh = httpx.get(f"{server.http}/metrics", timeout=10).text
        for method in ("Score", "GetInfo", "get_reward"):
            assert f'ppo_reward_requests_total{{code="OK",method="{method}"}} 0.0' in fresh, method
        out = openrlhf_rewards(f"{server.http}/get_reward", [prompt + r for r, _, _ in cases], [prompt] * len(cases),
                               [label for _, label, _ in cases])
    assert out["rewards"] == [reward for _, _, reward in cases]


def _metric(text: str, name: str) -> float:
    """The value of an unlabelled series in a /metrics text."""
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_math_verify_server_scores_equal_answers_symbolically_and_bounds_each_sample(embedded_cache, log_dir):
    """math-verify (NeMo-RL's math verifier) in worker processes: equal answers in other forms score 1.0 where
    math_answer compares text; a sample no signal can stop within its own limits (a timeout of 0.5 s here) has its
    worker replaced and scores 0.0, counted, and the server goes on scoring."""
    prompt = "Q: Simplify. A:"
    cases = [(" so the answer is $\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\dfrac{\\sqrt3}{2}", 1.0),
             (" \\boxed{(x+1)^2}", "x^2+2x+1", 1.0), (" \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
             (" \\boxed{[0, 1)}", "[0,1)", 1.0), (" \\boxed{[0, 1]}", "[0,1)", 0.0),
             (" 48 + 24 = 72. The answer is 72.", "Natalia sold 48/2 = 24 clips in May. #### 72", 1.0),
             (" The answer is 71.", "#### 72", 0.0), (" \\fbox{12}", "12", 1.0), (" \u221242", "-42", 1.0),
             # a boxed answer before a check longer than the tail read (it used to be cut off), and two boxed answers,
             # which math-verify reads as one set, as for NeMo-RL
             (" So the answer is \\boxed{42}." + " Let me check this once more." * 600, "42", 1.0),
             (" \\boxed{3}, no, wait: \\boxed{4}", "4", 0.0)]
    with ServiceProcess("reward", "--scorer", "math_verify", "math_verify.workers=2", log_dir=log_dir,
                        env={"PPO_SERVICES_CACHE": str(embedded_cache)}) as server:
        out = openrlhf_rewards(f"{server.http}/get_reward", [prompt + r for r, _, _ in cases], [prompt] * len(cases),
                               [label for _, label, _ in cases])
        assert out["rewards"] == [reward for _, _, reward in cases]
        with grpc.insecure_channel(server.address) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30)
            assert info.model == "rule:math_verify" and info.needs_labels
            reply = stub.Score(reward_pb2.ScoreRequest(texts=[prompt + r for r, _, _ in cases[:2]],
                                                       prompts=[prompt] * 2, labels=[c[1] for c in cases[:2]]))
            assert decode(reply.rewards, "r").tolist() == [1.0, 1.0]
    with ServiceProcess("reward", "--scorer", "math_verify", "math_verify.workers=1", "math_verify.timeout_s=0.5",
                        "math_verify.batch_timeout_s=3", log_dir=log_dir,
                        env={"PPO_SERVICES_CACHE": str(embedded_cache)}) as server:
        started = time.monotonic()
        out = openrlhf_rewards(f"{server.http}/get_reward", ["\\boxed{10^{10^{10}}}", "The answer is 72."], [],
                               ["1", "#### 72"])
        assert out["rewards"] == [0.0, 1.0] and time.monotonic() - started < 30
        metrics = httpx.get(f"{server.http}/metrics", timeout=10).text
        assert "ppo_reward_math_verify_timeouts_total 1.0" in metrics
        assert "math_verify did not score a sample within 0.5 s" in server.log()
        # its worker killed from outside while idle (it used to fail every request after, BrokenPipeError): started
        # again, and no answer is taken for another sample's
        workers = subprocess.run(["pgrep", "-f", "reward_server.verifier_worker"], capture_output=True, text=True,
                                 check=False).stdout.split()
        killed = 0
        for pid in workers:
            if Path(f"/proc/{pid}/stat").exists() and \
                    int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == server.proc.pid:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
        assert killed == 1
        for _ in range(2):
            out = openrlhf_rewards(f"{server.http}/get_reward", ["\\boxed{7}", "\\boxed{2}", "\\boxed{3}"], [],
                                   ["7", "3", "3"])
            assert out["rewards"] == [1.0, 0.0, 1.0]
        # a caller that gives up leaves no work behind: 20 slow samples (10 s or more) no longer hold the next caller
        with grpc.insecure_channel(server.address) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(reward_pb2.ScoreRequest(texts=["\\boxed{(10^{10})!}"] * 20, labels=["1"] * 20), timeout=2)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            started = time.monotonic()
            reply = stub.Score(reward_pb2.ScoreRequest(texts=["\\boxed{7}"], labels=["7"]), timeout=60)
            assert decode(reply.rewards, "r").tolist() == [1.0] and time.monotonic() - started < 5
        assert "the callers of this batch are gone" in server.log()
        # and over OpenRLHF's protocol, whose client closes the connection at its timeout
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.http}/get_reward", json={"query": ["\\boxed{(10^{10})!}"] * 20, "labels": ["1"] * 20},
                       timeout=2)
        started = time.monotonic()
        out = openrlhf_rewards(f"{server.http}/get_reward", ["\\boxed{7}"], [], ["7"])
        assert out["rewards"] == [1.0] and time.monotonic() - started < 5
        assert 'ppo_reward_requests_total{code="CANCELLED",method="get_reward"} 1.0' in \
            httpx.get(f"{server.http}/metrics", timeout=10).text
        # a caller that waits for many slow samples holds the server no longer than math_verify.batch_timeout_s
        # (and the sample then being scored): the samples not sent by then score 0.0, counted as timeouts
        timeouts = _metric(httpx.get(f"{server.http}/metrics", timeout=10).text, "ppo_reward_math_verify_timeouts_total")
        started = time.monotonic()
        out = openrlhf_rewards(f"{server.http}/get_reward", ["\\boxed{(10^{10})!}"] * 40, [], ["1"] * 40)
        assert out["rewards"] == [0.0] * 40 and time.monotonic() - started < 20
        assert "(math_verify.batch_timeout_s): its" in server.log()
        assert _metric(httpx.get(f"{server.http}/metrics", timeout=10).text,
                       "ppo_reward_math_verify_timeouts_total") - timeouts >= 30


def test_a_query_that_does_not_start_with_its_prompt_is_scored_whole(rule_server, rule_stub):
    """OpenRLHF truncates long prompts: the query then holds less of the prompt than `prompts` does."""
    prompts = ["river castle winter =>", "ocean =>", "city =>"]
    queries = ["castle winter => good great", "ocean => good bad", "<bos> city => great"]
    whole = [2 / 5, 1 / 2, 1 / 3]  # the first and last queries scored whole, the second after its prompt
    out = openrlhf_rewards(f"{rule_server.http}/get_reward", queries, prompts, ["", "", ""])
    assert out["rewards"] == pytest.approx(whole)
    unprompted = openrlhf_rewards(f"{rule_server.http}/get_reward", [queries[0]], [], [])
    assert out["rewards"][0] == unprompted["rewards"][0]
    by_grpc = rule_stub.Score(reward_pb2.ScoreRequest(texts=queries, prompts=prompts))
    assert decode(by_grpc.rewards, "r").tolist() == pytest.approx(whole)
    assert "scored whole" not in rule_server.log()  # debug level, not one warning per request


@pytest.mark.parametrize("raw, status, field", [
    ('{"query": [NaN]}', 422, ["body", "query", 0]),
    ('{"query": ["good"], "labels": [NaN]}', 400, "labels[0]"),
    ('{"query": ["good", "bad"], "labels": ["", Infinity]}', 400, "labels[1]"),
    ('{"query": ["good"], "labels": [1e400]}', 400, "labels[0]"),
    ('{"query": ["good"], "labels": [{"score": -Infinity}]}', 400, "labels[0]"),
    ('{"query": ["good \\ud800"]}', 400, "query[0]"),
    ('{"query": ["good"], "prompts": ["\\udc00"]}', 400, "prompts[0]"),
    ('{"query": ["good"], "labels": ["\\ud83d"]}', 400, "labels[0]"),
    ('{"query": ["good"], "labels": [{"\\ud800": 1}]}', 400, "labels[0]"),
    ('{"query": [NaN], "labels": ["\\ud800"]}', 422, ["body", "query", 0]),
], ids=["nan-query", "nan-label", "infinity-label", "overflow-label", "nested-infinity", "surrogate-query",
        "surrogate-prompt", "surrogate-label", "surrogate-key", "nan-and-surrogate"])
def test_what_json_cannot_carry_is_refused_naming_the_field(server, stub, raw, status, field):
    """Python's json.dumps (aiohttp's serializer) writes NaN and Infinity; \\uXXXX escapes can spell lone surrogates."""
    response = httpx.post(f"{server.http}/get_reward", content=raw.encode(), timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    if status == 422:
        assert [e["loc"] for e in detail] == [field]
    else:
        assert detail.startswith(field), detail
    assert httpx.get(f"{server.http}/ready").status_code == 200


# --- no_negative ----------------------------------------------------------------------------------


def test_no_negative_is_one_minus_the_negative_fraction():
    assert task.negative_fraction("good bad the sad") == 0.5
    assert task.negative_fraction("<bos> awful <eos>") == 1.0  # special tokens are no words
    assert task.negative_fraction("") == 0.0
    for response, expected in [("good bad the great", 0.75), ("sad awful", 0.0), ("amazing <eos>", 1.0),
                               ("river castle =>", 1.0), ("unknown hate", 0.5), ("", 0.0), ("  <eos> <pad>", 0.0)]:
        assert no_negative(response) == expected, response
        assert SCORERS["no_negative"].score(response, None) == expected


def test_every_scorer_is_documented_and_no_negative_is_served_as_a_component(exact_server):
    description = RewardConfig.model_fields["scorer"].description
    reference = (ROOT / "docs" / "configuration.md").read_text()
    for name in SCORERS:
        assert name in description and f"{name} (" in reference, name
    assert "no_negative" in (ROOT / "README.md").read_text()
    out = openrlhf_rewards(f"{exact_server.http}/get_reward", ["=> good bad the great", "=> "], ["=> "] * 2,
                           ["good bad the great", "x"])
    assert out["rewards"] == [1.0, 0.0]
    assert out["extra_logs"] == {"reward/exact_match": [1.0, 0.0], "reward/positive_fraction": [0.5, 0.0],
                                 "reward/no_negative": [0.75, 0.0]}


def test_sigterm_serves_the_requests_that_arrived_before_it_and_exits_zero(rule_server):
    """A request still arriving when SIGTERM comes is answered: a /get_reward whose body is still being sent (an
    OpenRLHF batch must not fail for a rolling restart) and a gRPC Score whose message is (over a slow link); one that
    arrives after it gets 503, and so does one still arriving when the grace period (3 s) ends, without a traceback;
    the server then exits 0."""
    body = json.dumps({"query": ["river => good"]}).encode()
    expected = httpx.post(f"{rule_server.http}/get_reward", json=json.loads(body), timeout=10).json()["rewards"]
    head = (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")

    def reply_to(sock: socket.socket) -> bytes:
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
            reply += sock.recv(65536) or b"}"
        return reply

    uplink = NetworkPath(rule_server.grpc_port, uplink_rate=300_000)
    texts = ["river => " + "good bad " * 16] * 4000  # 600 KB: 2 s at 300 KB/s
    with grpc.insecure_channel(f"127.0.0.1:{uplink.port}") as ch, \
            concurrent.futures.ThreadPoolExecutor(1) as pool, \
            socket.create_connection(("127.0.0.1", rule_server.http_port), timeout=30) as finishing, \
            socket.create_connection(("127.0.0.1", rule_server.http_port), timeout=30) as unfinished:
        scored = pool.submit(reward_pb2_grpc.RewardServiceStub(ch).Score, reward_pb2.ScoreRequest(texts=texts),
                             timeout=30)
        finishing.sendall(head + body[:5])
        unfinished.sendall(head + body[:5])
        while uplink.sent < 60_000 and not scored.done():  # the call's headers are in, its message is not
            time.sleep(0.02)
        stopped = time.monotonic()
        rule_server.proc.send_signal(signal.SIGTERM)
        while (late := httpx.post(f"{rule_server.http}/get_reward", json={"query": ["x"]}, timeout=10)).status_code \
                == 200 and time.monotonic() < stopped + 10:  # until the server has begun to stop
            time.sleep(0.05)
        assert late.status_code == 503 and "shutting down" in late.json()["detail"]
        finishing.sendall(body[5:])
        reply = reply_to(finishing)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["rewards"] == expected
        assert decode(scored.result().rewards, "rewards").shape == (len(texts),)
        assert uplink.sent > 500_000  # it was still arriving at the SIGTERM
        reply = reply_to(unfinished)
        assert reply.startswith(b"HTTP/1.1 503") and b"grace_period_s" in reply, reply
        assert 2.5 < time.monotonic() - stopped < 8
    uplink.close()
    rule_server.proc.send_signal(signal.SIGTERM)  # a repeated signal changes nothing, to the last instant
    assert rule_server.terminate() == 0
    assert "Exception in ASGI application" not in rule_server.log() and "Traceback" not in rule_server.log()


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_under_v1_and_v1alpha(server, version):
    """grpcurl asks grpc.reflection.v1 first; older clients v1alpha. Both list the services and describe them."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    def rpc_of(ch, version):
        return ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)

    with grpc.insecure_channel(server.address) as ch:
        answers = list(rpc_of(ch, version)(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="ppo_services.v1.RewardService"),
            # `grpcurl describe ppo_services.v1.RewardService.Score` asks for a method (grpcio-reflection alone
            # answers NOT_FOUND)
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="ppo_services.v1.RewardService.Score"),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="ppo_services.v1.RewardService.Nothing"),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="ppo_services.v1.DType.DTYPE_INT64"),
        ]), timeout=10))
    assert answers[2].file_descriptor_response == answers[1].file_descriptor_response
    assert answers[3].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    common = [descriptor_pb2.FileDescriptorProto.FromString(b).name
              for b in answers[4].file_descriptor_response.file_descriptor_proto]
    assert common == ["ppo_services/v1/common.proto"]
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"ppo_services.v1.RewardService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    # as `grpcurl describe` walks the list: every service listed can be described (v1's own file included)
    with grpc.insecure_channel(server.address) as ch:
        described = list(rpc_of(ch, version)(iter(
            [reflection_pb2.ServerReflectionRequest(file_containing_symbol=name) for name in sorted(names)]),
            timeout=10))
    for name, answer in zip(sorted(names), described, strict=True):
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in answer.file_descriptor_response.file_descriptor_proto]
        package, _, service = name.rpartition(".")
        assert any(f.package == package and service in [s.name for s in f.service] for f in files), name
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in answers[1].file_descriptor_response.file_descriptor_proto]
    (reward,) = [f for f in files if f.name == "ppo_services/v1/reward.proto"]
    assert reward.service[0].name == "RewardService"
    # the proto's comments travel too, so `grpcurl describe` explains every RPC and field
    comments = " ".join(loc.leading_comments for loc in reward.source_code_info.location)
    assert "One reward per sample" in comments


def test_clients_that_leave_their_replies_unread_at_a_shutdown_log_no_traceback(embedded_cache, log_dir):
    """Connections that pipeline requests and read nothing fill their sockets; at the shutdown's grace deadline the
    replies still being written were cancelled and uvicorn logged a 60-line traceback for each connection (a client
    chose how many). The server still ends within its grace period, quietly."""
    server = ServiceProcess("reward", "--scorer", "positive_fraction", "grace_period_s=2", log_dir=log_dir).start()
    sockets = []
    try:
        for _ in range(5):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the replies back up at once
            s.settimeout(30)
            s.connect(("127.0.0.1", server.http_port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 3000)
            sockets.append(s)
        time.sleep(1.0)
        started = time.monotonic()
        assert server.terminate(30) == 0
        assert time.monotonic() - started < 15
    finally:
        for s in sockets:
            s.close()
        server.stop()
    assert "Exception in ASGI application" not in server.log() and "Traceback" not in server.log(), server.log()[-3000:]
