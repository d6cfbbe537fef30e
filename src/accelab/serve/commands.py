"""`accelab serve MODEL`: an HTTP server for a model under a plan (OpenAI-compatible routes,
continuous batching for generation, dynamic batching for encoders and classifiers, admission
control, Prometheus metrics, graceful SIGTERM)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import typer

from accelab.options import command, fields_of
from accelab.serve.config import KV_TOKENS_PER_SEQUENCE, ServeConfig, ServeRun

log = logging.getLogger(__name__)

MODEL_HELP = "Catalog name, local directory, .gguf file, Hub id, or your own model as package.module:callable."


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)


@command(ServeRun, ServeConfig)
def serve_command(ctx: typer.Context, model: str = typer.Argument(..., help=MODEL_HELP), **options: Any) -> None:
    """Serve a model: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/classify, /metrics."""
    from accelab.catalog.resolve import resolve
    from accelab.plan.apply import resolve_device
    from accelab.plan.plan import load_plan
    from accelab.serve.server import engine_factory, run_server

    # resolve everything cheap before listening, so a typo fails at once, not in the loader
    run = ServeRun(**fields_of(ServeRun, options))
    spec = resolve(model, run.task)
    the_plan = load_plan(run.plan, run.overrides)
    the_device = resolve_device(the_plan, run.device)
    name = run.served_name or model
    typed = frozenset(k for k in options if _typed(ctx, k))
    config = ServeConfig.from_options(
        options, model_name=name, plan_name=the_plan.name, plan_settings=dict(the_plan.server), given=typed
    )
    if the_plan.server:
        used = ", ".join(f"{k}={getattr(config, k)}" for k, _ in the_plan.server)
        typer.echo(f"server settings of plan {the_plan.name}: {used} (an option you give wins)", err=True)
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        typer.secho(
            f"warning: listening on {config.host} without --api-key: anyone who reaches it can use it",
            fg=typer.colors.YELLOW,
            err=True,
        )
    _refuse_what_cannot_fit(spec, the_plan, the_device, config)
    factory = engine_factory(spec, the_plan, the_device, name=name, max_batch_size=config.max_batch_size)
    if run.replicas > 1 or run.ray_address:
        from accelab.serve.replicas import require_ray, run_replicas

        require_ray()
        raise typer.Exit(run_replicas(config, factory, replicas=run.replicas, ray_address=run.ray_address))
    raise typer.Exit(run_server(config, factory, access_log=run.access_log))


def _refuse_what_cannot_fit(spec: Any, plan: Any, device: Any, config: ServeConfig) -> None:
    """Exit 2, before listening or loading, when the plan's weights, the KV cache's least (one
    sequence of 2048 tokens, or --kv-cache-tokens) and the overhead exceed the available memory."""
    from accelab.catalog.facts import GENERATE_TASKS
    from accelab.plan import fit
    from accelab.plan.runtime import Unsupported

    kv_bytes = 0
    config_file = Path(spec.source) / "config.json"
    if spec.task in GENERATE_TASKS and config.scheduler == "continuous" and config_file.is_file():
        per_token = fit.kv_bytes_per_token(json.loads(config_file.read_text()), fit.kv_dtype(plan))
        kv_bytes = (per_token or 0) * (config.kv_cache_tokens or KV_TOKENS_PER_SEQUENCE)
    try:
        fit.check(spec, plan, device, kv_bytes=kv_bytes)
    except Unsupported as why:
        typer.secho(f"error: {why}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


def _typed(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option `name` (on the command line or in its environment variable),
    rather than leaving its default. (Typer carries its own copy of click: the source's name is
    compared, not click's enum.)"""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")
