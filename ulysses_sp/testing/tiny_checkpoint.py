"""A tiny model directory and JSON-lines corpus, made offline: what ``--model DIR --data FILE``
expects from a downloaded model, for tests and for trying the job without a download.

    python -m ulysses_sp.testing.tiny_checkpoint OUT              # OUT/model, OUT/train.jsonl, OUT/eval.jsonl
    python -m ulysses_sp.testing.tiny_checkpoint --vlm llava OUT  # an image-text model (llava, gemma3), its processor, images/


The tokenizer is word-level (trained here, saved with ``save_pretrained``); the documents
follow a learnable pattern (each word mostly followed by the next), so the loss falls within
a few steps. The image-text corpus puts one generated 32 x 32 image in each document, and the word
after it is the image's: its colour encodes the word.

LLaVA and Gemma 3 here (their image processors have PIL versions): Qwen's processors need torchvision
(their video processor), whose wheels on the package index are CUDA builds that do not load with the
CPU build of torch.
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch

__all__ = ["WORDS", "VLMS", "IMAGE_TOKENS", "write_tiny_llama", "write_tiny_vlm", "write_corpus", "write_image_corpus"]

WORDS = [f"w{i}" for i in range(40)]


def _tokenizer(special: list[str] = (), **extra):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *WORDS, *special])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]", **extra)


def _text_config() -> dict:
    return dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=1 << 14, tie_word_embeddings=False,
                pad_token_id=1, eos_token_id=2, bos_token_id=None)


def write_tiny_llama(path: str, seed: int = 0) -> None:
    """A 2-layer Llama (4 heads, 2 KV heads) with random weights, and its tokenizer, in ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _tokenizer().save_pretrained(path)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**_text_config())).save_pretrained(path)


CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }} {% else %}{% for c in m['content'] %}"
                 "{% if c['type'] == 'image' %}<image> {% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endif %}{% endfor %}")
"""The tiny processor's chat template: each message's text and image tokens in turn (roles are not words it knows)."""
VLMS = ("llava", "llava_next", "idefics3", "gemma3")
"""The image-text families ``write_tiny_vlm`` writes: the tested families whose processors load without torchvision
(PaliGemma's too, but the job's documents hold no prefix). Others need it: Mistral 3's (Pixtral's) processor, the video
processors of Qwen, GLM-4.xV, InternVL, SmolVLM, LLaVA-NeXT-Video, LLaVA-OneVision, Gemma 4, Kimi-K2.5's image processor."""
IMAGE_TOKENS = {"llava": "<image>", "llava_next": "<image>", "idefics3": "<image>", "gemma3": "<start_of_image>"}
"""Where each family's processor expands an image in a document's text."""
IMAGE_SIZE = 32
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def write_tiny_vlm(path: str, family: str = "llava", seed: int = 0) -> None:
    """A tiny image-text model of ``family`` (its text model as ``write_tiny_llama``'s, a 2-layer
    vision tower on 32 x 32 images in 8 x 8 patches: 16 tokens an image) and its processor, in ``path``."""
    if family not in VLMS:
        raise ValueError(f"--vlm {family}: the tiny image-text models written here are {', '.join(VLMS)}")
    if family != "llava":
        return {"llava_next": _write_tiny_llava_next, "idefics3": _write_tiny_idefics3, "gemma3": _write_tiny_gemma3}[family](path, seed)
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer = _tokenizer(["<image>"], extra_special_tokens={"image_token": "<image>"})
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    torch.manual_seed(seed)
    text = dict(_text_config(), model_type="llama", vocab_size=len(tokenizer))
    config = LlavaConfig(text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), projector_hidden_act="gelu",
                         vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=8, projection_dim=32),
                         vision_feature_layer=-1, tie_word_embeddings=False)
    LlavaForConditionalGeneration(config).save_pretrained(path)


def _write_tiny_gemma3(path: str, seed: int) -> None:
    """Gemma 3: its processor puts 16 image tokens, which attend to each other both ways (``token_type_ids``),
    between the image's markers; a sliding layer (window 16) and a full one."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    markers = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = _tokenizer(list(markers.values()), extra_special_tokens=markers)
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}), tokenizer=tokenizer,
                    image_seq_length=16, chat_template=CHAT_TEMPLATE.replace("<image>", IMAGE_TOKENS["gemma3"])).save_pretrained(path)
    torch.manual_seed(seed)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in markers.items()}
    text = dict(_text_config(), model_type="gemma3_text", vocab_size=len(tokenizer), query_pre_attn_scalar=8, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"])
    config = Gemma3Config(text_config=text, mm_tokens_per_image=16, image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
                          eoi_token_index=ids["eoi_token"], tie_word_embeddings=False,
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             image_size=IMAGE_SIZE, patch_size=8))
    Gemma3ForConditionalGeneration(config).save_pretrained(path)


def _write_tiny_llava_next(path: str, seed: int) -> None:
    """LLaVA-NeXT: anyres tiles of 16 x 16 pixels (2 x 2 patches), a 32 x 32 image a base tile and 4 tiles,
    a 16 x 32 one a base tile and 2 (`write_image_corpus`'s ``varied``): 24 and 14 tokens with their newlines."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextImageProcessorPil, LlavaNextProcessor

    tokenizer = _tokenizer(["<image>"], extra_special_tokens={"image_token": "<image>"})
    tiles = [[16, 16], [16, 32], [32, 16], [32, 32]]
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}, image_grid_pinpoints=tiles)
    LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
                       num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    torch.manual_seed(seed)
    config = LlavaNextConfig(text_config=dict(_text_config(), model_type="llama", vocab_size=len(tokenizer)), image_grid_pinpoints=tiles,
                             image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-1, tie_word_embeddings=False,
                             vision_config=dict(_VISION, model_type="clip_vision_model", image_size=16, patch_size=8, projection_dim=32))
    LlavaNextForConditionalGeneration(config).save_pretrained(path)


