"""Malformed requests to every gRPC method and REST route of the real servers get clear errors.

Seeded, so every run sends the same requests. Each gRPC answer must be one of the codes the method documents for
what was sent: INVALID_ARGUMENT for bytes that are no message or content that is wrong, NOT_FOUND for a health
check of an unknown service, OK where the content happens to be valid (never for a Train: no fuzzed Train is
valid, and the critic's weights and train step are compared before and after). REST answers are 2xx or 4xx. Never
UNKNOWN, INTERNAL or a 5xx; both servers stay SERVING. Run with `-s` to see the counts.
"""

from __future__ import annotations

import collections
import json
import math
import random
import socket

import grpc
import httpx
import pytest
import torch
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from bench.oversized_message import measure
from ppo_services.v1 import common_pb2, critic_pb2, reward_pb2
from serving.codec import decode, encode
from tests.grpc_helpers import channel
from tests.service_procs import ServiceProcess

SEED = 20261121
CRITIC = "/ppo_services.v1.CriticService/"
REWARD = "/ppo_services.v1.RewardService/"
CHECK, WATCH = "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"
REFLECTION = {v: f"/grpc.reflection.{v}.ServerReflection/ServerReflectionInfo" for v in ("v1", "v1alpha")}
OK, INVALID, NOT_FOUND = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
VOCAB, MAX_LENGTH = 51, 64  # the embedded reward model's (checked against GetInfo below)

counts: collections.Counter = collections.Counter()  # (target, outcome) -> requests, printed by each test
details: dict[str, str] = {}  # the last error's details, for failure messages


@pytest.fixture(scope="module")
def critic(embedded_cache, log_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("fuzz-ckpt")
    with ServiceProcess("critic", "--checkpoint-dir", str(ckpt), log_dir=log_dir) as proc:
        proc.ckpt = ckpt
        proc.channel = channel(proc.address)
        proc.reference = _reference_values(proc.channel)
        yield proc
        proc.channel.close()


@pytest.fixture(scope="module")
def reward(embedded_cache, log_dir):
    with ServiceProcess("reward", log_dir=log_dir) as proc:
        proc.channel = channel(proc.address)
        yield proc
        proc.channel.close()


FIXED = (torch.arange(3 * 10).reshape(3, 10) % (VOCAB - 4) + 4, torch.tensor([10, 7, 3]))


def _reference_values(ch: grpc.Channel) -> tuple[torch.Tensor, int]:
    """Values of a fixed batch and the train step: what the fuzz must leave unchanged."""
    info = critic_pb2.CriticInfo.FromString(_unary(ch, CRITIC + "GetInfo", b""))
    assert (info.vocab_size, info.max_length) == (VOCAB, MAX_LENGTH)
    reply = critic_pb2.InferResponse.FromString(
        _unary(ch, CRITIC + "Infer", critic_pb2.InferRequest(tokens=encode(FIXED[0]), lengths=encode(FIXED[1]))
               .SerializeToString()))
    return decode(reply.values, "values"), info.train_step


def _unary(ch: grpc.Channel, method: str, payload: bytes) -> bytes:
    return ch.unary_unary(method, request_serializer=None, response_deserializer=None)(payload, timeout=30)


# --- sending and checking ------------------------------------------------------------------------------------------
def call(ch: grpc.Channel, method: str, payload: bytes) -> grpc.StatusCode:
    try:
        _unary(ch, method, payload)
    except grpc.RpcError as e:
        details["last"] = e.details() or ""
        return e.code()
    return OK


def watch(ch: grpc.Channel, payload: bytes) -> grpc.StatusCode:
    """A health Watch of bytes that are no HealthCheckRequest: the stream must end at once."""
    stream = ch.unary_stream(WATCH, request_serializer=None, response_deserializer=None)(payload, timeout=10)
    try:
        for _ in stream:
            return OK  # a valid Watch answers; the caller only sends invalid ones
    except grpc.RpcError as e:
        return e.code()
    return OK


def reflect(ch: grpc.Channel, version: str, payloads: list[bytes]) -> grpc.StatusCode:
    rpc = ch.stream_stream(REFLECTION[version], request_serializer=None, response_deserializer=None)
    try:
        for _ in rpc(iter(payloads), timeout=10):
            pass
    except grpc.RpcError as e:
        return e.code()
    return OK


def expect(target: str, code: grpc.StatusCode, allowed: set[grpc.StatusCode], what: object) -> None:
    counts[(target, code.name)] += 1
    assert code in allowed, f"{target}: {code.name} {details.get('last', '')[:300]} (allowed {sorted(c.name for c in allowed)}) for {what!r:.300}"


def parses(cls, payload: bytes) -> bool:
    try:
        cls.FromString(payload)
    except DecodeError:
        return False
    return True


def report(prefix: str) -> int:
    mine = {k: v for k, v in counts.items() if k[0].startswith(prefix)}
    total = sum(mine.values())
    print(f"\n{prefix}: {total} requests")
    for (target, outcome), n in sorted(mine.items()):
        print(f"  {target:45s} {outcome:20s} {n}")
    return total


# --- malformed payloads --------------------------------------------------------------------------------------------
def random_bytes(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice([1, 2, 3, 5, 8, 17, 64, 255, 1024, 5000]))


def truncations(rng: random.Random, message: bytes, n: int) -> list[bytes]:
    return [message[:rng.randrange(len(message))] for _ in range(n)]


NASTY_SHAPES = [[], [0], [0, 0], [1], [-1, 4], [2, -3], [2**62, 2], [0, 2**62], [2**63 - 1, 0], [3, 2**40],
                [1] * 70, [0] * 65, [2, 3, 4], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1] * 500]


