"""The server with real models from the catalog, through the official `openai` client:
SmolLM2 chat (streaming and not, as a `python -m accelab.serve` subprocess), MiniLM embeddings,
a tiny VLM with an image, a ViT classifier; and batched generation equal to one-by-one."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from accelab.catalog.fetch import is_fetched
from accelab.serve.images import encode_png

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


def needs(*names: str):
    missing = [n for n in names if not is_fetched(n)]
    return pytest.mark.skipif(bool(missing), reason=f"run `accelab models fetch {' '.join(missing)}` first")


def in_process_server(model: str, **config):
    from serving import running_server

    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.app import create_app
    from accelab.serve.config import ServeConfig
    from accelab.serve.server import engine_factory

    factory = engine_factory(resolve(model, fetch=False), load_plan("baseline"), torch.device("cpu"), name=model)
    return running_server(create_app(ServeConfig(model_name=model, **config), factory))


@needs("smollm2-135m")
def test_openai_client_chat_with_smollm2_streaming_and_not():
    from serving import ServerProcess

    server = ServerProcess("-m", "accelab.serve", "smollm2-135m", "--port", "0", "--max-tokens", "64", timeout_s=120)
    try:
        server.wait_ready(timeout_s=180)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model="smollm2-135m", messages=question, max_tokens=8, temperature=0)
        answer = reply.choices[0].message.content
        assert "Paris" in answer
        assert reply.usage.prompt_tokens > 5 and 1 <= reply.usage.completion_tokens <= 8
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

        stream = client.chat.completions.create(
            model="smollm2-135m",
            messages=question,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert len({c.id for c in chunks}) == 1  # one id per stream
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == answer  # greedy: streamed and not streamed agree
        assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
        assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [reply.choices[0].finish_reason]

        short = client.completions.create(
            model="smollm2-135m", prompt="The capital of Germany is", max_tokens=3, temperature=0
        )
        assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="smollm2-135m", messages=question, max_tokens=65)
        assert err.value.status_code == 413
    finally:
        server.stop()
    assert server.proc.returncode == 0


@needs("minilm-l6")
def test_openai_client_embeddings_with_minilm_and_a_loadtest():
    from accelab.catalog import inputs
    from accelab.loadtest.client import LoadConfig, run_load
    from accelab.loadtest.summary import parse_slo, summarize_run

    with in_process_server("minilm-l6", max_batch_size=16, max_wait_ms=5) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        texts = ["A man is playing a guitar.", "Someone plays an acoustic guitar.", "The stock market fell today."]
        as_base64 = client.embeddings.create(model="minilm-l6", input=texts)  # the client asks for base64
        as_floats = client.embeddings.create(model="minilm-l6", input=texts, encoding_format="float")
        a, b, c = (d.embedding for d in as_floats.data)
        assert len(a) == 384 and math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-4)
        cosine = lambda u, v: sum(x * y for x, y in zip(u, v))  # noqa: E731 - unit vectors
        assert cosine(a, b) > 0.5 > cosine(a, c)
        assert max(abs(x - y) for x, y in zip(as_base64.data[0].embedding, a)) < 1e-6
        single = client.embeddings.create(model="minilm-l6", input=texts[2], encoding_format="float")
        assert max(abs(x - y) for x, y in zip(single.data[0].embedding, c)) < 1e-5  # batching changes nothing
        assert as_floats.usage.prompt_tokens > 10
        many = inputs.sentences(20)  # > one sub-batch of 16: sorted by length inside, order kept outside
        together = client.embeddings.create(model="minilm-l6", input=many, encoding_format="float").data
        for i in (0, 7, 19):
            alone = client.embeddings.create(model="minilm-l6", input=many[i], encoding_format="float").data[0]
            assert together[i].index == i
            assert max(abs(x - y) for x, y in zip(together[i].embedding, alone.embedding)) < 1e-5

        config = LoadConfig(
            url=url,
            endpoint="embeddings",
            inputs=tuple(inputs.sentences(50)),
            concurrency=4,
            requests=24,
            duration_s=30,
            warmup=2,
        )
        summary = summarize_run(run_load(config, "minilm-l6"), parse_slo("e2e=5s"))
        assert summary["requests"] == 24 and summary["ok"] == 24
        assert summary["e2e_ms"]["p50"] <= summary["e2e_ms"]["p99"] < 5000
        assert summary["goodput_fraction"] == 1.0 and summary["request_throughput"] > 1
        batches = httpx.get(f"{url}/metrics").text
        assert 'accelab_batch_size_bucket{le="1.0"}' in batches


@needs("smolvlm-tiny", "smollm2-135m")
def test_vision_language_chat_with_an_image_part():
    from accelab.catalog import inputs

    image = encode_png(inputs.photos(1)[0].resize((64, 48)))
    with in_process_server("smolvlm-tiny", max_images=2) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        content = [
            {"type": "text", "text": "What is in this photo?"},
            {"type": "image_url", "image_url": {"url": image}},
        ]
        three = [{"type": "image_url", "image_url": {"url": image}}] * 3
        many = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": three}]})
        assert many.status_code == 413 and "--max-images" in many.json()["error"]["message"]
        # the server's own address: refused before any byte is fetched (--allow-private-images to allow)
        inside = [{"type": "image_url", "image_url": {"url": f"{url}/metrics"}}]
        refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": inside}]})
        assert refused.status_code == 400, refused.text
        assert "image 0" in refused.text and "private, loopback" in refused.text
        reply = client.chat.completions.create(
            model="smolvlm-tiny", messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0
        )
        text_only = client.chat.completions.create(
            model="smolvlm-tiny",
            messages=[{"role": "user", "content": "What is in this photo?"}],
            max_tokens=4,
            temperature=0,
        )
        assert reply.usage.completion_tokens >= 1
        assert reply.usage.prompt_tokens > text_only.usage.prompt_tokens + 10  # the image's tokens count
        bad = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
                        ],
                    }
                ]
            },
        )
        assert bad.status_code == 422 and "image 0" in bad.json()["error"]["message"]
        # tools reach a vision chat's prompt (in its system message), and the grammar holds the answer to a call
        weather = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
        called = client.chat.completions.create(
            model="smolvlm-tiny",
            messages=[{"role": "user", "content": content}],
            tools=[weather],
            tool_choice="required",
            max_tokens=48,
            temperature=0,
        )
        assert called.usage.prompt_tokens > reply.usage.prompt_tokens + 10  # the tool spec is in the prompt
        choice = called.choices[0]
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls[0].function.name == "get_weather"
        else:  # the tiny model's city string can run to max_tokens, inside the call the grammar started
            assert choice.finish_reason == "length", choice
            assert choice.message.content.replace(" ", "").startswith('<tool_call>{"name":"get_weather","arguments":{')
        # /metrics: the two answered requests with an image (the refused ones are not counted)
        lines = dict(line.rsplit(" ", 1) for line in httpx.get(f"{url}/metrics").text.splitlines() if line[:1] != "#")
        assert float(lines["accelab_request_images_sum"]) == 2 and float(lines["accelab_request_images_count"]) == 2
        assert float(lines["accelab_image_preprocess_seconds_count"]) == 2
        assert 0 < float(lines["accelab_image_preprocess_seconds_sum"]) < 30
        # accelab loadtest --images generated:3 --images-per-request 2: every request carries its images
        from accelab.loadtest.client import LoadConfig, run_load
        from accelab.loadtest.images import load_images

        load = LoadConfig(
            url=url,
            inputs=("Describe it.",),
            concurrency=2,
            requests=3,
            warmup=0,
            max_tokens=2,
            images=load_images("generated:3"),
            images_per_request=2,
        )
        records = run_load(load, "smolvlm-tiny")
        assert [r.status for r in records] == ["200"] * 3, [r.error for r in records]
        after = dict(line.rsplit(" ", 1) for line in httpx.get(f"{url}/metrics").text.splitlines() if line[:1] != "#")
        assert float(after["accelab_request_images_sum"]) == 2 + 3 * 2


@needs("vit-tiny")
def test_classify_images_top_k():
    from accelab.catalog import inputs

    photos = [encode_png(p) for p in inputs.photos(3)]
    with in_process_server("vit-tiny", max_wait_ms=20) as url:
        r = httpx.post(f"{url}/v1/classify", json={"images": photos, "top_k": 3})
        assert r.status_code == 200
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2]
        for item in data:
            scores = [label["score"] for label in item["labels"]]
            assert len(scores) == 3 and scores == sorted(scores, reverse=True) and sum(scores) <= 1.0001
        one = httpx.post(f"{url}/v1/classify", json={"image": photos[1], "top_k": 3}).json()["data"][0]
        assert [x["label"] for x in one["labels"]] == [x["label"] for x in data[1]["labels"]]
        bad = httpx.post(f"{url}/v1/classify", json={"images": ["%%%"]})
        assert bad.status_code == 422 and "images[0]" in bad.json()["error"]["message"]


@needs("smollm2-135m")
def test_batched_left_padded_generation_equals_one_by_one():
    """A tiny random Llama with SmolLM2's tokenizer: rows of different lengths and sampling
    settings in one batch give the same greedy tokens as each alone."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from accelab.catalog.store import model_dir
    from accelab.plan.runtime import Runnable
    from accelab.serve.engines.base import GenUnit, SamplingParams
    from accelab.serve.engines.generation import HFGenerationEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    engine = HFGenerationEngine(
        Runnable(model=model, processor=tokenizer, device=torch.device("cpu"), task="text-generation"), name="tiny"
    )
    prompts = ["Hi", "Tell me a long story about a dragon and a castle by the sea", "What is 2 + 2?"]

    def unit(text: str, temperature: float = 0.0, max_tokens: int = 8) -> GenUnit:
        return GenUnit(
            prompt=engine.prepare_chat([{"role": "user", "content": text}]),
            params=SamplingParams(max_tokens=max_tokens, temperature=temperature),
        )

    alone = [engine.generate([unit(p)])[0] for p in prompts]
    together = engine.generate([unit(p) for p in prompts])
    assert [c.text for c in together] == [c.text for c in alone]
    assert all(c.completion_tokens == 8 for c in together)
    mixed = engine.generate([unit(prompts[0], temperature=1.0), unit(prompts[1], max_tokens=3)])
    assert mixed[1].text == engine.generate([unit(prompts[1], max_tokens=3)])[0].text  # greedy beside sampled
    assert mixed[1].completion_tokens == 3 and mixed[1].finish_reason == "length"


