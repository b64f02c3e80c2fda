"""The frontend role: client API, chat template, tokenizer pool, routing and detokenization.

The role is `mmlane.frontend.service.Frontend`; its settings are `config.FrontendConfig`,
which imports without the model (this package's import loads neither)."""