def garbage_tensor(rng: random.Random) -> common_pb2.Tensor:
    """A Tensor whose dtype, shape or byte count is wrong (or all three)."""
    kind = rng.randrange(5)
    if kind == 0:  # unknown or unset dtype
        return common_pb2.Tensor(dtype=rng.choice([0, 11, 99, -5, 2**31 - 1]), shape=[2, 3], data=bytes(48))
    if kind == 1:  # nasty shape, arbitrary bytes
        return common_pb2.Tensor(dtype=rng.randint(1, 10), shape=rng.choice(NASTY_SHAPES), data=random_bytes(rng))
    if kind == 2:  # byte count off by a little
        shape = [rng.randint(1, 4), rng.randint(1, 8)]
        t = encode(torch.zeros(shape, dtype=torch.int64))
        t.data = t.data[:-rng.randint(1, 7)] if rng.random() < 0.5 else t.data + bytes(rng.randint(1, 7))
        return t
    if kind == 3:  # NaN, infinity and huge floats where numbers are due
        return encode(torch.tensor([[math.nan, math.inf, -math.inf, 3.4e38, 1e308]], dtype=torch.float64))
    return common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, shape=[rng.randint(1, 3)], data=bytes(8))  # wrong rank


def _tokens(b: int, s: int, rng: random.Random) -> torch.Tensor:
    return torch.tensor([[rng.randrange(4, VOCAB) for _ in range(s)] for _ in range(b)])


def bad_infer(rng: random.Random) -> critic_pb2.InferRequest:
    b, s = rng.randint(1, 4), rng.randint(1, 12)
    tokens, lengths = encode(_tokens(b, s, rng)), encode(torch.full((b,), s))
    flaw = rng.randrange(7)
    if flaw == 0:
        tokens = garbage_tensor(rng)
    elif flaw == 1:
        lengths = garbage_tensor(rng)
    elif flaw == 2:  # ids outside the vocabulary
        tokens = encode(torch.full((b, s), rng.choice([-1, VOCAB, 2**62])))
    elif flaw == 3:  # lengths out of range
        lengths = encode(torch.full((b,), rng.choice([0, -3, s + 1])))
    elif flaw == 4:  # float or bool tokens
        tokens = encode(torch.ones(b, s, dtype=rng.choice([torch.float32, torch.bool])))
    elif flaw == 5:  # longer than the model's max length
        tokens, lengths = encode(torch.full((1, MAX_LENGTH + 1), 5)), encode(torch.tensor([MAX_LENGTH + 1]))
    else:  # a field missing
        return critic_pb2.InferRequest(**rng.choice([{"tokens": tokens}, {"lengths": lengths}, {}]))
    return critic_pb2.InferRequest(tokens=tokens, lengths=lengths)


