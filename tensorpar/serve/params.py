"""A request body's fields as the OpenAI API takes them: a bad value is a :class:`BadRequest` (HTTP 400 naming the
field, in OpenAI's error shape: :func:`error_body`), never ignored or clamped. Used by :mod:`tensorpar.serve.api`.
"""
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
