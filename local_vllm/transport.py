"""The vLLM HTTP contract (docs/vllm_api.md), its transport; 概要 (Overview): the server that
the demo starts. A threaded HTTP/1.1 server for local_vllm/server.py that survives any request.

The server knows nothing of vLLM's routes (server.py hands it a route table); it frames and
bounds what arrives and answers every refusal in vLLM's JSON error shape, so no request gets a 500,
a hang or a dropped connection for being malformed, and no request can hurt another:

    bytes in ─► request line + headers (http.server; its refusals → send_error → JSON, 501 → 405)
            ─► body: Content-Length (digits) or chunked (sizes checked), ≤ 32 MiB, else 400/413;
               a client silent for 60 s mid-body gets 408; framing errors close the connection
               after a lingering drain, so the client still reads why
            ─► --api-key: `Authorization: Bearer <key>` on all but /health and /metrics, else 401
            ─► route (404 unknown path, 405 known path, other method) ─► JSON body (UTF-8, an
               object; too deep or malformed → 400) ─► fn(engine, body, query[, alive])
    a generating route polls alive(): a client that closed its side aborts its sequences
    (Cancelled), and its connection closes without a reply
    a keep-alive connection idle for 5 s is closed (uvicorn's timeout_keep_alive)

Departures from vLLM (uvicorn + FastAPI), one line each:
- Bodies over 32 MiB get 413 (uvicorn sets no limit): one request's memory is bounded.
- A client silent for 60 s mid-request is dropped (uvicorn waits).
- 401 guards every route but /health and /metrics, as vLLM's newest guard does (older: /v1 only).
"""
import hashlib
import hmac
import json
import re
import select
import socket
import sys
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from local_vllm.engine import APIError, Cancelled

MAX_BODY_BYTES = 32 << 20      # a larger body gets 413 (uvicorn sets no limit; this bounds memory)
MAX_LINE = 1024                # a chunk-size or trailer line
READ_TIMEOUT_S = 60.0          # a client silent this long mid-request is dropped
KEEP_ALIVE_S = 5.0             # an idle keep-alive connection is closed (uvicorn's default)
PUBLIC_PATHS = {"/health", "/metrics"}   # open without --api-key's token, as in vLLM


class Dropped(Exception):
    """The client went away (or stopped sending): close the connection without a reply."""


def json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except UnicodeDecodeError as e:
        raise APIError(400, f"The request body is not UTF-8: {e}") from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply") from None
    except ValueError as e:                        # also integer literals of over 4300 digits
        raise APIError(400, f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object")
    try:                                   # a lone \ud800 escape is JSON but no Unicode text
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"The request body has an unpaired surrogate escape: {e}") from None
    return body