def bad_train(rng: random.Random) -> critic_pb2.TrainRequest:
    """A TrainRequest with at least one definite flaw, so the server must never apply it."""
    b, s = rng.randint(1, 4), rng.randint(2, 10)
    fields = {"tokens": encode(_tokens(b, s, rng)), "returns": encode(torch.zeros(b, s - 1)),
              "old_values": encode(torch.zeros(b, s - 1)), "mask": encode(torch.ones(b, s - 1)),
              "lengths": encode(torch.full((b,), s))}
    flaw = rng.randrange(9)
    if flaw == 0:
        fields[rng.choice(list(fields))] = garbage_tensor(rng)
    elif flaw == 1:
        fields[rng.choice(["returns", "old_values"])] = encode(torch.full((b, s - 1), rng.choice([math.nan, math.inf])))
    elif flaw == 2:
        fields["mask"] = encode(torch.full((b, s - 1), rng.choice([2.0, -1.0, 0.5])))
    elif flaw == 3:  # per-action tensors of the wrong shape
        fields[rng.choice(["returns", "old_values", "mask"])] = encode(torch.zeros(b, s))
    elif flaw == 4:  # a required field missing
        del fields[rng.choice(["tokens", "returns", "old_values", "mask"])]
    elif flaw == 5:
        fields["value_clip"] = rng.choice([-1.0, math.nan, math.inf])
    elif flaw == 6:
        fields["loss_scale"] = rng.choice([0.0, -2.0, math.nan])
    elif flaw == 7:  # a request id that is no printable ASCII, or too long
        fields["request_id"] = rng.choice(["a\nb", "é", "\x00", "x" * 257, "tab\there"])
    else:  # one token: no action to train on
        fields.update(tokens=encode(_tokens(b, 1, rng)), returns=encode(torch.zeros(b, 0)),
                      old_values=encode(torch.zeros(b, 0)), mask=encode(torch.zeros(b, 0)),
                      lengths=encode(torch.ones(b, dtype=torch.long)))
    return critic_pb2.TrainRequest(**fields)


def bad_tag(rng: random.Random) -> str:
    """A Save tag that is no plain checkpoint name."""
    return rng.choice(["", ".", "..", "../up", "a/b", "/abs", ".hidden", "-dash", "x" * 129, "a b", "tab\t",
                       "new\nline", "ünï", "a\x00b", "C:\\x", "~", "*", f"ok{rng.randrange(99)}/.."])


def bad_score(rng: random.Random) -> reward_pb2.ScoreRequest:
    b, s = rng.randint(1, 4), rng.randint(1, 12)
    flaw = rng.randrange(9)
    tokens, lengths = encode(_tokens(b, s, rng)), encode(torch.full((b,), s))
    if flaw == 0:
        return reward_pb2.ScoreRequest(tokens=garbage_tensor(rng), lengths=lengths)
    if flaw == 1:
        return reward_pb2.ScoreRequest(tokens=tokens, lengths=garbage_tensor(rng))
    if flaw == 2:  # tokens and texts, or neither
        return rng.choice([reward_pb2.ScoreRequest(tokens=tokens, lengths=lengths, texts=["a"]),
                           reward_pb2.ScoreRequest()])
    if flaw == 3:
        return reward_pb2.ScoreRequest(tokens=tokens, lengths=lengths,
                                       prompt_lengths=encode(torch.full((b,), rng.choice([-1, s + 1]))))
    if flaw == 4:  # counts that do not match
        return reward_pb2.ScoreRequest(texts=["good day"] * b, prompts=["good"] * (b + 1))
    if flaw == 5:
        return reward_pb2.ScoreRequest(texts=["good day"] * b, labels=["x"] * (b + 2))
    if flaw == 6:  # a text with no tokens, or too many
        return reward_pb2.ScoreRequest(texts=rng.choice([[""], ["good " * (MAX_LENGTH + 5)]]))
    if flaw == 7:  # conversations: malformed, mixed with texts, or (this model has no chat template) any at all
        def message(role: str) -> reward_pb2.ChatMessage:
            return reward_pb2.ChatMessage(role=role, content=rng.choice(["good day", "", "x =>"]))
        good = reward_pb2.Conversation(messages=[message("user"), message("assistant")])
        return rng.choice([
            reward_pb2.ScoreRequest(conversations=[reward_pb2.Conversation()] * b),
            reward_pb2.ScoreRequest(conversations=[reward_pb2.Conversation(messages=[message("assistant"),
                                                                                     message(rng.choice(["user", ""]))])]),
            reward_pb2.ScoreRequest(conversations=[good], texts=["good day"]),
            reward_pb2.ScoreRequest(conversations=[good], prompts=["x"]),
            reward_pb2.ScoreRequest(conversations=[good] * b),
        ])
    return reward_pb2.ScoreRequest(tokens=tokens)  # lengths missing


