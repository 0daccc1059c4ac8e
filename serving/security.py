"""Who may talk to a server: a shared bearer token on every gRPC method and REST route except the probes
(gRPC health and reflection, /health, /ready, /metrics), TLS or mutual TLS, and a refusal to listen beyond
loopback with neither.

The token comes from `auth_token_file` or the environment variable PPO_SERVICES_AUTH_TOKEN; clients send
`authorization: Bearer <token>` (once: a call carrying two is refused). Comparisons take constant time. A refused call
is UNAUTHENTICATED (gRPC) or 401 (REST), and is counted in the request metrics under its method or route; a method or
path that no service has is UNIMPLEMENTED or 404, token or not, and is not counted, so callers without the token
cannot add series to /metrics.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import ipaddress
import logging
import os
import re
import socket
import ssl
import stat
import time
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import Field
from starlette.routing import Match

from .config import FilePath, StrictModel
from .metrics import ServiceMetrics
from .wire import bare_host, is_known_method

TOKEN_ENV = "PPO_SERVICES_AUTH_TOKEN"
_METHOD_PATH = re.compile(r"/([A-Za-z_][\w.]*)/([A-Za-z_]\w*)")
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1.ServerReflection/",
                      "/grpc.reflection.v1alpha.ServerReflection/")
OPEN_REST_PATHS = frozenset({"/health", "/ready", "/metrics"})
log = logging.getLogger(__name__)


class SecurityConfig(StrictModel):
    """Authentication and transport security of a server."""

    auth_token_file: FilePath | None = Field(
        None, description=f"File holding the shared bearer token every call must carry (the environment variable "
        f"{TOKEN_ENV} is read when this is unset); probes (gRPC health and reflection, /health, /ready, /metrics) "
        "stay open.")
    allow_insecure: bool = Field(False, description="Listen on a non-loopback host with no token and no TLS anyway.")
    tls_cert_file: FilePath | None = Field(None, description="PEM certificate chain: serve gRPC and REST over TLS.")
    tls_key_file: FilePath | None = Field(None, description="PEM private key of tls_cert_file.")
    tls_client_ca_file: FilePath | None = Field(
        None, description="PEM CA bundle: clients must present a certificate it signed (mutual TLS), on every gRPC "
        "call and every REST route but the probes (/health, /ready, /metrics), which need none.")


# command-line shorthands every server takes; `--allow-insecure` is a switch
SECURITY_FLAGS = {
    "--auth-token-file": ("auth_token_file", f"file holding the bearer token clients must send (else ${TOKEN_ENV})"),
    "--allow-insecure": ("allow_insecure", "listen beyond loopback without a token or TLS anyway"),
    "--tls-cert-file": ("tls_cert_file", "PEM certificate chain: serve over TLS"),
    "--tls-key-file": ("tls_key_file", "PEM private key of the certificate"),
    "--tls-client-ca-file": ("tls_client_ca_file", "PEM CA: gRPC clients, and REST clients but for the probes, must present a certificate it signed"),
}
SECURITY_SWITCHES = frozenset({"allow_insecure"})


class SecurityError(ValueError):
    """The security settings cannot be used; the message names the key."""


# The largest token or PEM file read: a certificate bundle is tens of KiB
MAX_SECURITY_FILE_BYTES = 1 << 20


def read_security_file(path: str, key: str) -> bytes:
    """The bytes of setting `key`'s file: a regular file of at most 1 MiB. A FIFO (`<(command)`) would hold the start
    with no way to stop it short of SIGKILL, and a device (/dev/zero) would never end."""
    try:
        info = Path(path).stat()
        if not stat.S_ISREG(info.st_mode):
            raise SecurityError(f"{key}: {path} is not a regular file (a directory, FIFO or device); point it at a "
                                f"file")
        if info.st_size > MAX_SECURITY_FILE_BYTES:
            raise SecurityError(f"{key}: {path} has {info.st_size} bytes, more than a token or PEM file "
                                f"({MAX_SECURITY_FILE_BYTES} at most)")
        return Path(path).read_bytes()
    except OSError as e:
        raise SecurityError(f"{key}: cannot read {path}: {e.strerror}") from None


def load_token(path: str | None, key: str = "auth_token_file") -> str | None:
    """The token from `path`, else from PPO_SERVICES_AUTH_TOKEN, else None. Surrounding whitespace is dropped; a token
    no client could send in an authorization header (not one line of printable ASCII) is a SecurityError, where it
    used to start a server that refused every caller."""
    if path:
        try:
            token = read_security_file(path, key).decode("utf-8").strip(_ASCII_SPACE)
        except UnicodeDecodeError:
            raise SecurityError(f"{key}: {path} is not UTF-8 text") from None
        if not token:
            raise SecurityError(f"{key}: {path} is empty")
        source = f"{key}: the token in {path}"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip(_ASCII_SPACE)
        if not token and TOKEN_ENV in os.environ:
            log.warning("%s is set but blank: no bearer token is required", TOKEN_ENV)
        source = f"{TOKEN_ENV}: the token"
    if token and (why := _unsendable(token)) is not None:
        raise SecurityError(f"{source} {why}: a bearer token must be one line of printable ASCII (letters, digits, "
                            f"punctuation and spaces), which every gRPC and HTTP client can send")
    return token or None


# What is dropped around a token: ASCII whitespace only, so that a token with other blanks at its ends (a no-break
# space) is refused whole rather than taken without them, which a client sending the file's bytes would not match
_ASCII_SPACE = " \t\r\n\f\v"


def _unsendable(token: str) -> str | None:
    """Why `token` cannot travel in an authorization header, or None. Names a position, never the characters."""
    if token.startswith("\ufeff"):
        return "starts with a byte-order mark (the file was saved with one: save it without)"
    for i, ch in enumerate(token, 1):
        if " " <= ch <= "~":
            continue
        if ch in "\r\n":
            return f"spans more than one line (a line break after character {i - 1})"
        if ch in "\t\v\f":
            return f"has a tab or other control whitespace at character {i}"
        return f"has a character other than printable ASCII at character {i}"
    return None


def read_pem(path: str | None, key: str) -> bytes | None:
    return None if path is None else read_security_file(path, key)


def bearer_matches(header: str | None, token: str) -> bool:
    """True when `header` is `Bearer <token>` (the scheme name in any case, RFC 6750); constant time in the token."""
    scheme, _, presented = (header or "").strip().partition(" ")
    matches = hmac.compare_digest(presented.strip().encode(), token.encode())
    return matches and scheme.lower() == "bearer"


def is_loopback(host: str) -> bool:
    """True when `host` is a loopback address, or a name every address of which is one (`localhost` resolved, not
    trusted by its name: a hosts file may point it elsewhere). A name that does not resolve is not loopback."""
    try:
        return ipaddress.ip_address(bare_host(host)).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses)


def check_exposure(host: str, token: str | None, cfg: SecurityConfig, tls_alone: bool = True) -> None:
    """Refuse a non-loopback listener with neither a token nor TLS, unless allow_insecure. TLS without a client CA
    authenticates the server, not its callers: where that is not enough (`tls_alone` off: a server whose calls change
    its state), it needs a token or mutual TLS."""
    if is_loopback(host) or token:
        return
    if cfg.allow_insecure:
        if not cfg.tls_cert_file or not (tls_alone or cfg.tls_client_ca_file):
            log.warning("listening on %s with no caller authentication (allow_insecure): anyone who reaches it may "
                        "call every method", host)
        return
    if cfg.tls_cert_file and (tls_alone or cfg.tls_client_ca_file):
        return
    if cfg.tls_cert_file:
        raise SecurityError(
            f"refusing to listen on {host} with TLS but no caller authentication: TLS without tls_client_ca_file "
            f"proves the server to its callers, not the callers to it, and anyone who reaches this one could train it "
            f"or write and load its checkpoints; set auth_token_file (--auth-token-file) or {TOKEN_ENV}, or "
            f"tls_client_ca_file (mutual TLS), or pass --allow-insecure")
    tls = ("tls_cert_file/tls_key_file" if tls_alone else
           "tls_cert_file/tls_key_file with tls_client_ca_file (mutual TLS: TLS alone does not authenticate callers)")
    raise SecurityError(
        f"refusing to listen on {host} with no authentication: set auth_token_file (--auth-token-file) or "
        f"{TOKEN_ENV}, or {tls}, or pass --allow-insecure")


def server_credentials(cfg: SecurityConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port (mutual TLS with a client CA), or None for plaintext."""
    if (cfg.tls_cert_file is None) != (cfg.tls_key_file is None):
        raise SecurityError("tls_cert_file and tls_key_file: set both or neither")
    if cfg.tls_cert_file is None:
        if cfg.tls_client_ca_file:
            raise SecurityError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        return None
    key, cert = read_pem(cfg.tls_key_file, "tls_key_file"), read_pem(cfg.tls_cert_file, "tls_cert_file")
    client_ca = read_pem(cfg.tls_client_ca_file, "tls_client_ca_file")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


