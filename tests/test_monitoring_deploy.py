"""deploy/ without a server: promtool checks the scrape config and runs the alert rules' unit
tests (and those tests fail on a broken rule); the Grafana dashboard is what its build script
writes, validates against Grafana's own dashboard schema (grafana-foundation-sdk's types,
generated from Grafana's schema: every field known, every enum value allowed, every type
right), and names only metrics that accelab exports."""

from __future__ import annotations

import enum
import json
import re
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "accelab.json"


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool, "promtool is not installed: `make test` installs it (make monitoring: apt-get install prometheus)"
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_accepts_the_scrape_config_and_the_rules():
    checked = promtool("check", "config", "prometheus.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout
    rules = promtool("check", "rules", "accelab.rules.yml")
    assert rules.returncode == 0 and "SUCCESS: 19 rules found" in rules.stdout, rules.stdout + rules.stderr


def test_the_alert_rules_pass_their_unit_tests():
    result = promtool("test", "rules", "accelab.rules.test.yml")
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("alert", "change"),
    [
        ("AccelabHighErrorRate", ("> 0.05", "> 0.5")),  # 20% errors would no longer page
        ("AccelabKVCacheNearFull", ("5m", "3m")),  # it would fire a minute early
        (
            "AccelabReplicaDown",
            (" or max by (job, instance) (accelab_replicas_configured) * 0", ""),
        ),  # all dead: silent
    ],
)
def test_the_rule_unit_tests_fail_on_a_broken_rule(tmp_path, alert, change):
    rules = yaml.safe_load((PROMETHEUS / "accelab.rules.yml").read_text())
    [rule] = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert]
    field = "for" if change[0] == "5m" else "expr"
    assert change[0] in rule[field]
    rule[field] = rule[field].replace(*change)
    (tmp_path / "accelab.rules.yml").write_text(yaml.safe_dump(rules))
    shutil.copy(PROMETHEUS / "accelab.rules.test.yml", tmp_path)
    result = promtool("test", "rules", "accelab.rules.test.yml", cwd=tmp_path)
    assert result.returncode == 1 and f"alertname: {alert}" in result.stdout + result.stderr, result.stdout


# -- the dashboard -------------------------------------------------------------------------------------
def test_the_dashboard_is_what_its_build_script_writes():
    built = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "grafana" / "build_dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr


def schema_errors(doc: dict) -> list[str]:
    """Where `doc` breaks Grafana's dashboard schema, as grafana-foundation-sdk's types say: fields
    its decoder does not know (they do not survive a decode and encode), and values of the wrong
    type or outside an enum or Literal."""
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()  # panel options and Prometheus queries decode into their types
    decoded = Dashboard.from_json(doc)
    errors: list[str] = []
    _same(doc, json.loads(json.dumps(decoded, cls=JSONEncoder)), "$", errors)
    _walk(decoded, "$", errors)
    return errors


def _same(given, back, path: str, errors: list[str]) -> None:
    if isinstance(given, dict):
        for key, value in given.items():
            if not isinstance(back, dict) or key not in back:
                errors.append(f"{path}.{key}: not a field of the schema")
            else:
                _same(value, back[key], f"{path}.{key}", errors)
    elif isinstance(given, list):
        if not isinstance(back, list) or len(back) != len(given):
            errors.append(f"{path}: a list of {len(given)} came back as {back!r}")
        else:
            for i, (a, b) in enumerate(zip(given, back)):
                _same(a, b, f"{path}[{i}]", errors)
    elif given != back:
        errors.append(f"{path}: {given!r} came back as {back!r}")


def _walk(obj, path: str, errors: list[str]) -> None:
    from grafana_foundation_sdk.cog.runtime import UnknownDataquery

    if isinstance(obj, UnknownDataquery):
        errors.append(f"{path}: a query of no datasource type the schema knows")
        return
    for name, hint in typing.get_type_hints(type(obj)).items():
        if hasattr(obj, name):
            _check(getattr(obj, name), hint, f"{path}.{name}", errors)


