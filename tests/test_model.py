"""mmlane.model: tiny-model building, families, and parity of our preprocessing with HF's."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from msgspec.structs import replace
from test_config import loaded_on_import
from transformers import AutoConfig

from bench.images import noise_image
from conftest import (
    as_processor_output,
    hf_processor_call,
    reference_items,
)
from mmlane.common.memory import usage
from mmlane.engine.runner import ModelSpec
from mmlane.engine.validation import validate_request
from mmlane.mm_worker.media import jpeg_draft_scale
from mmlane.model import (
    ImageError,
    ModelDirError,
    PromptError,
    UnsupportedModelError,
    ensure_default_model,
    family_for,
    load_model,
    load_preprocessor,
    resolve_model_dir,
)
from mmlane.model.tiny import build_tiny_model
from mmlane.protocol.errors import RequestError
from mmlane.protocol.messages import MMItem

FAMILIES = [
    "qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "llava_onevision", "mistral3", "internvl",
    "idefics3", "smolvlm",
]


def file_hashes(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }


def chat(num_images: int) -> list[dict]:
    content = [{"type": "text", "text": "Look at these pictures, please."}]
    for _ in range(num_images):
        content += [{"type": "image"}, {"type": "text", "text": "And this one?"}]
    return [
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": "Hi. What can I do for you?"},
        {"role": "user", "content": content},
    ]


def assert_checker_refuses(model_dirs, preprocessors, family, size, change, message) -> None:
    """The family's shape check takes an image's tensors as processed and refuses them with
    `message` once `change` ({name: tensor -> tensor}) has been applied."""
    preprocessor = preprocessors[family]
    check = preprocessor.family.item_checker(AutoConfig.from_pretrained(model_dirs[family]))
    tensors = preprocessor.process_image(noise_image(*size, seed=0)).tensors
    check([MMItem(offset=0, length=1, tensors=tensors)])  # as processed: accepted
    changed = {name: change.get(name, lambda t: t)(array) for name, array in tensors.items()}
    with pytest.raises(RequestError, match=message):
        check([MMItem(offset=0, length=1, tensors=changed)])


class TestTinyModel:
    @pytest.mark.parametrize("family", FAMILIES)
    def test_same_seed_gives_identical_files(self, model_dirs, tmp_path, family):
        rebuilt = build_tiny_model(tmp_path / family, family=family, seed=0)
        assert file_hashes(rebuilt) == file_hashes(model_dirs[family])

    def test_default_model_is_built_once(self, tmp_path, monkeypatch):
        monkeypatch.setenv("MMLANE_HOME", str(tmp_path))
        built = ensure_default_model()
        config = built / "config.json"
        built_at = config.stat().st_mtime_ns
        assert ensure_default_model() == built
        assert config.stat().st_mtime_ns == built_at
        assert built.name == "tiny-qwen2-vl"
        assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []

    def test_unknown_family_is_refused(self, tmp_path):
        with pytest.raises(ValueError, match="'gpt2'"):
            build_tiny_model(tmp_path, family="gpt2")

    def test_qwen_config_matches_tokenizer(self, model_dirs, preprocessors):
        config = json.loads((model_dirs["qwen2_vl"] / "config.json").read_text())
        tokenizer = preprocessors["qwen2_vl"].tokenizer
        assert config["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert config["vision_start_token_id"] == tokenizer.convert_tokens_to_ids(
            "<|vision_start|>"
        )
        assert config["text_config"]["vocab_size"] == len(tokenizer)
        assert preprocessors["qwen2_vl"].eos_token_ids[0] == tokenizer.convert_tokens_to_ids(
            "<|im_end|>"
        )


class TestParity:
    """Our split path (render, tokenize, per-image processing, expansion) equals HF's one call."""

    @pytest.mark.parametrize("family", FAMILIES)
    @pytest.mark.parametrize(
        "sizes",
        [[], [(56, 56)], [(333, 500)], [(1024, 768)], [(56, 56), (333, 500), (1024, 768)]],
        ids=["text-only", "56x56", "333x500", "1024x768", "three-images"],
    )
    def test_matches_hf_processor(self, preprocessors, hf_processors, family, sizes):
        preprocessor, processor = preprocessors[family], hf_processors[family]
        images = [noise_image(width, height, seed) for seed, (width, height) in enumerate(sizes)]
        messages = chat(len(images))

        expected_prompt = processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        expected = hf_processor_call(processor, expected_prompt, images)

        prompt = preprocessor.render_prompt(messages)
        [token_ids] = preprocessor.tokenize_batch([prompt])
        items = [preprocessor.process_image(image) for image in images]

        assert prompt == expected_prompt
        assert (
            preprocessor.expand_placeholders(token_ids, items) == expected["input_ids"][0].tolist()
        )
        if images:  # image by image: a batch may pad its images to one shape (LLaVA-NeXT)
            batch = reference_items(family, processor, expected, images)
            for want, item in zip(batch, items, strict=True):
                got = as_processor_output(item.tensors, preprocessor.pixel_norm)
                for field in preprocessor.family.item_fields:
                    assert got[field].dtype == want[field].dtype
                    assert np.array_equal(got[field], want[field]), field

    @pytest.mark.parametrize("family", FAMILIES)
    def test_split_items_inverts_batch(self, preprocessors, family):
        preprocessor = preprocessors[family]
        images = [
            noise_image(width, height, seed)
            for seed, (width, height) in enumerate([(56, 56), (90, 300)])
        ]
        batch = preprocessor.image_processor(images=images, return_tensors="np")
        items = [preprocessor.process_image(image) for image in images]
        split_items = preprocessor.family.split_items(preprocessor.image_processor, batch)
        for split, item in zip(split_items, items, strict=True):
            assert split.keys() == item.tensors.keys()
            tensors = as_processor_output(item.tensors, preprocessor.pixel_norm)
            assert all(np.array_equal(split[field], tensors[field]) for field in split)

    def test_batch_tokenization_matches_tokenizer_call(self, preprocessors):
        preprocessor = preprocessors["qwen2_vl"]
        prompts = ["The harbour was quiet.", "Numbers: 12, XII, 0b1100 — and émigré café!", ""]
        expected = preprocessor.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        assert preprocessor.tokenize_batch(prompts) == expected
        assert preprocessor.decode(expected[1]) == prompts[1]

    def test_the_word_cache_holds_no_more_words_than_it_is_bounded_to(self, qwen_dir):
        """Each thread's word cache only fills: the heap a run of new 250-character words
        leaves allocated is their cache's, and none with a bound of 0 (a fresh tokenizer each, so
        that no cache is warm; rayon's threads are the same for both). Heap in use, not RSS:
        RSS does not grow where malloc reuses what earlier tests freed."""
        rng = np.random.default_rng(0)
        words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 250)) for _ in range(3000)]
        if "heap_in_use" not in usage():
            pytest.skip("needs glibc's mallinfo2")

        def heap() -> int:
            now = usage()
            return now["heap_in_use"] + now["heap_mapped"]

        kept = {}
        for bound in (0, 3000):
            preprocessor = load_preprocessor(qwen_dir)
            preprocessor.bound_word_cache(bound)
            before = heap()
            for start in range(0, len(words), 8):
                preprocessor.tokenize_batch(words[start:start + 8])
            kept[bound] = heap() - before
        assert kept[0] < 4 << 20 < 16 << 20 < kept[3000], kept  # 3000 x 8 KB: 23 MiB


