"""Hugging Face transformers models under SP, one module per job:

- `ulysses_sp.models.switch`: `apply_sequence_parallel` / `remove_sequence_parallel`, the
  ``"ulysses_sp"`` attention and mask functions;
- `ulysses_sp.models.coverage`: which modules mix tokens and whether SP covers them;
- `ulysses_sp.models.token_mixers`: a mixer strategy around each other token mixer;
- `ulysses_sp.models.adapters`: what each mixer family registers with the strategies;
- `ulysses_sp.models.image_text`: image- and video-text models split at their text decoder;
- `ulysses_sp.models.llama4`: Llama 4's chunked layers and its NoPE layers' query temperature;
- `ulysses_sp.models.verify`, `ulysses_sp.models.verify_image_text`: one process against SP.

`switch`, `image_text` and the verify modules import transformers (the ``hf`` extra)."""
