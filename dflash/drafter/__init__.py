"""The DFlash drafter and what defines it: the model (model), its block attention (attention),
the objective (objective), one forward on a micro-batch (step, shared by training and eval), the
HF export (export), and the FLOP model of target and drafter work (flops).

May import: dflash.util, dflash.nn (the transformer math of its layers), dflash.target
(init_from_target reads the target's weights).
"""
