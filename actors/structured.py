"""Structured output: a request's `StructuredOutput` compiled into a token grammar and
followed token by token.

Built on xgrammar (see benchmarks/grammar_libs.py for why), imported on first
use only: it loads torch and transformers, which a cold start without structured
requests should not pay for.

`GrammarCompiler` compiles for one tokenizer and keeps the compiled grammars in
a bounded LRU; `compiler_for` hands out this process's one compiler per
(tokenizer, vocabulary size, end-of-sequence ids, cache size), so the engine's
door (which compiles off the event loop, to refuse a bad schema before queueing)
and an executor in the same process share compiled grammars. A `TokenMatcher`
follows one request: the mask of its next token, and each token it takes. The
executors rebuild a request's matcher from its output tokens whenever the
request arrives in full (admission, resumption after preemption, a restarted
executor), so a matcher always stands where the request's accepted tokens do.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence

from cadence.statemachine.errors import StructuredOutputError
from cadence.statemachine.sampling import StructuredOutput

__all__ = ["GrammarCompiler", "TokenMatcher", "compiler_for", "checkpoint_matchers", "total_compiles",
           "DEFAULT_GRAMMAR_CACHE_SIZE", "LIBRARY"]

LIBRARY = "xgrammar"
# Compiled grammars kept per tokenizer: a compiled JSON schema takes tens to
# hundreds of kilobytes, so a few hundred stay well under a hundred megabytes.
DEFAULT_GRAMMAR_CACHE_SIZE = 128
# Threads one compilation may use; the model runs beside it.
COMPILE_THREADS = 2
# The library prefixes its messages with a time and a source location.
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
# What json_object asks for (OpenAI's meaning): an object, whatever its members.
_ANY_OBJECT = '{"type": "object"}'
_WHAT = {"json_object": "JSON", "json_schema": "JSON schema", "regex": "regular expression",
         "grammar": "grammar"}


def _library():
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputError(
            f"structured output needs the {LIBRARY} package, which is not installed "
            f"(pip install 'cadence[structured]'): {exc}", "structured_output") from None
    return xgrammar


def _clean(message: str) -> str:
    return _LOCATION.sub("", message.strip()).strip()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A name for the tokenizer's vocabulary: equal for two loads of the same tokenizer."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "to_str"):
        return "hf:" + hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()
    if getattr(tokenizer, "max_bytes_per_token", None) == 1:
        return "bytes"
    raise StructuredOutputError(
        f"structured output needs a Hugging Face tokenizer (tokenizer.json) or the byte tokenizer; "
        f"this engine has {type(tokenizer).__name__}", "structured_output")


def _tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
    """The library's view of the vocabulary: every token's bytes, and the end tokens."""
    xgrammar = _library()
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "to_str"):
        import transformers  # xgrammar has imported it already

        wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
        return xgrammar.TokenizerInfo.from_huggingface(
            wrapped, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
    # The byte tokenizer: id b < 256 is the byte b; the ids above are special.
    vocab: list[bytes | str] = [bytes([b]) for b in range(min(vocab_size, 256))]
    vocab += [""] * (vocab_size - len(vocab))
    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                  stop_token_ids=list(eos_token_ids))


class TokenMatcher:
    """Where one request stands in its grammar: which tokens may come next.

    Once the grammar is complete only the end-of-sequence ids may follow; after
    one of them is taken the matcher is `terminated` and any further mask allows
    only those ids again.
    """

    __slots__ = ("_matcher", "_eos_token_ids", "terminated")

    def __init__(self, matcher: Any, eos_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._eos_token_ids = tuple(eos_token_ids)
        self.terminated = False

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 CPU bitmask
        [rows, ceil(vocab / 32)] (bit t % 32 of word t // 32 is token t)."""
        if not self.terminated:
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return
        words = bitmask[row]
        words.zero_()
        for token in self._eos_token_ids:
            words[token // 32] |= _bit(token % 32)

    def accept(self, token_id: int) -> bool:
        """Take the sampled token; False if the grammar does not allow it here."""
        if self.terminated:
            return token_id in self._eos_token_ids
        if not self._matcher.accept_token(token_id):
            return False
        self.terminated = self._matcher.is_terminated()
        return True

    def allowed(self, bitmask, row: int = 0) -> list[int]:
        """The allowed next token ids (fills row `row` of `bitmask` first)."""
        self.fill_bitmask(bitmask, row)
        words = bitmask[row].tolist()
        return [32 * i + b for i, word in enumerate(words) if word for b in range(32) if (word >> b) & 1]


def _bit(index: int) -> int:
    """The int32 value with only bit `index` set (bit 31 is the sign bit)."""
    return -(1 << 31) if index == 31 else 1 << index


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer, keeping up to `cache_size` of
    them (least recently used dropped first; 0 keeps none). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self.num_compiles = 0
        self._tokenizer = tokenizer
        self._compiler = None
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._compiling: dict[StructuredOutput, threading.Event] = {}
        self._lock = threading.Lock()

    def cached(self, structured: StructuredOutput) -> bool:
        """Whether `structured` is compiled and kept (a request for it compiles nothing)."""
        with self._lock:
            return structured in self._cache

    def compile(self, structured: StructuredOutput) -> Any:
        """The compiled grammar of `structured`, from the cache or compiled now (a
        compilation of the same one already under way in another thread is waited for).

        Raises StructuredOutputError naming the request field and the library's
        reason when the schema, expression or grammar is invalid.
        """
        while True:
            with self._lock:
                compiled = self._cache.get(structured)
                if compiled is not None:
                    self._cache.move_to_end(structured)
                    return compiled
                under_way = self._compiling.get(structured) if self.cache_size else None
                if under_way is None:
                    done = self._compiling[structured] = threading.Event()
                    compiler = self._compiler_locked()
                    break
            under_way.wait()
        try:
            compiled = self._compile(compiler, structured)
            with self._lock:
                self.num_compiles += 1
                if self.cache_size:
                    self._cache[structured] = compiled
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
            return compiled
        finally:
            with self._lock:
                if self._compiling.get(structured) is done:
                    del self._compiling[structured]
            done.set()

    def matcher(self, structured: StructuredOutput, output_token_ids: Sequence[int] = ()) -> TokenMatcher:
        """A matcher for a request, advanced over the tokens it has already generated.

        Raises StructuredOutputError when those tokens do not follow the grammar.
        """
        xgrammar = _library()
        matcher = TokenMatcher(
            xgrammar.GrammarMatcher(self.compile(structured), override_stop_tokens=list(self.eos_token_ids)),
            self.eos_token_ids)
        for index, token in enumerate(output_token_ids):
            if not matcher.accept(token):
                raise StructuredOutputError(
                    f"{structured.field}: output token {index} ({token}) does not follow the "
                    f"{_WHAT[structured.kind]}", structured.field)
        return matcher

    def new_bitmask(self, rows: int):
        """An int32 CPU bitmask of `rows` rows, every token allowed."""
        import torch

        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def _compiler_locked(self):
        if self._compiler is None:
            xgrammar = _library()
            info = _tokenizer_info(self._tokenizer, self.vocab_size, self.eos_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        return self._compiler

    @staticmethod
    def _compile(compiler, structured: StructuredOutput):
        kind, spec = structured.kind, structured.spec
        try:
            if kind != "regex" and kind != "grammar":
                # No free whitespace: a model could otherwise emit blanks until max_tokens.
                schema = spec if kind == "json_schema" else _ANY_OBJECT
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise StructuredOutputError(
                f"{structured.field}: invalid {_WHAT[kind]}: {_clean(str(exc))}"[:1000],
                structured.field) from None


_compilers: dict[tuple, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE) -> GrammarCompiler:
    """This process's compiler for the tokenizer (shared by every user of an equal one)."""
    eos = tuple(sorted(set(eos_token_ids)))
    key = (tokenizer_fingerprint(tokenizer), vocab_size, eos, cache_size)
    with _compilers_lock:
        compiler = _compilers.get(key)
        if compiler is None:
            compiler = _compilers[key] = GrammarCompiler(tokenizer, vocab_size, eos, cache_size)
        return compiler


def total_compiles() -> int:
    """Compilations so far by every compiler of this process (the door's and an
    in-process executor's alike)."""
    with _compilers_lock:
        return sum(compiler.num_compiles for compiler in _compilers.values())


def checkpoint_matchers(model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int],
                        cache_size: int = DEFAULT_GRAMMAR_CACHE_SIZE
                        ) -> Callable[[StructuredOutput, Sequence[int]], TokenMatcher]:
    """A matcher factory for a model runner: reads the checkpoint's tokenizer.json on
    first use (a runner that never sees structured output never loads it)."""
    compiler: list[GrammarCompiler] = []

    def matcher(structured: StructuredOutput, output_token_ids: Sequence[int] = ()) -> TokenMatcher:
        if not compiler:
            from cadence.gpu.tokenizer import Tokenizer

            path = Path(model_dir)
            if not (path / "tokenizer.json").is_file():
                raise StructuredOutputError(f"{structured.field}: structured output needs the model's "
                                            f"tokenizer.json, and {path} has none", structured.field)
            compiler.append(compiler_for(Tokenizer.from_pretrained(path), vocab_size, eos_token_ids,
                                         cache_size))
        return compiler[0].matcher(structured, output_token_ids)

    return matcher
