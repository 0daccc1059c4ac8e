"""Who may talk to the servers: the bearer token on every route, TLS and mutual TLS (certificates made here with
openssl), and the refusal to listen beyond loopback unprotected. Real servers, real gRPC and HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import shutil
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from actor.clients import OpenRLHFRewardClient, RemoteError
from ppo_services.v1 import common_pb2, critic_pb2, reward_pb2, reward_pb2_grpc
from serving.rest import ClientNoiseFilter
from serving.security import TOKEN_ENV, SecurityError, check_certificate
from tests.service_procs import ROOT, ServiceProcess, actor_command, free_port

TOKEN = "s3cret-token-for-tests"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates")


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], check=True, cwd=cwd, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1/localhost (and an expired one) and a client certificate, all signed
    by the CA."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=test-ca", cwd=d)
    for name, san in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", None)):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)
        extra = []
        if san:
            (d / "san.ext").write_text(san + "\n")
            extra = ["-extfile", "san.ext"]
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *extra, cwd=d)
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "expired.pem", "-days", "-1", cwd=d)  # ended a day before it began
    (d / "token").write_text(TOKEN + "\n")
    return d


@pytest.fixture(scope="module")
def critic(embedded_cache, log_dir, pki, tmp_path_factory):
    with ServiceProcess("critic", "--auth-token-file", str(pki / "token"), "--checkpoint-dir",
                        str(tmp_path_factory.mktemp("ckpt")), log_dir=log_dir) as server:
        yield server


@pytest.fixture(scope="module")
def reward_tls(embedded_cache, log_dir, pki):
    """Token from the environment, TLS on both ports."""
    with ServiceProcess("reward", "--tls-cert-file", str(pki / "server.pem"), "--tls-key-file", str(pki / "server.key"),
                        log_dir=log_dir, env={TOKEN_ENV: TOKEN}, ready_scheme="https", ready_verify=str(pki / "ca.pem")) as s:
        yield s


ROUTES = {
    "critic": ("CriticService", [("Infer", critic_pb2.InferRequest()), ("Train", critic_pb2.TrainRequest()),
                                 ("Save", critic_pb2.SaveRequest(tag="x")), ("Load", critic_pb2.LoadRequest(tag="x")),
                                 ("GetInfo", common_pb2.GetInfoRequest())]),
    "reward": ("RewardService", [("Score", reward_pb2.ScoreRequest()), ("GetInfo", common_pb2.GetInfoRequest())]),
}


def call(channel: grpc.Channel, service: str, method: str, request, metadata=()) -> grpc.StatusCode:
    rpc = channel.unary_unary(f"/ppo_services.v1.{service}/{method}", request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=lambda b: b)
    try:
        rpc(request, timeout=30, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


@pytest.fixture(scope="module", params=[("critic", "plaintext"), ("critic", "tls"), ("reward", "plaintext"),
                                        ("reward", "tls")], ids=lambda p: "-".join(p))
def protected(request, embedded_cache, log_dir, pki, tmp_path_factory):
    """Each server with the token, over plaintext and over TLS (and 2 s to send a whole REST request)."""
    kind, transport = request.param
    args = ["--auth-token-file", str(pki / "token"), "http_read_timeout_s=2"]
    if kind == "critic":
        args += ["--checkpoint-dir", str(tmp_path_factory.mktemp("ckpt"))]
    tls = {}
    if transport == "tls":
        args += ["--tls-cert-file", str(pki / "server.pem"), "--tls-key-file", str(pki / "server.key")]
        tls = {"ready_scheme": "https", "ready_verify": str(pki / "ca.pem")}
    with ServiceProcess(kind, *args, log_dir=log_dir, **tls) as server:
        yield server, kind, transport


def open_channel(server: ServiceProcess, transport: str, pki) -> grpc.Channel:
    if transport == "tls":
        creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
        return grpc.secure_channel(server.address, creds)
    return grpc.insecure_channel(server.address)


def test_every_rpc_needs_the_token(protected, pki):
    server, kind, transport = protected
    service, methods = ROUTES[kind]
    with open_channel(server, transport, pki) as ch:
        for method, request in methods:
            assert call(ch, service, method, request) == grpc.StatusCode.UNAUTHENTICATED, method
            wrong = [("authorization", "Bearer not-the-token")]
            assert call(ch, service, method, request, wrong) == grpc.StatusCode.UNAUTHENTICATED, method
            right = [("authorization", f"Bearer {TOKEN}")]
            assert call(ch, service, method, request, right) != grpc.StatusCode.UNAUTHENTICATED, method
            # two headers are refused whichever comes last: a proxy and the caller may each have added one
            assert call(ch, service, method, request, [*wrong, *right]) == grpc.StatusCode.UNAUTHENTICATED, method
        # a method no service has is UNIMPLEMENTED, token or not, and adds no series to /metrics
        for n in range(20):
            assert call(ch, service, f"NoSuchMethod{n}", common_pb2.GetInfoRequest()) == grpc.StatusCode.UNIMPLEMENTED
        # probes stay open: health and reflection need no token
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_every_rest_route_but_the_probes_needs_the_token(protected, pki):
    server, kind, _ = protected
    verify = server.tls_context()
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{server.http}{path}", verify=verify, timeout=10).status_code == 200, path
    wrong_then_right = [("Authorization", "Bearer nope"), ("Authorization", f"Bearer {TOKEN}")]
    if kind == "reward":
        url, body = f"{server.http}/get_reward", {"query": ["river => good"]}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}, wrong_then_right):
            reply = httpx.post(url, json=body, headers=headers, verify=verify, timeout=30)
            assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer", headers
        assert httpx.post(url, json=body, verify=verify, timeout=30,
                          headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    # a path no route has is 404, token or not, and is not counted: callers without the token cannot grow /metrics;
    # nor with a body past the receive limit, which was 413 and counted under the caller's path, one series a path
    for n in range(20):
        for headers in ({}, {"Authorization": f"Bearer {TOKEN}"}):
            assert httpx.get(f"{server.http}/scan-{n}", headers=headers, verify=verify, timeout=10).status_code == 404
        assert raw_status(server, f"POST /huge-{n} HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n") == 404
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/openapi.json", "/docs", "/redoc"):  # no schema of the service for anyone
        assert httpx.get(f"{server.http}{path}", headers=auth, verify=verify, timeout=10).status_code == 404, path
    if kind == "reward":  # past the limit on a route of its own: 413, counted under that route
        assert raw_status(server, f"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n"
                                  f"Authorization: Bearer {TOKEN}\r\n\r\n") == 413
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{server.http}/metrics", verify=verify, timeout=10).text)}
    counted = {(s.labels["method"], s.labels["code"]) for s in families[f"ppo_{kind}_requests"].samples
               if s.name.endswith("_total")}
    methods = {m for m, _ in ROUTES[kind][1]} | ({"get_reward"} if kind == "reward" else set())
    assert {m for m, code in counted if code == "UNAUTHENTICATED"} <= methods, counted
    assert {m for m, _ in counted} <= methods | {"health", "ready", "metrics"}, counted
    if kind == "reward":
        assert ("get_reward", "RESOURCE_EXHAUSTED") in counted


def raw_status(server: ServiceProcess, head: str) -> int:
    """The status a server's REST port answers to a request head sent as is (over TLS when it serves TLS)."""
    context = server.tls_context() or None
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as plain:
        sock = context.wrap_socket(plain, server_hostname="127.0.0.1") if context else plain
        sock.sendall(head.encode())
        return int(sock.recv(4096).split(b" ", 2)[1])


