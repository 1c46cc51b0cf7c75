"""The job's image-text data (ulysses_sp/job/image_corpus.py) on the tiny LLaVA's processor:
whole documents packed, labels, positions, image inputs, and the refusals."""

import json

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("PIL", reason="the hf extra is not installed")

from ulysses_sp.job import JobError  # noqa: E402
from ulysses_sp.job.image_corpus import ImageRows, is_image_text, load_processor  # noqa: E402
from ulysses_sp.testing.tiny_checkpoint import write_image_corpus, write_tiny_llama, write_tiny_vlm  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    write_tiny_vlm(str(root / "model"))
    write_image_corpus(str(root / "docs.jsonl"), 6, seed=3)
    return root, load_processor(str(root / "model"))


def test_whole_documents_are_packed_with_their_images(tiny):
    root, processor = tiny
    image = processor.tokenizer.convert_tokens_to_ids("<image>")
    alone = ImageRows(str(root / "docs.jsonl"), processor, 64, 1, packing=False)
    lengths = [int((alone.batch([i])["input_ids"] != 1).sum()) for i in range(6)]  # the padding id is 1
    rows = ImageRows(str(root / "docs.jsonl"), processor, 64, 1, packing=True)
    assert sum(len(r) for r in rows.rows) == 6 and len(rows) < 6
    for r, docs in enumerate(rows.rows):
        b = rows.batch([r])
        used = sum(lengths[i] for i in docs)
        assert used <= 64 and b["input_ids"].shape == (1, 64) and b["pixel_values"].shape == (len(docs), 3, 32, 32)
        starts = torch.nonzero(b["position_ids"][0] == 0).flatten().tolist()
        assert starts[:len(docs)] == [sum(lengths[i] for i in docs[:k]) for k in range(len(docs))]
        assert int((b["input_ids"] == image).sum()) == 16 * len(docs)  # 16 tokens an image, one image a document
        assert int((b["input_ids"] == 2).sum()) == len(docs)  # EOS ends each
        labels = b["labels"][0]
        assert (labels[:used] == b["input_ids"][0, :used].masked_fill(b["input_ids"][0, :used] == image, -100)).all()
        assert (labels[used:] == -100).all() and (b["input_ids"][0, used:] == 1).all()


def test_chat_messages_go_through_the_processors_template(tiny, tmp_path):
    root, processor = tiny
    chat = tmp_path / "chat.jsonl"
    content = [{"type": "text", "text": "w1 w2"}, {"type": "image"}, {"type": "text", "text": "w3"}]
    chat.write_text(json.dumps({"images": [str(root / "images" / "docs-00000.png")],
                                "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "w4 w5"}]}) + "\n")
    b = ImageRows(str(chat), processor, 64, 1, packing=True).batch([0])
    ids = processor.tokenizer.convert_tokens_to_ids
    assert b["input_ids"][0, :23].tolist() == ids(["w1", "w2"]) + [ids("<image>")] * 16 + ids(["w3", "w4", "w5"]) + [2, 1], b["input_ids"]
    assert b["pixel_values"].shape == (1, 3, 32, 32)


def test_refusals_name_the_line(tiny, tmp_path):
    root, processor = tiny
    with pytest.raises(JobError, match="line 1: .* tokens with its images, more than --seq-len 16"):
        ImageRows(str(root / "docs.jsonl"), processor, 16, 1, packing=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "w1 w2"}) + "\n" + json.dumps({"images": ["missing.png"], "text": "w1 <image>"}) + "\n")
    with pytest.raises(JobError, match="line 2: image missing.png cannot be read"):
        ImageRows(str(bad), processor, 64, 1, packing=True)
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n")
    template, processor.chat_template = processor.chat_template, None
    try:
        with pytest.raises(JobError, match="line 1 holds chat messages, and the processor has no chat template"):
            ImageRows(str(bad), processor, 64, 1, packing=True)
    finally:
        processor.chat_template = template
    write_tiny_llama(str(tmp_path / "text"))
    assert is_image_text(str(root / "model")) and is_image_text(str(root / "model" / "config.json"))
    assert not is_image_text(str(tmp_path / "text")) and not is_image_text(None)
    with pytest.raises(JobError, match="config.json is an image-text model's config: pass its directory"):
        load_processor(str(root / "model" / "config.json"))


def test_a_processor_that_needs_torchvision_is_refused_by_what_it_needs(tmp_path):
    """Qwen2-VL's processor loads a video processor, which needs torchvision (not installable beside the CPU torch)."""
    pytest.importorskip("transformers").Qwen2VLImageProcessorPil().save_pretrained(tmp_path)
    write_tiny_llama(str(tmp_path))
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(JobError, match="cannot be loaded here: Qwen2VLVideoProcessor requires the Torchvision library"):
            load_processor(str(tmp_path))
    else:
        assert load_processor(str(tmp_path)).video_processor is not None
