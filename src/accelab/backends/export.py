"""Export a model to ONNX once, and keep it: the graph ONNX Runtime and OpenVINO both run.

Cache layout (`ACCELAB_CACHE` moves it):

    cache_dir()/exports/<key>/model.onnx     the exported graph
    cache_dir()/exports/<key>/export.json    what it is: input names, output, architecture
    cache_dir()/exports/<key>/<derived>/     graphs made from it (ORT-fused, int8-quantised)

`<key>` hashes everything the graph depends on: the model directory and its files (names,
sizes, mtimes), the task, the input names and dynamic axes, the opset, the exporter and the
versions of torch, transformers and onnx. A second run reuses the graph; a changed weight file
re-exports. Every directory appears through `os.replace` of a finished temporary one, so an
interrupted export never leaves half a graph behind, and two processes racing on one key both
end with the same complete graph.

The exporter is torch's legacy TorchScript exporter (`dynamo=False`) on the model loaded with
`attn_implementation="eager"`: only that graph has the MatMul/Softmax attention pattern ORT's
transformer optimizer fuses (the dynamo exporter's and SDPA's are not fused).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from accelab.catalog.custom import files_of
from accelab.catalog.load import load, load_processor
from accelab.catalog.spec import ModelSpec
from accelab.paths import cache_dir
from accelab.plan.runtime import Unsupported

log = logging.getLogger(__name__)

OPSET = 17  # LayerNormalization is a single op from 17 on; ORT's fusions expect it or the decomposed form
EXPORTER = "torch.onnx.export(dynamo=False)"
FORMAT = 1  # bump when what this module writes changes
GRAPH_TASKS = ("feature-extraction", "image-classification")
OUTPUT_OF_TASK = {"feature-extraction": "last_hidden_state", "image-classification": "logits"}


class ExportFailed(Unsupported):
    """The exporter could not convert this model; the message names the model and the operator."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Graph:
    """An exported ONNX graph and what a runtime needs to feed it."""

    path: Path  # model.onnx
    input_names: tuple[str, ...]
    output_name: str  # "last_hidden_state" | "logits"
    static_dims: dict[str, list[int | None]]  # per input: fixed sizes, None where dynamic
    model_type: str  # config.model_type, e.g. "bert", "vit"
    num_heads: int
    hidden_size: int

    @property
    def directory(self) -> Path:
        return self.path.parent

    def weight_bytes(self) -> int:
        """Bytes of the graph's files (initializers dominate; external data counted too)."""
        return sum(p.stat().st_size for p in self.directory.iterdir() if p.is_file() and p.name != "export.json")


# -- the cache key ---------------------------------------------------------------------------
def versions() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    return {"torch": torch.__version__, "transformers": version("transformers"), "onnx": version("onnx")}


