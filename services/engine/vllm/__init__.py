"""The "vllm" backend: vLLM's AsyncLLM runs the model; mmlane hands it rendered requests."""
