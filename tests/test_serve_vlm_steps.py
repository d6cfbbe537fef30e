"""Vision-language models in the continuous steps (Idefics3 / SmolVLM and LLaVA, the catalog's tiny
ones: real processors, random weights): images, text and both packed in one running batch, with
chunked prefill across image tokens and the prefix cache on, give every request's greedy tokens of
transformers' own `generate` for that request alone; each distinct image is encoded once; two
images behind the same text never share KV blocks; a fault in the image path is caught at start-up
and the server falls back to per-batch generation."""

from __future__ import annotations

import threading
from dataclasses import replace

import greenlet
import pytest
import torch
from fake_clock import FakeClock

from accelab.catalog.fetch import is_fetched
from accelab.catalog.samples import photos
from accelab.plan.runtime import Unsupported
from accelab.serve.engines.base import SamplingParams, StepInput
from accelab.serve.runner.vision import VisionEncoder, prompt_keys
from accelab.serve.scheduler import Scheduler, SchedulerConfig
from accelab.serve.stops import StopRules

MODELS = ["smolvlm-tiny", "llava-tiny"]
pytestmark = pytest.mark.skipif(
    not all(is_fetched(m) for m in MODELS), reason=f"run `accelab models fetch {' '.join(MODELS)}` first"
)


@pytest.fixture(scope="module", params=MODELS)
def vlm(request):
    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.engines import build_engine

    engine = build_engine(resolve(request.param, fetch=False), load_plan("baseline"), torch.device("cpu"), name="vlm")
    yield engine
    engine.close()


