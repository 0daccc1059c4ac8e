"""The critic server as a real subprocess, over real gRPC and HTTP on loopback."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ppo_services.v1 import common_pb2, critic_pb2, critic_pb2_grpc
from serving.codec import decode, encode
from serving.modeling import (
    NoScoreHead,
    attention_mask_from_lengths,
    load_scalar_head_model,
    load_tokenizer,
    per_token_scores,
    vocab_sha256,
)
from tests.grpc_helpers import channel, expect_invalid, random_blobs, send_raw
from tests.service_procs import ROOT, ServiceProcess, histogram_stats

SERVICE = "/ppo_services.v1.CriticService/"


TOKENS_PER_PASS = 512  # not the default (2048): the module's critic cuts its batches by this budget


@pytest.fixture(scope="module")
def critic(embedded_cache, log_dir, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("critic-ckpt")
    with ServiceProcess("critic", "--checkpoint-dir", str(ckpt), "batching.max_queue_delay_ms=200",
                        "batching.max_batch_size=64", f"batching.max_tokens_per_pass={TOKENS_PER_PASS}",
                        log_dir=log_dir) as proc:
        proc.ckpt = ckpt
        yield proc


@pytest.fixture(scope="module")
def stub(critic):
    ch = channel(critic.address)
    yield critic_pb2_grpc.CriticServiceStub(ch)
    ch.close()


# The Accept header of a Prometheus 2 / 3 scrape with its default scrape_protocols.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
                     "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")


def batch(seed: int, b: int = 4, s: int = 12, vocab: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (b, s), generator=g)
    lengths = torch.randint(2, s + 1, (b,), generator=g)
    lengths[0] = s
    return tokens, lengths


def infer(stub, tokens, lengths) -> torch.Tensor:
    reply = stub.Infer(critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(lengths)), timeout=60)
    return decode(reply.values, "values")


def train_request(tokens: torch.Tensor, target: float) -> critic_pb2.TrainRequest:
    b, s = tokens.shape
    returns = torch.full((b, s - 1), target)
    return critic_pb2.TrainRequest(tokens=encode(tokens), returns=encode(returns), old_values=encode(torch.zeros(b, s - 1)),
                                   mask=encode(torch.ones(b, s - 1)))


def test_info_describes_the_embedded_critic(stub, embedded_assets):
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30)
    tok = load_tokenizer(str(embedded_assets.reward_model))
    assert info.model == "embedded:reward"
    assert info.vocab_size == len(tok) and info.vocab_sha256 == vocab_sha256(tok)
    assert info.max_length >= 32 and not info.serves_rewards and info.max_batch_size == 64


def test_infer_matches_the_same_weights_in_process(critic, stub, embedded_assets):
    tokens, lengths = batch(0)
    remote = infer(stub, tokens, lengths)
    model = load_scalar_head_model(str(embedded_assets.reward_model)).eval()
    with torch.no_grad():
        local = per_token_scores(model, tokens, lengths)
    assert remote.shape == tokens.shape and remote.dtype == torch.float32
    torch.testing.assert_close(remote, local, atol=1e-5, rtol=1e-5)
    # on a CPU in float32, eager: through prepacked weights (prepack_weights, the default), Train on the weights
    assert "Infer passes compute through linear weights prepacked for oneDNN" in critic.log()
    assert (remote[1, lengths[1]:] == 0).all()  # padding positions are zero


def test_a_batch_cut_into_passes_by_the_token_budget_matches_the_same_weights_in_process(stub, embedded_assets):
    """64 rows of up to 64 tokens: more than the server's batching.max_tokens_per_pass holds, so it runs them as
    several passes of similar length; each row's values are those of the whole padded batch."""
    tokens, lengths = batch(7, b=64, s=64, vocab=20)
    remote = infer(stub, tokens, lengths)
    model = load_scalar_head_model(str(embedded_assets.reward_model)).eval()
    with torch.no_grad():
        local = per_token_scores(model, tokens, lengths)
    torch.testing.assert_close(remote, local, atol=1e-5, rtol=1e-5)


def test_each_forward_pass_holds_at_most_the_token_budget_as_metrics_show(critic, stub):
    """16 full rows of 64 tokens under a budget of 512: two passes of 8 rows, 512 padded tokens each, on /metrics;
    a Train of them cuts its micro-batches by train.micro_batch_size instead, one pass per micro-batch."""
    tokens = batch(8, b=16, s=64)[0]
    lengths = torch.full((16,), 64)

    def passes_since(before: tuple[float, float], method: str) -> tuple[float, float]:
        now = histogram_stats(critic, "ppo_critic_pass_tokens", method)
        return now[0] - before[0], now[1] - before[1]

    before = histogram_stats(critic, "ppo_critic_pass_tokens", "Infer")
    infer(stub, tokens, lengths)
    assert passes_since(before, "Infer") == (2, 2 * 8 * 64)
    assert 64 * 16 > TOKENS_PER_PASS  # one pass would have exceeded the budget
    before = histogram_stats(critic, "ppo_critic_pass_tokens", "Train")
    stub.Train(train_request(tokens[:4], 0.0), timeout=60)
    passes, total = passes_since(before, "Train")
    assert passes >= 1 and total == 4 * 64


def test_concurrent_infers_are_merged_and_each_gets_its_own_rows(critic, stub):
    requests = [batch(100 + i, b=2, s=6 + i) for i in range(8)]
    queued_before = histogram_stats(critic, "ppo_critic_queue_duration_seconds", "Infer")
    expected = [infer(stub, t, n) for t, n in requests]  # one caller, back to back: none waits for company
    count, waited = (a - b for a, b in zip(histogram_stats(critic, "ppo_critic_queue_duration_seconds", "Infer"),
                                           queued_before, strict=True))
    # Each waited the whole 200 ms window before; now at most the first waits it, for callers of an earlier test.
    assert count == len(requests) and waited < 0.5, f"{count} lone calls waited {waited:.3f} s in all"
    before = histogram_stats(critic, "ppo_critic_batch_size", "Infer")[0]
    calls = [stub.Infer.future(critic_pb2.InferRequest(tokens=encode(t), lengths=encode(n)), timeout=60)
             for t, n in requests]  # sent within a few milliseconds: those behind the first run merged
    got = [decode(c.result().values, "values") for c in calls]
    batches = histogram_stats(critic, "ppo_critic_batch_size", "Infer")[0] - before
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    assert batches < len(requests), f"{len(requests)} concurrent requests ran as {batches} batches"


def test_a_caller_that_goes_away_does_not_disturb_its_batch_mates(stub):
    requests = [batch(200 + i, b=2, s=8) for i in range(6)]
    expected = [infer(stub, t, n) for t, n in requests]
    calls = [stub.Infer.future(critic_pb2.InferRequest(tokens=encode(t), lengths=encode(n)), timeout=60)
             for t, n in requests]
    calls[2].cancel()
    for i, (c, e) in enumerate(zip(calls, expected)):
        if i != 2:
            torch.testing.assert_close(decode(c.result().values, "values"), e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(infer(stub, *requests[2]), expected[2], atol=1e-5, rtol=1e-5)


def test_a_train_sent_before_an_infer_is_applied_first(critic, stub):
    tokens, lengths = batch(1)
    before = infer(stub, tokens, lengths)
    step0 = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step
    big, _ = batch(12, b=1024, s=48)  # about a second of training on a CPU
    started = _metric(critic, r'ppo_critic_queue_duration_seconds_count\{method="Train"\}')
    train = stub.Train.future(train_request(big, 3.0), timeout=120)
    deadline = time.monotonic() + 60  # send the Infer once the Train has left the queue and is running
    while _metric(critic, r'ppo_critic_queue_duration_seconds_count\{method="Train"\}') == started:
        assert time.monotonic() < deadline and not train.done()
        time.sleep(0.005)
    concurrent_infer = stub.Infer.future(critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(lengths)), timeout=120)
    reply = train.result()
    seen = decode(concurrent_infer.result().values, "values")
    after = infer(stub, tokens, lengths)
    assert reply.train_step > step0 and reply.loss > 0
    assert {"grad_norm", "vf_clipfrac", "explained_variance", "lr"} <= set(reply.metrics)
    assert not torch.allclose(after, before, atol=1e-4)
    torch.testing.assert_close(seen, after, atol=1e-6, rtol=1e-6)  # the Infer saw the trained weights


def test_train_moves_values_toward_returns(stub):
    tokens, _ = batch(2, s=10)
    full = torch.full((4,), 10)
    start = infer(stub, tokens, full)[:, :-1].mean()
    for _ in range(5):
        stub.Train(train_request(tokens, 5.0), timeout=120)
    end = infer(stub, tokens, full)[:, :-1].mean()
    assert abs(end - 5.0) < abs(start - 5.0)


