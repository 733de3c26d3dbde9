"""The tokenizer of a local Hugging Face model directory (tokenizer.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import tokenizers

from .config import CONFIG_FILE, GENERATION_CONFIG_FILE, read_json
from .errors import CheckpointError, CheckpointFileNotFoundError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class Tokenizer:
    """Text to token ids and back, with the model's end-of-sequence ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Tokenizer:
        """Load tokenizer.json; eos ids from generation_config.json, config.json, tokenizer_config.json."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointFileNotFoundError(f"{path} does not exist (only tokenizer.json is supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:
            raise CheckpointError(f"{path} could not be loaded: {exc}") from None
        eos: list[int] = []
        bos = None
        for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
            if (directory / name).is_file():
                fields = read_json(directory / name)
                eos.extend(_ids(fields.get("eos_token_id")))
                bos = bos if bos is not None else fields.get("bos_token_id")
        if (directory / TOKENIZER_CONFIG_FILE).is_file():
            token = _token_text(read_json(directory / TOKENIZER_CONFIG_FILE).get("eos_token"))
            if token is not None and backend.token_to_id(token) is not None:
                eos.append(backend.token_to_id(token))
        return cls(backend, eos_token_ids=tuple(dict.fromkeys(eos)), bos_token_id=bos)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens (e.g. BOS) as the tokenizer's post-processor adds them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None when it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, or None when out of range."""
        return self.backend.id_to_token(token_id)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
