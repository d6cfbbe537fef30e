"""The sliced vision encoder on a toy tower: paused between layers when its slice is spent, the
same result as one whole forward, an error handed back with the image's key, a paused encoding
unwound by `close`, and the layers untouched outside the encoder's coroutine; waiting images in
batches of one forward, a failed batch encoded again image by image."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from accelab.serve.runner.encoder_slices import SlicedEncoder, encode_wanted
from accelab.serve.runner.vision import EncoderCache, ImageBatch, ImageInput, batch_images

LAYERS = 4


def tower(fail_at: int | None = None):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(LAYERS))
    ran: list[int] = []

    def encode(image):
        x = image.inputs
        for i, layer in enumerate(layers):
            if i == fail_at:
                raise ValueError(f"layer {i} failed")
            x = layer(x)
            ran.append(i)
        return x

    return layers, encode, ran


def image(key: str = "a") -> SimpleNamespace:
    return SimpleNamespace(key=key, inputs=torch.randn(3, 8))


def test_a_slice_of_no_time_runs_one_layer_and_the_result_is_the_whole_forwards():
    layers, encode, ran = tower()
    encoder = SlicedEncoder(encode, layers, torch.no_grad)
    picture = image()
    with torch.inference_mode():
        want = encode(picture)
    ran.clear()
    results = [encoder.run(picture, 0.0) for _ in range(LAYERS)]
    assert results[:-1] == [None] * (LAYERS - 1) and encoder.current is None
    done = results[-1]
    assert done is not None and done.key == "a" and done.error is None and torch.equal(done.features, want)
    assert ran == list(range(LAYERS)) and encoder.slices == LAYERS and done.seconds > 0
    ran.clear()
    assert encoder.run(image("b"), None) is not None and ran == list(range(LAYERS))  # no budget: whole
    assert not torch.is_inference_mode_enabled()  # the step side's thread state as it was


def test_another_image_waits_for_the_one_under_way():
    layers, encode, _ = tower()
    encoder = SlicedEncoder(encode, layers, torch.no_grad)
    first = image("a")
    assert encoder.run(first, 0.0) is None
    with pytest.raises(ValueError, match="under way"):
        encoder.run(image("b"), 0.0)
    assert encoder.current is first


def test_an_error_comes_back_with_the_image_and_the_next_image_encodes():
    layers, encode, _ = tower(fail_at=2)
    encoder = SlicedEncoder(encode, layers, torch.no_grad)
    assert encoder.run(image(), 0.0) is None
    done = encoder.run(image_of := encoder.current, None)
    assert (
        done is not None and done.key == image_of.key and isinstance(done.error, ValueError) and done.features is None
    )
    assert encoder.current is None


def test_close_unwinds_a_paused_encoding_and_the_layers_run_whole_again():
    layers, encode, ran = tower()
    encoder = SlicedEncoder(encode, layers, torch.no_grad)
    assert encoder.run(image(), 0.0) is None
    encoder.close()
    assert encoder.current is None
    ran.clear()
    encode(image())  # no hooks left: the forward runs through
    assert ran == list(range(LAYERS))


def picture(key: str, value: float, width: int = 8) -> ImageInput:
    """An image of the toy tower: one feature row, its encoder input [1, width]."""
    return ImageInput(key=key, positions=(0,), inputs={"pixel_values": torch.full((1, width), value)})


def toy_tower():
    """Rows through 4 Linear layers; a NaN input fails the whole forward it is in."""
    layers, _, _ = tower()
    forwards: list[tuple[str, ...]] = []

    def encode(work):
        x = work.inputs["pixel_values"]
        forwards.append(tuple(image.key for image in work.images))
        if torch.isnan(x).any():
            raise ValueError("a NaN pixel")
        for layer in layers:
            x = layer(x)
        return x

    return layers, encode, forwards


def test_waiting_images_go_through_the_tower_two_in_one_forward():
    layers, encode, forwards = toy_tower()
    encoder = SlicedEncoder(encode, layers, torch.no_grad)
    cache = EncoderCache(max_rows=100)
    a, b, c = picture("a", 0.1), picture("b", 0.2), picture("c", 0.3)
    with torch.inference_mode():
        solo = {image.key: encode(ImageBatch(images=(image,), inputs=image.inputs)) for image in (a, b, c)}
    forwards.clear()
    wanted = [(1, a), (2, b), (3, a), (4, c)]
    assert encode_wanted(encoder, cache, wanted, 0.0, batch=2) == {}  # one layer: the first batch begun
    assert encoder.current is not None and [i.key for i in encoder.current.images] == ["a", "b"]
    assert encode_wanted(encoder, cache, wanted, None, batch=2) == {}  # the rest, whole
    assert forwards == [("a", "b"), ("c",)] and cache.misses == 3 and cache.hits == 1  # a: sequences 1 and 3
    for key, want in solo.items():
        assert torch.allclose(cache.get(9, picture(key, 0.0), encode), want[0:1], atol=1e-6)
    with pytest.raises(ValueError, match="one image a forward at least"):
        encode_wanted(encoder, cache, wanted, None, batch=0)


def test_a_failed_batch_is_encoded_again_image_by_image_so_the_bad_image_fails_alone():
    layers, encode, forwards = toy_tower()
    encoder = SlicedEncoder(encode, layers, torch.no_grad)
    cache = EncoderCache(max_rows=100)
    good, bad = picture("good", 0.5), picture("bad", float("nan"))
    failed = encode_wanted(encoder, cache, [(1, good), (2, bad)], None, batch=4)
    assert list(failed) == ["bad"] and isinstance(failed["bad"], ValueError)
    assert "good" in cache and "bad" not in cache
    assert forwards == [("good", "bad"), ("good",), ("bad",)]


def test_only_images_whose_inputs_join_share_a_batch():
    a, b, wide, c = picture("a", 0.1), picture("b", 0.2), picture("wide", 0.3, width=16), picture("c", 0.4)
    batches = batch_images([a, b, wide, c], 3)
    assert [[i.key for i in batch.images] for batch in batches] == [["a", "b"], ["wide"], ["c"]]
    assert batches[0].inputs["pixel_values"].shape == (2, 8) and batches[0].rows == 2
    assert [f.tolist() for f in batches[0].split(torch.arange(4.0).reshape(2, 2))] == [[[0.0, 1.0]], [[2.0, 3.0]]]
    idefics = [  # Idefics3's tensors are [1, tiles, ...]: images stack on the tiles axis
        ImageInput(key=k, positions=(0, 1), inputs={"pixel_values": torch.zeros(1, 1, 3, 4, 4)}) for k in "xy"
    ]
    (joined,) = batch_images(idefics, 2)
    assert joined.inputs["pixel_values"].shape == (1, 2, 3, 4, 4) and joined.key == "x+y"


def test_an_interrupt_pauses_the_encoding_before_the_next_layer_even_without_a_deadline():
    layers, encode, ran = tower()
    encoder = SlicedEncoder(encode, layers, torch.no_grad)
    picture = image()
    asked: list[int] = []

    def due() -> bool:  # a text prompt became due while the first layer ran
        asked.append(len(ran))
        return True

    assert encoder.run(picture, None, due) is None and ran == [0] and asked == [1]  # one layer, then paused
    done = encoder.run(picture, None)
    assert done is not None and done.error is None and ran == list(range(LAYERS))
