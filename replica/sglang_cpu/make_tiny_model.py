"""Make the tiny Qwen2 model directory a CPU SGLang server loads with ``--load-format dummy``.

Run by ``replica/build_sglang_cpu_env.sh`` with the SGLang environment's interpreter (it needs the
``tokenizers`` package pinned there). Nothing is downloaded: the config is written here, weights are
random at load time (``--load-format dummy``), and the tokenizer is a byte-level BPE trained on a
fixed, pinned corpus (the installed ``sglang`` package's own source files, sorted), so the same lock
gives the same vocabulary. Output text is gibberish; scheduling, radix cache, usage and metrics are
the real engine's.

    python make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 2048
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] if message['content'] is string else '') + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS_BYTES = 4_000_000


def _corpus() -> Iterator[str]:
    import sglang

    root = Path(sglang.__file__).resolve().parent
    budget = CORPUS_BYTES
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        budget -= len(text)
        if budget <= 0:
            return


def make_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Pad to exactly VOCAB_SIZE so every id the random model can emit decodes.
    n = tok.get_vocab_size()
    if n < VOCAB_SIZE:
        tok.add_special_tokens([f"<|pad_{i}|>" for i in range(VOCAB_SIZE - n)])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} entries, wanted {VOCAB_SIZE}")
    tok.save(str(out / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIAL}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "chat_template": CHATML,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return ids


def make_config(out: Path, ids: dict[str, int]) -> None:
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 32768,
        "max_window_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    ids = make_tokenizer(out)
    make_config(out, ids)
    print(f"tiny-qwen2: {out} (vocab {VOCAB_SIZE}, specials {ids})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
