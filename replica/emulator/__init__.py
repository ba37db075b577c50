"""SGLang-compatible replica emulator: HTTP shell (``server``), pure prefix cache (``cache``), pure
event-driven time model (``timemodel``, ``profiles``), deterministic tokenizer (``tokenizer``),
Anthropic Messages and OpenAI Responses conversions (``anthropic``, ``responses``).
See docs/EMULATOR.md."""
