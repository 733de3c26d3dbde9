"""Train Cadence's built-in demo model: a tiny byte-level Llama.

The training text is the Python standard library's own top-level ``*.py``
sources (every Python install has them), so nothing is downloaded.  The
tokenizer is byte-level: ids 0..255 are the raw byte values and a few
special tokens follow them (see ``SPECIALS``).  The result is written as a
standard Hugging Face checkpoint that ``LlamaForCausalLM.from_pretrained``
loads directly.

Usage (this is how gpu/demo_model/ was produced):

    python examples/train_demo_model.py --out gpu/demo_model

Only CPU is needed (one thread by default, so it shares a busy machine
well).  Training stops when the step budget (--max-steps) or the wall-clock
budget (--max-seconds) is reached, whichever comes first; the cosine schedule
follows whichever of the two is further along, so the learning rate reaches
its floor at the end either way.  When the time budget is the one that binds,
the number of steps depends on the machine's speed and load; for a
bit-for-bit repeatable run give a step budget only, e.g.
``--max-steps 1675 --max-seconds 1e9``.

Training windows (256 bytes) start at the beginning of a line, so that a bare
prompt such as "def " or "import " looks like what the model was trained on.
See gpu/demo_model/README.md for the recorded run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sysconfig
import time

import torch

SPECIALS = ["<bos>", "<eos>", "<pad>", "<unk>"]  # ids 256, 257, 258, 259
BOS_ID, EOS_ID, PAD_ID, UNK_ID = 256, 257, 258, 259
VOCAB_SIZE = 256 + len(SPECIALS)


# --------------------------------------------------------------------------
# data


def stdlib_files(max_bytes: int) -> list[str]:
    """Deterministic subset: top-level stdlib *.py files in sorted order."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    out, total = [], 0
    for name in names:
        path = os.path.join(root, name)
        size = os.path.getsize(path)
        if total + size > max_bytes:
            break
        out.append(path)
        total += size
    return out


def load_corpus(max_bytes: int) -> tuple[torch.Tensor, list[str]]:
    """Each file becomes <bos> + its UTF-8 bytes + <eos>; all concatenated."""
    ids: list[int] = []
    files = stdlib_files(max_bytes)
    for path in files:
        with open(path, "rb") as fh:
            data = fh.read()
        ids.append(BOS_ID)
        ids.extend(data)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long), files


# --------------------------------------------------------------------------
# tokenizer


def build_tokenizer():
    """A byte-level `tokenizers` Tokenizer whose id for byte b is b.

    It is a BPE model with no merges over the 256 byte symbols of the
    ByteLevel alphabet, so every UTF-8 string encodes to exactly its bytes
    and decodes back losslessly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import AddedToken

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    table = _bytes_to_unicode()
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {sym: b for b, sym in table.items()}
    for i, s in enumerate(SPECIALS):
        vocab[s] = 256 + i

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """The usual reversible byte -> printable-char table used by ByteLevel."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def check_tokenizer(tok) -> None:
    samples = [
        "def foo(x):\n    return x + 1\n",
        "naïve café — 日本語 🙂 \t\r\n\x00",
        "  leading spaces and <bos> literal",
    ]
    for s in samples:
        enc = tok.encode(s, add_special_tokens=False)
        specials_in = "<bos>" in s
        if not specials_in:
            assert enc.ids == list(s.encode("utf-8")), (s, enc.ids)
        assert tok.decode(enc.ids, skip_special_tokens=False) == s, (s, tok.decode(enc.ids))


# --------------------------------------------------------------------------
# model


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


# --------------------------------------------------------------------------
# training


def lr_at(frac: float, args) -> float:
    """Linear warmup then cosine to lr*min_ratio; `frac` in [0,1] of budget."""
    warm = args.warmup_frac
    if frac < warm:
        return args.lr * frac / warm
    p = min(1.0, (frac - warm) / (1.0 - warm))
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1.0 + math.cos(math.pi * p))