def test_infer_after_a_train_computes_with_the_trained_weights(critic, stub):
    """The Infer passes' packed weights (prepack_weights, kept between Trains) are those of the latest Train: values
    after it equal those of its checkpoint loaded in process."""
    tokens, lengths = batch(9)
    infer(stub, tokens, lengths)  # packs the weights as they are
    stub.Train(train_request(tokens, 3.0), timeout=120)
    after = infer(stub, tokens, lengths)
    from transformers import AutoModelForSequenceClassification

    path = stub.Save(critic_pb2.SaveRequest(tag="after-train"), timeout=120).path
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(after, per_token_scores(model, tokens, lengths), atol=1e-5, rtol=1e-5)


def test_save_writes_a_checkpoint_transformers_loads(critic, stub):
    tokens, lengths = batch(3)
    reply = stub.Save(critic_pb2.SaveRequest(tag="step_7"), timeout=120)
    assert reply.path.endswith("step_7") and str(critic.ckpt) in reply.path
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reply.path).eval()
    with torch.no_grad():
        local = per_token_scores(model, tokens, lengths)
    torch.testing.assert_close(infer(stub, tokens, lengths), local, atol=1e-5, rtol=1e-5)
    assert (critic.ckpt / "step_7" / "optimizer.pt").is_file()
    assert not list(critic.ckpt.glob(".tmp-*"))
    assert (critic.ckpt / "step_7" / "model.safetensors").is_file()  # weights without pickle
    assert not [p.name for p in (critic.ckpt / "step_7").iterdir() if p.suffix in (".bin", ".pkl", ".pickle")]
    state = json.loads((critic.ckpt / "step_7" / "critic_state.json").read_text())
    assert state["train_step"] == reply.train_step and isinstance(state["saved_at"], float)
    # the same tag again replaces it; the old one is moved aside until the new one is in place, then removed
    stub.Train(train_request(tokens, 1.0), timeout=120)
    again = stub.Save(critic_pb2.SaveRequest(tag="step_7"), timeout=120)
    assert again.train_step == reply.train_step + 1
    assert json.loads((critic.ckpt / "step_7" / "critic_state.json").read_text())["train_step"] == again.train_step
    assert not list(critic.ckpt.glob(".old-*")) and not list(critic.ckpt.glob(".tmp-*"))


def _tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("tag", ["step_1\n", "../x", "a/b", "..", ".", ".hidden", ".tmp-x", "", "x" * 129, "a\x00b",
                                 "schritt_ü", "步骤", "/abs", "x" * 100_000],
                         ids=["trailing-newline", "parent", "slash", "dotdot", "dot", "hidden", "tmp-prefix", "empty",
                              "129-chars", "nul", "umlaut", "cjk", "absolute", "huge"])
def test_save_refuses_tags_that_are_not_one_plain_name_and_writes_nothing(critic, stub, tag):
    before = _tree(critic.ckpt.parent)
    details = expect_invalid(stub.Save, critic_pb2.SaveRequest(tag=tag), "tag", "ASCII letters, digits")
    assert details.startswith("tag:") and len(details) < 300
    assert _tree(critic.ckpt.parent) == before


def test_save_does_not_follow_links_or_replace_foreign_directories(critic, stub, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (critic.ckpt / "linked").symlink_to(outside, target_is_directory=True)
    (critic.ckpt / ".tmp-planted").symlink_to(outside, target_is_directory=True)
    (critic.ckpt / ".old-planted").symlink_to(outside, target_is_directory=True)
    (critic.ckpt / "notes").mkdir()
    (critic.ckpt / "notes" / "keep.txt").write_text("mine")
    try:
        expect_invalid(stub.Save, critic_pb2.SaveRequest(tag="linked"), "tag", "is a link", "checkpoint_dir itself")
        expect_invalid(stub.Load, critic_pb2.LoadRequest(tag="linked"), "tag", "is a link")
        expect_invalid(stub.Save, critic_pb2.SaveRequest(tag="notes"), "tag", "not a critic checkpoint")
        reply = stub.Save(critic_pb2.SaveRequest(tag="planted"), timeout=120)  # its temp dir name was a link
        assert reply.path == str((critic.ckpt / "planted").resolve())
        stub.Save(critic_pb2.SaveRequest(tag="planted"), timeout=120)  # replacing it moves it aside: a link there too
        assert (critic.ckpt / "planted" / "model.safetensors").is_file() and not (critic.ckpt / ".tmp-planted").exists()
        assert list(outside.iterdir()) == []
        assert (critic.ckpt / "notes" / "keep.txt").read_text() == "mine"
    finally:
        for name in ("linked", ".tmp-planted", ".old-planted"):
            if (critic.ckpt / name).is_symlink():
                (critic.ckpt / name).unlink()
        shutil.rmtree(critic.ckpt / "notes")


def test_keep_last_keeps_the_newest_checkpoints_and_nothing_it_did_not_write(embedded_cache, log_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "notes").mkdir(parents=True)  # a foreign directory
    (ckpt / "notes" / "keep.txt").write_text("mine")
    (ckpt / "legacy").mkdir()  # a state file without saved_at: not ordered, so never deleted
    (ckpt / "legacy" / "critic_state.json").write_text(json.dumps({"train_step": 3}))
    (ckpt / ".tmp-crashed").mkdir()  # what a Save interrupted before its rename leaves
    (ckpt / ".tmp-crashed" / "config.json").write_text("{}")
    os.utime(ckpt / ".tmp-crashed", (time.time() - 3600, time.time() - 3600))
    tags = ["d-first", "c-second", "b-third", "a-fourth"]  # name order is the reverse of write order
    with ServiceProcess("critic", "--checkpoint-dir", str(ckpt), "keep_last=2", log_dir=log_dir) as proc:
        ch = channel(proc.address)
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        tokens, _ = batch(15)
        for tag in tags:
            stub.Train(train_request(tokens, 1.0), timeout=120)
            stub.Save(critic_pb2.SaveRequest(tag=tag), timeout=120)
        ch.close()
    assert sorted(p.name for p in ckpt.iterdir()) == ["a-fourth", "b-third", "legacy", "notes"]
    assert (ckpt / "notes" / "keep.txt").read_text() == "mine"
    states = [json.loads((ckpt / t / "critic_state.json").read_text()) for t in ("b-third", "a-fourth")]
    assert [s["train_step"] for s in states] == [3, 4] and states[0]["saved_at"] < states[1]["saved_at"]


def test_autosave_keep_bounds_the_autosaves_and_leaves_every_other_checkpoint(embedded_cache, log_dir, tmp_path):
    """autosave_every=1 with keep_last would delete the actor's <run_id>-step_N checkpoints too; autosave_keep
    prunes autosave-* alone."""
    ckpt = tmp_path / "ckpt"
    with ServiceProcess("critic", "--checkpoint-dir", str(ckpt), "autosave_every=1", "autosave_keep=2",
                        log_dir=log_dir) as proc:
        ch = channel(proc.address)
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        tokens, _ = batch(16)
        stub.Train(train_request(tokens, 1.0), timeout=120)
        stub.Save(critic_pb2.SaveRequest(tag="run-a-step_1"), timeout=120)
        for _ in range(3):
            stub.Train(train_request(tokens, 1.0), timeout=120)
        ch.close()
    assert sorted(p.name for p in ckpt.iterdir()) == ["autosave-3", "autosave-4", "run-a-step_1"]


def test_an_optimizer_state_that_needs_pickle_stops_the_critic_with_the_file_named(stub, tmp_path):
    saved = Path(stub.Save(critic_pb2.SaveRequest(tag="to-tamper"), timeout=120).path)
    tampered = tmp_path / "tampered"
    shutil.copytree(saved, tampered)
    # Any global outside torch's weights_only allowlist would run arbitrary code under a full unpickle.
    torch.save({"state": {}, "param_groups": [], "extra": argparse.Namespace(x=1)}, tampered / "optimizer.pt")
    _as_written_before_sums(tampered)  # else its recorded CRC-32 refuses the changed file before it is read
    result = subprocess.run([sys.executable, "-m", "critic_server", "--port", "0", "--http-port", "0",
                             "--model", str(tampered)], check=False, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert "critic cannot load its model" in result.stderr
    assert str(tampered / "optimizer.pt") in result.stderr and "weights_only=True" in result.stderr
    assert "argparse.Namespace" in result.stderr


@pytest.mark.parametrize(
    "request_fn, words",
    [
        (lambda t, n: critic_pb2.InferRequest(lengths=encode(n)), ["tokens", "required"]),
        (lambda t, n: critic_pb2.InferRequest(tokens=encode(t.float()), lengths=encode(n)), ["tokens", "integer"]),
        (lambda t, n: critic_pb2.InferRequest(tokens=encode(t), lengths=encode(n * 0)), ["lengths", "[1, 12]"]),
        (lambda t, n: critic_pb2.InferRequest(tokens=encode(t), lengths=encode(n[:2])), ["lengths", "shape"]),
        (lambda t, n: critic_pb2.InferRequest(tokens=encode(t + 10_000), lengths=encode(n)), ["tokens", "token ids"]),
        (lambda t, n: critic_pb2.InferRequest(tokens=critic_pb2.InferRequest().tokens.__class__(dtype=5, shape=[4, 12], data=b"xx"),
                                              lengths=encode(n)), ["tokens", "bytes"]),
    ],
    ids=["missing-tokens", "float-tokens", "zero-lengths", "lengths-shape", "token-out-of-vocab", "short-data"],
)
def test_bad_infer_requests_name_the_field(stub, request_fn, words):
    tokens, lengths = batch(4)
    expect_invalid(stub.Infer, request_fn(tokens, lengths), *words)


def test_padding_may_hold_any_id_and_an_id_outside_the_vocabulary_before_a_row_s_end_is_named(stub):
    """Positions at or past lengths[b] are padding and ignored, as the proto says: hand-written trainers pad with -1
    or -100, or with a pad id added past the embeddings (all were refused). An id outside the vocabulary before a
    row's end is refused naming its row and position."""
    tokens, lengths = batch(9)
    vocab = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).vocab_size
    padding = torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]
    assert padding.any()
    want = infer(stub, torch.where(padding, 0, tokens), lengths)
    for pad in (-1, -100, vocab, vocab + 10_000):
        torch.testing.assert_close(infer(stub, torch.where(padding, pad, tokens), lengths), want, atol=0, rtol=0)
    step = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step
    padded = train_request(torch.where(padding, -100, tokens), 1.0)
    padded.lengths.CopyFrom(encode(lengths))
    padded.mask.CopyFrom(encode((~padding[:, 1:]).float()))
    assert stub.Train(padded, timeout=120).train_step == step + 1
    inside = tokens.clone()
    inside[1, 0] = vocab
    details = expect_invalid(stub.Infer, critic_pb2.InferRequest(tokens=encode(inside), lengths=encode(lengths)),
                             "tokens", "padding")
    assert f"tokens[1, 0] = {vocab}" in details


