"""The built-in backend: a Hugging Face transformers model run by torch in the engine process.

Imported only when the engine's `backend` setting is "hf" (see services/engine/runner.py):
`runner` imports torch and registers an attention function. `config` imports no torch, so the
engine's config can nest `HFConfig` without loading the backend.
"""