def invalid_utf8_string_field(field: int) -> bytes:
    """A message whose string field `field` holds bytes that are no UTF-8 (proto3 refuses to parse it)."""
    return bytes([field << 3 | 2, 3, 0xff, 0xfe, 0xc3])


# --- gRPC -----------------------------------------------------------------------------------------------------------
def test_malformed_critic_requests_get_invalid_argument_and_change_nothing(critic):
    rng, ch = random.Random(SEED), critic.channel
    # Random bytes to every method the service has. Bytes that happen to parse are a request like any other: unknown
    # fields only are a valid GetInfo, a short string a valid Save tag, or one no checkpoint has (NOT_FOUND).
    if_parsed = {"Infer": {INVALID}, "Train": {INVALID}, "GetInfo": {OK, INVALID}, "Save": {OK, INVALID}}
    for method in critic_pb2.DESCRIPTOR.services_by_name["CriticService"].methods:
        cls = GetMessageClass(method.input_type)
        for _ in range(60):
            blob = random_bytes(rng)
            expect(f"critic {method.name} random bytes", call(ch, CRITIC + method.name, blob),
                   if_parsed.get(method.name, {OK, INVALID, NOT_FOUND}) if parses(cls, blob) else {INVALID}, blob[:32])
    valid_infer = critic_pb2.InferRequest(tokens=encode(FIXED[0]), lengths=encode(FIXED[1])).SerializeToString()
    for blob in truncations(rng, valid_infer, 60):
        expect("critic Infer truncated", call(ch, CRITIC + "Infer", blob), {INVALID}, blob[:32])
    for _ in range(150):
        req = bad_infer(rng)
        expect("critic Infer bad tensors", call(ch, CRITIC + "Infer", req.SerializeToString()), {INVALID}, req)
    for _ in range(200):
        req = bad_train(rng)
        expect("critic Train bad tensors", call(ch, CRITIC + "Train", req.SerializeToString()), {INVALID}, req)
    # Truncations of a Train that is well-formed but out of the vocabulary (tokens come first on the wire): whatever
    # prefix arrives is invalid, so none can train.
    flawed = critic_pb2.TrainRequest(tokens=encode(torch.full((2, 6), VOCAB)), returns=encode(torch.zeros(2, 5)),
                                     old_values=encode(torch.zeros(2, 5)), mask=encode(torch.ones(2, 5)),
                                     lengths=encode(torch.full((2,), 6)), request_id="fuzz").SerializeToString()
    for blob in truncations(rng, flawed, 60):
        expect("critic Train truncated", call(ch, CRITIC + "Train", blob), {INVALID}, blob[:32])
    for _ in range(60):
        tag = bad_tag(rng)
        expect("critic Save bad tag", call(ch, CRITIC + "Save", critic_pb2.SaveRequest(tag=tag).SerializeToString()),
               {INVALID}, tag)
    expect("critic Save invalid UTF-8", call(ch, CRITIC + "Save", invalid_utf8_string_field(1)), {INVALID}, "utf-8")
    expect("critic Train invalid UTF-8", call(ch, CRITIC + "Train", invalid_utf8_string_field(8)), {INVALID}, "utf-8")
    assert report("critic") >= 700
    values, step = _reference_values(ch)
    assert step == critic.reference[1], "a fuzzed Train was applied"
    torch.testing.assert_close(values, critic.reference[0], atol=0, rtol=0)
    assert list(critic.ckpt.iterdir()) == [], "a fuzzed Save wrote a checkpoint"


