"""A YAML loader that remembers where every mapping key sits, so errors can point at the line."""

from __future__ import annotations

import yaml


class Located(dict):
    """A mapping that knows its own line and each key's line (1-based)."""

    line: int | None = None
    key_lines: dict


class LocatedList(list):
    line: int | None = None
    item_lines: list


class _Loader(yaml.SafeLoader):
    pass


def _mapping(loader: _Loader, node: yaml.MappingNode) -> Located:
    out = Located()
    out.line, out.key_lines = node.start_mark.line + 1, {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


def _sequence(loader: _Loader, node: yaml.SequenceNode) -> LocatedList:
    out = LocatedList(loader.construct_object(child, deep=True) for child in node.value)
    out.line, out.item_lines = node.start_mark.line + 1, [child.start_mark.line + 1 for child in node.value]
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _sequence)
# YAML 1.1 reads "1e-4" as a string; recipes are full of learning rates, so accept exponent floats.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    __import__("re").compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def load(text: str):
    return yaml.load(text, Loader=_Loader)