def test_a_rest_client_that_does_not_finish_its_request_is_cut_off(protected):
    """Connections that send nothing, half a head, or half a body are closed once http_read_timeout_s (2 s here)
    has passed since the server began waiting for their request, however they trickle; one that finishes each request
    in time keeps its connection across requests, and a large body that keeps up READ_MIN_RATE arrives whole."""
    server, kind, _ = protected
    context = server.tls_context() or None  # the CA that signed the server's certificate, over TLS
    started = time.monotonic()

    def connect(handshake: bool = True) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
        return context.wrap_socket(sock, server_hostname="127.0.0.1") if context and handshake else sock

    def held_for(sending: bytes, trickle: bool = False, handshake: bool = True, grpc_port: bool = False) -> float:
        """Seconds until the server closes a connection that sends `sending` (a byte every 0.3 s with trickle);
        over TLS, without `handshake`, one that never begins the TLS handshake (asyncio gave it 60 s); on the gRPC
        port, one that never begins gRPC's (TLS or HTTP/2) handshake (gRPC gave it 60 s)."""
        with (socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10) if grpc_port else
              connect(handshake)) as sock:
            opened = time.monotonic()
            try:
                for piece in ([bytes([b]) for b in sending] if trickle else [sending]):
                    sock.sendall(piece)
                    if trickle:
                        time.sleep(0.3)
                while sock.recv(1024):
                    pass
            except OSError:  # the close met a send: a reset, or an EOF the TLS layer reports as an error
                pass
            return time.monotonic() - opened

    slow = {
        "silent": (b"", False),
        "half a head": (b"GET /health HTTP/1.1\r\nHost: x\r\n", False),
        "half a body": (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{", False),
        "a trickled head": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 40, True),
        # 512 KiB at once earns 8 s more at 64 KiB/s, but not a pause longer than the deadline
        "a burst, then silence": (b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\n"
                                  + b" " * 512 * 1024, False),
    }
    if context:
        slow["no TLS handshake"] = (b"", False, False)
    slow["silent on the gRPC port"] = (b"", False, True, True)

    def replies_read_after_a_pause(requests: int) -> int:
        """Pipelines `requests` GET /metrics (1.4 KB and more each: more than the kernel buffers between the two
        hold) on a small receive buffer, reads nothing for twice the deadline, then reads what it can: all of the
        replies, unless the server dropped the connection for leaving its writes blocked."""
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.connect(("127.0.0.1", server.http_port))
        with (context.wrap_socket(raw, server_hostname="127.0.0.1") if context else raw) as sock:
            received = b""
            try:
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * requests)
                time.sleep(5)
                sock.settimeout(10)
                while chunk := sock.recv(1 << 20):
                    received += chunk
                    if received.count(b"HTTP/1.1 200") >= requests and received.endswith(b"\n"):
                        break
            except OSError:
                pass
            return received.count(b"HTTP/1.1 200")
    with concurrent.futures.ThreadPoolExecutor(len(slow) + 2) as pool:
        held = {name: pool.submit(held_for, *how) for name, how in slow.items()}
        unread = pool.submit(replies_read_after_a_pause, 6000)
        # meanwhile one client sends a request every 0.9 s on one connection, for longer than the deadline
        with httpx.Client(verify=server.tls_context(), timeout=10) as client:
            for _ in range(4):
                assert client.get(f"{server.http}/health").status_code == 200
                time.sleep(0.9)
        for name, future in held.items():
            assert 1.5 < future.result() < 6, (name, future.result())
        assert unread.result() < 6000, "a client that left its replies unread kept its connection"
    if kind == "reward":  # 256 KiB in 3.2 s: past the 2 s, at 80 KiB/s, above the 64 KiB/s that moves the deadline on
        body = json.dumps({"query": ["river => good"]}).encode()
        body += b" " * (256 * 1024 - len(body))
        with connect() as sock:
            sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Authorization: Bearer " + TOKEN.encode() + b"\r\nConnection: close\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            for i in range(0, len(body), 16 * 1024):
                sock.sendall(body[i:i + 16 * 1024])
                time.sleep(0.2)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert time.monotonic() - started < 16


