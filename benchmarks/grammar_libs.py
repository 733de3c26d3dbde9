"""Which grammar library to build structured output on: xgrammar, llguidance and
outlines-core, compared in one run on the same tokenizers and schemas.

    python benchmarks/grammar_libs.py [--quick]

Tokenizers: the demo model's (260 byte-level ids) and a byte-level BPE of
32,000 tokens trained here, at start-up, on the Python standard library's source
(no pretrained Hugging Face tokenizer can be downloaded on these machines; this
one has the size and the byte-level form of GPT-2's or Llama-3's). Grammars: a
small object schema, a nested schema with arrays, enums and a pattern, and a
regular expression. For each (tokenizer, grammar, library) it prints one JSON
line: `setup_ms` (the tokenizer made ready for the library, once per tokenizer),
`compile_ms` (median of fresh compilations, no cache), `first_mask_us` (the first
token mask of a fresh matcher: libraries that compile lazily pay here),
`mask_us` (mean per-token mask along a valid output, the first excluded),
`accept_us` (mean per-token advance of the matcher), and each figure's ratio to
the best library of its group. A last line per library gives its cold import
time in a fresh interpreter. Times drift between runs; the ratios are the result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import tokenizers
import torch

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "gpu" / "demo_model" / "tokenizer.json"
DEMO_EOS = 257
TRAINED_VOCAB = 32000
# Source bytes the trained tokenizer learns from (enough for a full 32k vocabulary).
TRAINING_BYTES = 12 << 20
LIBRARIES = ("xgrammar", "llguidance", "outlines_core")

SMALL = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                           "kind": {"enum": ["book", "tool", "food"]}},
            "required": ["sku", "qty", "kind"], "additionalProperties": False}},
        "meta": {"type": "object", "properties": {"source": {"type": "string"}, "score": {"type": "number"}},
                 "required": ["source", "score"], "additionalProperties": False},
    },
    "required": ["id", "tags", "items", "meta"], "additionalProperties": False,
}
TIMESTAMP = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d(Z|[+-][01]\d:[0-5]\d)"
# name -> (kind, grammar, an output it accepts)
GRAMMARS = {
    "small_object": ("json", SMALL, '{"name":"Ada Lovelace","age":36,"ok":true}'),
    "nested_arrays_enums": ("json", NESTED, json.dumps({
        "id": 42, "tags": ["red", "blue"],
        "items": [{"sku": "ABC-1234", "qty": 3, "kind": "book"}, {"sku": "XYZ-0001", "qty": 12, "kind": "food"},
                  {"sku": "QRS-9876", "qty": 99, "kind": "tool"}],
        "meta": {"source": "warehouse seven", "score": 0.75}}, separators=(",", ":"))),
    "regex_timestamp": ("regex", TIMESTAMP, "2024-06-30T12:34:56+02:00"),
}


def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet's characters back to bytes (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def train_tokenizer(path: Path, special_tokens: tuple[str, ...] = ("<|endoftext|>",)) -> None:
    """A 32k byte-level BPE trained on the standard library's source, saved at `path`
    (`special_tokens` take the first ids)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts, size = [], 0
    for file in files:
        try:
            text = file.read_text("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
        if size > TRAINING_BYTES:
            break
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=TRAINED_VOCAB, special_tokens=list(special_tokens),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer)
    backend.save(str(path))