def _check(value, hint, path: str, errors: list[str]) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (typing.Any, object):  # a panel's options and custom field config: typed by the panel's plugin
        if type(value).__module__.startswith("grafana_foundation_sdk"):
            _walk(value, path, errors)
        return
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        shaped = [
            h
            for h in args
            if h in (typing.Any, object)
            or typing.get_origin(h) is list
            and isinstance(value, list)
            or isinstance(h, type)
            and h.__module__.startswith("grafana")
            and not issubclass(h, enum.Enum)
            and isinstance(value, h)
        ]
        if len(shaped) == 1:  # a list, or an object of one of the types: its own errors are the errors
            _check(value, shaped[0], path, errors)
        elif not any(not _errors_of(value, h, path) for h in args):
            errors.append(f"{path}: {value!r} is none of {hint}")
    elif origin is typing.Literal:
        if value not in args:
            errors.append(f"{path}: {value!r} is not one of {args}")
    elif origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: {value!r} is not a list")
        else:
            for i, item in enumerate(value):
                _check(item, args[0], f"{path}[{i}]", errors)
    elif origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: {value!r} is not an object")
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        if value not in {member.value for member in hint}:
            errors.append(f"{path}: {value!r} is not one of {sorted(m.value for m in hint)}")
    elif hint in (bool, int, float, str):
        ok = {
            bool: lambda v: isinstance(v, bool),
            str: lambda v: isinstance(v, str),
            int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        }[hint](value)
        if not ok:
            errors.append(f"{path}: {value!r} is not a {hint.__name__}")
    elif isinstance(hint, type):
        if isinstance(value, dict) and hasattr(hint, "from_json"):  # its parent's decoder left it a dict
            value = hint.from_json(value)
        if not isinstance(value, hint):
            errors.append(f"{path}: a {type(value).__name__} where the schema has a {hint.__name__}")
        else:
            _walk(value, path, errors)
    else:
        errors.append(f"{path}: the validator does not know the type {hint!r}")


def _errors_of(value, hint, path: str) -> list[str]:
    errors: list[str] = []
    _check(value, hint, path, errors)
    return errors


def test_the_dashboard_follows_grafanas_dashboard_schema():
    doc = json.loads(DASHBOARD.read_text())
    assert schema_errors(doc) == []
    kinds = {p["type"] for p in doc["panels"]}
    assert kinds == {"row", "timeseries", "stat", "gauge", "table"}  # each kind's options were checked


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda p: p["options"]["legend"].update(displayMode="lists"), r"legend\.display_mode: 'lists' is not one of"),
        (lambda p: p["targets"][0].update(legendFormats="{{route}}"), r"targets\[0\]\.legendFormats: not a field"),
        (lambda p: p["gridPos"].update(h="8"), r"grid_pos\.h: '8' is not a int"),
        (lambda p: p["fieldConfig"]["defaults"]["thresholds"].update(mode="relative-ish"), r"mode: 'relative-ish'"),
        (lambda p: p.update(datasource={"type": "graphite", "uid": "x"}), r"no datasource type the schema knows"),
    ],
)
def test_the_schema_check_catches_what_grafana_would_not_take(mutate, expected):
    doc = json.loads(DASHBOARD.read_text())
    panel = next(p for p in doc["panels"] if p["type"] == "timeseries")
    mutate(panel)
    errors = schema_errors(doc)
    assert any(re.search(expected, e) for e in errors), errors


def test_every_metric_the_dashboard_and_rules_name_is_one_accelab_exports():
    from accelab.serve.metrics import FrontMetrics, ServeMetrics
    from accelab.serve.replica_front import merge_metrics

    class FakeCuda:  # FAKE: this machine has no GPU; the gauges only need these answers
        def is_available(self):
            return True

        def device_count(self):
            return 1

        memory_allocated = memory_reserved = max_memory_allocated = staticmethod(lambda i: 1.0)

    import accelab.serve.process_gauges as gauges

    original = gauges.gpu_gauges
    gauges.gpu_gauges = lambda registry: original(registry, cuda=FakeCuda())
    try:
        server = ServeMetrics()
    finally:
        gauges.gpu_gauges = original
    server.kv_blocks.labels(state="used").set(0)
    server.requests.labels(route="chat", status="200").inc()
    server.latency.labels(route="chat").observe(0.1)
    server.info.labels(model="m", plan="baseline", device="cpu").set(1)
    text = merge_metrics({"r1": (server.render().decode(), 1)}, FrontMetrics(1)).decode()
    exported = set(re.findall(r"^(accelab_\w+?)(?:\{| )", text, re.M))
    named = set(re.findall(r"\b(accelab_\w+)", DASHBOARD.read_text() + (PROMETHEUS / "accelab.rules.yml").read_text()))
    assert named and named <= exported, named - exported
