"""uint8 pixels: what the MM worker sends is the HF processor's output before its rescale and
normalise, and the engine's `normalize` gives back the processor's float32 output bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from bench.images import make_image, noise_image
from conftest import as_processor_output
from mmlane.model import FAMILIES, PixelNorm, Preprocessor, model_layout, normalize
from mmlane.model.families import processor_uint8

SIZES = [(56, 56), (333, 517), (64, 1900), (1024, 768)]


@pytest.fixture(scope="module", params=[family.name for family in FAMILIES])
def family(request):
    return request.param


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_normalised_uint8_pixels_equal_the_processor_output(preprocessors, family, size):
    assert_normalises_to_the_processor_output(preprocessors[family], make_image(*size,
                                                                               seed=sum(size)))


def assert_normalises_to_the_processor_output(preprocessor: Preprocessor, image: Image.Image):
    """The item's uint8 pixels, normalised, are the preprocessor's image processor's output."""
    batch = preprocessor.image_processor(images=[image], return_tensors="np")
    [expected] = preprocessor.family.split_items(preprocessor.image_processor, batch)
    item = preprocessor.process_image(image)

    assert item.tensors["pixel_values"].dtype == np.uint8
    got = as_processor_output(item.tensors, preprocessor.pixel_norm)
    for field in preprocessor.family.item_fields:
        assert got[field].dtype == expected[field].dtype, field
        assert got[field].shape == expected[field].shape, field
        assert np.array_equal(got[field], expected[field]), field


def test_a_phone_photo_normalises_exactly(preprocessors):
    preprocessor = preprocessors["qwen2_vl"]
    image = make_image(4032, 3024, seed=1)
    expected = preprocessor.image_processor(images=[image], return_tensors="np")["pixel_values"]
    item = preprocessor.process_image(image)
    got = as_processor_output(item.tensors, preprocessor.pixel_norm)["pixel_values"]
    assert np.array_equal(got, expected)
    # uint8, a quarter of float32's bytes; one of the image's two identical frames, half again
    assert preprocessor.pixel_norm.frames == 2
    assert item.tensors["pixel_values"].nbytes * 4 * 2 == expected.nbytes


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_qwen2_vl_uint8_layout_is_the_processors_own(preprocessors, size):
    """The fast Qwen2-VL path (resize on the PIL image, patches laid out in uint8) gives what
    the processor itself gives with its rescale and normalise off."""
    preprocessor = preprocessors["qwen2_vl"]
    image = noise_image(*size, seed=3)
    fast = preprocessor.family.uint8_pixels(preprocessor.image_processor, image)
    reference = processor_uint8(preprocessor.image_processor, image,
                                **preprocessor.family.one_frame())
    for field in preprocessor.family.item_fields:
        assert fast[field].dtype == reference[field].dtype
        assert np.array_equal(fast[field], reference[field]), field


def test_norm_is_read_from_the_processor(preprocessors, family):
    processor = preprocessors[family].image_processor
    norm = PixelNorm.of(processor)
    assert norm.rescale_factor == pytest.approx(1 / 255)
    assert norm.mean == tuple(float(v) for v in processor.image_mean)
    assert norm.std == tuple(float(v) for v in processor.image_std)


def test_model_layout_repeats_each_channel_block_per_frame():
    """Qwen2-VL's rows are channel x frame x patch x patch: one frame sent, each channel's
    block repeated in place; a layout of one frame is the tensor itself."""
    pixels = torch.arange(2 * 3 * 4, dtype=torch.uint8).reshape(2, 12)  # 3 channels of 4
    got = model_layout(pixels, PixelNorm(None, None, None, frames=2))
    expected = pixels.reshape(2, 3, 1, 4).repeat(1, 1, 2, 1).reshape(2, 24)
    assert torch.equal(got, expected)
    assert got[0, :8].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert model_layout(pixels, PixelNorm(None, None, None)) is pixels
    as_numpy = model_layout(pixels.numpy(), PixelNorm(None, None, None, frames=2))  # vLLM's way
    assert isinstance(as_numpy, np.ndarray) and np.array_equal(as_numpy, expected.numpy())


def test_normalize_without_rescale_or_normalise_only_casts():
    pixels = torch.arange(24, dtype=torch.uint8).reshape(2, 12)
    got = normalize(pixels, PixelNorm(None, None, None))
    assert got.dtype == torch.float32 and torch.equal(got, pixels.to(torch.float32))


def test_a_scalar_mean_applies_to_every_channel():
    pixels = torch.arange(24, dtype=torch.uint8).reshape(2, 12)
    got = normalize(pixels, PixelNorm(0.5, (1.0,), (2.0,)))
    assert torch.equal(got, (pixels.double() * 0.5).float().sub(1.0).div(2.0))