class Subject:
    """One library on one tokenizer: compile, make a matcher, mask, advance."""

    def __init__(self, name: str, tokenizer_path: Path, vocab_size: int, eos: int) -> None:
        self.name, self.vocab_size, self.eos = name, vocab_size, eos
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        __import__(name)  # its import is timed apart (cold_import_s)
        start = time.perf_counter()
        getattr(self, f"_setup_{name}")(backend, tokenizer_path)
        self.setup_ms = (time.perf_counter() - start) * 1e3
        self.bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    # ---- xgrammar
    def _setup_xgrammar(self, backend, path) -> None:
        import transformers
        import xgrammar
        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=[self.eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    # ---- llguidance
    def _setup_llguidance(self, backend, path) -> None:
        import llguidance
        self.llg = llguidance
        self.lltokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos)

    # ---- outlines-core
    def _setup_outlines_core(self, backend, path) -> None:
        import outlines_core
        self.oc = outlines_core
        decoder = _byte_decoder()
        special = {t.content for t in backend.get_added_tokens_decoder().values()}
        vocab: dict[bytes, list[int]] = {}
        for token, token_id in backend.get_vocab(with_added_tokens=False).items():
            if token in special or token_id == self.eos:
                continue
            vocab.setdefault(bytes(decoder[c] for c in token), []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(self.eos, vocab)

    def compile(self, kind: str, grammar):
        """A fresh compiled grammar (whatever the library keeps for a matcher)."""
        if self.name == "xgrammar":
            if kind == "json":
                return self.compiler.compile_json_schema(json.dumps(grammar), any_whitespace=False,
                                                         separators=(",", ":"))
            return self.compiler.compile_regex(grammar)
        if self.name == "llguidance":
            text = (self.llg.LLMatcher.grammar_from_json_schema(
                        grammar, overrides={"whitespace_flexible": False, "item_separator": ",",
                                            "key_separator": ":"})
                    if kind == "json" else self.llg.LLMatcher.grammar_from_regex(grammar))
            matcher = self.llg.LLMatcher(self.lltokenizer, text, log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
            return text
        regex = (self.oc.json_schema.build_regex_from_schema(json.dumps(grammar), "")
                 if kind == "json" else grammar)
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        if self.name == "xgrammar":
            return self.xgr.GrammarMatcher(compiled)
        if self.name == "llguidance":
            return self.llg.LLMatcher(self.lltokenizer, compiled, log_level=0)
        return self.oc.Guide(compiled)

    def mask(self, matcher) -> None:
        row = self.bitmask[0]
        if self.name == "xgrammar":
            matcher.fill_next_token_bitmask(self.bitmask, 0)
        elif self.name == "llguidance":
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        else:
            matcher.write_mask_into(row.data_ptr(), row.numel(), 4)

    def allowed(self, token: int) -> bool:
        return bool((int(self.bitmask[0, token // 32]) >> (token % 32)) & 1)

    def accept(self, matcher, token: int) -> None:
        if self.name == "xgrammar":
            ok = matcher.accept_token(token)
        elif self.name == "llguidance":
            ok = matcher.consume_token(token)
        elif token == self.eos:
            # outlines-core's guide has no move for the end token: a final state ends it.
            ok = matcher.is_finished()
        else:
            matcher.advance(token, False)
            ok = True
        if not ok:
            raise ValueError(f"{self.name} refused token {token}")


def measure(subject: Subject, kind: str, grammar, tokens: list[int], repeats: int) -> dict:
    compile_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled = subject.compile(kind, grammar)
        compile_s.append(time.perf_counter() - start)
    first_s, mask_s, accept_s = [], [], []
    for _ in range(repeats):
        matcher = subject.matcher(compiled)
        masks, accepts = [], []
        for i, token in enumerate(tokens):
            start = time.perf_counter()
            subject.mask(matcher)
            masks.append(time.perf_counter() - start)
            if not subject.allowed(token):
                raise ValueError(f"{subject.name}: token {i} ({token}) of a valid output is masked")
            start = time.perf_counter()
            subject.accept(matcher, token)
            accepts.append(time.perf_counter() - start)
        first_s.append(masks[0])
        mask_s.append(statistics.fmean(masks[1:]))
        accept_s.append(statistics.fmean(accepts))
    return {"compile_ms": statistics.median(compile_s) * 1e3,
            "first_mask_us": statistics.median(first_s) * 1e6,
            "mask_us": statistics.median(mask_s) * 1e6,
            "accept_us": statistics.median(accept_s) * 1e6}


def import_s(library: str) -> float:
    """Seconds to import the library in a fresh interpreter (what a cold start pays)."""
    code = f"import time; t = time.perf_counter(); import {library}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        trained = Path(folder) / "tokenizer.json"
        train_tokenizer(trained)
        trained_eos = tokenizers.Tokenizer.from_file(str(trained)).token_to_id("<|endoftext|>")
        setups = {"demo_260": (DEMO_TOKENIZER, 260, DEMO_EOS),
                  "bpe_32000": (trained, TRAINED_VOCAB, trained_eos)}
        for tokenizer_name, (path, vocab_size, eos) in setups.items():
            backend = tokenizers.Tokenizer.from_file(str(path))
            subjects = [Subject(name, path, vocab_size, eos) for name in LIBRARIES]
            for grammar_name, (kind, grammar, text) in GRAMMARS.items():
                tokens = backend.encode(text, add_special_tokens=False).ids + [eos]
                rows = {}
                for subject in subjects:
                    try:
                        rows[subject.name] = {"setup_ms": subject.setup_ms,
                                              **measure(subject, kind, grammar, tokens, repeats)}
                    except Exception as exc:  # a library that cannot run this grammar says why
                        rows[subject.name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                figures = ("setup_ms", "compile_ms", "first_mask_us", "mask_us", "accept_us")
                best = {f: min(r[f] for r in rows.values() if f in r) for f in figures}
                for name, row in rows.items():
                    line = {"tokenizer": tokenizer_name, "grammar": grammar_name, "library": name,
                            "num_tokens": len(tokens), **{k: round(v, 2) if isinstance(v, float) else v
                                                           for k, v in row.items()}}
                    for f in figures:
                        if f in row and best[f] > 0:
                            line[f"{f}_ratio"] = round(row[f] / best[f], 2)
                    print(json.dumps(line), flush=True)
    for library in LIBRARIES:
        print(json.dumps({"library": library, "cold_import_s": round(import_s(library), 3)}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
