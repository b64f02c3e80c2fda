"""The built-in backend: a Hugging Face transformers model run by torch in the engine process.

Imported only when the engine's `backend` setting is "hf" (see services/engine/runner.py):
`runner` imports torch and registers an attention function. Its settings are `HFConfig`, in
services/engine/config.py.
"""
