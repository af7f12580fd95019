"""TLS, mutual TLS and per-job bearer tokens: the server's credentials and interceptor, and
the one way every client here (FeederClient, `feeder status`, `feeder health`) opens a channel.

Certificates and the tokens file are re-read when their files change, so rotating either
needs no restart: new connections (TLS) and new calls (tokens) see the new material; open
streams keep the identity they were admitted with.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import ssl
import threading
import time
from dataclasses import dataclass

import grpc

from feeder.core import scope
from feeder.core.errors import Code, FeederError, InvalidArgument

log = logging.getLogger("feeder.security")

ALL_JOBS = "*"
# Methods a token must name the job of; Info (dataset facts) needs only a valid token, and
# health and reflection stay open for probes and load balancers.
FEEDER_SERVICE = "/feeder.v1.Feeder/"
JOB_SCOPED = ("Stream", "Report", "Status", "Mix")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "ftk_" + secrets.token_urlsafe(32)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgument(f"cannot read {path}: {e.strerror}") from None


def _mtimes(paths) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


class FileWatch:
    """Whether files changed (mtime, size, inode) since the last accepted look, looked at no
    more than once a second, so a check per handshake or per call costs nothing."""

    def __init__(self, paths, every_s: float = 1.0):
        self.paths, self.every_s = tuple(paths), every_s
        self._seen = _mtimes(self.paths)
        self._checked = 0.0
        self._lock = threading.Lock()

    def changed(self) -> tuple | None:
        """The files' new stamp when they changed (pass it to accept), else None."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked < self.every_s:
                return None
            self._checked = now
            seen = _mtimes(self.paths)
            return None if seen == self._seen else seen

    def accept(self, stamp: tuple) -> None:
        self._seen = stamp


# ---- server: TLS ------------------------------------------------------------------------

class _Reloading:
    """Server certificate (and client CA for mutual TLS), loaded anew when a file changes."""

    def __init__(self, cert: str, key: str, client_ca: str = ""):
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self.watch = FileWatch(p for p in (cert, key, client_ca) if p)

    def _load(self):
        raise NotImplementedError

    def _reload(self):
        """The material loaded anew if a file changed since the last good load, else None."""
        stamp = self.watch.changed()
        if stamp is None:
            return None
        try:
            loaded = self._load()
        except Exception as e:  # a half-written rotation: keep serving with what works, look again
            log.warning("certificate reload failed, keeping the current one: %s", e)
            return None
        self.watch.accept(stamp)
        log.info("reloaded TLS material (%s)", ", ".join(self.watch.paths))
        return loaded


class ReloadingCertificates(_Reloading):
    """For gRPC, which asks `fetch` at each new handshake; None keeps the current configuration."""

    def __init__(self, cert: str, key: str, client_ca: str = ""):
        super().__init__(cert, key, client_ca)
        self.initial = self._load()

    def _load(self):
        pairs = [(_read(self.key), _read(self.cert))]
        ca = _read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_certificate_configuration(pairs, root_certificates=ca)

    def fetch(self):
        return self._reload()

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self.initial, self.fetch,
                                                   require_client_authentication=bool(self.client_ca))