def chat(text: str, images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


def prompts(vlm):
    """Two pictures, one of them twice (in two requests), a text-only chat, and one with two images."""
    a, b = (p.resize((80, 64)) for p in photos(2))
    return [
        vlm._vision_prompt(chat("What is in the picture?", 1), (a,)),
        vlm._vision_prompt(chat("What is in the picture?", 1), (b,)),  # same text, another image
        vlm.prepare_chat([{"role": "user", "content": "Count to ten, slowly."}]),
        vlm._vision_prompt(chat("Describe it in one line.", 1), (a,)),  # the first image again
        vlm._vision_prompt(chat("Which one is brighter?", 2), (b, a)),
    ]


def alone(vlm, prompt, new: int) -> list[int]:
    """transformers' generate on this prompt alone: the processor's tensors, greedy."""
    model, processor = vlm.runnable.model, vlm.processor
    if prompt.images:
        inputs = processor(text=[prompt.text], images=list(prompt.images), return_tensors="pt")
    else:
        ids = torch.tensor([prompt.ids])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def serve(
    engine, limits: SchedulerConfig, reqs, slice_s: float | None = None, batch: int = 1
) -> tuple[list[list[int]], Scheduler]:
    """The continuous worker's loop, single-threaded: schedule, copy-on-write, step, advance;
    with `slice_s`, images are encoded between the steps in slices of that long, up to `batch`
    in one forward (the worker's `_encode_images`: the whole of them when the step fed nothing)."""
    ahead = slice_s is not None
    sched = Scheduler(limits, FakeClock(), ready=engine.image_ready if ahead else None)
    greedy = SamplingParams(max_tokens=64, temperature=0)
    seqs = [
        sched.add(prompt, prompt.ids, stops=StopRules(max_tokens=new), cache_prompt=prompt_keys(prompt))
        for prompt, new in reqs
    ]
    while not sched.idle:
        step = sched.schedule()
        engine.copy_blocks(step.copies)
        inputs = [
            StepInput(
                seq_id=c.seq.id,
                start=c.start,
                tokens=c.tokens,
                sample=c.sample,
                params=greedy,
                blocks=tuple(c.seq.block_table),
                images=c.seq.payload.media if c.start < len(c.seq.prompt) else (),
            )
            for c in step.chunks
        ]
        picked = iter(engine.step(inputs) if inputs else ())
        for chunk in step.chunks:
            if sched.advance(chunk, next(picked).token if chunk.sample else None) is not None:
                sched.finish(chunk.seq)
                engine.release(chunk.seq.id)
        wanted = [(s.id, im) for s, key in step.encode for im in s.payload.media if im.key == key]
        if wanted:
            assert not engine.encode_ahead(wanted, slice_s if step.chunks else None, batch=batch)
    return [s.generated for s in seqs], sched


def test_image_text_and_mixed_batches_give_generates_greedy_tokens(vlm):
    reqs = [(p, n) for p, n in zip(prompts(vlm), (6, 5, 7, 4, 6))]
    # 20 tokens a step: prefill chunks end inside images; 4 sequences at once: images beside text
    limits = SchedulerConfig(max_running=4, max_step_tokens=20, kv_blocks=96, block_size=8, prefix_caching=True)
    engine = vlm.step_engine(limits)
    try:
        cache = engine.encoder_cache
        before = cache.misses
        got, _ = serve(engine, limits, reqs)
        assert got == [alone(vlm, p, n) for p, n in reqs]
        assert cache.misses - before == 2 and cache.hits >= 1  # two distinct pictures, each encoded once
    finally:
        engine.close()


def test_images_encoded_between_the_steps_layer_by_layer_give_the_same_tokens(vlm, monkeypatch):
    """The encoder paused before every layer of its tower and inside each before its MLP (a slice
    of 0 s: half a layer each) while the steps run: each picture is encoded once, in the encoder's
    coroutine on the step's own thread, never inside a step, and every request's greedy tokens are
    still generate's."""
    from accelab.serve.runner.encoder_slices import pause_points

    reqs = [(p, n) for p, n in zip(prompts(vlm), (6, 5, 7, 4, 6))]
    limits = SchedulerConfig(max_running=4, max_step_tokens=20, kv_blocks=96, block_size=8, prefix_caching=True)
    engine = vlm.step_engine(limits)
    where: list[tuple[bool, bool]] = []  # (on this thread, in a coroutine of its own) per encoding
    encode = VisionEncoder.__call__

    def noted(self, image):
        where.append((threading.current_thread() is threading.main_thread(), greenlet.getcurrent().parent is not None))
        return encode(self, image)

    monkeypatch.setattr(VisionEncoder, "__call__", noted)
    try:
        cache, slices = engine.encoder_cache, engine._slices
        assert engine.encodes_ahead and slices is not None
        before = (cache.misses, slices.slices)
        got, _ = serve(engine, limits, reqs, slice_s=0.0)
        assert got == [alone(vlm, p, n) for p, n in reqs]
        assert cache.misses - before[0] == 2 and where == [(True, True)] * 2
        points = len(pause_points(engine._encoder.layers))
        assert points == 2 * len(engine._encoder.layers)  # each layer, and its norm before the MLP
        assert slices.slices - before[1] >= 2 * points - 1  # paused at every point (the first may run whole)
    finally:
        engine.close()
    assert not slices._hooks  # closed with the engine: the tower's layers run whole again


def test_images_encoded_two_in_one_forward_give_the_same_tokens(vlm, monkeypatch):
    """Two pictures the running prompts wait for go through the tower in one forward (their
    inputs joined), each still encoded once, and every request's greedy tokens are generate's."""
    reqs = [(p, n) for p, n in zip(prompts(vlm), (6, 5, 7, 4, 6))]
    limits = SchedulerConfig(max_running=4, max_step_tokens=20, kv_blocks=96, block_size=8, prefix_caching=True)
    engine = vlm.step_engine(limits)
    batches: list[int] = []  # images per forward of the tower
    encode = VisionEncoder.__call__

    def noted(self, work):
        batches.append(len(work.images))
        return encode(self, work)

    monkeypatch.setattr(VisionEncoder, "__call__", noted)
    try:
        cache = engine.encoder_cache
        before = cache.misses
        got, _ = serve(engine, limits, reqs, slice_s=0.0, batch=2)
        assert got == [alone(vlm, p, n) for p, n in reqs]
        assert batches == [2] and cache.misses - before == 2 and cache.hits >= 1
    finally:
        engine.close()


def test_two_images_behind_the_same_text_never_share_kv_blocks(vlm):
    a, b = (p.resize((80, 64)) for p in photos(2))
    text = "What is in the picture?"
    first, other, again = (vlm._vision_prompt(chat(text, 1), (im,)) for im in (a, b, a))
    assert first.ids == other.ids  # the placeholder tokens alone cannot tell the images apart
    limits = SchedulerConfig(max_running=1, max_step_tokens=256, kv_blocks=64, block_size=4, prefix_caching=True)
    engine = vlm.step_engine(limits)
    try:
        image_start = first.media[0].positions[0]
        _, sched = serve(engine, limits, [(first, 2)])  # its committed blocks stay cached in the pool
        for prompt, shared in ((other, image_start // 4), (again, len(again.ids) // 4)):
            hits = sched.pool.hits
            seq = sched.add(prompt, prompt.ids, stops=StopRules(max_tokens=1), cache_prompt=prompt_keys(prompt))
            step = sched.schedule()
            # another picture: only the text before it; the same one: every whole block of the prompt
            assert sched.pool.hits - hits == shared
            assert step.chunks[0].start == min(shared * 4, len(prompt.ids) - 1)
            sched.finish(seq)
    finally:
        engine.close()


def test_a_fault_in_the_image_path_is_caught_at_start_up(vlm, monkeypatch):
    """Features that miss the image (here: shifted) differ from the model's own forward: the
    check says so and the server runs the model per batch instead."""
    encode = VisionEncoder.__call__
    monkeypatch.setattr(VisionEncoder, "__call__", lambda self, image: encode(self, image) + 1.0)
    limits = SchedulerConfig(max_running=2, max_step_tokens=64, kv_blocks=64, block_size=8)
    with pytest.raises(Unsupported, match="differ from the model's own forward"):
        vlm.step_engine(limits)


def test_an_int8_plan_serves_images_with_the_language_part_int8_and_the_tower_bf16():
    """`int8-bf16[quantize_head=true]`: the language part's weights (its output layer too) int8,
    the vision tower bf16, on packed weights where oneDNN has a bf16 path on this CPU (AVX512-BF16,
    AMX; on AVX2 the tower runs its own modules); the start-up check passes on an image prompt
    and image and text requests run in one batch."""
    from accelab.catalog.resolve import resolve
    from accelab.plan.plan import load_plan
    from accelab.serve.engines import build_engine
    from accelab.serve.runner import packed_linear

    plan = load_plan("int8-bf16", ["quantize_head=true"])
    engine = build_engine(resolve("smolvlm-tiny", fetch=False), plan, torch.device("cpu"), name="vlm-int8")
    try:
        model = engine.runnable.model
        assert type(model.lm_head.weight) is not torch.nn.Parameter  # int8 (torchao)
        tower = list(model.model.vision_model.parameters())
        assert all(type(p) is torch.nn.Parameter and p.dtype == torch.bfloat16 for p in tower)
        limits = SchedulerConfig(max_running=4, max_step_tokens=32, kv_blocks=96, block_size=8, prefix_caching=True)
        steps = engine.step_engine(limits)  # raises Unsupported where the check fails
        try:
            if packed_linear.available(torch.device("cpu"), torch.bfloat16):
                assert steps._encoder._packed is not None and steps._encoder._packed.vit_layers > 0
            else:
                assert steps._encoder._packed is None
            reqs = [(p, 5) for p in prompts(engine)[:3]]
            got, _ = serve(steps, limits, reqs, slice_s=0.0, batch=2)
            assert [len(tokens) for tokens in got] == [5, 5, 5] and steps.encoder_cache.misses == 2
        finally:
            steps.close()
    finally:
        engine.close()


def test_the_encoder_slice_shrinks_to_a_layer_while_a_first_token_is_due(vlm):
    """After a step, a prompt that waits on no image and is still to prefill (a text chat, or an
    image chat whose picture is encoded) gets the next step before the encoder's full slice; a
    prompt waiting for its picture's encoding, or for room in a full running batch, does not."""
    from accelab.serve.continuous import ContinuousWorker

    limits = SchedulerConfig(max_running=4, max_step_tokens=32, kv_blocks=96, block_size=8, prefix_caching=True)
    engine = vlm.step_engine(limits)
    try:
        worker = ContinuousWorker(engine, limits, decode=vlm.decode, eos_ids=vlm.eos_ids)  # not started
        image_chat, _, text_chat = prompts(vlm)[:3]
        stops = StopRules(max_tokens=2)
        picture = worker._scheduler.add(image_chat, image_chat.ids, stops=stops, cache_prompt=prompt_keys(image_chat))
        assert not worker._first_token_due()  # its picture is not encoded yet
        assert not engine.encode_ahead([(picture.id, image_chat.media[0])], None)
        assert worker._first_token_due()  # encoded: its prefill is due
        worker._scheduler.finish(picture)
        assert not worker._first_token_due()
        worker._scheduler.add(text_chat, text_chat.ids, stops=stops)
        assert worker._first_token_due()
        full = replace(limits, max_running=1)  # a running batch of one, full: a waiting prompt is not due
        worker = ContinuousWorker(engine, full, decode=vlm.decode, eos_ids=vlm.eos_ids)
        other = prompts(vlm)[1]  # another picture, not encoded
        worker._scheduler.add(other, other.ids, stops=stops, cache_prompt=prompt_keys(other))
        worker._scheduler.schedule()  # admitted: its chunk stops before its picture
        worker._scheduler.add(text_chat, text_chat.ids, stops=stops)
        assert worker._scheduler.running == 1 and worker._scheduler.waiting == 1
        assert not worker._first_token_due()
    finally:
        engine.close()