class Server(ThreadingHTTPServer):
    """`routes`: {(method, path): fn(engine, body, query[, alive])}; those in `watching` also get
    `alive`."""
    daemon_threads = True
    request_queue_size = 1024                     # a rollout process opens many connections at once

    def __init__(self, address: tuple[str, int], routes: dict, watching: set, engine,
                 api_key: str | None):
        super().__init__(address, Handler)
        self.routes = routes
        self.watching = watching
        self.engine = engine
        self.api_key = api_key or None

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a client gone mid-reply: no traceback
            super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    """One connection. Every reply, http.server's own refusals included, is in vLLM's JSON
    shape."""
    protocol_version = "HTTP/1.1"                 # keep-alive; every reply has a Content-Length
    # headers and body are two writes: without TCP_NODELAY the body waits ~40 ms for the delayed
    # ACK of the first
    disable_nagle_algorithm = True
    timeout = READ_TIMEOUT_S

    def handle_one_request(self):
        """Wait KEEP_ALIVE_S for a request to begin (http.server closes on the timeout), then give
        the rest of it READ_TIMEOUT_S (parse_request runs once its first line came)."""
        self.connection.settimeout(KEEP_ALIVE_S)
        super().handle_one_request()

    def parse_request(self):
        self.connection.settimeout(READ_TIMEOUT_S)
        return super().parse_request()

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def do_other(self):                     # a method no route has: 405 (404 for an unknown path)
        self.dispatch(self.command)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_TRACE = do_CONNECT = do_other

    def send_error(self, code, message=None, explain=None):
        """http.server's refusals (bad request line, headers, unknown method) as JSON; 501 → 405,
        as vLLM answers."""
        if code == 501:
            code, message = 405, f"Method Not Allowed: {self.command}"
        if self.request_version == "HTTP/0.9":     # an unparsable request line: still a status line
            self.request_version = "HTTP/1.0"
        self.close_connection = True
        phrase = HTTPStatus(code).phrase
        error = APIError(code, message or phrase, phrase.replace(" ", "") + "Error")
        self.reply(code, error.body())

    def dispatch(self, method: str) -> None:
        url = urlparse(self.path)
        try:
            try:
                raw = self.read_body()
                self.authorize(url.path)
                fn = self.server.routes.get((method, url.path))
                if fn is None:
                    if any(path == url.path for _, path in self.server.routes):
                        raise APIError(405, f"Method Not Allowed: {method} {url.path}",
                                       "MethodNotAllowedError")
                    raise APIError(404, f"Not Found: {method} {url.path}", "NotFoundError")
                body = json_body(raw) if method == "POST" else {}
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                args = (self.alive,) if fn in self.server.watching else ()
                status, reply = 200, fn(self.server.engine, body, query, *args)
            except APIError as e:
                status, reply = e.status, e.body()
            except Cancelled:
                raise Dropped from None
            except Exception as e:                 # a bug: answer 500 and keep serving
                traceback.print_exc()
                status = 500
                reply = APIError(500, f"{type(e).__name__}: {e}", "InternalServerError").body()
            self.close_connection = self.close_connection or status >= 500   # as uvicorn does
            self.reply(status, reply)
        except (Dropped, OSError):                 # gone mid-request, or a reply it no longer reads
            self.close_connection = True

    def authorize(self, path: str) -> None:
        """--api-key: every route but /health and /metrics needs `Authorization: Bearer <key>`."""
        key = self.server.api_key
        if key is None or path in PUBLIC_PATHS:
            return
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        given = hashlib.sha256(token.strip().encode("latin-1", "replace")).digest()
        wanted = hashlib.sha256(key.encode()).digest()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, wanted):
            raise APIError(401, "Unauthorized", bare=True)

    def read_body(self) -> bytes:
        """The body framed by Content-Length or chunked encoding, at most MAX_BODY_BYTES. A body
        whose framing is wrong leaves the connection unusable: the reply closes it."""
        length = self.headers.get("Content-Length")
        coding = self.headers.get("Transfer-Encoding")
        try:
            if coding is not None:
                if length is not None:
                    raise APIError(400, "A request cannot have both Content-Length and "
                                   "Transfer-Encoding")
                if coding.strip().lower() != "chunked":
                    raise APIError(400, f"Transfer-Encoding {coding!r:.40} is not supported "
                                   "(use chunked)")
                body = self.read_chunked()
            elif length is None:
                body = b""                         # HTTP/1.1: no framing header, no body
            elif not re.fullmatch(r"[0-9]{1,19}", length.strip()):
                raise APIError(400, f"Invalid Content-Length {length!r:.40}")
            elif int(length) > MAX_BODY_BYTES:
                raise APIError(413, f"The body ({int(length)} bytes) exceeds {MAX_BODY_BYTES} "
                               "bytes", "RequestEntityTooLargeError")
            else:
                body = self.rfile.read(int(length))
                if len(body) < int(length):
                    raise Dropped
        except APIError:
            self.close_connection = True
            raise
        except TimeoutError:
            self.close_connection = True
            raise APIError(408, f"The body did not arrive within {READ_TIMEOUT_S:g}s",
                           "RequestTimeoutError") from None
        return body

    def read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            line = self.rfile.readline(MAX_LINE)
            if not line:
                raise Dropped
            if not line.endswith(b"\n"):
                raise APIError(400, "Malformed chunked body: a chunk-size line is cut or too long")
            size = line.split(b";")[0].strip()
            if not re.fullmatch(rb"[0-9a-fA-F]{1,16}", size):
                raise APIError(400, f"Malformed chunked body: chunk size {size[:20]!r}")
            size = int(size, 16)
            if len(body) + size > MAX_BODY_BYTES:
                raise APIError(413, f"The body exceeds {MAX_BODY_BYTES} bytes",
                               "RequestEntityTooLargeError")
            if size == 0:
                break
            chunk = self.rfile.read(size)
            if len(chunk) < size:
                raise Dropped
            body += chunk
            if self.rfile.readline(MAX_LINE) not in (b"\r\n", b"\n"):
                raise APIError(400, "Malformed chunked body: a chunk is longer than its size")
        for _ in range(64):                        # trailer lines, up to the blank line
            line = self.rfile.readline(MAX_LINE)
            if line in (b"\r\n", b"\n"):
                return bytes(body)
            if not line:
                raise Dropped
        raise APIError(400, "Malformed chunked body: too many trailer lines")

    def alive(self) -> bool:
        """False once the client has closed its side (readable, and a peek finds the end of the
        stream)."""
        try:
            readable = select.poll()               # poll, not select: any descriptor number
            readable.register(self.connection, select.POLLIN)
            return not readable.poll(0) or self.connection.recv(1, socket.MSG_PEEK) != b""
        except OSError:
            return False

    def reply(self, status: int, reply) -> None:
        if reply is None:
            data, ctype = b"", "application/json"
        elif isinstance(reply, str):
            data, ctype = reply.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(reply).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        if self.close_connection:
            self.linger()

    def linger(self) -> None:
        """Closing with unread request bytes makes TCP reset the connection, and the client may
        lose the reply: stop writing, then read and discard what the client still sends, for a
        short while."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.5)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and self.connection.recv(1 << 16):
                pass
        except OSError:
            pass

    def log_message(self, format, *args):          # a line per request is noise for tests and runs
        pass