def test_malformed_requests_and_websocket_upgrades_reach_the_log_once_a_minute(protected):
    """uvicorn logs a warning for each malformed request and WebSocket upgrade: any client could fill the log at its
    request rate. Each kind reaches the log at most once a minute (the next line counts those held back), and its
    advice to install a WebSocket library, for servers that serve none, not at all."""
    server, _, _ = protected
    context = server.tls_context() or None
    before = server.log().count("\n")
    for request in (b"NOT HTTP AT ALL\r\n\r\n",
                    b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n") * 15:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as raw, \
                (context.wrap_socket(raw, server_hostname="127.0.0.1") if context else raw) as sock:
            sock.sendall(request)
            assert sock.recv(1024).split(b" ")[1] in (b"200", b"400")
    assert httpx.get(f"{server.http}/health", verify=server.tls_context(), timeout=10).status_code == 200
    logged = "\n".join(server.log().splitlines()[before:])
    assert logged.count("Invalid HTTP request received.") <= 1, logged
    assert logged.count("Unsupported upgrade request.") <= 1, logged
    assert "WebSocket library" not in logged, logged


def test_the_noise_filter_says_how_many_lines_it_held_back(caplog):
    noise = ClientNoiseFilter(every_s=0.3)

    def passes(message: str) -> logging.LogRecord | None:
        record = logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, message, (), None)
        return record if noise.filter(record) else None

    assert passes("Invalid HTTP request received.")
    assert not any(passes("Invalid HTTP request received.") for _ in range(3))
    assert passes("Unsupported upgrade request.") and passes("Exceeded concurrency limit.")  # each kind on its own
    time.sleep(0.35)
    assert passes("Invalid HTTP request received.").getMessage() == (
        "Invalid HTTP request received. (3 more since the last such line, not logged)")
    assert not passes("Invalid HTTP request received.")
    with caplog.at_level(logging.WARNING, logger="tests.noise"):  # at shutdown, what is still held back
        noise.flush(logging.getLogger("tests.noise"))
    assert caplog.messages == ["Invalid HTTP request received. (1 more since the last such line, not logged)"]


