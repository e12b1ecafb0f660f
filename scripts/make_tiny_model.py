"""Build the end-to-end suite's tiny model and tokenizer offline, deterministically.

A random-weight Llama (hidden 128, 2 heads of 64, 2 layers, intermediate 256, vocab 2048, 8,192 positions,
float32; about 0.85 M parameters, 3.4 MB) and a byte-level BPE tokenizer trained here on built-in text, saved
as a Hugging Face model folder that vLLM serves (`--model DIR`). Nothing is downloaded. For a fixed seed every file is
byte-identical run to run; `--manifest` prints the sha256 of each so two builds can be compared.

Run it with the engine's interpreter (it needs torch, transformers and tokenizers):
    .venv-e2e/bin/python scripts/make_tiny_model.py --out .e2e/model
The output is gibberish and EOS is practically never sampled: clients send `max_tokens` with `ignore_eos`.
"""

from __future__ import annotations

import os

# Before transformers is imported: no hub, no telemetry, no parallel trainer whose merge order could vary.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse
import hashlib
import json
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 2048
# Longer than the recipe's 2,048 so one request can generate for tens of seconds on this fast tiny model
# (the suite needs work that outlasts a pause or a grace period); the weights are random either way.
MAX_POSITIONS = 8192
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Plain English so real prompts tokenize into real merges; the synthetic words below fill the vocabulary.
BUILT_IN_TEXT = """\
An inference gateway sits between the agents and the engines. It routes, queues and times every request so
that a request's timeout measures the engine's work on that request, not the time it waited in a queue.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Say hello. Count to ten: one, two, three, four, five, six, seven, eight, nine, ten.
You are a helpful assistant. The user asks a question and the assistant answers it briefly.
Write a short poem about the sea. Explain how a weight update pauses generation and resumes it.
{"role": "user", "content": "What is the capital of France?"} 0123456789 +-*/=()[]{}<>.,;:!?'"
"""
SYLLABLES = [
    c + v
    for c in [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "z",
        "th",
        "st",
    ]
    for v in ["a", "e", "i", "o", "u", "ai", "ou", "er"]
]


def corpus(seed: int, lines: int = 4000) -> Iterator[str]:
    """The built-in text, then seeded pseudo-words: enough distinct pairs to fill the whole vocabulary."""
    yield from BUILT_IN_TEXT.splitlines()
    rng = random.Random(seed)
    for _ in range(lines):
        words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(12)]
        yield " ".join(words).capitalize() + rng.choice([".", ",", "?", "!", ";"])


def build_tokenizer(out: Path, seed: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    size = tokenizer.get_vocab_size()
    if size != VOCAB_SIZE:  # a sampled id without a token would break detokenizing in the engine
        raise SystemExit(f"tokenizer has {size} tokens, the model {VOCAB_SIZE}: enlarge the corpus")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    # transformers 5 writes the template to chat_template.jinja; keep a copy where older loaders look for it.
    config_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return size


def build_model(out: Path, seed: int) -> int:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        num_attention_heads=2,  # head_dim 64: vLLM's CPU attention only supports some head sizes
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=256,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def manifest(folder: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
        if path.is_file() and not path.name.startswith(".")
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="model folder to (re)create")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--manifest", action="store_true", help="print 'sha256  file' for every file")
    args = parser.parse_args(argv)

    # Build beside the target and swap it in, so an interrupted build never leaves a half folder behind.
    args.out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=args.out.parent))
    try:
        vocab = build_tokenizer(staging, args.seed)
        parameters = build_model(staging, args.seed)
        shutil.rmtree(args.out, ignore_errors=True)
        staging.chmod(0o755)  # mkdtemp makes it private
        staging.rename(args.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"tiny model: {parameters} parameters, vocab {vocab}, seed {args.seed} -> {args.out}", file=sys.stderr
    )
    if args.manifest:
        for name, digest in manifest(args.out).items():
            print(f"{digest}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
