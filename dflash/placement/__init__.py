"""Where work runs: process groups (distributed), which ranks hold the target and which train the
drafter (topology), where a drafter rank gets its target features (features), and the feature
transport between target and drafter ranks (transport/).

May import: dflash.util, dflash.target, dflash.data, dflash.drafter.
"""
