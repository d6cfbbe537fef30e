"""The engine interfaces: what the server's workers and routes call on an engine (accelab.serve.
engines' own, the engine processes', and the tests' fakes alike)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, runtime_checkable

from accelab.catalog.facts import GENERATE_TASKS
from accelab.serve.engines.base import (
    Completion,
    ContinuousHooks,
    GenUnit,
    ImageInput,
    Label,
    Prompt,
    SamplingParams,
    StepEngine,
    TextInput,
)

if TYPE_CHECKING:
    from accelab.runtimes import WorkerKind
    from accelab.serve.config import ServeConfig
    from accelab.serve.jobs import SelfSchedulingWorker
    from accelab.serve.scheduler import SchedulerConfig


class Engine(Protocol):
    name: str
    task: str
    worker: WorkerKind  # who schedules its jobs (accelab.runtimes.ServePath.worker): the server starts that one

    @property
    def device(self) -> str: ...  # where the model runs, for the info metric ("n/a": no model)

    def warmup(self) -> None: ...

    def close(self) -> None: ...


class GenerationEngine(Engine, Protocol):
    @property
    def eos_ids(self) -> Sequence[int]: ...

    @property
    def max_context(self) -> int | None: ...  # prompt + output tokens the model takes (None: no limit known)

    @property
    def vocab_size(self) -> int | None: ...  # token ids a request may name (None: not known)

    def fit(self, prompt: Prompt, max_tokens: int, *, truncate: bool = False) -> Prompt: ...

    def prepare_chat(self, messages: list[dict[str, Any]], *, tools: Any = None) -> Prompt: ...

    def prepare_text(self, prompt: str | list[int]) -> Prompt: ...

    def generate(self, units: list[GenUnit]) -> list[Completion]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    # the StepEngine that runs this model for the continuous scheduler; Unsupported, with the
    # reason, where the model must run one generate call per batch
    def step_engine(self, limits: SchedulerConfig) -> StepEngine: ...


@runtime_checkable
class SamplesPerSequence(Protocol):
    """Each sequence samples with rules of its own (`runner.sampling.SequenceSampler`, or the
    engine process's sampler): min_tokens, ignore_eos, logprobs and grammars need it."""

    def sampler(self, params: SamplingParams, prompt: Prompt, *, grammar: Any = None, seed_offset: int = 0) -> Any: ...

    def grammar_tokenizer(self) -> Any: ...


@runtime_checkable
class SchedulesItself(Protocol):
    """A generation engine whose runtime schedules every step itself (vLLM): it brings its own
    worker in place of the continuous one."""

    def continuous_worker(self, config: ServeConfig, hooks: ContinuousHooks) -> SelfSchedulingWorker: ...


def generates(engine: Engine) -> TypeGuard[GenerationEngine]:
    """Whether `engine` generates text (its task is one of GENERATE_TASKS)."""
    return engine.task in GENERATE_TASKS


class EmbeddingEngine(Engine, Protocol):
    def prepare_text(self, text: str | list[int]) -> TextInput: ...

    def embed(self, units: list[TextInput]) -> list[Any]: ...  # one [D] vector (list or float32 array) per unit


class ClassificationEngine(Engine, Protocol):
    def prepare_image(self, data: str, *, top_k: int, where: str) -> ImageInput: ...

    def classify(self, units: list[ImageInput]) -> list[list[Label]]: ...
