"""The sliced vision encoder on a toy tower: paused between layers when its slice is spent, the
same result as one whole forward, an error handed back with the image's key, a paused encoding
unwound by `close`, and the layers untouched outside the encoder's coroutine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from accelab.serve.engines.encoder_slices import SlicedEncoder

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
