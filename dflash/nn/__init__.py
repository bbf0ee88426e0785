"""The transformer math both models run, the frozen target's fast decoder (dflash.target.static)
and the drafter (dflash.drafter.model): rotary position embedding, RMSNorm and grouped-query
attention under a mask, each HF's computation in fewer kernels (transformer.py).

May import: nothing of dflash (the lowest layer, beside util).
"""
