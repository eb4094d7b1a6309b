"""flashmsa inside training frameworks. `flashmsa.integrations.megatron`: MSA as the self-attention of a
Megatron-Core GPT model (docs/megatron.md; needs `pip install flashmsa[megatron]`)."""