class TestPreprocessor:
    @pytest.mark.parametrize(
        ("family", "size", "num_tokens"),
        [
            ("qwen2_vl", (56, 56), 4),
            ("qwen2_vl", (500, 333), 216),
            ("llava", (56, 56), 576),
            ("llava", (1024, 768), 576),
            ("llava_next", (56, 56), 1176),  # 2x1 tiles for a square: its best grid wastes least
            ("llava_next", (1024, 768), 2340),  # 2x2 tiles, unpadded to 48x36, a newline a row
            ("llava_next", (1200, 90), 1014),  # 1x3 tiles, mostly padding cut off again
            ("llava_onevision", (56, 56), 1485),  # one grid tile: 729 + 27 rows of 27 + 27 newlines
            ("llava_onevision", (1024, 768), 4725),  # 2x3 tiles, unpadded to 54x73
            ("llava_onevision", (4032, 3024), 7309),  # 5x6 tiles, pooled to about 9 tiles' worth
            ("mistral3", (56, 56), 6),  # 2 rows of 2 [IMG] cells, each row's break or end
            ("mistral3", (1024, 768), 1064),  # 28 rows of 37 cells (rounded up to whole cells)
            ("mistral3", (4032, 3024), 2352),  # reduced to 1540x1155, 42 rows of 55 cells
            ("internvl", (56, 56), 258),  # one tile, no thumbnail: <img>, 256, </img>
            ("internvl", (1024, 768), 3330),  # a 4x3 grid and the thumbnail
            ("internvl", (1200, 90), 3330),  # a 12x1 grid and the thumbnail
            # 17 tiles of 169 tokens, a <fake_token_around_image><row_R_col_C> each, 4 rows'
            # newlines, then "\n", <fake_token_around_image><global-img>, .., <fake_token...>
            ("idefics3", (56, 56), 17 * 169 + 16 * 2 + 4 + 1 + 3),
            ("idefics3", (1200, 90), 5 * 169 + 4 * 2 + 1 + 1 + 3),  # a 1x4 grid
            ("smolvlm", (56, 56), 17 * 64 + 16 * 2 + 4 + 1 + 3),  # 512-pixel tiles of 64
        ],
    )
    def test_num_tokens(self, preprocessors, family, size, num_tokens):
        assert (
            preprocessors[family].process_image(noise_image(*size, seed=0)).num_tokens == num_tokens
        )

    @pytest.mark.parametrize(
        ("size", "resized"), [((4032, 3024), (1540, 1176)), ((1200, 90), (1204, 112))]
    )
    def test_mistral3_jpegs_are_drafted_to_no_less_than_its_resize(
        self, preprocessors, size, resized
    ):
        """Pixtral's rule: the longest edge to at most 1540, each side up to whole 28-pixel
        cells (so an image may grow a little)."""
        image = noise_image(*size, seed=0)
        assert preprocessors["mistral3"].resized_size(*size) == resized
        pixels = preprocessors["mistral3"].process_image(image).tensors["pixel_values"]
        assert pixels.shape[2:] == resized[::-1]

    @pytest.mark.parametrize("family", ["llava_next", "llava_onevision", "internvl"])
    def test_anyres_jpegs_are_never_drafted(self, preprocessors, family):
        """Their tile grid and token count follow the image's own size (image_sizes)."""
        resized_size = preprocessors[family].resized_size
        assert resized_size(4032, 3024) == (4032, 3024)
        assert jpeg_draft_scale(4032, 3024, resized_size) == 1

    @pytest.mark.parametrize(
        ("size", "resized"), [((4032, 3024), (1456, 1092)), ((90, 1200), (110, 1456))]
    )
    def test_idefics3_jpegs_draft_to_its_longest_edge(self, preprocessors, size, resized):
        """Its tiles follow from the first resize alone (the longest edge to 1456, even)."""
        resized_size = preprocessors["idefics3"].resized_size
        assert resized_size(*size) == resized
        assert jpeg_draft_scale(4032, 3024, resized_size) == 2

    def test_expand_refuses_placeholder_count_mismatch(self, preprocessors):
        preprocessor = preprocessors["qwen2_vl"]
        [token_ids] = preprocessor.tokenize_batch([preprocessor.render_prompt(chat(2))])
        item = preprocessor.process_image(noise_image(56, 56, seed=0))
        with pytest.raises(PromptError, match="2 image placeholders but the request has 1 images"):
            preprocessor.expand_placeholders(token_ids, [item])

    def test_bos_is_not_doubled(self, preprocessors):
        preprocessor = preprocessors["llava"]
        bos = preprocessor.tokenizer.bos_token_id
        assert preprocessor.tokenize_batch(["USER: hi"])[0][:2] != [bos, bos]
        assert preprocessor.tokenize_batch(["<s>USER: hi"])[0][:2] != [bos, bos]

    @pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
    def test_a_completion_text_is_tokenized_as_the_tokenizer_call(self, preprocessors, family):
        """vLLM's /v1/completions default: the tokenizer's special tokens (llava: its BOS)."""
        preprocessor = preprocessors[family]
        for text in ("USER: hi", "<s>USER: hi"):
            assert preprocessor.tokenize_text(text) == preprocessor.tokenizer(text)["input_ids"]

    def test_bad_aspect_ratio_is_an_image_error(self, preprocessors):
        with pytest.raises(ImageError, match="1x300"):
            preprocessors["qwen2_vl"].process_image(noise_image(1, 300, seed=0))

    def test_metadata(self, preprocessors):
        qwen = preprocessors["qwen2_vl"]
        assert (qwen.model_id, qwen.family.name, qwen.max_context) == (
            "tiny-qwen2-vl",
            "qwen2_vl",
            4096,
        )
        assert qwen.tokenizer.convert_ids_to_tokens(qwen.image_token_id) == "<|image_pad|>"


