"""The frontend role: client API, chat template, tokenizer pool, routing and detokenization."""

from services.frontend.service import Frontend

__all__ = ["Frontend"]
