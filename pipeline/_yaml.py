"""YAML loading that remembers where each value came from, so errors can name file:line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import ConfigError


class Located:
    """Parsed YAML data plus the line of every mapping key and sequence item."""

    def __init__(self, path: Path, data: Any, node: yaml.Node | None) -> None:
        self.path = path
        self.data = data
        self._node = node

    def line_of(self, loc: Sequence[str | int]) -> int | None:
        """1-based line of the deepest node along ``loc`` that exists."""
        node = self._node
        line = node.start_mark.line + 1 if node is not None else None
        for part in loc:
            child = _child(node, part)
            if child is None:
                break
            node = child
            line = node.start_mark.line + 1
        return line


def _child(node: yaml.Node | None, part: str | int) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == part:
                # The key's line reads better than the value's for nested blocks.
                return value if isinstance(value, yaml.ScalarNode) else _Keyed(key, value)
    if isinstance(node, _Keyed):
        return _child(node.value, part)
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
        return node.value[part]
    return None


class _Keyed:
    """A mapping value that reports its key's position."""

    def __init__(self, key: yaml.Node, value: yaml.Node) -> None:
        self.start_mark = key.start_mark
        self.value = value


# Configs and grids are a few levels deep; anything deeper is a mistake or an attack, and
# PyYAML's composer recurses once a level (100000 `[` would end in RecursionError).
MAX_DEPTH = 32


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses, while composing, what configs never need but attackers use.

    * Aliases (``*name``) are refused outright. No file in configs/ or buckets/, no doc and no
      test uses anchors, and the schema is small enough to write out in full. A cap on the
      number of aliases would not be enough: 81 aliases (9 levels of 9) already expand to 9**9
      values in every walk of the data (duplicate-key check, pydantic), the "billion laughs".
      Refusing them also keeps every value's line its own (an alias would report its anchor's).
    * Explicit tags (``!!python/object:...``, ``!foo``, ``!!int``) are refused: the safe
      constructor rejects the unknown ones with a traceback, and the known ones only convert a
      plain value that quoting or leaving the tag off expresses as well.
    * Nesting deeper than MAX_DEPTH.
    """

    def __init__(self, text: str, shown: str) -> None:
        super().__init__(text)
        self._shown = shown
        self._depth = 0

    def _refuse(self, why: str, hint: str, event: yaml.Event) -> ConfigError:
        return ConfigError(self._shown, why, hint, line=event.start_mark.line + 1)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise self._refuse(
                f"YAML alias '*{event.anchor}' is not supported",
                "write the value out in full instead of referring to an anchor",
                event,
            )
        tag = getattr(event, "tag", None)
        if tag is not None:
            # Show `!!int` as written, not its expansion `tag:yaml.org,2002:int`.
            tag = tag.replace("tag:yaml.org,2002:", "!!", 1)
            raise self._refuse(
                f"YAML tag '{tag}' is not supported",
                "remove the tag; quote the value if it must stay a string",
                event,
            )
        if self._depth >= MAX_DEPTH:
            raise self._refuse(
                f"nested deeper than {MAX_DEPTH} levels",
                "configs and grids are a few levels deep; check the brackets and indentation",
                event,
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # Plain values that match a YAML type but do not convert (2024-13-45, an int of 5000
        # digits) raise ValueError from deep inside the constructor, with no line.
        try:
            return super().construct_object(node, deep=deep)
        except ConfigError:
            raise
        except (ValueError, TypeError, OverflowError) as e:
            raise ConfigError(
                self._shown,
                f"cannot read the value: {e}",
                "fix the value, or quote it to keep it a string",
                line=node.start_mark.line + 1,
            ) from None


def load_yaml(path: Path) -> Located:
    """Parse ``path`` safely; every problem raises ConfigError with the file and line.

    Malformed YAML, duplicate or non-scalar keys, aliases, tags and deep nesting are refused.
    """
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(shown, "file not found", "check the path") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ConfigError(
            shown, f"cannot read: {e.__class__.__name__}", "pass a YAML file"
        ) from None
    loader = _StrictLoader(text, shown)
    try:
        # One parse: the node tree (for lines and checks) and the data built from it.
        node = loader.get_single_node()
        if node is not None:
            _reject_duplicate_keys(shown, node)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            shown,
            f"malformed YAML: {problem}",
            "fix the syntax",
            line=mark.line + 1 if mark else None,
        ) from None
    finally:
        loader.dispose()
    return Located(path, data, node)


def _reject_duplicate_keys(shown: str, node: yaml.Node) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                # `? [a, b]: c`: no config key is a list or mapping, and it is unhashable.
                raise ConfigError(
                    shown,
                    "a key must be a plain name, not a list or mapping",
                    "write the key as a plain name",
                    line=key.start_mark.line + 1,
                )
            k = key.value
            if k in seen:
                raise ConfigError(
                    shown,
                    f"duplicate key '{k}' (first at line {seen[k]})",
                    "keep one",
                    line=key.start_mark.line + 1,
                    field=k,
                )
            seen[k] = key.start_mark.line + 1
            _reject_duplicate_keys(shown, value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _reject_duplicate_keys(shown, item)