class TestErrors:
    def test_family_for_unknown_model_type_names_it(self):
        with pytest.raises(UnsupportedModelError, match="'mamba'"):
            family_for("mamba")

    def test_qwen2_5_vl_shares_the_qwen2_vl_family(self):
        assert family_for("qwen2_5_vl") is family_for("qwen2_vl")

    def test_missing_directory(self, tmp_path):
        with pytest.raises(ModelDirError, match="does not exist"):
            resolve_model_dir(tmp_path / "nowhere")

    def test_directory_without_config(self, tmp_path):
        with pytest.raises(ModelDirError, match="no config.json"):
            resolve_model_dir(tmp_path)

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"pixel_values": lambda t: t[:-1]},  # the model would take 3 tiles
             r"pixel_values has shape \(2, 3, 336, 336\), an image of size \(500, 333\) "
             r"needs \(3, 3, 336, 336\)"),
            ({"image_sizes": lambda t: np.array([[1024, 768]])},  # a size with a 2x2 grid
             r"an image of size \(1024, 768\) needs \(5, 3, 336, 336\)"),
            ({"image_sizes": lambda t: np.array([[0, 333]])}, "image_sizes must be one positive"),
            ({"pixel_values": lambda t: t.astype("f4")},
             "pixel_values must be a 4-D array of kind 'u', got 4-D float32"),
        ],
        ids=["tile-missing", "size-of-another-grid", "zero-size", "float-pixels"],
    )
    def test_llava_next_tiles_must_be_those_of_the_image_size(
        self, model_dirs, preprocessors, change, message
    ):
        assert_checker_refuses(model_dirs, preprocessors, "llava_next", (333, 500), change, message)

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"image_sizes": lambda t: np.array([[28, 56]])},
             r"image_sizes must be the pixels' \(height, width\), \(84, 112\), "
             r"got \[\[28, 56\]\]"),
            ({"pixel_values": lambda t: t[:, :, :70],
              "image_sizes": lambda t: np.array([[70, 112]])},
             "is 70x112 pixels; the model takes sides that are multiples of 28, at most 1540"),
            ({"pixel_values": lambda t: np.zeros((1, 3, 1568, 28), np.uint8),
              "image_sizes": lambda t: np.array([[1568, 28]])}, "is 1568x28 pixels"),
            ({"pixel_values": lambda t: t.astype("f4")},
             "pixel_values must be a 4-D array of kind 'u', got 4-D float32"),
        ],
        ids=["sizes-not-the-pixels", "not-whole-cells", "beyond-the-rope", "float-pixels"],
    )
    def test_mistral3_pixels_must_be_whole_cells_of_their_size(
        self, model_dirs, preprocessors, change, message
    ):
        assert_checker_refuses(model_dirs, preprocessors, "mistral3", (100, 60), change, message)

    @pytest.mark.parametrize(
        ("pixels", "message"),
        [
            (np.zeros((0, 3, 448, 448), np.uint8), r"shape \(0, 3, 448, 448\), expected \(tiles, "
             r"3, 448, 448\) with at least one tile"),
            (np.zeros((1, 3, 448, 224), np.uint8), r"shape \(1, 3, 448, 224\)"),
            (np.zeros((1, 3, 448, 448), np.float32), "must be a 4-D array of kind 'u'"),
        ],
        ids=["no-tile", "half-a-tile", "float-pixels"],
    )
    def test_internvl_pixels_must_be_whole_tiles(self, model_dirs, preprocessors, pixels, message):
        change = {"pixel_values": lambda t: pixels}
        assert_checker_refuses(model_dirs, preprocessors, "internvl", (100, 60), change, message)

    def test_mistral3_span_must_be_the_layout_of_its_tensors(self, model_dirs, preprocessors):
        """The engine checks the [IMG] rows, [IMG_BREAK]s and [IMG_END] of each image."""
        from test_engine import make_request

        preprocessor = preprocessors["mistral3"]
        spec = ModelSpec.of(
            preprocessor, AutoConfig.from_pretrained(model_dirs["mistral3"]),
            vocab_size=len(preprocessor.tokenizer), max_context=preprocessor.max_context,
        )
        request = make_request(preprocessor, "hi", ((100, 60),))
        validate_request(request, spec)
        ids = list(request.prompt_token_ids)
        row_break = ids.index(preprocessor.tokenizer.convert_tokens_to_ids("[IMG_BREAK]"))
        ids[row_break - 1], ids[row_break] = ids[row_break], ids[row_break - 1]
        with pytest.raises(RequestError, match=r"mm_items\[0\] covers tokens that are not its"):
            validate_request(replace(request, prompt_token_ids=ids), spec)

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            ({"pixel_values": lambda t: t[:-1]},  # the whole image's tile missing
             r"pixel_values has shape \(12, 3, 364, 364\), a 3x4 grid needs \(13, 3, 364, 364\)"),
            ({"rows": lambda t: np.array([4])}, r"a 4x4 grid needs \(17, 3, 364, 364\)"),
            ({"cols": lambda t: np.array([0])}, "rows and cols must both be 0 or neither"),
            ({"rows": lambda t: np.array([7])}, r"rows must be one count of 0 to 6, got \[7\]"),
            ({"cols": lambda t: np.array([3, 4])}, "cols must be one count"),
            ({"pixel_values": lambda t: t.astype("f4")},
             "pixel_values must be a 4-D array of kind 'u', got 4-D float32"),
        ],
        ids=["tile-missing", "other-grid", "half-grid", "grid-too-large", "two-counts",
             "float-pixels"],
    )
    def test_idefics3_tiles_must_be_those_of_the_grid(
        self, model_dirs, preprocessors, change, message
    ):
        preprocessor = preprocessors["idefics3"]
        check = preprocessor.family.item_checker(AutoConfig.from_pretrained(model_dirs["idefics3"]))
        tensors = preprocessor.process_image(noise_image(500, 333, seed=0)).tensors
        check([MMItem(offset=0, length=1, tensors=tensors)])  # as processed: accepted
        changed = {name: change.get(name, lambda t: t)(array) for name, array in tensors.items()}
        with pytest.raises(RequestError, match=message):
            check([MMItem(offset=0, length=1, tensors=changed)])

    def test_unsupported_model_type_names_path_and_type(self, tmp_path):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
        with pytest.raises(UnsupportedModelError, match=f"{tmp_path}.*'bert'"):
            load_preprocessor(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_forward_on_processed_image(model_dirs, preprocessors, family):
    preprocessor = preprocessors[family]
    model = load_model(model_dirs[family], "cpu")
    item = preprocessor.process_image(noise_image(90, 60, seed=0))
    [token_ids] = preprocessor.tokenize_batch([preprocessor.render_prompt(chat(1))])
    input_ids = torch.tensor([preprocessor.expand_placeholders(token_ids, [item])])
    tensors = as_processor_output(item.tensors, preprocessor.pixel_norm)  # the model's layout
    inputs = {name: torch.from_numpy(tensor) for name, tensor in tensors.items()}
    if family == "qwen2_vl":
        # transformers 5's Qwen2-VL needs each token's modality to build its 3D (M-RoPE) positions.
        inputs["mm_token_type_ids"] = (input_ids == preprocessor.image_token_id).long()
    if preprocessor.family.name == "idefics3":  # one sample of tiles; rows, cols shape the prompt
        inputs = {"pixel_values": inputs["pixel_values"][None]}
    with torch.no_grad():
        logits = model(input_ids=input_ids, **inputs).logits
    assert logits.shape == (1, input_ids.shape[1], model.config.get_text_config().vocab_size)
    assert torch.isfinite(logits).all()


def test_importing_the_model_package_patches_no_environment():
    """The CPU-wheel fixes (services/common/cpu_wheels.py) are applied by the processes that need
    them, at their entry points: importing the model package does not bring them in."""
    loaded = loaded_on_import("mmlane.model")
    assert "mmlane.model.loading" in loaded
    assert "mmlane.common.cpu_wheels" not in loaded