def test_malformed_reward_requests_get_invalid_argument(reward):
    rng, ch = random.Random(SEED + 1), reward.channel
    for method in reward_pb2.DESCRIPTOR.services_by_name["RewardService"].methods:
        for _ in range(80):
            blob = random_bytes(rng)
            # bytes that parse are a request like any other: unknown fields only (GetInfo), or a few texts (Score)
            expect(f"reward {method.name} random bytes", call(ch, REWARD + method.name, blob),
                   {OK, INVALID} if parses(GetMessageClass(method.input_type), blob) else {INVALID}, blob[:32])
    valid = reward_pb2.ScoreRequest(tokens=encode(FIXED[0]), lengths=encode(FIXED[1])).SerializeToString()
    for blob in truncations(rng, valid, 60):
        expect("reward Score truncated", call(ch, REWARD + "Score", blob), {INVALID}, blob[:32])
    for _ in range(200):
        req = bad_score(rng)
        expect("reward Score bad content", call(ch, REWARD + "Score", req.SerializeToString()), {INVALID}, req)
    for field in (4, 5, 6):
        expect("reward Score invalid UTF-8", call(ch, REWARD + "Score", invalid_utf8_string_field(field)), {INVALID},
               field)
    for field in (1, 2):  # a conversation's message's role or content
        message = invalid_utf8_string_field(field)
        conversation = bytes([1 << 3 | 2, len(message)]) + message
        expect("reward Score invalid UTF-8", call(ch, REWARD + "Score", bytes([7 << 3 | 2, len(conversation)]) +
                                                  conversation), {INVALID}, field)
    assert report("reward") >= 400


def test_malformed_health_and_reflection_requests_get_invalid_argument(critic, reward):
    rng = random.Random(SEED + 2)
    for server in (critic, reward):
        ch = server.channel
        for _ in range(50):
            blob = random_bytes(rng)
            # a HealthCheckRequest names a service: "" and ours are SERVING, any other is NOT_FOUND
            expect("probe health Check random bytes", call(ch, CHECK, blob),
                   {OK, NOT_FOUND, INVALID} if parses(health_pb2.HealthCheckRequest, blob) else {INVALID}, blob[:32])
        for _ in range(10):
            name = "".join(rng.choice("abc./_-é") for _ in range(rng.randint(1, 30)))
            request = health_pb2.HealthCheckRequest(service=name).SerializeToString()
            expect("probe health Check unknown service", call(ch, CHECK, request), {NOT_FOUND}, name)
        expect("probe health Check invalid UTF-8", call(ch, CHECK, invalid_utf8_string_field(1)), {INVALID}, "utf-8")
        for _ in range(10):
            blob = random_bytes(rng)
            if not parses(health_pb2.HealthCheckRequest, blob):
                expect("probe health Watch random bytes", watch(ch, blob), {INVALID}, blob[:32])
        good = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
        for version in REFLECTION:
            for _ in range(25):
                blob = random_bytes(rng)
                ok = parses(reflection_pb2.ServerReflectionRequest, blob)
                # a parsed request is answered in the stream (an error_response for a bad one), the call ends OK
                expect(f"probe reflection {version} random bytes", reflect(ch, version, [good, blob]),
                       {OK} if ok else {INVALID}, blob[:32])
            symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol").SerializeToString()
            for blob in truncations(rng, symbol, 10):
                expect(f"probe reflection {version} truncated", reflect(ch, version, [blob]),
                       {OK} if parses(reflection_pb2.ServerReflectionRequest, blob) else {INVALID}, blob)
    assert report("probe") >= 250
    for server in (critic, reward):
        reply = health_pb2_grpc.HealthStub(server.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# --- REST ----------------------------------------------------------------------------------------------------------
def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False, 0, -1, 2**64, 1e308, -0.0, 3.5])
    if kind == 2:
        return "".join(rng.choice("ab =>\u00e9\u4e2d\U0001f600\\\"") for _ in range(rng.randint(0, 12)))
    if kind == 3:
        return rng.choice(["good day", "", "x" * 1000])
    if kind == 4:
        return rng.choice(["query", "prompts", "labels"])
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["query", "prompts", "labels", "extra", ""]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def get_reward_bodies(rng: random.Random) -> list[tuple[bytes, dict]]:
    """(body, headers) pairs: random JSON, JSON of the right shape with wrong content, what JSON cannot carry,
    invalid UTF-8, deep nesting, truncated JSON, random bytes, wrong content types."""
    json_type = {"content-type": "application/json"}
    bodies = []
    for _ in range(120):
        bodies.append((json.dumps(random_json(rng)).encode(), json_type))
    for _ in range(60):
        doc = {"query": [random_json(rng) for _ in range(rng.randint(0, 3))]}
        if rng.random() < 0.5:
            doc["prompts"] = random_json(rng)
        if rng.random() < 0.5:
            doc["labels"] = random_json(rng)
        bodies.append((json.dumps(doc).encode(), json_type))
    valid = json.dumps({"query": ["good day => happy"], "prompts": ["good day =>"], "labels": [1]}).encode()
    bodies += [(valid[:rng.randrange(len(valid))], json_type) for _ in range(30)]
    bodies += [(random_bytes(rng), json_type) for _ in range(30)]
    for raw in (b'{"query": [NaN]}', b'{"query": ["a"], "labels": [Infinity]}', b'{"query": ["\\ud800"]}',
                b'{"query": ["a"], "prompts": ["\\udfff"]}', b'{"query": ["\xff\xfe"]}', b'\xef\xbb\xbf{"query": ["a"]}',
                b'{"query": ["a"], "labels": [' + b"[" * 5000 + b"]" * 5000 + b"]}", b"[" * 100000 + b"]" * 100000,
                b'{"query": ["a"], "labels": [1e999999]}', b'{"query": ["a"], "query": ["b"]}', b"", b"null", b"{}",
                b'{"query": ["' + b"good " * (MAX_LENGTH + 5) + b'"]}', b'{"query": [""]}'):
        bodies.append((raw, json_type))
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                         "application/json; charset=latin-1", "application/octet-stream", "", "\x7f"):
        bodies.append((valid, {"content-type": content_type}))
    bodies.append((valid, {"content-encoding": "gzip", **json_type}))
    bodies.append((valid, {"authorization": "Bearer nonsense", **json_type}))
    return bodies


