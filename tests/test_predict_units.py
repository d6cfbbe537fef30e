"""Pure parts of `accelab predict`: the work plan, chunk files and resume bookkeeping, merging into
each output format, sources (folders, tables, saved datasets), the collator's bad-item handling
and the config. No model is loaded; milliseconds to a second each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from accelab.predict.chunks import (
    Chunk,
    plan_work,
    processing_order,
    rounded_chunk_size,
)
from accelab.predict.config import (
    PredictConfig,
    default_chunk_size,
    default_workers,
    output_format,
)
from accelab.predict.outputs import merge, read_output
from accelab.predict.parts import Parts, sidecar_path
from accelab.predict.pipeline import Collator, Example, ItemDataset
from accelab.predict.sources import BadItem, open_source


def make_config(tmp_path: Path, **changes) -> PredictConfig:
    base = {
        "spec": {"name": "m", "source": "/m"},
        "plan": {"name": "baseline", "precision": "fp32"},
        "source": "/data",
        "out": str(tmp_path / "out.jsonl"),
        "task": "feature-extraction",
        "source_items": 10,
        "source_digest": "abc",
    }
    return PredictConfig(**{**base, **changes})


# work plan ---------------------------------------------------------------------------------
def test_texts_are_processed_longest_first_and_images_in_input_order():
    assert processing_order([0, 1, 2, 3], [5, 9, 5, 1]) == [1, 0, 2, 3]  # ties keep input order
    assert processing_order([3, 1, 2], None) == [3, 1, 2]


def test_plan_deals_chunks_round_robin_and_batches_never_straddle_chunks():
    work = plan_work(total=10, done=set(), lengths=None, chunk_size=4, world_size=2, attempt=1)
    assert [c.indices for c in work.chunks] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert [c.rank for c in work.chunks] == [0, 1, 0]
    assert [c.indices for c in work.for_rank(0)] == [(0, 1, 2, 3), (8, 9)]
    assert work.chunks[0].batches(3) == [[0, 1, 2], [3]]
    assert work.chunks[0].name == "a001-rank0-chunk00000"


def test_same_batches_whatever_the_process_count():
    lengths = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]
    batches = {}
    for world in (1, 2, 3):
        work = plan_work(total=10, done=set(), lengths=lengths, chunk_size=4, world_size=world, attempt=1)
        batches[world] = sorted(tuple(b) for c in work.chunks for b in c.batches(2))
    assert batches[1] == batches[2] == batches[3]


def test_resume_plans_only_items_not_done_for_any_process_count():
    done = {0, 1, 2, 3, 8}
    work = plan_work(total=10, done=done, lengths=None, chunk_size=2, world_size=3, attempt=2)
    planned = [i for c in work.chunks for i in c.indices]
    assert sorted(planned) == [4, 5, 6, 7, 9]
    assert work.done_before == 5 and work.remaining == 5 and work.attempt == 2
    assert {c.rank for c in work.chunks} == {0, 1, 2}


def test_chunk_sizes():
    assert rounded_chunk_size(100, 32) == 128 and rounded_chunk_size(64, 32) == 64
    assert default_chunk_size(32, 100_000) == 256  # 8 batches
    assert default_chunk_size(32, 600) == 38  # small inputs: ~16 chunks, rounded up to whole batches later
    assert default_workers(2, 1) == 1 and default_workers(2, 2) == 0 and default_workers(64, 2) == 4


# parts: atomic chunks, manifest, resume checks --------------------------------------------------
def rows_for(chunk: Chunk) -> list[dict]:
    return [{"index": i, "id": f"item{i}", "embedding": [float(i), 1.0]} for i in chunk.indices]


def test_chunk_files_give_the_done_set_and_no_temporary_file_is_left(tmp_path):
    parts = Parts(tmp_path / "out.jsonl")
    attempt = parts.begin_attempt({"k": 1}, {"world_size": 2})
    work = plan_work(total=6, done=set(), lengths=None, chunk_size=2, world_size=2, attempt=attempt)
    for chunk in work.chunks[:2]:
        parts.write_chunk(chunk, list(reversed(rows_for(chunk))))
    assert parts.done_indices() == {0, 1, 2, 3}
    assert not list(parts.dir.glob(".tmp-*"))
    header = json.loads(parts.chunk_files()[0].read_text().splitlines()[0])
    assert header == {"chunk": "a001-rank0-chunk00000", "indices": [0, 1]}
    assert parts.begin_attempt({"k": 1}, {}) == 2
    with pytest.raises(AssertionError):
        parts.write_chunk(work.chunks[2], rows_for(work.chunks[2])[:1])  # a missing row is a bug


def test_resuming_with_other_settings_is_refused_with_the_fix(tmp_path):
    config = make_config(tmp_path)
    parts = Parts(config.out)
    parts.begin_attempt(config.identity(), {})
    parts.check_compatible(make_config(tmp_path, batch_size=8, chunk_size=64, world_size=2).identity())  # fine
    with pytest.raises(ValueError, match=r"options.*max_length.*--overwrite"):
        parts.check_compatible(make_config(tmp_path, max_length=64).identity())
    with pytest.raises(ValueError, match=r"digest"):
        parts.check_compatible(make_config(tmp_path, source_digest="changed").identity())


@pytest.mark.parametrize("fmt", ["jsonl", "npy", "parquet"])
def test_merge_writes_input_order_and_lists_skipped_items(tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    parts = Parts(out)
    parts.begin_attempt({}, {})
    work = plan_work(total=7, done=set(), lengths=[1, 7, 2, 6, 3, 5, 4], chunk_size=3, world_size=2, attempt=1)
    for chunk in work.chunks:
        rows = rows_for(chunk)
        rows = [{"index": r["index"], "id": r["id"], "skipped": "bad bytes"} if r["index"] == 4 else r for r in rows]
        parts.write_chunk(chunk, rows)
    merged = merge(parts, total=7, out=out, fmt=fmt)
    assert (merged.rows, merged.skipped) == (6, 1)
    rows = read_output(out)
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 5, 6]
    assert [r["id"] for r in rows] == ["item0", "item1", "item2", "item3", "item5", "item6"]
    assert np.allclose([r["embedding"][0] for r in rows], [0, 1, 2, 3, 5, 6])
    skipped = [json.loads(line) for line in sidecar_path(out, "skipped").read_text().splitlines()]
    assert skipped == [{"index": 4, "id": "item4", "reason": "bad bytes"}]
    if fmt == "npy":
        assert np.load(out).dtype == np.float32 and sidecar_path(out, "ids").is_file()


def test_merge_refuses_an_incomplete_set(tmp_path):
    parts = Parts(tmp_path / "out.jsonl")
    parts.begin_attempt({}, {})
    work = plan_work(total=4, done=set(), lengths=None, chunk_size=2, world_size=1, attempt=1)
    parts.write_chunk(work.chunks[0], rows_for(work.chunks[0]))
    with pytest.raises(RuntimeError, match="2 item"):
        merge(parts, total=4, out=tmp_path / "out.jsonl", fmt="jsonl")
    assert not (tmp_path / "out.jsonl").exists()


# sources ----------------------------------------------------------------------------------------
def test_image_folder_is_recursive_sorted_and_bad_files_fail_only_when_loaded(tmp_path):
    (tmp_path / "b" / "deep").mkdir(parents=True)
    Image.new("RGB", (8, 8), "red").save(tmp_path / "b" / "deep" / "x.png")
    Image.new("RGB", (8, 8), "blue").save(tmp_path / "a.JPG")
    (tmp_path / "c.webp").write_bytes(b"not an image")
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / ".hidden.png").write_bytes(b"")
    source = open_source(tmp_path, want="image")
    assert source.ids == ["a.JPG", "b/deep/x.png", "c.webp"]
    assert source.load(1).size == (8, 8)
    with pytest.raises(BadItem, match="unreadable image"):
        source.load(2)
    assert "1 file(s)" in source.notes[0]
    assert source.head(2).ids == ["a.JPG", "b/deep/x.png"]


def test_jsonl_text_field_detection_ids_and_bad_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "body": "hello", "n": 1}\nnot json\n{"id": "c", "body": null}\n\n{"body": "fourth"}\n')
    source = open_source(path, want="text")
    assert source.column == "body" and source.ids == ["a", 1, "c", 3]
    assert source.load(0) == "hello" and source.load(3) == "fourth"
    for bad in (1, 2):
        with pytest.raises(BadItem):
            source.load(bad)
    assert source.lengths() == [5, 0, 0, 6]
    preferred = tmp_path / "p.jsonl"
    preferred.write_text('{"prompt": "x", "other": "y"}\n')
    assert open_source(preferred, want="text").column == "prompt"


def test_csv_txt_and_saved_dataset_sources(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("id,sentence,label\n7,first one,x\n8,second,y\n")
    source = open_source(csv_path, want="text")
    assert source.column == "sentence" and source.ids == ["7", "8"]
    txt = tmp_path / "t.txt"
    txt.write_text("one\n\ntwo\n")
    assert open_source(txt, want="text").texts == ["one", "two"]

    from datasets import Dataset, DatasetDict

    data = Dataset.from_dict({"text": ["a b", "c"], "label": [0, 1]})
    DatasetDict({"train": data, "test": data}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="--split"):
        open_source(tmp_path / "dd", want="text")
    source = open_source(tmp_path / "dd", want="text", split="test")
    assert source.texts == ["a b", "c"] and source.ids == [0, 1]
    images = Dataset.from_dict({"image": [Image.new("RGB", (4, 4))] * 2})
    images.save_to_disk(str(tmp_path / "imgs"))
    assert open_source(tmp_path / "imgs", want="image").load(1).size == (4, 4)


@pytest.mark.parametrize(
    "make,want,message",
    [
        (lambda p: p.mkdir(), "image", "no images found"),
        (lambda p: (p.mkdir(), (p / "readme.md").write_text("x")), "image", "not images"),
        (lambda p: p.with_suffix(".xlsx").write_bytes(b"PK"), "text", "unknown format .xlsx"),
        (lambda p: p.with_suffix(".jsonl").write_text(""), "text", "no rows"),
        (lambda p: (p.mkdir(), Image.new("RGB", (4, 4)).save(p / "x.png")), "text", "holds images, but m takes texts"),
        (lambda p: p.with_suffix(".txt").write_text("hello\n"), "image", "holds texts, but m takes images"),
    ],
)
def test_bad_sources_say_what_and_how_to_fix(tmp_path, make, want, message):
    base = tmp_path / "src"
    make(base)
    path = next(tmp_path.iterdir())
    with pytest.raises(ValueError, match=message):
        open_source(path, want=want, taker="m")


def test_source_digest_changes_with_the_inputs(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a\nb\n")
    before = open_source(path, want="text").digest()
    path.write_text("a\nc\n")
    assert open_source(path, want="text").digest() != before


# the collator: a bad item costs only itself -------------------------------------------------------
def test_collator_skips_undecodable_and_unprocessable_items():
    def encode(values):
        if any(v < 0 for v in values):
            raise ValueError("negative")
        return {"x": torch.tensor(values)}

    collate = Collator(encode)
    batch = collate([Example(0, 1), Example(1, None, "unreadable image"), Example(2, -5), Example(3, 4)])
    assert batch.indices == [0, 3] and batch.tensors["x"].tolist() == [1, 4]
    assert batch.skipped[0] == (1, "unreadable image")
    assert batch.skipped[1][0] == 2 and "negative" in batch.skipped[1][1]
    empty = collate([Example(5, None, "bad")])
    assert empty.indices == [] and empty.skipped == [(5, "bad")]


def test_dataset_turns_bad_items_into_examples_with_a_reason(tmp_path):
    (tmp_path / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    example = ItemDataset(open_source(tmp_path, want="image"))[0]
    assert example.payload is None and "unreadable image" in example.error


# config ------------------------------------------------------------------------------------------
def test_config_checks_and_round_trip(tmp_path):
    config = make_config(tmp_path, top_k=3)
    assert PredictConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert output_format("x.NPY") == "npy"
    with pytest.raises(ValueError, match=r"unknown output format \.csv.*\.jsonl"):
        make_config(tmp_path, out=str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match="--batch-size 0"):
        make_config(tmp_path, batch_size=0)
    with pytest.raises(ValueError, match="unknown PredictConfig"):
        PredictConfig.from_dict({**config.to_dict(), "bogus": 1})
