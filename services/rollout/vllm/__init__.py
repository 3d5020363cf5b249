"""The rollout service on vLLM (docs/vllm.md): `engine` (VLLMEngine, the Engine protocol over
`vllm.LLM`) and `ext` (its worker-side half), and the plugins that make a stock `vllm serve` pull
weights from the registry: `plugin` (entry points), `transfer` (the weight-transfer backend) and
`pull` (the command that drives it). vLLM itself is imported only where these modules need it."""