# X509_V_ERR_CERT_NOT_YET_VALID and X509_V_ERR_CERT_HAS_EXPIRED (OpenSSL's x509_vfy.h)
_NOT_YET_VALID, _EXPIRED = 9, 10
# A certificate closer than this to its end is logged as a warning at start
CERTIFICATE_WARN_DAYS = 14
# The algorithm identifiers of Ed25519 and Ed448 keys (RFC 8410), as DER
_EDWARDS_OIDS = (b"\x06\x03\x2b\x65\x70", b"\x06\x03\x2b\x65\x71")
_PEM_PRIVATE_KEY = re.compile(rb"-----BEGIN PRIVATE KEY-----(.+?)-----END PRIVATE KEY-----", re.DOTALL)


class _Encrypted(Exception):
    """Raised for OpenSSL's passphrase prompt: a server never waits on a terminal for one."""


def _no_passphrase() -> bytes:
    raise _Encrypted


def _subject(cert: dict) -> str:
    names = dict(pair for rdn in cert.get("subject", ()) for pair in rdn)
    return names.get("commonName") or str(cert.get("subject"))


def load_key_pair(context: ssl.SSLContext, cert_file: str, key_file: str, prefix: str = "") -> None:
    """`context.load_cert_chain(cert_file, key_file)`, with what OpenSSL refuses as a SecurityError naming the setting
    at fault (`<prefix>tls_cert_file`, `<prefix>tls_key_file`): a key that does not match the chain's first
    certificate, an encrypted key (OpenSSL would wait at the terminal for its passphrase, or fail with an OSError
    without one: gRPC takes no passphrase either), a key too weak for this host's OpenSSL, a file with no PEM
    certificate or key."""
    cert, key = f"{prefix}tls_cert_file {cert_file}", f"{prefix}tls_key_file {key_file}"
    read_pem(cert_file, f"{prefix}tls_cert_file")  # one that cannot be read, named
    read_pem(key_file, f"{prefix}tls_key_file")
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
        return
    except _Encrypted:
        raise SecurityError(f"{key} is encrypted: a passphrase cannot be given (gRPC takes none either); decrypt it "
                            f"(`openssl pkey -in KEY -out KEY.plain`) and keep it readable only by its user") from None
    except ssl.SSLError as e:
        reason = e.reason or str(e)
    if reason == "KEY_VALUES_MISMATCH":
        why = (f"{key} does not match the first certificate in {cert}, the one presented (a chain file holds its own "
               f"certificate first, then the ones that issued it)")
    elif reason.endswith(("KEY_TOO_SMALL", "MD_TOO_WEAK")):
        why = (f"{cert} with {key}: too weak for this host's OpenSSL ({reason}); use an RSA key of 2048 bits or "
               f"more, or ECDSA P-256, signed with SHA-256 or better")
    else:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert_file)
            why = f"{key} holds no PEM private key ({reason})"
        except ssl.SSLError:
            why = f"{cert} holds no PEM certificate"
    raise SecurityError(why)