def model_files(source: str | Path) -> list[tuple[str, int, int]]:
    """(relative name, size, mtime in ns) of every file in the model directory."""
    root = Path(source)
    stamps = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            stat = path.stat()
            stamps.append((str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    return stamps


def output_name_of(spec: ModelSpec) -> str:
    """The graph's one output: a custom model's main tensor is `logits` whatever its task."""
    return "logits" if spec.custom else OUTPUT_OF_TASK[spec.task]


def dynamic_axes(
    task: str, input_names: Sequence[str], output_name: str, *, batch_only: bool = False
) -> dict[str, dict[int, str]]:
    """Batch is dynamic everywhere; text inputs and the token features also vary in sequence
    (not a custom model's: its example inputs fix every other axis)."""
    if task == "image-classification" or batch_only:
        return {**{name: {0: "batch"} for name in input_names}, output_name: {0: "batch"}}
    axes = {name: {0: "batch", 1: "sequence"} for name in input_names}
    axes[output_name] = {0: "batch", 1: "sequence"}
    return axes


def export_key(spec: ModelSpec, input_names: Sequence[str]) -> str:
    output = output_name_of(spec)
    if spec.builder is not None:  # custom: the builder's module or the saved object, not every file beside it
        files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files_of(spec.builder, spec.source)]
    else:
        files = model_files(spec.source)
    parts = {
        "format": FORMAT,
        "source": str(Path(spec.source).resolve()),  # two tmp models with equal sizes and mtimes differ here
        "gguf_file": spec.gguf_file,
        "builder": spec.builder,
        "files": files,
        "task": spec.task,
        "inputs": list(input_names),
        "dynamic_axes": dynamic_axes(spec.task, input_names, output, batch_only=spec.custom),
        "opset": OPSET,
        "exporter": EXPORTER,
        "attn_implementation": "eager",
        "versions": versions(),
    }
    return digest(parts)


def digest(parts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def exports_dir() -> Path:
    path = cache_dir() / "exports"
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- export, cached --------------------------------------------------------------------------
def onnx_graph(spec: ModelSpec) -> Graph:
    """The model's ONNX graph from the cache, exporting it first when the key is new."""
    check_task(spec)
    input_names = model_input_names(spec)
    directory = exports_dir() / export_key(spec, input_names)
    if not (directory / "export.json").is_file():
        log.info("exporting %s to ONNX (opset %d) into %s", spec.name, OPSET, directory)
        build_atomically(directory, lambda tmp: export_to(spec, input_names, tmp))
    else:
        log.info("reusing the ONNX export of %s from %s", spec.name, directory)
    return read_graph(directory)


def check_task(spec: ModelSpec) -> None:
    if spec.task not in GRAPH_TASKS:
        raise Unsupported(
            f"the ONNX Runtime and OpenVINO backends run {' and '.join(GRAPH_TASKS)} forward passes; "
            f"{spec.name} is {spec.task} (generating with a KV cache through them is not implemented: "
            "use backend=llamacpp with a GGUF, or torch)"
        )


def model_input_names(spec: ModelSpec) -> tuple[str, ...]:
    """The inputs the graph takes: the processor's model_input_names (text) or pixel_values."""
    if spec.task == "image-classification":
        return ("pixel_values",)

    if spec.custom:
        return load_processor(spec).call.keys

    tokenizer = load_processor(spec)
    return tuple(n for n in tokenizer.model_input_names if n in ("input_ids", "attention_mask", "token_type_ids"))


def read_graph(directory: Path) -> Graph:
    meta = json.loads((directory / "export.json").read_text())
    return Graph(
        path=directory / "model.onnx",
        input_names=tuple(meta["input_names"]),
        output_name=meta["output_name"],
        static_dims=meta["static_dims"],
        model_type=meta["model_type"],
        num_heads=meta["num_heads"],
        hidden_size=meta["hidden_size"],
    )


def build_atomically(directory: Path, build: Callable[[Path], None]) -> None:
    """Run `build(tmp)` in a fresh temporary directory beside `directory`, then rename it there."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{directory.name}-", dir=directory.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, directory)
        except OSError:  # another process finished the same key first: keep theirs
            if not directory.is_dir():
                raise
            log.info("%s appeared meanwhile; using it", directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_to(spec: ModelSpec, input_names: tuple[str, ...], directory: Path) -> None:
    """Load the model (fp32, eager attention), export it and write export.json into `directory`."""
    from accelab.catalog.inputs import forward_batch

    loaded = load(spec, attn_implementation=None if spec.custom else "eager")
    # batch 2 of 16 tokens with padding: the trace must not specialise on batch 1 or a full mask
    sample = forward_batch(loaded, 2, seq_len=16)
    sample = {name: sample[name] for name in input_names}
    output_name = output_name_of(spec)
    axes = dynamic_axes(spec.task, input_names, output_name, batch_only=spec.custom)
    export_module(
        PositionalForward(loaded.model, input_names, output_name),
        sample,
        directory / "model.onnx",
        output_name=output_name,
        axes=axes,
        model_name=spec.name,
    )
    config = loaded.model.config
    meta = {
        "model": spec.name,
        "task": spec.task,
        "input_names": list(input_names),
        "output_name": output_name,
        "static_dims": {
            n: [None if i in axes[n] else int(s) for i, s in enumerate(sample[n].shape)] for n in input_names
        },
        "model_type": getattr(config, "model_type", ""),
        "num_heads": int(getattr(config, "num_attention_heads", 0) or 0),
        "hidden_size": int(getattr(config, "hidden_size", 0) or 0),
        "opset": OPSET,
        "exporter": EXPORTER,
        "versions": versions(),
    }
    (directory / "export.json").write_text(json.dumps(meta, indent=2) + "\n")


class PositionalForward(torch.nn.Module):
    """model(**dict(zip(names, args)))[output]: the legacy exporter passes inputs positionally,
    and transformers 5 encoders take them by keyword only."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str], output: str):
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.output = output

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(**dict(zip(self.names, args)), return_dict=True), self.output)


def export_module(
    module: torch.nn.Module,
    sample: Mapping[str, torch.Tensor],
    path: Path,
    *,
    output_name: str,
    axes: Mapping[str, Mapping[int, str]],
    model_name: str,
) -> None:
    """torch.onnx.export with the legacy exporter; a failure names the model and the operator."""
    names = list(sample)
    try:
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")  # TracerWarnings about Python control flow, deprecation notes
            torch.onnx.export(
                module.eval(),
                tuple(sample[n] for n in names),
                str(path),
                dynamo=False,
                input_names=names,
                output_names=[output_name],
                dynamic_axes={k: dict(v) for k, v in axes.items()},
                opset_version=OPSET,
                do_constant_folding=True,
            )
    except Exception as err:
        raise ExportFailed(export_error_message(model_name, err)) from err


_OPERATOR_PATTERNS = (
    re.compile(r"operator '([\w:.]+)'"),
    re.compile(r"export of operator ([\w:.]+)"),
    re.compile(r"\b((?:aten|prim|onnx|quantized)::\w+)"),
)


def failed_operator(message: str) -> str | None:
    """The operator an exporter error message blames, e.g. "aten::linalg_eig", or None."""
    for pattern in _OPERATOR_PATTERNS:
        found = pattern.search(message)
        if found:
            return found.group(1)
    return None


def export_error_message(model_name: str, err: Exception) -> str:
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    operator = failed_operator(str(err))
    what = f"the operator {operator!r} has no ONNX conversion at opset {OPSET}" if operator else first_line
    return (
        f"could not export {model_name} to ONNX with {EXPORTER}: {what} "
        f"({type(err).__name__}: {first_line}); run it with backend=torch"
    )


# -- graphs derived from an export -------------------------------------------------------------
def derived_graph(base: Graph, name: str, key_parts: Mapping[str, Any], build: Callable[[Path, Path], None]) -> Graph:
    """A graph made from `base` by `build(base_path, out_path)` (optimised, quantised), cached
    beside it under `<name>-<hash of key_parts>`; the same inputs and output as `base`."""
    directory = base.directory / f"{name}-{digest(key_parts)}"
    if not (directory / "model.onnx").is_file():
        log.info("building the %s graph of %s", name, base.directory.name)

        def make(tmp: Path) -> None:
            build(base.path, tmp / "model.onnx")
            shutil.copy(base.directory / "export.json", tmp / "export.json")

        build_atomically(directory, make)
    else:
        log.info("reusing the %s graph %s", name, directory)
    fields = asdict(base)
    fields["path"] = directory / "model.onnx"
    return Graph(**fields)
