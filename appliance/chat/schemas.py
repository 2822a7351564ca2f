"""JSON Schemas that no finite JSON value matches: the one check llguidance leaves to sampling.

llguidance refuses an unsatisfiable schema it can see locally (``minLength`` above ``maxLength``,
an empty ``enum``, types that cannot meet) when it compiles it, but it compiles a schema whose
recursion never ends, such as ``{"type": "object", "properties": {"a": {"$ref": "#"}},
"required": ["a"]}`` (every value needs another inside it), and only fails while sampling
("ParserTooComplex"), after the answer has started. ``no_finite_value`` finds such a schema
before anything is generated: the schemas that have a finite value are found as a grammar's
productive symbols are, a least fixpoint over the schema's local references (``#...``).

It errs on the side of accepting: a keyword it does not model is taken to allow a value, and a
reference it cannot resolve is left to llguidance. It never raises on a malformed schema.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

#: Types whose values need no other value inside them.
_LEAF_TYPES = frozenset({"string", "number", "integer", "boolean", "null"})


def no_finite_value(schema: Any) -> str | None:
    """Why ``schema`` has no finite JSON value (its required recursion never ends), or None when
    it has one (or this check cannot tell)."""
    refs = {ref: _resolve(schema, ref) for ref in set(_refs(schema))}
    finite = {ref: False for ref, target in refs.items() if target is not _UNRESOLVED}
    changed = True
    while changed:  # least fixpoint: a reference is finite once its target is, given the others
        changed = False
        for ref, known in finite.items():
            if not known and _finite(refs[ref], finite):
                finite[ref] = changed = True
    if _finite(schema, finite):
        return None
    return _why(schema, "#", schema, finite, seen=set())


class _Unresolved:
    pass


_UNRESOLVED = _Unresolved()


def _refs(node: Any) -> Iterator[str]:
    """Every local ``$ref`` (``#...``) anywhere in ``node``."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            ref = item.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                yield ref
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _array_index(part: str) -> int | None:
    """A JSON Pointer's array index: ASCII digits only (``str.isdigit`` is true for "²", which
    ``int`` refuses) and short enough for ``int``."""
    return int(part) if part.isascii() and part.isdigit() and len(part) <= 9 else None


def _resolve(root: Any, ref: str) -> Any:
    """The schema ``ref`` (a JSON Pointer fragment) names in ``root``, or ``_UNRESOLVED``."""
    node = root
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return _UNRESOLVED  # an anchor name ("#foo"): left to llguidance
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif (
            isinstance(node, list)
            and part.isascii()
            and part.isdigit()
            and len(part) <= 9
            and int(part) < len(node)
        ):
            node = node[int(part)]
        else:
            return _UNRESOLVED
    return node


def _finite(node: Any, finite: Mapping[str, bool]) -> bool:
    """Whether ``node`` has a finite value, given which references do (``finite``)."""
    return _failing(node, finite) is None


def _failing(node: Any, finite: Mapping[str, bool]) -> tuple[str, Any, str] | None:
    """None if ``node`` has a finite value; else the first cause: (what, the subschema at fault
    or None, the subschema's path relative to ``node``)."""
    if node is False:
        return ("allows no value (false)", None, "")
    if not isinstance(node, Mapping):
        return None
    ref = node.get("$ref")
    if isinstance(ref, str) and finite.get(ref, True) is False:
        return (f"refers to '{ref}'", None, "")
    for i, part in enumerate(_list(node.get("allOf"))):
        if not _finite(part, finite):
            return ("", part, f"/allOf/{i}")
    for keyword in ("anyOf", "oneOf"):
        branches = _list(node.get(keyword))
        if branches and not any(_finite(b, finite) for b in branches):
            return (f"has no branch of {keyword} with a finite value", None, "")
    if "const" in node or "enum" in node:
        return None  # a literal value; whether it fits the rest is llguidance's check
    types = node.get("type")
    kinds = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if kinds is None or kinds & _LEAF_TYPES or not kinds & {"object", "array"}:
        return None  # a scalar will do (an unknown type is llguidance's to refuse)
    causes = []
    if "object" in kinds:
        cause = _object_failing(node, finite)
        if cause is None:
            return None
        causes.append(cause)
    if "array" in kinds:
        cause = _array_failing(node, finite)
        if cause is None:
            return None
        causes.append(cause)
    return causes[0]


def _object_failing(node: Mapping[str, Any], finite: Mapping[str, bool]) -> tuple[str, Any, str] | None:
    properties = node.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    for name in _list(node.get("required")):
        if not isinstance(name, str):
            continue
        if name in properties:
            schema, path = properties[name], f"/properties/{_escape(name)}"
        elif node.get("patternProperties"):
            continue  # a pattern may match it; not modelled
        else:
            schema, path = node.get("additionalProperties", True), "/additionalProperties"
        if not _finite(schema, finite):
            return (f"requires property '{name}'", schema, path)
    return None


def _array_failing(node: Mapping[str, Any], finite: Mapping[str, bool]) -> tuple[str, Any, str] | None:
    least = node.get("minItems", 0)
    least = least if isinstance(least, int) and not isinstance(least, bool) else 0
    items = node.get("items", True)
    prefix = _list(node.get("prefixItems")) or (items if isinstance(items, list) else [])
    rest = node.get("additionalItems", True) if isinstance(items, list) else items
    for i in range(min(least, len(prefix) + 1)):
        schema, path = (prefix[i], f"/prefixItems/{i}") if i < len(prefix) else (rest, "/items")
        if not _finite(schema, finite):
            return (f"requires at least {least} items", schema, path)
    contains = node.get("contains")
    if contains is not None and node.get("minContains", 1) != 0 and not _finite(contains, finite):
        return ("must contain an item", contains, "/contains")
    return None


def _why(node: Any, path: str, root: Any, finite: Mapping[str, bool], seen: set[str]) -> str:
    """The chain of requirements from ``node`` (at ``path``) to where a value would need
    another inside it without end."""
    seen.add(path)
    cause = _failing(node, finite)
    if cause is None:
        return f"{path} needs itself"
    what, sub, relative = cause
    if sub is not None:
        inner = _why(sub, path + relative, root, finite, seen)
        return f"{path} {what}, and {inner}" if what else inner
    ref = node.get("$ref") if isinstance(node, Mapping) else None
    if isinstance(ref, str) and what.startswith("refers") and ref not in seen:
        return f"{path} {what}, and {_why(_resolve(root, ref), ref, root, finite, seen)}"
    return f"{path} {what}"


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list) else []


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