def check_ca_file(ca_file: str, setting: str) -> None:
    """A CA bundle that cannot be read or holds no PEM certificate is a SecurityError naming `setting`."""
    read_pem(ca_file, setting)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca_file)
    except ssl.SSLError:
        raise SecurityError(f"{setting} {ca_file} holds no PEM certificate") from None


def check_certificate(cert_file: str, key_file: str) -> float | None:
    """Check the server's certificate chain as its clients will, and return when the first certificate of it expires
    (seconds since the epoch; the server's own or one that issued it).

    A TLS handshake of the server's own chain with a client that trusts that chain, in memory (the standard library
    decodes a certificate only once it has verified it). What every client would refuse is a SecurityError naming
    the file: a certificate of the chain that has expired, a key that does not match the certificate, an encrypted
    key (OpenSSL would wait at the terminal for its passphrase), a file that holds no PEM certificate or key. Before,
    such a server started as if nothing were wrong (a mismatched key was reported as a taken port). What else the
    handshake finds (not yet valid, a certificate not meant for servers) is logged as a warning and None returned:
    the clients' own trust settings decide; so is an Ed25519 or Ed448 key, which some gRPC clients (the actor's)
    cannot use. The clients' CA bundle is not known here, so a chain missing an intermediate certificate passes."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    load_key_pair(server, cert_file, key_file)
    key = _PEM_PRIVATE_KEY.search(Path(key_file).read_bytes())
    if key and any(oid in base64.b64decode(key[1])[:16] for oid in _EDWARDS_OIDS):  # it loaded: valid base64
        log.warning("tls_key_file %s is an Ed25519 or Ed448 key: gRPC clients built on gRPC's C core (Python's grpcio, "
                    "which the actor uses, C++) do not offer its signatures and cannot connect; REST clients and Go or "
                    "Java gRPC clients can. Use ECDSA P-256 or RSA for the actor", key_file)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # the names clients use are theirs to check
    client.load_verify_locations(cafile=cert_file)
    client.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # the chain's own certificates are the trust anchors
    issuers = client.get_ca_certs()  # the chain's CA certificates, decoded (the server's own is not one)
    bios = [ssl.MemoryBIO() for _ in range(4)]
    ends = client.wrap_bio(bios[0], bios[1]), server.wrap_bio(bios[2], bios[3], server_side=True)
    try:
        for _ in range(8):  # a TLS 1.3 handshake takes two round trips
            for end in ends:
                with contextlib.suppress(ssl.SSLWantReadError):
                    end.do_handshake()
            bios[2].write(bios[1].read())
            bios[0].write(bios[3].read())
            with contextlib.suppress(ValueError):  # "handshake not done yet"
                own = ends[0].getpeercert()
                return min(ssl.cert_time_to_seconds(c["notAfter"]) for c in [own, *issuers])
    except ssl.SSLCertVerificationError as e:
        if e.verify_code == _EXPIRED:
            ended = [_subject(c) for c in issuers if ssl.cert_time_to_seconds(c["notAfter"]) < time.time()]
            which = f"the certificate {ended[0]!r} that issued the server's" if ended else "the server's certificate"
            raise SecurityError(f"tls_cert_file {cert_file}: {which} has expired, so every client would refuse this "
                                f"server; renew it") from None
        note = " (the host's clock may be behind)" if e.verify_code == _NOT_YET_VALID else ""
        log.warning("tls_cert_file %s: clients that check it will refuse it: %s%s", cert_file, e.verify_message, note)
    except ssl.SSLError as e:
        log.warning("tls_cert_file %s could not be checked: %s", cert_file, e)
    return None


def report_certificate(cert_file: str, expires: float | None, metrics: ServiceMetrics) -> None:
    """Log when the server's certificate chain expires (a warning within CERTIFICATE_WARN_DAYS) and export it for
    alerting (`ppo_<service>_tls_certificate_expiry_timestamp_seconds`)."""
    if expires is None:
        return
    metrics.certificate_expiry(expires)
    days = (expires - time.time()) / 86400
    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires))
    if days < CERTIFICATE_WARN_DAYS:
        log.warning("the certificate chain in tls_cert_file %s expires in %.1f days (%s): renew it before then",
                    cert_file, days, until)
    else:
        log.info("the certificate chain in tls_cert_file %s is valid until %s", cert_file, until)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every method outside health and reflection needs the bearer token."""

    def __init__(self, token: str, metrics: ServiceMetrics):
        self.token, self.metrics = token, metrics

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        path = _METHOD_PATH.fullmatch(details.method)  # `/package.Service/Method`, nothing else
        if details.method.startswith(OPEN_GRPC_PREFIXES) or path is None or not is_known_method(
                f"{path[1]}.{path[2]}"):
            return await continuation(details)  # a method no service has is UNIMPLEMENTED, token or not
        headers = [v for k, v in details.invocation_metadata or () if k == "authorization"]
        if len(headers) == 1 and isinstance(headers[0], str) and bearer_matches(headers[0], self.token):
            return await continuation(details)
        method = path[2]  # a known method's name: the metric's labels stay bounded
        why = "missing" if not headers else "wrong" if len(headers) == 1 else "more than one"

        async def refuse(requests, context: grpc.aio.ServicerContext) -> None:
            self.metrics.record_request(method, grpc.StatusCode.UNAUTHENTICATED.name)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{why} bearer token: send metadata 'authorization: Bearer <token>'")

        # a streaming handler that never reads: the caller's message is not received whole (a unary handler would
        # take it all, up to the receive limit, before refusing)
        return grpc.stream_unary_rpc_method_handler(refuse)


