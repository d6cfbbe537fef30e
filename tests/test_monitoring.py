"""Production monitoring with the real tools: a real Prometheus (Debian's package) on 127.0.0.1
scrapes two real `accelab serve` processes every second, SmolLM2 (generation, continuous
batching, a KV cache small enough to preempt, vLLM's metric names on) and MiniLM (embeddings;
FAULT INJECTED through tests/faults: its model fails while a flag file exists, and its GPU
memory gauges read a FAKE GPU, as this machine has none), under a short real load.

- every query of deploy/grafana/accelab.json returns data, with the labels its legend names;
- every query of vLLM's own Grafana dashboard returns data from the SmolLM2 server;
- an error burst (the flag file) fires the shipped AccelabHighErrorRate alert;
- `accelab top` in tmux shows, on screen, the numbers /metrics and Prometheus give.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from serving import ServerProcess

from accelab.catalog.fetch import is_fetched
from accelab.serve.metrics import ERROR_KINDS

pytestmark = pytest.mark.slow  # not alone: it counts requests and series, never a speed

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
FAULTS = Path(__file__).parent / "faults"
FAKE_GPU_BYTES = 3 << 30  # what the FAKE GPU reports allocated (reserved 2x, peak 1.5x)
PROMPT = "Tell me a story about a cat named {}."  # 38 tokens with SmolLM2's chat template


def need(tool: str) -> str:
    path = shutil.which(tool)
    assert path, f"{tool} is not installed: `make test` installs it (make monitoring: apt-get install prometheus tmux)"
    return path


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Prometheus:
    """prometheus on 127.0.0.1 with the shipped config, scraping `targets` every second."""

    def __init__(self, workdir: Path, targets: list[str]):
        config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        [job] = config["scrape_configs"]
        job.update(scrape_interval="1s", static_configs=[{"targets": targets}])
        config["rule_files"] = [str(self.rules(workdir))]
        config.pop("alerting")
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [
                need("prometheus"),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(workdir / "prometheus.log", "w"),
        )
        self.log = workdir / "prometheus.log"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.2)

    @staticmethod
    def rules(workdir: Path) -> Path:
        """The shipped rules with the error-rate alert's `for` at 2 s instead of 2 min, so a burst
        fires it within the test (deploy/prometheus/accelab.rules.test.yml tests the 2 min)."""
        rules = yaml.safe_load((DEPLOY / "prometheus" / "accelab.rules.yml").read_text())
        [alert] = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "AccelabHighErrorRate"]
        alert["for"] = "2s"
        path = workdir / "accelab.rules.yml"
        path.write_text(yaml.safe_dump(rules))
        return path

    def query(self, expr: str) -> list[dict]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Both servers, Prometheus scraping them, and the load they served (counts by what was sent)."""
    for model in ("smollm2-135m", "minilm-l6"):
        assert is_fetched(model), f"run `accelab models fetch {model}` first (make test does)"
    work = tmp_path_factory.mktemp("monitoring")
    flag = work / "errors-on"
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])),
        "ACCELAB_TEST_FAULT": f"serve-errors:{flag},fake-gpu:{FAKE_GPU_BYTES}",
    }
    servers: list[ServerProcess] = []
    prometheus = None
    try:
        # --kv-cache-tokens 192: 12 blocks of 16, where 4 sequences of 40 + 24 tokens need 16 (KV pressure)
        servers.append(
            ServerProcess(
                "-m",
                "accelab.serve",
                "smollm2-135m",
                "--port",
                "0",
                "--max-batch-size",
                "4",
                "--kv-cache-tokens",
                "192",
                "--max-tokens",
                "64",
                "--set",
                "threads=1",
                "--metric-aliases",
                "vllm",
                timeout_s=120,
            )
        )
        servers.append(
            ServerProcess(
                "-m",
                "accelab.serve",
                "minilm-l6",
                "--port",
                "0",
                "--max-batch-size",
                "8",
                "--set",
                "threads=1",
                timeout_s=120,
                env=env,
            )
        )
        for server in servers:
            server.wait_ready(180)
        gen, enc = servers
        prometheus = Prometheus(work, [s.url.removeprefix("http://") for s in servers])
        _wait_for_targets(prometheus, len(servers))
        started = time.time()
        sent = asyncio.run(_load(gen.url, enc.url))
        _wait_for_scrapes(prometheus, [gen.url, enc.url], sent)
        yield {"gen": gen, "enc": enc, "prom": prometheus, "flag": flag, "sent": sent, "started": started}
    finally:
        if prometheus is not None:
            prometheus.stop()
        for server in servers:
            server.stop()


