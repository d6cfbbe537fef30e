"""Getting a Plan: a preset name or a YAML file, then `--set field=value` overrides.

The Plan itself (its fields and their validation) is `accelab.plan.fields`; it is importable
from here too, as it always was. Presets are just Plans (`accelab.plan.presets`).
"""

from __future__ import annotations

import difflib
from dataclasses import fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

from accelab.plan.backend_options import OPTION_KEYS
from accelab.plan.fields import Plan, parse_max_memory, unknown_field_message
from accelab.plan.presets import PRESETS

__all__ = ["Plan", "apply_overrides", "load_plan", "parse_max_memory"]


# -- coercion of --set field=value ----------------------------------------------------------
def _coerce(name: str, raw: str) -> Any:
    hint = get_type_hints(Plan)[name]
    if raw.lower() in ("none", "null", ""):
        return None
    if hint is bool:
        if raw.lower() in ("true", "1", "yes", "on"):
            return True
        if raw.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"Plan field {name}={raw!r} must be true or false")
    if int in get_args(hint) or hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"Plan field {name}={raw!r} must be a whole number") from None
    if name in ("backend_options", "server"):
        pairs = [p.split(":", 1) for p in raw.split(";") if p]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"Plan field {name}={raw!r} must look like key:value;key:value")
        if name == "server":
            try:
                return tuple(sorted((k, int(v)) for k, v in pairs))
            except ValueError:
                raise ValueError(f"Plan field server={raw!r}: each setting must be a whole number") from None
        return tuple(sorted((k, v) for k, v in pairs))
    return raw


def apply_overrides(plan: Plan, assignments: list[str] | tuple[str, ...]) -> Plan:
    """Apply `--set field=value` assignments; the plan keeps its name with a `+` mark."""
    changes: dict[str, Any] = {}
    options: dict[str, str] = {}  # backend options set by their own name: --set ort_fusion=on
    names = {f.name for f in fields(Plan)}
    for item in assignments:
        if "=" not in item:
            raise ValueError(f"--set {item!r} must look like field=value, e.g. --set batch_size=8")
        key, raw = item.split("=", 1)
        key = key.strip().replace("-", "_")
        if key in OPTION_KEYS and key not in names:
            options[key] = raw.strip()
            continue
        if key not in names:
            raise ValueError(
                unknown_field_message(key, tuple(OPTION_KEYS)) + f"; backend options: {', '.join(OPTION_KEYS)}"
            )
        changes[key] = _coerce(key, raw.strip())
    if not changes and not options:
        return plan
    label = ",".join([f"{k}={v}" for k, v in changes.items() if k != "name"] + [f"{k}={v}" for k, v in options.items()])
    if options:
        merged = dict(changes.get("backend_options", plan.backend_options))
        changes["backend_options"] = tuple(sorted({**merged, **options}.items()))
    changes.setdefault("name", f"{plan.name}+{label}" if label else plan.name)
    return plan.with_changes(**changes)


def load_plan(ref: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Plan:
    """A preset name or a YAML file path, then `--set` overrides.

    Inline overrides name a variant in one word, for compare: `baseline[batch_size=16]`,
    `compile-static[batch_size=16;threads=1]`; they apply after `overrides`.
    """
    text = str(ref).strip()
    if text.endswith("]") and "[" in text:
        base, inline = text[:-1].split("[", 1)
        plan = load_plan(base, overrides)
        assignments = [a for a in inline.split(";") if a.strip()]
        return apply_overrides(plan, assignments).with_changes(name=text)
    if text in PRESETS:
        plan = PRESETS[text]
    elif text.endswith((".yaml", ".yml")) or Path(text).is_file():
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"plan file {text!r} does not exist; give a preset ({', '.join(PRESETS)}) or a YAML file")
        plan = Plan.from_yaml(path.read_text())
        if plan.name == "custom":
            plan = plan.with_changes(name=path.stem)
    else:
        close = difflib.get_close_matches(text, list(PRESETS), n=2)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(f"unknown plan {text!r}.{hint} Presets: {', '.join(PRESETS)}; or give a YAML plan file.")
    return apply_overrides(plan, overrides)