def route_path(scope) -> str | None:
    """The path of the app's route that an HTTP request's scope matches (in full, or but for its method), or None (a
    404): what requests are counted under, so that no caller can name a metric series."""
    routes = getattr(scope.get("app"), "routes", None) or []
    return next((r.path for r in routes if r.matches(scope)[0] != Match.NONE), None)


def add_rest_auth(app: FastAPI, token: str, metrics: ServiceMetrics) -> None:
    """401 for a REST route other than the probes without `Authorization: Bearer <token>`."""

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        route = route_path(request.scope)
        headers = request.headers.getlist("authorization")
        if request.url.path in OPEN_REST_PATHS or route is None or (
                len(headers) == 1 and bearer_matches(headers[0], token)):
            return await call_next(request)  # no route: 404, token or not
        metrics.record_request(route.strip("/"), grpc.StatusCode.UNAUTHENTICATED.name)  # a route's own path
        return JSONResponse({"detail": "missing or wrong bearer token: send 'Authorization: Bearer <token>'"},
                            status_code=401, headers={"WWW-Authenticate": "Bearer"})


# The key of each REST request's scope["state"] saying whether its connection presented a verified client certificate
# (set by serving.rest.TimedRequestProtocol).
CLIENT_CERTIFIED = "tls_client_certified"


