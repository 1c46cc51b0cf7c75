"""The job's data for an image-text model (``--model`` a directory whose config has a
``vision_config``): JSON lines holding ``images`` (file paths, relative to the data file's folder
or absolute) and ``text`` (with the processor's image token where each image goes) or chat
``messages`` (through the processor's chat template), read with the model directory's processor.

Each document is run through the processor once to learn its length (its images expand to their
tokens there), then again, images read afresh, when a row holding it is drawn: the images never
stay in memory. Packing puts whole documents, each ended by EOS, into rows of ``seq_len`` in file
order (an image is never cut between rows); ``--no-packing`` gives each its own row. A document
longer than ``seq_len`` is refused by its line number. Labels ignore padding and the image and
video tokens.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from ..data import IGNORE_INDEX
from .errors import JobError

__all__ = ["is_image_text", "load_processor", "ImageRows"]


def is_image_text(model: str | None) -> bool:
    """Whether ``--model`` (a directory or a config.json) is an image-text model's (its config has a ``vision_config``)."""
    path = model if model and os.path.isfile(model) else os.path.join(model or "", "config.json")
    if not model or not os.path.isfile(path):
        return False
    with open(path) as f:
        return "vision_config" in json.load(f)


def load_processor(model_dir: str):
    from transformers import AutoProcessor

    if not os.path.isdir(model_dir):
        raise JobError(f"--model {model_dir} is an image-text model's config: pass its directory, which holds its processor "
                       "(with --from-scratch for random weights)")
    try:
        processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    except ImportError as e:  # a part of it needs a package not installed (torchvision, for most video processors)
        reason = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise JobError(f"the processor in {model_dir} cannot be loaded here: {reason.strip()[:200]}") from None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise JobError(f"no processor could be loaded from {model_dir} ({str(e).splitlines()[0][:200]}); an image-text model's "
                       "directory holds its processor (processor.save_pretrained)") from None
    if getattr(processor, "tokenizer", None) is None or processor.tokenizer.eos_token_id is None:
        raise JobError(f"the processor in {model_dir} has no tokenizer with an EOS token, which ends each document")
    return processor


class ImageRows:
    """``seq_len`` rows of whole documents: token ids, labels and position ids ``[batch, seq_len]``,
    and the processor's image inputs (``pixel_values``, ...) of the rows' documents in order."""

    def __init__(self, path: str, processor, seq_len: int, pad_id: int, *, packing: bool, say=None):
        self.processor, self.seq_len, self.pad_id = processor, seq_len, pad_id
        self.folder = os.path.dirname(os.path.abspath(path))
        with open(path) as f:
            self.lines = [(n, json.loads(line)) for n, line in enumerate(f, 1) if line.strip()]
        tokenizer = processor.tokenizer
        self.ignored = [tokenizer.convert_tokens_to_ids(t) for t in (getattr(processor, "image_token", None), getattr(processor, "video_token", None))
                        if t is not None]
        self.rows, row, used = [], [], 0
        for i in range(len(self.lines)):
            n = self._encode(i)["input_ids"].shape[1]
            if n > seq_len:
                raise JobError(f"{path} line {self.lines[i][0]}: {n} tokens with its images, more than --seq-len {seq_len}; an "
                               "image-text document is never cut: raise --seq-len or shorten it")
            if row and (not packing or used + n > seq_len):
                self.rows.append(row)
                row, used = [], 0
            row.append(i)
            used += n
        if row:
            self.rows.append(row)
        if say is not None:
            say(f"{path}: {len(self.lines)} image-text documents in {len(self.rows)} rows of {seq_len} tokens")

    def _encode(self, i: int) -> dict:
        """Document ``i`` through the processor, EOS appended: ``[1, n]`` per-token tensors and the image inputs."""
        n, record = self.lines[i]
        from PIL import Image

        images = []
        for name in record.get("images") or []:
            try:
                with Image.open(os.path.join(self.folder, name)) as image:
                    images.append(image.convert("RGB"))
            except OSError as e:
                raise JobError(f"line {n}: image {name} cannot be read ({e})") from None
        if "messages" in record:
            if not getattr(self.processor, "chat_template", None):
                raise JobError(f"line {n} holds chat messages, and the processor has no chat template; give the line a 'text'")
            text = self.processor.apply_chat_template(record["messages"], tokenize=False)
        elif isinstance(record.get("text"), str):
            text = record["text"]
        else:
            raise JobError(f"line {n}: an image-text document holds 'text' (a string) or chat 'messages'")
        try:
            out = self.processor(text=[text], images=images or None, return_tensors="pt")
        except (ValueError, TypeError) as e:
            raise JobError(f"line {n}: the processor refused it ({str(e).splitlines()[0][:200]})") from None
        out = {k: v for k, v in out.items() if k != "attention_mask" and isinstance(v, torch.Tensor)}
        eos = self.processor.tokenizer.eos_token_id
        out["input_ids"] = F.pad(out["input_ids"], (0, 1), value=eos)
        for key in [k for k, v in out.items() if k != "input_ids" and v.dim() == 2 and v.shape[0] == 1 and v.shape[1] == out["input_ids"].shape[1] - 1]:
            out[key] = F.pad(out[key], (0, 1))  # per-token inputs (token types) get the EOS's 0
        return out

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices) -> dict:
        rows, per_item = [], {}
        for r in indices:
            docs = [self._encode(i) for i in self.rows[r]]
            length = sum(d["input_ids"].shape[1] for d in docs)
            per_token = [k for k, v in docs[0].items() if v.dim() == 2 and v.shape[1] == docs[0]["input_ids"].shape[1]]
            extra = self.seq_len - length
            row = {k: F.pad(torch.cat([d[k] for d in docs], dim=1), (0, extra), value=self.pad_id if k == "input_ids" else 0)
                   for k in per_token}
            labels = row["input_ids"].clone()
            labels[:, length:] = IGNORE_INDEX
            for token in self.ignored:
                labels[labels == token] = IGNORE_INDEX
            row["labels"] = labels
            # each document numbered from 0, and the padding as a document of its own
            row["position_ids"] = torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs] + [torch.arange(extra)])[None]
            rows.append(row)
            for d in docs:
                for k, v in d.items():
                    if k not in per_token:
                        per_item.setdefault(k, []).append(v)
        out = {k: torch.cat([row[k] for row in rows]) for k in rows[0]}
        out.update({k: _padded_cat(v) for k, v in per_item.items()})
        return out


def _padded_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` joined along their first dim, each zero-padded at the end of every other dim to the largest, as the
    processors pad a batch: LLaVA-NeXT's tiles (its ``image_sizes`` tell how many are real), Idefics3's all-zero images
    (and their ``pixel_attention_mask``), pixels of different sizes."""
    shape = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors))]
    return torch.cat([F.pad(t, [p for size, have in zip(reversed(shape), reversed(t.shape[1:])) for p in (0, size - have)]) for t in tensors])
