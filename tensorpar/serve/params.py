"""A request body's fields as the OpenAI API takes them: a bad value is a :class:`BadRequest` (HTTP 400 naming the
field, in OpenAI's error shape: :func:`error_body`), never ignored or clamped. Used by :mod:`tensorpar.serve.api`.
Also the server's address checks (:func:`check_listen`, :func:`url_host`), used by :mod:`tensorpar.serve.cli`.
"""
import errno
import json
import math


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, kind: str, param: str | None, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _num(body: dict, name: str, default, kind=(int, float), lo=None, hi=None, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, kind):
        want = "an integer" if kind is int else "a number"
        raise BadRequest(f"'{name}' must be {want}, got {json.dumps(v)}", name)
    if isinstance(v, float) and not math.isfinite(v):      # Python's json reads NaN and Infinity
        raise BadRequest(f"'{name}' must be a finite number, got {v}", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise BadRequest(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise BadRequest(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` once and release it, so that an address in use or not on this machine is refused before
    the ranks load the model (another process can still take the port in between). Raises ValueError."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror or e})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)        # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as e:
            hint = ("another process listens there; pick another --port, or --port 0 for any free one"
                    if e.errno == errno.EADDRINUSE else "use an address of this machine, e.g. 127.0.0.1 or 0.0.0.0")
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); {hint}") from None


def url_host(host: str) -> str:
    """``host`` as it goes in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host