class ReloadingSSLContext(_Reloading):
    """For a plain `ssl` listener (the metrics port): `current()` at each accepted connection."""

    def __init__(self, cert: str, key: str, client_ca: str = ""):
        super().__init__(cert, key, client_ca)
        self.context = self._load()

    def _load(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.client_ca:
                ctx.load_verify_locations(self.client_ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as e:
            raise InvalidArgument(f"cannot load the certificate {self.cert} with key {self.key}"
                                  f"{' and client CA ' + self.client_ca if self.client_ca else ''}: {e}") from None
        return ctx

    def current(self) -> ssl.SSLContext:
        self.context = self._reload() or self.context
        return self.context


# ---- server: tokens ---------------------------------------------------------------------

@dataclass(frozen=True)
class Grant:
    name: str
    jobs: frozenset[str]
    # The datasets (source names) this token's streams may read; None: every one. Job names
    # alone do not keep teams apart: any job name may ask for any dataset.
    datasets: frozenset[str] | None = None
    metrics: bool = False   # may scrape /metrics (which shows every job's progress)

    def allows(self, job: str) -> bool:
        return ALL_JOBS in self.jobs or job in self.jobs

    def allows_dataset(self, name: str) -> bool:
        return self.datasets is None or name in self.datasets

    def scope(self) -> scope.Scope:
        """What answers to this token may name (feeder.core.scope)."""
        return scope.Scope(jobs=None if ALL_JOBS in self.jobs else self.jobs, datasets=self.datasets)


class TokenStore:
    """The tokens file (TOML): one `[[token]]` per credential with `sha256` (of the token;
    `feeder token` prints both) or `token` (the secret itself), `jobs` (names, or "*"), an
    optional `datasets` (the source names its streams may read; absent: all), `metrics = true`
    (may scrape /metrics; such a token may name no jobs) and an optional `name` for logs.
    Re-read when it changes; a broken edit keeps the last good set."""

    def __init__(self, path: str):
        self.path = path
        self.grants: dict[str, Grant] = self._load()
        self.watch = FileWatch([path])

    def _load(self) -> dict[str, Grant]:
        from feeder.core.config import load_toml

        data = load_toml(self.path)
        entries = data.get("token", [])
        if not isinstance(entries, list):
            raise InvalidArgument(f"{self.path}: expected [[token]] tables, got {type(entries).__name__}")
        grants = {}
        for i, t in enumerate(entries):
            where = f"{self.path}: token #{i + 1}"
            if not isinstance(t, dict):
                raise InvalidArgument(f"{where}: expected a table")
            unknown = set(t) - {"sha256", "token", "jobs", "name", "datasets", "metrics"}
            if unknown:
                raise InvalidArgument(f"{where}: unknown key(s) {sorted(unknown)}; expected sha256 or token, "
                                      "jobs, datasets, metrics, name")
            digest = t.get("sha256") or (token_hash(t["token"]) if t.get("token") else "")
            if len(digest) != 64:
                raise InvalidArgument(f"{where}: needs sha256 = \"<64 hex digits>\" or token = \"...\"")
            metrics = t.get("metrics", False)
            if not isinstance(metrics, bool):
                raise InvalidArgument(f"{where}: metrics must be true or false, got {metrics!r}")
            jobs = t.get("jobs", [] if metrics else None)
            if not _names(jobs, empty_ok=metrics):
                raise InvalidArgument(f"{where}: jobs must be a non-empty list of job names (or [\"*\"]); only a "
                                      "metrics = true token may leave it out")
            datasets = t.get("datasets")
            if datasets is not None and not _names(datasets, empty_ok=False):
                raise InvalidArgument(f"{where}: datasets must be a non-empty list of source names (leave it out "
                                      "for all)")
            grants[digest.lower()] = Grant(name=str(t.get("name", f"token{i + 1}")), jobs=frozenset(jobs),
                                           datasets=None if datasets is None else frozenset(datasets),
                                           metrics=metrics)
        return grants

    def _maybe_reload(self) -> None:
        stamp = self.watch.changed()
        if stamp is None:
            return
        self.watch.accept(stamp)  # a broken edit is not parsed again until the next change
        try:
            self.grants = self._load()
            log.info("reloaded %d token(s) from %s", len(self.grants), self.path)
        except FeederError as e:
            log.warning("tokens file reload failed, keeping the last good set: %s", e)

    def lookup(self, token: str) -> Grant | None:
        self._maybe_reload()
        return self.grants.get(token_hash(token))


def _names(value, empty_ok: bool) -> bool:
    return isinstance(value, list) and (empty_ok or bool(value)) and all(isinstance(v, str) and v for v in value)


def bearer(metadata) -> str:
    for k, v in metadata or ():
        if k == "authorization":
            v = v.decode() if isinstance(v, bytes) else v
            scheme, _, tok = v.partition(" ")
            return tok.strip() if scheme.lower() == "bearer" else ""
    return ""


def authorize(store: TokenStore, method: str, metadata) -> Grant:
    """Who the caller is, or UNAUTHENTICATED. Which job they may touch is checked per request."""
    tok = bearer(metadata)
    if not tok:
        raise FeederError(f"{method.rsplit('/', 1)[-1]} needs a bearer token (metadata 'authorization: Bearer "
                          "<token>'; FeederDataset(token=...) or --token-file)", code=Code.UNAUTHENTICATED)
    grant = store.lookup(tok)
    if grant is None:
        raise FeederError("the bearer token is not valid for this feeder (unknown, revoked or mistyped)",
                          code=Code.UNAUTHENTICATED)
    return grant


def check_job(grant: Grant, method: str, job: str) -> None:
    if grant.allows(job):
        return
    what = f"job {job!r}" if job else "all jobs (ask with --job NAME)"
    raise FeederError(f"token {grant.name!r} may not {method} {what}; it grants {sorted(grant.jobs)}",
                      code=Code.PERMISSION_DENIED)


def check_datasets(grant: Grant, method: str, names) -> None:
    denied = [n for n in names if not grant.allows_dataset(n)]
    if denied:
        raise FeederError(f"token {grant.name!r} may not {method} dataset {denied[0]!r}; it grants datasets "
                          f"{sorted(grant.datasets or ())}", code=Code.PERMISSION_DENIED)


def requested_datasets(name: str, request, default: str) -> list[str]:
    """The source names a Stream or Info request reads ("" is the feeder's default)."""
    if name == "Stream" and len(request.mixture):
        return [m.source for m in request.mixture]
    return [request.dataset or default]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Admits a Feeder call only with a valid bearer token, and only for the job and the
    datasets it names. Both are in the request body, which an interceptor cannot see, so the
    handler is wrapped to check them before the servicer runs."""

    def __init__(self, store: TokenStore, status_map, default_dataset: str = ""):
        self.store = store
        self.status = status_map
        self.default_dataset = default_dataset

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or not method.startswith(FEEDER_SERVICE):
            return handler
        name = method[len(FEEDER_SERVICE):]
        try:
            grant = authorize(self.store, method, details.invocation_metadata)
            err = None
        except FeederError as e:
            grant, err = None, e
        status = self.status

        async def admit(request, context) -> None:
            try:
                if err:
                    raise err
                # Every answer from here on names only what this token may see: set for this
                # call's task, read where messages and replies are made.
                scope.enter(grant.scope())
                # A request that did not parse comes as the servicer's InvalidArgument: it names
                # no job, and the servicer answers it once the token has been checked.
                if isinstance(request, FeederError):
                    return
                if name in JOB_SCOPED:
                    check_job(grant, name, request.job)
                if name in ("Stream", "Info"):
                    check_datasets(grant, name, requested_datasets(name, request, self.default_dataset))
            except FeederError as e:
                log.warning("refused %s from %s: %s", name, context.peer(), e)
                await context.abort(status[e.code], e.message)

        if handler.response_streaming:
            inner = handler.unary_stream

            async def stream_behavior(request, context):
                await admit(request, context)
                await inner(request, context)   # (it writes its replies itself: servicer._refusing_malformed)

            return grpc.unary_stream_rpc_method_handler(
                stream_behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)

        inner_unary = handler.unary_unary

        async def unary_behavior(request, context):
            await admit(request, context)
            return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_behavior, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


# ---- client -----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ClientSecurity:
    """How a client reaches feeders. All empty: plain text (loopback development)."""

    ca: str = ""            # PEM of the CA that signed the feeders' certificates: TLS on
    cert: str = ""          # client certificate + key, for feeders that require mutual TLS
    key: str = ""
    token: str = ""         # bearer token, or
    token_file: str = ""    # a file holding it (re-read for every new call: rotation)
    server_name: str = ""   # expected name in the feeder's certificate, when it differs from the host

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise InvalidArgument("a client certificate needs both cert and key, got only "
                                  f"{'cert' if self.cert else 'key'}")
        if self.cert and not self.ca:
            raise InvalidArgument("a client certificate (mutual TLS) needs ca= too: the CA of the feeders")

    @property
    def tls(self) -> bool:
        return bool(self.ca)

    def channel(self, target: str, options=()) -> grpc.Channel:
        options = list(options)
        if not self.tls:
            return grpc.insecure_channel(target, options=options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        creds = grpc.ssl_channel_credentials(root_certificates=_read(self.ca),
                                             private_key=_read(self.key) if self.key else None,
                                             certificate_chain=_read(self.cert) if self.cert else None)
        return grpc.secure_channel(target, creds, options=options)

    def metadata(self) -> tuple:
        tok = self.token
        if self.token_file:
            tok = _read(self.token_file).decode().strip()
        return (("authorization", f"Bearer {tok}"),) if tok else ()


def explain(e: grpc.RpcError, target: str, security: ClientSecurity, answered: bool = False) -> str:
    """An RpcError in words, with the likely fix for the transport mistakes people make.
    `answered`: this target has answered us before, so a closed socket is a feeder gone (killed,
    restarted), not a TLS mismatch, and no TLS hint is given."""
    code, details = e.code(), e.details() or ""
    msg = f"{target}: {code.name}: {details}"
    low = details.lower()
    if code == grpc.StatusCode.UNAVAILABLE and not answered:
        if not security.tls and ("socket closed" in low or "connection reset" in low or "eof" in low):
            msg += " (does this feeder use TLS? pass its CA: --ca / FeederDataset(tls_ca=...))"
        elif security.tls and not security.cert and "socket closed" in low:
            msg += (" (does this feeder require a client certificate, i.e. mutual TLS? pass --cert/--key / "
                    "FeederDataset(tls_cert=..., tls_key=...))")
        elif security.tls and ("ssl" in low or "handshake" in low or "certificate" in low or "tls" in low):
            msg += (" (TLS handshake failed: is the feeder plain text, is --ca the right CA, or does it need a "
                    "client certificate?)")
    return msg
