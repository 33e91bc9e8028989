"""Name maps for Hugging Face export: rename rules and fused-parameter splits, as data (JSON), not model code.

A training checkpoint often names and fuses tensors differently from the Hugging Face model class that
will load it: a fused QKV projection (with GQA, K and V have fewer rows than Q) or a fused SwiGLU
gate/up, against HF Llama's separate ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj`` and ``up_proj``.
A map file says how stored names become HF names::

    {
      "format": "ucp-hf-map/1",
      "description": "...",
      "variables": {"head_dim": "hidden_size // num_attention_heads"},
      "unmatched": "keep",
      "rules": [
        {"match": "model.layers.{i}.self_attn.qkv_proj.weight",
         "split": {"dim": 0,
                   "sizes": ["num_attention_heads * head_dim", "num_key_value_heads * head_dim",
                             "num_key_value_heads * head_dim"],
                   "into": ["model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.k_proj.weight",
                            "model.layers.{i}.self_attn.v_proj.weight"]}},
        {"match": "layers.{i}.attention.dense.weight", "rename": "model.layers.{i}.self_attn.o_proj.weight"},
        {"match": "rotary.inv_freq", "drop": true}
      ]
    }

``match`` is a stored tensor name with ``{placeholder}`` parts (each matches one dotted component);
the first rule that matches wins. ``sizes`` are integers or arithmetic over ``config.json`` values
(``+ - * //`` and parentheses; ``variables`` supply values the config lacks). A stored tensor whose
pattern is ``fused`` already knows its sub-parameter sizes and dimension, so its rule may leave
``sizes`` (and ``dim``) out; where the map gives them too they must agree. ``unmatched`` says what
happens to a tensor no rule matches: ``keep`` (its stored name), ``drop``, or ``error``.

Every problem (unknown keys, sizes that do not add up to the tensor's dimension, two outputs with the
same name, an unknown config value) is a :class:`~ucp_store.errors.ConfigurationError` that names the
map file, the rule and the tensor. Shipped maps live in ``ucp_store/formats/hf/maps/`` (``--map llama``).
"""

from __future__ import annotations

import ast
import difflib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ucp_store.errors import ConfigurationError

__all__ = ["NameMap", "Piece", "load_map", "shipped_maps", "plan_outputs"]

FORMAT = "ucp-hf-map/1"
_TOP_KEYS = ("format", "description", "variables", "unmatched", "rules")
_RULE_KEYS = ("match", "rename", "split", "drop", "description")
_SPLIT_KEYS = ("dim", "sizes", "into")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Piece:
    """One output tensor: ``source`` (a catalog ``TensorInfo``) narrowed to ``[start, stop)`` along
    ``dim`` (``dim is None``: the whole tensor), written under ``name``."""

    name: str
    source: Any
    dim: int | None = None
    start: int = 0
    stop: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.source.shape)
        if self.dim is None:
            return shape
        return shape[:self.dim] + (self.stop - self.start,) + shape[self.dim + 1:]


