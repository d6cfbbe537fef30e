"""`accelab predict` end to end on real catalog models and real photos/sentences, through the CLI:
1 process against 2 (torchrun, gloo), a run killed with SIGKILL and resumed with another process
count, corrupt images, and the user errors. The nproc-1 runs happen in this process (as the
command does), the nproc-2 runs under torchrun; `--threads 1` keeps them fast on a shared 2-core box."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import typer
from typer.testing import CliRunner

from accelab.predict.commands import register
from accelab.predict.outputs import read_output
from accelab.predict.parts import parts_path, sidecar_path
from accelab.results.store import Store

pytestmark = pytest.mark.slow

N_IMAGES = 240
N_SENTENCES = 2000
TOL = 1e-5


def cli(*args: str, ok: bool = True):
    app = typer.Typer()
    register(app)
    app.command("noop", hidden=True)(lambda: None)  # two commands: `predict` stays a subcommand
    result = CliRunner().invoke(app, ["predict", *args])
    if ok and result.exit_code != 0:
        raise AssertionError(
            f"predict {' '.join(args)} failed ({result.exit_code}):\n{result.output}\n{result.exception!r}"
        )
    return result


def predict(model: str, inputs: Path, out: Path, *extra: str) -> dict:
    """One run; its Result as a dict (from --json)."""
    doc = out.with_name(out.name + ".result.json")
    cli(model, "--inputs", str(inputs), "--out", str(out), "--no-progress", "--no-store", "--json", str(doc), *extra)
    return json.loads(doc.read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from accelab.catalog import inputs

    root = tmp_path_factory.mktemp("predict")
    images = root / "images"
    for i, photo in enumerate(inputs.photos(N_IMAGES)):  # real photos, augmented past the 14 originals
        photo.thumbnail((96, 96))
        folder = images / f"set{i % 3}" / ("nested" if i % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        photo.save(folder / f"photo{i:04d}.{'jpg' if i % 2 else 'png'}")
    broken = images / "broken"
    broken.mkdir()
    (broken / "random.jpg").write_bytes(np.random.default_rng(0).bytes(5000))
    png = (images / "set0" / "photo0000.png").read_bytes()
    (broken / "truncated.png").write_bytes(png[: len(png) // 2])
    texts = root / "sentences.jsonl"
    texts.write_text(
        "".join(json.dumps({"id": f"s{i}", "text": t}) + "\n" for i, t in enumerate(inputs.sentences(N_SENTENCES)))
    )
    return {"root": root, "images": images, "texts": texts}


@pytest.fixture(scope="module")
def classified(data):
    out = data["root"] / "classes-1.jsonl"
    return predict("vit-tiny", data["images"], out, "--threads", "1", "--top-k", "3"), out


@pytest.fixture(scope="module")
def embedded(data):
    out = data["root"] / "embeddings-1.jsonl"
    return predict("minilm-l6", data["texts"], out, "--threads", "1", "--max-length", "64"), out


# images ------------------------------------------------------------------------------------------
def test_classifies_a_folder_and_skips_corrupt_files(data, classified):
    result, out = classified
    rows = read_output(out)
    assert result["status"] == "ok" and len(rows) == N_IMAGES
    ids = [r["id"] for r in rows]
    assert ids == sorted(ids) and [r["index"] for r in rows] == sorted(r["index"] for r in rows)  # input order
    assert "set1/nested/photo0001.jpg" in ids and "set0/photo0000.png" in ids
    for row in rows[:20]:
        scores = [p["score"] for p in row["predictions"]]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1 + TOL
        assert all(p["label"] == str(p["class_id"]) for p in row["predictions"])  # vit-tiny's id2label
    skipped = [json.loads(line) for line in sidecar_path(out, "skipped").read_text().splitlines()]
    assert [s["id"] for s in skipped] == ["broken/random.jpg", "broken/truncated.png"]
    assert all("unreadable image" in s["reason"] for s in skipped)
    m = result["metrics"]
    assert (m["items"], m["rows"], m["skipped"]) == (N_IMAGES + 2, N_IMAGES, 2)
    assert m["items_per_s"] > 0 and 0 < m["compute_fraction"] <= 1 and 0 <= m["wait_fraction"] < 1
    assert m["peak_rss_mb_max"] > 100 and m["cpu_util_fraction"] > 0
    assert not parts_path(out).exists()


def test_two_processes_classify_identically_into_parquet(data, classified):
    _, reference = classified
    out = data["root"] / "classes-2.parquet"
    result = predict("vit-tiny", data["images"], out, "--nproc", "2", "--top-k", "3")
    assert result["workload"]["world_size"] == 2 and len(result["metrics"]["ranks"]) == 2
    assert all(r["items"] > 0 for r in result["metrics"]["ranks"])  # both ranks worked
    one, two = read_output(reference), read_output(out)
    assert [(r["index"], r["id"]) for r in one] == [(r["index"], r["id"]) for r in two]
    for a, b in zip(one, two):
        assert [p["class_id"] for p in a["predictions"]] == [p["class_id"] for p in b["predictions"]]
        assert np.allclose([p["score"] for p in a["predictions"]], [p["score"] for p in b["predictions"]], atol=TOL)
    assert result["metrics"]["skipped"] == 2


# texts -------------------------------------------------------------------------------------------
def test_embeds_sentences_in_input_order(data, embedded):
    result, out = embedded
    rows = read_output(out)
    assert [r["id"] for r in rows] == [f"s{i}" for i in range(N_SENTENCES)]
    vectors = np.array([r["embedding"] for r in rows])
    assert vectors.shape == (N_SENTENCES, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    groups: dict[str, list[int]] = {}  # the sentences cycle: the same text recurs, in other batches
    for i, line in enumerate(data["texts"].read_text().splitlines()):
        groups.setdefault(json.loads(line)["text"], []).append(i)
    assert max(len(g) for g in groups.values()) > 1
    for members in groups.values():  # the same text gives the same vector, whatever its batch
        assert np.abs(vectors[members] - vectors[members[0]]).max() < TOL
    assert result["metrics"]["rows"] == N_SENTENCES


def test_two_processes_embed_identically_into_npy(data, embedded):
    _, reference = embedded
    out = data["root"] / "embeddings-2.npy"
    predict("minilm-l6", data["texts"], out, "--nproc", "2", "--max-length", "64")
    one, two = read_output(reference), read_output(out)
    assert [r["id"] for r in two] == [r["id"] for r in one]
    assert np.abs(np.array([r["embedding"] for r in one]) - np.load(out)).max() < TOL


def test_killed_run_resumes_with_another_process_count_without_redoing(data, embedded):
    _, reference = embedded
    out = data["root"] / "killed.jsonl"
    parts = parts_path(out)
    cmd = [
        sys.executable,
        "-m",
        "accelab.predict",
        "minilm-l6",
        "--inputs",
        str(data["texts"]),
        "--out",
        str(out),
        "--nproc",
        "2",
        "--max-length",
        "64",
        "--chunk-size",
        "32",
        "--no-progress",
        "--no-store",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while len(list(parts.glob("a*-chunk*.jsonl"))) < 4:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no chunk written in time"
            time.sleep(0.1)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)  # the parent only: torchrun and the ranks must die with it
        proc.wait()
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
    done = len({i for p in parts.glob("a*-chunk*.jsonl") for i in json.loads(p.open().readline())["indices"]})
    assert 0 < done < N_SENTENCES and not out.exists()

    result = predict("minilm-l6", data["texts"], out, "--max-length", "64", "--threads", "1")  # 1 process now
    m = result["metrics"]
    assert (m["done_before"], m["processed"], m["attempt"]) == (done, N_SENTENCES - done, 2)  # nothing redone
    rows, expected = read_output(out), read_output(reference)
    assert [r["index"] for r in rows] == list(range(N_SENTENCES))  # complete, ordered, no duplicates
    assert [r["id"] for r in rows] == [r["id"] for r in expected]
    assert np.abs(np.array([r["embedding"] for r in rows]) - np.array([r["embedding"] for r in expected])).max() < TOL
    assert not parts.exists()


def test_result_is_stored_and_rerun_needs_overwrite(data, tmp_path):
    out, db = tmp_path / "few.jsonl", tmp_path / "results.db"
    args = [
        "minilm-l6",
        "--inputs",
        str(data["texts"]),
        "--out",
        str(out),
        "--limit",
        "40",
        "--max-length",
        "32",
        "--threads",
        "1",
        "--no-progress",
        "--db",
        str(db),
        "--tag",
        "t",
    ]
    cli(*args)
    (stored,) = Store(db).query(kind="predict")
    assert stored.status == "ok" and stored.tag == "t" and stored.metrics["rows"] == 40
    assert stored.workload["task"] == "feature-extraction" and stored.workload["limit"] == 40
    assert stored.metrics["per_process_items_per_s"][0] > 0
    again = cli(*args, ok=False)
    assert isinstance(again.exception, ValueError) and "--overwrite" in str(again.exception)
    cli(*args, "--overwrite")
    assert len(read_output(out)) == 40


# vision-language and generation ------------------------------------------------------------------
def test_vision_language_model_answers_the_prompt_for_each_image(data, tmp_path):
    folder = tmp_path / "three"
    folder.mkdir()
    for name in ("photo0000.png", "photo0006.png", "photo0012.png"):
        (folder / name).write_bytes((data["images"] / "set0" / name).read_bytes())
    out = tmp_path / "vlm.jsonl"
    result = predict("smolvlm-tiny", folder, out, "--max-new-tokens", "3", "--prompt", "What is this?")
    rows = read_output(out)
    assert [r["id"] for r in rows] == ["photo0000.png", "photo0006.png", "photo0012.png"]
    assert all(isinstance(r["generated_text"], str) and 1 <= r["new_tokens"] <= 3 for r in rows)
    assert result["workload"]["prompt"] == "What is this?"


def test_text_generation_applies_the_chat_template_and_decodes_new_tokens_only():
    from accelab.catalog.load import load_processor
    from accelab.catalog.resolve import resolve
    from accelab.predict.tasks import GenerateText

    tokenizer = load_processor(resolve("smollm2-135m"))
    handler = GenerateText(tokenizer, max_new_tokens=4, max_length=None)
    batch = handler.encode(["Hi", "What is the capital of France?"])
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][:, -1].all()  # left padded
    assert "<|im_start|>assistant" in tokenizer.decode(batch["input_ids"][1])
    answer = tokenizer("Paris", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id

    class FakeRunnable:  # continues every prompt with "Paris" + eos, then padding
        def generate(self, b, **kwargs):
            assert kwargs["max_new_tokens"] == 4 and kwargs["do_sample"] is False
            tail = torch.tensor([answer + [eos] * (4 - len(answer))] * b["input_ids"].shape[0])
            return torch.cat([b["input_ids"], tail], dim=1)

    rows = handler.predict(FakeRunnable(), batch)
    assert [r["generated_text"] for r in rows] == ["Paris", "Paris"]
    assert rows[0]["new_tokens"] == len(answer) + 1


# user errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model,make,message",
    [
        ("vit-tiny", lambda p: p.mkdir() or p, "no images found"),
        (
            "minilm-l6",
            lambda p: (p.with_suffix(".xlsx").write_bytes(b"PK"), p.with_suffix(".xlsx"))[1],
            "unknown format .xlsx",
        ),
        ("minilm-l6", lambda p: (p.with_suffix(".jsonl").write_text(""), p.with_suffix(".jsonl"))[1], "no rows"),
        ("minilm-l6", "images", r"holds images, but minilm-l6 \(feature-extraction\) takes texts"),
        ("vit-tiny", "texts", r"holds texts, but vit-tiny \(image-classification\) takes images"),
    ],
)
def test_clear_errors_for_bad_sources_and_wrong_tasks(data, tmp_path, model, make, message):
    source = data[make] if isinstance(make, str) else make(tmp_path / "src")
    result = cli(model, "--inputs", str(source), "--out", str(tmp_path / "o.jsonl"), ok=False)
    assert result.exit_code != 0 and isinstance(result.exception, ValueError)
    assert re.search(message, str(result.exception)), str(result.exception)


def test_npy_output_needs_an_embedding_model(data, tmp_path):
    result = cli("vit-tiny", "--inputs", str(data["images"]), "--out", str(tmp_path / "x.npy"), ok=False)
    assert isinstance(result.exception, ValueError) and "write .jsonl or .parquet" in str(result.exception)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned memory, non-blocking copies)")
def test_gpu_run_matches_the_cpu_run(data, classified):
    _, reference = classified
    out = data["root"] / "classes-gpu.jsonl"
    result = predict("vit-tiny", data["images"], out, "--device", "cuda", "--top-k", "3")
    assert result["metrics"]["device"].startswith("cuda") and result["metrics"]["gpu_peak_allocated_mb_max"] > 0
    for a, b in zip(read_output(reference), read_output(out)):
        assert a["id"] == b["id"]
        assert np.allclose([p["score"] for p in a["predictions"]], [p["score"] for p in b["predictions"]], atol=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="TF32 runs on a GPU")
def test_a_plan_that_cannot_run_here_is_reported_as_unsupported(data, tmp_path):
    result = cli(
        "minilm-l6", "--inputs", str(data["texts"]), "--out", str(tmp_path / "o.jsonl"), "--plan", "tf32", ok=False
    )
    assert result.exit_code == 3 and "TF32" in result.output and not (tmp_path / "o.jsonl").exists()
