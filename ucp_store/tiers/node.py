"""Node identity and the node's fast-tier folder (issue 38).

The node name: the argument, else ``UCP_NODE`` (``config.node``), else the host name, so that tests and
harnesses run several "nodes" on one machine. The fast tier's folder: the argument ``fast_tier=``, else
``UCP_FAST_TIER`` (``config.fast_tier``): a path template that may name ``{node}`` (``/dev/shm/ucp/{node}``);
without ``{node}`` the node's name is appended as a subfolder, so two nodes never share one folder.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from ucp_store import config
from ucp_store.errors import ConfigurationError

__all__ = ["node_name", "fast_tier_root", "check_node"]

_MAX_NODE = 255  # placements.node is String(255)


def check_node(name: str, where: str = "node") -> str:
    """``name`` when it is a usable node name (a non-empty single path component of at most 255 characters,
    no NUL, not ``.``/``..``); else ConfigurationError naming ``where``."""
    if not isinstance(name, str) or not name or len(name) > _MAX_NODE or name in (".", "..") \
            or "/" in name or "\\" in name or "\0" in name or name != name.strip():
        raise ConfigurationError(f"{where}={name!r}: expected a node name (1-{_MAX_NODE} characters, one path "
                                 "component: no '/', '\\\\', NUL, surrounding blanks, '.' or '..')")
    return name


def node_name(node: str | None = None) -> str:
    """This process's node: ``node``, else ``UCP_NODE``, else the host name (validated by :func:`check_node`)."""
    if node is not None:
        return check_node(node, "node")
    configured = config.node()
    if configured is not None:
        return check_node(configured, "UCP_NODE")
    return check_node(socket.gethostname() or "localhost", "the host name")


def fast_tier_root(fast_tier: str | os.PathLike | None = None, node: str | None = None) -> Path | None:
    """The fast tier's folder of ``node`` (default: this node), or None when no fast tier is configured.

    ``fast_tier`` (else ``UCP_FAST_TIER``) is a path template: ``{node}`` is replaced by the node name;
    without it the node name is appended as a subfolder. The folder is not created here."""
    where = "fast_tier"
    template = os.fspath(fast_tier) if fast_tier is not None else None
    if template is None:
        template, where = config.fast_tier(), "UCP_FAST_TIER"
    if template is None:
        return None
    if not template or "://" in template:
        raise ConfigurationError(f"{where}={template!r}: expected a node-local folder path (may contain {{node}}), "
                                 "not a URL")
    name = node_name(node)
    if "{node}" in template:
        rest = template.replace("{node}", "")
        if "{" in rest or "}" in rest:
            raise ConfigurationError(f"{where}={template!r}: the only field a fast-tier template may name is {{node}}")
        return Path(template.replace("{node}", name)).absolute()
    return (Path(template) / name).absolute()
