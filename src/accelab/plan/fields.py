"""Plan: how to run a model. Frozen, validated, YAML round-trip: every field, its allowed
values and the errors that name them.

A Plan says nothing about the device it runs on: whether a technique is supported here is
decided when it is applied (see `accelab.plan.apply`), and a Result carries the reason.
Getting one (a preset, a YAML file, `--set` overrides) is `accelab.plan.plan.load_plan`.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

from accelab.plan.backend_options import check_options

Precision = Literal["fp32", "bf16-autocast", "fp16-autocast", "bf16-weights", "fp16-weights", "fp8"]
CompileMode = Literal["off", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
CompileScope = Literal["model", "regional"]
Attention = Literal["default", "eager", "sdpa", "flash_attention_2", "flex_attention"]
Quantization = Literal["none", "int8-weight", "int8-dynamic", "int4-weight"]
KVCache = Literal["dynamic", "static"]
Placement = Literal["auto", "cpu", "cuda", "device-map", "cpu-offload", "disk-offload"]
MemoryFormat = Literal["contiguous", "channels_last"]
Backend = Literal["torch", "onnxruntime", "openvino", "llamacpp", "vllm"]
Tristate = Literal["auto", "on", "off"]
# `accelab serve` options a Plan may carry (`Plan.server`): how many sequences decode at once,
# the tokens of one step, the KV cache's tokens
SERVER_SETTINGS = ("max_batch_size", "max_step_tokens", "kv_cache_tokens")


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Every way accelab can change how a model runs. Defaults are the fp32 eager baseline."""

    name: str = "custom"
    precision: Precision = "fp32"
    compile: CompileMode = "off"
    compile_dynamic: Tristate = "auto"
    compile_fullgraph: bool = False
    compile_scope: CompileScope = "model"
    attention: Attention = "default"
    quantization: Quantization = "none"
    quantize_head: bool = False  # quantize the output head (lm_head) too; by default it keeps its precision
    batch_size: int | None = None  # None: the workload's batch size
    kv_cache: KVCache = "dynamic"
    placement: Placement = "auto"
    max_memory: str | None = None  # "cuda:0=4GiB,cpu=20GiB", for device-map / offload
    threads: int | None = None  # intra-op threads; None: torch's default
    interop_threads: int | None = None
    memory_format: MemoryFormat = "contiguous"
    tf32: bool = False
    cudnn_benchmark: bool = False
    backend: Backend = "torch"
    backend_options: tuple[tuple[str, str], ...] = ()  # ("ort_opt_level", "99"), ...
    # the `accelab serve` settings a serving tune measured this plan with (SERVER_SETTINGS); the
    # server takes them where its own options are left at their defaults
    server: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        hints = get_type_hints(Plan)
        for f in fields(self):
            _check_field(f.name, getattr(self, f.name), hints[f.name])
        for name in ("batch_size", "threads", "interop_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"Plan field {name}={value} is out of range: it must be 1 or more (or unset)")
        if self.max_memory is not None:
            parse_max_memory(self.max_memory)
        if self.backend_options:
            check_options(self.backend, dict(self.backend_options))
        for key, value in self.server:
            if key not in SERVER_SETTINGS:
                names = ", ".join(SERVER_SETTINGS)
                raise ValueError(f"Plan field server has {key!r}; the server settings are: {names}")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Plan field server: {key}={value!r} must be a whole number, 1 or more")
        if self.quantize_head and self.quantization == "none":
            raise ValueError("Plan field quantize_head=true needs a quantization (e.g. quantization=int8-weight)")
        if self.placement in ("device-map", "cpu-offload", "disk-offload") and self.backend != "torch":
            raise ValueError(f"placement={self.placement!r} needs backend='torch' (got {self.backend!r})")

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["backend_options"] = dict(self.backend_options)
        data["server"] = dict(self.server)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(unknown_field_message(sorted(unknown)[0]))
        data = dict(data)
        if isinstance(data.get("backend_options"), dict):
            data["backend_options"] = tuple(sorted((str(k), str(v)) for k, v in data["backend_options"].items()))
        if isinstance(data.get("server"), dict):
            data["server"] = tuple(sorted((str(k), v) for k, v in data["server"].items()))
        return cls(**data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> Plan:
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError("a plan file must be a YAML mapping of field: value")
        return cls.from_dict(data)

    def with_changes(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def differs_from_baseline(self) -> list[str]:
        """Names of the fields that differ from the fp32 eager baseline (for notes and tables)."""
        base = Plan()
        return [f.name for f in fields(self) if f.name != "name" and getattr(self, f.name) != getattr(base, f.name)]

    @property
    def option(self) -> dict[str, str]:
        return dict(self.backend_options)


def _allowed(hint: Any) -> tuple | None:
    if get_origin(hint) is Literal:
        return get_args(hint)
    for arg in get_args(hint):  # Optional[Literal[...]]
        if get_origin(arg) is Literal:
            return get_args(arg)
    return None


def _check_field(name: str, value: Any, hint: Any) -> None:
    allowed = _allowed(hint)
    if allowed is not None and value not in allowed:
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint_text = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"Plan field {name}={value!r} is not allowed{hint_text}; choose one of: {', '.join(map(str, allowed))}"
        )
    if hint is bool and not isinstance(value, bool):
        raise ValueError(f"Plan field {name}={value!r} must be true or false")


def unknown_field_message(name: str, also: list[str] | tuple[str, ...] = ()) -> str:
    names = [f.name for f in fields(Plan)]
    close = difflib.get_close_matches(name, [*names, *also], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown Plan field {name!r}{hint}; fields are: {', '.join(names)}"


def parse_max_memory(text: str) -> dict[str | int, str]:
    """Parse "cuda:0=4GiB,cpu=20GiB" into accelerate's max_memory mapping {0: "4GiB", "cpu": "20GiB"}."""
    result: dict[str | int, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ValueError(f"max_memory entry {part!r} must look like DEVICE=SIZE, e.g. cuda:0=4GiB,cpu=20GiB")
        device, size = (s.strip() for s in part.split("=", 1))
        if not size or not size[0].isdigit():
            raise ValueError(f"max_memory size {size!r} for {device!r} must be a number with a unit, e.g. 4GiB")
        if device.startswith("cuda:") and device[5:].isdecimal():
            result[int(device[5:])] = size
        elif device.isdecimal():
            result[int(device)] = size
        elif device in ("cpu", "disk", "mps"):
            result[device] = size
        else:
            raise ValueError(f"max_memory device {device!r} is not one of cuda:N, cpu, disk")
    if not result:
        raise ValueError("max_memory is empty; give e.g. cuda:0=4GiB,cpu=20GiB")
    return result
