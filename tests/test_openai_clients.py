"""Real clients no one here wrote, against one accelab server of the real SmolLM2: the official
`openai` client (structured outputs with a pydantic model, a tool-call round trip streamed and
not), lm-evaluation-harness (a loglikelihood task through local-completions, which needs echo
+ logprobs, and a generate_until task through local-chat-completions, on task files written
here, no Hub), and guidellm (a short benchmark; its own venv, `make guidellm`).

SmolLM2's chat template has no tool format (it renders role and content only), so the server
describes the tools in the system message and constrains the answer to a <tool_call> block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from accelab.catalog.fetch import is_fetched

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
ROOT = Path(__file__).resolve().parents[1]
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CAPITALS = [
    ("France", "Paris", ["Paris", "Rome", "Madrid", "Berlin"], 0),
    ("Germany", "Berlin", ["London", "Berlin", "Vienna", "Oslo"], 1),
    ("Italy", "Rome", ["Athens", "Lisbon", "Rome", "Paris"], 2),
    ("Japan", "Tokyo", ["Seoul", "Beijing", "Bangkok", "Tokyo"], 3),
    ("Spain", "Madrid", ["Madrid", "Prague", "Dublin", "Warsaw"], 0),
    ("England", "London", ["Cairo", "London", "Lima", "Quito"], 1),
]


@pytest.fixture(scope="module")
def url():
    if not is_fetched(MODEL):
        pytest.skip(f"run `accelab models fetch {MODEL}` first")
    from serving import running_server

    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.app import create_app
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import engine_factory

    factory = engine_factory(resolve(MODEL, fetch=False), load_plan("baseline"), torch.device("cpu"), name=MODEL)
    with running_server(
        create_app(ServeConfig(model_name=MODEL, max_tokens=256, max_batch_size=8), factory), ready_timeout_s=300
    ) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=100_000_000)


def test_openai_parse_with_a_pydantic_model_returns_a_valid_object(client):
    for question in ("Describe Paris.", "Tell me about Tokyo as data."):
        reply = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            response_format=City,
            max_tokens=120,
            temperature=0,
        )
        city = reply.choices[0].message.parsed
        assert isinstance(city, City) and city.name and isinstance(city.population, int)
        assert City.model_validate_json(reply.choices[0].message.content) == city


def _ask(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, **kw)


def test_a_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = _ask(client, messages, tool_choice="required", max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    messages += [
        choice.message,
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18, "sky": "sunny"}'},
    ]
    final = _ask(client, messages, tool_choice="none", max_tokens=32)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_a_streamed_tool_call_round_trip(client):
    messages = [{"role": "user", "content": "Is it raining in London?"}]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _ask(client, messages, tool_choice="required", max_tokens=40, stream=True):
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += delta.id or ""
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "get_weather"
    city = json.loads(calls[0]["arguments"])["city"]
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": calls[0]["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": calls[0]["arguments"]},
            }
        ],
    }
    messages += [assistant, {"role": "tool", "tool_call_id": calls[0]["id"], "content": f"No rain in {city} today."}]
    text = "".join(
        c.choices[0].delta.content or ""
        for c in _ask(client, messages, tool_choice="none", max_tokens=24, stream=True)
        if c.choices
    )
    assert text.strip()


def _task_files(directory: Path) -> None:
    data = directory / "capitals.jsonl"
    data.write_text(
        "".join(
            json.dumps({"country": c, "city": city, "choices": choices, "answer": answer}) + "\n"
            for c, city, choices, answer in CAPITALS
        )
    )
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (directory / "capitals_mc.yaml").write_text(
        "task: capitals_mc\n"
        + common
        + textwrap.dedent("""\
        output_type: multiple_choice
        doc_to_text: "Question: What is the capital of {{country}}?\\nAnswer:"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list:
          - metric: acc
        """)
    )
    (directory / "capitals_gen.yaml").write_text(
        "task: capitals_gen\n"
        + common
        + textwrap.dedent("""\
        output_type: generate_until
        doc_to_text: "What is the capital of {{country}}? Answer with the city name only."
        doc_to_target: "{{city}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 16
          do_sample: false
          temperature: 0
        filter_list:
          - name: city
            filter:
              - function: regex
                regex_pattern: "(Paris|Berlin|Rome|Tokyo|Madrid|London)"
              - function: take_first
        metric_list:
          - metric: exact_match
        """)
    )


LM_EVAL = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table
url, tokenizer, tasks_dir = sys.argv[1:4]
manager = TaskManager(include_path=tasks_dir)
runs = [("local-completions", f"model=smollm2-135m,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
         f"tokenizer={tokenizer},num_concurrent=2,max_retries=1", "capitals_mc", False),
        ("local-chat-completions", f"model=smollm2-135m,base_url={url}/v1/chat/completions,num_concurrent=2,"
         "max_retries=1", "capitals_gen", True)]
scores = {}
for model, args, task, chat in runs:
    out = simple_evaluate(model=model, model_args=args, tasks=[task], task_manager=manager,
                          apply_chat_template=chat, log_samples=True, bootstrap_iters=0)
    print(make_table(out))
    scores[task] = {"results": out["results"][task], "samples": len(out["samples"][task])}
print("SCORES " + json.dumps(scores))
"""


def test_lm_evaluation_harness_runs_a_loglikelihood_and_a_generate_task_to_the_end(url, tmp_path):
    from accelab.catalog.store import model_dir

    _task_files(tmp_path)
    script = tmp_path / "run_lm_eval.py"
    script.write_text(LM_EVAL)
    done = subprocess.run(
        [sys.executable, str(script), url, str(model_dir(MODEL)), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **OFFLINE},
        cwd=tmp_path,
        check=False,
    )
    print(done.stdout[-4000:])  # the score tables
    assert done.returncode == 0, done.stderr[-4000:]
    scores = json.loads(done.stdout.split("SCORES ", 1)[1])
    mc, gen = scores["capitals_mc"], scores["capitals_gen"]
    assert mc["samples"] == gen["samples"] == len(CAPITALS)
    assert mc["results"]["acc,none"] >= 4 / 6  # chance is 1/4: the prompt logprobs are the model's
    assert 0.5 <= gen["results"]["exact_match,city"] <= 1.0


@pytest.mark.skipif(not GUIDELLM.exists(), reason="guidellm lives in its own venv: run `make guidellm`")
def test_guidellm_benchmarks_the_server_without_errors(url, tmp_path):
    from accelab.catalog.store import model_dir

    out = tmp_path / "guidellm.json"
    cmd = [
        str(GUIDELLM),
        "run",
        "--backend",
        f"kind=openai_http,target={url},model={MODEL}",
        "--profile",
        "kind=concurrent,streams=4",
        "--data",
        "kind=synthetic_text,prompt_tokens=32,output_tokens=12",
        "--tokenizer",
        f"kind=huggingface_auto,model={model_dir(MODEL)}",
        "--constraint",
        "kind=max_duration,seconds=15",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **OFFLINE}, cwd=tmp_path, check=False
    )
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    totals = _request_totals(report)
    assert totals["successful"] >= 4 and totals["errored"] == 0 and totals["incomplete"] <= 4, totals


def _request_totals(report: dict) -> dict[str, int]:
    """successful / errored / incomplete request counts of every benchmark in guidellm's JSON."""
    totals = {"successful": 0, "errored": 0, "incomplete": 0}
    for bench in report["benchmarks"]:
        counts = bench.get("request_totals") or bench["scheduler_state"]
        for key in totals:
            totals[key] += int(counts.get(key, counts.get(f"{key}_requests", 0)))
    return totals
