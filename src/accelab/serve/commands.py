"""`accelab serve MODEL`: an HTTP server for a model under a plan (OpenAI-compatible routes,
continuous batching for generation, dynamic batching for encoders and classifiers, admission
control, Prometheus metrics, graceful SIGTERM)."""

from __future__ import annotations

import logging

import typer

log = logging.getLogger(__name__)

PLAN_HELP = "A preset name (baseline, compile, int8-weight, ...) or a YAML plan file (e.g. from `accelab tune`)."


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)


def serve_command(
    ctx: typer.Context,
    model: str = typer.Argument(
        ..., help="Catalog name, local directory, .gguf file, Hub id, or your own model as package.module:callable."
    ),
    task: str | None = typer.Option(None, help="Override the task inferred from the model's config."),
    plan: str = typer.Option("baseline", "--plan", help=PLAN_HELP),
    set_: list[str] = typer.Option([], "--set", help="Override a plan field: --set threads=2 (repeatable)."),
    device: str | None = typer.Option(None, help="cpu | cuda | cuda:N (default: CUDA when present)."),
    host: str = typer.Option(
        "127.0.0.1",
        help="Address to listen on. Anything but 127.0.0.1 exposes the server to the network: give it an --api-key.",
    ),
    port: int = typer.Option(8000, help="Port to listen on (0: any free port, printed at start)."),
    served_name: str | None = typer.Option(
        None, "--served-name", help="Model id in /v1/models and requests (default: MODEL)."
    ),
    max_batch_size: int = typer.Option(
        32,
        "--max-batch-size",
        help="Most inputs per model call; for generation "
        "with continuous batching, the most sequences decoding at once.",
    ),
    scheduler: str = typer.Option(
        "continuous",
        "--scheduler",
        help="Generation: continuous (requests join and "
        "leave the running batch at every decoding step) or static (one generate call "
        "per batch).",
    ),
    max_step_tokens: int | None = typer.Option(
        None,
        "--max-step-tokens",
        help="Continuous batching: tokens "
        "per decoding step; long prompts are prefilled in chunks of what "
        "the running decodes leave (default: max(256, 2 x batch size)).",
    ),
    kv_cache_tokens: int | None = typer.Option(
        None,
        "--kv-cache-tokens",
        help="Continuous batching: KV-cache "
        "capacity in tokens, over all sequences; requests queue when it "
        "is full (default: 2048 per sequence, at least the model's "
        "context).",
    ),
    max_wait_ms: float = typer.Option(
        5.0, "--max-wait-ms", help="How long the first request of a batch waits for others (ms)."
    ),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests that may wait; more get 429 with Retry-After."),
    request_timeout: float = typer.Option(
        60.0, "--request-timeout", help="A request not started after this many seconds gets 504 and is not run."
    ),
    grace_period: float = typer.Option(
        30.0, "--grace-period", help="On SIGTERM, seconds to finish requests in flight before exiting."
    ),
    max_body_bytes: int = typer.Option(20 * 1024 * 1024, "--max-body-bytes", help="Larger request bodies get 413."),
    max_tokens: int = typer.Option(2048, "--max-tokens", help="Largest max_tokens a request may ask for (413 above)."),
    default_max_tokens: int = typer.Option(
        256, "--default-max-tokens", help="max_tokens of chat requests that give none."
    ),
    max_inputs: int = typer.Option(256, "--max-inputs", help="Most texts, prompts or images per request (413 above)."),
    image_domains: str = typer.Option(
        "",
        "--image-domains",
        help="Comma-separated domains whose http(s) image URLs are fetched (and their subdomains); "
        "empty: any public host.",
    ),
    allow_private_images: bool = typer.Option(
        False, "--allow-private-images", help="Also fetch image URLs on private, loopback and link-local addresses."
    ),
    image_timeout: float = typer.Option(10.0, "--image-timeout", help="Seconds an image URL may take (400 after)."),
    max_image_bytes: int = typer.Option(
        20 * 1024 * 1024, "--max-image-bytes", help="Largest image a URL may return (413 above)."
    ),
    max_image_pixels: int = typer.Option(40_000_000, "--max-image-pixels", help="Most pixels per image (413 above)."),
    max_images: int = typer.Option(8, "--max-images", help="Most images in one generation request (413 above)."),
    api_key: str | None = typer.Option(
        None,
        "--api-key",
        envvar="ACCELAB_API_KEY",
        show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on the API routes.",
    ),
    access_log: bool = typer.Option(False, "--access-log", help="Log every request."),
    metric_aliases: str = typer.Option(
        "none",
        "--metric-aliases",
        help="vllm: /metrics also exports vLLM's "
        "metric names (vllm:..., with model_name), so vLLM's Grafana dashboards work "
        "unchanged (see deploy/README.md).",
    ),
    replicas: int = typer.Option(
        1,
        "--replicas",
        help="Serve N copies of the model on Ray Serve behind one address "
        "(needs accelab[ray]); with --ray-address, across a Ray cluster's machines.",
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        help="Join this Ray cluster (HOST:6379, or 'auto') instead of starting a local Ray instance.",
    ),
) -> None:
    """Serve a model: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/classify, /metrics."""
    from accelab.catalog.resolve import resolve
    from accelab.plan.apply import resolve_device
    from accelab.plan.plan import load_plan
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import engine_factory, run_server

    # resolve everything cheap before listening, so a typo fails at once, not in the loader
    spec = resolve(model, task)
    the_plan = load_plan(plan, set_)
    the_device = resolve_device(the_plan, device)
    name = served_name or model
    typed = frozenset(k for k in ctx.params if _typed(ctx, k))
    config = ServeConfig.from_options(
        ctx.params, model_name=name, plan_name=the_plan.name, plan_settings=dict(the_plan.server), given=typed
    )
    if the_plan.server:
        used = ", ".join(f"{k}={getattr(config, k)}" for k, _ in the_plan.server)
        typer.echo(f"server settings of plan {the_plan.name}: {used} (an option you give wins)", err=True)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        typer.secho(
            f"warning: listening on {host} without --api-key: anyone who reaches it can use it",
            fg=typer.colors.YELLOW,
            err=True,
        )
    if replicas < 1:
        raise ValueError(f"--replicas {replicas} must be 1 or more")
    factory = engine_factory(spec, the_plan, the_device, name=name, max_batch_size=config.max_batch_size)
    if replicas > 1 or ray_address:
        from accelab.serve.replicas import require_ray, run_replicas

        require_ray()
        raise typer.Exit(run_replicas(config, factory, replicas=replicas, ray_address=ray_address))
    raise typer.Exit(run_server(config, factory, access_log=access_log))


def _typed(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option `name` (on the command line or in its environment variable),
    rather than leaving its default. (Typer carries its own copy of click: the source's name is
    compared, not click's enum.)"""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")