def test_a_realistic_batch_fits_the_transport(stub):
    """512 x 4096 int64 tokens is 16 MiB, four times gRPC's default limit: it must reach the validator."""
    tokens = torch.zeros(512, 4096, dtype=torch.long)
    details = expect_invalid(stub.Infer, critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(torch.full((512,), 4096))))
    assert "max length" in details


def test_a_request_carries_at_most_max_request_rows_rows_of_max_length_tokens(stub):
    """The receive limit counts bytes for the widest encoding of a token (32 B); uint8 ids take one, so a message
    under it carried 32 times the tokens max_request_rows allows (one held the model thread for 10 s). Shorter rows
    fit in proportion; past the budget the request is refused naming the field."""
    max_length = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).max_length
    budget = 4096 * max_length  # the default max_request_rows
    fits = torch.ones(budget // 8, 8, dtype=torch.uint8)
    assert infer(stub, fits[:64], torch.full((64,), 8)).shape == (64, 8)
    over = torch.ones(budget // 8 + 1, 8, dtype=torch.uint8)
    details = expect_invalid(stub.Infer, critic_pb2.InferRequest(tokens=encode(over),
                                                                 lengths=encode(torch.full((len(over),), 8))),
                             "tokens", "max_request_rows")
    assert f"{budget + 8} tokens" in details


def test_bad_train_requests_leave_the_weights_alone(stub):
    tokens, lengths = batch(5)
    before, step = infer(stub, tokens, lengths), stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step
    nan = train_request(tokens, float("nan"))
    expect_invalid(stub.Train, nan, "returns", "NaN")
    beyond = train_request(tokens, 1.0)  # returns of 1e39: finite in float64, not in float32: it was said to be NaN or infinity
    beyond.returns.CopyFrom(encode(torch.full(decode(beyond.returns, "r").shape, 1e39, dtype=torch.float64)))
    expect_invalid(stub.Train, beyond, "returns", "beyond float32's range")
    bad_mask = train_request(tokens, 1.0)
    bad_mask.mask.CopyFrom(encode(torch.ones(4, 3)))
    expect_invalid(stub.Train, bad_mask, "mask", "shape")
    expect_invalid(stub.Save, critic_pb2.SaveRequest(tag="../escape"), "tag")
    expect_invalid(stub.Save, critic_pb2.SaveRequest(), "tag")
    assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step == step
    torch.testing.assert_close(infer(stub, tokens, lengths), before, atol=0, rtol=0)


def test_a_train_whose_mask_selects_nothing_takes_no_step(stub):
    """After a Train, Adam's momentum would move the weights on a zero gradient: a Train whose mask selects no
    position is answered, counts its global batches as empty and leaves the weights and the train step alone."""
    tokens, lengths = batch(6)
    stub.Train(train_request(tokens, 2.0), timeout=120)
    before, step = infer(stub, tokens, lengths), stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step
    nothing = train_request(tokens, 2.0)
    nothing.mask.CopyFrom(encode(torch.zeros(4, tokens.shape[1] - 1)))
    nothing.epochs = 2
    reply = stub.Train(nothing, timeout=120)
    assert (reply.train_step, reply.metrics["optimizer_steps"], reply.metrics["skipped_steps"]) == (step, 0, 0)
    assert reply.metrics["empty_steps"] >= 2 and math.isnan(reply.loss)
    assert math.isnan(reply.metrics["explained_variance"])  # nothing measured: it read 1.0, a perfect fit
    torch.testing.assert_close(infer(stub, tokens, lengths), before, atol=0, rtol=0)


def test_random_bytes_to_every_rpc_get_an_error_and_change_nothing(critic, stub):
    tokens, lengths = batch(6)
    before, step = infer(stub, tokens, lengths), stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step
    checkpoints = sorted(critic.ckpt.iterdir())
    ch = channel(critic.address)
    for method in ("Infer", "Train", "Save", "Load", "GetInfo"):
        for blob in random_blobs():
            assert send_raw(ch, SERVICE + method, blob) == grpc.StatusCode.INVALID_ARGUMENT, (method, blob[:16])
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step == step
    torch.testing.assert_close(infer(stub, tokens, lengths), before, atol=0, rtol=0)
    assert sorted(critic.ckpt.iterdir()) == checkpoints
    ch.close()


def test_health_reflection_and_rest_endpoints(critic):
    ch = channel(critic.address)
    stub = critic_pb2_grpc.CriticServiceStub(ch)  # one good and one bad Infer, so the metrics below have samples
    infer(stub, *batch(11))
    expect_invalid(stub.Infer, critic_pb2.InferRequest(tokens=encode(torch.tensor([[1, 2]])),
                                                       lengths=encode(torch.tensor([3]))), "lengths")
    for service in ("", "ppo_services.v1.CriticService"):
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    listed = health_pb2_grpc.HealthStub(ch).List(health_pb2.HealthListRequest(), timeout=10).statuses
    assert {name: s.status for name, s in listed.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING, "ppo_services.v1.CriticService": health_pb2.HealthCheckResponse.SERVING}
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"ppo_services.v1.CriticService", "grpc.health.v1.Health"} <= names
    ch.close()
    assert httpx.get(f"{critic.http}/health").json() == {"status": "ok"}
    assert httpx.get(f"{critic.http}/ready").status_code == 200
    text = httpx.get(f"{critic.http}/metrics").text
    for name in ("ppo_critic_requests_total", "ppo_critic_request_duration_seconds_bucket",
                 "ppo_critic_queue_duration_seconds_bucket", "ppo_critic_batch_size_bucket", "ppo_critic_pass_tokens_bucket",
                 "ppo_critic_train_steps", "ppo_critic_last_loss"):
        assert name in text, name
    assert "_created" not in text  # no gauge family per counter and histogram beside it
    assert re.search(r'ppo_critic_requests_total\{code="INVALID_ARGUMENT",method="Infer"\} [1-9]', text) or \
        re.search(r'ppo_critic_requests_total\{method="Infer",code="INVALID_ARGUMENT"\} [1-9]', text)
    # Prometheus' own scrape asks for OpenMetrics first (its default Accept header) and gets it
    scrape = httpx.get(f"{critic.http}/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    assert scrape.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert scrape.text.endswith("# EOF\n") and "# TYPE ppo_critic_requests counter" in scrape.text
    assert httpx.get(f"{critic.http}/metrics").headers["content-type"].startswith("text/plain")


def test_a_critic_initialised_from_the_policy_gets_a_fresh_value_head(embedded_cache, log_dir):
    with ServiceProcess("critic", "--model", "embedded:policy", "--checkpoint-dir", str(log_dir / "ckpt-policy"),
                        log_dir=log_dir) as proc:
        ch = channel(proc.address)
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).model == "embedded:policy"
        tokens, lengths = batch(9)
        values = infer(stub, tokens, lengths)
        assert values.shape == tokens.shape and torch.isfinite(values).all() and values.abs().sum() > 0
        reply = stub.Train(train_request(tokens, 1.0), timeout=120)
        assert reply.train_step == 1 and reply.loss > 0
        ch.close()


def test_sigterm_finishes_in_flight_work_and_exits_zero(embedded_cache, log_dir):
    proc = ServiceProcess("critic", "--checkpoint-dir", str(log_dir / "ckpt-sigterm"), log_dir=log_dir).start()
    ch = channel(proc.address)
    stub = critic_pb2_grpc.CriticServiceStub(ch)
    tokens, _ = batch(8, b=1024, s=48)
    pending = [stub.Train.future(train_request(tokens, 1.0), timeout=120) for _ in range(4)]
    # SIGTERM once the server holds work: one Train running and at least one queued behind it.
    deadline = time.monotonic() + 60
    while _metric(proc, "ppo_critic_queue_size") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not all(p.done() for p in pending), "the Trains finished before SIGTERM; make them larger"
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    proc.proc.send_signal(signal.SIGTERM)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # watchers hear of the shutdown
    deadline = time.monotonic() + 10
    while httpx.get(f"{proc.http}/ready", verify=proc.tls_context()).status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert httpx.get(f"{proc.http}/ready", verify=proc.tls_context()).status_code == 503  # readiness drops while work drains
    assert not all(p.done() for p in pending)
    assert all(p.result().train_step > 0 for p in pending)  # accepted work completes
    drained = time.monotonic()
    assert proc.terminate(60) == 0
    assert time.monotonic() - drained < 10, "an open health Watch held the shutdown"
    ch.close()
    assert "shutting down" in proc.log() and "stopped" in proc.log()


def _metric(proc: ServiceProcess, pattern: str) -> float:
    text = httpx.get(f"{proc.http}/metrics", verify=proc.tls_context()).text
    m = re.search(pattern + r" ([0-9.e+]+)", text)
    return float(m.group(1)) if m else 0.0


def test_a_model_that_cannot_load_exits_1_with_a_clear_message(tmp_path):
    result = subprocess.run([sys.executable, "-m", "critic_server", "--port", "0", "--http-port", "0",
                             "--model", str(tmp_path / "no-such-model")], check=False, cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1
    assert "critic cannot load its model" in result.stderr and "no-such-model" in result.stderr


def test_a_full_queue_answers_resource_exhausted_and_loses_nothing(embedded_cache, log_dir):
    with ServiceProcess("critic", "batching.max_queue_size=2", "--checkpoint-dir", str(log_dir / "ckpt-queue"),
                        log_dir=log_dir) as proc:
        ch = channel(proc.address)
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        tokens, _ = batch(10, b=512, s=48)
        calls = [stub.Train.future(train_request(tokens, 1.0), timeout=120) for _ in range(8)]
        codes = []
        for c in calls:
            try:
                c.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
                assert "queue is full" in e.details()
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
        # Every accepted Train was applied, and only those.
        assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step == 8 * codes.count(grpc.StatusCode.OK)
        ch.close()


def test_train_loss_equals_the_value_loss_of_the_same_weights_in_process(critic, stub):
    """One global batch: the reported loss is the clipped value loss before the optimizer step."""
    from algorithms import value_loss

    tokens, _ = batch(11, b=8, s=10)
    path = stub.Save(critic_pb2.SaveRequest(tag="before-loss-check"), timeout=120).path
    g = torch.Generator().manual_seed(1)
    returns, old_values = torch.randn(8, 9, generator=g), torch.randn(8, 9, generator=g) * 0.1
    mask = (torch.rand(8, 9, generator=g) > 0.3).float()
    model = load_scalar_head_model(path).eval()
    with torch.no_grad():
        values = per_token_scores(model, tokens, torch.full((8,), 10))[:, :-1]
        expected, stats = value_loss(values, old_values, returns, mask, clip=0.2)
    reply = stub.Train(critic_pb2.TrainRequest(tokens=encode(tokens), returns=encode(returns),
                                               old_values=encode(old_values), mask=encode(mask)), timeout=120)
    assert reply.loss == pytest.approx(float(expected), rel=1e-4)
    assert reply.metrics["vf_clipfrac"] == pytest.approx(float(stats["vf_clipfrac"]), abs=1e-6)


def test_a_second_server_on_a_taken_port_fails_instead_of_sharing_it(critic, log_dir, tmp_path):
    def start(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", *argv], check=False, cwd=ROOT, capture_output=True, text=True,
                              timeout=120)

    grpc_taken = start("critic_server", "--port", str(critic.grpc_port), "--http-port", "0")
    assert grpc_taken.returncode == 1
    assert f"cannot listen on 127.0.0.1:{critic.grpc_port} (gRPC)" in grpc_taken.stderr
    # A taken REST port stops the process with its own error (exit 1), whether a server's or the actor's
    http_taken = start("critic_server", "--port", "0", "--http-port", str(critic.http_port))
    assert http_taken.returncode == 1, http_taken.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{critic.http_port} (HTTP)" in http_taken.stderr
    actor = start("actor", "--config", str(ROOT / "configs" / "ppo.yaml"), "--http-port", str(critic.http_port),
                  f"run_dir={tmp_path}")
    assert actor.returncode == 1, actor.stderr[-2000:]
    assert f"error: cannot listen on 127.0.0.1:{critic.http_port} (HTTP)" in actor.stderr


def test_a_critic_resumes_from_its_checkpoint_with_the_configured_lr(critic, stub, log_dir):
    tokens, lengths = batch(13)
    stub.Train(train_request(tokens, 2.0), timeout=120)
    saved = stub.Save(critic_pb2.SaveRequest(tag="resume-me"), timeout=120)
    expected = infer(stub, tokens, lengths)
    with ServiceProcess("critic", "--model", saved.path, "train.lr=1e-5", "--checkpoint-dir",
                        str(log_dir / "ckpt-resumed"), log_dir=log_dir) as resumed:
        ch = channel(resumed.address)
        other = critic_pb2_grpc.CriticServiceStub(ch)
        assert other.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step == saved.train_step
        torch.testing.assert_close(infer(other, tokens, lengths), expected, atol=1e-6, rtol=1e-6)
        reply = other.Train(train_request(tokens, 2.0), timeout=120)
        assert reply.train_step == saved.train_step + 1 and reply.metrics["lr"] == pytest.approx(1e-5)
        ch.close()
    assert "resumed critic optimizer state" in resumed.log()


def test_shutdown_is_bounded_by_the_grace_period(embedded_cache, log_dir):
    proc = ServiceProcess("critic", "grace_period_s=1", "--checkpoint-dir", str(log_dir / "ckpt-grace"),
                          log_dir=log_dir).start()
    ch = channel(proc.address)
    stub = critic_pb2_grpc.CriticServiceStub(ch)
    tokens, _ = batch(14, b=1024, s=48)
    pending = [stub.Train.future(train_request(tokens, 1.0), timeout=120) for _ in range(8)]  # several seconds
    deadline = time.monotonic() + 60
    while _metric(proc, "ppo_critic_queue_size") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.terminate(60) == 0
    assert time.monotonic() - start < 5, "shutdown outlasted the 1 s grace period by far"
    assert "abandoning" in proc.log()
    assert any(not p.done() or p.exception() is not None for p in pending)
    ch.close()


def _train_inputs(seed: int, b: int = 8, s: int = 10) -> dict[str, torch.Tensor]:
    """A Train batch with lengths: garbage token ids after each row's end, and a mask that stays inside the rows."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 20, (b, s), generator=g)
    lengths = torch.randint(3, s + 1, (b,), generator=g)
    lengths[0] = s
    mask = ((torch.rand(b, s - 1, generator=g) > 0.3) & (torch.arange(s - 1)[None, :] < lengths[:, None] - 1)).float()
    mask[:, 0] = 1.0
    return {"tokens": tokens, "lengths": lengths, "mask": mask, "returns": torch.randn(b, s - 1, generator=g),
            "old_values": torch.randn(b, s - 1, generator=g)}


def _train_with(stub, inputs: dict[str, torch.Tensor], **settings) -> critic_pb2.TrainResponse:
    request = critic_pb2.TrainRequest(**{k: encode(v) for k, v in inputs.items()}, **settings)
    return stub.Train(request, timeout=120)


def _local_value_loss(path: str, inputs: dict[str, torch.Tensor], **kwargs) -> tuple[float, dict[str, float], torch.Tensor]:
    """The value loss of a saved critic in this process, with Infer's attention mask and padding id 0 after lengths."""
    from algorithms import value_loss

    tokens, lengths = inputs["tokens"].clone(), inputs["lengths"]
    tokens[torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]] = 0
    model = load_scalar_head_model(path).eval()
    with torch.no_grad():
        values = per_token_scores(model, tokens, lengths)[:, :-1]
        loss, stats = value_loss(values, inputs["old_values"], inputs["returns"], inputs["mask"], **kwargs)
    return float(loss), {k: float(v) for k, v in stats.items()}, values


def test_train_with_lengths_sees_the_attention_mask_infer_uses(stub):
    """With lengths, what follows a row's end does not matter: the loss is that of the clean, masked batch."""
    from algorithms import masked_mean

    inputs = _train_inputs(21)
    path = stub.Save(critic_pb2.SaveRequest(tag="before-lengths-check"), timeout=120).path
    expected, stats, values = _local_value_loss(path, inputs, clip=0.2)
    reply = _train_with(stub, inputs)
    assert reply.loss == pytest.approx(expected, rel=1e-4)
    assert reply.metrics["vf_clipfrac"] == pytest.approx(stats["vf_clipfrac"], abs=1e-6)
    assert reply.metrics["values_mean"] == pytest.approx(float(masked_mean(values, inputs["mask"])), abs=1e-5)


def test_value_clip_and_loss_scale_are_set_per_request(stub):
    inputs = _train_inputs(22)
    path = stub.Save(critic_pb2.SaveRequest(tag="before-settings-check"), timeout=120).path
    configured, _, _ = _local_value_loss(path, inputs, clip=0.2, scale=1.0)
    unclipped, _, _ = _local_value_loss(path, inputs, clip=0.0, scale=1.0)
    assert abs(unclipped - configured) > 1e-3  # the batch is one where clipping matters
    reply = _train_with(stub, inputs, value_clip=0.0, loss_scale=2.0)
    assert reply.loss == pytest.approx(2 * unclipped, rel=1e-4)
    assert reply.metrics["vf_clipfrac"] == 0.0
    path = stub.Save(critic_pb2.SaveRequest(tag="before-clip-check"), timeout=120).path
    expected, stats, _ = _local_value_loss(path, inputs, clip=0.05, scale=1.0)
    reply = _train_with(stub, inputs, value_clip=0.05)
    assert reply.loss == pytest.approx(expected, rel=1e-4)
    assert reply.metrics["vf_clipfrac"] == pytest.approx(stats["vf_clipfrac"], abs=1e-6) and stats["vf_clipfrac"] > 0


def test_bad_lengths_mask_and_loss_settings_name_the_field_and_leave_the_weights_alone(stub):
    inputs = _train_inputs(23)
    lengths = inputs["lengths"]
    tokens, probe_lengths = batch(24)
    before, step = infer(stub, tokens, probe_lengths), stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step
    past_end = inputs["mask"].clone()
    row = int(torch.argmin(lengths))
    past_end[row, int(lengths[row]) - 1] = 1.0  # the action after the row's last token
    cases = [
        ({"lengths": lengths * 0}, {}, ["lengths", "[1, 10]"]),
        ({"lengths": lengths + 10}, {}, ["lengths", "[1, 10]"]),
        ({"lengths": lengths.float()}, {}, ["lengths", "integer"]),
        ({"lengths": lengths[:3]}, {}, ["lengths", "shape"]),
        ({"mask": past_end}, {}, ["mask", f"mask[{row}, {int(lengths[row]) - 1}]", "lengths"]),
        ({}, {"value_clip": -0.1}, ["value_clip", ">= 0"]),
        ({}, {"value_clip": float("nan")}, ["value_clip", "finite"]),
        ({}, {"value_clip": float("inf")}, ["value_clip", "finite"]),
        ({}, {"loss_scale": 0.0}, ["loss_scale", "> 0"]),
        ({}, {"loss_scale": -2.0}, ["loss_scale", "> 0"]),
        ({}, {"loss_scale": float("nan")}, ["loss_scale", "finite"]),
        ({}, {"loss_scale": float("-inf")}, ["loss_scale", "finite"]),
    ]
    for tensors, settings, words in cases:
        request = critic_pb2.TrainRequest(**{k: encode(v) for k, v in {**inputs, **tensors}.items()}, **settings)
        details = expect_invalid(stub.Train, request, *words)
        assert details.startswith(words[0]), details
    assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step == step
    torch.testing.assert_close(infer(stub, tokens, probe_lengths), before, atol=0, rtol=0)


# --- at-most-once Train, deadlines, restarts (docs/RELIABILITY.md) -----------------------------------------------

def _info(stub) -> critic_pb2.CriticInfo:
    return stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30)


