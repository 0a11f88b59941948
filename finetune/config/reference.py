"""The config reference: every key of the schema with its type, default and meaning, as Markdown tables
(docs/configuration.md is written from it, and a test keeps the two equal)."""

from __future__ import annotations

import json

from pydantic import BaseModel

from finetune.config.schema import RunConfig


def reference_markdown() -> str:
    """Every config key with its type, default and meaning, as Markdown tables (docs/configuration.md)."""
    lines = []
    for section, field in RunConfig.model_fields.items():
        lines += [f"**`{section}`**", "", "| key | default | meaning |", "| --- | --- | --- |"]
        lines += _reference_rows(section, field.annotation)
        lines.append("")
    return "\n".join(lines)


def _reference_rows(prefix: str, schema: type[BaseModel]) -> list[str]:
    rows = []
    for key, f in schema.model_fields.items():
        if f.is_required():
            default = "*required*"
        else:
            value = f.default_factory() if f.default_factory else f.default
            default = f"`{json.dumps(value)}`"
        rows.append(f"| `{prefix}.{key}` | {default} | {f.description or ''} |")
        nested = [a for a in getattr(f.annotation, "__args__", (f.annotation,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        for sub in nested:
            rows += _reference_rows(f"{prefix}.{key}", sub)
    return rows
