"""The frozen target: any HF causal LM with hooked layers (frozen), a GGUF file as the target
(gguf), the forward over a static KV cache (static) replayed as CUDA graphs (graphs), and batched
greedy generation on it (generate).

May import: dflash.util, dflash.nn (the transformer math static.py runs).
"""
