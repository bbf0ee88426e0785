"""Judge a drafter: greedy and speculative decoding (speculative), tau, acceptance, speedup and the
lossless check (evaluate), and the exact tau while training (periodic).
`python -m dflash.eval` is __main__.py.

May import: dflash.util, dflash.demo, dflash.target, dflash.data, dflash.drafter, dflash.config.
"""