def _with_id(request: critic_pb2.TrainRequest, request_id: str) -> critic_pb2.TrainRequest:
    request.request_id = request_id
    return request


def test_a_train_sent_twice_with_the_same_request_id_is_applied_once(critic, stub):
    tokens, lengths = batch(30)
    step0 = _info(stub).train_step
    duplicates = _metric(critic, "ppo_critic_duplicate_trains_total")
    request = _with_id(train_request(tokens, 4.0), "run-a/7/0")
    first = stub.Train(request, timeout=120)
    values = infer(stub, tokens, lengths)
    again = stub.Train(request, timeout=120)
    assert first.train_step == step0 + 1
    assert again.repeated and not first.repeated  # the stored reply, loss and metrics included, said to be one
    again.repeated = False
    assert again == first
    assert _info(stub).train_step == step0 + 1
    torch.testing.assert_close(infer(stub, tokens, lengths), values, atol=0, rtol=0)  # weights changed once
    assert _metric(critic, "ppo_critic_duplicate_trains_total") == duplicates + 1
    # the same id with another payload (another step's returns): refused, not answered with the first call's reply
    expect_invalid(stub.Train, _with_id(train_request(tokens, 5.0), "run-a/7/0"), "request_id: 'run-a/7/0' was "
                   "applied already to another Train request", "a new request needs a new id")
    assert _info(stub).train_step == step0 + 1
    torch.testing.assert_close(infer(stub, tokens, lengths), values, atol=0, rtol=0)
    # the same request encoded otherwise is the same request: the mask as bool, the ids as int32 and the returns
    # as float64, epochs 0 (unset and 0 are 1), the server's own value_clip set, an unknown field of a newer client
    # (each was refused as another request, naming differences that were not there)
    same = _with_id(train_request(tokens, 4.0), "run-a/7/0")
    same.mask.CopyFrom(encode(decode(same.mask, "mask").bool()))
    same.tokens.CopyFrom(encode(tokens.int()))
    same.returns.CopyFrom(encode(decode(same.returns, "returns").double()))
    same.epochs, same.value_clip = 0, 0.2  # the fixture's train.value_clip, the default
    reply = stub.Train(same, timeout=120)
    assert reply.repeated and reply.train_step == step0 + 1
    with channel(critic.address) as ch:
        raw = ch.unary_unary(SERVICE + "Train")
        reply = critic_pb2.TrainResponse.FromString(raw(same.SerializeToString() + b"\x98\x06\x01", timeout=120))
    assert reply.repeated and reply.train_step == step0 + 1  # field 99 = 1 (\x98\x06 is its tag), which it ignores
    assert _info(stub).train_step == step0 + 1