def add_rest_client_cert_check(app: FastAPI, metrics: ServiceMetrics) -> None:
    """401 for a REST route other than the probes on a connection without a client certificate signed by the
    server's tls_client_ca_file: mutual TLS guards /get_reward as it guards gRPC, while probes need no certificate."""

    @app.middleware("http")
    async def require_client_certificate(request: Request, call_next):
        route = route_path(request.scope)
        if request.url.path in OPEN_REST_PATHS or route is None or request.scope.get("state", {}).get(CLIENT_CERTIFIED):
            return await call_next(request)
        metrics.record_request(route.strip("/"), grpc.StatusCode.UNAUTHENTICATED.name)
        return JSONResponse({"detail": "this server takes calls only from clients with a certificate signed by its "
                                       "tls_client_ca_file (mutual TLS); present one"}, status_code=401)


class _CallDetails(namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                               "compression")), grpc.ClientCallDetails):
    pass


class BearerClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Adds `authorization: Bearer <token>` to every unary call of a client channel."""

    def __init__(self, token: str):
        self.metadata = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(self, continuation, details, request):
        metadata = [*(details.metadata or ()), self.metadata]
        return continuation(_CallDetails(details.method, details.timeout, metadata, details.credentials,
                                         details.wait_for_ready, getattr(details, "compression", None)), request)