def _write_tiny_idefics3(path: str, seed: int) -> None:
    """Idefics3: an image split into crops of 16 x 16 pixels and a global view, each 4 x 4 patches shuffled 2 x 2 to
    4 tokens between its markers; a row's images as one ``[1, N, C, H, W]``, padded with all-zero images."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil, Idefics3Processor

    markers = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
    tokenizer = _tokenizer(["<image>", *markers], extra_special_tokens={"image_token": "<image>"})
    tokenizer.add_tokens(markers, special_tokens=True)  # whole tokens, not split at their punctuation
    images = Idefics3ImageProcessorPil(size={"longest_edge": IMAGE_SIZE}, max_image_size={"longest_edge": 16})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    torch.manual_seed(seed)
    config = Idefics3Config(text_config=dict(_text_config(), model_type="llama", vocab_size=len(tokenizer)), scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
                            vision_config=dict(_VISION, image_size=16, patch_size=4))
    Idefics3ForConditionalGeneration(config).save_pretrained(path)


def write_image_corpus(path: str, documents: int, seed: int = 0, image_dir: str = "images", image_token: str = "<image>",
                       varied: bool = False) -> None:
    """``documents`` JSON lines ``{"images": [file], "text": ...}``: words, ``image_token`` (where the
    processor expands the image: `IMAGE_TOKENS`), then the word the image's colour encodes and the
    words after it; the PNG files under ``image_dir`` beside ``path`` (named in the lines relative to
    ``path``'s folder), 32 x 32 pixels (``varied``: every other one 32 wide, 16 high)."""
    from PIL import Image

    rng = random.Random(seed)
    folder = os.path.join(os.path.dirname(os.path.abspath(path)), image_dir)
    os.makedirs(folder, exist_ok=True)
    stem = os.path.splitext(os.path.basename(path))[0]
    with open(path, "w") as f:
        for n in range(documents):
            word = rng.randrange(len(WORDS))
            colour = (40 + 5 * word, 255 - 5 * word, (97 * word) % 256)
            height = IMAGE_SIZE // 2 if varied and n % 2 else IMAGE_SIZE
            pixels = bytes(max(0, min(255, c + rng.randrange(-8, 9))) for _ in range(IMAGE_SIZE * height) for c in colour)
            name = os.path.join(image_dir, f"{stem}-{n:05d}.png")
            Image.frombytes("RGB", (IMAGE_SIZE, height), pixels).save(os.path.join(folder, os.path.basename(name)))
            before = [WORDS[rng.randrange(len(WORDS))] for _ in range(rng.randrange(1, 6))]
            after = [WORDS[(word + k) % len(WORDS)] for k in range(rng.randrange(4, 30))]
            f.write(json.dumps({"images": [name], "text": " ".join(before + [image_token] + after)}) + "\n")


def write_corpus(path: str, documents: int, seed: int = 0) -> None:
    """``documents`` JSON lines ``{"text": ...}`` of 8 to 70 words."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            i = rng.randrange(len(WORDS))
            words = [WORDS[(i + k + (rng.random() < 0.1)) % len(WORDS)] for k in range(rng.randrange(8, 70))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="tiny")
    parser.add_argument("--vlm", choices=VLMS, help="an image-text model and a corpus of generated images instead")
    a = parser.parse_args(argv)
    if a.vlm:
        write_tiny_vlm(os.path.join(a.out, "model"), a.vlm)
        for name, documents, seed in (("train", 200, 0), ("eval", 20, 1)):
            write_image_corpus(os.path.join(a.out, f"{name}.jsonl"), documents, seed=seed, image_token=IMAGE_TOKENS[a.vlm], varied=True)
    else:
        write_tiny_llama(os.path.join(a.out, "model"))
        write_corpus(os.path.join(a.out, "train.jsonl"), 400, seed=0)
        write_corpus(os.path.join(a.out, "eval.jsonl"), 40, seed=1)
    print(f"wrote {a.out}/model, {a.out}/train.jsonl, {a.out}/eval.jsonl" + (f" and {a.out}/images" if a.vlm else ""))


if __name__ == "__main__":
    main()