def test_concurrent_duplicates_are_applied_once(critic, stub):
    tokens, _ = batch(31)
    big, _ = batch(32, b=512, s=48)  # keeps the model busy while the duplicates queue up behind it
    step0 = _info(stub).train_step
    ahead = stub.Train.future(train_request(big, 1.0), timeout=120)
    request = _with_id(train_request(tokens, 4.0), "run-a/8/0")
    calls = [stub.Train.future(request, timeout=120) for _ in range(6)]
    replies = [c.result() for c in calls]
    big_steps = ahead.result().train_step - step0
    assert sorted(r.repeated for r in replies) == [False] + [True] * 5  # one applied, five answered with its reply
    for r in replies:
        r.repeated = False
    assert all(r == replies[0] for r in replies)
    assert _info(stub).train_step == step0 + big_steps + 1


def test_trains_without_a_request_id_are_each_applied(stub):
    tokens, _ = batch(33)
    step0 = _info(stub).train_step
    request = train_request(tokens, 4.0)
    assert [stub.Train(request, timeout=120).train_step for _ in range(2)] == [step0 + 1, step0 + 2]


@pytest.mark.parametrize("request_id", ["x" * 257, "run/ü/1", "run\n1"], ids=["257-chars", "non-ascii", "newline"])
def test_a_bad_request_id_is_refused_and_nothing_trains(stub, request_id):
    tokens, _ = batch(34)
    step0 = _info(stub).train_step
    expect_invalid(stub.Train, _with_id(train_request(tokens, 1.0), request_id), "request_id", "printable ASCII")
    assert _info(stub).train_step == step0