async def _load(gen: str, enc: str) -> dict[str, int]:
    """Chat streams (4 at once, twice), chat and completions answers, embeddings from 4 users,
    and a few malformed requests (422) on each server. Returns how many of each were answered 200."""
    sent = {"chat": 0, "completions": 0, "embeddings": 0, "invalid": 0}

    async def stream(client: httpx.AsyncClient, i: int) -> None:
        body = {"messages": [{"role": "user", "content": PROMPT.format(i)}], "max_tokens": 24, "stream": True}
        async with client.stream("POST", f"{gen}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                pass
        sent["chat"] += 1

    async def generation(client: httpx.AsyncClient) -> None:
        for round_ in range(2):
            await asyncio.gather(*(stream(client, 4 * round_ + i) for i in range(4)))
        chat = {"messages": [{"role": "user", "content": PROMPT.format("Tom")}], "max_tokens": 8}
        for route, path, body in (
            ("chat", "chat/completions", chat),
            ("completions", "completions", {"prompt": "Once upon a time", "max_tokens": 8}),
        ):
            for _ in range(2):
                assert (await client.post(f"{gen}/v1/{path}", json=body)).status_code == 200
                sent[route] += 1

    async def user(client: httpx.AsyncClient, u: int) -> None:
        for k in range(10):
            inputs = f"sentence {k} of user {u}" if k % 5 else [f"first of {k}", f"second of {k}"]
            assert (await client.post(f"{enc}/v1/embeddings", json={"input": inputs})).status_code == 200
            sent["embeddings"] += 1

    async def malformed(client: httpx.AsyncClient) -> None:
        for url, path in ((gen, "chat/completions"), (enc, "embeddings"), (enc, "embeddings")):
            assert (await client.post(f"{url}/v1/{path}", json={"no": "input"})).status_code == 422
            sent["invalid"] += 1

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(generation(client), *(user(client, u) for u in range(4)), malformed(client))
    return sent


def _wait_for_targets(prometheus: Prometheus, count: int) -> None:
    """Until Prometheus scraped every server before the load: every rate then starts from a sample
    taken before the first request."""
    deadline = time.monotonic() + 30
    while not (up := prometheus.query("up == 1")) or len(up) < count:
        assert time.monotonic() < deadline, (
            f"Prometheus does not scrape the servers: {up}\n{prometheus.log.read_text()}"
        )
        time.sleep(0.2)
    time.sleep(1.5)  # and once more


def _wait_for_scrapes(prometheus: Prometheus, urls: list[str], sent: dict[str, int]) -> None:
    """Until Prometheus holds the last of the load (both servers' request counts as sent)."""
    want = sent["chat"] + sent["completions"] + sent["embeddings"] + sent["invalid"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = prometheus.query('sum(accelab_requests_total{route!~"models|other"})')
        if got and float(got[0]["value"][1]) == want:
            time.sleep(2)  # two more scrapes: every rate window ends after the load
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never saw the {want} requests sent: {got}\n{prometheus.log.read_text()}")


def window(stack) -> str:
    return f"{int(time.time() - stack['started']) + 15}s"


def values(series: dict) -> list[float]:
    return [float(series["value"][1])]


# -- the shipped dashboard ---------------------------------------------------------------------------
# per panel: label values its series must show (beyond the legend's labels, which every query must carry)
EXPECTED = {
    "Requests/s by route": {"route": {"chat", "completions", "embeddings"}},
    "Responses/s by status code": {"status": {"200", "422"}},
    "Errors/s by kind": {"kind": set(ERROR_KINDS)},
    "KV-cache blocks": {"state": {"used", "free"}},
    "Finished sequences/s by reason": {"finish_reason": {"stop", "length"}},
    "End-to-end latency by route": {"route": {"chat", "completions", "embeddings"}},
    "GPU memory": {"device": {"0"}},
    "Model served": {"model": {"smollm2-135m", "minilm-l6"}, "plan": {"baseline+threads=1"}, "device": {"cpu"}},
}
OPTIONAL_LABELS = {"replica"}  # only behind --replicas


def dashboard_targets():
    doc = json.loads((DEPLOY / "grafana" / "accelab.json").read_text())
    return [(p["title"], t) for p in doc["panels"] if p["type"] != "row" for t in p["targets"]]


def test_every_dashboard_query_returns_data_with_the_labels_of_its_legend(stack):
    prom, rate_window = stack["prom"], window(stack)
    instances = {s.url.removeprefix("http://") for s in (stack["gen"], stack["enc"])}
    targets = dashboard_targets()
    assert len(targets) > 40
    seen: dict[str, dict[str, set[str]]] = {}
    for title, target in targets:
        expr = (
            target["expr"]
            .replace("$__rate_interval", rate_window)
            .replace('"$job"', '"accelab"')
            .replace('"$instance"', '".+"')
        )
        result = prom.query(expr)
        assert result, f"{title!r}: no data for {expr}"
        assert any(math.isfinite(v) for s in result for v in values(s)), f"{title!r}: only NaN for {expr}: {result}"
        wanted = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"])) - OPTIONAL_LABELS
        for series in result:
            assert wanted <= series["metric"].keys(), f"{title!r}: {series['metric']} lacks {wanted}: {expr}"
            for label, value in series["metric"].items():
                seen.setdefault(title, {}).setdefault(label, set()).add(value)
            if "instance" in series["metric"]:
                assert series["metric"]["instance"] in instances
    for title, labels in EXPECTED.items():
        for label, wanted_values in labels.items():
            assert wanted_values <= seen[title].get(label, set()), (title, label, seen[title])
    # the dashboard's variables: label_values(accelab_ready, job) and the instances of that job
    jobs = httpx.get(f"{prom.url}/api/v1/label/job/values", params={"match[]": "accelab_ready"}).json()["data"]
    assert jobs == ["accelab"]
    found = httpx.get(f"{prom.url}/api/v1/label/instance/values", params={"match[]": 'accelab_ready{job=~"accelab"}'})
    assert set(found.json()["data"]) == instances


def test_the_numbers_prometheus_holds_are_the_load_that_was_sent(stack):
    prom, sent, enc = stack["prom"], stack["sent"], stack["enc"].url.removeprefix("http://")

    def one(expr: str) -> float:
        [series] = prom.query(expr)
        return float(series["value"][1])

    assert one('sum(accelab_requests_total{route="embeddings", status="200"})') == sent["embeddings"]
    assert one('sum(accelab_requests_total{route="chat", status="200"})') == sent["chat"]
    assert one('sum(accelab_requests_total{status="422"})') == sent["invalid"]
    assert one("sum(accelab_finished_sequences_total)") == sent["chat"] + sent["completions"]
    assert one("sum(accelab_time_to_first_token_seconds_count)") == sent["chat"] + sent["completions"]
    assert one(f'accelab_gpu_memory_reserved_bytes{{instance="{enc}"}}') == 2 * FAKE_GPU_BYTES  # the FAKE GPU
    assert one("accelab:kv_cache:usage_ratio") == 0  # the recording rules run on the live series too


# -- vLLM's dashboard ----------------------------------------------------------------------------------
# The queries of vLLM's own Grafana dashboard (examples/observability/prometheus_grafana/grafana.json
# in vllm-project/vllm, one per panel target), written out here: every one must return data from
# `accelab serve --metric-aliases vllm`. Its variable: label_values(model_name).
VLLM_HISTOGRAMS = ("e2e_request_latency_seconds", "time_to_first_token_seconds", "inter_token_latency_seconds")
VLLM_QUERIES = (
    *(
        f'histogram_quantile({q}, sum by(le) (rate(vllm:{h}_bucket{{model_name="$model_name"}}[$__rate_interval])))'
        for h in VLLM_HISTOGRAMS
        for q in (0.99, 0.95, 0.9, 0.5)
    ),
    *(
        f'rate(vllm:{h}_sum{{model_name="$model_name"}}[$__rate_interval])\n/\n'
        f'rate(vllm:{h}_count{{model_name="$model_name"}}[$__rate_interval])'
        for h in VLLM_HISTOGRAMS
    ),
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
)


def test_vllms_own_dashboard_queries_return_data_from_accelab(stack):
    prom, rate_window = stack["prom"], window(stack)
    models = httpx.get(f"{prom.url}/api/v1/label/model_name/values").json()["data"]
    assert models == ["smollm2-135m"]  # only the server started with --metric-aliases vllm
    for query in VLLM_QUERIES:
        expr = query.replace("$model_name", "smollm2-135m").replace("$__rate_interval", rate_window)
        result = prom.query(expr)
        assert result, f"no data for vLLM's {query}"
        assert any(math.isfinite(v) for s in result for v in values(s)), f"only NaN for vLLM's {query}: {result}"
    reasons = {s["metric"]["finished_reason"] for s in prom.query("vllm:request_success_total")}
    assert reasons == {"stop", "length"}
    # the aliases are accelab's own series under vLLM's names: the same counts
    for vllm, ours in (
        ("vllm:generation_tokens_total", "accelab_generated_tokens_total"),
        ("vllm:time_to_first_token_seconds_count", "accelab_time_to_first_token_seconds_count"),
        ("vllm:num_preemptions_total", "accelab_preemptions_total"),
    ):
        gen = stack["gen"].url.removeprefix("http://")
        [a] = prom.query(vllm)
        [b] = prom.query(f'{ours}{{instance="{gen}"}}')
        assert a["value"][1] == b["value"][1], (vllm, a, b)


# -- the error-rate alert ------------------------------------------------------------------------------
def firing(prom: Prometheus, name: str) -> list[dict]:
    alerts = httpx.get(f"{prom.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_an_error_burst_fires_the_error_rate_alert_on_that_server_only(stack):
    prom, enc, flag = stack["prom"], stack["enc"], stack["flag"]
    instance = enc.url.removeprefix("http://")
    assert not firing(prom, "AccelabHighErrorRate")

    flag.write_text("on")
    try:
        # one after another, four inputs each: every request is one batch, which fails, is split,
        # and each of its inputs fails alone (a 500 for the request, one split counted)
        codes = [
            httpx.post(
                f"{enc.url}/v1/embeddings", json={"input": [f"text {i} {k}" for k in range(4)]}, timeout=60
            ).status_code
            for i in range(12)
        ]
    finally:
        flag.unlink()
    assert codes == [500] * 12
    assert httpx.post(f"{enc.url}/v1/embeddings", json={"input": "healthy again"}).status_code == 200
    deadline = time.monotonic() + 40
    while not (alerts := firing(prom, "AccelabHighErrorRate")):
        assert time.monotonic() < deadline, (
            f"the alert never fired: {prom.query('accelab:request_errors:ratio_rate5m')}"
        )
        time.sleep(1)
    [alert] = alerts
    assert alert["labels"]["instance"] == instance and alert["labels"]["severity"] == "page"
    assert re.fullmatch(
        rf"{re.escape(instance)}: \d+(\.\d+)?% of requests failed \(last 5 min\)", alert["annotations"]["summary"]
    )
    # the batch splits were counted where they happened, and the retries rule sees them
    [splits] = prom.query(f'accelab_batch_retries_total{{instance="{instance}", reason="batch_error"}}')
    assert float(splits["value"][1]) == 12
    deadline = time.monotonic() + 10
    while not prom.query(f'accelab:retries:rate5m{{instance="{instance}", cause="split_batch"}} > 0'):
        assert time.monotonic() < deadline
        time.sleep(1)


# -- accelab top, as a person sees it ---------------------------------------------------------------------
class Tmux:
    """`accelab top` in a detached tmux session of a fixed size; `screen()` is what it shows."""

    def __init__(self, name: str, url: str):
        self.name = f"accelab-test-{name}-{os.getpid()}"
        command = f"{sys.executable} -m accelab top {url} --interval 0.5 --window 4"
        subprocess.run(
            [need("tmux"), "new-session", "-d", "-s", self.name, "-x", "120", "-y", "45", command],
            check=True,
            # the pane's size is the terminal's; COLUMNS / LINES (pytest-xdist's workers set 80 x 24)
            # would override it
            env={**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}, "TERM": "xterm-256color"},
        )

    def screen(self) -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True, check=True
        ).stdout

    def wait_for(self, pattern: str, timeout_s: float = 20, meanwhile=lambda: time.sleep(0.25)) -> str:
        """The screen once `pattern` shows on it, doing `meanwhile` between looks."""
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern, text := self.screen(), re.M):
            assert time.monotonic() < deadline, f"{pattern!r} never appeared:\n{text}"
            meanwhile()
        return text

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True, check=False)


