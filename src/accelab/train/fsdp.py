"""FSDP2 for `accelab train --sharding fsdp`: torch's `fully_shard`, driven directly.

accelerate keeps DDP when FSDP is asked for on CPU, so the model never goes through
`accelerator.prepare` here (it would DDP-wrap it); the Accelerator still owns the process
group, the data loaders, the optimizer / scheduler wrappers and the accumulation bookkeeping.

Order in `apply_fsdp`, and why (models untouched, as in torchtitan's parallelize):
 1. gradient checkpointing is already on (model.py): it wraps each block's call, and FSDP2
    gathers a block's weights again when backward recomputes its forward.
 2. autocast around forward, as accelerate's prepare does for DDP: parameters stay fp32 and
    are all-gathered and reduce-scattered in fp32; autocast runs matmuls in bf16 and keeps
    norms, softmax and the loss in fp32. Chosen over FSDP2's MixedPrecisionPolicy(bf16): the
    numerics are the DDP rows' (same loss band, one comparison), gradients are averaged in
    fp32, and the bf16 all-gather that policy saves matters on GPU links, not on gloo here.
 3. `fully_shard` each repeated block, then the root: one all-gather before and one
    reduce-scatter after each block (the root holds the rest: embeddings, head, tied weights
    together); blocks reshard after forward, so one block's full weights exist at a time.
 4. `no_sync`, which accelerate's `accumulate` calls on non-final micro-steps: FSDP2 then
    keeps the unsharded gradients and reduce-scatters them once, on the last micro-step.

Checkpoints: model and optimizer through `torch.distributed.checkpoint` (each rank writes its
own shards to `<checkpoint>/sharded/`), the rest as accelerate's save_state writes it
(scheduler, every rank's RNG state, accelerate's step counter).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from accelab.train.config import TrainConfig

log = logging.getLogger(__name__)

SHARDED = "sharded"  # the DCP directory inside an FSDP checkpoint
_DDP_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # what accelerate's save_state writes for DDP


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the items of the outermost ModuleLists whose items share one class
    and hold parameters (ViT and Llama `layers`, ResNet `encoder.stages`)."""
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            items = list(child) if isinstance(child, nn.ModuleList) else []
            if items and len({type(m) for m in items}) == 1 and next(child.parameters(), None) is not None:
                blocks.extend(items)  # not entered: a block is sharded whole
            else:
                visit(child)

    visit(model)
    return blocks


def apply_fsdp(
    model: nn.Module, config: TrainConfig, device: torch.device, autocast: Callable[[], Any] | None
) -> nn.Module:
    """Shard `model` in place over all ranks (the recipe of the module docstring). `autocast`:
    the Accelerator's autocast context (None for fp32)."""
    if config.world_size < 2:
        raise ValueError("--sharding fsdp shards over processes: pass --nproc 2 or more (or --sharding ddp)")
    if autocast is not None:
        _autocast_forward(model, autocast)
    mesh = init_device_mesh(device.type, (config.world_size,))
    blocks = find_blocks(model)
    if not blocks:
        log.warning("%s has no repeated blocks (ModuleList): FSDP shards it as one unit", type(model).__name__)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # accelerate's accumulate calls `model.no_sync()` on non-final micro-steps (a DDP method)
    model.no_sync = functools.partial(_no_sync, model)  # type: ignore[assignment]
    log.info("FSDP2: %d blocks + root sharded over %d ranks", len(blocks), config.world_size)
    return model


def _autocast_forward(model: nn.Module, autocast: Callable[[], Any]) -> None:
    """Run forward under autocast and hand back fp32 outputs, as accelerate's prepare does."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with autocast():
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(autocast_forward)


@contextlib.contextmanager
def _no_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # every FSDP module below the root too
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the whole model's gradient to `max_norm`; the norm before clipping. With FSDP each
    rank holds a shard of every gradient (DTensor): the norm's partial sums are all-reduced."""
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if isinstance(total, DTensor):
        total = total.full_tensor()  # note: an all-reduce over the ranks
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def training_state_bytes(model: nn.Module, optimizer: Any) -> int:
    """Bytes of training state this rank holds: parameters, one gradient per trainable parameter
    (as held from backward to zero_grad, which frees them), optimizer state. Local shards under
    FSDP, whole tensors under DDP."""
    params = list(model.parameters())
    state = getattr(optimizer, "optimizer", optimizer).state  # accelerate's wrapper or a torch optimizer
    optimizer_bytes = sum(
        _local_bytes(value) for per_param in state.values() for value in per_param.values() if torch.is_tensor(value)
    )
    return sum(_local_bytes(p) * (2 if p.requires_grad else 1) for p in params) + optimizer_bytes


def full_state_dict(model: nn.Module) -> dict[str, Any]:
    """The whole model's weights on rank 0, on CPU ({} on the other ranks). Every rank must call it
    (each shard is gathered)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # tied weights (an LM's embeddings and head) are one parameter but two gathered copies: make
    # them one tensor again, so save_pretrained stores it once, as it does for an unsharded model
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name and owner in state:
            state[name] = state[owner]
    return state


def save_checkpoint(directory: Path, accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
    """Every rank writes its shards of the model and optimizer, then the rest accelerate's save_state
    would write. Collective: every rank calls it."""
    from accelerate.checkpointing import save_accelerator_state

    directory.mkdir(parents=True, exist_ok=True)
    model_state, optim_state = get_state_dict(model, optimizer.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=directory / SHARDED)
    save_accelerator_state(
        str(directory),
        [],  # model and optimizer: sharded above
        [],
        [scheduler],
        [],  # the data position is the trainer state's (EpochSampler + skip_first_batches)
        accelerator.process_index,
        accelerator.step,
        accelerator.scaler,
        save_on_each_node=accelerator.project_configuration.save_on_each_node,
    )


def load_checkpoint(directory: Path, accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any) -> None:
    """The counterpart of `save_checkpoint`; each rank reads only its own shards."""
    from accelerate.checkpointing import load_accelerator_state

    # the optimizer's state tensors must exist (sharded like the parameters) to be read into
    model_state, optim_state = get_state_dict(model, optimizer.optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=directory / SHARDED)
    set_state_dict(model, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    restored = load_accelerator_state(
        str(directory), [], [], [scheduler], [], accelerator.process_index, accelerator.scaler
    )
    accelerator.step = restored.get("step", accelerator.step)


def checkpoint_problem(checkpoint: Path, sharding: str) -> str | None:
    """Why this run (--sharding) cannot resume `checkpoint`, or None. Reads file names only."""
    sharded = (checkpoint / SHARDED).is_dir()
    whole = any((checkpoint / name).is_file() for name in _DDP_WEIGHTS)
    if sharding == "fsdp" and not sharded and whole:
        return f"checkpoint {checkpoint} was written by a DDP run; resume it with --sharding ddp"
    if sharding == "ddp" and sharded:
        return (
            f"checkpoint {checkpoint} holds FSDP shards ({SHARDED}/); resume it with --sharding fsdp --nproc 2 or more"
        )
    return None