def test_no_rest_request_gets_a_server_error(reward, critic):
    rng = random.Random(SEED + 3)
    with httpx.Client(base_url=reward.http, timeout=30) as http:
        for body, headers in get_reward_bodies(rng):
            status = http.post("/get_reward", content=body, headers=headers).status_code
            counts[("rest POST /get_reward", str(status))] += 1
            assert status in (200, 400, 415, 422), (status, body[:200], headers)
        for method in ("GET", "PUT", "DELETE", "PATCH"):
            status = http.request(method, "/get_reward", content=rng.randbytes(10)).status_code
            counts[(f"rest {method} /get_reward", str(status))] += 1
            assert status == 405, (method, status)
    for server in (critic, reward):
        with httpx.Client(base_url=server.http, timeout=30) as http:
            for route in ("/health", "/ready", "/metrics"):
                for _ in range(8):
                    query = "?" + "&".join(f"{rng.choice('abc')}={rng.randbytes(3).hex()}" for _ in range(3))
                    headers = {"content-type": rng.choice(["application/json", "text/plain", "\x7f"]),
                               "accept": rng.choice(["*/*", "application/xml", "nonsense"])}
                    status = http.request("GET", route + query, content=random_bytes(rng), headers=headers).status_code
                    counts[(f"rest GET {route}", str(status))] += 1
                    assert status == 200, (route, status)
                head = http.head(route)
                assert head.status_code == 200 and head.content == b"", route  # as GET, without the body
                # a trailing slash names no route: 404, not a redirect built from the caller's Host header
                slashed = http.get(route + "/", headers={"host": "elsewhere.example"})
                counts[(f"rest GET {route}/", str(slashed.status_code))] += 1
                assert slashed.status_code == 404 and "location" not in slashed.headers, (route, slashed.headers)
                for method in ("POST", "PUT", "DELETE", "PATCH"):
                    status = http.request(method, route, content=random_bytes(rng)).status_code
                    counts[(f"rest {method} {route}", str(status))] += 1
                    assert status == 405, (method, route, status)
            zipped = http.get("/metrics", headers={"accept-encoding": "gzip"})  # httpx decodes it
            assert zipped.headers["content-encoding"] == "gzip" and "# TYPE" in zipped.text
            assert "process_resident_memory_bytes" in zipped.text and "process_start_time_seconds" in zipped.text
            # Accept headers that prometheus-client's format negotiation cannot parse get the text format
            for accept in ("text/plain;version=xyz", "application/openmetrics-text;version=abc",
                           "application/openmetrics-text;version=1.0.0;escaping=\x7f", ";;,,", "text/plain;version="):
                reply = http.get("/metrics", headers={"accept": accept})
                counts[("rest GET /metrics, odd Accept", str(reply.status_code))] += 1
                assert reply.status_code == 200 and "# TYPE" in reply.text, (accept, reply.status_code)
            for _ in range(30):
                path = "/" + rng.choice("abc._~") + "".join(rng.choice("abc/%20.é~") for _ in range(rng.randint(0, 40)))
                method = rng.choice(["GET", "POST", "PUT", "DELETE", "OPTIONS"])
                status = http.request(method, path, content=random_bytes(rng)).status_code
                counts[("rest unknown route", str(status))] += 1
                assert status in (404, 405), (method, path, status)
    assert report("rest") >= 350


