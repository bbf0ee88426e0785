"""Where work runs: process groups (distributed), which ranks hold the target and which train the
drafter (topology), where a drafter rank gets its target features (features), the feature
transport between target and drafter ranks (transport/), and which peer a rank lost (peers).

May import: dflash.util, dflash.target, dflash.data, dflash.drafter.
"""
