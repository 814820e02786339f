"""Data shipped with llmjax, on the ground floor (imports nothing of llmjax): texts.py, the
public-domain prose (README.md gives its provenance) that SmoothQuant and InfiniGen calibrate on,
perplexity is evaluated on, and the benchmarks and programs draw their prompts from."""
