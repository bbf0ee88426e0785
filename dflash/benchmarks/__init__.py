"""Benchmarks, each a command (python -m dflash.benchmarks.<name>): the drafter step (step), the
whole training loop (e2e), decoding (decode), one batched regeneration step (regen_step) and its
attention kernel (decode_attention), how sure a target is of its own replies (target_confidence),
the CPU data path (data), checkpoint pauses (checkpoint), and the 8B-shaped random assets they
run on (assets).

May import: any layer. Nothing imports a benchmark (but another benchmark).
"""
