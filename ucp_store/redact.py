"""Credentials masked out of any text a person may see: messages, log lines, ``--json`` output.

A URL can carry a secret in several places, and a message may quote one whole (a catalog URL that did not
parse, a connection error, a store URL with ``?catalog=...``): ``user:password@host`` (with or without a
scheme), a query parameter whose name says it is secret (``?password=``, ``sslpassword``, ``token``,
``secret``, ``key``, ``X-Amz-Signature``, ...), and libpq's ``password=...`` keyword form. :func:`redact`
masks every one of them in a text, wherever it sits, as ``***``; what is masked is the value, so the
message still names the host, the database and the parameter. A leaf: it imports nothing of ucp_store.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "SECRET_NAMES", "SECRET_WORDS", "redact"]

MASK = "***"

#: a parameter whose name (lower case) contains one of these is a secret
SECRET_WORDS = ("password", "passwd", "secret", "token", "credential", "signature", "apikey", "api_key",
                "access_key", "accesskey", "private_key", "sslkey", "authorization")
#: a parameter of exactly one of these names (lower case) is a secret too
SECRET_NAMES = frozenset({"key", "pass", "pwd", "sig", "auth", "session", "x-amz-security-token"})

# user:password@ after a scheme, or at the start of a word without one (``ucp:secret@localhost/db``)
_USERINFO = re.compile(r"(?P<lead>(?:[A-Za-z][A-Za-z0-9+.-]*://|(?<![\w.:/@%+-]))[^\s/@:'\"<>]*):"
                       r"(?P<secret>[^\s/@'\"<>]*)@")
# name=value in a query string or a libpq keyword string; the name says whether the value is secret
_PARAM = re.compile(r"(?P<name>(?<![\w-])[A-Za-z][\w.-]*)(?P<eq>\s*=\s*)(?P<value>'(?:[^'\\]|\\.)*'|[^\s&;'\"<>,)]*)")


def _param(m: re.Match) -> str:
    name = m.group("name").lower()
    secret = name in SECRET_NAMES or any(word in name for word in SECRET_WORDS)
    if not secret or not m.group("value") or m.group("value") == MASK:
        return m.group(0)
    return f"{m.group('name')}{m.group('eq')}{MASK}"


def redact(text: object) -> str:
    """``str(text)`` with every credential masked (see the module docstring)."""
    s = str(text)
    if ":" in s and "@" in s:
        s = _USERINFO.sub(lambda m: f"{m.group('lead')}:{MASK}@" if m.group("secret") not in ("", MASK)
                          else m.group(0), s)
    if "=" in s:
        s = _PARAM.sub(_param, s)
    return s
