"""Prompt datasets: loading through Hugging Face ``datasets``, templating, a resumable cursor."""