def test_probes_stay_open_and_refusals_are_counted(critic):
    with grpc.insecure_channel(critic.address) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        answers = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for a in answers for s in a.list_services_response.service}
        assert "ppo_services.v1.CriticService" in names
        call(ch, "CriticService", "GetInfo", common_pb2.GetInfoRequest())
        # odd spellings of a known method are no method: UNIMPLEMENTED, and no series of their own
        for path in ("/ppo_services.v1.CriticService.Infer", "/ppo_services.v1.CriticService/Infer/",
                     "/grpc.health.v1.Health.Check"):
            odd = ch.unary_unary(path, request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as err:
                odd(common_pb2.GetInfoRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, path
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{critic.http}{path}", timeout=10).status_code == 200, path
    text = httpx.get(f"{critic.http}/metrics", timeout=10).text
    assert 'ppo_critic_requests_total{code="UNAUTHENTICATED",method="GetInfo"}' in text
    assert "ppo_services.v1" not in text and 'method=""' not in text and "Health.Check" not in text
    assert "tls_certificate_expiry" not in text  # no TLS, no expiry: an alert on it never fires here


def test_the_actor_sends_the_token(critic, pki):
    from actor.clients import CriticClient
    from actor.config import CriticConfig

    client = CriticClient(CriticConfig(address=critic.address, connect_timeout_s=30), token=TOKEN)
    assert client.info().vocab_size > 0
    client.close()


def test_tls_with_the_token_from_the_environment(reward_tls, pki):
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    with grpc.secure_channel(reward_tls.address, creds) as ch:
        stub = reward_pb2_grpc.RewardServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")])
        assert info.model == "embedded:reward"
    with grpc.insecure_channel(reward_tls.address) as ch:  # plaintext to a TLS port gets nowhere
        assert call(ch, "RewardService", "GetInfo", common_pb2.GetInfoRequest(),
                    [("authorization", f"Bearer {TOKEN}")]) == grpc.StatusCode.UNAVAILABLE
    url = f"https://127.0.0.1:{reward_tls.http_port}"
    body = {"query": ["river => good"], "prompts": ["river =>"]}
    ca = reward_tls.tls_context()
    assert httpx.post(f"{url}/get_reward", json=body, verify=ca, timeout=30).status_code == 401
    assert httpx.post(f"{url}/get_reward", json=body, verify=ca, timeout=30,
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = httpx.post(f"{url}/get_reward", json=body, verify=ca, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and len(ok.json()["rewards"]) == 1
    assert httpx.get(f"{url}/ready", verify=ca, timeout=10).status_code == 200
    # the certificate's end, for alerts, and a warning at start since it is near (the test's lasts 2 days)
    expiry = [s.value for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", verify=ca, timeout=10).text)
              for s in f.samples if s.name == "ppo_reward_tls_certificate_expiry_timestamp_seconds"]
    assert len(expiry) == 1 and 86400 < expiry[0] - time.time() < 2 * 86400 + 60, expiry
    assert re.search(r"WARNING .*chain in tls_cert_file \S+server.pem expires in [12]\.\d days", reward_tls.log())
    # the actor's OpenRLHF-protocol client: TLS verified with the CA, the token in its header
    from actor.clients import OpenRLHFRewardClient
    from actor.config import RewardConfig

    cfg = RewardConfig(source="openrlhf", url=f"{url}/get_reward", tls_ca_file=str(pki / "ca.pem"))
    client = OpenRLHFRewardClient(cfg, token=TOKEN)
    rewards, _ = client.score_texts(["river => good"], ["river =>"]).result()
    assert rewards.shape == (1,)
    client.close()
    # a certificate its CA did not sign stops it at once, as on gRPC: waiting cannot mend it (it retried with backoff)
    stranger = OpenRLHFRewardClient(RewardConfig(source="openrlhf", url=f"{url}/get_reward", retries=3,
                                                 tls_ca_file=str(pki / "client.pem")), token=TOKEN)
    started = time.monotonic()
    with pytest.raises(RemoteError, match="the TLS handshake failed: the server's certificate is not signed by the CA"):
        stranger.score_texts(["river => good"], ["river =>"]).result()
    assert time.monotonic() - started < 0.5
    stranger.close()


def test_mutual_tls_needs_a_client_certificate(embedded_cache, log_dir, pki):
    with ServiceProcess("reward", "--scorer", "positive_fraction", "--tls-cert-file", str(pki / "server.pem"),
                        "--tls-key-file", str(pki / "server.key"), "--tls-client-ca-file", str(pki / "ca.pem"),
                        log_dir=log_dir, ready_scheme="https", ready_verify=str(pki / "ca.pem")) as server:
        ca = (pki / "ca.pem").read_bytes()
        without = grpc.ssl_channel_credentials(root_certificates=ca)
        with grpc.secure_channel(server.address, without) as ch:
            assert call(ch, "RewardService", "GetInfo", common_pb2.GetInfoRequest()) == grpc.StatusCode.UNAVAILABLE
        from actor.clients import RewardClient
        from actor.config import RewardConfig

        client = RewardClient(RewardConfig(address=server.address, tls_ca_file=str(pki / "ca.pem"),
                                           tls_cert_file=str(pki / "client.pem"), tls_key_file=str(pki / "client.key"),
                                           connect_timeout_s=30))
        assert client.info().model == "rule:positive_fraction"
        client.close()
        # a certificate that does not fit is named at once, not waited on for connect_timeout_s as an outage
        started = time.monotonic()
        wrong_ca = RewardClient(RewardConfig(address=server.address, tls_ca_file=str(pki / "client.pem"),
                                             tls_cert_file=str(pki / "client.pem"),
                                             tls_key_file=str(pki / "client.key"), connect_timeout_s=60))
        with pytest.raises(RemoteError, match="the TLS handshake failed: the server's certificate is not signed by "
                                              "the CA this client trusts"):
            wrong_ca.info()
        assert time.monotonic() - started < 30
        wrong_ca.close()
        # REST: the probes need no certificate; /get_reward needs one the client CA signed, as gRPC does
        ca_only = server.tls_context()
        with_cert = server.tls_context()
        with_cert.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        query = {"query": ["river => good"]}
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(f"{server.http}{path}", verify=ca_only, timeout=10).status_code == 200, path
        refused = httpx.post(f"{server.http}/get_reward", json=query, verify=ca_only, timeout=30)
        assert refused.status_code == 401 and "tls_client_ca_file (mutual TLS)" in refused.json()["detail"]
        answered = httpx.post(f"{server.http}/get_reward", json=query, verify=with_cert, timeout=30)
        assert answered.status_code == 200 and len(answered.json()["rewards"]) == 1
        metrics = httpx.get(f"{server.http}/metrics", verify=ca_only, timeout=10).text
        assert 'ppo_reward_requests_total{code="UNAUTHENTICATED",method="get_reward"} 1.0' in metrics
        # the actor's own OpenRLHF client presents its certificate
        openrlhf = OpenRLHFRewardClient(RewardConfig(source="openrlhf", url=f"{server.http}/get_reward",
                                                     tls_ca_file=str(pki / "ca.pem"), tls_cert_file=str(pki / "client.pem"),
                                                     tls_key_file=str(pki / "client.key")))
        assert openrlhf.score_texts(["river => good"], [""]).result()[0].shape == (1,)
        # its keep-alive connection, idle and open, does not hold the server's stop: over TLS the server's close
        # waits for the client's close_notify (30 s) unless the server drops the connection a second later (before
        # the 5 s after which an idle keep-alive connection is closed anyway)
        # nor does a connection the server closed after an HTTP/1.0 reply, whose client ignores TLS's close_notify
        closed = ca_only.wrap_socket(socket.create_connection(("127.0.0.1", server.http_port)),
                                     server_hostname="127.0.0.1")
        closed.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        started = time.monotonic()
        assert server.terminate(60) == 0
        assert time.monotonic() - started < 4, "a server over TLS waited for an idle client at shutdown"
        closed.close()


def test_a_server_refuses_to_listen_beyond_loopback_unprotected(embedded_cache, pki, tmp_path):
    cmd = [sys.executable, "-m", "reward_server", "--host", "0.0.0.0", "--port", str(free_port()),
           "--http-port", str(free_port()), "--scorer", "positive_fraction"]
    env = {k: v for k, v in __import__("os").environ.items() if k != TOKEN_ENV}
    result = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0" in result.stderr and "--allow-insecure" in result.stderr
    # TLS alone proves the server, not its callers: not enough for a critic, which anyone reaching it could train
    cmd = [sys.executable, "-m", "critic_server", "--host", "0.0.0.0", "--port", str(free_port()), "--http-port",
           str(free_port()), "--checkpoint-dir", str(tmp_path / "ck"), "--tls-cert-file", str(pki / "server.pem"),
           "--tls-key-file", str(pki / "server.key")]
    result = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and "with TLS but no caller authentication" in result.stderr, result.stderr[-2000:]
    assert "tls_client_ca_file (mutual TLS)" in result.stderr
    # and the refusal of an unprotected critic names the ways that do suffice, not TLS alone
    result = subprocess.run(cmd[:-4], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and "with no authentication" in result.stderr, result.stderr[-2000:]
    assert "with tls_client_ca_file (mutual TLS" in result.stderr


def test_a_host_name_is_loopback_only_when_every_address_it_resolves_to_is(monkeypatch):
    """`localhost` is resolved, not trusted by its name: a hosts file may point it at a network address, and a server
    bound there with no token must be refused like one on that address."""
    from serving import security

    assert security.is_loopback("localhost") and security.is_loopback("[::1]") and security.is_loopback("127.0.0.2")
    assert not security.is_loopback("0.0.0.0") and not security.is_loopback("192.0.2.1")
    resolved = {"localhost": ["10.0.0.5"], "both": ["127.0.0.1", "10.0.0.5"], "lo6": ["::1", "fe80::1%lo"]}

    def getaddrinfo(host, port, *args, **kwargs):  # the resolver a hosts file would answer with
        if host not in resolved:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in resolved[host]]

    monkeypatch.setattr(security.socket, "getaddrinfo", getaddrinfo)
    assert not security.is_loopback("localhost") and not security.is_loopback("both")
    assert not security.is_loopback("lo6")  # fe80::1 is link-local, reachable from the network segment
    resolved["lo6"] = ["::1"]
    assert security.is_loopback("lo6") and not security.is_loopback("unknown-host")
    with pytest.raises(SecurityError, match="refusing to listen on localhost"):
        security.check_exposure("localhost", None, security.SecurityConfig())


def test_the_certificate_check_names_what_clients_would_refuse(pki, tmp_path, caplog):
    """The start-up check of a server's certificate chain (check_certificate), on the files operators get wrong."""
    d = tmp_path

    def sign(name: str, issuer: str, days: str, *ext: str) -> None:
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
                f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text("\n".join(ext or ["subjectAltName=DNS:localhost"]) + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{issuer}.pem", "-CAkey", f"{issuer}.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", days, "-extfile", f"{name}.ext", cwd=d)

    for f in ("ca.pem", "ca.key", "server.pem", "server.key"):
        shutil.copy(pki / f, d / f)
    ca = ("basicConstraints=critical,CA:TRUE", "keyUsage=critical,keyCertSign,cRLSign")
    sign("int", "ca", "1", *ca)  # an intermediate CA that ends in a day, and a server certificate for a year under it
    sign("leaf", "int", "365")
    sign("old_int", "ca", "-1", *ca)
    sign("leaf2", "old_int", "365")
    (d / "chain.pem").write_text((d / "leaf.pem").read_text() + (d / "int.pem").read_text())
    (d / "old_chain.pem").write_text((d / "leaf2.pem").read_text() + (d / "old_int.pem").read_text())
    (d / "reversed.pem").write_text((d / "int.pem").read_text() + (d / "leaf.pem").read_text())
    openssl("pkey", "-in", "server.key", "-aes256", "-passout", "pass:secret", "-out", "encrypted.key", cwd=d)
    openssl("genpkey", "-algorithm", "ed25519", "-out", "ed.key", cwd=d)
    openssl("req", "-x509", "-key", "ed.key", "-out", "ed.pem", "-days", "2", "-subj", "/CN=ed", cwd=d)

    # the chain's first expiry is the intermediate's, a day away, not the server certificate's year
    assert 0 < check_certificate(str(d / "chain.pem"), str(d / "leaf.key")) - time.time() <= 86400
    refused = {
        ("old_chain.pem", "leaf2.key"): "the certificate 'old_int' that issued the server's has expired",
        ("reversed.pem", "leaf.key"): "holds its own certificate first",
        ("server.pem", "leaf.key"): "does not match the first",
        ("server.pem", "encrypted.key"): "is encrypted",  # OpenSSL would ask the terminal for its passphrase
        ("server.key", "server.pem"): "server.key holds no PEM certificate",  # the two files swapped
    }
    for (cert, key), why in refused.items():
        with pytest.raises(SecurityError, match=re.escape(why)):
            check_certificate(str(d / cert), str(d / key))
    # an Ed25519 key serves (Go clients take it), with a warning: gRPC's C-core clients (the actor's) do not
    with caplog.at_level(logging.WARNING, logger="serving.security"):
        assert check_certificate(str(d / "ed.pem"), str(d / "ed.key")) > time.time()
    assert any("Ed25519" in m and "cannot connect" in m for m in caplog.messages), caplog.messages
    # the actor's own TLS files, named by their settings at its start
    from actor.clients import check_tls_files
    from actor.config import RewardConfig

    for files, why in (({"tls_ca_file": str(d / "server.key")}, "reward.tls_ca_file"),
                       ({"tls_cert_file": str(d / "server.pem"), "tls_key_file": str(d / "encrypted.key")},
                        "reward.tls_key_file"),
                       ({"tls_cert_file": str(d / "server.pem"), "tls_key_file": str(d / "nothing.key")},
                        "reward.tls_key_file")):
        with pytest.raises(SecurityError, match=re.escape(why)):
            check_tls_files("reward", RewardConfig(address="127.0.0.1:1", **files))


def test_a_server_refuses_an_expired_certificate_or_a_key_that_does_not_match(pki):
    """Every client would refuse it; before, it started as if nothing were wrong (a mismatched key was reported as a
    taken gRPC port)."""
    expired = f"tls_cert_file {pki / 'expired.pem'}: the server's certificate has expired"
    for cert, key, why in (("expired.pem", "server.key", expired),
                           ("server.pem", "client.key", f"tls_key_file {pki / 'client.key'} does not match")):
        cmd = [sys.executable, "-m", "reward_server", "--port", str(free_port()), "--http-port", str(free_port()),
               "--scorer", "positive_fraction", "--tls-cert-file", str(pki / cert), "--tls-key-file", str(pki / key)]
        result = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and why in result.stderr, result.stderr[-2000:]


def test_an_actor_without_the_token_is_refused_and_with_it_trains(embedded_cache, log_dir, pki, tmp_path):
    with ServiceProcess("reward", "--auth-token-file", str(pki / "token"), log_dir=log_dir) as server:
        base = [f"reward.address={server.address}", f"critic.address=127.0.0.1:{free_port()}", "ppo.max_num_steps=1",
                "ppo.num_prompts_per_step=4", "policy.train_global_batch_size=16", "checkpointing.enabled=false",
                "logger.num_val_samples_to_print=0", "ppo.val_period=0"]
        refused = subprocess.run(actor_command("grpo", tmp_path / "a", *base), check=False, cwd=ROOT,
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr[-2000:]
        assert "give the actor the same token file (auth_token_file" in refused.stderr, refused.stderr[-2000:]
        ok = subprocess.run([*actor_command("grpo", tmp_path / "b", *base), "--auth-token-file", str(pki / "token")],
                            check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert ok.returncode == 0, ok.stderr[-2000:]
        assert json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1


def test_an_actor_with_a_reward_tls_file_it_cannot_use_stops_before_it_waits_for_the_critic(embedded_cache, pki,
                                                                                           tmp_path):
    """Every TLS file is read at the actor's start: a bad reward server file stops it at once, though no critic is
    there to answer (before, it waited for the critic first, for up to critic.connect_timeout_s)."""
    result = subprocess.run(actor_command("ppo", tmp_path / "run", f"critic.address=127.0.0.1:{free_port()}",
                                          f"reward.address=127.0.0.1:{free_port()}",
                                          f"reward.tls_ca_file={pki / 'server.key'}"),
                            check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and f"reward.tls_ca_file {pki / 'server.key'} holds no PEM certificate" in \
        result.stderr, result.stderr[-2000:]


def test_a_token_no_client_can_send_or_a_file_that_never_ends_stops_the_start(tmp_path):
    """A token file saved with a byte-order mark, holding two lines or a non-ASCII letter started the servers, which
    then refused every caller, and the actor failed its first call with 'INTERNAL: Invalid metadata'. A FIFO whose
    writer stalls held the start, deaf to SIGTERM. Each now stops the start (exit 2) naming the setting and the
    reason, never the token's characters."""
    cases = {"bom": ("\ufeff" + TOKEN + "\n", "starts with a byte-order mark"),
             "two-lines": (TOKEN + "\nsecond-line\n", "spans more than one line"),
             "non-ascii": ("s3cret-t\u00f6ken\n", "has a character other than printable ASCII at character 9"),
             "no-break-space": ("\u00a0" + TOKEN + "\n", "has a character other than printable ASCII at character 1"),
             "fifo": (None, "is not a regular file")}
    for name, (text, _) in cases.items():
        if text is None:
            __import__("os").mkfifo(tmp_path / name)  # nothing ever writes it: opened for reading, it would block
        else:
            (tmp_path / name).write_text(text, encoding="utf-8")

    def start(name: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "reward_server", "--port", str(free_port()), "--http-port", str(free_port()),
               "--scorer", "exact_match", "--auth-token-file", str(tmp_path / name)]
        return subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = dict(zip(cases, pool.map(start, cases), strict=True))
    for name, (_, why) in cases.items():
        result = results[name]
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert "auth_token_file: " in result.stderr and why in result.stderr, (name, result.stderr[-2000:])
        assert "s3cret" not in result.stderr
    actor = subprocess.run([*actor_command("grpo", tmp_path / "run", f"reward.address=127.0.0.1:{free_port()}"),
                            "--auth-token-file", str(tmp_path / "bom")],
                           check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert actor.returncode == 2 and "starts with a byte-order mark" in actor.stderr, actor.stderr[-2000:]
    # the actor's TLS files too (OpenSSL, reading a FIFO as a CA bundle, waited for its writer)
    actor = subprocess.run(actor_command("grpo", tmp_path / "run", f"reward.address=127.0.0.1:{free_port()}",
                                         f"reward.tls_ca_file={tmp_path / 'fifo'}"),
                           check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert actor.returncode == 2 and f"reward.tls_ca_file: {tmp_path / 'fifo'} is not a regular file" in actor.stderr, \
        actor.stderr[-2000:]


def test_a_server_listens_on_an_ipv6_host(tmp_path):
    """`--host ::1` was read as YAML, and `[::1]` or `::` failed as 'is the port taken?': the gRPC address lacked
    the brackets an IPv6 literal needs, and the REST bind passed them to getaddrinfo."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "reward_server", "--host", "::1", "--port", str(grpc_port), "--http-port",
           str(http_port), "--scorer", "exact_match"]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read()[-2000:]
            try:
                if httpx.get(f"http://[::1]:{http_port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with grpc.insecure_channel(f"[::1]:{grpc_port}") as ch:
            info = reward_pb2_grpc.RewardServiceStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
        assert info.model == "rule:exact_match"
    finally:
        server.terminate()
        server.wait(timeout=60)
    # `--host ::` is the host `::`: refused beyond loopback for want of a token, not a type error
    env = {k: v for k, v in __import__("os").environ.items() if k != TOKEN_ENV}
    result = subprocess.run([*cmd[:4], "::", *cmd[5:]], check=False, cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2 and "refusing to listen on :: with no authentication" in result.stderr, \
        result.stderr[-2000:]


def test_the_actor_says_when_its_token_would_cross_a_network_in_clear_text(pki, tmp_path):
    """A token sent without TLS to a server beyond this machine can be read by anyone watching the network: said at
    start, once per such server; TLS settings with an http:// reward URL (which ignored them) are a config error."""
    from actor.clients import target_hosts

    assert [target_hosts(t) for t in ("gpu-1:5555", "[::1]:5555", "dns:///rm:5556", "unix:/run/critic.sock",
                                      "https://rm:8002/get_reward", "ipv4:127.0.0.1:5555,192.0.2.2:5555")] == \
        [["gpu-1"], ["::1"], ["rm"], [], ["rm"], ["127.0.0.1", "192.0.2.2"]]
    far = "192.0.2.1:5555"  # TEST-NET-1: nothing answers there
    result = subprocess.run([*actor_command("ppo", tmp_path / "a", f"critic.address={far}", "critic.connect_timeout_s=1",
                                            f"reward.address=127.0.0.1:{free_port()}"),
                             "--auth-token-file", str(pki / "token")],
                            check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"the bearer token goes to the critic server at {far} in clear text" in result.stderr, result.stderr[-2000:]
    assert "to the reward server" not in result.stderr  # loopback
    config = subprocess.run(actor_command("ppo", tmp_path / "b", "reward.source=openrlhf",
                                          "reward.url=http://rm:8002/get_reward", f"reward.tls_ca_file={pki / 'ca.pem'}"),
                            check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert config.returncode == 2 and "reward.tls_ca_file is set, but reward.url=http://rm:8002/get_reward is not " \
        "https://" in config.stderr, config.stderr[-2000:]
