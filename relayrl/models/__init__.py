"""The demo's built-in models and assets (``builtin:`` paths): seeded tiny models, built above the episodes the tiny
chat model is pretrained on."""