def row(screen: str, label: str) -> list[str]:
    """The cells of the table row that starts with `label`."""
    [line] = [line for line in screen.splitlines() if line.strip().startswith(label)]
    return [cell.strip() for cell in re.split(r"[│┃]", line)]


def seconds(cell: str) -> float:
    value, unit = cell.split()
    return float(value) / 1000 if unit == "ms" else float(value)


def test_top_in_a_terminal_shows_what_metrics_and_prometheus_say(stack):
    gen, prom = stack["gen"], stack["prom"]
    instance = gen.url.removeprefix("http://")
    top = Tmux("gen", gen.url)
    try:
        top.wait_for(r"accelab top · .* smollm2-135m \(plan baseline\+threads=1, cpu\) · ready")

        # a little traffic while a person watches: the window's rates move (requests until they show:
        # on a busy machine a screen refresh can come after a short burst has left the 4 s window)
        def request() -> None:
            assert httpx.post(f"{gen.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}).status_code == 200

        busy = top.wait_for(r"^ requests\s+│\s+[1-9][\d.]*/s", meanwhile=request)
        assert float(row(busy, "tokens generated")[1].removesuffix("/s")) > 0
        # idle again: the window empties, and "since start" holds every request ever answered
        quiet = top.wait_for(r"^ requests\s+│\s+0\.0/s", timeout_s=15)
    finally:
        top.close()
    metrics = httpx.get(f"{gen.url}/metrics").text
    api = sum(
        float(m.group(2))
        for m in re.finditer(r'^accelab_requests_total\{route="(\w+)",status="\d+"\} (\S+)$', metrics, re.M)
        if m.group(1) not in ("models", "other")
    )
    assert row(quiet, "requests")[2] == f"{api:,.0f}"
    generated = float(re.search(r"^accelab_generated_tokens_total (\S+)$", metrics, re.M).group(1))
    assert row(quiet, "tokens generated")[2].startswith(f"{generated:,.0f} (prompt ")
    # since-start percentiles: what Prometheus' histogram_quantile says over the same buckets
    for label, name in (
        ("time to first token", "accelab_time_to_first_token_seconds"),
        ("inter-token latency", "accelab_inter_token_latency_seconds"),
    ):
        shown = [seconds(cell) for cell in row(quiet, label)[2].split(" · ")]
        for q, value in zip((0.5, 0.99), shown):
            [series] = prom.query(f'histogram_quantile({q}, sum by (le) ({name}_bucket{{instance="{instance}"}}))')
            assert value == pytest.approx(float(series["value"][1]), rel=5e-3), (label, q)
    assert row(quiet, "KV cache")[1] == "0 of 12 blocks used (0%)"
    assert row(quiet, "queue")[1] == "0 waiting of 256"
    assert row(quiet, "running")[1] == "0 sequences, 0 waiting"
    retried = float(re.search(r"^accelab_preemptions_total (\S+)$", metrics, re.M).group(1)) + sum(
        float(v) for v in re.findall(r'^accelab_batch_retries_total\{reason="\w+"\} (\S+)$', metrics, re.M)
    )
    assert row(quiet, "retries")[2].split()[0] == f"{retried:,.0f}"


def test_top_shows_the_encoder_servers_errors_and_gpu(stack):
    enc = stack["enc"]
    top = Tmux("enc", enc.url)
    try:
        screen = top.wait_for(r"^ GPU 0 ")
    finally:
        top.close()
    metrics = httpx.get(f"{enc.url}/metrics").text
    kinds = {k: float(v) for k, v in re.findall(r'^accelab_errors_total\{kind="(\w+)"\} (\S+)$', metrics, re.M)}
    largest = sorted(((k, v) for k, v in kinds.items() if v), key=lambda kv: (-kv[1], kv[0]))[:2]
    assert largest  # the malformed requests of the load at least
    shown = ", ".join(f"{k} {v:,.0f}" for k, v in largest)
    assert row(screen, "errors")[2] == f"{sum(kinds.values()):,.0f} ({shown})"
    assert row(screen, "GPU 0")[1] == "3,221 MB allocated, 6,442 MB reserved"  # the FAKE GPU's 3 GiB
    assert "time to first token" not in screen  # an encoder: no generation rows
    assert "KV cache" not in screen