@needs("minilm-l6", "smollm2-135m")
def test_token_ids_past_the_vocabulary_and_inputs_past_the_window_on_every_text_route():
    """The model's edges: an id the embedding table does not have is a 422 naming it, an input
    longer than the model takes is a 400 with both lengths, and "truncate": true embeds or
    generates from what fits and says in usage how many tokens it left out."""
    long_text = "the quick brown fox jumps over the lazy dog " * 4000  # ~36k tokens, 176 KB
    with in_process_server("minilm-l6") as url:
        r = httpx.post(f"{url}/v1/embeddings", json={"input": [[101, 1000000000, 102]]})
        assert r.status_code == 422
        assert "token id 1000000000" in r.json()["error"]["message"] and "0 to 30521" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/embeddings", json={"input": [[101, -5]]})
        assert r.status_code == 422 and "token id -5" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/embeddings", json={"input": ["short", long_text]}, timeout=60)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "input[1] has 36002 tokens" in message and "at most 128" in message and '"truncate": true' in message
        r = httpx.post(f"{url}/v1/embeddings", json={"input": long_text, "truncate": True}, timeout=60).json()
        assert r["usage"]["prompt_tokens"] == 128 and r["usage"]["truncated_tokens"] == 36002 - 128
        window = " ".join(long_text.split()[:200])
        first = httpx.post(f"{url}/v1/embeddings", json={"input": window, "truncate": True}).json()
        assert first["data"][0]["embedding"] == r["data"][0]["embedding"]  # the same first 128 tokens
        ok = httpx.post(f"{url}/v1/embeddings", json={"input": "a short sentence"}).json()
        assert "truncated_tokens" not in ok["usage"]
    with in_process_server("smollm2-135m", max_tokens=64) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 49152], "max_tokens": 2})
        assert r.status_code == 422 and "token id 49152" in r.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": long_text[:40000]}], "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 400, r.text
        assert "is more than smollm2-135m's context of 8192 tokens" in r.json()["error"]["message"]