def line_starts(data: torch.Tensor, seq: int) -> torch.Tensor:
    """Offsets that begin a line (just after a newline or <bos>).

    Training windows start only at these offsets, so position 0 of every
    window is the start of a line -- just like a prompt such as "def " or
    "import " typed on its own.  (Windows starting mid-token-stream make
    the model treat a bare "def " as the middle of a docstring.)
    """
    prev = data[:-1]
    ok = (prev == ord("\n")) | (prev == BOS_ID)
    starts = torch.nonzero(ok).squeeze(1) + 1
    return starts[starts < data.numel() - seq - 1]


def get_batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator, starts_from: torch.Tensor):
    pick = torch.randint(0, starts_from.numel(), (batch,), generator=gen)
    starts = starts_from[pick]
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, batches: int, batch: int) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    starts = line_starts(data, seq)
    tot = 0.0
    for _ in range(batches):
        x, y = get_batch(data, batch, seq, gen, starts)
        logits = model(input_ids=x).logits
        tot += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)).item()
    model.train()
    return tot / batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu/demo_model")
    ap.add_argument("--max-seconds", type=float, default=840.0, help="wall-clock training budget")
    ap.add_argument("--max-steps", type=int, default=2400)
    ap.add_argument("--data-bytes", type=int, default=5_000_000)
    ap.add_argument("--val-frac", type=float, default=0.02)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1, help="1 is most robust on a shared machine")
    ap.add_argument("--no-autocast", dest="autocast_bf16", action="store_false",
                    help="train in plain fp32 (default: bf16 autocast, fp32 master weights)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="float32")
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = build_tokenizer()
    check_tokenizer(tok)

    data, files = load_corpus(args.data_bytes)
    n_val = int(data.numel() * args.val_frac)
    train, val = data[:-n_val], data[-n_val:]
    print(f"corpus: {len(files)} files, {data.numel():,} tokens (train {train.numel():,}, val {val.numel():,})", flush=True)

    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    train_starts = line_starts(train, args.seq)
    print(f"{train_starts.numel():,} line-start offsets to sample windows from", flush=True)
    model.train()

    t0 = time.time()
    step, ema = 0, None
    while step < args.max_steps:
        elapsed = time.time() - t0
        if elapsed >= args.max_seconds:
            break
        frac = max(elapsed / args.max_seconds, step / args.max_steps)
        lr = lr_at(frac, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = get_batch(train, args.batch, args.seq, gen, train_starts)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast_bf16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0 or step == 1:
            print(f"step {step:5d}  t {time.time() - t0:7.1f}s  lr {lr:.2e}  loss {loss.item():.4f}  ema {ema:.4f}", flush=True)
    train_seconds = time.time() - t0
    # validation loss of the weights exactly as they are shipped (save dtype)
    model.to(getattr(torch, args.save_dtype))
    val_loss = evaluate(model, val, args.seq, batches=8, batch=16)
    print(f"done: {step} steps in {train_seconds:.1f}s, train ema loss {ema:.4f}, val loss {val_loss:.4f} nats/byte", flush=True)

    stats_args = {k: v for k, v in vars(args).items() if k != "out"}
    save(model, tok, args, dict(args=stats_args, stopped_by="steps" if step >= args.max_steps else "time", steps=step, seconds=round(train_seconds, 1), train_loss_ema=round(ema, 4),
                                val_loss=round(val_loss, 4), params=n_params, files=len(files),
                                tokens=int(data.numel())))


def save(model, tok, args, stats: dict) -> None:
    from transformers import GenerationConfig

    os.makedirs(args.out, exist_ok=True)
    model.to(getattr(torch, args.save_dtype))
    model.config.dtype = args.save_dtype
    model.save_pretrained(args.out, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                     do_sample=False, max_new_tokens=80).save_pretrained(args.out)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as fh:
        json.dump({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
            "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": args.max_positions,
        }, fh, indent=2)
        fh.write("\n")
    with open(os.path.join(args.out, "training_stats.json"), "w") as fh:
        json.dump(stats, fh, indent=2)
        fh.write("\n")
    for name in os.listdir(args.out):
        os.chmod(os.path.join(args.out, name), 0o644)
    print(f"saved to {args.out}: {stats}", flush=True)


if __name__ == "__main__":
    main()
