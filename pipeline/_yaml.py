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


def load_yaml(path: Path) -> Located:
    """Parse ``path``; malformed YAML and duplicate keys raise ConfigError with the line."""
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(shown, "file not found", "check the path") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ConfigError(
            shown, f"cannot read: {e.__class__.__name__}", "pass a YAML file"
        ) from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(
            shown,
            f"malformed YAML: {problem}",
            "fix the syntax",
            line=mark.line + 1 if mark else None,
        ) from None
    if node is not None:
        _reject_duplicate_keys(shown, node)
    data = yaml.safe_load(text) if node is not None else None
    return Located(path, data, node)


def _reject_duplicate_keys(shown: str, node: yaml.Node) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
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