@pytest.mark.parametrize("leaves_by", ["deadline", "cancel"])
def test_a_train_whose_caller_leaves_while_it_is_queued_is_not_applied(critic, stub, leaves_by):
    """A Train queued behind a long one whose caller goes away (its deadline passes, or it cancels) before the
    model worker reaches it is never applied, is counted, and its id is not remembered."""
    tokens, lengths = batch(35)
    big, _ = batch(36, b=2048, s=48)  # about two seconds of training on a CPU
    request_id = f"run-a/{leaves_by}/0"
    step0 = _info(stub).train_step
    expired = _metric(critic, "ppo_critic_expired_trains_total")
    ahead = stub.Train.future(train_request(big, 1.0), timeout=120)
    time.sleep(0.2)  # let the big one reach the model worker first
    if leaves_by == "deadline":
        with pytest.raises(grpc.RpcError) as err:
            stub.Train(_with_id(train_request(tokens, 9.0), request_id), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:
        queued = stub.Train.future(_with_id(train_request(tokens, 9.0), request_id))
        time.sleep(0.3)
        assert queued.cancel() and not ahead.done()
    big_steps = ahead.result().train_step - step0
    values = infer(stub, tokens, lengths)
    time.sleep(0.5)  # anything still pending on the server would have run by now
    assert _info(stub).train_step == step0 + big_steps
    torch.testing.assert_close(infer(stub, tokens, lengths), values, atol=0, rtol=0)
    assert _metric(critic, "ppo_critic_expired_trains_total") == expired + 1
    # Not remembered as applied: the same id with time to spare trains.
    assert stub.Train(_with_id(train_request(tokens, 9.0), request_id), timeout=120).train_step == step0 + big_steps + 1


def test_a_critic_restarted_on_its_checkpoint_dir_resumes_and_remembers_request_ids(embedded_cache, log_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    tokens, lengths = batch(37)
    args = ("--checkpoint-dir", str(ckpt), "autosave_every=2")
    with ServiceProcess("critic", *args, log_dir=log_dir) as first:
        with channel(first.address) as ch:
            stub = critic_pb2_grpc.CriticServiceStub(ch)
            before = _info(stub)
            assert before.train_step == 0 and before.model == "embedded:reward" and len(before.instance_id) == 32
            replies = [stub.Train(_with_id(train_request(tokens, 3.0), f"run-b/{i}/0"), timeout=120) for i in range(3)]
            values = infer(stub, tokens, lengths)
        assert first.terminate(60) == 0
    assert [r.train_step for r in replies] == [1, 2, 3]
    assert sorted(p.name for p in ckpt.iterdir()) == ["autosave-2", "autosave-3"]  # every 2 steps, and on SIGTERM
    assert "saved" in first.log() and "on exit" in first.log()

    with ServiceProcess("critic", *args, log_dir=log_dir) as second, channel(second.address) as ch:
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        info = _info(stub)
        assert info.train_step == 3 and info.instance_id != before.instance_id
        assert info.model == str((ckpt / "autosave-3").resolve())
        torch.testing.assert_close(infer(stub, tokens, lengths), values, atol=1e-6, rtol=1e-6)
        again = stub.Train(_with_id(train_request(tokens, 3.0), "run-b/2/0"), timeout=120)
        assert again.instance_id == info.instance_id  # answered by this process, with the stored result
        assert again.repeated
        again.instance_id, again.repeated = replies[2].instance_id, False
        assert again == replies[2]
        assert _info(stub).train_step == 3
        assert stub.Train(_with_id(train_request(tokens, 3.0), "run-b/3/0"), timeout=120).train_step == 4
    assert "resume=latest: resumed from" in second.log() and "at train step 3" in second.log()

    # Damaged checkpoints (a save cut short, a bad copy): the newest that loads is resumed, each skipped one logged;
    # before, a damaged newest one failed every start (a crash loop) or was passed over silently. 64 bytes changed
    # in place load silently but for the CRC-32 the Save recorded.
    assert (ckpt / "autosave-4").is_dir()
    _overwrite_middle(ckpt / "autosave-4" / "model.safetensors")
    (ckpt / "autosave-3" / "critic_state.json").write_text("{not json")
    # leftovers of Saves killed mid-write: removed (or put back) at start once untouched for a minute
    for name in (".tmp-run-b-step_9", ".old-run-b-step_8", ".tmp-young"):
        (ckpt / name).mkdir()
        (ckpt / name / "model.safetensors").write_bytes(b"x")
        if name != ".tmp-young":
            for path in (ckpt / name / "model.safetensors", ckpt / name):
                os.utime(path, (time.time() - 120, time.time() - 120))
    with ServiceProcess("critic", *args, log_dir=log_dir) as third, channel(third.address) as ch:
        assert _info(critic_pb2_grpc.CriticServiceStub(ch)).train_step == 2
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith((".", "run-b"))) == [".tmp-young", "run-b-step_8"]
    assert (f"the checkpoint {ckpt / 'autosave-4'} cannot be loaded (FailedPrecondition: {ckpt / 'autosave-4'}: "
            f"model.safetensors is not the file the checkpoint wrote (it has CRC-32") in third.log()
    assert f"{ckpt / 'autosave-3'} holds a critic's optimizer.pt but no readable critic_state.json" in third.log()
    assert "1 newer checkpoint(s) could not be loaded, so the critic resumed from an older one" in third.log()
    # none loads: the server stops naming them, rather than start again from its model and lose the training
    (ckpt / "autosave-2" / "optimizer.pt").write_bytes(b"\x00" * 10)
    broken = subprocess.run(ServiceProcess("critic", *args, log_dir=log_dir).argv, cwd=ROOT, capture_output=True,
                            text=True, timeout=180, check=False)
    assert broken.returncode != 0 and "none of this critic's checkpoints in checkpoint_dir=" in broken.stderr, \
        broken.stderr[-3000:]
    assert str(ckpt / "autosave-2") in broken.stderr and "resume=never" in broken.stderr

    with ServiceProcess("critic", *args, "resume=never", log_dir=log_dir) as fresh, channel(fresh.address) as ch:
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        info = _info(stub)
        assert info.train_step == 0 and info.model == "embedded:reward"
        assert stub.Train(_with_id(train_request(tokens, 3.0), "run-b/2/0"), timeout=120).train_step == 1


def test_load_returns_to_a_checkpoint_weights_optimizer_step_and_request_ids(critic, stub):
    """What an actor resuming its run asks: the critic goes back to the checkpoint saved with the actor's."""
    tokens, lengths = batch(40)
    stub.Train(_with_id(train_request(tokens, 2.0), "run-l/1/0"), timeout=120)
    saved = stub.Save(critic_pb2.SaveRequest(tag="run-l-step_1"), timeout=120)
    values_then = infer(stub, tokens, lengths)
    second = stub.Train(_with_id(train_request(tokens, 5.0), "run-l/2/0"), timeout=120)
    assert second.train_step == saved.train_step + 1
    assert not torch.equal(infer(stub, tokens, lengths), values_then)  # packs step 2's weights (prepack_weights)
    loaded = stub.Load(critic_pb2.LoadRequest(tag="run-l-step_1"), timeout=120)
    assert (loaded.path, loaded.train_step) == (saved.path, saved.train_step)
    assert _info(stub).train_step == saved.train_step
    torch.testing.assert_close(infer(stub, tokens, lengths), values_then, atol=0, rtol=0)
    # the window is the checkpoint's: step 2's id is unknown again and trains, to the same result as before
    again = stub.Train(_with_id(train_request(tokens, 5.0), "run-l/2/0"), timeout=120)
    assert again.train_step == second.train_step and again.loss == pytest.approx(second.loss, rel=1e-6)
    for tag, code in (("no-such-checkpoint", grpc.StatusCode.NOT_FOUND), ("../x", grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as err:
            stub.Load(critic_pb2.LoadRequest(tag=tag), timeout=30)
        assert err.value.code() == code and "tag" in err.value.details()


def _as_written_before_sums(path: Path) -> None:
    """The checkpoint as a critic wrote it before Saves recorded their files' CRC-32: the checks behind the sums."""
    state = json.loads((path / "critic_state.json").read_text())
    del state["weights_crc32"]
    (path / "critic_state.json").write_text(json.dumps(state))


def _corrupt_optimizer(path: Path) -> str:
    _as_written_before_sums(path)
    (path / "optimizer.pt").write_bytes(b"not a torch file")
    return "optimizer.pt: cannot be read as an optimizer state"


def _misshapen_moments(path: Path) -> str:
    _as_written_before_sums(path)
    state = torch.load(path / "optimizer.pt", weights_only=True)
    first = next(iter(state["state"]))
    state["state"][first]["exp_avg"] = torch.zeros(3, 3)
    torch.save(state, path / "optimizer.pt")
    return "optimizer.pt: does not fit this critic's optimizer: exp_avg of parameter"


def _overwrite_middle(file: Path) -> None:  # 64 bytes changed in place: safetensors and torch.load both read it as it is
    with file.open("r+b") as f:
        f.seek(file.stat().st_size // 2)
        f.write(bytes(range(64)))


def _weights_overwritten(path: Path) -> str:
    _overwrite_middle(path / "model.safetensors")
    return "model.safetensors is not the file the checkpoint wrote (it has CRC-32"


def _optimizer_overwritten(path: Path) -> str:
    _overwrite_middle(path / "optimizer.pt")
    return "optimizer.pt is not the file the checkpoint wrote (it has CRC-32"


def _bad_state_json(path: Path) -> str:
    (path / "critic_state.json").write_text("{not json")
    return "critic_state.json: not a critic state"


def _another_model(path: Path) -> str:  # one more layer: transformers fills it in and warns, torch would copy the rest
    _as_written_before_sums(path)  # else the recorded CRC-32 of config.json refuses it first
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (path / "config.json").write_text(json.dumps(config))
    return "the weights do not fit this critic's model: unexpected"


@pytest.mark.parametrize("corrupt", [_corrupt_optimizer, _misshapen_moments, _bad_state_json, _another_model,
                                     _weights_overwritten, _optimizer_overwritten],
                         ids=["optimizer-unreadable", "optimizer-moments-misshapen", "state-not-json", "more-layers",
                              "weights-overwritten", "optimizer-overwritten"])
def test_a_load_that_cannot_apply_every_part_changes_nothing(critic, stub, corrupt):
    """A Load reads and checks the weights, the optimizer state and the critic state before it applies any: one
    that would apply only some (torch copies the matching weights before it raises for the rest) is
    FAILED_PRECONDITION naming the file, and the critic trains on from where it was."""
    tokens, lengths = batch(41)
    tag = f"to-break-{corrupt.__name__.strip('_')}"
    saved = stub.Save(critic_pb2.SaveRequest(tag=tag), timeout=120)
    stub.Train(train_request(tokens, 4.0), timeout=120)
    values, step = infer(stub, tokens, lengths), _info(stub).train_step
    words = corrupt(Path(saved.path))
    with pytest.raises(grpc.RpcError) as err:
        stub.Load(critic_pb2.LoadRequest(tag=tag), timeout=120)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and words in err.value.details(), err.value.details()
    assert _info(stub).train_step == step
    torch.testing.assert_close(infer(stub, tokens, lengths), values, atol=0, rtol=0)
    after = stub.Train(train_request(tokens, 4.0), timeout=120)  # the optimizer is whole: it steps
    assert after.train_step > step and math.isfinite(after.loss)


def test_epochs_train_that_many_passes_and_bad_counts_name_the_field(stub):
    inputs = _train_inputs(31, b=8)
    step = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step
    one = _train_with(stub, inputs)
    assert one.train_step == step + 1 and one.metrics["optimizer_steps"] == 1
    three = _train_with(stub, inputs, epochs=3)
    assert three.train_step == step + 4 and three.metrics["optimizer_steps"] == 3
    assert three.metrics["train_seconds"] > 0
    for bad in (65, 1000):
        with pytest.raises(grpc.RpcError) as err:
            _train_with(stub, inputs, epochs=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "epochs" in err.value.details()
    assert stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30).train_step == step + 4


def test_length_bucketed_training_equals_one_padded_pass(critic, stub, log_dir):
    """Micro-batches of 2 rows of similar length, each trimmed to its longest row, take the same optimizer step
    as one pass over the whole padded batch: same loss, same weights after (float32 rounding apart)."""
    inputs = _train_inputs(32, b=8, s=24)
    path = stub.Save(critic_pb2.SaveRequest(tag="before-bucket-check"), timeout=120).path
    probe, probe_lengths = batch(33)
    replies, after = [], []
    for micro in (8, 2):
        with ServiceProcess("critic", "--model", path, f"train.micro_batch_size={micro}", "--checkpoint-dir",
                            str(log_dir / f"ckpt-bucket-{micro}"), log_dir=log_dir) as server:
            ch = channel(server.address)
            other = critic_pb2_grpc.CriticServiceStub(ch)
            replies.append(_train_with(other, inputs))
            after.append(infer(other, probe, probe_lengths))
            ch.close()
    assert replies[1].loss == pytest.approx(replies[0].loss, rel=1e-5)
    assert replies[1].metrics["grad_norm"] == pytest.approx(replies[0].metrics["grad_norm"], rel=1e-4)
    torch.testing.assert_close(after[1], after[0], atol=1e-5, rtol=1e-4)


def test_a_critic_starts_from_a_policy_whose_type_has_no_sequence_classification_class(embedded_assets, log_dir,
                                                                                      tmp_path):
    """transformers has GraniteForCausalLM but no GraniteForSequenceClassification: the critic builds the head over
    the checkpoint's own body (not a random one), serves and trains it, and its checkpoint loads back the same."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    tokenizer = load_tokenizer(str(embedded_assets.policy))
    config = GraniteConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    policy.save_pretrained(tmp_path / "granite")
    tokenizer.save_pretrained(tmp_path / "granite")
    tokens, lengths = batch(51)
    with ServiceProcess("critic", "--model", str(tmp_path / "granite"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                        log_dir=log_dir) as server:
        ch = channel(server.address)
        granite = critic_pb2_grpc.CriticServiceStub(ch)
        before = infer(granite, tokens, lengths)
        saved = granite.Save(critic_pb2.SaveRequest(tag="untrained"), timeout=120).path
        reply = _train_with(granite, _train_inputs(52))
        after = infer(granite, tokens, lengths)
        ch.close()
    assert reply.train_step == 1 and reply.loss > 0
    assert not torch.allclose(after, before)
    model = load_scalar_head_model(saved).eval()
    assert type(model).__name__ == "GraniteForSequenceClassification" and model.score.out_features == 1
    for (name, trained), (_, source) in zip(model.model.state_dict().items(), policy.model.state_dict().items(),
                                            strict=True):
        torch.testing.assert_close(trained, source, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(per_token_scores(model, tokens, lengths), before, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_token_classification_checkpoint_is_served_with_its_head_bias(family, embedded_assets, log_dir, tmp_path):
    """verl saves its critics and reward models as `*ForTokenClassification`, whose head has a bias (the
    sequence-classification head has none, and loading it so dropped the bias), named `score` (Llama's family) or
    `classifier` (GPT-2's, GPT-NeoX's, BLOOM's, whose head was not read at all): as the critic's start and as its
    combined reward model, values and rewards are what that model computes, bias included, and the critic's
    checkpoint is the same class with the head under its own name."""
    from transformers import AutoModelForTokenClassification, GPT2Config, LlamaConfig

    tokenizer = load_tokenizer(str(embedded_assets.policy))
    ids = {"vocab_size": len(tokenizer), "num_labels": 1, "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    config = (LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=64, max_position_embeddings=64, **ids) if family == "llama" else
              GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **ids))
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(config).eval()
    head = "score" if family == "llama" else "classifier"
    with torch.no_grad():
        getattr(model, head).bias.fill_(0.75)
    model.save_pretrained(tmp_path / "verl")
    tokenizer.save_pretrained(tmp_path / "verl")
    tokens, lengths = batch(61)
    with ServiceProcess("critic", "--model", str(tmp_path / "verl"), "--reward-model", str(tmp_path / "verl"),
                        "--checkpoint-dir", str(tmp_path / "ckpt"), log_dir=log_dir) as server:
        ch = channel(server.address)
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        reply = stub.Infer(critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(lengths)), timeout=60)
        saved = stub.Save(critic_pb2.SaveRequest(tag="verl"), timeout=120).path
        ch.close()
    valid = attention_mask_from_lengths(lengths, tokens.shape[1])
    with torch.no_grad():
        logits = model(input_ids=tokens, attention_mask=valid).logits.squeeze(-1)
    torch.testing.assert_close(decode(reply.values, "values"), logits * valid, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode(reply.rewards, "rewards"), logits.gather(1, (lengths - 1)[:, None]).squeeze(1),
                               atol=1e-5, rtol=1e-5)
    reloaded = AutoModelForTokenClassification.from_pretrained(saved)
    assert type(reloaded) is type(model) and float(getattr(reloaded, head).bias.detach()) == 0.75


def test_an_encoders_token_classifier_is_refused_as_a_critic(tmp_path):
    """An encoder's token classifier (BERT's `classifier` at every position) sees the tokens after each position, so
    it cannot value a prefix: unlike a decoder's, its head is not read as a critic's."""
    from transformers import BertConfig, BertForTokenClassification, GPT2Config, GPT2ForTokenClassification

    for model, refused in ((BertForTokenClassification(BertConfig(
            vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            num_labels=1)), True), (GPT2ForTokenClassification(GPT2Config(
                vocab_size=20, n_embd=16, n_layer=1, n_head=2, n_positions=32, num_labels=1)), False)):
        model.save_pretrained(tmp_path / type(model).__name__)
        if refused:
            with pytest.raises(NoScoreHead):
                load_scalar_head_model(str(tmp_path / type(model).__name__))
        else:
            assert type(load_scalar_head_model(str(tmp_path / type(model).__name__))) is type(model)


def test_a_checkpoint_whose_body_matches_nothing_is_refused_at_start(embedded_assets, log_dir, tmp_path):
    """Weights under other names than the model type's would leave a random body behind transformers' load warning;
    the server stops instead, naming the checkpoint."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(embedded_assets.policy, tmp_path / "renamed")
    weights = load_file(tmp_path / "renamed" / "model.safetensors")
    save_file({k.replace("model.", "body.", 1): v for k, v in weights.items()},
              tmp_path / "renamed" / "model.safetensors", metadata={"format": "pt"})
    done = subprocess.run([sys.executable, "-m", "critic_server", "--port", "0", "--http-port", "0",
                           "--model", str(tmp_path / "renamed"), "--checkpoint-dir", str(tmp_path / "ckpt")],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "has no weights for the body of LlamaForSequenceClassification" in done.stderr
    assert str(tmp_path / "renamed") in done.stderr


def test_a_bf16_critic_trains_float32_weights_under_autocast(embedded_assets, log_dir, tmp_path):
    """dtype=bfloat16 is mixed precision: Infer and Train compute in bf16 while the optimizer updates float32
    weights, so one Train at a small learning rate moves nearly every weight, and its checkpoint is float32."""
    from safetensors.torch import load_file

    with ServiceProcess("critic", "dtype=bfloat16", "train.lr=1e-6", "--checkpoint-dir", str(tmp_path / "ckpt"),
                        log_dir=log_dir) as server:
        ch = channel(server.address)
        bf16 = critic_pb2_grpc.CriticServiceStub(ch)
        values = infer(bf16, *batch(61))
        reply = _train_with(bf16, _train_inputs(62))
        saved = bf16.Save(critic_pb2.SaveRequest(tag="bf16"), timeout=120).path
        ch.close()
    assert values.dtype == torch.float32 and torch.isfinite(values).all() and reply.loss > 0
    before = load_file(embedded_assets.reward_model / "model.safetensors")
    after = load_file(Path(saved) / "model.safetensors")
    assert {t.dtype for t in after.values()} == {torch.float32}
    moved = sum(int((after[k] != before[k]).sum()) for k in before) / sum(t.numel() for t in before.values())
    assert moved > 0.9, moved


def test_a_critic_serves_openrlhf_checkpoints_and_saves_them_in_transformers_layout(openrlhf_reward_model,
                                                                                   embedded_assets, log_dir, tmp_path):
    """An OpenRLHF reward model (head under `value_head`, normalize_reward with mean and std in config.json) as the
    critic's start and as its combined reward model: values and rewards are that head's (score - mean) / std, as
    OpenRLHF's critic and reward model report them (values 0 past each row's end), and the critic's checkpoints store
    the head as `score`, which transformers loads alone, with the statistics in config.json. normalize_values=false
    reads the head as it is."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from tests.conftest import OPENRLHF_MEAN, OPENRLHF_STD

    tokens, lengths = batch(91)
    with ServiceProcess("critic", "--model", str(openrlhf_reward_model), "--reward-model", str(openrlhf_reward_model),
                        "--checkpoint-dir", str(tmp_path / "ckpt"), log_dir=log_dir) as server:
        ch = channel(server.address)
        reply = critic_pb2_grpc.CriticServiceStub(ch).Infer(
            critic_pb2.InferRequest(tokens=encode(tokens), lengths=encode(lengths)), timeout=60)
        saved = critic_pb2_grpc.CriticServiceStub(ch).Save(critic_pb2.SaveRequest(tag="orl"), timeout=120).path
        ch.close()
        # the batch fits one pass, run by each model: the critic's for values, the reward model's for rewards
        assert histogram_stats(server, "ppo_critic_pass_tokens", "Infer") == (2, 2 * tokens.numel())
    model = load_scalar_head_model(str(embedded_assets.reward_model)).eval()
    with torch.no_grad():
        scores = per_token_scores(model, tokens, lengths)
    valid = attention_mask_from_lengths(lengths, tokens.shape[1])
    torch.testing.assert_close(decode(reply.values, "values"), (scores - OPENRLHF_MEAN) / OPENRLHF_STD * valid,
                               atol=1e-5, rtol=1e-5)
    last = scores.gather(1, (lengths - 1)[:, None]).squeeze(1)
    torch.testing.assert_close(decode(reply.rewards, "rewards"), (last - OPENRLHF_MEAN) / OPENRLHF_STD,
                               atol=1e-5, rtol=1e-5)
    assert "score.weight" in load_file(Path(saved) / "model.safetensors")
    assert "value_head.weight" not in load_file(Path(saved) / "model.safetensors")
    plain = AutoModelForSequenceClassification.from_pretrained(saved).eval()
    torch.testing.assert_close(plain.score.weight, model.score.weight, rtol=0, atol=0)
    config = json.loads((Path(saved) / "config.json").read_text())
    assert (config["normalize_reward"], config["mean"], config["std"]) == (True, OPENRLHF_MEAN, OPENRLHF_STD)
    with ServiceProcess("critic", "--model", saved, "normalize_values=false", "--checkpoint-dir",
                        str(tmp_path / "ckpt-raw"), log_dir=log_dir) as server:
        ch = channel(server.address)
        raw = infer(critic_pb2_grpc.CriticServiceStub(ch), tokens, lengths)
        ch.close()
    torch.testing.assert_close(raw, scores, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_directory_the_critic_may_not_read_is_passed_over(stub, log_dir, tmp_path):
    """A directory of checkpoint_dir the process may not read (mode 000; as root, under setpriv without the
    capabilities that override file modes) crash-looped the critic with a PermissionError traceback at every
    start; now it is named, passed over, and the newest readable checkpoint resumed."""
    ckpt = tmp_path / "ckpt"
    saved = Path(stub.Save(critic_pb2.SaveRequest(tag="readable"), timeout=120).path)
    shutil.copytree(saved, ckpt / "readable")
    locked = ckpt / "zz-locked"
    locked.mkdir()
    locked.chmod(0)
    server = ServiceProcess("critic", "--checkpoint-dir", str(ckpt), log_dir=log_dir)
    if os.geteuid() == 0:
        server.argv = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                       "--bounding-set=-dac_override,-dac_read_search", *server.argv]
    try:
        with server, channel(server.address) as ch:
            info = _info(critic_pb2_grpc.CriticServiceStub(ch))
            assert info.model == str((ckpt / "readable").resolve())
        assert f"{locked} cannot be read (Permission denied): passed over as a checkpoint" in server.log()
    finally:
        locked.chmod(0o755)


def test_a_critic_restarted_after_a_load_resumes_the_checkpoint_it_returned_to(embedded_cache, log_dir, tmp_path):
    """An actor's resume Loads the critic back to step 1; the critic then restarts before it trains again. It came
    back on the newest checkpoint by write time (step 2 of the attempt the resume abandoned), so the run found a
    critic one step ahead, stopped as if another client had trained it, and failed every restart after. Step 2's
    checkpoint is stamped a day ahead here, as a host whose clock runs ahead would on a shared volume: the order is
    the sequence each checkpoint records, not the clocks."""
    ckpt, (tokens, lengths) = tmp_path / "ckpt", batch(44)
    args = ("--checkpoint-dir", str(ckpt))
    with ServiceProcess("critic", *args, log_dir=log_dir) as first, channel(first.address) as ch:
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        stub.Train(_with_id(train_request(tokens, 2.0), "run-x/1/0"), timeout=120)
        one = stub.Save(critic_pb2.SaveRequest(tag="run-x-step_1"), timeout=120)
        stub.Train(_with_id(train_request(tokens, 5.0), "run-x/2/0"), timeout=120)
        stub.Save(critic_pb2.SaveRequest(tag="run-x-step_2"), timeout=120)
        state_file = ckpt / "run-x-step_2" / "critic_state.json"
        state = json.loads(state_file.read_text())
        state_file.write_text(json.dumps({**state, "saved_at": state["saved_at"] + 86400}))
        stub.Load(critic_pb2.LoadRequest(tag="run-x-step_1"), timeout=120)
        values = infer(stub, tokens, lengths)
    with ServiceProcess("critic", *args, log_dir=log_dir) as second, channel(second.address) as ch:
        stub = critic_pb2_grpc.CriticServiceStub(ch)
        info = _info(stub)
        assert info.train_step == one.train_step and info.model == str((ckpt / "run-x-step_1").resolve())
        torch.testing.assert_close(infer(stub, tokens, lengths), values, atol=1e-6, rtol=1e-6)
        # the Load's window came back too: step 2's id is unknown again, and trains
        assert stub.Train(_with_id(train_request(tokens, 5.0), "run-x/2/0"), timeout=120).train_step == \
            one.train_step + 1


def test_a_checkpoint_being_pruned_leaves_no_half_checkpoint_behind(tmp_path, monkeypatch):
    """A process killed while it deleted an old checkpoint (keep_last, autosave_keep) left a directory with its
    critic_state.json and half its files, passed over with an error at every start after. Pruning now moves it out of
    the checkpoints' names first, so what a kill leaves is a temp directory the next start removes."""
    from critic_server import core

    root = tmp_path / "ckpt"
    for i, name in enumerate(("autosave-1", "autosave-2", "autosave-3")):
        (root / name).mkdir(parents=True)
        (root / name / "critic_state.json").write_text(json.dumps({"train_step": i, "saved_at": 1000.0 + i}))
        (root / name / "model.safetensors").write_bytes(b"x")

    def killed_midway(path, *args, **kwargs):
        (Path(path) / "model.safetensors").unlink()
        raise OSError("killed")  # the process would be gone here; what it leaves on disk is what counts

    monkeypatch.setattr(core.shutil, "rmtree", killed_midway)
    core.prune_checkpoints(root, 2, root / "autosave-3", started=0.0, prefix="autosave-")
    assert sorted(p.name for p in root.iterdir()) == [".tmp-pruned-autosave-1", "autosave-2", "autosave-3"]
    found, unplaced = core.checkpoints_newest_first(root)
    assert [p.name for p in found] == ["autosave-3", "autosave-2"] and unplaced == []