def _unknown(keys: Iterable[str], allowed: tuple[str, ...], where: str) -> None:
    for k in keys:
        if k not in allowed:
            near = difflib.get_close_matches(k, allowed, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigurationError(f"{where}: unknown key {k!r}{hint} (allowed: {', '.join(allowed)})")


class _Expr:
    """An integer expression over config values (names, integers, + - * // and parentheses)."""

    _OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
            ast.FloorDiv: lambda a, b: a // b}

    def __init__(self, text: Any, where: str):
        self.where = where
        self.text = text
        if isinstance(text, bool) or not isinstance(text, (int, str)):
            raise ConfigurationError(f"{where}: a size must be an integer or an expression string, got {text!r}")
        if isinstance(text, int):
            self.tree = None
            return
        try:
            self.tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            raise ConfigurationError(f"{where}: size expression {text!r} is not valid arithmetic") from None
        self._check(self.tree)

    def _check(self, node) -> None:
        if isinstance(node, ast.BinOp) and type(node.op) in self._OPS:
            self._check(node.left)
            self._check(node.right)
        elif isinstance(node, ast.Name) or (isinstance(node, ast.Constant) and isinstance(node.value, int)
                                             and not isinstance(node.value, bool)):
            return
        else:
            raise ConfigurationError(f"{self.where}: size expression {self.text!r} may only use config names, "
                                     "integers, + - * // and parentheses")

    def names(self) -> set[str]:
        if self.tree is None:
            return set()
        return {n.id for n in ast.walk(self.tree) if isinstance(n, ast.Name)}

    def value(self, env: Mapping[str, Any], what: str) -> int:
        if self.tree is None:
            return int(self.text)

        def ev(node) -> int:
            if isinstance(node, ast.Constant):
                if isinstance(node.value, bool) or not isinstance(node.value, int):  # _check admits int only
                    raise ConfigurationError(f"{self.where}: size expression {self.text!r} has the non-integer "
                                             f"constant {node.value!r}")
                return node.value
            if isinstance(node, ast.Name):
                if node.id not in env:
                    near = difflib.get_close_matches(node.id, list(env), n=1)
                    hint = f"; did you mean {near[0]!r}?" if near else ""
                    raise ConfigurationError(f"{self.where}: size {self.text!r} for {what} needs {node.id!r}, which "
                                             f"neither config.json nor the map's variables define{hint}")
                v = env[node.id]
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ConfigurationError(f"{self.where}: size {self.text!r} for {what}: config value "
                                             f"{node.id!r} is {v!r}, not an integer")
                return v
            return self._OPS[type(node.op)](ev(node.left), ev(node.right))

        return ev(self.tree)


@dataclass
class _Rule:
    index: int
    match: str
    regex: re.Pattern
    rename: str | None = None
    drop: bool = False
    dim: int | None = None
    sizes: list[_Expr] | None = None
    into: list[str] | None = None

    @property
    def where(self) -> str:
        return f"rule {self.index} ({self.match!r})"


class NameMap:
    """A validated map file: ``plan(infos, config)`` turns stored tensors into output :class:`Piece` s."""

    def __init__(self, data: Any, *, origin: str = "<map>"):
        self.origin = origin
        if not isinstance(data, dict):
            raise ConfigurationError(f"name map {origin}: expected a JSON object, got {type(data).__name__}")
        _unknown(data, _TOP_KEYS, f"name map {origin}")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise ConfigurationError(f"name map {origin}: format {fmt!r} is not {FORMAT!r}")
        self.unmatched = data.get("unmatched", "keep")
        if self.unmatched not in ("keep", "drop", "error"):
            raise ConfigurationError(f"name map {origin}: 'unmatched' must be keep, drop or error, "
                                     f"got {self.unmatched!r}")
        variables = data.get("variables", {})
        if not isinstance(variables, dict):
            raise ConfigurationError(f"name map {origin}: 'variables' must be an object of name -> expression")
        self.variables = {k: _Expr(v, f"name map {origin} variable {k!r}") for k, v in variables.items()}
        rules = data.get("rules", [])
        if not isinstance(rules, list):
            raise ConfigurationError(f"name map {origin}: 'rules' must be a list")
        self.rules = [self._rule(i, r) for i, r in enumerate(rules)]

    def _rule(self, i: int, r: Any) -> _Rule:
        where = f"name map {self.origin} rule {i}"
        if not isinstance(r, dict):
            raise ConfigurationError(f"{where}: expected an object, got {r!r}")
        _unknown(r, _RULE_KEYS, where)
        match = r.get("match")
        if not isinstance(match, str) or not match:
            raise ConfigurationError(f"{where}: 'match' (a stored tensor name, with {{placeholders}}) is required")
        where = f"name map {self.origin} rule {i} ({match!r})"
        actions = [k for k in ("rename", "split", "drop") if k in r]
        if len(actions) != 1:
            raise ConfigurationError(f"{where}: give exactly one of 'rename', 'split', 'drop' (got "
                                     f"{', '.join(actions) or 'none'})")
        placeholders = _PLACEHOLDER.findall(match)
        if len(set(placeholders)) != len(placeholders):
            raise ConfigurationError(f"{where}: a placeholder appears twice in 'match'")
        regex, pos = [], 0
        for m in _PLACEHOLDER.finditer(match):
            regex.append(re.escape(match[pos:m.start()]))
            regex.append(f"(?P<{m.group(1)}>[^./]+)")
            pos = m.end()
        regex.append(re.escape(match[pos:]))
        rule = _Rule(i, match, re.compile("".join(regex) + r"\Z"))

        def template(t: Any, key: str) -> str:
            if not isinstance(t, str) or not t:
                raise ConfigurationError(f"{where}: {key} must be a non-empty name, got {t!r}")
            for p in _PLACEHOLDER.findall(t):
                if p not in placeholders:
                    raise ConfigurationError(f"{where}: {key} {t!r} uses {{{p}}}, which 'match' does not define "
                                             f"(it defines: {', '.join(placeholders) or 'nothing'})")
            return t

        if "rename" in r:
            rule.rename = template(r["rename"], "'rename'")
        elif "drop" in r:
            if r["drop"] is not True:
                raise ConfigurationError(f"{where}: 'drop' must be true")
            rule.drop = True
        else:
            split = r["split"]
            if not isinstance(split, dict):
                raise ConfigurationError(f"{where}: 'split' must be an object with dim, sizes, into")
            _unknown(split, _SPLIT_KEYS, f"{where} split")
            into = split.get("into")
            if not isinstance(into, list) or len(into) < 2:
                raise ConfigurationError(f"{where}: split 'into' must list at least two output names")
            rule.into = [template(t, "split 'into' name") for t in into]
            if len(set(rule.into)) != len(rule.into):
                raise ConfigurationError(f"{where}: split 'into' names the same output twice")
            if "dim" in split:
                d = split["dim"]
                if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                    raise ConfigurationError(f"{where}: split 'dim' must be a non-negative integer, got {d!r}")
                rule.dim = d
            if "sizes" in split:
                sizes = split["sizes"]
                if not isinstance(sizes, list) or len(sizes) != len(rule.into):
                    raise ConfigurationError(f"{where}: split 'sizes' must list one size per 'into' name "
                                             f"({len(rule.into)}), got {sizes!r}")
                rule.sizes = [_Expr(s, f"{where} split") for s in sizes]
        return rule

    # --- planning --------------------------------------------------------------------------------
    def _env(self, config: Mapping[str, Any] | None) -> dict[str, Any]:
        env = dict(config or {})
        for name, expr in self.variables.items():  # config values win over the map's defaults
            if name not in env:
                env[name] = expr.value(env, f"variable {name!r}")
        return env

    def plan(self, infos: Iterable[Any], config: Mapping[str, Any] | None = None) -> list[Piece]:
        """Output pieces for ``infos`` (catalog records, in output order); raises on any inconsistency."""
        env = None
        out: list[Piece] = []
        for info in infos:
            rule, groups = self._match(info.name)
            if rule is None:
                if self.unmatched == "error":
                    raise ConfigurationError(f"name map {self.origin}: no rule matches tensor {info.name!r} "
                                             "(and 'unmatched' is 'error')")
                if self.unmatched == "keep":
                    out.append(Piece(info.name, info))
                continue
            if rule.drop:
                continue
            if rule.rename is not None:
                out.append(Piece(rule.rename.format(**groups), info))
                continue
            if env is None:
                env = self._env(config)
            out.extend(self._split(rule, groups, info, env))
        seen: dict[str, Piece] = {}
        for p in out:
            if p.name in seen:
                a, b = seen[p.name].source.name, p.source.name
                raise ConfigurationError(f"name map {self.origin}: output name {p.name!r} is produced twice (from "
                                         f"stored tensor {a!r} and from {b!r}); two tensors cannot share one HF name")
            seen[p.name] = p
        return out

    def _match(self, name: str) -> tuple[_Rule | None, dict[str, str]]:
        for rule in self.rules:
            m = rule.regex.match(name)
            if m:
                return rule, m.groupdict()
        return None, {}

    def _split(self, rule: _Rule, groups: dict, info: Any, env: dict) -> list[Piece]:
        where = f"name map {self.origin} {rule.where}"
        what = f"stored tensor {info.name!r} (shape {list(info.shape)})"
        into = rule.into
        if into is None:  # plan() splits only with a split rule, which always has 'into'
            raise ConfigurationError(f"{where}: {what}: the rule has no split 'into' names")
        pattern = info.pattern if isinstance(info.pattern, dict) else None
        fused = pattern if pattern and pattern.get("kind") == "fused" else None
        dim = rule.dim
        if fused is not None:
            fdim, fsizes = int(fused.get("dim", 0)), [int(s) for s in fused["sizes"]]
            if dim is not None and dim != fdim:
                raise ConfigurationError(f"{where}: split dim {dim} disagrees with the fused pattern of {what} "
                                         f"(dim {fdim})")
            dim = fdim
            if len(fsizes) != len(into):
                raise ConfigurationError(f"{where}: {what} fuses {len(fsizes)} sub-parameters (sizes {fsizes}) but "
                                         f"the rule splits it into {len(into)}")
            if rule.sizes is not None:
                mine = [s.value(env, what) for s in rule.sizes]
                if mine != fsizes:
                    raise ConfigurationError(f"{where}: sizes {mine} disagree with the fused pattern of {what} "
                                             f"(sizes {fsizes})")
            sizes = fsizes
        else:
            if rule.sizes is None:
                raise ConfigurationError(f"{where}: {what} has no 'fused' pattern, so the rule must give 'sizes'")
            sizes = [s.value(env, what) for s in rule.sizes]
            dim = 0 if dim is None else dim
        if dim >= len(info.shape):
            raise ConfigurationError(f"{where}: split dim {dim} does not exist in {what}")
        if any(s <= 0 for s in sizes) or sum(sizes) != info.shape[dim]:
            raise ConfigurationError(f"{where}: sizes {sizes} add up to {sum(sizes)}, but dim {dim} of {what} has "
                                     f"{info.shape[dim]} (check the config values the sizes use)")
        pieces, start = [], 0
        for name, size in zip(into, sizes):
            pieces.append(Piece(name.format(**groups), info, dim, start, start + size))
            start += size
        return pieces


def shipped_maps() -> dict[str, str]:
    """``{name: path}`` of the maps shipped in ``ucp_store/formats/hf/maps``."""
    root = resources.files("ucp_store.formats.hf") / "maps"
    out = {}
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.endswith(".json"):
                out[entry.name[:-5]] = str(entry)
    return out


def load_map(spec: "str | os.PathLike | Mapping | NameMap") -> NameMap:
    """A map from a file path, a shipped map's name (``llama``), a dict, or a NameMap."""
    if isinstance(spec, NameMap):
        return spec
    if isinstance(spec, Mapping):
        return NameMap(dict(spec))
    path = os.fspath(spec)
    if not os.path.exists(path):
        shipped = shipped_maps()
        if path in shipped:
            path = shipped[path]
        else:
            near = difflib.get_close_matches(os.path.basename(path), list(shipped), n=1)
            hint = f"; did you mean the shipped map {near[0]!r}?" if near else ""
            raise ConfigurationError(f"name map {path}: no such file, and no shipped map of that name (shipped: "
                                     f"{', '.join(sorted(shipped)) or 'none'}){hint}")
    from ucp_store.formats.base import parse_json
    from ucp_store.inputs import read_regular

    raw = read_regular(path, "name map", ConfigurationError)
    return NameMap(parse_json(raw, f"name map {path}", error=ConfigurationError), origin=path)


def plan_outputs(infos: Iterable[Any], name_map: "NameMap | None", config: Mapping[str, Any] | None) -> list[Piece]:
    """Output pieces: through ``name_map`` when given, else every tensor under its stored name."""
    if name_map is None:
        return [Piece(i.name, i) for i in infos]
    return name_map.plan(infos, config)