def test_malformed_http_gets_no_server_error(reward):
    """Bytes that are no HTTP request, as a scanner sends them: uvicorn answers below 500 (4xx for what it cannot
    parse) or closes the connection."""
    rng = random.Random(SEED + 4)
    payloads = [b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello
                b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcde",
                b"POST /get_reward HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", b"GET /health HTTP/9.9\r\n\r\n"]
    payloads += [random_bytes(rng) + b"\r\n\r\n" for _ in range(13)]
    for payload in payloads:
        with socket.create_connection(("127.0.0.1", reward.http_port), timeout=10) as s:
            s.sendall(payload)
            try:
                answer = s.recv(64)
            except (ConnectionResetError, TimeoutError):
                answer = b""
        status = int(answer.split()[1]) if answer.startswith(b"HTTP/1.1 ") else None
        counts[("http malformed", str(status))] += 1
        assert status is None or status < 500, (payload[:60], answer)
    assert report("http") == len(payloads)
    assert httpx.get(f"{reward.http}/ready").status_code == 200


# --- message limits -------------------------------------------------------------------------------------------------
def test_oversized_messages_are_refused_before_they_grow_the_memory(critic):
    rss = measure(critic.address, critic.proc.pid, 256, 3)
    assert rss[-1] - rss[0] < 100, f"critic RSS grew {rss[-1] - rss[0]:.0f} MiB after 3 x 256 MiB junk"
    too_big = critic_pb2.InferRequest(tokens=common_pb2.Tensor(dtype=common_pb2.DTYPE_INT64, data=bytes(18 * 2**20)))
    with pytest.raises(grpc.RpcError) as err:
        _unary(critic.channel, CRITIC + "Infer", too_big.SerializeToString())
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in err.value.details()


def test_the_largest_legitimate_requests_still_fit(critic):
    """64 full-length rows are served; a Train of max_request_rows (4096) full-length rows with float64 per-action
    tensors, the largest encoding the receive limit allows for, reaches the validator (one mask entry is 2, so it
    is refused there and trains nothing)."""
    tokens = torch.randint(4, VOCAB, (64, MAX_LENGTH), generator=torch.Generator().manual_seed(0))
    reply = critic_pb2.InferResponse.FromString(_unary(critic.channel, CRITIC + "Infer", critic_pb2.InferRequest(
        tokens=encode(tokens), lengths=encode(torch.full((64,), MAX_LENGTH))).SerializeToString()))
    assert list(decode(reply.values, "values").shape) == [64, MAX_LENGTH]
    rows = 4096
    mask = torch.ones(rows, MAX_LENGTH - 1, dtype=torch.float64)
    mask[-1, -1] = 2
    request = critic_pb2.TrainRequest(
        tokens=encode(torch.full((rows, MAX_LENGTH), 5)), lengths=encode(torch.full((rows,), MAX_LENGTH)),
        returns=encode(torch.zeros(rows, MAX_LENGTH - 1, dtype=torch.float64)),
        old_values=encode(torch.zeros(rows, MAX_LENGTH - 1, dtype=torch.float64)), mask=encode(mask),
        request_id="r" * 256)
    assert request.ByteSize() > 7.5 * 2**20  # beyond what a 4096 x max_length Train of float32 and int64 needs
    with pytest.raises(grpc.RpcError) as err:
        _unary(critic.channel, CRITIC + "Train", request.SerializeToString())
    assert err.value.code() == INVALID and "mask" in err.value.details(), err.value.details()
    assert _reference_values(critic.channel)[1] == critic.reference[1]

